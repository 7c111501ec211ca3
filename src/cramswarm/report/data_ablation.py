"""Table 2 of Cramming at any scale: one pretraining run per (source, data recipe), fine-tuned and compared.

:func:`data_table` reads, per run, the pretraining ``summary.json``, the stage reports of its data chain
(corpus, each filter step, packing, order) and its fine-tuning results, and gives one row per run:
documents after each filter, tokens and blocks packed, held-out MLM loss, the median over seeds of each
fine-tuned score and their average. :func:`table2` pivots that average into the paper's layout (sources as
rows, cells as columns).

**Which number compares across data.** Each run's held-out loss is measured on held-out blocks of *its own*
data: blocks of a filtered corpus, tokenized by a tokenizer trained on it, so losses of different sources
or filters are not on the same text or even the same vocabulary. The fine-tuned scores are measured on the
same GLUE (or synthetic GLUE-shaped) validation rows for every run: they are the cross-data comparison, as
in the paper. Held-out losses do compare between runs of the same corpus variant and tokenizer, e.g.
``filtered`` vs ``filtered_sorted`` (the order stage puts the same held-out sample last for every order).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import pandas as pd

from cramswarm.io import read_json_object
from cramswarm.report.ablations import AVG_COLUMN, _number, _run_scores, read_summary, to_markdown
from cramswarm.report.tables import write_table

NOTE = (
    "\nGLUE scores (median over fine-tuning seeds; avg = mean over the tasks run) compare across sources and "
    "filters: every run is fine-tuned and scored on the same validation rows. Held-out MLM loss is measured on "
    "each run's own packed data and tokenizer, so it compares only between cells that share both (cells that "
    "differ only in order); documents counts are per stage (raw corpus, after trash filter, after dedup), and the "
    "trash filter's removed share is of the documents it read.\n"
)


def _report(path: str | None) -> dict:
    return read_json_object(path, "stage report", missing=ValueError) if path else {}


def data_table(runs: Mapping[str, Mapping], results: Iterable[str]) -> pd.DataFrame:
    """One row per run, in the order given. ``runs`` maps a run name to ``{"label", "source", "cell", "data"
    (the recipe), "summary" (summary.json), "reports": {"corpus", "trash", "dedup", "pack", "order"}}``
    (a filter's report is absent when the filter is off)."""
    if not runs:
        raise ValueError("data_table: no runs given")
    rows = []
    for run, spec in runs.items():
        summary = read_summary(spec["summary"], ("run", "tokens", "eval_loss"))
        if summary["run"] != run:
            raise ValueError(f"{spec['summary']}: summary of run {summary['run']!r} given for run {run!r}")
        reports = {stage: _report(path) for stage, path in spec["reports"].items()}
        data = spec["data"]
        rows.append(
            {
                "label": spec["label"],
                "run": run,
                "source": spec["source"],
                "cell": spec["cell"],
                "trash_filter": bool(data["trash_filter"]),
                "dedup": bool(data["dedup"]),
                "order": data["order"],
                "family": data["family"],
                "documents_raw": reports["corpus"].get("documents"),
                "documents_after_trash": reports.get("trash", {}).get("documents_out"),
                "trash_removed_share": reports.get("trash", {}).get("documents_removed_share"),
                "documents_after_dedup": reports.get("dedup", {}).get("documents_out"),
                "tokens_packed": reports["pack"].get("tokens"),
                "blocks": reports["pack"].get("blocks"),
                "pretrain_tokens": int(summary["tokens"]),
                "eval_loss": _number(summary["eval_loss"]),
            }
        )
    table = pd.DataFrame(rows)
    scores, columns = _run_scores(results, table["run"])
    table = table.join(scores[columns], on="run")
    table[AVG_COLUMN] = table[columns].mean(axis=1, skipna=False) if columns else float("nan")
    table["n_seeds"] = table["run"].map(scores["n_seeds"]).fillna(0).astype("int64")
    for column in ("documents_raw", "documents_after_trash", "documents_after_dedup", "tokens_packed", "blocks"):
        table[column] = table[column].astype("Int64")
    return table


def table2(table: pd.DataFrame, value: str = AVG_COLUMN) -> pd.DataFrame:
    """The paper's layout: one row per source (first-seen order), one column per cell, ``value`` in the cells."""
    pivot = table.pivot(index="source", columns="cell", values=value)
    return pivot.reindex(index=list(dict.fromkeys(table["source"])), columns=list(dict.fromkeys(table["cell"])))


COUNT_HEADERS = {
    "documents_raw": "Docs (raw)",
    "documents_after_trash": "Docs after trash",
    "documents_after_dedup": "Docs after dedup",
    "tokens_packed": "Tokens packed",
    "blocks": "Blocks",
    "pretrain_tokens": "Pretrain tokens",
}
TEXT_HEADERS = {
    "source": "Source",
    "cell": "Cell",
    "trash_filter": "Trash",
    "dedup": "Dedup",
    "order": "Order",
    "family": "Tokenizer",
}


def _markdown(df: pd.DataFrame) -> str:
    """:func:`cramswarm.report.ablations.to_markdown` with counts as integers ("-": stage not run), the trash
    filter's removed share in percent, and a note."""
    df = df.copy()
    if "trash_removed_share" in df.columns:
        df["trash_removed_share"] = df["trash_removed_share"].map(lambda v: "-" if pd.isna(v) else f"{100 * v:.1f}")
        df = df.rename(columns={"trash_removed_share": "Trash removed (% docs)"})
    for column in COUNT_HEADERS.keys() & set(df.columns):
        df[column] = df[column].map(lambda v: "-" if pd.isna(v) else f"{int(v):,}")
    return to_markdown(df.rename(columns={**COUNT_HEADERS, **TEXT_HEADERS})) + NOTE


# The paper's Table 2 (ICML): GLUE average per source x cell, one pretraining run each [third-party: quoted by
# a literature note, not verified against the paper; shared/reference/paper-numbers.md 1.4].
PAPER_TABLE2: dict[str, dict[str, float]] = {
    "bookcorpus-wikipedia": {"none": 78.1, "filtered": 78.7, "filtered_sorted": 78.8},
    "C4": {"none": 75.9, "filtered": 79.3, "filtered_sorted": 79.0},
    "OSCAR": {"none": 79.1, "filtered": 79.2, "filtered_sorted": 79.2},
    "Pile": {"none": 78.2, "filtered": 79.3, "filtered_sorted": 80.1},
    "Pile (natural sources)": {"none": 79.2, "filtered": 79.8, "filtered_sorted": 80.1},
}


def paper_table2(cells: list[str]) -> pd.DataFrame:
    """:data:`PAPER_TABLE2` as rows below ours: ``source`` = "paper (ICML, [third-party]): <corpus>", one
    column per cell of ``cells`` (NaN where the paper has no such cell, e.g. dedup)."""
    return pd.DataFrame(
        [
            {"source": f"paper (ICML, [third-party]): {corpus}", **{c: row.get(c, float("nan")) for c in cells}}
            for corpus, row in PAPER_TABLE2.items()
        ]
    )


def write_data_tables(table: pd.DataFrame, stem: str | Path) -> None:
    """``<stem>.{csv,md}`` (one row per run) and ``<stem>_table2.{csv,md}`` (sources x cells, GLUE average,
    the paper's published rows below ours)."""
    stem = Path(stem)
    write_table(table, stem, markdown=_markdown)
    pivot = table2(table).reset_index()
    pivot.columns = [str(c) for c in pivot.columns]
    pivot = pd.concat([pivot, paper_table2(list(pivot.columns[1:]))], ignore_index=True)
    write_table(pivot, stem.with_name(stem.name + "_table2"), markdown=_markdown)
