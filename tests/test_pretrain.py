import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ARCH, impl, killed_at_save, recipe

from cramswarm import pretrain as stage_module
from cramswarm.data import tokenizer as tokenization
from cramswarm.models.crammed_bert import CrammedBertConfig, CrammedBertForMaskedLM
from cramswarm.pretrain import HeldOut, pretrain
from cramswarm.provenance import settings_hash
from cramswarm.training import (
    accumulation_at,
    budget_progress,
    decay_groups,
    lr_multiplier,
    mask_tokens,
)


@pytest.mark.parametrize(
    "schedule, t, warmup, expected",
    [
        ("triangle", 0.0, 0, 0.25),  # starts at 25 % of peak
        ("triangle", 0.375, 0, 0.625),
        ("triangle", 0.75, 0, 1.0),  # peak at 75 % of the budget
        ("triangle", 0.875, 0, 0.5),
        ("triangle", 1.0, 0, 0.0),  # zero at the end
        ("one-cycle", 0.25, 0, 0.5),
        ("one-cycle", 0.5, 0, 1.0),
        ("cosine", 0.05, 0.1, 0.5),  # half-way through warmup
        ("cosine", 0.55, 0.1, 0.5),  # half-way through the decay
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
    model = CrammedBertForMaskedLM(
        CrammedBertConfig(
            vocab_size=50,
            num_hidden_layers=1,
            hidden_size=16,
            num_attention_heads=2,
            intermediate_size=32,
            use_bias=True,
        )
    )
    decay, no_decay = decay_groups(model, 0.01)
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert {"bert.layers.0.norm1.weight", "bert.final_norm.bias", "bert.layers.0.ffn.dense_in.bias"} <= no_decay_names
    assert "bert.embeddings.position_scale" in {names[id(p)] for p in decay["params"]}
    assert all(p.ndim == 2 or names[id(p)].endswith("position_scale") for p in decay["params"])
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0


def test_pretrain_reduces_loss_and_writes_checkpoint(tiny_run):
    folder, tok_path = tiny_run
    summary = pretrain(recipe(), ARCH, folder / "blocks.npy", tok_path, folder / "ckpt", progress=False, impl=impl())
    assert summary["steps"] == 30 and summary["tokens"] == 30 * 16 * 32
    rows = list(csv.DictReader(open(folder / "ckpt" / "train_log.csv")))
    assert [int(r["step"]) for r in rows] == [5, 10, 15, 20, 25, 30]
    assert float(rows[-1]["loss"]) < float(rows[0]["loss"]) - 0.3
    for r in rows:  # the realised LR of each logged step follows the triangle at that step's budget progress
        progress = (int(r["step"]) - 1) / 30
        assert float(r["lr"]) == pytest.approx(3e-3 * lr_multiplier("triangle", progress), rel=1e-4)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "summary.json"):
        assert (folder / "ckpt" / name).is_file()
    prov = json.loads((folder / "ckpt" / "summary.json").read_text())["provenance"]
    assert (
        prov["settings_sha256"] == settings_hash({"recipe": recipe(), "arch": ARCH})
        and prov["seed"] == recipe()["seed"]
    )
    assert set(prov) >= {"packages", "python", "hardware", "hostname", "git_commit", "finished_utc"}


def test_pretrain_is_deterministic_with_a_token_budget(tiny_run):
    folder, tok_path = tiny_run
    r = recipe(budget={"unit": "tokens", "value": 5000}, precision="fp32")
    a = pretrain(r, ARCH, folder / "blocks.npy", tok_path, folder / "a", progress=False, impl=impl())
    b = pretrain(r, ARCH, folder / "blocks.npy", tok_path, folder / "b", progress=False, impl=impl())
    assert a["steps"] == b["steps"] == 10  # ceil(5000 / (16 * 32))
    assert (folder / "a" / "train_log.csv").read_text().splitlines()[-1].split(",")[:3] == (
        folder / "b" / "train_log.csv"
    ).read_text().splitlines()[-1].split(",")[:3]


def test_pretrain_rejects_token_ids_outside_the_vocab(tiny_run):
    folder, tok_path = tiny_run
    np.save(folder / "bad.npy", np.full((4, 32), 500, dtype=np.uint16))
    with pytest.raises(ValueError, match="vocab size"):
        pretrain(recipe(), ARCH, folder / "bad.npy", tok_path, folder / "x", progress=False, impl=impl())


@pytest.mark.parametrize(
    "t, expected",
    [(0.0, 1), (0.1, 1), (0.15, 2), (0.3, 3), (0.59, 4), (0.6, 4), (0.9, 4)],
)
def test_batch_ramp_grows_linearly_in_micro_batches(t, expected):
    assert accumulation_at(t, final_accumulation=4, ramp_fraction=0.6) == expected


def test_no_ramp_means_the_final_batch_from_the_start():
    assert accumulation_at(0.0, 4, 0.0) == 4


def test_pretrain_logs_the_ramp_the_schedule_and_held_out_losses(tiny_run):
    folder, tok_path = tiny_run
    r = recipe(
        budget={"unit": "tokens", "value": 40 * 8 * 32},
        batch_sequences=32,
        batch_ramp_fraction=0.5,
        eval_points=4,
    )
    summary = pretrain(r, ARCH, folder / "blocks.npy", tok_path, folder / "ramp", progress=False,
                       impl=impl(log_every_steps=1))
    rows = list(csv.DictReader(open(folder / "ramp" / "train_log.csv")))
    batches = [int(row["batch_sequences"]) for row in rows]
    assert batches[0] == 8 and batches[-1] == 32 and batches == sorted(batches)  # one micro-batch -> the final batch
    assert sum(batches) * 32 == summary["tokens"] == int(rows[-1]["tokens"])
    for row in rows:  # realised LR = peak x multiplier at the progress before the step
        assert float(row["lr"]) == pytest.approx(3e-3 * float(row["lr_multiplier"]), rel=1e-4)
    evals = [float(row["eval_loss"]) for row in rows if row["eval_loss"]]
    assert len(evals) == 4 and evals[-1] < evals[0]
    assert summary["eval_loss"] == pytest.approx(evals[-1], abs=1e-5)
    progress = [float(row["progress"]) for row in rows]
    assert progress[0] == 0.0 and progress == sorted(progress) and progress[-1] < 1.0
    for row in rows:  # the logged multiplier is the schedule's at the logged progress
        assert float(row["lr_multiplier"]) == pytest.approx(lr_multiplier("triangle", float(row["progress"])), abs=1e-4)


def test_held_out_loss_is_the_same_measurement_for_every_recipe(tiny_run):
    """Runs that differ only in their training masking are scored on the identical held-out masks."""
    folder, tok_path = tiny_run
    blocks = np.load(folder / "blocks.npy")[-16:]
    a = HeldOut(blocks, 0.15, 96, 8)
    b = HeldOut(blocks, 0.15, 96, 4)
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.labels, b.labels)
    model = CrammedBertForMaskedLM(CrammedBertConfig.from_arch(ARCH, 96))
    assert a.loss(model, "fp32", torch.device("cpu")) == pytest.approx(
        b.loss(model, "fp32", torch.device("cpu")), rel=1e-5
    )


def test_pretrain_rejects_a_tokenizer_of_the_wrong_size(tiny_run):
    folder, tok_path = tiny_run
    with pytest.raises(ValueError, match=r"expects vocab size 128 \(tokenizer.vocab_sizes\)"):
        pretrain(recipe(), ARCH, folder / "blocks.npy", tok_path, folder / "x", progress=False, expected_vocab=128,
                 impl=impl())


def test_pretrain_rejects_holding_out_every_block(tiny_run):
    folder, tok_path = tiny_run
    n = len(np.load(folder / "blocks.npy"))
    with pytest.raises(ValueError, match="pretrain.eval_blocks"):
        pretrain(recipe(eval_blocks=n - 4), ARCH, folder / "blocks.npy", tok_path, folder / "x", progress=False,
                 impl=impl())


def test_pretrain_resumes_from_saved_state_in_process(tiny_run):
    """A state saved mid-run and resumed gives the uninterrupted run's log, step for step."""
    folder, tok_path = tiny_run
    r, how = recipe(budget={"unit": "tokens", "value": 20 * 16 * 32}), impl(resume_every_steps=4, log_every_steps=2)
    full = pretrain(r, ARCH, folder / "blocks.npy", tok_path, folder / "full", progress=False, impl=how)

    state = folder / "state"
    with killed_at_save(3) as saves:  # during the third write (step 12), before its rename: the file keeps step 8
        pretrain(r, ARCH, folder / "blocks.npy", tok_path, folder / "resumed", progress=False, state_dir=state,
                 impl=how)
    assert saves == [4, 8, 12] and (state / "state.pt").is_file()
    resumed = pretrain(r, ARCH, folder / "blocks.npy", tok_path, folder / "resumed", progress=False, state_dir=state,
                       impl=how)
    assert resumed["resumed_from_step"] == 8 and resumed["steps"] == full["steps"] == 20
    strip = lambda path: [line.rsplit(",", 2)[0] for line in path.read_text().splitlines()]  # noqa: E731 (drop time)
    log_a = [row.split(",") for row in strip(folder / "full" / "train_log.csv")]
    log_b = [row.split(",") for row in strip(folder / "resumed" / "train_log.csv")]
    assert [row[:3] for row in log_a] == [row[:3] for row in log_b]
    for a, b in zip(log_a[1:], log_b[1:]):
        assert float(a[3]) == pytest.approx(float(b[3]), abs=1e-4)  # the loss column
    assert resumed["eval_loss"] == pytest.approx(full["eval_loss"], abs=1e-4)
    assert not (state / "state.pt").exists()  # removed once the checkpoint is written


def test_state_of_another_recipe_is_not_resumed(tiny_run):
    folder, tok_path = tiny_run
    state = folder / "state"
    r, how = recipe(budget={"unit": "steps", "value": 6}), impl(resume_every_steps=2)
    with killed_at_save(1):
        pretrain(r, ARCH, folder / "blocks.npy", tok_path, folder / "a", progress=False, state_dir=state, impl=how)
    other = pretrain(
        r | {"lr": 1e-3}, ARCH, folder / "blocks.npy", tok_path, folder / "a", progress=False, state_dir=state, impl=how
    )
    assert other["resumed_from_step"] is None and other["steps"] == 6


def test_compiled_pretraining_matches_eager_and_saves_clean_keys(tiny_run):
    """pretrain.impl.compile: torch.compile (CPU inductor) trains the same model and the checkpoint has no _orig_mod."""
    import shutil

    from safetensors.torch import load_file

    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("torch.compile on CPU needs a C compiler (cc/gcc), none on PATH")
    folder, tok_path = tiny_run
    r = recipe(budget={"unit": "steps", "value": 6}, precision="fp32")
    eager = pretrain(r, ARCH, folder / "blocks.npy", tok_path, folder / "eager", progress=False, impl=impl())
    compiled = pretrain(
        r, ARCH, folder / "blocks.npy", tok_path, folder / "compiled", progress=False, impl=impl(compile=True)
    )
    assert compiled["final_loss"] == pytest.approx(eager["final_loss"], abs=1e-3)
    assert not [k for k in load_file(folder / "compiled" / "model.safetensors") if k.startswith("_orig_mod")]


def test_hot_loop_reads_the_loss_once_per_optimizer_step(tiny_run, monkeypatch):
    """No host sync per micro-step: the package's code reads a floating-point tensor (a loss) into Python at most
    once per optimizer step.

    Every way a tensor reaches Python as a number is counted (item, float, int, bool, tolist) when the tensor holds
    floating-point values and the read is made by cramswarm code (torch's CPU Adam reads its host-side step counter,
    which is no device sync); masks and masked-token counts are integer or boolean host tensors."""
    import sys

    folder, tok_path = tiny_run
    package = str(Path(stage_module.__file__).parent)
    reads = []
    for name in ("item", "__float__", "__int__", "__bool__", "tolist"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if self.is_floating_point() and caller.startswith(package):
                reads.append(f"{_name} in {caller}:{sys._getframe(1).f_lineno}")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    # 4 micro-batches per optimizer step, 6 steps, no held-out evaluation
    r = recipe(budget={"unit": "steps", "value": 6}, micro_batch_sequences=4, batch_sequences=16, eval_blocks=0)
    summary = pretrain(r, ARCH, folder / "blocks.npy", tok_path, folder / "ckpt", progress=False, impl=impl())
    assert summary["steps"] == 6
    assert 0 < len(reads) <= 6, reads


def test_nonfinite_guard_sees_one_bad_micro_batch_in_the_accumulated_loss(tiny_run, monkeypatch):
    """The guard checks the step's loss summed on the device at its one read: a NaN in one micro-batch of two
    (the other finite) still skips that step."""
    from cramswarm import pretrain as stage

    folder, tok_path = tiny_run
    calls = {"n": 0}
    original = stage.build_model

    def poisoned_build(*args, **kwargs):
        model = original(*args, **kwargs)
        forward = model.forward

        def maybe_nan(*a, **k):
            out = forward(*a, **k)
            calls["n"] += 1
            if calls["n"] == 5:  # the first micro-batch of step 3 only
                out.loss = out.loss * float("nan")
            return out

        model.forward = maybe_nan
        return model

    monkeypatch.setattr(stage, "build_model", poisoned_build)
    r = recipe(budget={"unit": "steps", "value": 4}, eval_blocks=0)
    summary = pretrain(r, ARCH, folder / "blocks.npy", tok_path, folder / "ckpt", progress=False, impl=impl())
    assert summary["skipped_nonfinite"] == 1 and summary["steps"] == 4
    assert math.isfinite(summary["final_loss"])
