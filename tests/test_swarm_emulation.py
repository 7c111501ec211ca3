"""Transport 2's throughput emulation: real threads on a scaled wall clock (emulated s = wall s / time_scale).

Threads carry scheduling jitter, so the assertions compare behaviour with generous margins, never speed.
"""

import pytest

from cramswarm.swarm.setups import FailureEvent, PeerSpec, SwarmSetup
from cramswarm.swarm.thread_swarm import ScaledClock
from cramswarm.swarm_sim.emulation import run

SCALE = 0.01   # 1 emulated second = 10 ms of wall clock


def heterogeneous(routing: str) -> SwarmSetup:
    """One stage, peers at speeds 1, 0.5, 0.25 (swarm.md 6.2 M2), 8 concurrent trainers."""
    return SwarmSetup(peers=[PeerSpec(0, 1.0), PeerSpec(0, 0.5), PeerSpec(0, 0.25)], trainers=8, stage_time_s=1.0,
                      routing=routing, forward_timeout_s=30.0, duration_s=400.0)


def test_weighted_routing_beats_uniform_on_heterogeneous_peers():
    weighted = run(heterogeneous("weighted"), time_scale=SCALE)
    uniform = run(heterogeneous("uniform"), time_scale=SCALE)
    assert weighted["throughput_mb_s"] > 1.3 * uniform["throughput_mb_s"]  # ideal 1.75 / 0.75 = 2.3
    assert weighted["lost_microbatches"] == uniform["lost_microbatches"] == 0
    served = weighted["served"]
    assert served["peer002"] < served["peer000"] and served["peer002"] < served["peer001"]  # slowest gets least
    assert weighted["timeline"][0] == (0.0, 0)
    assert weighted["timeline"][-1][1] == weighted["microbatches_done"]


def failing_swarm(routing: str) -> SwarmSetup:
    """2 stages x 3 peers; a stage-0 peer dies at 100 s and rejoins at 200 s; a stage-1 peer dies for good."""
    return SwarmSetup(peers=[PeerSpec(s) for s in (0, 0, 0, 1, 1, 1)], trainers=6, stage_time_s=1.0,
                      routing=routing, forward_timeout_s=5.0, duration_s=400.0,
                      failures=[FailureEvent(100.0, 1, rejoin_after_s=100.0), FailureEvent(150.0, 4)])


def completed_between(result: dict, start: float, end: float) -> int:
    inside = [n for t, n in result["timeline"] if start <= t < end]
    return inside[-1] - inside[0] if inside else 0


def test_killed_peers_lose_no_microbatch_and_work_continues():
    result = run(failing_swarm("weighted"), time_scale=SCALE)
    assert result["lost_microbatches"] == 0
    assert result["peers_killed"] == 2 and result["rejoins"] == 1
    assert result["retries"] > 0  # in-flight calls to the dead peers timed out and were resent
    assert completed_between(result, 160.0, 400.0) > 0.5 * completed_between(result, 0.0, 100.0) * 240 / 100
    assert result["per_stage_peers"] == {0: ["peer000", "peer001", "peer002"], 1: ["peer003", "peer005"]}


def test_fixed_chains_stall_while_swarm_reroutes():
    """Chain c = the c-th peer of each stage. Killing peer 0 (stage 0, chain 0) and peer 4 (stage 1, chain 1)
    breaks two of three chains, while each stage keeps two live peers for the swarm to route through."""
    def setup(routing):
        return SwarmSetup(peers=[PeerSpec(s) for s in (0, 0, 0, 1, 1, 1)], trainers=6, stage_time_s=1.0,
                          routing=routing, forward_timeout_s=5.0, duration_s=400.0,
                          failures=[FailureEvent(100.0, 0), FailureEvent(100.0, 4)])

    swarm, fixed = run(setup("weighted"), time_scale=SCALE), run(setup("fixed"), time_scale=SCALE)
    assert swarm["lost_microbatches"] == fixed["lost_microbatches"] == 0
    assert completed_between(swarm, 150.0, 400.0) > 1.4 * completed_between(fixed, 150.0, 400.0)  # ideal 2x


def test_rebalancing_moves_peers_to_the_bottleneck():
    def setup(period):
        return SwarmSetup(peers=[PeerSpec(0)] * 4 + [PeerSpec(1)], trainers=8, stage_time_s=1.0,
                          forward_timeout_s=30.0, duration_s=400.0, rebalance_period_s=period)

    static = run(setup(None), time_scale=SCALE)
    adaptive = run(setup(40.0), time_scale=SCALE)
    assert static["moves"] == []
    assert 1 <= len(adaptive["moves"]) <= 3
    assert adaptive["moves"][0]["from_stage"] == 0 and adaptive["moves"][0]["to_stage"] == 1
    assert len(adaptive["per_stage_peers"][1]) >= 2
    assert adaptive["throughput_mb_s"] > 1.2 * static["throughput_mb_s"]
    assert adaptive["lost_microbatches"] == 0


def test_the_emulation_and_the_simulator_move_the_same_peer_on_the_same_signal():
    """Both drive ``Rebalancer`` with each peer's own ``LoadMeter`` window (the launcher's peers publish the same):
    on one starved setup they move the same peer between the same stages, and agree on the throughput."""
    from cramswarm.swarm_sim import sim

    setup = SwarmSetup(peers=[PeerSpec(0)] * 4 + [PeerSpec(1)], trainers=8, stage_time_s=1.0,
                       forward_timeout_s=30.0, duration_s=400.0, rebalance_period_s=40.0)
    emulated, simulated = run(setup, time_scale=SCALE), sim.run(setup)

    def moves(result):
        return [(m["uid"], m["from_stage"], m["to_stage"]) for m in result["moves"]]

    assert moves(emulated) == moves(simulated) and len(moves(simulated)) >= 1
    assert emulated["throughput_mb_s"] == pytest.approx(simulated["throughput_mb_s"], rel=0.15)


def test_setup_errors_are_named():
    with pytest.raises(ValueError, match=r"stage\(s\) \[1\] have no peer"):
        run(SwarmSetup(peers=[PeerSpec(0), PeerSpec(2)], trainers=1, stage_time_s=1.0))
    with pytest.raises(ValueError, match="routing"):
        run(SwarmSetup(peers=[PeerSpec(0)], trainers=1, stage_time_s=1.0, routing="random"))
    with pytest.raises(ValueError, match="names peer 5"):
        run(SwarmSetup(peers=[PeerSpec(0)], trainers=1, stage_time_s=1.0, failures=[FailureEvent(1.0, 5)]))


def test_scaled_clock():
    clock = ScaledClock(0.001)
    clock.sleep(20.0)  # 20 ms of wall clock
    assert clock.now() >= 20.0
    assert clock.wall(5.0) == pytest.approx(0.005)
    with pytest.raises(ValueError):
        ScaledClock(0.0)
