"""The swarm_study tables: a summary table per experiment as CSV (full precision) and Markdown (labelled headers,
3 significant digits), what :mod:`cramswarm.report.swarm_figures` writes beside each figure."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pandas as pd

from cramswarm.report.tables import write_table

TABLE_LABELS: dict[str, str] = {
    "transport": "Transport",
    "routing": "Routing",
    "failures": "Failures",
    "hidden_size": "Hidden size",
    "scheme": "Scheme",
    "bandwidth_mbit_s": "Bandwidth (Mbit/s)",
    "compute_s": "Compute fwd+bwd (s)",
    "comm_s": "Comm. fwd+bwd (s)",
    "activation_payload_bytes": "Payload (bytes)",
    "compute_to_comm": "Compute / comm.",
    "throughput_mb_s": "Throughput (microbatches/s)",
    "optimum_mb_s": "Optimum (microbatches/s)",
    "percent_of_optimum": "% of optimum",
    "percent_of_failure_free": "% of failure-free",
    "retries": "Retries",
    "lost_microbatches": "Lost microbatches",
    "rebalance_period_s": "Rebalance period (s)",
    "before_mb_s": "Before kill, after fill (microbatches/s)",
    "after_mb_s": "Last half, after kill (microbatches/s)",
    "moves": "Moves",
    "first_move_s": "First move (s)",
    "config": "Boundary",
    "final_loss": "Final loss (nats/token)",
    "delta_vs_none": "Δ vs none (nats)",
    "peers": "Peers",
    "static_percent": "Initial assignment % of optimum",
    "preemptions": "Preemptions",
    "preemption_model": "Preemption model",
    "joins": "Joins",
    "run": "Run",
    "speeds": "Peer speeds",
    "trainers": "Trainers",
    "trainers_per_peer": "Trainers per peer",
    "nic_mbit_s": "NIC (Mbit/s)",
    "latency_ms": "Latency (ms)",
    "events": "Events",
    "sim_wall_s": "Sim wall time (s)",
}


def _format(value) -> str:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        return str(value)
    if isinstance(value, (int, np.integer)):
        return f"{int(value):,}"
    if np.isnan(value):
        return "NaN"
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"


def _label(name: str) -> str:
    """The Markdown header of a column: :data:`TABLE_LABELS`, or for the square-cube pivot's
    ``util_<bandwidth>mbit_<latency>ms_<scheme>`` columns, what the share is."""
    if match := re.fullmatch(r"util_(.+)mbit_(.+)ms_(\w+)", name):
        return f"% computing at {match[1]} Mbit/s, {match[2]} ms, {match[3]}"
    return TABLE_LABELS.get(name, name)


def to_markdown(df: pd.DataFrame) -> str:
    """Markdown with :data:`TABLE_LABELS` headers, 3 significant digits (whole numbers from 1000 on), integers
    with thousands separators, missing numbers as ``NaN``."""
    cells = pd.DataFrame({_label(name): column.map(_format) for name, column in df.items()})
    align = ["right" if pd.api.types.is_numeric_dtype(column) else "left" for _, column in df.items()]
    return cells.to_markdown(index=False, disable_numparse=True, colalign=align) + "\n"


def write_swarm_table(df: pd.DataFrame, stem: str | os.PathLike) -> tuple[Path, ...]:
    """``<stem>.csv`` (full precision) and ``<stem>.md`` (see :func:`to_markdown`), atomically."""
    return write_table(df, stem, markdown=to_markdown)
