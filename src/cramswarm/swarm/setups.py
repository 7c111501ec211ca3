"""The setup of a throughput run of SWARM, the one input of the thread emulation (``swarm_sim.emulation.run``) and the
discrete-event simulator (``swarm_sim.sim.run``): its peers (``PeerSpec``), failure and join events (``FailureEvent``,
``JoinEvent``), the whole run (``SwarmSetup``), and the constants of the cost model both transports share.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROUTINGS = ("weighted", "uniform", "fixed")
BACKWARD_COMPUTE_FACTOR = 2.0  # emulated backward compute = 2 x forward (emulation.run, sim.run)
RECORD_TTL_TIMEOUTS = 3.0  # directory records live this many forward timeouts; re-declared every timeout


@dataclass
class PeerSpec:
    stage: int
    speed: float = 1.0  # 0.5 = twice as slow
    nic_mbit_s: float | None = None  # this peer's NIC (simulator only); None: the setup's ``nic_mbit_s``
    latency_s: float | None = None  # one-way latency of this peer's links (simulator only); None: the setup's


@dataclass
class FailureEvent:
    at_s: float
    peer: int  # index into SwarmSetup.peers
    rejoin_after_s: float | None = None  # None: never comes back


JOIN_STAGES = ("random", "most_loaded")


@dataclass
class JoinEvent:
    """A new peer arriving (simulator only): it becomes peer ``len(peers) + j`` for the j-th join (joins are in
    time order), picks its stage on arrival, loads that stage's state and declares itself."""

    at_s: float
    speed: float = 1.0
    stage: str = "random"  # random | most_loaded (highest (queued calls + 1) / summed speed of its live peers)


@dataclass
class SwarmSetup:
    peers: list[PeerSpec]
    trainers: int
    stage_time_s: float  # emulated compute seconds per forward call at speed 1
    bandwidth_mbit_s: float | None = None  # per-link rate of one transfer; None: no transfer time
    latency_s: float = 0.0  # one-way latency of every transfer
    nic_mbit_s: float | None = None  # every peer's NIC, shared by its concurrent transfers (simulator only)
    activation_bytes: int = 0
    routing: str = "weighted"  # weighted (StageBalancer) | uniform (UniformBalancer) | fixed (chains)
    failures: list[FailureEvent] = field(default_factory=list)
    joins: list[JoinEvent] = field(default_factory=list)  # new peers arriving (simulator only)
    rebalance_period_s: float | None = None
    forward_timeout_s: float = 1.0
    duration_s: float = 30.0
    seed: int = 0
    state_download_s: float = 0.0  # emulated time a rejoining or moving peer spends loading stage state

    @property
    def num_stages(self) -> int:
        return max(p.stage for p in self.peers) + 1 if self.peers else 0

    def validate(self) -> None:
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {self.routing!r}")
        if not self.peers:
            raise ValueError("a swarm setup needs at least one peer")
        empty = sorted(set(range(self.num_stages)) - {p.stage for p in self.peers})
        if empty:
            raise ValueError(f"stage(s) {empty} have no peer")
        if self.trainers < 1 or self.stage_time_s <= 0 or self.duration_s <= 0 or self.forward_timeout_s <= 0:
            raise ValueError("trainers, stage_time_s, duration_s and forward_timeout_s must be positive")
        if any(p.speed <= 0 for p in self.peers):
            raise ValueError("peer speeds must be positive")
        if self.latency_s < 0 or any(p.latency_s is not None and p.latency_s < 0 for p in self.peers):
            raise ValueError("latencies must not be negative")
        if any(b is not None and b <= 0 for b in (self.nic_mbit_s, *(p.nic_mbit_s for p in self.peers))):
            raise ValueError("nic_mbit_s must be positive (None: unlimited)")
        for join in self.joins:
            if join.stage not in JOIN_STAGES or join.speed <= 0:
                raise ValueError(f"a join's stage must be one of {', '.join(JOIN_STAGES)} and its speed positive, "
                                 f"got {join}")
        if any(a.at_s > b.at_s for a, b in zip(self.joins, self.joins[1:])):
            raise ValueError("joins must be in time order")
        for event in self.failures:
            if not 0 <= event.peer < len(self.peers) + len(self.joins):
                raise ValueError(f"failure event names peer {event.peer}, but there are {len(self.peers)} peers "
                                 f"and {len(self.joins)} joins")
