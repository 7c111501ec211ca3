"""Resume after SIGKILL: a killed `python -m cramswarm pretrain`, rerun, continues from its last saved state.

With a token budget the resumed run must end at the same step count as an uninterrupted run, with the same
log rows and a final loss within a small tolerance.
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
from conftest import ARCH, REPO, recipe


def command(folder, tok_path, out, state, r):
    return [
        sys.executable,
        "-m",
        "cramswarm",
        "pretrain",
        "--recipe",
        json.dumps(r),
        "--impl",
        json.dumps({"device": "cpu", "resume_every_steps": 10, "log_every_steps": 10}),
        "--arch",
        json.dumps(ARCH),
        "--blocks",
        str(folder / "blocks.npy"),
        "--tokenizer",
        str(tok_path),
        "--out-dir",
        str(out),
        "--state-dir",
        str(state),
        "--run",
        "resume-test",
        "--quiet",
    ]


def env():
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])),
    }


def log_rows(path):
    return list(csv.DictReader(open(path)))


def test_sigkill_mid_run_then_rerun_resumes_to_the_same_end(tiny_run):
    folder, tok_path = tiny_run
    r = recipe(
        budget={"unit": "tokens", "value": 300 * 16 * 32},
        eval_points=3,
        precision="fp32",
    )
    full = folder / "full"
    subprocess.run(
        command(folder, tok_path, full, folder / "state-full", r), check=True, env=env(), capture_output=True
    )

    out, state = folder / "killed", folder / "state"
    proc = subprocess.Popen(
        command(folder, tok_path, out, state, r),
        env=env(),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not (state / "state.pt").exists():  # wait for the first saved state, then kill the process group
        assert proc.poll() is None, "pretraining ended before it saved any state; raise the budget"
        assert time.monotonic() < deadline, "no training state appeared within 120 s"
        time.sleep(0.02)
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "summary.json").exists(), "the run finished before it was killed; raise the budget"

    result = subprocess.run(
        command(folder, tok_path, out, state, r), check=True, env=env(), capture_output=True, text=True
    )
    assert "resuming from" in result.stdout
    resumed = json.loads((out / "summary.json").read_text())
    uninterrupted = json.loads((full / "summary.json").read_text())
    assert 0 < resumed["resumed_from_step"] < uninterrupted["steps"]
    assert resumed["steps"] == uninterrupted["steps"] == 300
    assert resumed["tokens"] == uninterrupted["tokens"]
    a, b = log_rows(full / "train_log.csv"), log_rows(out / "train_log.csv")
    assert [row["step"] for row in a] == [row["step"] for row in b]
    np.testing.assert_allclose([float(row["loss"]) for row in a], [float(row["loss"]) for row in b], atol=1e-3)
    assert resumed["final_loss"] == pytest.approx(uninterrupted["final_loss"], abs=1e-3)
    assert resumed["eval_loss"] == pytest.approx(uninterrupted["eval_loss"], abs=1e-3)
    assert not (state / "state.pt").exists()
