"""The OS processes of a hivemind swarm: each started as its own process-group leader
(``start_new_session=True``) and killed as a group with ``os.killpg``, so no ``p2pd`` daemon or child outlives it.
They do not watch the launcher's process: the swarm outlives it and leaves on its DHT heartbeat (``membership``).
A launcher re-attaching to a live swarm adopts the processes an earlier launcher started (``Adopted``,
``swarm_processes``). Used by the launcher (``launcher``)."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

import cramswarm

PEER_MODULE = [sys.executable, "-m", "cramswarm.swarm.peer_process"]
SUPERVISE_PERIOD_S = 0.5  # the launcher checks its processes (and, ending a run, its stages) this often
_LIVE_GROUPS: set[int] = set()  # process groups started by this process and not yet killed


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    _LIVE_GROUPS.discard(pgid)


@atexit.register
def _kill_leftover_groups() -> None:
    for pgid in list(_LIVE_GROUPS):
        _kill_group(pgid)


def visible_gpus() -> list[str]:
    """This process's GPUs as CUDA_VISIBLE_DEVICES entries (the variable's own list where it is set)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed:
        return [g.strip() for g in listed.split(",") if g.strip()]
    import torch  # here, not at the top: the launcher's peers import this module before they pick a device

    return [str(i) for i in range(torch.cuda.device_count())]


def peer_gpu(peer_number: int, device: str) -> str | None:
    """The GPU the ``peer_number``-th peer started on this host sees alone (``CUDA_VISIBLE_DEVICES``): this host's
    GPUs in turn, when the run's ``device`` (pretrain.impl) is not ``cpu`` and there is a GPU; None (the environment
    as it is) otherwise. Used by the local placements of the launcher; under srun, SLURM assigns them."""
    if device == "cpu":
        return None
    gpus = visible_gpus()
    return gpus[(peer_number - 1) % len(gpus)] if gpus else None


@dataclass
class PeerProcess:
    uid: str
    stage: int
    speed: float
    proc: subprocess.Popen
    log: Path

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else "(no log)"


class ProcessGroups:
    """The run's OS processes; each is a process-group leader and is killed with its whole group."""

    def __init__(self, workdir: Path, place=None):
        self.workdir = workdir
        # place(name) -> (command prefix, extra environment) of the process called ``name`` (e.g.
        # ``cramswarm.testbed.swarm.HostPlacement``: run it in a testbed host's namespace); None: here, as is
        self.place = place
        self.pgids: list[int] = []  # every group ever started (for the leftover check)
        self.procs: list[subprocess.Popen] = []
        self._pythonpath = os.pathsep.join(
            filter(None, [str(Path(cramswarm.__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")]))

    def spawn(self, args: list[str], name: str, launcher: list[str] = PEER_MODULE,
              gpu: str | None = None) -> tuple[subprocess.Popen, Path]:
        log = self.workdir / f"{name}.log"
        # no parent watchdog (CRAMSWARM_PARENT_PID empty): the process outlives this one, leaving on its heartbeat
        env = {**os.environ, "PYTHONPATH": self._pythonpath, "OMP_NUM_THREADS": "1", "CRAMSWARM_PARENT_PID": ""}
        if gpu is not None:  # one of this host's GPUs (local placement spreads its peers over them)
            env["CUDA_VISIBLE_DEVICES"] = gpu
        prefix: list[str] = []
        if self.place is not None:
            prefix, extra = self.place(name)
            env.update(extra)
        with open(log, "wb") as out:
            proc = subprocess.Popen([*prefix, *launcher, *args], stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True)
        if hasattr(self.place, "started_process"):  # e.g. srun.SrunPlacement: which job step the client runs
            self.place.started_process(proc)
        self.adopt(proc)
        return proc, log

    def start_peer(self, uid: str, stage: int, speed: float, config: Path, addr_file: Path,
                   load_state: bool, gpu: str | None = None) -> PeerProcess:
        args = ["stage", "--config", str(config), "--stage", str(stage), "--uid", uid, "--addr-file",
                str(addr_file), "--speed", repr(speed)] + (["--load-state"] if load_state else [])
        return PeerProcess(uid, stage, speed, *self.spawn(args, uid, gpu=gpu))

    def adopt(self, proc: subprocess.Popen | Adopted) -> None:
        """Count a live process as one of this run's groups: one ``spawn`` started, or one an earlier launcher
        started (``Adopted``)."""
        _LIVE_GROUPS.add(proc.pid)
        self.pgids.append(proc.pid)
        self.procs.append(proc)

    def kill(self, proc: subprocess.Popen) -> None:
        """SIGKILL a process and its group (first its remote part where the placement has one: a job step)."""
        if hasattr(self.place, "kill"):
            self.place.kill(proc)
        _kill_group(proc.pid)
        proc.wait()

    def close(self, timeout_s: float = 10.0) -> None:
        """Kill every group, reap the leaders, and wait until no member of any group is left (and, where the
        placement has remote parts, until they are gone: ``srun.SrunPlacement.close``)."""
        try:
            if hasattr(self.place, "close"):
                self.place.close()
        finally:  # the local groups go whatever happened to the remote parts
            for pgid in self.pgids:
                _kill_group(pgid)
            for proc in self.procs:
                proc.wait()
        deadline = time.monotonic() + timeout_s
        while (left := leftover_processes(self.pgids)) and time.monotonic() < deadline:
            time.sleep(0.05)
        if left:
            raise RuntimeError(f"processes {left} of this swarm survived SIGKILL of their process groups")


class Adopted:
    """A live process of the swarm that an earlier launcher started (so not this process's child), with
    ``subprocess.Popen``'s ``pid``, ``poll``, ``wait`` (no timeout) and ``returncode``. Its exit code cannot be
    read: once it is gone, ``poll`` gives 0 where ``ended_well()`` says its work was done, else ``-SIGKILL``
    (restart it)."""

    def __init__(self, pid: int, ended_well=lambda: False):
        self.pid, self.returncode, self._ended_well = pid, None, ended_well
        try:
            self._proc = psutil.Process(pid)
        except psutil.NoSuchProcess:
            self._proc = None

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(psutil.Error):
                if self._proc is not None and self._proc.status() != psutil.STATUS_ZOMBIE:
                    return None   # running
            self.returncode = 0 if self._ended_well() else -signal.SIGKILL
        return self.returncode

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(0.05)
        return self.returncode


def swarm_processes(markers: set[str]) -> dict[str, list[tuple[int, list[str]]]]:
    """The live processes of a swarm on this host, by role (``bootstrap``, ``stage``, ``trainer``, and ``other``
    for any other process naming them): (pid, command line) of each process whose command line names one of
    ``markers`` (its run folder's config or address file)."""
    found: dict[str, list[tuple[int, list[str]]]] = {"bootstrap": [], "stage": [], "trainer": [], "other": []}
    for proc in psutil.process_iter(["cmdline", "status"]):
        with contextlib.suppress(psutil.Error):
            cmdline = proc.info["cmdline"] or []
            if not markers & set(cmdline) or proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            role = ("trainer" if "cramswarm.swarm.trainer" in cmdline else
                    "bootstrap" if "bootstrap" in cmdline else "stage" if "stage" in cmdline else "other")
            found[role].append((proc.pid, cmdline))
    return found


def leftover_processes(pgids: list[int]) -> list[int]:
    """PIDs of live (non-zombie) processes in any of the given process groups (one gone meanwhile is skipped)."""
    wanted, found = set(pgids), []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if proc.status() != psutil.STATUS_ZOMBIE and os.getpgid(proc.pid) in wanted:
                found.append(proc.pid)
    return found


def own_daemons() -> set[int]:
    """PIDs of this process's ``p2pd`` children (its DHT node's daemon)."""
    return {c.pid for c in psutil.Process().children() if c.name() == "p2pd"}
