"""GLUE result tables: load fine-tuning result JSONs, aggregate over seeds, write CSV + Markdown.

Aggregation rules (one row per (model, vocab)):

* each score column is the **median over the seeds** that have it;
* ``avg_paper`` is the paper's GLUE average as Cramming prints it: the mean of the row's per-task medians
  (so the printed average is the mean of the printed columns);
* ``avg_paper_seeds`` / ``avg_glue`` are computed **per seed** (see :mod:`cramswarm.glue.metrics`) and then the
  median over seeds is reported, with ``avg_paper_std`` the sample standard deviation (ddof=1) of the per-seed
  paper averages — NaN with a single seed; they carry the seed-to-seed spread that a mean of medians hides. A seed
  lacking any task needed by an average makes that seed's average
  NaN and so the row's median NaN: a partial row says so instead of averaging fewer numbers.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from importlib import resources
from pathlib import Path

import numpy as np
import pandas as pd

from cramswarm.glue.metrics import (
    PAPER_AVERAGE_COLUMNS,
    SCORE_COLUMNS,
    glue_average,
    paper_average,
    score_columns,
)
from cramswarm.io import atomic_path, read_json_object

LONG_COLUMNS: tuple[str, ...] = ("model", "vocab", "task", "seed", "protocol", "column", "value")
KEYS: list[str] = ["model", "vocab"]

# Headers for the Markdown tables (the CSV keeps the machine-readable keys).
COLUMN_LABELS: dict[str, str] = {
    "model": "Model",
    "vocab": "Vocab",
    "protocol": "Protocol",
    "mnli_m": "MNLI-m",
    "mnli_mm": "MNLI-mm",
    "qqp_f1": "QQP F1",
    "qqp_acc": "QQP acc",
    "qnli": "QNLI",
    "sst2": "SST-2",
    "cola": "CoLA",
    "stsb_pearson": "STS-B Pearson",
    "stsb_spearman": "STS-B Spearman",
    "mrpc_f1": "MRPC F1",
    "mrpc_acc": "MRPC acc",
    "rte": "RTE",
    "wnli": "WNLI",
    "avg_paper": "GLUE avg (paper)",
    "avg_paper_seeds": "GLUE avg (seed median)",
    "avg_paper_std": "± seed std",
    "avg_glue": "GLUE avg (benchmark)",
    "mnli_m_std": "MNLI-m ± seed std",
    "n_seeds": "Seeds",
    "kind": "Kind",
    "avg_paper_delta": "Δ avg vs paper crammed",
    "pretrain_tokens": "Pretraining tokens",
    "data_passes": "Passes over the data",
    "source": "Source",
    "note": "Note",
}

# The published GLUE-dev rows (package data next to this module) and the row our deltas refer to by default.
PAPER_GLUE_CSV = "paper_glue.csv"
PAPER_COLUMNS: tuple[str, ...] = ("source", "model", *PAPER_AVERAGE_COLUMNS, "avg_paper", "note")
DEFAULT_REFERENCE_MODEL = "Crammed BERT (A6000, 24 h, v1)"


def load_results(paths: Iterable[str | os.PathLike]) -> pd.DataFrame:
    """Read fine-tuning result JSONs into a long frame with columns :data:`LONG_COLUMNS`.

    Each file holds ``{"model", "vocab", "task", "seed", "scores": {split: {metric: value}}, ...}``; its scores
    become one row per score column. ``protocol`` is the name of the fine-tuning protocol the file records
    (empty when it records none). A missing, unparsable or malformed file raises an error naming it, and so
    does a (model, vocab, task, seed) given by two files.
    """
    rows: list[tuple] = []
    seen: dict[tuple, Path] = {}
    for path in map(Path, paths):
        record = _read_result(path)
        run = (record["model"], record["vocab"], record["task"], record["seed"])
        if run in seen:
            raise ValueError(f"{path}: duplicates the run {run} already read from {seen[run]}")
        seen[run] = path
        protocol = str((record.get("protocol") or {}).get("name", ""))
        for split, metrics in record["scores"].items():
            try:
                columns = score_columns(record["task"], split, metrics)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{path}: {exc}") from exc
            rows.extend((*run, protocol, column, value) for column, value in columns.items())
    if not seen:
        raise ValueError("load_results: no result files given")
    df = pd.DataFrame(rows, columns=list(LONG_COLUMNS))
    return df.astype({"vocab": "int64", "seed": "int64", "value": "float64"})


def _read_result(path: Path) -> dict:
    record = read_json_object(path, "fine-tuning result file")
    missing = [k for k in ("model", "vocab", "task", "seed", "scores") if k not in record]
    if missing:
        raise ValueError(f"{path}: missing field(s) {', '.join(missing)}")
    for key in ("vocab", "seed"):
        if not isinstance(record[key], int) or isinstance(record[key], bool):
            raise ValueError(f"{path}: {key!r} must be an integer, got {record[key]!r}")
    if not isinstance(record["scores"], dict) or not record["scores"]:
        raise ValueError(f"{path}: 'scores' must be a non-empty {{split: {{metric: value}}}} object")
    return record


def per_seed_scores(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (model, vocab, seed): every score column (NaN where a task is missing) plus both averages."""
    wide = (
        df.pivot(index=[*KEYS, "seed"], columns="column", values="value")
        .reindex(columns=list(SCORE_COLUMNS))
        .rename_axis(columns=None)
    )
    wide["avg_paper"] = wide.apply(paper_average, axis=1, missing="nan")
    wide["avg_glue"] = wide.apply(glue_average, axis=1, missing="nan")
    return wide.reset_index()


def _strict_median(values: pd.Series) -> float:
    # NaN if any seed lacks the number: an aggregate over fewer seeds than n_seeds would hide a failed run.
    return float(values.median(skipna=False))


def _seed_std(values: pd.Series) -> float:
    return float(values.std(ddof=1, skipna=False))


def glue_table(df: pd.DataFrame) -> pd.DataFrame:
    """The GLUE table: one row per (model, vocab), columns ``model, vocab, protocol`` (the fine-tuning
    protocols the results record, ``/``-joined if several), :data:`SCORE_COLUMNS` (medians over seeds, paper
    order, WNLI last), ``avg_paper, avg_paper_std, avg_glue, n_seeds``. See the module docstring for the
    aggregation rules."""
    protocols = df.groupby(KEYS)["protocol"].agg(lambda names: "/".join(sorted(set(names) - {""})))
    groups = per_seed_scores(df).groupby(KEYS)
    table = groups[list(SCORE_COLUMNS)].median()
    table["avg_paper"] = table.apply(paper_average, axis=1, missing="nan")
    table["avg_paper_seeds"] = groups["avg_paper"].agg(_strict_median)
    table["avg_paper_std"] = groups["avg_paper"].agg(_seed_std)
    table["avg_glue"] = groups["avg_glue"].agg(_strict_median)
    table["n_seeds"] = groups.size()
    table.insert(0, "protocol", protocols)
    return table.reset_index()


def with_pretraining(table: pd.DataFrame, summaries: Iterable[tuple[str, int, dict]]) -> pd.DataFrame:
    """``table`` (one row per (model, vocab)) with what each model's pretraining saw: ``pretrain_tokens`` and
    ``data_passes`` (the training blocks read that many times; above 1 the data wrapped, and a curriculum order
    restarted), from the run's ``summary.json``. ``summaries``: (model, vocab, summary) per pretrained run; a row
    without one (the random-init baseline) gets NaN."""
    seen = {(model, int(vocab)): s for model, vocab, s in summaries}
    rows = [seen.get((m, int(v)), {}) for m, v in zip(table["model"], table["vocab"])]
    out = table.copy()
    out["pretrain_tokens"] = pd.array([row.get("tokens") for row in rows], dtype="Int64")
    out["data_passes"] = np.array([row.get("epochs_of_data", np.nan) for row in rows], dtype="float64")
    return out


def vocab_sweep_table(df: pd.DataFrame, *, exclude: Iterable[str] = ()) -> pd.DataFrame:
    """Per (model, vocab): the paper's GLUE average (mean of task medians), the median and seed std of the
    per-seed averages, median and seed std of MNLI-m, plus ``n_seeds``.

    ``exclude`` names models to leave out, e.g. the no-pretraining baseline, so that only pretrained models
    are swept. Rows are sorted by model, then vocab size.
    """
    seeds = per_seed_scores(df)
    groups = seeds[~seeds["model"].isin(list(exclude))].groupby(KEYS)
    table = pd.DataFrame(
        {
            "avg_paper": groups[list(SCORE_COLUMNS)].median().apply(paper_average, axis=1, missing="nan"),
            "avg_paper_seeds": groups["avg_paper"].agg(_strict_median),
            "avg_paper_std": groups["avg_paper"].agg(_seed_std),
            "mnli_m": groups["mnli_m"].agg(_strict_median),
            "mnli_m_std": groups["mnli_m"].agg(_seed_std),
            "n_seeds": groups.size(),
        }
    )
    return table.reset_index().sort_values(KEYS, ignore_index=True)


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp)`` on a temporary file next to ``path`` (same extension), then rename it onto ``path``."""
    with atomic_path(path) as tmp:
        write(tmp)
    return Path(path)


def to_markdown(df: pd.DataFrame) -> str:
    """A Markdown table: headers from :data:`COLUMN_LABELS`, floats to 1 decimal, missing numbers as ``NaN``,
    missing text (e.g. the source of our own rows) as an empty cell."""
    cells = pd.DataFrame(
        {
            COLUMN_LABELS.get(name, name): column.map(
                _format_cell
                if pd.api.types.is_numeric_dtype(column)
                else lambda v: "" if pd.isna(v) else _format_cell(v)
            )
            for name, column in df.items()
        }
    )
    align = ["right" if pd.api.types.is_numeric_dtype(column) else "left" for _, column in df.items()]
    # disable_numparse: the cells are already formatted; tabulate must not reformat "2048" as a float.
    return cells.to_markdown(index=False, disable_numparse=True, colalign=align) + "\n"


def _format_cell(value) -> str:
    if value is pd.NA:  # a missing entry of a nullable integer column (e.g. vocab of a published row)
        return "NaN"
    if isinstance(value, (float, np.floating)):
        return "NaN" if np.isnan(value) else f"{value:.1f}"
    return str(value)


def write_table(
    df: pd.DataFrame,
    stem: str | os.PathLike,
    *,
    latex: bool = False,
    markdown: Callable[[pd.DataFrame], str] = to_markdown,
) -> tuple[Path, ...]:
    """Write ``df`` to ``<stem>.csv`` (full precision, NaN as ``NaN``) and ``<stem>.md`` (rendered by
    ``markdown``), each atomically; with ``latex=True`` also ``<stem>.tex`` (see :func:`to_latex`). Returns the
    paths written, in that order."""
    stem = Path(stem)
    csv_path = atomic_write(stem.with_name(stem.name + ".csv"), lambda tmp: df.to_csv(tmp, index=False, na_rep="NaN"))
    md_path = atomic_write(stem.with_name(stem.name + ".md"), lambda tmp: tmp.write_text(markdown(df)))
    if not latex:
        return csv_path, md_path
    tex_path = atomic_write(stem.with_name(stem.name + ".tex"), lambda tmp: tmp.write_text(to_latex(df)))
    return csv_path, md_path, tex_path


# ---------------------------------------------------------------------------------------------------------------
# Published rows beside ours


def paper_rows() -> pd.DataFrame:
    """The published GLUE-dev rows shipped as ``paper_glue.csv``: columns :data:`PAPER_COLUMNS`, scores in
    percent, NaN where the source gives no number. ``note`` carries the confidence tag of the reference
    ([paper] = printed by the authors, [third-party] = quoted by someone else)."""
    with resources.as_file(resources.files(__package__).joinpath(PAPER_GLUE_CSV)) as path:
        rows = pd.read_csv(
            path,
            dtype={"source": "str", "model": "str", "note": "str"},
            keep_default_na=False,
            na_values={c: [""] for c in (*PAPER_AVERAGE_COLUMNS, "avg_paper")},
        )
    missing = [c for c in PAPER_COLUMNS if c not in rows.columns]
    if missing:
        raise ValueError(f"{PAPER_GLUE_CSV}: missing column(s) {', '.join(missing)}")
    if rows["model"].duplicated().any():
        raise ValueError(
            f"{PAPER_GLUE_CSV}: duplicate model(s) {sorted(set(rows['model'][rows['model'].duplicated()]))}"
        )
    numeric = [*PAPER_AVERAGE_COLUMNS, "avg_paper"]
    rows[numeric] = rows[numeric].astype("float64")
    return rows[list(PAPER_COLUMNS)]


def glue_table_with_paper(
    ours: pd.DataFrame,
    reference_model: str = DEFAULT_REFERENCE_MODEL,
    *,
    paper: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """Our GLUE table (the output of :func:`glue_table`) with the published rows appended below it.

    A leading ``kind`` column says ``"ours"`` or ``"published"``. ``avg_paper_delta`` is, for our rows, our
    ``avg_paper`` minus the published ``avg_paper`` of ``reference_model`` (NaN for the published rows and for
    our rows without an average); :func:`with_pretraining`'s columns, when ``ours`` has them, follow it.
    ``source`` and ``note`` cite the published rows. ``paper`` defaults to :func:`paper_rows`; an unknown
    reference model, or one without a published average, raises ValueError.
    """
    paper = paper_rows() if paper is None else paper
    matches = paper.loc[paper["model"] == reference_model, "avg_paper"]
    if matches.empty:
        raise ValueError(f"unknown reference model {reference_model!r}; published rows: {list(paper['model'])}")
    reference = float(matches.iloc[0])
    if np.isnan(reference):
        raise ValueError(f"reference model {reference_model!r} has no published GLUE average")

    ours = ours.copy()
    ours.insert(0, "kind", "ours")
    ours["avg_paper_delta"] = ours["avg_paper"] - reference
    published = paper.copy()
    published.insert(0, "kind", "published")
    combined = pd.concat([ours, published], ignore_index=True, sort=False)

    columns = list(ours.columns)
    columns.insert(columns.index("avg_paper") + 1, columns.pop(columns.index("avg_paper_delta")))
    for offset, name in enumerate(("pretrain_tokens", "data_passes"), start=2):  # beside the delta, when there
        if name in columns:
            columns.insert(columns.index("avg_paper") + offset, columns.pop(columns.index(name)))
    columns += [c for c in published.columns if c not in columns]
    combined = combined[columns]
    # Integer columns of our table stay integers (nullable, missing for the published rows), not 2048.0.
    for name in ("vocab", "n_seeds", "pretrain_tokens"):
        if name in combined and name in ours and pd.api.types.is_integer_dtype(ours[name]):
            combined[name] = combined[name].astype("Int64")
    return combined


# ---------------------------------------------------------------------------------------------------------------
# LaTeX

LATEX_NAN = "--"  # an en dash in LaTeX source: how a missing number is typeset
_LATEX_SPECIALS = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
}
_LATEX_SYMBOLS = {"Δ": r"$\Delta$", "±": r"$\pm$", "–": "--"}


def latex_escape(text: str) -> str:
    """Escape LaTeX's special characters in ``text`` (and typeset Δ, ± and – portably)."""
    out = []
    for char in str(text):
        out.append(_LATEX_SPECIALS.get(char) or _LATEX_SYMBOLS.get(char) or char)
    return "".join(out)


def _latex_cell(value) -> str:
    if value is pd.NA or value is None:
        return LATEX_NAN
    if isinstance(value, (float, np.floating)):
        return LATEX_NAN if np.isnan(value) else f"{value:.1f}"
    return latex_escape(value)


def to_latex(df: pd.DataFrame) -> str:
    """A booktabs ``tabular`` (needs ``\\usepackage{booktabs}``): headers from :data:`COLUMN_LABELS`, floats to
    one decimal, missing values as an en dash, text escaped. Numeric columns are right-aligned. With a ``kind``
    column, a ``\\midrule`` separates each run of equal kinds (our rows from the published ones)."""
    align = "".join("r" if pd.api.types.is_numeric_dtype(column) else "l" for _, column in df.items())
    header = " & ".join(latex_escape(COLUMN_LABELS.get(name, name)) for name in df.columns)
    lines = [f"\\begin{{tabular}}{{{align}}}", "\\toprule", header + r" \\", "\\midrule"]
    kinds = df["kind"].tolist() if "kind" in df.columns else [None] * len(df)
    for i, (kind, row) in enumerate(zip(kinds, df.itertuples(index=False))):
        if i and kind != kinds[i - 1]:
            lines.append("\\midrule")
        lines.append(" & ".join(_latex_cell(value) for value in row) + r" \\")
    lines += ["\\bottomrule", "\\end{tabular}"]
    return "\n".join(lines) + "\n"
