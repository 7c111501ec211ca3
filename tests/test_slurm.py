"""profiles/slurm on a real SLURM: a one-node cluster on this machine (tests/slurm_cluster.py).

The tiny config's pretraining chain runs locally; then, from the same corpus and tokenizer, its packing and
pretraining jobs go through `snakemake --workflow-profile profiles/slurm` exactly as the README tells a
CPU-only cluster's user. SLURM requeues the pretrain job mid-run (as a preempting scheduler does); it must
resume from its saved state, and the outputs must equal the local run's. Bad input (a missing partition, a
GPU job on a partition without GPUs) must fail fast with sbatch's message. Where SLURM cannot be installed or
started, the cluster tests skip with the reason. The profiles' dry-run checks are in test_slurm_profile.py.
"""

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
from conftest import TINY, copy_workflow, job_stats, planned_jobs, snakemake
from slurm_cluster import LocalSlurm, Unavailable, env, planned_resources, run
from swarm_helpers import processes_left

pytestmark = pytest.mark.slurm

PRETRAIN = "results/pretrain/synthetic/crammed/v128"
STATE = "results/.state/pretrain/synthetic/crammed/v128/state.pt"
# 300 optimizer steps of 32 x 128 tokens (about 10 s on one core), the state saved every 10: time to requeue.
STEPS = 300
OVERLAY = f"pretrain:\n  budget: {{unit: tokens, value: {STEPS * 32 * 128}}}\n  impl: {{resume_every_steps: 10}}\n"
CONFIG = [*TINY, "slurm_test.yaml"]
# What the README's "CPU-only cluster" lines set; the status poll starts after 2 s instead of 40.
CPU_CLUSTER = {"CRAMSWARM_SLURM_PARTITION": "test", "CRAMSWARM_SLURM_GPUS": "0"}
PROFILE = ["--workflow-profile", "profiles/slurm", "--slurm-init-seconds-before-status-checks", "2"]


def workflow(tmp_path_factory, name):
    work = copy_workflow(tmp_path_factory.mktemp(name))
    (work / "slurm_test.yaml").write_text(OVERLAY)
    return work


@pytest.fixture(scope="module")
def cluster():
    # Not under pytest's temporary folders: another pytest session on this machine may prune those.
    folder = Path(tempfile.mkdtemp(prefix="cramswarm-slurm-"))
    try:
        slurm = LocalSlurm(folder).start()
    except Unavailable as err:
        shutil.rmtree(folder, ignore_errors=True)
        if os.environ.get("CRAMSWARM_REQUIRE_SLURM"):  # set by .ci/run: there a skip would hide a SLURM test never run
            pytest.fail(f"CRAMSWARM_REQUIRE_SLURM is set, but there is no local SLURM cluster: {err}")
        pytest.skip(f"no local SLURM cluster: {err}")
    yield slurm
    slurm.stop()
    shutil.rmtree(folder, ignore_errors=True)


def rule_of(job):
    return job["comment"].split("_wildcards_")[0].removeprefix("rule_")  # the plugin's job comment


def pretrain_job(cluster):
    return next((job for job in cluster.jobs() if rule_of(job) == "pretrain"), None)


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """The target run locally (profiles/default), uninterrupted."""
    work = workflow(tmp_path_factory, "local")
    snakemake(work, "--cores", "2", f"{PRETRAIN}/summary.json", *CONFIG, timeout=600)
    return work


@pytest.fixture(scope="module")
def on_slurm(cluster, local, tmp_path_factory):
    """The target through the SLURM profile, starting from the local run's corpus and tokenizer. Two reasons:
    each SLURM stage costs about half a minute of status polling, and a tokenizer trained twice on the same
    corpus can number tied subword tokens differently (hash-map order, huggingface/tokenizers#1794).
    Once the pretrain job has saved state, `scontrol requeue` it."""
    work = workflow(tmp_path_factory, "on_slurm")
    for folder in ("results/data", "results/tokenizers"):
        shutil.copytree(local / folder, work / folder)  # keeps the times: nothing looks outdated
    planned = planned_jobs(work, f"{PRETRAIN}/summary.json", *CONFIG)
    assert "pretrain" in planned and "train_tokenizer" not in planned, planned
    log = work / "snakemake.log"
    cmd = ["snakemake", *PROFILE, f"{PRETRAIN}/summary.json", *CONFIG]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=work, env=env(**CPU_CLUSTER), stdout=out, stderr=subprocess.STDOUT)
    requeued, deadline = None, time.monotonic() + 900
    try:
        while proc.poll() is None:
            assert time.monotonic() < deadline, f"SLURM run still going after 900 s:\n{log.read_text()[-3000:]}"
            job = pretrain_job(cluster) if requeued is None and (work / STATE).exists() else None
            if job and job["state"] == "RUNNING":
                run("scontrol", "requeue", job["id"])
                requeued = job["id"]
                # A requeued job waits 120 s before it may start again; let it start as soon as it is pending.
                while pretrain_job(cluster)["state"] != "PENDING":
                    assert time.monotonic() < deadline, "requeued job never went back to PENDING"
                    time.sleep(0.2)
                run("scontrol", "update", f"JobId={requeued}", "StartTime=now")
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return work, proc.returncode, log.read_text(), requeued, planned


def test_jobs_ran_under_slurm(on_slurm, cluster):
    work, returncode, log, _, planned = on_slurm
    assert returncode == 0, log[-4000:]
    jobs = cluster.jobs()
    assert Counter(map(rule_of, jobs)) == planned and "pretrain" in planned  # every job of the dry run, once
    for job in jobs:
        assert job["state"] == "COMPLETED", job
        assert f"submitted with SLURM jobid {job['id']} " in log, job  # Snakemake's record of the same job
    # The rule's runtime (minutes) and mem_mb (MB), as the dry run planned them, are what SLURM gave the job;
    # no GPU (CRAMSWARM_SLURM_GPUS=0).
    planned = planned_resources(work, "-F", f"{PRETRAIN}/summary.json", *CONFIG)["pretrain"]
    runtime, mem_mb = (int(re.search(rf"\b{key}=(\d+)", planned)[1]) for key in ("runtime", "mem_mb"))
    pretrain = pretrain_job(cluster)
    assert slurm_minutes(pretrain["time_limit"]) == runtime
    assert f"mem={mem_mb}M" in pretrain["tres"] and "gpu" not in pretrain["tres"]


def slurm_minutes(limit: str) -> int:
    """scontrol's TimeLimit ([days-]hours:minutes:seconds) in minutes."""
    days, _, clock = limit.rpartition("-")
    hours, minutes, seconds = (int(x) for x in clock.split(":"))
    return int(days or 0) * 1440 + hours * 60 + minutes + seconds // 60


def packed_files(work):
    """{path: sha256} of every packed-blocks file a run wrote."""
    return {str(p.relative_to(work)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in work.glob("results/packed/**/*.npy")}


def test_outputs_equal_a_local_run(on_slurm, local):
    work = on_slurm[0]
    assert packed_files(work) and packed_files(work) == packed_files(local)
    ours, theirs = (json.loads((w / PRETRAIN / "summary.json").read_text()) for w in (work, local))
    assert ours["steps"] == theirs["steps"] and ours["tokens"] == theirs["tokens"]
    assert ours["final_loss"] == pytest.approx(theirs["final_loss"], abs=1e-3)
    assert ours["eval_loss"] == pytest.approx(theirs["eval_loss"], abs=1e-3)


def test_requeued_pretraining_resumes_from_its_state(on_slurm, cluster):
    work, returncode, log, requeued, _ = on_slurm
    assert requeued is not None, "the pretrain job was never seen running with saved state"
    job = pretrain_job(cluster)
    assert (job["id"], job["state"], job["restarts"]) == (requeued, "COMPLETED", 1)
    summary = json.loads((work / PRETRAIN / "summary.json").read_text())
    assert 0 < summary["resumed_from_step"] < summary["steps"]
    assert "resuming from" in (work / "logs/pretrain/synthetic/crammed/v128.log").read_text()
    assert not (work / STATE).exists()  # removed once the checkpoint is written


# Bad input: a pretrain job whose inputs the SLURM run built, so that it is the only job; sbatch refuses it.
OTHER = "results/pretrain/synthetic/bert_original/v128/summary.json"


def test_missing_partition_fails_with_sbatchs_message(on_slurm):
    start = time.monotonic()
    proc = snakemake(on_slurm[0], *PROFILE, OTHER, *CONFIG, check=False, timeout=300,
                     env=env(**{**CPU_CLUSTER, "CRAMSWARM_SLURM_PARTITION": "nosuch"}))
    output = proc.stdout + proc.stderr
    assert job_stats(output) == {"pretrain": 1}
    assert proc.returncode != 0 and "Invalid partition name specified" in output
    assert time.monotonic() - start < 120


def test_gpu_job_on_a_partition_without_gpus_fails_with_sbatchs_message(on_slurm):
    start = time.monotonic()
    proc = snakemake(on_slurm[0], *PROFILE, OTHER, *CONFIG, check=False, timeout=300,
                     env=env(CRAMSWARM_SLURM_PARTITION="test"))  # GPUs left at the profile's 1
    output = proc.stdout + proc.stderr
    assert job_stats(output) == {"pretrain": 1}
    assert proc.returncode != 0 and "--gpus=1" in output and "Requested node configuration is not available" in output
    assert time.monotonic() - start < 120


# The profiles' resources, from dry runs (no cluster needed).
# SWARM with swarm.impl.placement srun: one SLURM job (2 stages x 1 peer: --ntasks=2, one CPU each on the 2-CPU test
# node) whose batch step runs the launcher; every process it starts (bootstrap DHT, stage peers, trainers) is its own
# srun job step (--overlap: they share the job's CPUs). Mid-run the test SIGKILLs a trainer's step (scancel): the
# launcher starts it again as a new step. Then it SIGKILLs the rule's process: the job fails and SLURM ends its
# steps; the profile resubmits it (retries: 1), and the new job resumes from the stage shards.
SWARM_RUN = "results/swarm/synthetic/swarm/v128"
SWARM_STATE = "results/.state/swarm/synthetic/swarm/v128"
SWARM_STEPS = 80  # the peers' first shards came as late as step 29 (of 40) on this loaded machine
SWARM_OVERLAY = (f"pretrain:\n  budget: {{unit: tokens, value: {SWARM_STEPS * 32 * 128}}}\n"  # 32 x 128 tokens a step
                 "swarm:\n  transport: hivemind\n  peers_per_stage: 1\n"
                 "  impl: {placement: srun, interface: lo, checkpoint_every_s: 1.0}\n")


def job_steps() -> dict[str, str]:
    """Step name -> <job>.<step> of every job step SLURM lists now (squeue lists running steps only)."""
    out = run("squeue", "-h", "--steps", "-o", "%i %j", check=False).stdout
    return {name: step for step, _, name in (line.strip().partition(" ") for line in out.splitlines())}


def step_processes(job_id: str) -> dict[psutil.Process, list[psutil.Process]]:
    """The processes of a job's srun steps: each step's slurmstepd -> everything under it."""
    found = {}
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            title = " ".join(proc.info["cmdline"] or [])  # ["slurmstepd: [1.0]", "", ...], ["slurmstepd:", "[1.batch]"]
            if title.startswith(f"slurmstepd: [{job_id}.") and "batch" not in title:
                found[proc] = proc.children(recursive=True)
    return found


def mid_run_shards(shards: Path) -> bool:
    """Whether both stages have written a shard of a step before the last quarter (the trainers still run)."""
    steps = [[int(p.name.split(".")[1][len("step"):]) for p in shards.glob(f"stage{s}.step*.pt")] for s in (0, 1)]
    return all(found and max(found) < SWARM_STEPS * 3 // 4 for found in steps)


def rule_process(job_id: str):
    """The swarm-pretrain command's process in a job's batch step (None when there is none)."""
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if " ".join(proc.info["cmdline"] or []).startswith(f"slurmstepd: [{job_id}.batch]"):
                return next((p for p in proc.children(recursive=True) if "swarm-pretrain" in p.cmdline()), None)
    return None


def test_swarm_processes_run_as_job_steps_and_a_killed_rule_resumes(cluster, local, tmp_path_factory):
    work = copy_workflow(tmp_path_factory.mktemp("swarm_srun"))
    (work / "slurm_test.yaml").write_text(SWARM_OVERLAY)
    for folder in ("results/data", "results/tokenizers", "results/packed"):
        shutil.copytree(local / folder, work / folder)  # keeps the times: only swarm_pretrain is to run
    assert planned_jobs(work, f"{SWARM_RUN}/summary.json", *CONFIG) == Counter({"swarm_pretrain": 1})
    cmd = ["snakemake", *PROFILE, f"{SWARM_RUN}/summary.json", *CONFIG]
    shards = work / SWARM_STATE / "launcher" / "shards"
    steps_seen: set[str] = set()
    with open(work / "snakemake.log", "w") as out:
        proc = subprocess.Popen(cmd, cwd=work, env=env(**CPU_CLUSTER), stdout=out, stderr=subprocess.STDOUT)
    first, first_steps, trainer_killed, seen_shards, deadline = None, [], None, [], time.monotonic() + 900
    try:
        while proc.poll() is None:
            assert time.monotonic() < deadline, (work / "snakemake.log").read_text()[-4000:]
            steps = job_steps()
            steps_seen |= set(steps)
            if trainer_killed is None and (shards.parent / "trainer0.losses.jsonl").exists():  # training runs:
                # SIGKILL trainer 1's step
                trainer_killed = next((step for name, step in steps.items() if name.endswith(".trainer1.1")), None)
                if trainer_killed:
                    run("scancel", "--signal=KILL", trainer_killed)
            restarted = any(name.endswith(".trainer1.2") for name in steps_seen)
            if seen_shards[-1:] != [sorted(p.name for p in shards.glob("*.pt"))]:
                seen_shards.append(sorted(p.name for p in shards.glob("*.pt")))
            if first is None and restarted and mid_run_shards(shards):
                job = next(job for job in cluster.jobs() if rule_of(job) == "swarm_pretrain")
                victim = rule_process(job["id"])
                if victim is not None:  # the first job's steps' processes, then SIGKILL of the rule's process
                    first, first_steps = job, step_processes(job["id"])
                    victim.kill()
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = work / "logs/swarm_pretrain/synthetic/swarm/v128.log"
    output = (work / "snakemake.log").read_text()[-4000:] + (log.read_text()[-4000:] if log.exists() else "")
    assert first is not None and trainer_killed is not None, f"{seen_shards}\n{steps_seen}\n{output}"
    assert proc.returncode == 0, output
    # the first job failed with its rule's process and took every process of its steps with it: 5 steps
    # (bootstrap, 2 peers, 2 trainers), each a slurmstepd with its task (and the task's p2pd) under it
    assert len(first_steps) == 5 and all(first_steps.values()), first_steps
    gone, alive = psutil.wait_procs([p for stepd, tasks in first_steps.items() for p in (stepd, *tasks)], timeout=60)
    assert alive == [], alive
    jobs = {job["id"]: job for job in cluster.jobs() if rule_of(job) == "swarm_pretrain"}
    assert len(jobs) == 2 and jobs.pop(first["id"])["state"] != "COMPLETED", cluster.jobs()
    second = next(iter(jobs.values()))
    assert second["state"] == "COMPLETED" and "cpu=2" in second["tres"], second  # --ntasks=2: the peers' CPUs
    # every process was its own job step, <run id>.<process>.<start>; the killed trainer's step started again (a
    # resumed trainer whose shard is done exits at once: its step may come and go between two looks)
    runs: dict[str, set[str]] = {}
    for name in steps_seen:
        if name.startswith("cs"):
            runs.setdefault(name.split(".", 1)[0], set()).add(name.split(".", 1)[1])
    assert len(runs) == 2, steps_seen
    before, after = sorted(runs.values(), key=lambda names: "trainer1.2" not in names)
    assert {"bootstrap.1", "s0p1.1", "s1p2.1", "trainer0.1", "trainer1.1", "trainer1.2"} <= before, steps_seen
    # the resumed launcher's peers take fresh uids (s0p3, s1p4: the first life's logs stay)
    assert "bootstrap.1" in after and {name.split("p")[0] for name in after if name.startswith("s")} == {"s0", "s1"}
    # the second job resumed from the first one's shards and ran under the launcher, nothing lost
    stats = json.loads((work / SWARM_RUN / "summary.json").read_text())["swarm_stats"]
    assert stats["placement"] == "srun" and stats["roles"] == "launcher"
    assert stats["resumed"]["shard_steps"][0] > 0 and stats["resumed"]["shard_steps"][1] > 0, stats["resumed"]
    assert stats["microbatches_requested"] == stats["microbatches_done"] > 0 and stats["lost_microbatches"] == 0
    total = stats["microbatches_requested"]  # each stepped on every stage (at least once), across both jobs
    assert stats["stepped_microbatches"] == [total, total] and stats["assembled_from"] == ["shard", "shard"]
    # nothing outlived the run: no process, no job step, no state folder
    assert processes_left(str(work / SWARM_STATE)) == []
    assert not any(name.startswith("cs") for name in job_steps())
    assert not (work / SWARM_STATE / "launcher").exists()


# Data-parallel pretraining through the profile: pretrain.impl.devices 2 on the 2-CPU test node is one SLURM job with
# 2 CPUs (the rule's threads), in which the pretrain command relaunches itself through torchrun as 2 gloo processes.
DDP_OVERLAY = "pretrain:\n  budget: {unit: tokens, value: 81920}\n  impl: {devices: 2}\n"  # 20 steps of 32 x 128 tokens


def test_data_parallel_pretraining_runs_as_one_slurm_job(cluster, local, tmp_path_factory):
    work = copy_workflow(tmp_path_factory.mktemp("ddp"))
    (work / "slurm_test.yaml").write_text(DDP_OVERLAY)
    for folder in ("results/data", "results/tokenizers", "results/packed"):
        shutil.copytree(local / folder, work / folder)  # keeps the times: only pretrain is to run
    assert planned_jobs(work, f"{PRETRAIN}/summary.json", *CONFIG) == Counter({"pretrain": 1})
    proc = snakemake(work, *PROFILE, f"{PRETRAIN}/summary.json", *CONFIG, check=False, timeout=900,
                     env=env(**CPU_CLUSTER))  # fmt: skip
    log = work / "logs/pretrain/synthetic/crammed/v128.log"
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:] + (log.read_text()[-4000:] if log.exists() else "")
    submitted = proc.stdout + proc.stderr
    job = next(job for job in cluster.jobs() if f"submitted with SLURM jobid {job['id']} " in submitted)
    assert job["state"] == "COMPLETED" and "cpu=2" in job["tres"] and "gpu" not in job["tres"], job
    summary = json.loads((work / PRETRAIN / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["steps"] == 20 and summary["tokens"] == 81920
    assert log.read_text().count('"processes": 2') == 1  # one summary printed: rank 0's
    assert processes_left(str(work / PRETRAIN)) == []  # torchrun and both processes ended with the job
