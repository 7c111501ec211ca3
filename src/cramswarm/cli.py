"""``python -m cramswarm <command>``: one command per workflow stage.

Each Snakemake rule runs exactly one of these commands, so every stage also runs (and is tested) outside
Snakemake. Structured settings (a config section) are passed as JSON strings, e.g.
``--recipe "$(python -m cramswarm show-config config/config.yaml pretrain)"``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

COMMANDS: dict[str, tuple[str, callable]] = {}


def command(name: str, help: str):
    def register(fn):
        COMMANDS[name] = (help, fn)
        return fn

    return register


def _json(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON ({err}): {text[:80]!r}") from None


def _set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def _report(path: str | None, payload: dict) -> None:
    from cramswarm.io import write_json

    print(json.dumps(payload, sort_keys=True))
    for warning in payload.get("warnings", []):
        print(f"warning: {warning}", file=sys.stderr)
    if path:
        write_json(path, payload)


@command("check-config", "validate config files (merged in order) against config/schema.yaml")
def check_config(args) -> int:
    from cramswarm.config import load_config

    cfg = load_config(args.configs, args.schema)
    print(f"ok: {len(cfg['models'])} models, vocab sizes {cfg['tokenizer']['vocab_sizes']}, source {cfg['source']}")
    return 0


@command("show-config", "print one validated config section as JSON (to pass to the other commands)")
def show_config(args) -> int:
    from cramswarm.config import load_config, resolve_runs

    cfg = load_config(args.configs, args.schema)
    section = cfg
    if args.run:
        runs = resolve_runs(cfg)
        if args.run not in runs:
            raise ValueError(f"unknown run {args.run!r}; runs: {', '.join(runs)}")
        section = runs[args.run]
    for key in args.key.split(".") if args.key else []:
        section = section[key]
    print(json.dumps(section))
    return 0


@command("model-info", "parameter counts of every run's model at the main vocab size (counted from the built shapes)")
def model_info(args) -> int:
    import torch

    from cramswarm.config import load_config, resolve_runs
    from cramswarm.models.crammed_bert import CrammedBertConfig, CrammedBertForMaskedLM

    cfg = load_config(args.configs, args.schema)
    vocab = args.vocab_size or cfg["tokenizer"]["main_vocab_size"]
    runs = resolve_runs(cfg)
    for name in args.runs or [n for n, r in runs.items() if r["study"] == "models"]:
        if name not in runs:
            raise ValueError(f"unknown run {name!r}; known: {', '.join(runs)}")
        arch = runs[name]["arch"]
        with torch.device("meta"):  # shapes only, no memory
            model = CrammedBertForMaskedLM(CrammedBertConfig.from_arch(arch, vocab))
        total = sum(p.numel() for p in model.parameters())
        embedding = model.bert.embeddings.word_embeddings.weight.numel()
        print(f"{name}: {arch['layers']} layers x {arch['hidden_size']} ({arch['heads']} heads), vocab {vocab}: "
              f"{total:,} parameters ({embedding:,} in the tied word embedding, {total - embedding:,} elsewhere)")
    return 0


@command("corpus", "write the pretraining corpus (parquet, one 'text' column) from the configured source")
def corpus(args) -> int:
    from cramswarm.data.sources import corpus_documents, write_corpus

    counts = write_corpus(corpus_documents(args.source_spec), args.out)
    _report(args.report, {"source": args.source_spec["source"], **counts})
    return 0


@command("glue-data", "write one GLUE task's train and validation splits (parquet) from the configured source")
def glue_data(args) -> int:
    from cramswarm.data.sources import write_glue

    counts = write_glue(args.source_spec, args.task, args.out)
    _report(args.report, {"source": args.source_spec["source"], "task": args.task, "rows": counts})
    return 0


@command("tokenizer", "train a tokenizer (WordPiece, BPE or Unigram) on the corpus")
def tokenizer(args) -> int:
    from cramswarm import tokenizer as tokenization
    from cramswarm.io import atomic_path

    tok = tokenization.train(
        tokenization.iter_corpus_batches(args.corpus, progress=True), args.vocab_size, args.family, not args.cased, args.min_frequency
    )
    if tok.get_vocab_size() < args.vocab_size:
        raise ValueError(
            f"the corpus {args.corpus} filled only {tok.get_vocab_size()} of {args.vocab_size} {args.family} vocab "
            f"entries (min_frequency {args.min_frequency}); lower tokenizer.vocab_sizes or use a larger corpus"
        )
    with atomic_path(args.out) as tmp:
        tok.save(str(tmp))
    _report(args.report, {"family": args.family, "vocab_size": tok.get_vocab_size(), "requested": args.vocab_size,
                          "min_frequency": args.min_frequency, "lowercase": not args.cased, "corpus": args.corpus})
    return 0


@command("filter", "one raw-text filter step (trash or dedup) from corpus to corpus, with a report of rows in/out")
def filter_corpus(args) -> int:
    from cramswarm.data import filters

    if args.kind == "trash":
        from cramswarm import tokenizer as tokenization

        if not args.tokenizer:
            raise ValueError("the trash filter needs --tokenizer (the corpus's own tokenizer)")
        counts = filters.trash_filter(args.corpus, tokenization.load(args.tokenizer), args.out, args.trash_cutoff,
                                      args.memory_cap_mb)
        counts["tokenizer"] = args.tokenizer
    else:
        counts = filters.dedup(args.corpus, args.out, args.dedup_threshold, args.shingle_words, args.num_perm)
    _report(args.report, {"corpus": args.corpus, **counts})
    return 0


@command("pack", "tokenize the corpus and pack it into fixed-length blocks (.npy), streaming in bounded memory")
def pack(args) -> int:
    from cramswarm import packing, tokenizer as tokenization

    counts = packing.pack(args.corpus, tokenization.load(args.tokenizer), args.out, args.block_tokens,
                          args.shuffle_seed, args.memory_cap_mb, progress=True)
    _report(args.report, counts)
    return 0


@command("order", "order packed blocks (random or a curriculum); the held-out sample goes last")
def order(args) -> int:
    from cramswarm import ordering, tokenizer as tokenization

    counts = ordering.order_blocks(args.packed, tokenization.load(args.tokenizer), args.out, args.order, args.seed,
                                   args.holdout_blocks, args.memory_cap_mb)
    _report(args.report, counts)
    return 0


@command("pretrain", "MLM-pretrain a crammed BERT on packed blocks under the recipe's budget")
def pretrain(args) -> int:
    from cramswarm.pretrain import pretrain as run

    _set_threads(args.threads)
    summary = run(
        args.recipe, args.arch, args.blocks, args.tokenizer, args.out_dir, not args.quiet,
        state_dir=args.state_dir, run=args.run, expected_vocab=args.vocab_size,
    )
    print(json.dumps(summary, sort_keys=True))
    return 0


@command("init-model", "write a randomly initialised checkpoint (the no-pretraining baseline)")
def init_model(args) -> int:
    from cramswarm.io import write_json
    from cramswarm.pretrain import init_random

    summary = init_random(args.arch, args.tokenizer, args.out_dir, args.seed)
    write_json(Path(args.out_dir) / "summary.json", summary)
    print(json.dumps(summary))
    return 0


@command("finetune", "fine-tune a checkpoint on one GLUE task with one seed; write validation scores (JSON)")
def finetune(args) -> int:
    from cramswarm.finetune import finetune as run

    _set_threads(args.threads)
    labels = {"model": args.model, "vocab": args.vocab}
    result = run(args.checkpoint, args.task, args.data, args.seed, args.protocol, args.out, labels, args.precision, not args.quiet)
    print(json.dumps(result["scores"], sort_keys=True))
    return 0


@command("tables", "GLUE tables (CSV + Markdown): main table, main table beside the published rows (+ LaTeX), vocab sweep")
def tables(args) -> int:
    from cramswarm.report import tables as t

    df = t.load_results(args.results)
    main = t.glue_table(df)
    t.write_table(main, args.out_stem)
    # <out-stem>_paper.{csv,md,tex}: our rows, the published ones below, and our delta to a published average.
    t.write_table(t.glue_table_with_paper(main, args.paper_reference), f"{args.out_stem}_paper", latex=True)
    t.write_table(t.vocab_sweep_table(df, exclude=args.baseline + args.not_swept), args.sweep_stem)
    return 0


@command("figures", "figures (seaborn PNG + PDF + caption): MLM loss vs tokens, GLUE per task, GLUE average vs vocab size")
def figures(args) -> int:
    from cramswarm.report import figures as f, tables as t

    f.plot_loss_curves({Path(p).parent.parent.name + "/" + Path(p).parent.name: p for p in args.logs}, args.loss_png)
    df = t.load_results(args.results)
    f.plot_glue_by_task(df, args.tasks_png, source=args.source)
    main = t.glue_table(df)
    baseline_rows = main[main["model"].isin(args.baseline)]
    baseline = baseline_rows.iloc[0].to_dict() if len(baseline_rows) else None
    sweep = t.vocab_sweep_table(df, exclude=args.baseline + args.not_swept)
    f.plot_vocab_sweep(sweep, args.vocab_png, baseline=baseline)
    return 0


@command("ablation-report", "tables and figures of one training ablation (arch: Figure 1, schedule: Figure 2, groups: Table 5)")
def ablation_report(args) -> int:
    from cramswarm.report import ablations as a

    dirs = {label: Path(folder) for label, folder in args.runs.items()}
    summaries = {label: folder / "summary.json" for label, folder in dirs.items()}
    logs = {label: folder / "train_log.csv" for label, folder in dirs.items()}
    if args.kind == "arch":
        a.write_ablation_table(a.arch_table(summaries, args.results), args.out_stem)
        a.plot_arch(logs, args.png)
    elif args.kind == "schedule":
        table = a.schedule_table(summaries)
        a.write_ablation_table(table, args.out_stem)
        a.write_ablation_table(a.schedule_pivot(table), f"{args.out_stem}_pivot")
        a.plot_schedule(logs, summaries, args.png)
    else:  # groups: rows keyed by run name (the folder above v<vocab>)
        labels = {folder.parent.name: label for label, folder in dirs.items()}
        by_run = {folder.parent.name: summaries[label] for label, folder in dirs.items()}
        a.write_ablation_table(a.groups_table(args.results, labels, summaries=by_run), args.out_stem)
    return 0


@command("swarm-pretrain", "pretrain a model with SWARM parallelism (stages x replicas); writes a crammed-layout checkpoint")
def swarm_pretrain(args) -> int:
    from cramswarm.swarm.train import swarm_pretrain as run

    _set_threads(args.threads)
    summary = run(args.recipe, args.arch, args.swarm, args.blocks, args.tokenizer, args.out_dir,
                  progress=not args.quiet, run=args.run, expected_vocab=args.vocab_size, rendezvous=args.rendezvous)
    print(json.dumps({k: summary[k] for k in ("steps", "tokens", "final_loss", "eval_loss") if k in summary}))
    return 0


@command("swarm-peer", "serve as one peer of a running swarm-pretrain (swarm.placement attach or srun)")
def swarm_peer(args) -> int:
    from cramswarm.swarm.hivemind_peer import run_task

    return run_task(args.rendezvous, args.rank, args.max_restarts, args.wait_s)


# swarm_study config section -> cramswarm.swarm.study function, and config keys renamed to its keywords
SWARM_EXPERIMENTS = {
    "square_cube": ("square_cube", {"batch_sequences": "batch", "seq_len_tokens": "seq_len"}),
    "wiring": ("wiring_throughput", {}),
    "failures": ("failures_timeline", {}),
    "rebalancing": ("rebalancing_recovery", {}),
    "compression": ("compression_loss", {"micro_batch_sequences": "micro_batch"}),
    "sim_scale": ("sim_scale", {}),
}


@command("swarm-study", "one SWARM experiment (a swarm_study config section) -> one CSV")
def swarm_study(args) -> int:
    from cramswarm.swarm import study

    function, renames = SWARM_EXPERIMENTS[args.experiment]
    kwargs = {renames.get(key, key): value for key, value in args.settings.items()}
    if args.experiment == "compression":
        if not (args.blocks and args.tokenizer and args.arch):
            raise ValueError("swarm-study --experiment compression needs --blocks, --tokenizer and --arch")
        from cramswarm import tokenizer as tokenization

        vocab_size = tokenization.load(args.tokenizer).get_vocab_size()
        print(getattr(study, function)(args.out, args.blocks, arch=args.arch, vocab_size=vocab_size, **kwargs))
    else:
        print(getattr(study, function)(args.out, **kwargs))
    return 0


@command("swarm-report", "tables, figures (PNG + PDF + caption) of the swarm_study CSVs in one folder")
def swarm_report(args) -> int:
    from cramswarm.report.swarm_figures import swarm_report as report

    for path in report(args.study_dir, args.out_dir):
        print(path)
    return 0


@command("study-record", "the report's study record: config used, software versions, per-rule benchmark summary")
def study_record(args) -> int:
    from cramswarm.report.record import write_record

    for name, path in write_record(args.config, args.benchmarks, args.out_dir).items():
        print(f"{name}: {path}")
    return 0


@command("readme-figures", "small copies of figures for the README (committed under results/readme/)")
def readme_figures(args) -> int:
    from cramswarm.report.record import shrink_png

    for src in args.figures:
        print(shrink_png(src, Path(args.out_dir) / Path(src).name, args.max_width_px))
    return 0


@command("data-ablation-report", "Table 2: per-run data-chain counts, held-out loss and fine-tuned scores; sources x cells")
def data_ablation_report(args) -> int:
    from cramswarm.report import data_ablation

    data_ablation.write_data_tables(data_ablation.data_table(args.runs, args.results), args.out_stem)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cramswarm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = {name: sub.add_parser(name, help=help, description=help) for name, (help, _) in COMMANDS.items()}

    from cramswarm.config import DEFAULT_SCHEMA

    for name in ("check-config", "show-config", "model-info"):
        p[name].add_argument("configs", nargs="+", type=Path, help="config YAML files, later ones overlay earlier ones")
        p[name].add_argument("--schema", type=Path, default=DEFAULT_SCHEMA)
    p["model-info"].add_argument("--runs", nargs="*", help="run names (default: the study's models)")
    p["model-info"].add_argument("--vocab-size", type=int, help="default: tokenizer.main_vocab_size")
    p["show-config"].add_argument("--key", default="", help="dotted section to print, e.g. pretrain or models.crammed.arch")
    p["show-config"].add_argument("--run", help="print this run's resolved arch, recipe and GLUE protocol (--key picks one, e.g. glue)")
    source_help = "JSON with the config's source, synthetic and hub sections"
    for name in ("corpus", "glue-data"):
        p[name].add_argument("--source-spec", type=_json, required=True, help=source_help)
        p[name].add_argument("--out", required=True)
        p[name].add_argument("--report", help="also write the counts to this JSON file")
    p["glue-data"].add_argument("--task", required=True)
    for name in ("filter", "pack", "order"):
        p[name].add_argument("--memory-cap-mb", type=float, default=256,
                             help="working-set cap of the stage's batches (MiB; the trash filter, packing, order)")
    p["tokenizer"].add_argument("--corpus", required=True)
    p["tokenizer"].add_argument("--vocab-size", type=int, required=True)
    p["tokenizer"].add_argument("--family", default="wordpiece", choices=("wordpiece", "bpe", "unigram"))
    p["tokenizer"].add_argument("--min-frequency", type=int, default=2)
    p["tokenizer"].add_argument("--cased", action="store_true", help="keep case and accents")
    p["tokenizer"].add_argument("--out", required=True)
    p["tokenizer"].add_argument("--report", help="also write the vocab facts to this JSON file")
    p["filter"].add_argument("--kind", required=True, choices=("trash", "dedup"))
    p["filter"].add_argument("--corpus", required=True)
    p["filter"].add_argument("--tokenizer", help="trash: the corpus's own tokenizer (tokenizer.json)")
    p["filter"].add_argument("--trash-cutoff", type=float, default=0.25, help="trash: tokens per character")
    p["filter"].add_argument("--dedup-threshold", type=float, default=0.8, help="dedup: Jaccard similarity")
    p["filter"].add_argument("--shingle-words", type=int, default=5, help="dedup: words per shingle")
    p["filter"].add_argument("--num-perm", type=int, default=128, help="dedup: MinHash permutations")
    p["filter"].add_argument("--out", required=True)
    p["filter"].add_argument("--report")
    p["pack"].add_argument("--corpus", required=True)
    p["pack"].add_argument("--tokenizer", required=True)
    p["pack"].add_argument("--block-tokens", type=int, default=128)
    p["pack"].add_argument("--shuffle-seed", type=int, default=0)
    p["pack"].add_argument("--out", required=True)
    p["pack"].add_argument("--report")
    p["order"].add_argument("--packed", required=True)
    p["order"].add_argument("--tokenizer", required=True)
    p["order"].add_argument("--order", required=True, choices=("random", "sentence-length", "unigram", "unigram-reverse"))
    p["order"].add_argument("--seed", type=int, default=0)
    p["order"].add_argument("--holdout-blocks", type=int, default=0, help="blocks of a random sample put last (held out)")
    p["order"].add_argument("--out", required=True)
    p["order"].add_argument("--report")
    for name in ("pretrain", "init-model"):
        p[name].add_argument("--arch", type=_json, required=True, help="JSON of a models.<name>.arch section")
        p[name].add_argument("--tokenizer", required=True)
        p[name].add_argument("--out-dir", required=True)
    p["init-model"].add_argument("--seed", type=int, default=0)
    p["pretrain"].add_argument("--recipe", type=_json, required=True, help="JSON of the pretrain section")
    p["pretrain"].add_argument("--blocks", required=True)
    p["pretrain"].add_argument("--state-dir", help="resumable training state (kept outside the outputs; resumed if present)")
    p["pretrain"].add_argument("--run", help="run name recorded in the summary")
    p["pretrain"].add_argument("--vocab-size", type=int, help="vocab size this run expects; the tokenizer must match")
    p["swarm-pretrain"].add_argument("--arch", type=_json, required=True, help="JSON of a models.<name>.arch section")
    p["swarm-pretrain"].add_argument("--recipe", type=_json, required=True, help="JSON of the model's pretrain recipe")
    p["swarm-pretrain"].add_argument("--swarm", type=_json, required=True, help="JSON of the swarm section")
    p["swarm-pretrain"].add_argument("--blocks", required=True)
    p["swarm-pretrain"].add_argument("--tokenizer", required=True)
    p["swarm-pretrain"].add_argument("--out-dir", required=True)
    p["swarm-pretrain"].add_argument("--run", help="run name recorded in the summary")
    p["swarm-pretrain"].add_argument("--vocab-size", type=int, help="vocab size this run expects; the tokenizer must match")
    p["swarm-pretrain"].add_argument("--rendezvous", help="swarm.placement attach/srun: folder (shared filesystem) "
                                     "where the peers find config.json and the DHT address file")
    for name in ("pretrain", "finetune", "swarm-pretrain"):
        p[name].add_argument("--threads", type=int, default=1)
        p[name].add_argument("--quiet", action="store_true", help="no progress bar")
    p["finetune"].add_argument("--checkpoint", required=True)
    p["finetune"].add_argument("--task", required=True)
    p["finetune"].add_argument("--data", required=True)
    p["finetune"].add_argument("--seed", type=int, required=True)
    p["finetune"].add_argument("--protocol", type=_json, required=True, help="JSON of one fine-tuning protocol: a glue.protocols entry plus glue.max_length_tokens and glue.device")
    p["finetune"].add_argument("--model", required=True, help="model name recorded in the result")
    p["finetune"].add_argument("--vocab", type=int, required=True, help="vocab size recorded in the result")
    p["finetune"].add_argument("--precision", default="bf16", choices=("auto", "bf16", "fp16", "fp32"))
    p["finetune"].add_argument("--out", required=True)
    for name in ("tables", "figures"):
        p[name].add_argument("--results", nargs="+", required=True, help="fine-tuning result JSON files")
        p[name].add_argument("--baseline", nargs="*", default=[], help="random-init models (the reference line)")
        p[name].add_argument("--not-swept", nargs="*", default=[], help="pretrained models left out of the vocab sweep")
    p["tables"].add_argument("--out-stem", required=True)
    p["tables"].add_argument("--sweep-stem", required=True)
    p["tables"].add_argument(
        "--paper-reference",
        default="Crammed BERT (A6000, 24 h, v1)",
        help="published row (its 'model' in report/paper_glue.csv) that <out-stem>_paper's GLUE-average delta refers to",
    )
    p["figures"].add_argument("--logs", nargs="+", required=True, help="pretraining train_log.csv files")
    p["figures"].add_argument("--loss-png", required=True)
    p["figures"].add_argument("--tasks-png", required=True)
    p["figures"].add_argument("--vocab-png", required=True)
    p["figures"].add_argument("--source", default="synthetic", choices=("synthetic", "hub"), help="the config's source (captions)")
    p["readme-figures"].add_argument("--figures", nargs="+", required=True, help="PNG files")
    p["readme-figures"].add_argument("--out-dir", required=True)
    p["readme-figures"].add_argument("--max-width-px", type=int, default=900)
    p["swarm-peer"].add_argument("--rendezvous", required=True, help="the coordinator's rendezvous folder "
                                 "(swarm-pretrain --rendezvous), on a filesystem this host shares with it")
    p["swarm-peer"].add_argument("--rank", type=int, help="this peer's rank, 0 .. stages x peers_per_stage - 1 "
                                 "(default: SLURM_PROCID); it decides the stage and speed")
    p["swarm-peer"].add_argument("--max-restarts", type=int, default=100, help="restarts of a dying peer (count)")
    p["swarm-peer"].add_argument("--wait-s", type=float, default=600.0,
                                 help="seconds to wait for the coordinator's rendezvous files (and for its swarm)")
    p["swarm-study"].add_argument("--experiment", required=True, choices=tuple(SWARM_EXPERIMENTS))
    p["swarm-study"].add_argument("--settings", type=_json, required=True, help="JSON of the swarm_study.<experiment> section")
    p["swarm-study"].add_argument("--out", required=True, help="CSV written")
    p["swarm-study"].add_argument("--blocks", help="compression: packed blocks (.npy) to train on")
    p["swarm-study"].add_argument("--tokenizer", help="compression: the blocks' tokenizer (for the vocab size)")
    p["swarm-study"].add_argument("--arch", type=_json, help="compression: JSON of a models.<name>.arch section")
    p["swarm-report"].add_argument("--study-dir", required=True, help="folder of the experiments' CSVs")
    p["swarm-report"].add_argument("--out-dir", required=True)
    p["study-record"].add_argument("--config", type=_json, required=True, help="JSON of the validated config")
    p["study-record"].add_argument("--benchmarks", required=True, help="folder of Snakemake benchmark TSVs")
    p["study-record"].add_argument("--out-dir", required=True)
    p["ablation-report"].add_argument("--kind", required=True, choices=("arch", "schedule", "groups"))
    p["ablation-report"].add_argument("--runs", type=_json, required=True, help="JSON {label: checkpoint folder}")
    p["ablation-report"].add_argument("--results", nargs="*", default=[], help="fine-tuning result JSON files")
    p["ablation-report"].add_argument("--out-stem", required=True, help="table path without suffix (.csv and .md)")
    p["ablation-report"].add_argument("--png", help="figure path (arch and schedule)")
    p["data-ablation-report"].add_argument("--runs", type=_json, required=True,
                                           help="JSON {run: {label, source, cell, data, summary, reports}}")
    p["data-ablation-report"].add_argument("--results", nargs="*", default=[], help="fine-tuning result JSON files")
    p["data-ablation-report"].add_argument("--out-stem", required=True, help="<stem>.{csv,md} and <stem>_table2.{csv,md}")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from cramswarm.config import ConfigError

    try:
        return COMMANDS[args.command][1](args)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        print(f"cramswarm {args.command}: error: {err}", file=sys.stderr)
        return 2
