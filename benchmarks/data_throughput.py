"""Throughput of the two data stages the paper corpus waits on longest, today's way and the parallel / sequential
way side by side in one run, on a corpus built from the offline hub mirror's real English text.

* dedup (``cramswarm.data.filters.dedup``): its MinHash pass in 1 process vs ``--workers`` processes; the kept
  documents must be the same;
* order_blocks' gather: the ordered copy of a packed file read as ``order_blocks`` reads it (``blocks[rows]`` per
  chunk of rows, at random positions) vs in increasing row order per chunk (``sorted_gather``, a candidate for
  network filesystems, not adopted: slower on the disks measured so far); the bytes must be the same.

The corpus is the mirror's Wikipedia articles and Gutenberg books cut into paragraphs of about 2 kB, repeated
until ``--mb`` megabytes, every tenth paragraph copied with a changed word (near-duplicates for dedup to find).
The packed file is random token ids of the same token count (4 characters per token) at 128 tokens per block.
Both read and write under ``--work`` (default: a temporary folder). The gathers start with the page cache dropped
where the process may (root on Linux: the packed file is read from the disk, as a 16-28 GB file under a 9.6 GB
job is); elsewhere both run warm, and the result says which.

    python benchmarks/data_throughput.py --mb 1024 --workers 2         # the issue's >= 1 GB corpus
    python benchmarks/data_throughput.py --mb 20 --workers 2           # a quick check that the script runs

It prints MB/s of both variants, their ratio, and the hours projected for the paper corpus: Cramming v1 streams
20 M C4 documents; C4.en has about 156 B tokens over 365 M documents (Raffel et al. 2020), about 1.7 kB per document
at 4 characters per token, so about 34 GB of text (``--paper-gb``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from cramswarm.data import filters, ordering  # noqa: E402
from cramswarm.data.hub import iter_corpus  # noqa: E402
from cramswarm.data.sources import write_corpus  # noqa: E402

MIRROR = Path(__file__).resolve().parents[2] / "shared" / "data" / "hub"
SOURCES = [
    {"path": "wikimedia/wikipedia", "name": "en-2015-sample", "split": "train", "text_column": "text",
     "max_documents": None},
    {"path": "bookcorpus-like/gutenberg", "name": None, "split": "train", "text_column": "text",
     "max_documents": None},
]


def paragraphs(mirror: Path, target_bytes: int, size: int = 2000):
    """Paragraphs of about ``size`` characters of the mirror's text, repeated until ``target_bytes``; every tenth
    one is followed by a near-copy (one word changed)."""
    base = []
    for doc in iter_corpus(SOURCES, mirror):
        for start in range(0, len(doc), size):
            if len(doc) - start > size // 4:
                base.append(doc[start:start + size])
    written, rep = 0, 0
    while written < target_bytes:
        for i, text in enumerate(base):
            text = text if rep == 0 else f"{rep} {text}"  # each repetition of the base is new text
            yield text
            written += len(text)
            if i % 10 == 0:
                words = text.split()
                words[len(words) // 2] = "changed"
                yield " ".join(words)
                written += len(text)
            if written >= target_bytes:
                return
        rep += 1


def drop_page_cache() -> bool:
    """Write dirty pages and drop the page cache (Linux, root): the next read of a file comes from the disk."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def sorted_gather(blocks: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``blocks[rows]`` read in increasing row order (one forward sweep per chunk) and put back in the order asked."""
    order = np.argsort(rows, kind="stable")
    out = np.empty((len(rows), blocks.shape[1]), dtype=blocks.dtype)
    out[order] = blocks[rows[order]]
    return out


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=1024.0, help="megabytes of text in the corpus")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="dedup processes of the parallel run")
    parser.add_argument("--mirror", type=Path, default=MIRROR)
    parser.add_argument("--work", type=Path, help="folder for the corpus and outputs (default: a temporary one)")
    parser.add_argument("--paper-gb", type=float, default=34.0, help="GB of text of the paper corpus (projection)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if not args.mirror.is_dir():
        raise SystemExit(f"no hub mirror at {args.mirror} (the ../shared/data/hub folder beside the repository)")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        work = Path(work)
        corpus = work / "corpus.parquet"
        counts, build_s = timed(lambda: write_corpus(paragraphs(args.mirror, int(args.mb * 1e6)), corpus))
        docs = pq.ParquetFile(corpus).metadata.num_rows
        chars = counts.get("characters") or sum(len(t) for t in pq.read_table(corpus)["text"].to_pylist())
        one, one_s = timed(lambda: filters.dedup(corpus, work / "one.parquet", 0.8))
        many, many_s = timed(lambda: filters.dedup(corpus, work / "many.parquet", 0.8, workers=args.workers))
        same = pq.read_table(work / "one.parquet").equals(pq.read_table(work / "many.parquet"))
        # order_blocks' gather on a packed file of the same token count
        n_blocks = max(1, chars // 4 // 128)
        packed = work / "packed.npy"
        blocks = np.lib.format.open_memmap(packed, mode="w+", dtype=np.uint16, shape=(n_blocks, 128))
        rng = np.random.default_rng(0)
        for s in range(0, n_blocks, 65536):
            blocks[s:s + 65536] = rng.integers(5, 32768, size=(min(65536, n_blocks - s), 128), dtype=np.uint16)
        blocks.flush()
        del blocks
        blocks = np.load(packed, mmap_mode="r")
        final = rng.permutation(n_blocks)
        chunk = ordering._rows_per_chunk(128, 256)

        def write(gather, name):
            target = np.lib.format.open_memmap(work / name, mode="w+", dtype=np.uint16, shape=(n_blocks, 128))
            for s in ordering._chunks(n_blocks, chunk):
                target[s] = gather(blocks, final[s])
            target.flush()

        cold = drop_page_cache()
        _, random_s = timed(lambda: write(lambda b, rows: b[rows], "random.npy"))
        drop_page_cache()
        _, sorted_s = timed(lambda: write(sorted_gather, "sorted.npy"))
        equal = np.array_equal(np.load(work / "random.npy", mmap_mode="r"), np.load(work / "sorted.npy", mmap_mode="r"))
    mb = chars / 1e6
    block_mb = n_blocks * 128 * 2 / 1e6
    result = {
        "corpus_mb": round(mb, 1), "documents": docs, "build_s": round(build_s, 1),
        "dedup_removed": one["documents_removed"], "dedup_same_output": same, "workers": args.workers,
        "dedup_1_mb_s": round(mb / one_s, 2), f"dedup_{args.workers}_mb_s": round(mb / many_s, 2),
        "dedup_speedup": round(one_s / many_s, 2),
        "dedup_paper_hours_1": round(args.paper_gb * 1e3 / (mb / one_s) / 3600, 2),
        f"dedup_paper_hours_{args.workers}": round(args.paper_gb * 1e3 / (mb / many_s) / 3600, 2),
        "packed_mb": round(block_mb, 1), "gather_same_output": bool(equal),
        "gather_random_mb_s": round(block_mb / random_s, 1), "gather_sorted_mb_s": round(block_mb / sorted_s, 1),
        "gather_speedup": round(random_s / sorted_s, 2), "gather_page_cache": "dropped" if cold else "warm",
        "cpu": " ".join(open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].split(":")[1].split()),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if not (same and equal):
        raise SystemExit("the two variants' outputs differ")
    return result


if __name__ == "__main__":
    main()
