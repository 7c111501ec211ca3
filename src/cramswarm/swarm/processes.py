"""The OS processes of a hivemind swarm: each started as its own process-group leader
(``start_new_session=True``) and killed as a group with ``os.killpg``, so no ``p2pd`` daemon or child outlives it.
Used by the coordinator (``hivemind_transport``) and the launcher (``launcher``)."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

import cramswarm

PEER_MODULE = [sys.executable, "-m", "cramswarm.swarm.hivemind_peer"]
PR_SET_PDEATHSIG = 1  # prctl(2) option: the signal a child gets when the thread that forked it exits
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
        self.peers: list[PeerProcess] = []
        self.pgids: list[int] = []  # every group ever started (for the leftover check)
        self.procs: list[subprocess.Popen] = []
        self._pythonpath = os.pathsep.join(
            filter(None, [str(Path(cramswarm.__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")]))

    def spawn(self, args: list[str], name: str, launcher: list[str] = PEER_MODULE,
              gpu: str | None = None) -> tuple[subprocess.Popen, Path]:
        log = self.workdir / f"{name}.log"
        env = {**os.environ, "PYTHONPATH": self._pythonpath, "OMP_NUM_THREADS": "1",
               "CRAMSWARM_COORDINATOR_PID": str(os.getpid())}
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
        _LIVE_GROUPS.add(proc.pid)
        self.pgids.append(proc.pid)
        self.procs.append(proc)
        return proc, log

    def start_peer(self, uid: str, stage: int, speed: float, config: Path, addr_file: Path,
                   load_state: bool, gpu: str | None = None) -> PeerProcess:
        args = ["stage", "--config", str(config), "--stage", str(stage), "--uid", uid, "--addr-file",
                str(addr_file), "--speed", repr(speed)] + (["--load-state"] if load_state else [])
        proc, log = self.spawn(args, uid, gpu=gpu)
        peer = PeerProcess(uid, stage, speed, proc, log)
        self.peers.append(peer)
        return peer

    @staticmethod
    def kill(proc: subprocess.Popen) -> None:
        _kill_group(proc.pid)
        proc.wait()

    def close(self, timeout_s: float = 10.0) -> None:
        """Kill every group, reap the leaders, and wait until no member of any group is left."""
        for pgid in self.pgids:
            _kill_group(pgid)
        for proc in self.procs:
            proc.wait()
        deadline = time.monotonic() + timeout_s
        while (left := leftover_processes(self.pgids)) and time.monotonic() < deadline:
            time.sleep(0.05)
        if left:
            raise RuntimeError(f"processes {left} of this swarm survived SIGKILL of their process groups")


def _die_with(parent: int) -> None:
    """In a forked child before exec: SIGKILL this child when ``parent`` dies (at once if it already has)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def daemons_die_with_this_process():
    """Within this block, a DHT node created in this process gets a ``p2pd`` that the kernel SIGKILLs when this
    process dies, even by SIGKILL (no ``finally`` or ``atexit`` runs then; the daemon would be left behind, since
    it shares this process's group and nothing else watches it). hivemind 1.1.12 starts the daemon with
    ``asyncio.subprocess.create_subprocess_exec`` and offers no hook for its process attributes, so that call is
    wrapped to set ``PR_SET_PDEATHSIG`` (Linux only; elsewhere a no-op). The signal follows the thread that
    forked: call it from the thread running this process's event loop for its whole life (e.g. the main one)."""
    if not sys.platform.startswith("linux"):
        yield
        return
    original, parent = asyncio.subprocess.create_subprocess_exec, os.getpid()

    async def create_subprocess_exec(*args, **kwargs):
        kwargs.setdefault("preexec_fn", lambda: _die_with(parent))
        return await original(*args, **kwargs)

    asyncio.subprocess.create_subprocess_exec = create_subprocess_exec
    try:
        yield
    finally:
        asyncio.subprocess.create_subprocess_exec = original


def leftover_processes(pgids: list[int]) -> list[int]:
    """PIDs of live (non-zombie) processes in any of the given process groups (scans /proc)."""
    wanted, found = set(pgids), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z" and int(fields[2]) in wanted:
            found.append(int(entry.name))
    return found


def own_daemons() -> set[int]:
    """PIDs of this process's ``p2pd`` children (its DHT node's daemon)."""
    return {c.pid for c in psutil.Process().children() if c.name() == "p2pd"}
