"""The resource estimates behind the workflow's resource functions (cramswarm.resources): units, scaling, budgets,
GLUE rows."""

from __future__ import annotations

import pytest

from cramswarm import resources as est
from cramswarm.budget import training_flops_per_token

ARCH = {"hidden_size": 8, "layers": 2, "intermediate_size": 32, "heads": 2, "max_positions": 16}


def test_units_round_up_and_add_the_start_up_allowance():
    assert est.mb(1) == 100 and est.mb(1e8) == 100 and est.mb(1e8 + 1) == 200
    assert est.minutes(0) == est.BASE_MINUTES and est.minutes(61) == est.BASE_MINUTES + 2


def test_parameters_time_and_memory_follow_the_arch():
    matmul, total = est.model_params(ARCH, vocab=100)
    assert matmul == 2 * (4 * 64 + 2 * 8 * 32) + 8 * 100 and total == matmul + 8 * (100 + 16)
    cpu = est.training_seconds(ARCH, 100, tokens=1000, seq_len=16, device="cpu")
    assert est.training_seconds(ARCH, 100, tokens=2000, seq_len=16, device="cpu") == pytest.approx(2 * cpu)
    per_token = 6 * matmul + 12 * 2 * 16 * 8
    assert cpu == pytest.approx(per_token * 1000 / est.FLOPS_FLOOR["cpu"])
    cuda = est.training_seconds(ARCH, 100, tokens=1000, seq_len=16, device="cuda")
    assert cuda == pytest.approx(cpu * est.FLOPS_FLOOR["cpu"] / est.FLOPS_FLOOR["cuda"])
    # activations count on the CPU only; more copies, more memory
    big = {**ARCH, "hidden_size": 1024, "intermediate_size": 4096, "layers": 24}
    assert est.training_mem_mb(big, 32768, 64, 128, "cpu") > est.training_mem_mb(big, 32768, 64, 128, "cuda")
    assert est.training_mem_mb(big, 32768, 0, 128, "cuda", copies=3) > est.training_mem_mb(big, 32768, 0, 128, "cuda")


def test_budgets_in_tokens_steps_model_tflop_and_seconds():
    recipe = {"batch_sequences": 4, "eval_points": 2, "eval_blocks": 3, "mask_rate": 0.25,
              "budget": {"unit": "steps", "value": 10}}
    assert est.budget_tokens(recipe, 128, ARCH, 512) == 10 * 4 * 128
    assert est.budget_tokens({**recipe, "budget": {"unit": "tokens", "value": 999}}, 128, ARCH, 512) == 999
    flop = {**recipe, "budget": {"unit": "model_tflop", "value": 2.0}}
    per_token = training_flops_per_token(ARCH, 512, 128, 0.25)
    assert est.budget_tokens(flop, 128, ARCH, 512) == round(2e12 / per_token)
    deeper = {**ARCH, "layers": 2 * ARCH["layers"]}
    assert est.budget_tokens(flop, 128, deeper, 512) < est.budget_tokens(flop, 128, ARCH, 512)
    seconds = {**recipe, "budget": {"unit": "seconds", "value": 3600}}
    assert est.budget_tokens(seconds, 128, ARCH, 512) is None
    evals = est.training_seconds(ARCH, 100, 2 * 3 * 128, 128, "cpu") / 3
    assert est.pretrain_seconds(seconds, ARCH, 100, 128, "cpu") == pytest.approx(
        est.SECONDS_BUDGET_MARGIN * 3600 + est.TRAINING_MARGIN * evals)
    train = est.training_seconds(ARCH, 100, 10 * 4 * 128, 128, "cpu")
    assert est.pretrain_seconds(recipe, ARCH, 100, 128, "cpu") == pytest.approx(est.TRAINING_MARGIN * (train + evals))


def test_glue_rows_per_source_and_the_fine_tuning_time():
    synthetic = {"glue_train_examples": 50, "glue_validation_examples": 10}
    assert est.glue_rows("rte", "synthetic", synthetic) == (50, 10)
    assert est.glue_rows("mnli", "synthetic", synthetic) == (50, 20)   # matched + mismatched
    assert est.glue_rows("mnli", "hub", {"glue_max_train_examples": 500}) == (500, 19647)
    assert est.glue_rows("wnli", "hub", {"glue_max_train_examples": None}) == est.GLUE_ROWS["wnli"]
    protocol = {"max_length_tokens": 16, "epochs": 2}
    one = est.finetune_seconds(ARCH, 100, protocol, [(50, 10)], "cpu", seeds=1)
    assert est.finetune_seconds(ARCH, 100, protocol, [(50, 10)] * 3, "cpu", seeds=5) == pytest.approx(15 * one)
    assert one == pytest.approx(est.TRAINING_MARGIN * (est.training_seconds(ARCH, 100, 2 * 50 * 16, 16, "cpu")
                                                       + est.training_seconds(ARCH, 100, 2 * 10 * 16, 16, "cpu") / 3))


def test_a_normalised_budget_runs_as_long_as_the_declared_card_needs():
    """An A6000-day is 24 h on an A6000, 29.7 h on a V100 and 3.76 h on an H100 (Cramming Table 1 peaks and the
    datasheets); with no card declared, the card it is written for; the budget's own device peak wins."""
    day = {"unit": "seconds", "value": 86400, "reference_card": "a6000"}
    assert est.budget_seconds(day) == pytest.approx(86400)
    assert est.budget_seconds(day, est.card_peak("V100")) / 3600 == pytest.approx(29.72, abs=0.01)
    assert est.budget_seconds(day, est.card_peak("NVIDIA H100 80GB HBM3")) / 3600 == pytest.approx(3.755, abs=0.01)
    half = {**day, "device_peak_tflops": 154.8 / 2}
    assert est.budget_seconds(half, est.card_peak("H100")) == pytest.approx(2 * 86400)
    assert est.budget_seconds({"unit": "exaflop", "value": 13.37472}) == pytest.approx(86400)
    assert est.budget_seconds({"unit": "seconds", "value": 60, "reference_card": None}, 999.0) == 60
    assert est.card_peak(None) is None and est.card_peak("") is None
    with pytest.raises(ValueError, match="'Z9'.*device_peak_tflops"):
        est.card_peak("Z9")


def test_gpu_memory_is_calibrated_on_the_measured_crammed_run():
    """The crammed model at micro-batch 512 peaked at 28.9 GiB on an H200 (docs/benchmarks.md); Izsak's BERT-large
    at 512 does not fit a 48 GB card, at the reference's 128 it does."""
    crammed = {"layers": 16, "hidden_size": 768, "heads": 12, "intermediate_size": 3072, "max_positions": 128}
    large = {"layers": 24, "hidden_size": 1024, "heads": 16, "intermediate_size": 4096, "max_positions": 128}
    gib = 1e6 / 2**30
    assert est.gpu_mem_mb(crammed, 32768, 512, 128, flash_attention=True) * gib == pytest.approx(28.9, rel=0.05)
    assert est.gpu_mem_mb(large, 32768, 512, 128, flash_attention=True) * gib > 48
    assert est.gpu_mem_mb(large, 32768, 128, 128, flash_attention=False) * gib < 40
    assert est.gpu_mem_mb(large, 32768, 128, 128) > est.gpu_mem_mb(large, 32768, 128, 128, flash_attention=True)
