"""SWARM's decision policies as pure objects: no I/O, no clocks, no threads of their own (time is passed in as
``now``).

Every transport (threads in ``emulation``, the discrete-event ``sim``, real hivemind processes) drives these
same objects, so routing, retries, rebalancing and in-stage synchronisation behave identically everywhere.

* ``StageBalancer`` - stochastic wiring for one pipeline stage: an interleaved weighted round-robin over the
  stage's peers keyed by *virtual finish time* (each peer's key grows by task size / measured throughput, the
  minimum key is served next), so over time every peer receives work in proportion to its measured rate.
  New peers enter at the current minimum key (tried almost at once); a peer that errors is banned until its
  directory record expires; a timeout is not banned (its key already grew). Throughput is a bias-corrected EMA
  of seconds per sample (``PerformanceEMA``, alpha 0.1); a backward task weighs 2.5x a forward one.
* ``UniformBalancer`` - the same bookkeeping, choosing uniformly at random (the routing baseline).
* ``RetryPolicy`` - per-call timeouts (backward = forward x 2.5) and the bound on waiting for any live peer.
* ``microbatch_path`` - one microbatch's stage calls in SWARM's order, as a generator a trainer drives
  (``drive_path`` blocking, ``drive_path_async`` on an event loop): the one path of the launcher's trainer processes
  and the emulation's training threads (each encodes and sends the calls its own way).
* ``kill_candidates`` - fault injection's rule: which live replicas may be killed.
* ``StageCall`` - one stage call's retries on top of a balancer and a ``RetryPolicy``: the one retry loop of the
  launcher's trainer processes and the emulation's trainer threads (each sends, waits and sleeps its own way).
* ``LoadMeter`` - what a stage peer measures of itself for rebalancing (period-averaged queue, service rate): the
  one signal of the launcher's peers, the emulation's peer threads and the simulator's peers.
* ``Rebalancer`` - adaptive rebalancing (swarm.md 1.5): moves one peer from the least to the most loaded stage
  when the imbalance exceeds a hysteresis factor and the projected bottleneck throughput strictly improves.
* ``StageSync`` - sample accounting toward one global batch per stage and the replicas' averaging weights.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import random
import threading
from collections.abc import Awaitable, Callable, Container, Generator, Mapping
from dataclasses import dataclass
from typing import Any


class NoPeersError(RuntimeError):
    """No live (unbanned, unexpired) peer serves a stage."""

    def __init__(self, stage: int):
        super().__init__(f"stage {stage}: no live peer serves this stage (all peers are gone, banned or expired)")
        self.stage = stage


# Relative compute per sample of a stage call, for the work units a peer serves (``LoadMeter``): forward 1,
# backward 2 (it recomputes the forward), the last stage's fused forward + backward 3.
WORK_UNITS = {"forward": 1.0, "backward": 2.0, "last": 3.0}

# LoadMeter reports a peer's rate to the rebalancer only after this many served calls: a fresh peer's first calls
# pay a cold start (allocations, caches, a GPU's kernel selection); on the hivemind transport one moved peer's first
# rate was a quarter of its peers' and the rebalancer moved it straight back.
SETTLED_UPDATES = 10


class PerformanceEMA:
    """Bias-corrected exponential moving average of seconds per sample.

    After ``n`` updates the raw average is divided by ``1 - (1 - alpha)^n`` (the same correction as Adam's
    moments), so the first measurement is taken at face value instead of being shrunk toward zero.
    """

    def __init__(self, alpha: float = 0.1):
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must lie in (0, 1], got {alpha}")
        self.alpha = alpha
        self._raw = 0.0
        self._updates = 0

    def update(self, seconds: float, samples: float) -> None:
        if samples <= 0:
            raise ValueError(f"samples must be positive, got {samples}")
        self._raw = self.alpha * (max(seconds, 0.0) / samples) + (1.0 - self.alpha) * self._raw
        self._updates += 1

    @property
    def seconds_per_sample(self) -> float | None:
        if self._updates == 0:
            return None
        return self._raw / (1.0 - (1.0 - self.alpha) ** self._updates)

    @property
    def samples_per_second(self) -> float | None:
        """None before the first update."""
        spp = self.seconds_per_sample
        if spp is None:
            return None
        return 1.0 / max(spp, 1e-12)


class StageBalancer:
    """Virtual-finish-time weighted round-robin over the peers of one stage (SWARM's IWRR).

    The heap holds one ``[virtual_time, tiebreak, uid]`` entry per known peer. ``choose`` pops the smallest
    usable entry, charges it ``size / throughput`` (``size`` is the task size, x ``backward_multiplier`` for
    backward tasks) and pushes it back. A peer not measured yet is charged at the mean throughput of the stage's
    measured peers: charged 1 s per sample beside peers that take milliseconds, a peer that had just moved in got one
    call and then waited out the rest of a run. While no peer of the stage is measured, a call is charged 1 s per
    sample (as SWARM's balancer charges an unmeasured peer); those charges are made again at the stage's first
    measurement: the measured peer's calls at its rate, the others' at that rate as the stage's mean
    (``_reprice``). Without that, the first peer a trainer chose at the start of a run was charged seconds while
    the next one was charged measured milliseconds, and the first waited out most of a short run (on the testbed, a
    stage-0 peer served no backward call in a 40 s run).
    """

    def __init__(self, stage: int, *, alpha: float = 0.1, backward_multiplier: float = 2.5,
                 rng: random.Random | None = None):
        self.stage = stage
        self.alpha = alpha
        self.backward_multiplier = backward_multiplier
        self.rng = rng if rng is not None else random.Random(stage)
        self._heap: list[list] = []           # [virtual_time, tiebreak, uid]
        self._records: dict[str, float] = {}  # uid -> record expiration time
        self._banned: dict[str, float] = {}   # uid -> the expiration of the record it was banned under
        self._ema: dict[str, PerformanceEMA] = {}
        self._provisional: dict[str, float] = {}  # uid -> samples charged at 1 s each while none was measured
        self._now = -math.inf
        self.stats: dict[str, int] = {"chosen": 0, "timeouts": 0, "errors": 0}
        self.chosen_per_peer: dict[str, int] = {}

    # -- membership ------------------------------------------------------------------------------------
    def update_peers(self, records: dict[str, float], now: float) -> None:
        """``records``: uid -> expiration time of its directory record (as a DHT returns them)."""
        self._now = max(self._now, now)
        known = {entry[2] for entry in self._heap}
        floor = min((entry[0] for entry in self._heap if entry[2] in records and entry[2] not in self._banned),
                    default=0.0)
        for uid, expiration in records.items():
            if uid in self._banned and expiration > self._banned[uid]:
                del self._banned[uid]  # re-declared since the ban: admitted again, not ahead of the others
                for entry in self._heap:
                    if entry[2] == uid:
                        entry[0] = max(entry[0], floor)
            if uid not in known:
                heapq.heappush(self._heap, [floor, self.rng.random(), uid])
        self._records = dict(records)
        self._heap = [entry for entry in self._heap if entry[2] in records]
        heapq.heapify(self._heap)
        self._banned = {uid: exp for uid, exp in self._banned.items() if uid in records}
        self._provisional = {uid: charged for uid, charged in self._provisional.items() if uid in records}

    def _usable(self, uid: str) -> bool:
        return uid in self._records and uid not in self._banned and self._records[uid] >= self._now

    @property
    def peers(self) -> list[str]:
        """Usable uids (known, not banned, record not expired at the latest ``now`` seen), sorted."""
        return sorted(uid for uid in self._records if self._usable(uid))

    def throughput(self, uid: str) -> float | None:
        ema = self._ema.get(uid)
        return ema.samples_per_second if ema is not None else None

    def _mean_rate(self) -> float | None:
        """The mean throughput of the stage's measured peers (None if none is measured)."""
        known = [r for r in (self.throughput(entry[2]) for entry in self._heap) if r is not None]
        return sum(known) / len(known) if known else None

    # -- routing ---------------------------------------------------------------------------------------
    def _charge(self, uid: str, task_size: float, backward: bool) -> float:
        """What a call of ``task_size`` to ``uid`` is charged (seconds of its virtual time)."""
        size = task_size * (self.backward_multiplier if backward else 1.0)
        rate = self.throughput(uid)
        if rate is None:
            rate = self._mean_rate()
            if rate is None:  # no peer of the stage measured: 1 s per sample, priced again at the first measurement
                self._provisional[uid] = self._provisional.get(uid, 0.0) + size
                return size
        return size / rate

    def _record_choice(self, uid: str) -> str:
        self.stats["chosen"] += 1
        self.chosen_per_peer[uid] = self.chosen_per_peer.get(uid, 0) + 1
        return uid

    def choose(self, task_size: float, now: float, *, backward: bool = False) -> str:
        """The peer with the earliest virtual finish time; its key grows by the task's expected duration."""
        self._now = max(self._now, now)
        skipped = []
        chosen = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            if self._usable(entry[2]):
                chosen = entry
                break
            skipped.append(entry)
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        if chosen is None:
            raise NoPeersError(self.stage)
        chosen[0] += self._charge(chosen[2], task_size, backward)
        heapq.heappush(self._heap, chosen)
        return self._record_choice(chosen[2])

    # -- feedback --------------------------------------------------------------------------------------
    def report_success(self, uid: str, samples: float, seconds: float) -> None:
        """Feed a call's duration into the peer's EMA: end to end (network + the peer's queue + compute), less any
        seconds the peer held the call back for its stage's step or batch (the reply's ``held_s``, which the
        launcher's trainers subtract: a wait of the stage, not of this replica). The stage's first measurement
        re-prices what was charged before it (``_reprice``)."""
        self._ema.setdefault(uid, PerformanceEMA(self.alpha)).update(seconds, samples)
        if self._provisional:
            self._reprice()

    def _reprice(self) -> None:
        """The charges made while no peer was measured, made again now that one is: a measured peer's at its own
        rate, an unmeasured one's at the stage's mean measured rate (as ``_charge`` charges it from now on). Each
        peer's heap key moves by the difference; the charges are final."""
        mean = self._mean_rate()
        if mean is None:
            return
        shifts = {uid: size / (self.throughput(uid) or mean) - size for uid, size in self._provisional.items()}
        self._provisional = {}
        for entry in self._heap:
            entry[0] += shifts.get(entry[2], 0.0)
        heapq.heapify(self._heap)

    def report_timeout(self, uid: str) -> None:
        """Deadline exceeded: not banned (its heap key already grew, so another peer is usually next)."""
        self.stats["timeouts"] += 1

    def report_error(self, uid: str, now: float) -> None:
        """Any other failure: banned until its current record expires (back only with a later expiration)."""
        self._now = max(self._now, now)
        self.stats["errors"] += 1
        if uid in self._records:
            self._banned[uid] = self._records[uid]


class UniformBalancer(StageBalancer):
    """Same membership, bans and statistics; ``choose`` picks a usable peer uniformly at random."""

    def choose(self, task_size: float, now: float, *, backward: bool = False) -> str:
        self._now = max(self._now, now)
        usable = self.peers
        if not usable:
            raise NoPeersError(self.stage)
        return self._record_choice(self.rng.choice(usable))


ROUTINGS = ("weighted", "uniform")  # a trainer's routing over a stage's peers (hivemind transport: SwarmPlan.routing)


def make_balancer(routing: str, stage: int, rng: random.Random) -> StageBalancer:
    """A stage's balancer for ``routing``: ``weighted`` (``StageBalancer``, SWARM's) or ``uniform``
    (``UniformBalancer``, the baseline the routing benchmark compares it with)."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
    return (UniformBalancer if routing == "uniform" else StageBalancer)(stage, rng=rng)


CALL_ROUND_TRIPS = 10  # round trips a call's timeout allows on top of its compute budget (RetryPolicy.rtt_s)


@dataclass(frozen=True)
class RetryPolicy:
    """Bounds of one stage call. A silent peer (a cut link: no reset, no ICMP) is noticed only by the timeout, so
    every call has one; it grows with the links' round-trip time ``rtt_s`` (the testbed sets it from its relay's
    delay): a call opens a stream and moves its request and reply in a few round trips (the allowance of
    ``CALL_ROUND_TRIPS`` also covers TCP's slow start on a fresh connection)."""

    forward_timeout_s: float = 30.0
    backward_multiplier: float = 2.5   # backward timeout = forward * this
    give_up_after_s: float = 120.0     # a microbatch with no live peer for this long -> NoPeersError
    rtt_s: float = 0.0                 # round-trip time between hosts (seconds); 0: loopback / not known

    def timeout(self, backward: bool) -> float:
        return self.forward_timeout_s * (self.backward_multiplier if backward else 1.0) + CALL_ROUND_TRIPS * self.rtt_s

    def exhausted(self, failing_for_s: float, attempts: int) -> bool:
        """Give up a call that has timed out or failed ``attempts`` times in a row for ``failing_for_s`` seconds:
        at least 3 attempts and longer than ``give_up_after_s`` (declared peers that never answer)."""
        return attempts >= 3 and failing_for_s > self.give_up_after_s


class StageCall:
    """One stage call's retry rule, shared by the trainers of every transport that sends real calls (the launcher's
    trainer processes, ``trainer.StageClient``; the emulation's trainer threads, ``emulation.Router``): which
    replica to try next, what a failed try tells the balancer, when to give up. It only decides; the caller sends,
    waits and sleeps on its own clock and passes that clock's ``now`` (the balancer compares it with the peers'
    record expirations).

    A try ends in one of three ways: ``succeeded`` (the balancer learns the peer's throughput, in work units per
    second), ``timed_out`` (the peer is penalised as slow) or ``refused`` (refused, reset, a remote error, a peer
    known dead: banned until its record expires). Every failed try is a retry, counted with its kind through
    ``count`` (``retries``, ``timeouts``, ``errors``), and the microbatch is never dropped here: ``choose`` returns
    None while no live peer serves the stage (the caller waits a moment, ``NO_PEER_WAIT_S`` in the launcher's
    trainers, and re-reads the records) and
    raises ``NoPeersError`` once that has lasted ``give_up_after_s``; a failed try raises ``TimeoutError`` once
    ``RetryPolicy.exhausted`` counts the failures in a row: refusals, and timeouts of peers that never answered
    this trainer (declared peers that never answer; an unreachable address). Sharing this object showed the two
    trainers apart: the emulation's never gave up, the launcher's gave up on an overloaded replica that only
    answered late (uniform routing over peers of speed 1 / 0.5 / 0.25, 8 trainers, 30 s timeouts: 4 timeouts in
    120 s), which would have failed the run; now neither does."""

    NO_PEER_WAIT_S = 0.2   # between two looks for a live peer of a stranded stage (seconds of the caller's clock)

    def __init__(self, balancer, retry: RetryPolicy, *, task_size: float, backward: bool,
                 count: Callable[[str], None] = lambda key: None, what: str = "call"):
        self.balancer, self.retry, self.task_size, self.backward = balancer, retry, task_size, backward
        self.count, self.what = count, what
        self.attempts = 0
        self.failing_since: float | None = None
        self.stranded_since: float | None = None

    def choose(self, now: float) -> str | None:
        """The replica to send to, or None while the stage has no live peer."""
        try:
            uid = self.balancer.choose(self.task_size, now, backward=self.backward)
        except NoPeersError:
            self.stranded_since = now if self.stranded_since is None else self.stranded_since
            if now - self.stranded_since >= self.retry.give_up_after_s:
                raise
            return None
        self.stranded_since = None
        return uid

    def succeeded(self, uid: str, units: float, seconds: float) -> None:
        self.balancer.report_success(uid, units, seconds)

    def timed_out(self, uid: str, started: float, now: float) -> None:
        """The try sent at ``started`` had no answer by ``now``. A peer that has answered this trainer before is
        reachable, only busy (an overloaded slow replica under uniform routing) or gone (its record expires): its
        timeout is a retry but does not count toward giving up, which is for peers that never answer."""
        answered = self.balancer.throughput(uid) is not None
        self.balancer.report_timeout(uid)
        self._failed("timeouts", uid, started, now, toward_give_up=not answered)

    def refused(self, uid: str, started: float, now: float) -> None:
        """The try sent at ``started`` failed at ``now`` (refused, reset, a remote error; a peer known dead)."""
        self.balancer.report_error(uid, now)
        self._failed("errors", uid, started, now)

    def _failed(self, kind: str, uid: str, started: float, now: float, toward_give_up: bool = True) -> None:
        self.count(kind)
        self.count("retries")
        if not toward_give_up:
            return
        self.attempts += 1
        self.failing_since = started if self.failing_since is None else self.failing_since
        if self.retry.exhausted(now - self.failing_since, self.attempts):
            raise TimeoutError(f"stage {self.balancer.stage}: {self.attempts} {self.what} calls in a row failed or "
                               f"timed out over {now - self.failing_since:.0f} s (last on {uid}); its declared "
                               f"peers do not answer (unreachable address? see swarm.impl.host / interface)")


@dataclass(frozen=True)
class PathCall:
    """One stage call of a microbatch: ``forward`` (``payload``: the stage's input), ``last`` (the last stage's
    fused forward + backward; ``payload``: its input), ``backward`` (``payload``: the stage's input kept by the
    trainer, and the gradient of its output: any replica can take it, recomputing the stage's forward)."""

    stage: int
    kind: str
    payload: Any


def microbatch_path(stages: int, inputs: Any) -> Generator[PathCall, Any, Any]:
    """One microbatch's calls in SWARM's order: forward through stages 0..k-2 (the trainer keeping each stage's
    input), the last stage's fused forward + backward, backward through k-2..0. Yields each ``PathCall`` and is
    sent its answer: a forward call's output; for ``last``, ``(loss, gradient of its input)``; a backward call's
    gradient of its input. Returns the loss. Payloads are the transport's own (tensors, or tensors with their
    wire metadata); one stage is a single ``last`` call."""
    if stages < 1:
        raise ValueError(f"a microbatch needs at least one stage, got {stages}")
    kept, x = [], inputs
    for stage in range(stages - 1):
        kept.append(x)
        x = yield PathCall(stage, "forward", x)
    loss, grad = yield PathCall(stages - 1, "last", x)
    for stage in range(stages - 2, -1, -1):
        grad = yield PathCall(stage, "backward", (kept[stage], grad))
    return loss


def drive_path(path: Generator[PathCall, Any, Any], call: Callable[[PathCall], Any]) -> Any:
    """Run a ``microbatch_path`` with a blocking ``call``; returns its loss (``call``'s exceptions propagate)."""
    try:
        request = next(path)
        while True:
            request = path.send(call(request))
    except StopIteration as done:
        return done.value


async def drive_path_async(path: Generator[PathCall, Any, Any], call: Callable[[PathCall], Awaitable[Any]]) -> Any:
    """``drive_path`` on an event loop: ``call`` is a coroutine function."""
    try:
        request = next(path)
        while True:
            request = path.send(await call(request))
    except StopIteration as done:
        return done.value


def kill_candidates(steps: Mapping[int, Mapping[str, int]], live: Container[str]) -> list[str]:
    """Fault injection's victims, one rule for the launcher and the emulation: ``steps`` gives per stage the step
    each replica's record shows (dead ones too, until their records expire), ``live`` the uids that may be killed
    (alive, not moving, not already killed). A live replica may be killed if it is at its stage's latest step and
    at least one other live replica is too, so a kill never takes the last up-to-date copy of a stage. In the order
    given (the caller's random choice depends on it)."""
    found = []
    for replicas in steps.values():
        latest = max(replicas.values(), default=0)
        current = [uid for uid, step in replicas.items() if step == latest and uid in live]
        if len(current) >= 2:
            found.extend(current)
    return found


class LoadMeter:
    """A stage peer's own load over one window, the rebalancer's input on every transport: the time-average of the
    calls in its compute queue (waiting or computing) and the work units it served per second of its own compute
    (``served``; the rate of the last window with calls, None until ``SETTLED_UPDATES`` calls were served: a fresh
    peer's first calls pay a cold start). Caller-side latency, which includes queueing and the network, is not used.

    ``enter`` / ``exit`` date a queue change at ``now``; the simulator, which knows when an admitted call will
    finish, dates its exit ahead with ``exit_at`` and the change counts from then on. Times are arguments (no
    clock); a lock guards the counters, as the threaded transports call it from several threads.
    """

    def __init__(self, now: float):
        self._lock = threading.Lock()
        self._queue = 0
        self._exits: list[float] = []   # dated exits not reached yet (a heap)
        self._since = self._start = now
        self._area = 0.0
        self._units = self._busy_s = 0.0
        self._calls = 0
        self.total_calls = 0
        self.rate: float | None = None  # the last settled window's rate (kept through windows without calls)

    def _advance(self, now: float) -> None:
        while self._exits and self._exits[0] <= now:
            at = heapq.heappop(self._exits)
            self._area += self._queue * max(at - self._since, 0.0)
            self._since = max(at, self._since)
            self._queue -= 1
        self._area += self._queue * max(now - self._since, 0.0)
        self._since = max(now, self._since)

    @property
    def queue(self) -> int:
        """Calls in the queue at the latest time the meter was given."""
        with self._lock:
            self._advance(self._since)
            return self._queue

    def enter(self, now: float) -> None:
        with self._lock:
            self._advance(now)
            self._queue += 1

    def exit(self, now: float) -> None:
        with self._lock:
            self._advance(now)
            self._queue -= 1

    def exit_at(self, at: float) -> None:
        """A call leaves the queue at ``at`` (now or later)."""
        with self._lock:
            heapq.heappush(self._exits, at)

    def served(self, units: float, seconds: float) -> None:
        with self._lock:
            self._units += units
            self._busy_s += max(seconds, 0.0)
            self._calls += 1
            self.total_calls += 1

    def window(self, now: float) -> dict:
        """Close the window at ``now`` and start the next: its mean queue, served units, compute seconds, calls
        and the rate (units per compute second; the previous one without calls, None until settled)."""
        with self._lock:
            self._advance(now)
            span = now - self._start
            mean_queue = self._area / span if span > 0 else float(self._queue)
            if self._calls and self._busy_s > 0 and self.total_calls >= SETTLED_UPDATES:
                self.rate = self._units / self._busy_s
            out = {"queue": mean_queue, "units": self._units, "busy_s": self._busy_s, "calls": self._calls,
                   "span_s": span, "rate": self.rate if self.total_calls >= SETTLED_UPDATES else None}
            self._start = self._since = max(now, self._since)
            self._area = self._units = self._busy_s = 0.0
            self._calls = 0
            return out

    def load(self, uid: str, now: float) -> "PeerLoad":
        """Close the window at ``now``: the ``PeerLoad`` the rebalancer reads (mean queue, rate)."""
        window = self.window(now)
        return PeerLoad(uid, window["queue"], window["rate"])


@dataclass(frozen=True)
class PeerLoad:
    uid: str
    queue_len: float       # calls in its compute queue, averaged over the period (``LoadMeter``)
    samples_per_s: float | None   # work units per compute second; None: not settled yet (just joined or moved)


@dataclass(frozen=True)
class Move:
    uid: str
    from_stage: int
    to_stage: int


def _uid_hash(uid: str) -> str:
    return hashlib.sha1(uid.encode()).hexdigest()


TRANSIT_GIVE_UPS = 2.0   # a move in transit holds decisions for at most this many trainer give-up times


@dataclass
class LastMove:
    """The swarm's latest move as every rebalancing driver keeps it (the launcher's peers: the ``last_move_key``
    record in the DHT)."""

    period: int                 # the period whose loads decided it
    t: float                    # when it was decided (seconds on the driver's clock)
    arrived: int | None = None  # the period in which the mover began to serve its new stage; None: in transit


@dataclass(frozen=True)
class MoveGate:
    """When a swarm may decide its next move: the timing rule every driver applies before ``choose_move``.

    Nothing is decided while the last move is in transit (decided, the mover not serving its new stage yet: it
    drains its old stage and downloads the new one's state), for at most ``transit_s`` (a mover that died on its
    way never arrives), nor on the loads of a period that ended before the mover arrived (period index <= the
    arrival's), nor in the ``cooldown_periods`` periods after that. With the default 0 a move that arrives within
    its period allows the next decision one period later: one move per period, as the paper's rule has it
    (SWARM, as our notes paraphrase it); the mover's first, partial window counts it at its stage's mean rate
    (``Rebalancer.rates``). Deciding while a move is in transit would count the mover at no stage (it withdrew
    from one, has not declared itself at the other): its new stage would still look starved and a second peer
    would follow. The emulation and the simulator counted one period from the decision before 2026-11-27, which
    gives the same moves when the state download takes less than a period (``sim_scale``: 35 of 36 runs
    identical, one with 16 moves instead of 17)."""

    cooldown_periods: int = 0
    transit_s: float = TRANSIT_GIVE_UPS * RetryPolicy.give_up_after_s   # the launcher: its own give-up

    def quiet(self, last: LastMove | None, period: int, now: float) -> bool:
        if last is None:
            return False
        if last.arrived is None:
            return now - last.t < self.transit_s
        return period - last.arrived <= self.cooldown_periods


class Rebalancer:
    """Adaptive swarm rebalancing for a driver that sees every peer's load at once (the emulation's rebalancing
    thread, the simulator): every period, ``MoveGate`` then ``choose_move`` on the period's loads, as each of the
    launcher's peers does on the records in the DHT (``peer_rebalance``); the driver reports the mover's arrival
    (``arrived``).

    Stage load ``L_s = (sum of queue lengths + 1) / sum of throughputs``: seconds of backlog, plus one
    microbatch of service time so that with empty queues a stage with little capacity still counts as the
    bottleneck (a stage with no throughput has infinite load). Donor = argmin ``L`` among stages with at least
    two peers (a stage is never emptied); recipient = argmax ``L``. The move happens only if
    ``L_max / L_min > hysteresis`` and the projected bottleneck throughput ``min_s sum throughput`` strictly
    improves, by more than the relative margin ``min_gain`` (the mover brings its own measured rate along). Queue
    lengths fluctuate, so the load ratio alone would let a peer ping-pong between two stages of equal capacity
    (3/2 <-> 2/3 peers); measured rates carry a few per cent of noise, hence the margin (0 = plain strict
    improvement). The mover is the donor peer with the smallest SHA-1 of its uid (every peer computes the same
    answer).

    A peer with no measured rate yet (``samples_per_s is None``: it just joined or moved) counts at the mean rate
    of its stage's measured peers (of all measured peers if its stage has none; no decision if nobody is
    measured). Counted as zero, the peer that just moved would leave its new stage looking as short as before
    and a second peer would follow it (a move that gains nothing and costs a state download); waiting for every
    peer to be measured would stall rebalancing at scale, where some peer has always just rejoined.
    """

    def __init__(self, period_s: float, *, hysteresis: float = 1.5, cooldown_periods: int = 0,
                 transit_s: float | None = None, min_gain: float = 0.05):
        if period_s <= 0:
            raise ValueError(f"period_s must be positive, got {period_s}")
        if hysteresis < 1.0:
            raise ValueError(f"hysteresis must be >= 1, got {hysteresis}")
        self.period_s = period_s
        self.hysteresis = hysteresis
        self.gate = MoveGate(cooldown_periods, MoveGate.transit_s if transit_s is None else transit_s)
        self.min_gain = min_gain
        self.last: LastMove | None = None

    def period(self, now: float) -> int:
        """The index of the period that ends at ``now`` (the driver decides on period boundaries)."""
        return round(now / self.period_s)

    @staticmethod
    def stage_load(queue_len: float, samples_per_s: float) -> float:
        """Seconds to clear a stage's queue plus one microbatch (``inf`` without throughput)."""
        return math.inf if samples_per_s <= 0 else (queue_len + 1.0) / samples_per_s

    @staticmethod
    def rates(loads: dict[int, list[PeerLoad]]) -> dict[int, list[float]] | None:
        """Each peer's rate, an unmeasured one at its stage's (else the swarm's) mean measured rate; None if no
        peer is measured."""
        measured = [p.samples_per_s for peers in loads.values() for p in peers if p.samples_per_s is not None]
        if not measured:
            return None
        overall = sum(measured) / len(measured)
        out = {}
        for stage, peers in loads.items():
            known = [p.samples_per_s for p in peers if p.samples_per_s is not None]
            guess = sum(known) / len(known) if known else overall
            out[stage] = [guess if p.samples_per_s is None else p.samples_per_s for p in peers]
        return out

    def decide(self, loads: dict[int, list[PeerLoad]], now: float) -> Move | None:
        """``loads``: stage -> its live peers' loads over the period ending at ``now`` (a stage with no peer: empty
        list)."""
        period = self.period(now)
        if self.gate.quiet(self.last, period, now):
            return None
        move = choose_move(loads, hysteresis=self.hysteresis, min_gain=self.min_gain)
        if move is not None:
            self.last = LastMove(period, now)
        return move

    def arrived(self, now: float) -> None:
        """The last move's peer serves its new stage from ``now`` on: the cool-down starts."""
        if self.last is not None and self.last.arrived is None:
            self.last.arrived = math.floor(now / self.period_s)


def choose_move(loads: dict[int, list[PeerLoad]], *, hysteresis: float = 1.5, min_gain: float = 0.05) -> Move | None:
    """``Rebalancer``'s rule without its clock: the one move (or None) that ``loads`` call for.

    A pure function of the loads (the order of the stages and of the peers within a stage does not matter), so every
    stage peer that reads the same records computes the same move: the hivemind peers (``peer_rebalance``) each
    evaluate it and only the named peer acts."""
    if len(loads) < 2:
        return None
    loads = {s: sorted(peers, key=lambda p: p.uid) for s, peers in loads.items()}
    peer_rates = Rebalancer.rates(loads)
    if peer_rates is None:
        return None
    rates = {s: math.fsum(r) for s, r in peer_rates.items()}
    load = {s: Rebalancer.stage_load(math.fsum(p.queue_len for p in peers), rates[s]) for s, peers in loads.items()}
    donors = [s for s, peers in loads.items() if len(peers) >= 2]
    if not donors:
        return None
    donor = min(donors, key=lambda s: (load[s], s))
    recipient = max(loads, key=lambda s: (load[s], -s))
    if donor == recipient:
        return None
    ratio = math.inf if load[donor] == 0 else load[recipient] / load[donor]
    if not ratio > hysteresis:
        return None
    index, mover = min(enumerate(loads[donor]), key=lambda ip: _uid_hash(ip[1].uid))
    projected = dict(rates)
    projected[donor] -= peer_rates[donor][index]
    projected[recipient] += peer_rates[donor][index]
    if not min(projected.values()) > min(rates.values()) * (1.0 + min_gain):
        return None
    return Move(mover.uid, donor, recipient)


class StageSync:
    """Samples a stage's replicas processed toward one global batch, and their averaging weights."""

    def __init__(self, target_batch_samples: int):
        if target_batch_samples <= 0:
            raise ValueError(f"target_batch_samples must be positive, got {target_batch_samples}")
        self.target_batch_samples = target_batch_samples
        self._local: dict[str, int] = {}

    @property
    def total(self) -> int:
        return sum(self._local.values())

    def add(self, uid: str, samples: int) -> bool:
        """Count ``samples`` for ``uid``; True once the stage reached the target since the last reset."""
        self._local[uid] = self._local.get(uid, 0) + samples
        return self.total >= self.target_batch_samples

    def remove(self, uid: str) -> int:
        """Forget ``uid``'s samples (a replica that died with unaveraged gradients); returns how many."""
        return self._local.pop(uid, 0)

    def weights(self) -> dict[str, float]:
        """uid -> local samples / total (sums to 1); empty before any sample."""
        total = self.total
        return {uid: n / total for uid, n in self._local.items() if n > 0} if total else {}

    def reset(self) -> None:
        self._local.clear()
