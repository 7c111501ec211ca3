"""SWARM trainer: an independent OS process that pushes its own data shard through the stage peers.

    python -m cramswarm.swarm.trainer --config RUN/config.json --rank R --trainers N

The run's config names the microbatch source (``data``: ``cramswarm.swarm.data``, e.g. the packed training blocks,
memory-mapped) and the number of microbatches; the run's folder holds the DHT address file and the launcher's
``clock.json`` (``progress.CLOCK_FILE``). Trainer ``R`` of ``N`` owns the microbatches ``i`` with ``i mod N == R``,
so the union of the shards is exactly what one process would see, and makes each one itself (``source[i]``: the
blocks of microbatch ``i``, masked with a generator seeded from the run's seed and ``i``, so a trainer restarted
at microbatch ``i`` makes the same masked batch). Once it has joined the swarm it says so in its progress file
and waits for the clock file, which the launcher writes once every trainer has joined (training starts then).
With a seconds budget the shard is unbounded and the clock file holds a wall-clock deadline: the trainer takes
no new microbatch after it (the one under way is finished) and exits 0, as at the end of a counted shard. It
joins the DHT through any live entry of the address file and appends its own addresses (a DHT node like every
peer), re-reads the stages' peer records every ``REFRESH_PERIOD_S``, keeps its own ``StageBalancer`` per stage
(as SWARM's trainers do; the run's ``routing: uniform`` gives it ``UniformBalancer``s instead, the baseline of
``benchmarks/swarm_launcher.py``), and sends one microbatch at a time forward through stages 0..k-1 and backward through
k-1..0 (the last stage's forward and backward are one call). Every call is bounded (``RetryPolicy``: hivemind has
no client-side timeout); a failed or timed-out call is re-sent to another replica and a microbatch is never
dropped: a stage without a live peer for ``give_up_after_s`` ends the trainer with ``EXIT_NO_PEERS`` (the stage is
named in its progress file), a stage whose peers keep failing with ``EXIT_FAILED``.

Progress: after each microbatch the trainer appends its loss to ``trainer<R>.losses.jsonl`` and rewrites
``trainer<R>.json`` atomically (microbatches of its shard done). A trainer killed and restarted with the same rank
resumes its shard where that file says: a microbatch whose calls were under way when it died is sent again (the
backward calls carry its index, ``mb``: a stage peer that stepped or holds it does not accumulate it twice; one
that does not hold it while another replica does counts it again, as a re-sent call does in SWARM). A launcher
resuming a killed run from the stage shards rewrites the progress files first (``launcher``). The trainer exits
0 once its shard is done, and like a stage peer once the launcher's heartbeat record has been missing for
``launcher_grace_s`` or the launcher that started it is gone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from cramswarm.io import read_json, write_json
from cramswarm.swarm.data import bounded, from_spec
from cramswarm.swarm.membership import (
    ADDR_FILE,
    BootstrapError,
    LauncherGone,
    join_swarm,
    leave_now,
    listen_host,
    stage_namespace,
    stage_records,
    watch_launcher,
)
from cramswarm.swarm.peer_process import exit_with_parent
from cramswarm.swarm.peer_sync import SyncingStagePeer
from cramswarm.swarm.progress import CLOCK_FILE, read_clock
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
from cramswarm.swarm.wire import request, unpack

REFRESH_PERIOD_S = 1.0  # a trainer re-reads the stages' DHT records this often
EXIT_NO_PEERS = 4       # a stage had no live peer for give_up_after_s
EXIT_FAILED = 5         # a stage's peers kept failing (RetryPolicy exhausted) or the loss is not finite


def progress_path(workdir: Path, rank: int) -> Path:
    return workdir / f"trainer{rank}.json"


def losses_path(workdir: Path, rank: int) -> Path:
    return workdir / f"trainer{rank}.losses.jsonl"


def shard(total: int, rank: int, trainers: int) -> range:
    """The microbatch indices trainer ``rank`` of ``trainers`` owns."""
    return range(rank, total, trainers)


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


async def train_shard(cfg: dict, rank: int, trainers: int) -> None:
    workdir = Path(cfg["workdir"])
    torch.set_num_threads(1)
    source, total = from_spec(cfg["data"]), int(cfg["microbatches"])
    mine = shard(total, rank, trainers)
    size = len(mine) if bounded(total) else None  # a seconds budget: until the deadline
    state_file = progress_path(workdir, rank)
    previous = read_json(state_file) if state_file.exists() else {}
    done = previous.get("done", 0)
    watchdog = asyncio.create_task(exit_with_parent())
    node = await join_swarm(workdir / ADDR_FILE, host=listen_host(cfg), timeout_s=cfg["join_timeout_s"],
                            announce=True)
    launcher = asyncio.create_task(watch_launcher(node, cfg["run_id"], cfg["launcher_grace_s"]))
    client = StageClient(node, cfg["run_id"], cfg["stages"], RetryPolicy(**cfg["retry"]), cfg["seed"] + 7919 * rank,
                         cfg.get("routing", "weighted"))
    for key, count in previous.get("stats", {}).items():  # a restarted trainer counts on from its earlier lives
        if key in ("retries", "timeouts", "errors"):
            client.stats[key] += int(count)
    refresher = asyncio.create_task(client.refresh_forever())

    def progress(**extra) -> None:
        write_json(state_file, {"rank": rank, "run_id": cfg["run_id"], "done": done, "shard": size,
                                "stats": client.stats, **extra})

    async def work() -> None:
        nonlocal done
        progress()  # joined: the launcher starts the training clock once every trainer is here
        while (clock := read_clock(workdir, cfg["run_id"]))["origin_wall"] is None:
            await asyncio.sleep(0.1)
        deadline = clock["deadline_wall"]
        if size is None and deadline is None:
            raise RuntimeError(f"an unbounded shard ({total} microbatches: a seconds budget) but no deadline in "
                               f"{workdir / CLOCK_FILE}")
        for i in mine[done:]:
            if deadline is not None and time.time() >= deadline:  # a seconds budget spent: take no new one
                break
            inputs, labels = source[i]
            loss = await client.microbatch(inputs, labels, mb=i)
            if not math.isfinite(loss):
                raise FloatingPointError(f"swarm loss became {loss} at microbatch {i}; lower pretrain.lr")
            with open(losses_path(workdir, rank), "a") as out:
                out.write(json.dumps({"mb": i, "loss": loss, "time": time.time()}) + "\n")
            done += 1
            progress()

    job = asyncio.create_task(work())
    finished, _ = await asyncio.wait([job, watchdog, launcher], return_when=asyncio.FIRST_COMPLETED)
    refresher.cancel()
    if job not in finished:
        job.cancel()
        for task in finished:
            task.result()  # LauncherGone raises here
        raise LauncherGone("the launcher is done before this trainer's shard")
    try:
        job.result()
    except NoPeersError as e:
        progress(error=str(e), no_peers_stage=e.stage)
        raise


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m cramswarm.swarm.trainer", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="the run's config.json (written by the launcher)")
    parser.add_argument("--rank", type=int, required=True, help="this trainer's rank: it owns microbatches i = rank "
                                                                "mod trainers")
    parser.add_argument("--trainers", type=int, required=True, help="number of trainers")
    args = parser.parse_args(argv)
    if not 0 <= args.rank < args.trainers:
        parser.error(f"--rank {args.rank} is outside 0 .. {args.trainers - 1}")
    cfg = json.loads(Path(args.config).read_text())
    code = 0
    try:
        asyncio.run(train_shard(cfg, args.rank, args.trainers))
        print(f"[trainer {args.rank}] shard done", flush=True)
    except BootstrapError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = 2
    except LauncherGone as e:
        print(f"[trainer {args.rank}] {e}; exiting", flush=True)
        code = 3
    except NoPeersError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = EXIT_NO_PEERS
    except (TimeoutError, FloatingPointError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = EXIT_FAILED
    leave_now(code)


if __name__ == "__main__":
    main()
