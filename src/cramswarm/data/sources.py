"""Materialise the study's inputs as local files: the pretraining corpus and the GLUE splits.

Both sources (``synthetic`` and ``hub``) end up in the same format, so every later stage reads one kind
of file: ``corpus.parquet`` (one ``text`` column) and ``glue/<task>.parquet`` (the task's hub columns plus
``label``, ``idx`` and ``split``).
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Iterable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from cramswarm.data.stream import SCHEMA, CorpusWriter
from cramswarm.glue_tasks import get_task
from cramswarm.io import atomic_path, read_json, write_json


def corpus_documents(cfg: dict) -> Iterator:
    if cfg["source"] == "synthetic":
        from cramswarm.data import synthetic

        syn = cfg["synthetic"]
        docs = synthetic.corpus_documents(syn["corpus_documents"], syn["seed"])
        noise = syn.get("noise") or {}
        if noise.get("trash_share") or noise.get("duplicate_share"):
            from cramswarm.data.synthetic.noise import with_noise

            docs = with_noise(docs, noise.get("trash_share", 0.0), noise.get("duplicate_share", 0.0), syn["seed"])
        return docs
    from cramswarm.data import hub

    return hub.iter_corpus(cfg["hub"]["corpus"], cfg["hub"]["mirror"])


def as_text(doc) -> tuple[str | None, bool]:
    """``(text, repaired)``: a document as valid UTF-8 text. Bytes are decoded; bytes that are not UTF-8, and
    strings holding lone surrogates (undecodable bytes smuggled through ``surrogateescape``), get U+FFFD in
    place of the bad bytes (``repaired`` True). Anything that is not text gives ``(None, False)``."""
    if isinstance(doc, bytes):
        try:
            return doc.decode("utf-8"), False
        except UnicodeDecodeError:
            return doc.decode("utf-8", errors="replace"), True
    if not isinstance(doc, str):
        return None, False
    try:
        doc.encode("utf-8")
        return doc, False
    except UnicodeEncodeError:
        return doc.encode("utf-8", "surrogatepass").decode("utf-8", "replace"), True


def write_corpus(documents: Iterable, out: str | Path) -> dict:
    """Write documents to a parquet file in bounded memory (one row group at a time); return counts for the report.

    Nothing is dropped silently: empty documents and values that are not text are dropped and counted,
    documents with invalid UTF-8 are kept with U+FFFD replacement characters and counted; each count above
    zero also appears in the report's ``warnings``. No document at all is an error (and no file is written).
    """
    counts = dict.fromkeys(DROP_COUNTS, 0)
    with CorpusWriter(out) as writer:
        for doc in documents:
            _take(doc, writer, counts)
        _refuse_empty(writer.documents, counts, out)
    return _report(counts | {"documents": writer.documents, "characters": writer.characters})


# A streamed corpus is written in parts of this many row groups (at most MAX_ROW_GROUP_DOCUMENTS documents each):
# what a killed corpus job streams again.
PART_ROW_GROUPS = 25
DROP_COUNTS = ("empty_documents_dropped", "non_text_dropped", "invalid_utf8_repaired")


def write_corpus_resumable(stream: Callable[[dict | None], object], out: str | Path, state_dir: str | Path,
                           key: str) -> dict:
    """:func:`write_corpus` for a stream that can resume (``stream(state)``: a
    :class:`cramswarm.data.hub.CorpusStream` from ``state``, None for its start), with the same file and counts.

    The documents go to parts of :data:`PART_ROW_GROUPS` row groups in ``state_dir`` (outside the outputs), and after
    each part ``progress.json`` records the parts, the counts and the stream's state. A job killed mid-stream and
    started again with the same ``key`` (its source spec) continues after the last recorded part. The parts end on
    row-group boundaries, so ``out`` has the row groups one uninterrupted pass writes; ``state_dir`` goes at the end.
    """
    state_dir = Path(state_dir)
    progress_path = state_dir / "progress.json"
    progress = read_json(progress_path) if progress_path.is_file() else None
    if progress is None or progress.get("key") != key:
        shutil.rmtree(state_dir, ignore_errors=True)
        progress = {"key": key, "parts": 0, "stream": None,
                    "counts": dict.fromkeys((*DROP_COUNTS, "documents", "characters"), 0)}
    elif progress["parts"]:
        print(f"resuming the corpus after {progress['parts']} parts ({progress['counts']['documents']:,} "
              f"documents) from {state_dir}", flush=True)
    counts, source = progress["counts"], stream(progress["stream"])
    documents, finished = iter(source), False
    while not finished:
        finished = True
        with CorpusWriter(state_dir / f"part-{progress['parts']:05d}.parquet") as writer:
            for doc in documents:
                _take(doc, writer, counts)
                if writer.row_groups >= PART_ROW_GROUPS and writer.between_row_groups:
                    finished = False
                    break
        counts["documents"] += writer.documents
        counts["characters"] += writer.characters
        progress = progress | {"parts": progress["parts"] + 1, "stream": source.state(), "counts": counts}
        write_json(progress_path, progress)
    _refuse_empty(counts["documents"], counts, out)
    with atomic_path(out) as tmp, pq.ParquetWriter(tmp, SCHEMA) as joined:
        for part in range(progress["parts"]):
            reader = pq.ParquetFile(state_dir / f"part-{part:05d}.parquet")
            for group in range(reader.num_row_groups):
                joined.write_table(reader.read_row_group(group))
    shutil.rmtree(state_dir)
    return _report(counts)


def _take(doc, writer: CorpusWriter, counts: dict) -> None:
    """One document into ``writer``, or counted as dropped (``counts``, :data:`DROP_COUNTS`)."""
    text, fixed = as_text(doc)
    if text is None:
        counts["non_text_dropped"] += 1
        return
    if not text.strip():
        counts["empty_documents_dropped"] += 1
        return
    counts["invalid_utf8_repaired"] += fixed
    writer.write(text)


def _refuse_empty(documents: int, counts: dict, out) -> None:
    if documents == 0:
        raise ValueError(f"the corpus is empty: no non-empty documents ({counts['empty_documents_dropped']} empty "
                         f"ones, {counts['non_text_dropped']} not text) for {out}")


def _report(counts: dict) -> dict:
    empty, not_text, repaired = (counts[k] for k in DROP_COUNTS)
    warnings = [
        message
        for count, message in (
            (empty, f"{empty} empty documents dropped"),
            (not_text, f"{not_text} values that are not text dropped"),
            (repaired, f"{repaired} documents had invalid UTF-8; bad bytes replaced by U+FFFD"),
        )
        if count
    ]
    return {
        "documents": counts["documents"],
        "empty_documents_dropped": empty,
        "non_text_dropped": not_text,
        "invalid_utf8_repaired": repaired,
        "characters": counts["characters"],
        "warnings": warnings,
    }


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
            allowed = (
                "a finite number" if spec.is_regression else f"integers 0..{spec.num_labels - 1} {spec.label_names}"
            )
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
            out_row.update(
                label=float(row["label"]) if spec.is_regression else int(row["label"]),
                idx=int(row.get("idx", i)),
                split=split,
            )
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
