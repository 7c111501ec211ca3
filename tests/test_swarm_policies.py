"""SWARM's pure policy objects (routing, retries, rebalancing, in-stage accounting) and inter-stage compression."""

import dataclasses
import hashlib
import itertools
import json
import math
import random

import pytest
import torch

from cramswarm.swarm.compression import (
    SCHEMES,
    Bottleneck,
    Maxout,
    boundary,
    decode,
    encode,
    payload_bytes,
    payload_to,
    roundtrip,
)
from cramswarm.swarm.fault_rules import kill_candidates
from cramswarm.swarm.rebalancing import (
    ClaimRecord,
    LastMove,
    LoadMeter,
    LoadRecord,
    Move,
    MoveEvent,
    MoveGate,
    PeerLoad,
    Rebalancer,
    _uid_hash,
    choose_join_stage,
    choose_move,
)
from cramswarm.swarm.routing import (
    CALL_ROUND_TRIPS,
    NoPeersError,
    PerformanceEMA,
    RetryPolicy,
    StageBalancer,
    StageCall,
    UniformBalancer,
)
from cramswarm.swarm.stage_sync import StageSync

SPEEDS = {"fast": 1.0, "half": 0.5, "quarter": 0.25}


def serve(balancer, speeds, calls, now=0.0):
    """Route ``calls`` unit tasks; each peer takes 1/speed seconds per sample. Returns choices per peer."""
    counts = dict.fromkeys(speeds, 0)
    for _ in range(calls):
        uid = balancer.choose(1.0, now)
        balancer.report_success(uid, 1.0, 1.0 / speeds[uid])
        counts[uid] += 1
    return counts


def test_performance_ema_is_bias_corrected():
    ema = PerformanceEMA(alpha=0.1)
    assert ema.samples_per_second is None
    ema.update(2.0, 4)  # 0.5 s per sample, taken at face value despite alpha = 0.1
    assert ema.samples_per_second == pytest.approx(2.0)
    for _ in range(200):
        ema.update(1.0, 4)
    assert ema.samples_per_second == pytest.approx(4.0, rel=1e-6)


def test_iwrr_shares_are_proportional_to_throughput():
    balancer = StageBalancer(0, rng=random.Random(0))
    balancer.update_peers(dict.fromkeys(SPEEDS, 100.0), now=0.0)
    serve(balancer, SPEEDS, 70)  # every peer measured
    counts = serve(balancer, SPEEDS, 700)
    assert counts["fast"] / 700 == pytest.approx(4 / 7, abs=0.02)
    assert counts["half"] / 700 == pytest.approx(2 / 7, abs=0.02)
    assert counts["quarter"] / 700 == pytest.approx(1 / 7, abs=0.02)
    assert balancer.throughput("half") == pytest.approx(0.5)


def test_iwrr_interleaves_instead_of_bursting():
    balancer = StageBalancer(0, rng=random.Random(0))
    balancer.update_peers({"a": 100.0, "b": 100.0}, now=0.0)
    serve(balancer, {"a": 1.0, "b": 1.0}, 10)
    order = [balancer.choose(1.0, 0.0) for _ in range(8)]
    assert all(x != y for x, y in zip(order, order[1:]))  # equal peers alternate


def test_new_peer_is_tried_almost_at_once():
    balancer = StageBalancer(0, rng=random.Random(0))
    balancer.update_peers({"a": 100.0, "b": 100.0}, now=0.0)
    serve(balancer, {"a": 1.0, "b": 1.0}, 50)
    balancer.update_peers({"a": 100.0, "b": 100.0, "new": 100.0}, now=1.0)
    assert "new" in [balancer.choose(1.0, 1.0) for _ in range(2)]


def test_a_new_peer_beside_fast_peers_gets_its_share_before_it_is_measured():
    """Peers that take 5 ms per sample; a newcomer whose first call has not come back must not be charged 1 s per
    sample (it would wait 200 calls of the others for its second call): it is charged as their mean."""
    balancer = StageBalancer(0, rng=random.Random(0))
    balancer.update_peers({"a": 100.0, "b": 100.0}, now=0.0)
    serve(balancer, {"a": 200.0, "b": 200.0}, 50)
    balancer.update_peers({"a": 100.0, "b": 100.0, "new": 100.0}, now=1.0)
    order = [balancer.choose(1.0, 1.0) for _ in range(9)]  # no feedback: the newcomer stays unmeasured
    assert order.count("new") >= 3, order  # (the old charge of 1 s per sample: once in 9)

def test_calls_charged_before_any_peer_was_measured_are_priced_again_at_the_first_measurement():
    """At the start of a run no peer is measured: the first two calls are charged 1 s per sample. Unless those
    charges are made again at the first measurement (the measured peer's at its rate, the other's at the stage's
    mean), one of the two waits out the other's next 200 calls (a testbed run's stage-0 peer served
    no backward call in 40 s)."""
    speeds = {"a": 200.0, "b": 200.0}  # 5 ms per sample each
    balancer = StageBalancer(0, rng=random.Random(0))
    balancer.update_peers(dict.fromkeys(speeds, 100.0), now=0.0)
    first = balancer.choose(4.0, 0.0, backward=True)  # charged 4 x 2.5 samples at 1 sample per second
    second = balancer.choose(4.0, 0.0)                # the other one, still unmeasured: 4 s
    assert first != second
    balancer.report_success(first, 4.0, 4.0 / speeds[first])
    counts = serve(balancer, speeds, 40)
    assert min(counts.values()) >= 15, counts  # (without the re-pricing: the first peer got none of the 40)
    # charges made once a peer was measured are final: a later measurement moves nothing
    key = {entry[2]: entry[0] for entry in balancer._heap}
    balancer.report_success(second, 4.0, 1.0)
    assert {entry[2]: entry[0] for entry in balancer._heap} == key



def test_backward_tasks_weigh_more():
    balancer = StageBalancer(0, rng=random.Random(0))
    balancer.update_peers({"a": 100.0, "b": 100.0}, now=0.0)
    first = balancer.choose(1.0, 0.0, backward=True)  # unmeasured: key grows by 2.5
    assert [balancer.choose(1.0, 0.0) for _ in range(2)] == [next(u for u in "ab" if u != first)] * 2


def test_error_bans_until_a_later_expiration():
    balancer = StageBalancer(0, rng=random.Random(0))
    balancer.update_peers({"a": 10.0, "b": 10.0}, now=0.0)
    balancer.report_error("a", now=1.0)
    assert balancer.peers == ["b"]
    assert {balancer.choose(1.0, 1.0) for _ in range(10)} == {"b"}
    balancer.update_peers({"a": 10.0, "b": 10.0}, now=2.0)  # same record: still banned
    assert balancer.peers == ["b"]
    balancer.update_peers({"a": 20.0, "b": 20.0}, now=3.0)  # re-declared: admitted again
    assert balancer.peers == ["a", "b"]
    assert "a" in [balancer.choose(1.0, 3.0) for _ in range(3)]
    assert balancer.stats["errors"] == 1


def test_timeout_is_not_banned():
    balancer = StageBalancer(0, rng=random.Random(0))
    balancer.update_peers({"a": 10.0, "b": 10.0}, now=0.0)
    balancer.report_timeout("a")
    assert balancer.peers == ["a", "b"]
    assert balancer.stats["timeouts"] == 1


def test_expired_records_and_empty_stages_raise_no_peers_naming_the_stage():
    balancer = StageBalancer(3, rng=random.Random(0))
    with pytest.raises(NoPeersError, match="stage 3"):
        balancer.choose(1.0, 0.0)
    balancer.update_peers({"a": 5.0}, now=0.0)
    assert balancer.choose(1.0, 4.0) == "a"
    with pytest.raises(NoPeersError, match="stage 3: no live peer"):
        balancer.choose(1.0, 6.0)  # its record expired at 5
    balancer.update_peers({}, now=6.0)  # dropped from the directory
    assert balancer.peers == []


def test_uniform_balancer_ignores_throughput():
    balancer = UniformBalancer(0, rng=random.Random(0))
    balancer.update_peers(dict.fromkeys(SPEEDS, 100.0), now=0.0)
    counts = serve(balancer, SPEEDS, 3000)
    for uid in SPEEDS:
        assert counts[uid] / 3000 == pytest.approx(1 / 3, abs=0.04)
    balancer.report_error("fast", now=0.0)
    assert "fast" not in {balancer.choose(1.0, 0.0) for _ in range(50)}


def test_retry_policy_gives_up_after_three_failures_over_the_bound():
    retry = RetryPolicy(give_up_after_s=120.0)
    assert not retry.exhausted(500.0, 2)      # two failures: try another time, however long they took
    assert not retry.exhausted(119.0, 10)     # many quick failures: still within the bound
    assert retry.exhausted(121.0, 3)


def test_retry_policy_timeouts():
    retry = RetryPolicy(forward_timeout_s=30.0)
    assert retry.timeout(backward=False) == 30.0
    assert retry.timeout(backward=True) == 75.0
    # a silent peer is noticed by the timeout alone; on slower links (longer round trips) it allows more
    far = RetryPolicy(forward_timeout_s=30.0, rtt_s=0.5)
    assert far.timeout(backward=False) == 30.0 + CALL_ROUND_TRIPS * 0.5
    assert far.timeout(backward=True) == 75.0 + CALL_ROUND_TRIPS * 0.5
    assert RetryPolicy(rtt_s=0.04).timeout(False) < far.timeout(False)


def test_stage_call_retries_on_another_replica_and_gives_up_only_by_the_policy():
    """The retry rule both trainers use (the launcher's processes, the emulation's threads): a refused peer is
    banned and the next try goes elsewhere, a timed-out one is only penalised; every failure is a counted retry;
    a stranded stage yields None until give_up_after_s, then NoPeersError; failures in a row give up by
    ``RetryPolicy.exhausted``."""
    counted: dict[str, int] = {}

    def count(key):
        counted[key] = counted.get(key, 0) + 1

    balancer = StageBalancer(2, rng=random.Random(0))
    balancer.update_peers({"a": 100.0, "b": 100.0}, now=0.0)
    call = StageCall(balancer, RetryPolicy(give_up_after_s=60.0), task_size=4, backward=True, count=count,
                     what="backward")
    first = call.choose(0.0)
    call.refused(first, 0.0, 0.5)
    other = call.choose(0.5)
    assert other != first and {call.choose(0.6) for _ in range(5)} == {other}   # the refused peer is banned
    call.timed_out(other, 0.6, 75.6)
    assert balancer.peers == [other] and call.choose(76.0) == other   # a timeout is not a ban
    assert counted == {"errors": 1, "timeouts": 1, "retries": 2} and call.attempts == 2
    # a third failure more than give_up_after_s after the first try: the stage's peers do not answer
    with pytest.raises(TimeoutError, match="stage 2: 3 backward calls in a row"):
        call.timed_out(other, 76.0, 151.0)
    # a peer that answered before and now times out is busy (or gone: its record expires), not unreachable:
    # retried, never given up on
    one = StageBalancer(2, rng=random.Random(0))
    one.update_peers({"d": 1000.0}, now=0.0)
    busy = StageCall(one, RetryPolicy(give_up_after_s=60.0), task_size=4, backward=True, count=count)
    busy.succeeded("d", 12.0, 3.0)   # work units over seconds: the balancer's estimate
    assert one.throughput("d") == pytest.approx(12.0 / 3.0)
    for k in range(6):
        busy.timed_out(busy.choose(200.0 + 80 * k), 200.0 + 80 * k, 275.0 + 80 * k)
    assert busy.attempts == 0 and counted["timeouts"] == 8 and counted["retries"] == 9
    # a stage with no live peer: None (the caller waits and looks again) until the bound, then NoPeersError
    empty = StageBalancer(1, rng=random.Random(0))
    stranded = StageCall(empty, RetryPolicy(give_up_after_s=60.0), task_size=4, backward=False)
    assert stranded.choose(10.0) is None and stranded.choose(69.0) is None
    with pytest.raises(NoPeersError, match="stage 1"):
        stranded.choose(70.0)
    empty.update_peers({"c": 200.0}, now=70.0)   # a peer came back in time: the clock restarts
    fresh = StageCall(empty, RetryPolicy(give_up_after_s=60.0), task_size=4, backward=False)
    assert fresh.choose(70.0) == "c"


def test_kill_candidates_never_take_a_stages_last_up_to_date_replica():
    """Fault injection's rule (the launcher's and the emulation's): a live replica at its stage's latest step, with
    another live one there too; the latest step counts dead replicas' records (a copy that stepped, then died)."""
    steps = {0: {"a": 3, "b": 3, "c": 2},   # c lags: never a victim; a and b may go
             1: {"d": 5, "e": 5},           # e is dead: d is the last up-to-date copy
             2: {"f": 7, "g": 6, "h": 6}}   # f (dead) stepped last: g and h are behind it, none may go
    live = {"a", "b", "c", "d", "g", "h"}
    assert kill_candidates(steps, live) == ["a", "b"]
    assert kill_candidates(steps, live - {"b"}) == []
    assert kill_candidates({0: {"x": 0, "y": 0, "z": 0}}, {"z", "x"}) == ["x", "z"]
    assert kill_candidates({}, set()) == [] and kill_candidates({0: {}}, set()) == []


def loads(*stages, queue=0.0, rate=1.0):
    """Stage -> peers with the given uids, equal rates and queues."""
    return {s: [PeerLoad(uid, queue, rate) for uid in uids] for s, uids in enumerate(stages)}


def test_rebalancer_moves_from_over_to_under_provisioned_stage():
    rebalancer = Rebalancer(period_s=60.0)
    state = loads(["p1", "p2", "p3"], ["q1"], queue=0.0)
    state[1] = [PeerLoad("q1", 5.0, 1.0)]
    move = rebalancer.decide(state, now=0.0)
    mover = min(["p1", "p2", "p3"], key=lambda u: hashlib.sha1(u.encode()).hexdigest())
    assert move == Move(mover, 0, 1)


def test_rebalancer_hysteresis_keeps_a_balanced_swarm():
    rebalancer = Rebalancer(period_s=60.0)
    assert rebalancer.decide(loads(["a", "b"], ["c", "d"], queue=2.0), now=0.0) is None
    # 3 vs 2 equal peers: moving one would not raise the bottleneck throughput, however long the queue
    state = loads(["a", "b", "c"], ["d", "e"])
    state[1] = [PeerLoad("d", 10.0, 1.0), PeerLoad("e", 10.0, 1.0)]
    assert rebalancer.decide(state, now=0.0) is None


def test_rebalancer_waits_for_the_movers_arrival():
    """MoveGate, as the launcher's peers apply it: nothing while the move is in transit (for at most transit_s: a
    mover that died never arrives), nor on the loads of a period that ended before the mover arrived."""
    state = loads(["a", "b", "c", "d"], ["e"])
    rebalancer = Rebalancer(period_s=60.0)
    assert rebalancer.decide(state, now=0.0) is not None
    assert rebalancer.decide(state, now=60.0) is None and rebalancer.decide(state, now=180.0) is None  # in transit
    assert rebalancer.decide(state, now=240.0) is not None   # in transit for 240 s (transit_s): given up
    rebalancer = Rebalancer(period_s=60.0)
    assert rebalancer.decide(state, now=0.0) is not None
    rebalancer.arrived(90.0)   # serving its new stage in period 1 ([60, 120) s)
    assert rebalancer.last.arrived == 1
    assert rebalancer.decide(state, now=120.0) is not None   # period 2's loads show the mover: one move per period
    assert MoveGate().quiet(LastMove(0, 0.0, arrived=1), 1, 999.0)   # a period that ended before it arrived
    assert not MoveGate().quiet(LastMove(0, 0.0, arrived=1), 2, 999.0)
    assert MoveGate(cooldown_periods=2).quiet(LastMove(0, 0.0, arrived=1), 3, 999.0)
    assert not MoveGate(cooldown_periods=2).quiet(LastMove(0, 0.0, arrived=1), 4, 999.0)


def test_rebalancer_converges_without_oscillation():
    """Apply every move; the stage with fewer peers always holds the backlog (the worst case for ping-pong)."""
    rebalancer = Rebalancer(period_s=1.0)
    members = {0: ["a", "b", "c", "d", "e"], 1: ["f"]}
    moves = []
    for now in range(30):
        small = min(members, key=lambda s: len(members[s]))
        state = {s: [PeerLoad(u, 8.0 if s == small else 0.0, 1.0) for u in uids] for s, uids in members.items()}
        move = rebalancer.decide(state, now=float(now))
        if move is not None:
            moves.append(move)
            members[move.from_stage].remove(move.uid)
            members[move.to_stage].append(move.uid)
            rebalancer.arrived(now + 0.5)
    assert sorted(len(m) for m in members.values()) == [3, 3]
    assert len(moves) == 2
    assert all(m.to_stage == 1 for m in moves)


def test_rebalancer_counts_an_unmeasured_peer_at_its_stage_mean():
    """[4, 1] -> [3, 2] equal peers: the mover serves its new stage under a new uid with no rate yet. Counted as 0,
    stage 1 would look as short as before and a second peer would follow ([2, 3]: a move that gains nothing and
    costs a state download); counted at its stage's mean rate, [3, 2] stays."""
    rebalancer = Rebalancer(period_s=1.0)
    assert rebalancer.decide(loads(["a", "b", "c", "d"], ["e"]), now=0.0) is not None
    rebalancer.arrived(1.0)
    moved = loads(["a", "b", "c"], ["e", "d'"], queue=0.0)
    moved[1] = [PeerLoad("e", 4.0, 1.0), PeerLoad("d'", 0.0, None)]
    assert rebalancer.decide(moved, now=5.0) is None
    as_zero = {**moved, 1: [moved[1][0], PeerLoad("d'", 0.0, 0.0)]}
    assert Rebalancer(period_s=1.0).decide(as_zero, now=5.0) is not None  # what counting it as 0 would do
    assert Rebalancer.rates(moved) == {0: [1.0, 1.0, 1.0], 1: [1.0, 1.0]}
    # a stage with no measured peer takes the swarm's mean; with nobody measured there is no decision
    fresh = {0: [PeerLoad("a", 0.0, 2.0), PeerLoad("b", 0.0, 4.0)], 1: [PeerLoad("c", 9.0, None)]}
    assert Rebalancer.rates(fresh) == {0: [2.0, 4.0], 1: [3.0]}
    assert Rebalancer(period_s=1.0).decide({0: [PeerLoad("a", 0, None), PeerLoad("b", 0, None)], 1: []},
                                           now=0.0) is None


def test_rebalancer_never_empties_a_stage_and_fills_an_empty_one():
    rebalancer = Rebalancer(period_s=1.0)
    state = {0: [PeerLoad("fast", 0.0, 10.0)], 1: [PeerLoad("slow", 50.0, 0.1)]}
    assert rebalancer.decide(state, now=0.0) is None  # no stage has a peer to spare
    move = rebalancer.decide({0: [PeerLoad("a", 0, 1.0), PeerLoad("b", 0, 1.0)], 1: []}, now=0.0)
    assert move is not None and (move.from_stage, move.to_stage) == (0, 1)


def test_a_load_record_round_trips_and_garbage_is_no_record():
    """``LoadRecord``: what a peer stores of its meter's window and what every peer parses back (the DHT layout:
    period, queue, rate, units, busy_s, calls, span_s); a value that is not one parses to None."""
    meter = LoadMeter(now=0.0)
    for i in range(12):   # settled: a rate
        meter.enter(i * 0.1)
        meter.served(2.0, 0.05)
        meter.exit(i * 0.1 + 0.05)
    record = LoadRecord.from_window(7, meter.window(1.2))
    assert record.period == 7 and record.calls == 12 and record.rate == pytest.approx(40.0)
    assert set(record.value()) == {"period", "queue", "rate", "units", "busy_s", "calls", "span_s"}
    assert LoadRecord.from_value(record.value()) == record
    assert LoadRecord.from_value(json.loads(json.dumps(record.value()))) == record
    assert record.peer_load("s0p1") == PeerLoad("s0p1", record.queue, 40.0)
    unsettled = {"period": 3, "queue": 2, "rate": None, "units": 0.0, "busy_s": 0.0, "calls": 0, "span_s": 1.0}
    assert LoadRecord.from_value(unsettled).peer_load("a") == PeerLoad("a", 2.0, None)
    assert LoadRecord.from_value({"period": 3, "queue": 0.5, "rate": 1, "other": "x"}) == LoadRecord(3, 0.5, 1)
    good = {"period": 3, "queue": 0.5, "rate": 1.5, "units": 3.0, "busy_s": 2.0, "calls": 4, "span_s": 1.0}
    garbage = [None, "load", [], {}, 3, {**good, "period": "3"}, {**good, "period": True}, {**good, "period": -1},
               {**good, "period": 3.0}, {**good, "queue": -0.5}, {**good, "queue": math.nan},
               {**good, "queue": math.inf}, {**good, "queue": "1"}, {**good, "queue": None}, {**good, "queue": 10**400},
               {**good, "rate": math.nan}, {**good, "rate": -1.0}, {**good, "rate": "1"}, {**good, "rate": False},
               {**good, "calls": 1.5}, {**good, "calls": -1}, {**good, "busy_s": "x"}, {**good, "span_s": -1.0},
               {k: v for k, v in good.items() if k != "rate"}, {k: v for k, v in good.items() if k != "queue"},
               {k: v for k, v in good.items() if k != "period"}]
    assert LoadRecord.from_value(good) == LoadRecord(3, 0.5, 1.5, 3.0, 2.0, 4, 1.0)
    assert [LoadRecord.from_value(v) for v in garbage] == [None] * len(garbage)


def test_the_last_move_record_keeps_its_dht_layout_and_garbage_is_no_record():
    """``LastMove`` as the launcher's peers store it under ``last_move_key``: decided (``arrived`` None), then
    arrived; the move's uid and stages flat in the value."""
    move = Move("s0p2", 0, 1)
    decided = LastMove(9, 100.5, move=move)
    assert decided.value() == {"uid": "s0p2", "from_stage": 0, "to_stage": 1, "period": 9, "arrived": None,
                               "t": 100.5}
    arrived = LastMove(9, 130.0, arrived=11, move=move)
    for record in (decided, arrived, LastMove(4, 2.0)):
        assert LastMove.from_value(record.value()) == record
        assert LastMove.from_value(json.loads(json.dumps(record.value()))) == record
    # the arrival's record as the mover stores it, with its drain's entries
    stored = {**arrived.value(), "drain_s": 0.4, "handed_over_samples": 8, "lost_gradient_samples": 0}
    assert LastMove.from_value(stored) == arrived
    assert MoveGate().quiet(LastMove.from_value(decided.value()), 10, 101.0)
    good = decided.value()
    garbage = [None, "moved", [], {}, {**good, "period": "9"}, {**good, "period": 9.5}, {**good, "period": -1},
               {**good, "t": math.nan}, {**good, "t": "now"}, {**good, "arrived": "10"}, {**good, "arrived": -1},
               {**good, "arrived": 10.0}, {**good, "uid": ""}, {**good, "uid": 5}, {**good, "from_stage": -1},
               {**good, "to_stage": "1"}, {**good, "to_stage": True},
               {k: v for k, v in good.items() if k != "period"}, {k: v for k, v in good.items() if k != "t"},
               {k: v for k, v in good.items() if k != "to_stage"}, {"period": 9, "t": 1.0, "uid": "s0p2"}]
    assert [LastMove.from_value(v) for v in garbage] == [None] * len(garbage)
    # the simulator's and the emulation's Rebalancer keep the move they decided, then its arrival
    rebalancer = Rebalancer(period_s=60.0)
    move = rebalancer.decide(loads(["a", "b", "c", "d"], ["e"]), now=0.0)
    assert rebalancer.last == LastMove(0, 0.0, move=move)
    rebalancer.arrived(90.0)
    assert rebalancer.last == LastMove(0, 0.0, arrived=1, move=move)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rebalancer.last.arrived = 2


def test_a_claim_record_names_a_stage_and_garbage_is_no_claim():
    assert ClaimRecord(1).value() == {"to": 1}
    assert ClaimRecord.from_value({"to": 1}) == ClaimRecord(1)
    assert ClaimRecord.from_value({"to": 0, "from": 1}) == ClaimRecord(0)
    garbage = [None, 1, "to", [], {}, {"to": "1"}, {"to": -1}, {"to": True}, {"to": None}, {"to": 1.0},
               {"to_stage": 1}]
    assert [ClaimRecord.from_value(v) for v in garbage] == [None] * len(garbage)


def test_move_events_round_trip_through_a_json_line_and_garbage_is_no_event():
    """``MoveEvent``: the moves file's lines (decided; arrived with the new uid and the drain's outcome), the move's
    uid and stages flat in the line; a line of another layout parses to None."""
    decided = MoveEvent("decided", 1700000000.25, Move("s0p2", 0, 1), 7)
    assert decided.value() == {"event": "decided", "time": 1700000000.25, "uid": "s0p2", "from_stage": 0,
                               "to_stage": 1, "period": 7}
    drained = dataclasses.replace(decided, drain_s=0.5, handed_over_samples=8, lost_gradient_samples=0)
    arrived = dataclasses.replace(drained, event="arrived", time=1700000003.5, new_uid="s1p2m1")
    assert arrived.value() == {"event": "arrived", "time": 1700000003.5, "uid": "s0p2", "from_stage": 0,
                               "to_stage": 1, "period": 7, "new_uid": "s1p2m1", "drain_s": 0.5,
                               "handed_over_samples": 8, "lost_gradient_samples": 0}
    for event in (decided, drained, arrived):
        assert MoveEvent.from_value(json.loads(json.dumps(event.value()))) == event
    # an arrival line without handed_over_samples (written before gradients were handed over) counts 0
    old = {k: v for k, v in arrived.value().items() if k != "handed_over_samples"}
    assert MoveEvent.from_value(old) == dataclasses.replace(arrived, handed_over_samples=0)
    good, late = decided.value(), arrived.value()
    garbage = [None, "decided", [], {}, {**good, "event": "moved"}, {**good, "time": math.nan},
               {**good, "time": "now"}, {**good, "period": "7"}, {**good, "period": -1}, {**good, "uid": ""},
               {**good, "to_stage": 1.5}, {**good, "new_uid": "s1p2m1"}, {**good, "drain_s": -1.0},
               {k: v for k, v in good.items() if k != "time"}, {k: v for k, v in good.items() if k != "period"},
               {k: v for k, v in good.items() if k != "to_stage"}, {k: v for k, v in good.items() if k != "event"},
               {k: v for k, v in late.items() if k != "new_uid"}, {k: v for k, v in late.items() if k != "drain_s"},
               {**late, "new_uid": 3}, {**late, "lost_gradient_samples": -1}, {**late, "handed_over_samples": "8"},
               {**late, "drain_s": math.inf}]
    assert [MoveEvent.from_value(v) for v in garbage] == [None] * len(garbage)


def test_stage_sync_counts_to_the_target_and_weights_by_samples():
    sync = StageSync(16)
    assert not sync.add("a", 8)
    assert not sync.add("b", 4)
    assert sync.add("a", 4)
    assert sync.weights() == {"a": 0.75, "b": 0.25}
    assert sync.remove("b") == 4 and sync.total == 12
    sync.reset()
    assert sync.weights() == {} and sync.total == 0


# -- compression -------------------------------------------------------------------------------------------

def outlier_activations() -> torch.Tensor:
    """LayerNorm'd activations with 4 outlier channels x20, like real transformer residual streams."""
    x = torch.nn.functional.layer_norm(torch.randn(8, 128, 512, generator=torch.Generator().manual_seed(0)), (512,))
    x[..., :4] *= 20
    return x


def rel_error(a, b) -> float:
    return float((a - b).norm() / b.norm())


def uniform8_per_tensor(x: torch.Tensor) -> torch.Tensor:
    """One 8-bit linear code over mean +- 3 std for the whole tensor (the scheme of hivemind's Uniform8Bit)."""
    lo, hi = x.mean() - 3 * x.std(), x.mean() + 3 * x.std()
    return torch.round((x.clamp(lo, hi) - lo) / (hi - lo) * 255) / 255 * (hi - lo) + lo


def test_blockwise8_keeps_outlier_channels_that_a_per_tensor_code_destroys():
    x = outlier_activations()
    blockwise = rel_error(roundtrip(x, "blockwise8"), x)
    assert blockwise < 0.07  # swarm.md 2.1: 0.054
    assert rel_error(uniform8_per_tensor(x), x) > 5 * blockwise
    assert rel_error(roundtrip(x, "fp16"), x) < 1e-3
    assert torch.equal(roundtrip(x, "none"), x)


def test_payload_sizes():
    x = outlier_activations()
    full = payload_bytes(encode(x, "none"))
    assert full == x.numel() * 4
    assert payload_bytes(encode(x, "fp16")) == full // 2
    assert payload_bytes(encode(x, "blockwise8")) / full == pytest.approx(0.25, abs=0.002)
    # a tensor smaller than a block costs its own codes plus one scale, not a padded block
    small = torch.randn(2048)
    assert payload_bytes(encode(small, "blockwise8")) == 2048 + 4
    assert torch.allclose(roundtrip(small, "blockwise8"), small, atol=small.abs().max().item() / 127)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_encode_decode_keeps_shape_dtype_and_odd_sizes(scheme):
    x = torch.randn(3, 7, 5).to(torch.bfloat16)
    y = decode(encode(x, scheme, block_size=16))
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_error(y.float(), x.float()) < 0.02
    zeros = torch.zeros(4, 4)
    assert torch.equal(roundtrip(zeros, scheme), zeros)


@pytest.mark.parametrize("numel", [4 * 4096, 4 * 4096 + 5])
def test_blockwise8_is_the_reference_code_and_leaves_its_input_alone(numel):
    """The in-place codec gives exactly the out-of-place reference formula, whole blocks (a view of the input) or
    not, and never writes to the tensor it encodes."""
    x = torch.randn(numel) * 3
    before = x.clone()
    payload = encode(x, "blockwise8")
    assert torch.equal(x, before)
    blocks = -(-numel // 4096)
    padded = torch.zeros(blocks * 4096)
    padded[:numel] = x
    padded = padded.view(blocks, 4096)
    absmax = padded.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    codes = (torch.round(padded / scale[:, None]).clamp(-127, 127) + 128).to(torch.uint8).reshape(-1)[:numel]
    assert torch.equal(payload["codes"], codes) and torch.equal(payload["absmax"], absmax)
    values = ((codes.float() - 128.0) * (absmax / 127.0).repeat_interleave(4096)[:numel])
    assert torch.equal(decode(payload), values)
    moved = payload_to(payload, "cpu")
    assert moved["block_size"] == 4096 and torch.equal(moved["codes"], payload["codes"])


def test_unknown_scheme_is_named():
    with pytest.raises(ValueError, match="allowed: none, fp16, blockwise8"):
        encode(torch.ones(2), "int4")


def test_boundary_quantises_activations_and_gradients():
    x = torch.randn(4, 64, requires_grad=True)
    grad = torch.randn(4, 64)
    y = boundary(x, "blockwise8")
    assert torch.allclose(y, roundtrip(x.detach(), "blockwise8"))
    y.backward(grad)
    assert torch.allclose(x.grad, roundtrip(grad, "blockwise8"))
    assert not torch.equal(x.grad, grad)
    z = torch.randn(3, requires_grad=True)
    assert boundary(z, "none") is z


@pytest.mark.parametrize("layer", [Bottleneck(64, 4, "blockwise8"), Maxout(64, 4, "blockwise8"), Maxout(64, 2)])
def test_bottleneck_and_maxout_shapes_and_gradients(layer):
    x = torch.randn(2, 10, 64, requires_grad=True)
    y = layer(x)
    assert y.shape == x.shape
    y.square().mean().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    assert all(p.grad is not None for p in layer.parameters())
    with pytest.raises(ValueError, match="divisor"):
        type(layer)(64, 3)


# -- choose_move: the rule the launcher's stage peers each evaluate (peer_rebalance) --------------------------
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
        after = {0: [PeerLoad("s0p1", 3.0, 1.0)],
                 1: [PeerLoad("s1p3", 0.0, 0.1), PeerLoad("s1p2m1", 0.0, mover_rate)]}
        assert choose_move(after) is None
        assert choose_move(after, hysteresis=1.0, min_gain=0.0) is None


def test_the_rebalancer_keeps_its_gate_around_the_same_rule():
    rebalancer = Rebalancer(period_s=3.0)
    assert rebalancer.decide(starved(), now=0.0) == choose_move(starved())
    assert rebalancer.decide(starved(), now=3.0) is None  # in transit
    rebalancer.arrived(4.0)
    assert rebalancer.decide(starved(), now=6.0) == choose_move(starved())


def test_a_microbatch_path_calls_the_stages_in_swarms_order_and_keeps_each_stages_input():
    """Forward 0..k-2, the last stage's fused call, backward k-2..0 with the input the trainer kept for that stage;
    the blocking and the asyncio drivers give the same calls and the loss."""
    import asyncio

    from cramswarm.swarm.routing import PathCall, drive_path, drive_path_async, microbatch_path

    def fake(log):
        def call(request: PathCall):
            log.append((request.kind, request.stage, request.payload))
            if request.kind == "forward":
                return request.payload + 1          # each stage adds one
            if request.kind == "last":
                return 10.0 * request.payload, -request.payload   # (loss, gradient of its input)
            kept, grad = request.payload
            return grad - kept
        return call

    log = []
    assert drive_path(microbatch_path(3, 0), fake(log)) == 20.0
    assert log == [("forward", 0, 0), ("forward", 1, 1), ("last", 2, 2), ("backward", 1, (1, -2)),
                   ("backward", 0, (0, -3))]
    async_log = []

    async def acall(request):
        return fake(async_log)(request)

    assert asyncio.run(drive_path_async(microbatch_path(3, 0), acall)) == 20.0 and async_log == log
    one = []
    assert drive_path(microbatch_path(1, 5), fake(one)) == 50.0 and one == [("last", 0, 5)]

    def failing(request):
        if request.kind == "last":
            raise NoPeersError(request.stage)
        return request.payload
    with pytest.raises(NoPeersError):
        drive_path(microbatch_path(2, 0), failing)
    with pytest.raises(ValueError, match="at least one stage"):
        drive_path(microbatch_path(0, 0), failing)


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


def test_the_load_meter_counts_a_call_from_its_entry_to_an_exit_dated_ahead():
    """The simulator knows when an admitted call finishes: an exit dated ahead counts from then on, also across
    windows; a live peer's ``enter`` / ``exit`` and dated exits mix."""
    meter = LoadMeter(now=0.0)
    meter.enter(0.0)
    meter.exit_at(4.0)   # in the queue 0-4 s
    meter.enter(2.0)
    meter.exit_at(12.0)  # 2-12 s: crosses the window's end
    assert meter.queue == 2
    first = meter.window(now=10.0)   # 1 for 2 s, 2 for 2 s, 1 for 6 s -> 12 / 10
    assert first["queue"] == pytest.approx(1.2) and meter.queue == 1
    meter.enter(11.0)
    meter.exit(13.0)
    second = meter.window(now=20.0)  # 1 for 1 s, 2 for 1 s, 1 for 1 s, 0 for 7 s -> 4 / 10
    assert second["queue"] == pytest.approx(0.4) and meter.queue == 0
    load = meter.load("p", now=30.0)
    assert load.uid == "p" and load.queue_len == 0.0 and load.samples_per_s is None


def test_a_joining_peer_takes_the_most_loaded_stage_else_the_one_with_fewest_peers():
    # no loads (rebalancing off, or a period not yet complete): fewest declared peers, the lowest stage on ties
    assert choose_join_stage({0: 2, 1: 1, 2: 2}) == 1
    assert choose_join_stage({0: 1, 1: 1, 2: 3}) == 0
    # loads of every stage: the longest time to clear its queue at its peers' rate, whatever the peer counts
    loads = {0: [PeerLoad("a", 1.0, 10.0)], 1: [PeerLoad("b", 4.0, 10.0), PeerLoad("c", 4.0, 10.0)],
             2: [PeerLoad("d", 0.0, 10.0)]}
    assert choose_join_stage({0: 1, 1: 2, 2: 1}, loads) == 1     # (8 + 1) / 20 beats (1 + 1) / 10
    loads[0] = [PeerLoad("a", 9.0, 2.0)]
    assert choose_join_stage({0: 1, 1: 2, 2: 1}, loads) == 0     # (9 + 1) / 2
    # an unmeasured peer is charged its stage's (else the swarm's) mean rate; no measured peer: by peer counts
    assert choose_join_stage({0: 1, 1: 1}, {0: [PeerLoad("a", 3.0, None)], 1: [PeerLoad("b", 0.0, 1.0)]}) == 0
    assert choose_join_stage({0: 2, 1: 1}, {0: [PeerLoad("a", 3.0, None)], 1: [PeerLoad("b", 0.0, None)]}) == 1
    # loads missing a stage are not a complete view
    assert choose_join_stage({0: 2, 1: 1}, {0: [PeerLoad("a", 50.0, 1.0)]}) == 1
