"""What a workflow job asks a cluster for (``mem_mb``: MB, sbatch --mem; ``runtime``: minutes, sbatch --time),
estimated from the config: the arithmetic behind the resource functions of ``cramswarm.workflow``, which read the
config and the wildcards and call these with plain numbers.

The estimates err on the generous side (a job cut off at its time limit loses its allocation; only pretraining
resumes). They assume the slowest rates below, far under the measured ones (README: the 2-core CPU trains the
default crammed model, 1.4-1.8 M parameters, at 18-20 k tokens/s, about 2e11 FLOP/s). A site that knows better
sets a rule's values in a copy of profiles/slurm (set-resources), which takes precedence over these.
"""

from __future__ import annotations

import math

from cramswarm.budget import REFERENCE_CARDS, counted, datasheet_peak, is_normalised, resolve, training_flops_per_token

FLOPS_FLOOR = {"cpu": 2e10, "cuda": 5e12}  # model FLOP/s assumed per device (cuda: an older GPU at low utilisation)
DOCS_PER_S_FLOOR = 500  # documents per second a streaming data stage gets through (C4-sized documents)
UNCAPPED_DOCUMENTS = 100_000_000  # documents assumed of a hub dataset with max_documents: null
DEDUP_BYTES_PER_DOC = 64  # dedup's in-memory band column and its sort (cramswarm.data.filters.dedup: ~25 B)
PYTHON_MB = 1000  # memory floor of a job: Python, pyarrow, tokenizers
TORCH_MB = 2000  # memory floor of a job that imports torch
BASE_MINUTES = 10  # start-up, imports and writing outputs, every job
TRAINING_MARGIN = 1.25  # pretraining and fine-tuning: estimated time x this (evaluations, saves, stragglers)
SECONDS_BUDGET_MARGIN = 1.05  # a seconds budget x this: loading before its clock starts, the step in flight at its end
# GLUE train / validation rows per task (the hub's nyu-mll/glue; MNLI: matched + mismatched validation)
GLUE_ROWS = {
    "cola": (8551, 1043),
    "sst2": (67349, 872),
    "mrpc": (3668, 408),
    "qqp": (363846, 40430),
    "stsb": (5749, 1500),
    "mnli": (392702, 19647),
    "qnli": (104743, 5463),
    "rte": (2490, 277),
    "wnli": (635, 71),
}


def mb(n_bytes: float) -> int:
    """Bytes -> MB (SLURM's --mem unit), rounded up to 100 MB."""
    return 100 * math.ceil(n_bytes / 1e8)


def minutes(seconds: float) -> int:
    """Seconds of work -> a job's runtime in minutes (what Snakemake >= 9.20 reads), plus the start-up allowance."""
    return BASE_MINUTES + math.ceil(seconds / 60)


def model_params(arch: dict, vocab: int) -> tuple[int, int]:
    """(matmul parameters a token passes through, all parameters) of a crammed-BERT arch at ``vocab``: per layer
    the attention projections (4 h^2) and the FFN (2 h x intermediate, the gated FFN's halving ignored), plus the
    decoder (h x vocab); all parameters add the embeddings. An upper bound of cramswarm.models' exact count."""
    h, layers = arch["hidden_size"], arch["layers"]
    matmul = layers * (4 * h * h + 2 * h * arch["intermediate_size"]) + h * vocab
    return matmul, matmul + h * (vocab + arch["max_positions"])


def training_seconds(arch: dict, vocab: int, tokens: float, seq_len: int, device: str) -> float:
    """Forward and backward over ``tokens`` tokens on ``device`` (cpu | cuda): 6 FLOPs per matmul parameter and
    token, plus attention (12 x layers x seq_len x h per token), at the device's FLOPS_FLOOR."""
    matmul, _ = model_params(arch, vocab)
    per_token = 6 * matmul + 12 * arch["layers"] * seq_len * arch["hidden_size"]
    return per_token * tokens / FLOPS_FLOOR[device]


def training_mem_mb(arch: dict, vocab: int, sequences: int, seq_len: int, device: str, copies: int = 1,
                    bytes_per_param: int = 28) -> int:
    """Host memory of a training job on ``device`` (cpu | cuda): torch, and per model copy its weights, gradients,
    two Adam moments and a saved-state copy (``bytes_per_param``: 28 in training). On the CPU also the activations
    of ``sequences`` x ``seq_len`` tokens (fp32, about 64 B per token and width plus the attention maps per layer);
    on a GPU they stay there."""
    _, params = model_params(arch, vocab)
    n_bytes = copies * bytes_per_param * params
    if device == "cpu":
        per_layer = sequences * seq_len * (64 * arch["hidden_size"] + 8 * arch["heads"] * seq_len)
        n_bytes += copies * arch["layers"] * per_layer
    return mb(TORCH_MB * 1e6 + 2 * n_bytes)  # x2: allocator slack and the copies made while saving


def budget_tokens(recipe: dict, block_tokens: int, arch: dict, vocab: int) -> int | None:
    """Tokens a token, step or model-TFLOP budget trains on (a seconds or exaFLOP budget: None)."""
    budget = recipe["budget"]
    if budget["unit"] in ("seconds", "exaflop"):
        return None
    if budget["unit"] == "model_tflop":
        return counted(budget, training_flops_per_token(arch, vocab, block_tokens, recipe["mask_rate"]))["value"]
    per_step = recipe["batch_sequences"] * block_tokens
    return budget["value"] * (per_step if budget["unit"] == "steps" else 1)


def card_peak(card: str | None) -> float | None:
    """Datasheet TFLOP/s of the GPU model a cluster's jobs run on (``CRAMSWARM_SLURM_GPU_MODEL``: "A100", "V100",
    "H100 PCIe", ...; ``budget.DATASHEET_TFLOPS`` or a Cramming Table 1 card name); None when none is declared."""
    if not card:
        return None
    peak = datasheet_peak(card) or REFERENCE_CARDS.get(card.lower())
    if peak is None:
        from cramswarm.budget import DATASHEET_TFLOPS

        raise ValueError(f"GPU model {card!r} has no datasheet peak (known: {', '.join(DATASHEET_TFLOPS)}); "
                         "declare pretrain.budget.device_peak_tflops instead")
    return peak


def budget_seconds(budget: dict, peak_tflops: float | None = None) -> float:
    """Wall seconds of a seconds or exaFLOP budget on a device of ``peak_tflops``: the budget's own
    ``device_peak_tflops`` first, then ``peak_tflops`` (the declared card), else the card the budget is written for
    (its ``reference_card``, or the A6000 for an exaFLOP budget: Cramming's card), as the paper ran it."""
    if not is_normalised(budget):
        return float(budget["value"])
    peak = budget.get("device_peak_tflops") or peak_tflops
    if peak is None:
        peak = REFERENCE_CARDS[budget.get("reference_card") or "a6000"]
    return resolve(budget, peak)["value"]


def pretrain_seconds(recipe: dict, arch: dict, vocab: int, block_tokens: int, device: str,
                     peak_tflops: float | None = None) -> float:
    """A run's pretraining on ``device`` (cpu | cuda): a seconds or exaFLOP budget as :func:`budget_seconds` gives
    it on a card of ``peak_tflops`` (compile time counts against it), a token or step budget at the FLOPS_FLOOR;
    plus the held-out evaluations (forward passes only)."""
    seq = block_tokens
    evals = training_seconds(arch, vocab, recipe["eval_points"] * recipe["eval_blocks"] * seq, seq, device) / 3
    tokens = budget_tokens(recipe, block_tokens, arch, vocab)
    if tokens is None:
        return SECONDS_BUDGET_MARGIN * budget_seconds(recipe["budget"], peak_tflops) + TRAINING_MARGIN * evals
    return TRAINING_MARGIN * (training_seconds(arch, vocab, tokens, seq, device) + evals)


def gpu_mem_mb(arch: dict, vocab: int, micro_batch: int, seq_len: int, flash_attention: bool = False) -> int:
    """GPU memory of a pretraining process at its micro-batch: 16 B per parameter (fp32 weights, gradients, two Adam
    moments), the activations kept for the backward pass in 16-bit autocast (Megatron-LM's count per layer and
    token, without recomputation: 34 x width bytes, plus 5 x heads x seq_len for the attention maps unless a fused
    kernel keeps them out) and 1 GiB of CUDA context and allocator slack. Calibration: the crammed model (16 x 768,
    vocab 32768) at micro-batch 512 peaked at 28.9 GiB on an H200 (docs/benchmarks.md); this gives 29.0 GiB with the
    fused kernel. Izsak's BERT-large at 512 gives 57.6 GiB fused (72.6 with the maps kept), an OOM on 48 GB cards;
    at the reference's 128, 19.3 GiB."""
    _, params = model_params(arch, vocab)
    per_token_layer = 34 * arch["hidden_size"] + (0 if flash_attention else 5 * arch["heads"] * seq_len)
    activations = micro_batch * seq_len * arch["layers"] * per_token_layer
    return mb(16 * params + activations + 2**30)


def corpus_documents(spec: dict) -> int:
    """Documents a corpus stage streams for a corpus spec (source, synthetic, hub sections): a bound where a hub
    dataset has ``max_documents: null`` (it counts ``UNCAPPED_DOCUMENTS``)."""
    if spec["source"] == "synthetic":
        return spec["synthetic"]["corpus_documents"]
    return sum(d["max_documents"] or UNCAPPED_DOCUMENTS for d in spec["hub"]["corpus"])


def glue_rows(task: str, source: str, source_config: dict) -> tuple[int, int]:
    """(train, validation) rows the fine-tuning of ``task`` reads from ``source`` (synthetic | hub), whose config
    section is ``source_config``."""
    if source == "synthetic":
        train = source_config["glue_train_examples"]
        return train, source_config["glue_validation_examples"] * (2 if task == "mnli" else 1)
    train, validation = GLUE_ROWS[task]
    cap = source_config["glue_max_train_examples"]
    return (min(train, cap) if cap else train), validation


def finetune_seconds(arch: dict, vocab: int, protocol: dict, rows: list[tuple[int, int]], device: str,
                     seeds: int) -> float:
    """Fine-tuning runs of ``seeds`` seeds on tasks of ``rows`` (train, validation) each: every epoch over the
    train rows (padded to max_length_tokens) plus a validation pass per epoch."""
    seq, epochs = protocol["max_length_tokens"], protocol["epochs"]
    seconds = 0.0
    for train, validation in rows:
        seconds += training_seconds(arch, vocab, epochs * train * seq, seq, device)
        seconds += training_seconds(arch, vocab, epochs * validation * seq, seq, device) / 3
    return TRAINING_MARGIN * seconds * seeds
