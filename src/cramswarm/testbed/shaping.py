"""Link shaping and link cuts of the testbed, with the kernel's tools only (tc tbf, bridge port states).

Bandwidth: a token bucket filter (``tc qdisc ... tbf``) on the egress of both ends of a host's veth link: the
host's ``eth0`` limits what it sends, the switch's port limits what it receives. The bucket holds 4 ms of
traffic (at least 16 full frames) and the queue 50 ms; a longer queue only adds delay under load.

Latency, jitter and loss are not done here: this kernel has no ``netem`` (see :mod:`cramswarm.testbed.relay`).

A cut sets the host's bridge port to the ``disabled`` state: the switch neither forwards frames from it nor to
it. Nothing answers the lost packets (no TCP reset, no ICMP), and the host itself sees its link up, as a host
behind a failed route on the internet would. Restoring sets the port back to ``forwarding``.
"""

from __future__ import annotations

import json
import subprocess

BUCKET_S = 0.004  # seconds of traffic the token bucket holds
MIN_BURST_BYTES = 16 * 1514  # at least 16 full Ethernet frames
QUEUE_MS = 50  # how long a packet may wait in the shaper's queue before it is dropped


def _tc(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["tc", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def tbf_args(mbit: float) -> list[str]:
    """The ``tc qdisc`` arguments of a token bucket of ``mbit`` megabits (10^6 bits) per second."""
    if not mbit > 0:
        raise ValueError(f"bandwidth must be > 0 Mbit/s, not {mbit}")
    bits = int(mbit * 1e6)
    burst = max(int(bits / 8 * BUCKET_S), MIN_BURST_BYTES)
    return ["tbf", "rate", f"{bits}bit", "burst", str(burst), "latency", f"{QUEUE_MS}ms"]


def set_rate(netns: str, dev: str, mbit: float | None) -> None:
    """Shape what ``dev`` (in ``netns``) sends to ``mbit`` megabits per second; None removes the shaper."""
    if mbit is None:
        _tc("-n", netns, "qdisc", "del", "dev", dev, "root", check=False)  # no shaper is fine too
        return
    _tc("-n", netns, "qdisc", "replace", "dev", dev, "root", *tbf_args(mbit))


def rate_mbit(netns: str, dev: str) -> float | None:
    """The rate of the shaper on ``dev`` in megabits per second as the kernel reports it, or None if unshaped."""
    for qdisc in json.loads(_tc("-n", netns, "-j", "qdisc", "show", "dev", dev).stdout or "[]"):
        if qdisc.get("kind") == "tbf":
            return qdisc["options"]["rate"] * 8 / 1e6  # tc -j reports bytes per second
    return None


def _port_state(switch: str, port: str, state: str) -> None:
    argv = ["bridge", "-n", switch, "link", "set", "dev", port, "state", state]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")


def cut(switch: str, port: str) -> None:
    """Drop every frame from and to bridge port ``port`` silently (port state 0: disabled)."""
    _port_state(switch, port, "0")


def restore(switch: str, port: str) -> None:
    """Forward ``port``'s frames again (port state 3: forwarding)."""
    _port_state(switch, port, "3")


def port_state(switch: str, port: str) -> str:
    argv = ["bridge", "-n", switch, "-j", "link", "show", "dev", port]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True).stdout
    return json.loads(out)[0]["state"]
