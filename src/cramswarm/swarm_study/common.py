"""What every swarm_study experiment shares: its intra-op thread count and its CSV writer."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import torch

from cramswarm.io import atomic_path


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run with ``threads`` intra-op threads (None: leave as is), restoring the previous count afterwards.

    Tiny models on a shared machine run far faster on one thread: with two, every small kernel pays for
    synchronising threads that other processes keep descheduling (measured 10 ms vs 570 ms per step on a busy
    2-core box).
    """
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def write_csv(frame: pd.DataFrame, out_csv: str | os.PathLike) -> Path:
    """Write an experiment's CSV atomically (NaN as ``NaN``); returns its path."""
    with atomic_path(out_csv) as tmp:
        frame.to_csv(tmp, index=False, na_rep="NaN")
    return Path(out_csv)
