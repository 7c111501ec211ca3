"""The hivemind transport's wire format: named tensors plus msgpack metadata, streamed in chunks.

A message (``ExpertRequest`` / ``ExpertResponse``) stream carries a header (tensor names and metadata, on the first
message) and every tensor cut into ``CHUNK_BYTES`` parts (``pack``; ``unpack`` puts them together). A uint8 tensor
(a state blob) is cut from its own buffer and received into its final storage, so no whole serialised copy of it
exists on either side. ``flatten_payload`` / ``restore_payload`` carry a ``compression.encode`` payload.
"""
from __future__ import annotations

import io
import warnings
from collections.abc import Iterator
from typing import AsyncIterator  # hivemind's servicer recognises typing's alias only

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils.asyncio import as_aiter
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

CHUNK_BYTES = 2**20        # streamed message chunk (well below p2pd's 4 MiB message limit)


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

