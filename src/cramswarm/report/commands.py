"""Commands of the report: tables, figures, vocab-sweep,
ablation-report, data-ablation-report, swarm-report, study-record,
readme-figures, docs-snapshot, docs, fidelity-table, claims."""

from __future__ import annotations

from pathlib import Path

from cramswarm.cli import arg, command, json_arg
from cramswarm.config import schema_default

RESULTS = arg("--results", nargs="+", required=True, help="fine-tuning result JSON files")
RESULTS_OPTIONAL = arg("--results", nargs="*", default=[], help="fine-tuning result JSON files")
BASELINE = arg("--baseline", nargs="*", default=[], help="random-init models (the reference line)")
NOT_SWEPT = arg("--not-swept", nargs="*", default=[], help="pretrained models left out of the vocab sweep")
OUT_STEM = arg("--out-stem", required=True, help="table path without suffix (.csv and .md)")


@command(
    "tables",
    "GLUE tables (CSV + Markdown): main table, main table beside the published rows (+ LaTeX)",
    RESULTS,
    OUT_STEM,
    arg(
        "--paper-reference",
        default=schema_default("glue.paper_reference"),
        help="published row (its 'model' in report/paper_glue.csv) that <out-stem>_paper's GLUE-average delta "
        "refers to",
    ),
    arg(
        "--pretraining",
        type=json_arg,
        default=[],
        help="JSON [[model, vocab, summary.json], ...] of the pretrained runs: their tokens and passes over the data "
        "become columns",
    ),
)
def tables(args) -> int:
    from cramswarm.io import read_json
    from cramswarm.report import tables as t

    df = t.load_results(args.results)
    main = t.with_pretraining(t.glue_table(df), [(m, v, read_json(path)) for m, v, path in args.pretraining])
    t.write_table(main, args.out_stem)
    # <out-stem>_paper.{csv,md,tex}: our rows, the published ones below, and our delta to a published average.
    t.write_table(t.glue_table_with_paper(main, args.paper_reference), f"{args.out_stem}_paper", latex=True)
    return 0


@command(
    "figures",
    "figures (seaborn PNG + PDF + caption): MLM loss vs tokens, GLUE per task",
    RESULTS,
    arg("--logs", nargs="+", required=True, help="pretraining train_log.csv files"),
    arg("--loss-png", required=True),
    arg("--tasks-png", required=True),
    arg("--source", default="synthetic", choices=("synthetic", "hub"), help="the config's source (captions)"),
)
def figures(args) -> int:
    from cramswarm.report import figures as f
    from cramswarm.report import tables as t

    f.plot_loss_curves({Path(p).parent.parent.name + "/" + Path(p).parent.name: p for p in args.logs}, args.loss_png)
    f.plot_glue_by_task(t.load_results(args.results), args.tasks_png, source=args.source)
    return 0


@command(
    "vocab-sweep",
    "Figure 3 (seaborn PNG + PDF + caption) and its table: GLUE average and MNLI vs vocab size",
    RESULTS,
    BASELINE,
    NOT_SWEPT,
    OUT_STEM,
    arg("--png", required=True, help="figure path"),
)
def vocab_sweep(args) -> int:
    from cramswarm.report import figures as f
    from cramswarm.report import tables as t

    df = t.load_results(args.results)
    main = t.glue_table(df)
    baseline_rows = main[main["model"].isin(args.baseline)]
    baseline = baseline_rows.iloc[0].to_dict() if len(baseline_rows) else None
    sweep = t.vocab_sweep_table(df, exclude=args.baseline + args.not_swept)
    t.write_table(sweep, args.out_stem)
    f.plot_vocab_sweep(sweep, args.png, baseline=baseline)
    return 0


@command(
    "ablation-report",
    "tables and figures of one training ablation (arch: Figure 1, schedule: Figure 2, groups: Table 5)",
    arg("--kind", required=True, choices=("arch", "schedule", "groups")),
    arg("--runs", type=json_arg, required=True, help="JSON {label: checkpoint folder}"),
    RESULTS_OPTIONAL,
    OUT_STEM,
    arg("--png", help="figure path (arch and schedule)"),
)
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


@command(
    "data-ablation-report",
    "Table 2: per-run data-chain counts, held-out loss and fine-tuned scores; sources x cells",
    arg("--runs", type=json_arg, required=True, help="JSON {run: {label, source, cell, data, summary, reports}}"),
    RESULTS_OPTIONAL,
    arg("--out-stem", required=True, help="<stem>.{csv,md} and <stem>_table2.{csv,md}"),
)
def data_ablation_report(args) -> int:
    from cramswarm.report import data_ablation

    data_ablation.write_data_tables(data_ablation.data_table(args.runs, args.results), args.out_stem)
    return 0


@command(
    "swarm-report",
    "tables, figures (PNG + PDF + caption) of the swarm_study CSVs in one folder",
    arg("--study-dir", required=True, help="folder of the experiments' CSVs"),
    arg("--out-dir", required=True),
)
def swarm_report(args) -> int:
    from cramswarm.report.swarm_figures import swarm_report as write

    for path in write(args.study_dir, args.out_dir):
        print(path)
    return 0


@command(
    "study-record",
    "the report's study record: config used, software versions, per-rule benchmark summary",
    arg("--config", type=json_arg, required=True, help="JSON of the validated config"),
    arg("--benchmarks", required=True, help="folder of Snakemake benchmark TSVs"),
    arg("--out-dir", required=True),
)
def study_record(args) -> int:
    from cramswarm.report.record import write_record

    for name, path in write_record(args.config, args.benchmarks, args.out_dir).items():
        print(f"{name}: {path}")
    return 0


@command(
    "readme-figures",
    "small copies of figures for the README (committed under results/readme/)",
    arg("--figures", nargs="+", required=True, help="PNG files"),
    arg("--out-dir", required=True),
    arg("--max-width-px", type=int, default=900),
)
def readme_figures(args) -> int:
    from cramswarm.report.record import shrink_png

    for src in args.figures:
        print(shrink_png(src, Path(args.out_dir) / Path(src).name, args.max_width_px))
    return 0


@command(
    "fidelity-table",
    "write docs/fidelity.md: every setting of both published Cramming recipes and the baselines, the reference "
    "code's value and source, ours from the config files, the verdict",
    arg("--repo", default=".", help="repository root holding config/"),
    arg("--out", required=True, help="Markdown file to write"),
)
def fidelity_table(args) -> int:
    from cramswarm.io import atomic_path
    from cramswarm.report import fidelity

    table = fidelity.rows(args.repo)
    with atomic_path(Path(args.out)) as tmp:
        tmp.write_text(fidelity.markdown(table))
    undocumented = [r for r in table if r["verdict"].startswith("DIFFERS")]
    for r in undocumented:
        print(f"undocumented difference: {r['recipe']} {r['section']} {r['setting']}: reference {r['reference']}, "
              f"ours {r['ours']}")
    return 1 if undocumented else 0


@command(
    "docs-snapshot",
    "copy the study's README tables into the committed results folder with the run's config and provenance.json",
    arg("--files", nargs="+", required=True, help="workflow outputs to commit (tables; figures already there)"),
    arg("--record", required=True, help="the study record folder (config.yaml, software.csv)"),
    arg("--source", help="the config's source (recorded)"),
    arg("--out-dir", default="results/readme"),
)
def docs_snapshot(args) -> int:
    from cramswarm.report.docs import snapshot

    print(snapshot(args.files, args.record, args.out_dir, source=args.source))
    return 0


@command(
    "docs",
    "rewrite the generated blocks (<!-- generated:NAME --> ... <!-- /generated:NAME -->) of Markdown files from "
    "the committed results",
    arg("paths", nargs="+", help="Markdown files (README.md docs/*.md docs/history/*.md)"),
    arg("--results-dir", default="results/readme", help="the committed results folder"),
    arg("--repo", default=".", help="the repository root (links are written relative to each file)"),
    arg("--check", action="store_true", help="write nothing; exit 1 if a block is not what the results give"),
)
def docs(args) -> int:
    from cramswarm.report.docs import regenerate

    changed = regenerate(args.paths, args.results_dir, args.repo, write=not args.check)
    for path in changed:
        print(f"{'stale' if args.check else 'rewrote'}: {path}")
    return 1 if args.check and changed else 0


@command(
    "claims",
    "the papers' claims, checked: one row per claim (verdict from the result files), as CSV + Markdown",
    arg("--manifest", type=json_arg, required=True,
        help="JSON naming the result files per claim input (cramswarm.workflow.report.claims_manifest)"),
    arg("--out-stem", required=True, help="table path without suffix (.csv and .md)"),
    arg("--copy-to", help="also copy the CSV to this path (the committed results/readme/ folder) and record where "
        "its inputs were made beside it, in <path>.provenance.json"),
    arg("--config-files", nargs="*", default=[], help="the workflow's config files, recorded with the copy"),
)
def claims(args) -> int:
    from cramswarm.io import atomic_path
    from cramswarm.report.claims import inputs_record, write_claims
    from cramswarm.report.docs import record_file, sha256

    paths = write_claims(args.manifest, args.out_stem)
    if args.copy_to:
        with atomic_path(Path(args.copy_to)) as tmp:
            tmp.write_bytes(paths[0].read_bytes())
        configs = [{"path": Path(c).as_posix(), "sha256": sha256(c)} for c in args.config_files]
        side = record_file(args.copy_to, paths[0], inputs_record(args.manifest)
                           | {"source": args.manifest.get("source"), "config_files": configs})
        paths = (*paths, Path(args.copy_to), side)
    for path in paths:
        print(path)
    return 0
