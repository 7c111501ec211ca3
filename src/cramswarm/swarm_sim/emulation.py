"""Transport 2: the payload-free throughput emulation of a SWARM, ``run(setup)``, on the threads of ``thread_swarm``.

Compute is ``sleep(stage_time_s / speed)`` per forward call and ``BACKWARD_COMPUTE_FACTOR`` times that per backward
call; the network costs ``activation_bytes * 8 / bandwidth + latency`` for the request and again for the reply of
every call, slept by the trainer (links are not shared). With ``time_scale=0.05`` a 60 s setup runs in 3 s; compare
results with margins (thread-scheduling jitter; ``sim`` is the exact counterpart). Failure events kill and revive
peers at their emulated times. The training emulation on the same machinery is ``emulation_training.train``.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

from cramswarm.swarm.rebalancing import Rebalancer
from cramswarm.swarm.routing import NoPeersError, RetryPolicy
from cramswarm.swarm.setups import BACKWARD_COMPUTE_FACTOR, SwarmSetup
from cramswarm.swarm.thread_swarm import Peer, Request, Router, ScaledClock, StopRun, Swarm


class _EmulatedSwarm(Swarm):
    def __init__(self, setup: SwarmSetup, clock: ScaledClock):
        super().__init__(setup.peers, clock, setup.forward_timeout_s, setup.state_download_s)
        self.setup = setup

    def serve(self, peer: Peer, request: Request, incarnation: int) -> Any:
        seconds = self.setup.stage_time_s / peer.speed
        self.clock.sleep(seconds * (BACKWARD_COMPUTE_FACTOR if request.kind == "backward" else 1.0))
        return None

    def work_units(self, request: Request) -> float:
        return BACKWARD_COMPUTE_FACTOR if request.kind == "backward" else 1.0


def _chains(setup: SwarmSetup, peers: list[Peer]) -> list[list[Peer]]:
    by_stage = [[p for p in peers if p.stage == s] for s in range(setup.num_stages)]
    count = min(len(members) for members in by_stage)
    return [[by_stage[s][c] for s in range(setup.num_stages)] for c in range(count)]


def run(setup: SwarmSetup, *, clock: ScaledClock | None = None, time_scale: float = 1.0) -> dict:
    """Emulate ``setup`` for ``duration_s`` emulated seconds; returns the common transport result dict.

    ``clock`` (or a fresh ``ScaledClock(time_scale)``) sets how fast emulated time passes on the wall clock.
    Results: ``microbatches_done`` (completed forward + backward through every stage), ``throughput_mb_s``,
    ``timeline`` [(t_s, completed_total)], ``lost_microbatches`` (gave up: no live peer for
    ``give_up_after_s``), ``retries``, ``moves``, plus ``timeouts``, ``errors``, ``served`` (uid -> forward calls
    served), ``per_stage_peers`` (live at the end), ``wall_s``.
    """
    setup.validate()
    if setup.nic_mbit_s is not None or any(p.nic_mbit_s is not None or p.latency_s is not None for p in setup.peers):
        raise ValueError("shared NICs (nic_mbit_s) and per-peer latencies are modelled by the simulator only "
                         "(cramswarm.swarm_sim.sim); the emulation's links are never shared")
    if setup.joins or any(event.peer >= len(setup.peers) for event in setup.failures):
        raise ValueError("new peers joining (joins) are modelled by the simulator only (cramswarm.swarm_sim.sim)")
    clock = clock or ScaledClock(time_scale)
    swarm = _EmulatedSwarm(setup, clock)
    stages = setup.num_stages
    retry = RetryPolicy(forward_timeout_s=setup.forward_timeout_s)
    rng = random.Random(setup.seed)

    def network_s(nbytes: int) -> float:
        if not setup.bandwidth_mbit_s:
            return setup.latency_s
        return nbytes * 8 / (setup.bandwidth_mbit_s * 1e6) + setup.latency_s

    state = {"done": 0, "lost": 0, "next_mb": 0}
    timeline: list[tuple[float, int]] = [(0.0, 0)]
    chains = _chains(setup, swarm.peers) if setup.routing == "fixed" else None
    start = clock.now()
    deadline = start + setup.duration_s
    nbytes = (setup.activation_bytes, setup.activation_bytes)

    def trainer(index: int) -> None:
        router = Router(
            swarm,
            stages,
            setup.routing,
            retry,
            random.Random(rng.random()),
            chain=chains[index % len(chains)] if chains else None,
            network_s=network_s,
            deadline_s=deadline,
        )
        while True:
            with swarm.lock:
                mb = state["next_mb"]
                state["next_mb"] += 1
            try:
                for stage in range(stages):
                    router.call(stage, "forward", mb, None, 1.0, nbytes)
                for stage in reversed(range(stages)):
                    router.call(stage, "backward", mb, None, 1.0, nbytes)
            except StopRun:
                return
            except NoPeersError:
                with swarm.lock:
                    state["lost"] += 1
                continue
            except TimeoutError as exc:   # StageCall gave up: a stage's peers kept failing (the run fails)
                swarm.record_error(exc)
                return
            now = clock.now()
            if now > deadline:
                return
            with swarm.lock:
                state["done"] += 1
                timeline.append((round(now - start, 4), state["done"]))

    threads = [
        threading.Thread(target=trainer, args=(i,), name=f"trainer{i}", daemon=True) for i in range(setup.trainers)
    ]
    if setup.rebalance_period_s and setup.routing != "fixed":
        rebalancer = Rebalancer(setup.rebalance_period_s)
        threads.append(threading.Thread(target=swarm.rebalance_loop, args=(rebalancer, stages), daemon=True))
    faults = threading.Thread(target=swarm.fault_loop, args=(setup.failures,), kwargs={"start": start}, daemon=True)
    threads.append(faults)
    wall_start = time.perf_counter()
    swarm.start()
    for thread in threads:
        thread.start()
    clock.sleep(deadline - clock.now())
    for thread in threads[: setup.trainers]:
        thread.join()
    swarm.shutdown()
    for thread in threads[setup.trainers :]:
        thread.join(timeout=5.0)
    if swarm.errors:
        raise RuntimeError("an emulated peer or trainer failed") from swarm.errors[0]
    served = {peer.uid: peer.served["forward"] for peer in swarm.peers}
    return {
        "transport": "emulation",
        "microbatches_done": state["done"],
        "throughput_mb_s": state["done"] / setup.duration_s,
        "timeline": timeline,
        "lost_microbatches": state["lost"],
        **swarm.counters,  # retries, timeouts, errors, peers_killed, rejoins
        "moves": list(swarm.moves),
        "served": served,
        "per_stage_peers": swarm.stage_peers(),
        "wall_s": round(time.perf_counter() - wall_start, 3),
        "time_scale": clock.time_scale,
    }
