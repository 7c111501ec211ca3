"""Transport 1: SWARM on real hivemind processes (localhost, or any hosts that share a rendezvous folder).

Its entry points: ``run_swarm`` checks a plan (``settings.SwarmPlan``) and hands it with a microbatch source (``data``)
to the launcher (``launcher``: its processes, their restarts, faults, checkpoint and resume); ``train`` is the
swarm_pretrain rule's hivemind transport.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from cramswarm.swarm.emulation_training import TrainResult
from cramswarm.swarm.processes import (  # noqa: F401 (leftover_processes, own_daemons, visible_gpus: the tests' names)
    leftover_processes,
    own_daemons,
    visible_gpus,
)
from cramswarm.swarm.settings import SwarmPlan
from cramswarm.swarm.stages import check_memory_cap, stage_state_bytes


def run_swarm(plan: SwarmPlan, source, total_microbatches: int, progress: bool = True) -> TrainResult:
    """Run one hivemind swarm under the launcher; every process it started (and this process's p2pd) is gone when
    it returns. ``source``: the microbatch source (``data``) the launcher's trainers make their own microbatches
    from (an iterator of microbatches cannot be handed on: ``launcher`` says so)."""
    plan.validate()
    check_memory_cap(stage_state_bytes(plan.arch, plan.vocab_size, plan.stages, plan.compression),
                     plan.peer_memory_cap_mb)
    from cramswarm.swarm import launcher

    return launcher.run(plan, source, total_microbatches, progress)


def train(plan: SwarmPlan, *, total_microbatches: int, progress: bool = True, source=None,
          state_dir: str | Path | None = None) -> TrainResult:
    """The swarm_pretrain rule's hivemind transport (``emulation_training.train``'s result): the launcher's trainers
    make their microbatches by index from ``source`` (``data``: the microbatches the thread transport is handed),
    ``state_dir`` is the folder of the launcher's resumable state, where a rerun after the rule's process died
    resumes (None: no such state). Without a source it refuses (the rule always gives one)."""
    if source is None:
        raise ValueError("the hivemind transport needs a microbatch source (cramswarm.swarm.data): its trainers make "
                         "their own microbatches; an iterator of batches cannot be handed to them")
    plan = dataclasses.replace(plan, state_dir=Path(state_dir) if state_dir is not None else None)
    return run_swarm(plan, source, total_microbatches, progress)
