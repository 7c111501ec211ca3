"""Data-parallel pretraining with torch.distributed: the process group of one run, and the launcher command.

A run asks for ``devices`` processes per node on ``nodes`` nodes (``pretrain.impl``,
:class:`~cramswarm.impl.PretrainImpl`). ``python -m cramswarm pretrain`` started by hand (or by Snakemake) with
``devices x nodes > 1`` relaunches itself through torch's launcher
(``torch.distributed.run``, i.e. torchrun); the launched processes find ``WORLD_SIZE``, ``RANK`` and
``LOCAL_RANK`` in their environment and join one process group: NCCL on CUDA, gloo on CPU.

One node: ``torchrun --standalone`` (a local rendezvous on a free port). Several nodes: inside a SLURM allocation,
one ``srun`` task per node starts torchrun, which rendezvous at the allocation's first host.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass

from cramswarm.impl import PretrainImpl

RENDEZVOUS_PORT = 29500  # multi-node: the c10d rendezvous port on the allocation's first host


def launched() -> bool:
    """Whether this process was started by torch's launcher (it sets WORLD_SIZE and LOCAL_RANK)."""
    return "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def launch_command(impl: PretrainImpl, command: list[str]) -> list[str] | None:
    """The command line that runs ``python -m cramswarm <command...>`` as the run's data-parallel job, or None
    where this process should train itself (one process asked for, or already launched)."""
    devices, nodes = impl.devices, impl.nodes
    if devices * nodes <= 1 or launched():
        return None
    run = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={devices}"]
    target = ["-m", "--", "cramswarm", *command]  # "--": the launcher's own options must not parse the command's
    if nodes == 1:
        return [*run, "--standalone", "--nnodes=1", *target]
    job, nodelist = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_JOB_NODELIST")
    if not job or not nodelist or not shutil.which("srun"):
        raise ValueError(
            f"pretrain.impl.nodes: {nodes} nodes need a SLURM allocation of {nodes} nodes to start them in (srun, "
            "SLURM_JOB_ID and SLURM_JOB_NODELIST); outside SLURM use nodes: 1"
        )
    head = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], check=True, capture_output=True, text=True
    ).stdout.split()[0]
    srun = ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    rendezvous = ["--rdzv-backend=c10d", f"--rdzv-endpoint={head}:{RENDEZVOUS_PORT}", f"--rdzv-id=cramswarm-{job}"]
    return [*srun, *run, f"--nnodes={nodes}", *rendezvous, *target]


def _die_with_launcher() -> None:
    """Linux: end this process when its launcher dies. torchrun starts its processes in sessions of their own, so
    a SIGKILL of the launcher's process group (a killed job, ``kill -9``) would leave them training on, writing
    state beside a rerun; PR_SET_PDEATHSIG has the kernel send them SIGKILL instead."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the launcher died before the line above
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class World:
    """This process's place in the run: rank among ``size`` processes, and its local rank on its node."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        """Rank 0: the only process that prints, evaluates and writes files."""
        return self.rank == 0

    @classmethod
    def join(cls, device_type: str) -> World:
        """The process group of a launched run (NCCL on CUDA, gloo on CPU); a single process without a launcher."""
        if not launched() or int(os.environ["WORLD_SIZE"]) <= 1:
            return cls()
        import torch
        import torch.distributed as dist

        backend = "nccl" if device_type == "cuda" else "gloo"
        if not dist.is_available() or (backend == "gloo" and not dist.is_gloo_available()):
            raise ValueError(f"data-parallel pretraining needs torch.distributed with the {backend} backend")
        world = cls(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]))
        _die_with_launcher()
        if device_type == "cuda":
            torch.cuda.set_device(world.local_rank)
        dist.init_process_group(backend)
        return world

    def all_sum(self, tensor):
        """``tensor`` summed over the processes (in place; returned)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def from_main(self, tensor):
        """Rank 0's ``tensor`` on every process (in place; returned)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.broadcast(tensor, src=0)
        return tensor

    def close(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
