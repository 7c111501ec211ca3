"""Masked-LM pretraining of crammed BERT under an explicit budget (tokens, optimizer steps, model TFLOP or seconds).

The learning-rate schedule is a function of budget progress t in [0, 1] (Cramming §4.3: with a wall-clock
budget the schedule follows elapsed time; with a token or step budget it follows tokens or steps, which
makes mini runs repeatable). Every optimizer step's realised LR is logged.

:func:`pretrain` sets up a :class:`CrammingRun` (data, model, optimizer, budget), resumes or starts its
:class:`~cramswarm.train_state.TrainState`, runs the loop (:func:`_train`: set the LR, accumulate gradients, recover
from a non-finite loss or step, evaluate, log, save, each a named step of the run) and writes the outputs with
:func:`cramswarm.run_outputs.write_outputs`, as SWARM pretraining does.
"""

from __future__ import annotations

import contextlib
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
from cramswarm.impl import PretrainImpl
from cramswarm.models.crammed_bert import unwrap_compiled
from cramswarm.precision import autocast, choose_precision
from cramswarm.provenance import provenance
from cramswarm.run_outputs import summary as run_summary
from cramswarm.run_outputs import write_outputs
from cramswarm.train_state import TrainState, clone_state, fingerprint, load_state, save_state
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

# A non-finite loss reloads the weights of the last snapshot (taken every SNAPSHOT_EVERY_STEPS optimizer steps) and
# skips its batch; more than MAX_NONFINITE_STEPS such steps end the run (the recipe is unstable, not unlucky).
SNAPSHOT_EVERY_STEPS = 50
MAX_NONFINITE_STEPS = 10
WRAP_ESTIMATE_SHARE = 0.02  # a seconds budget's data wrap is estimated once this share of it has passed


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


def compile_model(model: torch.nn.Module, impl: PretrainImpl):
    """The run's forward: the module itself, or torch.compile of it in ``impl.compile_mode``."""
    if not impl.compile:
        return model
    mode = impl.compile_mode
    return torch.compile(model, mode=None if mode == "default" else mode)


# pretrain.impl.attention_backend -> the torch.nn.attention.SDPBackend it allows (auto: torch chooses among all)
ATTENTION_BACKENDS = {"math": "MATH", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}


def attention_backend(impl: PretrainImpl, model: torch.nn.Module, precision: str, device: torch.device):
    """A context running scaled-dot-product attention with ``impl.attention_backend``'s kernel only.

    ``auto`` leaves the choice to torch. Another choice is tried once on a short input first (in eval mode, so no
    dropout draw changes the run), and refused with a message naming the key where this device, dtype or shape
    has no such kernel (e.g. ``efficient`` on a CPU), rather than failing inside the first step.
    """
    name = impl.attention_backend
    if name == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name not in ATTENTION_BACKENDS:
        allowed = ", ".join(["auto", *ATTENTION_BACKENDS])
        raise ValueError(f"pretrain.impl.attention_backend: unknown {name!r}; allowed: {allowed}")
    backend = getattr(SDPBackend, ATTENTION_BACKENDS[name])
    was_training = model.training
    model.eval()
    probe = torch.full((2, min(16, model.config.max_position_embeddings)), tokenization.MASK_ID, device=device)
    try:
        with sdpa_kernel([backend]), autocast(precision, device):
            model(probe)
    except RuntimeError as error:
        raise ValueError(
            f"pretrain.impl.attention_backend: {name} attention does not run here ({device.type}, precision "
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
    impl: PretrainImpl | None = None,
) -> dict | None:
    """Train until the budget is spent, executing as ``impl`` says (default: :class:`PretrainImpl`'s defaults);
    write the checkpoint, ``train_log.csv`` and ``summary.json`` (with ``extra_summary``'s keys added).

    With ``state_dir``, the full training state (weights, optimizer, scaler, RNG, counters, log) is saved
    there atomically every ``impl.resume_every_seconds`` / ``resume_every_steps``; a rerun with the same recipe,
    arch and data continues from it (at any number of processes), and it is deleted once the checkpoint is written.

    Started by torch's launcher (:mod:`cramswarm.distributed`), every process trains its slice of each
    micro-batch and only rank 0 prints, evaluates and writes files; the others return None.
    """
    impl = impl or PretrainImpl()
    device = resolve_device(impl.device)
    world = World.join(device.type)
    try:
        return _pretrain(
            world, device, impl, recipe, arch, blocks_path, tokenizer_path, out_dir, progress, state_dir, run,
            expected_vocab, extra_summary or {},
        )
    finally:
        world.close()


def _pretrain(
    world: World, device: torch.device, impl: PretrainImpl, recipe, arch, blocks_path, tokenizer_path, out_dir,
    progress, state_dir, run, expected_vocab, extra_summary,
) -> dict | None:  # fmt: skip
    """:func:`pretrain` in one process of ``world``: set up, resume or start, train, write the outputs."""
    if world.size > 1 and device.type == "cuda":
        device = torch.device("cuda", world.local_rank)
    r = CrammingRun(world, device, impl, recipe, arch, blocks_path, tokenizer_path, expected_vocab, progress, run)
    state = r.resume_or_start(Path(state_dir) / "state.pt" if state_dir is not None else None)
    with r.running():
        _train(r, state)
    if not world.main:  # rank 0 writes the outputs
        return None
    summary = write_outputs(out_dir, unwrap_compiled(r.model).cpu(), r.tok, arch["max_positions"], state.log,
                            r.summary(state, extra_summary))
    if r.state_path is not None:
        r.state_path.unlink(missing_ok=True)
    return summary


def _train(r: CrammingRun, s: TrainState) -> None:
    """The Cramming loop: one optimizer step per pass until the budget is spent, each step's LR and batch size
    set by budget progress at its start."""
    while (t := r.progress(s)) < 1.0:
        lr, multiplier = r.set_lr(t, s)
        accumulate = step_accumulation(r.recipe, t, s.sequences)
        step_loss = r.accumulate_gradients(s, accumulate)
        if not math.isfinite(step_loss):
            r.recover_from_nonfinite(s, step_loss)
            continue
        r.optimizer_step(s, step_loss)
        done = budget_progress(r.budget, s.tokens, s.step, r.elapsed(s))
        eval_loss = r.evaluate_if_due(s, done)
        r.log_if_due(s, t, done, lr, multiplier, accumulate, eval_loss)
        r.warn_wrap_once(s, done)
        r.save_if_due(s, done)


class CrammingRun:
    """One process's pretraining run: its data, model, optimizer and budget, and the named steps of the loop
    (:func:`_train`). Only rank 0 prints, evaluates, saves state and writes outputs."""

    def __init__(self, world: World, device: torch.device, impl: PretrainImpl, recipe: dict, arch: dict, blocks_path,
                 tokenizer_path, expected_vocab: int | None, progress: bool, run: str | None):  # fmt: skip
        self.world, self.device, self.impl, self.arch, self.blocks_path = world, device, impl, arch, blocks_path
        self.run = run
        self.say = print if world.main else lambda *args, **kwargs: None
        self.precision = choose_precision(recipe["precision"], device)
        self.say(f"precision {self.precision.name} ({self.precision.reason})", flush=True)
        self.tok, self.blocks, self.n_blocks = load_training_data(recipe, tokenizer_path, blocks_path, expected_vocab)
        self.vocab_size, self.block_tokens = self.tok.get_vocab_size(), self.blocks.shape[1]
        self.micro = recipe["micro_batch_sequences"]
        if self.micro % world.size:
            raise ValueError(
                f"pretrain.micro_batch_sequences: {self.micro} sequences cannot be split evenly over {world.size} "
                "processes (devices x nodes); every process takes an equal slice of each micro-batch"
            )
        # this process's rows of every micro-batch: N processes x micro/N rows see exactly the blocks of 1 x micro
        share = self.micro // world.size
        self.rows = slice(world.rank * share, (world.rank + 1) * share)
        use_heldout = recipe["eval_blocks"] and world.main
        self.heldout = (HeldOut(self.blocks[self.n_blocks :], recipe["eval_mask_rate"], self.vocab_size, self.micro)
                        if use_heldout else None)  # fmt: skip
        self.recipe = recipe = budgets.for_model(recipe, arch, self.vocab_size, self.block_tokens)
        self.budget = resolve_budget(recipe, device)
        self._announce_budget(share)
        self.model = build_model(arch, self.vocab_size, recipe["seed"], dropout=recipe.get("dropout", 0.0)).to(device)
        self.model.train()
        self.optimizer = make_optimizer(self.model, recipe, fused=device.type == "cuda")
        self.scaler = torch.amp.GradScaler(enabled=self.precision.name == "fp16")
        # the training masks are drawn where the model runs (on CPU the same draws as earlier versions)
        self.generator = torch.Generator(device=device).manual_seed(recipe["seed"])
        self.bar = tqdm(total=100, desc=run or "pretrain", unit="%", disable=not (progress and world.main),
                        mininterval=2.0)  # fmt: skip
        self.last_good = None  # weights and optimizer state of the last snapshot (non-finite recovery)
        self.wrap_checked = False  # a seconds budget's wrap is estimated once (warn_wrap_once)
        self.state_path: Path | None = None
        self.start = self.last_save = time.perf_counter()

    def _announce_budget(self, share: int) -> None:
        """The budget's conversions and the warnings it deserves, before the first step."""
        recipe, arch, say = self.recipe, self.arch, self.say
        if "model_tflop" in recipe["budget"]:
            say(budgets.describe_counted(recipe["budget"]), flush=True)
        if budgets.is_normalised(recipe["budget"]):
            say(f"budget {recipe['budget']} -> {self.budget['value']:,.0f} s on this device "
                f"({self.budget['device_peak_tflops']:.1f} TFLOP/s, {self.budget['device_peak_source']})", flush=True)
        passes = data_passes_planned(self.budget, self.n_blocks, self.block_tokens, recipe["batch_sequences"])
        if passes is not None and passes > 1:
            say(f"warning: this budget reads the {self.n_blocks:,} training blocks {passes:.2f} times; the data "
                "order (e.g. the sentence-length curriculum) restarts on every pass", flush=True)
        if arch["sparse_prediction"] == "static" and recipe["mask_mode"] == "fixed":
            rate = arch.get("sparse_prediction_rate", 0.25)
            if max(1, round(recipe["mask_rate"] * self.block_tokens)) * share > round(rate * share * self.block_tokens):
                say(f"warning: sparse_prediction_rate {rate} decodes fewer positions than mask_rate "
                    f"{recipe['mask_rate']} masks; the loss leaves the last masked positions of each micro-batch out",
                    flush=True)

    # -- resume ------------------------------------------------------------------------------------------------
    def resume_or_start(self, state_path: Path | None) -> TrainState:
        """The saved state at ``state_path`` if it is this run's (weights, optimizer, scaler, masks, counters,
        log restored), else a fresh one; then the model as this process trains it (DDP, compiled)."""
        self.state_path, self.key = state_path, fingerprint(self.recipe, self.arch, self.blocks_path, self.vocab_size)
        state = TrainState()
        if (saved := load_state(state_path, self.key)) is not None:
            self.model.load_state_dict(saved["model"])
            self.optimizer.load_state_dict(saved["optimizer"])
            self.scaler.load_state_dict(saved["scaler"])
            state = TrainState.saved(saved)
            saved_on = saved.get("generator_device", "cpu")  # states of earlier versions: a CPU generator
            if saved_on == self.device.type:
                self.generator.set_state(saved["generator"])
            else:  # a state saved on another kind of device: its generator state does not fit this one's
                self.generator.manual_seed(self.recipe["seed"] + state.step)
                self.say(f"masks after the resume are drawn afresh (seed + step): the state was saved on {saved_on}",
                         flush=True)  # fmt: skip
            state.resumed_from_step = state.step
            self.say(f"resuming from {state_path} at step {state.step} ({state.tokens:,} tokens)", flush=True)
        if self.world.size > 1:
            torch.manual_seed(self.recipe["seed"] + self.world.rank)  # dropout masks differ between processes
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            self.trained = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=device_ids,
                                                                     broadcast_buffers=False)  # fmt: skip
        else:
            self.trained = self.model
        self.forward = compile_model(self.trained, self.impl)
        return state

    @contextlib.contextmanager
    def running(self):
        """The loop's surroundings: the attention kernel choice and the micro-batch loader's thread."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(attention_backend(self.impl, self.model, self.precision.name, self.device))
            self.loader = MicroBatches(self.blocks, self.n_blocks, self.micro, self.device, self.impl.prefetch)
            stack.callback(self.loader.close)
            yield
        self.bar.close()

    # -- the steps of the loop -----------------------------------------------------------------------------------
    def elapsed(self, s: TrainState) -> float:
        return s.elapsed_s + time.perf_counter() - self.start

    def progress(self, s: TrainState) -> float:
        """Budget progress at the start of a step; under a seconds budget with several processes, rank 0's clock
        (they must stop together)."""
        clock = self.elapsed(s)
        if self.world.size > 1 and self.budget["unit"] == "seconds":
            clock = float(self.world.from_main(torch.tensor([clock], dtype=torch.float64, device=self.device)).item())
        return budget_progress(self.budget, s.tokens, s.step, clock)

    def set_lr(self, t: float, s: TrainState) -> tuple[float, float]:
        lr, multiplier = step_lr(self.recipe, t, s.sequences)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr, multiplier

    def accumulate_gradients(self, s: TrainState, accumulate: int) -> float:
        """Forward and backward over ``accumulate`` micro-batches; the step's loss, read from the device once."""
        step_loss = torch.zeros((), device=self.device)  # summed on the device: no host sync per micro-step
        for micro_step in range(accumulate):
            batch = self.loader.take(s.cursor)
            s.cursor = (s.cursor + self.micro) % self.n_blocks
            s.epochs_of_data += self.micro / self.n_blocks
            # every process masks the whole micro-batch with the shared generator (the same draws as one process)
            # and keeps its rows
            inputs, labels = mask_tokens(batch, self.recipe["mask_rate"], self.recipe["mask_mode"], self.vocab_size,
                                         self.generator)  # fmt: skip
            # inner micro-steps accumulate gradients locally; the last one all-reduces them
            inner = self.world.size > 1 and micro_step < accumulate - 1
            with self.trained.no_sync() if inner else contextlib.nullcontext():
                if self.world.size == 1:
                    with autocast(self.precision.name, self.device):
                        loss = self.forward(inputs, labels=labels).loss
                else:
                    loss = _slice_loss(self.forward, inputs[self.rows], labels[self.rows], labels,
                                       self.precision.name, self.device)  # fmt: skip
                loss = loss / accumulate
                self.scaler.scale(loss * self.world.size).backward()  # DDP averages over processes; undo that
            step_loss += loss.detach().float()
            s.tokens += self.micro * self.block_tokens
            s.sequences += self.micro
        # the one host read of this optimizer step (every process reads the same sum, so all skip or step alike)
        return self.world.all_sum(step_loss).item()

    def recover_from_nonfinite(self, s: TrainState, step_loss: float) -> None:
        """Skip the step's batch and reload the last snapshot (as the reference reloads its last checkpoint);
        more than MAX_NONFINITE_STEPS such steps end the run (the recipe is unstable, not unlucky)."""
        s.skipped_nonfinite += 1
        self.optimizer.zero_grad(set_to_none=True)
        if self.last_good is not None:
            self.model.load_state_dict(self.last_good["model"])
            self.optimizer.load_state_dict(self.last_good["optimizer"])
            s.reloaded += 1
        self.say(f"non-finite loss {step_loss} at step {s.step + 1}: batch skipped"
                 + (", weights reloaded from the last good step" if self.last_good is not None else ""), flush=True)
        if s.skipped_nonfinite > MAX_NONFINITE_STEPS:
            raise FloatingPointError(f"pretraining loss was non-finite in {s.skipped_nonfinite} steps (last at step "
                                     f"{s.step + 1}); lower pretrain.lr")

    def optimizer_step(self, s: TrainState, step_loss: float) -> None:
        """Clip, step, and every SNAPSHOT_EVERY_STEPS steps keep a copy of the weights for non-finite recovery."""
        self.scaler.unscale_(self.optimizer)
        if self.recipe["grad_clip_norm"] is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.recipe["grad_clip_norm"])
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        s.step += 1
        if s.step % SNAPSHOT_EVERY_STEPS == 1:
            self.last_good = {"model": clone_state(self.model.state_dict()),
                              "optimizer": clone_state(self.optimizer.state_dict())}  # fmt: skip
        s.window_loss, s.window_n = s.window_loss + step_loss, s.window_n + 1

    def evaluate_if_due(self, s: TrainState, done: float) -> str:
        """The held-out loss (formatted for the log) at each of the recipe's eval_points, else ""."""
        points = self.recipe["eval_points"]
        if self.heldout is None or done * points < s.next_eval - 1e-9:
            return ""
        s.next_eval = math.floor(done * points + 1e-9) + 1
        return f"{self.heldout.loss(self.model, self.precision.name, self.device):.5f}"

    def log_if_due(self, s: TrainState, t: float, done: float, lr: float, multiplier: float, accumulate: int,
                   eval_loss: str) -> None:  # fmt: skip
        """A log row every log_every_steps steps, at each evaluation and at the end; the progress bar."""
        if s.step % self.impl.log_every_steps == 0 or eval_loss or done >= 1.0:
            mean_loss = s.window_loss / s.window_n
            s.log_row(s.step, s.tokens, f"{t:.5f}", f"{mean_loss:.5f}", f"{lr:.6g}", f"{multiplier:.5f}",
                      accumulate * self.micro, f"{self.elapsed(s):.2f}", eval_loss)  # fmt: skip
            s.last_loss = mean_loss
            if eval_loss:
                s.last_eval_loss = float(eval_loss)
            self.bar.set_postfix(tokens=f"{s.tokens:,}", loss=f"{mean_loss:.3f}", lr=f"{lr:.2e}",
                                 tok_s=f"{s.tokens / self.elapsed(s):,.0f}")  # fmt: skip
            s.window_loss, s.window_n = 0.0, 0
        self.bar.update(min(100, int(100 * done)) - self.bar.n)

    def warn_wrap_once(self, s: TrainState, done: float) -> None:
        """A seconds budget's data wrap, estimated from the first WRAP_ESTIMATE_SHARE of the budget (a token or step
        budget's is announced before the first step): the passes over the training blocks the budget will make at
        the rate so far, and the budget share where the data order restarts."""
        if self.wrap_checked or self.budget["unit"] != "seconds" or done < WRAP_ESTIMATE_SHARE:
            return
        self.wrap_checked = True
        rate = s.tokens / self.elapsed(s)
        passes = rate * self.budget["value"] / (self.n_blocks * self.block_tokens)
        if passes > 1:
            self.say(f"warning: at {rate:,.0f} tokens/s so far this {self.budget['value']:,.0f} s budget reads the "
                     f"{self.n_blocks:,} training blocks about {passes:.2f} times; the data order restarts at about "
                     f"{1 / passes:.0%} of the budget", flush=True)

    def save_if_due(self, s: TrainState, done: float) -> None:
        """The resumable state, every resume_every_seconds (and resume_every_steps), before the end."""
        if self.state_path is None or done >= 1.0 or not self.world.main:
            return
        every, due = self.impl.resume_every_steps, time.perf_counter() - self.last_save
        if (every and s.step % every == 0) or due >= self.impl.resume_every_seconds:
            s.elapsed_s = self.elapsed(s)
            self.start = self.last_save = time.perf_counter()
            save_state(self.state_path, {
                "fingerprint": self.key, "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict(), "generator": self.generator.get_state(),
                "generator_device": self.device.type, "counters": s.counters(), "log": s.log,
            })  # fmt: skip

    # -- outputs ---------------------------------------------------------------------------------------------------
    def summary(self, s: TrainState, extra: dict) -> dict:
        total_s = self.elapsed(s)
        return {
            **run_summary(run=self.run, steps=s.step, tokens=s.tokens, data_passes=s.epochs_of_data, elapsed_s=total_s,
                          final_loss=s.last_loss, eval_loss=s.last_eval_loss, model=self.model, recipe=self.recipe,
                          arch=self.arch, precision=self.precision, device=str(self.device),
                          settings={"recipe": self.recipe, "arch": self.arch}, trained_on=str(self.device)),
            "resumed_from_step": s.resumed_from_step,
            "budget_resolved": self.budget,
            "data_passes": round(s.epochs_of_data, 4),
            "data_wrapped": s.epochs_of_data > 1.0,
            "skipped_nonfinite": s.skipped_nonfinite,
            "reloaded_after_nonfinite": s.reloaded,
            "processes": self.world.size,
            "impl": self.impl.as_dict(),  # how it ran (pretrain.impl): no part of what it computed
            **extra,
        }  # fmt: skip
