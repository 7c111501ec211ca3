"""The hivemind transport's wire format (``swarm.wire``): tensors cut into streamed chunks and put together again,
a state blob without a whole copy of it on either side."""

import asyncio
import io

import pytest
import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils.asyncio import as_aiter
from hivemind.utils.streaming import split_for_streaming

from cramswarm.swarm.wire import CHUNK_BYTES, BufferReader, blob_tensor, pack, respond, unpack


def _hivemind_chunks(tensor: torch.Tensor) -> list:
    return list(split_for_streaming(serialize_torch_tensor(tensor), CHUNK_BYTES))


@pytest.mark.parametrize("size", [0, 5, CHUNK_BYTES, 2 * CHUNK_BYTES + 17])
def test_a_blob_streams_as_the_same_messages_hivemind_would_make_and_comes_back_equal(size):
    g = torch.Generator().manual_seed(size)
    data = torch.randint(0, 256, (size,), generator=g, dtype=torch.uint8).numpy().tobytes()
    blob = blob_tensor(data)
    activations = torch.randn(3, 5)
    messages = list(pack(runtime_pb2.ExpertResponse, {"blob": blob, "x": activations}, {"step": 4}))
    parts = [part for message in messages for part in message.tensors]
    assert parts == _hivemind_chunks(blob) + _hivemind_chunks(activations)
    assert messages[0].metadata and not any(m.metadata for m in messages[1:])
    tensors, meta = asyncio.run(unpack(as_aiter(*messages)))
    assert meta == {"step": 4} and list(tensors) == ["blob", "x"]
    assert tensors["blob"].dtype == torch.uint8 and tensors["blob"].numpy().tobytes() == data
    assert torch.equal(tensors["x"], activations)


def test_a_reply_without_tensors_and_a_cut_stream():
    (message,) = list(respond({}, {"status": "ok"}))
    assert asyncio.run(unpack(as_aiter(message))) == ({}, {"status": "ok"})
    messages = list(respond({"blob": blob_tensor(bytes(3 * CHUNK_BYTES))}, {}))
    with pytest.raises(ConnectionError, match="0 of 1 tensors"):
        asyncio.run(unpack(as_aiter(*messages[:-1])))


def test_a_state_loads_from_its_tensor_through_the_buffer_reader():
    layer = torch.nn.Linear(4, 3)
    buffer = io.BytesIO()
    torch.save({"module": layer.state_dict(), "step": 7}, buffer)
    state = torch.load(BufferReader(blob_tensor(buffer.getvalue()).numpy()), weights_only=True)
    assert state["step"] == 7 and torch.equal(state["module"]["weight"], layer.weight)
