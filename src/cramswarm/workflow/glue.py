"""Stage 4, rules/glue.smk: what a fine-tuning job reads (the checkpoint, the warmup task's data), its protocol,
and its GPUs, memory and time for the tasks and seeds it runs (glue.jobs)."""

from __future__ import annotations

import json
from typing import Any

from cramswarm import resources as est
from cramswarm.resources import mb, minutes
from cramswarm.workflow.data import glue_rows
from cramswarm.workflow.study import GLUE_DATA, Study, bind, checkpoint_dir, device_of, gpus, training_mem_mb


def checkpoint_of(study: Study, wildcards) -> str:
    """The weights of run ``wildcards.model`` at ``wildcards.vocab`` (pretrained, SWARM or random init)."""
    return f"{checkpoint_dir(study, wildcards.model, wildcards.vocab)}/model.safetensors"


def protocol_json(study: Study, wildcards) -> str:
    """The run's GLUE fine-tuning protocol (glue.protocols entry with its name, plus the shared settings)."""
    return json.dumps(study.runs[wildcards.model]["glue"], sort_keys=True)


def finetune_gpus(study: Study, wildcards) -> int:
    return gpus(study.runs[wildcards.model]["glue"]["device"])


def warmup_data(study: Study, wildcards) -> list[str]:
    """The GLUE data whose train split sets every task's warmup (the protocol's warmup_from_task), or none."""
    task = study.runs[wildcards.model]["glue"].get("warmup_from_task")
    return [GLUE_DATA.format(source=wildcards.source, task=task)] if task else []


def warmup_arg(study: Study, wildcards, input) -> str:
    return f"--warmup-data {input.warmup_data}" if input.warmup_data else ""


def finetune_tasks(study: Study, wildcards) -> list[str]:
    """The GLUE tasks one fine-tuning job runs: its own task, or (rule finetune_model, no {task}) every task."""
    return [wildcards.task] if hasattr(wildcards, "task") else study.tasks


def finetune_runtime(study: Study, wildcards) -> int:
    """Every epoch over the train rows (padded to max_length_tokens) plus a validation pass per epoch, for each
    task and seed the job runs."""
    protocol = study.runs[wildcards.model]["glue"]
    seeds = 1 if study.glue_jobs == "per_seed" else len(study.seeds)  # per_task and per_model jobs run every seed
    rows = [glue_rows(study, task) for task in finetune_tasks(study, wildcards)]
    arch, vocab, device = study.runs[wildcards.model]["arch"], int(wildcards.vocab), device_of(protocol["device"])
    return minutes(est.finetune_seconds(arch, vocab, protocol, rows, device, seeds))


def finetune_mem_mb(study: Study, wildcards) -> int:
    """The model in training at the protocol's batch size, plus the largest task's rows as token ids (8 B per
    token; a job holds one task's rows at a time)."""
    protocol = study.runs[wildcards.model]["glue"]
    seq = protocol["max_length_tokens"]
    arch, vocab = study.runs[wildcards.model]["arch"], int(wildcards.vocab)
    model = training_mem_mb(arch, vocab, protocol["batch_size"], seq, protocol["device"])
    return model + mb(8 * seq * max(sum(glue_rows(study, task)) for task in finetune_tasks(study, wildcards)))


def names(study: Study) -> dict[str, Any]:
    """The names rules/glue.smk uses."""
    return bind(
        study, checkpoint_of, protocol_json, finetune_gpus, warmup_data, warmup_arg, finetune_runtime, finetune_mem_mb
    )  # fmt: skip
