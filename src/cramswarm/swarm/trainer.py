"""SWARM trainer: an independent OS process that takes leases of the run's microbatches and pushes them through
the stage peers.

    python -m cramswarm.swarm.trainer --config RUN/config.json --rank R     (started by the launcher)
    python -m cramswarm swarm-train --peer <multiaddr>                      (added to a running swarm by hand)

The run's config names the microbatch source (``data``: ``cramswarm.swarm.data``, e.g. the packed training
blocks, memory-mapped), the number of microbatches and the work order (``order``: ``work.WorkOrder``); the run's
folder holds the DHT address file and the launcher's ``clock.json`` (``membership.CLOCK_FILE``). No trainer owns a
share of the data: each takes leases of the order from the claim records in the DHT (``work``; ``WorkClaims``
reads and stores them), so trainers can join and leave during a run and every microbatch is still trained. A
trainer makes each microbatch itself (``source[i]``: the blocks of microbatch ``i``, masked with a generator
seeded from the run's seed and ``i``, so whoever trains ``i`` makes the same masked batch). Once it has joined
the swarm it says so in its progress file and waits for the training clock, which the launcher writes once its
trainers have joined (a trainer added later finds it running). With a seconds budget the order has no end and
the clock holds a wall-clock deadline: the trainer takes no new microbatch after it (the one under way is
finished) and exits 0. It joins the DHT through any live entry of the address file (or the address it is given)
and appends its own addresses, re-reads the stages' peer records every ``REFRESH_PERIOD_S``, keeps its own
``StageBalancer`` per stage (as SWARM's trainers do; ``routing: uniform`` gives it ``UniformBalancer``s, the
baseline of ``benchmarks/swarm_launcher.py``), and sends one microbatch at a time forward through stages 0..k-1
and backward through k-1..0 (the last stage's forward and backward are one call). Every call is bounded
(``RetryPolicy``: hivemind has no client-side timeout); a failed or timed-out call is re-sent to another replica
and a microbatch is never dropped: a stage without a live peer for ``give_up_after_s`` ends the trainer with
``EXIT_NO_PEERS`` (the stage is named in its progress file), a stage whose peers keep failing with ``EXIT_FAILED``.

Progress: after each microbatch the trainer appends its loss to ``trainer<name>.losses.jsonl``, rewrites
``trainer<name>.json`` atomically (microbatches it has done over all its lives) and moves its claim on. A trainer
killed and restarted under the same name goes on with its claim's lease; one that is not restarted leaves its lease
to whoever adopts it once its claim is stale. A microbatch whose calls were under way when it died is sent again
(the backward calls carry its index, ``mb``: a stage peer that stepped or holds it does not accumulate it twice;
one that does not hold it while another replica does counts it again, as a re-sent call does in SWARM). SIGTERM
or SIGINT makes a trainer leave: it finishes the microbatch under way, releases its lease (adopted at once) and
exits ``EXIT_LEFT``. It exits 0 once every lease is finished (or the deadline passed), and like a stage peer once
the launcher's heartbeat record has been missing for ``launcher_grace_s`` or says the swarm stops.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import random
import signal
import socket
import sys
import time
from pathlib import Path

import torch
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from cramswarm.io import read_json, write_json
from cramswarm.swarm.data import from_spec
from cramswarm.swarm.membership import (
    ADDR_FILE,
    BootstrapError,
    LauncherGone,
    join_swarm,
    join_through,
    leave_now,
    listen_host,
    stage_namespace,
    stage_records,
    watch_launcher,
    work_key,
)
from cramswarm.swarm.peer_sync import SyncingStagePeer
from cramswarm.swarm.progress import read_clock
from cramswarm.swarm.rebalancing import WORK_UNITS
from cramswarm.swarm.routing import (
    NoPeersError,
    PathCall,
    RetryPolicy,
    StageCall,
    drive_path_async,
    make_balancer,
    microbatch_path,
)
from cramswarm.swarm.settings import ProcessConfig
from cramswarm.swarm.wire import request, unpack
from cramswarm.swarm.work import (
    RENEW_PERIOD_S,
    WAIT,
    Claim,
    Work,
    WorkOrder,
    next_work,
    yields_to,
)

REFRESH_PERIOD_S = 1.0  # a trainer re-reads the stages' DHT records this often
EXIT_NO_PEERS = 4       # a stage had no live peer for give_up_after_s
EXIT_FAILED = 5         # a stage's peers kept failing (RetryPolicy exhausted) or the loss is not finite
EXIT_LEFT = 6           # told to leave (SIGTERM, SIGINT): its lease released, the run goes on without it
RECORD_LIFE_S = 7 * 24 * 3600.0  # claim records outlive any run: the frontier is read from them


def progress_path(workdir: Path, name: str | int) -> Path:
    return Path(workdir) / f"trainer{name}.json"


def losses_path(workdir: Path, name: str | int) -> Path:
    return Path(workdir) / f"trainer{name}.losses.jsonl"


class WorkClaims:
    """This trainer's claim in the DHT and the leases it takes (the rules: ``work``)."""

    def __init__(self, node, run_id: str, name: str, order: WorkOrder):
        self.node, self.key, self.name, self.order = node, work_key(run_id), name, order
        self.claim = Claim()
        self.stats = {"leases": 0, "adopted_leases": 0, "yielded_leases": 0}

    async def read(self) -> dict[str, Claim]:
        found = await self.node.get(self.key, latest=True)
        if found is None or not isinstance(found.value, dict):
            return {}
        claims = {name: Claim.from_value(entry.value) for name, entry in found.value.items()}
        return {name: c for name, c in claims.items() if isinstance(name, str) and c is not None}

    async def store(self, name: str, claim: Claim) -> None:
        if not await self.node.store(self.key, claim.value(), get_dht_time() + RECORD_LIFE_S, subkey=name):
            raise ConnectionError(f"could not store the claim of trainer {name} in the DHT")

    async def put(self, **changes) -> None:
        self.claim = dataclasses.replace(self.claim, beat=get_dht_time(), **changes)
        await self.store(self.name, self.claim)

    async def take(self, until: asyncio.Event | None = None) -> Work | None:
        """The next lease to train (waiting while only others' unfinished leases are left), or None: all done, or
        ``until`` was set while waiting."""
        while True:
            try:
                claims = await self.read()
            except Exception:   # a DHT hiccup: look again
                await asyncio.sleep(1.0)
                continue
            if self.name in claims:   # a restarted trainer goes on from its earlier life's record
                self.claim = dataclasses.replace(claims[self.name], top=max(claims[self.name].top, self.claim.top))
            work = next_work(claims, self.name, get_dht_time(), positions=self.order.positions)
            if work is None:
                return None
            if work == WAIT:
                if until is not None and until.is_set():
                    return None
                await asyncio.sleep(1.0)
                continue
            try:
                if work.adopted_from is not None:  # nobody takes the orphan again
                    await self.store(work.adopted_from, dataclasses.replace(claims[work.adopted_from],
                                                                            state="adopted"))
                    self.stats["adopted_leases"] += 1
                await self.put(lease=work.lease, next=work.next, end=work.end, top=max(self.claim.top, work.lease),
                               state="working")
            except Exception:
                await asyncio.sleep(1.0)
                continue
            if not await self.yields():
                self.stats["leases"] += 1
                return work

    async def yields(self) -> bool:
        """Whether another trainer took this lease too and keeps it (``work.yields_to``): then this one is idle."""
        with contextlib.suppress(Exception):
            if yields_to(await self.read(), self.name, get_dht_time()) is not None:
                await self.put(lease=-1, next=0, end=0, state="idle")
                self.stats["yielded_leases"] += 1
                return True
        return False

    async def renew_forever(self) -> None:
        while True:
            await asyncio.sleep(RENEW_PERIOD_S)
            with contextlib.suppress(Exception):
                await self.put()


class StageClient:
    """A trainer's view of the stages: peer records from the DHT, one balancer per stage, bounded re-sent calls
    (SWARM's trainer-side call and microbatch)."""

    peer_cls = SyncingStagePeer  # whose RPC handler names the calls use

    def __init__(self, node, run_id: str, stages: int, retry: RetryPolicy, seed: int, routing: str = "weighted"):
        self.node, self.run_id, self.stages, self.retry = node, run_id, stages, retry
        # weighted: SWARM's balancer by measured throughput; uniform: the routing benchmark's baseline
        self.balancers = [make_balancer(routing, s, random.Random(seed * 1000 + s)) for s in range(stages)]
        self.peer_ids: dict[str, str] = {}
        self.stats = {"retries": 0, "timeouts": 0, "errors": 0}

    async def _refresh(self, stage: int) -> None:
        found = await stage_records(self.node, self.run_id, stage)
        self.peer_ids.update({uid: peer for uid, (peer, _) in found.items()})
        self.balancers[stage].update_peers({uid: exp for uid, (_, exp) in found.items()}, get_dht_time())

    async def refresh_forever(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await asyncio.gather(*(self._refresh(s) for s in range(self.stages)))
            await asyncio.sleep(REFRESH_PERIOD_S)

    async def _rpc(self, stage: int, uid: str, method: str, tensors: dict, meta: dict) -> tuple[dict, dict]:
        stub = self.peer_cls.get_stub(self.node.p2p, PeerID.from_base58(self.peer_ids[uid]),
                                      namespace=stage_namespace(self.run_id, stage))
        return await unpack(await getattr(stub, f"rpc_{method}")(request(tensors, meta)))

    async def _call(self, stage: int, method: str, tensors: dict, meta: dict, samples: int, *,
                    fused: bool = False) -> tuple[dict, dict]:
        """One stage call with SWARM's retry semantics, decided by ``routing.StageCall`` (the emulation's trainer
        threads retry by the same object): another replica on a timeout or error, never dropped (``NoPeersError``
        once the stage has had no live peer for ``give_up_after_s``; ``TimeoutError`` once ``RetryPolicy`` is
        exhausted: declared peers that never answer). A backward call sent again is marked ``resent``: the replica
        tried before may still compute it, and then both count (at least once, as in SWARM; ``peer_sync``).

        ``fused``: the last stage's forward + backward in one call. The peer's throughput estimate counts the
        call's work units (``WORK_UNITS``: forward 1, backward 2, fused 3 per sample, as the emulation does), so
        every stage does the same units per microbatch and the rebalancer can compare stages; counted in samples,
        the last stage (one call per microbatch) looked half as fast as the others (two calls) and drew a
        second peer after a rebalancing move had already evened the stages out."""
        units = samples * WORK_UNITS["last" if fused else method]
        call = StageCall(self.balancers[stage], self.retry, task_size=samples, backward=method == "backward",
                         count=self._count, what=method)
        sent = meta
        while True:
            uid = call.choose(get_dht_time())
            if uid is None:   # no live peer: look again shortly (NoPeersError once give_up_after_s passed)
                await asyncio.sleep(StageCall.NO_PEER_WAIT_S)
                with contextlib.suppress(Exception):
                    await self._refresh(stage)
                continue
            started, sent_at = time.perf_counter(), get_dht_time()
            try:
                result = await asyncio.wait_for(self._rpc(stage, uid, method, tensors, sent),
                                                self.retry.timeout(call.backward))
            except asyncio.TimeoutError:
                call.timed_out(uid, sent_at, get_dht_time())
            except Exception as e:  # refused, reset, remote handler error: banned until its record expires
                self.stats["last_error"] = f"stage {stage} {method} on {uid}: {e!r}"
                call.refused(uid, sent_at, get_dht_time())
            else:
                call.succeeded(uid, units, max(time.perf_counter() - started, 1e-3))
                return result
            if method == "backward":  # the replica tried may still compute it (counted by the stage if so)
                sent = {**meta, "resent": True}

    def _count(self, key: str) -> None:
        self.stats[key] += 1

    @staticmethod
    def _rename(tensors: dict, meta: dict, old: str, new: str) -> tuple[dict, dict]:
        renamed = {f"{new}.{k[len(old) + 1:]}": t for k, t in tensors.items() if k.startswith(f"{old}.")}
        return renamed, {"payloads": {new: meta["payloads"][old]}}

    async def microbatch(self, input_ids: torch.Tensor, labels: torch.Tensor, mb: int | None = None) -> float:
        """Forward through the stages, backward back; returns the loss. Activations travel trainer -> peer ->
        trainer (the trainer is the hub, as in SWARM's code); the trainer keeps each stage's input payload and
        sends it again with the output gradient, so any replica can take the backward call (it recomputes the
        stage forward). The backward calls carry their sample count (``samples``) and, given ``mb``, the
        microbatch's index (the stage lists it as stepped, and counts one stepped twice: ``peer_sync``)."""
        samples = int(input_ids.shape[0])
        index = {} if mb is None else {"mb": int(mb)}

        async def send(request: PathCall):   # a stage input is (tensors, meta); a gradient too
            if request.kind == "forward":
                out, out_meta = await self._call(request.stage, "forward", *request.payload, samples)
                return self._rename(out, out_meta, "y", "x")
            if request.kind == "last":
                tensors, meta = request.payload
                grad, grad_meta = await self._call(request.stage, "backward", {**tensors, "labels": labels},
                                                   {**meta, "samples": samples, **index}, samples, fused=True)
                return grad_meta["loss"], (grad, grad_meta)
            (tensors, meta), (grad, grad_meta) = request.payload
            payloads = {**meta.get("payloads", {}), "g": grad_meta["payloads"]["g"]}
            return await self._call(request.stage, "backward", {**tensors, **grad},
                                    {"payloads": payloads, "samples": samples, **index}, samples)

        return await drive_path_async(microbatch_path(self.stages, ({"input_ids": input_ids}, {})), send)


async def train(cfg: ProcessConfig, name: str, node=None) -> None:
    """Train leases of the run's work order as trainer ``name`` until every lease is finished or the deadline
    passed (see the module docstring); ``node``: a DHT node already joined (a trainer added by hand)."""
    workdir = Path(cfg.workdir)
    torch.set_num_threads(1)
    source = from_spec(cfg.data)
    order = WorkOrder.from_spec(cfg.microbatches, cfg.order)
    state_file = progress_path(workdir, name)
    previous = read_json(state_file) if state_file.exists() else {}
    done = int(previous.get("done", 0)) if previous.get("run_id") in cfg.run_ids else 0
    if node is None:
        node = await join_swarm(workdir / ADDR_FILE, host=listen_host(cfg.host, cfg.interface),
                                timeout_s=cfg.join_timeout_s, announce=True)
    launcher = asyncio.create_task(watch_launcher(node, cfg.run_id, cfg.launcher_grace_s))
    seed = cfg.seed + 7919 * (int(name) if name.isdigit() else 1000 + os.getpid())
    client = StageClient(node, cfg.run_id, cfg.stages, cfg.retry, seed,
                         cfg.routing)
    for key, count in previous.get("stats", {}).items():  # a restarted trainer counts on from its earlier lives
        if key in client.stats and key != "last_error":
            client.stats[key] += int(count)
    claims = WorkClaims(node, cfg.run_id, name, order)
    refresher = asyncio.create_task(client.refresh_forever())
    leave = asyncio.Event()
    with contextlib.suppress(ValueError, RuntimeError):  # off the main thread: no handlers (a test's in-process run)
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, leave.set)

    def progress(**extra) -> None:
        write_json(state_file, {"name": name, "run_id": cfg.run_id, "done": done, "lease": claims.claim.lease,
                                "stats": {**client.stats, **claims.stats}, **extra})

    async def work() -> str:
        nonlocal done
        progress()  # joined: the launcher starts the training clock once its trainers are here
        while (clock := read_clock(workdir, cfg.run_id))["origin_wall"] is None:
            await asyncio.sleep(0.1)
        deadline = clock["deadline_wall"]
        renew = asyncio.create_task(claims.renew_forever())
        try:
            while not leave.is_set():
                if deadline is not None and time.time() >= deadline:  # a seconds budget spent: take no new one
                    return "deadline"
                lease = await claims.take(until=leave)
                if lease is None:
                    return "left" if leave.is_set() else "finished"
                for position in range(lease.next, lease.end):
                    if leave.is_set() or (deadline is not None and time.time() >= deadline):
                        break
                    if position == lease.next + 1 and await claims.yields():   # a rival's claim seen late
                        break
                    i = order.index(position)
                    inputs, labels = source[i]
                    loss = await client.microbatch(inputs, labels, mb=i)
                    if not math.isfinite(loss):
                        raise FloatingPointError(f"swarm loss became {loss} at microbatch {i}; lower pretrain.lr")
                    with open(losses_path(workdir, name), "a") as out:
                        out.write(json.dumps({"mb": i, "loss": loss, "time": time.time(), "trainer": name}) + "\n")
                    done += 1
                    with contextlib.suppress(Exception):
                        await claims.put(next=position + 1)
                    progress()
            with contextlib.suppress(Exception):   # whoever looks for work next adopts the rest of the lease
                await claims.put(state="released")   # (not stored: once its claim is stale)
            return "left"
        finally:
            renew.cancel()

    job = asyncio.create_task(work())
    finished, _ = await asyncio.wait([job, launcher], return_when=asyncio.FIRST_COMPLETED)
    refresher.cancel()
    if job not in finished:
        job.cancel()
        launcher.result()  # LauncherGone raises here
        raise LauncherGone("the launcher is done before this trainer's work")
    try:
        ending = job.result()
    except NoPeersError as e:
        progress(error=str(e), no_peers_stage=e.stage)
        raise
    progress(finished=ending in ("finished", "deadline"), ending=ending)   # nothing left for it to do
    return ending


async def train_joined(initial_peer: str, name: str | None, host: str, workdir: str | None, wait_s: float) -> str:
    """A trainer added to a running swarm with nothing but ``initial_peer`` (a multiaddr of any live process of
    it): it reads the swarm's description from the DHT (``membership.read_swarm``) and trains leases like the
    launcher's trainers. Its files go to the run's folder where this host has it, else to ``workdir`` (or a
    temporary folder), with the training clock from the description."""
    node, cfg = await join_through(initial_peer, host=host, wait_s=wait_s, workdir=workdir,
                                   prefix="cramswarm-trainer-")
    name = name or f"j{socket.gethostname()}-{os.getpid()}"
    print(f"[trainer {name}] joined swarm {cfg.run_id} through {initial_peer}", flush=True)
    return await train(cfg, name, node=node)


def run(coro, name: str) -> int:
    """Run a trainer's coroutine as this process's work: its exit code, said on the way out."""
    code = 0
    try:
        ending = asyncio.run(coro)
        if ending == "left":
            code = EXIT_LEFT
        print(f"[trainer {name}] {ending}", flush=True)
    except BootstrapError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = 2
    except LauncherGone as e:
        print(f"[trainer {name}] {e}; exiting", flush=True)
        code = 3
    except NoPeersError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = EXIT_NO_PEERS
    except (TimeoutError, FloatingPointError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = EXIT_FAILED
    return code


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m cramswarm.swarm.trainer", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="the run's config.json (written by the launcher)")
    parser.add_argument("--rank", type=int, required=True, help="this trainer's number among the launcher's (its "
                                                                "name; a restart under it goes on with its lease)")
    args = parser.parse_args(argv)
    if args.rank < 0:
        parser.error(f"--rank {args.rank} is negative")
    try:
        cfg = ProcessConfig.read(args.config)
    except (OSError, TypeError, ValueError) as e:  # unreadable, or another version's
        parser.error(f"cannot read the swarm's config {args.config}: {e}")
    leave_now(run(train(cfg, str(args.rank)), str(args.rank)))


if __name__ == "__main__":
    main()
