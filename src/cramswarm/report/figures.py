"""Report figures (PNG): MLM loss curves, GLUE vs vocabulary size, per-task GLUE scores.

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
from cramswarm.report.tables import COLUMN_LABELS, atomic_write

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


def _save(fig: Figure, out_png: str | os.PathLike) -> Path:
    try:
        return atomic_write(out_png, lambda tmp: fig.savefig(tmp, format="png", dpi=150))
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
        sns.lineplot(data=data, x="tokens", y="loss", hue="label", estimator=None, sort=True, ax=ax)
        if log_x:
            ax.set_xscale("log")
        else:
            ax.xaxis.set_major_formatter(EngFormatter())  # 1.5M rather than 1.5e6
        ax.set_xlabel("tokens seen (count)")
        ax.set_ylabel("MLM loss (cross-entropy, nats/token)")
        ax.set_title("Masked-LM pretraining loss")
        ax.legend(title=None)
    return _save(fig, out_png)


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
                    rows["vocab"], rows[column], yerr=rows[f"{column}_std"],
                    marker="o", capsize=3, color=colors[model], label=model,
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
    return _save(fig, out_png)


def plot_glue_by_task(df: pd.DataFrame, out_png: str | os.PathLike) -> Path:
    """Per-task GLUE scores per model: bars are the median over seeds, whiskers the seed range (min to max),
    dots the individual seeds.

    ``df`` is the long frame of :func:`cramswarm.report.tables.load_results`. Models are labelled
    ``model (V=vocab)`` when a model comes with several vocabulary sizes.
    """
    data = df[df["column"].isin(TASK_PLOT_COLUMNS)].copy()
    if data.empty:
        raise ValueError("plot_glue_by_task: no task scores to plot")
    several_vocabs = data.groupby("model")["vocab"].nunique().max() > 1
    data["run"] = (
        data["model"] + " (V=" + data["vocab"].astype(str) + ")" if several_vocabs else data["model"]
    )
    order = [COLUMN_LABELS[c] for c in TASK_PLOT_COLUMNS if c in set(data["column"])]
    data["task"] = data["column"].map(COLUMN_LABELS)
    runs = data[["model", "vocab", "run"]].drop_duplicates().sort_values(["model", "vocab"])
    hue_order = list(dict.fromkeys(runs["run"]))  # by model, then numerically by vocab size
    with _style():
        fig = _new_figure(max(8.0, 1.0 + 0.35 * len(order) * len(hue_order)), 4.5)
        ax = fig.subplots()
        sns.barplot(
            data=data, x="task", y="value", hue="run", order=order, hue_order=hue_order,
            estimator="median", errorbar=("pi", 100), capsize=0.1, err_kws={"linewidth": 1}, ax=ax,
        )
        sns.stripplot(
            data=data, x="task", y="value", hue="run", order=order, hue_order=hue_order,
            dodge=True, palette=dict.fromkeys(hue_order, "0.15"), size=2.5, jitter=0.1, legend=False, ax=ax,
        )
        ax.set_xlabel("GLUE task (metric as in the paper's table)")
        ax.set_ylabel("dev score (%)")
        ax.set_title("GLUE dev scores per task (median over seeds, whiskers: seed range)")
        sns.move_legend(ax, "upper left", bbox_to_anchor=(1, 1), title=None)  # outside, clear of the bars
    return _save(fig, out_png)
