"""Order packed blocks: the curriculum (Cramming §3.2, step 6). Pretraining reads blocks sequentially, so
the order written here *is* the order the model sees them.

* ``random``: a seeded permutation;
* ``sentence-length``: by the count of the ``.`` token per block, **descending** (blocks dense in short
  sentences first), as the public code's ``sentence-length-curriculum``;
* ``unigram``: by the block's mean log2 unigram probability (add-1 smoothed counts over the training blocks),
  **ascending** (least likely blocks first), as ``unigram-curriculum``;
* ``unigram-reverse``: the same, descending (most likely first), as ``reverse-unigram-curriculum``.

Ties keep the packed order (stable sorts). Held-out blocks: the last ``holdout_blocks`` rows of every
output are one seeded random sample of the packed blocks, in packed order, the same for every order of the
same packed file, so the held-out MLM loss (pretraining holds out the last ``pretrain.eval_blocks``) is
measured on the same unbiased blocks whatever the curriculum. Bounded memory: blocks are read in chunks;
the index arrays cost 8-16 bytes per block.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cramswarm.data.packing import load_blocks
from cramswarm.data.stream import BYTES_PER_TEXT_CHAR, batch_chars
from cramswarm.io import atomic_path

ORDERS = ("random", "sentence-length", "unigram", "unigram-reverse")


def _chunks(n: int, rows: int):
    for start in range(0, n, rows):
        yield slice(start, min(start + rows, n))


def _rows_per_chunk(block_tokens: int, memory_cap_mb: float) -> int:
    # a chunk of int64 ids plus temporaries; batch_chars already leaves BYTES_PER_TEXT_CHAR-fold room
    return max(1, batch_chars(memory_cap_mb) * BYTES_PER_TEXT_CHAR // (block_tokens * 8 * 8))


def block_keys(blocks: np.ndarray, rows: np.ndarray, order: str, tok, chunk: int) -> tuple[np.ndarray, dict]:
    """Sort keys (ascending = earlier) of ``blocks[rows]`` for a curriculum order, and facts for the report."""
    if order == "sentence-length":
        dot = tok.token_to_id(".")
        if dot is None:
            raise ValueError("sentence-length order: the tokenizer has no '.' token")
        counts = np.concatenate([(blocks[rows[s]] == dot).sum(axis=1) for s in _chunks(len(rows), chunk)])
        return -counts.astype(np.float64), {"dot_token_id": dot}
    if order in ("unigram", "unigram-reverse"):
        vocab = tok.get_vocab_size()
        counts = np.zeros(vocab, dtype=np.int64)
        for s in _chunks(len(rows), chunk):
            counts += np.bincount(np.asarray(blocks[rows[s]]).ravel(), minlength=vocab)[:vocab]
        log2p = np.log2((counts + 1) / (counts.sum() + vocab))  # add-1 smoothing, as the public code
        scores = np.concatenate([log2p[blocks[rows[s]]].mean(axis=1) for s in _chunks(len(rows), chunk)])
        return (scores if order == "unigram" else -scores), {}
    raise ValueError(f"unknown block order {order!r}; allowed: {', '.join(ORDERS)}")


def order_blocks(packed: str | Path, tok, out: str | Path, order: str, seed: int, holdout_blocks: int,
                 memory_cap_mb: float = 256, max_training_blocks: int | None = None) -> dict:
    """Write ``packed``'s blocks in ``order`` to ``out`` (.npy), the held-out sample last; return the report.

    ``max_training_blocks`` keeps only the first that many training blocks of the order (the reference keeps the
    first 85e6 sorted sequences, about one A6000-day of training), so a run never restarts its curriculum.
    """
    if order not in ORDERS:
        raise ValueError(f"unknown block order {order!r}; allowed: {', '.join(ORDERS)}")
    blocks = load_blocks(packed)
    n, block_tokens = blocks.shape
    if holdout_blocks >= n:
        raise ValueError(f"holding out {holdout_blocks} of {n} packed blocks leaves none to train on "
                         "(lower pretrain.eval_blocks or use a larger corpus)")
    chunk = _rows_per_chunk(block_tokens, memory_cap_mb)
    perm = np.random.default_rng(seed).permutation(n)
    held = np.sort(perm[:holdout_blocks])
    facts: dict = {}
    if order == "random":
        train = perm[holdout_blocks:]
        keys = None
    else:
        rows = np.sort(perm[holdout_blocks:])
        keys, facts = block_keys(blocks, rows, order, tok, chunk)
        sorter = np.argsort(keys, kind="stable")
        train, keys = rows[sorter], keys[sorter]
    before_cap = len(train)
    if max_training_blocks is not None and len(train) > max_training_blocks:
        train = train[:max_training_blocks]
        keys = keys[:max_training_blocks] if keys is not None else None
    final = np.concatenate([train, held])
    n = len(final)
    with atomic_path(out) as tmp:
        target = np.lib.format.open_memmap(tmp, mode="w+", dtype=blocks.dtype, shape=(n, block_tokens))
        for s in _chunks(n, chunk):
            target[s] = blocks[final[s]]
        target.flush()
        del target
    report = {"order": order, "seed": seed, "blocks": int(n), "block_tokens": int(block_tokens),
              "training_blocks": int(len(train)), "held_out_blocks": int(holdout_blocks),
              "max_training_blocks": max_training_blocks, "dropped_by_cap": int(before_cap - len(train)), **facts}
    if keys is not None and len(keys):  # the curriculum's ends, in the key's own units (sign as sorted)
        tenth = max(1, len(keys) // 10)
        report["key_mean_first_tenth"] = round(float(keys[:tenth].mean()), 4)
        report["key_mean_last_tenth"] = round(float(keys[-tenth:].mean()), 4)
        report["key"] = "-(count of '.')" if order == "sentence-length" else (
            "mean log2 unigram probability" if order == "unigram" else "-(mean log2 unigram probability)")
    return report
