"""The recipe keys that make the paper's recipes and baselines runnable as the reference runs them: normalised
budgets, BERT's step-based schedule cut by the budget, the v1 micro-step batch ramp, Adam with coupled L2,
pretraining dropout, and surviving a non-finite loss."""

import csv
import json

import pytest
import torch
from conftest import ARCH, impl, recipe
from safetensors.torch import load_file
from tokenizers import Tokenizer

from cramswarm import budget as budgets
from cramswarm import pretrain as pretraining
from cramswarm.pretrain import pretrain
from cramswarm.training import accumulation_at_micro_step, lr_multiplier, make_optimizer, schedule_point


def test_a6000_day_is_the_papers_13_4_exaflop():
    day = budgets.resolve({"unit": "seconds", "value": 86400, "reference_card": "a6000"}, 154.8, "declared")
    assert day["value"] == pytest.approx(86400)
    assert day["exaflop"] == pytest.approx(13.37472)
    assert day["a6000_days"] == pytest.approx(1.0)


def test_declared_h100_peak_gives_the_a6000_day_equivalent():
    budget = {"unit": "seconds", "value": 86400, "reference_card": "a6000", "device_peak_tflops": 989.4}
    resolved = budgets.resolve(budget, *budgets.device_peak(budget, torch.device("cpu")))
    assert resolved["unit"] == "seconds"
    assert resolved["value"] == pytest.approx(86400 * 154.8 / 989.4)  # about 3.76 h
    assert resolved["device_peak_source"].startswith("declared")
    # the same compute as an exaFLOP budget
    flops = budgets.resolve({"unit": "exaflop", "value": resolved["exaflop"]}, 989.4)
    assert flops["value"] == pytest.approx(resolved["value"])


def test_plain_budgets_pass_through_and_known_cards_are_matched_by_name():
    assert budgets.resolve({"unit": "tokens", "value": 5, "reference_card": None}) == {"unit": "tokens", "value": 5}
    assert budgets.datasheet_peak("NVIDIA H100 80GB HBM3") == pytest.approx(989.4)
    assert budgets.datasheet_peak("NVIDIA H100 PCIe") == pytest.approx(756.0)
    assert budgets.datasheet_peak("NVIDIA RTX A6000") == pytest.approx(154.8)
    assert budgets.datasheet_peak("Some Future Card") is None
    with pytest.raises(ValueError, match="peak"):
        budgets.resolve({"unit": "exaflop", "value": 1.0})


@pytest.mark.parametrize(
    "switches",
    [{}, {"ffn": "gelu", "head_transform": True, "sparse_prediction": False}, {"sparse_prediction": "static"}],
    ids=["crammed", "bert-original", "static-sparse"],
)
def test_the_training_flop_count_is_torch_s_count_of_the_model(switches):
    """budget.training_flops_per_token against torch's own FLOP counter over a forward and backward pass of the
    real model, a quarter of each block masked."""
    from torch.utils.flop_counter import FlopCounterMode

    from cramswarm.models.crammed_bert import CrammedBertConfig, CrammedBertForMaskedLM

    arch, vocab, batch, length = {**ARCH, **switches}, 96, 2, 32
    model = CrammedBertForMaskedLM(CrammedBertConfig.from_arch(arch, vocab))
    ids = torch.randint(5, vocab, (batch, length))
    labels = torch.full_like(ids, -100)
    chosen = torch.rand(batch, length).argsort(1)[:, : length // 4]
    labels.scatter_(1, chosen, ids.gather(1, chosen))
    with FlopCounterMode(display=False) as counter:
        model(ids, labels=labels).loss.backward()
    counted = budgets.training_flops_per_token(arch, vocab, length, 0.25) * batch * length
    assert counted == pytest.approx(counter.get_total_flops(), rel=1e-6)


def test_a_model_tflop_budget_gives_each_model_its_counted_tokens(tiny_run, capsys):
    folder, tok_path = tiny_run
    budget = {"unit": "model_tflop", "value": 0.001, "reference_card": None, "device_peak_tflops": None}
    vocab = Tokenizer.from_file(str(tok_path)).get_vocab_size()
    runs = {}
    for name, arch in {"shallow": ARCH, "deep": {**ARCH, "layers": 2 * ARCH["layers"]}}.items():
        runs[name] = pretrain(recipe(budget=budget), arch, folder / "blocks.npy", tok_path, folder / name,
                              progress=False, impl=impl())
        per_token = budgets.training_flops_per_token(arch, vocab, 32, recipe()["mask_rate"])
        resolved = runs[name]["budget_resolved"]
        assert resolved == {"unit": "tokens", "value": round(1e9 / per_token)}
        assert resolved["value"] <= runs[name]["tokens"] < resolved["value"] + 16 * 32  # to the end of its step
    assert runs["deep"]["tokens"] < runs["shallow"]["tokens"]  # the same compute buys fewer tokens
    assert "model TFLOP ->" in capsys.readouterr().out


def test_measured_peak_on_cpu_is_positive():
    assert budgets.measure_matmul_tflops(torch.device("cpu"), size=256, repeats=2) > 0


def test_bert_step_schedule_is_cut_by_the_budget_not_squeezed_into_it():
    r = recipe(schedule="linear", warmup_fraction=0.5, schedule_horizon_sequences={"warmup": 100, "total": 10_000})
    # 50 sequences in: half-way through the 100-sequence warmup, whatever the budget progress says
    assert lr_multiplier(r["schedule"], *schedule_point(r, 0.99, 50)) == pytest.approx(0.5)
    # 5,050 sequences: half-way down the linear decay from 100 to 10,000 sequences
    assert lr_multiplier(r["schedule"], *schedule_point(r, 0.99, 5050)) == pytest.approx(0.5)
    # without a horizon the schedule follows the budget
    plain = recipe(schedule="linear", warmup_fraction=0.0)
    assert lr_multiplier(plain["schedule"], *schedule_point(plain, 0.25, 10**9)) == pytest.approx(0.75)


def test_v1_batch_ramp_counts_micro_steps():
    # batch 4096, micro-batch 128, ramp over 300,000 micro-steps (Cramming v1 bert-o3)
    assert accumulation_at_micro_step(0, 4096, 128, 300_000) == 1
    assert accumulation_at_micro_step(150_000, 4096, 128, 300_000) == 17  # 2048 sequences // 128 + 1
    assert accumulation_at_micro_step(299_999, 4096, 128, 300_000) == 32
    assert accumulation_at_micro_step(10**7, 4096, 128, 300_000) == 32


def test_adam_l2_couples_weight_decay_into_the_gradient():
    def step(kind):
        model = torch.nn.Linear(4, 4, bias=False)
        torch.nn.init.constant_(model.weight, 1.0)
        opt = make_optimizer(model, recipe(optimizer=kind, weight_decay=0.1, lr=0.1, betas=[0.9, 0.999], eps=1e-8))
        model.weight.grad = torch.zeros_like(model.weight)  # no loss gradient: only the decay acts
        opt.step()
        return model.weight.detach()[0, 0].item()

    # AdamW shrinks the weight by lr * wd = 1 %; Adam with L2 normalises the decay gradient: a full lr step (-0.1)
    assert step("adamw") == pytest.approx(0.99)
    assert step("adam_l2") == pytest.approx(0.9, abs=1e-4)


def test_pretraining_dropout_is_a_recipe_key(tiny_run):
    folder, tok_path = tiny_run
    summary = pretrain(
        recipe(dropout=0.1, budget={"unit": "steps", "value": 2}),
        ARCH,
        folder / "blocks.npy",
        tok_path,
        folder / "drop",
        progress=False, impl=impl(),
    )
    config = json.loads((folder / "drop" / "config.json").read_text())
    assert config["hidden_dropout_prob"] == 0.1 and config["attention_probs_dropout_prob"] == 0.1
    assert summary["recipe"]["dropout"] == 0.1


def test_a_non_finite_loss_is_survived_skipped_and_counted(tiny_run, monkeypatch):
    folder, tok_path = tiny_run
    calls = {"n": 0}
    original = pretraining.build_model

    def poisoned_build(*args, **kwargs):
        model = original(*args, **kwargs)
        forward = model.forward

        def maybe_nan(*a, **k):
            out = forward(*a, **k)
            calls["n"] += 1
            if calls["n"] in (7, 8):  # micro-batches of steps 4 (both halves of the 16-sequence batch)
                out.loss = out.loss * float("nan")
            return out

        model.forward = maybe_nan
        return model

    monkeypatch.setattr(pretraining, "build_model", poisoned_build)
    summary = pretrain(recipe(eval_blocks=0), ARCH, folder / "blocks.npy", tok_path, folder / "nan", progress=False,
                       impl=impl())
    assert summary["steps"] == 30  # the budget is still reached
    assert summary["skipped_nonfinite"] == 1 and summary["reloaded_after_nonfinite"] == 1
    rows = list(csv.DictReader(open(folder / "nan" / "train_log.csv")))
    assert all(float(r["loss"]) == float(r["loss"]) for r in rows)  # no NaN reached the log
    assert float(rows[-1]["loss"]) < float(rows[0]["loss"])
    weights = load_file(folder / "nan" / "model.safetensors")
    assert all(torch.isfinite(tensor).all() for tensor in weights.values())


def test_a_reference_card_budget_runs_for_its_equivalent_seconds(tiny_run, capsys):
    folder, tok_path = tiny_run
    # 2 seconds of a card with a tenth of this device's declared peak: 0.2 s here
    budget = {"unit": "seconds", "value": 2.0, "reference_card": "a6000", "device_peak_tflops": 1548.0}
    summary = pretrain(recipe(budget=budget), ARCH, folder / "blocks.npy", tok_path, folder / "card", progress=False,
                       impl=impl())
    assert summary["budget_resolved"]["value"] == pytest.approx(0.2)
    assert summary["budget_resolved"]["device_peak_source"].startswith("declared")
    assert 0.2 <= summary["elapsed_s"] < 2.0
    assert "s on this device" in capsys.readouterr().out


def test_plain_budgets_from_the_config_keep_their_keys(tiny_run):
    folder, tok_path = tiny_run
    budget = {"unit": "steps", "value": 2, "reference_card": None, "device_peak_tflops": None}  # as validated
    summary = pretrain(recipe(budget=budget), ARCH, folder / "blocks.npy", tok_path, folder / "plain", progress=False,
                       impl=impl())
    assert summary["steps"] == 2 and summary["budget_resolved"] == {"unit": "steps", "value": 2}


def test_a_run_that_would_wrap_its_data_says_so(tiny_run, capsys):
    folder, tok_path = tiny_run
    summary = pretrain(
        recipe(budget={"unit": "tokens", "value": 400 * 32}),
        ARCH,
        folder / "blocks.npy",
        tok_path,
        folder / "wrap",
        progress=False, impl=impl(),
    )
    assert "times; the data order" in capsys.readouterr().out
    assert summary["data_wrapped"] is True and summary["data_passes"] > 1


def test_a_seconds_budget_that_would_wrap_its_data_says_so_early(tiny_run, capsys, monkeypatch):
    """A seconds budget's wrap is estimated once from the rate of its first 2 % (pretrain.WRAP_ESTIMATE_SHARE),
    and the warning names where the data order restarts. The clock is a counter (10 ms per reading), so the rate,
    and with it the verdict, does not depend on this machine's speed."""
    import itertools

    from cramswarm import pretrain as pretraining

    ticks = itertools.count()
    monkeypatch.setattr(pretraining.time, "perf_counter", lambda: next(ticks) * 0.01)
    folder, tok_path = tiny_run
    summary = pretrain(recipe(budget={"unit": "seconds", "value": 1.0}), ARCH, folder / "blocks.npy", tok_path,
                       folder / "wrap-seconds", progress=False, impl=impl())
    out = capsys.readouterr().out
    assert out.count("s budget reads the") == 1 and "the data order restarts at about" in out
    assert summary["data_wrapped"] is True
