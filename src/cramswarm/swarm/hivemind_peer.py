"""Transport 1 (real hivemind), process side: the bootstrap DHT node and the SWARM stage peer.

Run as a module, one OS process per role (the launcher, ``launcher``, starts each one as its own process-group
leader, so killing the group also kills the peer's ``p2pd`` daemon)::

    python -m cramswarm.swarm.hivemind_peer bootstrap --addr-file F [--host 127.0.0.1]
    python -m cramswarm.swarm.hivemind_peer stage --config C --stage S --uid U --addr-file F [--speed X] [--load-state]
    python -m cramswarm.swarm.hivemind_peer task --rendezvous DIR [--rank R]      (= python -m cramswarm swarm-peer)

``bootstrap`` starts a DHT node and writes its visible multiaddrs to the address file (atomically, one per line).
Every peer and trainer also appends its own multiaddrs and joins through the file's newest entries
(``join_swarm``), so the bootstrap is not needed after the start. ``stage`` serves one pipeline stage
(``stages.build_stage`` of the crammed-BERT MLM) as a ``peer_sync.SyncingStagePeer`` over hivemind P2P streams and
declares itself under the stage's DHT key; it steps with its stage's other peers by itself (``peer_sync``) and may
move itself to another stage (``peer_rebalance``), in the same process. ``task`` is one peer of a swarm whose
launcher did not start it (placements ``attach`` and ``srun``): it reads the launcher's rendezvous folder
(``config.json``, then the address file ``dht_addrs.txt``), takes the stage and speed of its rank (``--rank``, else
``SLURM_PROCID``: the tasks of one ``srun`` job step; ``claim_rank`` locks it, so a rank runs once) and runs
``stage`` as a child process group, which it restarts with a state download when it dies (``rejoin_after_s``
later; on its rank's stage: a peer that moved and then died comes back where it started). The RPCs of this
module's ``StagePeer`` (``rpc_*``; ``peer_sync`` adds its own):

* ``forward``  - stage output for the inputs (no grad), compressed with ``compression.encode``;
* ``backward`` - re-runs the stage forward on the saved inputs (so any replica can take it, as in SWARM),
  backpropagates the output gradient (the last stage: the loss x samples; forward and backward of the last
  stage are one call, since its output gradient is the constant 1), accumulates parameter gradients and the
  local sample count, returns the compressed input gradient (and the loss);
* ``state`` - parameters + optimizer state + step count of a replica (a joining or lagging peer downloads them
  from a live replica before it serves);
* ``aggregate_part`` - hivemind's all-reduce traffic, dispatched to the running ``AllReduceRunner`` (the
  in-stage all-reduce, ``_all_reduce``, weighted by local samples, compressed with
  ``swarm.averaging_compression``: ``averaging.StageAllReduce``);
* ``die`` - fault injection where the launcher cannot signal the process (another host, an attached task): the
  peer SIGKILLs its own process group (itself and its p2pd) right after replying.

The launcher keeps a heartbeat record in the DHT (``launcher_key``: ``starting``, ``training`` or ``done``,
re-stored every 2 s with a 10 s expiration). A stage peer exits (code 0) once it reads ``done``, and (code
``LAUNCHER_GONE``) once the record has been missing for ``LAUNCHER_GRACE_S``; a peer that joins while the record
says ``training`` downloads its stage's state before it serves. A peer started by a launcher on the same host
(``CRAMSWARM_PARENT_PID``, the parent's pid) also SIGKILLs its own process group once that parent is gone,
so a launcher or supervisor killed without clean-up leaves no peer or p2pd behind.

Addresses: every process listens on ``host`` (an IPv4 address; ``0.0.0.0``: all interfaces) or, when
``interface`` is set (e.g. ``ib0``), on that network interface's IPv4 address, looked up on each host. The
address file lists the bootstrap's visible multiaddrs, loopback ones last.

The RPCs' payload tensors travel uncompressed at the hivemind level (``CompressionType.NONE``): the boundary
compression is ours, applied before. The in-stage all-reduce uses hivemind's codecs (``averaging``; its 8-bit
one with a decoder that runs on numpy 2.4).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import hashlib
import io
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import AsyncIterator  # hivemind's servicer recognises typing's alias only

import psutil
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2PContext, PeerID, ServicerBase
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import achain, as_aiter
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from cramswarm.precision import autocast, resolve_precision
from cramswarm.swarm.averaging import StageAllReduce, average, chunk_timeout_s, codec, state_timeout_s
from cramswarm.swarm.compression import decode, encode, payload_to, wire_scheme
from cramswarm.swarm.stages import SavedActivations, build_stage, rss_bytes
from cramswarm.training import apply_gradients, make_optimizer, resolve_device

CHUNK_BYTES = 2**20        # streamed message chunk (well below p2pd's 4 MiB message limit)
DECLARE_PERIOD_S = 2.0     # a peer re-declares its DHT record this often ...
RECORD_TTL_S = 10.0        # ... with this expiration; a dead peer's record disappears within this time
LAUNCHER_GRACE_S = 30.0  # a stage peer exits once the launcher's heartbeat record is missing this long
LAUNCHER_GONE = 3       # exit code of a stage peer whose launcher is gone (its supervisor does not restart it)
ADDR_FILE, CONFIG_FILE = "dht_addrs.txt", "config.json"  # in a rendezvous folder, written in the order config, addrs
JOIN_THROUGH = 32          # a joining process tries this many of the address file's newest entries
DONE_FILE = "done"         # in a rendezvous folder: the run id of a launcher that has finished
# Set by a placement that puts a process on a host of its own (``cramswarm.testbed.swarm``): the multiaddrs its
# DHT node listens on and those it announces (space-separated; e.g. a relay's address that other hosts must dial).
LISTEN_ENV, ANNOUNCE_ENV = "CRAMSWARM_P2P_LISTEN", "CRAMSWARM_P2P_ANNOUNCE"


# oneDNN primitives (CPU kernels built for one shape) a stage peer process caches; oneDNN's default is 1024. The
# last stage decodes only the masked positions, a count that differs from microbatch to microbatch, so every new
# count builds new decoder primitives; with the default cache they pile up (benchmarks/swarm_peer_memory.py on the
# last stage of swarm_launcher.py's memory run: RSS still rising by about 16 MiB per backward call at the 24th).
# 16 bounds that; the CPU per call stayed within the probe's noise. ONEDNN_PRIMITIVE_CACHE_CAPACITY in the
# environment wins.
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


class BootstrapError(RuntimeError):
    """The swarm's bootstrap DHT could not be found or joined."""


class RankTaken(RuntimeError):
    """Another live task holds this task's rank in the rendezvous folder."""


class LauncherGone(RuntimeError):
    """The launcher's heartbeat record has been missing from the DHT for too long."""


def listen_host(cfg: dict) -> str:
    """The IPv4 address this process listens on: that of ``cfg["interface"]`` on this host, else ``cfg["host"]``."""
    name = cfg.get("interface")
    if not name:
        return cfg.get("host") or "127.0.0.1"
    interfaces = psutil.net_if_addrs()
    if name not in interfaces:
        raise BootstrapError(f"swarm.interface={name!r}: no such network interface on {socket.gethostname()} "
                             f"(it has {', '.join(sorted(interfaces))})")
    addresses = [a.address for a in interfaces[name] if a.family == socket.AF_INET]
    if not addresses:
        raise BootstrapError(f"swarm.interface={name!r} has no IPv4 address on {socket.gethostname()}")
    return addresses[0]


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


def append_addr_file(path: str | Path, maddrs: list[str]) -> None:
    """Add this process's multiaddrs to the address file (one ``write`` of whole lines with ``O_APPEND``, so
    concurrent writers never interleave within a line): any live process listed there lets newcomers in."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, "".join(f"{m}\n" for m in maddrs).encode())
    finally:
        os.close(fd)


async def join_swarm(addr_file: str | Path, *, host: str, timeout_s: float, announce: bool,
                     recent: int = JOIN_THROUGH) -> DHTNode:
    """A full DHT node joined through the ``recent`` newest entries of the address file (dead entries are
    skipped: joining needs one live one); with ``announce`` its own multiaddrs are appended, so that no single
    process - the one that started the DHT included - is needed for later joins."""
    maddrs = await asyncio.to_thread(read_addr_file, addr_file, timeout_s)
    newest = list(dict.fromkeys(reversed(maddrs)))[:recent]
    node = await join_dht(newest, client_mode=False, host=host, timeout_s=timeout_s)
    if announce:
        visible = sorted((str(m) for m in await node.p2p.get_visible_maddrs()), key=lambda m: m.startswith("/ip4/127."))
        append_addr_file(addr_file, visible)
    return node


async def join_dht(initial_peers: list[str] | None, *, client_mode: bool, host: str = "127.0.0.1",
                   timeout_s: float = 15.0) -> DHTNode:
    """A DHT node in this process (its P2P daemon is a child process), joined through ``initial_peers``.

    Any failure to reach the bootstrap peers - unreachable, refusing, garbage - raises ``BootstrapError``
    within ``timeout_s``. It listens on ``host`` (a free port) unless ``LISTEN_ENV`` names multiaddrs, and
    announces the multiaddrs in ``ANNOUNCE_ENV`` instead of those it listens on where that is set.
    """
    listen = os.environ.get(LISTEN_ENV, "").split() or [f"/ip4/{host}/tcp/0"]
    announce = os.environ.get(ANNOUNCE_ENV, "").split() or None
    try:
        return await asyncio.wait_for(
            DHTNode.create(initial_peers=initial_peers or None, client_mode=client_mode,
                           host_maddrs=listen, announce_maddrs=announce, startup_timeout=timeout_s,
                           bootstrap_timeout=min(timeout_s, 3.0) if initial_peers and len(initial_peers) > 1
                           else timeout_s, ensure_bootstrap_success=True),
            timeout=timeout_s,
        )
    except (asyncio.TimeoutError, TimeoutError) as e:
        raise BootstrapError(f"could not join the swarm DHT through {initial_peers} within {timeout_s:.0f} s") from e
    except Exception as e:  # P2PDaemonError, multiaddr parse errors, bootstrap failures
        raise BootstrapError(f"could not join the swarm DHT through {initial_peers}: {e}") from e


def launcher_key(run_id: str) -> str:
    """DHT key of the launcher's heartbeat (value: ``starting``, ``training`` or ``done``)."""
    return f"{run_id}_launcher"


async def launcher_phase(node: DHTNode, run_id: str) -> str | None:
    found = await node.get(launcher_key(run_id), latest=True)
    return found.value if found is not None and isinstance(found.value, str) else None


async def watch_launcher(node: DHTNode, run_id: str, grace_s: float = LAUNCHER_GRACE_S) -> None:
    """Return once the launcher says ``done``; raise ``LauncherGone`` once its record is missing ``grace_s``."""
    last_seen = time.monotonic()
    while True:
        try:
            phase = await launcher_phase(node, run_id)
        except Exception:  # a DHT hiccup counts as not seen
            phase = None
        if phase == "done":
            return
        if phase is not None:
            last_seen = time.monotonic()
        elif time.monotonic() - last_seen > grace_s:
            raise LauncherGone(f"the launcher of swarm {run_id} has not been seen for {grace_s:.0f} s")
        await asyncio.sleep(DECLARE_PERIOD_S)


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


def _chunks(tensor: torch.Tensor) -> Iterator[runtime_pb2.Tensor]:
    """The streamed parts of one tensor: hivemind's ``split_for_streaming`` of its uncompressed serialisation. A
    uint8 tensor (a state blob, 12 bytes per parameter) is cut from its own buffer into the same messages, one at a
    time, so its whole serialised copy never exists."""
    if tensor.dtype != torch.uint8 or tensor.requires_grad:
        yield from split_for_streaming(serialize_torch_tensor(tensor), CHUNK_BYTES)
        return
    view = memoryview(tensor.numpy()).cast("B")
    yield runtime_pb2.Tensor(compression=runtime_pb2.CompressionType.NONE, buffer=view[:CHUNK_BYTES].tobytes(),
                             chunks=len(range(0, len(view), CHUNK_BYTES)), size=list(tensor.shape), dtype="uint8",
                             requires_grad=False)
    for start in range(CHUNK_BYTES, len(view), CHUNK_BYTES):
        yield runtime_pb2.Tensor(buffer=view[start:start + CHUNK_BYTES].tobytes())


def pack(message_cls: type, tensors: dict[str, torch.Tensor], meta: dict) -> Iterator:
    """Messages (``ExpertRequest`` or ``ExpertResponse``) carrying the tensors in chunks; meta rides on the first.
    Made as they are consumed: a reply streams a large tensor without holding all of its chunks."""
    names = list(tensors)
    header = MSGPackSerializer.dumps({"names": names, "meta": meta})
    first = True
    for name in names:
        for part in _chunks(tensors[name].detach().contiguous()):
            yield message_cls(tensors=[part], metadata=header if first else b"")
            first = False
    if first:
        yield message_cls(metadata=header)


class _Assembly:
    """One tensor being received: a uint8 tensor (a state blob) is copied chunk by chunk into its final storage,
    any other keeps its chunks for ``combine_from_streaming``."""

    def __init__(self, first: runtime_pb2.Tensor):
        self.count, self.received = max(first.chunks, 1), 0
        self.direct = first.compression == runtime_pb2.CompressionType.NONE and first.dtype == "uint8"
        if self.direct:
            self.out = torch.empty(tuple(first.size), dtype=torch.uint8)
            self.flat, self.pos = self.out.view(-1).numpy(), 0
        else:
            self.parts: list = []

    def add(self, part: runtime_pb2.Tensor) -> bool:
        """Take the next chunk; whether the tensor is complete."""
        if self.direct:
            data = part.buffer
            self.flat[self.pos:self.pos + len(data)] = memoryview(data).cast("B")
            self.pos += len(data)
        else:
            self.parts.append(part)
        self.received += 1
        return self.received == self.count

    def tensor(self) -> torch.Tensor:
        return self.out if self.direct else deserialize_torch_tensor(combine_from_streaming(self.parts))


async def unpack(stream: AsyncIterator) -> tuple[dict[str, torch.Tensor], dict]:
    header, tensors, assembly = None, {}, None
    async for message in stream:
        if header is None:
            header = MSGPackSerializer.loads(message.metadata)
        for part in message.tensors:
            assembly = assembly or _Assembly(part)
            if assembly.add(part):
                tensors[header["names"][len(tensors)]] = assembly.tensor()
                assembly = None
    if header is None:
        raise ConnectionError("empty message stream")
    if assembly is not None or len(tensors) != len(header["names"]):
        raise ConnectionError(f"message stream ended with {len(tensors)} of {len(header['names'])} tensors")
    return tensors, header["meta"]


def respond(tensors: dict[str, torch.Tensor], meta: dict) -> Iterator[runtime_pb2.ExpertResponse]:
    return pack(runtime_pb2.ExpertResponse, tensors, meta)


def request(tensors: dict[str, torch.Tensor], meta: dict) -> AsyncIterator[runtime_pb2.ExpertRequest]:
    return as_aiter(*pack(runtime_pb2.ExpertRequest, tensors, meta))


class BufferReader(io.RawIOBase):
    """A read-only, seekable file over a buffer (a numpy array, bytes, a memoryview) that reads from the buffer
    itself, where ``io.BytesIO`` of anything but ``bytes`` copies it first."""

    def __init__(self, buffer):
        super().__init__()
        self.view, self.pos = memoryview(buffer).cast("B"), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, target) -> int:
        n = max(0, min(len(target), len(self.view) - self.pos))
        target[:n] = self.view[self.pos:self.pos + n]
        self.pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: len(self.view)}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos


def blob_tensor(data: bytes) -> torch.Tensor:
    """A read-only uint8 view of ``data`` (no copy; nothing writes to it)."""
    if not data:
        return torch.zeros(0, dtype=torch.uint8)
    with warnings.catch_warnings():   # torch warns that the buffer of a bytes object is not writable
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8)


# --------------------------------------------------------------------------------------------------------------
# Stage peer
# --------------------------------------------------------------------------------------------------------------
class StagePeer(ServicerBase):
    """One replica of one pipeline stage: model slice, the recipe's optimizer, accumulated gradients, RPC handlers.

    All torch work runs on one compute thread (requests queue there, like a device), the RPC handlers and the
    all-reduce on the asyncio loop. The launcher and the trainers reach a peer through ``get_stub``.
    """

    def __init_subclass__(cls, **kwargs):
        # hivemind 1.1.12 caches a servicer's RPC handlers and stub type on the class (ServicerBase._rpc_handlers,
        # _stub_type) and returns early when the cache is set: a subclass created after its parent built them
        # inherits the parent's, and its stubs then call the parent's handle names ("StagePeer.rpc_state"), which
        # the subclass's servers (registered as "SyncingStagePeer.rpc_state") do not answer. Each class its own.
        super().__init_subclass__(**kwargs)
        cls._rpc_handlers = None
        cls._stub_type = None

    def __init__(self, cfg: dict, stage: int, uid: str, speed: float, node: DHTNode):
        self.runtime_rss_bytes = runtime_rss_bytes()   # before anything of the stage is allocated
        recipe = cfg["recipe"]
        self.cfg, self.stage, self.uid, self.speed, self.node = cfg, stage, uid, speed, node
        self.run_id, self.num_stages = cfg["run_id"], cfg["stages"]
        self.namespace = stage_namespace(self.run_id, stage)
        self.device = resolve_device(recipe["device"])  # auto: the GPU this process sees (srun --gpus-per-task)
        self.precision = resolve_precision(recipe["precision"], self.device)
        if self.precision == "fp16":
            raise ValueError("swarm peers train in bf16 or fp32: fp16 would need loss scaling across stages "
                             "(set the model's recipe precision to bf16 or fp32)")
        # only this stage's parameters, with the whole model's initial values (the same on every replica)
        self.module = build_stage(cfg["arch"], cfg["vocab_size"], recipe["seed"], stage, self.num_stages,
                                  cfg["compression"], cfg.get("peer_memory_cap_mb")).to(self.device)
        self.module.train()
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(self.module, recipe)   # the recipe's: AdamW, or Adam with L2 (BERT's)
        self.grad_clip = recipe["grad_clip_norm"]
        # what the boundary tensors travel in: a narrowing compression's narrowed tensor goes as is (fp32)
        self.scheme = wire_scheme(cfg["compression"])
        self.averaging_scheme, self.link_mbit_s = cfg["averaging_compression"], cfg["link_mbit_s"]
        self.num_params = sum(p.numel() for p in self.params)
        self.sync_timeout_s = cfg["sync_timeout_s"]
        self.unit_time_s = cfg.get("peer_unit_time_s")  # emulated compute floor per work unit at speed 1 (or None)
        self.compute = ThreadPoolExecutor(1, thread_name_prefix=f"stage{stage}-compute")
        # a job that must not wait for the compute queue (_run_next: a step's snapshot) runs on a thread of its own;
        # the lock keeps it and the compute jobs from touching the stage's state at once
        self.state_lock, self.next_waiting = threading.Lock(), False
        self.next_thread = ThreadPoolExecutor(1, thread_name_prefix=f"stage{stage}-next")
        self.step = 0
        self.local_samples = 0
        self.snapshot: tuple[int, torch.Tensor, int] | None = None  # (step, flat fp32 gradient sums, samples)
        self.averaged: tuple[bytes, torch.Tensor] | None = None     # (group id, flat averaged gradient)
        self.runners: dict[bytes, asyncio.Future] = {}
        self.activation_bytes = 0   # the most bytes one backward call's forward saved for backward (SavedActivations)

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

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
    def _emulate_speed(self, seconds: float, units: float) -> None:
        """A peer of speed s takes compute / s for a call (emulated by sleeping on the compute thread). The compute
        is what the call measured (``seconds``), or with ``peer_unit_time_s`` (``SwarmPlan.peer_unit_time_s``) at
        least ``units`` x that (a microbatch's forward 1, backward 2, the last stage's fused call 3: the work
        units of ``policies.WORK_UNITS``): then a call's time stays ``units x peer_unit_time_s / s`` on a loaded
        host, as long as the real compute fits under it, and peers' speeds keep their ratios whatever else runs.
        A peer of speed >= 1 without the floor does not sleep."""
        floor = units * self.unit_time_s if self.unit_time_s else 0.0
        time.sleep(max(0.0, max(seconds, floor) / self.speed - seconds))

    def _input(self, tensors: dict[str, torch.Tensor], meta: dict) -> torch.Tensor:
        if self.stage == 0:
            return tensors["input_ids"].to(self.device)
        # decoded where the stage computes: only the payload (codes, scales) crosses to the device
        return decode(payload_to(restore_payload("x", tensors, meta), self.device))

    def _forward(self, tensors: dict[str, torch.Tensor], meta: dict) -> tuple[dict, dict]:
        start = time.perf_counter()
        with torch.no_grad(), autocast(self.precision, self.device):
            out = self.module(self._input(tensors, meta))
        result, out_meta = {}, {}
        # encoded where it was computed: only the payload crosses to host memory (an 8-bit payload is a quarter of
        # the fp32 activation; on a GPU the codec's passes over the tensor take no CPU time)
        flatten_payload("y", payload_to(encode(out.float(), self.scheme), "cpu"), result, out_meta)
        self._emulate_speed(time.perf_counter() - start, 1.0)
        return result, out_meta

    def _backward(self, tensors: dict[str, torch.Tensor], meta: dict) -> tuple[dict, dict]:
        start = time.perf_counter()
        x = self._input(tensors, meta)
        samples = int(x.shape[0])
        if x.is_floating_point():
            x = x.detach().requires_grad_()
        out_meta: dict = {"samples": samples}
        with torch.enable_grad():
            with SavedActivations(self.params) as saved, autocast(self.precision, self.device):
                out = self.module(x, tensors["labels"].to(self.device)) if self.is_last else self.module(x)
            self.activation_bytes = max(self.activation_bytes, saved.bytes)
            if self.is_last:
                (out.float() * samples).backward()  # sample-weighted, so replicas' sums average correctly
                out_meta["loss"] = float(out.item())
            else:
                grad = decode(payload_to(restore_payload("g", tensors, meta), self.device))
                out.backward(grad.to(out.dtype))
        result: dict = {}
        if x.is_floating_point():
            flatten_payload("g", payload_to(encode(x.grad.float(), self.scheme), "cpu"), result, out_meta)
        self._emulate_speed(time.perf_counter() - start, 3.0 if self.is_last else 2.0)
        self.local_samples += samples   # held once the call's (emulated) compute ends, not during its sleep
        return result, out_meta

    def _flat_grads(self) -> torch.Tensor:
        """The accumulated gradients as one flat fp32 vector on the host (zeros for a parameter without one)."""
        return torch.cat([p.grad.detach().float().reshape(-1).cpu() if p.grad is not None
                          else torch.zeros(p.numel()) for p in self.params])

    def _take_snapshot(self, step: int) -> tuple[torch.Tensor, int]:
        """Move the accumulated gradients out of ``.grad`` into one flat fp32 vector divided by the local sample
        count (once per step; kept across reduce retries) and return it. Divided in place and returned as is: the
        all-reduce only reads it (its result is a new tensor), and the step that consumes it (``_apply``: for a
        group of one, the average is this vector) drops the snapshot, so no second copy of the gradients exists."""
        if self.snapshot is None or self.snapshot[0] != step:
            flat = self._flat_grads()
            for p in self.params:
                p.grad = None
            if self.local_samples:
                flat.div_(self.local_samples)
            self.snapshot = (step, flat, self.local_samples)
            self.local_samples = 0
        _, flat, samples = self.snapshot
        return flat, samples

    def _apply(self, group_id: bytes, lr: float) -> dict:
        if self.averaged is None or self.averaged[0] != group_id:
            return {"status": "failed", "error": "no averaged gradients held for this group"}
        leftover = [p.grad for p in self.params]  # backward calls that arrived after the snapshot
        self.snapshot = None   # the gradients are averaged: not needed again (a group of one averages in place)
        apply_gradients(self.params, self.optimizer, torch.split(self.averaged[1], [p.numel() for p in self.params]),
                        lr, self.grad_clip)
        for p, g in zip(self.params, leftover):
            p.grad = g
        self.step += 1
        self.snapshot = self.averaged = None
        digest = hashlib.sha1()
        for p in self.params:
            digest.update(p.detach().cpu().contiguous().numpy())   # its buffer, not a copy
        return {"status": "ok", "step": self.step, "digest": digest.hexdigest()}

    def _state(self) -> dict:
        """What a replica hands a joining one (and a shard holds): parameters, optimizer state, step and
        ``_extra_state``; the tensors are the live ones (serialise it on the compute thread)."""
        return {"module": self.module.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step,
                **self._extra_state()}

    def _state_blob(self) -> tuple[bytes, int]:
        buffer = io.BytesIO()
        torch.save(self._state(), buffer)
        return buffer.getvalue(), self.step

    def _load_blob(self, blob: bytes) -> int:
        return self._load_state(torch.load(io.BytesIO(blob), weights_only=True, map_location=self.device))

    def _load_state_tensor(self, blob: torch.Tensor) -> int:
        """``_load_blob`` of a downloaded state (a uint8 tensor) without a bytes copy of it: ``torch.load`` reads the
        tensor's own buffer (a state is 12 bytes per parameter)."""
        return self._load_state(torch.load(BufferReader(blob.numpy()), weights_only=True, map_location=self.device))

    def _load_state(self, state: dict) -> int:
        self.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])
        for p in self.params:
            p.grad = None
        self.step, self.local_samples = state["step"], 0
        self.snapshot = self.averaged = None
        self._load_extra_state(state)
        return self.step

    def _extra_state(self) -> dict:
        """More entries of the state a replica hands a joining one (``peer_sync`` adds its stepped samples)."""
        return {}

    def _load_extra_state(self, state: dict) -> None:
        pass

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

    async def rpc_state(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                        context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        await unpack(requests)
        blob, step = await self._run(self._state_blob)
        meta = {"step": step, "uid": self.uid, "device": str(self.device)}
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
        stub = type(self).get_stub(self.node.p2p, source, namespace=self.namespace)

        async def fetch() -> dict[str, torch.Tensor]:
            return (await unpack(await stub.rpc_state(request({}, {}))))[0]

        tensors = await asyncio.wait_for(fetch(), timeout=state_timeout_s(self.num_params, self.link_mbit_s,
                                                                           self.sync_timeout_s))
        return await self._run(self._load_state_tensor, tensors.pop("blob"))

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

    def background_tasks(self) -> list[asyncio.Task]:
        """Tasks the peer runs while it serves (``peer_sync``: its in-stage synchronisation loop)."""
        return []

    async def declare_forever(self) -> None:
        key, peer_id = stage_key(self.run_id, self.stage), self.node.p2p.peer_id.to_base58()
        while True:
            await self.node.store(key, subkey=self.uid, value=peer_id, expiration_time=get_dht_time() + RECORD_TTL_S)
            await asyncio.sleep(DECLARE_PERIOD_S)


# --------------------------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------------------------
async def exit_with_parent() -> None:
    """Kill this process's whole group (itself and its p2pd) once the launcher that started it is gone. Without
    ``CRAMSWARM_PARENT_PID`` (unset or empty: a process whose parent is not its starter, e.g. an srun job
    step's task) it waits forever; such a process leaves on the launcher's DHT heartbeat instead."""
    parent = int(os.environ.get("CRAMSWARM_PARENT_PID") or "0")
    if not parent:
        await asyncio.Event().wait()
    while True:
        await asyncio.sleep(1.0)
        if os.getppid() != parent:
            os.killpg(os.getpgid(0), signal.SIGKILL)


async def serve_bootstrap(addr_file: str, host: str, run_id: str | None = None,
                          grace_s: float = LAUNCHER_GRACE_S) -> None:
    """The DHT's first node; it writes the address file. With ``run_id`` it also leaves once the launcher of that
    run says ``done`` or its heartbeat has been missing ``grace_s`` (the srun placement: no parent to watch)."""
    node = await join_dht(None, client_mode=False, host=host)
    maddrs = sorted((str(m) for m in await node.p2p.get_visible_maddrs()), key=lambda m: m.startswith("/ip4/127."))
    write_addr_file(addr_file, maddrs)
    print(f"bootstrap DHT at {maddrs}", flush=True)
    watches = [asyncio.create_task(exit_with_parent())]
    if run_id is not None:
        watches.append(asyncio.create_task(watch_launcher(node, run_id, grace_s)))
    done, _ = await asyncio.wait(watches, return_when=asyncio.FIRST_COMPLETED)
    for task in done:
        with contextlib.suppress(LauncherGone):
            task.result()
    for daemon in psutil.Process().children():  # its p2pd
        with contextlib.suppress(psutil.Error):
            daemon.kill()
    sys.stdout.flush()
    os._exit(0)


async def serve_stage(args: argparse.Namespace) -> None:
    """Serve one stage until the launcher is done (exit code 0) or gone (``LAUNCHER_GONE``); a peer that moves
    itself to another stage (``peer_rebalance``) serves that one in the same process."""
    cfg = json.loads(Path(args.config).read_text())
    bound_kernel_cache()
    torch.set_num_threads(1)
    watchdog = asyncio.create_task(exit_with_parent())
    from cramswarm.swarm.peer_sync import SyncingStagePeer  # peers step by themselves; any live entry joins

    node = await join_swarm(args.addr_file, host=listen_host(cfg), timeout_s=cfg["join_timeout_s"], announce=True)
    peer = SyncingStagePeer(cfg, args.stage, args.uid, args.speed, node)
    while True:
        peer.migrate_to = asyncio.get_running_loop().create_future()
        await peer.add_p2p_handlers(node.p2p, namespace=peer.namespace)
        with contextlib.suppress(Exception):  # joining a running swarm: take the stage's state first
            args.load_state = args.load_state or await launcher_phase(node, peer.run_id) == "training"
        if args.load_state:
            await peer.load_from_replica(cfg["give_up_after_s"])
        print(f"[{peer.uid}] serving stage {peer.stage} (speed {args.speed}) as {node.p2p.peer_id}", flush=True)
        declare = asyncio.create_task(peer.declare_forever())
        background = peer.background_tasks()
        launcher = asyncio.create_task(watch_launcher(node, peer.run_id, cfg.get("launcher_grace_s",
                                                                                        LAUNCHER_GRACE_S)))
        done, _ = await asyncio.wait([declare, watchdog, launcher, peer.migrate_to, *background],
                                     return_when=asyncio.FIRST_COMPLETED)
        if peer.migrate_to in done:  # it moves itself (peer_rebalance): (to stage, its move record)
            for task in (declare, launcher, *background):
                task.cancel()
            await asyncio.gather(declare, launcher, *background, return_exceptions=True)
            from cramswarm.swarm.peer_rebalance import move_peer

            peer = await move_peer(peer, *peer.migrate_to.result())
            args.load_state = True
            continue
        break
    if launcher in done and launcher.exception() is not None:
        print(f"[{peer.uid}] {launcher.exception()}; exiting", flush=True)
        code = LAUNCHER_GONE
    else:
        for task in done:
            task.result()  # a failed declaration or watchdog raises here
        print(f"[{peer.uid}] the launcher is done; exiting", flush=True)
        code = 0
    # Leave at once: an all-reduce or compute call in flight would hold up an orderly shutdown for many seconds.
    for daemon in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            daemon.kill()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def rank_of(explicit: int | None) -> int:
    """This task's rank: ``--rank``, else SLURM's ``SLURM_PROCID`` (the task's index in its ``srun`` step)."""
    if explicit is not None:
        return explicit
    if "SLURM_PROCID" not in os.environ:
        raise SystemExit("error: no --rank given and SLURM_PROCID is unset (not a task of an srun job step)")
    return int(os.environ["SLURM_PROCID"])


def finished(rendezvous: Path, run_id: str) -> bool:
    """Whether the launcher of ``run_id`` has finished (it writes its run id to the rendezvous' done file)."""
    with contextlib.suppress(OSError):
        return (rendezvous / DONE_FILE).read_text().strip() == run_id
    return False


def claim_rank(rendezvous: Path, rank: int) -> int:
    """Lock ``rank<R>.lock`` in the rendezvous folder for this task's life (returns the open descriptor; the lock
    goes with the process, however it ends). A second task of the same rank - a leftover task of an earlier run,
    a job launched twice - would join as the same uid and corrupt its stage's averaging (a NaN loss, seen once),
    so it gets ``RankTaken`` naming the holder. On a filesystem without ``flock`` (Lustre without ``-o flock``)
    the check is skipped with a warning."""
    path = rendezvous / f"rank{rank}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 200).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RankTaken(f"rank {rank} is already taken by a running task ({holder}; lock {path})") from None
    except OSError as e:
        print(f"warning: cannot lock {path} ({e}); duplicate ranks go undetected", file=sys.stderr, flush=True)
        return fd
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"host {socket.gethostname()} pid {os.getpid()}\n".encode(), 0)
    return fd


def read_rendezvous(rendezvous: Path, timeout_s: float) -> dict:
    """The launcher's config.json, once its address file is there too (the config is written first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        read_addr_file(rendezvous / ADDR_FILE, max(deadline - time.monotonic(), 0.0))
        try:
            return json.loads((rendezvous / CONFIG_FILE).read_text())
        except (OSError, ValueError):  # cleared or rewritten by a launcher starting right now
            if time.monotonic() > deadline:
                raise BootstrapError(f"no readable {CONFIG_FILE} in the rendezvous folder {rendezvous}") from None
            time.sleep(0.5)


def run_task(rendezvous: str | Path, rank: int | None, max_restarts: int = 100, wait_s: float = 600.0) -> int:
    """One peer of an ``attach``/``srun`` swarm (rank -> stage, speed via the rendezvous folder's config), run as
    a child process group and restarted when it dies or moves; returns the exit code of the task.

    ``wait_s``: how long to wait for the launcher's rendezvous files, and for a swarm to join when the files
    found belong to an earlier run."""
    rendezvous, rank = Path(rendezvous), rank_of(rank)
    child: subprocess.Popen | None = None

    def stop(signum, frame):  # srun / scancel: end the peer's whole group with this task
        if child is not None and child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    deadline = time.monotonic() + wait_s
    try:
        cfg = read_rendezvous(rendezvous, wait_s)
    except BootstrapError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    specs = cfg["placement_specs"]  # [stage, speed] per rank
    if not 0 <= rank < len(specs):
        print(f"error: rank {rank} is outside the swarm's {len(specs)} peers (swarm.stages x swarm.peers_per_stage)",
              file=sys.stderr, flush=True)
        return 2
    try:
        claim_rank(rendezvous, rank)  # held until this task exits
    except RankTaken as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    stage, speed = specs[rank]
    incarnation, served, restarts = 0, False, 0
    while True:
        uid = f"s{stage}r{rank}.{incarnation}"
        args = [sys.executable, "-m", "cramswarm.swarm.hivemind_peer", "stage", "--config",
                str(rendezvous / CONFIG_FILE), "--stage", str(stage), "--uid", uid, "--addr-file",
                str(rendezvous / ADDR_FILE), "--speed", repr(speed)] + (["--load-state"] if served else [])
        env = {**os.environ, "CRAMSWARM_PARENT_PID": str(os.getpid())}
        child = subprocess.Popen(args, env=env, start_new_session=True, stdin=subprocess.DEVNULL)
        code = child.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)  # its p2pd
        if code == 0 or finished(rendezvous, cfg["run_id"]):  # the run is over (this peer may have died last)
            return 0
        if code == LAUNCHER_GONE:
            return code
        if code == 2 and served:  # the swarm's bootstrap is gone: the run is over
            return LAUNCHER_GONE
        if code == 2:  # files of an earlier run, or a launcher still starting: read them again
            if time.monotonic() > deadline:
                return 2
            time.sleep(1.0)
            cfg = read_rendezvous(rendezvous, max(deadline - time.monotonic(), 0.0))
            stage, speed = cfg["placement_specs"][rank]
            continue
        if restarts == max_restarts:
            print(f"[rank {rank}] gave up after {max_restarts} restarts", file=sys.stderr, flush=True)
            return 1
        served, restarts, incarnation = True, restarts + 1, incarnation + 1
        # a peer that moved itself to another stage (peer_rebalance) comes back on the stage it last served
        from cramswarm.swarm.peer_rebalance import MOVES_FILE, stage_after_moves

        _, stage = stage_after_moves(Path(cfg["workdir"]) / MOVES_FILE, uid, stage)
        print(f"[rank {rank}] peer {uid} ended with code {code}; restarting on stage {stage} in "
              f"{cfg['rejoin_after_s']} s", flush=True)
        time.sleep(cfg["rejoin_after_s"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m cramswarm.swarm.hivemind_peer", description=__doc__.split("\n")[0])
    roles = parser.add_subparsers(dest="role", required=True)
    boot = roles.add_parser("bootstrap", help="run the bootstrap DHT node and write its address file")
    boot.add_argument("--addr-file", required=True)
    boot.add_argument("--host", default="127.0.0.1", help="IPv4 address to listen on (0.0.0.0: all interfaces)")
    boot.add_argument("--interface", help="listen on this network interface's IPv4 address (looked up here)")
    boot.add_argument("--run-id", help="leave once this run's launcher says done or its heartbeat is missing")
    boot.add_argument("--grace-s", type=float, default=LAUNCHER_GRACE_S,
                      help="seconds the heartbeat may be missing (with --run-id)")
    stage = roles.add_parser("stage", help="serve one pipeline stage")
    stage.add_argument("--config", required=True)
    stage.add_argument("--stage", type=int, required=True)
    stage.add_argument("--uid", required=True)
    stage.add_argument("--addr-file", required=True)
    stage.add_argument("--speed", type=float, default=1.0)
    stage.add_argument("--load-state", action="store_true")
    task = roles.add_parser("task", help="one peer of a swarm started outside its launcher (rank -> stage)")
    task.add_argument("--rendezvous", required=True, help="the launcher's rendezvous folder (shared filesystem)")
    task.add_argument("--rank", type=int, help="this peer's rank (default: SLURM_PROCID)")
    task.add_argument("--max-restarts", type=int, default=100, help="restarts of a dying peer before giving up")
    task.add_argument("--wait-s", type=float, default=600.0, help="seconds to wait for the launcher's rendezvous")
    args = parser.parse_args(argv)
    if args.role == "task":
        sys.exit(run_task(args.rendezvous, args.rank, args.max_restarts, args.wait_s))
    if args.role == "stage" and not (args.speed > 0 and math.isfinite(args.speed)):
        parser.error(f"--speed must be positive, got {args.speed}")
    try:
        if args.role == "bootstrap":
            asyncio.run(serve_bootstrap(args.addr_file, listen_host({"host": args.host, "interface": args.interface}),
                                        args.run_id, args.grace_s))
        asyncio.run(serve_stage(args))
    except BootstrapError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
