"""Adaptive rebalancing (swarm.md 1.5) as pure objects: no I/O, no clocks, no threads of their own (time is passed
in as ``now``).

Every transport (the launcher's stage peers, ``peer_rebalance``; the emulation's rebalancing thread; the
discrete-event ``sim``) measures with the same meter and decides with the same rule:

* ``LoadMeter`` - what a stage peer measures of itself (period-averaged queue, service rate in ``WORK_UNITS`` per
  second of its own compute): the one signal of the launcher's peers, the emulation's peer threads and the
  simulator's peers.
* ``choose_move`` - the rule, a pure function of the stages' loads (``PeerLoad``): move one peer from the least to
  the most loaded stage when the imbalance exceeds a hysteresis factor and the projected bottleneck throughput
  strictly improves.
* ``MoveGate`` - when the swarm may decide its next move (``LastMove``: not while a move is in transit, nor on a
  period that ended before the mover arrived).
* ``Rebalancer`` - gate and rule for a driver that sees every peer's load at once (the emulation, the simulator).
"""

from __future__ import annotations

import hashlib
import heapq
import math
import threading
from dataclasses import dataclass

from cramswarm.swarm.routing import RetryPolicy

# Relative compute per sample of a stage call, for the work units a peer serves (``LoadMeter``): forward 1,
# backward 2 (it recomputes the forward), the last stage's fused forward + backward 3.
WORK_UNITS = {"forward": 1.0, "backward": 2.0, "last": 3.0}

# LoadMeter reports a peer's rate to the rebalancer only after this many served calls: a fresh peer's first calls
# pay a cold start (allocations, caches, a GPU's kernel selection); on the hivemind transport one moved peer's first
# rate was a quarter of its peers' and the rebalancer moved it straight back.
SETTLED_UPDATES = 10


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
    would follow."""

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

