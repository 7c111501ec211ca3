"""The SLURM and default profiles' resources, from dry runs (no cluster needed): GPU rules on the GPU partition,
a GPU per data-parallel process, the default profile's one local GPU."""

import os
import re

import pytest
from conftest import TINY, copy_workflow
from slurm_cluster import env, planned_resources

PRETRAIN = "results/pretrain/synthetic/crammed/v128"


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    return copy_workflow(tmp_path_factory.mktemp("dry"))


def test_slurm_profile_puts_gpu_rules_on_the_gpu_partition(dry):
    environ = env(CRAMSWARM_SLURM_PARTITION="cpu", CRAMSWARM_SLURM_GPU_PARTITION="gpu", CRAMSWARM_SLURM_GPUS="2",
                  CRAMSWARM_SLURM_ACCOUNT="lab")
    resources = planned_resources(dry, "--workflow-profile", "profiles/slurm", f"{PRETRAIN}/summary.json", *TINY,
                                  environ=environ)
    assert "slurm_partition=gpu" in resources["pretrain"] and "gpu=2" in resources["pretrain"]
    assert "slurm_account=lab" in resources["pretrain"]
    assert "slurm_partition=cpu" in resources["train_tokenizer"] and "gpu" not in resources["train_tokenizer"]
    # memory and time are the rules' own (estimated from the config), not the profile's
    local = planned_resources(dry, f"{PRETRAIN}/summary.json", *TINY)
    for rule in ("pretrain", "train_tokenizer", "pack_corpus"):
        for key in ("runtime", "mem_mb"):
            assert re.search(rf"\b{key}=(\d+)", resources[rule])[1] == re.search(rf"\b{key}=(\d+)", local[rule])[1]


def test_data_parallel_pretraining_asks_for_a_gpu_per_process(dry, tmp_path):
    """pretrain.impl.devices x nodes processes: the profile's GPUs per process times that, the nodes, one CPU per
    process on a node (threads), and memory for each process."""
    overlay = tmp_path / "ddp.yaml"
    target = [f"{PRETRAIN}/summary.json", *TINY]
    single = planned_resources(dry, "--workflow-profile", "profiles/slurm", *target,
                               environ=env(CRAMSWARM_SLURM_GPUS="1"))["pretrain"]  # fmt: skip
    overlay.write_text("pretrain:\n  impl: {devices: 2}\n")
    gpus = planned_resources(dry, "--workflow-profile", "profiles/slurm", *target, str(overlay),
                             environ=env(CRAMSWARM_SLURM_GPUS="1"))["pretrain"]  # fmt: skip
    assert "gpu=1" in single and "nodes=1" in single
    assert "gpu=2" in gpus and "nodes=1" in gpus
    assert int(re.search(r"\bmem_mb=(\d+)", gpus)[1]) > int(re.search(r"\bmem_mb=(\d+)", single)[1])
    overlay.write_text("pretrain:\n  impl: {devices: 2, nodes: 2}\n")
    cpus = planned_resources(dry, "--workflow-profile", "profiles/slurm", *target, str(overlay),
                             environ=env(CRAMSWARM_SLURM_GPUS="0"))["pretrain"]  # fmt: skip
    assert "gpu=0" in cpus and "nodes=2" in cpus


def test_local_gpu_jobs_hold_the_default_profiles_one_gpu(dry, tmp_path):
    """pretrain and finetune hold the `gpu` that profiles/default caps at 1 where a GPU driver is there
    (device auto), and none when their config says device: cpu."""
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\n")
    (tmp_path / "nvidia-smi").chmod(0o755)
    with_gpu = env(PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    target = f"{PRETRAIN}/summary.json"
    assert "gpu=1" in planned_resources(dry, target, *TINY, environ=with_gpu)["pretrain"]
    cpu = tmp_path / "cpu.yaml"
    cpu.write_text("pretrain:\n  impl: {device: cpu}\n")
    assert "gpu=0" in planned_resources(dry, target, *TINY, str(cpu), environ=with_gpu)["pretrain"]
    finetune = "results/glue/synthetic/no_pretrain/v128/sst2/s0.json"  # glue.jobs per_model: rule finetune_model
    assert "gpu=1" in planned_resources(dry, finetune, *TINY, environ=with_gpu)["finetune_model"]
    cpu.write_text("glue:\n  device: cpu\n")
    assert "gpu=0" in planned_resources(dry, finetune, *TINY, str(cpu), environ=with_gpu)["finetune_model"]
