"""Transport 1 (real hivemind), process side: the bootstrap DHT node and the SWARM stage peer.

Run as a module, one OS process per role (the coordinator in ``hivemind_transport`` starts each one as its own
process-group leader, so killing the group also kills the peer's ``p2pd`` daemon)::

    python -m cramswarm.swarm.hivemind_peer bootstrap --addr-file F [--host 127.0.0.1]
    python -m cramswarm.swarm.hivemind_peer stage --config C --stage S --uid U --addr-file F [--speed X] [--load-state]

``bootstrap`` starts a DHT node and writes its visible multiaddrs to the address file (atomically, one per line);
every other process joins the swarm through that file, as the tasks of a multi-node job would on a shared
filesystem. ``stage`` serves one pipeline stage (``stages.split_model`` of the crammed-BERT MLM) over hivemind
P2P streams and declares itself under the stage's DHT key. Its RPCs (``StagePeer.rpc_*``):

* ``forward``  - stage output for the inputs (no grad), compressed with ``compression.encode``;
* ``backward`` - re-runs the stage forward on the saved inputs (so any replica can take it, as in SWARM),
  backpropagates the output gradient (the last stage: the loss x samples; forward and backward of the last
  stage are one call, since its output gradient is the constant 1), accumulates parameter gradients and the
  local sample count, returns the compressed input gradient (and the loss);
* ``reduce``   - phase 1 of the synchronous in-stage step (with ``probe``: only compare the step count):
  snapshot the accumulated gradients (later backward calls accumulate toward the next step), divide by the
  local sample count and average them across the group the coordinator named, weighted by local samples, with
  hivemind's butterfly ``AllReduceRunner`` (in float64, so the replicas cast the same fp32 average); the
  result is held, not applied;
* ``commit``   - phase 2: apply the held average (clip, set the LR, AdamW step) - every replica of the group
  takes the same step, so replicas stay equal; replies with a SHA-1 of the parameters;
* ``state`` / ``resync`` - parameters + optimizer state + step count of a replica (a joining or lagging peer
  downloads them from a live replica before it serves);
* ``aggregate_part`` - hivemind's all-reduce traffic, dispatched to the running ``AllReduceRunner``.

A peer started by a coordinator (``CRAMSWARM_COORDINATOR_PID``) SIGKILLs its own process group once that
coordinator is gone, so a coordinator killed without clean-up leaves no peer or p2pd behind.
``EmulatedStagePeer`` (``"emulate"`` in the config) serves the throughput emulation of ``hivemind_transport.run``:
the same RPCs, but it sleeps an emulated compute time instead of running a model.

Payload tensors travel uncompressed at the hivemind level (``CompressionType.NONE``; hivemind's own 8-bit codecs
are broken with numpy 2.4, swarm.md 5.2-1): the compression is ours, applied before.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import io
import json
import math
import os
import random
import signal
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import AsyncIterator  # hivemind's servicer recognises typing's alias only

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2PContext, PeerID, ServicerBase
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import achain, as_aiter, azip
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from cramswarm.pretrain import autocast, build_model, decay_groups, resolve_precision
from cramswarm.swarm.compression import decode, encode
from cramswarm.swarm.stages import split_model

CHUNK_BYTES = 2**20        # streamed message chunk (well below p2pd's 4 MiB message limit)
DECLARE_PERIOD_S = 2.0     # a peer re-declares its DHT record this often ...
RECORD_TTL_S = 10.0        # ... with this expiration; a dead peer's record disappears within this time
CPU = torch.device("cpu")


class BootstrapError(RuntimeError):
    """The swarm's bootstrap DHT could not be found or joined."""


# --------------------------------------------------------------------------------------------------------------
# Bootstrap address file and DHT membership
# --------------------------------------------------------------------------------------------------------------
def write_addr_file(path: str | Path, maddrs: list[str]) -> None:
    """Atomic write (temporary file + rename), so a reader never sees a half-written list."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(f"{m}\n" for m in maddrs))
    os.replace(tmp, path)


def read_addr_file(path: str | Path, timeout_s: float) -> list[str]:
    """Multiaddrs from the address file, waiting up to ``timeout_s`` for it to appear."""
    path = Path(path)
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise BootstrapError(f"bootstrap address file {path} did not appear within {timeout_s:.0f} s")
        time.sleep(0.1)
    maddrs = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    bad = [m for m in maddrs if not m.startswith("/")]
    if not maddrs or bad:
        raise BootstrapError(f"bootstrap address file {path} holds no valid multiaddr (got {bad or 'nothing'})")
    return maddrs


async def join_dht(initial_peers: list[str] | None, *, client_mode: bool, host: str = "127.0.0.1",
                   timeout_s: float = 15.0) -> DHTNode:
    """A DHT node in this process (its P2P daemon is a child process), joined through ``initial_peers``.

    Any failure to reach the bootstrap peers - unreachable, refusing, garbage - raises ``BootstrapError``
    within ``timeout_s``.
    """
    try:
        return await asyncio.wait_for(
            DHTNode.create(initial_peers=initial_peers or None, client_mode=client_mode,
                           host_maddrs=[f"/ip4/{host}/tcp/0"], startup_timeout=timeout_s,
                           bootstrap_timeout=timeout_s, ensure_bootstrap_success=True),
            timeout=timeout_s,
        )
    except (asyncio.TimeoutError, TimeoutError) as e:
        raise BootstrapError(f"could not join the swarm DHT through {initial_peers} within {timeout_s:.0f} s") from e
    except Exception as e:  # P2PDaemonError, multiaddr parse errors, bootstrap failures
        raise BootstrapError(f"could not join the swarm DHT through {initial_peers}: {e}") from e


def stage_key(run_id: str, stage: int) -> str:
    """DHT key under which the peers of one stage declare themselves (sub-key = peer uid)."""
    return f"{run_id}_stage{stage}"


def stage_namespace(run_id: str, stage: int) -> str:
    """P2P handler namespace of one stage (also the all-reduce prefix: stages never talk to each other)."""
    return f"{run_id}.stage{stage}"


async def stage_records(node: DHTNode, run_id: str, stage: int) -> dict[str, tuple[str, float]]:
    """uid -> (peer id, record expiration) of the stage's declared peers."""
    found = await node.get(stage_key(run_id, stage), latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    return {uid: (entry.value, entry.expiration_time) for uid, entry in found.value.items()
            if isinstance(uid, str) and isinstance(entry.value, str)}


# --------------------------------------------------------------------------------------------------------------
# Wire format: named tensors + msgpack metadata, streamed in chunks
# --------------------------------------------------------------------------------------------------------------
def flatten_payload(name: str, payload: dict, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Put a ``compression.encode`` payload into a message: its tensors under ``name.key``, the rest in meta."""
    fields = {}
    for key, value in payload.items():
        if isinstance(value, torch.Tensor):
            tensors[f"{name}.{key}"] = value
        else:
            fields[key] = list(value) if isinstance(value, tuple) else value
    meta.setdefault("payloads", {})[name] = fields


def restore_payload(name: str, tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    payload = dict(meta["payloads"][name])
    prefix = f"{name}."
    payload.update({key[len(prefix):]: t for key, t in tensors.items() if key.startswith(prefix)})
    return payload


def pack(message_cls: type, tensors: dict[str, torch.Tensor], meta: dict) -> Iterator:
    """Messages (``ExpertRequest`` or ``ExpertResponse``) carrying the tensors in chunks; meta rides on the first."""
    names = list(tensors)
    header = MSGPackSerializer.dumps({"names": names, "meta": meta})
    parts = [chunk for name in names
             for chunk in split_for_streaming(serialize_torch_tensor(tensors[name].detach().contiguous()), CHUNK_BYTES)]
    if not parts:
        yield message_cls(metadata=header)
    for i, part in enumerate(parts):
        yield message_cls(tensors=[part], metadata=header if i == 0 else b"")


async def unpack(stream: AsyncIterator) -> tuple[dict[str, torch.Tensor], dict]:
    header, parts = None, []
    async for message in stream:
        if header is None:
            header = MSGPackSerializer.loads(message.metadata)
        parts.extend(message.tensors)
    if header is None:
        raise ConnectionError("empty message stream")
    tensors, i = {}, 0
    for name in header["names"]:
        count = max(parts[i].chunks, 1)
        tensors[name] = deserialize_torch_tensor(combine_from_streaming(parts[i:i + count]))
        i += count
    return tensors, header["meta"]


def respond(tensors: dict[str, torch.Tensor], meta: dict) -> Iterator[runtime_pb2.ExpertResponse]:
    return pack(runtime_pb2.ExpertResponse, tensors, meta)


def request(tensors: dict[str, torch.Tensor], meta: dict) -> AsyncIterator[runtime_pb2.ExpertRequest]:
    return as_aiter(*pack(runtime_pb2.ExpertRequest, tensors, meta))


def blob_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)


# --------------------------------------------------------------------------------------------------------------
# Stage peer
# --------------------------------------------------------------------------------------------------------------
class StagePeer(ServicerBase):
    """One replica of one pipeline stage: model slice, AdamW, accumulated gradients, RPC handlers.

    All torch work runs on one compute thread (requests queue there, like a device), the RPC handlers and the
    all-reduce on the asyncio loop. The coordinator imports this class only for ``StagePeer.get_stub``.
    """

    def __init__(self, cfg: dict, stage: int, uid: str, speed: float, node: DHTNode):
        recipe = cfg["recipe"]
        self.cfg, self.stage, self.uid, self.speed, self.node = cfg, stage, uid, speed, node
        self.run_id, self.num_stages = cfg["run_id"], cfg["stages"]
        self.namespace = stage_namespace(self.run_id, stage)
        model = build_model(cfg["arch"], cfg["vocab_size"], recipe["seed"])
        self.module = split_model(model, self.num_stages)[stage]
        del model
        self.module.train()
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(decay_groups(self.module, recipe["weight_decay"]), lr=recipe["lr"],
                                           betas=tuple(recipe["betas"]), eps=recipe["eps"])
        self.grad_clip = recipe["grad_clip_norm"]
        self.precision = resolve_precision(recipe["precision"], CPU)
        self.scheme = cfg["compression"]
        self.sync_timeout_s = cfg["sync_timeout_s"]
        self.compute = ThreadPoolExecutor(1, thread_name_prefix=f"stage{stage}-compute")
        self.step = 0
        self.local_samples = 0
        self.snapshot: tuple[int, list[torch.Tensor], int] | None = None  # (step, float64 grads, samples)
        self.averaged: tuple[bytes, list[torch.Tensor]] | None = None     # (group id, averaged float64 grads)
        self.runners: dict[bytes, asyncio.Future] = {}

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.compute, fn, *args)

    # -- compute (on the compute thread) ------------------------------------------------------------------
    def _emulate_speed(self, seconds: float) -> None:
        """A peer of speed s < 1 takes 1/s times as long (emulated by sleeping on the compute thread)."""
        if self.speed < 1.0:
            time.sleep(seconds * (1.0 / self.speed - 1.0))

    def _input(self, tensors: dict[str, torch.Tensor], meta: dict) -> torch.Tensor:
        return tensors["input_ids"] if self.stage == 0 else decode(restore_payload("x", tensors, meta))

    def _forward(self, tensors: dict[str, torch.Tensor], meta: dict) -> tuple[dict, dict]:
        start = time.perf_counter()
        with torch.no_grad(), autocast(self.precision, CPU):
            out = self.module(self._input(tensors, meta))
        result, out_meta = {}, {}
        flatten_payload("y", encode(out.float(), self.scheme), result, out_meta)
        self._emulate_speed(time.perf_counter() - start)
        return result, out_meta

    def _backward(self, tensors: dict[str, torch.Tensor], meta: dict) -> tuple[dict, dict]:
        start = time.perf_counter()
        x = self._input(tensors, meta)
        samples = int(x.shape[0])
        if x.is_floating_point():
            x = x.detach().requires_grad_()
        out_meta: dict = {"samples": samples}
        with torch.enable_grad():
            with autocast(self.precision, CPU):
                out = self.module(x, tensors["labels"]) if self.is_last else self.module(x)
            if self.is_last:
                (out.float() * samples).backward()  # sample-weighted, so replicas' sums average correctly
                out_meta["loss"] = float(out.item())
            else:
                grad = decode(restore_payload("g", tensors, meta))
                out.backward(grad.to(out.dtype))
        self.local_samples += samples
        result: dict = {}
        if x.is_floating_point():
            flatten_payload("g", encode(x.grad.float(), self.scheme), result, out_meta)
        self._emulate_speed(time.perf_counter() - start)
        return result, out_meta

    def _take_snapshot(self, step: int) -> tuple[list[torch.Tensor], int]:
        """Move the accumulated gradients out of ``.grad`` (once per step; kept across reduce retries)."""
        if self.snapshot is None or self.snapshot[0] != step:
            grads = [p.grad.detach().double().reshape(-1) if p.grad is not None
                     else torch.zeros(p.numel(), dtype=torch.float64) for p in self.params]
            self.snapshot = (step, grads, self.local_samples)
            for p in self.params:
                p.grad = None
            self.local_samples = 0
        _, grads, samples = self.snapshot
        return [g / samples if samples else g.clone() for g in grads], samples

    def _apply(self, group_id: bytes, lr: float) -> dict:
        if self.averaged is None or self.averaged[0] != group_id:
            return {"status": "failed", "error": "no averaged gradients held for this group"}
        leftover = [p.grad for p in self.params]  # backward calls that arrived after the snapshot
        for p, g in zip(self.params, self.averaged[1]):
            p.grad = g.to(p.dtype).view_as(p)
        if self.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        for p, g in zip(self.params, leftover):
            p.grad = g
        self.step += 1
        self.snapshot = self.averaged = None
        digest = hashlib.sha1()
        for p in self.params:
            digest.update(p.detach().numpy().tobytes())
        return {"status": "ok", "step": self.step, "digest": digest.hexdigest()}

    def _state_blob(self) -> tuple[bytes, int]:
        buffer = io.BytesIO()
        torch.save({"module": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "step": self.step}, buffer)
        return buffer.getvalue(), self.step

    def _load_blob(self, blob: bytes) -> int:
        state = torch.load(io.BytesIO(blob), weights_only=True)
        self.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])
        for p in self.params:
            p.grad = None
        self.step, self.local_samples = state["step"], 0
        self.snapshot = self.averaged = None
        return self.step

    # -- RPC handlers -------------------------------------------------------------------------------------
    async def rpc_forward(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                          context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        tensors, meta = await unpack(requests)
        result, out_meta = await self._run(self._forward, tensors, meta)
        for message in respond(result, out_meta):
            yield message

    async def rpc_backward(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                           context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        tensors, meta = await unpack(requests)
        result, out_meta = await self._run(self._backward, tensors, meta)
        for message in respond(result, out_meta):
            yield message

    async def rpc_reduce(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                         context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        _, meta = await unpack(requests)
        if meta["step"] != self.step:
            reply = {"status": "stale", "step": self.step}
        elif meta.get("probe"):
            reply = {"status": "ok", "step": self.step}
        else:
            grads, samples = await self._run(self._take_snapshot, self.step)
            peers = [PeerID.from_base58(p) for p in meta["peers"]]
            try:
                averaged = await self._all_reduce(grads, samples, meta["group_id"], peers)
                self.averaged = (meta["group_id"], averaged)
                reply = {"status": "ok", "samples": samples}
            except Exception as e:  # a group member died or timed out: the coordinator retries without it
                reply = {"status": "failed", "error": repr(e), "samples": samples}
        for message in respond({}, reply):
            yield message

    async def rpc_commit(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                         context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        _, meta = await unpack(requests)
        reply = await self._run(self._apply, meta["group_id"], meta["lr"])
        for message in respond({}, reply):
            yield message

    async def rpc_state(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                        context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        await unpack(requests)
        blob, step = await self._run(self._state_blob)
        for message in respond({"blob": blob_tensor(blob)}, {"step": step, "uid": self.uid}):
            yield message

    async def rpc_resync(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                         context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        _, meta = await unpack(requests)
        step = await self.download_state(PeerID.from_base58(meta["source"]))
        for message in respond({}, {"status": "ok", "step": step}):
            yield message

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.AveragingData]:
        first = await anext(stream)
        future = self.runners.setdefault(first.group_id, asyncio.get_running_loop().create_future())
        try:  # a group mate may reach us before our own reduce call registered the runner
            runner = await asyncio.wait_for(asyncio.shield(future), timeout=self.sync_timeout_s)
        except asyncio.TimeoutError:
            self.runners.pop(first.group_id, None)
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        async for message in runner.rpc_aggregate_part(achain(as_aiter(first), stream), context):
            yield message

    # -- in-stage averaging and state transfer ------------------------------------------------------------
    async def _all_reduce(self, tensors: list[torch.Tensor], weight: int, group_id: bytes,
                          peers: list[PeerID]) -> list[torch.Tensor]:
        """Weighted average over ``peers`` (the coordinator's group, same order everywhere)."""
        if len(peers) == 1:
            return tensors
        runner = AllReduceRunner(
            p2p=self.node.p2p, servicer_type=type(self), prefix=self.namespace, group_id=group_id,
            tensors=tensors, weight=float(weight), ordered_peer_ids=peers,
            peer_fractions=tuple(1.0 / len(peers) for _ in peers),
            sender_timeout=self.sync_timeout_s / 2, reducer_timeout=self.sync_timeout_s,
        )
        future = self.runners.setdefault(group_id, asyncio.get_running_loop().create_future())
        future.set_result(runner)
        try:
            averaged = [t.clone() for t in tensors]
            async for tensor, delta in azip(as_aiter(*averaged), runner):
                tensor.add_(delta)
            return averaged
        finally:
            self.runners.pop(group_id, None)

    async def download_state(self, source: PeerID) -> int:
        stub = type(self).get_stub(self.node.p2p, source, namespace=self.namespace)

        async def fetch() -> dict[str, torch.Tensor]:
            return (await unpack(await stub.rpc_state(request({}, {}))))[0]

        tensors = await asyncio.wait_for(fetch(), timeout=self.sync_timeout_s)
        return await self._run(self._load_blob, tensors["blob"].numpy().tobytes())

    async def load_from_replica(self, give_up_after_s: float) -> None:
        """Download parameters + optimizer state from a live replica of this stage before serving."""
        deadline = time.monotonic() + give_up_after_s
        while True:
            records = await stage_records(self.node, self.run_id, self.stage)
            sources = [(uid, peer) for uid, (peer, _) in records.items() if uid != self.uid]
            random.shuffle(sources)
            for uid, peer in sources:
                try:
                    step = await self.download_state(PeerID.from_base58(peer))
                    print(f"[{self.uid}] loaded stage {self.stage} state at step {step} from {uid}", flush=True)
                    return
                except Exception as e:
                    print(f"[{self.uid}] state download from {uid} failed: {e!r}", flush=True)
            if time.monotonic() > deadline:
                raise RuntimeError(f"stage {self.stage}: no live replica to load the state from "
                                   f"within {give_up_after_s:.0f} s")
            await asyncio.sleep(0.5)

    async def declare_forever(self) -> None:
        key, peer_id = stage_key(self.run_id, self.stage), self.node.p2p.peer_id.to_base58()
        while True:
            await self.node.store(key, subkey=self.uid, value=peer_id, expiration_time=get_dht_time() + RECORD_TTL_S)
            await asyncio.sleep(DECLARE_PERIOD_S)


class EmulatedStagePeer(StagePeer):
    """Throughput emulation of an ``emulation.SwarmSetup`` on real processes and RPCs: no model, no optimizer;
    a forward call sleeps ``stage_time_s / speed`` (backward: ``backward_factor`` times that) on the compute
    thread and answers with ``activation_bytes`` of payload."""

    def __init__(self, cfg: dict, stage: int, uid: str, speed: float, node: DHTNode):
        emulate = cfg["emulate"]
        self.cfg, self.stage, self.uid, self.speed, self.node = cfg, stage, uid, speed, node
        self.run_id, self.num_stages = cfg["run_id"], cfg["stages"]
        self.namespace = stage_namespace(self.run_id, stage)
        self.sync_timeout_s = cfg["sync_timeout_s"]
        self.compute = ThreadPoolExecutor(1, thread_name_prefix=f"stage{stage}-compute")
        self.stage_time_s, self.backward_factor = emulate["stage_time_s"], emulate["backward_factor"]
        self.payload = torch.zeros(emulate["activation_bytes"], dtype=torch.uint8)
        self.runners = {}

    def _forward(self, tensors: dict[str, torch.Tensor], meta: dict) -> tuple[dict, dict]:
        time.sleep(self.stage_time_s / self.speed)
        return {"y": self.payload}, {}

    def _backward(self, tensors: dict[str, torch.Tensor], meta: dict) -> tuple[dict, dict]:
        time.sleep(self.stage_time_s * self.backward_factor / self.speed)
        return {"y": self.payload}, {}


# --------------------------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------------------------
async def exit_with_coordinator() -> None:
    """Kill this process's whole group (itself and its p2pd) once the coordinator that started it is gone."""
    coordinator = int(os.environ.get("CRAMSWARM_COORDINATOR_PID", "0"))
    while coordinator:
        await asyncio.sleep(1.0)
        if os.getppid() != coordinator:
            os.killpg(os.getpgid(0), signal.SIGKILL)


async def serve_bootstrap(addr_file: str, host: str) -> None:
    node = await join_dht(None, client_mode=False, host=host)
    maddrs = [str(m) for m in await node.p2p.get_visible_maddrs()]
    write_addr_file(addr_file, maddrs)
    print(f"bootstrap DHT at {maddrs}", flush=True)
    await exit_with_coordinator()
    await asyncio.Event().wait()


async def serve_stage(args: argparse.Namespace) -> None:
    cfg = json.loads(Path(args.config).read_text())
    torch.set_num_threads(1)
    watchdog = asyncio.create_task(exit_with_coordinator())
    maddrs = read_addr_file(args.addr_file, cfg["join_timeout_s"])
    node = await join_dht(maddrs, client_mode=False, host=cfg["host"], timeout_s=cfg["join_timeout_s"])
    peer = (EmulatedStagePeer if "emulate" in cfg else StagePeer)(cfg, args.stage, args.uid, args.speed, node)
    await peer.add_p2p_handlers(node.p2p, namespace=peer.namespace)
    if args.load_state:
        await peer.load_from_replica(cfg["give_up_after_s"])
    print(f"[{args.uid}] serving stage {args.stage} (speed {args.speed}) as {node.p2p.peer_id}", flush=True)
    await asyncio.gather(peer.declare_forever(), watchdog)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m cramswarm.swarm.hivemind_peer", description=__doc__.split("\n")[0])
    roles = parser.add_subparsers(dest="role", required=True)
    boot = roles.add_parser("bootstrap", help="run the bootstrap DHT node and write its address file")
    boot.add_argument("--addr-file", required=True)
    boot.add_argument("--host", default="127.0.0.1")
    stage = roles.add_parser("stage", help="serve one pipeline stage")
    stage.add_argument("--config", required=True)
    stage.add_argument("--stage", type=int, required=True)
    stage.add_argument("--uid", required=True)
    stage.add_argument("--addr-file", required=True)
    stage.add_argument("--speed", type=float, default=1.0)
    stage.add_argument("--load-state", action="store_true")
    args = parser.parse_args(argv)
    if args.role == "stage" and not (args.speed > 0 and math.isfinite(args.speed)):
        parser.error(f"--speed must be positive, got {args.speed}")
    try:
        asyncio.run(serve_bootstrap(args.addr_file, args.host) if args.role == "bootstrap" else serve_stage(args))
    except BootstrapError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
