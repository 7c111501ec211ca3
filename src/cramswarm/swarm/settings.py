"""The settings of one SWARM training run (``SwarmPlan``): built once from the ``swarm:`` config section
(``SwarmPlan.from_config``), checked once (``SwarmPlan.validate``, errors name the config key) and handed typed to
either transport: the threads of ``emulation_training`` or the hivemind processes of ``hivemind_transport``, whose
launcher hands each process its part as a ``ProcessConfig`` (the run's ``config.json``, and the swarm's
description in the DHT for processes that join). Importing it imports no hivemind.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from cramswarm.swarm.compression import COMPRESSIONS
from cramswarm.swarm.routing import ROUTINGS, RetryPolicy
from cramswarm.swarm.stages import check_stage_count

TRANSPORTS = ("emulation", "hivemind")   # threads in this process | one process per peer
PLACEMENTS = ("local", "attach", "srun")  # who starts the hivemind stage peers (SwarmPlan.placement)
AVERAGING_SCHEMES = ("none", "fp16", "8bit")  # the in-stage all-reduce's compression (averaging's codecs)


@dataclass
class SwarmPlan:
    """Everything a swarm run needs. The thread transport reads the model, recipe, peers, speeds, trainers,
    compression, retry, faults, rebalancing and seed; the rest is the hivemind transport's."""

    arch: dict
    vocab_size: int
    recipe: dict
    peers_per_stage: list[int]
    transport: str = "hivemind"
    device: str = "auto"            # where the stage peers compute (pretrain.impl.device): auto | cpu | cuda
    peer_speeds: list[float] = field(default_factory=lambda: [1.0])
    trainers: int = 2
    compression: str = "blockwise8"
    averaging_compression: str = "fp16"  # in-stage all-reduce: AVERAGING_SCHEMES
    link_mbit_s: float = 100.0      # assumed link speed of a peer; the averaging and state timeouts grow with it
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    kill_every_s: float | None = None
    rejoin_after_s: float | None = 5.0
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
                                    # "join" | "join:<speed>": a new peer joins by swarm-join, picking its stage;
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

    @classmethod
    def from_config(cls, arch: dict, vocab_size: int, recipe: dict, swarm: dict,
                    rendezvous: str | Path | None = None) -> SwarmPlan:
        """The plan of a ``swarm:`` config section with its ``impl`` keys merged in, plus the peers' ``device``
        (:func:`cramswarm.swarm.train.runtime_settings`), for the model ``arch`` with ``vocab_size`` tokens."""
        return cls(
            arch=arch, vocab_size=vocab_size, recipe=recipe, transport=swarm["transport"],
            device=swarm.get("device", "auto"), peers_per_stage=[swarm["peers_per_stage"]] * swarm["stages"],
            peer_speeds=list(swarm["peer_speeds"]), trainers=swarm["trainers"], compression=swarm["compression"],
            averaging_compression=swarm["averaging_compression"], link_mbit_s=swarm["link_mbit_s"],
            retry=RetryPolicy(forward_timeout_s=swarm["forward_timeout_s"],
                              give_up_after_s=swarm.get("give_up_after_s", RetryPolicy.give_up_after_s)),
            launcher_grace_s=swarm.get("launcher_grace_s", cls.launcher_grace_s),
            kill_every_s=swarm["kill_every_s"], rejoin_after_s=swarm["rejoin_after_s"],
            rebalance_period_s=swarm["rebalance_period_s"], seed=swarm["seed"], placement=swarm["placement"],
            rendezvous=Path(rendezvous) if rendezvous else None, host=swarm["host"], interface=swarm["interface"],
            srun_args=list(swarm["srun_args"]), startup_timeout_s=swarm["startup_timeout_s"],
            checkpoint_every_s=swarm["checkpoint_every_s"], peer_memory_cap_mb=swarm.get("peer_memory_cap_mb"),
        )

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
        """Raise ``ValueError`` naming the setting of the first rule the plan breaks (before any process starts)."""
        if self.transport not in TRANSPORTS:
            raise ValueError(f"swarm.transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        check_stage_count(self.arch["layers"], self.stages)
        if min(self.peers_per_stage, default=0) < 1:
            raise ValueError(f"swarm.peers_per_stage={self.peers_per_stage}: every stage needs at least one peer")
        if self.trainers < 1:
            raise ValueError(f"swarm.trainers={self.trainers}: need at least one trainer")
        if not self.peer_speeds or any(not s > 0 for s in self.peer_speeds):
            raise ValueError(f"swarm.peer_speeds={self.peer_speeds}: every speed must be positive")
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"swarm.compression={self.compression!r}; allowed: {', '.join(COMPRESSIONS)}")
        if self.averaging_compression not in AVERAGING_SCHEMES:
            raise ValueError(f"swarm.averaging_compression={self.averaging_compression!r}; allowed: "
                             f"{', '.join(AVERAGING_SCHEMES)}")
        if not self.link_mbit_s > 0:
            raise ValueError(f"swarm.link_mbit_s={self.link_mbit_s!r}: must be positive")
        if self.peer_unit_time_s is not None and not self.peer_unit_time_s > 0:
            raise ValueError(f"swarm peer_unit_time_s={self.peer_unit_time_s!r}: must be positive seconds or None")
        if self.routing not in ROUTINGS:
            raise ValueError(f"swarm routing={self.routing!r}; allowed: {', '.join(ROUTINGS)}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"swarm.impl.placement={self.placement!r}; allowed: {', '.join(PLACEMENTS)}")
        if self.placement != "local" and self.transport != "hivemind":
            raise ValueError(f"swarm.impl.placement={self.placement} runs peers as separate processes: it needs "
                             f"swarm.transport: hivemind (got {self.transport})")
        if self.placement != "local" and self.rendezvous is None:
            raise ValueError(f"swarm.impl.placement={self.placement} needs a rendezvous folder on a filesystem the "
                             "peers share (swarm-pretrain --rendezvous)")
        if self.placement == "srun" and "SLURM_JOB_ID" not in os.environ:
            raise ValueError("swarm.impl.placement=srun starts the peers as a job step of the SLURM job it runs in, "
                             "but SLURM_JOB_ID is unset: run it through profiles/slurm (or placement: local / attach)")


@dataclass(frozen=True)
class ProcessConfig:
    """What every process of a hivemind swarm is handed (a stage peer, a trainer, a peer task, a joiner): the
    plan's settings the processes use, the run's identity (``run_id``; ``run_ids``: its lives, a resumed run's
    earlier ones first) and folders, the microbatch source and lease order of the trainers, and the training
    clock (``clock``, only in the DHT description a joiner reads). Built by the launcher from the plan
    (``of_plan``), written as the run's ``config.json`` (``to_dict``) and read back typed (``from_dict``,
    ``read``): a key missing or unknown raises ``ValueError`` naming it."""

    run_id: str
    run_ids: list[str]
    arch: dict
    vocab_size: int
    recipe: dict
    device: str
    stages: int
    compression: str
    averaging_compression: str
    link_mbit_s: float | None
    sync_timeout_s: float
    join_timeout_s: float
    retry: RetryPolicy
    host: str
    interface: str | None
    launcher_grace_s: float
    seed: int
    checkpoint_every_s: float
    rebalance_period_s: float | None
    peer_memory_cap_mb: float | None
    routing: str
    peer_unit_time_s: float | None
    rejoin_after_s: float | None
    placement_specs: list[list]     # [stage, speed] per rank of an attached swarm (SwarmPlan.slots)
    seq_len: int                    # tokens per sequence of the run's microbatches
    workdir: str                    # the run's folder (this host's view; a joiner on another host gets its own)
    shard_dir: str
    data: dict                      # the trainers' microbatch source (``data.from_spec``)
    microbatches: int               # the run's microbatches (``work.WorkOrder``)
    order: dict | None              # the leases' order (``WorkOrder.spec``; a resume's owed microbatches first)
    clock: dict | None = None       # the training clock (joiners: the launcher's DHT description)

    @classmethod
    def of_plan(cls, plan: SwarmPlan, *, run_id: str, run_ids: list[str], seq_len: int, workdir: str | Path,
                shard_dir: str | Path, data: dict, microbatches: int, order: dict | None) -> ProcessConfig:
        """The processes' part of ``plan`` for one life ``run_id`` of the run."""
        return cls(run_id=run_id, run_ids=list(run_ids), arch=plan.arch, vocab_size=plan.vocab_size,
                   recipe=plan.recipe, device=plan.device, stages=plan.stages, compression=plan.compression,
                   averaging_compression=plan.averaging_compression, link_mbit_s=plan.link_mbit_s,
                   sync_timeout_s=plan.sync_timeout_s, join_timeout_s=plan.join_timeout_s, retry=plan.retry,
                   host=plan.host, interface=plan.interface, launcher_grace_s=plan.launcher_grace_s, seed=plan.seed,
                   checkpoint_every_s=plan.checkpoint_every_s, rebalance_period_s=plan.rebalance_period_s,
                   peer_memory_cap_mb=plan.peer_memory_cap_mb, routing=plan.routing,
                   peer_unit_time_s=plan.peer_unit_time_s, rejoin_after_s=plan.rejoin_after_s,
                   placement_specs=[list(slot) for slot in plan.slots()], seq_len=seq_len, workdir=str(workdir),
                   shard_dir=str(shard_dir), data=data, microbatches=microbatches, order=order)

    def to_dict(self) -> dict:
        """JSON-ready: ``retry`` as its fields."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> ProcessConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(names - set(values) - {"clock"})
        unknown = sorted(set(values) - names)
        problems = ([f"lacks {', '.join(missing)}"] if missing else []) + (
            [f"has unknown keys {', '.join(unknown)}"] if unknown else [])
        if problems:
            raise ValueError(f"a swarm process config {'; '.join(problems)} (written by another version of cramswarm?)")
        return cls(**{**values, "retry": RetryPolicy(**values["retry"])})

    @classmethod
    def read(cls, path: str | Path) -> ProcessConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def elsewhere(self, workdir: str) -> ProcessConfig:
        """This config for a process on a host without the run's folder: its files (and shards) go to ``workdir``."""
        return dataclasses.replace(self, workdir=workdir, shard_dir=workdir)
