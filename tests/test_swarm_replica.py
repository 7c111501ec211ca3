"""replica.StageReplica: the stage compute, gradient sums and step both training transports use."""

import copy
import io

import pytest
import torch
from conftest import ARCH

from cramswarm.swarm import replica as replica_module
from cramswarm.swarm.replica import StageReplica
from cramswarm.swarm.stages import build_swarm_model, split_model

VOCAB = 120
CPU = torch.device("cpu")
RECIPE = {"seed": 0, "weight_decay": 0.01, "lr": 1e-3, "betas": [0.9, 0.98], "eps": 1e-12, "grad_clip_norm": 0.5}


def _stages(num_stages: int = 2) -> list[torch.nn.Module]:
    return split_model(build_swarm_model(ARCH | {"layers": num_stages}, VOCAB, 0, num_stages, "none"), num_stages)


def _replicas(stages) -> list[StageReplica]:
    return [StageReplica(copy.deepcopy(s), RECIPE, "fp32", CPU, last=i == len(stages) - 1)
            for i, s in enumerate(stages)]


def _microbatch(seed: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (rows, 16), generator=g)
    return ids, torch.where(torch.rand(rows, 16, generator=g) < 0.3, ids, torch.full_like(ids, -100))


def _call(reps: list[StageReplica], ids: torch.Tensor, labels: torch.Tensor) -> float:
    """One microbatch through a pipeline of replicas, as a trainer drives it (forward calls, then backward calls
    from the last stage back); the caller counts the samples."""
    inputs = [ids]
    for rep in reps[:-1]:
        inputs.append(rep.forward(inputs[-1]))
    grad, loss = reps[-1].backward(inputs[-1], labels)
    for rep, x in zip(reversed(reps[:-1]), reversed(inputs[:-1])):
        grad, no_loss = rep.backward(x, grad)
        assert no_loss is None
    assert grad is None   # token ids: no input gradient
    for rep in reps:
        rep.local_samples += int(ids.shape[0])
    return loss


@pytest.mark.parametrize("num_stages", [2, 3])
def test_a_replicas_backward_sums_the_sample_weighted_gradients_of_the_whole_pipeline(num_stages):
    """The last stage backpropagates its loss x samples and hands the input gradient back; each stage before
    backpropagates the gradient it gets: each replica's ``.grad`` is the sum over its calls of samples x the mean
    loss's gradient, as one autograd graph over all stages computes it."""
    stages = _stages(num_stages)
    reps, reference = _replicas(stages), copy.deepcopy(stages)
    for seed, rows in ((1, 3), (2, 5)):
        ids, labels = _microbatch(seed, rows)
        loss = _call(reps, ids, labels)
        x = ids
        for stage in reference[:-1]:
            x = stage(x)
        expected = reference[-1](x, labels)
        (expected * rows).backward()
        assert loss == pytest.approx(float(expected.detach()), rel=1e-6)
    for rep, ref in zip(reps, reference):
        assert rep.local_samples == 8 and rep.activation_bytes > 0
        ref_params = [p for p in ref.parameters() if p.requires_grad]
        assert len(rep.params) == len(ref_params)
        for p, r in zip(rep.params, ref_params):
            assert (p.grad is None) == (r.grad is None)
            if p.grad is not None:
                assert torch.allclose(p.grad, r.grad, rtol=1e-5, atol=1e-7)


def test_snapshot_apply_digest_and_state_round_trip():
    """The snapshot moves the sums out of ``.grad`` divided by the samples (once per step); calls after it stay in
    ``.grad`` across ``apply``; replicas applying the same average have the same digest; a state saved and loaded
    (as a download or a shard) or a clone reproduces parameters, optimizer state and step."""
    reps = _replicas(_stages())
    last = reps[1]
    for seed in (1, 2):
        _call(reps, *_microbatch(seed, 4))
    sums = torch.cat([p.grad.reshape(-1).clone() for p in last.params])
    twin = last.clone(speed=0.5)
    assert twin.speed == 0.5 and twin.digest() == last.digest() and all(p.grad is None for p in twin.params)

    flat, samples = last.take_snapshot(0)
    assert samples == 8 and torch.equal(flat, sums / 8)
    assert all(p.grad is None for p in last.params) and last.local_samples == 0
    assert last.take_snapshot(0)[0] is flat   # a reduce retry gets the same vector
    _call(reps, *_microbatch(3, 4))           # arrives while the step averages: toward the next step
    held = [None if p.grad is None else p.grad.clone() for p in last.params]

    before = last.digest()
    twin.apply(flat.clone(), 1e-3)
    last.apply(flat, 1e-3)
    assert last.step == twin.step == 1 and last.snapshot is None
    assert last.digest() == twin.digest() != before
    assert all((p.grad is None and h is None) or torch.equal(p.grad, h) for p, h in zip(last.params, held))
    assert last.local_samples == 4

    buffer = io.BytesIO()
    torch.save(last.state(), buffer)
    assert set(last.state()) == {"module", "optimizer", "step"}
    fresh = _replicas(_stages())[1]
    assert fresh.load_state(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)) == 1
    assert fresh.digest() == last.digest() and fresh.local_samples == 0 and fresh.snapshot is None
    moments = [s["exp_avg"] for s in last.optimizer.state.values()]
    assert all(torch.equal(a, b) for a, b in zip(moments, [s["exp_avg"] for s in fresh.optimizer.state.values()]))
    assert all(a is not b for a, b in zip(moments, [s["exp_avg"] for s in last.clone(1.0).optimizer.state.values()]))


def test_held_gradients_move_out_and_back_as_one_flat_vector():
    reps = _replicas(_stages())
    _call(reps, *_microbatch(1, 3))
    last = reps[1]
    grads = [None if p.grad is None else p.grad.clone() for p in last.params]
    flat, samples = last.take_grads()
    assert samples == 3 and flat.numel() == last.num_params and flat.dtype == torch.float32
    assert last.local_samples == 0 and all(p.grad is None for p in last.params)
    last.add_grads(flat, samples)
    last.add_grads(flat, samples)
    assert last.local_samples == 6
    for p, g in zip(last.params, grads):
        assert torch.equal(p.grad, 2 * g if g is not None else torch.zeros_like(p))


def test_speed_emulation_without_a_floor_scales_the_measured_compute(monkeypatch):
    """The emulation's rule (no ``unit_time_s``): a peer of speed s < 1 sleeps compute x (1/s - 1), one of speed
    >= 1 not at all; with the floor each call counts at least units x ``unit_time_s``."""
    slept: list[float] = []
    monkeypatch.setattr(replica_module.time, "sleep", slept.append)
    rep = _replicas(_stages())[0]
    for speed, floor, seconds, units, expected in [(0.5, None, 0.02, 2.0, 0.02), (0.25, None, 0.01, 1.0, 0.03),
                                                   (1.0, None, 0.01, 3.0, 0.0), (2.0, None, 0.01, 1.0, 0.0),
                                                   (0.5, 0.05, 0.01, 2.0, 0.19)]:
        rep.speed, rep.unit_time_s = speed, floor
        slept.clear()
        rep.emulate_speed(seconds, units)
        assert slept == [pytest.approx(expected)], (speed, floor, seconds, units)
