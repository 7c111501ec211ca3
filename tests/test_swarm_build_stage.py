"""stages.build_stage: a stage peer materialises only its stage, with the whole model's initial values."""

import pytest
import torch
from conftest import ARCH
from torch.profiler import ProfilerActivity, profile

from cramswarm.swarm.stages import (
    STATE_BYTES_PER_PARAMETER,
    SavedActivations,
    build_stage,
    build_swarm_model,
    check_memory_cap,
    split_model,
    stage_memory,
    stage_state_bytes,
)

VOCAB = 120


def _equal(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    """Names where the two modules' state differs (keys, values bitwise, or trainability)."""
    sa, sb = a.state_dict(), b.state_dict()
    if sa.keys() != sb.keys():
        return sorted(sa.keys() ^ sb.keys())
    bad = [k for k in sa if sa[k].dtype != sb[k].dtype or not torch.equal(sa[k], sb[k])]
    trainable = {n for n, p in a.named_parameters() if p.requires_grad}
    return bad + ([] if trainable == {n for n, p in b.named_parameters() if p.requires_grad} else ["requires_grad"])


@pytest.mark.parametrize("stages,compression", [(1, "none"), (2, "none"), (4, "none"), (2, "bottleneck2"),
                                                (4, "bottleneck2"), (4, "maxout2")])
def test_build_stage_equals_split_model(stages, compression):
    arch = ARCH | {"layers": 4}
    whole = split_model(build_swarm_model(arch, VOCAB, 7, stages, compression), stages)
    after_whole = torch.get_rng_state()
    for index in range(stages):
        torch.manual_seed(123)   # build_stage seeds the RNG itself, whatever state it finds
        stage = build_stage(arch, VOCAB, 7, index, stages, compression)
        assert _equal(whole[index], stage) == [], (stages, compression, index)
        assert torch.equal(torch.get_rng_state(), after_whole)   # the RNG left where the whole build leaves it
        assert not any(t.is_meta for t in (*stage.parameters(), *stage.buffers()))
        if stages == 1:   # one stage is the whole model: the decoder stays tied to the embeddings
            assert stage.head.decoder.weight is stage.embeddings.word_embeddings.weight
        elif stage.is_last:   # several: the last stage's own decoder copy, equal to the initial embeddings
            assert torch.equal(stage.head.decoder.weight, whole[0].embeddings.word_embeddings.weight)


def test_build_stage_other_architecture_switches():
    arch = ARCH | {"layers": 2, "pos_embedding": "learned", "head_transform": True, "decoder_bias": True,
                   "qkv_bias": True, "use_bias": True, "norm_scheme": "post", "ffn": "gelu", "final_norm": False}
    whole = split_model(build_swarm_model(arch, VOCAB, 3, 2, "none"), 2)
    for index in range(2):
        assert _equal(whole[index], build_stage(arch, VOCAB, 3, index, 2)) == []


def test_build_stage_rejects_bad_stage_and_compression():
    with pytest.raises(ValueError, match="stage 2 does not exist"):
        build_stage(ARCH | {"layers": 2}, VOCAB, 0, 2, 2)
    with pytest.raises(ValueError, match="swarm.compression=bottleneck2"):
        build_stage(ARCH | {"layers": 2}, VOCAB, 0, 0, 1, "bottleneck2")


def _peak_cpu_bytes(fn):
    """(peak bytes of CPU memory torch allocated while ``fn`` ran, fn's result), from the profiler's allocation
    and free events in time order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
    current = peak = 0
    for event in events:
        current += event.self_cpu_memory_usage
        peak = max(peak, current)
    return peak, out


def test_build_stage_allocates_only_its_stage_and_one_module():
    arch = ARCH | {"layers": 8, "hidden_size": 64, "intermediate_size": 256}
    vocab = 1000
    whole_peak, model = _peak_cpu_bytes(lambda: build_swarm_model(arch, vocab, 0, 4, "none"))
    whole_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert whole_peak >= whole_bytes   # the measure sees the whole model's allocation
    embedding_bytes = vocab * arch["hidden_size"] * 4   # the largest single module (fp32)
    for index in range(4):
        peak, stage = _peak_cpu_bytes(lambda i=index: build_stage(arch, vocab, 0, i, 4))
        own = sum(t.numel() * t.element_size() for t in (*stage.parameters(), *stage.buffers()))
        slack = 64 * 1024   # the sinusoid table's temporaries and small scratch
        if stage.is_last:
            # its decoder copy comes from a rewound RNG, not a stash of the embeddings: nothing beyond its own
            # (the embeddings' transient draw happens before the decoder exists and is no larger)
            assert peak <= own + slack, (index, peak, own)
        else:   # its own, plus at most one other module at a time (the largest: embeddings / decoder)
            assert peak <= own + embedding_bytes + slack, (index, peak, own)
        if 0 < index < 3:
            assert peak < 0.4 * whole_peak, (peak, whole_peak)


def test_stage_memory_counts_each_stages_own_parameters_and_optimizer_state():
    arch = ARCH | {"layers": 4}
    whole = build_swarm_model(arch, VOCAB, 0, 4, "none")
    whole_count = sum(p.numel() for p in whole.parameters())   # the decoder tied: counted once
    counts = []
    for index in range(4):
        stage = build_stage(arch, VOCAB, 0, index, 4)
        optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-3)
        before = stage_memory(stage, optimizer)
        own = sum(p.numel() for p in stage.parameters())
        assert before["stage_parameter_count"] == own and before["parameter_bytes"] == 4 * own
        assert before["optimizer_bytes"] == 0   # AdamW allocates its moments at the first step
        x = torch.randint(1, VOCAB, (2, 8)) if stage.is_first else torch.randn(2, 8, arch["hidden_size"])
        labels = torch.randint(1, VOCAB, (2, 8))
        out = stage(x, labels) if stage.is_last else stage(x)
        (out if stage.is_last else out.square().mean()).backward()
        optimizer.step()
        after = stage_memory(stage, optimizer)
        # two fp32 moments per parameter, plus one step counter per parameter tensor
        assert 2 * after["parameter_bytes"] <= after["optimizer_bytes"] <= 2 * after["parameter_bytes"] + 4 * 64
        assert after["peak_rss_bytes"] > after["parameter_bytes"] + after["optimizer_bytes"]
        counts.append(own)
    # the stages partition the model, the last one holding its own copy of the (tied) decoder weight
    assert sum(counts) == whole_count + VOCAB * arch["hidden_size"]
    assert counts[1] == counts[2] < counts[0] and counts[1] < counts[3]


def test_memory_cap_refuses_a_stage_over_it_before_allocating():
    arch = ARCH | {"layers": 4}
    state = stage_state_bytes(arch, VOCAB, 4)
    for index, stage_bytes in enumerate(state):
        stage = build_stage(arch, VOCAB, 0, index, 4, memory_cap_mb=stage_bytes / 2**20)   # exactly at the cap
        assert stage_bytes == STATE_BYTES_PER_PARAMETER * sum(p.numel() for p in stage.parameters())
        with pytest.raises(ValueError, match=rf"swarm.peer_memory_cap_mb=.*stage {index} of 4"):
            build_stage(arch, VOCAB, 0, index, 4, memory_cap_mb=0.99 * stage_bytes / 2**20)
    peak, _ = _peak_cpu_bytes(lambda: pytest.raises(ValueError, build_stage, arch, VOCAB, 0, 1, 4,
                                                    memory_cap_mb=1e-6))
    assert peak < 64 * 1024   # refused on the meta layout: no parameter was allocated
    check_memory_cap(state, max(state) / 2**20)
    with pytest.raises(ValueError, match="swarm.peer_memory_cap_mb"):
        check_memory_cap(state, min(state) / 2**20)


def test_hivemind_run_refuses_a_cap_below_a_stage_at_its_start():
    pytest.importorskip("hivemind", reason="hivemind is not installed")
    from cramswarm.swarm import hivemind_transport as ht

    arch = ARCH | {"layers": 2}
    plan = ht.SwarmPlan(arch=arch, vocab_size=VOCAB, recipe={}, peers_per_stage=[1, 1],
                        peer_memory_cap_mb=min(stage_state_bytes(arch, VOCAB, 2)) / 2 / 2**20)
    with pytest.raises(ValueError, match="swarm.peer_memory_cap_mb"):
        ht.run_swarm(plan, iter([]), 1, progress=False)


def test_last_stage_decodes_only_the_masked_positions():
    """The last stage's decoder (and so its logits, microbatch x positions x vocabulary) sees the masked rows only:
    its input has as many rows as labels that are not -100, and the loss is the whole model's."""
    arch = ARCH | {"layers": 2}
    model = build_swarm_model(arch, VOCAB, 0, 1, "none")
    last = build_stage(arch, VOCAB, 0, 1, 2)
    hidden = split_model(model, 2)[0](torch.randint(5, VOCAB, (3, 16)))
    rows = []
    last.head.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[0]))
    labels = torch.full((3, 16), -100)
    labels[0, :4], labels[2, 7] = torch.randint(5, VOCAB, (4,)), 9
    last(hidden.detach(), labels)
    assert rows == [5]


def test_saved_activations_counts_what_backward_holds_but_not_the_parameters():
    layer = torch.nn.Linear(64, 32)
    x = torch.randn(10, 64, requires_grad=True)
    with SavedActivations(list(layer.parameters())) as saved:
        out = torch.relu(layer(x))
    # the linear layer saves its input (10 x 64) and its weight (excluded); relu saves its output (10 x 32)
    assert saved.bytes == 4 * (10 * 64 + 10 * 32)
    out.sum().backward()   # the tensors pass through unchanged
    assert torch.allclose(x.grad, (out > 0).float() @ layer.weight)
    with SavedActivations() as everything:
        torch.relu(layer(x))
    assert everything.bytes == saved.bytes + 4 * 64 * 32


def test_last_stage_with_static_sparse_prediction_decodes_the_models_fixed_count():
    """``sparse_prediction: static``: the last stage decodes round(rate x positions) rows, as the whole model does,
    so its loss is the model's even where more positions are masked than fit (the boolean gather would take all)."""
    arch = ARCH | {"layers": 2, "sparse_prediction": "static", "sparse_prediction_rate": 0.25}
    model = build_swarm_model(arch, VOCAB, 0, 1, "none")
    first, last = split_model(model, 2)
    ids = torch.randint(5, VOCAB, (2, 16))
    labels = torch.full((2, 16), -100)
    labels[:, :12] = torch.randint(5, VOCAB, (2, 12))   # 24 masked of 32 positions, 8 decoded
    rows = []
    last.head.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[0]))
    with torch.no_grad():
        loss = last(first(ids), labels)
        expected = model(ids, labels=labels).loss
    assert rows == [8]
    assert torch.allclose(loss, expected, rtol=1e-6, atol=1e-7), (loss, expected)


def _peer(stage: int, stages: int = 2):
    from swarm_helpers import plan, process_config

    from cramswarm.swarm.hivemind_peer import StagePeer

    recipe = {"device": "cpu", "precision": "fp32", "seed": 0, "weight_decay": 0.01, "lr": 1e-3,
              "betas": [0.9, 0.98], "eps": 1e-12, "grad_clip_norm": 0.5}
    swarm = plan(arch=ARCH | {"layers": 2}, vocab_size=VOCAB, recipe=recipe, peers_per_stage=[1] * stages,
                 compression="none", averaging_compression="none")
    return StagePeer(process_config(swarm, link_mbit_s=None, sync_timeout_s=5.0), stage, "u", 1.0, node=None)


def test_a_peers_gradient_snapshot_is_one_vector_divided_in_place_and_dropped_at_the_step():
    """The in-stage step holds one flat copy of the gradients: the snapshot, divided by the samples in place, is
    what the all-reduce reads (a retry gets the same vector) and, in a group of one, the average the step applies;
    the step drops it."""
    from cramswarm.swarm.compression import encode
    from cramswarm.swarm.wire import flatten_payload

    peer = _peer(1)
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        tensors, meta = {"labels": torch.randint(5, VOCAB, (3, 8), generator=g)}, {}
        flatten_payload("x", encode(torch.randn(3, 8, ARCH["hidden_size"], generator=g), "none"), tensors, meta)
        peer._backward(tensors, meta)
    sums = torch.cat([p.grad.reshape(-1).clone() for p in peer.replica.params])
    flat, samples = peer.replica.take_snapshot(0)
    assert samples == 6 and torch.equal(flat, sums / 6)
    assert all(p.grad is None for p in peer.replica.params) and peer.replica.local_samples == 0
    again, _ = peer.replica.take_snapshot(0)   # a reduce retry
    assert again is flat
    before = [p.detach().clone() for p in peer.replica.params]
    peer.averaged = (b"group", flat)
    assert peer._apply(b"group", 1e-3)["status"] == "ok"
    assert peer.replica.snapshot is None and peer.averaged is None
    assert any(not torch.equal(a, p) for a, p in zip(before, peer.replica.params))


def test_a_stage_peer_bounds_the_onednn_primitive_cache_unless_the_environment_sets_it(monkeypatch):
    import os

    from cramswarm.swarm.hivemind_peer import KERNEL_CACHE_ENV, PEER_KERNEL_CACHE, bound_kernel_cache

    monkeypatch.delenv(KERNEL_CACHE_ENV, raising=False)
    bound_kernel_cache()
    assert os.environ[KERNEL_CACHE_ENV] == str(PEER_KERNEL_CACHE)
    monkeypatch.setenv(KERNEL_CACHE_ENV, "200")
    bound_kernel_cache()
    assert os.environ[KERNEL_CACHE_ENV] == "200"


def _syncing_peer(tmp_path, uid: str):
    import dataclasses
    from types import SimpleNamespace

    from cramswarm.swarm.peer_sync import SyncingStagePeer

    peer = _peer(1)
    node = SimpleNamespace(p2p=SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: uid)))
    cfg = dataclasses.replace(peer.cfg, seq_len=8, workdir=str(tmp_path), shard_dir=str(tmp_path / "shards"))
    return SyncingStagePeer(cfg, 1, uid, 1.0, node)


def test_a_leaving_peer_hands_its_held_gradients_to_a_replica_that_stays(tmp_path):
    """peer_rebalance's mover gives what it accumulated since its last step to a replica of its stage (as the
    emulation's mover does): the heir's gradients become the sum of both, with both sample counts, loss sums and
    microbatches; the mover holds nothing after. Gradients of another step are refused (stale); those of a
    microbatch the heir holds already count again (at least once, as in SWARM)."""
    from cramswarm.swarm.compression import encode
    from cramswarm.swarm.wire import flatten_payload

    mover, heir = _syncing_peer(tmp_path, "s1p1"), _syncing_peer(tmp_path, "s1p2")

    def backward(peer, seed: int, mb: int) -> None:
        g = torch.Generator().manual_seed(seed)
        tensors, meta = {"labels": torch.randint(5, VOCAB, (3, 8), generator=g)}, {"mb": mb}
        flatten_payload("x", encode(torch.randn(3, 8, ARCH["hidden_size"], generator=g), "none"), tensors, meta)
        peer._backward(tensors, meta)

    backward(mover, 1, 10)
    backward(mover, 2, 11)
    backward(heir, 3, 12)
    expected = [a.grad + b.grad for a, b in zip(mover.replica.params, heir.replica.params)]
    loss = mover.local_loss + heir.local_loss
    tensors, meta = mover._take_held()
    assert meta["samples"] == 6 and meta["mbs"] == [10, 11] and meta["step"] == 0
    assert mover.replica.local_samples == 0 and not mover.local_mbs
    assert all(p.grad is None for p in mover.replica.params)
    assert heir._add_held(tensors, meta) == {"status": "ok"}
    assert heir.replica.local_samples == 9 and sorted(heir.local_mbs) == [10, 11, 12]
    assert heir.local_loss == pytest.approx(loss)
    assert all(torch.allclose(p.grad, e) for p, e in zip(heir.replica.params, expected))

    assert heir._add_held(tensors, meta) == {"status": "ok"}   # the same microbatches once more: at least once
    assert heir.replica.local_samples == 15
    heir.replica.step = 1
    assert heir._add_held(tensors, meta | {"mbs": [20]})["status"] == "refused"   # computed at another step


def _backward_call(peer, seed: int, mb: int, **extra) -> None:
    from cramswarm.swarm.compression import encode
    from cramswarm.swarm.wire import flatten_payload

    g = torch.Generator().manual_seed(seed)
    tensors, meta = {"labels": torch.randint(5, VOCAB, (3, 8), generator=g)}, {"mb": mb, **extra}
    flatten_payload("x", encode(torch.randn(3, 8, ARCH["hidden_size"], generator=g), "none"), tensors, meta)
    peer._backward(tensors, meta)


def test_calls_computed_while_a_peer_steps_count_toward_its_next_step(tmp_path):
    """Backward calls are never held for a step: those computed after a peer's snapshot accumulate toward the next
    step, and applying the step (the averaged gradients) keeps them (double buffering), as if computed after it."""
    peer, reference = _syncing_peer(tmp_path, "s1p1"), _syncing_peer(tmp_path, "s1p2")
    _backward_call(peer, 1, 10)
    flat, samples = peer._take_snapshot(0)
    assert peer._stepping() and samples == 3 and sorted(peer.snapshot_mbs) == [10] and peer.busy()
    _backward_call(peer, 2, 11)
    _backward_call(peer, 3, 12)
    assert peer._held_samples() == 3 + 6 and sorted(peer.local_mbs) == [11, 12]
    peer.averaged = (b"group", flat)
    assert peer._apply_counted(b"group", 1e-3, 3, {10})["status"] == "ok"
    assert peer.step == 1 and peer.stepped_mbs == {10} and peer.stepped_samples == 3 and not peer._stepping()
    for seed, mb in ((2, 11), (3, 12)):
        _backward_call(reference, seed, mb)
    assert peer._held_samples() == 6 and peer.local_loss == pytest.approx(reference.local_loss)
    assert all(torch.allclose(p.grad, r.grad, atol=1e-6)
               for p, r in zip(peer.replica.params, reference.replica.params))
    peer._take_snapshot(1)
    _backward_call(peer, 4, 13)
    peer._drop_snapshot()                      # a step that stepped nothing: later calls stay accumulated
    assert sorted(peer.local_mbs) == [13] and peer.replica.local_samples == 3 and not peer._stepping()


def test_a_resent_or_repeated_microbatch_counts_again_and_is_counted(tmp_path):
    """At least once, as in SWARM: a re-sent backward call is accumulated like any other (its first replica may
    have computed it too) and counted in ``resent_samples``; a microbatch this peer already holds toward its step
    is held twice (its multiplicity; the step counts it in ``duplicate_microbatches``). A state download drops what
    the peer held."""
    peer = _syncing_peer(tmp_path, "s1p1")
    _backward_call(peer, 1, 10)
    _backward_call(peer, 2, 11, resent=True)
    assert peer.replica.local_samples == 6 and sorted(peer.local_mbs) == [10, 11]
    assert peer.counters["resent_samples"] == 3
    _backward_call(peer, 2, 11)
    assert peer.replica.local_samples == 9 and sorted(peer.local_mbs) == [10, 11, 11]
    peer._load_state(peer._state())
    assert peer._held_samples() == 0 and not peer.local_mbs and all(p.grad is None for p in peer.replica.params)


def test_a_peer_taking_the_state_one_step_ahead_keeps_the_gradients_it_holds_toward_that_step(tmp_path):
    """A member whose all-reduce failed while its group stepped downloads the state one step ahead: the gradients
    it accumulated since its snapshot (toward that step) stay, counted as one step stale; a state further ahead
    drops everything held (lost, as in SWARM)."""
    peer, source = _syncing_peer(tmp_path, "s1p1"), _syncing_peer(tmp_path, "s1p2")
    _backward_call(peer, 1, 10)
    peer._take_snapshot(0)                     # the step's snapshot (applied by the group without this peer)
    _backward_call(peer, 2, 11)                # toward the next step
    held = [p.grad.clone() for p in peer.replica.params]
    source.replica.step = 1
    assert peer._load_state(source._state()) == 1
    assert peer.replica.local_samples == 3 and sorted(peer.local_mbs) == [11] and not peer._stepping()
    assert all(torch.equal(p.grad, h) for p, h in zip(peer.replica.params, held))
    assert peer.counters["stale_gradient_samples"] == 3 and peer.counters["lost_gradient_samples"] == 3
    source.replica.step = 4
    assert peer._load_state(source._state()) == 4
    assert peer._held_samples() == 0 and not peer.local_mbs and all(p.grad is None for p in peer.replica.params)
    assert peer.counters["lost_gradient_samples"] == 6
