"""Pack a tokenized corpus into fixed-length blocks (the paper's 128-token sequences).

Each document is encoded without special tokens and ends in ``[SEP]``; documents are concatenated and cut
into ``block_tokens`` blocks, so fragments of neighbouring documents share a block, separated only by
``[SEP]`` (Cramming §3.2). The tail that does not fill a block is dropped (counted in the report). The
corpus is encoded once; texts and token ids are held in memory (ids as 2- or 4-byte integers, less than
the text itself), which suits corpora of a few GB of text, not paper-scale C4.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from cramswarm.io import atomic_path
from cramswarm.tokenizer import SEP_ID


def dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.int32)


def shuffled_order(n_documents: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(n_documents)


def pack(corpus: str | Path, tok, out: str | Path, block_tokens: int, shuffle_seed: int) -> dict:
    """Write blocks to ``out`` (.npy, shape (blocks, block_tokens)); return counts for the stage report."""
    texts = pq.read_table(corpus, columns=["text"]).column("text").to_pylist()
    order = shuffled_order(len(texts), shuffle_seed)
    dtype = dtype_for(tok.get_vocab_size())

    pieces = []
    for start in range(0, len(order), 1024):
        docs = [texts[i] for i in order[start : start + 1024]]
        for enc in tok.encode_batch(docs, add_special_tokens=False):
            pieces.append(np.asarray(enc.ids + [SEP_ID], dtype=dtype))  # each document ends in [SEP]
    stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)
    total = len(stream)
    n_blocks = total // block_tokens
    if n_blocks == 0:
        raise ValueError(f"corpus {corpus} has {total} tokens, fewer than one block of {block_tokens}")
    with atomic_path(out) as tmp:
        np.save(tmp, stream[: n_blocks * block_tokens].reshape(n_blocks, block_tokens))
    return {
        "documents": len(order),
        "tokens": total,
        "blocks": n_blocks,
        "block_tokens": block_tokens,
        "tokens_dropped_in_tail": total - n_blocks * block_tokens,
        "dtype": str(dtype),
    }


def load_blocks(path: str | Path) -> np.ndarray:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"missing packed data file: {path}")
    try:
        return np.load(path, mmap_mode="r")
    except ValueError as err:
        raise ValueError(f"corrupt packed data file {path}: {err}") from None
