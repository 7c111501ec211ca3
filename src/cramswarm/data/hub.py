"""Real data through ``datasets.load_dataset``: GLUE by hub id, pretraining corpora streamed by hub id.

Every loader takes an optional ``mirror``: a local folder in hub layout (``<mirror>/<owner>/<name>/...``,
e.g. a copy made with ``huggingface-cli download --repo-type dataset``). With a mirror the same hub ids are
read from disk, which is what clusters whose compute nodes have no internet need.
"""

from __future__ import annotations

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
    return iter(CorpusStream(sources, mirror))


class CorpusStream:
    """The documents of ``sources`` (``hub.corpus`` entries) streamed in order, at most ``max_documents`` from each,
    that can say where it stands and start again from there.

    :meth:`state` (between two documents) is the source being read, the documents taken from it and that stream's
    own position (``datasets``' ``IterableDataset.state_dict``: its shard and the example in it); a stream built
    with ``state`` continues with the document after it, so a corpus job killed after hours of streaming resumes
    instead of reading the sources again from their start (:func:`cramswarm.data.sources.write_corpus`).
    """

    def __init__(self, sources: list[dict], mirror: str | Path | None = None, state: dict | None = None):
        self.sources, self.mirror = sources, mirror
        self._index, self._taken, self._stream_state = 0, 0, None
        if state is not None:
            self._index, self._taken, self._stream_state = state["source"], state["taken"], state["stream"]
        self._stream = None

    def state(self) -> dict:
        stream = self._stream.state_dict() if self._stream is not None else self._stream_state
        return {"source": self._index, "taken": self._taken, "stream": stream}

    def __iter__(self) -> Iterator[str]:
        import datasets

        while self._index < len(self.sources):
            src = self.sources[self._index]
            stream = datasets.load_dataset(
                resolve(src["path"], self.mirror), src.get("name"), split=src.get("split", "train"), streaming=True
            )
            column = src.get("text_column", "text")
            if column not in (stream.column_names or [column]):
                raise ValueError(f"corpus {src['path']} has no column {column!r}; columns: {stream.column_names}")
            if self._stream_state is not None:
                stream.load_state_dict(self._stream_state)
            self._stream, limit = stream, src.get("max_documents")
            rows = iter(stream)
            try:
                while limit is None or self._taken < limit:
                    row = next(rows, None)
                    if row is None:
                        break
                    self._taken += 1
                    yield row[column]
            finally:
                # Close the stream's generator explicitly: an abandoned one aborts the interpreter at exit.
                close = getattr(rows, "close", None)
                if close is not None:
                    close()
            self._index, self._taken, self._stream_state, self._stream = self._index + 1, 0, None, None
