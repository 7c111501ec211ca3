"""The training library the stages share: device and precision, autocast, MLM masking, LR schedules and the
batch ramp as functions of budget progress, AdamW parameter groups, building and saving a crammed BERT.

The pretraining stage (:mod:`cramswarm.pretrain`), fine-tuning (:mod:`cramswarm.glue.finetune`) and SWARM
(:mod:`cramswarm.swarm`) import these; nothing here reads files or runs a loop.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path

import torch

from cramswarm.data import tokenizer as tokenization
from cramswarm.models.crammed_bert import CrammedBertConfig, CrammedBertForMaskedLM, unwrap_compiled

SCHEDULES = ("triangle", "one-cycle", "cosine", "linear", "inverse-sqrt", "constant")


def lr_multiplier(schedule: str, t: float, warmup: float = 0.0) -> float:
    """Multiplier of the peak LR at budget progress ``t`` (0 = start, 1 = budget spent)."""
    t = min(max(t, 0.0), 1.0)
    if schedule == "triangle":  # the paper's final shape: 25 % of peak -> peak at t=0.75 -> 0
        return min(0.25 + t, 4.0 * (1.0 - t))
    if schedule == "one-cycle":
        return 2.0 * t if t < 0.5 else 2.0 * (1.0 - t)
    if schedule == "constant":
        return 1.0
    if warmup > 0 and t < warmup:
        return t / warmup
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * (t - warmup) / (1.0 - warmup))) if warmup < 1 else 1.0
    if schedule == "linear":
        return (1.0 - t) / (1.0 - warmup) if warmup < 1 else 1.0
    if schedule == "inverse-sqrt":
        return math.sqrt(max(warmup, 1e-3) / max(t, 1e-3)) if t > 0 else 1.0
    raise ValueError(f"unknown schedule {schedule!r}; allowed: {', '.join(SCHEDULES)}")


def budget_progress(budget: dict, tokens: int, steps: int, elapsed_s: float) -> float:
    """Share of the budget spent; ``budget`` is ``{"unit": tokens|steps|seconds, "value": amount}``."""
    used = {"tokens": tokens, "steps": steps, "seconds": elapsed_s}[budget["unit"]]
    return used / budget["value"]


def mask_tokens(
    block: torch.Tensor, rate: float, mode: str, vocab_size: int, generator: torch.Generator, static: bool | None = None
):
    """BERT masking with the 80/10/10 rule. Returns (inputs, labels); labels are -100 where not predicted.

    ``fixed``: exactly round(rate x length) positions per sequence (ICML recipe; any position may be chosen).
    ``bernoulli``: each non-[SEP] token independently with probability ``rate`` (v1 recipe).
    Random replacements are drawn from the non-special vocabulary.

    The masks are drawn on ``block``'s device from ``generator`` (which must live there). ``static`` picks how:
    with fixed shapes only (one replacement token drawn for every position, kept where replaced: no count read
    back, so no host sync on an accelerator), or with a replacement drawn only per replaced position (the draws
    of every earlier version, kept byte for byte on the CPU). By default it is static unless the generator is
    a CPU one, where reading a count is free and the masks stay those of earlier runs.
    """
    if static is None:
        static = generator.device.type != "cpu"
    batch, length = block.shape
    device = block.device
    if mode == "fixed":
        count = max(1, round(rate * length))
        chosen_pos = torch.rand(batch, length, generator=generator, device=device).argsort(dim=1)[:, :count]
        selected = torch.zeros(batch, length, dtype=torch.bool, device=device).scatter_(1, chosen_pos, True)
    elif mode == "bernoulli":
        draw = torch.rand(batch, length, generator=generator, device=device)
        selected = (draw < rate) & (block != tokenization.SEP_ID)
    else:
        raise ValueError(f"unknown mask_mode {mode!r}; allowed: fixed, bernoulli")
    labels = torch.where(selected, block, torch.full_like(block, -100))
    roll = torch.rand(batch, length, generator=generator, device=device)
    replace = selected & (roll >= 0.8) & (roll < 0.9)
    first_regular = len(tokenization.SPECIAL_TOKENS)
    if static:
        random_ids = torch.randint(first_regular, vocab_size, (batch, length), generator=generator, device=device)
        inputs = torch.where(selected & (roll < 0.8), torch.full_like(block, tokenization.MASK_ID), block)
        return torch.where(replace, random_ids, inputs), labels
    inputs = block.clone()
    inputs[selected & (roll < 0.8)] = tokenization.MASK_ID
    random_ids = torch.randint(first_regular, vocab_size, (int(replace.sum()),), generator=generator, device=device)
    inputs[replace] = random_ids
    return inputs, labels


def schedule_point(recipe: dict, t: float, sequences: int) -> tuple[float, float]:
    """(schedule progress, warmup share) at budget progress ``t`` after ``sequences`` sequences.

    By default the schedule runs over the budget (Cramming's rule). With ``schedule_horizon_sequences`` it runs
    over a fixed number of sequences however long the budget is (BERT's step-based schedule, which the
    budget truncates: Cramming v1, "BERT settings stopped after our budget is reached").
    """
    horizon = recipe.get("schedule_horizon_sequences")
    if not horizon:
        return t, recipe["warmup_fraction"]
    return sequences / horizon["total"], horizon["warmup"] / horizon["total"]


def step_lr(recipe: dict, t: float, sequences: int) -> tuple[float, float]:
    """(learning rate, multiplier of the peak) of the optimizer step taken at budget progress ``t`` after
    ``sequences`` sequences: the recipe's schedule over the budget or over its horizon (``schedule_point``). One
    rule for ``pretrain``, the emulation's stage steps and the launcher's stage peers."""
    multiplier = lr_multiplier(recipe["schedule"], *schedule_point(recipe, t, sequences))
    return recipe["lr"] * multiplier, multiplier


def apply_gradients(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, grads, lr: float,
                    grad_clip_norm: float | None) -> None:
    """One optimizer step on gradients computed elsewhere (a swarm stage's averaged ones): set each parameter's
    ``.grad`` (``grads`` in parameter order, any shape of the same size; clipping changes them in place), clip
    their global norm, step at ``lr``. The emulation's replicas and the launcher's stage peers step with it."""
    for param, grad in zip(params, grads):
        param.grad = grad.to(param.device, param.dtype).view_as(param)
    if grad_clip_norm is not None:
        torch.nn.utils.clip_grad_norm_(params, grad_clip_norm)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()


def step_accumulation(recipe: dict, t: float, sequences: int) -> int:
    """Micro-batches of the optimizer step taken at budget progress ``t`` after ``sequences`` sequences: the ramp
    counted in micro-batch steps (``batch_ramp_micro_steps``, Cramming v1) if the recipe sets one, else over the
    budget (``batch_ramp_fraction``). One rule for ``pretrain``, the swarm's microbatch plan, the emulation's
    dispatcher and the launcher's stage peers."""
    micro, batch = recipe["micro_batch_sequences"], recipe["batch_sequences"]
    if recipe.get("batch_ramp_micro_steps"):
        return accumulation_at_micro_step(sequences // micro, batch, micro, recipe["batch_ramp_micro_steps"])
    return accumulation_at(t, batch // micro, recipe["batch_ramp_fraction"])


def make_optimizer(model: torch.nn.Module, recipe: dict, fused: bool | None = None) -> torch.optim.Optimizer:
    """The recipe's optimizer over :func:`decay_groups`: AdamW, or Adam with coupled L2 decay (BERT's)."""
    kind = recipe.get("optimizer", "adamw")
    cls = {"adamw": torch.optim.AdamW, "adam_l2": torch.optim.Adam}.get(kind)
    if cls is None:
        raise ValueError(f"unknown optimizer {kind!r}; allowed: adamw, adam_l2")
    extra = {"fused": True} if fused else {}
    return cls(decay_groups(model, recipe["weight_decay"]), lr=recipe["lr"], betas=tuple(recipe["betas"]),
               eps=recipe["eps"], **extra)


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW parameter groups: no weight decay on biases or LayerNorm parameters (the position scale decays)."""
    norm_params = {id(p) for m in model.modules() if isinstance(m, torch.nn.LayerNorm) for p in m.parameters()}
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            exempt = name.endswith("bias") or id(param) in norm_params
            (no_decay if exempt else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when it is available; asking for ``cuda`` without one is an error."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but torch sees no CUDA device (use device: auto or cpu)")
    return torch.device(name)


def accumulation_at(t: float, final_accumulation: int, ramp_fraction: float) -> int:
    """Micro-batches per optimizer step at budget progress ``t``: one at the start, growing linearly in
    micro-batch steps to ``final_accumulation`` at ``t = ramp_fraction`` (Cramming's batch-size ramp)."""
    if ramp_fraction <= 0 or t >= ramp_fraction:
        return final_accumulation
    return max(1, min(final_accumulation, 1 + math.floor(t / ramp_fraction * final_accumulation)))


def accumulation_at_micro_step(micro_steps: int, batch: int, micro: int, ramp_micro_steps: int) -> int:
    """Micro-batches per optimizer step after ``micro_steps`` micro-batches under a ramp counted in micro-steps
    (Cramming v1's ``batch_size_ramp: 300000``): the batch grows by ``batch / ramp_micro_steps`` sequences per
    micro-step, rounded down to whole micro-batches, from one micro-batch to ``batch``."""
    if micro_steps >= ramp_micro_steps:
        return batch // micro
    return min(batch // micro, int(micro_steps * batch / ramp_micro_steps // micro) + 1)


def save_checkpoint(model, tok, out_dir: str | Path, max_length: int) -> None:
    """save_pretrained into a temporary folder beside ``out_dir``, then move each file into place."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".ckpt-", dir=out_dir))
    try:
        unwrap_compiled(model).save_pretrained(tmp)
        tokenization.to_transformers(tok, max_length).save_pretrained(tmp)
        for path in tmp.iterdir():
            os.replace(path, out_dir / path.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_model(arch: dict, vocab_size: int, seed: int, dropout: float = 0.0) -> CrammedBertForMaskedLM:
    torch.manual_seed(seed)
    config = CrammedBertConfig.from_arch(
        arch, vocab_size, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout
    )
    return CrammedBertForMaskedLM(config)
