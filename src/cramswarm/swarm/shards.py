"""Stage shards: a stage's state on disk, for checkpoints and resumes.

A shard holds a stage's parameters, optimizer state, step, stepped samples (what the LR schedule and the batch
ramp are computed from), the indices of the microbatches it stepped and the run's id. It is written atomically as
``stage<S>.step<N>.<uid>.pt`` in the run's shard folder, and older steps' files of the stage are removed after.
"""
from __future__ import annotations

from pathlib import Path

import torch

from cramswarm.io import atomic_path

SHARD_GLOB = "stage{stage}.step*.pt"


class ForeignShard(ValueError):
    """A shard written by another run."""


def shard_files(shard_dir: Path, stage: int) -> list[tuple[int, str, Path]]:
    """(step, uid, path) of the stage's shard files, newest first (highest step, then lowest uid)."""
    found = []
    for path in Path(shard_dir).glob(SHARD_GLOB.format(stage=stage)):
        parts = path.name[:-len(".pt")].split(".", 2)  # stage<S> . step<N> . <uid> (which may hold dots)
        if len(parts) == 3 and parts[1].startswith("step") and parts[1][4:].isdigit():
            found.append((int(parts[1][4:]), parts[2], path))
    return sorted(found, key=lambda f: (-f[0], f[1]))


def newest_shard(shard_dir: Path, stage: int) -> tuple[int, Path] | None:
    """(step, path) of the stage's newest shard, or None."""
    found = shard_files(shard_dir, stage)
    return (found[0][0], found[0][2]) if found else None


def write_shard(shard_dir: Path, stage: int, uid: str, step: int, blob: bytes | dict) -> Path:
    """Write one stage shard atomically, then remove the stage's shards of older steps. ``blob``: the serialised
    state, or the state itself, which ``torch.save`` streams to the file (no serialised copy held in memory)."""
    path = Path(shard_dir) / f"stage{stage}.step{step:08d}.{uid}.pt"
    with atomic_path(path) as tmp:
        if isinstance(blob, dict):
            torch.save(blob, tmp)
        else:
            tmp.write_bytes(blob)
    for old_step, _, old in shard_files(shard_dir, stage):
        if old_step < step:
            old.unlink(missing_ok=True)
    return path


def load_shard(path: Path, run_ids: tuple[str, ...] | None = None, map_location="cpu") -> dict:
    """A shard's contents (on ``map_location``): module and optimizer state dicts, step, stepped_samples,
    stepped_mbs, stepped_repeats, run_id. With ``run_ids``, a shard of another run is refused (``ForeignShard``,
    naming both)."""
    state = torch.load(path, weights_only=True, map_location=map_location)
    if run_ids is not None and state.get("run_id") not in run_ids:
        raise ForeignShard(f"shard {path} belongs to run {state.get('run_id')!r}, not to this run "
                           f"({' or '.join(run_ids)}): refused")
    return state
