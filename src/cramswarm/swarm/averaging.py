"""In-stage averaging of the hivemind transport: compressed butterfly all-reduce, traffic counts, timeouts.

The replicas of one stage average their gradients with hivemind's ``AllReduceRunner`` (butterfly all-reduce:
the flat gradient vector is cut into parts, peer i reduces the i-th share and sends it back to every other
peer). ``SCHEMES`` name the compression of the parts on the wire (``swarm.averaging_compression``):

* ``none`` - fp32 as is (4 bytes per value);
* ``fp16`` - hivemind's ``Float16Compression`` (2 bytes per value);
* ``8bit`` - ``Blockwise8Bit``: blockwise absmax 8-bit (the ``compression`` module's ``blockwise8``, 1 byte per
  value plus one fp32 maximum per 4,096 values) as a hivemind codec. Its per-block scales follow the layers of a
  512 KiB part that spans layers of different gradient scales, where one range per part would clip (hivemind's
  ``Uniform8BitQuantization``; its ``BlockwiseQuantization`` needs bitsandbytes, not a dependency here).

Replicas must take the same step, so they must all apply the same averaged values. hivemind's runner does not
give them that: a reducer keeps its own share of the average uncompressed and sends the others a compressed
*difference* between the average and what it received from them, which each adds to its own uncompressed
gradient - with compression on, every replica ends with a slightly different vector. ``StageAllReduce``
changes that one thing: the reducer compresses its averaged part once and sends those same bytes to every
sender, and decompresses them for itself too; every replica therefore holds the decompressed average,
bit for bit. A reducer that fails leaves a part unaveraged on the peers that depended on it, so that
all-reduce counts as failed (``failed_parts``) and is redone, rather than let the replicas differ.

``StageAllReduce`` also counts what this peer puts on the wire: the serialized tensor parts it sends as a
sender and as a reducer (``bytes_sent``: protobuf ``Tensor`` messages, i.e. payload + size/dtype fields; the
``AveragingData`` envelope and the p2p framing are not counted) and the values they hold (``values_sent``).
In a group of n replicas a peer sends 2 (n - 1) / n of the stage's values per all-reduce: for n = 2, one value
per parameter, so ``bytes_sent / parameters`` is the codec's width plus the per-part overhead.

Timeouts grow with the stage: ``averaging_timeout_s`` and ``state_timeout_s`` give the time to move the
all-reduce's or a state download's bytes over a link of ``link_mbit_s``, with a slack factor, on top of a
fixed floor (latency, start-up, queueing on the compute thread).
"""

from __future__ import annotations

import asyncio
import math
from typing import AsyncIterator

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES, AllreduceException, BannedException
from hivemind.compression import (
    CompressionBase,
    CompressionInfo,
    Float16Compression,
    NoCompression,
)
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import aiter_with_timeout, amap_in_executor, attach_event_on_finished

from cramswarm.swarm.compression import decode, encode
from cramswarm.swarm.settings import AVERAGING_SCHEMES
from cramswarm.swarm.wire import CHUNK_BYTES

SCHEMES = AVERAGING_SCHEMES
BYTES_PER_VALUE = {"none": 4.0, "fp16": 2.0, "8bit": 1.0 + 4.0 / 4096}  # 8bit: code + its block's fp32 maximum
PART_OVERHEAD_BYTES = {"none": 0, "fp16": 0, "8bit": 4}  # 8bit: a part's last, partial block has a maximum too
STATE_BYTES_PER_PARAM = 12.0  # a state download: fp32 weights and AdamW's two fp32 moments
TIMEOUT_SLACK = 4.0           # a timeout allows this many times the transfer time at the configured link speed


class Blockwise8Bit(CompressionBase):
    """8-bit blockwise absmax code (``compression.encode(..., "blockwise8")``: blocks of ``BLOCK`` values, each
    scaled by its absolute maximum to a linear code -127..127; one fp32 absmax per block) as a hivemind codec.
    Its wire type is hivemind's ``BLOCKWISE_8BIT`` (the protobuf enum has no free value), but not hivemind's
    layout (bitsandbytes' dynamic code): only ``deserialize`` here decodes it, which ``StageAllReduce`` uses on
    every part it receives. Buffer: the block maxima (fp32), then the codes (uint8, offset 128)."""

    compression_type = runtime_pb2.BLOCKWISE_8BIT
    BLOCK = 4096

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        payload = encode(tensor.detach().cpu(), "blockwise8", block_size=self.BLOCK)
        return runtime_pb2.Tensor(compression=self.compression_type, size=tensor.shape,
                                  dtype=str(tensor.dtype).replace("torch.", ""),
                                  buffer=payload["absmax"].numpy().tobytes() + payload["codes"].numpy().tobytes())

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        shape = tuple(serialized_tensor.size)
        numel = math.prod(shape)
        blocks = math.ceil(numel / self.BLOCK)
        raw = bytearray(serialized_tensor.buffer)
        absmax = torch.frombuffer(raw, dtype=torch.float32, count=blocks) if blocks else torch.zeros(0)
        codes = torch.frombuffer(raw, dtype=torch.uint8, offset=4 * blocks) if numel else torch.zeros(0, torch.uint8)
        return decode({"scheme": "blockwise8", "shape": shape, "dtype": f"torch.{serialized_tensor.dtype}",
                       "codes": codes, "absmax": absmax, "block_size": self.BLOCK})

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return (1.0 + 4.0 / self.BLOCK) / info.descriptor.dtype.itemsize


_CODECS: dict[str, CompressionBase] = {"none": NoCompression(), "fp16": Float16Compression(), "8bit": Blockwise8Bit()}
_BY_TYPE = {codec.compression_type: codec for codec in _CODECS.values()}


def codec(scheme: str) -> CompressionBase:
    if scheme not in _CODECS:
        raise ValueError(f"unknown averaging compression {scheme!r}; allowed: {', '.join(SCHEMES)}")
    return _CODECS[scheme]


def deserialize(serialized: runtime_pb2.Tensor) -> torch.Tensor:
    """A tensor part from the wire (by its compression type; only the codecs of ``SCHEMES``)."""
    if serialized.compression not in _BY_TYPE:
        raise AllreduceException(f"unexpected compression {runtime_pb2.CompressionType.Name(serialized.compression)}")
    return _BY_TYPE[serialized.compression].extract(serialized)


# --------------------------------------------------------------------------------------------------------------
# Timeouts
# --------------------------------------------------------------------------------------------------------------
def transfer_s(nbytes: float, link_mbit_s: float) -> float:
    """Seconds to move ``nbytes`` over a link of ``link_mbit_s`` megabits per second."""
    if not link_mbit_s > 0:
        raise ValueError(f"link speed must be positive, got {link_mbit_s} Mbit/s")
    return nbytes * 8.0 / (link_mbit_s * 1e6)


def allreduce_bytes(params: int, group_size: int, scheme: str) -> float:
    """Bytes one peer sends in a butterfly all-reduce of ``params`` values in a group of ``group_size``: its
    parts to the n - 1 other reducers, and its reduced share back to the n - 1 other peers."""
    if group_size < 2:
        return 0.0
    values = 2.0 * (group_size - 1) / group_size * params
    parts = 2 * (group_size - 1) * max(1, math.ceil(params * BYTES_PER_VALUE[scheme] / group_size
                                                    / DEFAULT_PART_SIZE_BYTES))
    return values * BYTES_PER_VALUE[scheme] + parts * PART_OVERHEAD_BYTES[scheme]


def averaging_timeout_s(params: int, group_size: int, scheme: str, link_mbit_s: float, floor_s: float) -> float:
    """How long one in-stage all-reduce may take: ``floor_s`` plus ``TIMEOUT_SLACK`` times its transfer time."""
    return floor_s + TIMEOUT_SLACK * transfer_s(allreduce_bytes(params, group_size, scheme), link_mbit_s)


def state_timeout_s(params: int, link_mbit_s: float, floor_s: float) -> float:
    """How long a state download (weights + AdamW moments) of a stage of ``params`` parameters may take."""
    return floor_s + TIMEOUT_SLACK * transfer_s(STATE_BYTES_PER_PARAM * params, link_mbit_s)


def state_chunk_timeout_s(link_mbit_s: float, floor_s: float) -> float:
    """How long a state download waits for its next chunk (``wire.CHUNK_BYTES``), as hivemind's
    ``load_state_from_peers`` bounds each part rather than the whole."""
    return floor_s + TIMEOUT_SLACK * transfer_s(CHUNK_BYTES, link_mbit_s)


def chunk_timeout_s(scheme: str, link_mbit_s: float, floor_s: float) -> float:
    """The runner's per-part timeout (the wait between two parts of one stream): one part's transfer time."""
    return floor_s + TIMEOUT_SLACK * transfer_s(DEFAULT_PART_SIZE_BYTES + PART_OVERHEAD_BYTES[scheme], link_mbit_s)


# --------------------------------------------------------------------------------------------------------------
# The all-reduce
# --------------------------------------------------------------------------------------------------------------
class StageAllReduce(AllReduceRunner):
    """hivemind's ``AllReduceRunner``, except that it yields the averaged tensors themselves (not differences),
    the same decompressed values on every peer (module docstring), and counts the bytes this peer sends.

    Overrides three methods of hivemind 1.1.12's runner; their protocol (message codes, part order, bans,
    timeouts) is unchanged, so it talks to the other peers exactly as the original does.
    """

    def __init__(self, *, compression: CompressionBase, **kwargs):
        super().__init__(compression=compression, **kwargs)
        self.compression = compression
        self.tensor_part_container.return_deltas = False  # a failed reducer's parts stay the local values
        self.bytes_sent = 0
        self.values_sent = 0
        self._averaged: dict[int, asyncio.Future] = {}  # part index -> its compressed average (this reducer's)

    @property
    def failed_parts(self) -> int:
        """Values that some reducer failed to average (then this peer holds its own values there)."""
        return self.tensor_part_container.failed_size

    def _count(self, part: runtime_pb2.Tensor) -> None:
        self.bytes_sent += part.ByteSize()
        self.values_sent += math.prod(part.size)

    async def _compressed_average(self, part_index: int, averaged: torch.Tensor) -> runtime_pb2.Tensor:
        """The averaged part, compressed once; every sender gets the same bytes."""
        if part_index not in self._averaged:
            info = CompressionInfo.from_tensor(averaged, key=part_index)
            self._averaged[part_index] = asyncio.get_running_loop().run_in_executor(
                None, self.compression.compress, averaged, info)
        return await self._averaged[part_index]

    async def _communicate_with_peer(self, peer_id: PeerID):
        peer_index = self.ordered_peer_ids.index(peer_id)
        if peer_id == self.peer_id:
            sender_index = self.sender_peer_ids.index(peer_id)
            for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
                averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, tensor_part,
                                                                          weight=self.weight)
                # the owner takes the decompressed average too, as every other peer does
                shared = deserialize(await self._compressed_average(part_index, averaged))
                self.tensor_part_container.register_processed_part(peer_index, part_index, shared)
            return
        try:
            done_sending = asyncio.Event()
            inputs = attach_event_on_finished(self._generate_input_for_peer(peer_index), done_sending)
            stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs)
            if self.should_delay_results(self.peer_id):
                await done_sending.wait()

            def _extract(msg):
                if msg.code != averaging_pb2.AVERAGED_PART:
                    raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(msg.code)}")
                return deserialize(msg.tensor_part)

            part_index = 0
            async for averaged in amap_in_executor(_extract, aiter_with_timeout(stream, self.reducer_timeout),
                                                   max_prefetch=self.tensor_part_container.prefetch):
                self.tensor_part_container.register_processed_part(peer_index, part_index, averaged)
                part_index += 1
            if part_index != self.tensor_part_container.num_parts_by_peer[peer_index]:
                raise AllreduceException(f"peer {peer_id} sent {part_index} parts, but we expected "
                                         f"{self.tensor_part_container.num_parts_by_peer[peer_index]}")
        except BaseException:
            self.tensor_part_container.register_failed_reducer(peer_index)
            raise

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in super()._generate_input_for_peer(peer_index):
            self._count(message.tensor_part)
            yield message

    async def _accumulate_parts_streaming(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                                          sender_index: int):
        part_index = 0
        try:
            async for tensor_part, weight in amap_in_executor(
                lambda msg: (deserialize(msg.tensor_part), msg.weight), stream,
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                try:
                    averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, tensor_part,
                                                                              weight=weight)
                except BannedException:
                    break  # this sender was banned meanwhile: it gets no more parts
                serialized = await self._compressed_average(part_index, averaged)
                part_index += 1
                self._count(serialized)
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])


async def average(runner: StageAllReduce) -> torch.Tensor:
    """Run ``runner`` on its one flat tensor; the average, or ``AllreduceException`` if a part went unaveraged."""
    outputs = [tensor async for tensor in runner]
    if runner.failed_parts:
        raise AllreduceException(f"{runner.failed_parts} values were not averaged (a reducer failed): the "
                                 "replicas would differ")
    (flat,) = outputs
    return flat
