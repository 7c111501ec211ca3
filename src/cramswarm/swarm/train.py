"""``swarm_pretrain``: masked-LM pretraining of crammed BERT with SWARM parallelism (the swarm_pretrain rule).

The data are exactly single-process pretraining's (``cramswarm.pretrain.pretrain``): the same held-out split,
the same cursor order over the packed blocks and the same ``mask_tokens`` calls on a generator seeded with the
recipe seed, so both see identical microbatches - except under the hivemind launcher, whose trainers make their
own microbatches by index (``cramswarm.swarm.data.BlockSource``: the same blocks and masking, each microbatch's
masks drawn from a generator seeded with the seed and its index). The budget is counted the same way (tokens,
optimizer steps or seconds, checked before each step; a step has ``training.step_accumulation`` microbatches
and the learning rate ``training.step_lr``: pretrain's rules, a ramp or schedule horizon in sequences included),
so a token or step budget fixes the number of microbatches in advance. Training runs on a transport chosen by
``swarm["transport"]`` (the run's settings are one ``settings.SwarmPlan``, checked before any data is read):
``emulation`` (threads in this process, ``cramswarm.swarm.emulation_training.train``) or
``hivemind`` (one process per peer, ``cramswarm.swarm.hivemind_transport.train``, imported only when asked for;
its processes are started by this process's launcher - ``swarm["placement"]`` ``local``, or ``srun``: each as a
job step of the SLURM job it runs in - or, with ``attach``, its peers by ``swarm-peer`` tasks that meet the
launcher through the ``rendezvous`` folder).
The stages are then assembled into one crammed-BERT checkpoint (``stages.assemble_model``), written with
``run_outputs.write_outputs`` as every pretraining run's, with ``train_log.csv`` (pretrain's columns; rows every
``log_every_steps`` steps, window means; the held-out loss is evaluated once, at the end) and ``summary.json``, each
written atomically.

Under the launcher the run's resumable state lives in ``<rendezvous>/launcher`` (``STATE_SUBDIR``; the rule's state
folder). It outlives the training: once every output is written, ``outputs.json`` there records them (name ->
SHA-1) and the folder is removed (renamed away first, so a kill mid-removal leaves no half state). A rerun that
finds that record and every output matching it writes nothing and trains nothing: it only removes the folder. A
rerun that finds the folder without the record (killed in training or while writing the outputs) resumes from the
stage shards (``launcher``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from cramswarm import budget as budgets
from cramswarm.impl import PretrainImpl
from cramswarm.io import read_json, write_json
from cramswarm.precision import choose_precision
from cramswarm.pretrain import HeldOut, load_training_data
from cramswarm.run_outputs import summary as run_summary
from cramswarm.run_outputs import write_outputs
from cramswarm.swarm.settings import SwarmPlan
from cramswarm.swarm.stages import assemble_model, build_swarm_model, split_model
from cramswarm.train_state import LOG_COLUMNS
from cramswarm.training import (
    budget_progress,
    mask_tokens,
    step_accumulation,
)

UNBOUNDED = 1 << 62  # microbatch bound for a seconds budget (time decides)
STATE_SUBDIR = "launcher"  # under the rendezvous folder: the launcher's resumable state (hivemind_transport.train)
OUTPUTS_FILE = "outputs.json"  # in the state folder: the outputs written from its finished run (name -> SHA-1)


def microbatches(
    blocks: np.ndarray, n_blocks: int, recipe: dict, vocab_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """pretrain's microbatch sequence: consecutive (wrapping) windows of the training blocks, masked in order."""
    micro = recipe["micro_batch_sequences"]
    generator = torch.Generator().manual_seed(recipe["seed"])
    cursor = 0
    while True:
        idx = np.arange(cursor, cursor + micro) % n_blocks
        cursor = (cursor + micro) % n_blocks
        batch = torch.from_numpy(blocks[np.sort(idx)].astype(np.int64))
        yield mask_tokens(batch, recipe["mask_rate"], recipe["mask_mode"], vocab_size, generator)


def planned_microbatches(recipe: dict, block_tokens: int) -> int:
    """Microbatches single-process pretraining spends on a token or step budget (UNBOUNDED for seconds)."""
    budget = recipe["budget"]
    if budget["unit"] == "seconds":
        return UNBOUNDED
    micro = recipe["micro_batch_sequences"]
    total = tokens = steps = 0
    while (t := budget_progress(budget, tokens, steps, 0.0)) < 1.0:
        size = step_accumulation(recipe, t, total * micro)
        total, tokens, steps = total + size, tokens + size * micro * block_tokens, steps + 1
    return total


def _sha1(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha1").hexdigest()


def _settings(recipe: dict, arch: dict, swarm: dict, run: str | None) -> dict:
    return json.loads(json.dumps({"recipe": recipe, "arch": arch, "swarm": swarm, "run": run}))


def runtime_settings(swarm: dict, swarm_impl: dict | None, impl: PretrainImpl) -> dict:
    """The one settings dict the transports read: what the swarm computes (``swarm`` less ``impl``), how it runs
    (``swarm.impl``) and where its peers compute (``pretrain.impl.device``)."""
    return {**swarm, **(swarm_impl or {}), "device": impl.device}


def record_outputs(state_dir: Path, out_dir: Path, settings: dict) -> None:
    """Record in the state folder that every output of its run is written: each file of ``out_dir`` with its SHA-1,
    and the settings they were made with."""
    files = {p.name: _sha1(p) for p in sorted(out_dir.iterdir()) if p.is_file() and not p.name.startswith(".")}
    write_json(state_dir / OUTPUTS_FILE, {"out_dir": str(out_dir.resolve()), "settings": settings, "files": files})


def outputs_complete(state_dir: Path, out_dir: Path, settings: dict) -> bool:
    """Whether the state folder records outputs of this run (same folder and settings) that are all still there,
    unchanged: then its run finished and only the folder's removal was cut short."""
    try:
        record = read_json(state_dir / OUTPUTS_FILE)
    except (FileNotFoundError, ValueError):
        return False
    if record.get("out_dir") != str(out_dir.resolve()) or record.get("settings") != settings:
        return False
    return all((out_dir / name).is_file() and _sha1(out_dir / name) == digest
               for name, digest in record["files"].items())


def remove_state(state_dir: Path) -> None:
    """Remove a state folder: renamed to a hidden sibling first (atomic), so a kill mid-removal leaves no half
    folder that a rerun would resume from, then deleted."""
    trash = state_dir.with_name(f".{state_dir.name}.removed-{os.getpid()}")
    os.replace(state_dir, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _remove_trash(state_dir: Path) -> None:
    """State folders renamed for removal by a process killed before it deleted them."""
    for trash in state_dir.parent.glob(f".{state_dir.name}.removed-*"):
        shutil.rmtree(trash, ignore_errors=True)


def _log_rows(log: list[dict], every: int, eval_loss: float | None) -> list[dict]:
    """pretrain's log cadence: a row every ``every`` steps and at the last, with the window's mean loss."""
    rows, window = [], []
    for i, row in enumerate(log):
        window.append(row["loss"])
        if row["step"] % every == 0 or i == len(log) - 1:
            rows.append(row | {"loss": sum(window) / len(window), "eval_loss": ""})
            window = []
    if rows and eval_loss is not None:
        rows[-1]["eval_loss"] = f"{eval_loss:.5f}"
    return rows


def _csv(rows: list[dict]) -> str:
    fmt = {"progress": "{:.5f}", "loss": "{:.5f}", "lr": "{:.6g}", "lr_multiplier": "{:.5f}", "elapsed_s": "{:.2f}"}
    lines = [",".join(LOG_COLUMNS)]
    for row in rows:
        lines.append(",".join(fmt.get(c, "{}").format(row[c]) for c in LOG_COLUMNS))
    return "\n".join(lines) + "\n"


def swarm_pretrain(
    recipe: dict,
    arch: dict,
    swarm: dict,
    blocks_path,
    tokenizer_path,
    out_dir,
    *,
    progress: bool = True,
    run: str | None = None,
    expected_vocab: int | None = None,
    rendezvous: str | Path | None = None,
    impl: PretrainImpl | None = None,
    swarm_impl: dict | None = None,
) -> dict:
    """Pretrain with SWARM until the budget is spent; write the checkpoint, train_log.csv and summary.json.
    ``swarm`` says what the swarm computes, ``swarm_impl`` (``swarm.impl``) and ``impl`` (``pretrain.impl``: the
    peers' device, the log's granularity) how it runs. ``rendezvous``: the folder where peers of the attach placement
    find the swarm, and whose ``launcher/`` holds the launcher's resumable state (a shared filesystem for attach and
    srun)."""
    impl = impl or PretrainImpl()
    settings = _settings(recipe, arch, swarm, run)  # what the outputs were computed from
    swarm = runtime_settings(swarm, swarm_impl, impl)
    plan = SwarmPlan.from_config(arch, 0, recipe, swarm, rendezvous)   # vocab and budget filled in once known
    plan.validate()
    out_dir = Path(out_dir)
    state_dir = Path(rendezvous) / STATE_SUBDIR if rendezvous is not None else None
    if state_dir is not None:
        _remove_trash(state_dir)
        if outputs_complete(state_dir, out_dir, settings):
            print(f"the swarm run in {state_dir} finished and its outputs in {out_dir} are complete; removing its "
                  f"state folder (nothing to train)", flush=True)
            remove_state(state_dir)
            return read_json(out_dir / "summary.json")
    # CPU peers (and the evaluation below) run in this precision; a peer on a GPU chooses for its GPU
    chosen = choose_precision(recipe["precision"], torch.device("cpu"))
    print(f"precision {chosen.name} on the CPU ({chosen.reason})", flush=True)
    tok, blocks, n_blocks = load_training_data(recipe, tokenizer_path, blocks_path, expected_vocab)
    vocab_size = tok.get_vocab_size()
    micro = recipe["micro_batch_sequences"]
    block_tokens = blocks.shape[1]
    recipe = budgets.for_model(recipe, arch, vocab_size, block_tokens)
    if "model_tflop" in recipe["budget"]:
        print(budgets.describe_counted(recipe["budget"]), flush=True)
    total = planned_microbatches(recipe, block_tokens)

    plan = dataclasses.replace(plan, vocab_size=vocab_size, recipe=recipe)
    if plan.transport == "hivemind":
        from cramswarm.swarm.data import BlockSource
        from cramswarm.swarm.hivemind_transport import train as transport_train

        # the launcher's trainers make the same blocks' microbatches by index (masks seeded per microbatch)
        extra = {"state_dir": state_dir, "source": BlockSource.for_recipe(blocks_path, n_blocks, recipe, vocab_size)}
    else:
        from cramswarm.swarm.emulation_training import train as transport_train

        extra = {"batches": microbatches(blocks, n_blocks, recipe, vocab_size)}
    result = transport_train(plan, total_microbatches=total, progress=progress, **extra)
    stats = result.stats

    # the model the transport split (with a narrowing compression's boundary layers), without dropout
    shape = build_swarm_model(arch, vocab_size, recipe["seed"], plan.stages, plan.compression)
    stages = split_model(shape, plan.stages)
    for stage, state in zip(stages, result.stage_states):
        stage.load_state_dict(state)
    model = assemble_model(stages, shape.config)
    device = torch.device("cpu")
    eval_loss = None
    if recipe["eval_blocks"]:
        heldout = HeldOut(blocks[n_blocks:], recipe["eval_mask_rate"], vocab_size, micro)
        eval_loss = round(heldout.loss(model, chosen.name, device), 5)

    rows = _log_rows(result.log, impl.log_every_steps, eval_loss)
    # every transport logs one row per optimizer step; the budget counts every microbatch handed out
    tokens, steps = stats["microbatches_requested"] * micro * block_tokens, len(result.log)
    # the hardware the stage peers trained on, where this host has it (evaluation above is on the CPU)
    on_gpu = any(str(d).startswith("cuda") for d in (stats.get("peer_devices") or {}).values())
    peers_device = "cuda" if on_gpu and torch.cuda.is_available() else "cpu"
    summary = run_summary(
        run=run, steps=steps, tokens=tokens, data_passes=tokens / (n_blocks * block_tokens), elapsed_s=stats["wall_s"],
        final_loss=rows[-1]["loss"] if rows else math.nan, eval_loss=eval_loss, model=model, recipe=recipe,
        arch=arch, precision=chosen, device=str(device), settings={k: settings[k] for k in ("recipe", "arch", "swarm")},
        trained_on=peers_device,
    ) | {"swarm": settings["swarm"], "swarm_stats": stats, "impl": impl.as_dict(), "swarm_impl": swarm_impl or {}}
    write_outputs(out_dir, model, tok, arch["max_positions"], _csv(rows), summary)
    if state_dir is not None and stats.get("roles") == "launcher" and state_dir.is_dir():  # left to us: outputs first
        record_outputs(state_dir, out_dir, settings)
        remove_state(state_dir)
    return summary
