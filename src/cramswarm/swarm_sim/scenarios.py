"""Scenarios for the throughput transports (``sim.run``, ``emulation.run``): large heterogeneous swarms
(``heterogeneous_setup``) and their failure and join events - a kill schedule (``kill_schedule``) and the preemption
models ``poisson_failures`` (independent), ``burst_failures`` (correlated: several peers at once) and ``churn`` (peers
leave for good and new ones arrive), one rate for all through ``preemptions``."""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator

from cramswarm.swarm.setups import JOIN_STAGES, FailureEvent, JoinEvent, PeerSpec, SwarmSetup
from cramswarm.swarm_sim.optimum import greedy_assignment


def heterogeneous_setup(num_peers: int, num_stages: int, *, speed_range: tuple[float, float] = (0.5, 1.0),
                        assignment: str = "random", trainers: int | None = None, seed: int = 0,
                        **setup_fields) -> SwarmSetup:
    """A swarm of ``num_peers`` peers with speeds drawn log-uniformly from ``speed_range``.

    ``assignment``: ``random`` puts each peer on a uniformly random stage (every stage gets at least one
    peer), ``balanced`` the greedy one :func:`optimum.optimal_throughput` rates (``optimum.greedy_assignment``).
    ``trainers`` defaults to 1.5 per peer. Further ``SwarmSetup`` fields (``stage_time_s`` is required) pass through.
    """
    if num_stages < 1 or num_peers < num_stages:
        raise ValueError(f"need at least one peer per stage: {num_peers} peers for {num_stages} stages")
    if assignment not in ("random", "balanced"):
        raise ValueError(f"assignment must be 'random' or 'balanced', got {assignment!r}")
    rng = random.Random(seed)
    low, high = speed_range
    speeds = [math.exp(rng.uniform(math.log(low), math.log(high))) for _ in range(num_peers)]
    if assignment == "balanced":
        stages = greedy_assignment(speeds, num_stages)
    else:
        stages = list(range(num_stages)) + [rng.randrange(num_stages) for _ in range(num_peers - num_stages)]
        rng.shuffle(stages)
    peers = [PeerSpec(stage=s, speed=v) for s, v in zip(stages, speeds)]
    return SwarmSetup(peers=peers, trainers=trainers or math.ceil(1.5 * num_peers), seed=seed, **setup_fields)


def kill_schedule(kill_times: Iterable[float], num_peers: int, rejoin_after_s: float | None,
                  rng: random.Random) -> list[FailureEvent]:
    """A failure at each of ``kill_times`` (ascending), each hitting a uniformly random peer that is up at that
    moment (none up: the kill is skipped); it rejoins after ``rejoin_after_s`` (None: never)."""
    back_at = [0.0] * num_peers
    events = []
    for t in kill_times:
        up = [i for i in range(num_peers) if back_at[i] <= t]
        if up:
            peer = rng.choice(up)
            events.append(FailureEvent(at_s=t, peer=peer, rejoin_after_s=rejoin_after_s))
            back_at[peer] = math.inf if rejoin_after_s is None else t + rejoin_after_s
    return events


def poisson_failures(num_peers: int, duration_s: float, *, mean_interval_s: float, rejoin_after_s: float | None,
                     seed: int = 0) -> list[FailureEvent]:
    """Preemptions as one Poisson process over the swarm (mean ``mean_interval_s`` between two), each hitting
    a uniformly random peer that is up at that moment; it rejoins after ``rejoin_after_s`` (None: never)."""
    rng = random.Random(seed)
    return kill_schedule(_poisson_times(duration_s, mean_interval_s, rng), num_peers, rejoin_after_s, rng)


def _poisson_times(duration_s: float, mean_interval_s: float, rng: random.Random) -> Iterator[float]:
    if mean_interval_s <= 0:
        raise ValueError(f"mean_interval_s must be positive, got {mean_interval_s}")
    t = rng.expovariate(1.0 / mean_interval_s)
    while t < duration_s:
        yield t
        t += rng.expovariate(1.0 / mean_interval_s)


def burst_failures(num_peers: int, duration_s: float, *, mean_interval_s: float, burst_size: int,
                   rejoin_after_s: float | None, seed: int = 0) -> list[FailureEvent]:
    """Correlated preemptions: bursts arrive as a Poisson process (mean ``mean_interval_s`` between two), each
    killing ``burst_size`` distinct peers that are up at that moment (all of them if fewer are up) at the same
    instant; each rejoins its stage after ``rejoin_after_s`` (None: never). With ``burst_size`` = 1 this is
    :func:`poisson_failures`' model."""
    if burst_size < 1:
        raise ValueError(f"burst_size must be at least 1, got {burst_size}")
    rng = random.Random(seed)
    back_at = [0.0] * num_peers
    events = []
    for t in _poisson_times(duration_s, mean_interval_s, rng):
        up = [i for i in range(num_peers) if back_at[i] <= t]
        for peer in rng.sample(up, min(burst_size, len(up))):
            events.append(FailureEvent(at_s=t, peer=peer, rejoin_after_s=rejoin_after_s))
            back_at[peer] = math.inf if rejoin_after_s is None else t + rejoin_after_s
    return events


def churn(num_peers: int, duration_s: float, *, mean_interval_s: float, join_after_s: float, stage: str = "random",
          speed_range: tuple[float, float] = (0.5, 1.0), seed: int = 0) -> tuple[list[FailureEvent], list[JoinEvent]]:
    """Churn: peers leave for good (a Poisson process over the swarm, mean ``mean_interval_s`` between two
    departures, each a uniformly random present peer, original or newly joined) and a new peer, of a speed
    drawn log-uniformly from ``speed_range``, arrives ``join_after_s`` after each departure and picks its stage
    by ``stage`` (``random`` | ``most_loaded``, see :class:`JoinEvent`). Returns (failures, joins); the j-th
    join is peer ``num_peers + j`` in the failure events."""
    if stage not in JOIN_STAGES:
        raise ValueError(f"stage must be one of {', '.join(JOIN_STAGES)}, got {stage!r}")
    if join_after_s < 0:
        raise ValueError(f"join_after_s must not be negative, got {join_after_s}")
    rng = random.Random(seed)
    low, high = speed_range
    arrives_at = [0.0] * num_peers   # per peer index; math.inf once it has left
    failures: list[FailureEvent] = []
    joins: list[JoinEvent] = []
    for t in _poisson_times(duration_s, mean_interval_s, rng):
        present = [i for i, at in enumerate(arrives_at) if at <= t]
        if present:
            peer = rng.choice(present)
            arrives_at[peer] = math.inf
            failures.append(FailureEvent(at_s=t, peer=peer, rejoin_after_s=None))
        if t + join_after_s < duration_s:
            speed = math.exp(rng.uniform(math.log(low), math.log(high)))
            joins.append(JoinEvent(at_s=t + join_after_s, speed=speed, stage=stage))
            arrives_at.append(t + join_after_s)
    return failures, joins


PREEMPTION_MODELS = ("independent", "burst", "churn_random", "churn_most_loaded")


def preemptions(model: str, num_peers: int, duration_s: float, *, preemptions_per_peer_hour: float,
                rejoin_after_s: float | None, burst_size: int = 4, join_after_s: float | None = None,
                speed_range: tuple[float, float] = (0.5, 1.0),
                seed: int = 0) -> tuple[list[FailureEvent], list[JoinEvent]]:
    """(failures, joins) of one preemption model at the same mean rate of preempted peers:

    * ``independent``: :func:`poisson_failures`, the peer back on its stage after ``rejoin_after_s``;
    * ``burst``: :func:`burst_failures` of ``burst_size`` peers at once, bursts ``burst_size`` times rarer;
    * ``churn_random`` / ``churn_most_loaded``: :func:`churn`, a new peer arriving ``join_after_s`` (default
      ``rejoin_after_s``) after each departure, on a random or on the most loaded stage.
    """
    if preemptions_per_peer_hour <= 0:
        raise ValueError(f"preemptions_per_peer_hour must be positive, got {preemptions_per_peer_hour}")
    interval = 3600.0 / (preemptions_per_peer_hour * num_peers)
    if model == "independent":
        return poisson_failures(num_peers, duration_s, mean_interval_s=interval, rejoin_after_s=rejoin_after_s,
                                seed=seed), []
    if model == "burst":
        return burst_failures(num_peers, duration_s, mean_interval_s=interval * burst_size, burst_size=burst_size,
                              rejoin_after_s=rejoin_after_s, seed=seed), []
    if model in ("churn_random", "churn_most_loaded"):
        delay = rejoin_after_s if join_after_s is None else join_after_s
        if delay is None:
            raise ValueError("churn needs join_after_s (or rejoin_after_s)")
        return churn(num_peers, duration_s, mean_interval_s=interval, join_after_s=delay,
                     stage=model.removeprefix("churn_"), speed_range=speed_range, seed=seed)
    raise ValueError(f"unknown preemption model {model!r}; allowed: {', '.join(PREEMPTION_MODELS)}")
