"""Stage peer of the launcher's swarm (``launcher``): in-stage synchronisation decided by the stage's own peers.

No process tells the peers when to step. Every ``PROGRESS_PERIOD_S`` each peer stores a progress record under
its stage's DHT key (``progress_key``; sub-key = its uid; expiration ``PROGRESS_TTL_S``): its step, the samples
whose backward it has accumulated toward that step, whether it is ready to average (and with how many samples,
and their summed loss), and the digest of its parameters after its last step. It reads its stage's records back
and

* steps once the samples of the records at its step reach the global batch of that step, or another peer at its
  step is ready, or the launcher asked for the last, partial batch (``flush_key``, stored once every trainer
  reported its shard done). The global batch is the recipe batch with pretrain's ramp, at the budget progress
  computed from the stage's stepped samples and steps (tokens = stepped samples x sequence length), so every
  replica computes the same batch and the same learning rate (``training.step_lr`` at that progress) from the
  stage's own progress: no schedule comes from outside. With a seconds budget the progress is the training time
  over the budget: training time counts from the origin in the launcher's ``clock.json`` (``CLOCK_FILE``: the
  training start less the training seconds of a resumed run's earlier lives); each ready record carries its
  peer's training time at its snapshot (``at``) and a step's progress is the latest ``at`` of its group (hashed
  into the group id, so every member computes the same learning rate);
* to step, it moves the gradients it accumulated aside as soon as the call it computes ends (``_run_next``: the
  backward calls admitted and still queued, like those arriving later, count toward the next step; until
  2026-11-27 the step waited for every admitted call, so each step waited for the slowest replica's queue),
  marks its record ready and waits until every peer with a record at its step is ready (at most
  ``sync_timeout_s``; a dead peer's record expires within ``GATHER_S``, see ``record_window_s``).
  The group is **deterministic, from the DHT records** (the ready records at this step, ordered by uid; the group id
  hashes their uids and sample counts), not hivemind's matchmaking: ``DecentralizedAverager``'s matchmaking needs its
  own averager process per peer with its own copy of the gradients and forms groups by time windows, while here every
  replica of a stage must take part in every step or fall behind; a group read from the records that every member reads
  alike is enough, and a member that read a different set simply fails the all-reduce (group ids differ) and tries again
  with a fresh read (records of dead peers expire within ``PROGRESS_TTL_S``, or ``record_window_s``);
* the group all-reduces the gradients with ``averaging.StageAllReduce`` (compressed by
  ``swarm.averaging_compression``, weighted by each member's samples, the same decompressed average everywhere,
  bounded by ``averaging.averaging_timeout_s``), and each member clips and takes its optimizer step: the same step
  from the same state, so replicas stay bitwise equal;
* a peer that sees a record at a later step (it was left out of a group, or its all-reduce failed) downloads the
  state of the most advanced replica; a peer whose parameter digest differs from that of the lowest uid at the
  same step does too (counted: ``digest_mismatches``). The gradients it held are lost and counted
  (``lost_gradient_samples``), as in SWARM. While it downloads, and after it arrived until it is ready at that
  step, it publishes its record marked ``joining`` with the step, and the peers at that step wait for it at their
  gather (``GatherView``; at most the download's own bound, ``state_timeout_s``) instead of stepping without it.
  Without that, over a slow link a replica left out once never got back in: the one ahead stepped alone while it
  downloaded or before its ready record could be read, and every download arrived a step old;
* records live, and a ready peer waits for its group, ``record_window_s``: 2 s, or ``DHT_ROUNDS`` of the peer's
  own recent DHT rounds (publish + read) where those are slower (seconds over a 2 Mbit/s link);
* a peer leaving its stage (``peer_rebalance``) hands the gradients it accumulated since its last step to a replica
  that stays (``hand_over`` and that replica's ``rpc_handover``), which adds them to its own toward its next step.

Each peer writes its counters to ``peer-<uid>.json`` in the run's folder (atomically, after every step and shard
write, and every ``COUNTERS_PERIOD_S`` from its publishing task; with what it holds: ``stages.stage_memory``, its
stage's parameter and optimizer bytes and its peak and current RSS; ``runtime_rss_bytes``, its RSS before the stage
was built; ``activation_bytes``, the most one backward call saved for backward; and the seconds its backward calls
waited for admission, ``admission_wait_s`` over ``held_calls`` calls) and, on the last stage, one line per
step (step, progress, mean loss of the group's samples, LR, samples) to ``log-<uid>.jsonl``. Every peer also
writes one line per step it took to ``sync-<uid>.jsonl`` (``SYNC_LOG``): the wall-clock times (``time.time()``)
of its phases - ``last_backward`` (the end of the last backward computation in its snapshot; None without one),
``close`` (the step began: new backward calls wait), ``snapshot``, ``gathered`` (the
group read from the records), ``reduced`` (the all-reduce done) and ``applied`` (the optimizer step taken; backward
calls are admitted again) - with its stage, the step, its own and the group's samples and the all-reduce attempts.
From them ``stage_stalls`` computes how long each step held a stage's backward calls back.

**Stage shards** (checkpoint and resume): a stage's state - parameters, optimizer state, step, stepped samples (what
the LR schedule and the batch ramp are computed from) and the indices of the microbatches whose gradients it
has stepped - is written to the run's shard folder (``shard_dir``) as ``stage<S>.step<N>.<uid>.pt``
(``write_shard``: atomic, older files of the stage removed after). Only the lowest uid among the records at the
stage's latest step writes (the replicas there are bitwise equal), every ``checkpoint_every_s`` and once more
when the launcher asked for the last batch and the stage is idle, so the last shard holds the stage's final
state. A peer starts from its stage's newest shard when there is one (``newest_shard``: highest step, then
lowest uid): the peers of a rerun of a killed launcher resume where the shards end. Backward calls carry their
microbatch index (``mb``); a call for a microbatch this stage has already stepped, or holds, is computed (its
input gradient is needed upstream) but its parameter gradients are not accumulated again (``duplicate_samples``),
so trainers that resume from the shards' microbatches do not count one twice.

**Re-sent backward calls.** A trainer that re-sends a backward call to another replica (the first timed out or
failed) marks it ``resent``. The first replica may still compute it, so the replica that takes the re-send keeps
its gradients apart (``resent``: summed gradients, samples and loss per microbatch) and lists them in its ready
record. At the step every member applies ``resent_kept`` to the group's records: a re-sent microbatch that a member
of the group accumulated is dropped (``duplicate_samples``), one held apart by several members only is kept by the
lowest uid, and the keeper adds its copy to its snapshot before the all-reduce. Before this, both copies went into
the step. The two copies can also fall into different steps: the first replica computes its call after its
snapshot (it was queued there), while the re-sent copy is in the step being taken; or the re-sent copy is computed
after its replica's snapshot, while the first is in the step. So a peer holds apart every call it computes while it
steps (``late``) and, when it applies the step, drops those and the re-sent ones whose microbatch the step holds
(``duplicate_samples``) and accumulates the other late ones (``_settle_late``). Until 2026-11-28 such a call counted
in both steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
import time
from pathlib import Path
from typing import AsyncIterator  # hivemind's servicer recognises typing's alias only

import torch
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time

from cramswarm.io import atomic_path, write_json
from cramswarm.swarm.averaging import averaging_timeout_s, state_timeout_s
from cramswarm.swarm.hivemind_peer import StagePeer
from cramswarm.swarm.membership import DECLARE_PERIOD_S, RECORD_TTL_S, flush_key, progress_key, stage_key, stage_records
from cramswarm.swarm.peer_rebalance import PeerRebalancer, call_units
from cramswarm.swarm.policies import LoadMeter
from cramswarm.swarm.stages import stage_memory
from cramswarm.swarm.wire import request, respond, unpack
from cramswarm.training import budget_progress, step_accumulation, step_lr

PROGRESS_PERIOD_S = 0.25  # a peer publishes its progress record and reads its stage's this often ...
PROGRESS_TTL_S = 2.0      # ... with this expiration: a dead peer drops out of its stage's groups within it
GATHER_S = 2.0            # a ready peer waits at most this long for the other peers at its step to be ready
DHT_ROUNDS = 4            # ... and the TTL and that wait are at least this many of the peer's own DHT rounds
                          # (publish + read, ``record_window_s``): over a slow link a round takes seconds
MIN_GATHER_S = 0.3        # ... and at least this long (records of peers that became ready at once)
ZERO_WEIGHT = 1e-6        # all-reduce weight of a member without samples (see _step)
FLUSH_CHECK_S = 1.0       # a peer reads the launcher's flush record at most this often
SHARD_GLOB = "stage{stage}.step*.pt"
SYNC_LOG = "sync-{uid}.jsonl"  # in the run's folder: one line per step a peer took (the step's phases)
CLOCK_FILE = "clock.json"  # in the run's folder: the training clock's origin and a seconds budget's deadline
RATE_WINDOW_S = 2.0       # a peer's published admission rate: backward samples it admitted over this many seconds
ALONE_AFTER_S = 5.0       # a peer that loaded its stage's shard serves it once no other replica was declared this long
COUNTERS_PERIOD_S = 2.0   # a peer rewrites its counters file at least this often (also at steps and shard writes)


def read_clock(workdir: Path, run_id: str) -> dict:
    """The launcher's training clock of run ``run_id`` (``origin_wall``: wall-clock time at which training time is
    0; ``deadline_wall``: a seconds budget's end, or None); both None before this run's launcher wrote it (an
    earlier life's file in a resumed run's folder does not count)."""
    try:
        clock = json.loads((Path(workdir) / CLOCK_FILE).read_text())
        if clock["run_id"] == run_id:
            return clock
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return {"run_id": run_id, "origin_wall": None, "deadline_wall": None}


async def progress_records(node, run_id: str, stage: int) -> dict[str, dict]:
    found = await node.get(progress_key(run_id, stage), latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    return {uid: entry.value for uid, entry in found.value.items()
            if isinstance(uid, str) and isinstance(entry.value, dict) and "step" in entry.value}


def resent_kept(group: dict[str, dict]) -> dict[str, list[int]]:
    """The re-sent microbatches each member of a step's group adds to its gradients (uid -> microbatches), from
    the group's ready records: ``mbs`` (accumulated) and ``resent`` (held apart: ``[mb, samples, loss sum]``). A
    re-sent microbatch that a member accumulated is dropped; of one that several members hold apart only, the
    lowest uid keeps its copy. Every member reads the same records, so every member computes the same answer."""
    accumulated = {int(mb) for record in group.values() for mb in record.get("mbs", ())}
    kept: dict[str, list[int]] = {}
    claimed: set[int] = set()
    for uid in sorted(group):
        for mb, *_ in group[uid].get("resent", ()):
            if int(mb) not in accumulated and int(mb) not in claimed:
                claimed.add(int(mb))
                kept.setdefault(uid, []).append(int(mb))
    return kept


def resent_samples(group: dict[str, dict], kept: dict[str, list[int]]) -> tuple[int, float]:
    """Samples and loss sum of the kept re-sent microbatches (``resent_kept``) over the group."""
    entries = [(int(n), float(loss)) for uid, mbs in kept.items()
               for mb, n, loss in group[uid].get("resent", ()) if int(mb) in mbs]
    return sum(n for n, _ in entries), sum(loss for _, loss in entries)


def admission_share(remaining: int, call_samples: int, me: str, rates: dict[str, float]) -> int:
    """Samples of its stage's batch that peer ``me`` may admit on its own between two reads of its replicas' records.

    ``remaining``: the samples the batch still lacked at the read (the target less every record's count at the
    step, ``me``'s included); ``rates``: each replica's published admission rate (samples per second, ``me``'s
    included). The remaining batch is cut into calls of ``call_samples`` and the calls are dealt out in proportion
    to the rates (equal shares where no replica admitted anything lately), the leftover calls to the largest
    remainders, ties to the lowest uid. Every replica that read the same records computes the same deal, and the
    shares add up to the remaining calls, so replicas that admit on last-read counts together hold the batch
    rather than each filling it up (see ``SyncingStagePeer.rpc_backward``)."""
    if remaining <= 0 or call_samples <= 0 or me not in rates:
        return 0
    calls = remaining // call_samples
    uids = sorted(rates)
    total = sum(max(0.0, float(r)) for r in rates.values())
    exact = {u: calls * (max(0.0, float(rates[u])) / total if total > 0 else 1.0 / len(uids)) for u in uids}
    dealt = {u: int(exact[u]) for u in uids}
    for u in sorted(uids, key=lambda u: (dealt[u] - exact[u], u))[:calls - sum(dealt.values())]:
        dealt[u] += 1
    return dealt[me] * call_samples


def handed_samples(meta: dict) -> int:
    """Samples of the gradients a leaving replica hands over (``_take_held``): accumulated and held apart."""
    return int(meta["samples"]) + sum(int(n) for _, n, _ in meta.get("resent", ()))


def settled(records: dict[str, dict]) -> dict[str, dict]:
    """The records of peers that hold a stage state of their own (not ``joining``: downloading one)."""
    return {u: r for u, r in records.items() if r.get("joining") is None}


def catch_up_source(records: dict[str, dict], uid: str, step: int, digest: str | None) -> tuple[str | None, bool]:
    """Whose state a peer at ``step`` with parameter digest ``digest`` downloads, from its stage's progress records:
    the most advanced replica (highest step, then lowest uid) when one is ahead; else, at a step past 0, the
    reference replica (the lowest uid at ``step``) when its digest differs; else None. A ``joining`` record
    (its peer is downloading itself) is never a source. Returns (source uid, whether it is a digest mismatch)."""
    held = settled(records)
    ahead = {u: r for u, r in held.items() if r["step"] > step}
    if ahead:
        return min(ahead, key=lambda u: (-ahead[u]["step"], u)), False
    same = {u: r for u, r in held.items() if r["step"] == step and r.get("digest")}
    if same and digest is not None and step > 0:
        reference = min(same)
        if reference != uid and same[reference]["digest"] != digest:
            return reference, True
    return None, False


class GatherView:
    """What a ready peer at ``step`` reads from its stage's progress records while it gathers its group: the
    records at ``step`` (``at_step``), those of them ready to average (``ready``), the peers downloading the state
    of ``step`` to join it (``joining``: their records say the step they left, or ``step`` itself when they
    download the reference replica's state over a digest mismatch), and whether a replica is past ``step`` already
    (``passed``: this peer then catches up instead). ``me``, the reading peer, is never awaited: ``unready`` and
    ``joining`` leave it out (its own joining record of a moment ago may still be read back after it arrived)."""

    def __init__(self, records: dict[str, dict], step: int, me: str | None = None):
        held = settled(records)
        self.passed = any(r["step"] > step for r in held.values())
        self.at_step = {u: r for u, r in held.items() if r["step"] == step}
        self.ready = {u: r for u, r in self.at_step.items() if r.get("ready")}
        self.unready = sorted(u for u in self.at_step if u != me and u not in self.ready)
        self.joining = sorted(u for u, r in records.items() if r.get("joining") == step and u != me)

    def complete(self) -> bool:
        """Every other peer at ``step`` is ready and none is on its way to it."""
        return not self.unready and not self.joining


def record_window_s(round_s: float) -> float:
    """How long a progress record lives and a ready peer waits for its group, given the peer's recent DHT round
    (one publish and one read of its stage's records, ``round_s`` seconds): ``PROGRESS_TTL_S`` / ``GATHER_S``
    (both 2 s) on a fast network, ``DHT_ROUNDS`` rounds where rounds are slower. With fixed 2 s windows a round of
    1-3 s (a 2 Mbit/s link carrying activations) let records expire between publishes and gathers close before a
    replica's ready record could be read, and the replica was left out of its stage's step."""
    return max(GATHER_S, PROGRESS_TTL_S, DHT_ROUNDS * round_s)


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
    """Write one stage shard atomically (``io.atomic_path``), then remove the stage's shards of older steps. ``blob``:
    the serialised state, or the state itself (``StagePeer._state``), which ``torch.save`` writes to the file as it
    serialises it, so no serialised copy of the stage is held in memory."""
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


def load_shard(path: Path) -> dict:
    """A shard's contents: module and optimizer state dicts, step, stepped_samples, stepped_mbs."""
    return torch.load(path, weights_only=True, map_location="cpu")


def step_target(recipe: dict, seq_len: int, stepped_samples: int, step: int,
                elapsed_s: float = 0.0) -> tuple[float, int]:
    """(budget progress, global batch in samples) of a stage's step ``step`` after ``stepped_samples`` and
    ``elapsed_s`` seconds of training: pretrain's accounting (the dispatcher's: progress before the step,
    ``training.step_accumulation`` micro-batches)."""
    t = budget_progress(recipe["budget"], stepped_samples * seq_len, step, elapsed_s)
    return t, step_accumulation(recipe, t, stepped_samples) * recipe["micro_batch_sequences"]


def stage_stalls(rows: list[dict]) -> dict[int, list[dict]]:
    """Per stage, per step, how long the step held the stage's backward calls back, from the peers' ``SYNC_LOG``
    lines (``rows``: each with its ``stage``, ``step`` and phase times).

    A stage's step begins once the last backward computation of its batch ends (the latest ``last_backward`` of
    its group's lines) and ends when its peers have stepped (the mean ``applied`` of the lines): the stall. Each
    entry: ``step``, ``stall_s`` and its parts ``trigger_s`` (batch done -> the first peer's ``close``),
    ``gather_s`` (-> the mean ``gathered``), ``reduce_s`` (-> the mean ``reduced``) and ``apply_s`` (-> the mean
    ``applied``), ``samples`` (the most any line's group stepped), ``peers`` (lines) and ``end`` (the mean
    ``applied``). A step whose lines have no ``last_backward`` (no samples) is left out."""
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


class SyncingStagePeer(StagePeer):
    """A ``StagePeer`` that synchronises with its stage's other peers by itself (see the module docstring)."""

    def __init__(self, cfg: dict, stage: int, uid: str, speed: float, node):
        super().__init__(cfg, stage, uid, speed, node)
        self.meter = LoadMeter(time.monotonic())  # its own queue and service rate (peer_rebalance)
        self.leaving = False       # moving to another stage (peer_rebalance): new calls are refused
        self.seq_len = cfg["seq_len"]
        self.workdir = Path(cfg["workdir"])
        self.peer_id = node.p2p.peer_id.to_base58()
        self.stepped_samples = 0
        self.local_loss = 0.0      # summed loss x samples of the last stage's backward calls since the snapshot
        self.snapshot_loss = 0.0
        self.digest: str | None = None
        self.ready: tuple[int, int, float, float] | None = None  # (step, samples, loss sum, training seconds at
                                   # the snapshot) while waiting to average
        self.clock_origin: float | None = None  # CLOCK_FILE's origin, once read
        # the backward calls admitted whose replies have not left, by admission number: their samples and state
        # ("queued", "computing", "computed": held from then on in the accumulated gradients or apart). The call's
        # RPC removes its entry when it ends; a call whose RPC was cancelled may still compute later, on its own
        # entry, which no longer counts
        self.calls: dict[int, dict] = {}
        self.admissions_made = 0
        # what the batch of a step adds to the recipe's (_target): the samples this peer's last step left queued
        # (step, samples), and at the last read, what the other replicas at the step left
        self.carried, self.others_carried = (0, 0), 0
        self.trigger: dict | None = None   # the counts this peer read when it last stepped (_round)
        self.closing = False       # taking the step's snapshot: new backward calls wait (admitted ones go on)
        self.others_pending = 0    # samples the other peers at this step held at the last read of the records
        # admission between reads (rpc_backward, admission_share): what the batch lacked at the last read, the
        # replicas' admission rates then, the oldest publish time (DHT clock) of the other records at this step
        # read then, and the samples this peer admitted since
        self.read_remaining, self.read_rates, self.read_stamp, self.since_read = 0, {uid: 0.0}, 0.0, 0
        self.admissions: list[tuple[float, int]] = []   # (monotonic time, samples) of recent admissions
        self.publishing, self.republish = False, False   # a record store under way (publish_soon), one more asked
        self.publish_task: asyncio.Task | None = None
        self.joining: int | None = None  # the step whose state this peer is downloading (_catch_up), and
                                   # after it arrived, until it is ready at that step or finds no peer ready there
        self.round_s = 0.0         # its recent DHT round (publish + read of its stage's records): record_window_s
        self.record_expiration = 0.0  # DHT time its last progress record expires
        self.nudge = asyncio.Event()  # wakes the synchronisation loop early (this peer's count reached the batch)
        self.last_backward: float | None = None      # wall time the last accumulated backward computation ended
        self.snapshot_backward: float | None = None  # ... of those in the snapshot
        self.counters = {"uid": uid, "stage": stage, "steps_taken": 0, "resyncs": 0, "digest_mismatches": 0,
                         "lost_gradient_samples": 0, "averaging_bytes_sent": 0, "averaging_values_sent": 0,
                         "averaging_param_steps": 0, "group_sizes": [], "failed_rounds": 0, "shards_written": 0,
                         "duplicate_samples": 0, "loaded_shard_step": None, "served_from_shard_alone": None,
                         "backward_samples": 0,
                         "admission_wait_s": 0.0, "held_calls": 0, "device": str(self.device),
                         "handed_over_samples": 0, "taken_over_samples": 0, "joining_wait_s": 0.0,
                         "slowest_dht_round_s": 0.0, "resent_samples": 0, "resent_kept_samples": 0}
        self.stepped_mbs: set[int] = set()   # microbatches whose gradients the stage has stepped
        self.local_mbs: set[int] = set()     # ... accumulated here since the snapshot
        self.snapshot_mbs: set[int] = set()  # ... in the snapshot
        # re-sent backward calls held apart since the snapshot, and in it: microbatch -> (summed gradients as one
        # flat fp32 vector, samples, loss sum); the step adds those that no other replica holds (resent_kept)
        self.resent: dict[int, tuple[torch.Tensor, int, float]] = {}
        self.snapshot_resent: dict[int, tuple[torch.Tensor, int, float]] = {}
        # backward calls computed while this peer steps (snapshot taken, step not applied), held apart the same
        # way until it applies the step (_settle_late): another replica's re-sent copy may be in that step
        self.late: dict[int, tuple[torch.Tensor, int, float]] = {}
        self.shard_dir = Path(cfg.get("shard_dir") or self.workdir / "shards")
        self.checkpoint_every_s = float(cfg.get("checkpoint_every_s", 60.0))
        self.shard_step, self.last_write, self.writing = 0, time.monotonic(), False
        self.flush_seen, self.flush_checked = False, 0.0
        newest = newest_shard(self.shard_dir, stage)
        if newest is not None:  # a rerun of a killed launcher (or a restart): start from the stage's last shard
            self._load_blob(newest[1].read_bytes())
            self.shard_step = self.counters["loaded_shard_step"] = self.step
            print(f"[{uid}] loaded stage {stage} shard {newest[1].name} (step {self.step})", flush=True)

    async def load_from_replica(self, give_up_after_s: float, alone_after_s: float | None = None) -> bool:
        """A live replica's state, as every joining peer takes it; a peer that loaded its stage's shard serves from
        that shard once no other replica of the stage has been declared for ``ALONE_AFTER_S`` (the stage's last
        replicas died: the run goes on from the shard, losing at most one shard period of this stage's steps)."""
        shard_step = self.counters["loaded_shard_step"]
        if shard_step is None:
            return await super().load_from_replica(give_up_after_s)
        if await super().load_from_replica(give_up_after_s, alone_after_s=ALONE_AFTER_S):
            return True
        self.counters["served_from_shard_alone"] = shard_step
        print(f"[{self.uid}] no live replica of stage {self.stage} for {ALONE_AFTER_S:.0f} s: serving from its shard "
              f"at step {shard_step}", flush=True)
        return False

    # -- compute thread ---------------------------------------------------------------------------------------
    def _forward(self, tensors: dict[str, torch.Tensor], meta: dict) -> tuple[dict, dict]:
        start = time.perf_counter()
        result, out_meta = super()._forward(tensors, meta)
        samples = out_meta["payloads"]["y"]["shape"][0]
        self.meter.served(call_units("forward", samples, self.is_last), time.perf_counter() - start)
        return result, out_meta

    def _backward(self, tensors: dict[str, torch.Tensor], meta: dict) -> tuple[dict, dict]:
        call = meta.get("call", {})
        call["state"] = "computing"   # its gradients go into the next snapshot
        try:
            return self._backward_held(tensors, meta)
        finally:
            call["state"] = "computed"   # held now (or, a duplicate, not at all): its admission no longer counts

    def _backward_held(self, tensors: dict[str, torch.Tensor], meta: dict) -> tuple[dict, dict]:
        start = time.perf_counter()
        mb = meta.get("mb")
        if mb is not None and int(mb) in self._held_mbs():
            return self._duplicate_backward(tensors, meta)
        if mb is not None and meta.get("resent"):
            return self._resent_backward(tensors, meta, start)
        if mb is not None and self._stepping():
            return self._late_backward(tensors, meta, start)
        result, out_meta = super()._backward(tensors, meta)
        self.meter.served(call_units("backward", out_meta["samples"], self.is_last), time.perf_counter() - start)
        if "loss" in out_meta:
            self.local_loss += out_meta["loss"] * out_meta["samples"]
        if mb is not None:
            self.local_mbs.add(int(mb))
        self.last_backward = time.time()
        return result, out_meta

    def _held_mbs(self) -> set[int]:
        """Microbatches this stage stepped, or this peer holds toward its step (accumulated or apart)."""
        return (self.stepped_mbs | self.local_mbs | self.snapshot_mbs | set(self.resent)
                | set(self.snapshot_resent) | set(self.late))

    def _stepping(self) -> bool:
        """Whether this peer took its step's snapshot and has not applied the step yet."""
        return self.snapshot is not None and self.snapshot[0] == self.step

    def _late_backward(self, tensors: dict[str, torch.Tensor], meta: dict, start: float) -> tuple[dict, dict]:
        """A backward call computed while this peer steps (a call it admitted before the snapshot and had queued):
        held apart (``late``) until the step is applied. If the call's trainer gave up on it meanwhile (it waited
        past the trainer's timeout), a copy re-sent to another replica may be in the step being taken (this peer's
        snapshot does not list the microbatch); accumulated at once, it would count in the next step too."""
        result, out_meta, flat = self._backward_apart(tensors, meta, keep=True)
        n = int(out_meta["samples"])
        self.late[int(meta["mb"])] = (flat, n, float(out_meta.get("loss", 0.0)) * n)
        self.meter.served(call_units("backward", n, self.is_last), time.perf_counter() - start)
        self.last_backward = time.time()
        return result, out_meta

    def _settle_late(self, stepped: set[int]) -> None:
        """After a step that stepped the microbatches ``stepped`` (or, empty, a step that stepped nothing): the calls
        held apart while it was taken (``late``) are added to the accumulated gradients toward the next step, but
        those of a stepped microbatch are dropped (a re-sent copy counted there: ``duplicate_samples``). Re-sent
        calls held apart since the snapshot (``resent``) are dropped if their microbatch was stepped, and otherwise
        stay apart for the next step's group."""
        for mb in [mb for mb in self.resent if mb in stepped]:
            self.counters["duplicate_samples"] += self.resent.pop(mb)[1]
        late, self.late = self.late, {}
        for mb, (flat, n, loss) in late.items():
            if mb in stepped:
                self.counters["duplicate_samples"] += n
                continue
            self._add_flat(flat)
            self.local_samples += n
            self.local_loss += loss
            self.local_mbs.add(mb)

    def _resent_backward(self, tensors: dict[str, torch.Tensor], meta: dict, start: float) -> tuple[dict, dict]:
        """A re-sent backward call (``meta["resent"]``; the replica it went to first may still compute it): its
        gradients, samples and loss are kept apart (``resent``) until the step decides whether they count."""
        result, out_meta, flat = self._backward_apart(tensors, meta, keep=True)
        n = int(out_meta["samples"])
        self.resent[int(meta["mb"])] = (flat, n, float(out_meta.get("loss", 0.0)) * n)
        self.counters["resent_samples"] += n
        self.meter.served(call_units("backward", n, self.is_last), time.perf_counter() - start)
        self.last_backward = time.time()
        return result, out_meta

    def _resent_entries(self) -> list[list]:
        """The snapshot's re-sent microbatches as its ready record lists them: ``[mb, samples, loss sum]``."""
        return [[mb, n, loss] for mb, (_, n, loss) in sorted(self.snapshot_resent.items())]

    def _with_resent(self, flat: torch.Tensor, samples: int, mbs: list[int]) -> tuple[torch.Tensor, int]:
        """The snapshot's mean gradient (``flat`` over ``samples``) with the kept re-sent microbatches ``mbs``
        added: a new vector (the snapshot stays as it is for a retry), and the samples it is the mean of."""
        if not mbs:
            return flat, samples
        sums, n = flat * samples, samples
        for mb in mbs:
            grads, count, _ = self.snapshot_resent[mb]
            sums.add_(grads)
            n += count
        return sums.div_(n), n

    def _duplicate_backward(self, tensors: dict[str, torch.Tensor], meta: dict) -> tuple[dict, dict]:
        """A microbatch this stage already stepped or holds: the input gradient (and loss) for the trainer, the
        accumulated parameter gradients and sample count left as they were."""
        result, out_meta, _ = self._backward_apart(tensors, meta, keep=False)
        self.counters["duplicate_samples"] += int(out_meta.get("samples", 0))
        return result, out_meta

    def _backward_apart(self, tensors: dict[str, torch.Tensor], meta: dict,
                        keep: bool) -> tuple[dict, dict, torch.Tensor | None]:
        """``StagePeer._backward`` with this peer's accumulated gradients and sample count left as they were; the
        call's own parameter gradients as one flat vector if ``keep``, else dropped."""
        held, samples = [p.grad for p in self.params], self.local_samples
        for p in self.params:
            p.grad = None
        try:
            result, out_meta = super()._backward(tensors, meta)
            flat = self._flat_grads() if keep else None
        finally:
            for p, g in zip(self.params, held):
                p.grad = g
            self.local_samples = samples
        return result, out_meta, flat

    def _take_snapshot(self, step: int) -> tuple[torch.Tensor, int]:
        if self.snapshot is None or self.snapshot[0] != step:
            self.carried = (step + 1, self._calls_samples("queued"))   # admitted toward this step, still queued
            self.snapshot_loss, self.local_loss = self.local_loss, 0.0
            self.snapshot_mbs, self.local_mbs = self.local_mbs, set()
            self.snapshot_resent, self.resent = self.resent, {}
            self.snapshot_backward, self.last_backward = self.last_backward, None
        return super()._take_snapshot(step)

    def _apply_counted(self, group_id: bytes, lr: float, samples: int, mbs: set[int]) -> dict:
        """``_apply`` and, in the same compute-thread call, the stage's stepped samples and microbatches, so that a
        state taken for a download or a shard never holds a step without its counts."""
        reply = self._apply(group_id, lr)
        if reply.get("status") == "ok":
            self.stepped_samples += samples
            self.stepped_mbs |= mbs
            self.snapshot_mbs, self.snapshot_resent = set(), {}
            self._settle_late(mbs)
        return reply

    def _take_held(self) -> tuple[dict, dict]:
        """The gradients held since the last snapshot, moved out of this peer (its held samples drop to 0): one
        flat fp32 vector of the accumulated gradients' sum, with its step, samples, loss sum and microbatches, and
        the re-sent microbatches held apart (``resent``: one row each, listed ``[mb, samples, loss sum]``)."""
        flat = self._flat_grads()
        apart = sorted(self.resent.items())
        meta = {"step": self.step, "samples": self.local_samples, "loss": self.local_loss,
                "mbs": sorted(self.local_mbs), "resent": [[mb, n, loss] for mb, (_, n, loss) in apart]}
        tensors = {"grad": flat}
        if apart:
            tensors["resent"] = torch.stack([grads for _, (grads, _, _) in apart])
        for p in self.params:
            p.grad = None
        self.local_samples, self.local_loss, self.local_mbs, self.resent = 0, 0.0, set(), {}
        return tensors, meta

    def _add_held(self, tensors: dict, meta: dict) -> dict:
        """Add gradients another replica of this stage held (``_take_held``) to this peer's own, toward its next
        step: refused if they were computed at another step, or share a microbatch with what this stage holds or
        has stepped (they would count twice)."""
        if int(meta["step"]) != self.step:
            return {"status": "refused", "reason": f"at step {self.step}, not {meta['step']}"}
        mbs, held = {int(i) for i in meta["mbs"]}, self._held_mbs()
        if mbs & held:
            return {"status": "refused", "reason": "a microbatch held twice"}
        self._add_flat(tensors["grad"])
        self.local_samples += int(meta["samples"])
        self.local_loss += float(meta["loss"])
        self.local_mbs |= mbs
        # re-sent microbatches held apart go on being held apart here (the step's rule, resent_kept, decides);
        # one this peer accumulated, stepped or holds apart itself is counted already
        for row, (mb, n, loss) in enumerate(meta.get("resent", ())):
            if int(mb) in held or int(mb) in mbs:
                self.counters["duplicate_samples"] += int(n)
            else:
                self.resent[int(mb)] = (tensors["resent"][row], int(n), float(loss))
        return {"status": "ok"}

    def _drop_snapshot(self) -> None:
        """End a step that stepped nothing: the snapshot goes, the calls held apart meanwhile are accumulated."""
        self.snapshot = None
        self._settle_late(set())

    def _add_flat(self, flat: torch.Tensor) -> None:
        """Add gradient sums held as one flat fp32 vector (``_flat_grads``' layout) to the accumulated ones."""
        for p, g in zip(self.params, torch.split(flat, [p.numel() for p in self.params])):
            g = g.to(p.device, p.dtype).view_as(p)
            p.grad = g if p.grad is None else p.grad.add_(g)

    def _extra_state(self) -> dict:
        return {"stepped_samples": self.stepped_samples, "stepped_mbs": sorted(self.stepped_mbs)}

    def _load_extra_state(self, state: dict) -> None:
        self.stepped_samples = int(state.get("stepped_samples", 0))
        self.stepped_mbs = {int(i) for i in state.get("stepped_mbs", [])}
        self.local_mbs, self.snapshot_mbs = set(), set()
        self.resent, self.snapshot_resent, self.late = {}, {}, {}
        self.local_loss = self.snapshot_loss = 0.0
        self.ready = None
        self.digest = self._digest()

    def _digest(self) -> str:
        digest = hashlib.sha1()
        for p in self.params:
            digest.update(p.detach().cpu().contiguous().numpy())   # its buffer, not a copy
        return digest.hexdigest()

    def _held_samples(self) -> int:
        """Samples whose gradients this peer holds toward its current step (snapshot and since)."""
        snap = self.snapshot[2] + sum(n for _, n, _ in self.snapshot_resent.values()) if self._stepping() else 0
        apart = sum(n for _, n, _ in self.resent.values()) + sum(n for _, n, _ in self.late.values())
        # a computed call's samples are held from the end of its compute; counted as admitted too until its reply
        # left, they made the stage step short of its batch (176 samples of 192 typical)
        return self.local_samples + snap + apart + self._calls_samples("queued", "computing")

    def _calls_samples(self, *states: str) -> int:
        """Samples of the admitted backward calls in ``states`` (``calls``)."""
        return sum(c["samples"] for c in list(self.calls.values()) if c["state"] in states)

    def _elapsed(self) -> float:
        """Seconds of training so far (0 before the launcher started the trainers): a seconds budget's clock."""
        if self.clock_origin is None:
            self.clock_origin = read_clock(self.workdir, self.run_id)["origin_wall"]
        return max(0.0, time.time() - self.clock_origin) if self.clock_origin is not None else 0.0

    def _target(self) -> int:
        """The samples this step of the stage holds: the recipe's batch (``training.step_target``), plus the samples
        of the calls the replicas had admitted toward the step before and left queued at their snapshots. Those
        count toward this step, so without them each step would hold the recipe's batch less what was queued at
        its end; with them the steps hold the batch on average (a step's excess is the next one's shortfall)."""
        base = step_target(self.cfg["recipe"], self.seq_len, self.stepped_samples, self.step, self._elapsed())[1]
        return base + self._own_carried() + self.others_carried

    def _own_carried(self) -> int:
        step, samples = self.carried
        return samples if step == self.step else 0

    def _refuse_if_leaving(self) -> None:
        if self.leaving:  # the trainer re-sends the call to another replica of this stage
            raise RuntimeError(f"{self.uid} is leaving stage {self.stage} (rebalancing)")

    async def _metered(self, fn, *args):
        """``_run`` of a forward or backward call, counted in this peer's queue while it waits and computes."""
        self.meter.enter(time.monotonic())
        try:
            return await self._run(fn, *args)
        finally:
            self.meter.exit(time.monotonic())

    async def rpc_forward(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                          context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        tensors, meta = await unpack(requests)
        self._refuse_if_leaving()
        result, out_meta = await self._metered(self._forward, tensors, meta)
        for message in respond(result, out_meta):
            yield message

    def _rate(self) -> float:
        """Backward samples this peer admitted per second over the last ``RATE_WINDOW_S`` (its published rate)."""
        since = time.monotonic() - RATE_WINDOW_S
        self.admissions = [(t, n) for t, n in self.admissions if t >= since]
        return sum(n for _, n in self.admissions) / RATE_WINDOW_S

    def _full(self, samples: int) -> bool:
        """Whether a backward call of ``samples`` would take the stage past its batch, by the counts last read (a
        peer holding nothing admits a call larger than what is left, unless the others hold the batch already)."""
        held, target = self._held_samples(), self._target()
        return (held > 0 or self.others_pending >= target) and self.others_pending + held + samples > target

    def _over_share(self, samples: int, arrived: float) -> bool:
        """Whether a backward call of ``samples`` that arrived at DHT time ``arrived`` passes this peer's share of
        what the batch lacked at the last read (``admission_share``) and no read since shows every other record at
        the step published after it arrived: the other replicas may have filled the rest meanwhile."""
        return self.read_stamp < arrived and self._past_share(samples)

    def _past_share(self, samples: int) -> bool:
        """Whether ``samples`` more than this peer admitted since the last read pass its share of what the batch
        lacked at that read (``admission_share``)."""
        return self.since_read + samples > admission_share(self.read_remaining, samples, self.uid, self.read_rates)

    def _held_by_batch(self, samples: int, arrived: float, arrived_dht: float) -> bool:
        """Whether the batch rules hold back a backward call of ``samples`` that arrived at ``arrived`` (monotonic)
        / ``arrived_dht`` (DHT time): the batch is full, or the call passes this peer's share (for at most
        ``record_window_s``)."""
        return self._full(samples) or (time.monotonic() - arrived < record_window_s(self.round_s)
                                       and self._over_share(samples, arrived_dht))

    async def rpc_backward(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                           context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Admission toward the stage's global batch: a backward call waits while this peer is averaging, or the
        stage's samples (others' as last read, plus this peer's) would pass the batch, or it passes this peer's
        share of what the batch lacked at the last read (``admission_share``) until a read shows every other
        replica's count as of after its arrival (at most ``record_window_s``: a dead replica's record is not
        renewed) - in all at most ``sync_timeout_s`` (then it counts toward the next step); the rest is
        ``StagePeer``'s. Without the shares, replicas that shared a stage's calls each admitted up to the batch on
        the other's count of up to 0.25 s before, and steps held up to twice the batch. The reply's ``held_s`` is the
        wait: the stage's, not this replica's (every replica's calls wait for a step), so the trainers' balancers
        leave it out of the call's time. Counted in, it flattened the measured speeds (for example a speed-1 call of
        0.3 s that waited 1 s for a step looked 1.3 s beside 2.2 s for a speed-0.25 one). A peer leaving its stage
        refuses the call, before and after the wait."""
        tensors, meta = await unpack(requests)
        self._refuse_if_leaving()
        samples = int(meta.get("samples", 0))
        arrived, arrived_dht = time.monotonic(), get_dht_time()
        deadline = arrived + self.sync_timeout_s
        while time.monotonic() < deadline and (self.closing or self.ready is not None
                                               or self._held_by_batch(samples, arrived, arrived_dht)):
            self.nudge.set()
            await asyncio.sleep(0.02)
        if (waited := time.monotonic() - arrived) > 0.001:
            self.counters["admission_wait_s"] += waited
            self.counters["held_calls"] += 1
        self._refuse_if_leaving()
        self.since_read += samples
        admission, self.admissions_made = self.admissions_made, self.admissions_made + 1
        self.calls[admission] = call = {"samples": samples, "state": "queued"}
        meta = {**meta, "call": call}
        self.admissions.append((time.monotonic(), samples))
        self.publish_soon()   # the replicas holding calls wait for a count of this peer's as of after their arrival
        if self._past_share(samples):
            self.nudge.set()   # its share is spent: read the replicas' counts now, for a new deal
        try:
            result, out_meta = await self._metered(self._backward, tensors, meta)
        finally:
            self.calls.pop(admission, None)
        self.counters["backward_samples"] += samples  # what the trainers' routing gave this peer
        out_meta = {**out_meta, "held_s": round(waited, 4)}   # the trainer's balancer leaves it out of the call's time
        if self.others_pending + self._held_samples() >= self._target():
            self.nudge.set()
        for message in respond(result, out_meta):
            yield message

    async def rpc_handover(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                           context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """A replica leaving this stage (``peer_rebalance``) hands this peer the gradients it holds."""
        tensors, meta = await unpack(requests)
        if self.leaving or self.closing or self.ready is not None:
            reply = {"status": "refused", "reason": "leaving or stepping"}
        else:
            reply = await self._run(self._add_held, tensors, meta)
        if reply["status"] == "ok":
            self.counters["taken_over_samples"] += handed_samples(meta)
            if self.others_pending + self._held_samples() >= self._target():
                self.nudge.set()
        for message in respond({}, reply):
            yield message

    async def hand_over(self, timeout_s: float) -> int:
        """Give the gradients this peer holds since its last step (accumulated, and re-sent ones held apart) to
        another replica of its stage, the first (by uid) that accepts, as the emulation's moving peer does: a peer
        that leaves its stage loses no samples and need not wait for the stage's step. Only between steps (no
        snapshot held), with no call admitted. Returns the samples handed over; what no replica took stays here
        (restored, if still at the same step)."""
        records = await stage_records(self.node, self.run_id, self.stage)
        heirs = sorted(uid for uid in records if uid != self.uid)
        # checked after the last await before the take: no step can begin in between (one event loop)
        nothing = self.local_samples == 0 and not self.resent
        if not heirs or nothing or self.calls or self.closing or self.ready is not None or self._stepping():
            return 0
        tensors, meta = await self._run(self._take_held)   # queued on the compute thread before any snapshot
        for uid in heirs:
            stub = type(self).get_stub(self.node.p2p, PeerID.from_base58(records[uid][0]), namespace=self.namespace)
            try:
                _, reply = await asyncio.wait_for(unpack(await stub.rpc_handover(request(tensors, meta))), timeout_s)
            except Exception as e:
                print(f"[{self.uid}] handing its gradients to {uid} failed: {e!r}", flush=True)
                continue
            if reply.get("status") == "ok":
                self.counters["handed_over_samples"] += handed_samples(meta)
                print(f"[{self.uid}] handed {handed_samples(meta)} samples' gradients to {uid}", flush=True)
                await self._publish()   # its record no longer counts them
                return handed_samples(meta)
            print(f"[{self.uid}] {uid} refused its gradients: {reply.get('reason')}", flush=True)
        if self.closing or self.ready is not None or (await self._run(self._add_held, tensors, meta))["status"] != "ok":
            self.counters["lost_gradient_samples"] += handed_samples(meta)   # the stage stepped meanwhile
        return 0

    # -- records ----------------------------------------------------------------------------------------------
    async def _publish(self) -> None:
        value = {"peer": self.peer_id, "step": self.step, "samples": self._held_samples(),
                 "stepped": self.stepped_samples, "digest": self.digest, "ready": False, "rate": self._rate(),
                 "carried": self._own_carried(), "t": get_dht_time()}
        if self.ready is not None and self.ready[0] == self.step:
            value.update(ready=True, snap=self.ready[1], loss=self.ready[2], at=self.ready[3],
                         mbs=sorted(self.snapshot_mbs), resent=self._resent_entries())
        elif self.joining is not None:  # held gradients go with the download: they count toward no step
            value.update(joining=self.joining, samples=0)
        # later records expire later, so the latest stored value wins even where the window shrank meanwhile
        self.record_expiration = max(get_dht_time() + record_window_s(self.round_s), self.record_expiration + 1e-3)
        await self.node.store(progress_key(self.run_id, self.stage), subkey=self.uid, value=value,
                              expiration_time=self.record_expiration)

    def publish_soon(self) -> None:
        """Store this peer's record now, in a task of its own (one store at a time; one more if asked meanwhile)."""
        if self.publishing:
            self.republish = True
            return
        self.publishing = True
        self.publish_task = asyncio.create_task(self._publish_now())   # referenced: the loop keeps weak ones only

    async def _publish_now(self) -> None:
        try:
            while True:
                self.republish = False
                try:
                    await self._publish()
                except Exception as e:  # a DHT hiccup: publish_forever stores it again within a period
                    print(f"[{self.uid}] publishing the progress record failed: {e!r}", flush=True)
                if not self.republish:
                    return
        finally:
            self.publishing = False

    async def _read_records(self) -> dict[str, dict]:
        """Publish this peer's record and read its stage's, timing the round (``round_s``: the latest round when
        it is slower, else an average that forgets slowly)."""
        started = time.monotonic()
        await self._publish()
        records = await progress_records(self.node, self.run_id, self.stage)
        took = time.monotonic() - started
        self.round_s = took if took > self.round_s else 0.8 * self.round_s + 0.2 * took
        self.counters["slowest_dht_round_s"] = max(self.counters["slowest_dht_round_s"], round(took, 3))
        return records

    def _write_counters(self) -> None:
        write_json(self.workdir / f"peer-{self.uid}.json",
                   {**self.counters, "step": self.step, "stepped_samples": self.stepped_samples,
                    "stepped_microbatches": len(self.stepped_mbs), **stage_memory(self.module, self.optimizer),
                    "runtime_rss_bytes": self.runtime_rss_bytes, "activation_bytes": self.activation_bytes})

    def background_tasks(self) -> list[asyncio.Task]:
        tasks = [asyncio.create_task(self.sync_forever()), asyncio.create_task(self.publish_forever())]
        if self.cfg.get("rebalance_period_s"):  # this peer decides moves with its stage's and the others' peers
            tasks.append(asyncio.create_task(PeerRebalancer(self, self.cfg["rebalance_period_s"]).run()))
        return tasks

    async def declare_forever(self) -> None:
        """``StagePeer``'s declaration, paused once this peer is leaving its stage (its record is withdrawn)."""
        key = stage_key(self.run_id, self.stage)
        while True:
            if not self.leaving:
                await self.node.store(key, subkey=self.uid, value=self.peer_id,
                                      expiration_time=get_dht_time() + RECORD_TTL_S)
            await asyncio.sleep(DECLARE_PERIOD_S)

    async def publish_forever(self) -> None:
        """This peer's progress record, every ``PROGRESS_PERIOD_S``, from a task of its own: the synchronisation
        loop publishes at each of its reads, but not while it all-reduces or downloads a state (seconds over a slow
        link), and a record that expired meanwhile made the other replicas count this one as gone and step
        without it."""
        counted = time.monotonic()
        while True:
            started = time.monotonic()
            try:
                await self._publish()
            except Exception as e:  # a DHT hiccup: the next period publishes again
                print(f"[{self.uid}] publishing the progress record failed: {e!r}", flush=True)
            if started - counted >= COUNTERS_PERIOD_S:   # a peer cut off from its stage steps no more, and its
                counted = started                        # calls served would otherwise not reach the file
                try:
                    self._write_counters()
                except OSError as e:   # a full disk or a removed folder: the next period tries again
                    print(f"[{self.uid}] writing its counters failed: {e!r}", flush=True)
            took = time.monotonic() - started
            if took > self.round_s:
                self.round_s = took
            await asyncio.sleep(PROGRESS_PERIOD_S)

    async def sync_forever(self) -> None:
        self.digest = await self._run(self._digest)
        while True:
            try:
                await self._round()
            except Exception as e:  # a DHT or transfer hiccup: the next round reads the records again
                print(f"[{self.uid}] sync round failed: {e!r}", flush=True)
                self.counters["failed_rounds"] += 1
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.nudge.wait(), PROGRESS_PERIOD_S)
            self.nudge.clear()

    async def _round(self) -> None:
        records = await self._read_records()
        if await self._catch_up(records):
            return
        at_step = {uid: r for uid, r in records.items() if r["step"] == self.step and uid != self.uid}
        if self.joining is not None and not any(r.get("ready") for r in at_step.values()):
            self.joining = None  # arrived and nobody is waiting: an ordinary member of its step now
        self.others_pending = sum(r["samples"] for r in at_step.values())
        self.others_carried = sum(int(r.get("carried", 0)) for r in at_step.values())
        pending = self.others_pending + self._held_samples()
        target = self._target()
        self.read_remaining, self.since_read = target - pending, 0
        self.read_rates = {uid: float(r.get("rate", 0.0)) for uid, r in at_step.items()} | {self.uid: self._rate()}
        self.read_stamp = min((float(r.get("t", 0.0)) for r in at_step.values()), default=float("inf"))
        ready = sorted(u for u, r in at_step.items() if r.get("ready"))
        if ready or pending >= target or (pending > 0 and await self._flushing()):
            # what this peer read when it stepped (the sync log's ``trigger``): the others' samples, its own, the
            # target, the replicas ready at its step, and whether the launcher's flush made it step short
            self.trigger = {"others": self.others_pending, "own": pending - self.others_pending, "target": target,
                            "ready": ready, "flush": not ready and pending < target}
            await self._step()
        elif self.step > self.shard_step and not self.writing:
            await self._flushing()  # the final shard waits for the launcher's flush record
            if self._writes_shard(records, at_step):
                self.writing = True
                self.write_task = asyncio.create_task(self._write_shard())

    async def _flushing(self) -> bool:
        if not self.flush_seen and time.monotonic() - self.flush_checked >= FLUSH_CHECK_S:
            self.flush_checked = time.monotonic()
            found = await self.node.get(flush_key(self.run_id), latest=True)
            self.flush_seen = found is not None and found.value is True
        return self.flush_seen

    def _writes_shard(self, records: dict[str, dict], at_step: dict[str, dict]) -> bool:
        """Whether this peer writes its stage's shard now: it is the lowest uid at the stage's latest step, its
        step has no shard yet, and ``checkpoint_every_s`` passed since its last write - or the launcher asked for
        the last batch and the stage holds no samples (the final shard)."""
        if self.step <= self.shard_step or self.step == 0:
            return False
        if min([uid for uid, r in records.items() if r["step"] == self.step] + [self.uid]) != self.uid:
            return False
        if time.monotonic() - self.last_write >= self.checkpoint_every_s:
            return True
        idle = self._held_samples() == 0 and not any(r["samples"] or r.get("ready") for r in at_step.values())
        return idle and self.flush_seen

    async def _write_shard(self) -> None:
        try:
            def save() -> tuple[Path, int]:   # on the compute thread: the state of one moment, streamed to the file
                state = self._state()
                return write_shard(self.shard_dir, self.stage, self.uid, state["step"], state), state["step"]

            path, step = await self._run(save)
            self.shard_step, self.last_write = step, time.monotonic()
            self.counters["shards_written"] += 1
            print(f"[{self.uid}] wrote {path.name}", flush=True)
            self._write_counters()   # the peak with this write (the final shard follows the last step)
        except Exception as e:  # a full disk or a removed folder: training goes on, the next period tries again
            print(f"[{self.uid}] writing the stage shard failed: {e!r}", flush=True)
            self.last_write = time.monotonic()
        finally:
            self.writing = False

    async def _catch_up(self, records: dict[str, dict]) -> bool:
        """Download the state of a replica that is ahead, or of the reference replica (lowest uid) at this step
        when the parameter digests differ (``catch_up_source``), publishing a ``joining`` record meanwhile so
        that the peers at that step wait for this one. Returns whether it did."""
        source, mismatch = catch_up_source(records, self.uid, self.step, self.digest)
        if source is None:
            return False
        self.counters["digest_mismatches"] += int(mismatch)
        lost = self._held_samples()
        self.joining = int(records[source]["step"])
        await self._publish()   # at once; publish_forever keeps it live while the download lasts
        try:
            step = await self.download_state(PeerID.from_base58(records[source]["peer"]))
        except BaseException:
            self.joining = None
            raise
        self.joining = step   # still on its way until it is ready at this step (_step) or nobody waits (_round)
        self.counters["lost_gradient_samples"] += lost
        self.counters["resyncs"] += 1
        print(f"[{self.uid}] took the state of {source} (step {step}); {lost} samples' gradients dropped", flush=True)
        await self._publish()   # at its new step at once: the peers waiting for it see it arrive
        self._write_counters()
        return True

    async def _gather(self, step: int) -> dict[str, dict] | None:
        """The ready records at ``step`` once every record at it is ready and no peer is downloading the state of
        ``step`` to join it (``GatherView.complete``), or once ``record_window_s`` (``GATHER_S`` on a fast network)
        passed since a peer was last awaited. A peer at ``step`` whose record is live but not ready is awaited for
        at most ``sync_timeout_s`` from the gather's start (it becomes ready at its next round, which over a slow
        link takes several DHT round trips; a dead one's record expires), a joining peer for at most
        ``state_timeout_s`` (its download's bound; the seconds are counted in ``joining_wait_s``). None once a
        replica is past ``step`` (this peer then catches up)."""
        started = waiting_from = time.monotonic()
        joiner_bound = state_timeout_s(self.num_params, self.link_mbit_s, self.sync_timeout_s)
        joiner_seen: float | None = None
        while True:
            view = GatherView(await self._read_records(), step, self.uid)
            window = record_window_s(self.round_s)
            if view.passed:
                return None
            now = time.monotonic()
            unready = view.unready
            joining = view.joining if now - started < joiner_bound else []
            if joining:
                if joiner_seen is None:
                    print(f"[{self.uid}] step {step}: waiting for {joining} to join it", flush=True)
                else:
                    self.counters["joining_wait_s"] += now - joiner_seen
                joiner_seen = now
            if joining or (unready and now - started < self.sync_timeout_s):
                waiting_from = now   # the window counts from the last moment a peer was awaited
            waited = now - waiting_from
            ready = view.ready
            if waited >= window and self.uid not in ready:  # this peer's own record not read back yet
                ready[self.uid] = {"peer": self.peer_id, "snap": self.ready[1], "loss": self.ready[2],
                                   "at": self.ready[3], "mbs": sorted(self.snapshot_mbs),
                                   "resent": self._resent_entries()}
            if self.uid in ready and ((view.complete() and now - started >= MIN_GATHER_S) or waited >= window):
                return ready
            await asyncio.sleep(0.1)

    async def _step(self) -> None:
        step = self.step
        phases = {"close": time.time()}
        # the snapshot holds the calls this peer computed; those admitted and not yet computed count toward the
        # next step (as in SWARM, where a peer's progress counts the samples it accumulated): waiting for them made
        # every replica wait for the slowest replica's queue at each step
        self.closing = True
        try:
            flat, samples = await self._run_next(self._take_snapshot, step)
        finally:
            self.closing = False
        phases["snapshot"] = time.time()
        self.ready = (step, samples, self.snapshot_loss, round(self._elapsed(), 3))
        self.joining = None   # a joiner that arrived is ready now: its record says so (_publish)
        attempts = 0
        while True:
            group = await self._gather(step)
            phases["gathered"], attempts = time.time(), attempts + 1
            if group is None:
                return  # someone stepped without this peer: the next round downloads its state
            uids = sorted(group)
            kept = resent_kept(group)   # re-sent microbatches: each counts once in the group (module docstring)
            kept_samples, kept_loss = resent_samples(group, kept)
            total = sum(int(group[uid]["snap"]) for uid in uids) + kept_samples
            if total == 0:  # nobody holds gradients (e.g. a flush after the last step): nothing to step, and
                self.ready = None  # the empty snapshot must not be reused by the next attempt
                await self._run_next(self._drop_snapshot)
                return
            group_id = hashlib.sha1("|".join([self.run_id, str(self.stage), str(step)] +
                                             [f"{uid}:{group[uid]['snap']}:{group[uid].get('at', 0.0)}"
                                              for uid in uids]).encode()).digest()
            peers = [PeerID.from_base58(group[uid]["peer"]) for uid in uids]
            traffic: dict = {}
            bound = averaging_timeout_s(self.num_params, len(peers), self.averaging_scheme, self.link_mbit_s,
                                        2 * self.sync_timeout_s)
            try:
                # a member without samples gets a weight of 1e-6, not 0: a reducer that (a sender having died)
                # finalises with the parts of such members alone would otherwise divide 0 by 0
                reduced, weight = self._with_resent(flat, samples, kept.get(self.uid, []))
                averaged = await asyncio.wait_for(
                    self._all_reduce(reduced, weight or ZERO_WEIGHT, group_id, peers, traffic), bound)
                if not bool(torch.isfinite(averaged).all()):  # every member got these values: all retry
                    raise FloatingPointError("the averaged gradient is not finite")
            except Exception as e:  # a member died, or read another group: read the records again
                print(f"[{self.uid}] step {step}: all-reduce over {uids} failed ({e!r}); retrying", flush=True)
                self.counters["failed_rounds"] += 1
                await asyncio.sleep(0.2 + 0.3 * random.random())
                continue
            phases["reduced"] = time.time()
            flat = None   # the snapshot goes with the step (_apply); a group of more than one holds the average
            elapsed = max(float(group[uid].get("at", 0.0)) for uid in uids)  # the group's, for a seconds budget
            t, _ = step_target(self.cfg["recipe"], self.seq_len, self.stepped_samples, step, elapsed)
            lr, multiplier = step_lr(self.cfg["recipe"], t, self.stepped_samples)
            self.averaged = (group_id, averaged)
            mbs = {int(i) for uid in uids for i in group[uid].get("mbs", ())} | {mb for m in kept.values() for mb in m}
            mine = set(kept.get(self.uid, []))
            apart = {mb: n for mb, (_, n, _) in self.snapshot_resent.items()}
            # as soon as the call computing ends, like the snapshot: behind the calls queued, a slow replica took
            # its step seconds after the others and was left out of their next group
            reply = await self._run_next(self._apply_counted, group_id, lr, total, mbs)
            if reply.get("status") != "ok":
                raise RuntimeError(f"step {step}: {reply}")
            self.digest, self.ready, self.others_pending, self.others_carried = reply["digest"], None, 0, 0
            # the next batch, dealt by the rates last read until this peer reads its replicas' counts again
            self.read_remaining, self.since_read = self._target() - self._held_samples(), 0
            self.counters["resent_kept_samples"] += sum(n for mb, n in apart.items() if mb in mine)
            self.counters["duplicate_samples"] += sum(n for mb, n in apart.items() if mb not in mine)
            phases["applied"] = time.time()
            with open(self.workdir / SYNC_LOG.format(uid=self.uid), "a") as log:
                log.write(json.dumps({"uid": self.uid, "stage": self.stage, "step": step + 1, "samples": samples,
                                      "group_samples": total, "group": len(uids), "attempts": attempts,
                                      "trigger": self.trigger,
                                      "last_backward": self.snapshot_backward if samples else None}
                                     | phases) + "\n")
            self.counters["steps_taken"] += 1
            self.counters["group_sizes"].append(len(uids))
            if len(uids) > 1:
                self.counters["averaging_bytes_sent"] += traffic.get("bytes_sent", 0)
                self.counters["averaging_values_sent"] += traffic.get("values_sent", 0)
                self.counters["averaging_param_steps"] += self.num_params
            if self.is_last:
                loss = (sum(float(group[uid].get("loss", 0.0)) for uid in uids) + kept_loss) / total
                row = {"step": step + 1, "progress": t, "loss": loss, "lr": lr,
                       "lr_multiplier": multiplier, "batch_sequences": total,
                       "tokens": self.stepped_samples * self.seq_len, "time": time.time(), "group": uids}
                with open(self.workdir / f"log-{self.uid}.jsonl", "a") as log:
                    log.write(json.dumps(row) + "\n")
            await self._publish()
            self._write_counters()
            return
