"""Report tables and figures for the three training ablations of the Cramming paper.

* **Architecture** (paper Figure 1 and ICML Table 11): :func:`arch_table`, :func:`plot_arch`.
* **LR schedule** (paper Figure 2): :func:`schedule_table`, :func:`schedule_pivot`, :func:`plot_schedule`.
* **Group ablation** (paper Table 5: reset the architecture / training / data group to BERT's choice):
  :func:`groups_table`.

Inputs are what the pretraining and fine-tuning stages write per run:

* ``summary.json`` — ``run``, ``steps``, ``tokens``, ``tokens_per_s``, ``parameters``, ``final_loss`` (training
  MLM loss over the last logged window), ``eval_loss`` (held-out MLM loss, same masking for every run),
  ``recipe`` (``lr``, ``schedule`` …) and ``arch`` (``layers``, ``hidden_size``, ``heads`` …);
* ``train_log.csv`` — ``step, tokens, progress, loss, lr, lr_multiplier, batch_sequences, elapsed_s, eval_loss``
  (``eval_loss`` empty on rows without an evaluation);
* fine-tuning result JSONs, read by :func:`cramswarm.report.tables.load_results` (``model`` = the run name).

Fine-tuning scores use the paper's nine numbers (:data:`~cramswarm.glue.metrics.PAPER_AVERAGE_COLUMNS`: one
metric per task, MNLI-m and MNLI-mm both, no WNLI). Each is the **median over the seeds** that have it; an
average is the mean of those medians (the paper's "median per task, then mean" rule). Tables are written by
:func:`write_ablation_table`: the CSV exactly as :func:`cramswarm.report.tables.write_table` writes it, the
Markdown with per-column precision (losses need three decimals, learning rates are not percentages).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

from cramswarm.glue.metrics import PAPER_AVERAGE_COLUMNS
from cramswarm.io import read_json_object
from cramswarm.report.figures import PALETTE, _new_figure, _save, _style
from cramswarm.report.tables import COLUMN_LABELS, load_results, per_seed_scores, write_table

PathLike = str | os.PathLike

LOG_COLUMNS: tuple[str, ...] = (
    "step", "tokens", "progress", "loss", "lr", "lr_multiplier", "batch_sequences", "elapsed_s", "eval_loss",
)
AVG_COLUMN = "avg_tasks_run"
DELTA_COLUMN = "delta_avg"

# Markdown headers for the ablation columns (score columns take theirs from tables.COLUMN_LABELS).
ABLATION_LABELS: dict[str, str] = {
    **COLUMN_LABELS,
    "label": "Run",
    "run": "Run name",
    "layers": "Layers",
    "hidden_size": "Hidden size",
    "heads": "Heads",
    "parameters": "Parameters",
    "steps": "Steps",
    "tokens": "Tokens",
    "tokens_per_s": "Tokens/s",
    "final_loss": "Final train MLM loss",
    "eval_loss": "Held-out MLM loss",
    "schedule": "Schedule",
    "lr": "Peak LR",
    AVG_COLUMN: "avg (tasks run)",
    DELTA_COLUMN: "Δ avg vs first row",
}
_INT_COLUMNS = frozenset({"layers", "hidden_size", "heads", "parameters", "steps", "tokens", "n_seeds", "vocab"})
_LOSS_COLUMNS = frozenset({"final_loss", "eval_loss"})

_SUMMARY_FIELDS_ARCH = (
    "run", "parameters", "tokens", "tokens_per_s", "final_loss", "eval_loss",
    "arch.layers", "arch.hidden_size", "arch.heads",
)
_SUMMARY_FIELDS_SCHEDULE = ("run", "steps", "tokens", "final_loss", "eval_loss", "recipe.schedule", "recipe.lr")


# --------------------------------------------------------------------------------------------------- reading


def read_summary(path: PathLike, fields: Sequence[str] = ()) -> dict:
    """Read a pretraining ``summary.json``; ``fields`` (dotted for nested keys, e.g. ``recipe.lr``) must exist.

    A missing or unreadable file, or a missing field, raises ``ValueError`` naming the file (and the field).
    """
    path = Path(path)
    summary = read_json_object(path, "pretraining summary", missing=ValueError)
    for field in fields:
        _field(summary, field, path)
    return summary


def _field(summary: dict, dotted: str, path: PathLike):
    value = summary
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            raise ValueError(f"{path}: summary is missing the field {dotted!r}")
        value = value[key]
    return value


def _number(value) -> float:
    # JSON null (e.g. an eval loss a diverged run never got) reads as NaN.
    return math.nan if value is None else float(value)


def read_log(path: PathLike, columns: Sequence[str] = ("tokens", "loss", "eval_loss")) -> pd.DataFrame:
    """Read a pretraining ``train_log.csv``; ``columns`` must be present. Numeric columns are parsed as floats,
    so the empty ``eval_loss`` cells of rows without an evaluation become NaN.

    A missing or unreadable file, a missing column, or a non-numeric cell raises ``ValueError`` naming the file.
    """
    path = Path(path)
    try:
        log = pd.read_csv(path)
    except FileNotFoundError:
        raise ValueError(f"pretraining log not found: {path}") from None
    except (OSError, UnicodeDecodeError, pd.errors.ParserError, pd.errors.EmptyDataError) as exc:
        raise ValueError(f"{path}: not a readable CSV log ({exc})") from exc
    missing = [c for c in columns if c not in log.columns]
    if missing:
        raise ValueError(f"{path}: missing column(s) {', '.join(missing)} (a train log has {', '.join(LOG_COLUMNS)})")
    for column in log.columns.intersection(LOG_COLUMNS):
        try:
            log[column] = pd.to_numeric(log[column]).astype("float64")
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}: column {column!r} is not numeric ({exc})") from exc
    return log


def _run_scores(results: Iterable[PathLike], runs: Iterable[str]) -> tuple[pd.DataFrame, list[str]]:
    """Per run (index): the median over seeds of each paper score column, and ``n_seeds``.

    Only the score columns that some result holds are kept (in paper order), and only results of ``runs``.
    """
    paths = list(results)
    runs = list(runs)
    if not paths:
        return pd.DataFrame({"n_seeds": 0}, index=pd.Index(runs, name="model")), []
    long = load_results(paths)
    long = long[long["model"].isin(runs)]
    if long.empty:
        return pd.DataFrame({"n_seeds": 0}, index=pd.Index(runs, name="model")), []
    vocabs = long.groupby("model")["vocab"].unique()
    for run, sizes in vocabs.items():
        if len(sizes) > 1:
            raise ValueError(
                f"run {run!r}: fine-tuning results with several vocabulary sizes {sorted(sizes)}; "
                "an ablation row needs exactly one"
            )
    present = set(long["column"])
    columns = [c for c in PAPER_AVERAGE_COLUMNS if c in present]
    groups = per_seed_scores(long).groupby("model")
    table = groups[columns].median()  # median over the seeds that have each score (as tables.glue_table)
    table["n_seeds"] = groups["seed"].nunique()
    table = table.reindex(runs)
    table["n_seeds"] = table["n_seeds"].fillna(0).astype("int64")
    return table, columns


# --------------------------------------------------------------------------------------------------- tables


def arch_table(summaries: Mapping[str, PathLike], results: Iterable[PathLike] = ()) -> pd.DataFrame:
    """Figure-1 companion (ICML Table 11 style): one row per label, sorted by parameter count.

    ``summaries`` maps the label readers see to a run's ``summary.json``. Columns: ``label, run, layers,
    hidden_size, heads, parameters, tokens, tokens_per_s, final_loss, eval_loss``, then the median over seeds
    of each paper score column present in ``results`` (matched by ``model`` = the summary's ``run``), and
    ``n_seeds``. A run without fine-tuning results keeps its row, with NaN scores and ``n_seeds`` 0.
    """
    if not summaries:
        raise ValueError("arch_table: no runs given")
    rows = []
    for label, path in summaries.items():
        s = read_summary(path, _SUMMARY_FIELDS_ARCH)
        rows.append(
            {
                "label": label, "run": s["run"],
                "layers": int(s["arch"]["layers"]), "hidden_size": int(s["arch"]["hidden_size"]),
                "heads": int(s["arch"]["heads"]), "parameters": int(s["parameters"]), "tokens": int(s["tokens"]),
                "tokens_per_s": _number(s["tokens_per_s"]),
                "final_loss": _number(s["final_loss"]), "eval_loss": _number(s["eval_loss"]),
            }
        )
    table = pd.DataFrame(rows)
    scores, columns = _run_scores(results, table["run"].unique())
    table = table.join(scores[[*columns, "n_seeds"]], on="run")
    return table.sort_values("parameters", kind="stable", ignore_index=True)


def schedule_table(summaries: Mapping[str, PathLike]) -> pd.DataFrame:
    """Figure-2 companion: one row per label with ``label, run, schedule, lr`` (peak LR), ``final_loss,
    eval_loss, steps, tokens``, sorted by schedule (first-seen order), then peak LR."""
    if not summaries:
        raise ValueError("schedule_table: no runs given")
    rows = []
    for label, path in summaries.items():
        s = read_summary(path, _SUMMARY_FIELDS_SCHEDULE)
        rows.append(
            {
                "label": label, "run": s["run"], "schedule": str(s["recipe"]["schedule"]),
                "lr": float(s["recipe"]["lr"]),
                "final_loss": _number(s["final_loss"]), "eval_loss": _number(s["eval_loss"]),
                "steps": int(s["steps"]), "tokens": int(s["tokens"]),
            }
        )
    table = pd.DataFrame(rows)
    order = {name: i for i, name in enumerate(dict.fromkeys(table["schedule"]))}
    table = table.sort_values(["schedule", "lr"], key=lambda c: c.map(order) if c.name == "schedule" else c)
    return table.reset_index(drop=True)


def schedule_pivot(table: pd.DataFrame, value: str = "eval_loss") -> pd.DataFrame:
    """The readable form of :func:`schedule_table`: schedules as rows (index ``schedule``), peak LRs as columns
    (ascending), ``value`` (held-out MLM loss by default) in the cells; NaN where a combination was not run.
    Two runs with the same schedule and peak LR raise ``ValueError``."""
    missing = [c for c in ("schedule", "lr", value) if c not in table.columns]
    if missing:
        raise ValueError(f"schedule_pivot: table is missing column(s) {', '.join(missing)}")
    dupes = table[table.duplicated(["schedule", "lr"], keep=False)]
    if not dupes.empty:
        raise ValueError(
            "schedule_pivot: several runs share a schedule and peak LR: "
            + ", ".join(f"{r.label} ({r.schedule}, {r.lr:g})" if "label" in table else f"({r.schedule}, {r.lr:g})"
                        for r in dupes.itertuples())
        )
    schedules = list(dict.fromkeys(table["schedule"]))
    pivot = table.pivot(index="schedule", columns="lr", values=value).reindex(schedules)
    return pivot.reindex(columns=sorted(pivot.columns)).rename_axis(columns="lr")


def groups_table(
    results: Iterable[PathLike],
    labels: Mapping[str, str],
    summaries: Mapping[str, PathLike] | None = None,
) -> pd.DataFrame:
    """Table-5 style group ablation: one row per run of ``labels`` (run name -> row label), in that order.

    Columns: ``label, run``, the median over seeds of each paper score column present in any row's results,
    ``avg_tasks_run`` (mean of those medians; NaN for a row lacking one of them, so rows are always averaged
    over the same tasks), ``delta_avg`` (that average minus the first row's), ``n_seeds`` and, when
    ``summaries`` (run name -> ``summary.json``) is given, ``eval_loss``. A run without results raises.
    """
    if not labels:
        raise ValueError("groups_table: no runs given")
    runs = list(labels)
    scores, columns = _run_scores(results, runs)
    empty = [run for run in runs if scores.loc[run, "n_seeds"] == 0]
    if empty:
        raise ValueError(f"groups_table: no fine-tuning results for run(s) {', '.join(map(repr, empty))}")
    table = scores[columns].copy()
    table[AVG_COLUMN] = table[columns].mean(axis=1, skipna=False)
    table[DELTA_COLUMN] = table[AVG_COLUMN] - table[AVG_COLUMN].iloc[0]
    table["n_seeds"] = scores["n_seeds"]
    table = table.reset_index(names="run")
    table.insert(0, "label", [labels[run] for run in runs])
    if summaries is not None:
        unknown = [run for run in summaries if run not in labels]
        if unknown:
            raise ValueError(f"groups_table: summaries for run(s) not in labels: {', '.join(map(repr, unknown))}")
        losses = {}
        for run, path in summaries.items():
            s = read_summary(path, ("run", "eval_loss"))
            if s["run"] != run:
                raise ValueError(f"{path}: summary of run {s['run']!r} given for run {run!r}")
            losses[run] = _number(s["eval_loss"])
        table["eval_loss"] = table["run"].map(losses).astype("float64")
    return table


# --------------------------------------------------------------------------------------------------- writing


def to_markdown(df: pd.DataFrame) -> str:
    """Markdown for an ablation table: headers from :data:`ABLATION_LABELS` (a float column name, as in
    :func:`schedule_pivot`, becomes ``peak LR <lr>``); scores to 1 decimal, losses to 3, counts with thousands
    separators, learning rates in general format; missing values as ``NaN``."""
    cells = pd.DataFrame(
        {_header(name): column.map(lambda v, n=name: _format_cell(n, v)) for name, column in df.items()}
    )
    align = ["right" if pd.api.types.is_numeric_dtype(column) else "left" for _, column in df.items()]
    return cells.to_markdown(index=False, disable_numparse=True, colalign=align) + "\n"


def _header(name) -> str:
    if isinstance(name, (float, np.floating)):
        return f"peak LR {name:g}"
    return ABLATION_LABELS.get(name, str(name))


def _format_cell(name, value) -> str:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        return str(value)
    if np.isnan(value):
        return "NaN"
    if name in _INT_COLUMNS:
        return f"{int(value):,}"
    if name == "tokens_per_s":
        return f"{value:,.0f}"
    if name == "lr":
        return f"{value:g}"
    if name in _LOSS_COLUMNS or isinstance(name, (float, np.floating)):  # pivot cells hold losses
        return f"{value:.3f}"
    if name == DELTA_COLUMN:
        return f"{value:+.1f}"
    return f"{value:.1f}"


def write_ablation_table(df: pd.DataFrame, stem: PathLike) -> tuple[Path, Path]:
    """Write ``df`` to ``<stem>.csv`` (full precision, NaN as ``NaN``, as :func:`tables.write_table`) and
    ``<stem>.md`` (see :func:`to_markdown`), each atomically. A pivot's ``schedule`` index becomes a column."""
    if df.index.name is not None:
        df = df.reset_index()
    return write_table(df, stem, markdown=to_markdown)


# --------------------------------------------------------------------------------------------------- figures


def plot_arch(logs: Mapping[str, PathLike], out_png: PathLike) -> Path:
    """Figure 1: MLM loss vs tokens seen (log x), one colour per label.

    ``logs`` maps a label to its ``train_log.csv``. The training loss is drawn as a light line, the held-out
    eval loss (rows where it was measured) as markers joined by a solid line.
    """
    if not logs:
        raise ValueError("plot_arch: no logs given")
    frames = {label: read_log(path, ("tokens", "loss", "eval_loss")) for label, path in logs.items()}
    with _style():
        colors = dict(zip(frames, sns.color_palette(PALETTE, len(frames))))
        fig = _new_figure(7.5, 4.2)
        ax = fig.subplots()
        train_losses, eval_losses = [], []
        for label, log in frames.items():
            log = log[log["tokens"] > 0].sort_values("tokens")  # log x has no place for 0 tokens
            train = log[np.isfinite(log["loss"])]
            ax.plot(train["tokens"], train["loss"], color=colors[label], alpha=0.35, linewidth=1)
            evals = log[np.isfinite(log["eval_loss"])]
            ax.plot(evals["tokens"], evals["eval_loss"], color=colors[label], marker="o", markersize=4, linewidth=1.5)
            train_losses.append(train["loss"])
            eval_losses.append(evals["eval_loss"])
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(_count_label))
        ax.xaxis.set_minor_locator(NullLocator())
        bottom, top, clipped = _loss_limits(pd.concat(train_losses), pd.concat(eval_losses))
        ax.set_ylim(bottom, top)
        title = "MLM loss vs tokens seen per architecture"
        if clipped:
            # Start the x axis where the first curve enters the chart instead of leaving an empty stretch.
            entered = [log.loc[log["loss"] <= top, "tokens"].min() for log in frames.values()]
            entered = [x for x in entered if np.isfinite(x) and x > 0]
            if entered:
                ax.set_xlim(left=0.8 * min(entered))
            title += f"\n(y axis cut at {top:.2f} nats; the first steps' higher losses are off the chart)"
        ax.set_title(title)
        ax.set_xlabel("tokens seen (count, log scale)")
        ax.set_ylabel("MLM loss (cross-entropy, nats/token)")
        handles = [Line2D([], [], color=colors[label], marker="o", markersize=4, label=label) for label in frames]
        handles += [
            Line2D([], [], color="0.3", alpha=0.35, linewidth=1, label="training loss"),
            Line2D([], [], color="0.3", marker="o", markersize=4, linestyle="none", label="held-out eval loss"),
        ]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
    finals = {label: log["eval_loss"].dropna() for label, log in frames.items()}
    caption = (
        f"Figure 1 of the paper at this study's scale: MLM loss (cross-entropy, nats per token) against tokens "
        f"seen (log scale) for {len(frames)} architecture variant(s) trained on the same data and budget; light "
        "lines are the training loss, markers the held-out loss. Final held-out loss: "
        + "; ".join(f"{label} {values.iloc[-1]:.3f}" if len(values) else f"{label} not measured"
                    for label, values in finals.items())
        + ". In the paper's Figure 1 (24 h budget, 1e9+ tokens) the curves differ, after an erratic start, only by "
        "a horizontal shift set by model size rather than type, and all end near MLM loss 1.9 (32k vocabulary) "
        "[paper]; that loss is not comparable with this vocabulary, so it is not drawn."
    )
    return _save(fig, out_png, caption)


def _count_label(value: float, _pos=None) -> str:
    """1e3 -> 1k, 2.5e8 -> 250M, 2e9 -> 2B (tokens are counted in billions, not SI giga)."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:g}{suffix}"
    return f"{value:g}"


def _loss_limits(train: pd.Series, evals: pd.Series) -> tuple[float, float, bool]:
    """(bottom, top, clipped) of the loss axis.

    The first steps sit near ln(vocab) (~10 nats) and would flatten the part of the curves that differs, so
    with enough logged rows (20+) the top is the 90th percentile of the training loss (rows are spaced evenly
    in steps, so this keeps all but the earliest stretch). Short logs, or a cut that would hide little, show
    everything. ``clipped`` says whether values lie above the top.
    """
    values = pd.concat([train, evals])
    if values.empty:
        return 0.0, 1.0, False
    bottom, highest = values.min(), values.max()
    top = train.quantile(0.9) if len(train) >= 20 else highest
    clipped = highest - top > 0.25 * (top - bottom)
    if not clipped:
        top = highest
    pad = 0.05 * max(top - bottom, 1e-3)
    return bottom - pad, top + pad, bool(clipped)


def plot_schedule(logs: Mapping[str, PathLike], summaries: Mapping[str, PathLike], out_png: PathLike) -> Path:
    """Figure 2, two panels. Left: LR multiplier vs budget fraction, one line per schedule (from the first
    label in ``logs`` with that schedule; a schedule's shape is the same at every peak LR). Right: held-out
    MLM loss vs peak LR (log x), one line per schedule over all ``summaries``.

    Both mappings are keyed by run label; a label's schedule and peak LR come from its ``summary.json``.
    """
    table = schedule_table(summaries)
    unknown = [label for label in logs if label not in summaries]
    if unknown:
        raise ValueError(f"plot_schedule: log(s) without a summary: {', '.join(map(repr, unknown))}")
    schedule_of = dict(zip(table["label"], table["schedule"]))
    shape_from: dict[str, str] = {}
    for label in logs:
        shape_from.setdefault(schedule_of[label], label)
    schedules = list(dict.fromkeys(table["schedule"]))
    without = [s for s in schedules if s not in shape_from]
    if without:
        raise ValueError(f"plot_schedule: no log for schedule(s) {', '.join(map(repr, without))}")
    with _style():
        colors = dict(zip(schedules, sns.color_palette(PALETTE, len(schedules))))
        fig = _new_figure(10, 4)
        left, right = fig.subplots(1, 2)
        for schedule in schedules:
            log = read_log(logs[shape_from[schedule]], ("progress", "lr_multiplier")).sort_values("progress")
            left.plot(log["progress"], log["lr_multiplier"], color=colors[schedule], linewidth=1.5, label=schedule)
            rows = table[(table["schedule"] == schedule) & np.isfinite(table["eval_loss"])]
            right.plot(rows["lr"], rows["eval_loss"], color=colors[schedule], marker="o", linewidth=1.5)
        left.set_xlim(0, 1)
        left.set_ylim(bottom=0)
        left.set_xlabel("budget fraction (elapsed / budget)")
        left.set_ylabel("LR multiplier (LR / peak LR)")
        left.set_title("LR schedule shapes")
        right.set_xscale("log")
        lrs = sorted(table["lr"].unique())
        right.set_xticks(lrs, [f"{lr:g}" for lr in lrs])
        right.minorticks_off()
        right.set_xlabel("peak learning rate (log scale)")
        right.set_ylabel("held-out MLM loss (nats/token)")
        right.set_title("Final held-out MLM loss vs peak LR")
        fig.legend(
            handles=[Line2D([], [], color=colors[s], marker="o", label=s) for s in schedules],
            title="schedule", loc="outside right upper",
        )
    best = table[np.isfinite(table["eval_loss"])].sort_values("eval_loss").head(1)
    caption = (
        f"Figure 2 of the paper at this study's scale: left, the learning-rate multiplier over the budget for "
        f"{len(schedules)} schedule(s); right, the final held-out MLM loss (nats per token) of each schedule at "
        f"{len(lrs)} peak learning rate(s) ({', '.join(f'{lr:g}' for lr in lrs)}), one pretraining run each. "
        + (f"Lowest held-out loss: {best.iloc[0]['schedule']} at peak LR {best.iloc[0]['lr']:g} "
           f"({best.iloc[0]['eval_loss']:.3f}). " if len(best) else "")
        + "The paper (v1) finds that many shapes reach a similar loss and that one-cycle with peak 1e-3 gives the "
        "lowest; it prints no per-schedule values, so none are drawn."
    )
    return _save(fig, out_png, caption)
