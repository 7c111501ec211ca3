"""Transport 1 (real hivemind), the processes: the bootstrap DHT node, a stage peer, and a task of an attached swarm.

Run as a module, one OS process per role (the launcher, ``launcher``, starts each one as its own process-group
leader, so killing the group also kills the peer's ``p2pd`` daemon)::

    python -m cramswarm.swarm.peer_process bootstrap --addr-file F --run-id ID [--host 127.0.0.1]
    python -m cramswarm.swarm.peer_process stage --config C --stage S --uid U --addr-file F [--speed X] [--load-state]

``bootstrap`` starts a DHT node, writes its visible multiaddrs to the address file (``membership``) and leaves once
the launcher of ``--run-id`` says ``done`` or its heartbeat has been missing ``--grace-s``. ``stage`` serves one
pipeline stage as a ``peer_sync.SyncingStagePeer`` and declares itself under the stage's DHT key; it steps with its
stage's other peers by itself (``peer_sync``) and may move itself to another stage (``peer_rebalance`` decides,
``move_peer`` moves it), in the same process. A task (``run_task``: ``python -m cramswarm swarm-peer --rendezvous
DIR [--rank R]``) is one peer of a swarm whose launcher did not start it (placements ``attach`` and ``srun``): it
reads the launcher's rendezvous folder (``config.json``, then the address file ``dht_addrs.txt``), takes the stage
and speed of its rank (``--rank``, else ``SLURM_PROCID``: the tasks of one ``srun`` job step; ``claim_rank`` locks
it, so a rank runs once) and runs ``stage`` as a child process group, which it restarts with a state download when
it dies (``rejoin_after_s`` later; on the stage it last served: a peer that moved and then died comes back on its
new stage).

The launcher keeps a heartbeat record in the DHT (``membership.launcher_key``: ``starting``, ``training`` or
``done``, re-stored every 2 s with a 10 s expiration). A stage peer exits (code 0) once it reads ``done``, and
(code ``LAUNCHER_GONE``) once the record has been missing for ``launcher_grace_s``, after the lowest uid at its
stage's latest step wrote the stage's shard; a launcher started again within that time re-attaches and beats under
the same run id (``launcher``), so the swarm trains on. A peer that joins while the record says ``training``
downloads its stage's state before it serves. The launcher's processes do not watch it (``CRAMSWARM_PARENT_PID``
empty); a task's peer does watch its task (the parent's pid): it SIGKILLs its own process group once the task is
gone, so a task killed without clean-up leaves no peer or p2pd behind.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
from hivemind.utils import get_dht_time

from cramswarm.io import write_text
from cramswarm.swarm.hivemind_peer import bound_kernel_cache
from cramswarm.swarm.membership import (
    ADDR_FILE,
    CONFIG_FILE,
    DONE_FILE,
    LAUNCHER_GONE,
    LAUNCHER_GRACE_S,
    BootstrapError,
    LauncherGone,
    RankTaken,
    join_dht,
    join_swarm,
    join_through,
    launcher_phase,
    leave_now,
    listen_host,
    progress_key,
    read_addr_file,
    stage_records,
    watch_launcher,
)
from cramswarm.swarm.peer_rebalance import MOVES_FILE, moved_uid, read_loads, stage_after_moves
from cramswarm.swarm.peer_sync import SyncingStagePeer
from cramswarm.swarm.progress import record_window_s, writes_shard
from cramswarm.swarm.rebalancing import MoveEvent, choose_join_stage
from cramswarm.swarm.settings import ProcessConfig


async def move_peer(peer, to_stage: int, record: MoveEvent):
    """The peer that left its stage (``PeerRebalancer.leave``; its tasks are cancelled) becomes a new peer of
    ``to_stage`` in the same process: its progress record is withdrawn, its handlers removed, the new stage built
    under ``moved_uid``, and ``record`` (the decided move, its drain over) goes with it (``arrived_from``: its
    ``PeerRebalancer`` records the arrival). The caller (``serve_stage``) downloads the new stage's state and serves
    it."""
    await peer.node.store(progress_key(peer.run_id, peer.stage), subkey=peer.uid, value={"left": True},
                          expiration_time=max(get_dht_time() + record_window_s(peer.round_s),
                                              peer.record_expiration) + 1.0)
    await peer.remove_p2p_handlers(peer.node.p2p, namespace=peer.namespace)
    peer.compute.shutdown(wait=False)
    moves = getattr(peer, "moves", 0) + 1
    fresh = type(peer)(peer.cfg, to_stage, moved_uid(peer.uid, to_stage, moves), peer.speed, peer.node)
    fresh.moves = moves
    fresh.arrived_from = record
    fresh.counters["moved_from"] = peer.uid
    peer._write_counters()
    return fresh



# --------------------------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------------------------
async def exit_with_parent() -> None:
    """Kill this process's whole group (itself and its p2pd) once the process that started it is gone (a stage peer
    of ``run_task``: ``CRAMSWARM_PARENT_PID`` is its task's pid). Without it (unset or empty: every process the
    launcher starts) it waits forever; such a process leaves on the launcher's DHT heartbeat instead."""
    parent = int(os.environ.get("CRAMSWARM_PARENT_PID") or "0")
    if not parent:
        await asyncio.Event().wait()
    while True:
        await asyncio.sleep(1.0)
        if os.getppid() != parent:
            os.killpg(os.getpgid(0), signal.SIGKILL)


async def serve_bootstrap(addr_file: str, host: str, run_id: str, grace_s: float = LAUNCHER_GRACE_S) -> None:
    """The DHT's first node; it writes the address file (atomically: ``io.write_text``, so a reader never sees a
    half-written list) and leaves once the launcher of ``run_id`` says ``done`` or its heartbeat has been missing
    ``grace_s``."""
    node = await join_dht(None, client_mode=False, host=host)
    maddrs = sorted((str(m) for m in await node.p2p.get_visible_maddrs()), key=lambda m: m.startswith("/ip4/127."))
    write_text(addr_file, "".join(f"{m}\n" for m in maddrs))
    print(f"bootstrap DHT at {maddrs}", flush=True)
    with contextlib.suppress(LauncherGone):
        await watch_launcher(node, run_id, grace_s)
    leave_now(0)


async def serve_stage(args: argparse.Namespace) -> None:
    """Serve one stage until the launcher is done (exit code 0) or gone (``LAUNCHER_GONE``); a peer that moves
    itself to another stage (``peer_rebalance``) serves that one in the same process."""
    try:
        cfg = ProcessConfig.read(args.config)
    except (OSError, TypeError, ValueError) as e:  # unreadable, or another version's
        raise BootstrapError(f"cannot read the swarm's config {args.config}: {e}") from None
    bound_kernel_cache()
    torch.set_num_threads(1)
    node = await join_swarm(args.addr_file, host=listen_host(cfg.host, cfg.interface), timeout_s=cfg.join_timeout_s,
                            announce=True)
    peer = SyncingStagePeer(cfg, args.stage, args.uid, args.speed, node)
    await serve(peer, cfg, args.load_state)


async def serve_joined(initial_peer: str, speed: float, host: str, workdir: str | None, wait_s: float) -> None:
    """Join a running swarm with nothing but ``initial_peer`` (a multiaddr of any live process of it), read its
    config from the DHT (``membership.read_swarm``), take the stage it needs most (``rebalancing.choose_join_stage``
    on the stages' load records, else on their declared peers), download that stage's state from a live replica
    (or, with none and the run's shards on this host, its newest shard) and serve it until the launcher is done.
    Its logs and counters go to the run's folder where this host has it, else to ``workdir`` (or a temporary
    folder, with the swarm's training clock: ``membership.join_through``); it takes no part in writing shards unless
    it is its stage's lowest uid."""
    bound_kernel_cache()
    torch.set_num_threads(1)
    node, cfg = await join_through(initial_peer, host=host, wait_s=wait_s, workdir=workdir,
                                   prefix="cramswarm-joined-")
    declared = await asyncio.gather(*(stage_records(node, cfg.run_id, s) for s in range(cfg.stages)))
    loads = None
    if cfg.rebalance_period_s:   # the peers publish their loads each period: the latest complete one
        period = math.floor(get_dht_time() / cfg.rebalance_period_s)
        loads = (await read_loads(node, cfg.run_id, cfg.stages, period))[0]
    stage = choose_join_stage({s: len(d) for s, d in enumerate(declared)}, loads)
    uid = f"s{stage}q{os.getpid()}"   # after the launcher's s<stage>p<n> in uid order
    print(f"[{uid}] joined swarm {cfg.run_id} through {initial_peer}: stage {stage} (declared peers "
          f"{[len(d) for d in declared]}, loads {'read' if loads else 'unknown'})", flush=True)
    await serve(SyncingStagePeer(cfg, stage, uid, speed, node), cfg, load_state=True)


async def serve(peer: SyncingStagePeer, cfg: ProcessConfig, load_state: bool) -> None:
    """Serve ``peer``'s stage (after a state download with ``load_state``, or when the launcher says training)
    until the launcher is done (exit 0) or gone or stopping (``LAUNCHER_GONE``, after the stage's shard)."""
    node, speed = peer.node, peer.speed
    watchdog = asyncio.create_task(exit_with_parent())
    while True:
        peer.migrate_to = asyncio.get_running_loop().create_future()
        await peer.add_p2p_handlers(node.p2p, namespace=peer.namespace)
        with contextlib.suppress(Exception):  # joining a running swarm: take the stage's state first
            load_state = load_state or await launcher_phase(node, peer.run_id) == "training"
        if load_state:
            await peer.load_from_replica(cfg.retry.give_up_after_s)
        print(f"[{peer.uid}] serving stage {peer.stage} (speed {speed}) as {node.p2p.peer_id}", flush=True)
        declare = asyncio.create_task(peer.declare_forever())
        background = peer.background_tasks()
        launcher = asyncio.create_task(watch_launcher(node, peer.run_id, cfg.launcher_grace_s))
        done, _ = await asyncio.wait([declare, watchdog, launcher, peer.migrate_to, *background],
                                     return_when=asyncio.FIRST_COMPLETED)
        if peer.migrate_to in done:  # it moves itself (peer_rebalance): (to stage, its move record)
            for task in (declare, launcher, *background):
                task.cancel()
            await asyncio.gather(declare, launcher, *background, return_exceptions=True)
            peer = await move_peer(peer, *peer.migrate_to.result())
            load_state = True
            continue
        break
    if launcher in done and launcher.exception() is not None:
        print(f"[{peer.uid}] {launcher.exception()}; writing the stage's shard if it is this peer's, then exiting",
              flush=True)
        await leave_with_shard(peer, timeout_s=30.0)
        code = LAUNCHER_GONE
    else:
        for task in done:
            task.result()  # a failed declaration or watchdog raises here
        print(f"[{peer.uid}] the launcher is done; exiting", flush=True)
        code = 0
    leave_now(code)


def run_join(initial_peer: str, speed: float = 1.0, host: str = "127.0.0.1", workdir: str | None = None,
             wait_s: float = 60.0) -> int:
    """``serve_joined`` as a process: exits 0 when the run is done, ``LAUNCHER_GONE`` when its launcher is gone or
    stops it, 2 (saying why) when ``initial_peer`` is dead, no multiaddr, or no training swarm's."""
    if not (speed > 0 and math.isfinite(speed)):
        print(f"error: --speed must be positive, got {speed}", file=sys.stderr, flush=True)
        return 2
    try:
        asyncio.run(serve_joined(initial_peer, speed, host, workdir, wait_s))
    except BootstrapError as e:
        print(f"error: cannot join through {initial_peer}: {e}", file=sys.stderr, flush=True)
        leave_now(2)
    return 0


async def leave_with_shard(peer: SyncingStagePeer, timeout_s: float) -> None:
    """Before ``peer`` exits because its launcher is gone or stops the swarm: the lowest uid at the stage's latest
    step writes the stage's shard (``progress.writes_shard``), so a later launcher resumes from the swarm's last
    state. Each DHT read and the write are bounded by ``timeout_s``."""
    with contextlib.suppress(Exception):
        records = await asyncio.wait_for(peer._read_records(), timeout_s)
        if not peer.writing and writes_shard(peer.uid, peer.step, peer.shard_step, records, True, True):
            peer.writing = True
            await asyncio.wait_for(peer._write_shard(), timeout_s)


def rank_of(explicit: int | None) -> int:
    """This task's rank: ``--rank``, else SLURM's ``SLURM_PROCID`` (the task's index in its ``srun`` step)."""
    if explicit is not None:
        return explicit
    if "SLURM_PROCID" not in os.environ:
        raise SystemExit("error: no --rank given and SLURM_PROCID is unset (not a task of an srun job step)")
    return int(os.environ["SLURM_PROCID"])


def finished(rendezvous: Path, run_id: str) -> bool:
    """Whether the launcher of ``run_id`` has finished (it writes its run id to the rendezvous' done file)."""
    with contextlib.suppress(OSError):
        return (rendezvous / DONE_FILE).read_text().strip() == run_id
    return False


def claim_rank(rendezvous: Path, rank: int) -> int:
    """Lock ``rank<R>.lock`` in the rendezvous folder for this task's life (returns the open descriptor; the lock
    goes with the process, however it ends). A second task of the same rank - a leftover task of an earlier run,
    a job launched twice - would join as the same uid and corrupt its stage's averaging, so it gets ``RankTaken``
    naming the holder. On a filesystem without ``flock`` (Lustre without ``-o flock``) the check is skipped with a
    warning."""
    path = rendezvous / f"rank{rank}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 200).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RankTaken(f"rank {rank} is already taken by a running task ({holder}; lock {path})") from None
    except OSError as e:
        print(f"warning: cannot lock {path} ({e}); duplicate ranks go undetected", file=sys.stderr, flush=True)
        return fd
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"host {socket.gethostname()} pid {os.getpid()}\n".encode(), 0)
    return fd


def read_rendezvous(rendezvous: Path, timeout_s: float) -> ProcessConfig:
    """The launcher's config.json, once its address file is there too (the config is written first); one of
    another version counts as unreadable."""
    deadline = time.monotonic() + timeout_s
    while True:
        read_addr_file(rendezvous / ADDR_FILE, max(deadline - time.monotonic(), 0.0))
        try:
            return ProcessConfig.read(rendezvous / CONFIG_FILE)
        except (OSError, TypeError, ValueError):  # cleared or rewritten by a launcher starting right now
            if time.monotonic() > deadline:
                raise BootstrapError(f"no readable {CONFIG_FILE} in the rendezvous folder {rendezvous}") from None
            time.sleep(0.5)


def run_task(rendezvous: str | Path, rank: int | None, max_restarts: int = 100, wait_s: float = 600.0) -> int:
    """One peer of an ``attach``/``srun`` swarm (rank -> stage, speed via the rendezvous folder's config), run as
    a child process group and restarted when it dies or moves; returns the exit code of the task.

    ``wait_s``: how long to wait for the launcher's rendezvous files, and for a swarm to join when the files
    found belong to an earlier run."""
    rendezvous, rank = Path(rendezvous), rank_of(rank)
    child: subprocess.Popen | None = None

    def stop(signum, frame):  # srun / scancel: end the peer's whole group with this task
        if child is not None and child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    deadline = time.monotonic() + wait_s
    try:
        cfg = read_rendezvous(rendezvous, wait_s)
    except BootstrapError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    specs = cfg.placement_specs  # [stage, speed] per rank
    if not 0 <= rank < len(specs):
        print(f"error: rank {rank} is outside the swarm's {len(specs)} peers (swarm.stages x swarm.peers_per_stage)",
              file=sys.stderr, flush=True)
        return 2
    try:
        claim_rank(rendezvous, rank)  # held until this task exits
    except RankTaken as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    stage, speed = specs[rank]
    incarnation, served, restarts = 0, False, 0
    while True:
        uid = f"s{stage}r{rank}.{incarnation}"
        args = [sys.executable, "-m", "cramswarm.swarm.peer_process", "stage", "--config",
                str(rendezvous / CONFIG_FILE), "--stage", str(stage), "--uid", uid, "--addr-file",
                str(rendezvous / ADDR_FILE), "--speed", repr(speed)] + (["--load-state"] if served else [])
        env = {**os.environ, "CRAMSWARM_PARENT_PID": str(os.getpid())}
        child = subprocess.Popen(args, env=env, start_new_session=True, stdin=subprocess.DEVNULL)
        code = child.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)  # its p2pd
        if code == 0 or finished(rendezvous, cfg.run_id):  # the run is over (this peer may have died last)
            return 0
        if code == LAUNCHER_GONE:
            return code
        if code == 2 and served:  # the swarm's bootstrap is gone: the run is over
            return LAUNCHER_GONE
        if code == 2:  # files of an earlier run, or a launcher still starting: read them again
            if time.monotonic() > deadline:
                return 2
            time.sleep(1.0)
            cfg = read_rendezvous(rendezvous, max(deadline - time.monotonic(), 0.0))
            stage, speed = cfg.placement_specs[rank]
            continue
        if restarts == max_restarts:
            print(f"[rank {rank}] gave up after {max_restarts} restarts", file=sys.stderr, flush=True)
            return 1
        served, restarts, incarnation = True, restarts + 1, incarnation + 1
        # a peer that moved itself to another stage (peer_rebalance) comes back on the stage it last served
        _, stage = stage_after_moves(Path(cfg.workdir) / MOVES_FILE, uid, stage)
        print(f"[rank {rank}] peer {uid} ended with code {code}; restarting on stage {stage} in "
              f"{cfg.rejoin_after_s or 0} s", flush=True)
        time.sleep(cfg.rejoin_after_s or 0.0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m cramswarm.swarm.peer_process", description=__doc__.split("\n")[0])
    roles = parser.add_subparsers(dest="role", required=True)
    boot = roles.add_parser("bootstrap", help="run the bootstrap DHT node and write its address file")
    boot.add_argument("--addr-file", required=True)
    boot.add_argument("--host", default="127.0.0.1", help="IPv4 address to listen on (0.0.0.0: all interfaces)")
    boot.add_argument("--interface", help="listen on this network interface's IPv4 address (looked up here)")
    boot.add_argument("--run-id", required=True,
                      help="leave once this run's launcher says done or its heartbeat is missing")
    boot.add_argument("--grace-s", type=float, default=LAUNCHER_GRACE_S, help="seconds the heartbeat may be missing")
    stage = roles.add_parser("stage", help="serve one pipeline stage")
    stage.add_argument("--config", required=True)
    stage.add_argument("--stage", type=int, required=True)
    stage.add_argument("--uid", required=True)
    stage.add_argument("--addr-file", required=True)
    stage.add_argument("--speed", type=float, default=1.0)
    stage.add_argument("--load-state", action="store_true")
    args = parser.parse_args(argv)
    if args.role == "stage" and not (args.speed > 0 and math.isfinite(args.speed)):
        parser.error(f"--speed must be positive, got {args.speed}")
    try:
        if args.role == "bootstrap":
            asyncio.run(serve_bootstrap(args.addr_file, listen_host(args.host, args.interface),
                                        args.run_id, args.grace_s))
        asyncio.run(serve_stage(args))
    except BootstrapError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
