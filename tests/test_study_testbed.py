"""The swarm_study's ``testbed`` transport (cramswarm.swarm_study.study with cramswarm.swarm_study.study_launcher): the
launcher's real processes, each on a host of the network testbed, in wiring_throughput and failures_timeline.

The slow test builds a testbed; it skips with the reason where namespaces cannot be made (CI sets
CRAMSWARM_REQUIRE_NETNS, which turns the skip into a failure, as in test_testbed.py). The others run everywhere.
"""

from __future__ import annotations

import subprocess

import pandas as pd
import pytest

from cramswarm.report import swarm_figures
from cramswarm.swarm_study import runtime, study, study_launcher


def test_without_a_testbed_the_transport_is_skipped_with_the_reason(tmp_path, monkeypatch, capsys):
    import cramswarm.testbed

    monkeypatch.setattr(cramswarm.testbed, "unavailable_reason", lambda: "network namespaces need root (test)")
    study.wiring_throughput(tmp_path / "w.csv", duration_s=10.0, time_scale=0.02, sweep_trainers_per_peer=(),
                            transports=("sim", "testbed"))
    study.failures_timeline(tmp_path / "f.csv", stages=2, peers_per_stage=2, trainers=4, stage_time_s=0.5,
                            kill_every_s=10.0, rejoin_after_s=5.0, duration_s=20.0, forward_timeout_s=3.0,
                            window_s=5.0, transports=("testbed", "sim"))
    study.rebalancing_recovery(tmp_path / "r.csv", stages=2, peers_per_stage=3, killed=2, kill_at_s=10.0,
                               trainers=4, stage_time_s=0.5, periods_s=(None, 5.0), duration_s=40.0,
                               forward_timeout_s=3.0, window_s=5.0, transports=("sim", "testbed"))
    out = capsys.readouterr().out
    for section in ("wiring", "failures", "rebalancing"):
        assert (f"swarm_study.{section}: transport testbed skipped (no testbed here: network namespaces need root "
                "(test))") in out
    wiring, failures = pd.read_csv(tmp_path / "w.csv"), pd.read_csv(tmp_path / "f.csv")
    rebalancing = pd.read_csv(tmp_path / "r.csv")
    assert set(wiring["transport"]) == set(failures["transport"]) == set(rebalancing["transport"]) == {"sim"}
    # the link columns are there for every transport; without a network they are empty
    assert wiring["link_mbit_s"].isna().all() and failures["latency_ms"].isna().all()
    assert rebalancing["link_mbit_s"].isna().all() and rebalancing["latency_ms"].isna().all()
    assert (wiring["lost_microbatches"] == 0).all() and (rebalancing["lost_microbatches"] == 0).all()
    with pytest.raises(ValueError, match=r"swarm_study.wiring.transports: unknown transport\(s\) \['carrier'\]"):
        study.wiring_throughput(tmp_path / "x.csv", transports=("carrier",))


def test_captions_say_which_rows_are_real_processes_and_on_what_link(tmp_path):
    study.wiring_throughput(tmp_path / "w.csv", duration_s=10.0, sweep_trainers_per_peer=(), transports=("sim",))
    study.failures_timeline(tmp_path / "f.csv", stages=2, peers_per_stage=2, trainers=4, stage_time_s=0.5,
                            kill_every_s=10.0, rejoin_after_s=5.0, duration_s=20.0, forward_timeout_s=3.0,
                            window_s=5.0, transports=("sim",))
    # the simulator's rows again as if the testbed had run them (weighted and uniform only), at 100 Mb/s, 20 ms
    for name in ("w", "f"):
        frame = pd.read_csv(tmp_path / f"{name}.csv")
        real = frame[frame["routing"] != "fixed"].assign(transport="testbed", link_mbit_s=100.0, latency_ms=20.0)
        pd.concat([frame, real]).to_csv(tmp_path / f"{name}.csv", index=False)
    swarm_figures.wiring_figure(tmp_path / "w.csv", tmp_path / "report")
    swarm_figures.failures_figure(tmp_path / "f.csv", tmp_path / "report")
    for name in ("wiring_throughput", "failures_timeline"):
        caption = " ".join((tmp_path / "report" / f"{name}.caption.rst").read_text().split())
        assert "sim: the discrete-event simulator, no network" in caption
        assert "testbed: real processes of the launcher" in caption
        assert "links shaped to 100 Mbit/s, 20 ms one way through the relay" in caption
    assert "(testbed)" in (tmp_path / "report" / "wiring_throughput.caption.rst").read_text()
    assert "SIGKILLs a random live peer" in (tmp_path / "report" / "failures_timeline.caption.rst").read_text()


def test_the_launchers_kills_become_failure_events_that_count_peers_up():
    # three peers; a kill every 10 s, each replacement started 15 s after its kill: two down from 20 s to 25 s
    killed = [{"uid": "s0p1", "stage": 0, "t_s": 10.0}, {"uid": "s1p3", "stage": 1, "t_s": 20.0},
              {"uid": "trainer0", "t_s": 22.0}, {"uid": "s0p4", "stage": 0, "t_s": 30.0}]
    events = study_launcher.killed_as_failures(killed, 3, 15.0)
    assert [(e.at_s, e.peer, e.rejoin_after_s) for e in events] == [(10.0, 0, 15.0), (20.0, 1, 15.0),
                                                                   (30.0, 0, 15.0)]
    assert [study.peers_up(events, 3, t) for t in (5.0, 12.0, 22.0, 26.0, 31.0, 40.0, 45.0)] == [3, 2, 1, 2, 1, 2, 3]


def test_kills_for_good_are_never_back_and_become_gone_faults():
    from cramswarm.swarm.setups import FailureEvent, PeerSpec, SwarmSetup

    # two peers killed for good at 12 s (not replaced), one killed every so often and back 5 s later
    killed = [{"uid": "s1p4", "stage": 1, "t_s": 12.0, "replaced": False},
              {"uid": "s1p5", "stage": 1, "t_s": 12.0, "replaced": False}, {"uid": "s0p1", "stage": 0, "t_s": 20.0}]
    events = study_launcher.killed_as_failures(killed, 6, 5.0)
    assert [(e.at_s, e.peer, e.rejoin_after_s) for e in events] == [(12.0, 0, None), (12.0, 1, None),
                                                                   (20.0, 2, 5.0)]
    assert [study.peers_up(events, 6, t) for t in (11.0, 13.0, 21.0, 26.0, 1000.0)] == [6, 4, 3, 4, 4]
    # the study's failures for good, per time and stage, as the launcher's gone<N>:stage<S> faults
    peers = [PeerSpec(stage=s) for s in range(3) for _ in range(3)]
    setup = SwarmSetup(peers=peers, trainers=4, stage_time_s=1.0, failures=[
        FailureEvent(at_s=45.0, peer=3, rejoin_after_s=None), FailureEvent(at_s=45.0, peer=4, rejoin_after_s=None),
        FailureEvent(at_s=60.0, peer=8, rejoin_after_s=None)])
    assert study_launcher.gone_faults(setup) == [(45.0, "gone2:stage1"), (60.0, "gone1:stage2")]
    back = SwarmSetup(peers=peers, trainers=4, stage_time_s=1.0, failures=[FailureEvent(at_s=5.0, peer=0,
                                                                                       rejoin_after_s=3.0)])
    with pytest.raises(ValueError, match="failures for good only"):
        study_launcher.gone_faults(back)


def test_the_gone_fault_kills_all_but_the_stages_last_current_replica():
    from cramswarm.swarm import fault_rules

    assert fault_rules.parse_gone("gone2:stage1") == (2, 1) and fault_rules.parse_gone("gone12:stage0") == (12, 0)
    for other in ("stage1", "peer", "trainer0", "cut:h3", "gone:stage1", "gone2:stage", "gone2:stage1x"):
        assert fault_rules.parse_gone(other) is None, other
    with pytest.raises(ValueError, match="at least one peer"):
        fault_rules.parse_gone("gone0:stage1")
    steps = {"s1p4": 3, "s1p5": 2, "s1p6": 3, "s1p7": -1}
    # the furthest behind first; s1p4 (smallest uid at the latest step) is kept whatever the count
    assert fault_rules.gone_victims(steps, 2) == ["s1p7", "s1p5"]
    assert fault_rules.gone_victims(steps, 3) == fault_rules.gone_victims(steps, 9) == ["s1p7", "s1p5", "s1p6"]
    assert fault_rules.gone_victims({"s1p4": 0}, 1) == [] and fault_rules.gone_victims({}, 2) == []


def test_joins_become_join_faults_and_the_joined_peers_join_events():
    from cramswarm.swarm import fault_rules
    from cramswarm.swarm.setups import FailureEvent, JoinEvent, PeerSpec, SwarmSetup

    peers = [PeerSpec(stage=s) for s in range(3) for _ in range(3)]
    setup = SwarmSetup(peers=peers, trainers=4, stage_time_s=1.0,
                       failures=[FailureEvent(at_s=40.0, peer=3), FailureEvent(at_s=40.0, peer=4)],
                       joins=[JoinEvent(at_s=80.0, stage="most_loaded"),
                              JoinEvent(at_s=100.0, speed=0.5, stage="most_loaded")])
    assert study_launcher.join_faults(setup) == [(80.0, "join"), (100.0, "join:0.5")]
    assert sorted(study_launcher.gone_faults(setup) + study_launcher.join_faults(setup))[0] == (40.0, "gone2:stage1")
    with pytest.raises(ValueError, match="most loaded stage itself"):
        study_launcher.join_faults(SwarmSetup(peers=peers, trainers=4, stage_time_s=1.0, joins=[JoinEvent(80.0)]))
    for target, speed in (("join", 1.0), ("join:0.5", 0.5), ("join:2", 2.0)):
        assert fault_rules.parse_join(target) == speed
    for other in ("joined", "join:", "join:x", "rejoin", "gone2:stage1", "cut:j0"):
        assert fault_rules.parse_join(other) is None, other
    with pytest.raises(ValueError, match="must be positive"):
        fault_rules.parse_join("join:0")
    # the joiners declared themselves at 84.5 s and 103 s: join events then, of their speeds, on the most loaded stage
    joined = [{"uid": "s2q77", "stage": 2, "speed": 0.5, "t_s": 100.0, "declared_s": 103.0},
              {"uid": "s1q51", "stage": 1, "speed": 1.0, "t_s": 80.0, "declared_s": 84.5}]
    assert study_launcher.joined_as_joins(joined) == [JoinEvent(84.5, 1.0, "most_loaded"),
                                                      JoinEvent(103.0, 0.5, "most_loaded")]
    # kills for good on the setup's peers of the killed peers' own stages
    killed = [{"uid": "s1p4", "stage": 1, "t_s": 40.0, "replaced": False},
              {"uid": "s1p5", "stage": 1, "t_s": 40.0, "replaced": False},
              {"uid": "s1q51", "stage": 1, "t_s": 90.0, "replaced": False},
              {"uid": "s1p6", "stage": 1, "t_s": 95.0, "replaced": False}]
    events = study_launcher.killed_as_failures(killed, 9, 5.0, [p.stage for p in peers])
    assert [(e.at_s, e.peer) for e in events] == [(40.0, 3), (40.0, 4), (90.0, 5), (95.0, 0)]


def test_a_joining_peer_enters_through_a_declared_peer_or_the_live_bootstrap():
    from cramswarm.swarm import fault_rules

    maddrs = ["/ip4/10.77.1.1/tcp/4100/p2p/Qboot", "/ip4/10.77.1.2/tcp/4100/p2p/Qa",
              "/ip4/10.77.1.3/tcp/4100/p2p/Qb", "/ip4/10.77.1.4/tcp/4100/p2p/Qgone"]
    assert fault_rules.join_entry(maddrs, {"Qa", "Qb"}, True) == maddrs[2]   # the newest live one
    assert fault_rules.join_entry(maddrs, {"Qa"}, False) == maddrs[1]
    assert fault_rules.join_entry(maddrs, set(), True) == maddrs[0]
    assert fault_rules.join_entry(maddrs, {"Qx"}, False) is None and fault_rules.join_entry([], set(), True) is None


def test_runtime_bound_counts_testbed_runs_in_real_seconds():
    emulated = {"duration_s": 40.0, "time_scale": 0.1}
    assert runtime.transports_runtime_s("wiring", emulated) == pytest.approx(2 * 3 * 4.0)  # the default transports
    with_testbed = emulated | {"transports": ["emulation", "sim", "testbed"]}
    assert runtime.transports_runtime_s("wiring", with_testbed) == pytest.approx(
        2 * 3 * 4.0 + 2 * (40.0 + runtime.TESTBED_START_S))
    assert runtime.transports_runtime_s("failures", {"duration_s": 300.0, "time_scale": 0.02,
                                                   "transports": ["sim"]}) == pytest.approx(4 * 6.0)
    # rebalancing: one run per period and transport
    rebalancing = {"duration_s": 120.0, "time_scale": 0.02, "periods_s": [None, 10.0]}
    assert runtime.transports_runtime_s("rebalancing", rebalancing) == pytest.approx(2 * 2 * 2.4)
    assert runtime.transports_runtime_s("rebalancing", rebalancing | {"transports": ["testbed"]}) == pytest.approx(
        2 * (120.0 + runtime.TESTBED_START_S))


@pytest.mark.netns
def test_wiring_on_the_testbed_runs_real_processes_and_leaves_nothing(tmp_path, monkeypatch, can_build):
    """One stage of peers of speed 1 and 0.25, two trainers, each process on its own host at 100 Mb/s, 20 ms one way:
    weighted and uniform routing both measured, no microbatch lost, every process, namespace and link gone."""
    pytest.importorskip("hivemind", reason="hivemind is not installed: the launcher's processes cannot run")
    from cramswarm.swarm import hivemind_transport as ht
    from cramswarm.testbed import run_namespaces

    runs, original = [], study_launcher.run_setup

    def recorded(setup, **kw):
        runs.append((setup, kw, original(setup, **kw)))
        return runs[-1][2]

    monkeypatch.setattr(study_launcher, "run_setup", recorded)
    daemons = sorted(ht.own_daemons())
    study.wiring_throughput(tmp_path / "w.csv", speeds=(1.0, 0.25), stages=1, trainers=2, stage_time_s=0.05,
                            duration_s=6.0, forward_timeout_s=5.0, transports=("testbed",),
                            sweep_trainers_per_peer=(), testbed_link_mbit_s=100.0, testbed_latency_ms=20.0)
    frame = pd.read_csv(tmp_path / "w.csv")
    assert list(frame["routing"]) == ["weighted", "uniform"] and set(frame["transport"]) == {"testbed"}
    assert (frame["link_mbit_s"] == 100.0).all() and (frame["latency_ms"] == 20.0).all()
    assert (frame["microbatches_done"] > 0).all() and (frame["throughput_mb_s"] > 0).all(), frame
    assert (frame["lost_microbatches"] == 0).all(), frame
    # each run: the peers of speed 1 and 0.25 and the trainers on hosts of their own, through the relay
    assert [setup.routing for setup, _, _ in runs] == ["weighted", "uniform"]
    for setup, kw, result in runs:
        tb = result["testbed"]
        assert [p.speed for p in setup.peers] == [1.0, 0.25] and setup.stage_time_s == 0.05
        assert kw == {"link_mbit_s": 100.0, "latency_ms": 20.0} and tb["relay"] and tb["latency_ms"] == 20.0
        assert tb["hosts"] == 1 + 2 + 2 and len({host for host, _ in tb["placement"].values()}) == 5
        assert result["microbatches_done"] == len(result["timeline"]) and result["failures"] == []
        # nothing is left: no namespace of the run, no process of its groups, no p2pd of this process's
        assert result["leftover_processes"] == 0 and not run_namespaces(tb["run_id"])
    assert sorted(ht.own_daemons()) == daemons
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    assert "csw-" not in links


@pytest.mark.netns
def test_rebalancing_on_the_testbed_moves_a_peer_to_the_starved_stage(tmp_path, monkeypatch, can_build):
    """2 stages x 3 peers of speed 1, 5 trainers, each process on its own host at 100 Mb/s, 20 ms one way; 3 s into
    training the launcher SIGKILLs 2 peers of stage 1 for good. Off: nobody moves and stage 1's last peer bounds the
    throughput; on (every 2 s): a stage-0 peer moves to stage 1 and, once it arrived, the swarm runs faster than
    without rebalancing over the same seconds. No microbatch lost, nothing left."""
    pytest.importorskip("hivemind", reason="hivemind is not installed: the launcher's processes cannot run")
    from cramswarm.swarm import hivemind_transport as ht
    from cramswarm.testbed import run_namespaces

    runs, original = [], study_launcher.run_setup

    def recorded(setup, **kw):
        runs.append((setup, original(setup, **kw)))
        return runs[-1][1]

    monkeypatch.setattr(study_launcher, "run_setup", recorded)
    daemons = sorted(ht.own_daemons())
    duration = 60.0   # the move is decided 13-16 s in (a dead peer's record lingers 10 s), the mover arrives ~5 s later
    study.rebalancing_recovery(tmp_path / "r.csv", stages=2, peers_per_stage=3, starved_stage=1, killed=2,
                               kill_at_s=3.0, trainers=5, stage_time_s=0.3, periods_s=(None, 2.0),
                               duration_s=duration, forward_timeout_s=4.0, window_s=5.0, transports=("testbed",),
                               testbed_link_mbit_s=100.0, testbed_latency_ms=20.0)
    frame = pd.read_csv(tmp_path / "r.csv", na_values=["NaN"])
    off, on = frame[frame["rebalance_period_s"].isna()], frame[frame["rebalance_period_s"] == 2.0]
    assert len(off) == len(on) == 12 and set(frame["transport"]) == {"testbed"}
    assert (frame["link_mbit_s"] == 100.0).all() and (frame["latency_ms"] == 20.0).all()
    assert (frame["lost_microbatches"] == 0).all(), frame
    # two of six peers down from the kill on, in both runs (never replaced)
    assert off["peers_up"].max() > 5 and off["peers_up"].iloc[-1] == on["peers_up"].iloc[-1] == 4, frame
    assert (off["moves"] == 0).all() and off["first_move_s"].isna().all()
    assert (on["moves"] >= 1).all() and (on["first_move_s"] > 3.0).all(), frame
    (_, without), (_, with_moves) = runs
    assert [(f.rejoin_after_s, without["testbed"]["hosts"]) for f in without["failures"]] == [(None, 12)] * 2
    first = with_moves["moves"][0]
    assert (first["from_stage"], first["to_stage"]) == (0, 1) and first.get("arrived_s"), with_moves["moves"]
    # the stage steps only at the end: the mover handed the gradients it held to a replica that stays, none lost
    assert first["handed_over_samples"] > 0 and first["lost_gradient_samples"] == 0, first
    # after the mover arrived: faster than the same seconds without rebalancing
    assert first["arrived_s"] < duration - 5.0, with_moves["moves"]
    after = (first["arrived_s"], duration)
    rates = [study_launcher.rate_in([t for t, _ in r["timeline"]], *after) for r in (without, with_moves)]
    assert rates[1] > rates[0], (rates, first)
    for _, result in runs:
        assert result["leftover_processes"] == 0 and not run_namespaces(result["testbed"]["run_id"])
    assert sorted(ht.own_daemons()) == daemons
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    assert "csw-" not in links
