"""The launcher's srun placement (cramswarm.swarm.srun) against stand-ins for srun, squeue and scancel.

The stand-in srun runs its command in a session of its own, as slurmstepd runs a task apart from the srun client:
a SIGKILL of the client's process group does not reach it, only scancel of its step does (tests/test_slurm.py runs
the launcher's swarm on a real one-node SLURM cluster)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cramswarm.swarm.peer_process import exit_with_parent
from cramswarm.swarm.processes import ProcessGroups
from cramswarm.swarm.srun import SrunPlacement

SRUN = '''
import os, subprocess, sys
args, name = sys.argv[1:], None
while args and args[0].startswith("--"):
    option = args.pop(0)
    if option.startswith("--job-name="):
        name = option.split("=", 1)[1]
steps = os.environ["FAKE_SLURM_STEPS"]
task = subprocess.Popen(args, start_new_session=True)  # the remote task: not in the client's process group
with open(os.path.join(steps, str(task.pid)), "w") as out:
    out.write(f"{os.environ['SLURM_JOB_ID']}.{task.pid} {name}\\n")
code = task.wait()
os.unlink(os.path.join(steps, str(task.pid)))
sys.exit(128 - code if code < 0 else code)  # as srun: 128 + the signal that killed the task
'''
SQUEUE = '''
import os
steps = os.environ["FAKE_SLURM_STEPS"]
for pid in os.listdir(steps):
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        continue
    if state != "Z":
        print(open(os.path.join(steps, pid)).read().strip())
'''
SCANCEL = '''
import os, signal, sys
for step in sys.argv[1:]:
    if not step.startswith("--"):
        try:
            os.killpg(int(step.split(".")[1]), signal.SIGKILL)  # slurmstepd kills every process of the step
        except ProcessLookupError:
            pass
'''
# a task that starts a child of its own (as a peer starts its p2pd) and records both pids and what it was given
TASK = '''
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(sys.argv[1], "w") as out:
    out.write(f"{os.getpid()} {child.pid} {os.environ.get('CRAMSWARM_PARENT_PID')!r}\\n")
time.sleep(600)
'''


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    bin_dir, steps = tmp_path / "bin", tmp_path / "steps"
    bin_dir.mkdir()
    steps.mkdir()
    for name, code in (("srun", SRUN), ("squeue", SQUEUE), ("scancel", SCANCEL)):
        (bin_dir / name).write_text(f"#!{sys.executable}\n{code}")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM_STEPS", str(steps))
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    return steps


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def start(groups: ProcessGroups, name: str, record: Path) -> tuple[subprocess.Popen, int, int, str]:
    proc, _ = groups.spawn([str(record)], name, launcher=[sys.executable, "-c", TASK])
    deadline = time.monotonic() + 30
    while not record.exists() or not record.read_text().endswith("\n"):
        assert proc.poll() is None and time.monotonic() < deadline, (groups.workdir / f"{name}.log").read_text()
        time.sleep(0.05)
    task, child, coordinator = record.read_text().split()
    return proc, int(task), int(child), coordinator


def test_each_process_is_a_job_step_killed_with_scancel(fake_slurm, tmp_path):
    place = SrunPlacement("csrun1", ["--gpus-per-task=1"])
    prefix, env = place("s0p1")
    assert prefix[0] == "srun" and {"--jobid=77", "--ntasks=1", "--nodes=1", "--overlap", "--exact",
                                    "--job-name=csrun1.s0p1.1", "--gpus-per-task=1"} <= set(prefix)
    assert env == {"CRAMSWARM_PARENT_PID": ""}  # under slurmstepd: no parent watchdog
    assert "--gpus-per-task=1" not in place("trainer0")[0]  # swarm.impl.srun_args: the stage peers' steps only
    place = SrunPlacement("csrun1")
    groups = ProcessGroups(tmp_path, place=place)
    peer, task, child, coordinator = start(groups, "s0p1", tmp_path / "peer.txt")
    assert coordinator == "''"
    assert place.live_steps() == {"csrun1.s0p1.1": f"77.{task}"}
    # the launcher's kill: the step goes (task and its child), the srun client exits as srun does (128 + 9)
    groups.kill(peer)
    assert peer.returncode == 128 + signal.SIGKILL
    deadline = time.monotonic() + 10
    while (alive(task) or alive(child)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(task) and not alive(child)
    assert place.live_steps() == {}
    # a restart under the same name is a new step; close ends every step of the run, the leftover check passes
    again, task2, child2, _ = start(groups, "s0p1", tmp_path / "again.txt")
    trainer, task3, child3, _ = start(groups, "trainer0", tmp_path / "trainer.txt")
    assert set(place.live_steps()) == {"csrun1.s0p1.2", "csrun1.trainer0.1"}
    groups.close()
    assert place.live_steps() == {} and not any(alive(pid) for pid in (task2, child2, task3, child3))
    assert again.poll() is not None and trainer.poll() is not None


def test_killing_only_the_srun_client_leaves_the_task(fake_slurm, tmp_path):
    """Why kill goes through scancel: the client's process group does not hold the remote task."""
    place = SrunPlacement("csrun2")
    groups = ProcessGroups(tmp_path, place=place)
    proc, task, child, _ = start(groups, "bootstrap", tmp_path / "boot.txt")
    try:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        time.sleep(0.3)
        assert alive(task) and alive(child)
        assert set(place.live_steps()) == {"csrun2.bootstrap.1"}
    finally:
        place.close()
    deadline = time.monotonic() + 10
    while (alive(task) or alive(child)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(task) and not alive(child)


def test_srun_placement_needs_a_slurm_job(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(ValueError, match="SLURM_JOB_ID is unset"):
        SrunPlacement("cs")


def test_a_process_without_a_watched_parent_does_not_exit_by_the_watchdog(monkeypatch):
    monkeypatch.setenv("CRAMSWARM_PARENT_PID", "")
    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(asyncio.wait_for(exit_with_parent(), timeout=1.5))
