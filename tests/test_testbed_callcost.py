"""What one hivemind call between two testbed hosts costs (cramswarm.testbed.callcost): real calls through the
relay grow by about one round trip of the configured delay, and the line read from them.

The testbed test skips where namespaces cannot be made (CI sets CRAMSWARM_REQUIRE_NETNS: a failure there); the
line's arithmetic runs everywhere.
"""

from __future__ import annotations

import os

import pandas as pd
import pytest

from cramswarm.testbed import callcost, run_namespaces


def point(rate, delay_ms, ms_by_size):
    return {"bandwidth_mbit": rate, "latency_ms": delay_ms,
            "calls_ms": {str(size): {"median": ms} for size, ms in ms_by_size.items()}}


def test_call_model_reads_round_trips_and_fixed_time_from_the_unshaped_points():
    # calls of 5 ms + 2 round trips: 5, 85 and 205 ms at 0, 20 and 50 ms one way; a shaped point adds its wire time
    measured = [point(None, d, {1000: 5 + 2 * 2 * d}) for d in (0.0, 20.0, 50.0)]
    measured.append(point(8.0, 20.0, {1000: 85 + 2.0}))   # 2 x 1000 B at 8 Mbit/s: 2 ms
    model = callcost.call_model(measured, 1000)
    assert model["round_trips_per_call"] == pytest.approx(2.0)
    assert model["call_overhead_s"] == pytest.approx(0.005)
    assert [c["model_over_measured"] for c in model["checks"]] == pytest.approx([1.0] * 4)
    with pytest.raises(ValueError, match="two or more delays"):
        callcost.call_model(measured[:1] + measured[3:], 1000)


@pytest.mark.netns
def test_a_hivemind_call_through_the_relay_costs_about_one_round_trip_per_call(can_build):
    run_id = f"cc{os.getpid()}"
    measured = callcost.measure([(None, 0.0), (None, 40.0)], [callcost.ECHO_BYTES], count=5, run_id=run_id)
    assert run_namespaces(run_id) == []           # the testbed is gone (another run's may exist)
    fast, slow = (m["calls_ms"][str(callcost.ECHO_BYTES)]["median"] for m in measured)
    assert slow >= 80.0                           # a call crosses the 40 ms relay at least once each way
    model = callcost.call_model(measured, callcost.ECHO_BYTES)
    # hivemind opens its stream without waiting for an answer: about one round trip, not two or more
    assert 0.8 < model["round_trips_per_call"] < 1.5
    assert model["call_overhead_s"] < 0.5 and fast < slow


@pytest.mark.netns
def test_the_square_cube_experiment_times_real_calls_on_the_testbed(can_build, tmp_path):
    """swarm_study's square-cube rows with ``link: auto`` where a testbed can be built: each call is a real
    hivemind call over a shaped, delayed link: it costs a round trip or more, and more for more bytes."""
    from cramswarm.swarm_study import study

    out = study.square_cube(tmp_path / "sq.csv", hidden_sizes=(64,), bandwidths_mbit_s=(20.0,),
                            latencies_ms=(0.0, 30.0), schemes=("none", "blockwise8"), batch=4, seq_len=32,
                            repeats=1, head_dim=16, link="auto", calls=1)
    frame = pd.read_csv(out)
    assert set(frame["link"]) == {"testbed"} and len(frame) == 2 * 2
    calls = frame.pivot_table(index="scheme", columns="latency_ms", values="comm_s")
    # the delay costs at least its round trip per call (more where TCP needs several for the payload) ...
    assert (calls[30.0] - calls[0.0] >= 0.9 * 0.060).all(), calls
    # ... and 4x the bytes cost more on the same link (not a fixed bound: tbf's burst lets the first bytes through)
    assert (calls.loc["none"] > calls.loc["blockwise8"]).all(), calls
    assert (frame["utilisation"] < 1).all() and (frame["utilisation"] > 0).all()
