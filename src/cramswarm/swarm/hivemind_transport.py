"""Transport 1: SWARM on real hivemind processes (localhost, or any hosts that share the address file).

Two ways to run a swarm: ``run_swarm`` hands a plan with ``decentralised`` set to the launcher (``launcher``:
independent trainer processes, in-stage steps decided by the stage peers, no process whose state training needs;
``train`` sets it wherever ``decentralised_supported`` allows; there the stage peers also decide rebalancing,
``peer_rebalance``; its trainers make their own microbatches from a source, ``data``; the local and srun
placements), and runs every other plan - the attach placement, a plan without a microbatch source, the throughput
emulation of ``run`` - with the coordinator below (its srun code, one job step of all peers, serves those plans
only when ``train`` is given no source).
The trainers' call and microbatch code is ``trainer.StageClient`` in both; the coordinator adds its window
through StageClient's hooks.

Coordinator process layout (every process its own process-group leader, ``start_new_session=True``, killed as a
group with ``os.killpg`` so no ``p2pd`` daemon or child outlives it):

* bootstrap - ``python -m cramswarm.swarm.hivemind_peer bootstrap``: a DHT node (+ its p2pd) that writes its
  visible multiaddrs to the run's address file; everybody else joins through that file.
* stage peers - ``python -m cramswarm.swarm.hivemind_peer stage``: one process (+ p2pd) per replica, serving one
  stage module over hivemind P2P streams and declaring ``uid -> peer id`` under the stage's DHT key every 2 s
  (record TTL 10 s).
* coordinator - this process (the caller of ``train``): a client-mode DHT node (+ p2pd) and an asyncio loop
  running the trainers, the in-stage synchronisation, the fault injector and the restarts.

Trainers (``trainers`` coroutines in the coordinator, one microbatch in flight each, sharing one
``policies.StageBalancer`` per stage as trainer threads of one process would; DHT records re-read every second)
take microbatches from the emulation's dispatcher (the same budget, batch-size ramp and LR-progress accounting
as ``pretrain``), wrap every RPC in ``asyncio.wait_for`` (``RetryPolicy``: hivemind has no client-side
timeout), re-send to another replica on a timeout or error (errors ban the peer until its record expires) and
never drop a microbatch: a call waits for a live peer up to ``give_up_after_s`` and then raises
``NoPeersError`` naming the stage. Activations travel trainer -> peer -> trainer (the trainer is the hub, as in
SWARM's code), compressed by the producing peer with ``compression.encode`` and passed on unchanged; the
trainer keeps each stage's input payload, and the backward call re-sends it with the output gradient to any
replica, which recomputes the stage forward. The last stage's forward and backward are one call (its output
gradient is the constant 1; SWARM's trainer makes two).

In-stage synchronisation (SWARM's synchronous step, driven by the coordinator): backward calls are admitted
toward the stage's current global batch (``recipe`` batch, with pretrain's ramp) and counted per replica in a
``policies.StageSync``; once it is full, no further backward call is admitted, the coordinator waits for those
in flight and runs two phases on the stage's live replicas: ``reduce`` (each replica snapshots its accumulated
gradient, divides it by its local sample count and all-reduces it with hivemind's ``AllReduceRunner`` weighted
by that count - the butterfly all-reduce of ``DecentralizedAverager`` without its matchmaking: the coordinator
names the group; compressed by ``swarm.averaging_compression``, every replica receiving the same decompressed
average, see ``averaging``; the coordinator's timeout grows with the stage's parameters, the group size and
``swarm.link_mbit_s``) and, only if every replica of the
group succeeded, ``commit`` (per-stage clipping, the schedule's LR at the step's planned progress, AdamW step:
the same step everywhere, so replicas stay bitwise equal; the commit replies carry parameter digests, and a
replica that differs takes the state of the first). A failed reduce (a replica died or timed out) is
retried without it; a dead replica's unaveraged gradient is lost, as in SWARM (``lost_gradient_samples``).
Other stages keep running (no cross-stage barrier). A live replica left out of a step (lagging step count after
a state download, reduce timeout, failed commit) re-downloads the state from a replica that stepped.

Fault injection (``kill_every_s``): the coordinator SIGKILLs a random peer's process group - never the last
declared replica of a stage, whose state would be lost - and starts a fresh peer (new uid) for the same stage
``rejoin_after_s`` later; it downloads the stage's parameters and optimizer state from a live replica before it
declares itself. Rebalancing (``rebalance_period_s``) moves a peer the same way: the coordinator feeds in-flight
calls and measured throughputs to ``policies.Rebalancer``; the mover is stopped and a peer of the same speed starts
on the recipient stage with a state download.

``run(setup)`` runs an ``emulation.SwarmSetup`` on the same machinery with emulated compute
(``hivemind_peer.EmulatedStagePeer``) and returns the throughput result keys of ``emulation.run`` / ``sim.run``
(``benchmarks/swarm_hivemind.py`` compares it with the simulator).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time
from tqdm.auto import tqdm

from cramswarm.swarm import averaging
from cramswarm.swarm.compression import COMPRESSIONS
from cramswarm.swarm.emulation import (
    BACKWARD_COMPUTE_FACTOR,
    Dispatcher,
    FailureEvent,
    SwarmSetup,
    TrainResult,
)
from cramswarm.swarm.hivemind_peer import (
    ADDR_FILE,
    CONFIG_FILE,
    DECLARE_PERIOD_S,
    DONE_FILE,
    RECORD_TTL_S,
    BootstrapError,
    EmulatedStagePeer,
    StagePeer,
    coordinator_key,
    join_dht,
    listen_host,
    read_addr_file,
    stage_records,
)
from cramswarm.swarm.policies import (
    ROUTINGS,
    NoPeersError,
    PeerLoad,
    Rebalancer,
    RetryPolicy,
    StageSync,
    make_balancer,
)
from cramswarm.swarm.processes import (  # noqa: F401 (leftover_processes, _LIVE_GROUPS, visible_gpus: the tests' names)
    _LIVE_GROUPS,
    PEER_MODULE,
    PeerProcess,
    ProcessGroups,
    leftover_processes,
    own_daemons,
    peer_gpu,
    visible_gpus,
)
from cramswarm.swarm.stages import (
    build_swarm_model,
    check_memory_cap,
    check_stage_count,
    split_model,
    stage_state_bytes,
)
from cramswarm.swarm.trainer import StageClient
from cramswarm.training import lr_multiplier

REFRESH_PERIOD_S = 1.0  # trainers re-read the stages' DHT records this often
PLACEMENTS = ("local", "attach", "srun")  # who starts the stage peers (SwarmPlan.placement)


@dataclass
class SwarmPlan:
    """Everything a hivemind swarm run needs (``train`` builds it from the ``swarm:`` config section)."""

    arch: dict
    vocab_size: int
    recipe: dict
    peers_per_stage: list[int]
    peer_speeds: list[float] = field(default_factory=lambda: [1.0])
    trainers: int = 2
    compression: str = "blockwise8"
    averaging_compression: str = "fp16"  # in-stage all-reduce: none | fp16 | 8bit (averaging.SCHEMES)
    link_mbit_s: float = 100.0      # assumed link speed of a peer; the averaging and state timeouts grow with it
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    kill_every_s: float | None = None
    rejoin_after_s: float = 5.0
    rebalance_period_s: float | None = None
    seed: int = 0
    addr_file: Path | None = None   # join an existing swarm's bootstrap instead of starting one
    placement: str = "local"        # local: start the processes here | attach: wait for peers started elsewhere
                                    # (`swarm-peer` tasks) | srun: the launcher starts each process as its own job
                                    # step (srun.SrunPlacement; the coordinator: the peers as one srun job step)
    rendezvous: Path | None = None  # attach/srun: folder for config.json + dht_addrs.txt, on a shared filesystem
    host: str = "127.0.0.1"         # IPv4 address every process listens on (0.0.0.0: all interfaces)
    interface: str | None = None    # listen on this network interface's IPv4 address instead (looked up per host)
    srun_args: list[str] = field(default_factory=list)  # srun: extra options of the peers' job step(s)
    coordinator_grace_s: float = 30.0  # attach/srun processes exit once this process's heartbeat is missing this long
    emulate: dict | None = None     # throughput emulation (``run``): stage_time_s, backward_factor, activation_bytes
    startup_timeout_s: float = 180.0
    join_timeout_s: float = 15.0
    decentralised: bool = False     # run under the launcher (independent trainers, peer-driven steps), not the
                                    # coordinator; train() sets it where decentralised_supported() allows
    faults: list[tuple[float, str]] = field(default_factory=list)  # launcher: SIGKILL (seconds into training,
                                    # "bootstrap" | "trainer<R>" | "peer" | "stage<S>") - the kill tests' faults;
                                    # other targets go to ``hosts.fault`` (e.g. "cut:<host>": a testbed link cut)
    state_dir: Path | None = None   # launcher: resumable run folder (stage shards, trainer progress); None: temporary
    checkpoint_every_s: float = 60.0  # launcher: seconds between a stage's shard writes (and one at the end)
    hosts: object | None = None     # launcher: where each process runs (``ProcessGroups.place``; None: here);
                                    # ``cramswarm.testbed.swarm.HostPlacement`` puts each on a testbed host
    peer_memory_cap_mb: float | None = None  # most MiB of model state a stage peer may hold (None: no cap)
    routing: str = "weighted"       # the trainers' routing over a stage's peers: weighted (StageBalancer, by
                                    # measured throughput) | uniform (UniformBalancer: the routing benchmark's baseline)
    peer_unit_time_s: float | None = None  # launcher: a stage call computes at least this x its work units (forward
                                    # 1, backward 2, fused last 3) at speed 1, the rest slept: peers' speeds hold on a
                                    # loaded host (None: the measured compute alone, x 1/speed)

    @property
    def stages(self) -> int:
        return len(self.peers_per_stage)

    @property
    def sync_timeout_s(self) -> float:
        return max(4.0, self.retry.forward_timeout_s)

    @property
    def peers(self) -> int:
        return sum(self.peers_per_stage)

    def validate(self) -> None:
        if self.peer_unit_time_s is not None and not self.peer_unit_time_s > 0:
            raise ValueError(f"swarm peer_unit_time_s={self.peer_unit_time_s!r}: must be positive seconds or None")
        if self.routing not in ROUTINGS:
            raise ValueError(f"swarm routing={self.routing!r}; allowed: {', '.join(ROUTINGS)}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"swarm.placement={self.placement!r}; allowed: {', '.join(PLACEMENTS)}")
        if self.placement != "local" and self.rendezvous is None:
            raise ValueError(f"swarm.placement={self.placement} needs a rendezvous folder on a filesystem the "
                             "peers share (swarm-pretrain --rendezvous)")
        if self.placement == "srun" and "SLURM_JOB_ID" not in os.environ:
            raise ValueError("swarm.placement=srun starts the peers as a job step of the SLURM job it runs in, but "
                             "SLURM_JOB_ID is unset: run it through profiles/slurm (or placement: local / attach)")


def stage_parameter_counts(arch: dict, vocab_size: int, stages: int, compression: str = "none") -> list[int]:
    """Trainable parameters of each stage (a narrowing ``compression``'s boundary layers included), counted on a
    model built on the meta device (no memory, and the global RNG is left as it was)."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = build_swarm_model(arch, vocab_size, 0, stages, compression)
    return [sum(p.numel() for p in stage.parameters() if p.requires_grad) for stage in split_model(model, stages)]


def rank_of_uid(uid: str) -> int | None:
    """The rank in a ``swarm-peer`` task's uid (``s<stage>r<rank>.<incarnation>``); None for local peers."""
    head, _, rest = uid.partition("r")
    return int(rest.split(".")[0]) if rest and head.startswith("s") and "." in rest else None


class Coordinator(StageClient):
    """Runs one swarm: processes, trainers, in-stage synchronisation, fault injection, state collection."""

    def __init__(self, plan: SwarmPlan, batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
                 total_microbatches: int, progress: bool):
        self.plan, self.batches, self.total = plan, batches, total_microbatches
        self.stages, self.retry = plan.stages, plan.retry  # StageClient's
        self.dispatcher: Dispatcher | None = None  # made when the swarm is up (a seconds budget starts then)
        self.progress = progress
        self.rng = random.Random(plan.seed)
        self.workdir = Path(tempfile.mkdtemp(prefix="cramswarm-hivemind-"))
        self.run_id = f"cs{os.getpid()}x{self.rng.getrandbits(32):08x}"
        self.groups = ProcessGroups(self.workdir)
        self.local = plan.placement == "local"
        self.folder = self.workdir if self.local else Path(plan.rendezvous)  # config.json + dht_addrs.txt
        self.host = listen_host({"host": plan.host, "interface": plan.interface})
        self.phase = "starting"                  # the heartbeat's value: starting | training | done
        self.srun: subprocess.Popen | None = None
        self.seen: set[str] = set()              # attach/srun: uids declared so far
        self.retired: set[str] = set()           # uids killed or moved: their DHT records are ignored until expiry
        self.pending_moves: dict[int, int] = {}  # attach/srun: rank -> stage it was asked to move to
        self.training = plan.emulate is None
        self.peer_cls = StagePeer if self.training else EmulatedStagePeer
        self.node: DHTNode | None = None
        stages = plan.stages
        self.balancers = [make_balancer(plan.routing, s, random.Random(plan.seed * 1000 + s)) for s in range(stages)]
        self.syncs = [StageSync(plan.recipe["batch_sequences"]) for _ in range(stages)]
        self.peer_ids: dict[str, str] = {}       # uid -> base58 peer id
        self.records: list[dict[str, float]] = [{} for _ in range(stages)]
        self.target = plan.recipe["batch_sequences"]
        self.window_open = [asyncio.Event() for _ in range(stages)]
        self.reserved = [0] * stages             # samples of backward calls admitted toward the current step
        self.backward_inflight = [0] * stages
        self.syncing = [False] * stages
        self.steps = [0] * stages
        self.known_steps: dict[str, int] = {}   # uid -> step count the replica last reported or reached
        self.resyncing: set[str] = set()
        self.inflight: dict[str, int] = {}       # uid -> calls in flight (queue length for the rebalancer)
        self.done = 0
        self.window: list[float] = []
        self.log: list[dict] = []
        self.timeline: list[tuple[float, int]] = []
        self.stats = {"retries": 0, "timeouts": 0, "errors": 0, "peers_killed": 0, "rejoins": 0, "moves": [],
                      "moves_completed": 0, "rollbacks": [], "catch_ups": [],
                      "stage_steps": [0] * stages, "lost_gradient_samples": 0, "resyncs": 0,
                      "sync_retries": 0, "killed": [],
                      "digest_mismatches": 0, "peer_devices": {},
                      # in-stage all-reduce traffic, per stage, summed over the replicas of groups of >= 2
                      "averaging_bytes_sent": [0] * stages, "averaging_values_sent": [0] * stages,
                      "averaging_param_steps": [0] * stages}
        self.stage_params = (stage_parameter_counts(plan.arch, plan.vocab_size, stages, plan.compression)
                             if self.training else [0] * stages)
        self.tasks: set[asyncio.Task] = set()
        self.start = time.perf_counter()
        self.next_uid = 0
        self.bar = None

    # -- processes ------------------------------------------------------------------------------------------
    def _new_uid(self, stage: int) -> str:
        self.next_uid += 1
        return f"s{stage}p{self.next_uid}"

    def _start_peer(self, stage: int, speed: float, load_state: bool) -> PeerProcess:
        uid = self._new_uid(stage)
        device = self.plan.recipe.get("device", "cpu") if self.training else "cpu"
        return self.groups.start_peer(uid, stage, speed, self.folder / CONFIG_FILE, self.addr_file, load_state,
                                      gpu=peer_gpu(self.next_uid, device))

    def _write_config(self) -> None:
        """The peers' config.json (attach/srun: first clearing a rendezvous folder of an earlier run)."""
        p = self.plan
        cfg = {"run_id": self.run_id, "arch": p.arch, "vocab_size": p.vocab_size, "recipe": p.recipe,
               "stages": p.stages, "compression": p.compression, "sync_timeout_s": self.sync_timeout_s,
               "averaging_compression": p.averaging_compression, "link_mbit_s": p.link_mbit_s,
               "join_timeout_s": p.join_timeout_s, "give_up_after_s": p.retry.give_up_after_s, "host": p.host,
               "interface": p.interface, "placement_specs": [list(spec) for spec in self._initial_specs()],
               "rejoin_after_s": p.rejoin_after_s, "coordinator_grace_s": p.coordinator_grace_s,
               "peer_memory_cap_mb": p.peer_memory_cap_mb}
        if p.emulate is not None:
            cfg["emulate"] = p.emulate
        self.folder.mkdir(parents=True, exist_ok=True)
        for name in (ADDR_FILE, CONFIG_FILE, DONE_FILE):
            (self.folder / name).unlink(missing_ok=True)
        tmp = self.folder / f".{CONFIG_FILE}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(cfg))
        os.replace(tmp, self.folder / CONFIG_FILE)

    @property
    def sync_timeout_s(self) -> float:
        return self.plan.sync_timeout_s

    def _reduce_timeout_s(self, stage: int, group_size: int) -> float:
        """Bound on one replica's reduce call: the stage's all-reduce at ``link_mbit_s`` (``averaging``)."""
        return averaging.averaging_timeout_s(self.stage_params[stage], group_size, self.plan.averaging_compression,
                                             self.plan.link_mbit_s, 2 * self.sync_timeout_s)

    def _state_timeout_s(self, stage: int) -> float:
        """Bound on a state download of the stage (a replica's own bound, plus ``sync_timeout_s``)."""
        return averaging.state_timeout_s(self.stage_params[stage], self.plan.link_mbit_s, 2 * self.sync_timeout_s)

    def _check_started(self, peers: list[PeerProcess]) -> None:
        for peer in peers:
            if not peer.alive:
                raise RuntimeError(f"stage peer {peer.uid} (stage {peer.stage}) exited with code "
                                   f"{peer.proc.returncode} before declaring itself:\n{peer.log_tail()}")

    async def _wait_declared(self, peers: list[PeerProcess], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            await self._refresh_all()
            # a peer the fault injection already killed (it can pick one that declared before this loop saw it)
            missing = [p for p in peers if p.uid not in self.records[p.stage] and p.uid not in self.retired]
            if not missing:
                return
            self._check_started(missing)
            if time.monotonic() > deadline:
                raise TimeoutError(f"stage peers {[p.uid for p in missing]} did not declare themselves within "
                                   f"{timeout_s:.0f} s (logs in {self.workdir})")
            await asyncio.sleep(0.5)

    # -- DHT records ----------------------------------------------------------------------------------------
    async def _refresh(self, stage: int) -> None:
        found = {uid: record for uid, record in (await stage_records(self.node, self.run_id, stage)).items()
                 if uid not in self.retired}
        self.peer_ids.update({uid: peer for uid, (peer, _) in found.items()})
        self.records[stage] = {uid: exp for uid, (_, exp) in found.items()}
        self.balancers[stage].update_peers(self.records[stage], get_dht_time())
        if not self.local:
            for uid in found.keys() - self.seen:
                self.seen.add(uid)
                self._joined(stage, uid)

    def _joined(self, stage: int, uid: str) -> None:
        """attach/srun: a peer that declared itself after the start is a restarted or a moved one."""
        if self.phase != "training":
            return
        rank = rank_of_uid(uid)
        if rank is not None and self.pending_moves.get(rank) == stage:
            del self.pending_moves[rank]
            self.stats["moves_completed"] += 1
        else:
            self.stats["rejoins"] += 1

    async def _refresh_all(self) -> None:
        await asyncio.gather(*(self._refresh(s) for s in range(self.plan.stages)))

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_PERIOD_S)
            await self._refresh_all()

    # -- RPC ------------------------------------------------------------------------------------------------
    async def _control(self, stage: int, uid: str, method: str, meta: dict, timeout_s: float | None = None) -> dict:
        _, reply = await asyncio.wait_for(self._rpc(stage, uid, method, {}, meta),
                                          timeout=timeout_s or 2 * self.sync_timeout_s)
        return reply

    # -- the window: hooks of StageClient._call (the trainers' call, written once in ``trainer``) --------------
    async def _admit(self, stage: int, samples: int, backward: bool) -> None:
        if backward and self.training:
            await self._reserve(stage, samples)

    def _unadmit(self, stage: int, samples: int, backward: bool) -> None:
        if backward and self.training:
            self._release(stage, samples)

    def _started(self, stage: int, uid: str, backward: bool) -> None:
        self.inflight[uid] = self.inflight.get(uid, 0) + 1
        self.backward_inflight[stage] += backward

    def _ended(self, stage: int, uid: str, backward: bool) -> None:
        self.inflight[uid] -= 1
        self.backward_inflight[stage] -= backward

    def _succeeded(self, stage: int, uid: str, samples: int, backward: bool) -> None:
        if backward and self.training:
            self.syncs[stage].target_batch_samples = self._target(stage)
            if self.syncs[stage].add(uid, samples) and not self.syncing[stage]:
                self._spawn(self._sync(stage))

    # -- trainers -------------------------------------------------------------------------------------------
    async def _trainer(self) -> None:
        while (item := self.dispatcher.next()) is not None:
            _, input_ids, labels = item
            loss = await self.microbatch(input_ids, labels)
            self.window.append(loss)  # the last stage's step reports the mean loss of the microbatches it saw
            if not math.isfinite(loss):
                raise FloatingPointError(f"swarm loss became {loss} after {self.done} microbatches; lower pretrain.lr")
            self.done += 1
            if self.bar is not None:
                self.bar.update(1)
                self.bar.set_postfix(loss=f"{loss:.3f}", peers=sum(len(b.peers) for b in self.balancers))

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    # -- in-stage synchronisation ---------------------------------------------------------------------------
    def _planned(self, stage: int) -> tuple[float, int]:
        """(budget progress, microbatches) of the stage's current step, as the dispatcher planned it."""
        plan = self.dispatcher.plan
        return plan[min(self.steps[stage], len(plan) - 1)] if plan else (0.0, 1)

    def _target(self, stage: int) -> int:
        return self._planned(stage)[1] * self.plan.recipe["micro_batch_sequences"]

    async def _reserve(self, stage: int, samples: int) -> None:
        """Admit a backward call toward the stage's current global batch (wait while it is full or stepping)."""
        while self.syncing[stage] or self.reserved[stage] >= self._target(stage):
            self.window_open[stage].clear()
            await self.window_open[stage].wait()
        self.reserved[stage] += samples

    def _release(self, stage: int, samples: int) -> None:
        self.reserved[stage] -= samples
        self.window_open[stage].set()

    async def _sync(self, stage: int) -> None:
        self.syncing[stage] = True
        try:
            while self.backward_inflight[stage]:
                await asyncio.sleep(0.005)
            await self._step_stage(stage)
        finally:
            self.syncing[stage] = False
            self.window_open[stage].set()

    def _close_window(self, stage: int) -> None:
        """The samples counted so far went into a step (or were lost): start the next global batch."""
        self.reserved[stage] -= self.syncs[stage].total
        self.syncs[stage].reset()

    async def _step_stage(self, stage: int) -> None:
        """Reduce (all-reduce of sample-weighted gradients) then commit (same AdamW step) on the live replicas."""
        sync, balancer, recipe = self.syncs[stage], self.balancers[stage], self.plan.recipe
        t, _ = self._planned(stage)
        multiplier = lr_multiplier(recipe["schedule"], t, recipe["warmup_fraction"])
        lr = recipe["lr"] * multiplier
        total = sync.total
        contributions = {uid: share * total for uid, share in sync.weights().items()}
        stale: set[str] = set()     # replicas whose step count lags: left out, resynced after the step
        slow: set[str] = set()      # replicas whose reduce timed out: left out while others can step
        # a step may take a few all-reduce attempts of the whole stage (the group size is at most its peers)
        step_bound_s = max(self.plan.retry.give_up_after_s, 3 * self._reduce_timeout_s(stage, len(balancer.peers)))
        deadline = time.monotonic() + step_bound_s
        while True:
            await self._refresh(stage)
            unknown = [u for u in balancer.peers if u in self.peer_ids and self.known_steps.get(u) != self.steps[stage]]
            probe = {"step": self.steps[stage], "probe": True}
            probes = await asyncio.gather(*(self._control(stage, u, "reduce", probe) for u in unknown),
                                          return_exceptions=True)
            for uid, reply in zip(unknown, probes):  # a replica that lags would stall the group's all-reduce
                if isinstance(reply, dict) and reply.get("status") in ("ok", "stale"):
                    self.known_steps[uid] = reply["step"]
                    if reply["status"] == "stale":
                        stale.add(uid)
            if time.monotonic() > deadline:
                raise RuntimeError(f"stage {stage}: in-stage averaging did not succeed within {step_bound_s:.0f} s")
            live = [uid for uid in balancer.peers if uid in self.peer_ids and uid not in stale]
            if not live and stale:  # no replica at the current step: go on from the most advanced one
                best = max(self.known_steps[uid] for uid in stale)
                # behind: every replica at the current step died (its steps are lost); ahead: a replica applied a
                # commit whose reply never came (the window's gradients are in it; the next step closes the window)
                kind = "rollbacks" if best < self.steps[stage] else "catch_ups"
                self.stats[kind].append({"stage": stage, "from_step": self.steps[stage], "to_step": best})
                self.steps[stage] = best
                stale = {uid for uid in stale if self.known_steps[uid] != best}
                continue
            members = [uid for uid in live if uid not in slow]
            if not any(contributions.get(uid, 0) > 0 for uid in members):
                if any(contributions.get(uid, 0) > 0 for uid in live):
                    slow.clear()  # only slow replicas hold this step's gradients: wait for them
                    continue
                self.stats["lost_gradient_samples"] += total  # every contributor died before the step
                self._close_window(stage)
                return
            group_id = os.urandom(16)
            meta = {"step": self.steps[stage], "group_id": group_id, "peers": [self.peer_ids[u] for u in members]}
            reduce_s = self._reduce_timeout_s(stage, len(members))
            replies = await asyncio.gather(*(self._control(stage, u, "reduce", meta, reduce_s) for u in members),
                                           return_exceptions=True)
            status = {u: r.get("status") if isinstance(r, dict) else
                      "timeout" if isinstance(r, asyncio.TimeoutError) else "dead" for u, r in zip(members, replies)}
            for uid, reply in zip(members, replies):
                if status[uid] == "dead":  # refused / reset: banned until its record expires
                    balancer.report_error(uid, get_dht_time())
                elif status[uid] in ("stale", "timeout"):
                    (stale if status[uid] == "stale" else slow).add(uid)
                    if status[uid] == "stale":
                        self.known_steps[uid] = reply["step"]
            ok = [u for u in members if status[u] == "ok"]
            if len(ok) == len(members):
                commits = await asyncio.gather(*(self._control(stage, u, "commit", {"group_id": group_id, "lr": lr})
                                                 for u in ok), return_exceptions=True)
                digests = {u: r["digest"] for u, r in zip(ok, commits)
                           if isinstance(r, dict) and r.get("status") == "ok"}
                committed = list(digests)
                if committed:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"stage {stage}: in-stage averaging did not succeed within {step_bound_s:.0f} s "
                                   f"(last replies: {replies})")
            self.stats["sync_retries"] += 1
        self.stats["lost_gradient_samples"] += round(sum(n for u, n in contributions.items() if u not in committed))
        if len(members) > 1:  # the traffic of the all-reduce that made this step (a lone replica sends nothing)
            for reply in replies:
                self.stats["averaging_bytes_sent"][stage] += reply["bytes_sent"]
                self.stats["averaging_values_sent"][stage] += reply["values_sent"]
                self.stats["averaging_param_steps"][stage] += reply["params"]
        self.steps[stage] += 1
        self.known_steps.update({uid: self.steps[stage] for uid in committed})
        self.stats["stage_steps"][stage] = self.steps[stage]
        self._close_window(stage)
        # Replicas apply bitwise-identical averages (averaging.StageAllReduce); a replica whose parameters differ
        # all the same from the first one's takes its state (counted, so it shows if it ever happens).
        diverged = {u for u in committed if digests[u] != digests[committed[0]]}
        self.stats["digest_mismatches"] += len(diverged)
        for uid in stale | slow | diverged | (set(ok) - set(committed)):  # alive replicas that missed this step
            self._spawn(self._resync(stage, uid, committed[0]))
        if stage == self.plan.stages - 1:
            loss = sum(self.window) / len(self.window) if self.window else float("nan")
            self.window = []
            tokens_per_mb = self.dispatcher.tokens // max(self.dispatcher.issued, 1)
            self.log.append({
                "step": self.steps[stage], "tokens": sum(n for _, n in self.dispatcher.plan[:self.steps[stage]])
                * tokens_per_mb, "progress": t, "loss": loss, "lr": lr, "lr_multiplier": multiplier,
                "batch_sequences": total, "elapsed_s": self.elapsed()})

    async def _resync(self, stage: int, uid: str, source: str) -> None:
        """A live replica that missed a step downloads the state of one that took it."""
        if uid in self.resyncing:
            return
        self.resyncing.add(uid)
        try:
            reply = await self._control(stage, uid, "resync", {"source": self.peer_ids[source]},
                                        self._state_timeout_s(stage))
            self.known_steps[uid] = reply["step"]
            self.stats["resyncs"] += 1
        except Exception:
            self.balancers[stage].report_error(uid, get_dht_time())
        finally:
            self.resyncing.discard(uid)

    # -- background work ------------------------------------------------------------------------------------
    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and not self.failed.done():
            self.failed.set_exception(task.exception())

    def _process(self, uid: str) -> PeerProcess | None:
        """local placement: the live process of a peer this coordinator started."""
        return next((p for p in self.groups.peers if p.uid == uid and p.alive), None)

    def _killable(self, stage: int) -> list[str]:
        """The stage's declared live peers if at least two of them hold its current state (else none: killing
        one could lose the state)."""
        live = [uid for uid in self.balancers[stage].peers if uid in self.peer_ids
                and uid in self.records[stage] and (not self.local or self._process(uid))]
        current = [uid for uid in live if not self.training or self.known_steps.get(uid) == self.steps[stage]]
        return live if len(current) >= 2 else []

    async def _kill_forever(self, every_s: float) -> None:
        """SIGKILL a random peer's process group every ``every_s``: directly (local placement; a fresh peer starts
        ``rejoin_after_s`` later) or by its ``die`` RPC (attach/srun: its task restarts it)."""
        while True:
            await asyncio.sleep(every_s)
            candidates = [(s, uid) for s in range(self.plan.stages) for uid in self._killable(s)]
            if not candidates:
                continue
            stage, uid = self.rng.choice(candidates)
            self.retired.add(uid)
            if self.local:
                victim = self._process(uid)
                self.groups.kill(victim.proc)
                self._spawn(self._rejoin(stage, victim.speed, self.plan.rejoin_after_s, "rejoins"))
            else:
                with contextlib.suppress(Exception):
                    await self._control(stage, uid, "die", {})
                self.balancers[stage].report_error(uid, get_dht_time())
            self.stats["peers_killed"] += 1
            self.stats["killed"].append({"uid": uid, "stage": stage, "t_s": round(self.elapsed(), 2)})

    async def _rejoin(self, stage: int, speed: float, delay_s: float, counter: str) -> None:
        """Start a peer for ``stage`` after ``delay_s``; it loads the stage's state, then declares itself."""
        await asyncio.sleep(delay_s)
        peer = self._start_peer(stage, speed, load_state=True)
        await self._wait_declared([peer], self.plan.startup_timeout_s)
        self.stats[counter] += 1

    async def _mean_inflight(self, period_s: float, every_s: float = 0.1) -> dict[str, float]:
        """Each peer's calls in flight, averaged over ``period_s`` (sampled every ``every_s``): the queue lengths
        of the rebalancer's loads. A snapshot holds 0-3 calls per peer and made [3, 1] peers look balanced
        (load ratio under the hysteresis) in about one decision of two."""
        totals: dict[str, float] = {}
        count, end = 0, time.monotonic() + period_s
        while (left := end - time.monotonic()) > 0:
            await asyncio.sleep(min(every_s, left))
            for uid, calls in self.inflight.items():
                totals[uid] = totals.get(uid, 0.0) + calls
            count += 1
        return {uid: total / max(count, 1) for uid, total in totals.items()}

    async def _rebalance_forever(self, period_s: float) -> None:
        rebalancer = Rebalancer(period_s)
        while True:
            queues = await self._mean_inflight(period_s)
            loads = {s: [PeerLoad(uid, queues.get(uid, 0.0), b.settled_throughput(uid)) for uid in b.peers]
                     for s, b in enumerate(self.balancers)}
            move = rebalancer.decide(loads, time.monotonic())
            if move is None:
                continue
            if self.local:
                mover = self._process(move.uid)
                if mover is None:
                    continue
                self.groups.kill(mover.proc)
                self.retired.add(move.uid)
            else:  # the peer exits; its task restarts it on the new stage
                try:
                    reply = await self._control(move.from_stage, move.uid, "migrate", {"to_stage": move.to_stage})
                except Exception:
                    continue
                if reply.get("status") != "ok":
                    continue
                self.retired.add(move.uid)
                self.balancers[move.from_stage].report_error(move.uid, get_dht_time())
                self.pending_moves[rank := rank_of_uid(move.uid)] = move.to_stage
            self.stats["moves"].append({"t_s": round(self.elapsed(), 3), "uid": move.uid,
                                        "from_stage": move.from_stage, "to_stage": move.to_stage})
            if self.local:
                await self._rejoin(move.to_stage, mover.speed, 0.0, "moves_completed")
            else:  # as locally: no further decision before the mover serves its new stage (or cannot)
                deadline = time.monotonic() + self.plan.startup_timeout_s
                while rank in self.pending_moves and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                self.pending_moves.pop(rank, None)

    # -- run ------------------------------------------------------------------------------------------------
    async def _bootstrap(self) -> Path:
        if self.plan.addr_file is not None:
            return Path(self.plan.addr_file)
        addr_file = self.folder / ADDR_FILE
        proc, log = self.groups.spawn(["bootstrap", "--addr-file", str(addr_file), "--host", self.host], "bootstrap")
        deadline = time.monotonic() + self.plan.startup_timeout_s
        while not addr_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the bootstrap DHT did not write {addr_file}:\n{log.read_text(errors='replace')}")
            await asyncio.sleep(0.2)
        return addr_file

    async def _collect_states(self) -> tuple[list[dict[str, torch.Tensor]], dict[int, dict[str, int]], list[float]]:
        """Each stage's parameters from its live replicas, their step counts and the largest parameter difference
        between replicas per stage (0.0: all replicas bitwise equal)."""
        states, steps, spread = [], {}, []
        for stage in range(self.plan.stages):
            await self._refresh(stage)
            replicas = []
            for uid in self.balancers[stage].peers:
                try:
                    tensors, meta = await asyncio.wait_for(self._rpc(stage, uid, "state", {}, {}),
                                                           timeout=self._state_timeout_s(stage))
                except Exception:
                    continue
                blob = torch.load(io.BytesIO(tensors["blob"].numpy().tobytes()), weights_only=True,
                                  map_location="cpu")
                replicas.append((uid, meta["step"], blob["module"]))
                self.stats["peer_devices"][uid] = meta.get("device", "cpu")
            if not replicas:
                raise NoPeersError(stage)
            reference = replicas[0][2]
            spread.append(max((float((reference[k].float() - state[k].float()).abs().max()) for _, _, state in
                               replicas[1:] for k in reference if reference[k].numel()), default=0.0))
            states.append(reference)
            steps[stage] = {uid: step for uid, step, _ in replicas}
        return states, steps, spread

    def _initial_specs(self) -> list[tuple[int, float]]:
        """(stage, speed) of the peers to start: stage by stage, speeds cycled over the peers."""
        speeds = self.plan.peer_speeds
        stages = [s for s, n in enumerate(self.plan.peers_per_stage) for _ in range(n)]
        return [(s, speeds[i % len(speeds)]) for i, s in enumerate(stages)]

    async def _start_swarm(self) -> list[PeerProcess]:
        """Bootstrap DHT, this process's DHT client and heartbeat, the stage peers (all declared: started here,
        as an srun job step, or by whoever runs the attach placement's tasks) and the record refresher."""
        self.failed = asyncio.get_running_loop().create_future()
        for event in self.window_open:
            event.set()
        self._write_config()
        self.addr_file = await self._bootstrap()
        maddrs = await asyncio.to_thread(read_addr_file, self.addr_file, self.plan.join_timeout_s)
        self.node = await join_dht(maddrs, client_mode=True, host=self.host, timeout_s=self.plan.join_timeout_s)
        self._spawn(self._heartbeat_forever())
        if self.local:
            peers = [self._start_peer(stage, speed, load_state=False) for stage, speed in self._initial_specs()]
            await self._wait_declared(peers, self.plan.startup_timeout_s)
            self.known_steps.update({p.uid: 0 for p in peers})
        else:
            peers = []
            if self.plan.placement == "srun":
                launcher = ["srun", f"--ntasks={self.plan.peers}", "--kill-on-bad-exit=0", *self.plan.srun_args,
                            *PEER_MODULE]
                self.srun, _ = self.groups.spawn(["task", "--rendezvous", str(self.folder)], "srun", launcher)
            else:
                print(f"waiting for {self.plan.peers} peers: run `python -m cramswarm swarm-peer --rendezvous "
                      f"{self.folder} --rank R` for R = 0 .. {self.plan.peers - 1}", file=sys.stderr, flush=True)
            await self._wait_tasks(self.plan.startup_timeout_s)
            self.known_steps.update({uid: 0 for records in self.records for uid in records})
        self._spawn(self._refresh_forever())
        self.phase = "training"
        await self._beat()
        self.start = time.perf_counter()
        return peers

    async def _wait_tasks(self, timeout_s: float) -> None:
        """attach/srun: wait until every stage has its ``peers_per_stage`` declared peers."""
        deadline = time.monotonic() + timeout_s
        while True:
            await self._refresh_all()
            missing = {s: n - len(self.records[s]) for s, n in enumerate(self.plan.peers_per_stage)
                       if len(self.records[s]) < n}
            if not missing:
                return
            if self.srun is not None and self.srun.poll() is not None:
                log = (self.workdir / "srun.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"the peers' srun job step ended with code {self.srun.returncode} before every "
                                   f"peer declared itself:\n{log}")
            if time.monotonic() > deadline:
                lacking = ", ".join(f"stage {s}: {self.plan.peers_per_stage[s] - n} of {self.plan.peers_per_stage[s]}"
                                    for s, n in missing.items())
                raise TimeoutError(f"swarm.placement={self.plan.placement}: not every stage's peers declared "
                                   f"themselves within {timeout_s:.0f} s ({lacking}); rendezvous {self.folder}")
            await asyncio.sleep(0.5)

    async def _beat(self) -> None:
        await self.node.store(coordinator_key(self.run_id), self.phase, get_dht_time() + RECORD_TTL_S)

    async def _heartbeat_forever(self) -> None:
        """The coordinator's DHT record: peers that cannot see this process exit once it has been gone a while."""
        while True:
            with contextlib.suppress(Exception):
                await self._beat()
            await asyncio.sleep(DECLARE_PERIOD_S)

    async def _shutdown(self) -> None:
        if self.bar is not None:
            self.bar.close()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.node is not None and not self.local:  # tell the peers this process did not start to exit
            self.phase = "done"
            (self.folder / DONE_FILE).write_text(self.run_id + "\n")
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._beat(), timeout=10.0)
            if self.srun is not None:
                await self._end_srun()
        self.groups.close()
        if self.node is not None:
            await self.node.shutdown()

    async def _end_srun(self, wait_s: float = 30.0) -> None:
        """Let the srun job step end by itself (its peers read ``done``), else SIGTERM it (srun forwards it to
        the tasks, which kill their peers)."""
        for signum in (None, signal.SIGTERM):
            if signum is not None and self.srun.poll() is None:
                self.srun.send_signal(signum)
            deadline = time.monotonic() + wait_s
            while self.srun.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.2)

    async def main(self) -> TrainResult:
        try:
            await self._start_swarm()
            self.dispatcher = Dispatcher(self.batches, self.total, self.plan.recipe)
            self.bar = tqdm(total=self.total if self.total < 1 << 40 else None, desc="swarm (hivemind)", unit="mb",
                            disable=not self.progress, mininterval=2.0)
            if self.plan.kill_every_s:
                self._spawn(self._kill_forever(self.plan.kill_every_s))
            if self.plan.rebalance_period_s:
                self._spawn(self._rebalance_forever(self.plan.rebalance_period_s))
            trainers = asyncio.gather(*(self._trainer() for _ in range(self.plan.trainers)))
            await asyncio.wait([trainers, self.failed], return_when=asyncio.FIRST_COMPLETED)
            if self.failed.done():
                trainers.cancel()
                self.failed.result()
            trainers.result()
            wall_s = self.elapsed()
            while any(self.syncing):
                await asyncio.sleep(0.01)
            for stage in range(self.plan.stages):  # the last, partial global batch
                if self.syncs[stage].total:
                    await self._sync(stage)
            stage_states, replica_steps, spread = await self._collect_states()
        finally:
            await self._shutdown()
        self.stats.update(
            transport="hivemind", placement=self.plan.placement, microbatches_done=self.done,
            microbatches_requested=self.dispatcher.issued,
            lost_microbatches=self.dispatcher.issued - self.done, steps=len(self.dispatcher.plan),
            tokens=self.dispatcher.tokens, wall_s=round(wall_s, 3),
            throughput_mb_s=round(self.done / wall_s, 4) if wall_s > 0 else 0.0,
            per_stage_peers=[len(steps) for steps in replica_steps.values()], replica_steps=replica_steps,
            replicas_equal=not any(spread), replica_max_abs_diff=spread, process_groups=list(self.groups.pgids),
            balancer_stats=[dict(b.stats) for b in self.balancers],
            stage_parameters=self.stage_params, averaging_compression=self.plan.averaging_compression,
            averaging_bytes_per_param=[round(b / n, 4) if n else None for b, n in
                                       zip(self.stats["averaging_bytes_sent"], self.stats["averaging_param_steps"])],
            averaging_bytes_per_value=[round(b / n, 4) if n else None for b, n in
                                       zip(self.stats["averaging_bytes_sent"], self.stats["averaging_values_sent"])],
        )
        return TrainResult(stage_states=stage_states, log=self.log, stats=self.stats)


class ThroughputCoordinator(Coordinator):
    """``run(setup)``: an ``emulation.SwarmSetup`` on real processes, DHT and RPCs, with emulated compute.

    Like the emulation and the simulator: each trainer pushes one microbatch at a time forward through stages
    ``0..k-1`` and backward through ``k-1..0`` (one call per stage and direction, task size 1), the peers sleep
    ``stage_time_s / speed`` per forward call (``BACKWARD_COMPUTE_FACTOR`` times that per backward call) and
    send ``activation_bytes`` back; no model, no in-stage synchronisation. The network is the real localhost
    one (``bandwidth_mbit_s`` and ``latency_s`` are not emulated). ``FailureEvent``s SIGKILL the peer's process
    group; a rejoining peer is a fresh process for the same stage (its start-up is the state download).
    """

    def __init__(self, setup: SwarmSetup):
        setup.validate()
        counts = [sum(p.stage == s for p in setup.peers) for s in range(setup.num_stages)]
        plan = SwarmPlan(
            arch={}, vocab_size=0, recipe={"batch_sequences": 1, "micro_batch_sequences": 1},
            peers_per_stage=counts, trainers=setup.trainers, seed=setup.seed,
            retry=RetryPolicy(forward_timeout_s=setup.forward_timeout_s),
            emulate={"stage_time_s": setup.stage_time_s, "backward_factor": BACKWARD_COMPUTE_FACTOR,
                     "activation_bytes": setup.activation_bytes},
        )
        super().__init__(plan, iter(()), 0, progress=False)
        self.setup = setup

    def _initial_specs(self) -> list[tuple[int, float]]:
        return [(p.stage, p.speed) for p in self.setup.peers]

    async def _emulated_trainer(self) -> None:
        payload = {"x": torch.zeros(self.setup.activation_bytes, dtype=torch.uint8)}
        stages = self.plan.stages
        while True:
            for stage in range(stages):
                await self._call(stage, "forward", payload, {}, 1)
            for stage in range(stages - 1, -1, -1):
                await self._call(stage, "backward", payload, {}, 1)
            self.done += 1
            self.timeline.append((self.elapsed(), self.done))

    async def _failure(self, peer: PeerProcess, event: FailureEvent) -> None:
        await asyncio.sleep(event.at_s)
        if peer.alive:
            self.groups.kill(peer.proc)
            self.stats["peers_killed"] += 1
            if event.rejoin_after_s is not None:
                await self._rejoin(peer.stage, peer.speed, event.rejoin_after_s, "rejoins")

    async def measure(self) -> dict:
        try:
            peers = await self._start_swarm()
            for event in self.setup.failures:
                self._spawn(self._failure(peers[event.peer], event))
            for _ in range(self.setup.trainers):
                self._spawn(self._emulated_trainer())
            await asyncio.wait([self.failed], timeout=self.setup.duration_s)
            if self.failed.done():
                self.failed.result()
            wall_s = self.elapsed()
        finally:
            await self._shutdown()
        return {"microbatches_done": self.done, "throughput_mb_s": self.done / wall_s, "timeline": self.timeline,
                "lost_microbatches": 0, "retries": self.stats["retries"], "moves": [], "wall_s": wall_s,
                "peers_killed": self.stats["peers_killed"], "rejoins": self.stats["rejoins"],
                "chosen_per_peer": [dict(b.chosen_per_peer) for b in self.balancers]}


def _exit_on_sigterm(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


_own_daemons = own_daemons  # the tests' name for it


def decentralised_supported(plan: SwarmPlan, total_microbatches: int) -> str | None:
    """Why the launcher (independent trainer processes, steps decided by the stage peers) cannot run ``plan``
    yet, or None. Every placement runs under it (srun: every process it starts is its own job step,
    ``srun.SrunPlacement``; attach: the user's ``swarm-peer`` tasks serve the stages, the launcher starts the
    bootstrap and the trainers; with ``kill_every_s`` it asks a peer to die by its ``die`` RPC and the peer's task
    restarts it). Only the throughput emulation (``run``) uses the coordinator. Any budget and any
    amount of data run under the launcher: its trainers read the training blocks and mask their microbatches
    themselves (``data``), and with a seconds
    budget they stop at the launcher's deadline (rebalancing is decided by the stage peers: ``peer_rebalance``).
    ``total_microbatches`` is kept for the callers; no count is refused."""
    if plan.emulate is not None:
        return "throughput emulation (hivemind_transport.run) uses the coordinator"
    if min(plan.peers_per_stage, default=0) < 1:
        return f"swarm.peers_per_stage={plan.peers_per_stage}: every stage needs a peer"
    return None


def run_swarm(plan: SwarmPlan, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], total_microbatches: int,
              progress: bool = True) -> TrainResult:
    """Run one hivemind swarm; every process it started (and this process's p2pd) is gone when it returns.
    ``batches``: the microbatches in order (the coordinator), or - for a plan with ``decentralised`` - a microbatch
    source (``data``) the launcher's trainers make their own microbatches from."""
    check_stage_count(plan.arch["layers"], plan.stages)
    plan.validate()
    check_memory_cap(stage_state_bytes(plan.arch, plan.vocab_size, plan.stages, plan.compression),
                     plan.peer_memory_cap_mb)
    if plan.compression not in COMPRESSIONS:
        raise ValueError(f"swarm.compression={plan.compression!r}; allowed: {', '.join(COMPRESSIONS)}")
    if plan.averaging_compression not in averaging.SCHEMES:
        raise ValueError(f"swarm.averaging_compression={plan.averaging_compression!r}; allowed: "
                         f"{', '.join(averaging.SCHEMES)}")
    if not plan.link_mbit_s > 0:
        raise ValueError(f"swarm.link_mbit_s={plan.link_mbit_s!r}: must be positive")
    if plan.trainers < 1 or any(n < 0 for n in plan.peers_per_stage) or not plan.peer_speeds \
            or any(not s > 0 for s in plan.peer_speeds):
        raise ValueError(f"invalid swarm plan: trainers={plan.trainers}, peers_per_stage={plan.peers_per_stage}, "
                         f"peer_speeds={plan.peer_speeds}")
    if plan.decentralised:
        problem = decentralised_supported(plan, total_microbatches)
        if problem:
            raise ValueError(f"the launcher cannot run this swarm: {problem}")
        from cramswarm.swarm import launcher

        return launcher.run(plan, batches, total_microbatches, progress)
    before = _own_daemons()
    coordinator = Coordinator(plan, batches, total_microbatches, progress)
    keep_logs = True
    previous = None
    if threading.current_thread() is threading.main_thread():  # SIGTERM (e.g. from Snakemake) -> clean-up
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        result = asyncio.run(coordinator.main())
        keep_logs = False
        return result
    except (BootstrapError, NoPeersError):  # the message says it all; the peer logs add nothing
        keep_logs = False
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        coordinator.groups.close()
        for pid in _own_daemons() - before:  # this process's p2pd, if the DHT shutdown left it behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if keep_logs:
            print(f"hivemind swarm failed; peer logs kept in {coordinator.workdir}", file=sys.stderr, flush=True)
        else:
            shutil.rmtree(coordinator.workdir, ignore_errors=True)


def run(setup: SwarmSetup) -> dict:
    """Throughput of ``setup`` on real hivemind processes (same result keys as ``emulation.run`` / ``sim.run``)."""
    coordinator = ThroughputCoordinator(setup)
    try:
        return asyncio.run(coordinator.measure())
    finally:
        coordinator.groups.close()
        shutil.rmtree(coordinator.workdir, ignore_errors=True)


def train(*, arch: dict, vocab_size: int, recipe: dict, swarm: dict,
          batches: Iterator[tuple[torch.Tensor, torch.Tensor]], total_microbatches: int,
          progress: bool = True, rendezvous: str | Path | None = None, source=None) -> TrainResult:
    """The swarm_pretrain rule's hivemind transport (``emulation.train``'s signature and result, plus the
    rendezvous folder of the attach and srun placements and the microbatch source, ``data``, of the same
    microbatches by index: with one, the launcher runs the swarm wherever it supports the plan, its trainers
    making their own microbatches from it; the coordinator takes ``batches``)."""
    if swarm["peers_per_stage"] < 1:
        raise ValueError(f"swarm.peers_per_stage={swarm['peers_per_stage']}: every stage needs at least one peer")
    plan = SwarmPlan(
        arch=arch, vocab_size=vocab_size, recipe=recipe,
        peers_per_stage=[swarm["peers_per_stage"]] * swarm["stages"], peer_speeds=list(swarm["peer_speeds"]),
        trainers=swarm["trainers"], compression=swarm["compression"],
        averaging_compression=swarm["averaging_compression"], link_mbit_s=swarm["link_mbit_s"],
        retry=RetryPolicy(forward_timeout_s=swarm["forward_timeout_s"]), kill_every_s=swarm["kill_every_s"],
        rejoin_after_s=swarm["rejoin_after_s"], rebalance_period_s=swarm["rebalance_period_s"], seed=swarm["seed"],
        placement=swarm["placement"], rendezvous=Path(rendezvous) if rendezvous else None, host=swarm["host"],
        interface=swarm["interface"], srun_args=list(swarm["srun_args"]), startup_timeout_s=swarm["startup_timeout_s"],
    )
    plan.checkpoint_every_s = swarm["checkpoint_every_s"]
    plan.peer_memory_cap_mb = swarm.get("peer_memory_cap_mb")
    plan.decentralised = source is not None and decentralised_supported(plan, total_microbatches) is None
    if plan.decentralised and rendezvous:  # the rule's state folder: a rerun after the rule's process died resumes
        from cramswarm.swarm.train import STATE_SUBDIR

        plan.state_dir = Path(rendezvous) / STATE_SUBDIR
    return run_swarm(plan, source if plan.decentralised else batches, total_microbatches, progress)
