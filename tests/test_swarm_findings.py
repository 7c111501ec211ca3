"""The ``swarm-findings`` block (``report.swarm_findings``): each finding computed from the committed run files."""

import json

import pandas as pd

from cramswarm.report import docs, swarm_findings


def _wiring(path, weighted, uniform):
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [dict(run="base", transport="testbed", routing=r, stages=2, trainers=12, duration_s=60.0,
                 throughput_mb_s=t, percent_of_optimum=p, lost_microbatches=0, link_mbit_s=100.0, latency_ms=20.0)
            for r, t, p in (("weighted", weighted, 60.0), ("uniform", uniform, 30.0))]
    rows.append(dict(rows[0], run="sweep", throughput_mb_s=99.0))  # the load sweep is not the finding
    pd.DataFrame(rows).to_csv(path, index=False)


def test_without_committed_runs_the_block_names_the_commands(tmp_path):
    text = swarm_findings.render(tmp_path, tmp_path, tmp_path)
    assert "Not committed yet" in text and "|" not in text


def test_wiring_ratio_comes_from_the_base_run_of_the_csv(tmp_path):
    _wiring(tmp_path / "swarm_study_testbed" / "wiring_throughput.csv", weighted=3.0, uniform=1.2)
    text = docs.render_block("swarm-findings", tmp_path, tmp_path, tmp_path)
    row = next(line for line in text.splitlines() if line.startswith("| Throughput-weighted"))
    assert "testbed: 2.50x (60 vs 30 % of optimum, 0 lost)" in row
    assert "100 Mbit/s, 20 ms" in row and "(S3)" in row
    assert "wiring_throughput.csv" in text.splitlines()[-1]


def test_a_wiring_run_on_another_host_is_a_row_of_its_own_naming_the_host(tmp_path):
    _wiring(tmp_path / "swarm_study_testbed" / "wiring_throughput.csv", weighted=3.0, uniform=1.2)
    bigger = tmp_path / "swarm_study_testbed_16cores"
    _wiring(bigger / "wiring_throughput.csv", weighted=3.9, uniform=2.0)
    (bigger / "run.json").write_text(json.dumps({"host": {"cpu_cores": 16}}))
    rows = [f for f in swarm_findings.findings(tmp_path) if f.finding.startswith("Throughput-weighted")]
    assert [f.ours for f in rows] == ["testbed: 2.50x (60 vs 30 % of optimum, 0 lost)",
                                      "testbed: 1.95x (60 vs 30 % of optimum, 0 lost)"]
    assert "host" not in rows[0].setup  # no run.json: the host is not claimed
    assert rows[1].setup.endswith("host: 16 CPU cores; one run each")


def test_failures_kept_share_is_the_mean_window_ratio_of_weighted_routing(tmp_path):
    path = tmp_path / "swarm_study_testbed" / "failures_timeline.csv"
    path.parent.mkdir(parents=True)
    rows = []
    for failures, rates in (("none", (4.0, 6.0)), ("periodic", (3.0, 4.5))):
        for i, rate in enumerate(rates):
            rows.append(dict(transport="sim", routing="weighted", failures=failures, t_s=10.0 * i, window_s=10.0,
                             throughput_mb_s=rate, peers_up=6.0 - i, lost_microbatches=2, link_mbit_s=float("nan"),
                             latency_ms=float("nan")))
            rows.append(dict(rows[-1], routing="fixed", throughput_mb_s=0.1))
    pd.DataFrame(rows).to_csv(path, index=False)
    (finding,) = [f for f in swarm_findings.findings(tmp_path) if f.files == (path,)]
    assert finding.ours == "sim: 75 % (2 lost)"
    assert "testbed links" not in finding.setup  # no testbed rows, no link


def test_simulator_rows_count_the_runs_within_the_tolerance(tmp_path):
    folder = tmp_path / "swarm_testbed"
    folder.mkdir()
    args = {"stages": 2, "peers": 2, "trainers": 2, "compression": "none"}
    shaped = [{"bandwidth_mbit": 100.0, "latency_ms": 20.0, "mb_s": 2.0},
              {"bandwidth_mbit": 10.0, "latency_ms": 50.0, "mb_s": 1.0}]
    (folder / "a.json").write_text(json.dumps({"args": args, "testbed": {"shaped": shaped},
                                               "sim_step_mb": {"shaped": [2.2, 1.3]}}))
    (folder / "old.json").write_text(json.dumps({"args": args, "testbed": {"shaped": shaped}}))
    finding = swarm_findings.simulator(tmp_path)
    assert finding.ours.endswith("1 of 2 within 15%")
    assert "1.10" in finding.ours and "1.30" in finding.ours
    assert finding.files == (folder / "a.json",) and "1 run (of 2 committed" in finding.setup


def test_sim_scale_gives_the_range_over_preemption_models_per_swarm_size_and_period(tmp_path):
    path = tmp_path / "sim_scale" / "sim_scale.csv"
    path.parent.mkdir()
    rows = [dict(peers=100, stages=4, preemption_model=model, rebalance_period_s=period, percent_of_optimum=share,
                 nic_mbit_s=float("nan"))
            for model, period, share in (("independent", float("nan"), 80.0), ("burst", float("nan"), 85.0),
                                         ("independent", 60.0, 90.0), ("burst", 60.0, 90.0))]
    pd.DataFrame(rows).to_csv(path, index=False)
    finding = swarm_findings.sim_scale(tmp_path)
    assert finding.ours == "100 peers: off 80.0-85.0 %, T = 60 s 90.0 %"
    assert "2 preemption models (independent, burst" in finding.setup and "no network" in finding.setup


def test_compression_rows_compare_schemes_over_several_seeds_only(tmp_path):
    folder = tmp_path / "swarm_compression_link"
    folder.mkdir()
    args = dict(peers=2, trainers=2, hidden=256, microbatches=32, mbit=2.0, ms=20.0, seeds=3)

    def scheme(name, ratio, loss):
        return dict(scheme=name, done_mb_s_vs_none=ratio, heldout_loss=loss, heldout_loss_sd=0.05)

    (folder / "mbit2_ms20_seeds3.json").write_text(json.dumps(
        dict(args=args, summary=[scheme("none", 1.0, 3.3), scheme("fp16", 1.25, 3.4)])))
    (folder / "mbit2_ms20_none_seeds3.json").write_text(json.dumps(   # a rerun of one scheme: no comparison
        dict(args=args, summary=[scheme("none", 1.0, 3.2)])))
    (folder / "mbit5_ms20_seeds1.json").write_text(json.dumps(          # one seed: no spread to compare with
        dict(args=dict(args, mbit=5.0, seeds=1), summary=[scheme("none", 1.0, 3.3), scheme("fp16", 2.0, 3.3)])))
    found = swarm_findings.compression(tmp_path)
    assert len(found) == 1
    assert "fp16 1.25x" in found[0].ours and "2 Mbit/s" in found[0].setup


def test_churn_rows_give_the_simulators_ratio_after_the_warmup_per_model(tmp_path):
    """The churn benchmark's ratio is simulated over measured microbatches per second from the warm-up to the end;
    a file without the simulation (the run stopped after the testbed) is left out."""
    folder = tmp_path / "swarm_churn"
    folder.mkdir()
    args = {"stages": 3, "peers": 3, "trainers": 6, "link": 100.0, "latency": 20.0, "batch": 24, "rebalance": 10.0,
            "killed": 2, "starved": 1, "kill_at": 40.0, "join_at": [80.0, 100.0], "warmup": 10.0, "duration": 30.0}

    def timeline(times):
        return [[t, i + 1] for i, t in enumerate(times)]

    real = {"timeline": timeline([5, 12, 14, 20, 25]), "joined": [{}, {}], "moves": [{}], "lost_microbatches": 0,
            "step_overshoot": {"0": {"mean": 0.9, "max": 1.1, "steps": 3}, "1": {"mean": 1.05, "max": 1.2, "steps": 2}}}
    sim = {"compute": {run: {"timeline": timeline([1, 11, 15, 29, 30, 31])} for run in ("calibration", "churn")},
           "calls": {run: {"timeline": timeline([11, 15, 21, 22, 29])} for run in ("calibration", "churn")}}
    (folder / "a.json").write_text(json.dumps({"args": args, "testbed": {"calibration": real, "churn": real},
                                               "sim": sim}))
    (folder / "b.json").write_text(json.dumps({"args": args, "testbed": {"calibration": real, "churn": real}}))
    (finding,) = swarm_findings.churn(tmp_path)
    assert finding.files == (folder / "a.json",)
    # measured: 12, 14, 20, 25 in [10, 30] -> 4; compute: 11, 15, 29, 30 -> 4 (1.00); calls: all 5 (1.25)
    assert finding.ours.startswith("simulated / measured throughput under churn 1.00, 1.25 (1 of 2 within 15%")
    assert "2 of 2 joiners served, 1 move, 0 microbatches lost" in finding.ours
    assert "mean 0.90-1.05, max 1.20 per stage" in finding.ours and "rates after 10 s" in finding.setup
