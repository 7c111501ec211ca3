"""The pretraining hot loop (issue 18): masking where the model runs, a prefetching loader, static-count sparse
prediction, the SDPA backend choice and no host sync inside the micro-step loop."""

import csv

import numpy as np
import pytest
import torch
from conftest import ARCH, recipe

from cramswarm.data import tokenizer as tokenization
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
        r = recipe(budget={"unit": "steps", "value": 12}, precision="fp32", prefetch=prefetch, eval_points=1)
        summary = pretrain(r, ARCH, folder / "blocks.npy", tok_path, folder / f"p{prefetch}", progress=False)
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
    r = recipe(budget={"unit": "steps", "value": 2}, attention_backend=backend, eval_points=1)
    runs_here = backend != "efficient"  # torch has no memory-efficient attention kernel for CPUs
    if not runs_here:
        with pytest.raises(ValueError, match="pretrain.attention_backend: efficient"):
            pretrain(r, ARCH, folder / "blocks.npy", tok_path, folder / backend, progress=False)
        return
    summary = pretrain(r, ARCH, folder / "blocks.npy", tok_path, folder / backend, progress=False)
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
    r = recipe(budget={"unit": "steps", "value": 1}, attention_backend="math", eval_blocks=0)
    pretrain(r, ARCH, folder / "blocks.npy", tok_path, folder / "math", progress=False)
    assert seen and not any(seen)
    assert torch.backends.cuda.flash_sdp_enabled()
