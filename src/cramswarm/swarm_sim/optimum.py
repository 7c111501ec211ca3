"""The yardstick of the throughput transports: the throughput of the best assignment of a swarm's peers to stages
(``optimal_throughput``), and its time average over a run's failures and joins (``optimum_over_time``), ignoring
the network."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from cramswarm.swarm.setups import BACKWARD_COMPUTE_FACTOR, SwarmSetup


def greedy_assignment(speeds: Sequence[float], num_stages: int) -> list[int]:
    """Longest-processing-time greedy: fastest peer first, each to the stage with the least capacity so far."""
    capacity = [0.0] * num_stages
    stages = [0] * len(speeds)
    for i in sorted(range(len(speeds)), key=lambda i: -speeds[i]):
        s = min(range(num_stages), key=capacity.__getitem__)
        stages[i] = s
        capacity[s] += speeds[i]
    return stages


def optimal_throughput(speeds: Sequence[float], num_stages: int, stage_time_s: float) -> float:
    """Microbatches/s of the best assignment of peers of ``speeds`` to ``num_stages`` stages: max over
    assignments of min over stages of the stage's summed rate (a microbatch costs a peer
    ``(1 + BACKWARD_COMPUTE_FACTOR) x stage_time_s / speed``), ignoring the network.

    The max-min partition comes from the longest-processing-time greedy: exact for equal speeds, and within
    one peer's rate of the bound (sum of rates / stages) otherwise, i.e. close to exact for many peers.
    """
    if len(speeds) < num_stages:
        return 0.0
    capacity = [0.0] * num_stages
    for s, v in zip(greedy_assignment(speeds, num_stages), speeds):
        capacity[s] += v
    return min(capacity) / (stage_time_s * (1.0 + BACKWARD_COMPUTE_FACTOR))


def optimum_over_time(setup: SwarmSetup) -> float:
    """Time average over the run of :func:`optimal_throughput` for the peers alive at each moment (a killed
    peer counts again from its rejoin, a new peer from its arrival; state downloads are ignored)."""
    all_speeds = [p.speed for p in setup.peers] + [j.speed for j in setup.joins]
    alive = [True] * len(setup.peers) + [False] * len(setup.joins)
    # (time, order, peer, rejoin delay); order 0 = (re)join before 1 = kill at the same moment.
    changes = [(e.at_s, 1, e.peer, e.rejoin_after_s) for e in setup.failures]
    changes += [(j.at_s, 0, len(setup.peers) + k, None) for k, j in enumerate(setup.joins)]
    heapq.heapify(changes)

    def optimum() -> float:
        speeds = [v for v, up in zip(all_speeds, alive) if up]
        return optimal_throughput(speeds, setup.num_stages, setup.stage_time_s)

    total, last, current = 0.0, 0.0, optimum()
    while changes and changes[0][0] < setup.duration_s:
        time, order, index, rejoin_after_s = heapq.heappop(changes)
        if order == 1 and alive[index]:
            alive[index] = False
            if rejoin_after_s is not None:
                heapq.heappush(changes, (time + rejoin_after_s, 0, index, None))
        elif order == 0:
            alive[index] = True
        else:
            continue
        total += current * (time - last)
        last, current = time, optimum()
    return (total + current * (setup.duration_s - last)) / setup.duration_s
