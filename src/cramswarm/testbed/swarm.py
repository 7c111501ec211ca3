"""The launcher's hivemind swarm on the testbed: every process on an emulated host of its own.

:func:`run` builds a testbed with one host per process - ``ctl`` (the launcher and the bootstrap DHT node), one
host per stage peer (``s<stage><letter>``: ``s0a``, ``s0b``, ``s1a``, ...), one per trainer (``t<rank>``) and one per
``join`` fault of the plan (``j<n>``: the n-th joining peer, ``join<n>``) -,
shapes every host's link to ``bandwidth_mbit``, starts the testbed's relay when a latency or jitter is set, and
runs ``hivemind_transport.run_swarm`` with a :class:`HostPlacement`:

* each process the launcher starts runs in its host's namespace (``ip netns exec``: it replaces itself with the
  command, so the launcher stays its parent and its process group is killed as before);
* its DHT node listens on its host's address at a fixed port (``membership.LISTEN_ENV``) and announces the
  relay's address for that port (``ANNOUNCE_ENV``) when the relay runs, else its own. libp2p hands out the
  announced addresses only (identify, the address file), so every connection between two hosts crosses the relay
  and its delay (``connections`` probes it: the peers' remote ends are relay or switch addresses, no host's);
* the launcher itself (with its client DHT node, whose ``p2pd`` is its child) runs in ``ctl``: the calling
  thread enters that namespace for the run (``entered``) and returns to its own after it.

A restarted process goes to the same host (a trainer) or to its stage's hosts in turn, those with a cut link
last (a stage peer), and a joining peer to its spare host, each on the host's next port (``PORTS_PER_HOST`` per
host, reused in turn). ``faults`` targets (seconds after the first finished microbatch) ``cut:<host>`` /
``restore:<host>`` cut a host's link (packets silently dropped at the switch, no reset) or restore it;
``connections`` records every host's established TCP connections (``HostPlacement.snapshots``). The plan learns
the link (:func:`link_plan`): ``link_mbit_s`` is the shaped rate, and the trainers' call timeouts allow for the
relay's round trip (``RetryPolicy.rtt_s``): a cut peer is noticed by them alone.
Leaving :func:`run` - normally or by an exception - kills every process and deletes every namespace and link.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import ipaddress
import os
import re
import subprocess
import time
from collections import Counter

from cramswarm.swarm.fault_rules import parse_join
from cramswarm.swarm.membership import ANNOUNCE_ENV, LISTEN_ENV
from cramswarm.testbed import relay as relays
from cramswarm.testbed.netns import SUBNET, Testbed

CONTROL = "ctl"       # the launcher's and the bootstrap's host
PORT_BASE = 4100      # the first port a host's DHT node listens on
PORTS_PER_HOST = 8    # ports per host (the relay routes each), taken in turn by the processes started there
CLONE_NEWNET = 0x40000000


def host_names(peers_per_stage: list[int], trainers: int, joiners: int = 0) -> list[str]:
    """The testbed's hosts for a swarm: ``ctl``, then each stage's peers, then the trainers, then ``joiners`` spare
    hosts for the peers that join during the run (``j0``, ``j1``, ...)."""
    if any(n > 26 for n in peers_per_stage) or len(peers_per_stage) > 99 or trainers > 999:
        raise ValueError(f"at most 99 stages of 26 peers and 999 trainers on a testbed: {peers_per_stage}, {trainers}")
    stages = [f"s{s}{chr(ord('a') + j)}" for s, n in enumerate(peers_per_stage) for j in range(n)]
    return [CONTROL, *stages, *(f"t{r}" for r in range(trainers)), *(f"j{n}" for n in range(joiners))]


def joins_of(faults: list[tuple[float, str]]) -> int:
    """How many peers a plan's ``faults`` have join (``join`` / ``join:<speed>`` targets)."""
    return sum(parse_join(target) is not None for _, target in faults)


class HostPlacement:
    """``ProcessGroups.place`` for the testbed: the command prefix and listen/announce addresses of each process."""

    def __init__(self, testbed: Testbed, peers_per_stage: list[int], trainers: int, relay=None, joiners: int = 0):
        self.testbed, self.relay, self.trainers = testbed, relay, trainers
        names = host_names(peers_per_stage, trainers, joiners)
        self.stage_hosts = [[n for n in names if re.fullmatch(rf"s{s}[a-z]", n)] for s in range(len(peers_per_stage))]
        self.started: Counter = Counter()  # stage -> peers started on it
        self.ports: Counter = Counter()    # host -> processes started on it
        self.where: dict[str, tuple[str, int]] = {}  # process name -> (host, port) of its latest start
        self.snapshots: list[dict] = []

    def host_of(self, name: str) -> str:
        if name == "bootstrap":
            return CONTROL
        if m := re.fullmatch(r"trainer(\d+)", name):
            return f"t{m[1]}"
        if m := re.fullmatch(r"join(\d+)", name):   # the n-th joining peer: the spare host j<n>
            return f"j{m[1]}"
        if m := re.fullmatch(r"s(\d+)p\d+", name):
            hosts = [h for h in self.stage_hosts[int(m[1])] if h not in self.testbed.cut_hosts]
            hosts = hosts or self.stage_hosts[int(m[1])]  # its stage's hosts, in turn; cut hosts only if all are
            host = hosts[self.started[int(m[1])] % len(hosts)]
            self.started[int(m[1])] += 1
            return host
        raise ValueError(f"no testbed host for the process {name!r}")

    def __call__(self, name: str) -> tuple[list[str], dict[str, str]]:
        host = self.testbed.host(self.host_of(name))
        port = PORT_BASE + self.ports[host.name] % PORTS_PER_HOST
        self.ports[host.name] += 1
        self.where[name] = (host.name, port)
        seen_at = host.relay_ip if self.relay is not None else host.ip
        env = {LISTEN_ENV: f"/ip4/{host.ip}/tcp/{port}", ANNOUNCE_ENV: f"/ip4/{seen_at}/tcp/{port}"}
        return ["ip", "netns", "exec", host.netns], env

    def fault(self, target: str) -> None:
        kind, _, host = target.partition(":")
        if kind == "cut":
            self.testbed.cut(host)
        elif kind == "restore":
            self.testbed.restore(host)
        elif kind == "connections":
            self.snapshots.append({"time": time.time(), "hosts": self.connections()})
        else:
            raise ValueError(f"unknown testbed fault {target!r} (cut:<host>, restore:<host> or connections)")

    def connections(self) -> dict[str, list[tuple[str, str]]]:
        """Every host's established TCP connections: host -> [(local address, remote address)]."""
        found = {}
        for h in self.testbed.hosts:
            out = subprocess.run(["ip", "netns", "exec", h.netns, "ss", "-Htn", "state", "established"],
                                 capture_output=True, text=True, timeout=30).stdout
            rows = [line.split() for line in out.splitlines() if line.strip()]
            found[h.name] = [(row[-2], row[-1]) for row in rows if len(row) >= 2]
        return found


def host_address(endpoint: str) -> bool:
    """Whether ``ip:port`` is a testbed host's own address (10.77.0.x), not the switch's or the relay's."""
    address = ipaddress.ip_address(endpoint.rsplit(":", 1)[0].strip("[]"))
    return address in ipaddress.ip_network(f"{SUBNET}.0.0/24")


@contextlib.contextmanager
def entered(netns: str):
    """Run the calling thread (and the processes it starts) in network namespace ``netns`` inside the block."""
    libc = ctypes.CDLL(None, use_errno=True)
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(f"/run/netns/{netns}", os.O_RDONLY)
        try:
            if libc.setns(target, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"cannot enter network namespace {netns}: {os.strerror(err)}")
        finally:
            os.close(target)
        try:
            yield
        finally:
            if libc.setns(own, CLONE_NEWNET) != 0:  # a thread left in a deleted namespace would be cut off
                err = ctypes.get_errno()
                raise OSError(err, f"cannot return to this thread's network namespace: {os.strerror(err)}")
    finally:
        os.close(own)


def link_plan(plan, bandwidth_mbit: float | None, latency_ms: float = 0.0, jitter_ms: float = 0.0):
    """``plan`` (a ``settings.SwarmPlan``) told the testbed's link: ``link_mbit_s`` is the shaped rate
    (``bandwidth_mbit``; unshaped: the plan's own), so the averaging's, state downloads' and final steps' bounds
    grow with the link as they would on real hosts of that rate, and the calls' timeouts allow for the relay's
    round trip (``RetryPolicy.rtt_s``: a cut peer is noticed by them alone)."""
    if bandwidth_mbit is not None and not bandwidth_mbit > 0:
        raise ValueError(f"bandwidth_mbit={bandwidth_mbit!r}: must be positive (None: unshaped)")
    retry = dataclasses.replace(plan.retry, rtt_s=plan.retry.rtt_s + 2 * (latency_ms + jitter_ms) / 1000)
    link = plan.link_mbit_s if bandwidth_mbit is None else float(bandwidth_mbit)
    return dataclasses.replace(plan, link_mbit_s=link, retry=retry)


def run(plan, source, total_microbatches: int, *, bandwidth_mbit: float | None = None,
        latency_ms: float = 0.0, jitter_ms: float = 0.0, progress: bool = False, seed: int = 0,
        relay: bool | None = None):
    """Run ``plan`` under the launcher, on a microbatch ``source`` (``cramswarm.swarm.data``), with each process on its
    own testbed host; returns its ``TrainResult``
    with ``stats["testbed"]`` (the setup, each process's host and port, the ``connections`` snapshots).
    ``bandwidth_mbit``: each host's link, both ways (None: unshaped); ``latency_ms`` / ``jitter_ms``: the relay's
    one-way delay and its spread; ``relay``: route through the relay (None: where a delay is set; True with no
    delay measures what the relay itself costs; without it hosts dial each other directly)."""
    from cramswarm.swarm import hivemind_transport as ht

    if relay is False and (latency_ms or jitter_ms):
        raise ValueError(f"latency_ms={latency_ms}, jitter_ms={jitter_ms}: a delay needs the relay (relay=False)")
    joiners = joins_of(plan.faults)
    with Testbed(host_names(plan.peers_per_stage, plan.trainers, joiners), bandwidth_mbit=bandwidth_mbit) as tb:
        proxy = None
        if relay or latency_ms or jitter_ms:
            routes = [(h.name, PORT_BASE + i) for h in tb.hosts for i in range(PORTS_PER_HOST)]
            proxy = relays.start(tb, tcp=routes, latency_ms=latency_ms, jitter_ms=jitter_ms, seed=seed)
        hosts = HostPlacement(tb, plan.peers_per_stage, plan.trainers, proxy, joiners)
        control = tb.host(CONTROL)
        plan = dataclasses.replace(link_plan(plan, bandwidth_mbit, latency_ms, jitter_ms), hosts=hosts,
                                   host=control.ip, interface=None)
        retry = plan.retry
        with entered(control.netns):
            result = ht.run_swarm(plan, source, total_microbatches, progress=progress)
        result.stats["testbed"] = {
            "hosts": len(tb.hosts), "bandwidth_mbit": bandwidth_mbit, "link_mbit_s": plan.link_mbit_s,
            "latency_ms": latency_ms,
            "jitter_ms": jitter_ms, "relay": proxy is not None, "run_id": tb.run_id,
            "call_timeout_s": [retry.timeout(backward=False), retry.timeout(backward=True)],
            "placement": {name: list(where) for name, where in hosts.where.items()},
            "cut_hosts": sorted(tb.cut_hosts), "connections": hosts.snapshots,
        }
    return result
