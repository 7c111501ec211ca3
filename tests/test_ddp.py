"""Data-parallel pretraining on CPU: 2 gloo processes started through torchrun by ``python -m cramswarm pretrain``.

Two processes x micro/2 sequences see exactly the blocks (and masks) one process x micro sees, with the loss
weighted by predicted tokens, so the logged loss curve of the two runs agrees to float32 rounding (the tolerance
below: the two all-reduce the same sums in another order). A run killed mid-way resumes at the other world size.
"""

import csv
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch.distributed as dist
from conftest import ARCH, REPO, recipe

from cramswarm.distributed import launch_command
from cramswarm.impl import PretrainImpl

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is unavailable"
)

# loss rows of 1 x B and 2 x B/2 (float32, 12 steps of the tiny model): equal up to summation order
LOSS_ATOL = 2e-4


def command(folder, tok_path, out, r, state=None, **how):
    """The pretrain command line; ``how``: pretrain.impl keys (on the CPU, a log row per step by default)."""
    run_impl = {"device": "cpu", "log_every_steps": 1} | how
    argv = [sys.executable, "-m", "cramswarm", "pretrain", "--recipe", json.dumps(r), "--impl", json.dumps(run_impl),
            "--arch", json.dumps(ARCH),
            "--blocks", str(folder / "blocks.npy"), "--tokenizer", str(tok_path), "--out-dir", str(out),
            "--run", "ddp-test", "--quiet"]  # fmt: skip
    return argv + (["--state-dir", str(state)] if state else [])


def env():
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
    }


def run(folder, tok_path, out, r, state=None, **how):
    proc = subprocess.run(
        command(folder, tok_path, out, r, state, **how), env=env(), cwd=folder, capture_output=True, text=True,
        timeout=560,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def losses(path):
    return [(int(row["step"]), float(row["loss"])) for row in csv.DictReader(open(path))]


def tiny_recipe(**kw):
    # bernoulli masking: the two halves of a micro-batch predict different numbers of tokens, so the loss weighting
    # by predicted tokens is what makes the curves agree
    base = dict(budget={"unit": "steps", "value": 12}, precision="fp32", mask_mode="bernoulli", mask_rate=0.2,
                eval_blocks=16, eval_points=2)  # fmt: skip
    return recipe(**(base | kw))


def test_launch_command_only_for_several_processes():
    assert launch_command(PretrainImpl(devices=1, nodes=1), ["pretrain"]) is None
    cmd = launch_command(PretrainImpl(devices=2, nodes=1), ["pretrain", "--quiet"])
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and "--nproc-per-node=2" in cmd and "--standalone" in cmd
    assert cmd[-5:] == ["-m", "--", "cramswarm", "pretrain", "--quiet"]


def test_several_nodes_need_a_slurm_allocation(monkeypatch):
    for name in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="pretrain.impl.nodes"):
        launch_command(PretrainImpl(devices=1, nodes=2), ["pretrain"])


def test_two_processes_match_one_and_only_rank_0_writes(tiny_run):
    folder, tok_path = tiny_run
    before = {p.relative_to(folder) for p in folder.rglob("*")}
    run(folder, tok_path, folder / "one", tiny_recipe())
    two = run(folder, tok_path, folder / "two", tiny_recipe(), devices=2)
    a, b = losses(folder / "one" / "train_log.csv"), losses(folder / "two" / "train_log.csv")
    assert [s for s, _ in a] == [s for s, _ in b] == list(range(1, 13))
    np.testing.assert_allclose([v for _, v in b], [v for _, v in a], rtol=0, atol=LOSS_ATOL)
    assert a[-1][1] < a[0][1]  # it learned something, so the comparison is not of two flat curves
    s1, s2 = (json.loads((folder / d / "summary.json").read_text()) for d in ("one", "two"))
    assert (s1["processes"], s2["processes"]) == (1, 2)
    assert s1["steps"] == s2["steps"] and s1["tokens"] == s2["tokens"]
    assert s2["eval_loss"] == pytest.approx(s1["eval_loss"], abs=LOSS_ATOL)
    # rank 0 alone wrote: the same files as the one-process run, nothing else anywhere, one summary printed
    assert sorted(p.name for p in (folder / "two").iterdir()) == sorted(p.name for p in (folder / "one").iterdir())
    after = {p.relative_to(folder) for p in folder.rglob("*")}
    assert {p.parts[0] for p in after - before} == {"one", "two"}
    assert sum(line.startswith("{") for line in two.stdout.splitlines()) == 1


def test_killed_two_process_run_resumes_as_one_process_to_the_same_end(tiny_run):
    folder, tok_path = tiny_run
    r = tiny_recipe(budget={"unit": "tokens", "value": 60 * 16 * 32})
    how = dict(resume_every_steps=5, log_every_steps=5)
    run(folder, tok_path, folder / "full", r, **how)

    out, state = folder / "killed", folder / "state"
    killed_log = folder / "killed.log"  # what the killed run printed, for the messages below
    with open(killed_log, "w") as log:
        proc = subprocess.Popen(command(folder, tok_path, out, r, state, devices=2, **how), env=env(), cwd=folder,
                                start_new_session=True, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.monotonic() + 300
    while not (state / "state.pt").exists():  # the first saved state, then kill torchrun and its processes
        assert proc.poll() is None, f"the 2-process run ended before it saved any state:\n{killed_log.read_text()}"
        assert time.monotonic() < deadline, f"no training state appeared within 300 s:\n{killed_log.read_text()}"
        time.sleep(0.02)
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "summary.json").exists(), "the run finished before it was killed; raise the budget"

    resumed_run = run(folder, tok_path, out, r, state, devices=1, **how)
    assert "resuming from" in resumed_run.stdout, resumed_run.stdout[-3000:] + killed_log.read_text()[-3000:]
    resumed = json.loads((out / "summary.json").read_text())
    full = json.loads((folder / "full" / "summary.json").read_text())
    assert 0 < resumed["resumed_from_step"] < full["steps"] == 60
    assert resumed["steps"] == full["steps"] and resumed["tokens"] == full["tokens"]
    a, b = losses(folder / "full" / "train_log.csv"), losses(out / "train_log.csv")
    assert [s for s, _ in a] == [s for s, _ in b]
    np.testing.assert_allclose([v for _, v in b], [v for _, v in a], rtol=0, atol=1e-3)
    assert not (state / "state.pt").exists()


def test_two_processes_stop_together_on_a_seconds_budget(tiny_run):
    """Under a wall-clock budget the processes follow rank 0's clock, so they stop after the same step (a process
    stopping alone would leave the other waiting in its all-reduce until the test's timeout)."""
    folder, tok_path = tiny_run
    r = tiny_recipe(budget={"unit": "seconds", "value": 4})
    run(folder, tok_path, folder / "timed", r, devices=2, log_every_steps=5)
    summary = json.loads((folder / "timed" / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["steps"] > 0
    assert summary["tokens"] == summary["steps"] * 16 * 32  # whole global batches of 16 sequences x 32 tokens
    assert summary["elapsed_s"] >= 4
