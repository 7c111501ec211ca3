"""Raw-text filters of Cramming §3.2, each a corpus -> corpus stage with a report of what it removed.

* :func:`trash_filter` — the paper's "trash" filter: keep a document only if
  ``#tokens < cutoff x #characters``. Tokens are counted with **the corpus's own tokenizer**: the study's
  tokenizer family trained on the *unfiltered* corpus at ``tokenizer.main_vocab_size`` (the public code used a
  downloaded ``albert-base-v2`` tokenizer instead; we never download one). The ratio depends on the vocab
  size, so the cutoff is calibrated per scale; the report gives the ratio's quantiles in and out.
* :func:`dedup` — near-duplicate removal with MinHash LSH (``datasketch`` MinHash and banding): a document that
  shares an LSH band with an earlier document (shingle sets of estimated Jaccard similarity about
  ``threshold`` or more) is dropped; the first copy stays. The paper used exact-substring dedup (Lee et al. 2022)
  through a Rust suffix-array tool; docs/data.md says why we use MinHash.

Both stream the corpus (one row group and one encoding batch in memory; dedup also keeps a few bytes per
document) and write through :class:`~cramswarm.data.stream.CorpusWriter`. A filter that removes every
document is an error.
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import numpy as np

from cramswarm.data.stream import CorpusWriter, batch_chars, encode_documents, iter_documents

RATIO_BINS = np.linspace(0.0, 4.0, 801)  # tokens-per-character histogram bins (0.005 wide; above 4 lands in the last)
SHINGLE_BATCH = 50_000  # shingles hashed at once (bounds memory on book-length documents)


def _quantiles(hist: np.ndarray, lowest: float, highest: float) -> dict[str, float] | None:
    """Exact min/max and (to the 0.005 bin) the 1 %, 50 % and 99 % quantiles of a ratio histogram."""
    total = hist.sum()
    if total == 0:
        return None
    cdf = np.cumsum(hist) / total
    centres = (RATIO_BINS[:-1] + RATIO_BINS[1:]) / 2
    out = {"min": round(lowest, 4)}
    out |= {f"q{int(q * 100):02d}": round(float(centres[np.searchsorted(cdf, q)]), 3) for q in (0.01, 0.5, 0.99)}
    return out | {"max": round(highest, 4)}


def _nothing_left(name: str, n_in: int, detail: str) -> ValueError:
    return ValueError(f"the {name} removed all {n_in} documents ({detail}); loosen the filter or switch it off")


def _counts(n_in: int, chars_in: int, writer) -> dict:
    """What a filter read and kept: documents and characters, in, out and the share removed."""
    return {
        "documents_in": n_in,
        "documents_out": writer.documents,
        "documents_removed": n_in - writer.documents,
        "documents_removed_share": (n_in - writer.documents) / n_in,
        "characters_in": chars_in,
        "characters_out": writer.characters,
        "characters_removed_share": (chars_in - writer.characters) / max(chars_in, 1),
    }


def trash_filter(corpus: str | Path, tok, out: str | Path, cutoff: float, memory_cap_mb: float = 256) -> dict:
    """Keep documents with fewer than ``cutoff`` tokens per character; return the stage report."""
    if cutoff <= 0:
        raise ValueError(f"trash cutoff must be positive, got {cutoff}")
    max_chars = batch_chars(memory_cap_mb)
    kept_hist = np.zeros(len(RATIO_BINS) - 1, dtype=np.int64)
    removed_hist = np.zeros_like(kept_hist)
    n_in = chars_in = tokens_in = 0
    extremes = {True: [np.inf, -np.inf], False: [np.inf, -np.inf]}  # kept?: [lowest, highest] ratio
    with CorpusWriter(out) as writer:
        for doc, ids in encode_documents(tok, iter_documents(corpus), max_chars):
            n_in += 1
            chars_in += len(doc)
            tokens_in += len(ids)
            ratio = len(ids) / max(len(doc), 1)
            keep = len(ids) < cutoff * len(doc)
            extremes[keep] = [min(extremes[keep][0], ratio), max(extremes[keep][1], ratio)]
            (kept_hist if keep else removed_hist)[
                min(np.searchsorted(RATIO_BINS, ratio, "right") - 1, len(kept_hist) - 1)
            ] += 1
            if keep:
                writer.write(doc)
        if n_in == 0:
            raise ValueError(f"corpus {corpus} has no documents")
        if writer.documents == 0:
            lowest = extremes[False][0]
            raise _nothing_left(
                "trash filter", n_in, f"cutoff {cutoff} tokens/character; the lowest ratio is {lowest:.3f}"
            )
    return {
        "filter": "trash",
        "cutoff_tokens_per_char": cutoff,
        "tokenizer_vocab_size": tok.get_vocab_size(),
        **_counts(n_in, chars_in, writer),
        "tokens_in": tokens_in,
        "tokens_per_char_kept": _quantiles(kept_hist, *extremes[True]),
        "tokens_per_char_removed": _quantiles(removed_hist, *extremes[False]),
        "warnings": [],
    }


def _shingles(words: list[str], k: int, start: int, stop: int) -> list[bytes]:
    return [" ".join(words[j : j + k]).encode("utf-8") for j in range(start, stop)]


def _band_rows(documents: list[str], shingle_words: int, num_perm: int, seed: int, bands: int, rows: int) -> bytes:
    """The band hashes of a batch of documents, row after row (8 bytes per band and document): pass 1 of
    :func:`dedup`, run in a worker process when it has several. Deterministic: any split into batches writes the
    same bytes."""
    from datasketch import MinHash

    template = MinHash(num_perm=num_perm, seed=seed)
    out = []
    for doc in documents:
        words = doc.lower().split()
        n_shingles = max(1, len(words) - shingle_words + 1)
        sketch = MinHash(num_perm=num_perm, seed=seed, permutations=template.permutations, scheme=template.scheme)
        for start in range(0, n_shingles, SHINGLE_BATCH):
            sketch.update_batch(_shingles(words, shingle_words, start, min(start + SHINGLE_BATCH, n_shingles)))
        out.append(_band_hashes(sketch, bands, rows).tobytes())
    return b"".join(out)


def _batches(documents, chars: int):
    """Lists of documents of about ``chars`` characters each (at least one document)."""
    batch, size = [], 0
    for doc in documents:
        batch.append(doc)
        size += len(doc)
        if size >= chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _in_order(fn, batches, workers: int):
    """``fn(batch)`` of every batch, in order; with ``workers`` > 1 in that many processes, at most two batches
    per worker in flight (so memory stays bounded on a corpus of any size)."""
    if workers <= 1:
        yield from map(fn, batches)
        return
    from collections import deque
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers) as pool:
        pending = deque()
        for batch in batches:
            pending.append(pool.submit(fn, batch))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _band_hashes(sketch, bands: int, rows: int) -> np.ndarray:
    """One 64-bit hash per LSH band of a MinHash signature (``rows`` hash values per band)."""
    values = np.ascontiguousarray(sketch.hashvalues[: bands * rows], dtype=np.uint64).reshape(bands, rows)
    return np.array(
        [int.from_bytes(hashlib.blake2b(v.tobytes(), digest_size=8).digest(), "little") for v in values],
        dtype=np.uint64,
    )


def dedup(
    corpus: str | Path, out: str | Path, threshold: float, shingle_words: int = 5, num_perm: int = 128, seed: int = 1,
    workers: int = 1, memory_cap_mb: float = 256,
) -> dict:
    """Drop near-duplicate documents (MinHash LSH over word ``shingle_words``-grams); return the stage report.

    Documents are compared after lowercasing and whitespace splitting; a document shorter than one shingle is
    one shingle. ``datasketch`` computes each document's MinHash and picks the LSH banding (bands x rows) for
    ``threshold``. A document is a duplicate when, in some band, its band hash equals that of an earlier
    document; the first of each group stays. Pass 1 writes 8 bytes per band and document to a temporary file
    next to ``out``; pass 2 sorts one band column at a time (about 25 bytes per document in memory, instead of
    the ~3 KB per document of an in-memory ``MinHashLSH`` index) and writes the kept documents. Pass 1 runs in
    ``workers`` processes (batches of documents within ``memory_cap_mb``, two per worker in flight); the result is
    the same for any number.
    """
    from functools import partial

    from datasketch import MinHashLSH

    if not 0 < threshold <= 1:
        raise ValueError(f"dedup threshold must be in (0, 1], got {threshold}")
    banding = MinHashLSH(threshold=threshold, num_perm=num_perm)  # only for its optimal (bands, rows)
    bands, rows = banding.b, banding.r
    out = Path(out)
    n_in = chars_in = 0
    out.parent.mkdir(parents=True, exist_ok=True)

    def documents():
        nonlocal n_in, chars_in
        for doc in iter_documents(corpus):
            n_in += 1
            chars_in += len(doc)
            yield doc

    hashes = partial(_band_rows, shingle_words=shingle_words, num_perm=num_perm, seed=seed, bands=bands, rows=rows)
    # batches of up to 1 M characters, fewer where the cap asks (two per worker in flight, ~4 bytes per character)
    chars = max(1, min(2**20, int(memory_cap_mb * 2**20 / max(workers, 1) / 8)))
    with tempfile.NamedTemporaryFile(prefix=f".{out.name}.", suffix=".bands", dir=out.parent) as f:  # deleted on close
        for block in _in_order(hashes, _batches(documents(), chars), workers):
            f.write(block)
        f.flush()
        if n_in == 0:
            raise ValueError(f"corpus {corpus} has no documents")
        table = np.memmap(f.name, dtype=np.uint64, mode="r", shape=(n_in, bands))
        duplicate = np.zeros(n_in, dtype=bool)
        for band in range(bands):
            column = np.array(table[:, band])
            order = np.argsort(column, kind="stable")  # equal hashes in document order: the first one stays
            ordered = column[order]
            duplicate[order[1:][ordered[1:] == ordered[:-1]]] = True
        del table
    with CorpusWriter(out) as writer:
        for keep, doc in zip(~duplicate, iter_documents(corpus)):
            if keep:
                writer.write(doc)
    return {
        "filter": "dedup",
        "method": "MinHash LSH (datasketch MinHash; band hashes sorted per band)",
        "jaccard_threshold": threshold,
        "shingle_words": shingle_words,
        "num_perm": num_perm,
        "lsh_bands": bands,
        "lsh_rows": rows,
        **_counts(n_in, chars_in, writer),
        "warnings": [],
    }
