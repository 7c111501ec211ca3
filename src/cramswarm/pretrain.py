"""Masked-LM pretraining of crammed BERT under an explicit budget (tokens, optimizer steps or seconds).

The learning-rate schedule is a function of budget progress t in [0, 1] (Cramming §4.3: with a wall-clock
budget the schedule follows elapsed time; with a token or step budget it follows tokens or steps, which
makes mini runs repeatable). Every optimizer step's realised LR is logged.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from cramswarm import budget as budgets
from cramswarm.data import tokenizer as tokenization
from cramswarm.data.packing import load_blocks
from cramswarm.distributed import World
from cramswarm.io import atomic_path, write_json
from cramswarm.models.crammed_bert import unwrap_compiled
from cramswarm.precision import autocast, choose_precision
from cramswarm.provenance import provenance
from cramswarm.training import (
    budget_progress,
    build_model,
    make_optimizer,
    mask_tokens,
    resolve_device,
    save_checkpoint,
    step_accumulation,
    step_lr,
)

# progress: budget fraction at the start of the step, where its LR multiplier and batch size were set.
# A non-finite loss reloads the weights of the last snapshot (taken every SNAPSHOT_EVERY_STEPS optimizer steps) and
# skips its batch; more than MAX_NONFINITE_STEPS such steps end the run (the recipe is unstable, not unlucky).
SNAPSHOT_EVERY_STEPS = 50
MAX_NONFINITE_STEPS = 10
# recipe keys that change how a run executes but not what it computes: a state saved under other values resumes
RUN_ONLY_KEYS = ("compile_mode", "devices", "nodes", "prefetch", "attention_backend")
LOG_COLUMNS = ("step", "tokens", "progress", "loss", "lr", "lr_multiplier", "batch_sequences", "elapsed_s", "eval_loss")


def init_random(arch: dict, tokenizer_path: str | Path, out_dir: str | Path, seed: int) -> dict:
    """The no-pretraining baseline: a randomly initialised model saved like a pretrained one."""
    tok = tokenization.load(tokenizer_path)
    model = build_model(arch, tok.get_vocab_size(), seed)
    save_checkpoint(model, tok, out_dir, arch["max_positions"])
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "pretrained": False,
        "provenance": provenance({"arch": arch}, seed),
    }


def fingerprint(recipe: dict, arch: dict, blocks_path: str | Path, vocab_size: int) -> str:
    """What a saved training state must match to be resumed: the recipe (minus save cadence and how it runs: the
    compile mode and the number of processes), arch and data."""
    relevant = {k: v for k, v in recipe.items() if not k.startswith("resume_every") and k not in RUN_ONLY_KEYS}
    stat = Path(blocks_path).stat()
    payload = json.dumps([relevant, arch, vocab_size, stat.st_size], sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


class HeldOut:
    """Held-out MLM loss on fixed blocks with fixed masks (one seed for every run, so recipes compare)."""

    SEED = 1234

    def __init__(self, blocks: np.ndarray, rate: float, vocab_size: int, micro: int):
        generator = torch.Generator().manual_seed(self.SEED)
        batch = torch.from_numpy(blocks.astype(np.int64))
        self.inputs, self.labels = mask_tokens(batch, rate, "bernoulli", vocab_size, generator)
        self.micro = micro

    @torch.no_grad()
    def loss(self, model, precision: str, device: torch.device) -> float:
        was_training = model.training
        model.eval()
        # summed on the device and read once (one host sync per evaluation, not one per micro-batch)
        total, count = torch.zeros((), device=device), 0
        for start in range(0, len(self.inputs), self.micro):
            labels = self.labels[start : start + self.micro]
            n = int((labels != -100).sum())  # labels live on the host: no device sync
            if n == 0:
                continue
            with autocast(precision, device):
                inputs = to_device(self.inputs[start : start + self.micro], device)
                out = model(inputs, labels=to_device(labels, device))
            total, count = total + out.loss.float() * n, count + n
        model.train(was_training)
        return total.item() / max(count, 1)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on ``device``: from the host to CUDA through pinned memory, copied without blocking the host."""
    if device.type != "cuda" or tensor.device.type == "cuda":
        return tensor
    return (tensor if tensor.is_pinned() else tensor.pin_memory()).to(device, non_blocking=True)


class MicroBatches:
    """The training blocks of each micro-batch on the device: rows ``[cursor, cursor + micro)`` of the training
    blocks (wrapping around), in row order.

    With ``prefetch``, a background thread gathers the next micro-batch's rows (and pins them on CUDA) while the
    current one computes; :meth:`take` then only starts its non-blocking copy. The batch is a function of the
    cursor alone, which the caller keeps (and saves with the training state): a prefetched batch is used only when
    it was prepared for the cursor asked for, so prefetching never changes which blocks a step sees.
    """

    def __init__(self, blocks: np.ndarray, n_blocks: int, micro: int, device: torch.device, prefetch: bool):
        self.blocks, self.n_blocks, self.micro, self.device = blocks, n_blocks, micro, device
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="prefetch") if prefetch else None
        self._pending: tuple[int, Future] | None = None

    def _host(self, cursor: int) -> torch.Tensor:
        idx = np.sort(np.arange(cursor, cursor + self.micro) % self.n_blocks)
        batch = torch.from_numpy(self.blocks[idx].astype(np.int64))
        return batch.pin_memory() if self.device.type == "cuda" else batch

    def take(self, cursor: int) -> torch.Tensor:
        """The micro-batch at ``cursor``, on the device; with prefetching, the next one is started."""
        if self._pending is not None and self._pending[0] == cursor:
            batch = self._pending[1].result()
        else:
            batch = self._host(cursor)
        if self._pool is not None:
            following = (cursor + self.micro) % self.n_blocks
            self._pending = (following, self._pool.submit(self._host, following))
        return to_device(batch, self.device)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def compile_model(model: torch.nn.Module, recipe: dict):
    """The recipe's forward: the module itself, or torch.compile of it in ``compile_mode``."""
    if not recipe["compile"]:
        return model
    mode = recipe.get("compile_mode", "default")
    return torch.compile(model, mode=None if mode == "default" else mode)


# pretrain.attention_backend -> the torch.nn.attention.SDPBackend it allows (auto: torch chooses among all)
ATTENTION_BACKENDS = {"math": "MATH", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}


def attention_backend(recipe: dict, model: torch.nn.Module, precision: str, device: torch.device):
    """A context running scaled-dot-product attention with the recipe's ``attention_backend`` kernel only.

    ``auto`` leaves the choice to torch. Another choice is tried once on a short input first (in eval mode, so no
    dropout draw changes the run), and refused with a message naming the key where this device, dtype or shape
    has no such kernel (e.g. ``efficient`` on a CPU), rather than failing inside the first step.
    """
    name = recipe.get("attention_backend", "auto")
    if name == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name not in ATTENTION_BACKENDS:
        allowed = ", ".join(["auto", *ATTENTION_BACKENDS])
        raise ValueError(f"pretrain.attention_backend: unknown {name!r}; allowed: {allowed}")
    backend = getattr(SDPBackend, ATTENTION_BACKENDS[name])
    was_training = model.training
    model.eval()
    probe = torch.full((2, min(16, model.config.max_position_embeddings)), tokenization.MASK_ID, device=device)
    try:
        with sdpa_kernel([backend]), autocast(precision, device):
            model(probe)
    except RuntimeError as error:
        raise ValueError(
            f"pretrain.attention_backend: {name} attention does not run here ({device.type}, precision "
            f"{precision}); use auto or math. torch said: {str(error).splitlines()[0]}"
        ) from error
    finally:
        model.train(was_training)
    return sdpa_kernel([backend])


def _slice_loss(forward, inputs, labels, all_labels, precision: str, device: torch.device):
    """This process's share of a micro-batch's mean MLM loss: its rows' mean loss weighted by its share of the
    micro-batch's predicted tokens, so that the shares sum to the loss one process computes on the whole
    micro-batch (and their gradients to its gradient). The counts stay on the device (no host read)."""
    predicted, total = (labels != -100).sum(), (all_labels != -100).sum().clamp(min=1)
    with autocast(precision, device):
        out = forward(to_device(inputs, device), labels=to_device(labels, device))
    # nothing to predict in this slice: a zero loss (its mean over no tokens is NaN) that still reaches every
    # parameter, with zero gradients
    return torch.where(predicted > 0, out.loss, torch.zeros_like(out.loss)) * (predicted / total)


def _clone_state(value):
    """A deep copy of an optimizer state dict (tensors cloned, so later steps do not change it)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone_state(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone_state(v) for v in value]
    return value


def _save_state(path: Path, payload: dict) -> None:
    with atomic_path(path) as tmp:  # creates the folder
        torch.save(payload, tmp)


def _load_state(path: Path | None, expected: str) -> dict | None:
    if path is None or not path.is_file():
        return None
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state.get("fingerprint") != expected:
        print(f"ignoring training state {path}: it belongs to a different recipe, arch or data", flush=True)
        return None
    return state


def resolve_budget(recipe: dict, device: torch.device) -> dict:
    """The recipe's budget in tokens, steps or seconds on ``device`` (:mod:`cramswarm.budget`)."""
    budget = recipe["budget"]
    if not budgets.is_normalised(budget):
        return budgets.resolve(budget)
    peak, source = budgets.device_peak(budget, device)
    return budgets.resolve(budget, peak, source)


def data_passes_planned(budget: dict, n_blocks: int, block_tokens: int, batch_sequences: int) -> float | None:
    """Passes over the training blocks a token or step budget will make (None for seconds: time decides)."""
    if budget["unit"] == "tokens":
        return budget["value"] / (n_blocks * block_tokens)
    if budget["unit"] == "steps":
        return budget["value"] * batch_sequences / n_blocks  # an upper bound under a batch ramp
    return None


def load_training_data(
    recipe: dict, tokenizer_path: str | Path, blocks_path: str | Path, expected_vocab: int | None = None
):
    """(tokenizer, blocks, training blocks): the tokenizer and packed blocks a pretraining run reads, checked
    against each other and the recipe; the last ``eval_blocks`` rows are held out, so rows
    ``[0, training blocks)`` are trained on."""
    tok = tokenization.load(tokenizer_path)
    vocab_size = tok.get_vocab_size()
    if expected_vocab is not None and expected_vocab != vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer_path} has {vocab_size} tokens but this run expects vocab size {expected_vocab} "
            "(tokenizer.vocab_sizes); rebuild the tokenizer"
        )
    blocks = load_blocks(blocks_path)
    if int(blocks.max(initial=0)) >= vocab_size:
        raise ValueError(f"packed data {blocks_path} holds token ids >= the tokenizer's vocab size {vocab_size}")
    micro = recipe["micro_batch_sequences"]
    n_blocks = blocks.shape[0] - recipe["eval_blocks"]
    if n_blocks < micro:
        raise ValueError(
            f"pretrain.eval_blocks: holding out {recipe['eval_blocks']} of {blocks.shape[0]} packed blocks leaves "
            f"{n_blocks}, fewer than one micro-batch ({micro}); lower eval_blocks or use a larger corpus"
        )
    return tok, blocks, n_blocks


def choose_sweep_lr(summaries: dict) -> dict:
    """The peak LR of a schedule sweep whose run reached the lowest final held-out loss.

    ``summaries``: {peak LR (number or its string): path of that run's ``summary.json``}. Runs without a finite
    held-out loss (diverged, or no evaluation) are not chosen; ties go to the smaller LR. Returns
    ``{"chosen_lr", "eval_loss_by_lr", "runs"}`` (the evidence summary.json keeps)."""
    losses, runs = {}, {}
    for lr, path in summaries.items():
        done = json.loads(Path(path).read_text())
        loss = done.get("eval_loss")
        losses[float(lr)] = loss if isinstance(loss, (int, float)) and math.isfinite(loss) else None
        runs[float(lr)] = done.get("run") or str(Path(path).parent)
    finite = {lr: loss for lr, loss in losses.items() if loss is not None}
    if not finite:
        raise ValueError(f"no run of the LR sweep has a finite held-out loss: {summaries}")
    chosen = min(sorted(finite), key=lambda lr: finite[lr])
    return {"chosen_lr": chosen, "eval_loss_by_lr": dict(sorted(losses.items())), "runs": dict(sorted(runs.items()))}


def pretrain(
    recipe: dict,
    arch: dict,
    blocks_path: str | Path,
    tokenizer_path: str | Path,
    out_dir: str | Path,
    progress: bool = True,
    state_dir: str | Path | None = None,
    run: str | None = None,
    expected_vocab: int | None = None,
    extra_summary: dict | None = None,
) -> dict | None:
    """Train until the budget is spent; write the checkpoint, ``train_log.csv`` and ``summary.json`` (with
    ``extra_summary``'s keys added).

    With ``state_dir``, the full training state (weights, optimizer, scaler, RNG, counters, log) is saved
    there atomically every ``resume_every_seconds`` / ``resume_every_steps``; a rerun with the same recipe,
    arch and data continues from it (at any number of processes), and it is deleted once the checkpoint is written.

    Started by torch's launcher (:mod:`cramswarm.distributed`), every process trains its slice of each
    micro-batch and only rank 0 prints, evaluates and writes files; the others return None.
    """
    device = resolve_device(recipe["device"])
    world = World.join(device.type)
    try:
        return _pretrain(
            world, device, recipe, arch, blocks_path, tokenizer_path, out_dir, progress, state_dir, run, expected_vocab,
            extra_summary or {},
        )
    finally:
        world.close()


def _pretrain(
    world: World, device: torch.device, recipe, arch, blocks_path, tokenizer_path, out_dir, progress, state_dir, run,
    expected_vocab, extra_summary,
) -> dict | None:  # fmt: skip
    """:func:`pretrain` in one process of ``world``."""
    if world.size > 1 and device.type == "cuda":
        device = torch.device("cuda", world.local_rank)
    say = print if world.main else lambda *args, **kwargs: None
    chosen = choose_precision(recipe["precision"], device)
    precision = chosen.name
    say(f"precision {precision} ({chosen.reason})", flush=True)
    tok, blocks, n_blocks = load_training_data(recipe, tokenizer_path, blocks_path, expected_vocab)
    vocab_size = tok.get_vocab_size()
    micro = recipe["micro_batch_sequences"]
    if micro % world.size:
        raise ValueError(
            f"pretrain.micro_batch_sequences: {micro} sequences cannot be split evenly over {world.size} processes "
            "(devices x nodes); every process takes an equal slice of each micro-batch"
        )
    # this process's rows of every micro-batch: N processes x micro/N rows see exactly the blocks of 1 x micro
    share = micro // world.size
    rows = slice(world.rank * share, (world.rank + 1) * share)
    use_heldout = recipe["eval_blocks"] and world.main
    heldout = HeldOut(blocks[n_blocks:], recipe["eval_mask_rate"], vocab_size, micro) if use_heldout else None
    block_tokens = blocks.shape[1]
    recipe = budgets.for_model(recipe, arch, vocab_size, block_tokens)
    if "model_tflop" in recipe["budget"]:
        say(budgets.describe_counted(recipe["budget"]), flush=True)

    budget = resolve_budget(recipe, device)
    if budgets.is_normalised(recipe["budget"]):
        say(
            f"budget {recipe['budget']} -> {budget['value']:,.0f} s on this device "
            f"({budget['device_peak_tflops']:.1f} TFLOP/s, {budget['device_peak_source']})",
            flush=True,
        )
    planned_passes = data_passes_planned(budget, n_blocks, block_tokens, recipe["batch_sequences"])
    if planned_passes is not None and planned_passes > 1:
        say(
            f"warning: this budget reads the {n_blocks:,} training blocks {planned_passes:.2f} times; the data "
            "order (e.g. the sentence-length curriculum) restarts on every pass",
            flush=True,
        )

    if arch["sparse_prediction"] == "static" and recipe["mask_mode"] == "fixed":
        rate = arch.get("sparse_prediction_rate", 0.25)
        if max(1, round(recipe["mask_rate"] * block_tokens)) * share > round(rate * share * block_tokens):
            say(
                f"warning: sparse_prediction_rate {rate} decodes fewer positions than mask_rate "
                f"{recipe['mask_rate']} masks; the loss leaves the last masked positions of each micro-batch out",
                flush=True,
            )
    model = build_model(arch, vocab_size, recipe["seed"], dropout=recipe.get("dropout", 0.0)).to(device)
    model.train()
    optimizer = make_optimizer(model, recipe, fused=device.type == "cuda")
    scaler = torch.amp.GradScaler(enabled=precision == "fp16")
    # the training masks are drawn where the model runs (on CPU the same draws as earlier versions)
    generator = torch.Generator(device=device).manual_seed(recipe["seed"])

    counters = dict(
        step=0,
        tokens=0,
        cursor=0,
        epochs_of_data=0.0,
        window_loss=0.0,
        window_n=0,
        next_eval=1,
        elapsed_s=0.0,
        resumed_from_step=None,
        sequences=0,
        skipped_nonfinite=0,
        reloaded=0,
    )
    log_text = ",".join(LOG_COLUMNS) + "\n"
    state_path = Path(state_dir) / "state.pt" if state_dir is not None else None
    key = fingerprint(recipe, arch, blocks_path, vocab_size)
    if (state := _load_state(state_path, key)) is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        counters, log_text = {**counters, **state["counters"]}, state["log"]
        saved_on = state.get("generator_device", "cpu")  # states of earlier versions: a CPU generator
        if saved_on == device.type:
            generator.set_state(state["generator"])
        else:  # a state saved on another kind of device: its generator state does not fit this one's
            generator.manual_seed(recipe["seed"] + counters["step"])
            say(f"masks after the resume are drawn afresh (seed + step): the state was saved on {saved_on}", flush=True)
        counters["resumed_from_step"] = counters["step"]
        say(f"resuming from {state_path} at step {counters['step']} ({counters['tokens']:,} tokens)", flush=True)
    if world.size > 1:
        torch.manual_seed(recipe["seed"] + world.rank)  # dropout masks differ between processes
        trained = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False
        )
    else:
        trained = model
    forward = compile_model(trained, recipe)

    def save_state() -> None:
        _save_state(
            state_path,
            {
                "fingerprint": key,
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(),
                "generator": generator.get_state(),
                "generator_device": device.type,
                "counters": dict(counters),
                "log": log_text,
            },
        )

    c = counters
    start, last_save = time.perf_counter(), time.perf_counter()
    elapsed = lambda: c["elapsed_s"] + time.perf_counter() - start  # noqa: E731
    bar = tqdm(total=100, desc=run or "pretrain", unit="%", disable=not (progress and world.main), mininterval=2.0)

    def clock() -> float:
        """Elapsed seconds; under a seconds budget with several processes, rank 0's (they must stop together)."""
        if world.size == 1 or budget["unit"] != "seconds":
            return elapsed()
        return float(world.from_main(torch.tensor([elapsed()], dtype=torch.float64, device=device)).item())

    # the last good weights and optimizer state, in memory: a non-finite loss reloads them (Cramming's reference
    # reloads its last checkpoint), skips the batch that caused it and counts it in the summary
    last_good = None
    # the loader's thread and the attention kernel choice last as long as the loop
    running = contextlib.ExitStack()
    running.enter_context(attention_backend(recipe, model, precision, device))
    loader = MicroBatches(blocks, n_blocks, micro, device, recipe["prefetch"])
    running.callback(loader.close)
    try:
        while (t := budget_progress(budget, c["tokens"], c["step"], clock())) < 1.0:
            lr, multiplier = step_lr(recipe, t, c["sequences"])
            for group in optimizer.param_groups:
                group["lr"] = lr
            accumulate = step_accumulation(recipe, t, c["sequences"])
            # the step's loss is summed on the device and read once, after the last micro-batch: no host sync per
            # micro-step (a .item() there would wait for every forward and backward to finish)
            step_loss = torch.zeros((), device=device)
            for micro_step in range(accumulate):
                batch = loader.take(c["cursor"])
                c["cursor"] = (c["cursor"] + micro) % n_blocks
                c["epochs_of_data"] += micro / n_blocks
                # every process masks the whole micro-batch with the shared generator (the same draws as one process)
                # and keeps its rows
                inputs, labels = mask_tokens(batch, recipe["mask_rate"], recipe["mask_mode"], vocab_size, generator)
                # inner micro-steps accumulate gradients locally; the last one all-reduces them
                inner = world.size > 1 and micro_step < accumulate - 1
                with trained.no_sync() if inner else contextlib.nullcontext():
                    if world.size == 1:
                        with autocast(precision, device):
                            loss = forward(inputs, labels=labels).loss
                    else:
                        loss = _slice_loss(forward, inputs[rows], labels[rows], labels, precision, device)
                    loss = loss / accumulate
                    scaler.scale(loss * world.size).backward()  # DDP averages gradients over processes; undo that
                step_loss += loss.detach().float()
                c["tokens"] += micro * block_tokens
                c["sequences"] += micro
            # the one host read of this optimizer step (every process reads the same sum, so all skip or step alike)
            step_loss = world.all_sum(step_loss).item()
            if not math.isfinite(step_loss):
                c["skipped_nonfinite"] += 1
                optimizer.zero_grad(set_to_none=True)
                if last_good is not None:
                    model.load_state_dict(last_good["model"])
                    optimizer.load_state_dict(last_good["optimizer"])
                    c["reloaded"] += 1
                say(
                    f"non-finite loss {step_loss} at step {c['step'] + 1}: batch skipped"
                    + (", weights reloaded from the last good step" if last_good is not None else ""),
                    flush=True,
                )
                if c["skipped_nonfinite"] > MAX_NONFINITE_STEPS:
                    raise FloatingPointError(
                        f"pretraining loss was non-finite in {c['skipped_nonfinite']} steps "
                        f"(last at step {c['step'] + 1}); "
                        "lower pretrain.lr"
                    )
                continue
            scaler.unscale_(optimizer)
            if recipe["grad_clip_norm"] is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), recipe["grad_clip_norm"])
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            c["step"] += 1
            if c["step"] % SNAPSHOT_EVERY_STEPS == 1:
                last_good = {
                    "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
                    "optimizer": _clone_state(optimizer.state_dict()),
                }
            c["window_loss"], c["window_n"] = c["window_loss"] + step_loss, c["window_n"] + 1
            done = budget_progress(budget, c["tokens"], c["step"], elapsed())
            eval_loss = ""
            if heldout is not None and done * recipe["eval_points"] >= c["next_eval"] - 1e-9:
                eval_loss = f"{heldout.loss(model, precision, device):.5f}"
                c["next_eval"] = math.floor(done * recipe["eval_points"] + 1e-9) + 1
            if c["step"] % recipe["log_every_steps"] == 0 or eval_loss or done >= 1.0:
                mean_loss = c["window_loss"] / c["window_n"]
                row = (
                    c["step"],
                    c["tokens"],
                    f"{t:.5f}",
                    f"{mean_loss:.5f}",
                    f"{lr:.6g}",
                    f"{multiplier:.5f}",
                    accumulate * micro,
                    f"{elapsed():.2f}",
                    eval_loss,
                )
                log_text += ",".join(map(str, row)) + "\n"
                c["last_loss"] = mean_loss
                if eval_loss:
                    c["last_eval_loss"] = float(eval_loss)
                bar.set_postfix(
                    tokens=f"{c['tokens']:,}",
                    loss=f"{mean_loss:.3f}",
                    lr=f"{lr:.2e}",
                    tok_s=f"{c['tokens'] / elapsed():,.0f}",
                )
                c["window_loss"], c["window_n"] = 0.0, 0
            bar.update(min(100, int(100 * done)) - bar.n)
            if state_path is not None and done < 1.0 and world.main:
                every = recipe["resume_every_steps"]
                due = time.perf_counter() - last_save >= recipe["resume_every_seconds"]
                if (every and c["step"] % every == 0) or due:
                    c["elapsed_s"] = elapsed()
                    start = last_save = time.perf_counter()
                    save_state()
    finally:
        running.close()
    bar.close()
    total_s = elapsed()
    if not world.main:  # rank 0 writes the outputs
        return None
    out_dir = Path(out_dir)
    save_checkpoint(unwrap_compiled(model).cpu(), tok, out_dir, arch["max_positions"])
    with atomic_path(out_dir / "train_log.csv") as tmp:
        tmp.write_text(log_text)
    summary = {
        "run": run,
        "steps": c["step"],
        "tokens": c["tokens"],
        "epochs_of_data": round(c["epochs_of_data"], 4),
        "elapsed_s": round(total_s, 2),
        "tokens_per_s": round(c["tokens"] / total_s, 1),
        "final_loss": round(c.get("last_loss", float("nan")), 5),
        "eval_loss": c.get("last_eval_loss"),
        "resumed_from_step": c["resumed_from_step"],
        "parameters": sum(p.numel() for p in model.parameters()),
        "budget": recipe["budget"],
        "budget_resolved": budget,
        "data_passes": round(c["epochs_of_data"], 4),
        "data_wrapped": c["epochs_of_data"] > 1.0,
        "skipped_nonfinite": c["skipped_nonfinite"],
        "reloaded_after_nonfinite": c["reloaded"],
        "precision": precision,
        "precision_reason": chosen.reason,
        "device": str(device),
        "processes": world.size,
        "recipe": recipe,
        "arch": arch,
        "pretrained": True,
        "provenance": provenance({"recipe": recipe, "arch": arch}, recipe["seed"], str(device)),
        **extra_summary,
    }
    write_json(out_dir / "summary.json", summary)
    if state_path is not None:
        state_path.unlink(missing_ok=True)
    return summary
