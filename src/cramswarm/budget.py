"""Budgets that mean the paper's budget on any device.

Cramming's budget is "one day of one named GPU". Table 1 of the paper turns each card's day into exaFLOP with the
card's peak tensor throughput (v1 appendix B.1), so an A6000 day is 154.8 TFLOP/s x 86,400 s = 13.4 exaFLOP. A
plain 24-hour budget on a faster card trains on several times the paper's compute. Two budget forms make the
budget portable:

- ``{unit: seconds, value: 86400, reference_card: a6000}``: 24 hours *of an A6000*; on this device the run stops
  after ``value x peak(reference) / peak(device)`` seconds;
- ``{unit: exaflop, value: 13.4}``: stop after ``value x 1e18 / peak(device)`` seconds.

A third form gives every model the same compute on any machine without a clock: ``{unit: model_tflop, value: 19}``
trains each model on ``value x 1e12 / training_flops_per_token(...)`` tokens, its own arithmetic counted from its
shapes. A deeper or denser model trains on fewer tokens, as the paper's baselines do within its one day; the count
is of arithmetic, not of time (docs/models-and-recipes.md says what that leaves out).

The device's peak is ``device_peak_tflops`` when the budget declares it, else the datasheet value of a known
CUDA card (dense bf16/fp16 tensor throughput with fp32 accumulate, the basis of Table 1), else a measured bf16
matmul rate (which is below any datasheet peak, so the run gets more seconds, never fewer, than a datasheet
would give).
"""

from __future__ import annotations

import time

# Table 1 of Cramming (v1 appendix B.1): the peak TFLOP/s behind each card's exaFLOP per day.
REFERENCE_CARDS = {
    "rtx2080ti": 53.8,
    "a4000": 88.45,
    "titan_rtx": 130.5,
    "v100": 125.0,
    "a6000": 154.8,
}

# Datasheet dense tensor peaks (bf16, or fp16 where the card has no bf16; fp32 accumulate) matched against
# torch.cuda.get_device_name(). Longest key first, so "A100" does not shadow "A100 80GB"-style names wrongly.
DATASHEET_TFLOPS = {
    "H200": 989.4,
    "H100 PCIe": 756.0,
    "H100": 989.4,
    "A100": 312.0,
    "A6000": 154.8,
    "A5000": 111.1,
    "A4000": 88.45,
    "L40S": 362.05,
    "L4": 121.0,
    "RTX 4090": 165.2,
    "RTX 3090": 71.0,
    "2080 Ti": 53.8,
    "TITAN RTX": 130.5,
    "V100": 125.0,
    "T4": 65.0,
}

SECONDS_PER_DAY = 86_400


def datasheet_peak(device_name: str) -> float | None:
    """The datasheet TFLOP/s of a CUDA card by its name, or None for an unknown card."""
    for key in sorted(DATASHEET_TFLOPS, key=len, reverse=True):
        if key.lower() in device_name.lower():
            return DATASHEET_TFLOPS[key]
    return None


def measure_matmul_tflops(device, size: int = 2048, repeats: int = 10, dtype=None) -> float:
    """Achieved matmul TFLOP/s on ``device`` in ``dtype`` (default bf16): a lower bound of its peak."""
    import torch

    dtype = dtype or torch.bfloat16
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b  # warm up
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync()
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e12


def device_peak(budget: dict, device) -> tuple[float, str]:
    """(TFLOP/s, where it came from) of the device running a budget."""
    if budget.get("device_peak_tflops"):
        return float(budget["device_peak_tflops"]), "declared (budget.device_peak_tflops)"
    if device.type == "cuda":
        import torch

        name = torch.cuda.get_device_name(device)
        if (peak := datasheet_peak(name)) is not None:
            return peak, f"datasheet ({name})"
    return measure_matmul_tflops(device), f"measured bf16 matmul on {device}"


def training_flops_per_token(arch: dict, vocab_size: int, seq_len: int, mask_rate: float) -> float:
    """Training FLOPs per token of a crammed-BERT ``arch`` (cramswarm.models.crammed_bert): 3 x the forward pass
    (forward, and a backward of twice its cost), 2 FLOPs per multiply-add.

    Per layer: the attention projections (4 h^2), the attention scores and their weighted sum (2 x seq_len x h), the
    FFN (h x intermediate in, intermediate out, halved by the gated FFN). Per decoded position: the head transform
    (h^2, where the arch has one) and the decoder (h x vocab). The decoder sees every position without sparse
    prediction, the masked share (``mask_rate``) with it, ``sparse_prediction_rate`` with static sparse prediction.
    Embedding lookups, norms, activations, biases and the narrowing layers of a SWARM split are left out (under
    1 % of the count at the study's shapes)."""
    h, inner = arch["hidden_size"], arch["intermediate_size"]
    ffn = h * inner + (inner // 2 if arch.get("ffn", "glu") == "glu" else inner) * h
    layer = 4 * h * h + ffn + 2 * seq_len * h
    sparse = arch.get("sparse_prediction", True)
    decoded = {True: mask_rate, False: 1.0, "static": arch.get("sparse_prediction_rate", 0.25)}[sparse]
    head = decoded * ((h * h if arch.get("head_transform", False) else 0) + h * vocab_size)
    return 6.0 * (arch["layers"] * layer + head)


def counted(budget: dict, flops_per_token: float) -> dict:
    """A ``model_tflop`` budget as the token budget this model trains on (``value x 1e12 / flops_per_token``
    tokens), with the count it came from; any other budget unchanged."""
    if budget["unit"] != "model_tflop":
        return budget
    tokens = max(1, round(budget["value"] * 1e12 / flops_per_token))
    return {"unit": "tokens", "value": tokens, "model_tflop": budget["value"], "flops_per_token": flops_per_token}


def for_model(recipe: dict, arch: dict, vocab_size: int, block_tokens: int) -> dict:
    """``recipe`` with a ``model_tflop`` budget turned into this model's tokens (:func:`counted`); any other budget
    as it is."""
    flops = training_flops_per_token(arch, vocab_size, block_tokens, recipe["mask_rate"])
    return {**recipe, "budget": counted(recipe["budget"], flops)}


def describe_counted(budget: dict) -> str:
    """The log line of a counted budget: what it was and the tokens it became."""
    return (f"budget {budget['model_tflop']:g} model TFLOP -> {budget['value']:,} tokens "
            f"({budget['flops_per_token'] / 1e6:.2f} MFLOP per token)")


def is_normalised(budget: dict) -> bool:
    return budget["unit"] == "exaflop" or bool(budget.get("reference_card"))


def resolve(budget: dict, peak_tflops: float | None = None, peak_source: str = "") -> dict:
    """The budget in a unit the training loop counts (tokens, steps or seconds), with how it was derived.

    ``peak_tflops`` is the running device's peak; it is needed only for a normalised budget.
    """
    if not is_normalised(budget):
        return {"unit": budget["unit"], "value": budget["value"]}
    if peak_tflops is None:
        raise ValueError("a normalised budget (exaflop unit or reference_card) needs the device's peak TFLOP/s")
    if budget["unit"] == "exaflop":
        seconds = budget["value"] * 1e18 / (peak_tflops * 1e12)
        exaflop = budget["value"]
    elif budget["unit"] == "seconds":
        card = budget["reference_card"]
        reference = REFERENCE_CARDS[card]
        seconds = budget["value"] * reference / peak_tflops
        exaflop = budget["value"] * reference * 1e12 / 1e18
    else:
        raise ValueError(f"budget.reference_card applies to a seconds budget, not to unit {budget['unit']!r}")
    return {
        "unit": "seconds",
        "value": seconds,
        "exaflop": exaflop,
        "device_peak_tflops": peak_tflops,
        "device_peak_source": peak_source,
        "reference_card": budget.get("reference_card"),
        "a6000_days": exaflop * 1e18 / (REFERENCE_CARDS["a6000"] * 1e12 * SECONDS_PER_DAY),
    }
