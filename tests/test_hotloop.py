"""The pretraining hot loop (issue 18): masking where the model runs, a prefetching loader, static-count sparse
prediction, the SDPA backend choice and no host sync inside the micro-step loop."""

import contextlib
import csv
import functools

import numpy as np
import pytest
import torch
from conftest import ARCH, impl, killed_at_save, recipe

from cramswarm import pretrain as stage_module
from cramswarm.data import tokenizer as tokenization
from cramswarm.distributed import World
from cramswarm.models.crammed_bert import CrammedBertConfig, CrammedBertForMaskedLM
from cramswarm.pretrain import MicroBatches, pretrain
from cramswarm.training import mask_tokens


def legacy_mask(block, rate, mode, vocab_size, generator):
    """The masking of earlier versions, step by step (the CPU path must keep its draws)."""
    batch, length = block.shape
    if mode == "fixed":
        chosen = torch.rand(batch, length, generator=generator).argsort(dim=1)[:, : max(1, round(rate * length))]
        selected = torch.zeros(batch, length, dtype=torch.bool).scatter_(1, chosen, True)
    else:
        selected = (torch.rand(batch, length, generator=generator) < rate) & (block != tokenization.SEP_ID)
    labels = torch.where(selected, block, torch.full_like(block, -100))
    roll = torch.rand(batch, length, generator=generator)
    inputs = block.clone()
    inputs[selected & (roll < 0.8)] = tokenization.MASK_ID
    replace = selected & (roll >= 0.8) & (roll < 0.9)
    first = len(tokenization.SPECIAL_TOKENS)
    inputs[replace] = torch.randint(first, vocab_size, (int(replace.sum()),), generator=generator)
    return inputs, labels


@pytest.mark.parametrize("mode", ["fixed", "bernoulli"])
def test_cpu_masks_keep_the_draws_of_earlier_versions(mode):
    block = torch.randint(5, 1000, (64, 32), generator=torch.Generator().manual_seed(1))
    block[:, ::8] = tokenization.SEP_ID
    got = mask_tokens(block, 0.25, mode, 1000, torch.Generator().manual_seed(3))
    want = legacy_mask(block, 0.25, mode, 1000, torch.Generator().manual_seed(3))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("mode", ["fixed", "bernoulli"])
def test_static_masking_selects_the_same_positions_with_the_80_10_10_rule(mode):
    block = torch.randint(5, 1000, (400, 128), generator=torch.Generator().manual_seed(1))
    inputs, labels = mask_tokens(block, 0.25, mode, 1000, torch.Generator().manual_seed(3), static=True)
    _, legacy_labels = mask_tokens(block, 0.25, mode, 1000, torch.Generator().manual_seed(3), static=False)
    assert torch.equal(labels, legacy_labels)  # the selection draws come first and are the same
    selected = labels != -100
    assert torch.equal(inputs[~selected], block[~selected])
    assert (inputs[selected] == tokenization.MASK_ID).float().mean().item() == pytest.approx(0.8, abs=0.02)
    assert (inputs[selected] == block[selected]).float().mean().item() == pytest.approx(0.1, abs=0.02)
    replaced = selected & (inputs != tokenization.MASK_ID) & (inputs != block)
    assert replaced.float().sum().item() / selected.sum().item() == pytest.approx(0.1, abs=0.02)
    assert (inputs[replaced] >= len(tokenization.SPECIAL_TOKENS)).all()


def test_prefetching_loader_gives_the_same_batches_at_any_cursor():
    blocks = np.arange(13 * 4, dtype=np.uint16).reshape(13, 4)
    plain = MicroBatches(blocks, 11, 3, torch.device("cpu"), prefetch=False)
    ahead = MicroBatches(blocks, 11, 3, torch.device("cpu"), prefetch=True)
    try:
        # reading on (wrapping past the 11 training blocks), then jumping as a resume does
        for cursor in [0, 3, 6, 9, 1, 4, 2, 5, 8, 0]:
            a, b = plain.take(cursor), ahead.take(cursor)
            assert torch.equal(a, b) and a.dtype == torch.int64
            rows = np.sort(np.arange(cursor, cursor + 3) % 11)
            assert torch.equal(a, torch.from_numpy(blocks[rows].astype(np.int64)))
    finally:
        plain.close()
        ahead.close()


def test_pretraining_with_and_without_prefetch_is_identical(tiny_run):
    folder, tok_path = tiny_run
    runs = {}
    for prefetch in (False, True):
        r = recipe(budget={"unit": "steps", "value": 12}, precision="fp32", eval_points=1)
        summary = pretrain(r, ARCH, folder / "blocks.npy", tok_path, folder / f"p{prefetch}", progress=False,
                           impl=impl(prefetch=prefetch))
        log = [{k: v for k, v in row.items() if k != "elapsed_s"}
               for row in csv.DictReader(open(folder / f"p{prefetch}" / "train_log.csv"))]
        runs[prefetch] = (summary["final_loss"], summary["eval_loss"], log)
    assert runs[False] == runs[True]


def mlm(sparse_prediction, rate=0.25):
    torch.manual_seed(0)
    config = CrammedBertConfig(vocab_size=300, num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                               intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0, sparse_prediction=sparse_prediction,
                               sparse_prediction_rate=rate)
    return CrammedBertForMaskedLM(config)


def masked(share=0.2, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 300, (4, 32), generator=generator)
    return ids, torch.where(torch.rand(4, 32, generator=generator) < share, ids, torch.full_like(ids, -100))


def loss_and_grads(model, ids, labels):
    loss = model(ids, labels=labels).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_static_sparse_prediction_has_the_boolean_gathers_loss_and_gradients():
    ids, labels = masked(0.2)
    masked_count = int((labels != -100).sum())
    assert masked_count < round(0.25 * labels.numel())  # every masked position has a slot, the rest are padding
    out = mlm("static")(ids, labels=labels)
    assert out.logits.shape == (round(0.25 * labels.numel()), 300)  # from the shapes, not the mask
    static, boolean = loss_and_grads(mlm("static"), ids, labels), loss_and_grads(mlm(True), ids, labels)
    assert static[0] == pytest.approx(boolean[0].item(), rel=1e-5)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(static[1], boolean[1], strict=True))


def test_static_sparse_prediction_keeps_the_first_masked_positions_when_more_are_masked():
    ids, labels = masked(0.5)
    count = round(0.25 * labels.numel())
    flat = labels.view(-1).clone()
    first = torch.nonzero(flat != -100).view(-1)[:count]
    assert (flat != -100).sum() > count
    kept = torch.full_like(flat, -100)
    kept[first] = flat[first]
    truncated = mlm("static")(ids, labels=labels).loss
    assert truncated.item() == pytest.approx(mlm(True)(ids, labels=kept.view_as(labels)).loss.item(), rel=1e-5)


def test_static_sparse_prediction_compiles_without_a_graph_break():
    ids, labels = masked(0.2)
    torch._dynamo.reset()
    assert torch._dynamo.explain(mlm(True))(ids, labels=labels).graph_break_count > 0  # the nonzero at the gather
    torch._dynamo.reset()
    assert torch._dynamo.explain(mlm("static"))(ids, labels=labels).graph_break_count == 0
    # one whole graph, forward and backward (aot_eager: traced by dynamo and AOT autograd, no C compiler needed)
    torch._dynamo.reset()
    compiled = torch.compile(mlm("static"), fullgraph=True, backend="aot_eager")
    got, want = loss_and_grads(compiled, ids, labels), loss_and_grads(mlm("static"), ids, labels)
    assert got[0] == pytest.approx(want[0].item(), rel=1e-5)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got[1], want[1], strict=True))
    torch._dynamo.reset()


def test_sparse_prediction_rejects_other_values():
    with pytest.raises(ValueError, match="sparse_prediction"):
        mlm("dense")
    with pytest.raises(ValueError, match="sparse_prediction_rate"):
        mlm("static", rate=0.0)


@pytest.mark.parametrize("backend", ["auto", "math", "flash", "efficient"])
def test_each_attention_backend_runs_on_cpu_or_is_refused_naming_the_key(tiny_run, backend):
    folder, tok_path = tiny_run
    r, how = recipe(budget={"unit": "steps", "value": 2}, eval_points=1), impl(attention_backend=backend)
    runs_here = backend != "efficient"  # torch has no memory-efficient attention kernel for CPUs
    if not runs_here:
        with pytest.raises(ValueError, match="pretrain.impl.attention_backend: efficient"):
            pretrain(r, ARCH, folder / "blocks.npy", tok_path, folder / backend, progress=False, impl=how)
        return
    summary = pretrain(r, ARCH, folder / "blocks.npy", tok_path, folder / backend, progress=False, impl=how)
    assert summary["steps"] == 2 and np.isfinite(summary["final_loss"])


def test_attention_backend_math_is_the_kernel_the_loop_runs(tiny_run, monkeypatch):
    """Inside the training loop only the chosen kernel is allowed (flash off under math); afterwards torch's
    choice is back."""
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.flash_sdp_enabled())  # the global switch sdpa_kernel sets, CPU included
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    folder, tok_path = tiny_run
    r = recipe(budget={"unit": "steps", "value": 1}, eval_blocks=0)
    pretrain(r, ARCH, folder / "blocks.npy", tok_path, folder / "math", progress=False,
             impl=impl(attention_backend="math"))
    assert seen and not any(seen)
    assert torch.backends.cuda.flash_sdp_enabled()


# what reads a tensor back to the host (a device sync on an accelerator); bool-tensor indexing runs a nonzero
HOST_READS = ("item", "tolist", "cpu", "numpy", "nonzero", "__int__", "__float__", "__bool__")


@contextlib.contextmanager
def micro_step_marks(monkeypatch, on_micro=None, on_read=None):
    """Marks in one event list: ``micro`` when a micro-step starts (the loader's take), ``read`` when the step's
    loss is read back (World.all_sum), and every host read of a tensor in between or elsewhere."""
    events = []
    take, all_sum = stage_module.MicroBatches.take, World.all_sum

    def marked_take(self, cursor):
        events.append("micro")
        if on_micro:
            on_micro()
        return take(self, cursor)

    def marked_sum(self, tensor):
        if on_read:
            on_read()
        events.append("read")
        return all_sum(self, tensor)

    monkeypatch.setattr(stage_module.MicroBatches, "take", marked_take)
    monkeypatch.setattr(World, "all_sum", marked_sum)
    yield events


def counting_host_reads(monkeypatch, events):
    for name in HOST_READS:
        real = getattr(torch.Tensor, name)

        def counted(self, *args, _real=real, _name=name, **kwargs):
            events.append(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    real_nonzero = torch.nonzero
    monkeypatch.setattr(torch, "nonzero", lambda *a, **k: events.append("nonzero") or real_nonzero(*a, **k))
    for name in ("__getitem__", "__setitem__"):
        real = getattr(torch.Tensor, name)

        def indexed(self, index, *args, _real=real, **kwargs):
            parts = index if isinstance(index, tuple) else (index,)
            if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
                events.append("bool-index")
            return _real(self, index, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, indexed)


def reads_inside_micro_steps(events):
    """Host reads between a micro-step's start and its optimizer step's loss read."""
    inside, found = False, []
    for event in events:
        if event == "micro":
            inside = True
        elif event == "read":
            inside = False
        elif inside:
            found.append(event)
    return found


@pytest.mark.parametrize("hot_loop", [True, False])
def test_no_host_read_inside_the_micro_step_loop(tiny_run, monkeypatch, hot_loop):
    """With static masks and static sparse prediction nothing in a micro-step reads a tensor back: the optimizer
    step's loss is the first read. The masks and gather of earlier versions (the CPU default) do read: the
    check sees them."""
    folder, tok_path = tiny_run
    arch = ARCH | {"sparse_prediction": "static" if hot_loop else True}
    monkeypatch.setattr(stage_module, "mask_tokens", functools.partial(mask_tokens, static=hot_loop))
    r = recipe(budget={"unit": "steps", "value": 3}, batch_ramp_fraction=0.0, eval_points=1)
    with micro_step_marks(monkeypatch) as events:
        counting_host_reads(monkeypatch, events)
        summary = pretrain(r, arch, folder / "blocks.npy", tok_path, folder / "out", progress=False, impl=impl())
    assert summary["steps"] == 3 and events.count("micro") == 3 * 2 and events.count("read") == 3
    found = reads_inside_micro_steps(events)
    assert events.count("item") >= 3  # the reads are counted: every step's loss is read once, after its micro-steps
    if hot_loop:
        assert found == []
    else:
        assert "bool-index" in found and "__int__" in found


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_device_sync_inside_the_micro_step_loop_on_cuda(tiny_run, monkeypatch):
    """torch raises on any synchronising CUDA call while the micro-steps run (sync debug mode ``error``)."""
    folder, tok_path = tiny_run
    arch = ARCH | {"sparse_prediction": "static"}
    r = recipe(budget={"unit": "steps", "value": 3}, batch_ramp_fraction=0.0, eval_points=1)
    with micro_step_marks(monkeypatch, on_micro=lambda: torch.cuda.set_sync_debug_mode("error"),
                          on_read=lambda: torch.cuda.set_sync_debug_mode("default")) as events:
        try:
            summary = pretrain(r, arch, folder / "blocks.npy", tok_path, folder / "out", progress=False,
                               impl=impl(device="cuda"))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert summary["steps"] == 3 and events.count("micro") == 6


@pytest.mark.parametrize("sparse_prediction", [True, False, "static"])
def test_a_process_slice_without_masked_tokens_adds_zero_loss_and_zero_gradients(sparse_prediction):
    """Data parallel: a slice with nothing to predict contributes 0 (not NaN) and reaches every parameter."""
    ids, labels = masked(0.3)
    unmasked = torch.full_like(labels[:2], -100)
    model = mlm(sparse_prediction)
    loss = stage_module._slice_loss(model, ids[:2], unmasked, labels, "fp32", torch.device("cpu"))
    loss.backward()
    assert loss.item() == 0.0
    assert all(p.grad is not None and torch.all(p.grad == 0) for p in model.parameters() if p.requires_grad)
    # a slice with masked tokens: its share of the whole micro-batch's mean loss
    model.zero_grad()
    share = stage_module._slice_loss(model, ids[:2], labels[:2], labels, "fp32", torch.device("cpu"))
    predicted, total = int((labels[:2] != -100).sum()), int((labels != -100).sum())
    assert share.item() == pytest.approx(model(ids[:2], labels=labels[:2]).loss.item() * predicted / total, rel=1e-5)


def test_a_state_saved_with_another_devices_generator_resumes_with_fresh_masks(tiny_run, capsys):
    """A masking generator's state only fits a generator on the same kind of device: a state from a GPU (or from
    a version that saved no device) resumes on this device with the generator reseeded, and the run says so."""
    folder, tok_path = tiny_run
    r, how = recipe(budget={"unit": "steps", "value": 12}, eval_points=1), impl(resume_every_steps=4)
    state = folder / "state"
    with killed_at_save(2) as saves:  # the step-8 write fails: the file keeps step 4
        pretrain(r, ARCH, folder / "blocks.npy", tok_path, folder / "out", progress=False, state_dir=state, impl=how)
    assert saves == [4, 8]
    payload = torch.load(state / "state.pt", weights_only=False)
    assert payload["generator_device"] == "cpu"
    payload["generator_device"] = "cuda"
    torch.save(payload, state / "state.pt")
    capsys.readouterr()
    resumed = pretrain(r, ARCH, folder / "blocks.npy", tok_path, folder / "out", progress=False, state_dir=state,
                       impl=how)
    assert resumed["resumed_from_step"] == 4 and resumed["steps"] == 12
    assert "drawn afresh (seed + step): the state was saved on cuda" in capsys.readouterr().out
