"""A trainer's routing over a stage's replicas, as pure objects: no I/O, no clocks, no threads of their own (time
is passed in as ``now``).

Every transport (the launcher's trainer processes, the emulation's trainer threads, the discrete-event simulator
``swarm_sim.sim``) drives these same objects, so routing and retries behave identically everywhere.

* ``StageBalancer`` - stochastic wiring for one pipeline stage: an interleaved weighted round-robin over the
  stage's peers keyed by *virtual finish time* (each peer's key grows by task size / measured throughput, the
  minimum key is served next), so over time every peer receives work in proportion to its measured rate.
  New peers enter at the current minimum key (tried almost at once); a peer that errors is banned until its
  directory record expires; a timeout is not banned (its key already grew). Throughput is a bias-corrected EMA
  of seconds per sample (``PerformanceEMA``, alpha 0.1); a backward task weighs 2.5x a forward one.
* ``UniformBalancer`` - the same bookkeeping, choosing uniformly at random (the routing baseline).
* ``RetryPolicy`` - per-call timeouts (backward = forward x 2.5) and the bound on waiting for any live peer.
* ``StageCall`` - one stage call's retries on top of a balancer and a ``RetryPolicy``: the one retry loop of the
  launcher's trainer processes and the emulation's trainer threads (each sends, waits and sleeps its own way).
* ``microbatch_path`` - one microbatch's stage calls in SWARM's order, as a generator a trainer drives
  (``drive_path`` blocking, ``drive_path_async`` on an event loop): the one path of the launcher's trainer processes
  and the emulation's training threads (each encodes and sends the calls its own way).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Any


class NoPeersError(RuntimeError):
    """No live (unbanned, unexpired) peer serves a stage."""

    def __init__(self, stage: int):
        super().__init__(f"stage {stage}: no live peer serves this stage (all peers are gone, banned or expired)")
        self.stage = stage


class PerformanceEMA:
    """Bias-corrected exponential moving average of seconds per sample.

    After ``n`` updates the raw average is divided by ``1 - (1 - alpha)^n`` (the same correction as Adam's
    moments), so the first measurement is taken at face value instead of being shrunk toward zero.
    """

    def __init__(self, alpha: float = 0.1):
        self.alpha = alpha
        self._raw = 0.0
        self._updates = 0

    def update(self, seconds: float, samples: float) -> None:
        if samples <= 0:
            raise ValueError(f"samples must be positive, got {samples}")
        self._raw = self.alpha * (max(seconds, 0.0) / samples) + (1.0 - self.alpha) * self._raw
        self._updates += 1

    @property
    def samples_per_second(self) -> float | None:
        """The inverse of the corrected average; None before the first update."""
        if self._updates == 0:
            return None
        return 1.0 / max(self._raw / (1.0 - (1.0 - self.alpha) ** self._updates), 1e-12)


class StageBalancer:
    """Virtual-finish-time weighted round-robin over the peers of one stage (SWARM's IWRR).

    The heap holds one ``[virtual_time, tiebreak, uid]`` entry per known peer. ``choose`` pops the smallest
    usable entry, charges it ``size / throughput`` (``size`` is the task size, x ``BACKWARD_MULTIPLIER`` for
    backward tasks) and pushes it back. A peer not measured yet is charged at the mean throughput of the stage's
    measured peers. While no peer of the stage is measured, a call is charged 1 s per sample (as SWARM's balancer
    charges an unmeasured peer); at the stage's first measurement those charges are made again (``_reprice``): the
    measured peer's calls at its rate, the others' at that rate as the stage's mean. Either way no peer stays
    charged seconds beside peers charged measured milliseconds, which would leave it idle for most of a run.
    """

    ALPHA = 0.1                 # the throughput EMA's weight of a new measurement (``PerformanceEMA``)
    BACKWARD_MULTIPLIER = 2.5   # a backward task's size, in forward tasks

    def __init__(self, stage: int, *, rng: random.Random):
        self.stage = stage
        self.rng = rng
        self._heap: list[list] = []           # [virtual_time, tiebreak, uid]
        self._records: dict[str, float] = {}  # uid -> record expiration time
        self._banned: dict[str, float] = {}   # uid -> the expiration of the record it was banned under
        self._ema: dict[str, PerformanceEMA] = {}
        self._provisional: dict[str, float] = {}  # uid -> samples charged at 1 s each while none was measured
        self._now = -math.inf
        self.stats: dict[str, int] = {"timeouts": 0, "errors": 0}

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
        size = task_size * (self.BACKWARD_MULTIPLIER if backward else 1.0)
        rate = self.throughput(uid)
        if rate is None:
            rate = self._mean_rate()
            if rate is None:  # no peer of the stage measured: 1 s per sample, priced again at the first measurement
                self._provisional[uid] = self._provisional.get(uid, 0.0) + size
                return size
        return size / rate

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
        return chosen[2]

    # -- feedback --------------------------------------------------------------------------------------
    def report_success(self, uid: str, samples: float, seconds: float) -> None:
        """Feed a call's duration into the peer's EMA: end to end (network + the peer's queue + compute). The
        stage's first measurement re-prices what was charged before it (``_reprice``)."""
        self._ema.setdefault(uid, PerformanceEMA(self.ALPHA)).update(seconds, samples)
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
        return self.rng.choice(usable)


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
    trainer processes, ``trainer.StageClient``; the emulation's trainer threads, ``thread_swarm.Router``): which
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
    this trainer (declared peers that never answer; an unreachable address). A timeout of a replica that has answered
    this trainer before (an overloaded one that only answers late) is a retry that does not count toward giving
    up."""

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

