"""A stage's collective progress toward its next step, as the stage's peers publish it in the DHT.

The record and the step rule follow hivemind's ``ProgressTracker`` (``hivemind.optim.progress_tracker``): each peer
publishes its step (hivemind's epoch), the samples it accumulated toward it, its rate (samples per second) and the
DHT time of the record; every peer estimates the stage's collective count as each record's samples plus its rate
times the record's age, and steps once that estimate reaches the step's target batch (``collective_samples``). The
batch a step takes is what its group holds then, the target plus what arrived meanwhile: the overshoot is measured
(``Overshoot``), not prevented. The rest of a record serves the group that averages: ``ready`` with the samples
of its snapshot (``snap``), their loss sum and microbatch indices, the training seconds at the snapshot (``at``),
the digest of the parameters after the peer's last step, and ``joining`` while the peer downloads a step's state.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from cramswarm.swarm.membership import CLOCK_FILE, progress_key
from cramswarm.training import budget_progress, step_accumulation

PROGRESS_PERIOD_S = 0.25  # a peer publishes its progress record and reads its stage's this often ...
PROGRESS_TTL_S = 2.0      # ... with this expiration: a dead peer drops out of its stage's groups within it
GATHER_S = 2.0            # a ready peer waits at most this long for the other peers at its step to be ready
DHT_ROUNDS = 4            # ... and the TTL and that wait are at least this many of the peer's own DHT rounds
MIN_GATHER_S = 0.05       # ... and at least this long (a record that changed just before the read)


@dataclasses.dataclass(frozen=True)
class ProgressRecord:
    """One peer's progress record (the value stored under ``progress_key``, sub-key = its uid)."""

    step: int
    peer: str = ""                 # its P2P peer id (base58)
    samples: int = 0               # accumulated toward ``step`` (0 while joining)
    rate: float = 0.0              # samples accumulated per second, lately
    t: float = 0.0                 # DHT time of the record
    stepped: int = 0               # the stage's stepped samples as this peer holds them
    digest: str | None = None      # of its parameters after its last step
    ready: bool = False            # its snapshot is taken: it waits for its group
    snap: int = 0                  # ... of this many samples
    loss: float = 0.0              # ... their summed loss (the last stage)
    at: float = 0.0                # ... taken at this many training seconds
    mbs: tuple[int, ...] = ()      # ... their microbatch indices
    joining: int | None = None     # downloading the state of this step

    @classmethod
    def from_value(cls, value) -> ProgressRecord | None:
        """The record a DHT value holds, or None where it is not one (another run's layout, garbage)."""
        if not isinstance(value, dict) or not isinstance(value.get("step"), int):
            return None
        try:
            fields = {f.name: value[f.name] for f in dataclasses.fields(cls) if f.name in value}
            record = cls(**fields | {"mbs": tuple(int(i) for i in fields.get("mbs", ()))})
        except (TypeError, ValueError):
            return None
        return record

    def value(self) -> dict:
        """What is stored in the DHT (defaults left out)."""
        return {f.name: (list(v) if f.name == "mbs" else v) for f in dataclasses.fields(self)
                if (v := getattr(self, f.name)) != f.default}


async def progress_records(node, run_id: str, stage: int) -> dict[str, ProgressRecord]:
    """uid -> record of a stage's live progress records."""
    found = await node.get(progress_key(run_id, stage), latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    records = {uid: ProgressRecord.from_value(entry.value) for uid, entry in found.value.items()}
    return {uid: r for uid, r in records.items() if isinstance(uid, str) and r is not None}


def collective_samples(others: dict[str, ProgressRecord], own: int, now: float) -> float:
    """The stage's estimated samples toward the step of the records ``others`` (the other peers at this peer's step)
    plus this peer's ``own``: a ready record counts its snapshot, any other its samples plus its rate times its age
    (``now`` - ``t``, DHT time), as ``ProgressTracker`` extrapolates each peer's progress."""
    return own + sum(r.snap if r.ready else r.samples + r.rate * max(0.0, now - r.t) for r in others.values())


def settled(records: dict[str, ProgressRecord]) -> dict[str, ProgressRecord]:
    """The records of peers that hold a stage state of their own (not ``joining``: downloading one)."""
    return {u: r for u, r in records.items() if r.joining is None}


def catch_up_source(records: dict[str, ProgressRecord], uid: str, step: int,
                    digest: str | None) -> tuple[str | None, bool]:
    """Whose state a peer at ``step`` with parameter digest ``digest`` downloads: the most advanced replica
    (highest step, then lowest uid) when one is ahead; else, at a step past 0, the reference replica (the lowest
    uid at ``step``) when its digest differs; else None. A joining record is never a source. Returns (source uid,
    whether it is a digest mismatch)."""
    held = settled(records)
    ahead = {u: r for u, r in held.items() if r.step > step}
    if ahead:
        return min(ahead, key=lambda u: (-ahead[u].step, u)), False
    same = {u: r for u, r in held.items() if r.step == step and r.digest}
    if same and digest is not None and step > 0:
        reference = min(same)
        if reference != uid and same[reference].digest != digest:
            return reference, True
    return None, False


class GatherView:
    """What a ready peer at ``step`` reads while it gathers its group: the records at ``step`` (``at_step``), the
    ready ones, the peers downloading the state of ``step`` to join it (``joining``), those whose record still
    shows the step before (``behind``: they are applying it, or were left out of it), and whether a replica is past
    ``step`` (``passed``: this peer catches up instead). ``me``, the reader, is never awaited."""

    def __init__(self, records: dict[str, ProgressRecord], step: int, me: str | None = None):
        held = settled(records)
        self.passed = any(r.step > step for r in held.values())
        self.at_step = {u: r for u, r in held.items() if r.step == step}
        self.ready = {u: r for u, r in self.at_step.items() if r.ready}
        self.unready = sorted(u for u in self.at_step if u != me and u not in self.ready)
        self.joining = sorted(u for u, r in records.items() if r.joining == step and u != me)
        self.behind = sorted(u for u, r in held.items() if r.step == step - 1 and u != me)

    def complete(self) -> bool:
        """Every other peer at ``step`` is ready and none is on its way to it."""
        return not self.unready and not self.joining


def writes_shard(uid: str, step: int, shard_step: int, records: dict[str, ProgressRecord], due: bool,
                 final: bool) -> bool:
    """Whether peer ``uid`` at ``step`` writes its stage's shard now: it is the lowest uid at the stage's latest
    step, that step is past its last shard (``shard_step``) and past 0, and a checkpoint is ``due`` or this is the
    ``final`` shard (the launcher asked for the last batch and the stage is idle)."""
    if step <= shard_step or step == 0:
        return False
    if min([u for u, r in records.items() if r.step == step] + [uid]) != uid:
        return False
    return due or final


def record_window_s(round_s: float) -> float:
    """How long a progress record lives and a ready peer waits for its group, given the peer's recent DHT round
    (one publish and one read, ``round_s`` seconds): 2 s on a fast network, ``DHT_ROUNDS`` rounds where slower
    (over a 2 Mbit/s link carrying activations a round takes seconds)."""
    return max(GATHER_S, PROGRESS_TTL_S, DHT_ROUNDS * round_s)


def step_target(recipe: dict, seq_len: int, stepped_samples: int, step: int,
                elapsed_s: float = 0.0) -> tuple[float, int]:
    """(budget progress, target batch in samples) of a stage's step ``step`` after ``stepped_samples`` and
    ``elapsed_s`` seconds of training: pretrain's accounting (``training.step_accumulation`` micro-batches)."""
    t = budget_progress(recipe["budget"], stepped_samples * seq_len, step, elapsed_s)
    return t, step_accumulation(recipe, t, stepped_samples) * recipe["micro_batch_sequences"]


def read_clock(workdir: Path, run_id: str) -> dict:
    """The run's training clock (``origin_wall``: wall-clock time at which training time is 0; ``deadline_wall``: a
    seconds budget's end, or None); both None before run ``run_id`` wrote it."""
    try:
        clock = json.loads((Path(workdir) / CLOCK_FILE).read_text())
        if clock["run_id"] == run_id:
            return clock
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return {"run_id": run_id, "origin_wall": None, "deadline_wall": None}


def overshoot(rows: list[dict]) -> dict[int, dict]:
    """Per stage, how far its steps' batches passed their targets, from the peers' step lines (``SYNC_LOG``: each
    with ``stage``, ``step``, ``group_samples``, ``target`` and ``flush``): ``steps``, ``mean`` and ``max`` of
    group samples over target (one line per step; the last, partial batch of a flush left out) and ``under``, the
    steps below their target (an estimate that ran ahead of the samples)."""
    by_step = {(int(r["stage"]), int(r["step"])): r for r in rows if r.get("target") and not r.get("flush")}
    stages: dict[int, list[float]] = {}
    for (stage, _), row in sorted(by_step.items()):
        stages.setdefault(stage, []).append(int(row["group_samples"]) / int(row["target"]))
    return {stage: {"steps": len(ratios), "mean": round(sum(ratios) / len(ratios), 4), "max": round(max(ratios), 4),
                    "under": sum(r < 1.0 for r in ratios)} for stage, ratios in stages.items()}


def stage_stalls(rows: list[dict]) -> dict[int, list[dict]]:
    """Per stage, per step, the step's phases from the peers' step lines (``rows``: each with ``stage``, ``step``
    and phase times): from the end of the batch's last backward computation (``last_backward``) to the mean
    ``applied``, with the parts ``trigger_s`` (-> the first ``close``), ``gather_s``, ``reduce_s`` and ``apply_s``,
    ``samples`` (the most any line's group stepped), ``peers`` and ``end``. Backward calls are not held while a
    stage steps: the stall is the step's latency, not a pause of the stage. Steps without samples are left out."""
    by_step: dict[tuple[int, int], list[dict]] = {}
    for row in rows:
        by_step.setdefault((int(row["stage"]), int(row["step"])), []).append(row)
    stalls: dict[int, list[dict]] = {}
    for (stage, step), lines in sorted(by_step.items()):
        backward = [r["last_backward"] for r in lines if r.get("last_backward") is not None]
        if not backward:
            continue
        start = max(backward)
        close = min(float(r["close"]) for r in lines)
        gathered, reduced, applied = (sum(float(r[key]) for r in lines) / len(lines)
                                      for key in ("gathered", "reduced", "applied"))
        stalls.setdefault(stage, []).append({
            "step": step, "stall_s": applied - start, "trigger_s": close - start, "gather_s": gathered - close,
            "reduce_s": reduced - gathered, "apply_s": applied - reduced,
            "samples": max(int(r["group_samples"]) for r in lines), "peers": len(lines), "end": applied})
    return stalls
