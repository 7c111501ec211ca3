"""Masked-LM pretraining of crammed BERT under an explicit budget (tokens, optimizer steps or seconds).

The learning-rate schedule is a function of budget progress t in [0, 1] (Cramming §4.3: with a wall-clock
budget the schedule follows elapsed time; with a token or step budget it follows tokens or steps, which
makes mini runs repeatable). Every optimizer step's realised LR is logged.
"""

from __future__ import annotations

import csv
import io
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from cramswarm import tokenizer as tokenization
from cramswarm.io import atomic_path, write_json
from cramswarm.models.crammed_bert import CrammedBertConfig, CrammedBertForMaskedLM
from cramswarm.packing import load_blocks

SCHEDULES = ("triangle", "one-cycle", "cosine", "linear", "inverse-sqrt", "constant")
LOG_COLUMNS = ("step", "tokens", "loss", "lr", "elapsed_s")


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


def mask_tokens(block: torch.Tensor, rate: float, mode: str, vocab_size: int, generator: torch.Generator):
    """BERT masking with the 80/10/10 rule. Returns (inputs, labels); labels are -100 where not predicted.

    ``fixed``: exactly round(rate x length) positions per sequence (ICML recipe; any position may be chosen).
    ``bernoulli``: each non-[SEP] token independently with probability ``rate`` (v1 recipe).
    Random replacements are drawn from the non-special vocabulary.
    """
    batch, length = block.shape
    if mode == "fixed":
        count = max(1, round(rate * length))
        chosen_pos = torch.rand(batch, length, generator=generator).argsort(dim=1)[:, :count]
        selected = torch.zeros(batch, length, dtype=torch.bool).scatter_(1, chosen_pos, True)
    elif mode == "bernoulli":
        selected = (torch.rand(batch, length, generator=generator) < rate) & (block != tokenization.SEP_ID)
    else:
        raise ValueError(f"unknown mask_mode {mode!r}; allowed: fixed, bernoulli")
    labels = torch.where(selected, block, torch.full_like(block, -100))
    roll = torch.rand(batch, length, generator=generator)
    inputs = block.clone()
    inputs[selected & (roll < 0.8)] = tokenization.MASK_ID
    replace = selected & (roll >= 0.8) & (roll < 0.9)
    first_regular = len(tokenization.SPECIAL_TOKENS)
    inputs[replace] = torch.randint(first_regular, vocab_size, (int(replace.sum()),), generator=generator)
    return inputs, labels


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


def autocast(precision: str, device: torch.device):
    if precision == "fp32":
        return torch.autocast(device.type, enabled=False)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    if dtype == torch.float16 and device.type != "cuda":
        raise ValueError("precision fp16 needs a CUDA device; use bf16 or fp32 on CPU")
    return torch.autocast(device.type, dtype=dtype)


def save_checkpoint(model, tok, out_dir: str | Path, max_length: int) -> None:
    """save_pretrained into a temporary folder beside ``out_dir``, then move each file into place."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".ckpt-", dir=out_dir))
    try:
        model.save_pretrained(tmp)
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


def init_random(arch: dict, tokenizer_path: str | Path, out_dir: str | Path, seed: int) -> dict:
    """The no-pretraining baseline: a randomly initialised model saved like a pretrained one."""
    tok = tokenization.load(tokenizer_path)
    model = build_model(arch, tok.get_vocab_size(), seed)
    save_checkpoint(model, tok, out_dir, arch["max_positions"])
    return {"parameters": sum(p.numel() for p in model.parameters()), "pretrained": False}


def pretrain(
    recipe: dict,
    arch: dict,
    blocks_path: str | Path,
    tokenizer_path: str | Path,
    out_dir: str | Path,
    progress: bool = True,
) -> dict:
    """Train until the budget is spent; write the checkpoint, ``train_log.csv`` and ``summary.json``."""
    device = resolve_device(recipe["device"])
    tok = tokenization.load(tokenizer_path)
    vocab_size = tok.get_vocab_size()
    blocks = load_blocks(blocks_path)
    if int(blocks.max(initial=0)) >= vocab_size:
        raise ValueError(f"packed data {blocks_path} holds token ids >= the tokenizer's vocab size {vocab_size}")
    model = build_model(arch, vocab_size, recipe["seed"]).to(device)
    model.train()
    optimizer = torch.optim.AdamW(
        decay_groups(model, recipe["weight_decay"]), lr=recipe["lr"], betas=tuple(recipe["betas"]), eps=recipe["eps"]
    )
    scaler = torch.amp.GradScaler(enabled=recipe["precision"] == "fp16")
    generator = torch.Generator().manual_seed(recipe["seed"])
    micro, accumulate = recipe["micro_batch_sequences"], recipe["batch_sequences"] // recipe["micro_batch_sequences"]
    block_tokens = blocks.shape[1]
    n_blocks = blocks.shape[0]

    log = io.StringIO()
    writer = csv.writer(log)
    writer.writerow(LOG_COLUMNS)
    step = tokens = cursor = 0
    epochs_of_data = 0.0
    window_loss, window_n = 0.0, 0
    lr = recipe["lr"] * lr_multiplier(recipe["schedule"], 0.0, recipe["warmup_fraction"])
    start = time.perf_counter()
    bar = tqdm(total=100, desc="pretrain", unit="%", disable=not progress, mininterval=2.0)
    while (t := budget_progress(recipe["budget"], tokens, step, time.perf_counter() - start)) < 1.0:
        lr = recipe["lr"] * lr_multiplier(recipe["schedule"], t, recipe["warmup_fraction"])
        for group in optimizer.param_groups:
            group["lr"] = lr
        step_loss = 0.0
        for _ in range(accumulate):
            idx = np.arange(cursor, cursor + micro) % n_blocks
            cursor = (cursor + micro) % n_blocks
            epochs_of_data += micro / n_blocks
            batch = torch.from_numpy(blocks[np.sort(idx)].astype(np.int64))
            inputs, labels = mask_tokens(batch, recipe["mask_rate"], recipe["mask_mode"], vocab_size, generator)
            with autocast(recipe["precision"], device):
                loss = model(inputs.to(device), labels=labels.to(device)).loss / accumulate
            scaler.scale(loss).backward()
            step_loss += loss.item()
            tokens += micro * block_tokens
        scaler.unscale_(optimizer)
        if recipe["grad_clip_norm"] is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe["grad_clip_norm"])
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if not math.isfinite(step_loss):
            raise FloatingPointError(f"pretraining loss became {step_loss} at step {step}; lower pretrain.lr")
        window_loss, window_n = window_loss + step_loss, window_n + 1
        if step % recipe["log_every_steps"] == 0:
            elapsed = time.perf_counter() - start
            writer.writerow((step, tokens, f"{window_loss / window_n:.5f}", f"{lr:.6g}", f"{elapsed:.2f}"))
            bar.set_postfix(loss=f"{window_loss / window_n:.3f}", lr=f"{lr:.2e}", tok_s=f"{tokens / elapsed:,.0f}")
            window_loss, window_n = 0.0, 0
        bar.update(min(100, int(100 * t)) - bar.n)
    bar.close()
    elapsed = time.perf_counter() - start
    if window_n:
        writer.writerow((step, tokens, f"{window_loss / window_n:.5f}", f"{lr:.6g}", f"{elapsed:.2f}"))
    out_dir = Path(out_dir)
    save_checkpoint(model.cpu(), tok, out_dir, arch["max_positions"])
    with atomic_path(out_dir / "train_log.csv") as tmp:
        tmp.write_text(log.getvalue())
    summary = {
        "steps": step,
        "tokens": tokens,
        "epochs_of_data": round(epochs_of_data, 4),
        "elapsed_s": round(elapsed, 2),
        "tokens_per_s": round(tokens / elapsed, 1),
        "parameters": sum(p.numel() for p in model.parameters()),
        "budget": recipe["budget"],
        "device": str(device),
        "pretrained": True,
    }
    write_json(out_dir / "summary.json", summary)
    return summary
