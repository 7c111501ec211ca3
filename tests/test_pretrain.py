import csv

import numpy as np
import pytest
import torch
from conftest import REPO

from cramswarm import tokenizer as tokenization
from cramswarm.config import load_config
from cramswarm.models.crammed_bert import CrammedBertConfig, CrammedBertForMaskedLM
from cramswarm.pretrain import budget_progress, decay_groups, lr_multiplier, mask_tokens, pretrain


@pytest.mark.parametrize(
    "schedule, t, warmup, expected",
    [
        ("triangle", 0.0, 0, 0.25),   # starts at 25 % of peak
        ("triangle", 0.375, 0, 0.625),
        ("triangle", 0.75, 0, 1.0),   # peak at 75 % of the budget
        ("triangle", 0.875, 0, 0.5),
        ("triangle", 1.0, 0, 0.0),    # zero at the end
        ("one-cycle", 0.25, 0, 0.5),
        ("one-cycle", 0.5, 0, 1.0),
        ("cosine", 0.05, 0.1, 0.5),   # half-way through warmup
        ("cosine", 0.55, 0.1, 0.5),   # half-way through the decay
        ("linear", 0.53, 0.06, 0.5),
        ("inverse-sqrt", 0.4, 0.1, 0.5),
        ("constant", 0.9, 0, 1.0),
    ],
)
def test_schedule_shapes(schedule, t, warmup, expected):
    assert lr_multiplier(schedule, t, warmup) == pytest.approx(expected)


def test_budget_progress_uses_the_named_unit():
    assert budget_progress({"unit": "tokens", "value": 1000}, 250, 99, 99.0) == 0.25
    assert budget_progress({"unit": "steps", "value": 10}, 10**9, 5, 99.0) == 0.5
    assert budget_progress({"unit": "seconds", "value": 60}, 10**9, 99, 30.0) == 0.5


def test_fixed_masking_selects_exact_count_with_80_10_10():
    block = torch.randint(5, 1000, (400, 128))
    inputs, labels = mask_tokens(block, 0.25, "fixed", 1000, torch.Generator().manual_seed(0))
    selected = labels != -100
    assert (selected.sum(1) == 32).all()
    assert torch.equal(labels[selected], block[selected])
    assert torch.equal(inputs[~selected], block[~selected])
    masked = (inputs[selected] == tokenization.MASK_ID).float().mean().item()
    unchanged = (inputs[selected] == block[selected]).float().mean().item()
    assert masked == pytest.approx(0.8, abs=0.02)
    assert unchanged == pytest.approx(0.1, abs=0.02)  # plus random picks that hit the same id (rare)


def test_bernoulli_masking_rate_and_no_sep():
    block = torch.randint(5, 1000, (400, 128))
    block[:, ::16] = tokenization.SEP_ID
    _, labels = mask_tokens(block, 0.15, "bernoulli", 1000, torch.Generator().manual_seed(0))
    selected = labels != -100
    assert selected.float().mean().item() == pytest.approx(0.15 * 120 / 128, abs=0.01)
    assert not selected[block == tokenization.SEP_ID].any()


def test_weight_decay_groups_exempt_biases_and_norms():
    model = CrammedBertForMaskedLM(CrammedBertConfig(vocab_size=50, num_hidden_layers=1, hidden_size=16,
                                                     num_attention_heads=2, intermediate_size=32, use_bias=True))
    decay, no_decay = decay_groups(model, 0.01)
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert {"bert.layers.0.norm1.weight", "bert.final_norm.bias", "bert.layers.0.ffn.dense_in.bias"} <= no_decay_names
    assert "bert.embeddings.position_scale" in {names[id(p)] for p in decay["params"]}
    assert all(p.ndim == 2 or names[id(p)].endswith("position_scale") for p in decay["params"])
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0


@pytest.fixture
def tiny_run(tmp_path):
    """A corpus with learnable structure: a repeated sentence pattern, tokenized and packed."""
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(40)]
    docs = [" ".join(rng.choice(words[:20]) + " " + words[20 + i % 20] for i in range(12)) for _ in range(300)]
    tok = tokenization.train_wordpiece([docs], 96, min_frequency=1)
    tok_path = tmp_path / "tok.json"
    tok.save(str(tok_path))
    ids = [i for d in tok.encode_batch(docs, add_special_tokens=False) for i in d.ids + [tokenization.SEP_ID]]
    blocks = np.array(ids[: len(ids) // 32 * 32], dtype=np.uint16).reshape(-1, 32)
    np.save(tmp_path / "blocks.npy", blocks)
    return tmp_path, tok_path


def recipe(**kw):
    base = dict(seed=0, budget={"unit": "steps", "value": 30}, micro_batch_sequences=8, batch_sequences=16, lr=3e-3,
                schedule="triangle", warmup_fraction=0.0, betas=[0.9, 0.98], eps=1e-12, weight_decay=0.01,
                grad_clip_norm=0.5, mask_rate=0.25, mask_mode="fixed", precision="bf16", device="cpu",
                log_every_steps=5)
    return base | kw


# The default config's arch section (schema defaults filled in), shrunk to test size.
ARCH = load_config([REPO / "config" / "config.yaml"])["models"]["crammed"]["arch"] | dict(
    layers=1, hidden_size=32, heads=2, intermediate_size=64, max_positions=32
)


def test_pretrain_reduces_loss_and_writes_checkpoint(tiny_run):
    folder, tok_path = tiny_run
    summary = pretrain(recipe(), ARCH, folder / "blocks.npy", tok_path, folder / "ckpt", progress=False)
    assert summary["steps"] == 30 and summary["tokens"] == 30 * 16 * 32
    rows = list(csv.DictReader(open(folder / "ckpt" / "train_log.csv")))
    assert [int(r["step"]) for r in rows] == [5, 10, 15, 20, 25, 30]
    assert float(rows[-1]["loss"]) < float(rows[0]["loss"]) - 0.3
    for r in rows:  # the realised LR of each logged step follows the triangle at that step's budget progress
        progress = (int(r["step"]) - 1) / 30
        assert float(r["lr"]) == pytest.approx(3e-3 * lr_multiplier("triangle", progress), rel=1e-4)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "summary.json"):
        assert (folder / "ckpt" / name).is_file()


def test_pretrain_is_deterministic_with_a_token_budget(tiny_run):
    folder, tok_path = tiny_run
    r = recipe(budget={"unit": "tokens", "value": 5000}, precision="fp32")
    a = pretrain(r, ARCH, folder / "blocks.npy", tok_path, folder / "a", progress=False)
    b = pretrain(r, ARCH, folder / "blocks.npy", tok_path, folder / "b", progress=False)
    assert a["steps"] == b["steps"] == 10  # ceil(5000 / (16 * 32))
    assert (folder / "a" / "train_log.csv").read_text().splitlines()[-1].split(",")[:3] == \
        (folder / "b" / "train_log.csv").read_text().splitlines()[-1].split(",")[:3]


def test_pretrain_rejects_token_ids_outside_the_vocab(tiny_run):
    folder, tok_path = tiny_run
    np.save(folder / "bad.npy", np.full((4, 32), 500, dtype=np.uint16))
    with pytest.raises(ValueError, match="vocab size"):
        pretrain(recipe(), ARCH, folder / "bad.npy", tok_path, folder / "x", progress=False)
