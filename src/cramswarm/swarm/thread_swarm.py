"""A SWARM in one process - stage peers and trainers are real threads: the machinery the throughput emulation
(``swarm_sim.emulation.run``) and the training emulation (``emulation_training.train``) run on.

Every peer (``Peer``) is a thread serving a request queue for the stage it currently holds, with the swarm's
``serve`` (``Swarm``: the transport's hook); every trainer is a thread that sends its calls through a ``Router``,
picking a peer per stage and per call with its own ``StageBalancer`` (or ``UniformBalancer``, or a fixed GPipe-style
chain), with per-call timeouts and retries on another replica (``RetryPolicy``, ``StageCall``). Peers declare
themselves in a shared ``Directory`` (a stand-in for the DHT: records with an expiration time, re-declared every
``forward_timeout_s``, valid for ``RECORD_TTL_TIMEOUTS x forward_timeout_s``).

Failure model: a killed peer stops answering - requests already queued or being computed are dropped, so the
trainers waiting on them hit their timeout and resend elsewhere; a new call to a dead peer fails at once
("connection refused") and bans it until its record expires; a rejoining peer re-declares with a later
expiration and is admitted again. Rebalancing (``Rebalancer``) runs in its own thread (``Swarm.rebalance_loop``);
a moving peer hands its unaveraged work to a replica, withdraws, loads the new stage's state and re-declares.

Time is a *scaled wall clock* (``ScaledClock``): emulated seconds = wall seconds / ``time_scale``. The threads
really run concurrently, so results carry thread-scheduling jitter.
"""

from __future__ import annotations

import abc
import math
import queue
import random
import threading
import time
from typing import Any, Callable

from cramswarm.swarm.fault_rules import kill_candidates
from cramswarm.swarm.rebalancing import LoadMeter, Rebalancer
from cramswarm.swarm.routing import RetryPolicy, StageBalancer, StageCall, UniformBalancer
from cramswarm.swarm.setups import RECORD_TTL_TIMEOUTS, FailureEvent, PeerSpec


class ScaledClock:
    """Emulated time on the wall clock: emulated seconds = wall seconds since creation / ``time_scale``."""

    def __init__(self, time_scale: float = 1.0):
        if time_scale <= 0:
            raise ValueError(f"time_scale must be positive, got {time_scale}")
        self.time_scale = time_scale
        self._start = time.perf_counter()

    def now(self) -> float:
        return (time.perf_counter() - self._start) / self.time_scale

    def wall(self, seconds: float) -> float:
        return max(seconds, 0.0) * self.time_scale

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds * self.time_scale)


class Directory:
    """The DHT stand-in: stage -> {uid: record expiration}; expired records are not returned."""

    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._lock = threading.RLock()
        self._records: dict[int, dict[str, float]] = {}

    def declare(self, uid: str, stage: int, now: float) -> None:
        with self._lock:   # withdrawn and declared at once: no reader finds it at no stage
            self.withdraw(uid)
            self._records.setdefault(stage, {})[uid] = now + self.ttl_s

    def withdraw(self, uid: str) -> None:
        with self._lock:
            for records in self._records.values():
                records.pop(uid, None)

    def records(self, stage: int, now: float) -> dict[str, float]:
        with self._lock:
            return {uid: exp for uid, exp in self._records.get(stage, {}).items() if exp >= now}


class Dropped(Exception):
    """The peer died (or moved) while computing: the reply is never sent."""


class Request:
    """One RPC: the caller waits on ``done``; a dropped request is never answered."""

    def __init__(self, kind: str, stage: int, mb: int, data: Any):
        self.kind, self.stage, self.mb, self.data = kind, stage, mb, data
        self.done = threading.Event()
        self.result: Any = None
        self.error: str | None = None
        self.meter: LoadMeter | None = None  # the serving peer's meter it counts in (``Peer.submit``)

    def reply(self, result: Any) -> None:
        self.result = result
        self.done.set()

    def fail(self, error: str) -> None:
        self.error = error
        self.done.set()


class Peer(threading.Thread):
    """A stage server thread: serves its queue with the swarm's ``serve`` while up.

    ``status``: ``up`` (serving, reachable), ``down`` (killed: unreachable, answers nothing), ``joining``
    (restarted, loading its stage's state before it declares itself), ``moving`` (rebalancing to another stage).
    """

    def __init__(self, index: int, stage: int, speed: float, swarm: "Swarm"):
        super().__init__(name=f"peer{index}", daemon=True)
        self.index, self.uid, self.stage, self.speed = index, f"peer{index:03d}", stage, speed
        self.swarm = swarm
        self.queue: queue.Queue[Request] = queue.Queue()
        self.status = "up"
        self.incarnation = 0
        self.pending_move: int | None = None
        self.meter = LoadMeter(swarm.clock.now())  # its own queue and service rate: the rebalancer's input
        self.served: dict[str, int] = {"forward": 0, "backward": 0, "last": 0}
        self.state: Any = None  # transport-specific stage state (train: module, optimizer, gradient buffers)
        self._wake = threading.Event()
        self._next_declare = -math.inf

    @property
    def alive(self) -> bool:
        return self.status == "up"

    def submit(self, request: Request) -> None:
        """Queue ``request`` (a trainer's call); it counts in the meter it entered until the peer is done with it."""
        request.meter = self.meter
        self.meter.enter(self.swarm.clock.now())
        self.queue.put(request)

    def _done(self, request: Request) -> None:
        request.meter.exit(self.swarm.clock.now())

    def _drain(self, error: str | None) -> None:
        while True:
            try:
                request = self.queue.get_nowait()
            except queue.Empty:
                return
            self._done(request)
            if error is not None:
                request.fail(error)

    def kill(self) -> None:
        """Stop answering; queued requests are dropped (their callers time out)."""
        self.status = "down"
        self.incarnation += 1
        self._drain(None)

    def revive(self) -> None:
        """Restart: the peer thread loads its stage's state from a live replica, then declares itself."""
        self._drain(None)  # a restarted process starts with an empty queue
        self.status = "joining"
        self._wake.set()

    def run(self) -> None:
        try:
            self._serve_forever()
        except BaseException as exc:  # surfaced by the thread that owns the emulation
            self.swarm.record_error(exc)

    def _serve_forever(self) -> None:
        swarm, clock = self.swarm, self.swarm.clock
        while not swarm.stop.is_set():
            if self.status == "down":
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            if self.status == "joining":
                swarm.join_state(self)
                self._arrive()
                continue
            if self.pending_move is not None:
                self._move(self.pending_move)
                continue
            now = clock.now()
            if now >= self._next_declare:
                swarm.directory.declare(self.uid, self.stage, now)
                self._next_declare = now + swarm.declare_period_s
            try:
                request = self.queue.get(timeout=min(0.05, clock.wall(self._next_declare - now)))
            except queue.Empty:
                continue
            if request.stage != self.stage:
                self._done(request)
                request.fail(f"{self.uid} serves stage {self.stage}, not {request.stage}")
                continue
            incarnation, start = self.incarnation, clock.now()
            try:
                result = swarm.serve(self, request, incarnation)
            except Dropped:
                continue
            except Exception as exc:  # a server-side bug: reported to the caller and to the run's owner
                swarm.record_error(exc)
                request.fail(f"{self.uid}: {exc!r}")
                continue
            finally:
                self._done(request)
            if not self.alive or self.incarnation != incarnation:
                continue
            request.meter.served(swarm.work_units(request), clock.now() - start)
            self.served[request.kind] += 1
            request.reply(result)

    def _arrive(self) -> None:
        """Serve again once the stage's state is downloaded (a restart, a move): a fresh meter, declared at once."""
        self.swarm.clock.sleep(self.swarm.state_download_s)
        self.meter, self.status, self._next_declare = LoadMeter(self.swarm.clock.now()), "up", -math.inf

    def _move(self, to_stage: int) -> None:
        swarm = self.swarm
        self.status = "moving"
        swarm.directory.withdraw(self.uid)
        self._drain(f"{self.uid} left stage {self.stage}")
        swarm.move_state(self, self.stage, to_stage)
        self.stage, self.pending_move = to_stage, None   # unseen while it is moving (not alive)
        self._arrive()
        if swarm.rebalancer is not None:  # no lock: the rebalancer decides nothing while this move is in transit
            swarm.rebalancer.arrived(swarm.clock.now())


class Swarm(abc.ABC):
    """State shared by the threads of one emulation: clock, directory, peers, counters, stop flag."""

    def __init__(self, specs: list[PeerSpec], clock: ScaledClock, forward_timeout_s: float, state_download_s: float):
        self.clock = clock
        self.declare_period_s = forward_timeout_s
        self.directory = Directory(RECORD_TTL_TIMEOUTS * forward_timeout_s)
        self.state_download_s = state_download_s
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.membership = threading.Lock()  # kill and move decisions: never two at once on one stage
        self.counters = {"retries": 0, "timeouts": 0, "errors": 0, "peers_killed": 0, "rejoins": 0}
        self.moves: list[dict] = []
        self.rebalancer: Rebalancer | None = None   # set by rebalance_loop; a mover reports its arrival to it
        self.errors: list[BaseException] = []
        self.peers = [Peer(i, spec.stage, spec.speed, self) for i, spec in enumerate(specs)]
        for peer in self.peers:
            self.directory.declare(peer.uid, peer.stage, clock.now())
        self.by_uid = {peer.uid: peer for peer in self.peers}

    # transport hooks: the emulated swarm only sleeps, the training swarm computes and holds state
    @abc.abstractmethod
    def serve(self, peer: Peer, request: Request, incarnation: int) -> Any:
        """Compute ``request`` on ``peer``; raise ``Dropped`` if the peer died meanwhile."""

    @abc.abstractmethod
    def work_units(self, request: Request) -> float:
        """The request's size for the peer's own throughput estimate (the rebalancer's input)."""

    def kill(self, peer: Peer) -> None:
        peer.kill()

    def join_state(self, peer: Peer) -> None:  # noqa: B027 (a no-op by default, not abstract)
        """A restarted peer downloads its stage's state (no state to copy when compute is emulated)."""

    def move_state(self, peer: Peer, from_stage: int, to_stage: int) -> None:  # noqa: B027 (a no-op by default)
        """A moving peer hands its unaveraged work to its old stage and loads the new stage's state."""

    def record_error(self, exc: BaseException) -> None:
        with self.lock:
            self.errors.append(exc)

    def count(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counters[key] += n

    def live(self, stage: int) -> list[Peer]:
        return [p for p in self.peers if p.alive and p.stage == stage and p.pending_move is None]

    def stage_peers(self) -> dict[int, list[str]]:
        stages: dict[int, list[str]] = {}
        for peer in self.peers:
            if peer.alive:
                stages.setdefault(peer.stage, []).append(peer.uid)
        return {s: sorted(uids) for s, uids in sorted(stages.items())}

    def start(self) -> None:
        for peer in self.peers:
            peer.start()

    def shutdown(self) -> None:
        self.stop.set()
        for peer in self.peers:
            peer._wake.set()
            peer.join(timeout=5.0)

    def rebalance_loop(self, rebalancer: Rebalancer, stages: int) -> None:
        self.rebalancer = rebalancer
        while not self.stop.wait(self.clock.wall(rebalancer.period_s)):
            with self.membership:
                now = self.clock.now()
                loads = {s: [p.meter.load(p.uid, now) for p in self.live(s)] for s in range(stages)}
                move = rebalancer.decide(loads, now)
                if move is not None:
                    with self.lock:
                        self.moves.append({"t_s": round(now, 3), **move.value()})
                    self.by_uid[move.uid].pending_move = move.to_stage

    def fault_loop(self, schedule: list[FailureEvent], kill_every_s: float | None = None,
                   rejoin_after_s: float | None = None, seed: int = 0, start: float = 0.0) -> None:
        """The thread transport's fault driver (run as a thread): kills the ``schedule``'s peers at their times and,
        every ``kill_every_s``, a random live peer whose stage keeps another (``fault_rules.kill_candidates``, the
        launcher's rule), in emulated seconds since ``start``. A killed peer rejoins after its event's
        ``rejoin_after_s`` (a random kill: ``rejoin_after_s``; None: never), loading its stage's state."""
        rng = random.Random(seed)
        kills: list[tuple[float, int | None, float | None]] = [(e.at_s, e.peer, e.rejoin_after_s) for e in schedule]
        rejoins: list[tuple[float, Peer]] = []
        next_random = kill_every_s if kill_every_s else math.inf
        while not self.stop.is_set():
            now = self.clock.now() - start
            for at, peer in [r for r in rejoins if r[0] <= now]:
                rejoins.remove((at, peer))
                if peer.status == "down":
                    peer.revive()
                    self.count("rejoins")
            if now >= next_random:
                kills.append((now, None, rejoin_after_s))
                next_random = now + kill_every_s
            for event in sorted(k for k in kills if k[0] <= now):
                kills.remove(event)
                with self.membership:
                    if event[1] is None:
                        steps = {s: {p.uid: 0 for p in self.live(s)} for s in {p.stage for p in self.peers}}
                        candidates = kill_candidates(steps, self.by_uid)   # steps: the live peers only, all at 0
                        victim = self.by_uid[rng.choice(candidates)] if candidates else None
                    else:
                        victim = self.peers[event[1]] if self.peers[event[1]].alive else None
                    if victim is not None:
                        self.kill(victim)
                if victim is not None:
                    self.count("peers_killed")
                    if event[2] is not None:
                        rejoins.append((now + event[2], victim))
            upcoming = min([k[0] for k in kills] + [r[0] for r in rejoins] + [next_random])
            if upcoming == math.inf:
                return
            self.stop.wait(min(0.05, self.clock.wall(upcoming - (self.clock.now() - start))))


class StopRun(Exception):
    """The emulation's duration is over: the trainer abandons its microbatch."""


class Router:
    """A trainer's view of the swarm: one balancer per stage (or a fixed chain), timeouts and retries."""

    def __init__(
        self,
        swarm: Swarm,
        stages: int,
        routing: str,
        retry: RetryPolicy,
        rng: random.Random,
        chain: list[Peer] | None = None,
        network_s: Callable[[int], float] = lambda nbytes: 0.0,
        deadline_s: float = math.inf,
    ):
        self.swarm, self.retry = swarm, retry
        self.chain, self.network_s, self.deadline_s = chain, network_s, deadline_s
        cls = UniformBalancer if routing == "uniform" else StageBalancer
        self.balancers = [cls(s, rng=random.Random(rng.random())) for s in range(stages)]
        self._refreshed = [-math.inf] * stages

    def _refresh(self, stage: int, now: float, force: bool = False) -> None:
        if force or now - self._refreshed[stage] >= self.swarm.declare_period_s:
            self.balancers[stage].update_peers(self.swarm.directory.records(stage, now), now)
            self._refreshed[stage] = now

    def _check_deadline(self) -> None:
        if self.swarm.stop.is_set() or self.swarm.clock.now() >= self.deadline_s:
            raise StopRun

    def _wait(self, request: Request, timeout_s: float) -> bool:
        clock = self.swarm.clock
        until = clock.now() + timeout_s
        while True:
            self._check_deadline()
            left = until - clock.now()
            if left <= 0:
                return request.done.is_set()
            if request.done.wait(min(clock.wall(left), 0.05)):
                return True

    def call(self, stage: int, kind: str, mb: int, data: Any, task_size: float, nbytes: tuple[int, int]) -> Any:
        """Send one request to a peer of ``stage`` and return its result, retrying until a peer answers: the retry
        rule is ``StageCall``'s, as in the launcher's trainers; a fixed chain waits for its member instead."""
        swarm, clock = self.swarm, self.swarm.clock
        backward = kind != "forward"  # "backward", or "last" (the last stage's forward + backward)
        timeout = self.retry.timeout(backward)
        call = None
        if self.chain is None:
            call = StageCall(self.balancers[stage], self.retry, task_size=task_size, backward=backward,
                             count=swarm.count, what=kind)
        while True:
            self._check_deadline()
            now = clock.now()
            if call is None:
                peer = self.chain[stage]
                if not peer.alive:  # a fixed pipeline waits for its member to come back
                    clock.sleep(min(timeout, 0.1 * swarm.declare_period_s))
                    continue
            else:
                self._refresh(stage, now)
                uid = call.choose(now)
                if uid is None:   # no live peer: look again shortly (NoPeersError once give_up_after_s passed)
                    clock.sleep(0.1 * swarm.declare_period_s)
                    self._refresh(stage, clock.now(), force=True)
                    continue
                peer = swarm.by_uid[uid]
                if not peer.alive or peer.pending_move is not None:  # connection refused
                    call.refused(uid, now, now)
                    continue
            start = now
            clock.sleep(self.network_s(nbytes[0]))
            request = Request(kind, stage, mb, data)
            peer.submit(request)
            if not self._wait(request, timeout):
                if call is None:
                    swarm.count("timeouts")
                    swarm.count("retries")
                else:
                    call.timed_out(peer.uid, start, clock.now())
                continue
            if request.error is not None:
                if call is None:
                    swarm.count("errors")
                    swarm.count("retries")
                else:
                    call.refused(peer.uid, start, clock.now())
                continue
            clock.sleep(self.network_s(nbytes[1]))
            if call is not None:
                # in work units, as the peer's own estimate and the hivemind transport count them
                call.succeeded(peer.uid, task_size * swarm.work_units(request), clock.now() - start)
            return request.result
