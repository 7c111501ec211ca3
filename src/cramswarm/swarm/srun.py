"""The launcher's ``srun`` placement: every process it starts is its own job step of the SLURM job it runs in.

``SrunPlacement`` is a ``processes.ProcessGroups.place``: the bootstrap DHT, each stage peer and each trainer runs
as ``srun --ntasks=1 --nodes=1 --cpus-per-task=1 --exact --overlap --job-name=<run id>.<process>.<n> ...`` (a stage
peer's step also with ``swarm.impl.srun_args``, e.g. ``--gpus-per-task=1``), so SLURM puts it on any node of the
allocation. ``--overlap``: the steps share the job's
CPUs and memory (the job asks for one CPU per stage peer; the trainers and the bootstrap are light), and a step
never waits for another to end. The processes run under ``slurmstepd``, not under the launcher: the parent
watchdog (``CRAMSWARM_PARENT_PID``) is off for them, and they leave once the launcher's DHT heartbeat says
``done`` or has been missing ``launcher_grace_s`` (the bootstrap included: ``--run-id``).

Killing: a SIGKILL of the ``srun`` client does not reach the remote task, so ``kill`` finds the process's step
by its name (``squeue --steps``) and sends it SIGKILL (``scancel --signal=KILL <job>.<step>``): slurmstepd kills
the task with every process it started (its ``p2pd`` too). Then the client exits by itself and its process group
is killed as in the local placement. ``close`` does the same for every step of the run and waits until SLURM lists
none of them (else it raises, naming them), so no process is left on any node.

If the job itself ends (the rule's process killed inside the batch step, a requeue, ``scancel`` of the job),
SLURM ends every step with it; a rerun resumes from the stage shards in the state folder as in the local placement.
"""

from __future__ import annotations

import os
import re
import subprocess
import time

STEP_TIMEOUT_S = 30.0  # seconds for a step to end after its SIGKILL (and for one just started to be listed)


class SrunPlacement:
    """``ProcessGroups.place`` running each process as its own job step of this process's SLURM job
    (``SLURM_JOB_ID``), one CPU each; step names start with ``prefix`` (the launcher's run id); ``srun_args`` go to
    the stage peers' steps only."""

    def __init__(self, prefix: str, srun_args: list[str] | None = None):
        self.job_id = os.environ.get("SLURM_JOB_ID")
        if not self.job_id:
            raise ValueError("swarm.impl.placement=srun starts each process as a job step of the SLURM job it runs in, "
                             "but SLURM_JOB_ID is unset: run it through profiles/slurm (or placement: local)")
        self.prefix, self.srun_args = prefix, list(srun_args or [])
        self.started: dict[str, int] = {}   # process name -> steps started under it
        self.steps: dict[int, str] = {}     # srun client pid -> its step's name
        self._last: str | None = None

    def __call__(self, name: str) -> tuple[list[str], dict[str, str]]:
        self.started[name] = self.started.get(name, 0) + 1
        self._last = step = f"{self.prefix}.{name}.{self.started[name]}"
        peer = re.fullmatch(r"s\d+p\d+", name) is not None  # a stage peer (launcher.Launcher._start_peer's names)
        prefix = ["srun", f"--jobid={self.job_id}", "--ntasks=1", "--nodes=1", "--cpus-per-task=1",
                  "--exact", "--overlap", f"--job-name={step}", "--kill-on-bad-exit=0", "--quiet",
                  *(self.srun_args if peer else [])]
        # under slurmstepd the parent is not the launcher: no parent watchdog, the DHT heartbeat ends them
        return prefix, {"CRAMSWARM_PARENT_PID": ""}

    def started_process(self, proc: subprocess.Popen) -> None:
        """Called by ``ProcessGroups.spawn`` right after the ``srun`` client of the last ``__call__`` started."""
        self.steps[proc.pid] = self._last

    def live_steps(self) -> dict[str, str]:
        """Step name -> ``<job>.<step>`` of this run's steps SLURM lists now (a failing ``squeue`` raises with its
        stderr)."""
        cmd = ["squeue", "-h", "--steps", f"--jobs={self.job_id}", "-o", "%i %j"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed with code {proc.returncode}: {proc.stderr.strip()}")
        found = {}
        for line in proc.stdout.splitlines():
            step, _, name = line.strip().partition(" ")
            if name.startswith(f"{self.prefix}."):
                found[name.strip()] = step
        return found

    def signal_steps(self, names: set[str]) -> set[str]:
        """SIGKILL the listed ones of ``names``; returns the names still listed."""
        live = {n: s for n, s in self.live_steps().items() if n in names}
        if live:
            subprocess.run(["scancel", "--signal=KILL", *live.values()], capture_output=True, timeout=30)
        return set(live)

    def kill(self, proc: subprocess.Popen) -> None:
        """SIGKILL the step of the ``srun`` client ``proc`` and wait for the client to exit (the caller then kills
        the client's process group, as for a local process)."""
        name = self.steps.get(proc.pid)
        if name is None:
            return
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while proc.poll() is None and time.monotonic() < deadline:
            self.signal_steps({name})  # a step not yet listed (srun still creating it) is tried again
            for _ in range(10):
                if proc.poll() is not None:
                    break
                time.sleep(0.1)

    def close(self) -> None:
        """SIGKILL every step of this run and wait until SLURM lists none of them (``STEP_TIMEOUT_S``, else it
        raises)."""
        names = set(self.steps.values())
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while left := self.signal_steps(names):
            if time.monotonic() > deadline:
                raise RuntimeError(f"job steps {sorted(left)} of this swarm are still listed by SLURM "
                                   f"{STEP_TIMEOUT_S:.0f} s after their SIGKILL")
            time.sleep(0.5)
