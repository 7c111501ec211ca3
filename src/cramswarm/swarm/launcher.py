"""The launcher of a hivemind swarm: starts the processes, restarts the dead, gathers the result - no training.

``hivemind_transport.run_swarm`` uses it for plans with ``decentralised`` set (``train`` sets it for every
placement and any budget; see ``hivemind_transport.decentralised_supported``).
Processes (each its own process-group leader, ``processes.ProcessGroups``; with the srun placement each also its
own job step of the SLURM job, on any of its nodes: ``srun.SrunPlacement``; with the attach placement the stage
peers are the user's ``swarm-peer`` tasks - ``peer_process.run_task``, rank r serving the r-th entry of the
config's ``placement_specs`` - which the launcher waits for and neither restarts nor kills: each task restarts its
own peer):

* ``bootstrap`` - the process that starts the DHT (``peer_process bootstrap``) and writes the address file;
  every later process - stage peer or trainer - joins through any live entry of that file and appends its own
  addresses (``membership.join_swarm``), so the bootstrap may die without stopping newcomers or training;
* stage peers - ``peer_process stage`` with ``peer_sync.SyncingStagePeer``: they serve their stage, decide
  their stage's synchronous steps among themselves (``peer_sync``) and, with ``rebalance_period_s``, which of them
  moves to a starved stage; the mover moves itself, in its process (``peer_rebalance``);
* trainers - ``python -m cramswarm.swarm.trainer``, one per ``trainers``, each owning a shard of the
  microbatches (``trainer``), which it makes itself from the run's microbatch source (``data``: the packed
  training blocks, masked per microbatch index); this process writes no microbatch. Training starts once every
  trainer has joined the swarm: then this process writes the training clock (``peer_sync.CLOCK_FILE``), which
  the trainers wait for before their first microbatch.

Budgets: a token or step budget fixes the number of microbatches before the start. A seconds budget does not:
the training clock (``peer_sync.CLOCK_FILE``) holds the origin of training time and the deadline, the budget
after the origin; the trainers take microbatches until the deadline
and finish the one under way, and the end is that of a counted run (the last, partial global batch, the final
shards). Only training time counts: a resumed seconds run gets the budget less its earlier lives' training time.

What the launcher still does, and what its death means: it keeps a heartbeat record in the DHT (the key the peers and
trainers of the swarm watch, ``membership.launcher_key``); it restarts a trainer that died (same rank: it
resumes its shard from its progress file) and a stage peer that died (a fresh uid for the same stage, which
downloads the stage's state from a live replica before it serves), ``rejoin_after_s`` later; it runs the fault
injection (``kill_every_s``: SIGKILL of a random stage peer, never the last replica at its stage's latest step; with
the attach placement the peer's ``die`` RPC, and its task restarts it; ``faults``: SIGKILL of named processes at
given times; ``gone<N>:stage<S>``: N peers of a stage, never replaced) - it only kills and restarts, it holds no
training state; once every trainer reports its shard done it asks the peers for the last, partial global batch
(``peer_sync.flush_key``), waits until every stage is idle, downloads the stages' parameters from live replicas and
stops everything. If it dies, the peers and trainers exit: at once where they see their parent gone, else once its
heartbeat record has been missing ``launcher_grace_s``.

Checkpoint and resume: with ``state_dir`` (the swarm_pretrain rule's resumable state folder, under
``results/.state``) the run's folder is that folder, not a temporary one. The stage peers write their stages'
shards to its ``shards/`` folder (``peer_sync``: every ``checkpoint_every_s`` and once more at the end) and the
checkpoint is assembled from the final shards. ``resume.json`` records what the run was started with (model,
recipe, stages, trainers, compressions, seed, microbatches, the microbatch source's spec and a SHA-1 of its first
and last microbatch). A launcher that
finds it - the previous one was killed with everything it started - resumes: the stage peers load their stage's
newest shard, and each trainer resumes its shard at its first microbatch that not every stage's shard has
stepped (the stages skip the ones they already stepped: ``peer_sync``'s duplicate backward calls), so no
microbatch is lost or stepped twice. A launcher whose settings or data differ from ``resume.json``'s refuses,
naming what differs. The folder is kept when the run fails, and also when it succeeds: its caller removes it
once the run's outputs are written (``train.swarm_pretrain``), so that a kill between the two resumes instead of
starting from step 0.

Rebalancing (``rebalance_period_s``) is the peers' own (``peer_rebalance``): the launcher decides and tells no move;
it reads the peers' ``moves.jsonl`` to restart a moved peer, should it die, on its new stage, and for the result's
``moves``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import io
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import torch
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from tqdm.auto import tqdm

from cramswarm.io import read_json, write_json, write_text
from cramswarm.swarm import averaging, data
from cramswarm.swarm.emulation_training import TrainResult
from cramswarm.swarm.membership import (
    ADDR_FILE,
    CONFIG_FILE,
    DECLARE_PERIOD_S,
    DONE_FILE,
    RECORD_TTL_S,
    flush_key,
    join_dht,
    launcher_key,
    listen_host,
    read_addr_file,
    stage_namespace,
    stage_records,
)
from cramswarm.swarm.peer_rebalance import MOVES_FILE
from cramswarm.swarm.peer_sync import (
    CLOCK_FILE,
    SYNC_LOG,
    SyncingStagePeer,
    load_shard,
    newest_shard,
    progress_records,
    stage_stalls,
)
from cramswarm.swarm.policies import NoPeersError, kill_candidates
from cramswarm.swarm.processes import PeerProcess, ProcessGroups, own_daemons, peer_gpu
from cramswarm.swarm.trainer import EXIT_NO_PEERS, losses_path, progress_path, shard
from cramswarm.swarm.wire import request, unpack

TRAINER_MODULE = [sys.executable, "-m", "cramswarm.swarm.trainer"]
SUPERVISE_PERIOD_S = 0.5  # the launcher checks its processes this often
IDLE_READS = 3            # a stage is idle once this many reads in a row show no held samples and one step
COLLECT_ATTEMPTS = 3      # the end of a run asks a stage for its state this many times (twice the wait each time)
RESUME_FILE = "resume.json"  # in a state folder: what the run was started with (a rerun resumes only the same)
LOCK_FILE = "launcher.lock"
TIME_FILE = "launcher.json"  # in a state folder: training seconds so far, first start (wall clock)
STALE_WAIT_S = 45.0       # a resuming launcher waits this long for the killed run's processes to be gone
KILLED_STEP = 128 + signal.SIGKILL  # srun's exit code for a task SIGKILLed (its step's, srun placement)
PEER_MEMORY_KEYS = ("uid", "stage", "stage_parameter_count", "parameter_bytes", "optimizer_bytes", "peak_rss_bytes",
                    "rss_bytes", "runtime_rss_bytes", "activation_bytes")


class ResumeMismatch(ValueError):
    """A state folder holds an interrupted run whose settings or data differ from this one's."""


def differences(old, new, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two JSON-like values, with both values (``key: old -> new``)."""
    if isinstance(old, dict) and isinstance(new, dict):
        found = []
        for key in sorted(set(old) | set(new), key=str):
            name = f"{prefix}.{key}" if prefix else str(key)
            if key not in old or key not in new:
                found.append(f"{name}: {old.get(key, '(absent)')!r} -> {new.get(key, '(absent)')!r}")
            else:
                found.extend(differences(old[key], new[key], name))
        return found
    return [] if old == new else [f"{prefix or 'value'}: {old!r} -> {new!r}"]


def rank_of_uid(uid: str) -> int | None:
    """The rank in a ``swarm-peer`` task's uid (``s<stage>r<rank>.<incarnation>``); None for local peers."""
    head, _, rest = uid.partition("r")
    return int(rest.split(".")[0]) if rest and head.startswith("s") and "." in rest else None


class Launcher:
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
        self.host = listen_host({"host": plan.host, "interface": plan.interface})
        self.node = None
        self.phase = "starting"
        self.stage_params = stage_parameter_counts(plan.arch, plan.vocab_size, plan.stages, plan.compression)
        self.peers: dict[str, PeerProcess] = {}   # uid -> process (live or dead, until restarted)
        self.retired: set[str] = set()            # peers killed on purpose or restarted
        self.trainers: dict[int, object] = {}     # rank -> Popen
        self.finished: set[int] = set()
        self.next_uid = 0
        self.moves_seen = self.moves_base = 0      # lines of the peers' moves file read so far / before this life
        self.bootstrap = None
        self.tasks: set[asyncio.Task] = set()
        self.stats = {"peers_killed": 0, "rejoins": 0, "trainer_restarts": 0, "killed": [], "bootstrap_killed": 0}
        self.start = time.perf_counter()
        self.start_wall = time.time()
        self.wall_before, self.first_start_wall = 0.0, None  # training time of earlier lives (a resumed run)

    # -- files ----------------------------------------------------------------------------------------------
    def _lock(self) -> None:
        """Hold ``launcher.lock`` in the state folder until ``run`` returns: two launchers on one folder at once
        would resume the same run twice."""
        self.lock_fd = os.open(self.workdir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.lock_fd)
            raise RuntimeError(f"another launcher is running on the swarm state folder {self.workdir}") from None

    def _fingerprint(self) -> dict:
        """What a resumed run must share with the interrupted one (timeouts, faults, hosts may change)."""
        p = self.plan
        return json.loads(json.dumps({
            "arch": p.arch, "vocab_size": p.vocab_size, "recipe": p.recipe, "stages": p.stages,
            "trainers": p.trainers, "compression": p.compression, "averaging_compression": p.averaging_compression,
            "seed": p.seed, "microbatches": self.total}))

    def _clear(self) -> None:
        """A fresh start in a state folder: remove an earlier run's files (all but the lock)."""
        for path in self.workdir.iterdir():
            if path.name == LOCK_FILE:
                continue
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    def _prepare(self) -> int:
        """Check the microbatch source; in a state folder holding an interrupted run, check that this run
        is the same and set it up to resume from the shards. Returns the tokens per sequence."""
        record_path = self.workdir / RESUME_FILE
        if self.state_dir is not None:
            self._wait_for_stale_processes()
        previous = read_json(record_path) if self.state_dir is not None and record_path.exists() else None
        fingerprint = self._fingerprint()
        if previous is not None:
            diff = differences(previous["fingerprint"], fingerprint)
            if diff:
                raise ResumeMismatch(f"cannot resume the interrupted swarm run in {self.workdir}: its settings differ "
                                     f"from this run's ({'; '.join(diff)}); rerun with the interrupted run's "
                                     f"settings, or remove {self.workdir} to start from step 0")
        elif self.state_dir is not None:
            self._clear()
        seq_len, digest, spec = int(self.source[0][0].shape[1]), data.fingerprint(self.source, self.total), \
            self.source.spec()
        if previous is not None:
            diff = differences(previous.get("data"), spec, "data")
            if diff or previous["data_sha1"] != digest:
                raise ResumeMismatch(f"cannot resume the interrupted swarm run in {self.workdir}: its training "
                                     f"microbatches differ from this run's ({'; '.join(diff) or 'same source'}; "
                                     f"SHA-1 {previous['data_sha1']} -> {digest}: other blocks or masking); remove "
                                     f"{self.workdir} to start from step 0")
            self._resume()
        elif self.state_dir is not None:
            write_json(record_path, {"fingerprint": fingerprint, "data": spec, "data_sha1": digest,
                                     "seq_len": seq_len})
        return seq_len

    def _resume(self) -> None:
        """Set up the folder of an interrupted run: the trainers restart at the first microbatch of their shard
        that not every stage's newest shard has stepped; the last stage's log keeps the shard's steps."""
        (self.workdir / ADDR_FILE).unlink(missing_ok=True)  # the dead swarm's addresses
        (self.workdir / CLOCK_FILE).unlink(missing_ok=True)  # its clock: this life writes its own
        for tmp in [*self.workdir.glob(".*.tmp"), *self.shard_dir.glob(".*")]:  # writes cut short
            tmp.unlink(missing_ok=True)
        shards = [newest_shard(self.shard_dir, s) for s in range(self.plan.stages)]
        states = [load_shard(found[1]) if found else None for found in shards]
        stepped = set.intersection(*[set(state.get("stepped_mbs", [])) if state else set() for state in states])
        before, after = [], []
        for rank in range(self.plan.trainers):
            mine = shard(self.total, rank, self.plan.trainers)
            counts = {"retries": 0, "timeouts": 0, "errors": 0}
            try:
                previous = read_json(progress_path(self.workdir, rank))
                before.append(int(previous["done"]))
                counts.update({k: int(previous.get("stats", {}).get(k, 0)) for k in counts})  # the run's, both lives
            except Exception:  # no progress file yet: the trainer had not started
                before.append(0)
            # not past the trainer's own count either: a microbatch stepped everywhere may lack its loss record
            done = min(next((j for j, i in enumerate(mine) if i not in stepped), len(mine)), before[-1])
            losses = losses_path(self.workdir, rank)
            if losses.exists():  # whole records only (a write cut short would run into the next one)
                write_text(losses, "".join(f"{line}\n" for line in losses.read_text().splitlines()
                                           if _mb_of(line) is not None))
            size = len(mine) if data.bounded(self.total) else None
            write_json(progress_path(self.workdir, rank), {"rank": rank, "done": done, "shard": size,
                                                            "stats": counts})
            after.append(done)
        last_step = shards[-1][0] if shards[-1] else 0
        for path in self.workdir.glob(f"log-s{self.plan.stages - 1}[pr]*.jsonl"):  # steps the shard holds
            kept = [line for line in path.read_text().splitlines() if _step_of(line) <= last_step]
            write_text(path, "".join(f"{line}\n" for line in kept))
        used = [int(p.stem.split("p")[-1]) for p in self.workdir.glob("s*p*.log") if p.stem.split("p")[-1].isdigit()]
        self.next_uid = max(used, default=0)  # fresh uids: the dead peers' logs and counters stay
        with contextlib.suppress(Exception):  # a run killed before its training started has none
            times = read_json(self.workdir / TIME_FILE)
            self.wall_before, self.first_start_wall = float(times["wall_s"]), float(times["start_wall"])
        self.stats["resumed"] = {"wall_s_before": round(self.wall_before, 3),
                                 "shard_steps": [found[0] if found else 0 for found in shards],
                                 "trainer_done_before": before, "trainer_done": after}
        print(f"resuming the swarm run in {self.workdir}: stage shards at steps {self.stats['resumed']['shard_steps']}"
              f", trainers at microbatch {after} of their shards (they had done {before})", flush=True)

    def _stale_processes(self) -> list[int]:
        """PIDs of live processes of an earlier launcher of this folder (their command line names its config or its
        DHT address file)."""
        markers, found = {str(self.workdir / CONFIG_FILE), str(self.workdir / ADDR_FILE)}, []
        for proc in psutil.process_iter(["cmdline", "status"]):
            with contextlib.suppress(psutil.Error):
                if markers & set(proc.info["cmdline"] or []) and proc.info["status"] != psutil.STATUS_ZOMBIE:
                    found.append(proc.pid)
        return found

    def _wait_for_stale_processes(self) -> None:
        """The killed run's peers and trainers exit by themselves (their parent is gone, or its heartbeat): wait
        for them, so that none writes a shard or a progress file under the resumed run."""
        deadline = time.monotonic() + STALE_WAIT_S
        while stale := self._stale_processes():
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {stale} of the interrupted swarm run in {self.workdir} are still "
                                   f"running after {STALE_WAIT_S:.0f} s; end them before resuming")
            time.sleep(0.5)

    def _write_clock(self) -> None:
        """The training clock the trainers and peers read (``peer_sync.CLOCK_FILE``): training time 0 is this
        life's start less the earlier lives' training time; a seconds budget ends ``budget`` seconds after it."""
        origin = self.start_wall - self.wall_before
        budget = self.plan.recipe["budget"]
        deadline = origin + float(budget["value"]) if budget["unit"] == "seconds" else None
        write_json(self.workdir / CLOCK_FILE, {"run_id": self.run_id, "origin_wall": origin,
                                               "deadline_wall": deadline})
        self.stats["deadline_s"] = round(deadline - origin, 3) if deadline is not None else None

    def _record_time(self) -> None:
        """In a state folder: the training time so far (all lives) and the first life's start, for a resume."""
        if self.state_dir is not None:
            write_json(self.workdir / TIME_FILE, {"wall_s": self.wall_before + self.elapsed(),
                                                  "start_wall": self.first_start_wall})

    def _write_config(self, seq_len: int) -> Path:
        p = self.plan
        cfg = {"run_id": self.run_id, "arch": p.arch, "vocab_size": p.vocab_size, "recipe": p.recipe,
               "device": p.device, "stages": p.stages, "compression": p.compression, "sync_timeout_s": p.sync_timeout_s,
               "averaging_compression": p.averaging_compression, "link_mbit_s": p.link_mbit_s,
               "join_timeout_s": p.join_timeout_s, "give_up_after_s": p.retry.give_up_after_s, "host": p.host,
               "interface": p.interface, "launcher_grace_s": p.launcher_grace_s, "peer_sync": True,
               "seq_len": seq_len, "workdir": str(self.workdir), "retry": dataclasses.asdict(p.retry),
               "seed": p.seed, "shard_dir": str(self.shard_dir), "checkpoint_every_s": p.checkpoint_every_s,
               "rebalance_period_s": p.rebalance_period_s, "peer_memory_cap_mb": p.peer_memory_cap_mb,
               "data": self.source.spec(), "microbatches": self.total, "routing": p.routing,
               "peer_unit_time_s": p.peer_unit_time_s, "rejoin_after_s": p.rejoin_after_s,
               # attach: rank r's task serves (stage, speed) of the r-th peer in stage order (peer_process.run_task)
               "placement_specs": [[s, p.peer_speeds[i % len(p.peer_speeds)]] for i, s in enumerate(
                   s for s, n in enumerate(p.peers_per_stage) for _ in range(n))]}
        path = self.workdir / CONFIG_FILE
        tmp = self.workdir / f".{CONFIG_FILE}.tmp"
        tmp.write_text(json.dumps(cfg))
        os.replace(tmp, path)
        return path

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
        proc, _ = self.groups.spawn(["--config", str(self.config), "--rank", str(rank), "--trainers",
                                     str(self.plan.trainers)], f"trainer{rank}", launcher=TRAINER_MODULE)
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
        args = ["bootstrap", "--addr-file", str(self.addr_file), "--host", self.host]
        if self.plan.placement == "srun":  # on any node: its own interface's address; no parent to watch
            args += ["--interface", self.plan.interface] if self.plan.interface else []
            args += ["--run-id", self.run_id, "--grace-s", repr(self.plan.launcher_grace_s)]
        self.bootstrap, log = self.groups.spawn(args, "bootstrap")
        deadline = time.monotonic() + self.plan.startup_timeout_s
        while not self.addr_file.exists():
            if self.bootstrap.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the bootstrap DHT did not write {self.addr_file}:\n"
                                   f"{log.read_text(errors='replace')}")
            await asyncio.sleep(0.2)
        maddrs = await asyncio.to_thread(read_addr_file, self.addr_file, self.plan.join_timeout_s)
        self.node = await join_dht(maddrs, client_mode=True, host=self.host, timeout_s=self.plan.join_timeout_s)

    async def _beat(self) -> None:
        await self.node.store(launcher_key(self.run_id), self.phase, get_dht_time() + RECORD_TTL_S)

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

    def _move_events(self) -> list[dict]:
        """The complete lines of the moves file the peers append to (``peer_rebalance``)."""
        path = self.workdir / MOVES_FILE
        events = []
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                events.append(json.loads(line))
            except ValueError:  # a line being written: read it next time
                break
        return events

    def _follow_moves(self) -> None:
        """Follow the moves the peers made themselves: a moved process is restarted, should it die, on the stage
        it moved to, and is known by its new uid once it arrived (the launcher decides and tells nothing)."""
        events = self._move_events()
        for event in events[self.moves_seen:]:
            peer = self.peers.get(event["uid"])
            if peer is None:
                continue
            peer.stage = event["to_stage"]
            if event["event"] == "arrived":
                del self.peers[event["uid"]]
                peer.uid = event["new_uid"]
                self.peers[peer.uid] = peer
        self.moves_seen = len(events)

    def _trainer_failed(self, rank: int, code: int) -> Exception:
        log = (self.workdir / f"trainer{rank}.log").read_text(errors="replace")[-3000:]
        if code == EXIT_NO_PEERS:
            with contextlib.suppress(Exception):
                return NoPeersError(read_json(progress_path(self.workdir, rank))["no_peers_stage"])
        return RuntimeError(f"trainer {rank} exited with code {code}:\n{log}")

    async def _killable(self) -> list[PeerProcess]:
        """Live peers of stages where at least two live replicas are at the stage's latest step
        (``policies.kill_candidates``, the emulation's rule too)."""
        steps = {stage: {u: r["step"] for u, r in (await progress_records(self.node, self.run_id, stage)).items()}
                 for stage in range(self.plan.stages)}
        live = {u for u, peer in self.peers.items() if peer.alive and u not in self.retired}
        return [self.peers[u] for u in kill_candidates(steps, live)]

    def _kill_peer(self, peer: PeerProcess) -> None:
        self.retired.add(peer.uid)
        self.groups.kill(peer.proc)
        self.stats["peers_killed"] += 1
        self.stats["killed"].append({"uid": peer.uid, "stage": peer.stage, "t_s": round(self.elapsed(), 2)})
        self._spawn(self._restart_peer(peer))

    async def _kill_forever(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            if self.plan.placement == "attach":  # the user's tasks' peers: asked to die, their task restarts them
                candidates = await self._killable_attached()
                if candidates:
                    await self._kill_attached(*self.rng.choice(candidates))
                continue
            candidates = await self._killable()
            if candidates:
                self._kill_peer(self.rng.choice(candidates))

    async def _killable_attached(self) -> list[tuple[int, str, str]]:
        """attach: (stage, uid, DHT peer id) of the declared peers of stages where at least two of them are at the
        stage's latest step (the launcher has no process of theirs to look at: their records say who is alive)."""
        found = []
        for stage in range(self.plan.stages):
            records = await progress_records(self.node, self.run_id, stage)
            declared = await stage_records(self.node, self.run_id, stage)
            live = set(declared) - self.retired
            steps = {stage: {u: r["step"] for u, r in records.items()}}
            found.extend((stage, uid, declared[uid][0]) for uid in kill_candidates(steps, live))
        return found

    def _stage_stub(self, stage: int, peer: str):
        """An RPC stub for the stage peer whose DHT peer id (base58) is ``peer``."""
        return SyncingStagePeer.get_stub(self.node.p2p, PeerID.from_base58(peer),
                                         namespace=stage_namespace(self.run_id, stage))

    async def _kill_attached(self, stage: int, uid: str, peer: str) -> None:
        """attach: a peer the launcher did not start dies by its ``die`` RPC (it SIGKILLs its own process group, as
        a preempted host would lose it); its ``swarm-peer`` task starts it again as a new incarnation, which
        downloads the stage's state. Counted as a rejoin once the task's new incarnation has declared itself."""
        self.retired.add(uid)
        stub = self._stage_stub(stage, peer)
        with contextlib.suppress(Exception):  # it may die before its reply is out
            await asyncio.wait_for(unpack(await stub.rpc_die(request({}, {}))), timeout=self.plan.sync_timeout_s)
        self.stats["peers_killed"] += 1
        self.stats["killed"].append({"uid": uid, "stage": stage, "t_s": round(self.elapsed(), 2)})
        self._spawn(self._count_rejoin(stage, uid))

    async def _count_rejoin(self, stage: int, uid: str) -> None:
        """attach: wait for the killed peer's task (its rank, ``rank_of_uid``) to declare a new incarnation."""
        rank, prefix = rank_of_uid(uid), uid.split(".")[0] + "."
        deadline = time.monotonic() + self.plan.startup_timeout_s
        while rank is not None and time.monotonic() < deadline:
            declared = await stage_records(self.node, self.run_id, stage)
            if any(u.startswith(prefix) and u != uid and u not in self.retired for u in declared):
                self.stats["rejoins"] += 1
                return
            await asyncio.sleep(SUPERVISE_PERIOD_S)

    async def _fault(self, at_s: float, target: str) -> None:
        """``faults``: SIGKILL ``bootstrap``, ``trainer<R>``, ``peer`` (a killable stage peer), ``stage<S>`` (every
        live peer of stage S but one at its latest step, at once) or ``allofstage<S>`` (every live peer of stage S:
        their restarts find no replica and serve from the stage's shard) at ``at_s``; ``gone<N>:stage<S>`` SIGKILLs N
        live peers of stage S (:func:`gone_victims`) and starts no replacement (they are gone for good: the stage stays
        starved unless the peers rebalance); any other target goes to the placement (``plan.hosts.fault``) ``at_s``
        after the first finished microbatch (trainer processes take seconds to start: a link cut must fall into the
        training)."""
        gone = parse_gone(target)
        host_fault = (gone is None and target not in ("bootstrap", "peer")
                      and not target.startswith(("trainer", "stage", "allofstage")))
        while host_fault and self._done_microbatches() < 1:
            await asyncio.sleep(0.1)
        await asyncio.sleep(at_s)
        if target == "bootstrap":
            self.groups.kill(self.bootstrap)
            self.stats["bootstrap_killed"] += 1
        elif target.startswith("trainer"):
            rank = int(target[len("trainer"):])
            if rank not in self.finished and self.trainers[rank].poll() is None:
                self.groups.kill(self.trainers[rank])
                self.stats["killed"].append({"uid": target, "t_s": round(self.elapsed(), 2)})
        elif gone is not None:
            count, stage = gone
            records = await progress_records(self.node, self.run_id, stage)
            live = {u: records[u]["step"] if u in records else -1 for u, p in self.peers.items()
                    if p.stage == stage and p.alive and u not in self.retired}
            for uid in gone_victims(live, count):
                peer = self.peers[uid]
                self.retired.add(uid)   # never replaced: _supervise restarts only peers that are not retired
                self.groups.kill(peer.proc)
                self.stats["peers_killed"] += 1
                self.stats["killed"].append({"uid": uid, "stage": stage, "t_s": round(self.elapsed(), 2),
                                             "replaced": False})
        elif target == "peer":
            candidates = await self._killable()
            if candidates:
                self._kill_peer(self.rng.choice(candidates))
        elif target.startswith("allofstage"):  # every live peer of the stage; each is restarted as usual
            stage = int(target[len("allofstage"):])
            for uid, peer in list(self.peers.items()):
                if peer.stage == stage and peer.alive and uid not in self.retired:
                    self._kill_peer(peer)
        elif target.startswith("stage"):
            stage = int(target[len("stage"):])
            records = await progress_records(self.node, self.run_id, stage)
            latest = max((r["step"] for r in records.values()), default=0)
            keep = min((u for u, r in records.items() if r["step"] == latest and u in self.peers
                        and self.peers[u].alive and u not in self.retired), default=None)
            for uid, peer in list(self.peers.items()):
                if peer.stage == stage and peer.alive and uid not in self.retired and uid != keep and keep:
                    self._kill_peer(peer)
        elif hasattr(self.place, "fault"):  # the placement's own faults (a testbed link cut)
            await asyncio.to_thread(self.place.fault, target)
            self.stats.setdefault("host_faults", []).append({"target": target, "t_s": round(self.elapsed(), 2)})
        else:
            raise ValueError(f"unknown fault target {target!r}")

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def _done_microbatches(self) -> int:
        done = 0
        for rank in range(self.plan.trainers):
            with contextlib.suppress(Exception):
                done += read_json(progress_path(self.workdir, rank))["done"]
        return done

    async def _supervise(self) -> None:
        """Until every trainer is done: restart dead trainers and peers, fail on a trainer's error."""
        bar = tqdm(total=self.total if data.bounded(self.total) else None, desc="swarm (hivemind, launcher)",
                   unit="mb", disable=not self.progress,
                   mininterval=2.0)
        try:
            while len(self.finished) < self.plan.trainers:
                if self.failed.done():
                    self.failed.result()
                for rank, proc in list(self.trainers.items()):
                    if rank in self.finished or proc is None or (code := proc.poll()) is None:
                        continue
                    self.groups.kill(proc)  # its p2pd
                    if code == 0:
                        self.finished.add(rank)
                    elif code < 0 or (code == KILLED_STEP and self.plan.placement == "srun"):
                        # killed by a signal: restart with the same rank, it resumes its shard
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

    async def _finish_steps(self) -> None:
        """Ask the peers for the last, partial global batch and wait until every stage is idle."""
        await self.node.store(flush_key(self.run_id), True, get_dht_time() + 3600)
        bound = max(self.plan.retry.give_up_after_s, 3 * max(
            averaging.averaging_timeout_s(n, max(self.plan.peers_per_stage), self.plan.averaging_compression,
                                          self.plan.link_mbit_s, 2 * self.plan.sync_timeout_s)
            for n in self.stage_params))
        deadline, idle = time.monotonic() + bound, 0
        while idle < IDLE_READS:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the stages did not finish their last steps within {bound:.0f} s")
            quiet = True
            for stage in range(self.plan.stages):
                records = await progress_records(self.node, self.run_id, stage)
                steps = {r["step"] for r in records.values()}
                quiet &= bool(records) and len(steps) == 1 and not any(r["samples"] or r["ready"]
                                                                        for r in records.values())
            idle = idle + 1 if quiet else 0
            await asyncio.sleep(SUPERVISE_PERIOD_S)

    async def _final_shards(self, replica_steps: dict[int, dict[str, int]]) -> tuple[list[dict | None], list[int]]:
        """The stages' final shards (module state dicts; None for a stage that never stepped), once each stage's
        newest shard is at the step its live replicas reached."""
        bound = max(self.plan.retry.give_up_after_s, 3 * max(
            averaging.state_timeout_s(n, self.plan.link_mbit_s, 2 * self.plan.sync_timeout_s)
            for n in self.stage_params))
        deadline = time.monotonic() + bound
        while True:
            found = [newest_shard(self.shard_dir, s) for s in range(self.plan.stages)]
            lacking = [s for s in range(self.plan.stages) if max(replica_steps[s].values()) > 0 and
                       (found[s] is None or found[s][0] < max(replica_steps[s].values()))]
            if not lacking:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"stages {lacking} wrote no shard of their last step within {bound:.0f} s "
                                   f"(newest: {[f[2].name if f else None for f in found]}; logs in {self.workdir})")
            await asyncio.sleep(SUPERVISE_PERIOD_S)
        states = [load_shard(f[1]) if f else None for f in found]
        self.stats["stepped_microbatches"] = [len(s.get("stepped_mbs", [])) if s else 0 for s in states]
        return [s["module"] if s else None for s in states], [f[0] if f else 0 for f in found]

    async def _stage_replicas(self, stage: int, floor_s: float) -> list[tuple[str, int, dict]]:
        """(uid, step, module state) of every live replica of ``stage`` that sends its state within the timeout."""
        replicas = []
        for uid, (peer, _) in (await stage_records(self.node, self.run_id, stage)).items():
            stub = self._stage_stub(stage, peer)
            try:
                tensors, meta = await asyncio.wait_for(
                    unpack(await stub.rpc_state(request({}, {}))),
                    timeout=averaging.state_timeout_s(self.stage_params[stage], self.plan.link_mbit_s, floor_s))
            except Exception as e:
                print(f"[launcher] {uid} sent no state of stage {stage} within {floor_s:.0f} s + transfer: {e!r}",
                      flush=True)
                continue
            blob = torch.load(io.BytesIO(tensors["blob"].numpy().tobytes()), weights_only=True, map_location="cpu")
            replicas.append((uid, meta["step"], blob["module"]))
        return replicas

    async def _collect_states(self) -> tuple[list[dict], dict[int, dict[str, int]], list[float]]:
        """Every stage's live replicas at the end. A stage none of whose replicas answered is asked again, up to
        ``COLLECT_ATTEMPTS`` times with twice the wait each time: once (test_slurm's resume test, beside other jobs) a
        stage's only replica sent no state at the end of a run that had reached its budget; why is not known, so
        each failure is printed."""
        states, steps, spread = [], {}, []
        for stage in range(self.plan.stages):
            floor_s = 2 * self.plan.sync_timeout_s
            for _ in range(COLLECT_ATTEMPTS):
                replicas = await self._stage_replicas(stage, floor_s)
                if replicas:
                    break
                floor_s *= 2
            if not replicas:
                raise NoPeersError(stage)
            replicas.sort()
            reference = replicas[0][2]
            spread.append(max((float((reference[k].float() - state[k].float()).abs().max()) for _, _, state in
                               replicas[1:] for k in reference if reference[k].numel()), default=0.0))
            states.append(reference)
            steps[stage] = {uid: step for uid, step, _ in replicas}
        return states, steps, spread

    # -- results --------------------------------------------------------------------------------------------
    def _log(self) -> list[dict]:
        rows = {}
        for path in sorted(self.workdir.glob(f"log-s{self.plan.stages - 1}[pr]*.jsonl")):
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    row = json.loads(line)
                    rows.setdefault(row["step"], row)
        return [{k: v for k, v in row.items() if k not in ("time", "group")}
                | {"elapsed_s": round(row["time"] - self.first_start_wall, 3)} for _, row in sorted(rows.items())]

    def _first_logged_step(self) -> int | None:
        """The first step the last stage's peers of this launcher logged (1 unless it resumed from shards)."""
        steps = []
        for uid, peer in self.peers.items():
            path = self.workdir / f"log-{uid}.jsonl"
            if peer.stage == self.plan.stages - 1 and path.exists():
                steps.extend(_step_of(line) for line in path.read_text().splitlines())
        return min((s for s in steps if s >= 0), default=None)

    def _loss_rows(self) -> Iterator[dict]:
        """The trainers' loss records (one per microbatch done; a line cut short by a kill is skipped)."""
        for rank in range(self.plan.trainers):
            path = losses_path(self.workdir, rank)
            for line in path.read_text().splitlines() if path.exists() else []:
                with contextlib.suppress(ValueError):
                    yield json.loads(line)

    def _trainer_losses(self) -> dict[int, float]:
        return {row["mb"]: row["loss"] for row in self._loss_rows()}

    def _done_times(self) -> list[float]:
        """Seconds into training at which each microbatch was done (a resumed one: its last time), sorted."""
        return sorted({row["mb"]: round(row["time"] - self.start_wall, 3) for row in self._loss_rows()}.values())

    def _moves(self) -> list[dict]:
        """Each move the peers decided: when (seconds into training), who, from where to where, and once it
        arrived, when and under which uid, how long its drain took and the gradient samples it dropped."""
        moves, open_moves = [], {}
        for event in self._move_events()[self.moves_base:]:
            if event["event"] == "decided":
                open_moves[event["uid"]] = move = {
                    "t_s": round(event["time"] - self.start_wall, 3), "uid": event["uid"],
                    "from_stage": event["from_stage"], "to_stage": event["to_stage"], "period": event["period"]}
                moves.append(move)
            elif event["uid"] in open_moves:
                open_moves.pop(event["uid"]).update(
                    arrived_s=round(event["time"] - self.start_wall, 3), new_uid=event["new_uid"],
                    drain_s=event["drain_s"], handed_over_samples=event.get("handed_over_samples", 0),
                    lost_gradient_samples=event["lost_gradient_samples"])
        return moves

    def _trainer_stats(self) -> dict:
        """The trainers' call counters (retries, timeouts, errors), summed; a restarted trainer and a resumed run
        count on from the earlier lives (stepped samples restored from a shard include their re-sent calls)."""
        total: dict = {"retries": 0, "timeouts": 0, "errors": 0}
        for rank in range(self.plan.trainers):
            with contextlib.suppress(Exception):
                stats = read_json(progress_path(self.workdir, rank))["stats"]
                for key in total:
                    total[key] += stats[key]
                if "last_error" in stats:
                    total["last_error"] = stats["last_error"]
        return total

    def _peer_counters(self) -> list[dict]:
        found = []
        for path in sorted(self.workdir.glob("peer-*.json")):
            with contextlib.suppress(Exception):
                found.append(read_json(path))
        return found

    def _step_stalls(self) -> dict[str, list[dict]]:
        """``peer_sync.stage_stalls`` of the peers' step lines (``SYNC_LOG``; a line cut short by a kill is
        skipped), times rounded to ms and ``end`` as seconds from the first start (as the log's ``elapsed_s``);
        keyed by the stage as a string (JSON keys)."""
        rows = []
        for path in sorted(self.workdir.glob(SYNC_LOG.format(uid="*"))):
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    rows.append(json.loads(line))
        stalls = stage_stalls(rows)
        base = self.first_start_wall or 0.0
        return {str(stage): [{k: (round(v - base if k == "end" else v, 3) if isinstance(v, float) else v)
                              for k, v in entry.items()} for entry in entries] for stage, entries in stalls.items()}

    async def main(self) -> TrainResult:
        self.failed = asyncio.get_running_loop().create_future()
        try:
            seq_len = self._prepare()
            self.moves_base = self.moves_seen = len(self._move_events())  # an earlier life's moves (a resumed run)
            self.config = self._write_config(seq_len)
            await self._start_dht()
            self._spawn(self._heartbeat_forever())
            if self.plan.placement == "attach":  # the user's swarm-peer tasks serve the stages
                await self._wait_attached()
            else:
                speeds = self.plan.peer_speeds
                specs = [s for s, n in enumerate(self.plan.peers_per_stage) for _ in range(n)]
                peers = [self._start_peer(s, speeds[i % len(speeds)], load_state=False) for i, s in enumerate(specs)]
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
            if self.plan.kill_every_s:
                self._spawn(self._kill_forever(self.plan.kill_every_s))
            for at_s, target in self.plan.faults:
                self._spawn(self._fault(at_s, target))
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

    def _result(self, stage_states, replica_steps, spread, wall_s) -> TrainResult:
        losses = self._trainer_losses()
        done = self._done_microbatches()
        counters = self._peer_counters()
        micro = self.plan.recipe["micro_batch_sequences"]
        stepped = [max((c["stepped_samples"] for c in counters if c["stage"] == s), default=0)
                   for s in range(self.plan.stages)]

        def per_stage(key: str) -> list[int]:
            return [sum(c.get(key, 0) for c in counters if c["stage"] == s) for s in range(self.plan.stages)]

        sent, values = per_stage("averaging_bytes_sent"), per_stage("averaging_values_sent")
        param_steps = per_stage("averaging_param_steps")

        log = self._log()
        moves = self._moves()
        self.stats.update(self._trainer_stats())
        self.stats["first_logged_step"] = self._first_logged_step()
        self.stats["peer_devices"] = {c["uid"]: c.get("device", "cpu") for c in counters}  # where each peer computed
        # peers that found no live replica of their stage and served from its shard (the stage's last ones died)
        self.stats["served_from_shard_alone"] = {c["uid"]: c["served_from_shard_alone"] for c in counters
                                                 if c.get("served_from_shard_alone") is not None}
        # a seconds budget: the trainers took microbatches until the deadline, and each one they took counts
        requested = self.total if data.bounded(self.total) else done
        self.stats.update(
            transport="hivemind", placement=self.plan.placement, roles="launcher", microbatches_done=done,
            microbatches_requested=requested, lost_microbatches=requested - done,
            microbatches_with_loss=len(losses), trainer_losses=[losses[i] for i in sorted(losses)],
            shard_sizes=[len(shard(self.total, r, self.plan.trainers)) if data.bounded(self.total) else None
                         for r in range(self.plan.trainers)],
            steps=len(log), stage_steps=[max(steps.values()) for steps in replica_steps.values()],
            stepped_samples=stepped, lost_gradient_samples=[requested * micro - n for n in stepped],
            duplicate_samples=per_stage("duplicate_samples"), resent_samples=per_stage("resent_samples"),
            resent_kept_samples=per_stage("resent_kept_samples"),
            wall_s=round(wall_s, 3), throughput_mb_s=round(done / wall_s, 4) if wall_s > 0 else 0.0,
            per_stage_peers=[len(steps) for steps in replica_steps.values()], replica_steps=replica_steps,
            replicas_equal=not any(spread), replica_max_abs_diff=spread, process_groups=list(self.groups.pgids),
            resyncs=sum(c["resyncs"] for c in counters), digest_mismatches=sum(c["digest_mismatches"]
                                                                              for c in counters),
            joining_wait_s=round(sum(c.get("joining_wait_s", 0.0) for c in counters), 3),
            stage_parameters=self.stage_params, averaging_compression=self.plan.averaging_compression,
            peer_memory=[{key: c.get(key) for key in PEER_MEMORY_KEYS} for c in counters],
            averaging_bytes_per_param=[round(b / n, 4) if n else None for b, n in zip(sent, param_steps)],
            averaging_bytes_per_value=[round(b / n, 4) if n else None for b, n in zip(sent, values)],
            moves=moves, moves_completed=sum("arrived_s" in m for m in moves), microbatch_done_s=self._done_times(),
            incomplete_load_views=sum(c.get("incomplete_views", 0) for c in counters),
            incomplete_view_missing=_summed(c.get("incomplete_view_missing", {}) for c in counters),
            late_load_views=sum(c.get("late_views", 0) for c in counters),
            peer_loads={c["uid"]: c["load"] for c in counters if "load" in c},
            peer_backward_samples={c["uid"]: c.get("backward_samples", 0) for c in counters},
            step_stalls=self._step_stalls(),
            admission_wait_s={c["uid"]: round(c.get("admission_wait_s", 0.0), 3) for c in counters},
            held_calls={c["uid"]: c.get("held_calls", 0) for c in counters},
        )
        return TrainResult(stage_states=stage_states, log=log, stats=self.stats)

    async def _shutdown(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.node is not None:
            self.phase = "done"
            write_text(self.workdir / DONE_FILE, self.run_id + "\n")  # attach: a task whose peer died last exits 0
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._beat(), timeout=5.0)
        self.groups.close()
        if self.node is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.node.shutdown(), timeout=10.0)


GONE_TARGET = re.compile(r"gone(\d+):stage(\d+)")


def _summed(counts) -> dict[str, int]:
    """Per key, the sum of the counts of several dicts (the peers' counters)."""
    total: dict[str, int] = {}
    for one in counts:
        for key, n in one.items():
            total[key] = total.get(key, 0) + n
    return dict(sorted(total.items()))


def parse_gone(target: str) -> tuple[int, int] | None:
    """(peers, stage) of a ``gone<N>:stage<S>`` fault target (N >= 1), None for any other target."""
    match = GONE_TARGET.fullmatch(target)
    if match is None:
        return None
    count, stage = int(match.group(1)), int(match.group(2))
    if count < 1:
        raise ValueError(f"fault target {target!r}: kill at least one peer (gone1:stage<S> or more)")
    return count, stage


def gone_victims(steps: dict[str, int], count: int) -> list[str]:
    """Which of a stage's live peers (uid -> its latest step, -1 without a progress record) a ``gone<N>:stage<S>``
    fault kills: ``count`` of them, never the last one at the stage's latest step (the stage's state must stay
    downloadable), so at most all but one; the furthest behind first, then by uid."""
    if not steps:
        return []
    latest = max(steps.values())
    keep = min(u for u, step in steps.items() if step == latest)
    others = sorted((u for u in steps if u != keep), key=lambda u: (steps[u], u))
    return others[:count]


def _step_of(line: str) -> int:
    """The step of a log line (-1 for a line cut short)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return -1


def _mb_of(line: str) -> int | None:
    """The microbatch of a trainer's loss record (None for a record cut short)."""
    try:
        row = json.loads(line)
        return int(row["mb"]) if "loss" in row else None
    except (ValueError, KeyError, TypeError):
        return None


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
    except NoPeersError:
        keep_logs = launcher.state_dir is not None  # a state folder is kept for a rerun to resume
        raise
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
