"""Stage peer of the launcher's swarm: in-stage steps decided by the stage's own peers, on SWARM's semantics.

No process tells the peers when to step. Every ``PROGRESS_PERIOD_S`` each peer publishes its progress record
(``progress.ProgressRecord``: step, samples accumulated toward it, rate, time) under its stage's DHT key and reads
its stage's records back, as hivemind's ``ProgressTracker`` does. It steps when

* the stage's collective samples, each record extrapolated by its rate (``progress.collective_samples``), reach
  the step's target batch (``progress.step_target``: the recipe's batch with pretrain's ramp, at the budget progress
  computed from the stage's stepped samples, so every replica computes the same batch and learning rate), or
* another peer at its step is ready, or the launcher asked for the last, partial batch (``flush_key``).

To step, a peer moves its accumulated gradients aside as soon as the call it computes ends (``_run_next``), marks
its record ready and gathers its group: the ready records at its step, once every live peer at the step is ready
and none is downloading the step's state to join it (``progress.GatherView``; at most ``record_window_s``, a
joiner at most its download's bound). The group is deterministic (ordered by uid; its id hashes the uids, sample
counts and training times), the gradients are all-reduced with ``averaging.StageAllReduce`` (compressed by
``swarm.averaging_compression``, weighted by samples, the same decompressed average on every member) and each
member clips and steps: replicas stay bitwise equal. Backward calls are never held: those that arrive while a step
averages accumulate toward the next one (``StageReplica.apply`` keeps them), so a step's batch is its target plus
what arrived meanwhile. The overshoot is logged per step (``SYNC_LOG``, ``progress.overshoot``).

Accounting is at least once, as in SWARM: a re-sent backward call or a microbatch retrained after a resume counts
again, counted (``duplicate_microbatches``, part of the state) rather than prevented. A peer that sees a replica
ahead, or whose digest differs from the lowest uid's at its step, downloads that replica's state (``_catch_up``;
its held gradients are lost and counted). The lowest uid at the stage's latest step writes the stage's shard
every ``checkpoint_every_s`` and once after the flush. A leaving peer (``peer_rebalance``) hands its held
gradients to a replica that stays. Per peer: counters in ``peer-<uid>.json``, one line per step in
``sync-<uid>.jsonl`` (phase wall times, target, group samples), on the last stage the loss log ``log-<uid>.jsonl``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
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

from cramswarm.io import write_json
from cramswarm.swarm.averaging import averaging_timeout_s, state_timeout_s
from cramswarm.swarm.hivemind_peer import StagePeer
from cramswarm.swarm.membership import flush_key, progress_key
from cramswarm.swarm.peer_rebalance import PeerRebalancer, call_units
from cramswarm.swarm.progress import (
    MIN_GATHER_S,
    PROGRESS_PERIOD_S,
    GatherView,
    ProgressRecord,
    catch_up_source,
    collective_samples,
    progress_records,
    read_clock,
    record_window_s,
    step_target,
    writes_shard,
)
from cramswarm.swarm.rebalancing import LoadMeter
from cramswarm.swarm.settings import ProcessConfig
from cramswarm.swarm.shards import load_shard, newest_shard, write_shard
from cramswarm.swarm.stages import stage_memory
from cramswarm.swarm.wire import respond, unpack
from cramswarm.training import step_lr

ZERO_WEIGHT = 1e-6        # all-reduce weight of a member without samples (see _step)
FLUSH_CHECK_S = 1.0       # a peer reads the launcher's flush record at most this often
SYNC_LOG = "sync-{uid}.jsonl"  # in the run's folder: one line per step a peer took (the step's phases)
RATE_WINDOW_S = 2.0       # a peer's published rate: backward samples it accumulated over this many seconds
ALONE_AFTER_S = 5.0       # a peer that loaded its stage's shard serves it once no other replica was declared this long
COUNTERS_PERIOD_S = 2.0   # a peer rewrites its counters file at least this often (also at steps and shard writes)


class SyncingStagePeer(StagePeer):
    """A ``StagePeer`` that serves its stage's forward and backward calls and steps with its stage's other peers by
    itself (see the module docstring)."""

    def __init__(self, cfg: ProcessConfig, stage: int, uid: str, speed: float, node):
        super().__init__(cfg, stage, uid, speed, node)
        self.meter = LoadMeter(time.monotonic())  # its own queue and service rate (peer_rebalance)
        self.seq_len = cfg.seq_len
        self.workdir = Path(cfg.workdir)
        self.peer_id = node.p2p.peer_id.to_base58()
        self.stepped_samples = 0
        self.stepped_repeats = 0   # microbatches the stage stepped again (at least once)
        self.local_loss = self.snapshot_loss = 0.0  # summed loss x samples (last stage) since / in the snapshot
        self.digest: str | None = None
        self.ready: tuple[int, int, float, float] | None = None  # (step, samples, loss sum, training seconds)
        self.clock_origin: float | None = None  # the run's training clock origin, once read
        self.arrivals: list[tuple[float, int]] = []   # (monotonic time, samples) of recent backward calls: _rate
        self.others: dict[str, ProgressRecord] = {}   # the other records at this peer's step, as last read
        self.wait_s = PROGRESS_PERIOD_S   # until the next read: the period, or sooner where the batch is due sooner
        self.trigger: dict | None = None   # what this peer read when it last stepped (the sync log's ``trigger``)
        self.joining: int | None = None  # the step whose state this peer downloads (_catch_up), and after it
                                   # arrived, until it is ready at that step or finds no peer ready there
        self.round_s = 0.0         # its recent DHT round (publish + read of its stage's records): record_window_s
        self.record_expiration = 0.0  # DHT time its last progress record expires
        self.nudge = asyncio.Event()  # wakes the synchronisation loop early (this peer's count reached the batch)
        self.last_backward: float | None = None      # wall time the last accumulated backward computation ended
        self.snapshot_backward: float | None = None  # ... of those in the snapshot
        self.counters = {"uid": uid, "stage": stage, "steps_taken": 0, "resyncs": 0, "digest_mismatches": 0,
                         "lost_gradient_samples": 0, "averaging_bytes_sent": 0, "averaging_values_sent": 0,
                         "averaging_param_steps": 0, "group_sizes": [], "failed_rounds": 0, "shards_written": 0,
                         "resent_samples": 0, "loaded_shard_step": None,
                         "served_from_shard_alone": None, "backward_samples": 0, "device": str(self.device),
                         "handed_over_samples": 0, "taken_over_samples": 0, "joining_wait_s": 0.0,
                         "slowest_dht_round_s": 0.0, "stale_gradient_samples": 0}
        self.stepped_mbs: set[int] = set()   # microbatches the stage stepped (a resume restarts the trainers there)
        self.local_mbs: list[int] = []       # ... accumulated here since the snapshot
        self.snapshot_mbs: list[int] = []    # ... in the snapshot
        self.shard_dir = Path(cfg.shard_dir)
        self.checkpoint_every_s = cfg.checkpoint_every_s
        self.shard_step, self.last_write, self.writing = 0, time.monotonic(), False
        self.flush_seen, self.flush_checked = False, 0.0
        newest = newest_shard(self.shard_dir, stage)
        if newest is not None:  # a resumed run (or a restart): start from the stage's last shard
            self._load_state(load_shard(newest[1], tuple(cfg.run_ids), self.device))
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
        """``StagePeer._backward``, accumulated toward the next step whatever the microbatch: one this peer holds or
        the stage stepped already (a re-sent call, or a resume's) counts again. Microbatches are held with their
        multiplicity; the step counts the repeats it steps (``duplicate_microbatches``)."""
        start = time.perf_counter()
        result, out_meta = super()._backward(tensors, meta)
        self.meter.served(call_units("backward", out_meta["samples"], self.is_last), time.perf_counter() - start)
        if "loss" in out_meta:
            self.local_loss += out_meta["loss"] * out_meta["samples"]
        if (mb := meta.get("mb")) is not None:
            self.local_mbs.append(int(mb))
        if meta.get("resent"):
            self.counters["resent_samples"] += int(out_meta["samples"])
        self.last_backward = time.time()
        return result, out_meta

    def _take_snapshot(self, step: int) -> tuple[torch.Tensor, int]:
        """``StageReplica.take_snapshot``; the loss sum, microbatches and time of the calls in it move along."""
        if self.replica.snapshot is None or self.replica.snapshot[0] != step:
            self.snapshot_loss, self.local_loss = self.local_loss, 0.0
            self.snapshot_mbs, self.local_mbs = self.local_mbs, []
            self.snapshot_backward, self.last_backward = self.last_backward, None
        return self.replica.take_snapshot(step)

    def _apply_counted(self, group_id: bytes, lr: float, samples: int, listed: list[int]) -> dict:
        """``_apply`` and, in the same compute-thread call, the stage's stepped samples and microbatches, so that a
        state taken for a download or a shard never holds a step without its counts."""
        reply = self._apply(group_id, lr)
        if reply.get("status") == "ok":
            mbs = set(listed)
            self.stepped_samples += samples
            self.stepped_repeats += len(listed) - len(mbs) + len(mbs & self.stepped_mbs)
            self.stepped_mbs |= mbs
            self.snapshot_mbs = []
        return reply

    def _take_held(self) -> tuple[dict, dict]:
        """The gradients accumulated since the last snapshot, moved out of this peer: one flat fp32 vector of their
        sum, with its step, samples, loss sum and microbatches."""
        flat, samples = self.replica.take_grads()
        meta = {"step": self.step, "samples": samples, "loss": self.local_loss, "mbs": sorted(self.local_mbs)}
        self.local_loss, self.local_mbs = 0.0, []
        return {"grad": flat}, meta

    def _add_held(self, tensors: dict, meta: dict) -> dict:
        """Add gradients another replica of this stage held (``_take_held``) to this peer's own, toward its next
        step; refused if they were computed at another step."""
        if int(meta["step"]) != self.step:
            return {"status": "refused", "reason": f"at step {self.step}, not {meta['step']}"}
        self.replica.add_grads(tensors["grad"], int(meta["samples"]))
        self.local_loss += float(meta["loss"])
        self.local_mbs.extend(int(i) for i in meta["mbs"])
        return {"status": "ok"}

    def _drop_snapshot(self) -> None:
        """End a step that stepped nothing."""
        self.replica.snapshot = None

    def _state(self) -> dict:
        """``StagePeer._state`` with the stage's stepped samples and microbatches, and the run's id."""
        return super()._state() | {"stepped_samples": self.stepped_samples, "stepped_mbs": sorted(self.stepped_mbs),
                                   "stepped_repeats": self.stepped_repeats, "run_id": self.run_id}

    def _load_state(self, state: dict) -> int:
        """``StagePeer._load_state``; the gradients this peer held are dropped (``lost_gradient_samples``), as in
        SWARM, except those it accumulated toward the step it loads (a state one step ahead: its group stepped
        while its own all-reduce failed), which it keeps, computed at the parameters before that step
        (``stale_gradient_samples``), like hivemind's delayed updates."""
        kept = self._take_held() if int(state["step"]) == self.step + 1 and self.replica.local_samples else None
        lost = self._held_samples()
        step = super()._load_state(state)
        self.stepped_samples = int(state.get("stepped_samples", 0))
        self.stepped_repeats = int(state.get("stepped_repeats", 0))
        self.stepped_mbs = {int(i) for i in state.get("stepped_mbs", [])}
        self.local_mbs, self.snapshot_mbs = [], []
        self.local_loss = self.snapshot_loss = 0.0
        self.ready = None
        self.digest = self.replica.digest()
        self.counters["lost_gradient_samples"] += lost
        if kept is not None:
            tensors, meta = kept
            self._add_held(tensors, meta | {"step": step})
            self.counters["stale_gradient_samples"] += int(meta["samples"])
        return step

    async def _source_order(self, sources: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """(uid, peer id) of the replicas to download from, in the order to try them: the newest first (by the step
        of its progress record; ties, and replicas without a record, at random), as hivemind's
        ``load_state_from_peers`` takes the most advanced peer."""
        shuffled = await super()._source_order(sources)
        with contextlib.suppress(Exception):
            steps = {uid: record.step for uid, record in (await self._read_records()).items()}
            return sorted(shuffled, key=lambda source: -steps.get(source[0], -1))
        return shuffled

    def _stepping(self) -> bool:
        """Whether this peer took its step's snapshot and has not applied the step yet."""
        return self.replica.snapshot is not None and self.replica.snapshot[0] == self.step

    def _held_samples(self) -> int:
        """Samples whose gradients this peer holds toward its current step (snapshot and since)."""
        return self.replica.local_samples + (self.replica.snapshot[2] if self._stepping() else 0)

    def busy(self) -> bool:
        """Calls waiting or computing, or a step under way (a leaving peer hands over its gradients only when not)."""
        return bool(self.meter.queue) or self.ready is not None or self._stepping()

    def _elapsed(self) -> float:
        """Seconds of training so far (0 before the launcher started the trainers): a seconds budget's clock."""
        if self.clock_origin is None:
            self.clock_origin = read_clock(self.workdir, self.run_id)["origin_wall"]
        return max(0.0, time.time() - self.clock_origin) if self.clock_origin is not None else 0.0

    def _target(self) -> int:
        """The target batch of this peer's step (``progress.step_target``)."""
        return step_target(self.cfg.recipe, self.seq_len, self.stepped_samples, self.step, self._elapsed())[1]

    def _estimate(self) -> float:
        """The stage's collective samples toward this peer's step now (``progress.collective_samples`` of the other
        records at the step as last read, and this peer's own count)."""
        return collective_samples(self.others, self._held_samples(), get_dht_time())

    def _rate(self) -> float:
        """Backward samples this peer accumulated per second over the last ``RATE_WINDOW_S`` (its published rate)."""
        since = time.monotonic() - RATE_WINDOW_S
        self.arrivals = [(t, n) for t, n in self.arrivals if t >= since]
        return sum(n for _, n in self.arrivals) / RATE_WINDOW_S

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

    async def rpc_backward(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                           context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """``StagePeer._backward``, never held for the stage's step; a peer leaving its stage refuses the call.
        Once the stage's estimated count reaches the batch the synchronisation loop is woken."""
        tensors, meta = await unpack(requests)
        self._refuse_if_leaving()
        result, out_meta = await self._metered(self._backward, tensors, meta)
        samples = int(out_meta["samples"])
        self.arrivals.append((time.monotonic(), samples))
        self.counters["backward_samples"] += samples  # what the trainers' routing gave this peer
        if self._estimate() >= self._target():
            self.nudge.set()
        for message in respond(result, out_meta):
            yield message

    async def rpc_handover(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                           context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """A replica leaving this stage (``peer_rebalance``) hands this peer the gradients it holds."""
        tensors, meta = await unpack(requests)
        if self.leaving or self.ready is not None:
            reply = {"status": "refused", "reason": "leaving or stepping"}
        else:
            reply = await self._run(self._add_held, tensors, meta)
        if reply["status"] == "ok":
            self.counters["taken_over_samples"] += int(meta["samples"])
            self.nudge.set()
        for message in respond({}, reply):
            yield message

    # -- records ----------------------------------------------------------------------------------------------
    def _record(self) -> ProgressRecord:
        record = ProgressRecord(step=self.step, peer=self.peer_id, samples=self._held_samples(), rate=self._rate(),
                                t=get_dht_time(), stepped=self.stepped_samples, digest=self.digest)
        if self.ready is not None and self.ready[0] == self.step:
            _, snap, loss, at = self.ready
            return dataclasses.replace(record, ready=True, snap=snap, loss=loss, at=at,
                                       mbs=tuple(sorted(self.snapshot_mbs)))
        if self.joining is not None:  # held gradients go with the download: they count toward no step
            return dataclasses.replace(record, joining=self.joining, samples=0, rate=0.0)
        return record

    async def _publish(self) -> None:
        # later records expire later, so the latest stored value wins even where the window shrank meanwhile
        self.record_expiration = max(get_dht_time() + record_window_s(self.round_s), self.record_expiration + 1e-3)
        await self.node.store(progress_key(self.run_id, self.stage), subkey=self.uid, value=self._record().value(),
                              expiration_time=self.record_expiration)

    async def _read_records(self) -> dict[str, ProgressRecord]:
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
                    "duplicate_microbatches": self.stepped_repeats, "stepped_microbatches": len(self.stepped_mbs),
                    **stage_memory(self.replica.module, self.replica.optimizer),
                    "runtime_rss_bytes": self.runtime_rss_bytes, "activation_bytes": self.replica.activation_bytes})

    def background_tasks(self) -> list[asyncio.Task]:
        """Tasks the peer runs while it serves: its in-stage synchronisation loop, its record and, with
        ``rebalance_period_s``, its ``PeerRebalancer``."""
        tasks = [asyncio.create_task(self.sync_forever()), asyncio.create_task(self.publish_forever())]
        if self.cfg.rebalance_period_s:  # this peer decides moves with its stage's and the others' peers
            tasks.append(asyncio.create_task(PeerRebalancer(self, self.cfg.rebalance_period_s).run()))
        return tasks

    async def publish_forever(self) -> None:
        """This peer's progress record every ``PROGRESS_PERIOD_S``, from a task of its own (the synchronisation loop
        does not publish while it all-reduces or downloads, seconds over a slow link, and an expired record makes
        the other replicas step without this one), and its counters file every ``COUNTERS_PERIOD_S``."""
        counted = time.monotonic()
        while True:
            started = time.monotonic()
            try:
                await self._publish()
            except Exception as e:  # a DHT hiccup: the next period publishes again
                print(f"[{self.uid}] publishing the progress record failed: {e!r}", flush=True)
            if started - counted >= COUNTERS_PERIOD_S:
                counted = started
                try:
                    self._write_counters()
                except OSError as e:   # a full disk or a removed folder: the next period tries again
                    print(f"[{self.uid}] writing its counters failed: {e!r}", flush=True)
            took = time.monotonic() - started
            if took > self.round_s:
                self.round_s = took
            await asyncio.sleep(PROGRESS_PERIOD_S)

    async def sync_forever(self) -> None:
        self.digest = await self._run(self.replica.digest)
        while True:
            try:
                await self._round()
            except Exception as e:  # a DHT or transfer hiccup: the next round reads the records again
                print(f"[{self.uid}] sync round failed: {e!r}", flush=True)
                self.counters["failed_rounds"] += 1
                self.wait_s = PROGRESS_PERIOD_S
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.nudge.wait(), self.wait_s)
            self.nudge.clear()

    async def _round(self) -> None:
        records = await self._read_records()
        if await self._catch_up(records):
            return
        at_step = {uid: r for uid, r in records.items()
                   if r.step == self.step and r.joining is None and uid != self.uid}
        if self.joining is not None and not any(r.ready for r in at_step.values()):
            self.joining = None  # arrived and nobody is waiting: an ordinary member of its step now
        self.others, own, target = at_step, self._held_samples(), self._target()
        estimate = self._estimate()
        ready = sorted(u for u, r in at_step.items() if r.ready)
        # the next read when the stage's rate says the batch is due (ProgressTracker's ETA), at most a period away
        rate = self._rate() + sum(r.rate for r in at_step.values() if not r.ready)
        self.wait_s = min(PROGRESS_PERIOD_S, max(0.01, (target - estimate) / rate)) if rate > 0 else PROGRESS_PERIOD_S
        held = own + sum(r.snap if r.ready else r.samples for r in at_step.values())   # as published, unextrapolated
        if ready or estimate >= target or (held > 0 and await self._flushing()):
            self.trigger = {"estimate": round(estimate, 1), "own": own, "target": target, "ready": ready,
                            "flush": not ready and estimate < target}
            self.wait_s = 0.0   # the next step's count is read at once: calls went on meanwhile
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

    def _writes_shard(self, records: dict[str, ProgressRecord], at_step: dict[str, ProgressRecord]) -> bool:
        """Whether this peer writes its stage's shard now (``progress.writes_shard``)."""
        idle = self._held_samples() == 0 and not any(r.samples or r.ready for r in at_step.values())
        return writes_shard(self.uid, self.step, self.shard_step, records,
                            time.monotonic() - self.last_write >= self.checkpoint_every_s, idle and self.flush_seen)

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

    async def _catch_up(self, records: dict[str, ProgressRecord]) -> bool:
        """Download the state of a replica that is ahead, or of the reference replica (lowest uid) at this step
        when the parameter digests differ (``progress.catch_up_source``), publishing a ``joining`` record meanwhile
        so that the peers at that step wait for this one. Returns whether it did."""
        source, mismatch = catch_up_source(records, self.uid, self.step, self.digest)
        if source is None:
            return False
        self.counters["digest_mismatches"] += int(mismatch)
        self.joining = records[source].step
        await self._publish()   # at once; publish_forever keeps it live while the download lasts
        try:
            step = await self.download_state(PeerID.from_base58(records[source].peer))
        except BaseException:
            self.joining = None
            raise
        self.joining = step   # still on its way until it is ready at this step (_step) or nobody waits (_round)
        self.counters["resyncs"] += 1
        print(f"[{self.uid}] took the state of {source} (step {step})", flush=True)
        await self._publish()   # at its new step at once: the peers waiting for it see it arrive
        self._write_counters()
        return True

    async def _gather(self, step: int) -> dict[str, ProgressRecord] | None:
        """The ready records at ``step`` once every record at it is ready, no peer is downloading the state of
        ``step`` to join it (``GatherView.complete``), none still shows the step before (a member of the last group
        applying it) and ``MIN_GATHER_S`` passed; or once ``record_window_s`` passed since a peer was last awaited.
        A live peer unready at ``step``, behind it, or seen at it (at the trigger or an earlier read) but missing from
        this read is awaited for at most ``sync_timeout_s`` from the gather's start, a joining one for at most
        ``state_timeout_s`` (its download's bound; counted in ``joining_wait_s``). None once a replica is past
        ``step`` (this peer then catches up)."""
        started = waiting_from = time.monotonic()
        joiner_bound = state_timeout_s(self.replica.num_params, self.link_mbit_s, self.sync_timeout_s)
        joiner_seen: float | None = None
        seen = {uid for uid in self.others if uid != self.uid}   # at this step when it was triggered
        while True:
            view = GatherView(await self._read_records(), step, self.uid)
            if view.passed:
                return None
            seen |= set(view.at_step) - {self.uid}
            # one DHT read that lacks a live peer's record (lapsed, unpropagated) must not make a smaller group
            missing = sorted(seen - set(view.at_step) - set(view.behind) - set(view.joining))
            now = time.monotonic()
            joining = view.joining if now - started < joiner_bound else []
            if joining:
                if joiner_seen is None:
                    print(f"[{self.uid}] step {step}: waiting for {joining} to join it", flush=True)
                else:
                    self.counters["joining_wait_s"] += now - joiner_seen
                joiner_seen = now
            if joining or ((view.unready or view.behind or missing) and now - started < self.sync_timeout_s):
                waiting_from = now   # the window counts from the last moment a peer was awaited
            waited = now - waiting_from
            ready = view.ready
            if waited >= record_window_s(self.round_s) and self.uid not in ready:  # its own not read back yet
                ready[self.uid] = self._record()
            settled = view.complete() and not view.behind and not missing and now - started >= MIN_GATHER_S
            if self.uid in ready and (settled or waited >= record_window_s(self.round_s)):
                return ready
            await asyncio.sleep(0.02)

    async def _step(self) -> None:
        step = self.step
        phases = {"close": time.time()}
        flat, samples = await self._run_next(self._take_snapshot, step)   # later calls count toward the next step
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
            total = sum(group[uid].snap for uid in uids)
            if total == 0:  # nobody holds gradients (e.g. a flush after the last step): nothing to step
                self.ready = None
                await self._run_next(self._drop_snapshot)
                return
            group_id = hashlib.sha1("|".join([self.run_id, str(self.stage), str(step)] + [
                f"{uid}:{group[uid].snap}:{group[uid].at}" for uid in uids]).encode()).digest()
            peers = [PeerID.from_base58(group[uid].peer) for uid in uids]
            traffic: dict = {}
            bound = averaging_timeout_s(self.replica.num_params, len(peers), self.averaging_scheme, self.link_mbit_s,
                                        2 * self.sync_timeout_s)
            try:
                # a member without samples weighs 1e-6, not 0: a reducer that (a sender having died) finalises with
                # the parts of such members alone would otherwise divide 0 by 0
                averaged = await asyncio.wait_for(
                    self._all_reduce(flat, samples or ZERO_WEIGHT, group_id, peers, traffic), bound)
                if not bool(torch.isfinite(averaged).all()):  # every member got these values: all retry
                    raise FloatingPointError("the averaged gradient is not finite")
            except Exception as e:  # a member died, or read another group: read the records again
                print(f"[{self.uid}] step {step}: all-reduce over {uids} failed ({e!r}); retrying", flush=True)
                self.counters["failed_rounds"] += 1
                await asyncio.sleep(0.2 + 0.3 * random.random())
                continue
            phases["reduced"] = time.time()
            flat = None   # the snapshot goes with the step (_apply); a group of more than one holds the average
            elapsed = max(group[uid].at for uid in uids)  # the group's training time, for a seconds budget
            t, target = step_target(self.cfg.recipe, self.seq_len, self.stepped_samples, step, elapsed)
            lr, multiplier = step_lr(self.cfg.recipe, t, self.stepped_samples)
            self.averaged = (group_id, averaged)
            # at least once: a microbatch twice in the group's snapshots (one member's or two), or stepped
            # before, counts again (every member reads the same records: the replicas' counts stay equal)
            listed = [mb for uid in uids for mb in group[uid].mbs]
            reply = await self._run_next(self._apply_counted, group_id, lr, total, listed)
            if reply.get("status") != "ok":
                raise RuntimeError(f"step {step}: {reply}")
            self.digest, self.ready, self.others = reply["digest"], None, {}
            phases["applied"] = time.time()
            with open(self.workdir / SYNC_LOG.format(uid=self.uid), "a") as log:
                log.write(json.dumps({"uid": self.uid, "stage": self.stage, "step": step + 1, "samples": samples,
                                      "group_samples": total, "target": target, "group": len(uids),
                                      "attempts": attempts, "trigger": self.trigger,
                                      "flush": bool(self.trigger and self.trigger["flush"]),
                                      "last_backward": self.snapshot_backward if samples else None}
                                     | phases) + "\n")
            self.counters["steps_taken"] += 1
            self.counters["group_sizes"].append(len(uids))
            if len(uids) > 1:
                self.counters["averaging_bytes_sent"] += traffic.get("bytes_sent", 0)
                self.counters["averaging_values_sent"] += traffic.get("values_sent", 0)
                self.counters["averaging_param_steps"] += self.replica.num_params
            if self.is_last:
                loss = sum(group[uid].loss for uid in uids) / total
                row = {"step": step + 1, "progress": t, "loss": loss, "lr": lr, "lr_multiplier": multiplier,
                       "batch_sequences": total, "target_sequences": target,
                       "tokens": self.stepped_samples * self.seq_len, "time": time.time(), "group": uids}
                with open(self.workdir / f"log-{self.uid}.jsonl", "a") as log:
                    log.write(json.dumps(row) + "\n")
            await self._publish()
            self._write_counters()
            return
