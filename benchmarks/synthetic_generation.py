"""Speed of the synthetic stand-in's generator: corpus documents and GLUE rows per second (what the default
study's data stages cost). Prints one line per measurement, the best of ``--repeats``.

    python benchmarks/synthetic_generation.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from cramswarm.data import synthetic as syn  # noqa: E402
from cramswarm.glue_tasks import TASKS  # noqa: E402


def best_rate(make, count: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        made = make()
        best = min(best, time.perf_counter() - start)
        assert made == count, (made, count)
    return count / best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=5000, help="corpus documents per timed run")
    parser.add_argument("--rows", type=int, default=2000, help="rows per GLUE split per timed run")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    rate = best_rate(lambda: sum(1 for _ in syn.corpus_documents(args.documents, 3)), args.documents, args.repeats)
    print(f"corpus: {rate:,.0f} documents/s")
    for task, spec in TASKS.items():
        for split in ("train", *spec.eval_splits):
            rate = best_rate(lambda t=task, s=split: len(syn.glue_split(t, s, args.rows, 3)), args.rows, args.repeats)
            print(f"{task} {split}: {rate:,.0f} rows/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
