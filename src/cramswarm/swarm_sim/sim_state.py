"""The discrete-event simulator's state (``sim``): its event kinds and the records it keeps per NIC, trainer, call
and peer."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from cramswarm.swarm.rebalancing import LoadMeter
from cramswarm.swarm.routing import StageBalancer

# Event kinds; the heap holds (time, sequence number, kind, payload). Kinds up to SEND carry (call, token).
ARRIVE, REPLY, TIMEOUT, ERROR, SEND, RETRY, KILL, REJOIN, READY, REBALANCE, NIC, JOIN, STEPPED, COMPUTED = range(14)


@dataclass(slots=True)
class Nic:
    """A peer's NIC under processor sharing: every transfer in flight gets ``rate()`` bits/s.

    ``virtual`` counts the bits each transfer in flight has received since the NIC was made (they all receive
    the same), so a transfer of B bits added at virtual v is done when ``virtual`` reaches v + B: ``flows``
    is a heap of those finish tags and the next completion is one event, whatever the number in flight.
    """

    bps: float                       # capacity, bits/s
    link_bps: float                  # one transfer's most, bits/s (math.inf: only the NIC limits)
    virtual: float = 0.0
    updated: float = 0.0
    flows: list = field(default_factory=list)   # heap of (finish tag, sequence number, delivery)
    token: int = 0                   # bumped at every reschedule; stale completion events are ignored

    def rate(self) -> float:
        return min(self.link_bps, self.bps / len(self.flows)) if self.flows else 0.0

    def advance(self, now: float) -> None:
        if self.flows:
            self.virtual += (now - self.updated) * self.rate()
        self.updated = now


@dataclass(slots=True)
class SimTrainer:
    balancers: list[StageBalancer]   # shared by the trainers of one process
    refreshed_at: list[float]        # when each stage's records were last read (shared likewise)
    chain: int = 0
    stage: int = 0
    backward: bool = False
    stranded_since: float | None = None   # when it first found no usable peer for the current call
    force_refresh: bool = False


@dataclass(slots=True)
class SimCall:
    trainer: SimTrainer
    stage: int
    backward: bool
    peer: SimPeer
    sent_at: float
    deadline: float = math.inf
    start: float = math.inf          # when the peer starts computing it
    finish: float = math.inf         # when the peer finishes computing it
    token: int = 0                   # bumped when its scheduled outcome changes; stale events are ignored
    resolved: bool = False           # the trainer has handled its outcome
    answered: bool = False           # its scheduled outcome is a reply (not a timeout)


@dataclass(slots=True)
class SimPeer:
    uid: str
    stage: int                       # the stage it serves (or will, once its state download ends)
    speed: float
    status: str = "up"               # up | down | joining | moving (as the emulation's peers)
    epoch: int = 0                   # bumped at every kill and move; stale READY events are ignored
    free_at: float = 0.0             # when its FIFO queue drains
    pending: deque[SimCall] = field(default_factory=deque)   # calls queued or computing, in FIFO order
    record_stage: int = 0            # the stage of its latest directory record
    declared_at: float = 0.0         # first declaration of the current series
    stopped_at: float = math.inf     # when it stopped re-declaring (death); a move withdraws the record
    withdrawn: bool = False
    served: int = 0                  # forward calls answered
    work: float = 0.0                # compute in forward-call units (backward = BACKWARD_COMPUTE_FACTOR) answered
    meter: LoadMeter = field(default_factory=lambda: LoadMeter(0.0))   # its own queue and rate (rebalancer's input)
    latency_s: float = 0.0           # one-way latency of its links
    transfer_s: float = 0.0          # one transfer's time without a NIC (bytes / link bandwidth + latency)
    nic: Nic | None = None          # None: transfers take ``transfer_s``, never shared
    call_extra_s: float = 0.0        # a call's round trips beyond the first and its fixed overhead (delay a request)

    def queue_len(self, now: float) -> int:
        pending = self.pending
        while pending and pending[0].finish <= now:
            pending.popleft()
        return len(pending)

