"""Hosts as Linux network namespaces joined by veth links through a bridge in a namespace of their own.

One testbed (run id ``R``) makes these namespaces and nothing in the root namespace:

- ``csw-R-br``: the switch. A bridge ``br0`` with one port ``p<i>`` per host, address ``10.77.255.254/16``, and
  one relay address ``10.77.1.<i+1>`` per host (the user-space relay listens there, see
  :mod:`cramswarm.testbed.relay`).
- ``csw-R-<name>``, one per host: ``lo`` and ``eth0`` (the other end of ``p<i>``) with address ``10.77.0.<i+1>/16``.

Every host knows every other host's and the switch's MAC address (permanent neighbour entries), so a cut link
(:mod:`cramswarm.testbed.shaping`) makes packets vanish: no ARP failure turns it into "host unreachable".
Testbeds of different run ids share nothing (their addresses live in separate namespaces), so they can run in
parallel. :class:`Testbed` always removes what it made, also on exceptions and Ctrl-C; :func:`cleanup` removes a
run's leftovers (e.g. of a process killed with SIGKILL).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from cramswarm.testbed import shaping

PREFIX = "csw-"
SUBNET = "10.77"
BRIDGE_IP = f"{SUBNET}.255.254"
BRIDGE_MAC = "02:77:00:00:ff:fe"
MAX_HOSTS = 250
RUN_ID = re.compile(r"^[a-z0-9]{1,20}$")
HOST_NAME = re.compile(r"^[a-z][a-z0-9]{0,11}$")


class Unavailable(RuntimeError):
    """Network namespaces (or veth, bridges, tbf) cannot be made here; the message says why."""


def ip(*args: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    return _run(["ip", *args], check=check, input=input)


def _run(argv: list[str], check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, input=input, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def namespaces() -> list[str]:
    """Names of all network namespaces (``ip netns list``)."""
    out = ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def run_namespaces(run_id: str) -> list[str]:
    return [ns for ns in namespaces() if ns.startswith(f"{PREFIX}{run_id}-")]


def _kill_namespace(ns: str) -> None:
    """SIGKILL what still runs in ``ns`` (processes this testbed started there), then delete it."""
    pids = ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    ip("netns", "del", ns, check=False)


def cleanup(run_id: str) -> list[str]:
    """Delete every namespace of run ``run_id`` (their links and bridge go with them); return their names."""
    if not RUN_ID.match(run_id):
        raise ValueError(f"run id must match {RUN_ID.pattern}: {run_id!r}")
    gone = run_namespaces(run_id)
    for ns in gone:
        _kill_namespace(ns)
    return gone


_AVAILABLE: str | None | bool = False  # False: not probed yet; None: available; str: why not


def unavailable_reason() -> str | None:
    """Why a testbed cannot be built here, or None if it can (probes once: a namespace, a bridge, a veth, tbf)."""
    global _AVAILABLE
    if _AVAILABLE is False:
        _AVAILABLE = _probe()
    return _AVAILABLE


def _probe() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network namespaces need root (this process runs as uid %d)" % os.geteuid()
    for tool in ("ip", "tc", "bridge"):
        if shutil.which(tool) is None:
            return f"{tool} (iproute2) is not installed"
    run_id = f"probe{os.getpid()}"
    ns = f"{PREFIX}{run_id}-x"
    try:
        ip("netns", "add", ns)
        ip("-n", ns, "link", "add", "br0", "type", "bridge")
        ip("-n", ns, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
        _run(["tc", "-n", ns, "qdisc", "add", "dev", "v0", "root", *shaping.tbf_args(100.0)])
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as err:
        return f"cannot build a testbed: {err}"
    finally:
        cleanup(run_id)
    return None


@dataclass(frozen=True)
class Host:
    """One emulated host: its namespace, its address, and the relay address that stands for it."""

    name: str
    index: int
    netns: str
    ip: str
    relay_ip: str  # in the switch namespace: the relay listens here for traffic meant for this host
    port: str  # the switch's port (bridge member) this host hangs on


def _mac(ns: str, dev: str) -> str:
    return json.loads(ip("-n", ns, "-j", "link", "show", dev).stdout)[0]["address"]


def package_env() -> dict:
    """The environment of processes started in the hosts: this checkout's package first on the path."""
    src = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": src + (os.pathsep + path if path else "")}


class Testbed:
    """N hosts in network namespaces on one bridge, each link shaped to ``bandwidth_mbit`` in both directions.

    Use as a context manager; leaving it (normally, by an exception or by Ctrl-C) kills the processes started
    in the hosts and deletes every namespace, link and the bridge::

        with Testbed(3, bandwidth_mbit=100) as tb:
            server = tb.popen("h1", [sys.executable, "-m", "http.server", "8000", "--bind", tb.host("h1").ip])
            tb.run("h0", ["curl", f"http://{tb.host('h1').ip}:8000/"])

    ``bandwidth_mbit``: one rate for all hosts, a list (one per host) or None (unshaped); megabits per second.
    """

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        hosts: int | list[str] = 3,
        bandwidth_mbit: float | list[float | None] | None = None,
        run_id: str | None = None,
    ):
        names = [f"h{i}" for i in range(hosts)] if isinstance(hosts, int) else list(hosts)
        if not 1 <= len(names) <= MAX_HOSTS:
            raise ValueError(f"a testbed has 1..{MAX_HOSTS} hosts, not {len(names)}")
        for name in names:
            if not HOST_NAME.match(name) or name in ("br", "switch"):
                raise ValueError(f"host names must match {HOST_NAME.pattern} (and be neither 'br' nor 'switch'): "
                                 f"{name!r}")  # fmt: skip
        if len(set(names)) != len(names):
            raise ValueError(f"host names repeat: {names}")
        self.run_id = run_id or f"{os.getpid() % 100000}{secrets.token_hex(3)}"
        if not RUN_ID.match(self.run_id):
            raise ValueError(f"run id must match {RUN_ID.pattern}: {self.run_id!r}")
        rates = bandwidth_mbit if isinstance(bandwidth_mbit, list) else [bandwidth_mbit] * len(names)
        if len(rates) != len(names):
            raise ValueError(f"{len(rates)} bandwidths for {len(names)} hosts")
        self.bandwidth_mbit = dict(zip(names, rates))
        self.switch = f"{PREFIX}{self.run_id}-br"
        self.hosts = [
            Host(name, i, f"{PREFIX}{self.run_id}-{name}", f"{SUBNET}.0.{i + 1}", f"{SUBNET}.1.{i + 1}", f"p{i}")
            for i, name in enumerate(names)
        ]
        self._procs: list[subprocess.Popen] = []
        self._made: list[str] = []
        self._lock = threading.Lock()
        self.cut_hosts: set[str] = set()

    # -- life cycle ------------------------------------------------------------------------------------------

    def __enter__(self) -> Testbed:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> Testbed:
        reason = unavailable_reason()
        if reason:
            raise Unavailable(reason)
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _add_namespace(self, ns: str) -> None:
        self._made.append(ns)  # before it exists: close() deletes it even if "add" is interrupted half-way
        ip("netns", "add", ns)

    def _build(self) -> None:
        sw = self.switch
        self._add_namespace(sw)
        ip("-n", sw, "link", "add", "br0", "type", "bridge")
        ip("-n", sw, "link", "set", "br0", "address", BRIDGE_MAC)
        batch = ["link set lo up", "link set br0 up", f"addr add {BRIDGE_IP}/16 dev br0"]
        batch += [f"addr add {h.relay_ip}/16 dev br0" for h in self.hosts]
        ip("-n", sw, "-batch", "-", input="\n".join(batch) + "\n")
        for h in self.hosts:
            self._add_namespace(h.netns)
            ip("link", "add", "eth0", "netns", h.netns, "type", "veth", "peer", "name", h.port, "netns", sw)
            ip("-n", sw, "-batch", "-", input=f"link set {h.port} master br0\nlink set {h.port} up\n")
            batch = ["link set lo up", f"addr add {h.ip}/16 dev eth0", "link set eth0 up"]
            ip("-n", h.netns, "-batch", "-", input="\n".join(batch) + "\n")
            self.shape(h.name, self.bandwidth_mbit[h.name])
        macs = {h.name: _mac(h.netns, "eth0") for h in self.hosts}
        # Permanent neighbours: a cut host's packets are dropped silently instead of failing ARP ("unreachable").
        switch = [f"neigh replace {h.ip} lladdr {macs[h.name]} dev br0 nud permanent" for h in self.hosts]
        ip("-n", sw, "-batch", "-", input="\n".join(switch) + "\n")
        for h in self.hosts:
            batch = [f"neigh replace {o.ip} lladdr {macs[o.name]} dev eth0 nud permanent" for o in self.hosts if o != h]
            batch += [f"neigh replace {a} lladdr {BRIDGE_MAC} dev eth0 nud permanent" for a in self.switch_ips()]
            ip("-n", h.netns, "-batch", "-", input="\n".join(batch) + "\n")

    def close(self) -> None:
        """Kill the processes started in the hosts and delete every namespace this testbed made (idempotent)."""
        restore = None
        if threading.current_thread() is threading.main_thread():
            restore = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not stop the clean-up
        try:
            with self._lock:
                for proc in self._procs:
                    _stop(proc)
                self._procs.clear()
                for ns in reversed(self._made):
                    _kill_namespace(ns)
                self._made.clear()
                # Whatever an interrupted build left (a namespace added but not yet recorded cannot exist: it is
                # recorded first), and a leftover of the same run id.
                for ns in run_namespaces(self.run_id):
                    _kill_namespace(ns)
            atexit.unregister(self.close)
        finally:
            if restore is not None:
                signal.signal(signal.SIGINT, restore)

    # -- addressing ------------------------------------------------------------------------------------------

    def host(self, name: str | int) -> Host:
        if isinstance(name, int):
            return self.hosts[name]
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"no host {name!r} in this testbed ({', '.join(h.name for h in self.hosts)})")

    def switch_ips(self) -> list[str]:
        return [BRIDGE_IP, *(h.relay_ip for h in self.hosts)]

    # -- processes -------------------------------------------------------------------------------------------

    def netns_of(self, where: str | int) -> str:
        return self.switch if where == "switch" else self.host(where).netns

    def popen(self, where: str | int, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` in host ``where`` (or in the switch's namespace: ``"switch"``); killed at close()."""
        kwargs.setdefault("env", package_env())
        with self._lock:
            if not self._made:
                raise RuntimeError("the testbed is not started (or already closed)")
            proc = subprocess.Popen(["ip", "netns", "exec", self.netns_of(where), *argv], **kwargs)
            self._procs.append(proc)
        return proc

    def run(self, where: str | int, argv: list[str], timeout: float = 60.0, **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` in host ``where`` to its end; its output is captured as text."""
        kwargs.setdefault("env", package_env())
        return subprocess.run(
            ["ip", "netns", "exec", self.netns_of(where), *argv], capture_output=True, text=True, timeout=timeout,
            **kwargs,
        )  # fmt: skip

    def python(self, where: str | int, module: str, *args: str, **kwargs) -> subprocess.Popen:
        """Start ``python -m module args`` (this interpreter, this checkout's package) in host ``where``."""
        return self.popen(where, [sys.executable, "-m", module, *args], **kwargs)

    # -- links -----------------------------------------------------------------------------------------------

    def shape(self, name: str | int, mbit: float | None) -> None:
        """Limit host ``name``'s link to ``mbit`` megabits per second each way (None: unshaped)."""
        h = self.host(name)
        shaping.set_rate(h.netns, "eth0", mbit)  # what the host sends
        shaping.set_rate(self.switch, h.port, mbit)  # what the host receives
        self.bandwidth_mbit[h.name] = mbit

    def cut(self, name: str | int) -> None:
        """Cut host ``name`` off: its packets, and packets to it, vanish at the switch (no reset, no ICMP)."""
        h = self.host(name)
        shaping.cut(self.switch, h.port)
        self.cut_hosts.add(h.name)

    def restore(self, name: str | int) -> None:
        h = self.host(name)
        shaping.restore(self.switch, h.port)
        self.cut_hosts.discard(h.name)

    @contextlib.contextmanager
    def link_cut(self, name: str | int):
        """``with tb.link_cut("h1"): ...``: host h1 is cut off inside the block and reconnected after it."""
        self.cut(name)
        try:
            yield
        finally:
            self.restore(name)


def _stop(proc: subprocess.Popen, grace_s: float = 2.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``; close its pipes."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        deadline = time.monotonic() + grace_s
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()
