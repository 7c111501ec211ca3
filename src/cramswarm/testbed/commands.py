"""Commands of the network testbed: testbed-check."""

from __future__ import annotations

import sys

from cramswarm.cli import arg, command, report


@command(
    "testbed-check",
    "build a network testbed (hosts in network namespaces), measure what processes on it see, tear it down",
    arg("--hosts", type=int, default=3, help="hosts (count, >= 2)"),
    arg("--bandwidth-mbit", type=float, help="each host's link, both directions, in megabits per second (default: "
        "unshaped)"),  # fmt: skip
    arg("--latency-ms", type=float, default=0.0, help="the relay's one-way delay, each direction (milliseconds)"),
    arg("--jitter-ms", type=float, default=0.0, help="the relay's delay spread: uniform +- this (milliseconds)"),
    arg("--loss", type=float, default=0.0, help="the relay's UDP drop probability, each direction (0..1)"),
    arg("--seconds", type=float, default=3.0, help="length of each throughput measurement (seconds)"),
    arg("--cut-timeout-s", type=float, default=2.0, help="how long a client waits for an answer over a cut link"),
    arg("--out", help="also write the JSON here"),
)
def testbed_check(args) -> int:
    from cramswarm.testbed import Testbed, Unavailable, measure, relay

    if args.hosts < 2:
        raise ValueError(f"--hosts must be >= 2, not {args.hosts}")
    port = measure.PORT
    try:
        with Testbed(args.hosts, bandwidth_mbit=args.bandwidth_mbit) as tb:
            src, dst = tb.host(0), tb.host(1)
            measure.start_server(tb, dst.name)
            r = relay.start(tb, tcp=[(dst.name, port)], udp=[(dst.name, port)], latency_ms=args.latency_ms,
                            jitter_ms=args.jitter_ms, loss=args.loss)  # fmt: skip
            direct, relayed = (dst.ip, port), r.address(dst.name, port)
            seen = {
                "rtt_direct_ms": measure.rtt(tb, src.name, direct)["median_ms"],
                "rtt_relay_ms": measure.rtt(tb, src.name, relayed)["median_ms"],
                "throughput_direct_mbit": measure.throughput(tb, src.name, direct, args.seconds)["mbit"],
                "throughput_relay_mbit": measure.throughput(tb, src.name, relayed, args.seconds)["mbit"],
                "udp_relay_delivered": measure.udp_echo(tb, src.name, r.address(dst.name, port, "udp"))["fraction"],
            }
            session = measure.Session(tb, src.name, direct, timeout_s=args.cut_timeout_s)
            with tb.link_cut(dst.name):
                seen["cut_open_connection"] = session.echo("cut")["outcome"]
                seen["cut_new_connection"] = measure.connect(tb, src.name, direct, args.cut_timeout_s)["outcome"]
            seen["restored_open_connection"] = session.echo("restored", timeout_s=30.0)["outcome"]
            session.close()
    except Unavailable as err:
        print(f"cramswarm testbed-check: no testbed here: {err}", file=sys.stderr)
        return 1
    configured = {
        "hosts": args.hosts, "bandwidth_mbit": args.bandwidth_mbit, "latency_ms": args.latency_ms,
        "jitter_ms": args.jitter_ms, "loss": args.loss,
        "expected_rtt_relay_ms": 2 * args.latency_ms + seen["rtt_direct_ms"],
        "expected_udp_relay_delivered": (1 - args.loss) ** 2,
    }  # fmt: skip
    report(args.out, {"configured": configured, "seen": seen, "between": [src.name, dst.name]})
    return 0


@command(
    "testbed-cleanup",
    "list the network testbeds' namespaces left on this machine, or delete one run's (with its links and bridge)",
    arg("--run-id", help="delete this run's namespaces (default: only list the run ids found)"),
)
def testbed_cleanup(args) -> int:
    from cramswarm.testbed.netns import PREFIX, cleanup, namespaces

    if args.run_id:
        gone = cleanup(args.run_id)
        print(f"deleted {len(gone)} namespaces of run {args.run_id}" + (f": {' '.join(gone)}" if gone else ""))
        return 0
    runs = sorted({ns[len(PREFIX):].split("-")[0] for ns in namespaces() if ns.startswith(PREFIX)})
    print("\n".join(runs) if runs else "no testbed namespaces")
    return 0
