"""Rebalancing decided by the stage peers (``peer_rebalance``): the pure decision every peer evaluates, the peer's
own load measurement, and a starved stage recovered on real hivemind processes under the launcher."""

from __future__ import annotations

import itertools
import random

import pytest

from cramswarm.swarm.policies import PeerLoad, Rebalancer, _uid_hash, choose_move

pytest.importorskip("hivemind", reason="hivemind is not installed: the peers' rebalancing is untested")

from test_swarm_hivemind import MICRO  # noqa: E402
from test_swarm_roles import brief, launch  # noqa: E402

from cramswarm.swarm.peer_rebalance import LoadMeter, call_units, moved_uid  # noqa: E402


def starved(queue_s1: float = 2.0) -> dict[int, list[PeerLoad]]:
    """Stage 0: three peers of rate 1; stage 1: one peer of rate 0.25 with a queue."""
    return {0: [PeerLoad(f"s0p{i}", 0.0, 1.0) for i in range(3)], 1: [PeerLoad("s1p9", queue_s1, 0.25)]}


def test_every_peer_computes_the_same_single_mover_whatever_order_it_read_the_records_in():
    loads = starved()
    moves = set()
    for stage_order in itertools.permutations(loads):
        for seed in range(5):
            shuffled = {}
            for s in stage_order:
                peers = list(loads[s])
                random.Random(seed).shuffle(peers)
                shuffled[s] = peers
            moves.add(choose_move(shuffled))
    assert len(moves) == 1
    (move,) = moves
    # from the over-provisioned stage to the starved one; the mover is the donor with the smallest uid hash
    assert (move.from_stage, move.to_stage) == (0, 1)
    assert move.uid == min((p.uid for p in loads[0]), key=_uid_hash)


def test_hysteresis_and_the_projected_gain_hold_a_move_back():
    balanced = {0: [PeerLoad("a", 1.0, 1.0), PeerLoad("b", 1.0, 1.0)], 1: [PeerLoad("c", 1.0, 1.6)]}
    assert choose_move(balanced) is None  # load ratio (3/2) / (2/1.6) = 1.2 < 1.5
    assert choose_move(balanced, hysteresis=1.1) is None  # ratio passes, but moving 1.0 makes 1.0 vs 2.6: no gain
    # a real imbalance moves; above the hysteresis only
    skewed = {0: [PeerLoad("a", 0.0, 1.0), PeerLoad("b", 0.0, 1.0)], 1: [PeerLoad("c", 0.0, 0.5)]}
    assert choose_move(skewed) is not None  # ratio (1/0.5) / (1/2) = 4
    assert choose_move(skewed, hysteresis=4.0) is None
    # the gain margin: 2 peers of rate 1 vs one of 0.9 -> moving gives 1 vs 1.9, gain 11 %
    close = {0: [PeerLoad("a", 0.0, 1.0), PeerLoad("b", 0.0, 1.0)], 1: [PeerLoad("c", 2.0, 0.9)]}
    assert choose_move(close, min_gain=0.05) is not None
    assert choose_move(close, min_gain=0.2) is None


def test_after_the_move_of_the_slow_test_nothing_moves_back():
    # the hivemind test's swarm after its move: stage 0 keeps one peer, stage 1 the slow peer and the mover
    # (measured, or not yet: counted at its stage's mean). A one-peer stage never gives its peer away, and moving
    # either stage-1 peer to stage 0 does not raise the bottleneck's rate by the margin
    for mover_rate in (1.0, None):
        after = {0: [PeerLoad("s0p1", 3.0, 1.0)], 1: [PeerLoad("s1p3", 0.0, 0.1), PeerLoad("s1p2m1", 0.0, mover_rate)]}
        assert choose_move(after) is None
        assert choose_move(after, hysteresis=1.0, min_gain=0.0) is None


def test_the_rebalancer_keeps_its_cooldown_around_the_same_rule():
    rebalancer = Rebalancer(period_s=3.0)
    assert rebalancer.decide(starved(), now=0.0) == choose_move(starved())
    assert rebalancer.decide(starved(), now=1.0) is None  # cooling down
    assert rebalancer.decide(starved(), now=3.0) == choose_move(starved())


def test_the_load_meter_averages_the_queue_over_time_and_rates_served_units_per_compute_second():
    meter = LoadMeter(now=0.0)
    meter.enter(0.0)
    meter.enter(1.0)
    meter.exit(3.0)
    meter.exit(4.0)  # queue: 1 for 1 s, 2 for 2 s, 1 for 1 s, 0 for 6 s -> 6 / 10
    for _ in range(9):
        meter.served(units=3.0, seconds=0.5)
    first = meter.window(now=10.0)
    assert first["queue"] == pytest.approx(0.6) and first["calls"] == 9 and first["units"] == 27.0
    assert first["rate"] is None  # not settled: fewer than 10 calls served since the peer started
    for _ in range(3):
        meter.served(units=2.0, seconds=1.0)
    second = meter.window(now=20.0)
    assert second["queue"] == 0.0 and second["rate"] == pytest.approx(6.0 / 3.0) and second["span_s"] == 10.0
    third = meter.window(now=25.0)  # no call in this window: the last rate is kept
    assert third["calls"] == 0 and third["rate"] == pytest.approx(2.0)
    assert call_units("forward", 4, False) == 4 and call_units("backward", 4, False) == 8
    assert call_units("backward", 4, True) == 12  # the last stage's fused forward + backward


def test_a_moved_peer_keeps_its_process_number_in_its_new_uid():
    assert moved_uid("s0p2", 1, 1) == "s1p2m1"
    assert moved_uid("s1p2m1", 0, 2) == "s0p2m2"
    assert moved_uid("custom", 3, 1) == "custom-s3m1"


@pytest.mark.slow
def test_peers_move_one_of_their_own_to_a_starved_stage_and_throughput_recovers():
    # stage 0: two peers of speed 0.25; stage 1: one of speed 0.025 (the bottleneck: a tenth of stage 0's rate)
    total = 160
    _, stats = launch(total, peers_per_stage=[2, 1], trainers=3, peer_speeds=[0.25, 0.25, 0.025],
                      rebalance_period_s=3.0)
    moves = stats["moves"]
    assert moves and (moves[0]["from_stage"], moves[0]["to_stage"]) == (0, 1), moves
    assert stats["moves_completed"] == len(moves), moves
    first = moves[0]
    # the mover drained: it let its admitted calls finish and its gradients go into a step before it left
    assert first["lost_gradient_samples"] == 0, first
    # it serves stage 1 at the end, in step with the replica it downloaded the state from
    assert first["new_uid"] in stats["replica_steps"][1], stats["replica_steps"]
    # no peer was moved back to stage 0 (the gain margin: no ping-pong)
    assert all((m["from_stage"], m["uid"]) != (1, first["new_uid"]) for m in moves), moves
    # throughput from the trainers' logs: before the move (from the first microbatch done) vs after the arrival
    times = stats["microbatch_done_s"]
    before = [t for t in times if t <= first["t_s"]]
    after = [t for t in times if t > first["arrived_s"]]
    assert len(before) >= 5 and len(after) >= 40, (len(before), len(after), moves)
    rate_before = (len(before) - 1) / (before[-1] - before[0])
    rate_after = (len(after) - 1) / (after[-1] - after[0])
    assert rate_after > 1.2 * rate_before, (rate_before, rate_after, brief(stats))
    # the refused calls were re-sent: every microbatch was done once (launch checks that). Gradients: a re-sent
    # backward call may count twice on a stage; a replica left out of a step (the slow one of stage 1, whose
    # calls take seconds here) downloads the state and drops what it held, at most a global batch per resync
    batch = 4 * MICRO
    assert all(-stats["retries"] * MICRO <= n <= stats["resyncs"] * batch for n in stats["lost_gradient_samples"]), \
        brief(stats)
