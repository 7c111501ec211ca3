"""What a pretraining run carries from one optimizer step to the next and saves to resume: its counters and log
(:class:`TrainState`), the resumable state file (:func:`fingerprint`, :func:`save_state`, :func:`load_state`) and the
in-memory copy of the last good weights a non-finite loss reloads (:func:`clone_state`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path

import torch

from cramswarm.io import atomic_path

LOG_COLUMNS = ("step", "tokens", "progress", "loss", "lr", "lr_multiplier", "batch_sequences", "elapsed_s", "eval_loss")


@dataclasses.dataclass
class TrainState:
    """The counters of a pretraining run and its ``train_log.csv`` so far: all a resumed run needs besides the
    weights, optimizer, scaler and mask generator. ``progress`` in the log is the budget fraction at the start of a
    step, where its LR and batch size were set; ``window_*`` accumulate the steps' losses between log rows."""

    step: int = 0
    tokens: int = 0
    sequences: int = 0
    cursor: int = 0  # the next micro-batch's first training block
    epochs_of_data: float = 0.0
    window_loss: float = 0.0
    window_n: int = 0
    next_eval: int = 1  # the held-out evaluation due next (1 .. eval_points)
    elapsed_s: float = 0.0  # training seconds of the earlier lives of a resumed run
    resumed_from_step: int | None = None
    skipped_nonfinite: int = 0
    reloaded: int = 0
    last_loss: float = math.nan
    last_eval_loss: float | None = None
    log: str = ",".join(LOG_COLUMNS) + "\n"

    def counters(self) -> dict:
        """Everything but the log, as the state file stores it."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "log"}

    @classmethod
    def saved(cls, state: dict) -> TrainState:
        """The state a state file holds (counters it lacks keep their defaults)."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in state["counters"].items() if k in known}, log=state["log"])

    def log_row(self, *values) -> None:
        self.log += ",".join(map(str, values)) + "\n"


def fingerprint(recipe: dict, arch: dict, blocks_path: str | Path, vocab_size: int) -> str:
    """What a saved training state must match to be resumed: what the run computes (its recipe, arch and data).
    How it executes (``pretrain.impl``: processes, compile, save cadence) is no part of it: a state resumes under
    other values."""
    stat = Path(blocks_path).stat()
    payload = json.dumps([recipe, arch, vocab_size, stat.st_size], sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def save_state(path: Path, payload: dict) -> None:
    """Write a resumable state atomically (the folder is created)."""
    with atomic_path(path) as tmp:
        torch.save(payload, tmp)


def load_state(path: Path | None, expected: str) -> dict | None:
    """The state saved at ``path`` if it belongs to this run (its fingerprint is ``expected``), else None."""
    if path is None or not path.is_file():
        return None
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state.get("fingerprint") != expected:
        print(f"ignoring training state {path}: it belongs to a different recipe, arch or data", flush=True)
        return None
    return state


def clone_state(value):
    """A deep copy of a state dict (tensors cloned, so later steps do not change it)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: clone_state(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clone_state(v) for v in value]
    return value
