"""Stage 3, rules/pretrain.smk: packing and ordering (data.py's resources), the LR a run takes from the schedule
sweep, and the GPUs, memory, time and priority of pretraining and random init (the arithmetic: cramswarm.resources;
a site's set-resources in a copy of profiles/slurm take precedence)."""

from __future__ import annotations

import json
import shlex
from typing import Any

from cramswarm import resources as est
from cramswarm.resources import minutes
from cramswarm.workflow.study import Study, bind, checkpoint_dir, device_of, gpus, training_mem_mb


def lr_sweep_summaries(study: Study, wildcards) -> dict[str, str]:
    """{peak LR: summary.json} of the schedule-sweep runs a model with lr_from_sweep takes its LR from (else empty)."""
    runs = study.runs[wildcards.model]["lr_from"] or {}
    return {str(lr): f"{checkpoint_dir(study, run, study.main_vocab)}/summary.json" for lr, run in runs.items()}


def lr_from_arg(study: Study, wildcards) -> str:
    """The pretrain command's --lr-from option for a model with lr_from_sweep ('' for the others)."""
    summaries = lr_sweep_summaries(study, wildcards)
    return f"--lr-from {shlex.quote(json.dumps(summaries, sort_keys=True))}" if summaries else ""


def pretrain_gpus(study: Study, wildcards) -> int:
    """GPUs per data-parallel process (gpus(); under profiles/slurm its CRAMSWARM_SLURM_GPUS, which the profile
    passes on as CRAMSWARM_GPUS_PER_PROCESS) x processes (pretrain.impl devices x nodes)."""
    per_process = study.gpus_per_process if study.gpus_per_process is not None else gpus(study.impl["device"])
    return per_process * study.impl["devices"] * study.impl["nodes"]


def pretrain_seconds(study: Study, run: str, vocab: int) -> float:
    """A run's estimated seconds on pretrain.impl's device (a normalised budget on CRAMSWARM_GPU_MODEL's card)."""
    spec, device = study.runs[run], device_of(study.impl["device"])
    return est.pretrain_seconds(
        spec["recipe"], spec["arch"], vocab, study.block_tokens, device, study.gpu_peak_tflops
    )  # fmt: skip


def critical_path_priority(study: Study, wildcards) -> int:
    """A pretraining job's priority: its estimated seconds, so the longest (the study's critical path: the run, then
    its fine-tuning) starts first when cores are scarce; fine-tuning and data jobs keep priority 0."""
    return int(pretrain_seconds(study, wildcards.model, int(wildcards.vocab)))


def pretrain_runtime(study: Study, wildcards) -> int:
    return minutes(pretrain_seconds(study, wildcards.model, int(wildcards.vocab)))


def _micro_batch_share(study: Study, model: str) -> int:
    """The sequences of a micro-batch one data-parallel process holds."""
    return study.runs[model]["recipe"]["micro_batch_sequences"] // (study.impl["devices"] * study.impl["nodes"])


def pretrain_mem_mb(study: Study, wildcards) -> int:
    """Per node (sbatch --mem): one training process per pretrain.impl.devices, each with its micro-batch slice."""
    share = _micro_batch_share(study, wildcards.model)
    arch, vocab = study.runs[wildcards.model]["arch"], int(wildcards.vocab)
    return study.impl["devices"] * training_mem_mb(arch, vocab, share, study.block_tokens, study.impl["device"])


def pretrain_gpu_mem_mb(study: Study, wildcards) -> int:
    """GPU memory (MB) one data-parallel process of a pretraining run holds at its share of the micro-batch: the
    `gpu_mem_mb` resource (0 for a CPU run). A cluster maps it to a card (a constraint or gres in a copy of
    profiles/slurm); the estimate is cramswarm.resources.gpu_mem_mb."""
    if not pretrain_gpus(study, wildcards):
        return 0
    share = _micro_batch_share(study, wildcards.model)
    fused = study.impl["attention_backend"] != "math"
    return est.gpu_mem_mb(study.runs[wildcards.model]["arch"], int(wildcards.vocab), share, study.block_tokens, fused)


def init_mem_mb(study: Study, wildcards) -> int:
    """Random weights and their saved copy (fp32): 8 B per parameter."""
    arch = study.runs[wildcards.model]["arch"]
    return training_mem_mb(arch, int(wildcards.vocab), 0, 0, "cuda", bytes_per_param=8)


def names(study: Study) -> dict[str, Any]:
    """The names rules/pretrain.smk uses (pretrain_gpus: rules/swarm.smk too)."""
    return bind(
        study, lr_sweep_summaries, lr_from_arg, pretrain_gpus, critical_path_priority, pretrain_runtime,
        pretrain_mem_mb, pretrain_gpu_mem_mb, init_mem_mb,
    )  # fmt: skip
