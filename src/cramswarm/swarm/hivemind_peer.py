"""Transport 1 (real hivemind): one replica of one pipeline stage, served over hivemind P2P streams.

``StagePeer`` holds a ``replica.StageReplica`` of a stage (``stages.build_stage`` of the crammed-BERT MLM: the
module, the recipe's optimizer, the accumulated gradients) and its compute: ``_forward``, the replica's output for
the inputs, compressed with ``compression.encode``, and ``_backward``, the replica's backward (the last stage's
forward and backward are one computation: its output gradient is the constant 1), counted in its local samples,
returning the compressed input gradient (and the loss). ``peer_sync.SyncingStagePeer`` serves that compute (its
``forward`` and ``backward`` RPCs) and adds the in-stage steps; ``peer_process`` runs it as a process. The RPCs
every peer has (``rpc_*``):

* ``state`` - parameters + optimizer state + step count of a replica (a joining or lagging peer downloads them
  from a live replica before it serves);
* ``aggregate_part`` - hivemind's all-reduce traffic, dispatched to the running ``AllReduceRunner`` (the
  in-stage all-reduce, ``_all_reduce``, weighted by local samples, compressed with
  ``swarm.averaging_compression``: ``averaging.StageAllReduce``);
* ``die`` - fault injection where the launcher cannot signal the process (another host, an attached task): the
  peer SIGKILLs its own process group (itself and its p2pd) right after replying.

The RPCs' payload tensors travel uncompressed at the hivemind level (``CompressionType.NONE``, ``wire``): the
boundary compression is ours, applied before. The in-stage all-reduce compresses with ``averaging``'s codecs.
"""
from __future__ import annotations

import asyncio
import io
import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator  # hivemind's servicer recognises typing's alias only

import torch
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2PContext, PeerID, ServicerBase
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import achain, aiter_with_timeout, as_aiter

from cramswarm.precision import resolve_precision
from cramswarm.swarm.averaging import StageAllReduce, average, chunk_timeout_s, codec, state_chunk_timeout_s
from cramswarm.swarm.compression import decode, encode, payload_to, wire_scheme
from cramswarm.swarm.membership import DECLARE_PERIOD_S, RECORD_TTL_S, stage_key, stage_namespace, stage_records
from cramswarm.swarm.replica import StageReplica
from cramswarm.swarm.settings import ProcessConfig
from cramswarm.swarm.stages import build_stage, rss_bytes
from cramswarm.swarm.wire import BufferReader, blob_tensor, flatten_payload, request, respond, restore_payload, unpack
from cramswarm.training import resolve_device

# oneDNN primitives (CPU kernels built for one shape) a stage peer process caches; oneDNN's default is 1024. The
# last stage decodes only the masked positions, a count that differs from microbatch to microbatch, so every new
# count builds new decoder primitives, and with the default cache the peer's RSS keeps growing
# (benchmarks/swarm_peer_memory.py); 16 bounds it at no measurable CPU cost per call.
# ONEDNN_PRIMITIVE_CACHE_CAPACITY in the environment wins.
PEER_KERNEL_CACHE = 16
KERNEL_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
_RUNTIME_RSS: list[int | None] = []


def bound_kernel_cache() -> None:
    """Bound this process's oneDNN primitive cache (``PEER_KERNEL_CACHE``) unless the environment sets it. oneDNN
    reads the variable when it builds its first primitive, so call this before the process computes anything."""
    os.environ.setdefault(KERNEL_CACHE_ENV, str(PEER_KERNEL_CACHE))


def runtime_rss_bytes() -> int | None:
    """This process's resident set size when its first stage peer was created, before the stage was built: the
    runtime (Python, PyTorch, hivemind and the joined DHT node; not the ``p2pd`` daemon, a process of its own)
    that the stage's memory comes on top of. Measured once per process (a peer moved to another stage keeps it)."""
    if not _RUNTIME_RSS:
        _RUNTIME_RSS.append(rss_bytes())
    return _RUNTIME_RSS[0]



# --------------------------------------------------------------------------------------------------------------
# Stage peer
# --------------------------------------------------------------------------------------------------------------
class StagePeer(ServicerBase):
    """One replica of one pipeline stage (``replica``: model slice, optimizer, accumulated gradients) and its RPCs.

    All torch work runs on one compute thread (requests queue there, like a device), the RPC handlers and the
    all-reduce on the asyncio loop. The launcher and the trainers reach a peer through ``get_stub``.
    """

    def __init_subclass__(cls, **kwargs):
        # hivemind caches a servicer's RPC handlers and stub type on the class (ServicerBase._rpc_handlers,
        # _stub_type): a subclass would inherit its parent's, whose handle names ("StagePeer.rpc_state") its own
        # servers do not answer. Each class builds its own.
        super().__init_subclass__(**kwargs)
        cls._rpc_handlers = None
        cls._stub_type = None

    def __init__(self, cfg: ProcessConfig, stage: int, uid: str, speed: float, node: DHTNode):
        self.runtime_rss_bytes = runtime_rss_bytes()   # before anything of the stage is allocated
        recipe = cfg.recipe
        self.cfg, self.stage, self.uid, self.speed, self.node = cfg, stage, uid, speed, node
        self.run_id, self.num_stages = cfg.run_id, cfg.stages
        self.namespace = stage_namespace(self.run_id, stage)
        self.device = resolve_device(cfg.device)  # auto: the GPU this process sees (srun --gpus-*)
        precision = resolve_precision(recipe["precision"], self.device)
        if precision == "fp16":
            raise ValueError("swarm peers train in bf16 or fp32: fp16 would need loss scaling across stages "
                             "(set the model's recipe precision to bf16 or fp32)")
        # only this stage's parameters, with the whole model's initial values (the same on every replica)
        module = build_stage(cfg.arch, cfg.vocab_size, recipe["seed"], stage, self.num_stages,
                             cfg.compression, cfg.peer_memory_cap_mb).to(self.device)
        self.replica = StageReplica(module, recipe, precision, self.device, self.is_last, speed,
                                    cfg.peer_unit_time_s)
        # what the boundary tensors travel in: a narrowing compression's narrowed tensor goes as is (fp32)
        self.scheme = wire_scheme(cfg.compression)
        self.averaging_scheme, self.link_mbit_s = cfg.averaging_compression, cfg.link_mbit_s
        self.sync_timeout_s = cfg.sync_timeout_s
        self.compute = ThreadPoolExecutor(1, thread_name_prefix=f"stage{stage}-compute")
        # a job that must not wait for the compute queue (_run_next: a step's snapshot) runs on a thread of its own;
        # the lock keeps it and the compute jobs from touching the stage's state at once
        self.state_lock, self.next_waiting = threading.Lock(), False
        self.next_thread = ThreadPoolExecutor(1, thread_name_prefix=f"stage{stage}-next")
        self.averaged: tuple[bytes, torch.Tensor] | None = None     # (group id, flat averaged gradient)
        self.runners: dict[bytes, asyncio.Future] = {}
        self.leaving = False   # moving to another stage (peer_rebalance): new calls are refused

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def step(self) -> int:   # the in-stage steps its replica applied (or downloaded)
        return self.replica.step

    async def _run(self, fn, *args):
        """``fn(*args)`` on the compute thread, after the jobs queued there."""
        return await asyncio.get_running_loop().run_in_executor(self.compute, self._in_turn, fn, *args)

    async def _run_next(self, fn, *args):
        """``fn(*args)`` as soon as the compute job running now ends, before those queued behind it."""
        self.next_waiting = True
        try:
            return await asyncio.get_running_loop().run_in_executor(self.next_thread, self._first, fn, *args)
        finally:
            self.next_waiting = False

    def _in_turn(self, fn, *args):
        while self.next_waiting:   # a _run_next job goes first (it clears the flag once it holds the lock)
            time.sleep(0.001)
        with self.state_lock:
            return fn(*args)

    def _first(self, fn, *args):
        with self.state_lock:
            self.next_waiting = False
            return fn(*args)

    # -- compute (on the compute thread) ------------------------------------------------------------------
    def _input(self, tensors: dict[str, torch.Tensor], meta: dict) -> torch.Tensor:
        if self.stage == 0:
            return tensors["input_ids"].to(self.device)
        # decoded where the stage computes: only the payload (codes, scales) crosses to the device
        return decode(payload_to(restore_payload("x", tensors, meta), self.device))

    def _forward(self, tensors: dict[str, torch.Tensor], meta: dict) -> tuple[dict, dict]:
        start = time.perf_counter()
        out = self.replica.forward(self._input(tensors, meta))
        result, out_meta = {}, {}
        # encoded where it was computed: only the payload crosses to host memory (an 8-bit payload is a quarter of
        # the fp32 activation; on a GPU the codec's passes over the tensor take no CPU time)
        flatten_payload("y", payload_to(encode(out.float(), self.scheme), "cpu"), result, out_meta)
        self.replica.emulate_speed(time.perf_counter() - start, 1.0)
        return result, out_meta

    def _backward(self, tensors: dict[str, torch.Tensor], meta: dict) -> tuple[dict, dict]:
        start = time.perf_counter()
        x = self._input(tensors, meta)
        target = (tensors["labels"].to(self.device) if self.is_last
                  else decode(payload_to(restore_payload("g", tensors, meta), self.device)))
        grad, loss = self.replica.backward(x, target)
        samples = int(x.shape[0])
        out_meta: dict = {"samples": samples} if loss is None else {"samples": samples, "loss": loss}
        result: dict = {}
        if grad is not None:
            flatten_payload("g", payload_to(encode(grad.float(), self.scheme), "cpu"), result, out_meta)
        self.replica.emulate_speed(time.perf_counter() - start, 3.0 if self.is_last else 2.0)
        self.replica.local_samples += samples   # held once the call's (emulated) compute ends, not during its sleep
        return result, out_meta

    def _apply(self, group_id: bytes, lr: float) -> dict:
        if self.averaged is None or self.averaged[0] != group_id:
            return {"status": "failed", "error": "no averaged gradients held for this group"}
        self.replica.apply(self.averaged[1], lr)
        self.averaged = None
        return {"status": "ok", "step": self.step, "digest": self.replica.digest()}

    def _state(self) -> dict:
        """What a replica hands a joining one (and a shard holds): parameters, optimizer state and step (``peer_sync``
        adds its stepped samples); the tensors are the live ones (serialise it on the compute thread)."""
        return self.replica.state()

    def _state_blob(self) -> tuple[bytes, int, str]:
        buffer = io.BytesIO()
        torch.save(self._state(), buffer)
        return buffer.getvalue(), self.step, self.replica.digest()

    def _load_state_tensor(self, blob: torch.Tensor) -> int:
        """``_load_blob`` of a downloaded state (a uint8 tensor) without a bytes copy of it: ``torch.load`` reads the
        tensor's own buffer (a state is 12 bytes per parameter)."""
        return self._load_state(torch.load(BufferReader(blob.numpy()), weights_only=True, map_location=self.device))

    def _load_state(self, state: dict) -> int:
        self.replica.load_state(state)
        self.averaged = None
        return self.step

    # -- RPC handlers -------------------------------------------------------------------------------------
    async def rpc_state(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                        context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        await unpack(requests)
        blob, step, digest = await self._run(self._state_blob)
        meta = {"step": step, "uid": self.uid, "device": str(self.device), "digest": digest}
        for message in respond({"blob": blob_tensor(blob)}, meta):
            yield message

    async def rpc_die(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                      context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        await unpack(requests)
        print(f"[{self.uid}] killed by the launcher's fault injection", flush=True)
        asyncio.get_running_loop().call_later(0.2, os.killpg, os.getpgid(0), signal.SIGKILL)
        for message in respond({}, {"status": "ok"}):
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
    async def _all_reduce(self, flat: torch.Tensor, weight: int, group_id: bytes, peers: list[PeerID],
                          traffic: dict) -> torch.Tensor:
        """Weighted average of the flat gradient over ``peers`` (the group read from the stage's records, the same
        order everywhere), the same decompressed values on every peer; ``traffic`` gets the bytes and values this
        peer sent."""
        traffic.update(bytes_sent=0, values_sent=0)
        if len(peers) == 1:
            return flat
        # per-part timeouts (between two parts of one stream); the whole all-reduce's bound, which grows with
        # the stage, is the caller's (averaging.averaging_timeout_s)
        part_s = chunk_timeout_s(self.averaging_scheme, self.link_mbit_s, self.sync_timeout_s / 2)
        runner = StageAllReduce(
            p2p=self.node.p2p, servicer_type=type(self), prefix=self.namespace, group_id=group_id,
            tensors=[flat], weight=float(weight), ordered_peer_ids=peers,
            peer_fractions=tuple(1.0 / len(peers) for _ in peers), compression=codec(self.averaging_scheme),
            sender_timeout=part_s, reducer_timeout=2 * part_s,
        )
        future = self.runners.setdefault(group_id, asyncio.get_running_loop().create_future())
        future.set_result(runner)
        try:
            return await average(runner)
        finally:
            traffic.update(bytes_sent=runner.bytes_sent, values_sent=runner.values_sent)
            self.runners.pop(group_id, None)

    async def download_state(self, source: PeerID) -> int:
        """Load ``source``'s state (``_state``) as hivemind's ``load_state_from_peers`` does: streamed in chunks
        (``wire``), each awaited for at most one chunk's transfer time plus the sync timeout (a stalled source fails
        fast, a large state is not cut off), and checked: the loaded parameters' digest must equal the one the source
        sent (else ``ValueError``: try another source)."""
        stub = type(self).get_stub(self.node.p2p, source, namespace=self.namespace)
        chunk_s = state_chunk_timeout_s(self.link_mbit_s, self.sync_timeout_s)
        stream = await asyncio.wait_for(stub.rpc_state(request({}, {})), timeout=chunk_s)
        tensors, meta = await unpack(aiter_with_timeout(stream, chunk_s))
        step = await self._run(self._load_state_tensor, tensors.pop("blob"))
        if (digest := await self._run(self.replica.digest)) != meta["digest"]:
            raise ValueError(f"the state loaded from {meta['uid']} has parameter digest {digest[:12]}, "
                             f"not the {meta['digest'][:12]} it sent")
        return step

    async def _source_order(self, sources: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """(uid, peer id) of the replicas to download from, in the order to try them: at random (``peer_sync``: the
        newest step first)."""
        return random.sample(sources, len(sources))

    async def load_from_replica(self, give_up_after_s: float, alone_after_s: float | None = None) -> bool:
        """Download parameters + optimizer state from a live replica of this stage before serving: True once loaded.
        With ``alone_after_s``, False once no other replica has been declared for that long (the caller serves the
        state it has); a RuntimeError once ``give_up_after_s`` passed without a download."""
        alone_since = time.monotonic()  # the last time another replica was declared
        deadline = alone_since + give_up_after_s
        while True:
            records = await stage_records(self.node, self.run_id, self.stage)
            sources = await self._source_order([(uid, peer) for uid, (peer, _) in records.items() if uid != self.uid])
            if sources:
                alone_since = time.monotonic()
            for uid, peer in sources:
                try:
                    step = await self.download_state(PeerID.from_base58(peer))
                    print(f"[{self.uid}] loaded stage {self.stage} state at step {step} from {uid}", flush=True)
                    return True
                except Exception as e:
                    print(f"[{self.uid}] state download from {uid} failed: {e!r}", flush=True)
            if alone_after_s is not None and time.monotonic() - alone_since > alone_after_s:
                return False
            if time.monotonic() > deadline:
                raise RuntimeError(f"stage {self.stage}: no live replica to load the state from "
                                   f"within {give_up_after_s:.0f} s")
            await asyncio.sleep(0.5)

    async def declare_forever(self) -> None:
        """This peer's stage record, every ``DECLARE_PERIOD_S``; paused while it is ``leaving`` its stage (its record
        is withdrawn: ``peer_rebalance``)."""
        key, peer_id = stage_key(self.run_id, self.stage), self.node.p2p.peer_id.to_base58()
        while True:
            if not self.leaving:
                await self.node.store(key, subkey=self.uid, value=peer_id,
                                      expiration_time=get_dht_time() + RECORD_TTL_S)
            await asyncio.sleep(DECLARE_PERIOD_S)
