"""The launcher of a hivemind swarm: starts the processes, restarts the dead, gathers the result - no training.

``hivemind_transport.run_swarm`` runs every hivemind swarm through ``run``. Its processes, each its own process group
(``processes.ProcessGroups``; srun placement: each its own job step, ``srun.SrunPlacement``; attach placement: the
stage peers are the user's ``swarm-peer`` tasks, ``peer_process.run_task``, which the launcher waits for and neither
restarts nor kills):

* the bootstrap (``peer_process bootstrap``): starts the DHT and writes the address file, which every later process
  joins through and appends to (``membership.join_swarm``), so it may die;
* stage peers (``peer_process stage``, ``peer_sync.SyncingStagePeer``): serve their stage, step it among themselves
  (``peer_sync``) and move themselves to a starved stage (``peer_rebalance``);
* trainers (``trainer``): take leases of the run's work from the DHT (``work``) and make their microbatches from the
  run's microbatch source (``data``).

The launcher holds no training state: it keeps a heartbeat record in the DHT (``membership.launcher_key``), writes
the training clock once its trainers have joined (``membership.CLOCK_FILE``), restarts a dead trainer of its own (not
one that left, ``EXIT_LEFT``) and a dead stage peer (a fresh uid on the stage it last served, ``moves.jsonl``)
``rejoin_after_s`` later, and stops every process at the end or on SIGTERM / Ctrl-C (``_stop_swarm``). If it dies,
the swarm trains on until its heartbeat has been missing ``launcher_grace_s``. Its parts: ``run_state`` (the run
folder, resume, re-attaching to a live swarm), ``launcher_faults`` (``kill_every_s``, ``faults``), ``run_result``
(the last, partial global batch, the stages' states, the result).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from tqdm.auto import tqdm

from cramswarm.io import read_json, write_json, write_text
from cramswarm.swarm import data
from cramswarm.swarm.emulation_training import TrainResult
from cramswarm.swarm.launcher_faults import FaultInjection
from cramswarm.swarm.membership import (
    ADDR_FILE,
    CONFIG_FILE,
    DECLARE_PERIOD_S,
    DONE_FILE,
    RECORD_TTL_S,
    SWARM_KEY,
    join_dht,
    launcher_key,
    listen_host,
    read_addr_file,
    stage_namespace,
    stage_records,
)
from cramswarm.swarm.peer_rebalance import MOVES_FILE, read_move_events, stage_after_moves
from cramswarm.swarm.peer_sync import SyncingStagePeer
from cramswarm.swarm.processes import (
    SUPERVISE_PERIOD_S,
    Adopted,
    PeerProcess,
    ProcessGroups,
    own_daemons,
    peer_gpu,
    swarm_processes,
)
from cramswarm.swarm.progress import read_clock
from cramswarm.swarm.rebalancing import MoveEvent
from cramswarm.swarm.routing import NoPeersError
from cramswarm.swarm.run_result import RunResult
from cramswarm.swarm.run_state import TIME_FILE, RunFolder
from cramswarm.swarm.settings import ProcessConfig
from cramswarm.swarm.trainer import EXIT_LEFT, EXIT_NO_PEERS, WorkClaims, progress_path
from cramswarm.swarm.work import WorkOrder, all_done

TRAINER_MODULE = [sys.executable, "-m", "cramswarm.swarm.trainer"]
KILLED_STEP = 128 + signal.SIGKILL  # srun's exit code for a task SIGKILLed (its step's, srun placement)
STOP_WAIT_S = 60.0  # a deliberate stop waits this long for the stages' shards and the processes' exits


class SwarmStopped(RuntimeError):
    """The run was stopped deliberately (``Launcher._stop_swarm``); ``run`` exits as SIGTERM does."""


def option(cmdline: list[str], name: str) -> str:
    """The value after ``name`` in a command line."""
    return cmdline[cmdline.index(name) + 1]


class Launcher(RunFolder, FaultInjection, RunResult):
    """The supervisor of one swarm run: starts the processes, restarts the dead, follows the peers' moves. Its run
    folder and resume are ``RunFolder``'s, its fault injection ``FaultInjection``'s, the end of its run
    ``RunResult``'s."""

    def __init__(self, plan, source, total_microbatches: int, progress: bool):
        from cramswarm.swarm.stages import stage_parameter_counts

        if not data.is_source(source):
            raise TypeError("the launcher's trainers make their own microbatches: give it a microbatch source "
                            "(cramswarm.swarm.data), not an iterator")
        self.plan, self.source, self.total, self.progress = plan, source, total_microbatches, progress
        self.rng = random.Random(plan.seed)
        # the run's folder: the plan's state folder, else its rendezvous folder (attach, srun: the tasks read the
        # config and the DHT addresses there), else a temporary one
        state_dir = plan.state_dir if plan.state_dir is not None else plan.rendezvous
        self.state_dir = Path(state_dir).resolve() if state_dir is not None else None
        if self.state_dir is not None:  # resumable: the run's files stay where a rerun finds them
            self.state_dir.mkdir(parents=True, exist_ok=True)
            self.workdir = self.state_dir
            self._lock()
        else:
            self.workdir = Path(tempfile.mkdtemp(prefix="cramswarm-swarm-"))
        self.shard_dir = self.workdir / "shards"
        self.run_id = f"cs{os.getpid()}x{self.rng.getrandbits(32):08x}"
        self.place = plan.hosts
        if self.place is None and plan.placement == "srun":  # each process its own job step (srun.SrunPlacement)
            from cramswarm.swarm.srun import SrunPlacement

            self.place = SrunPlacement(self.run_id, plan.srun_args)
        self.groups = ProcessGroups(self.workdir, place=self.place)
        self.host = listen_host(plan.host, plan.interface)
        self.node = None
        self.phase = "starting"
        self.stage_params = stage_parameter_counts(plan.arch, plan.vocab_size, plan.stages, plan.compression)
        self.peers: dict[str, PeerProcess] = {}   # uid -> process (live or dead, until restarted)
        self.retired: set[str] = set()            # peers killed on purpose or restarted
        self.trainers: dict[int, object] = {}     # rank -> Popen
        self.finished: set[int] = set()           # ranks that exited 0: every lease finished (or the deadline)
        self.left: set[int] = set()               # ranks told to leave (EXIT_LEFT): not restarted
        self.order = WorkOrder(total_microbatches)  # the leases' order (run_state: a resume's owed microbatches first)
        self.description: dict | None = None      # the swarm's config as stored for joiners (_beat)
        self.next_uid = 0
        self.moves_seen = self.moves_base = 0      # events of the peers' moves file read so far / before this life
        self.bootstrap = None
        self.stop = asyncio.Event()                # set by SIGTERM / SIGINT during training (_stop_on_signals)
        self.reattach: str | None = None           # the run id of the live swarm this launcher takes over (run_state)
        self.tasks: set[asyncio.Task] = set()
        self.stats = {"peers_killed": 0, "rejoins": 0, "trainer_restarts": 0, "killed": [], "bootstrap_killed": 0,
                      "joins_started": 0, "joined": []}
        self.start = time.perf_counter()
        self.start_wall = time.time()
        self.wall_before, self.first_start_wall = 0.0, None  # training time of earlier lives (a resumed run)
        self.run_ids = [self.run_id]   # the run's lives (run_state: a resumed run's earlier ones first)

    # -- config ---------------------------------------------------------------------------------------------
    def _write_config(self, seq_len: int) -> Path:
        cfg = ProcessConfig.of_plan(self.plan, run_id=self.run_id, run_ids=self.run_ids, seq_len=seq_len,
                                    workdir=self.workdir, shard_dir=self.shard_dir, data=self.source.spec(),
                                    microbatches=self.total, order=self.order.spec())
        write_json(self.workdir / CONFIG_FILE, cfg.to_dict())   # atomic: a process started meanwhile reads a whole one
        return self.workdir / CONFIG_FILE

    # -- processes ------------------------------------------------------------------------------------------
    def _start_peer(self, stage: int, speed: float, load_state: bool) -> PeerProcess:
        self.next_uid += 1
        # local placement: peer i sees GPU i mod (this host's GPUs) alone; srun: the step's own (SLURM's --gpus-*)
        gpu = peer_gpu(self.next_uid, self.plan.device) if self.place is None else None
        peer = self.groups.start_peer(f"s{stage}p{self.next_uid}", stage, speed, self.config, self.addr_file,
                                      load_state, gpu=gpu)
        self.peers[peer.uid] = peer
        return peer

    def _start_trainer(self, rank: int) -> None:
        proc, _ = self.groups.spawn(["--config", str(self.config), "--rank", str(rank)], f"trainer{rank}",
                                    launcher=TRAINER_MODULE)
        self.trainers[rank] = proc

    async def _wait_trainers_ready(self) -> None:
        """Until every trainer has joined the swarm and waits for the training clock (its progress file names
        this run's id); a trainer that exits before is an error."""
        deadline = time.monotonic() + self.plan.startup_timeout_s
        while True:
            waiting = []
            for rank, proc in self.trainers.items():
                if (code := proc.poll()) is not None:
                    raise self._trainer_failed(rank, code)
                with contextlib.suppress(Exception):
                    if read_json(progress_path(self.workdir, rank)).get("run_id") == self.run_id:
                        continue
                waiting.append(rank)
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"trainers {waiting} did not join the swarm within "
                                   f"{self.plan.startup_timeout_s:.0f} s (logs in {self.workdir})")
            await asyncio.sleep(0.2)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and not self.failed.done():
            self.failed.set_exception(task.exception())

    async def _start_dht(self) -> None:
        self.addr_file = self.workdir / ADDR_FILE
        # it leaves once this run's heartbeat says done or has been missing launcher_grace_s (a re-attaching
        # launcher beats under the same run id)
        args = ["bootstrap", "--addr-file", str(self.addr_file), "--host", self.host,
                "--run-id", self.run_id, "--grace-s", repr(self.plan.launcher_grace_s)]
        if self.plan.placement == "srun" and self.plan.interface:  # on any node: its own interface's address
            args += ["--interface", self.plan.interface]
        self.bootstrap, log = self.groups.spawn(args, "bootstrap")
        deadline = time.monotonic() + self.plan.startup_timeout_s
        while not self.addr_file.exists():
            if self.bootstrap.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the bootstrap DHT did not write {self.addr_file}:\n"
                                   f"{log.read_text(errors='replace')}")
            await asyncio.sleep(0.2)
        await self._join()

    async def _join(self) -> None:
        """Join the swarm's DHT as a client (``node``) through the bootstrap's addresses (``addr_file``)."""
        maddrs = await asyncio.to_thread(read_addr_file, self.addr_file, self.plan.join_timeout_s)
        self.node = await join_dht(maddrs, client_mode=True, host=self.host, timeout_s=self.plan.join_timeout_s)

    async def _beat(self) -> None:
        """The heartbeat; while the swarm trains, also its description (its config and training clock) for peers
        and trainers that join it through any live address (``peer_process.serve_joined``, ``trainer``)."""
        expiration = get_dht_time() + RECORD_TTL_S
        await self.node.store(launcher_key(self.run_id), self.phase, expiration)
        if self.phase == "training":
            self.description = self.description or json.loads(self.config.read_text())
            clock = read_clock(self.workdir, self.run_id)
            await self.node.store(SWARM_KEY, {**self.description, "clock": clock}, expiration)

    async def _heartbeat_forever(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self._beat()
            await asyncio.sleep(DECLARE_PERIOD_S)

    async def _wait_declared(self, peers: list[PeerProcess]) -> None:
        deadline = time.monotonic() + self.plan.startup_timeout_s
        while True:
            declared = set()
            for stage in range(self.plan.stages):
                declared |= set(await stage_records(self.node, self.run_id, stage))
            missing = [p for p in peers if p.uid not in declared and p.uid not in self.retired]
            if not missing:
                return
            for peer in missing:
                if not peer.alive:
                    raise RuntimeError(f"stage peer {peer.uid} (stage {peer.stage}) exited with code "
                                       f"{peer.proc.returncode} before declaring itself:\n{peer.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"stage peers {[p.uid for p in missing]} did not declare themselves within "
                                   f"{self.plan.startup_timeout_s:.0f} s (logs in {self.workdir})")
            await asyncio.sleep(0.5)

    async def _wait_attached(self) -> None:
        """attach: wait until every stage has its ``peers_per_stage`` declared peers, started by the user as
        ``swarm-peer --rendezvous <this run's folder> --rank R`` tasks (each restarts its own peer when it dies)."""
        print(f"waiting for {self.plan.peers} peers: run `python -m cramswarm swarm-peer --rendezvous {self.workdir} "
              f"--rank R` for R = 0 .. {self.plan.peers - 1}", file=sys.stderr, flush=True)
        deadline = time.monotonic() + self.plan.startup_timeout_s
        while True:
            counts = [len(await stage_records(self.node, self.run_id, s)) for s in range(self.plan.stages)]
            missing = {s: n - c for s, (n, c) in enumerate(zip(self.plan.peers_per_stage, counts)) if c < n}
            if not missing:
                return
            if time.monotonic() > deadline:
                lacking = ", ".join(f"stage {s}: {counts[s]} of {self.plan.peers_per_stage[s]}" for s in missing)
                raise TimeoutError(f"swarm.impl.placement=attach: not every stage's peers declared themselves within "
                                   f"{self.plan.startup_timeout_s:.0f} s ({lacking}); rendezvous {self.workdir}")
            await asyncio.sleep(0.5)

    async def _restart_peer(self, peer: PeerProcess) -> None:
        """A fresh peer for a dead one's stage, ``rejoin_after_s`` later (it loads the stage's state first)."""
        await asyncio.sleep(self.plan.rejoin_after_s)
        fresh = self._start_peer(peer.stage, peer.speed, load_state=True)
        await self._wait_declared([fresh])
        self.stats["rejoins"] += 1

    async def _restart_trainer(self, rank: int) -> None:
        await asyncio.sleep(self.plan.rejoin_after_s)
        self._start_trainer(rank)
        self.stats["trainer_restarts"] += 1

    def _move_events(self) -> list[MoveEvent]:
        """The events of the moves file the peers append to (``peer_rebalance.read_move_events``)."""
        return read_move_events(self.workdir / MOVES_FILE)

    def _follow_moves(self) -> None:
        """Follow the moves the peers made themselves: a moved process is restarted, should it die, on the stage
        it moved to, and is known by its new uid once it arrived (the launcher decides and tells nothing)."""
        events = self._move_events()
        for event in events[self.moves_seen:]:
            peer = self.peers.get(event.move.uid)
            if peer is None:
                continue
            peer.stage = event.move.to_stage
            if event.event == "arrived":
                del self.peers[event.move.uid]
                peer.uid = event.new_uid
                self.peers[peer.uid] = peer
        self.moves_seen = len(events)

    def _trainer_failed(self, rank: int, code: int) -> Exception:
        log = (self.workdir / f"trainer{rank}.log").read_text(errors="replace")[-3000:]
        if code == EXIT_NO_PEERS:
            with contextlib.suppress(Exception):
                return NoPeersError(read_json(progress_path(self.workdir, rank))["no_peers_stage"])
        return RuntimeError(f"trainer {rank} exited with code {code}:\n{log}")

    def _stage_stub(self, stage: int, peer: str):
        """An RPC stub for the stage peer whose DHT peer id (base58) is ``peer``."""
        return SyncingStagePeer.get_stub(self.node.p2p, PeerID.from_base58(peer),
                                         namespace=stage_namespace(self.run_id, stage))

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    async def _work_done(self) -> bool:
        """Whether the claim records say every lease is finished (``work.all_done``)."""
        with contextlib.suppress(Exception):
            claims = await WorkClaims(self.node, self.run_id, "launcher", self.order).read()
            return all_done(claims, positions=self.order.positions)
        return False

    async def _trainers_done(self) -> bool:
        """Whether training is over: every trainer of this launcher has exited 0 (every lease finished, or the
        deadline) or left, and, if all of them left, the trainers added by hand have finished the leases."""
        if len(self.finished | self.left) < self.plan.trainers:
            return False
        return bool(self.finished) or await self._work_done()

    async def _supervise(self) -> None:
        """Until every trainer is done: restart dead trainers and peers, fail on a trainer's error."""
        bar = tqdm(total=self.total if data.bounded(self.total) else None, desc="swarm (hivemind, launcher)",
                   unit="mb", disable=not self.progress,
                   mininterval=2.0)
        try:
            while not await self._trainers_done():
                if self.failed.done():
                    self.failed.result()
                if self.stop.is_set():
                    await self._stop_swarm()
                for rank, proc in list(self.trainers.items()):
                    if rank in self.finished | self.left or proc is None or (code := proc.poll()) is None:
                        continue
                    self.groups.kill(proc)  # its p2pd
                    if code == 0:
                        self.finished.add(rank)
                    elif code == EXIT_LEFT:   # told to leave: its lease goes to the others
                        self.left.add(rank)
                    elif code < 0 or (code == KILLED_STEP and self.plan.placement == "srun"):
                        # killed by a signal: restart under the same rank, it goes on with its lease
                        self.trainers[rank] = None
                        self._spawn(self._restart_trainer(rank))
                    else:
                        raise self._trainer_failed(rank, code)
                for uid, peer in list(self.peers.items()):
                    if uid not in self.retired and not peer.alive:  # died by itself: replace it
                        self.retired.add(uid)
                        self._spawn(self._restart_peer(peer))
                self._follow_moves()
                bar.n = self._done_microbatches()
                bar.refresh()
                self._record_time()
                await asyncio.sleep(SUPERVISE_PERIOD_S)
        finally:
            bar.close()

    async def main(self) -> TrainResult:
        self.failed = asyncio.get_running_loop().create_future()
        try:
            seq_len = self._prepare()
            self.moves_base = self.moves_seen = len(self._move_events())  # an earlier life's moves (a resumed run)
            if self.reattach is not None:
                await self._reattach()
            else:
                await self._start_swarm(seq_len)
            if self.plan.kill_every_s:
                self._spawn(self._kill_forever(self.plan.kill_every_s))
            for at_s, target in self.plan.faults:
                self._spawn(self._fault(at_s, target))
            self._stop_on_signals()
            await self._supervise()
            wall_s = self.wall_before + self.elapsed()
            for task in list(self.tasks):  # no more kills or restarts once the trainers are done
                if task.get_coro().__name__ in ("_kill_forever", "_fault"):
                    task.cancel()
            await self._finish_steps()
            live_states, replica_steps, spread = await self._collect_states()
            # the checkpoint is assembled from the stages' final shards (a stage that never stepped: a replica's)
            shard_states, shard_steps = await self._final_shards(replica_steps)
            stage_states = [s if s is not None else live for s, live in zip(shard_states, live_states)]
            self.stats.update(assembled_from=["shard" if s is not None else "replica" for s in shard_states],
                              shard_steps=shard_steps)
        finally:
            await self._shutdown()
        return self._result(stage_states, replica_steps, spread, wall_s)

    async def _start_swarm(self, seq_len: int) -> None:
        """Start the run's processes (the bootstrap, the stage peers unless the user's tasks serve them, the
        trainers) and its training clock."""
        self.config = self._write_config(seq_len)
        await self._start_dht()
        self._spawn(self._heartbeat_forever())
        if self.plan.placement == "attach":  # the user's swarm-peer tasks serve the stages
            await self._wait_attached()
        else:
            peers = [self._start_peer(s, speed, load_state=False) for s, speed in self.plan.slots()]
            await self._wait_declared(peers)
        self.phase = "training"
        await self._beat()
        for rank in range(self.plan.trainers):
            self._start_trainer(rank)
        await self._wait_trainers_ready()
        # training starts now, for every trainer at once (their start-up - seconds of imports and a DHT join
        # on a loaded machine - does not count against a seconds budget)
        self.start, self.start_wall = time.perf_counter(), time.time()
        self.first_start_wall = self.first_start_wall or self.start_wall
        self._write_clock()

    async def _reattach(self) -> None:
        """Take over the live swarm of this folder (``run_state``: its launcher was killed, its processes train
        on): join its DHT, beat its heartbeat under its run id, adopt its bootstrap, stage peers and trainers
        (``processes.Adopted``: restarted like this launcher's own when they die), start a peer for each one a
        stage lacks, and go on with its training clock. Training time runs from the clock's origin."""
        self.config, self.addr_file = self.workdir / CONFIG_FILE, self.workdir / ADDR_FILE
        self.order = WorkOrder.from_spec(self.total, read_json(self.config).get("order"))
        await self._join()
        self.phase = "training"
        await self._beat()
        self._spawn(self._heartbeat_forever())
        live = swarm_processes(self._markers())
        for pid, _ in live["bootstrap"]:
            self.bootstrap = Adopted(pid)
            self.groups.adopt(self.bootstrap)
        moves = self.workdir / MOVES_FILE
        for pid, cmdline in live["stage"]:
            uid, stage = stage_after_moves(moves, option(cmdline, "--uid"), int(option(cmdline, "--stage")))
            peer = PeerProcess(uid, stage, float(option(cmdline, "--speed")), Adopted(pid),
                               self.workdir / f"{option(cmdline, '--uid')}.log")
            self.groups.adopt(peer.proc)
            self.peers[uid] = peer
        for pid, cmdline in live["trainer"]:
            rank = int(option(cmdline, "--rank"))
            self.trainers[rank] = Adopted(pid, ended_well=lambda rank=rank: self._trainer_finished(rank))
            self.groups.adopt(self.trainers[rank])
        self.moves_seen = len(self._move_events())   # the adopted peers' moves are known
        self.next_uid = self._last_uid()
        for stage, planned in enumerate(self.plan.peers_per_stage):   # the missing slots, with their own speeds
            free = [speed for s, speed in self.plan.slots() if s == stage]
            live = [p for p in self.peers.values() if p.stage == stage]
            for peer in live:
                if peer.speed in free:
                    free.remove(peer.speed)
            for speed in free[:max(planned - len(live), 0)]:
                self._start_peer(stage, speed, load_state=True)
        for rank in range(self.plan.trainers):
            if rank not in self.trainers:
                self.trainers[rank] = None
                if self._trainer_finished(rank):
                    self.finished.add(rank)
                else:
                    self._start_trainer(rank)
        origin = read_clock(self.workdir, self.run_id)["origin_wall"]
        self.start, self.start_wall = time.perf_counter(), time.time()
        self.wall_before = self.start_wall - origin   # the swarm trained while no launcher was there
        with contextlib.suppress(Exception):
            self.first_start_wall = float(read_json(self.workdir / TIME_FILE)["start_wall"])
        self.first_start_wall = self.first_start_wall or origin
        self.stats["reattached"] = {"run_id": self.run_id, "peers": sorted(self.peers),
                                    "trainers": sorted(r for r, p in self.trainers.items() if p is not None),
                                    "training_s_before": round(self.wall_before, 3)}
        print(f"re-attached to the live swarm {self.run_id} in {self.workdir}: peers {sorted(self.peers)}, "
              f"trainers {self.stats['reattached']['trainers']}", flush=True)

    def _stop_on_signals(self) -> None:
        """From here on (training), SIGTERM and SIGINT (``scancel``, Ctrl-C) stop the swarm deliberately
        (``_stop_swarm``) instead of ending this process at once; off the main thread there are no handlers."""
        if threading.current_thread() is threading.main_thread():
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stop.set)

    async def _stop_swarm(self) -> None:
        """A deliberate stop: the heartbeat says ``stopping``; each stage's lowest uid at its latest step writes the
        stage's shard, then every peer and trainer exits (``membership.watch_launcher``). Waits ``STOP_WAIT_S`` at
        most for them, then raises ``SwarmStopped`` (the shutdown kills what is left; ``run`` exits as SIGTERM would);
        a rerun resumes from the shards."""
        for task in list(self.tasks):
            if task.get_coro().__name__ in ("_kill_forever", "_fault", "_restart_peer", "_restart_trainer"):
                task.cancel()
        print(f"stopping the swarm {self.run_id}: its stages write their shards", file=sys.stderr, flush=True)
        self.phase = "stopping"
        with contextlib.suppress(Exception):
            await self._beat()
        deadline = time.monotonic() + STOP_WAIT_S
        while time.monotonic() < deadline and (any(p.alive for p in self.peers.values() if p.uid not in self.retired)
                                               or any(t is not None and t.poll() is None
                                                      for t in self.trainers.values())):
            await asyncio.sleep(SUPERVISE_PERIOD_S)
        raise SwarmStopped(f"the swarm {self.run_id} was stopped (SIGTERM or SIGINT)")

    async def _shutdown(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.node is not None and self.phase != "stopping":
            self.phase = "done"
            write_text(self.workdir / DONE_FILE, self.run_id + "\n")  # attach: a task whose peer died last exits 0
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._beat(), timeout=5.0)
        self.groups.close()
        if self.node is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.node.shutdown(), timeout=10.0)


def _exit_on_sigterm(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


def run(plan, source, total_microbatches: int, progress: bool = True) -> TrainResult:
    """Run one swarm under the launcher on a microbatch source (``data``); every process it started (and this
    process's p2pd) is gone on return. A state folder (``plan.state_dir``) is kept, also after success: the caller
    removes it (``train.remove_state``) once it has written what it makes of the result."""
    before = own_daemons()
    launcher = Launcher(plan, source, total_microbatches, progress)
    keep_logs, previous = True, None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        result = asyncio.run(launcher.main())
        keep_logs = False
        return result
    except SwarmStopped as e:
        print(e, file=sys.stderr, flush=True)
        raise SystemExit(128 + signal.SIGTERM) from None
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        launcher.groups.close()
        for pid in own_daemons() - before:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if launcher.state_dir is not None:  # every process of the run is gone: another launcher may resume it
            os.close(launcher.lock_fd)
        if keep_logs:
            print(f"hivemind swarm failed; logs kept in {launcher.workdir}"
                  + (" (a rerun with the same settings resumes from its stage shards)" if launcher.state_dir else ""),
                  file=sys.stderr, flush=True)
        elif launcher.state_dir is None:  # a state folder stays for the caller, which removes it after its outputs
            shutil.rmtree(launcher.workdir, ignore_errors=True)
