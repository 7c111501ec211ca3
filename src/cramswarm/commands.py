"""Commands of the config and the models: check-config, show-config, model-info, pretrain, init-model."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from cramswarm.cli import arg, command, json_arg, set_threads
from cramswarm.config import DEFAULT_SCHEMA

CONFIGS = arg("configs", nargs="+", type=Path, help="config YAML files, later ones overlay earlier ones")
SCHEMA = arg("--schema", type=Path, default=DEFAULT_SCHEMA)
ARCH = arg("--arch", type=json_arg, required=True, help="JSON of a models.<name>.arch section")
TOKENIZER = arg("--tokenizer", required=True)
OUT_DIR = arg("--out-dir", required=True)
RUN = arg("--run", help="run name recorded in the summary")
VOCAB = arg("--vocab-size", type=int, help="vocab size this run expects; the tokenizer must match")
THREADS = arg("--threads", type=int, default=1)
QUIET = arg("--quiet", action="store_true", help="no progress bar")


@command("check-config", "validate config files (merged in order) against config/schema.yaml", CONFIGS, SCHEMA)
def check_config(args) -> int:
    from cramswarm.config import load_config

    cfg = load_config(args.configs, args.schema)
    print(f"ok: {len(cfg['models'])} models, vocab sizes {cfg['tokenizer']['vocab_sizes']}, source {cfg['source']}")
    return 0


@command(
    "show-config",
    "print one validated config section as JSON (to pass to the other commands)",
    CONFIGS,
    SCHEMA,
    arg("--key", default="", help="dotted section to print, e.g. pretrain or models.crammed.arch"),
    arg("--run", help="print this run's resolved arch, recipe and GLUE protocol (--key picks one, e.g. glue)"),
)
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


@command(
    "model-info",
    "parameter counts of every run's model at the main vocab size (counted from the built shapes)",
    CONFIGS,
    SCHEMA,
    arg("--runs", nargs="*", help="run names (default: the study's models)"),
    arg("--vocab-size", type=int, help="default: tokenizer.main_vocab_size"),
)
def model_info(args) -> int:
    from cramswarm.config import load_config, resolve_runs
    from cramswarm.models.crammed_bert import parameter_counts

    cfg = load_config(args.configs, args.schema)
    vocab = args.vocab_size or cfg["tokenizer"]["main_vocab_size"]
    runs = resolve_runs(cfg)
    for name in args.runs or [n for n, r in runs.items() if r["study"] == "models"]:
        if name not in runs:
            raise ValueError(f"unknown run {name!r}; known: {', '.join(runs)}")
        arch = runs[name]["arch"]
        total, embedding = parameter_counts(arch, vocab)
        print(
            f"{name}: {arch['layers']} layers x {arch['hidden_size']} ({arch['heads']} heads), vocab {vocab}: "
            f"{total:,} parameters ({embedding:,} in the tied word embedding, {total - embedding:,} elsewhere)"
        )
    return 0


@command(
    "pretrain",
    "MLM-pretrain a crammed BERT on packed blocks under the recipe's budget",
    ARCH,
    TOKENIZER,
    OUT_DIR,
    arg("--recipe", type=json_arg, required=True, help="JSON of what the run computes: the pretrain section less impl"),
    arg("--impl", type=json_arg, default={}, help="JSON of how it runs: pretrain.impl (unset keys at their defaults)"),
    arg("--blocks", required=True),
    arg("--state-dir", help="resumable training state (kept outside the outputs; resumed if present)"),
    arg(
        "--lr-from",
        type=json_arg,
        help="JSON {peak LR: summary.json of a schedule-sweep run}: train at the LR whose run reached the lowest "
        "final held-out loss (models.NAME.lr_from_sweep); the choice is printed and kept in summary.json",
    ),
    RUN,
    VOCAB,
    THREADS,
    QUIET,
)
def pretrain(args) -> int:
    from cramswarm.distributed import launch_command
    from cramswarm.impl import PretrainImpl
    from cramswarm.pretrain import choose_sweep_lr

    sweep = None
    if args.lr_from:
        sweep = choose_sweep_lr(args.lr_from)
        args.recipe = {**args.recipe, "lr": sweep["chosen_lr"]}
        print(f"peak LR {sweep['chosen_lr']:g} from the schedule sweep (final held-out loss per LR: "
              + ", ".join(f"{lr:g}: {loss}" for lr, loss in sweep["eval_loss_by_lr"].items()) + ")", flush=True)

    # devices x nodes > 1: this process becomes the recipe's data-parallel job (torchrun, or srun of torchruns), so
    # that signals (scancel, Snakemake's SIGTERM) reach the launcher, which passes them on to its processes
    impl = PretrainImpl.parse(args.impl)
    relaunch = launch_command(impl, ["pretrain", *pretrain_arguments(args)])
    if relaunch is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execvp(relaunch[0], relaunch)

    from cramswarm.pretrain import pretrain as run

    set_threads(args.threads)
    summary = run(
        args.recipe, args.arch, args.blocks, args.tokenizer, args.out_dir, not args.quiet,
        state_dir=args.state_dir, run=args.run, expected_vocab=args.vocab_size,
        extra_summary={"lr_from_sweep": sweep} if sweep else None, impl=impl,
    )  # fmt: skip
    if summary is not None:  # rank 0 (or the only process)
        print(json.dumps(summary, sort_keys=True))
    return 0


def pretrain_arguments(args) -> list[str]:
    """The pretrain command line that ``args`` were parsed from (what every data-parallel process runs)."""
    argv = ["--recipe", json.dumps(args.recipe), "--impl", json.dumps(args.impl), "--arch", json.dumps(args.arch)]
    argv += ["--blocks", str(args.blocks)]
    argv += ["--tokenizer", str(args.tokenizer), "--out-dir", str(args.out_dir), "--threads", str(args.threads)]
    for flag, value in (("--state-dir", args.state_dir), ("--run", args.run), ("--vocab-size", args.vocab_size)):
        if value is not None:
            argv += [flag, str(value)]
    if args.lr_from:  # every process makes the same choice from the same files
        argv += ["--lr-from", json.dumps(args.lr_from)]
    return argv + (["--quiet"] if args.quiet else [])


@command(
    "init-model",
    "write a randomly initialised checkpoint (the no-pretraining baseline)",
    ARCH,
    TOKENIZER,
    OUT_DIR,
    arg("--seed", type=int, default=0),
)
def init_model(args) -> int:
    from cramswarm.io import write_json
    from cramswarm.pretrain import init_random

    summary = init_random(args.arch, args.tokenizer, args.out_dir, args.seed)
    write_json(Path(args.out_dir) / "summary.json", summary)
    print(json.dumps(summary))
    return 0
