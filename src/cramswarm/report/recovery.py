"""The recovery windows of a rebalancing run: what the SWARM findings block, the claims check and the figure's
table all average."""

from __future__ import annotations

import pandas as pd


def late_windows(data: pd.DataFrame) -> tuple[float, pd.DataFrame]:
    """A ``rebalancing_recovery`` table's kill time and its windows in the last half of the run after the kill
    (what the findings block, the claims check and the figure's table all average: the swarm has had time to
    recover)."""
    kill_at = float(data["kill_at_s"].iloc[0])
    end = float((data["t_s"] + data["window_s"]).max())
    return kill_at, data[data["t_s"] >= kill_at + (end - kill_at) / 2].copy()
