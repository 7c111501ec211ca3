"""The multi-host network testbed (cramswarm.testbed): hosts in network namespaces, shaped links, the delaying
relay, silent link cuts, and a teardown that leaves nothing behind.

Everything is measured by real processes in the hosts' namespaces. Where namespaces cannot be made (not root, no
iproute2), the testbed tests skip with the reason; CI sets CRAMSWARM_REQUIRE_NETNS, which turns the skip into a
failure. The argument checks at the end run everywhere.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil
import pytest

from cramswarm.testbed import Testbed, Unavailable, cleanup, measure, relay, run_namespaces, shaping
from cramswarm.testbed.netns import namespaces, package_env

PORT = measure.PORT
netns = pytest.mark.netns


def root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip() for line in out.splitlines()}


@netns
def test_three_hosts_reach_each_other_over_tcp_and_nothing_lands_in_the_root_namespace(can_build):
    before = root_links()
    with Testbed(3) as tb:
        assert root_links() == before  # all links live in the testbed's namespaces
        assert len({h.ip for h in tb.hosts}) == 3
        for h in tb.hosts:
            measure.start_server(tb, h.name)
            addrs = subprocess.run(["ip", "-n", h.netns, "-o", "-4", "addr", "show"], capture_output=True, text=True,
                                   check=True).stdout  # fmt: skip
            assert f"{h.ip}/16" in addrs and "127.0.0.1" in addrs
        for src in tb.hosts:
            for dst in tb.hosts:
                if src != dst:
                    result = measure.rtt(tb, src.name, (dst.ip, PORT), count=3)
                    assert len(result["rtt_ms"]) == 3 and result["median_ms"] < 50
        # a host only reaches the others: nothing listens on a host's own address but its own server
        assert measure.connect(tb, "h0", (tb.host("h1").ip, 1))["outcome"] == "refused"


@netns
def test_shaped_bandwidth_is_what_processes_see_within_25_percent(can_build):
    """h0 and h1 at 40 Mb/s, h2 at 16 Mb/s: a transfer is limited by its slower end, in either direction."""
    with Testbed(3, bandwidth_mbit=[40.0, 40.0, 16.0]) as tb:
        assert shaping.rate_mbit(tb.host("h0").netns, "eth0") == 40.0  # what the host sends
        assert shaping.rate_mbit(tb.switch, tb.host("h2").port) == 16.0  # what it receives
        for h in ("h0", "h2"):
            measure.start_server(tb, h)
        for src, dst, mbit in (("h1", "h0", 40.0), ("h0", "h2", 16.0), ("h2", "h0", 16.0)):
            seen = measure.throughput(tb, src, (tb.host(dst).ip, PORT), seconds=3.0)["mbit"]
            assert 0.75 * mbit <= seen <= 1.25 * mbit, (src, dst, seen, mbit)
        tb.shape("h2", None)  # h2 unshaped: the same path is now limited by h0's 40 Mb/s
        assert shaping.rate_mbit(tb.switch, tb.host("h2").port) is None
        seen = measure.throughput(tb, "h0", (tb.host("h2").ip, PORT), seconds=3.0)["mbit"]
        assert 0.75 * 40.0 <= seen <= 1.25 * 40.0


@netns
def test_the_relay_adds_the_configured_latency_both_ways(can_build):
    latency = 15.0
    with Testbed(2) as tb:
        h1 = tb.host("h1")
        measure.start_server(tb, "h1")
        direct = measure.rtt(tb, "h0", (h1.ip, PORT), count=10)["median_ms"]
        r = relay.start(tb, tcp=[("h1", PORT)], latency_ms=latency)
        seen = measure.rtt(tb, "h0", r.address("h1", PORT), count=20)
        expected = 2 * latency + direct  # one-way delay, each direction
        assert abs(seen["median_ms"] - expected) <= 0.2 * expected + 3.0, (seen, expected)
        assert seen["min_ms"] >= 2 * latency - 0.5, seen  # never early
        # and the throughput through the relay is still the link's (the relay pipelines, it does not stop-and-wait)
        tb.shape("h1", 24.0)
        assert measure.throughput(tb, "h0", r.address("h1", PORT), seconds=3.0)["mbit"] >= 0.75 * 24.0


@netns
def test_jitter_spreads_the_round_trips_within_its_bounds(can_build):
    latency, jitter = 10.0, 4.0
    with Testbed(2) as tb:
        measure.start_server(tb, "h1", PORT)
        measure.start_server(tb, "h1", PORT + 1)
        steady = relay.start(tb, tcp=[("h1", PORT)], latency_ms=latency)
        jittery = relay.start(tb, tcp=[("h1", PORT + 1)], latency_ms=latency, jitter_ms=jitter, seed=1)
        without = measure.rtt(tb, "h0", steady.address("h1", PORT), count=40)
        seen = measure.rtt(tb, "h0", jittery.address("h1", PORT + 1), count=40)
        # a round trip is 20 ms + the sum of two uniform(-4, 4) ms delays (median 0); a loaded machine only adds
        assert seen["min_ms"] >= 2 * (latency - jitter) - 0.5, seen  # never earlier than the smallest delay
        # the fastest round trips are faster than without jitter (P(sum < -2 ms) = 0.28 each; none of 40: 2e-6)
        assert seen["min_ms"] <= without["min_ms"] - 2.0, (seen, without)
        assert abs(seen["median_ms"] - 2 * latency) <= 0.2 * 2 * latency + 3.0, seen


@netns
def test_the_udp_relay_drops_datagrams_with_the_configured_probability(can_build):
    with Testbed(2) as tb:
        measure.start_server(tb, "h1")
        lossless = relay.start(tb, udp=[("h1", PORT)], latency_ms=5.0)
        result = measure.udp_echo(tb, "h0", lossless.address("h1", PORT, "udp"), count=100, wait_s=1.0)
        assert result["fraction"] == 1.0 and result["median_ms"] >= 10.0 - 0.5
        lossless.proc.kill()
        lossless.proc.wait()
        lossy = relay.start(tb, udp=[("h1", PORT)], latency_ms=5.0, loss=0.2, seed=3)
        result = measure.udp_echo(tb, "h0", lossy.address("h1", PORT, "udp"), count=400, wait_s=1.0)
        # each direction drops 20 %: 64 % come back; 400 datagrams, 0.1 is over 4 standard deviations
        assert abs(result["fraction"] - 0.8**2) <= 0.1, result


@netns
def test_a_cut_link_times_out_without_a_reset_and_restoring_it_resumes_the_connection(can_build):
    with Testbed(3) as tb:
        h1 = tb.host("h1")
        measure.start_server(tb, "h1")
        r = relay.start(tb, tcp=[("h1", PORT), ("h1", 1)], latency_ms=5.0)
        # the control: the same client sees a reset where there is one (nothing listens on port 1), also through
        # the relay, which passes a refused connection on as a reset
        assert measure.connect(tb, "h0", (h1.ip, 1))["outcome"] == "refused"
        assert measure.connect(tb, "h0", r.address("h1", 1))["outcome"] == "reset"
        sessions = [measure.Session(tb, "h0", (h1.ip, PORT), timeout_s=2.0),
                    measure.Session(tb, "h2", r.address("h1", PORT), timeout_s=2.0)]  # fmt: skip
        assert [s.connected["outcome"] for s in sessions] == ["ok", "ok"]
        with tb.link_cut("h1"):
            assert shaping.port_state(tb.switch, h1.port) == "disabled"
            link = subprocess.run(["ip", "-n", h1.netns, "link", "show", "eth0"], capture_output=True, text=True,
                                  check=True).stdout  # fmt: skip
            assert "LOWER_UP" in link  # the host itself sees nothing: its link is up
            during = [s.echo("cut") for s in sessions]
            assert [d["outcome"] for d in during] == ["timeout", "timeout"], during
            assert all(d["s"] >= 1.9 for d in during)
            assert measure.connect(tb, "h0", (h1.ip, PORT), timeout_s=2.0)["outcome"] == "timeout"
            assert measure.connect(tb, "h0", (h1.ip, 1), timeout_s=2.0)["outcome"] == "timeout"  # no RST either
        assert shaping.port_state(tb.switch, h1.port) == "forwarding"
        # the same connections carry on once TCP retransmits (its backoff after a cut of about 8 s: a few seconds)
        after = [s.echo("restored", timeout_s=15.0) for s in sessions]
        assert [a["outcome"] for a in after] == ["ok", "ok"], after
        assert measure.connect(tb, "h0", (h1.ip, PORT))["outcome"] == "ok"
        for s in sessions:
            s.close()


@netns
def test_teardown_leaves_no_namespace_link_or_process(can_build):
    before_ns, before_links = set(namespaces()), root_links()
    with Testbed(3, bandwidth_mbit=50.0) as tb:
        server = measure.start_server(tb, "h1")
        r = relay.start(tb, tcp=[("h1", PORT)], latency_ms=5.0)
        made = set(run_namespaces(tb.run_id))
        assert made == {tb.switch, *(h.netns for h in tb.hosts)} and not made & before_ns
    assert not run_namespaces(tb.run_id)
    assert set(namespaces()) - before_ns == set()
    assert root_links() - before_links == set()
    assert server.poll() is not None and r.proc.poll() is not None


@netns
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_teardown_on_an_exception_or_ctrl_c(can_build, error):
    with pytest.raises(error):
        with Testbed(2) as tb:
            server = measure.start_server(tb, "h0")
            raise error("stop")
    assert not run_namespaces(tb.run_id)
    assert server.poll() is not None


@netns
def test_a_build_that_fails_half_way_removes_what_it_made(can_build, monkeypatch):
    calls = []

    def failing(netns, dev, mbit):
        calls.append(netns)
        if len(calls) == 3:  # the second host's shaping
            raise RuntimeError("tc failed")

    monkeypatch.setattr(shaping, "set_rate", failing)
    tb = Testbed(3, bandwidth_mbit=10.0)
    with pytest.raises(RuntimeError, match="tc failed"):
        tb.start()
    assert len(calls) == 3 and not run_namespaces(tb.run_id)


@netns
def test_cleanup_removes_a_killed_runs_leftovers_and_parallel_runs_do_not_collide(can_build):
    left = Testbed(2).start()  # as if its process had been killed before close()
    with Testbed(2) as other:  # the same addresses, other namespaces
        measure.start_server(left, "h1")
        measure.start_server(other, "h1")
        for tb in (left, other):
            assert measure.connect(tb, "h0", (tb.host("h1").ip, PORT))["outcome"] == "ok"
        listed = subprocess.run([sys.executable, "-m", "cramswarm", "testbed-cleanup"], capture_output=True,
                                text=True, check=True, env=package_env()).stdout.split()  # fmt: skip
        assert {left.run_id, other.run_id} <= set(listed)
        assert sorted(cleanup(left.run_id)) == sorted([left.switch, *(h.netns for h in left.hosts)])
        assert not run_namespaces(left.run_id)
        assert measure.connect(other, "h0", (other.host("h1").ip, PORT))["outcome"] == "ok"
    left.close()  # nothing left to do
    assert not run_namespaces(other.run_id)


@netns
def test_cleanup_after_the_owner_was_sigkilled_removes_its_namespaces_and_processes(can_build):
    code = ("import time\nfrom cramswarm.testbed import Testbed, measure\ntb = Testbed(2).start()\n"
            "measure.start_server(tb, 'h1')\nprint(tb.run_id, flush=True)\ntime.sleep(120)\n")  # fmt: skip
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=package_env())
    try:
        run_id = owner.stdout.readline().strip()
    finally:
        owner.kill()  # SIGKILL: no clean-up of its own
        owner.wait()
        owner.stdout.close()
    left = run_namespaces(run_id)
    assert len(left) == 3
    pids = [int(p) for ns in left for p in subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                                          text=True, check=True).stdout.split()]  # fmt: skip
    assert pids  # the measurement server outlived its owner
    assert sorted(cleanup(run_id)) == sorted(left)
    assert not run_namespaces(run_id)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# -- argument checks (no namespaces needed) -----------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(hosts=0), "1..250 hosts"),
        (dict(hosts=["a", "a"]), "repeat"),
        (dict(hosts=["Bad-name"]), "host names"),
        (dict(hosts=["br"]), "host names"),
        (dict(hosts=["switch"]), "host names"),
        (dict(hosts=2, run_id="x/y"), "run id"),
        (dict(hosts=2, bandwidth_mbit=[1.0]), "1 bandwidths for 2 hosts"),
    ],
)
def test_bad_testbed_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Testbed(**kwargs)


def test_the_token_bucket_holds_4_ms_of_traffic_and_at_least_16_frames():
    args = shaping.tbf_args(100.0)
    assert args[:3] == ["tbf", "rate", "100000000bit"] and args[4] == str(50_000)
    assert shaping.tbf_args(1.0)[4] == str(16 * 1514)
    with pytest.raises(ValueError, match="> 0"):
        shaping.tbf_args(0.0)


def test_relay_delays_stay_within_latency_plus_minus_jitter():
    delay = relay.Delay(10.0, 4.0, 0.25, seed=0)
    samples = [delay.sample() for _ in range(2000)]
    assert 0.006 <= min(samples) < 0.0065 and 0.0135 < max(samples) <= 0.014
    drops = sum(delay.drop() for _ in range(4000))
    assert 800 <= drops <= 1200
    with pytest.raises(ValueError):
        relay.Delay(1.0, 0.0, 1.0, seed=0)


@netns
def test_testbed_check_prints_what_processes_saw_and_leaves_nothing(can_build, tmp_path):
    before = set(namespaces())
    out = tmp_path / "check.json"
    argv = [sys.executable, "-m", "cramswarm", "testbed-check", "--hosts", "2", "--bandwidth-mbit", "30",
            "--latency-ms", "10", "--seconds", "2", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=package_env())
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout) == result
    seen, configured = result["seen"], result["configured"]
    assert 0.75 * 30 <= seen["throughput_direct_mbit"] <= 1.25 * 30
    assert 0.75 * 30 <= seen["throughput_relay_mbit"] <= 1.25 * 30
    assert abs(seen["rtt_relay_ms"] - configured["expected_rtt_relay_ms"]) <= 0.2 * 20 + 3.0
    assert seen["udp_relay_delivered"] == 1.0
    assert (seen["cut_open_connection"], seen["cut_new_connection"], seen["restored_open_connection"]) == (
        "timeout", "timeout", "ok")
    assert set(namespaces()) - before == set()


def test_without_root_or_iproute2_the_reason_is_named(monkeypatch):
    from cramswarm.testbed import netns as tn

    monkeypatch.setattr(tn.sys, "platform", "linux")
    monkeypatch.setattr(tn.os, "geteuid", lambda: 1000)
    assert tn._probe() == "network namespaces need root (this process runs as uid 1000)"
    monkeypatch.setattr(tn.os, "geteuid", lambda: 0)
    monkeypatch.setattr(tn.shutil, "which", lambda tool: None if tool == "bridge" else f"/usr/sbin/{tool}")
    assert tn._probe() == "bridge (iproute2) is not installed"
    monkeypatch.setattr(tn, "_AVAILABLE", "no namespaces here")
    with pytest.raises(Unavailable, match="no namespaces here"):
        Testbed(2).start()
