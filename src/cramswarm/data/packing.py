"""Pack a tokenized corpus into fixed-length blocks (the paper's 128-token sequences), in bounded memory.

Each document is encoded without special tokens and ends in ``[SEP]``; documents are concatenated and cut
into ``block_tokens`` blocks, so fragments of neighbouring documents share a block, separated only by
``[SEP]`` (Cramming §3.2). The tail that does not fill a block is dropped (counted in the report).

The corpus is streamed (:mod:`cramswarm.data.stream`: one row group and one encoding batch in memory, sized
from the memory cap) and blocks are appended to a ``.npy`` file whose header is written last, so the result
is an ordinary ``np.load(..., mmap_mode="r")``-able array however large. Documents are shuffled locally
(:func:`cramswarm.data.stream.iter_documents`); the order stage (:mod:`cramswarm.data.ordering`) then sets the
global block order. Deterministic: the same corpus, tokenizer and seed give the same bytes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from cramswarm.data.stream import batch_chars, encode_documents, iter_documents, open_corpus
from cramswarm.data.tokenizer import SEP_ID
from cramswarm.io import atomic_path

HEADER_BYTES = 128  # fixed .npy (v1.0) header size: the shape is filled in once the block count is known


def dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.int32)


def npy_header(shape: tuple[int, ...], dtype: np.dtype) -> bytes:
    """A .npy v1.0 header of exactly :data:`HEADER_BYTES` bytes (padded with spaces, as numpy pads)."""
    text = repr({"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": shape})
    body_len = HEADER_BYTES - 10
    if len(text) + 1 > body_len:
        raise ValueError(f"shape {shape} does not fit a {HEADER_BYTES}-byte .npy header")
    return b"\x93NUMPY\x01\x00" + body_len.to_bytes(2, "little") + (text.ljust(body_len - 1) + "\n").encode("latin1")


class BlockWriter:
    """Append token ids to a ``(blocks, block_tokens)`` .npy file; only whole blocks are written."""

    def __init__(self, file, block_tokens: int, dtype: np.dtype):
        self.file, self.block_tokens, self.dtype = file, block_tokens, np.dtype(dtype)
        self.blocks = 0
        self._carry = np.zeros(0, dtype=self.dtype)
        file.write(npy_header((0, block_tokens), self.dtype))

    def append(self, ids: np.ndarray) -> None:
        stream = np.concatenate([self._carry, ids.astype(self.dtype, copy=False)])
        whole = len(stream) // self.block_tokens * self.block_tokens
        self.file.write(stream[:whole].tobytes())
        self.blocks += whole // self.block_tokens
        self._carry = stream[whole:].copy()

    def finish(self) -> int:
        """Write the final header; return the number of tail tokens left out (fewer than one block)."""
        self.file.seek(0)
        self.file.write(npy_header((self.blocks, self.block_tokens), self.dtype))
        return len(self._carry)


def pack(corpus: str | Path, tok, out: str | Path, block_tokens: int, shuffle_seed: int, memory_cap_mb: float = 256,
         progress: bool = False) -> dict:
    """Write blocks to ``out`` (.npy, shape (blocks, block_tokens)); return counts for the stage report.
    ``progress`` draws a tqdm bar over documents packed."""
    dtype = dtype_for(tok.get_vocab_size())
    max_chars = batch_chars(memory_cap_mb)
    documents = tokens = characters = short = empty = 0
    sep = np.array([SEP_ID], dtype=np.int32)
    with atomic_path(out) as tmp, open(tmp, "wb") as file:
        writer = BlockWriter(file, block_tokens, dtype)
        pending: list[np.ndarray] = []
        pending_tokens = 0
        bar = tqdm(total=open_corpus(corpus).metadata.num_rows, unit="doc", desc=f"packing {Path(corpus).name}",
                   disable=not progress, mininterval=2.0)
        for doc, ids in encode_documents(tok, iter_documents(corpus, shuffle_seed), max_chars):
            bar.update()
            documents += 1
            characters += len(doc)
            empty += len(ids) == 0
            short += len(ids) + 1 < block_tokens
            pending += [ids, sep]  # each document ends in [SEP]
            pending_tokens += len(ids) + 1
            if pending_tokens >= max_chars // 4:  # ids cost ~4 bytes each; flush well inside the cap
                writer.append(np.concatenate(pending))
                tokens += pending_tokens
                pending, pending_tokens = [], 0
        if pending:
            writer.append(np.concatenate(pending))
            tokens += pending_tokens
        if documents == 0:
            raise ValueError(f"corpus {corpus} has no documents")
        bar.close()
        tail = writer.finish()
        if writer.blocks == 0:
            raise ValueError(f"corpus {corpus} has {tokens} tokens, fewer than one block of {block_tokens}")
    warnings = []
    if empty:
        warnings.append(f"{empty} documents encode to no tokens (only [SEP] packed for them)")
    return {
        "documents": documents,
        "characters": characters,
        "tokens": tokens,
        "blocks": writer.blocks,
        "block_tokens": block_tokens,
        "tokens_dropped_in_tail": tail,
        "documents_shorter_than_block": short,  # packed with their neighbours, not dropped
        "documents_without_tokens": empty,
        "dtype": str(dtype),
        "warnings": warnings,
    }


def load_blocks(path: str | Path) -> np.ndarray:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"missing packed data file: {path}")
    try:
        return np.load(path, mmap_mode="r")
    except ValueError as err:
        raise ValueError(f"corrupt packed data file {path}: {err}") from None

