"""Report figures: MLM loss curves, GLUE vs vocabulary size, per-task GLUE scores.

Every figure is written three times beside each other: ``<stem>.png`` (150 dpi), ``<stem>.pdf`` (vector, for
papers) and ``<stem>.caption.rst``: what is drawn, on what data, and what the paper reports for it. The
caption is plain prose (valid reStructuredText), so ``snakemake --report`` shows it under the figure.

Figures are built on :class:`matplotlib.figure.Figure` with an explicit Agg canvas rather than through pyplot,
so no global backend or figure registry is touched (safe in parallel Snakemake jobs and importable anywhere);
each figure is released once saved. One style (seaborn ``whitegrid``, ``paper`` context, ``colorblind``
palette) is applied to every figure, and each is written atomically.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter

from cramswarm.glue.metrics import PAPER_AVERAGE_COLUMNS
from cramswarm.report.tables import COLUMN_LABELS, atomic_write, paper_rows

PALETTE = "colorblind"
LOSS_COLUMNS = ("step", "tokens", "loss", "lr", "elapsed_s")
# One bar group per task in plot_glue_by_task: the paper's nine numbers, then WNLI.
TASK_PLOT_COLUMNS: tuple[str, ...] = (*PAPER_AVERAGE_COLUMNS, "wnli")


@contextlib.contextmanager
def _style() -> Iterator[None]:
    with sns.axes_style("whitegrid"), sns.plotting_context("paper"), sns.color_palette(PALETTE):
        yield


def _new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def figure_paths(out_png: str | os.PathLike) -> dict[str, Path]:
    """The files one figure is written to: ``png``, ``pdf`` and ``caption`` (``<stem>.caption.rst``)."""
    png = Path(out_png)
    if png.suffix != ".png":
        raise ValueError(f"figure path {png} must end in .png (the PDF and caption go beside it)")
    return {"png": png, "pdf": png.with_suffix(".pdf"), "caption": png.with_suffix(".caption.rst")}


def _save(fig: Figure, out_png: str | os.PathLike, caption: str) -> Path:
    """Write the figure as PNG and PDF and its caption, each atomically; return the PNG path."""
    if not caption.strip():
        raise ValueError(f"figure {out_png}: empty caption")
    if "{{" in caption or "{%" in caption:  # Snakemake renders report captions as Jinja templates
        raise ValueError(f"figure {out_png}: caption must not contain Jinja markup")
    paths = figure_paths(out_png)
    try:
        atomic_write(paths["png"], lambda tmp: fig.savefig(tmp, format="png", dpi=150))
        atomic_write(paths["pdf"], lambda tmp: fig.savefig(tmp, format="pdf"))
        atomic_write(paths["caption"], lambda tmp: tmp.write_text(caption.strip() + "\n"))
        return paths["png"]
    finally:
        fig.clear()  # drop the artists now instead of waiting for garbage collection


def _read_curve(label: str, curve: pd.DataFrame | str | os.PathLike) -> pd.DataFrame:
    frame = curve if isinstance(curve, pd.DataFrame) else pd.read_csv(curve)
    missing = [c for c in ("tokens", "loss") if c not in frame.columns]
    if missing:
        raise ValueError(f"loss curve {label!r}: missing column(s) {', '.join(missing)} (expected {LOSS_COLUMNS})")
    return frame.assign(label=label)[["label", "tokens", "loss"]]


def plot_loss_curves(
    curves: Mapping[str, pd.DataFrame | str | os.PathLike], out_png: str | os.PathLike, *, log_x: bool = False
) -> Path:
    """MLM training loss vs tokens seen, one line per label.

    ``curves`` maps a legend label to a pretraining log (a DataFrame or the path of its CSV) with at least
    the columns ``tokens`` and ``loss``.
    """
    if not curves:
        raise ValueError("plot_loss_curves: no curves given")
    data = pd.concat([_read_curve(label, curve) for label, curve in curves.items()], ignore_index=True)
    with _style():
        fig = _new_figure(6, 4)
        ax = fig.subplots()
        sns.lineplot(
            data=data, x="tokens", y="loss", hue="label", hue_order=sorted(curves), estimator=None, sort=True, ax=ax
        )
        if log_x:
            ax.set_xscale("log")
        else:
            ax.xaxis.set_major_formatter(EngFormatter())  # 1.5M rather than 1.5e6
        ax.set_xlabel("tokens seen (count)")
        ax.set_ylabel("MLM loss (cross-entropy, nats/token)")
        ax.set_title("Masked-LM pretraining loss")
        ax.legend(title=None)
    finals = data.sort_values("tokens").groupby("label", sort=False).last()
    caption = (
        f"Masked-LM training loss (cross-entropy, nats per token) against tokens seen, {len(curves)} pretraining "
        "run(s), one line per model/vocabulary (one row of the training log every few optimizer steps). Last "
        "logged loss: "
        + "; ".join(f"{label} {row.loss:.3f} at {row.tokens:,.0f} tokens" for label, row in finals.iterrows())
        + ". Losses are comparable only at the same vocabulary size (a larger vocabulary has a higher entropy floor). "
        "The paper draws loss curves (Figure 1) but prints no values, so no paper reference is drawn."
    )
    return _save(fig, out_png, caption)


def plot_vocab_sweep(
    table: pd.DataFrame,
    out_png: str | os.PathLike,
    *,
    baseline: Mapping[str, float] | None = None,
    baseline_label: str = "no pretraining",
) -> Path:
    """GLUE average (paper rule) and MNLI-m vs vocabulary size, one panel each, one line per model.

    ``table`` is :func:`cramswarm.report.tables.vocab_sweep_table` output; error bars are ± the seed std
    (absent for single-seed points). ``baseline`` holds the no-pretraining scores keyed ``avg_paper`` /
    ``mnli_m`` (a :func:`~cramswarm.report.tables.glue_table` row will do); each present key is drawn as a
    dashed horizontal line on its panel.
    """
    if table.empty:
        raise ValueError("plot_vocab_sweep: empty table")
    panels = (("avg_paper", "GLUE average, paper rule (%)"), ("mnli_m", "MNLI-m accuracy (%)"))
    sizes = sorted(table["vocab"].unique())
    models = sorted(table["model"].unique())
    with _style():
        colors = dict(zip(models, sns.color_palette(PALETTE, len(models))))
        fig = _new_figure(9, 3.8)
        for ax, (column, ylabel) in zip(fig.subplots(1, 2), panels):
            for model in models:
                rows = table[table["model"] == model].sort_values("vocab")
                ax.errorbar(
                    rows["vocab"],
                    rows[column],
                    yerr=rows[f"{column}_std"],
                    marker="o",
                    capsize=3,
                    color=colors[model],
                    label=model,
                )
            if baseline is not None and column in baseline and np.isfinite(baseline[column]):
                ax.axhline(baseline[column], color="0.4", linestyle="--", label=baseline_label)
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes, [str(s) for s in sizes])
            ax.minorticks_off()
            ax.set_xlabel("vocabulary size (number of tokens, log2 scale)")
            ax.set_ylabel(ylabel)
            ax.legend()
        fig.suptitle("GLUE dev scores vs vocabulary size (median over seeds ± seed std)")
    complete = table[np.isfinite(table["avg_paper"])]
    best = complete.loc[complete.groupby("model")["avg_paper"].idxmax()] if len(complete) else complete
    caption = (
        "GLUE dev average over the paper's nine columns (left) and MNLI-m accuracy (right) against the "
        f"tokenizer's vocabulary size ({', '.join(map(str, sizes))} tokens), one pretraining run per point, "
        "median over fine-tuning seeds, error bars plus/minus the seed standard deviation. "
        + (
            "Best average per model: "
            + "; ".join(f"{row.model} {row.avg_paper:.1f} at {row.vocab}" for row in best.itertuples())
            if len(best)
            else "No average is drawn: not all nine of the paper's columns were fine-tuned"
        )
        + ". The paper (v1 Figure 3) prints no per-size values; its text says smaller vocabularies (4096 to "
        "16384) did worse and 65536 was not reliably better than 32768, with MNLI plateauing around 32768 [paper]."
    )
    return _save(fig, out_png, caption)


# Published per-task rows drawn over the bars as a level line across each task's group:
# (paper_glue.csv model, legend label, line style, colour).
PAPER_LEVELS: tuple[tuple[str, str, str, str], ...] = (
    ("Crammed BERT (A6000, 24 h, v1)", "paper: crammed BERT, 24 h (v1 Table 3)", "-", "black"),
    ("BERT-base (fully trained)", "paper: BERT-base, fully trained [third-party]", "--", "0.45"),
)


def plot_glue_by_task(
    df: pd.DataFrame, out_png: str | os.PathLike, *, paper: pd.DataFrame | None = None, source: str = "synthetic"
) -> Path:
    """Per-task GLUE scores per model: bars are the median over seeds, whiskers the seed range (min to max),
    dots the individual seeds; the published rows of :data:`PAPER_LEVELS` are drawn as a level line across
    each task's group of bars.

    ``df`` is the long frame of :func:`cramswarm.report.tables.load_results`; ``paper`` defaults to
    :func:`cramswarm.report.tables.paper_rows`. Models are labelled ``model (V=vocab)`` when a model comes
    with several vocabulary sizes. ``source`` (the config's) goes into the caption: on the synthetic stand-in
    the paper's numbers are a scale reference, not a target.
    """
    data = df[df["column"].isin(TASK_PLOT_COLUMNS)].copy()
    if data.empty:
        raise ValueError("plot_glue_by_task: no task scores to plot")
    paper = paper_rows() if paper is None else paper
    several_vocabs = data.groupby("model")["vocab"].nunique().max() > 1
    data["run"] = data["model"] + " (V=" + data["vocab"].astype(str) + ")" if several_vocabs else data["model"]
    columns = [c for c in TASK_PLOT_COLUMNS if c in set(data["column"])]
    order = [COLUMN_LABELS[c] for c in columns]
    data["task"] = data["column"].map(COLUMN_LABELS)
    runs = data[["model", "vocab", "run"]].drop_duplicates().sort_values(["model", "vocab"])
    hue_order = list(dict.fromkeys(runs["run"]))  # by model, then numerically by vocab size
    with _style():
        fig = _new_figure(min(13.0, max(8.0, 1.0 + 0.18 * len(order) * len(hue_order))), 5.2)
        ax = fig.subplots()
        sns.barplot(
            data=data,
            x="task",
            y="value",
            hue="run",
            order=order,
            hue_order=hue_order,
            estimator="median",
            errorbar=("pi", 100),
            capsize=0.1,
            err_kws={"linewidth": 1},
            ax=ax,
        )
        sns.stripplot(
            data=data,
            x="task",
            y="value",
            hue="run",
            order=order,
            hue_order=hue_order,
            dodge=True,
            palette=dict.fromkeys(hue_order, "0.15"),
            size=2.0,
            jitter=0.1,
            legend=False,
            ax=ax,
        )
        drawn = []
        for model, label, style, color in PAPER_LEVELS:
            row = paper[paper["model"] == model]
            if row.empty:
                continue
            values = [
                (i, float(row.iloc[0][c])) for i, c in enumerate(columns) if c in row and np.isfinite(row.iloc[0][c])
            ]
            if values:
                x, y = np.array(values).T
                ax.hlines(y, x - 0.45, x + 0.45, colors=color, linestyles=style, linewidth=1.6, zorder=5, label=label)
                drawn.append(label)
        ax.set_xlabel("GLUE task (metric as in the paper's table)")
        ax.set_ylabel("dev score (%)")
        ax.set_ylim(bottom=min(0.0, float(data["value"].min()) - 5), top=100)
        ax.set_title("GLUE dev scores per task (bars: median over seeds, whiskers: seed range, dots: seeds)")
        handles, labels = ax.get_legend_handles_labels()
        ax.get_legend().remove()
        fig.legend(handles, labels, loc="outside lower center", ncol=min(4, len(labels)), frameon=False)
    medians = data.groupby(["run", "column"])["value"].median().unstack()
    seeds = data.groupby("run")["seed"].nunique()
    caption = (
        f"GLUE dev score per task (percent; the metric of the paper's table: F1 for QQP and MRPC, Matthews "
        f"correlation for CoLA, Pearson for STS-B, accuracy elsewhere) for {len(hue_order)} model(s); bars are "
        f"medians over {', '.join(f'{run}: {n}' for run, n in seeds.items())} fine-tuning seed(s), whiskers the "
        "range over seeds, dots single seeds. Median per task: "
        + "; ".join(
            f"{run}: "
            + ", ".join(
                f"{COLUMN_LABELS[c]} {medians.loc[run, c]:.1f}"
                for c in columns
                if c in medians and np.isfinite(medians.loc[run, c])
            )
            for run in hue_order
        )
        + ". "
        + (
            f"Level lines: {' and '.join(drawn)}, from report/paper_glue.csv (WNLI is not in the paper's table). "
            if drawn
            else ""
        )
        + (
            "These runs use the synthetic stand-in tasks, not real GLUE: the paper's lines show the real scale only. "
            if source == "synthetic"
            else ""
        )
    )
    return _save(fig, out_png, caption)
