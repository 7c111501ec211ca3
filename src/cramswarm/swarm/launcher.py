"""The launcher of a hivemind swarm: starts the processes, restarts the dead, gathers the result - no training.

``hivemind_transport.run_swarm`` uses it for plans with ``decentralised`` set (``train`` sets it for the local
placement without rebalancing and a token or step budget; see ``hivemind_transport.decentralised_supported``).
Processes (each its own process-group leader, ``processes.ProcessGroups``):

* ``bootstrap`` - the process that starts the DHT (``hivemind_peer bootstrap``) and writes the address file;
  every later process - stage peer or trainer - joins through any live entry of that file and appends its own
  addresses (``hivemind_peer.join_swarm``), so the bootstrap may die without stopping newcomers or training;
* stage peers - ``hivemind_peer stage`` with ``peer_sync.SyncingStagePeer``: they serve their stage and decide
  their stage's synchronous steps among themselves (``peer_sync``);
* trainers - ``python -m cramswarm.swarm.trainer``, one per ``trainers``, each owning a shard of the
  microbatches (``trainer``), which this process writes to the run folder before it starts anything.

What the launcher still does, and what its death means: it keeps a heartbeat record in the DHT (the key the
peers of the coordinator's swarm watch, ``hivemind_peer.coordinator_key``); it restarts a trainer that died (same
rank: it resumes its shard from its progress file) and a stage peer that died (a fresh uid for the same stage,
which downloads the stage's state from a live replica before it serves), ``rejoin_after_s`` later; it runs the
fault injection (``kill_every_s``: SIGKILL of a random stage peer, never the last replica at its stage's
latest step; ``faults``: SIGKILL of named processes at given times) - it only kills and restarts, it holds no
training state; once every trainer reports its shard done it asks the peers for the last, partial global batch
(``peer_sync.flush_key``), waits until every stage is idle, downloads the stages' parameters from live replicas
and stops everything. If it dies, the peers and trainers exit: at once where they see their parent gone, else
once its heartbeat record has been missing ``coordinator_grace_s`` (resuming from the trainers' progress files
and the stages' state is not implemented).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from tqdm.auto import tqdm

from cramswarm.io import read_json
from cramswarm.swarm import averaging
from cramswarm.swarm.emulation import TrainResult
from cramswarm.swarm.hivemind_peer import (
    ADDR_FILE,
    CONFIG_FILE,
    DECLARE_PERIOD_S,
    RECORD_TTL_S,
    coordinator_key,
    join_dht,
    listen_host,
    read_addr_file,
    request,
    stage_namespace,
    stage_records,
    unpack,
)
from cramswarm.swarm.peer_sync import SyncingStagePeer, flush_key, progress_records
from cramswarm.swarm.policies import NoPeersError
from cramswarm.swarm.processes import PeerProcess, ProcessGroups, own_daemons
from cramswarm.swarm.trainer import EXIT_NO_PEERS, losses_path, progress_path, shard

TRAINER_MODULE = [sys.executable, "-m", "cramswarm.swarm.trainer"]
SUPERVISE_PERIOD_S = 0.5  # the launcher checks its processes this often
IDLE_READS = 3            # a stage is idle once this many reads in a row show no held samples and one step


class Launcher:
    def __init__(self, plan, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], total_microbatches: int,
                 progress: bool):
        from cramswarm.swarm.hivemind_transport import stage_parameter_counts

        self.plan, self.batches, self.total, self.progress = plan, batches, total_microbatches, progress
        self.rng = random.Random(plan.seed)
        self.workdir = Path(tempfile.mkdtemp(prefix="cramswarm-swarm-"))
        self.run_id = f"cs{os.getpid()}x{self.rng.getrandbits(32):08x}"
        self.groups = ProcessGroups(self.workdir, place=plan.hosts)
        self.host = listen_host({"host": plan.host, "interface": plan.interface})
        self.node = None
        self.phase = "starting"
        self.stage_params = stage_parameter_counts(plan.arch, plan.vocab_size, plan.stages)
        self.peers: dict[str, PeerProcess] = {}   # uid -> process (live or dead, until restarted)
        self.retired: set[str] = set()            # peers killed on purpose or restarted
        self.trainers: dict[int, object] = {}     # rank -> Popen
        self.finished: set[int] = set()
        self.next_uid = 0
        self.bootstrap = None
        self.tasks: set[asyncio.Task] = set()
        self.stats = {"peers_killed": 0, "rejoins": 0, "trainer_restarts": 0, "killed": [], "bootstrap_killed": 0}
        self.start = time.perf_counter()
        self.start_wall = time.time()

    # -- files ----------------------------------------------------------------------------------------------
    def _write_data(self) -> int:
        """The microbatches, memory-mapped for the trainers; returns the tokens per sequence."""
        inputs = labels = None
        for i in range(self.total):
            try:
                x, y = next(self.batches)
            except StopIteration:
                raise ValueError(f"the batch iterator ran out after {i} of {self.total} microbatches") from None
            if inputs is None:
                shape = (self.total, *x.shape)
                inputs = np.lib.format.open_memmap(self.workdir / "inputs.npy", "w+", np.int32, shape)
                labels = np.lib.format.open_memmap(self.workdir / "labels.npy", "w+", np.int32, shape)
            inputs[i], labels[i] = x.numpy(), y.numpy()
        inputs.flush()
        labels.flush()
        return int(inputs.shape[2])

    def _write_config(self, seq_len: int) -> Path:
        p = self.plan
        cfg = {"run_id": self.run_id, "arch": p.arch, "vocab_size": p.vocab_size, "recipe": p.recipe,
               "stages": p.stages, "compression": p.compression, "sync_timeout_s": p.sync_timeout_s,
               "averaging_compression": p.averaging_compression, "link_mbit_s": p.link_mbit_s,
               "join_timeout_s": p.join_timeout_s, "give_up_after_s": p.retry.give_up_after_s, "host": p.host,
               "interface": p.interface, "coordinator_grace_s": p.coordinator_grace_s, "peer_sync": True,
               "seq_len": seq_len, "workdir": str(self.workdir), "retry": dataclasses.asdict(p.retry),
               "seed": p.seed}
        path = self.workdir / CONFIG_FILE
        tmp = self.workdir / f".{CONFIG_FILE}.tmp"
        tmp.write_text(json.dumps(cfg))
        os.replace(tmp, path)
        return path

    # -- processes ------------------------------------------------------------------------------------------
    def _start_peer(self, stage: int, speed: float, load_state: bool) -> PeerProcess:
        self.next_uid += 1
        peer = self.groups.start_peer(f"s{stage}p{self.next_uid}", stage, speed, self.config, self.addr_file,
                                      load_state)
        self.peers[peer.uid] = peer
        return peer

    def _start_trainer(self, rank: int) -> None:
        proc, _ = self.groups.spawn(["--config", str(self.config), "--rank", str(rank), "--trainers",
                                     str(self.plan.trainers)], f"trainer{rank}", launcher=TRAINER_MODULE)
        self.trainers[rank] = proc

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
        self.bootstrap, log = self.groups.spawn(["bootstrap", "--addr-file", str(self.addr_file), "--host",
                                                 self.host], "bootstrap")
        deadline = time.monotonic() + self.plan.startup_timeout_s
        while not self.addr_file.exists():
            if self.bootstrap.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the bootstrap DHT did not write {self.addr_file}:\n"
                                   f"{log.read_text(errors='replace')}")
            await asyncio.sleep(0.2)
        maddrs = await asyncio.to_thread(read_addr_file, self.addr_file, self.plan.join_timeout_s)
        self.node = await join_dht(maddrs, client_mode=True, host=self.host, timeout_s=self.plan.join_timeout_s)

    async def _beat(self) -> None:
        await self.node.store(coordinator_key(self.run_id), self.phase, get_dht_time() + RECORD_TTL_S)

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

    def _trainer_failed(self, rank: int, code: int) -> Exception:
        log = (self.workdir / f"trainer{rank}.log").read_text(errors="replace")[-3000:]
        if code == EXIT_NO_PEERS:
            with contextlib.suppress(Exception):
                return NoPeersError(read_json(progress_path(self.workdir, rank))["no_peers_stage"])
        return RuntimeError(f"trainer {rank} exited with code {code}:\n{log}")

    async def _killable(self) -> list[PeerProcess]:
        """Live peers of stages where at least two live replicas are at the stage's latest step."""
        found = []
        for stage in range(self.plan.stages):
            records = await progress_records(self.node, self.run_id, stage)
            latest = max((r["step"] for r in records.values()), default=0)
            current = [self.peers[u] for u, r in records.items()
                       if r["step"] == latest and u in self.peers and self.peers[u].alive and u not in self.retired]
            if len(current) >= 2:
                found.extend(current)
        return found

    def _kill_peer(self, peer: PeerProcess) -> None:
        self.retired.add(peer.uid)
        ProcessGroups.kill(peer.proc)
        self.stats["peers_killed"] += 1
        self.stats["killed"].append({"uid": peer.uid, "stage": peer.stage, "t_s": round(self.elapsed(), 2)})
        self._spawn(self._restart_peer(peer))

    async def _kill_forever(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            candidates = await self._killable()
            if candidates:
                self._kill_peer(self.rng.choice(candidates))

    async def _fault(self, at_s: float, target: str) -> None:
        """``faults``: SIGKILL ``bootstrap``, ``trainer<R>`` or ``peer`` (a killable stage peer) at ``at_s``; any
        other target goes to the placement (``plan.hosts.fault``) ``at_s`` after the first finished microbatch
        (trainer processes take seconds to start: a link cut must fall into the training)."""
        host_fault = target not in ("bootstrap", "peer") and not target.startswith("trainer")
        while host_fault and self._done_microbatches() < 1:
            await asyncio.sleep(0.1)
        await asyncio.sleep(at_s)
        if target == "bootstrap":
            ProcessGroups.kill(self.bootstrap)
            self.stats["bootstrap_killed"] += 1
        elif target.startswith("trainer"):
            rank = int(target[len("trainer"):])
            if rank not in self.finished and self.trainers[rank].poll() is None:
                ProcessGroups.kill(self.trainers[rank])
                self.stats["killed"].append({"uid": target, "t_s": round(self.elapsed(), 2)})
        elif target == "peer":
            candidates = await self._killable()
            if candidates:
                self._kill_peer(self.rng.choice(candidates))
        elif self.plan.hosts is not None:  # the placement's own faults (a testbed link cut)
            await asyncio.to_thread(self.plan.hosts.fault, target)
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
        bar = tqdm(total=self.total, desc="swarm (hivemind, launcher)", unit="mb", disable=not self.progress,
                   mininterval=2.0)
        try:
            while len(self.finished) < self.plan.trainers:
                if self.failed.done():
                    self.failed.result()
                for rank, proc in list(self.trainers.items()):
                    if rank in self.finished or proc is None or (code := proc.poll()) is None:
                        continue
                    ProcessGroups.kill(proc)  # its p2pd
                    if code == 0:
                        self.finished.add(rank)
                    elif code < 0:  # killed by a signal: restart with the same rank, it resumes its shard
                        self.trainers[rank] = None
                        self._spawn(self._restart_trainer(rank))
                    else:
                        raise self._trainer_failed(rank, code)
                for uid, peer in list(self.peers.items()):
                    if uid not in self.retired and not peer.alive:  # died by itself: replace it
                        self.retired.add(uid)
                        self._spawn(self._restart_peer(peer))
                bar.n = self._done_microbatches()
                bar.refresh()
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

    async def _collect_states(self) -> tuple[list[dict], dict[int, dict[str, int]], list[float]]:
        states, steps, spread = [], {}, []
        for stage in range(self.plan.stages):
            replicas = []
            for uid, (peer, _) in (await stage_records(self.node, self.run_id, stage)).items():
                stub = SyncingStagePeer.get_stub(self.node.p2p, PeerID.from_base58(peer),
                                                 namespace=stage_namespace(self.run_id, stage))
                try:
                    tensors, meta = await asyncio.wait_for(
                        unpack(await stub.rpc_state(request({}, {}))),
                        timeout=averaging.state_timeout_s(self.stage_params[stage], self.plan.link_mbit_s,
                                                          2 * self.plan.sync_timeout_s))
                except Exception:
                    continue
                blob = torch.load(io.BytesIO(tensors["blob"].numpy().tobytes()), weights_only=True,
                                  map_location="cpu")
                replicas.append((uid, meta["step"], blob["module"]))
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
        for path in sorted(self.workdir.glob(f"log-s{self.plan.stages - 1}p*.jsonl")):
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    row = json.loads(line)
                    rows.setdefault(row["step"], row)
        return [{k: v for k, v in row.items() if k not in ("time", "group")}
                | {"elapsed_s": round(row["time"] - self.start_wall, 3)} for _, row in sorted(rows.items())]

    def _trainer_losses(self) -> dict[int, float]:
        losses = {}
        for rank in range(self.plan.trainers):
            path = losses_path(self.workdir, rank)
            for line in path.read_text().splitlines() if path.exists() else []:
                with contextlib.suppress(ValueError):
                    row = json.loads(line)
                    losses[row["mb"]] = row["loss"]
        return losses

    def _trainer_stats(self) -> dict:
        """The trainers' call counters (retries, timeouts, errors), summed; restarts start them again at 0."""
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

    async def main(self) -> TrainResult:
        self.failed = asyncio.get_running_loop().create_future()
        try:
            seq_len = self._write_data()
            self.config = self._write_config(seq_len)
            await self._start_dht()
            self._spawn(self._heartbeat_forever())
            speeds = self.plan.peer_speeds
            specs = [s for s, n in enumerate(self.plan.peers_per_stage) for _ in range(n)]
            peers = [self._start_peer(s, speeds[i % len(speeds)], load_state=False) for i, s in enumerate(specs)]
            await self._wait_declared(peers)
            self.phase = "training"
            await self._beat()
            self.start, self.start_wall = time.perf_counter(), time.time()
            for rank in range(self.plan.trainers):
                self._start_trainer(rank)
            if self.plan.kill_every_s:
                self._spawn(self._kill_forever(self.plan.kill_every_s))
            for at_s, target in self.plan.faults:
                self._spawn(self._fault(at_s, target))
            await self._supervise()
            wall_s = self.elapsed()
            for task in list(self.tasks):  # no more kills or restarts once the trainers are done
                if task.get_coro().__name__ in ("_kill_forever", "_fault"):
                    task.cancel()
            await self._finish_steps()
            stage_states, replica_steps, spread = await self._collect_states()
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
        sent = [sum(c["averaging_bytes_sent"] for c in counters if c["stage"] == s) for s in range(self.plan.stages)]
        values = [sum(c["averaging_values_sent"] for c in counters if c["stage"] == s)
                  for s in range(self.plan.stages)]
        param_steps = [sum(c["averaging_param_steps"] for c in counters if c["stage"] == s)
                       for s in range(self.plan.stages)]
        log = self._log()
        self.stats.update(self._trainer_stats())
        self.stats.update(
            transport="hivemind", placement="local", roles="launcher", microbatches_done=done,
            microbatches_requested=self.total, lost_microbatches=self.total - done,
            microbatches_with_loss=len(losses), trainer_losses=[losses[i] for i in sorted(losses)],
            shard_sizes=[len(shard(self.total, r, self.plan.trainers)) for r in range(self.plan.trainers)],
            steps=len(log), stage_steps=[max(steps.values()) for steps in replica_steps.values()],
            stepped_samples=stepped, lost_gradient_samples=[self.total * micro - n for n in stepped],
            wall_s=round(wall_s, 3), throughput_mb_s=round(done / wall_s, 4) if wall_s > 0 else 0.0,
            per_stage_peers=[len(steps) for steps in replica_steps.values()], replica_steps=replica_steps,
            replicas_equal=not any(spread), replica_max_abs_diff=spread, process_groups=list(self.groups.pgids),
            resyncs=sum(c["resyncs"] for c in counters), digest_mismatches=sum(c["digest_mismatches"]
                                                                              for c in counters),
            stage_parameters=self.stage_params, averaging_compression=self.plan.averaging_compression,
            averaging_bytes_per_param=[round(b / n, 4) if n else None for b, n in zip(sent, param_steps)],
            averaging_bytes_per_value=[round(b / n, 4) if n else None for b, n in zip(sent, values)],
        )
        return TrainResult(stage_states=stage_states, log=log, stats=self.stats)

    async def _shutdown(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.node is not None:
            self.phase = "done"
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._beat(), timeout=5.0)
        self.groups.close()
        if self.node is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.node.shutdown(), timeout=10.0)


def _exit_on_sigterm(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


def run(plan, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], total_microbatches: int,
        progress: bool = True) -> TrainResult:
    """Run one swarm under the launcher; every process it started (and this process's p2pd) is gone on return."""
    before = own_daemons()
    launcher = Launcher(plan, batches, total_microbatches, progress)
    keep_logs, previous = True, None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        result = asyncio.run(launcher.main())
        keep_logs = False
        return result
    except NoPeersError:
        keep_logs = False
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        launcher.groups.close()
        for pid in own_daemons() - before:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if keep_logs:
            print(f"hivemind swarm failed; logs kept in {launcher.workdir}", file=sys.stderr, flush=True)
        else:
            shutil.rmtree(launcher.workdir, ignore_errors=True)
