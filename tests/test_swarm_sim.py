"""The discrete-event SWARM simulator (cramswarm.swarm_sim.sim): routing shares, failures, rebalancing, scale, and
agreement with the thread emulation on the same setup."""

import dataclasses

import pytest

from cramswarm.swarm.setups import BACKWARD_COMPUTE_FACTOR, FailureEvent, JoinEvent, PeerSpec, SwarmSetup
from cramswarm.swarm_sim import emulation, scenarios, sim
from cramswarm.swarm_sim.optimum import optimal_throughput, optimum_over_time

SPEEDS = (1.0, 0.5, 0.25)


def one_stage(routing: str, trainers: int = 8, **kw) -> SwarmSetup:
    return SwarmSetup(peers=[PeerSpec(0, v) for v in SPEEDS], trainers=trainers, stage_time_s=0.1,
                      routing=routing, forward_timeout_s=5.0, **{"duration_s": 120.0, **kw})


def window_rate(result: dict, start: float, end: float) -> float:
    done = [n for t, n in result["timeline"] if t <= end]
    before = [n for t, n in result["timeline"] if t <= start]
    return (max(done, default=0) - max(before, default=0)) / (end - start)


def test_weighted_routing_gives_work_in_proportion_to_speed():
    result = sim.run(one_stage("weighted"))
    work = result["work_units"]
    total = sum(work.values())
    for uid, speed in zip(sorted(work), SPEEDS):
        assert work[uid] / total == pytest.approx(speed / sum(SPEEDS), abs=0.03)
    assert result["lost_microbatches"] == 0


def test_weighted_beats_uniform_on_heterogeneous_peers():
    weighted = sim.run(one_stage("weighted"))["throughput_mb_s"]
    uniform = sim.run(one_stage("uniform"))["throughput_mb_s"]
    optimum = optimal_throughput(SPEEDS, 1, 0.1)
    assert weighted > 1.5 * uniform          # the benchmark's target is 1.8x; this is a generous floor
    assert 0.8 * optimum < weighted <= optimum + 1e-9


def test_fixed_chains_stall_while_a_member_is_down_swarm_does_not():
    # Two stages x two peers; at 20 s one peer of each fixed chain dies for 30 s, leaving one live peer per stage.
    peers = [PeerSpec(0), PeerSpec(0), PeerSpec(1), PeerSpec(1)]
    failures = [FailureEvent(20.0, 0, rejoin_after_s=30.0), FailureEvent(20.0, 3, rejoin_after_s=30.0)]
    rates = {}
    for routing in ("weighted", "fixed"):
        setup = SwarmSetup(peers=peers, trainers=4, stage_time_s=0.5, routing=routing, failures=failures,
                           forward_timeout_s=2.0, duration_s=90.0)
        result = sim.run(setup)
        rates[routing] = (window_rate(result, 30.0, 50.0), window_rate(result, 60.0, 90.0))
        assert result["lost_microbatches"] == 0
        assert result["peers_killed"] == 2 and result["rejoins"] == 2
    assert rates["fixed"][0] == 0.0                     # both chains broken: nothing completes
    assert rates["weighted"][0] > 0.3                   # the swarm reroutes to the live replicas
    assert rates["fixed"][1] > 0.5 and rates["weighted"][1] > 0.5   # both recover after the rejoin


def test_failures_cost_retries_but_no_microbatch():
    peers = [PeerSpec(s) for s in range(3) for _ in range(3)]
    failures = [FailureEvent(float(t), (t // 10) % 9, rejoin_after_s=15.0) for t in range(10, 200, 20)]
    setup = SwarmSetup(peers=peers, trainers=12, stage_time_s=1.0, failures=failures, forward_timeout_s=10.0,
                       duration_s=200.0)
    result = sim.run(setup)
    assert result["lost_microbatches"] == 0
    assert result["retries"] > 0 and result["peers_killed"] == len(failures)
    assert result["microbatches_done"] > 0.5 * optimal_throughput([1.0] * 9, 3, 1.0) * 200


def test_a_stage_without_peers_loses_microbatches_after_the_bounded_wait():
    setup = SwarmSetup(peers=[PeerSpec(0), PeerSpec(1)], trainers=2, stage_time_s=0.1,
                       failures=[FailureEvent(5.0, 1)], forward_timeout_s=1.0, duration_s=300.0)
    result = sim.run(setup)
    assert result["lost_microbatches"] >= 2   # give_up_after_s = 120 s: each trainer drops one, then another


def test_rebalancing_moves_a_peer_to_the_starved_stage():
    peers = [PeerSpec(s) for s in range(3) for _ in range(3)]
    failures = [FailureEvent(30.0, 3), FailureEvent(30.0, 4)]
    results = {}
    for period in (None, 10.0):
        setup = SwarmSetup(peers=peers, trainers=12, stage_time_s=1.0, failures=failures, rebalance_period_s=period,
                           forward_timeout_s=30.0, duration_s=240.0, state_download_s=5.0)
        results[period] = sim.run(setup)
    moved = results[10.0]
    assert not results[None]["moves"]
    assert len(moved["moves"]) >= 1 and moved["moves"][0]["to_stage"] == 1
    assert [len(v) for v in moved["per_stage_peers"].values()] in ([2, 2, 3], [3, 2, 2])
    assert window_rate(moved, 120.0, 240.0) > 1.3 * window_rate(results[None], 120.0, 240.0)


def test_same_seed_same_result():
    setup = one_stage("uniform", failures=[FailureEvent(10.0, 0, rejoin_after_s=5.0)])
    first, second = sim.run(setup), sim.run(setup)
    assert first["timeline"] == second["timeline"] and first["retries"] == second["retries"]


def test_thousand_peer_swarm_with_preemptions_runs():
    setup = scenarios.heterogeneous_setup(1000, 4, stage_time_s=1.0, forward_timeout_s=30.0, duration_s=120.0,
                                          rebalance_period_s=30.0, state_download_s=10.0)
    setup.failures = scenarios.poisson_failures(1000, 120.0, mean_interval_s=1.0, rejoin_after_s=60.0, seed=1)
    result = sim.run(setup, trainers_per_process=250, rebalancer_options={"min_gain": 0.0})
    assert result["peers_killed"] == len(setup.failures) > 50
    assert result["lost_microbatches"] == 0
    assert result["microbatches_done"] > 0.3 * optimum_over_time(setup) * 120.0
    assert result["events"] > 10_000


def test_optimum_helpers():
    assert optimal_throughput([1.0] * 6, 3, 1.0) == pytest.approx(2 / 3.0)   # 2 peers per stage, 3 s each
    assert optimal_throughput([1.0], 2, 1.0) == 0.0
    setup = SwarmSetup(peers=[PeerSpec(0), PeerSpec(1)], trainers=1, stage_time_s=1.0, duration_s=100.0,
                       failures=[FailureEvent(50.0, 0, rejoin_after_s=25.0)])
    # 1/3 microbatch/s while both are up, 0 for the 25 s one peer cannot fill two stages
    assert optimum_over_time(setup) == pytest.approx((75 / 100) / 3.0)
    events = scenarios.poisson_failures(5, 1000.0, mean_interval_s=5.0, rejoin_after_s=50.0, seed=2)
    down_until = {}
    for event in events:   # never a peer that is already down
        assert down_until.get(event.peer, -1.0) <= event.at_s
        down_until[event.peer] = event.at_s + 50.0


def test_sim_agrees_with_emulation():
    # Heterogeneous peers, two stages, weighted routing; ~50-200 ms wall-clock sleeps keep thread jitter small.
    peers = [PeerSpec(s, v) for s in range(2) for v in SPEEDS]
    setup = SwarmSetup(peers=peers, trainers=8, stage_time_s=0.5, forward_timeout_s=10.0, duration_s=60.0)
    simulated = sim.run(setup)["throughput_mb_s"]
    emulated = emulation.run(setup, time_scale=0.1)["throughput_mb_s"]
    assert emulated == pytest.approx(simulated, rel=0.15)


# -- the network: shared NICs and per-link latency --------------------------------------------------------------
MB = 1_000_000


def first_done_s(result: dict) -> list[float]:
    return [t for t, _ in result["timeline"][1:]]


def test_one_call_over_a_nic_takes_bytes_over_bandwidth_plus_latency():
    # One trainer, one peer: 4 transfers (forward and backward, request and reply) of 1 MB at 100 Mbit/s (0.08 s
    # each) with 20 ms one-way latency, plus 0.5 s forward and 1 s backward compute.
    expected = 4 * (MB * 8 / 100e6 + 0.02) + 0.5 * (1 + BACKWARD_COMPUTE_FACTOR)
    for network in ({"nic_mbit_s": 100.0}, {"bandwidth_mbit_s": 100.0}):
        setup = SwarmSetup(peers=[PeerSpec(0)], trainers=1, stage_time_s=0.5, activation_bytes=MB, latency_s=0.02,
                           duration_s=10.0, **network)
        assert first_done_s(sim.run(setup))[0] == pytest.approx(expected, rel=1e-9)
    # the per-peer fields override the setup's
    setup = SwarmSetup(peers=[PeerSpec(0, nic_mbit_s=100.0, latency_s=0.02)], trainers=1, stage_time_s=0.5,
                       activation_bytes=MB, nic_mbit_s=1.0, duration_s=10.0)
    assert first_done_s(sim.run(setup))[0] == pytest.approx(expected, rel=1e-9)


def test_two_concurrent_transfers_through_one_nic_each_take_twice_as_long():
    # Two trainers call one peer at once; compute is negligible, so their requests and replies overlap on its NIC
    # and each transfer takes 2 x 0.08 s: both microbatches finish after 4 x (0.16 + 0.02) s.
    common = {"peers": [PeerSpec(0)], "trainers": 2, "stage_time_s": 1e-9, "activation_bytes": MB,
              "latency_s": 0.02, "duration_s": 1.0}
    shared = first_done_s(sim.run(SwarmSetup(nic_mbit_s=100.0, **common)))
    assert shared[:2] == pytest.approx([4 * (2 * 0.08 + 0.02)] * 2, rel=1e-6)
    # per-link bandwidth alone is never shared: the same two calls take 0.08 s per transfer
    unshared = first_done_s(sim.run(SwarmSetup(bandwidth_mbit_s=100.0, **common)))
    assert unshared[:2] == pytest.approx([4 * (0.08 + 0.02)] * 2, rel=1e-6)
    # a link slower than the NIC's share caps each transfer: 50 Mbit/s links under a 1 Gbit/s NIC
    capped = first_done_s(sim.run(SwarmSetup(nic_mbit_s=1000.0, bandwidth_mbit_s=50.0, **common)))
    assert capped[:2] == pytest.approx([4 * (0.16 + 0.02)] * 2, rel=1e-6)


def pure_latency(stages: int, **kw) -> SwarmSetup:
    """One trainer, one peer per stage, 20 ms one way, no bytes: a microbatch is its calls' round trips + compute."""
    return SwarmSetup(peers=[PeerSpec(s) for s in range(stages)], trainers=1, stage_time_s=0.1,
                      forward_timeout_s=5.0, **{"duration_s": 60.0, "latency_s": 0.02, **kw})


@pytest.mark.parametrize("network", [{}, {"nic_mbit_s": 100.0, "activation_bytes": 1000}])
def test_more_round_trips_per_call_cost_their_latency_on_every_call(network):
    # 2 stages: 4 calls of 0.04 s per round trip + 0.1 x (1 + 2) x 2 s compute. With 3 round trips per call each
    # call waits 2 x 0.04 s longer: the microbatch 0.32 s, and throughput drops from 1 / 0.76 to 1 / 1.08 mb/s.
    wire = 2 * 1000 * 8 / 100e6 if network else 0.0   # the request's and the reply's bits through the NIC
    compute = 0.1 * (1 + BACKWARD_COMPUTE_FACTOR) * 2
    one = sim.run(pure_latency(2, **network))
    three = sim.run(pure_latency(2, **network), round_trips_per_call=3.0)
    assert first_done_s(one)[0] == pytest.approx(4 * (0.04 + wire) + compute, rel=1e-9)
    assert first_done_s(three)[0] == pytest.approx(4 * (3 * 0.04 + wire) + compute, rel=1e-9)
    assert three["throughput_mb_s"] == pytest.approx(
        one["throughput_mb_s"] * (4 * (0.04 + wire) + compute) / (4 * (3 * 0.04 + wire) + compute), rel=0.02)
    # without latency, round trips cost nothing
    assert (first_done_s(sim.run(pure_latency(2, latency_s=0.0), round_trips_per_call=3.0))[0]
            == pytest.approx(compute, rel=1e-9))


def test_a_fixed_overhead_is_paid_once_per_call_whatever_the_latency():
    for latency in (0.0, 0.02):
        base = first_done_s(sim.run(pure_latency(3, latency_s=latency)))[0]
        slow = first_done_s(sim.run(pure_latency(3, latency_s=latency), call_overhead_s=0.005))[0]
        assert slow - base == pytest.approx(6 * 0.005, rel=1e-6)   # 3 stages: 6 calls


def test_fused_last_stage_saves_one_call_but_no_compute():
    # 2 stages: stage 0 forward, the last stage's forward + backward in one call, stage 0 backward: 3 round trips
    # of 0.04 s instead of 4, the same 0.6 s of compute.
    compute = 0.1 * (1 + BACKWARD_COMPUTE_FACTOR) * 2
    fused = sim.run(pure_latency(2), fused_last_stage=True)
    assert first_done_s(fused)[0] == pytest.approx(3 * 0.04 + compute, rel=1e-9)
    assert first_done_s(sim.run(pure_latency(2)))[0] == pytest.approx(4 * 0.04 + compute, rel=1e-9)
    # the last stage still does forward + backward work per microbatch and counts its forward once
    done = fused["microbatches_done"]
    work = fused["work_units"]
    assert work["peer001"] == pytest.approx(done * (1 + BACKWARD_COMPUTE_FACTOR), abs=3)
    assert fused["served"]["peer000"] == pytest.approx(fused["served"]["peer001"], abs=1)
    # one stage: the microbatch is one call
    assert first_done_s(sim.run(pure_latency(1), fused_last_stage=True))[0] == pytest.approx(
        0.04 + 0.1 * (1 + BACKWARD_COMPUTE_FACTOR), rel=1e-9)
    with pytest.raises(ValueError, match="round_trips_per_call"):
        sim.run(pure_latency(1), round_trips_per_call=0.5)
    with pytest.raises(ValueError, match="call_overhead_s"):
        sim.run(pure_latency(1), call_overhead_s=-1.0)


def test_a_slow_shared_nic_bounds_throughput_and_the_emulation_refuses_it():
    # 8 trainers, one fast peer whose 10 Mbit/s NIC carries 4 x 1 MB per microbatch: at most 10e6 / 32e6 mb/s
    # (without the NIC it would be about 30 mb/s); the trainers move in lockstep, so the run ends mid-round
    setup = SwarmSetup(peers=[PeerSpec(0)], trainers=8, stage_time_s=0.01, activation_bytes=MB, nic_mbit_s=10.0,
                       forward_timeout_s=60.0, duration_s=200.0)
    result = sim.run(setup)
    bound = 10e6 / (4 * 8 * MB)
    assert 0.85 * bound < result["throughput_mb_s"] <= bound
    assert result["lost_microbatches"] == 0 and result["timeouts"] == 0
    with pytest.raises(ValueError, match="simulator only"):
        emulation.run(setup, time_scale=0.01)
    with pytest.raises(ValueError, match="nic_mbit_s"):
        SwarmSetup(peers=[PeerSpec(0)], trainers=1, stage_time_s=1.0, nic_mbit_s=0.0).validate()


def test_a_peer_killed_mid_transfer_times_out_and_the_call_is_resent():
    peers = [PeerSpec(0), PeerSpec(0)]
    setup = SwarmSetup(peers=peers, trainers=4, stage_time_s=0.1, activation_bytes=MB, nic_mbit_s=100.0,
                       latency_s=0.01, forward_timeout_s=2.0, duration_s=60.0,
                       failures=[FailureEvent(10.0, 0, rejoin_after_s=10.0)])
    result = sim.run(setup)
    assert result["peers_killed"] == 1 and result["rejoins"] == 1
    assert result["lost_microbatches"] == 0 and result["retries"] > 0
    assert window_rate(result, 40.0, 60.0) > 0.5 * window_rate(result, 0.0, 10.0)


# -- preemption models ----------------------------------------------------------------------------------------
def test_burst_failures_kill_several_up_peers_at_once():
    events = scenarios.burst_failures(20, 3600.0, mean_interval_s=300.0, burst_size=4, rejoin_after_s=600.0, seed=3)
    times = sorted({e.at_s for e in events})
    assert 5 <= len(times) <= 20                      # about 12 bursts in an hour
    down_until: dict[int, float] = {}
    for t in times:
        hit = [e.peer for e in events if e.at_s == t]
        assert len(hit) == len(set(hit)) == 4        # never fewer than 4 up out of 20 here
        for peer in hit:
            assert down_until.get(peer, -1.0) <= t    # never a peer that is down
            down_until[peer] = t + 600.0
    assert events == scenarios.burst_failures(20, 3600.0, mean_interval_s=300.0, burst_size=4,
                                              rejoin_after_s=600.0, seed=3)


def test_churn_replaces_departed_peers_with_new_ones():
    failures, joins = scenarios.churn(10, 3600.0, mean_interval_s=120.0, join_after_s=60.0, stage="most_loaded", seed=1)
    assert all(e.rejoin_after_s is None for e in failures)
    assert 15 <= len(failures) <= 45                  # about 30 departures in an hour
    assert [j.at_s for j in joins] == [e.at_s + 60.0 for e in failures][:len(joins)]
    assert all(j.stage == "most_loaded" and 0.5 <= j.speed <= 1.0 for j in joins)
    left: set[int] = set()
    for event in failures:      # each departure is a peer present at that moment, original or arrived
        assert event.peer not in left
        assert event.peer < 10 or joins[event.peer - 10].at_s <= event.at_s
        left.add(event.peer)


def test_preemption_models_share_the_rate_of_preempted_peers():
    counts = {}
    for model in scenarios.PREEMPTION_MODELS:
        failures, joins = scenarios.preemptions(model, 100, 7200.0, preemptions_per_peer_hour=1.0,
                                                rejoin_after_s=600.0, burst_size=4, seed=5)
        counts[model] = len(failures)
        # churn: a newcomer for each departure whose newcomer arrives within the run
        expected_joins = sum(e.at_s + 600.0 < 7200.0 for e in failures) if model.startswith("churn") else 0
        assert len(joins) == expected_joins
    for count in counts.values():
        assert count == pytest.approx(200, rel=0.25)   # 100 peers x 1 per hour x 2 hours
    with pytest.raises(ValueError, match="unknown preemption model"):
        scenarios.preemptions("sunspots", 10, 10.0, preemptions_per_peer_hour=1.0, rejoin_after_s=1.0)


def test_a_newcomer_joins_the_most_loaded_stage():
    # Stage 1 loses two of its three peers for good at 10 s; a peer arriving at 30 s takes the starved stage
    # (most_loaded) and serves it after its 5 s state download; the optimum counts it from its arrival.
    peers = [PeerSpec(s) for s in range(2) for _ in range(3)]
    failures = [FailureEvent(10.0, 3), FailureEvent(10.0, 4)]
    results = {}
    for joins in ([JoinEvent(30.0, speed=1.0, stage="most_loaded")], []):
        setup = SwarmSetup(peers=peers, trainers=8, stage_time_s=0.5, failures=failures, joins=joins,
                           forward_timeout_s=5.0, duration_s=120.0, state_download_s=5.0)
        results[len(joins)] = sim.run(setup)
        assert results[len(joins)]["lost_microbatches"] == 0
    assert results[1]["joins"] == 1 and results[0]["joins"] == 0
    assert results[1]["per_stage_peers"][1] == ["peer005", "peer006"]
    assert window_rate(results[1], 60.0, 120.0) > 1.6 * window_rate(results[0], 60.0, 120.0)   # 2 peers vs 1
    setup = SwarmSetup(peers=[PeerSpec(0), PeerSpec(1)], trainers=1, stage_time_s=1.0, duration_s=100.0,
                       failures=[FailureEvent(50.0, 1)], joins=[JoinEvent(75.0)])
    assert optimum_over_time(setup) == pytest.approx((75 / 100) / 3.0)
    with pytest.raises(ValueError, match="simulator only"):
        emulation.run(setup, time_scale=0.01)


def test_an_in_stage_step_holds_no_call_and_its_apply_costs_only_the_apply():
    # One stage, one peer, one trainer, no network: a microbatch is a 0.1 s forward and a 0.2 s backward call, its
    # backward computed at 0.3 x k s. A step every 4 microbatches lasting 0.5 s (shorter than the 1.2 s a batch
    # takes) holds nothing: the run is the plain one (a step holding the backward calls would delay the 5th).
    setup = pure_latency(1, latency_s=0.0)
    plain = sim.run(setup)
    stepped = sim.run(setup, step_microbatches=4, step_s=0.5)
    assert first_done_s(plain)[:9] == pytest.approx([0.3 * k for k in range(1, 10)], rel=1e-9)
    assert stepped["timeline"] == plain["timeline"]
    assert stepped["stage_steps"] == [plain["microbatches_done"] // 4]
    assert stepped["step_overshoot"] == {0: {"steps": plain["microbatches_done"] // 4, "mean": 1.0, "max": 1.0,
                                             "under": 0}}
    assert plain["stage_steps"] == [0] and plain["step_overshoot"] == {}
    # the optimizer step's compute (apply_s) at the step's end (1.7 s): the peer computes the 6th backward until
    # 1.8 s, then the apply until 1.85 s; every 4 microbatches take 4 x 0.3 + 0.05 s
    applied = sim.run(setup, step_microbatches=4, step_s=0.5, apply_s=0.05)
    assert first_done_s(applied)[:12] == pytest.approx(
        [0.3, 0.6, 0.9, 1.2, 1.5, 1.8, 2.15, 2.45, 2.75, 3.05, 3.4, 3.7], rel=1e-9)
    assert applied["throughput_mb_s"] == pytest.approx(4 / (4 * 0.3 + 0.05), rel=0.02)
    # 2.5 microbatches per step (the fused call counts as the backward): targets 3, 2, 3, 2, steps after the 3rd,
    # 5th, 8th and 10th call, none over its target
    fused = dataclasses.replace(setup, duration_s=3.1)
    fraction = sim.run(fused, fused_last_stage=True, step_microbatches=2.5, step_s=0.1)
    assert fraction["stage_steps"] == [4]
    assert fraction["step_overshoot"] == {0: {"steps": 4, "mean": 1.0, "max": 1.0, "under": 0}}
    assert fraction["timeline"] == sim.run(fused, fused_last_stage=True)["timeline"]


def test_a_step_longer_than_a_batch_overshoots_by_the_calls_computed_meanwhile():
    # One stage, one peer, backward calls computed at 0.3 x k s, a step every 2 lasting 0.95 s, 2.9 s in all:
    # step 1 at 0.6 s with 2 calls, ends 1.55 s; the calls computed at 0.9, 1.2, 1.5 s make step 2 at 1.55 s (3 of
    # a target of 2), ends 2.5 s; 1.8, 2.1, 2.4 s make step 3 at 2.5 s (3); 2.7 s waits for the next.
    setup = pure_latency(1, latency_s=0.0, duration_s=2.9)
    tiny = sim.run(setup, step_microbatches=2, step_s=0.95)
    assert tiny["stage_steps"] == [3]
    assert tiny["step_overshoot"] == {0: {"steps": 3, "mean": round(4 / 3, 4), "max": 1.5, "under": 0}}
    assert tiny["timeline"] == sim.run(setup)["timeline"]
    # a step longer than the call timeout: nothing waits for it, so no call times out
    long = sim.run(dataclasses.replace(setup, forward_timeout_s=0.5, duration_s=60.0), step_microbatches=2, step_s=3.0)
    assert long["timeouts"] == 0 and long["lost_microbatches"] == 0
    assert long["step_overshoot"][0]["mean"] > 4.5   # 10 calls computed per 3 s step, a target of 2


def test_each_stage_steps_on_its_own_calls_and_the_arguments_are_checked():
    # Two stages, one trainer, no network: a microbatch takes 0.6 s, stage 1's backward computed at 0.4 + 0.6 x k s,
    # stage 0's at 0.6 x (k + 1) s. Stage 0 steps at once (0 s) on every 2 calls; stage 1's steps last 1.9 s,
    # in which 3 or 4 of its calls are computed: its batches pass the target, stage 0's do not
    setup = pure_latency(2, latency_s=0.0)
    plain = sim.run(setup)
    result = sim.run(setup, step_microbatches=2, step_s=[0.0, 1.9])
    assert result["timeline"] == plain["timeline"]
    over = result["step_overshoot"]
    assert over[0] == {"steps": plain["microbatches_done"] // 2, "mean": 1.0, "max": 1.0, "under": 0}
    assert 1.5 <= over[1]["mean"] < 2.0 and over[1]["max"] == 2.0
    assert result["stage_steps"] == [over[0]["steps"], over[1]["steps"]]
    assert over[1]["steps"] < over[0]["steps"] / 1.5
    for name in ("step_s", "apply_s"):
        with pytest.raises(ValueError, match=name):
            sim.run(setup, step_microbatches=2, **{name: [0.1]})
        with pytest.raises(ValueError, match=name):
            sim.run(setup, step_microbatches=2, **{name: -0.1})
    with pytest.raises(ValueError, match="step_microbatches"):
        sim.run(setup, step_microbatches=0, step_s=0.1)
