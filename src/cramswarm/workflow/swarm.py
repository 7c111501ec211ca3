"""SWARM, rules/swarm.smk: the swarm's settings, the srun placement, the threads, memory, time and priority of a
SWARM run, and the swarm_study experiments' inputs, settings and time."""

from __future__ import annotations

import json
import shlex
from typing import Any

from cramswarm.config import swarm_study_model
from cramswarm.impl import computed
from cramswarm.resources import TORCH_MB, mb, minutes
from cramswarm.workflow.pretrain import pretrain_seconds
from cramswarm.workflow.study import Study, bind, data_files, device_of, training_mem_mb

# CSV / figure name (as cramswarm.report.swarm_figures names them) -> the swarm_study config section it runs
SWARM_EXPERIMENTS = {
    "square_cube": "square_cube",
    "wiring_throughput": "wiring",
    "failures_timeline": "failures",
    "rebalancing_recovery": "rebalancing",
    "compression_loss": "compression",
    "sim_scale": "sim_scale",
}


def swarm_study_dir(study: Study) -> str:
    """Named target swarm_study: the paper's experiments in miniature (one CSV each), then their tables and figures."""
    return f"results/swarm_study/{study.source}"


def swarm_tasks(study: Study) -> int:
    """The stage peers of a swarm job (with swarm.impl.placement srun, its SLURM tasks)."""
    return study.config["swarm"]["stages"] * study.config["swarm"]["peers_per_stage"]


def swarm_srun(study: Study) -> bool:
    """swarm.impl.placement srun: one SLURM job of swarm_tasks() tasks, one CPU per stage peer across nodes; the
    launcher runs in its batch step and starts every process as its own srun job step (--overlap)."""
    return study.config["swarm"]["impl"]["placement"] == "srun"


def swarm_threads(study: Study) -> int:
    """Threads of a swarm job - srun: one CPU per task; the emulation: one process; hivemind here: its processes."""
    return 1 if swarm_srun(study) or study.config["swarm"]["transport"] == "emulation" else 2


def swarm_slurm(study: Study) -> dict[str, Any]:
    """The resources of the srun placement (`mpi`: the launcher calls srun itself), else none."""
    return {"tasks": swarm_tasks(study), "mpi": "srun"} if swarm_srun(study) else {}


def swarm_json(study: Study, wildcards) -> str:
    """What the swarm computes (its impl reaches the command as the resource SWARM_IMPL)."""
    return json.dumps(computed(study.config["swarm"]), sort_keys=True)


def swarm_seconds(study: Study, wildcards) -> float:
    """SWARM pretraining: a seconds budget as it is; any other at half the single-process estimate's rate (pipeline,
    compression, routing, every peer on the job's own CPUs or GPUs)."""
    seconds = pretrain_seconds(study, wildcards.model, int(wildcards.vocab))
    return seconds if study.runs[wildcards.model]["recipe"]["budget"]["unit"] == "seconds" else 2 * seconds


def swarm_priority(study: Study, wildcards) -> int:
    """The swarm run's priority: the core-seconds it claims (its estimated seconds x its threads). Snakemake's
    scheduler weighs the jobs it starts together by the sum of their priorities, so two single-core runs of the same
    budget outweigh a two-core job of their own estimate; with this weight the swarm run starts first, before
    single-core jobs keep one of its cores busy to the end of the study."""
    return int(swarm_seconds(study, wildcards) * swarm_threads(study))


def swarm_runtime(study: Study, wildcards) -> int:
    """SWARM pretraining's runtime: its estimated seconds plus the peers' start-up."""
    return minutes(swarm_seconds(study, wildcards) + study.config["swarm"]["impl"]["startup_timeout_s"])


def swarm_mem_mb(study: Study, wildcards) -> int:
    """Every peer holds one stage's share of the model (a replica of the whole model per peers_per_stage), each
    hivemind peer is a torch process of its own; the rule's process assembles the whole model. Per node of the job
    (sbatch --mem), counted as if every peer ran on one node."""
    run, swarm = study.runs[wildcards.model], study.config["swarm"]
    processes = 1 + (swarm_tasks(study) if swarm["transport"] == "hivemind" else 0)
    model = training_mem_mb(
        run["arch"], int(wildcards.vocab), run["recipe"]["micro_batch_sequences"], study.block_tokens,
        study.impl["device"], copies=1 + swarm["peers_per_stage"],
    )  # fmt: skip
    return model + mb((processes - 1) * TORCH_MB * 1e6)


def swarm_study_inputs(study: Study, wildcards) -> dict[str, str]:
    """The compression experiment trains on the study's blocks at the main vocab size."""
    return data_files(study.study_data, study.main_vocab) if SWARM_EXPERIMENTS[wildcards.name] == "compression" else {}


def swarm_study_settings(study: Study, wildcards) -> str:
    return json.dumps(study.config["swarm_study"][SWARM_EXPERIMENTS[wildcards.name]], sort_keys=True)


def swarm_study_args(study: Study, wildcards, input) -> str:
    if SWARM_EXPERIMENTS[wildcards.name] != "compression":
        return ""
    arch = shlex.quote(json.dumps(study.runs[swarm_study_model(study.config)]["arch"], sort_keys=True))
    return f"--blocks {input.blocks} --tokenizer {input.tokenizer} --arch {arch}"


def swarm_experiment_runtime(study: Study, wildcards) -> int:
    """A swarm_study experiment's runtime (cramswarm.swarm_study.runtime.experiment_seconds, the compression
    experiment on the study's SWARM model)."""
    from cramswarm.swarm_study.runtime import experiment_seconds

    section = SWARM_EXPERIMENTS[wildcards.name]
    arch = study.runs[swarm_study_model(study.config)]["arch"]
    settings = study.config["swarm_study"][section]
    seconds = experiment_seconds(section, settings, arch, study.main_vocab, study.block_tokens, device_of("auto"))
    return minutes(seconds)


def names(study: Study) -> dict[str, Any]:
    """The names rules/swarm.smk uses."""
    return {
        "SWARM_EXPERIMENTS": SWARM_EXPERIMENTS,
        "SWARM_STUDY": swarm_study_dir(study),
        "SWARM_THREADS": swarm_threads(study),
        "SWARM_SLURM": swarm_slurm(study),
        **bind(
            study, swarm_json, swarm_priority, swarm_runtime, swarm_mem_mb, swarm_study_inputs, swarm_study_settings,
            swarm_study_args, swarm_experiment_runtime,
        ),  # fmt: skip
    }
