"""Bounded-memory reading encoding and writing of corpus files (parquet, one ``text`` column).

Every data stage (corpus, filters, packing) holds at most one *batch* of text at a time, sized from the
configured memory cap (``data.memory_cap_mb``): :func:`batch_chars` turns the cap into a number of text
characters per batch, leaving room for what a batch costs beyond its text (``tokenizers`` encodings and id
lists: 20 bytes per character on the synthetic corpus, up to ~80 on real text with non-ASCII characters;
measured). A single document longer than a batch is cut at whitespace into pieces (every tokenizer family
here splits at whitespace first, so the pieces encode to the same ids as the whole). The process's own
baseline (Python, pyarrow, tokenizers; ~100-150 MiB) comes on top of the cap.

Writers flush a parquet row group every :data:`ROW_GROUP_CHARS` characters, whatever the cap, so a reader
decodes one bounded row group at a time and the file layout (which the local shuffle of
:func:`iter_documents` follows) does not depend on the cap: the cap changes no output byte.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from cramswarm.io import atomic_path

BYTES_PER_TEXT_CHAR = 96  # working-set bytes per character of text in a batch (encodings, ids, strings; with margin)
PIECE_CHARS = 8192  # longest text (characters) handed to the tokenizer at once
ROW_GROUP_CHARS = 1_000_000  # characters of text per parquet row group (a longer document gets one to itself)
MAX_ROW_GROUP_DOCUMENTS = 4096  # documents per row group at most (many short documents)
SCHEMA = pa.schema([("text", pa.string())])


def batch_chars(memory_cap_mb: float) -> int:
    """Characters of text per batch so that a batch's working set stays within ``memory_cap_mb`` MiB."""
    if memory_cap_mb <= 0:
        raise ValueError(f"memory cap must be positive, got {memory_cap_mb} MiB")
    return max(4096, int(memory_cap_mb * 2**20 / BYTES_PER_TEXT_CHAR))


def open_corpus(path: str | Path) -> pq.ParquetFile:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"missing corpus file: {path}")
    try:
        reader = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises several types for a damaged file
        raise ValueError(f"corrupt corpus file {path}: {err}") from None
    if "text" not in reader.schema_arrow.names:
        raise ValueError(f"corpus file {path} has no 'text' column (columns: {reader.schema_arrow.names})")
    return reader


def iter_documents(path: str | Path, shuffle_seed: int | None = None) -> Iterator[str]:
    """The corpus's documents, one row group in memory at a time.

    With ``shuffle_seed`` the order is shuffled in bounded memory: row groups in a seeded random order,
    documents within each row group permuted (a local shuffle; the block order stage shuffles globally).
    """
    reader = open_corpus(path)
    rng = np.random.default_rng(shuffle_seed) if shuffle_seed is not None else None
    groups = range(reader.num_row_groups)
    for group in rng.permutation(reader.num_row_groups) if rng is not None else groups:
        texts = reader.read_row_group(int(group), columns=["text"]).column(0).to_pylist()
        for i in rng.permutation(len(texts)) if rng is not None else range(len(texts)):
            yield texts[i]
        del texts


def split_long(text: str, max_chars: int) -> list[str]:
    """Cut ``text`` at whitespace into pieces of at most about ``max_chars`` characters (a word longer than
    that stays whole). Joined back with the cut whitespace kept, the pieces are the text."""
    if len(text) <= max_chars:
        return [text]
    pieces, start = [], 0
    while len(text) - start > max_chars:
        cut = text.rfind(" ", start + 1, start + max_chars)
        if cut <= start:
            cut = text.find(" ", start + max_chars)
            if cut < 0:
                break
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def encode_documents(tok, documents: Iterable[str], max_chars: int) -> Iterator[tuple[str, np.ndarray]]:
    """``(document, token ids)`` for each document, in order, encoded without special tokens in batches of at
    most ``max_chars`` characters. Every document is encoded in whitespace-cut pieces of at most
    :data:`PIECE_CHARS` characters: the tokenizer's transient state per character grows with the length of
    the text it normalizes at once (book-length documents cost hundreds of bytes per character whole)."""
    piece_chars = min(max_chars, PIECE_CHARS)
    docs: list[str] = []
    pieces: list[str] = []
    owners: list[int] = []
    size = 0

    def encode(texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int32) for e in tok.encode_batch_fast(texts, add_special_tokens=False)]

    def flush() -> list[tuple[str, np.ndarray]]:
        parts: list[list[np.ndarray]] = [[] for _ in docs]
        for owner, ids in zip(owners, encode(pieces)):
            parts[owner].append(ids)
        return [(doc, ids[0] if len(ids) == 1 else np.concatenate(ids)) for doc, ids in zip(docs, parts)]

    for doc in documents:
        if docs and size + len(doc) > max_chars:
            yield from flush()
            docs, pieces, owners, size = [], [], [], 0
        if len(doc) > max_chars:  # alone: its pieces in groups of at most max_chars characters
            arrays: list[np.ndarray] = []
            group: list[str] = []
            for part in split_long(doc, piece_chars):
                if group and sum(map(len, group)) + len(part) > max_chars:
                    arrays += encode(group)
                    group = []
                group.append(part)
            yield doc, np.concatenate(arrays + encode(group))
            continue
        for part in split_long(doc, piece_chars):
            pieces.append(part)
            owners.append(len(docs))
        docs.append(doc)
        size += len(doc)
    if docs:
        yield from flush()


class CorpusWriter:
    """Append documents to a parquet corpus, flushing a row group every ``max_chars`` characters of text
    (or :data:`MAX_ROW_GROUP_DOCUMENTS` documents). Written to a temporary file, renamed on success."""

    def __init__(self, out: str | Path, max_chars: int = ROW_GROUP_CHARS):
        self.out, self.max_chars = Path(out), max_chars
        self.documents = self.characters = self.row_groups = 0
        self._chunk: list[str] = []
        self._size = 0

    def __enter__(self):
        self._atomic = atomic_path(self.out)
        self._writer = pq.ParquetWriter(self._atomic.__enter__(), SCHEMA)
        return self

    def write(self, doc: str) -> None:
        self._chunk.append(doc)
        self._size += len(doc)
        self.documents += 1
        self.characters += len(doc)
        if self._size >= self.max_chars or len(self._chunk) >= MAX_ROW_GROUP_DOCUMENTS:
            self._flush()

    def _flush(self) -> None:
        if self._chunk:
            self._writer.write_table(pa.table({"text": self._chunk}, schema=SCHEMA))
            self._chunk, self._size = [], 0
            self.row_groups += 1

    @property
    def between_row_groups(self) -> bool:
        """Whether every document written so far is in a flushed row group (none waiting for the next)."""
        return not self._chunk

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                self._flush()
            self._writer.close()
        except BaseException as err:  # a failed flush or close: no file appears
            self._atomic.__exit__(type(err), err, err.__traceback__)
            raise
        return self._atomic.__exit__(exc_type, exc, tb)  # an error in the with block: no file appears either
