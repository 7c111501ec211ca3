"""The swarm_study experiments (cramswarm.swarm_study.study) at tiny sizes, and their tables, figures and captions
(cramswarm.report.swarm_figures)."""

import numpy as np
import pandas as pd
import pytest
from conftest import ARCH

from cramswarm.report import swarm_figures
from cramswarm.swarm_study import runtime, study

TIMELINE = ["t_s", "window_s", "throughput_mb_s", "completed_total", "peers_up"]


def columns(path) -> list[str]:
    return list(pd.read_csv(path).columns)


@pytest.fixture(scope="module")
def study_dir(tmp_path_factory):
    """Every experiment's CSV at tiny sizes (~15 s in all), written once for the tests of this module."""
    out = tmp_path_factory.mktemp("study")
    study.square_cube(out / "square_cube.csv", hidden_sizes=(32, 64), bandwidths_mbit_s=(10.0, 100.0),
                      batch=4, seq_len=32, repeats=1, head_dim=16, link="ideal", device="cpu")
    study.wiring_throughput(out / "wiring_throughput.csv", duration_s=20.0, time_scale=0.05,
                            sweep_trainers_per_peer=(0.5, 2.0, 8.0))
    study.failures_timeline(out / "failures_timeline.csv", stages=2, peers_per_stage=2, trainers=4,
                            stage_time_s=0.5, kill_every_s=10.0, rejoin_after_s=5.0, duration_s=30.0,
                            forward_timeout_s=3.0, window_s=5.0, transports=("sim",))
    study.rebalancing_recovery(out / "rebalancing_recovery.csv", kill_at_s=10.0, periods_s=(None, 5.0),
                               stage_time_s=0.5, duration_s=40.0, forward_timeout_s=10.0, window_s=5.0,
                               state_download_s=1.0, transports=("sim",))
    rng = np.random.default_rng(0)
    np.save(out / "blocks.npy", rng.integers(5, 64, size=(64, 16)).astype(np.uint16))
    study.compression_loss(out / "compression_loss.csv", out / "blocks.npy",
                           arch=ARCH | {"layers": 2, "max_positions": 16}, vocab_size=64,
                           configs=("none", "blockwise8", "bottleneck2", "maxout2"), steps=4, micro_batch=4)
    study.sim_scale(out / "sim_scale.csv", peer_counts=(20,), stages=2, duration_s=120.0,
                    preemptions_per_peer_hour=30.0, rejoin_after_s=30.0, rebalance_periods_s=(None, 20.0),
                    state_download_s=5.0, trainer_processes=2, nic_mbit_s=100.0, latency_ms=20.0,
                    activation_bytes=100_000)
    return out


def test_square_cube_columns_and_payloads(study_dir):
    frame = pd.read_csv(study_dir / "square_cube.csv")
    assert columns(study_dir / "square_cube.csv") == [
        "hidden_size", "heads", "batch", "seq_len", "device", "threads", "layer_params", "layer_flops", "compute_s",
        "scheme", "activation_payload_bytes", "link", "bandwidth_mbit_s", "latency_ms", "comm_s", "compute_to_comm",
        "utilisation", "device_tflops", "device_compute_s", "device_utilisation"]
    assert len(frame) == 2 * 3 * 2 and (frame["compute_s"] > 0).all() and set(frame["link"]) == {"ideal"}
    assert set(frame["device"]) == {"cpu"}
    # the shares of time computing, on this CPU and at the stated device rate, from the same call time
    assert np.allclose(frame["utilisation"], frame["compute_s"] / (frame["compute_s"] + frame["comm_s"]))
    assert np.allclose(frame["device_compute_s"], frame["layer_flops"] / (frame["device_tflops"] * 1e12))
    assert np.allclose(frame["device_utilisation"],
                       frame["device_compute_s"] / (frame["device_compute_s"] + frame["comm_s"]))
    # training FLOPs of one layer (FFN 4d with the gated half, attention over 32 tokens): 6 x 10 d^2 + 12 s d
    tokens, d = 4 * 32, 64
    flops = 6 * 10 * d * d * tokens + 12 * 32 * d * tokens
    assert np.allclose(frame.loc[frame["hidden_size"] == d, "layer_flops"], flops)
    payload = frame[(frame["hidden_size"] == 64) & (frame["bandwidth_mbit_s"] == 10.0)].set_index("scheme")
    values = 4 * 32 * 64   # two blocks of 4096
    assert payload.loc["none", "activation_payload_bytes"] == 4 * values    # fp32 activation
    assert payload.loc["fp16", "activation_payload_bytes"] == 2 * values
    assert payload.loc["blockwise8", "activation_payload_bytes"] == values + 2 * 4   # codes + one fp32 absmax per block
    # ten times the bandwidth, ten times the ratio
    ratio = frame.pivot_table(index=["hidden_size", "scheme"], columns="bandwidth_mbit_s", values="compute_to_comm")
    assert np.allclose(ratio[100.0] / ratio[10.0], 10.0)


def test_square_cube_ideal_link_adds_a_round_trip_per_call_and_refuses_unknown_links(tmp_path):
    study.square_cube(tmp_path / "sq.csv", hidden_sizes=(64,), bandwidths_mbit_s=(100.0,), latencies_ms=(0.0, 25.0),
                      schemes=("none",), batch=2, seq_len=16, repeats=1, head_dim=16, link="ideal")
    frame = pd.read_csv(tmp_path / "sq.csv").set_index("latency_ms")
    assert frame.loc[25.0, "comm_s"] - frame.loc[0.0, "comm_s"] == pytest.approx(0.050)
    with pytest.raises(ValueError, match="swarm_study.square_cube.link"):
        study.square_cube(tmp_path / "x.csv", hidden_sizes=(64,), link="carrier-pigeon")


def test_wiring_columns_and_order(study_dir):
    frame = pd.read_csv(study_dir / "wiring_throughput.csv")
    assert columns(study_dir / "wiring_throughput.csv") == [
        "run", "speeds", "transport", "routing", "stages", "peers", "trainers", "trainers_per_peer",
        "throughput_mb_s", "optimum_mb_s", "percent_of_optimum", "microbatches_done", "retries", "duration_s",
        "wall_s", "lost_microbatches", "link_mbit_s", "latency_ms"]
    base, sweep = frame[frame["run"] == "base"], frame[frame["run"] == "sweep"]
    assert set(base["transport"]) == {"emulation", "sim"} and set(sweep["transport"]) == {"sim"}
    simulated = base[base["transport"] == "sim"].set_index("routing")["throughput_mb_s"]
    assert simulated["weighted"] > simulated["uniform"]
    # the sweep: 3 loads x 2 speed profiles x 3 routings, 6 peers -> 3, 12 and 48 trainers
    assert len(sweep) == 3 * 2 * 3
    assert sorted(set(sweep["trainers"])) == [3, 12, 48]
    assert set(sweep["speeds"]) == {"mixed", "equal"}
    weighted = sweep[sweep["routing"] == "weighted"].pivot_table(index="trainers_per_peer", columns="speeds",
                                                                 values="percent_of_optimum")
    assert (weighted.loc[8.0] > weighted.loc[0.5]).all()   # more in flight per peer: closer to the optimum
    assert (sweep["percent_of_optimum"] <= 100 + 1e-9).all()
    with pytest.raises(ValueError, match="sweep_speeds"):
        study.wiring_throughput(study_dir / "unused.csv", sweep_speeds=("fast",), transports=())


def test_failure_and_rebalancing_timelines(study_dir):
    failures = pd.read_csv(study_dir / "failures_timeline.csv")
    assert columns(study_dir / "failures_timeline.csv") == [
        "transport", "routing", "failures", *TIMELINE, "retries", "lost_microbatches", "link_mbit_s", "latency_ms"]
    assert set(failures["failures"]) == {"none", "periodic"} and set(failures["routing"]) == {"weighted", "fixed"}
    assert failures["t_s"].max() == 25.0
    assert (failures.loc[failures["routing"] == "weighted", "lost_microbatches"] == 0).all()
    assert failures.loc[failures["failures"] == "periodic", "peers_up"].min() < 4
    rebalancing = pd.read_csv(study_dir / "rebalancing_recovery.csv", na_values=["NaN"])
    assert columns(study_dir / "rebalancing_recovery.csv") == [
        "transport", "rebalance_period_s", "kill_at_s", *TIMELINE, "moves", "first_move_s", "lost_microbatches",
        "link_mbit_s", "latency_ms"]
    off = rebalancing[rebalancing["rebalance_period_s"].isna()]
    on = rebalancing[rebalancing["rebalance_period_s"] == 5.0]
    assert (off["moves"] == 0).all() and (on["moves"] >= 1).all()


def test_compression_loss_rows(study_dir):
    frame = pd.read_csv(study_dir / "compression_loss.csv")
    assert columns(study_dir / "compression_loss.csv") == ["config", "stages", "step", "tokens", "loss"]
    assert frame.groupby("config").size().to_dict() == {"none": 4, "blockwise8": 4, "bottleneck2": 4, "maxout2": 4}
    first = frame[frame["step"] == 1].set_index("config")["loss"]
    # same weights, batch and masks: 8-bit quantisation barely moves the first loss, the narrowing layers do
    assert first["blockwise8"] == pytest.approx(first["none"], abs=0.05)
    assert np.isfinite(frame["loss"]).all()


def test_compression_config_names_are_checked(tmp_path):
    np.save(tmp_path / "blocks.npy", np.full((8, 16), 7, dtype=np.uint16))
    with pytest.raises(ValueError, match="unknown compression config 'squeeze2'"):
        study.compression_loss(tmp_path / "out.csv", tmp_path / "blocks.npy", arch=ARCH | {"layers": 2},
                               vocab_size=64, configs=("squeeze2",), steps=1, micro_batch=4)


def test_sim_scale_rows(study_dir):
    frame = pd.read_csv(study_dir / "sim_scale.csv", na_values=["NaN"])
    assert columns(study_dir / "sim_scale.csv") == [
        "peers", "stages", "preemption_model", "rebalance_period_s", "throughput_mb_s", "optimum_mb_s",
        "percent_of_optimum", "static_percent", "preemptions", "joins", "moves", "retries", "lost_microbatches",
        "nic_mbit_s", "latency_ms", "activation_bytes", "events", "sim_wall_s"]
    assert len(frame) == 4 * 2 and (frame["preemptions"] > 0).all()
    assert list(dict.fromkeys(frame["preemption_model"])) == ["independent", "burst", "churn_random",
                                                              "churn_most_loaded"]
    churn = frame["preemption_model"].str.startswith("churn")
    assert (frame.loc[churn, "joins"] > 0).all() and (frame.loc[~churn, "joins"] == 0).all()
    assert ((frame["percent_of_optimum"] > 0) & (frame["percent_of_optimum"] <= 100)).all()
    assert (frame["nic_mbit_s"] == 100.0).all() and (frame["latency_ms"] == 20.0).all()
    with pytest.raises(ValueError, match="preemption_models"):
        study.sim_scale(study_dir / "unused.csv", preemption_models=("meteor",))


def test_report_writes_tables_figures_and_captions(study_dir, tmp_path):
    paths = swarm_figures.swarm_report(study_dir, tmp_path)
    for name in swarm_figures.EXPERIMENTS:
        for suffix in (".png", ".pdf", ".caption.rst", "_table.csv", "_table.md"):
            path = tmp_path / f"{name}{suffix}"
            assert path in paths and path.stat().st_size > 0, path
        assert (tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
        assert (tmp_path / f"{name}.pdf").read_bytes()[:4] == b"%PDF"
    assert "95.8 %" in (tmp_path / "sim_scale.caption.rst").read_text()
    assert "churn most loaded" in (tmp_path / "sim_scale.caption.rst").read_text()
    assert "trainers per peer" in (tmp_path / "wiring_throughput.caption.rst").read_text()
    assert "[secondary" in (tmp_path / "square_cube.caption.rst").read_text()
    table = pd.read_csv(tmp_path / "failures_timeline_table.csv")
    assert np.allclose(table.loc[table["failures"] == "none", "percent_of_failure_free"], 100.0)


def test_report_needs_some_csv(tmp_path):
    with pytest.raises(FileNotFoundError, match="square_cube.csv"):
        swarm_figures.swarm_report(tmp_path, tmp_path / "out")


def test_square_cube_caption_names_where_the_compute_was_measured(study_dir, tmp_path):
    # the study's CSV (measured on the CPU), then the same rows as if a GPU had measured them
    swarm_figures.square_cube_figure(study_dir / "square_cube.csv", tmp_path / "cpu")
    assert "on this CPU (1 thread(s))" in (tmp_path / "cpu" / "square_cube.caption.rst").read_text()
    gpu = pd.read_csv(study_dir / "square_cube.csv").assign(device="NVIDIA H200")
    gpu.to_csv(tmp_path / "gpu.csv", index=False)
    swarm_figures.square_cube_figure(tmp_path / "gpu.csv", tmp_path / "gpu")
    caption = (tmp_path / "gpu" / "square_cube.caption.rst").read_text()
    assert "on the NVIDIA H200 (timed between CUDA synchronisations)" in caption and "this CPU" not in caption


def test_square_cube_runtime_bound_covers_compute_and_calls():
    from conftest import DEFAULT

    settings = DEFAULT["swarm_study"]["square_cube"]
    base = runtime.square_cube_runtime_s(settings)
    # the 4096-wide layer alone: (3 + 1) passes of 60 d^2 x 1024 tokens at 0.15 TFLOP/s
    assert base > 4 * 60 * 4096**2 * 1024 / 1.5e11
    assert runtime.square_cube_runtime_s(settings | {"hidden_sizes": [*settings["hidden_sizes"], 8192]}) > 2 * base
    slower = settings | {"latencies_ms": [0.0, 500.0]}
    assert runtime.square_cube_runtime_s(slower) - base > 30 * 0.45 * len(settings["hidden_sizes"])
