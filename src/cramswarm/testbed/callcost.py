"""What one hivemind call between two testbed hosts costs: round trips per call and fixed time.

A stage call of the swarm (``trainer.StageClient._rpc``) opens a libp2p stream from the trainer's ``p2pd`` to the
peer's, sends the request's messages (``wire.request``), and reads the reply's. This module makes the
same kind of call - a ``ServicerBase`` stub, the same ``request`` / ``respond`` / ``unpack`` framing - between
processes on two testbed hosts, through the relay, and times it:

- ``serve`` (on each server host): a P2P daemon listening on the host's address, announcing the relay's, with one
  handler ``rpc_echo`` that answers a request of B bytes with a reply of B bytes (no compute);
- ``calls`` (on the client host): connects to every server in turn (one new connection each, as a trainer meets
  each peer once), makes one warm-up call, then ``count`` calls per payload size, one at a time; the median
  wall time per (server, size) in milliseconds.

:func:`measure` builds the testbed: one client host (``c``, unshaped) and one server host per (rate, one-way
delay) point (its link shaped to the rate; one relay process per distinct delay), runs the servers and one
client, and returns the call times. :func:`call_model` reads a per-call network cost from them: over the
unshaped points, the median call time against the round-trip time ``2 x delay`` is a line (least squares); its
slope is the round trips one call costs and its intercept the fixed time of a call (the relay's, the daemons'
and the serialisation's share at that payload size). Both are measurements of the calls, not fitted to a swarm's
throughput. The shaped points check the resulting model ``fixed + round trips x 2 delay + 2 x bytes x 8 / rate``.

    python -m cramswarm.testbed.callcost serve --listen MADDR --announce MADDR
    python -m cramswarm.testbed.callcost calls --to ID@MADDR [--to ...] --sizes 64,8192 --count 15
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import AsyncIterator  # hivemind's servicer recognises typing's alias only

import torch
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils.multiaddr import Multiaddr

from cramswarm.swarm.wire import request, respond, unpack

PORT = 4300          # the servers' port on their hosts (routed by the relay)
ECHO_BYTES = 64      # the smallest payload: a call that is all overhead
CALL_ATTEMPTS = 3    # a failed call is made again (and counted in ``failed_calls``) at most this often


# -- in the hosts --------------------------------------------------------------------------------------------
class CallCost(ServicerBase):
    """A stage peer without a stage: ``rpc_echo`` answers a request with a reply of ``meta["reply_bytes"]``."""

    async def rpc_echo(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                       context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        tensors, meta = await unpack(requests)
        for message in respond({"y": torch.zeros(int(meta["reply_bytes"]), dtype=torch.uint8)}, {}):
            yield message


async def _serve(listen: str, announce: str) -> None:
    p2p = await P2P.create(host_maddrs=[listen], announce_maddrs=[announce])
    await CallCost().add_p2p_handlers(p2p)
    print(json.dumps({"peer_id": p2p.peer_id.to_base58(), "maddr": announce}), flush=True)
    await asyncio.Event().wait()


async def _calls(targets: list[str], sizes: list[int], count: int, listen: str) -> dict:
    p2p = await P2P.create(host_maddrs=[listen])
    results = {}
    try:
        for target in targets:
            peer_id, _, maddr = target.partition("@")
            started = time.perf_counter()
            await p2p._client.connect(PeerID.from_base58(peer_id), [Multiaddr(maddr)])
            connect_ms = (time.perf_counter() - started) * 1e3
            stub = CallCost.get_stub(p2p, PeerID.from_base58(peer_id))

            row = {"connect_ms": connect_ms, "calls_ms": {}, "failed_calls": 0}

            async def call(size: int, stub=stub, row=row) -> float:
                """One timed call; a call that fails (seen once: an empty reply stream) is counted and made
                again, at most ``CALL_ATTEMPTS`` times."""
                for attempt in range(CALL_ATTEMPTS):
                    t0 = time.perf_counter()
                    try:
                        await unpack(await stub.rpc_echo(request({"x": torch.zeros(size, dtype=torch.uint8)},
                                                                 {"reply_bytes": size})))
                        return (time.perf_counter() - t0) * 1e3
                    except Exception:
                        row["failed_calls"] += 1
                        if attempt + 1 == CALL_ATTEMPTS:
                            raise

            await call(ECHO_BYTES)  # the first call also pays for the handler's and the stream's first use
            for size in sizes:
                times = [await call(size) for _ in range(count)]
                row["calls_ms"][str(size)] = {"median": statistics.median(times), "min": min(times),
                                              "max": max(times)}
            results[target] = row
    finally:
        await p2p.shutdown()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="time hivemind calls between testbed hosts")
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("serve")
    p.add_argument("--listen", required=True)
    p.add_argument("--announce", required=True)
    p = sub.add_parser("calls")
    p.add_argument("--to", action="append", required=True, help="PEERID@MULTIADDR (repeatable)")
    p.add_argument("--sizes", required=True, help="payload bytes each way, comma-separated")
    p.add_argument("--count", type=int, default=15)
    p.add_argument("--listen", required=True)
    args = parser.parse_args(argv)
    if args.what == "serve":
        asyncio.run(_serve(args.listen, args.announce))
        return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    print(json.dumps(asyncio.run(_calls(args.to, sizes, args.count, args.listen))), flush=True)
    return 0


# -- the parent's side ---------------------------------------------------------------------------------------
def point_name(i: int) -> str:
    return f"s{i}"


def measure(points: list[tuple[float | None, float]], sizes: list[int], count: int = 15,
            timeout_s: float = 240.0, run_id: str | None = None) -> list[dict]:
    """Median hivemind call times (ms) from one client host to one server host per point (rate in Mbit/s or
    None: unshaped, one-way delay in ms, through the relay): a dict per point with ``bandwidth_mbit``,
    ``latency_ms``, ``connect_ms``, ``calls_ms`` (payload bytes -> {median, min, max}) and ``failed_calls`` (calls
    that failed and were made again; not timed). The testbed is gone
    on return (``run_id``: the testbed's, else a fresh one)."""
    from cramswarm.testbed import relay as relays
    from cramswarm.testbed.netns import Testbed
    from cramswarm.testbed.relay import _read_line

    names = ["c", *(point_name(i) for i in range(len(points)))]
    with Testbed(names, bandwidth_mbit=[None, *(rate for rate, _ in points)], run_id=run_id) as tb:
        relays_by_delay = {}
        for delay in sorted({d for _, d in points}):
            routes = [(point_name(i), PORT) for i, (_, d) in enumerate(points) if d == delay]
            relays_by_delay[delay] = relays.start(tb, tcp=routes, latency_ms=delay)
        servers, targets = [], []
        for i, (_, delay) in enumerate(points):
            host = tb.host(point_name(i))
            seen_at = relays_by_delay[delay].address(host.name, PORT)[0]
            servers.append(tb.python(host.name, "cramswarm.testbed.callcost", "serve",
                                     "--listen", f"/ip4/{host.ip}/tcp/{PORT}",
                                     "--announce", f"/ip4/{seen_at}/tcp/{PORT}", stdout=-1, stderr=-1, text=True))
        for i, proc in enumerate(servers):
            line = _read_line(proc, timeout_s)
            if not line.startswith("{"):
                err = proc.stderr.read()[-2000:] if proc.poll() is not None else "no answer"
                raise RuntimeError(f"the call-cost server on {point_name(i)} did not start: {line!r} {err}")
            info = json.loads(line)
            targets += ["--to", f"{info['peer_id']}@{info['maddr']}"]
        client = tb.host("c")
        argv = [sys.executable, "-m", "cramswarm.testbed.callcost", "calls", *targets, "--count", str(count),
                "--sizes", ",".join(str(s) for s in sizes), "--listen", f"/ip4/{client.ip}/tcp/0"]
        proc = tb.run("c", argv, timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(f"the call-cost client failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        rows = list(json.loads(proc.stdout.strip().splitlines()[-1]).values())
    return [{"bandwidth_mbit": rate, "latency_ms": delay, **row} for (rate, delay), row in zip(points, rows)]


def call_model(measured: list[dict], size: int) -> dict:
    """Round trips per call and fixed seconds per call at payload ``size``, read from the unshaped points of
    :func:`measure` (at least two delays): the least-squares line of median call time against the round-trip
    time. Also the model's relative error at every point (shaped ones add ``2 x size x 8 / rate``)."""
    unshaped = [m for m in measured if m["bandwidth_mbit"] is None]
    xs = [2 * m["latency_ms"] / 1e3 for m in unshaped]
    ys = [m["calls_ms"][str(size)]["median"] / 1e3 for m in unshaped]
    if len(set(xs)) < 2:
        raise ValueError(f"need unshaped points at two or more delays, got {sorted(set(xs))}")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    fixed = my - slope * mx
    checks = []
    for m in measured:
        wire = 0.0 if m["bandwidth_mbit"] is None else 2 * size * 8 / (m["bandwidth_mbit"] * 1e6)
        model = fixed + slope * 2 * m["latency_ms"] / 1e3 + wire
        real = m["calls_ms"][str(size)]["median"] / 1e3
        checks.append({"bandwidth_mbit": m["bandwidth_mbit"], "latency_ms": m["latency_ms"], "measured_s": real,
                       "model_s": model, "model_over_measured": model / real})
    return {"bytes": size, "round_trips_per_call": slope, "call_overhead_s": fixed, "checks": checks}


if __name__ == "__main__":
    sys.exit(main())
