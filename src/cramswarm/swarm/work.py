"""Which microbatches a trainer trains next: leases of the run's work order, taken from claim records in the DHT.

Pure objects (no I/O, no clock: time is passed in as ``now``); the trainer (``trainer.WorkClaims``) reads and
stores the records. No trainer is tied to a share of the data, so trainers can come and go during a run: the
run's microbatches, in the order ``WorkOrder`` gives (0, 1, 2, ...; after a resume from shards, first those the
shards had not all stepped), are handed out in leases of ``LEASE_MICROBATCHES`` consecutive positions. Every
trainer keeps one ``Claim`` record in the DHT (``membership.work_key``, sub-key = its name), renewed every
``RENEW_PERIOD_S``: the lease it trains, its next position there, the highest lease it ever took, and the time
of its last renewal. A trainer looking for work (``next_work``) takes, in this order:

1. its own unfinished lease (a trainer restarted under the same name goes on where its record says);
2. an orphan: an unfinished lease that no live record holds - its holder's record is stale (not renewed for
   ``stale_s``: the trainer died) or released (it left deliberately) - the lowest first; the adopter marks the
   orphan's record ``adopted`` so that nobody takes it again;
3. a fresh lease: the one after the highest lease any record names (the frontier);

and otherwise waits while another trainer's lease is unfinished (that trainer may still die), or is done.

The DHT has no compare-and-swap: two trainers that take the same lease at once both see it on their next read,
and the one whose name sorts later gives it up (``yields_to``). What slips through (a trainer presumed dead that
was only slow, a record not yet seen) is trained twice and counted by the stages as a duplicate: at least once,
as in SWARM.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

LEASE_MICROBATCHES = 4   # positions per lease
RENEW_PERIOD_S = 2.0     # a trainer re-stores its claim this often
CLAIM_STALE_S = 20.0     # a claim not renewed this long is a dead trainer's: its unfinished lease is adopted
STATES = ("working", "released", "adopted", "idle")


@dataclass(frozen=True)
class WorkOrder:
    """The run's microbatches by position: first ``holes`` (a resumed run's microbatches before ``start`` that
    the shards had not all stepped), then ``start``, ``start + 1``, ... up to ``total`` (``data.BOUNDED`` or more
    for a seconds budget: no end in practice)."""

    total: int
    holes: tuple[int, ...] = ()
    start: int = 0

    @property
    def positions(self) -> int:
        return len(self.holes) + max(self.total - self.start, 0)

    def index(self, position: int) -> int:
        """The microbatch at ``position``."""
        if not 0 <= position < self.positions:
            raise IndexError(f"position {position} is outside the work order's {self.positions}")
        return self.holes[position] if position < len(self.holes) else self.start + position - len(self.holes)

    def spec(self) -> dict:
        return {"holes": list(self.holes), "start": self.start}

    @classmethod
    def from_spec(cls, total: int, spec: dict | None) -> WorkOrder:
        spec = spec or {}
        return cls(int(total), tuple(int(i) for i in spec.get("holes", ())), int(spec.get("start", 0)))

    @classmethod
    def after(cls, total: int, finished: set[int]) -> WorkOrder:
        """The order of a run resumed with the microbatches ``finished`` (stepped by every stage's shard and with
        a loss record): everything else, the gaps below the last finished one first."""
        start = max(finished, default=-1) + 1
        return cls(int(total), tuple(i for i in range(start) if i not in finished), start)


@dataclass(frozen=True)
class Claim:
    """One trainer's claim record (see the module docstring); ``lease`` -1: none taken yet."""

    lease: int = -1
    next: int = 0
    end: int = 0
    top: int = -1
    beat: float = 0.0
    state: str = "idle"

    @property
    def unfinished(self) -> bool:
        return self.state in ("working", "released") and self.lease >= 0 and self.next < self.end

    def stale(self, now: float, stale_s: float) -> bool:
        return self.state == "released" or now - self.beat > stale_s

    def value(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_value(cls, value) -> Claim | None:
        """The record a DHT value holds; None for anything else (never decides anything)."""
        try:
            claim = cls(int(value["lease"]), int(value["next"]), int(value["end"]), int(value["top"]),
                        float(value["beat"]), str(value["state"]))
        except (TypeError, KeyError, ValueError):
            return None
        return claim if claim.state in STATES and claim.next <= claim.end else None


@dataclass(frozen=True)
class Work:
    """A lease to train from position ``next`` to ``end`` (exclusive); ``adopted_from``: the trainer whose
    orphaned lease it is."""

    lease: int
    next: int
    end: int
    adopted_from: str | None = None


WAIT = "wait"   # next_work: nothing to take now, another trainer's lease is unfinished


def next_work(claims: dict[str, Claim], me: str, now: float, *, positions: int,
              stale_s: float = CLAIM_STALE_S) -> Work | str | None:
    """What trainer ``me`` trains next (a ``Work``), ``WAIT``, or None once every lease is finished."""
    mine = claims.get(me)
    if mine is not None and mine.state == "working" and mine.unfinished:
        return Work(mine.lease, mine.next, mine.end)
    others = {name: c for name, c in claims.items() if name != me}
    held = {c.lease for c in others.values() if c.unfinished and not c.stale(now, stale_s)}
    orphans = sorted((c.lease, c.next, name) for name, c in others.items()
                     if c.unfinished and c.stale(now, stale_s) and c.lease not in held)
    if orphans:
        lease, _, name = orphans[0]
        return Work(lease, others[name].next, others[name].end, adopted_from=name)
    frontier = max((c.top for c in claims.values()), default=-1) + 1
    start = frontier * LEASE_MICROBATCHES
    if start < positions:
        return Work(frontier, start, min(start + LEASE_MICROBATCHES, positions))
    return WAIT if held else None


def yields_to(claims: dict[str, Claim], me: str, now: float, stale_s: float = CLAIM_STALE_S) -> str | None:
    """The trainer to whom ``me`` gives up its lease: another live one working on the same lease whose name sorts
    first (None: keep it)."""
    mine = claims.get(me)
    if mine is None or not mine.unfinished:
        return None
    rivals = sorted(name for name, c in claims.items() if name < me and c.lease == mine.lease and c.unfinished
                    and c.state == "working" and not c.stale(now, stale_s))
    return rivals[0] if rivals else None


def all_done(claims: dict[str, Claim], *, positions: int) -> bool:
    """Whether every lease of the order was taken and none is unfinished."""
    frontier = max((c.top for c in claims.values()), default=-1) + 1
    return frontier * LEASE_MICROBATCHES >= positions and not any(c.unfinished for c in claims.values())
