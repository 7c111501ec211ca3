"""Real data through ``datasets.load_dataset``: GLUE by hub id, pretraining corpora streamed by hub id.

Every loader takes an optional ``mirror``: a local folder in hub layout (``<mirror>/<owner>/<name>/...``,
e.g. a copy made with ``huggingface-cli download --repo-type dataset``). With a mirror the same hub ids are
read from disk, which is what clusters whose compute nodes have no internet need.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Iterator

from cramswarm.glue_tasks import get_task


def resolve(hub_id: str, mirror: str | Path | None) -> str:
    """The path ``load_dataset`` should get: the hub id itself, or its folder inside ``mirror``."""
    if mirror is None:
        return hub_id
    folder = Path(mirror) / hub_id
    if not folder.is_dir():
        raise FileNotFoundError(f"hub mirror {mirror} has no folder for {hub_id!r} (looked for {folder})")
    return str(folder)


def load_glue_split(task: str, split: str, glue_id: str = "nyu-mll/glue", mirror: str | Path | None = None):
    """One split of one GLUE task as a ``datasets.Dataset``. Test splits are refused: GLUE test labels are hidden."""
    import datasets

    spec = get_task(task)
    allowed = ("train", *spec.eval_splits)
    if split not in allowed:
        raise ValueError(f"GLUE {task} split {split!r} is not read by this workflow; allowed: {', '.join(allowed)}")
    return datasets.load_dataset(resolve(glue_id, mirror), task, split=split)


def iter_corpus(sources: list[dict], mirror: str | Path | None = None) -> Iterator[str]:
    """Stream documents from each source in order, at most ``max_documents`` from each."""
    import datasets

    for src in sources:
        stream = datasets.load_dataset(
            resolve(src["path"], mirror), src.get("name"), split=src.get("split", "train"), streaming=True
        )
        column = src.get("text_column", "text")
        if column not in (stream.column_names or [column]):
            raise ValueError(f"corpus {src['path']} has no column {column!r}; columns: {stream.column_names}")
        rows = iter(stream)
        try:
            for row in itertools.islice(rows, src.get("max_documents")):
                yield row[column]
        finally:
            # Close the stream's generator explicitly: an abandoned one aborts the interpreter at exit.
            close = getattr(rows, "close", None)
            if close is not None:
                close()
