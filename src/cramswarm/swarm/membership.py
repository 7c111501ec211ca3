"""Swarm membership over the hivemind DHT: the bootstrap address file, joining, the DHT keys and records.

Every process of a hivemind swarm joins the DHT through the rendezvous folder's address file (``ADDR_FILE``): the
bootstrap writes its visible multiaddrs there and every later process appends its own (``join_swarm``), so any
live entry lets a newcomer in. A process listens on the swarm's ``host`` or on its ``interface``'s IPv4 address
(``listen_host``); a placement that gives a process a host of its own sets ``LISTEN_ENV`` / ``ANNOUNCE_ENV``.

The keys: ``launcher_key`` (the heartbeat: ``starting``, ``training``, ``stopping`` or ``done``), ``stage_key``
(the declared peers of a stage, sub-key = peer uid, value = P2P peer id), ``progress_key`` (a stage's progress
records, ``peer_sync``), ``work_key`` (the trainers' claims, ``work``) and ``flush_key`` (step the last, partial
batch). ``stage_namespace`` is a stage's P2P handler namespace and all-reduce prefix.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import psutil
from hivemind.dht.node import DHTNode

from cramswarm.io import write_json
from cramswarm.swarm.settings import ProcessConfig

DECLARE_PERIOD_S = 2.0     # a peer re-declares its DHT record this often ...
RECORD_TTL_S = 10.0        # ... with this expiration; a dead peer's record disappears within this time
LAUNCHER_GRACE_S = 30.0  # a stage peer exits once the launcher's heartbeat record is missing this long
LAUNCHER_GONE = 3       # exit code of a stage peer whose launcher is gone (its supervisor does not restart it)
ADDR_FILE, CONFIG_FILE = "dht_addrs.txt", "config.json"  # in a rendezvous folder, written in the order config, addrs
SWARM_KEY = "cramswarm_swarm"  # DHT key of the running swarm's description (its config), read by a joining peer
JOIN_THROUGH = 32          # a joining process tries this many of the address file's newest entries
DONE_FILE = "done"         # in a rendezvous folder: the run id of a launcher that has finished
CLOCK_FILE = "clock.json"  # in a run's folder: the training clock's origin and a seconds budget's deadline
# Set by a placement that puts a process on a host of its own (``cramswarm.testbed.swarm``): the multiaddrs its
# DHT node listens on and those it announces (space-separated; e.g. a relay's address that other hosts must dial).
LISTEN_ENV, ANNOUNCE_ENV = "CRAMSWARM_P2P_LISTEN", "CRAMSWARM_P2P_ANNOUNCE"


class BootstrapError(RuntimeError):
    """The swarm's bootstrap DHT could not be found or joined."""


class RankTaken(RuntimeError):
    """Another live task holds this task's rank in the rendezvous folder."""


class LauncherGone(RuntimeError):
    """The launcher's heartbeat record has been missing from the DHT for too long, or says ``stopping`` (a
    deliberate stop): the swarm writes its shards and exits."""


def listen_host(host: str | None, interface: str | None) -> str:
    """The IPv4 address this process listens on: that of ``interface`` on this host, else ``host``."""
    name = interface
    if not name:
        return host or "127.0.0.1"
    interfaces = psutil.net_if_addrs()
    if name not in interfaces:
        raise BootstrapError(f"swarm.impl.interface={name!r}: no such network interface on {socket.gethostname()} "
                             f"(it has {', '.join(sorted(interfaces))})")
    addresses = [a.address for a in interfaces[name] if a.family == socket.AF_INET]
    if not addresses:
        raise BootstrapError(f"swarm.impl.interface={name!r} has no IPv4 address on {socket.gethostname()}")
    return addresses[0]


# --------------------------------------------------------------------------------------------------------------
# Bootstrap address file and DHT membership
# --------------------------------------------------------------------------------------------------------------
def read_addr_file(path: str | Path, timeout_s: float) -> list[str]:
    """Multiaddrs from the address file, waiting up to ``timeout_s`` for it to appear."""
    path = Path(path)
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise BootstrapError(f"bootstrap address file {path} did not appear within {timeout_s:.0f} s")
        time.sleep(0.1)
    maddrs = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    bad = [m for m in maddrs if not m.startswith("/")]
    if not maddrs or bad:
        raise BootstrapError(f"bootstrap address file {path} holds no valid multiaddr (got {bad or 'nothing'})")
    return maddrs


async def join_swarm(addr_file: str | Path, *, host: str, timeout_s: float, announce: bool) -> DHTNode:
    """A full DHT node joined through the ``JOIN_THROUGH`` newest entries of the address file (dead entries are
    skipped: joining needs one live one); with ``announce`` its own multiaddrs are appended (one ``write`` of whole
    lines with ``O_APPEND``, so concurrent writers never interleave within a line), so that no single process - the
    one that started the DHT included - is needed for later joins."""
    maddrs = await asyncio.to_thread(read_addr_file, addr_file, timeout_s)
    newest = list(dict.fromkeys(reversed(maddrs)))[:JOIN_THROUGH]
    node = await join_dht(newest, client_mode=False, host=host, timeout_s=timeout_s)
    if announce:
        visible = sorted((str(m) for m in await node.p2p.get_visible_maddrs()), key=lambda m: m.startswith("/ip4/127."))
        fd = os.open(addr_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, "".join(f"{m}\n" for m in visible).encode())
        finally:
            os.close(fd)
    return node


async def join_through(initial_peer: str, *, host: str, wait_s: float, workdir: str | None,
                       prefix: str) -> tuple[DHTNode, ProcessConfig]:
    """A full DHT node joined through ``initial_peer`` (a multiaddr of any live process of a running swarm) and the
    swarm's config (``read_swarm``). Where this host lacks the run's folder, the process's files go to ``workdir``
    (or a new temporary folder named ``prefix...``: ``ProcessConfig.elsewhere``), with the swarm's training clock
    (``CLOCK_FILE``) written there from the description, so that a seconds budget runs on the same clock."""
    node = await join_dht([initial_peer], client_mode=False, host=host, timeout_s=wait_s)
    cfg = await read_swarm(node, wait_s)
    if not Path(cfg.workdir).is_dir():
        cfg = cfg.elsewhere(workdir or tempfile.mkdtemp(prefix=prefix))
        write_json(Path(cfg.workdir) / CLOCK_FILE, cfg.clock)
    return node, cfg


async def join_dht(initial_peers: list[str] | None, *, client_mode: bool, host: str = "127.0.0.1",
                   timeout_s: float = 15.0) -> DHTNode:
    """A DHT node in this process (its P2P daemon is a child process), joined through ``initial_peers``.

    Any failure to reach the bootstrap peers - unreachable, refusing, garbage - raises ``BootstrapError``
    within ``timeout_s``. It listens on ``host`` (a free port) unless ``LISTEN_ENV`` names multiaddrs, and
    announces the multiaddrs in ``ANNOUNCE_ENV`` instead of those it listens on where that is set.
    """
    listen = os.environ.get(LISTEN_ENV, "").split() or [f"/ip4/{host}/tcp/0"]
    announce = os.environ.get(ANNOUNCE_ENV, "").split() or None
    try:
        return await asyncio.wait_for(
            DHTNode.create(initial_peers=initial_peers or None, client_mode=client_mode,
                           host_maddrs=listen, announce_maddrs=announce, startup_timeout=timeout_s,
                           bootstrap_timeout=min(timeout_s, 3.0) if initial_peers and len(initial_peers) > 1
                           else timeout_s, ensure_bootstrap_success=True),
            timeout=timeout_s,
        )
    except (asyncio.TimeoutError, TimeoutError) as e:
        raise BootstrapError(f"could not join the swarm DHT through {initial_peers} within {timeout_s:.0f} s") from e
    except Exception as e:  # P2PDaemonError, multiaddr parse errors, bootstrap failures
        raise BootstrapError(f"could not join the swarm DHT through {initial_peers}: {e}") from e


def launcher_key(run_id: str) -> str:
    """DHT key of the launcher's heartbeat (value: ``starting``, ``training``, ``stopping`` or ``done``)."""
    return f"{run_id}_launcher"


async def launcher_phase(node: DHTNode, run_id: str) -> str | None:
    found = await node.get(launcher_key(run_id), latest=True)
    return found.value if found is not None and isinstance(found.value, str) else None


async def watch_launcher(node: DHTNode, run_id: str, grace_s: float = LAUNCHER_GRACE_S) -> None:
    """Return once the launcher says ``done``; raise ``LauncherGone`` once it says ``stopping`` or its record is
    missing ``grace_s``."""
    last_seen = time.monotonic()
    while True:
        try:
            phase = await launcher_phase(node, run_id)
        except Exception:  # a DHT hiccup counts as not seen
            phase = None
        if phase == "done":
            return
        if phase == "stopping":
            raise LauncherGone(f"the launcher of swarm {run_id} stops it")
        if phase is not None:
            last_seen = time.monotonic()
        elif time.monotonic() - last_seen > grace_s:
            raise LauncherGone(f"the launcher of swarm {run_id} has not been seen for {grace_s:.0f} s")
        await asyncio.sleep(DECLARE_PERIOD_S)


async def read_swarm(node: DHTNode, timeout_s: float) -> ProcessConfig:
    """The config of the swarm this node joined, with its training clock (``SWARM_KEY``: the launcher re-stores it
    with its heartbeat while the swarm trains); ``BootstrapError`` if none is found within ``timeout_s`` (a DHT of
    no training swarm) or it is not this version's (``ProcessConfig.from_dict`` says which keys differ)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = None
        with contextlib.suppress(Exception):
            found = await node.get(SWARM_KEY, latest=True)
        if found is not None and isinstance(found.value, dict) and isinstance(found.value.get("run_id"), str):
            try:
                return ProcessConfig.from_dict(found.value)
            except (TypeError, ValueError) as e:
                raise BootstrapError(f"swarm {found.value['run_id']}: {e}") from None
        if time.monotonic() > deadline:
            raise BootstrapError(f"no training swarm found in this DHT within {timeout_s:.0f} s")
        await asyncio.sleep(1.0)


def stage_key(run_id: str, stage: int) -> str:
    """DHT key under which the peers of one stage declare themselves (sub-key = peer uid)."""
    return f"{run_id}_stage{stage}"


def stage_namespace(run_id: str, stage: int) -> str:
    """P2P handler namespace of one stage (also the all-reduce prefix: stages never talk to each other)."""
    return f"{run_id}.stage{stage}"


async def stage_records(node: DHTNode, run_id: str, stage: int) -> dict[str, tuple[str, float]]:
    """uid -> (peer id, record expiration) of the stage's declared peers."""
    found = await node.get(stage_key(run_id, stage), latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    return {uid: (entry.value, entry.expiration_time) for uid, entry in found.value.items()
            if isinstance(uid, str) and isinstance(entry.value, str)}


def progress_key(run_id: str, stage: int) -> str:
    """DHT key of a stage's progress records (sub-key: peer uid)."""
    return f"{run_id}_progress{stage}"


def work_key(run_id: str) -> str:
    """DHT key of the trainers' claim records (sub-key: trainer name; ``work``)."""
    return f"{run_id}_work"


def flush_key(run_id: str) -> str:
    """DHT key the launcher sets once every trainer is done: step the last, partial global batch."""
    return f"{run_id}_flush"


def leave_now(code: int) -> None:
    """Exit this process at once with its p2pd daemon: an orderly DHT shutdown, or an all-reduce or compute call in
    flight, can hold up a normal exit for many seconds on dead connections."""
    for daemon in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            daemon.kill()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
