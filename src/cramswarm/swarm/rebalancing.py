"""Adaptive rebalancing (swarm.md 1.5) as pure objects: no I/O, no clocks, no threads of their own (time is passed
in as ``now``).

Every transport (the launcher's stage peers, ``peer_rebalance``; the emulation's rebalancing thread; the
discrete-event ``swarm_sim.sim``) measures with the same meter and decides with the same rule:

* ``LoadMeter`` - what a stage peer measures of itself (period-averaged queue, service rate in ``WORK_UNITS`` per
  second of its own compute): the one signal of the launcher's peers, the emulation's peer threads and the
  simulator's peers.
* ``choose_move`` - the rule, a pure function of the stages' loads (``PeerLoad``): move one peer from the least to
  the most loaded stage when the imbalance exceeds a hysteresis factor and the projected bottleneck throughput
  strictly improves.
* ``MoveGate`` - when the swarm may decide its next move (``LastMove``: not while a move is in transit, nor on a
  period that ended before the mover arrived).
* ``Rebalancer`` - gate and rule for a driver that sees every peer's load at once (the emulation, the simulator).
* The records the launcher's peers exchange (``peer_rebalance``): ``LoadRecord`` (a peer's period load in the DHT),
  ``LastMove`` (the swarm's latest move in the DHT), ``ClaimRecord`` (a claim of a period's move) and ``MoveEvent``
  (a line of the run's moves file). Each parses a raw value with ``from_value`` (None for a value that is not one:
  garbage, another layout) and gives what is stored with ``value``.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import threading
from dataclasses import dataclass, fields, replace

from cramswarm.swarm.routing import RetryPolicy

# Relative compute per sample of a stage call, for the work units a peer serves (``LoadMeter``): forward 1,
# backward 2 (it recomputes the forward), the last stage's fused forward + backward 3.
WORK_UNITS = {"forward": 1.0, "backward": 2.0, "last": 3.0}

# LoadMeter reports a peer's rate to the rebalancer only after this many served calls: a fresh peer's first calls
# pay a cold start (allocations, caches, a GPU's kernel selection), and a rate measured then would move it back.
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


def _is_int(value, minimum: int = 0) -> bool:
    """An int (not a bool) of at least ``minimum``: a wire value's count, index or stage."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _is_number(value, minimum: float | None = 0.0) -> bool:
    """A finite int or float (not a bool) of at least ``minimum`` (None: any): a wire value's measure or time."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and (minimum is None or value >= minimum))


def _parsed(cls, value):
    """``cls`` built from the entries of ``value`` named after its fields (a missing one keeps its default), or
    None where ``value`` is no dict, a field without default is missing or the record is not valid (``_valid``):
    the ``from_value`` of a record stored flat."""
    if not isinstance(value, dict):
        return None
    try:
        record = cls(**{f.name: value[f.name] for f in fields(cls) if f.name in value})
        return record if record._valid() else None
    except (TypeError, ValueError, OverflowError):   # a field missing, or a value no check can compare
        return None


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

    from_value = classmethod(_parsed)   # the move a wire value names, or None (``_valid``)

    def _valid(self) -> bool:
        """The wire value's ``uid``, ``from_stage`` and ``to_stage`` name a move: a uid not empty, stages >= 0."""
        return isinstance(self.uid, str) and bool(self.uid) and _is_int(self.from_stage) and _is_int(self.to_stage)

    def value(self) -> dict:
        """Its wire entries (``uid``, ``from_stage``, ``to_stage``), part of the records that name a move."""
        return {"uid": self.uid, "from_stage": self.from_stage, "to_stage": self.to_stage}


@dataclass(frozen=True)
class LoadRecord:
    """A stage peer's load over one rebalancing period, as it stores it under its stage's load key
    (``peer_rebalance.load_key``, sub-key = its uid): its ``LoadMeter`` window closed at the period's start."""

    period: int                 # the period's index k (DHT time // period length)
    queue: float                # calls in its compute queue (waiting or computing), time-averaged, >= 0
    rate: float | None          # work units per second of its own compute, >= 0; None: not settled yet
    units: float = 0.0          # work units served in the window
    busy_s: float = 0.0         # seconds of its own compute in the window
    calls: int = 0              # calls served in the window
    span_s: float = 0.0         # the window's length in seconds

    @classmethod
    def from_window(cls, period: int, window: dict) -> LoadRecord:
        """The record of a ``LoadMeter.window`` published for period ``period``."""
        return cls(period, **{f.name: window[f.name] for f in fields(cls) if f.name != "period"})

    from_value = classmethod(_parsed)   # the record a DHT value holds, or None (``_valid``)

    def _valid(self) -> bool:
        """Counts and measures finite numbers >= 0 (``period``, ``queue`` and ``rate`` have no default)."""
        return (_is_int(self.period) and _is_int(self.calls)
                and all(_is_number(v) for v in (self.queue, self.units, self.busy_s, self.span_s))
                and (self.rate is None or _is_number(self.rate)))

    def value(self) -> dict:
        """What is stored in the DHT (every field; ``rate`` None while unsettled)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def peer_load(self, uid: str) -> PeerLoad:
        """The load ``choose_move`` reads of peer ``uid``."""
        return PeerLoad(uid, float(self.queue), None if self.rate is None else float(self.rate))


@dataclass(frozen=True)
class ClaimRecord:
    """A peer's claim of a period's move, stored under the period's claims key (``peer_rebalance.claims_key``,
    sub-key = the claiming peer's uid): the stage it would move to."""

    to_stage: int

    @classmethod
    def from_value(cls, value) -> ClaimRecord | None:
        """The claim a DHT value holds (``to``: a stage index), or None where it is not one."""
        return _parsed(cls, {"to_stage": value["to"]}) if isinstance(value, dict) and "to" in value else None

    def _valid(self) -> bool:
        return _is_int(self.to_stage)

    def value(self) -> dict:
        """What is stored in the DHT."""
        return {"to": self.to_stage}


MOVE_EVENTS = ("decided", "arrived")


@dataclass(frozen=True)
class MoveEvent:
    """A line of the run's moves file (``peer_rebalance.MOVES_FILE``), appended by the moving peer: ``decided``
    when it leaves its stage, ``arrived`` once it serves the new one under ``new_uid``. The drain's fields are set
    once the mover left its stage (``PeerRebalancer.leave``); an ``arrived`` line holds ``new_uid`` and
    ``drain_s``."""

    event: str                          # one of ``MOVE_EVENTS``
    time: float                         # wall-clock seconds (``time.time()``)
    move: Move                          # who moved from which stage to which
    period: int                         # the period whose loads decided it
    new_uid: str | None = None          # its uid at the new stage (``arrived``)
    drain_s: float | None = None        # seconds its drain took
    handed_over_samples: int = 0        # gradient samples it handed to a replica that stays
    lost_gradient_samples: int = 0      # gradient samples it dropped

    @classmethod
    def from_value(cls, value) -> MoveEvent | None:
        """The event a parsed line holds, or None where it is not one (another layout, garbage)."""
        if (move := Move.from_value(value)) is None:   # None for a value that is no dict, too
            return None
        return _parsed(cls, value | {"move": move})

    def _valid(self) -> bool:
        arrived = self.event == "arrived"
        return (self.event in MOVE_EVENTS and _is_number(self.time, None) and isinstance(self.move, Move)
                and self.move._valid() and _is_int(self.period)
                and (isinstance(self.new_uid, str) and bool(self.new_uid) if arrived else self.new_uid is None)
                and (_is_number(self.drain_s) if arrived else self.drain_s is None or _is_number(self.drain_s))
                and _is_int(self.handed_over_samples) and _is_int(self.lost_gradient_samples))

    def value(self) -> dict:
        """The line's entries (the move's flat: ``uid``, ``from_stage``, ``to_stage``; the drain's only once it
        is over)."""
        out = {"event": self.event, "time": self.time, **self.move.value(), "period": self.period}
        if self.new_uid is not None:
            out["new_uid"] = self.new_uid
        if self.drain_s is not None:
            out |= {"drain_s": self.drain_s, "handed_over_samples": self.handed_over_samples,
                    "lost_gradient_samples": self.lost_gradient_samples}
        return out


def _uid_hash(uid: str) -> str:
    return hashlib.sha1(uid.encode()).hexdigest()


TRANSIT_GIVE_UPS = 2.0   # a move in transit holds decisions for at most this many trainer give-up times


@dataclass(frozen=True)
class LastMove:
    """The swarm's latest move as every rebalancing driver keeps it; the launcher's peers store it under
    ``peer_rebalance.last_move_key`` when a move is decided and again when the mover arrived."""

    period: int                 # the period whose loads decided it
    t: float                    # when it was decided or arrived (seconds on the driver's clock; the DHT's time)
    arrived: int | None = None  # the period in which the mover began to serve its new stage; None: in transit
    move: Move | None = None    # who moved where (None: a driver that keeps the timing only)

    @classmethod
    def from_value(cls, value) -> LastMove | None:
        """The record a DHT value holds (``period``, ``t``, ``arrived`` and the move's ``uid``, ``from_stage``,
        ``to_stage``, or none of those three), or None where it is not one."""
        if not isinstance(value, dict):
            return None
        move = None
        if any(k in value for k in ("uid", "from_stage", "to_stage")):
            if (move := Move.from_value(value)) is None:
                return None
        return _parsed(cls, value | {"move": move})

    def _valid(self) -> bool:
        return (_is_int(self.period) and _is_number(self.t, None)
                and (self.arrived is None or _is_int(self.arrived))
                and (self.move is None or isinstance(self.move, Move) and self.move._valid()))

    def value(self) -> dict:
        """What is stored in the DHT (the move's entries flat)."""
        return {"period": self.period, "t": self.t, "arrived": self.arrived,
                **(self.move.value() if self.move is not None else {})}


@dataclass(frozen=True)
class MoveGate:
    """When a swarm may decide its next move: the timing rule every driver applies before ``choose_move``.

    Nothing is decided while the last move is in transit (decided, the mover not serving its new stage yet: it
    drains its old stage and downloads the new one's state), for at most ``transit_s`` (a mover that died on its
    way never arrives), nor on the loads of a period that ended before the mover arrived (period index <= the
    arrival's), nor in the ``cooldown_periods`` periods after that. With the default 0 a move that arrives within
    its period allows the next decision one period later: one move per period, as SWARM's rule has it; the
    mover's first, partial window counts it at its stage's mean rate (``Rebalancer.rates``). Deciding while a
    move is in transit would count the mover at no stage (it withdrew from one, has not declared itself at the
    other): its new stage would still look starved and a second peer would follow."""

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
    ``L_max / L_min > 1.5`` (the hysteresis) and the projected bottleneck throughput ``min_s sum throughput`` strictly
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

    def __init__(self, period_s: float, *, min_gain: float = 0.05):
        if period_s <= 0:
            raise ValueError(f"period_s must be positive, got {period_s}")
        self.period_s = period_s
        self.gate = MoveGate()
        self.min_gain = min_gain
        self.last: LastMove | None = None

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
        list; the driver decides on period boundaries)."""
        period = round(now / self.period_s)   # the index of the period that ends at ``now``
        if self.gate.quiet(self.last, period, now):
            return None
        move = choose_move(loads, min_gain=self.min_gain)
        if move is not None:
            self.last = LastMove(period, now, move=move)
        return move

    def arrived(self, now: float) -> None:
        """The last move's peer serves its new stage from ``now`` on: the cool-down starts."""
        if self.last is not None and self.last.arrived is None:
            self.last = replace(self.last, arrived=math.floor(now / self.period_s))


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



def choose_join_stage(declared: dict[int, int], loads: dict[int, list[PeerLoad]] | None = None) -> int:
    """The stage a peer joining a running swarm serves (SWARM's newcomers go where the swarm needs them): the most
    loaded by ``choose_move``'s measure (seconds to clear a stage's queue at its peers' rate) where ``loads`` covers
    every stage and some peer is measured; else the stage with the fewest declared peers. Ties go to the lowest
    stage. ``declared``: stage -> its declared peers (every stage of the swarm)."""
    if loads is not None and set(loads) == set(declared) and (peer_rates := Rebalancer.rates(loads)) is not None:
        load = {s: Rebalancer.stage_load(math.fsum(p.queue_len for p in peers), math.fsum(peer_rates[s]))
                for s, peers in loads.items()}
        return max(sorted(load), key=lambda s: (load[s], -s))
    return min(sorted(declared), key=lambda s: (declared[s], s))
