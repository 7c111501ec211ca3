"""In-stage averaging of the hivemind transport (``cramswarm.swarm.averaging``): the compressed all-reduce on
real hivemind P2P daemons in this process, its traffic count, the 8-bit codec and the timeouts."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

pytest.importorskip("hivemind", reason="hivemind is not installed: the in-stage all-reduce is untested")

from hivemind.averaging.allreduce import AllReduceRunner  # noqa: E402
from hivemind.compression import CompressionInfo  # noqa: E402
from hivemind.p2p import P2P  # noqa: E402

from cramswarm.swarm import averaging  # noqa: E402
from cramswarm.swarm.averaging import StageAllReduce  # noqa: E402

PARAMS = 300_000  # fp32/fp16: several 512 KiB parts per reducer; 8-bit: one part per reducer


async def _p2ps(n: int) -> list[P2P]:
    first = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    maddrs = await first.get_visible_maddrs()
    return [first] + [await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=maddrs)
                      for _ in range(n - 1)]


async def _all_reduce(runner_cls, tensors: list[torch.Tensor], weights: list[float], scheme: str):
    """Every peer's output (the average, or for hivemind's own runner local + delta) and its runner."""
    p2ps = await _p2ps(len(tensors))
    try:
        peers = [p.peer_id for p in p2ps]
        group_id = os.urandom(16)
        runners = []
        for p2p, tensor, weight in zip(p2ps, tensors, weights):
            runner = runner_cls(p2p=p2p, servicer_type=runner_cls, prefix=None, group_id=group_id,
                                tensors=[tensor.clone()], weight=weight, ordered_peer_ids=peers,
                                peer_fractions=tuple(1.0 / len(peers) for _ in peers),
                                compression=averaging.codec(scheme), sender_timeout=10.0, reducer_timeout=20.0)
            await runner.add_p2p_handlers(p2p)
            runners.append(runner)

        async def run(runner, tensor):
            if isinstance(runner, StageAllReduce):
                return await averaging.average(runner)
            return tensor + [delta async for delta in runner][0]

        outputs = await asyncio.wait_for(asyncio.gather(*(run(r, t) for r, t in zip(runners, tensors))), 60)
        return outputs, runners
    finally:
        for p2p in p2ps:
            await p2p.shutdown()


def _gradients(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-4, 0, PARAMS)  # a flat gradient's layers differ in scale
    return [torch.randn(PARAMS, generator=g) * scales for _ in range(n)]


@pytest.mark.parametrize("scheme", averaging.SCHEMES)
def test_every_replica_gets_the_same_compressed_weighted_average(scheme):
    tensors, weights = _gradients(3), [4.0, 8.0, 12.0]
    outputs, runners = asyncio.run(_all_reduce(StageAllReduce, tensors, weights, scheme))
    exact = sum(w * t for w, t in zip(weights, tensors)) / sum(weights)
    # bit for bit the same values on every replica, the reducers' own shares included
    assert all(torch.equal(outputs[0], out) for out in outputs[1:])
    error = float((outputs[0] - exact).norm() / exact.norm())
    assert error <= {"none": 1e-6, "fp16": 1e-3, "8bit": 0.02}[scheme], error
    # a peer sends the others' shares of its vector and its own share back to each of them: 2 (n - 1) / n of the
    # values on average (whole 512 KiB parts go to each reducer, so the shares are uneven), at the codec's width
    # plus the per-part overhead
    assert sum(r.values_sent for r in runners) == 2 * (3 - 1) * PARAMS
    assert sum(r.bytes_sent for r in runners) == pytest.approx(3 * averaging.allreduce_bytes(PARAMS, 3, scheme),
                                                               rel=0.01)


def test_hivemind_runner_alone_leaves_compressed_replicas_different():
    """Why ``StageAllReduce`` exists: with fp16, hivemind's runner gives each replica its own vector."""
    tensors = _gradients(2, seed=1)
    outputs, _ = asyncio.run(_all_reduce(AllReduceRunner, tensors, [1.0, 1.0], "fp16"))
    assert not torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize(("scheme", "bound"), [("none", 4.0), ("fp16", 2.0), ("8bit", 1.001)])
def test_traffic_per_parameter_in_a_pair_is_the_codec_width(scheme, bound):
    """Two replicas: each sends one value per parameter (half as a sender, half back as a reducer). The bound
    is the codec's bytes per value (8-bit: 1 + 4 / 4,096, the blocks' maxima) plus 1 % (protobuf fields)."""
    outputs, runners = asyncio.run(_all_reduce(StageAllReduce, _gradients(2, seed=2), [1.0, 3.0], scheme))
    assert torch.equal(outputs[0], outputs[1])
    for runner in runners:
        assert runner.values_sent == PARAMS
        per_param = runner.bytes_sent / PARAMS
        assert bound * 0.999 <= per_param <= bound * 1.01, per_param


def test_blockwise8bit_codec_roundtrip_and_degenerate_parts():
    codec = averaging.codec("8bit")
    x = torch.randn(10_000) * torch.logspace(-3, 0, 10_000)
    serialized = codec.compress(x, CompressionInfo.from_tensor(x))
    assert len(serialized.buffer) == 10_000 + 4 * 3  # a code per value, an fp32 maximum per 4,096-value block
    decoded = averaging.deserialize(serialized)
    assert decoded.shape == x.shape and decoded.dtype == x.dtype
    # each block's error is at most half a code step of its own maximum
    for block, out in zip(x.split(4096), decoded.split(4096)):
        assert float((out - block).abs().max()) <= float(block.abs().max()) / 127 / 2 * 1.0001
    for t in (torch.tensor([2.5]), torch.zeros(7), torch.full((4097,), -1.0)):  # decoded exactly
        assert torch.equal(averaging.deserialize(codec.compress(t, CompressionInfo.from_tensor(t))), t)


def test_timeouts_grow_with_the_stage_and_the_group_and_shrink_with_the_link():
    floor = 8.0
    small = averaging.averaging_timeout_s(10**6, 2, "fp16", 100.0, floor)
    assert small == pytest.approx(floor + averaging.TIMEOUT_SLACK * 2e6 * 8 / 100e6, rel=1e-3)
    assert averaging.averaging_timeout_s(10**9, 2, "fp16", 100.0, floor) > 100 * (small - floor)
    assert averaging.averaging_timeout_s(10**6, 8, "fp16", 100.0, floor) > small
    assert averaging.averaging_timeout_s(10**6, 2, "8bit", 100.0, floor) < small
    assert averaging.averaging_timeout_s(10**6, 2, "fp16", 1000.0, floor) < small
    assert averaging.averaging_timeout_s(10**6, 1, "fp16", 100.0, floor) == floor  # alone: nothing to send
    # a 1 B-parameter stage on 200 Mbit/s: the fp16 all-reduce of a pair is 2 GB, 80 s on the wire; a state
    # download 12 GB, 480 s (the fixed 60 s / 30 s bounds these replace could not hold either)
    assert averaging.averaging_timeout_s(10**9, 2, "fp16", 200.0, 0.0) > 80.0 * averaging.TIMEOUT_SLACK * 0.99
    assert averaging.state_timeout_s(10**9, 200.0, 0.0) == pytest.approx(480.0 * averaging.TIMEOUT_SLACK)
    with pytest.raises(ValueError, match="link speed"):
        averaging.state_timeout_s(10, 0.0, 1.0)
