"""Materialise the study's inputs as local files: the pretraining corpus and the GLUE splits.

Both sources (``synthetic`` and ``hub``) end up in the same format, so every later stage reads one kind
of file: ``corpus.parquet`` (one ``text`` column) and ``glue/<task>.parquet`` (the task's hub columns plus
``label``, ``idx`` and ``split``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from cramswarm.glue.tasks import get_task
from cramswarm.io import atomic_path

CHUNK_DOCUMENTS = 4096  # documents per parquet row group: bounds memory while writing large corpora


def corpus_documents(cfg: dict) -> Iterator[str]:
    if cfg["source"] == "synthetic":
        from cramswarm.data import synthetic

        syn = cfg["synthetic"]
        return synthetic.corpus_documents(syn["corpus_documents"], syn["seed"])
    from cramswarm.data import hub

    return hub.iter_corpus(cfg["hub"]["corpus"], cfg["hub"]["mirror"])


def write_corpus(documents: Iterable[str], out: str | Path) -> dict:
    """Write non-empty documents to a parquet file in chunks; return counts for the stage report."""
    schema = pa.schema([("text", pa.string())])
    kept = empty = characters = 0
    with atomic_path(out) as tmp, pq.ParquetWriter(tmp, schema) as writer:
        chunk: list[str] = []
        for doc in documents:
            if not isinstance(doc, str) or not doc.strip():
                empty += 1
                continue
            chunk.append(doc)
            kept += 1
            characters += len(doc)
            if len(chunk) == CHUNK_DOCUMENTS:
                writer.write_table(pa.table({"text": chunk}, schema=schema))
                chunk = []
        if chunk:
            writer.write_table(pa.table({"text": chunk}, schema=schema))
        if kept == 0:
            raise ValueError(f"the corpus is empty: no non-empty documents ({empty} empty ones) for {out}")
    return {"documents": kept, "empty_documents_dropped": empty, "characters": characters}


def glue_rows(cfg: dict, task: str, split: str) -> list[dict]:
    if cfg["source"] == "synthetic":
        from cramswarm.data import synthetic

        syn = cfg["synthetic"]
        n = syn["glue_train_examples"] if split == "train" else syn["glue_validation_examples"]
        return synthetic.glue_split(task, split, n, syn["seed"])
    from cramswarm.data import hub

    ds = hub.load_glue_split(task, split, cfg["hub"]["glue"], cfg["hub"]["mirror"])
    cap = cfg["hub"]["glue_max_train_examples"]
    if split == "train" and cap is not None and len(ds) > cap:
        ds = ds.select(range(cap))
    return ds.to_list()


def check_rows(task: str, split: str, rows: list[dict]) -> None:
    """Reject rows whose columns or labels do not match the task, before any training starts."""
    spec = get_task(task)
    if not rows:
        raise ValueError(f"GLUE {task}/{split} has no rows")
    missing = {*spec.text_columns, "label"} - set(rows[0])
    if missing:
        raise ValueError(f"GLUE {task}/{split} lacks columns {sorted(missing)}; has {sorted(rows[0])}")
    for row in rows:
        label = row["label"]
        if spec.is_regression:
            ok = isinstance(label, (int, float)) and math.isfinite(label)
        else:
            ok = isinstance(label, int) and 0 <= label < spec.num_labels
        if not ok:
            allowed = "a finite number" if spec.is_regression else f"integers 0..{spec.num_labels - 1} {spec.label_names}"
            raise ValueError(f"GLUE {task}/{split} row idx={row.get('idx')} has label {label!r}; expected {allowed}")


def write_glue(cfg: dict, task: str, out: str | Path) -> dict:
    """Write the train and validation splits of ``task`` into one parquet file with a ``split`` column."""
    spec = get_task(task)
    table_rows = []
    counts = {}
    for split in ("train", *spec.eval_splits):
        rows = glue_rows(cfg, task, split)
        check_rows(task, split, rows)
        counts[split] = len(rows)
        for i, row in enumerate(rows):
            out_row = {col: row[col] for col in spec.text_columns}
            out_row.update(label=float(row["label"]) if spec.is_regression else int(row["label"]),
                           idx=int(row.get("idx", i)), split=split)
            table_rows.append(out_row)
    with atomic_path(out) as tmp:
        pq.write_table(pa.Table.from_pylist(table_rows), tmp)
    return counts


def read_glue(path: str | Path, split: str) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"missing GLUE data file: {path}")
    try:
        table = pq.read_table(path, filters=[("split", "=", split)])
    except pa.ArrowInvalid as err:
        raise ValueError(f"corrupt GLUE data file {path}: {err}") from None
    if table.num_rows == 0:
        raise ValueError(f"GLUE data file {path} has no rows for split {split!r}")
    return table.to_pylist()
