"""In-stage synchronisation accounting as a pure object (no I/O, no clock): the samples a stage's replicas processed
toward one global batch, and their averaging weights (``StageSync``)."""

from __future__ import annotations


class StageSync:
    """Samples a stage's replicas processed toward one global batch, and their averaging weights."""

    def __init__(self, target_batch_samples: int):
        if target_batch_samples <= 0:
            raise ValueError(f"target_batch_samples must be positive, got {target_batch_samples}")
        self.target_batch_samples = target_batch_samples
        self._local: dict[str, int] = {}

    @property
    def total(self) -> int:
        return sum(self._local.values())

    def add(self, uid: str, samples: int) -> bool:
        """Count ``samples`` for ``uid``; True once the stage reached the target since the last reset."""
        self._local[uid] = self._local.get(uid, 0) + samples
        return self.total >= self.target_batch_samples

    def remove(self, uid: str) -> int:
        """Forget ``uid``'s samples (a replica that died with unaveraged gradients); returns how many."""
        return self._local.pop(uid, 0)

    def weights(self) -> dict[str, float]:
        """uid -> local samples / total (sums to 1); empty before any sample."""
        total = self.total
        return {uid: n / total for uid, n in self._local.items() if n > 0} if total else {}

    def reset(self) -> None:
        self._local.clear()
