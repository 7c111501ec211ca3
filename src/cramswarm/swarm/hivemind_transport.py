"""Transport 1: SWARM on real hivemind processes (localhost, or any hosts that share a rendezvous folder).

This module holds the plan of a hivemind swarm (``SwarmPlan``) and its entry points: ``run_swarm`` checks a plan and
hands it with a microbatch source (``data``) to the launcher (``launcher``: its processes, their restarts, faults,
checkpoint and resume); ``train`` (the swarm_pretrain rule's hivemind transport) builds both from the ``swarm:``
config section.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from cramswarm.swarm import averaging
from cramswarm.swarm.compression import COMPRESSIONS
from cramswarm.swarm.emulation_training import TrainResult
from cramswarm.swarm.processes import (  # noqa: F401 (leftover_processes, _LIVE_GROUPS, visible_gpus: the tests' names)
    _LIVE_GROUPS,
    leftover_processes,
    own_daemons,
    visible_gpus,
)
from cramswarm.swarm.routing import ROUTINGS, RetryPolicy
from cramswarm.swarm.stages import (  # noqa: F401 (stage_parameter_counts: the tests' and benchmarks' name here)
    build_swarm_model,
    check_memory_cap,
    check_stage_count,
    split_model,
    stage_parameter_counts,
    stage_state_bytes,
)

PLACEMENTS = ("local", "attach", "srun")  # who starts the stage peers (SwarmPlan.placement)


@dataclass
class SwarmPlan:
    """Everything a hivemind swarm run needs (``train`` builds it from the ``swarm:`` config section)."""

    arch: dict
    vocab_size: int
    recipe: dict
    peers_per_stage: list[int]
    device: str = "auto"            # where the stage peers compute (pretrain.impl.device): auto | cpu | cuda
    peer_speeds: list[float] = field(default_factory=lambda: [1.0])
    trainers: int = 2
    compression: str = "blockwise8"
    averaging_compression: str = "fp16"  # in-stage all-reduce: none | fp16 | 8bit (averaging.SCHEMES)
    link_mbit_s: float = 100.0      # assumed link speed of a peer; the averaging and state timeouts grow with it
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    kill_every_s: float | None = None
    rejoin_after_s: float = 5.0
    rebalance_period_s: float | None = None
    seed: int = 0
    placement: str = "local"        # local: start the processes here | attach: wait for peers started elsewhere
                                    # (`swarm-peer` tasks) | srun: the launcher starts each process as its own job
                                    # step (srun.SrunPlacement)
    rendezvous: Path | None = None  # attach/srun: folder for config.json + dht_addrs.txt, on a shared filesystem
    host: str = "127.0.0.1"         # IPv4 address every process listens on (0.0.0.0: all interfaces)
    interface: str | None = None    # listen on this network interface's IPv4 address instead (looked up per host)
    srun_args: list[str] = field(default_factory=list)  # srun: extra options of the peers' job step(s)
    launcher_grace_s: float = 30.0  # attach/srun processes exit once the launcher's heartbeat is missing this long
    startup_timeout_s: float = 180.0
    join_timeout_s: float = 15.0
    faults: list[tuple[float, str]] = field(default_factory=list)  # launcher: SIGKILL (seconds into training,
                                    # "bootstrap" | "trainer<R>" | "peer" | "stage<S>"; "gone<N>:stage<S>": N peers
                                    # of stage S, never replaced) - the kill tests' and rebalancing_recovery's;
                                    # other targets go to ``hosts.fault`` (e.g. "cut:<host>": a testbed link cut)
    state_dir: Path | None = None   # launcher: resumable run folder (stage shards, trainer progress); None: the
                                    # rendezvous folder, else a temporary one
    checkpoint_every_s: float = 60.0  # launcher: seconds between a stage's shard writes (and one at the end)
    hosts: object | None = None     # launcher: where each process runs (``ProcessGroups.place``; None: here);
                                    # ``cramswarm.testbed.swarm.HostPlacement`` puts each on a testbed host
    peer_memory_cap_mb: float | None = None  # most MiB of model state a stage peer may hold (None: no cap)
    routing: str = "weighted"       # the trainers' routing over a stage's peers: weighted (StageBalancer, by
                                    # measured throughput) | uniform (UniformBalancer: the routing benchmark's baseline)
    peer_unit_time_s: float | None = None  # launcher: a stage call computes at least this x its work units (forward
                                    # 1, backward 2, fused last 3) at speed 1, the rest slept: peers' speeds hold on a
                                    # loaded host (None: the measured compute alone, x 1/speed)

    @property
    def stages(self) -> int:
        return len(self.peers_per_stage)

    @property
    def sync_timeout_s(self) -> float:
        return max(4.0, self.retry.forward_timeout_s)

    @property
    def peers(self) -> int:
        return sum(self.peers_per_stage)

    def slots(self) -> list[tuple[int, float]]:
        """(stage, speed) of every planned peer, in stage order: the i-th has ``peer_speeds[i mod len]``."""
        speeds = self.peer_speeds
        return [(s, speeds[i % len(speeds)]) for i, s in enumerate(s for s, n in enumerate(self.peers_per_stage)
                                                                    for _ in range(n))]

    def validate(self) -> None:
        if self.peer_unit_time_s is not None and not self.peer_unit_time_s > 0:
            raise ValueError(f"swarm peer_unit_time_s={self.peer_unit_time_s!r}: must be positive seconds or None")
        if self.routing not in ROUTINGS:
            raise ValueError(f"swarm routing={self.routing!r}; allowed: {', '.join(ROUTINGS)}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"swarm.impl.placement={self.placement!r}; allowed: {', '.join(PLACEMENTS)}")
        if self.placement != "local" and self.rendezvous is None:
            raise ValueError(f"swarm.impl.placement={self.placement} needs a rendezvous folder on a filesystem the "
                             "peers share (swarm-pretrain --rendezvous)")
        if self.placement == "srun" and "SLURM_JOB_ID" not in os.environ:
            raise ValueError("swarm.impl.placement=srun starts the peers as a job step of the SLURM job it runs in, "
                             "but SLURM_JOB_ID is unset: run it through profiles/slurm (or placement: local / attach)")


def run_swarm(plan: SwarmPlan, source, total_microbatches: int, progress: bool = True) -> TrainResult:
    """Run one hivemind swarm under the launcher; every process it started (and this process's p2pd) is gone when
    it returns. ``source``: the microbatch source (``data``) the launcher's trainers make their own microbatches
    from (an iterator of microbatches cannot be handed on: ``launcher`` says so)."""
    check_stage_count(plan.arch["layers"], plan.stages)
    plan.validate()
    check_memory_cap(stage_state_bytes(plan.arch, plan.vocab_size, plan.stages, plan.compression),
                     plan.peer_memory_cap_mb)
    if plan.compression not in COMPRESSIONS:
        raise ValueError(f"swarm.compression={plan.compression!r}; allowed: {', '.join(COMPRESSIONS)}")
    if plan.averaging_compression not in averaging.SCHEMES:
        raise ValueError(f"swarm.averaging_compression={plan.averaging_compression!r}; allowed: "
                         f"{', '.join(averaging.SCHEMES)}")
    if not plan.link_mbit_s > 0:
        raise ValueError(f"swarm.link_mbit_s={plan.link_mbit_s!r}: must be positive")
    if min(plan.peers_per_stage, default=0) < 1:
        raise ValueError(f"swarm.peers_per_stage={plan.peers_per_stage}: every stage needs at least one peer")
    if plan.trainers < 1 or not plan.peer_speeds or any(not s > 0 for s in plan.peer_speeds):
        raise ValueError(f"invalid swarm plan: trainers={plan.trainers}, peer_speeds={plan.peer_speeds}")
    from cramswarm.swarm import launcher

    return launcher.run(plan, source, total_microbatches, progress)


def train(*, arch: dict, vocab_size: int, recipe: dict, swarm: dict, batches, total_microbatches: int,
          progress: bool = True, rendezvous: str | Path | None = None, source=None,
          state_dir: str | Path | None = None) -> TrainResult:
    """The swarm_pretrain rule's hivemind transport (``emulation_training.train``'s signature and result, plus
    the rendezvous folder of the attach and srun placements, the microbatch source, ``data``, and the folder of
    the launcher's resumable state, where a rerun after the rule's process died resumes; None: no such state).
    The launcher's trainers make their own microbatches from ``source`` (the same microbatches as ``batches`` by
    index); ``batches`` is taken for ``emulation_training.train``'s signature and not read. Without a source it
    refuses (the rule always gives one)."""
    if source is None:
        raise ValueError("the hivemind transport needs a microbatch source (cramswarm.swarm.data): its trainers make "
                         "their own microbatches; an iterator of batches cannot be handed to them")
    plan = plan_from_config(arch, vocab_size, recipe, swarm, rendezvous)
    plan.state_dir = Path(state_dir) if state_dir is not None else None
    return run_swarm(plan, source, total_microbatches, progress)


def plan_from_config(arch: dict, vocab_size: int, recipe: dict, swarm: dict,
                     rendezvous: str | Path | None = None) -> SwarmPlan:
    """The ``SwarmPlan`` of a validated ``swarm:`` config section with its ``impl`` keys merged in, plus the
    peers' ``device`` (:func:`cramswarm.swarm.train.runtime_settings`), and the model it trains."""
    if swarm["peers_per_stage"] < 1:
        raise ValueError(f"swarm.peers_per_stage={swarm['peers_per_stage']}: every stage needs at least one peer")
    plan = SwarmPlan(
        arch=arch, vocab_size=vocab_size, recipe=recipe, device=swarm.get("device", "auto"),
        peers_per_stage=[swarm["peers_per_stage"]] * swarm["stages"], peer_speeds=list(swarm["peer_speeds"]),
        trainers=swarm["trainers"], compression=swarm["compression"],
        averaging_compression=swarm["averaging_compression"], link_mbit_s=swarm["link_mbit_s"],
        retry=RetryPolicy(forward_timeout_s=swarm["forward_timeout_s"],
                          give_up_after_s=swarm.get("give_up_after_s", RetryPolicy.give_up_after_s)),
        launcher_grace_s=swarm.get("launcher_grace_s", SwarmPlan.launcher_grace_s), kill_every_s=swarm["kill_every_s"],
        rejoin_after_s=swarm["rejoin_after_s"], rebalance_period_s=swarm["rebalance_period_s"], seed=swarm["seed"],
        placement=swarm["placement"], rendezvous=Path(rendezvous) if rendezvous else None, host=swarm["host"],
        interface=swarm["interface"], srun_args=list(swarm["srun_args"]), startup_timeout_s=swarm["startup_timeout_s"],
    )
    plan.checkpoint_every_s = swarm["checkpoint_every_s"]
    plan.peer_memory_cap_mb = swarm.get("peer_memory_cap_mb")
    return plan
