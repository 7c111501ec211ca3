"""Transport 3: a discrete-event simulator of a SWARM swarm (virtual time, one heapq event loop, no threads).

It runs the same ``SwarmSetup`` as the thread emulation (``cramswarm.swarm.emulation.run``) and returns the same
result keys, driving the same policy objects (``StageBalancer`` / ``UniformBalancer``, ``RetryPolicy``,
``Rebalancer``, ``LoadMeter``) with the simulated clock passed in as ``now``. Nothing sleeps, so it is
exact and deterministic for a seed, and reaches swarms of hundreds to thousands of peers and millions of events
(swarm.md 6.3).

The model is the emulation's, so the two transports can be compared run for run:

* Trainers are the hub (swarm.md 1.1): each pushes one microbatch at a time forward through stages ``0..k-1``
  and backward through ``k-1..0``, one call per stage and direction; a microbatch is done when its stage-0
  backward call returns.
* A call: the request travels ``activation_bytes * 8 / bandwidth + latency``, waits in the peer's FIFO queue,
  is computed in ``stage_time_s / speed`` (forward) or ``BACKWARD_COMPUTE_FACTOR`` times that (backward), and
  the reply travels back (same size). The timeout (``RetryPolicy.timeout``) runs from the request's arrival to
  the end of its computation; a computation that would end later times out (the peer still spends the time on
  it). The balancer of the stage receives the whole call duration on success (task size 1, as the emulation).
  ``run``'s ``round_trips_per_call`` and ``call_overhead_s`` delay every request's arrival by the round trips a
  call costs beyond the first and a fixed time (measured on the testbed: ``cramswarm.testbed.callcost``), and
  ``fused_last_stage`` makes the last stage's forward and backward one call, as the hivemind trainer does.
* The in-stage synchronous step (off by default): with ``run``'s ``step_microbatches`` a stage steps once
  every that many backward calls have arrived at its peers (its global batch), and for ``step_stall_s`` seconds
  after the last of them is computed its peers admit no backward call (the gather, the all-reduce and the
  optimizer step of ``peer_sync``): backward calls arriving then wait, forward calls are served.
* The network (off by default: links are never shared, as in the emulation): with ``nic_mbit_s`` set (for the
  setup or per ``PeerSpec``) every byte a peer receives (requests) or sends (replies) goes through its NIC,
  shared equally by all its transfers in flight, in and out alike (processor sharing); a transfer's rate is
  ``min(bandwidth_mbit_s, nic_mbit_s / transfers in flight)`` and it arrives the link's one-way latency
  (``PeerSpec.latency_s``, else ``SwarmSetup.latency_s``) after its last bit left the NIC. One call of B bytes
  alone on a NIC of b Mbit/s takes ``B * 8 / b`` seconds plus the latency each way; two at once take twice as
  long. Trainers' NICs are not modelled (each trainer has one call in flight). A killed peer's NIC finishes
  the transfers it had started; requests so delivered to a dead peer time out as any other.
* Each trainer has one balancer per stage (``weighted``: ``StageBalancer``, ``uniform``: ``UniformBalancer``)
  and re-reads the stage's directory records every ``forward_timeout_s``; with no usable peer it waits
  ``0.1 x forward_timeout_s`` and re-reads at once, and after ``give_up_after_s`` without any the microbatch is
  lost. Peers re-declare every ``forward_timeout_s`` and records live ``RECORD_TTL_TIMEOUTS x`` that, so a dead
  peer stays listed for a while. Large swarms may let several trainers share balancers
  (``trainers_per_process``), as several trainer threads of one process would.
* A call to a peer that is down, restarting or moving fails at once (connection refused: ``report_error``
  bans it until its record expires) and is re-sent to the balancer's next choice; a call queued or computing
  at a peer that dies is never answered and times out (``report_timeout``), then is re-sent. No microbatch is
  lost unless a whole stage has no usable peer for ``give_up_after_s``.
* ``fixed`` routing (GPipe-style chains): chain ``c`` is the ``c``-th peer of every stage and trainer ``t`` uses
  chain ``t mod chains``; a call to a chain member that is down waits for it (polling every
  ``min(timeout, 0.1 x forward_timeout_s)``), a timed-out call is re-sent to the same member. No rerouting,
  no rebalancing.
* Failures: a ``FailureEvent`` kills a peer (its queued calls are dropped); with ``rejoin_after_s`` it restarts
  after that long, loads its stage's state for ``state_download_s`` and declares itself again.
* Joins (``SwarmSetup.joins``, churn): a new peer arrives, picks a stage (``random``, or ``most_loaded``: the
  highest (queued + computing calls + 1) / summed nominal speed of the stage's live peers, as a newcomer
  reading published queue sizes would), loads its state for ``state_download_s`` and declares itself. It is
  peer ``len(peers) + j`` for failure events; a kill of a peer that has not arrived yet is ignored.
* Rebalancing (``rebalance_period_s``): every period each serving peer's ``LoadMeter`` window (its queued +
  computing calls averaged over the period, the work units it served per second of compute, None until settled),
  the signal the launcher's and the emulation's peers measure, goes to a ``Rebalancer``; the mover withdraws
  at once, fails its queued calls (their trainers re-send them), finishes the call it is computing, loads the
  new stage's state for ``state_download_s`` and then serves the new stage. A peer not measured yet counts at its
  stage's mean measured rate (``Rebalancer.rates``), as everywhere; no peer reports its nominal speed.

``run(setup)`` simulates one setup; ``heterogeneous_setup`` builds large ones, and the preemption models
``poisson_failures`` (independent), ``burst_failures`` (correlated: several peers at once) and ``churn``
(peers leave for good and new ones arrive) give their failure and join events;
``optimal_throughput`` / ``optimum_over_time`` give the throughput of the best assignment of the live peers to
stages (the yardstick of the paper's rebalancing experiment, E4).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from cramswarm.swarm.emulation import (
    BACKWARD_COMPUTE_FACTOR,
    JOIN_STAGES,
    RECORD_TTL_TIMEOUTS,
    FailureEvent,
    JoinEvent,
    PeerSpec,
    SwarmSetup,
)
from cramswarm.swarm.policies import (
    LoadMeter,
    NoPeersError,
    Rebalancer,
    RetryPolicy,
    StageBalancer,
    UniformBalancer,
)

# Event kinds; the heap holds (time, sequence number, kind, payload). Kinds up to _SEND carry (call, token).
_ARRIVE, _REPLY, _TIMEOUT, _ERROR, _SEND, _RETRY, _KILL, _REJOIN, _READY, _REBALANCE, _NIC, _JOIN, _STEPPED = range(13)


@dataclass(slots=True)
class _Nic:
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
class _Trainer:
    balancers: list[StageBalancer]   # shared by the trainers of one process
    refreshed_at: list[float]        # when each stage's records were last read (shared likewise)
    chain: int = 0
    stage: int = 0
    backward: bool = False
    stranded_since: float | None = None   # when it first found no usable peer for the current call
    force_refresh: bool = False


@dataclass(slots=True)
class _Call:
    trainer: _Trainer
    stage: int
    backward: bool
    peer: _Peer
    sent_at: float
    deadline: float = math.inf
    start: float = math.inf          # when the peer starts computing it
    finish: float = math.inf         # when the peer finishes computing it
    token: int = 0                   # bumped when its scheduled outcome changes; stale events are ignored
    resolved: bool = False           # the trainer has handled its outcome
    answered: bool = False           # its scheduled outcome is a reply (not a timeout)


@dataclass(slots=True)
class _Peer:
    uid: str
    stage: int                       # the stage it serves (or will, once its state download ends)
    speed: float
    status: str = "up"               # up | down | joining | moving (as the emulation's peers)
    epoch: int = 0                   # bumped at every kill and move; stale READY events are ignored
    free_at: float = 0.0             # when its FIFO queue drains
    pending: deque[_Call] = field(default_factory=deque)   # calls queued or computing, in FIFO order
    record_stage: int = 0            # the stage of its latest directory record
    declared_at: float = 0.0         # first declaration of the current series
    stopped_at: float = math.inf     # when it stopped re-declaring (death); a move withdraws the record
    withdrawn: bool = False
    served: int = 0                  # forward calls answered
    work: float = 0.0                # compute in forward-call units (backward = BACKWARD_COMPUTE_FACTOR) answered
    meter: LoadMeter = field(default_factory=lambda: LoadMeter(0.0))   # its own queue and rate (rebalancer's input)
    latency_s: float = 0.0           # one-way latency of its links
    transfer_s: float = 0.0          # one transfer's time without a NIC (bytes / link bandwidth + latency)
    nic: _Nic | None = None          # None: transfers take ``transfer_s``, never shared
    call_extra_s: float = 0.0        # a call's round trips beyond the first and its fixed overhead (delay a request)

    def queue_len(self, now: float) -> int:
        pending = self.pending
        while pending and pending[0].finish <= now:
            pending.popleft()
        return len(pending)


class Simulator:
    """One simulated run of a ``SwarmSetup``; :meth:`run` returns the result dict (see :func:`run`)."""

    def __init__(self, setup: SwarmSetup, *, trainers_per_process: int = 1,
                 rebalancer_options: dict | None = None, round_trips_per_call: float = 1.0,
                 call_overhead_s: float = 0.0, fused_last_stage: bool = False,
                 step_microbatches: float | Sequence[float] | None = None, step_stall_s: float | Sequence[float] = 0.0):
        setup.validate()
        if trainers_per_process < 1:
            raise ValueError(f"trainers_per_process must be at least 1, got {trainers_per_process}")
        if not round_trips_per_call >= 1.0:
            raise ValueError(f"round_trips_per_call must be at least 1 (the request and the reply cross once each), "
                             f"got {round_trips_per_call}")
        if not call_overhead_s >= 0.0:
            raise ValueError(f"call_overhead_s must not be negative, got {call_overhead_s}")
        self.setup = setup
        self.round_trips_per_call, self.call_overhead_s = round_trips_per_call, call_overhead_s
        self.fused_last_stage = fused_last_stage
        self.num_stages = setup.num_stages
        stalls = self._per_stage(step_stall_s)
        if stalls is None or not all(v >= 0.0 for v in stalls):
            raise ValueError(f"step_stall_s must be one non-negative number or one per stage ({self.num_stages}), "
                             f"got {step_stall_s}")
        batches = None if step_microbatches is None else self._per_stage(step_microbatches)
        if step_microbatches is not None and (batches is None or not all(v >= 1.0 for v in batches)):
            raise ValueError(f"step_microbatches must be None, or one number of at least 1 or one per stage "
                             f"({self.num_stages}), got {step_microbatches}")
        self.step_microbatches, self.step_stall_s = batches, stalls
        self.batch_calls = [0] * self.num_stages            # backward calls admitted at the stage, in all
        self.batch_done_at = [0.0] * self.num_stages        # when the last of them is computed
        self.stepping_until = [-math.inf] * self.num_stages  # the stage's current step ends then
        self.held: list[list[_Call]] = [[] for _ in range(self.num_stages)]  # backward calls waiting for it
        self.steps = [0] * self.num_stages
        self.retry = RetryPolicy(forward_timeout_s=setup.forward_timeout_s)
        self.declare_period_s = setup.forward_timeout_s
        self.ttl_s = RECORD_TTL_TIMEOUTS * setup.forward_timeout_s
        self.bits = setup.activation_bytes * 8
        rng = random.Random(setup.seed)
        self.peers = [self._new_peer(f"peer{i:03d}", spec) for i, spec in enumerate(setup.peers)]
        self.by_uid = {p.uid: p for p in self.peers}
        self.now = 0.0
        self._events: list[tuple] = []
        self._seq = 0
        self.done = 0
        self.counters = {"lost": 0, "retries": 0, "timeouts": 0, "errors": 0, "peers_killed": 0, "rejoins": 0,
                         "joins": 0}
        self.join_rng = random.Random(f"joins-{setup.seed}")   # its own stream: the balancers' seeds stay as they were
        self.moves: list[dict] = []
        self.timeline: list[tuple[float, int]] = [(0.0, 0)]
        self.chains = self._chains() if setup.routing == "fixed" else []
        balancer_cls = UniformBalancer if setup.routing == "uniform" else StageBalancer
        self.trainers: list[_Trainer] = []
        for t in range(setup.trainers):
            if t % trainers_per_process == 0:
                balancers = [balancer_cls(s, rng=random.Random(rng.random())) for s in range(self.num_stages)]
                refreshed = [-math.inf] * self.num_stages
            trainer = _Trainer(balancers, refreshed, chain=t % len(self.chains) if self.chains else 0)
            self._first_call(trainer)
            self.trainers.append(trainer)
        self.rebalancer = (Rebalancer(setup.rebalance_period_s, **(rebalancer_options or {}))
                           if setup.rebalance_period_s and not self.chains else None)

    def _per_stage(self, value: float | Sequence[float]) -> list[float] | None:
        """One number for every stage, or one per stage; None if neither."""
        if isinstance(value, (int, float)):
            return [float(value)] * self.num_stages
        values = [float(v) for v in value]
        return values if len(values) == self.num_stages else None

    def _chains(self) -> list[list[_Peer]]:
        by_stage = [[p for p in self.peers if p.stage == s] for s in range(self.num_stages)]
        count = min(len(members) for members in by_stage)
        return [[by_stage[s][c] for s in range(self.num_stages)] for c in range(count)]

    def _new_peer(self, uid: str, spec: PeerSpec) -> _Peer:
        setup = self.setup
        latency = setup.latency_s if spec.latency_s is None else spec.latency_s
        link = setup.bandwidth_mbit_s
        transfer = latency if not link else self.bits / (link * 1e6) + latency
        nic_mbit_s = spec.nic_mbit_s if spec.nic_mbit_s is not None else setup.nic_mbit_s
        nic = _Nic(nic_mbit_s * 1e6, link * 1e6 if link else math.inf) if nic_mbit_s is not None else None
        extra = (self.round_trips_per_call - 1.0) * 2.0 * latency + self.call_overhead_s
        return _Peer(uid, spec.stage, spec.speed, record_stage=spec.stage, latency_s=latency, transfer_s=transfer,
                     nic=nic, call_extra_s=extra)

    # -- network ---------------------------------------------------------------------------------------
    def _transmit(self, peer: _Peer, delivery: tuple) -> None:
        """Put ``delivery`` = (kind, call, token) through ``peer``'s NIC; it happens the latency after."""
        nic, now = peer.nic, self.now
        nic.advance(now)
        self._seq += 1
        heapq.heappush(nic.flows, (nic.virtual + self.bits, self._seq, delivery))
        self._reschedule_nic(nic)

    def _reschedule_nic(self, nic: _Nic) -> None:
        nic.token += 1
        if nic.flows:
            self._push(self.now + max(nic.flows[0][0] - nic.virtual, 0.0) / nic.rate(), _NIC, (nic, nic.token))

    def _on_nic(self, payload: tuple[_Nic, int]) -> None:
        nic, token = payload
        if token != nic.token:
            return
        nic.advance(self.now)
        nic.virtual = max(nic.virtual, nic.flows[0][0])   # the event was due now: absorb rounding
        finished = []
        while nic.flows and nic.flows[0][0] <= nic.virtual * (1 + 1e-12):
            finished.append(heapq.heappop(nic.flows)[2])
        self._reschedule_nic(nic)
        for kind, call, token in finished:
            arrival = self.now + call.peer.latency_s
            if kind == _ARRIVE:
                self._push(arrival + call.peer.call_extra_s, _ARRIVE, call)
            elif token == call.token:   # a reply: delivered unless its call was settled otherwise meanwhile
                self._schedule(call, arrival, _REPLY)

    def _on_send(self, call: _Call) -> None:
        """The peer finished computing ``call``: its reply enters the NIC."""
        self._transmit(call.peer, (_REPLY, call, call.token))

    def _push(self, time: float, kind: int, payload: object = None) -> None:
        self._seq += 1
        heapq.heappush(self._events, (time, self._seq, kind, payload))

    def _schedule(self, call: _Call, time: float, kind: int) -> None:
        call.token += 1
        call.answered = kind in (_REPLY, _SEND)
        self._push(time, kind, (call, call.token))

    def _units(self, stage: int, backward: bool) -> float:
        """A call's compute in forward-call units: forward 1, backward ``BACKWARD_COMPUTE_FACTOR``, and both for
        the last stage's backward call where ``fused_last_stage`` makes it the stage's only call."""
        if not backward:
            return 1.0
        return BACKWARD_COMPUTE_FACTOR + (1.0 if self.fused_last_stage and stage == self.num_stages - 1 else 0.0)

    def _service_s(self, peer: _Peer, stage: int, backward: bool) -> float:
        return self.setup.stage_time_s / peer.speed * self._units(stage, backward)

    # -- directory -------------------------------------------------------------------------------------
    def _records(self, stage: int) -> dict[str, float]:
        """The stage's unexpired records: each peer's latest declaration + TTL."""
        now, period = self.now, self.declare_period_s
        records = {}
        for peer in self.peers:
            if peer.record_stage != stage or peer.withdrawn or peer.declared_at > now:
                continue
            last = min(now, peer.stopped_at)
            expiration = peer.declared_at + (last - peer.declared_at) // period * period + self.ttl_s
            if expiration >= now:
                records[peer.uid] = expiration
        return records

    def _declare(self, peer: _Peer) -> None:
        peer.record_stage, peer.declared_at, peer.stopped_at, peer.withdrawn = peer.stage, self.now, math.inf, False

    # -- trainer side ----------------------------------------------------------------------------------
    def _send(self, trainer: _Trainer) -> None:
        """Issue the trainer's current call (stage, direction) to the peer its routing picks."""
        stage, backward, now = trainer.stage, trainer.backward, self.now
        if self.chains:
            peer = self.chains[trainer.chain][stage]
            if peer.status != "up":   # a fixed pipeline waits for its member to come back
                self._push(now + min(self.retry.timeout(backward), 0.1 * self.declare_period_s), _RETRY, trainer)
                return
        else:
            balancer = trainer.balancers[stage]
            while True:
                if trainer.force_refresh or now - trainer.refreshed_at[stage] >= self.declare_period_s:
                    balancer.update_peers(self._records(stage), now)
                    trainer.refreshed_at[stage] = now
                    trainer.force_refresh = False
                try:
                    uid = balancer.choose(1.0, now, backward=backward)
                except NoPeersError:
                    self._stranded(trainer)
                    return
                trainer.stranded_since = None
                peer = self.by_uid[uid]
                if peer.status == "up":
                    break
                self.counters["errors"] += 1   # connection refused: ban it and ask again at once
                self.counters["retries"] += 1
                balancer.report_error(uid, now)
        call = _Call(trainer, stage, backward, peer, now)
        if peer.nic is None:
            self._push(now + peer.transfer_s + peer.call_extra_s, _ARRIVE, call)
        else:
            self._transmit(peer, (_ARRIVE, call, 0))

    def _stranded(self, trainer: _Trainer) -> None:
        now = self.now
        if trainer.stranded_since is None:
            trainer.stranded_since = now
        elif now - trainer.stranded_since >= self.retry.give_up_after_s:
            self.counters["lost"] += 1   # the bounded wait is over: drop the microbatch, start a new one
            trainer.stranded_since = None
            self._first_call(trainer)
        trainer.force_refresh = True
        self._push(now + 0.1 * self.declare_period_s, _RETRY, trainer)

    def _first_call(self, trainer: _Trainer) -> None:
        """A new microbatch: stage 0's forward call (its fused forward + backward call if it is the last)."""
        trainer.stage = 0
        trainer.backward = self.fused_last_stage and self.num_stages == 1

    def _advance(self, trainer: _Trainer) -> None:
        """The current call succeeded: issue the microbatch's next call, or count it done and start anew."""
        if not trainer.backward:
            if trainer.stage + 1 < self.num_stages:
                trainer.stage += 1
                # with fused_last_stage the last stage's first call is its backward call (forward included)
                trainer.backward = self.fused_last_stage and trainer.stage == self.num_stages - 1
            else:
                trainer.backward = True
        elif trainer.stage > 0:
            trainer.stage -= 1
        else:
            self.done += 1
            self.timeline.append((self.now, self.done))
            self._first_call(trainer)
        self._send(trainer)

    def _on_arrive(self, call: _Call) -> None:
        peer, now = call.peer, self.now
        if call.deadline == math.inf:   # a call held through a step keeps the deadline of its arrival
            call.deadline = now + self.retry.timeout(call.backward)
        if peer.status == "moving":   # queued until the move ends, then refused (wrong stage)
            if peer.free_at < call.deadline:
                self._schedule(call, peer.free_at, _ERROR)
            else:
                self._schedule(call, call.deadline, _TIMEOUT)
            return
        if peer.status != "up":       # dead or restarting: never answered
            self._schedule(call, call.deadline, _TIMEOUT)
            return
        if peer.stage != call.stage:  # moved away meanwhile: refused
            self._schedule(call, now, _ERROR)
            return
        stage = call.stage
        if call.backward and self.step_microbatches is not None and now < self.stepping_until[stage]:
            self.held[stage].append(call)   # the stage is stepping: admitted when its step ends
            return
        service = self._service_s(peer, call.stage, call.backward)
        call.start = max(now, peer.free_at)
        call.finish = peer.free_at = call.start + service
        peer.pending.append(call)
        peer.meter.enter(now)
        peer.meter.exit_at(call.finish)
        if call.backward and self.step_microbatches is not None:
            self._count_toward_step(stage, call.finish)
        peer.meter.served(self._units(call.stage, call.backward), service)
        if call.finish <= call.deadline:
            if peer.nic is None:
                self._schedule(call, call.finish + peer.transfer_s, _REPLY)
            else:
                self._schedule(call, call.finish, _SEND)
        else:
            self._schedule(call, call.deadline, _TIMEOUT)

    def _count_toward_step(self, stage: int, finish: float) -> None:
        """A backward call admitted at ``stage``, computed by ``finish``: the last of the batch starts its step
        (step k ends the batch once the stage's calls reach ``ceil(k x step_microbatches)``)."""
        self.batch_calls[stage] += 1
        self.batch_done_at[stage] = max(self.batch_done_at[stage], finish)
        if self.batch_calls[stage] >= math.ceil((self.steps[stage] + 1) * self.step_microbatches[stage] - 1e-9):
            self.stepping_until[stage] = self.batch_done_at[stage] + self.step_stall_s[stage]
            self.batch_done_at[stage] = 0.0
            self.steps[stage] += 1
            self._push(self.stepping_until[stage], _STEPPED, stage)

    def _on_stepped(self, stage: int) -> None:
        """The stage's step ended: its held backward calls arrive again, in their order (the first of them may
        complete the next batch and start the next step, holding the rest again)."""
        held, self.held[stage] = self.held[stage], []
        for call in held:
            if self.now >= call.deadline:   # its trainer gave up waiting meanwhile
                self._schedule(call, self.now, _TIMEOUT)
            else:
                self._on_arrive(call)

    def _on_reply(self, call: _Call) -> None:
        call.resolved = True
        trainer = call.trainer
        units = self._units(call.stage, call.backward)   # work units, as the real transports count
        call.peer.work += units
        if not call.backward or units > BACKWARD_COMPUTE_FACTOR:   # a fused call holds the stage's forward
            call.peer.served += 1
        if not self.chains:
            trainer.balancers[call.stage].report_success(call.peer.uid, units, self.now - call.sent_at)
        self._advance(trainer)

    def _on_timeout(self, call: _Call) -> None:
        call.resolved = True
        self.counters["timeouts"] += 1
        self.counters["retries"] += 1
        if not self.chains:
            call.trainer.balancers[call.stage].report_timeout(call.peer.uid)
        self._send(call.trainer)

    def _on_error(self, call: _Call) -> None:
        call.resolved = True
        self.counters["errors"] += 1
        self.counters["retries"] += 1
        if not self.chains:
            call.trainer.balancers[call.stage].report_error(call.peer.uid, self.now)
        self._send(call.trainer)

    def _on_retry(self, trainer: _Trainer) -> None:
        self._send(trainer)

    # -- peers dying, rejoining and moving -------------------------------------------------------------
    def _on_kill(self, event: FailureEvent) -> None:
        if event.peer >= len(self.peers):   # a peer that has not joined yet
            return
        peer, now = self.peers[event.peer], self.now
        if peer.status == "down":
            return
        self.counters["peers_killed"] += 1
        for call in peer.pending:   # dropped: a call due to be answered times out instead
            if call.finish > now and not call.resolved and call.answered:
                self._schedule(call, call.deadline, _TIMEOUT)
        peer.pending.clear()
        peer.status, peer.free_at = "down", now
        peer.epoch += 1
        peer.stopped_at = min(peer.stopped_at, now)
        if event.rejoin_after_s is not None:
            self._push(now + event.rejoin_after_s, _REJOIN, peer)

    def _on_rejoin(self, peer: _Peer) -> None:
        if peer.status != "down":
            return
        self.counters["rejoins"] += 1
        peer.status = "joining"
        peer.free_at = self.now + self.setup.state_download_s
        self._push(peer.free_at, _READY, (peer, peer.epoch))

    def stage_loads(self) -> list[float]:
        """Per stage: (queued + computing calls + 1) / summed nominal speed of its live peers (inf: none)."""
        queued, speed = [0] * self.num_stages, [0.0] * self.num_stages
        for peer in self.peers:
            if peer.status == "up":
                queued[peer.stage] += peer.queue_len(self.now)
                speed[peer.stage] += peer.speed
        return [(q + 1) / v if v else math.inf for q, v in zip(queued, speed)]

    def _on_join(self, join: JoinEvent) -> None:
        if join.stage == "random":
            stage = self.join_rng.randrange(self.num_stages)
        else:
            loads = self.stage_loads()
            stage = max(range(self.num_stages), key=loads.__getitem__)
        peer = self._new_peer(f"peer{len(self.peers):03d}", PeerSpec(stage=stage, speed=join.speed))
        peer.status, peer.declared_at = "joining", math.inf   # no record before its state is loaded
        peer.free_at = self.now + self.setup.state_download_s
        self.peers.append(peer)
        self.by_uid[peer.uid] = peer
        self.counters["joins"] += 1
        self._push(peer.free_at, _READY, (peer, peer.epoch))

    def _on_ready(self, payload: tuple[_Peer, int]) -> None:
        peer, epoch = payload
        if epoch != peer.epoch or peer.status not in ("joining", "moving"):
            return
        if peer.status == "moving" and self.rebalancer is not None:
            self.rebalancer.arrived(self.now)   # the mover serves its new stage: the cool-down starts
        peer.status = "up"
        peer.meter = LoadMeter(self.now)
        self._declare(peer)

    def _move(self, peer: _Peer, to_stage: int) -> None:
        now = self.now
        keep: deque[_Call] = deque()
        for call in peer.pending:
            if call.start <= now:
                keep.append(call)   # computing (it finishes) or done
            elif not call.resolved:
                self._schedule(call, now, _ERROR)   # queued: refused now, its trainer re-sends it
        peer.pending = keep
        peer.free_at = max([now, *(c.finish for c in keep)]) + self.setup.state_download_s
        peer.status, peer.stage, peer.withdrawn = "moving", to_stage, True
        peer.epoch += 1
        self._push(peer.free_at, _READY, (peer, peer.epoch))

    def _on_rebalance(self, _: object) -> None:
        now = self.now
        loads: dict[int, list] = {s: [] for s in range(self.num_stages)}
        for peer in self.peers:
            if peer.status == "up":
                # like the real transports: no rate until measured (no oracle speed), so the same moves happen
                loads[peer.stage].append(peer.meter.load(peer.uid, now))
        move = self.rebalancer.decide(loads, now)
        if move is not None:
            self.moves.append({"t_s": now, "uid": move.uid, "from_stage": move.from_stage,
                               "to_stage": move.to_stage})
            self._move(self.by_uid[move.uid], move.to_stage)
        self._push(now + self.rebalancer.period_s, _REBALANCE)

    # -- main loop -------------------------------------------------------------------------------------
    def run(self) -> dict:
        duration = self.setup.duration_s
        handlers = (self._on_arrive, self._on_reply, self._on_timeout, self._on_error, self._on_send)
        others = (None, None, None, None, None, self._on_retry, self._on_kill, self._on_rejoin, self._on_ready,
                  self._on_rebalance, self._on_nic, self._on_join, self._on_stepped)
        for event in self.setup.failures:
            self._push(event.at_s, _KILL, event)
        for join in self.setup.joins:
            self._push(join.at_s, _JOIN, join)
        if self.rebalancer is not None:
            self._push(self.rebalancer.period_s, _REBALANCE)
        for trainer in self.trainers:
            self._send(trainer)
        events, pop = self._events, heapq.heappop
        processed = 0
        while events and events[0][0] <= duration:
            self.now, _, kind, payload = pop(events)
            processed += 1
            if kind == _ARRIVE:
                self._on_arrive(payload)
            elif kind <= _SEND:
                call, token = payload
                if token == call.token:
                    handlers[kind](call)
            else:
                others[kind](payload)
        self.now = duration
        return {
            "transport": "sim",
            "microbatches_done": self.done,
            "throughput_mb_s": self.done / duration,
            "timeline": self.timeline,
            "lost_microbatches": self.counters["lost"],
            "retries": self.counters["retries"],
            "timeouts": self.counters["timeouts"],
            "errors": self.counters["errors"],
            "peers_killed": self.counters["peers_killed"],
            "rejoins": self.counters["rejoins"],
            "joins": self.counters["joins"],
            "moves": self.moves,
            "served": {p.uid: p.served for p in self.peers},
            "work_units": {p.uid: p.work for p in self.peers},
            "per_stage_peers": {s: sorted(p.uid for p in self.peers if p.status == "up" and p.stage == s)
                                for s in range(self.num_stages)},
            "events": processed,
            "stage_steps": list(self.steps),
        }


def run(setup: SwarmSetup, *, trainers_per_process: int = 1, rebalancer_options: dict | None = None,
        round_trips_per_call: float = 1.0, call_overhead_s: float = 0.0, fused_last_stage: bool = False,
        step_microbatches: float | Sequence[float] | None = None, step_stall_s: float | Sequence[float] = 0.0
        ) -> dict:
    """Simulate ``setup`` for ``setup.duration_s`` virtual seconds; returns the emulation's result keys.

    ``microbatches_done`` (forward + backward through every stage), ``throughput_mb_s`` (microbatches per
    second over the run), ``timeline`` [(t_s, completed_total) at every completion, from (0, 0)],
    ``lost_microbatches`` (given up: no usable peer for ``give_up_after_s``), ``retries`` (re-sent calls),
    ``moves`` (list of {t_s, uid, from_stage, to_stage}), ``timeouts``, ``errors``, ``peers_killed``,
    ``rejoins``, ``joins`` (new peers arrived), ``served`` (uid -> forward calls answered), ``work_units``
    (uid -> compute of its answered calls in forward-call units, backward = ``BACKWARD_COMPUTE_FACTOR``),
    ``per_stage_peers`` (stage -> serving uids at the end), ``events`` (events processed), ``stage_steps``
    (per stage, the synchronous steps begun; zeros without ``step_microbatches``).
    ``trainers_per_process`` trainers share one set of balancers; ``rebalancer_options`` go to ``Rebalancer``
    (e.g. ``min_gain`` for large swarms).

    What one call costs on the network beyond its transfers (defaults: the model above, as the emulation):

    * ``round_trips_per_call``: round trips of the link's latency per call (at least 1: the request's way and
      the reply's); each one beyond the first delays the request's arrival by ``2 x latency`` (a transport
      that negotiates a stream before it sends, say). ``benchmarks/swarm_testbed.py`` measures it for hivemind
      calls between testbed hosts (``cramswarm.testbed.callcost``);
    * ``call_overhead_s``: fixed seconds per call that delay its request's arrival, whatever the latency (the
      daemons, the serialisation, a relay); it takes no peer time;
    * ``fused_last_stage``: the last stage's forward and backward are one call (the hivemind trainer's): its
      backward call, computed in ``(1 + BACKWARD_COMPUTE_FACTOR) x stage_time_s / speed``, follows the
      previous stage's forward, so a microbatch makes ``2 x stages - 1`` calls instead of ``2 x stages``. Its
      work counts ``1 + BACKWARD_COMPUTE_FACTOR`` units and one forward call in ``served``.

    The in-stage synchronous step (``peer_sync``: a stage's peers gather, all-reduce and step once their backward
    calls reach the global batch, and admit no backward call meanwhile; default: not modelled):

    * ``step_microbatches``: microbatches per step (None: no steps): the global batch, or what the peers step on
      average (``peer_sync``'s peers read each other's counts a little late and may admit more); one number or
      one per stage. Every that many backward calls admitted at a stage's peers (the last stage's fused call
      counts as its backward) make one step; a fraction alternates the neighbouring whole numbers to its mean
      (step k ends once the stage's calls reach ``ceil(k x step_microbatches)``);
    * ``step_stall_s``: seconds a step holds the stage's backward calls back, counted from the end of the
      computation of its batch's last backward call (one number, or one per stage). A backward call arriving at
      the stage from the moment its batch's last call was admitted until the step ends waits (no peer time; its
      timeout runs from its arrival) and is then admitted in arrival order; forward calls are served
      throughout. ``benchmarks/swarm_testbed.py`` measures it on the testbed from the peers' step lines
      (``peer_sync.stage_stalls``). A stage whose peers all die with calls of its batch in flight counts them
      all the same (the step is not re-run).
    """
    return Simulator(setup, trainers_per_process=trainers_per_process, rebalancer_options=rebalancer_options,
                     round_trips_per_call=round_trips_per_call, call_overhead_s=call_overhead_s,
                     fused_last_stage=fused_last_stage, step_microbatches=step_microbatches,
                     step_stall_s=step_stall_s).run()


# -- large setups and the optimum ------------------------------------------------------------------------
def heterogeneous_setup(num_peers: int, num_stages: int, *, speed_range: tuple[float, float] = (0.5, 1.0),
                        assignment: str = "random", trainers: int | None = None, seed: int = 0,
                        **setup_fields) -> SwarmSetup:
    """A swarm of ``num_peers`` peers with speeds drawn log-uniformly from ``speed_range``.

    ``assignment``: ``random`` puts each peer on a uniformly random stage (every stage gets at least one
    peer), ``balanced`` uses the greedy assignment of :func:`optimal_throughput`. ``trainers`` defaults to
    1.5 per peer. Further ``SwarmSetup`` fields (``stage_time_s`` is required) pass through.
    """
    if num_stages < 1 or num_peers < num_stages:
        raise ValueError(f"need at least one peer per stage: {num_peers} peers for {num_stages} stages")
    if assignment not in ("random", "balanced"):
        raise ValueError(f"assignment must be 'random' or 'balanced', got {assignment!r}")
    rng = random.Random(seed)
    low, high = speed_range
    speeds = [math.exp(rng.uniform(math.log(low), math.log(high))) for _ in range(num_peers)]
    if assignment == "balanced":
        stages = _greedy_assignment(speeds, num_stages)
    else:
        stages = list(range(num_stages)) + [rng.randrange(num_stages) for _ in range(num_peers - num_stages)]
        rng.shuffle(stages)
    peers = [PeerSpec(stage=s, speed=v) for s, v in zip(stages, speeds)]
    return SwarmSetup(peers=peers, trainers=trainers or math.ceil(1.5 * num_peers), seed=seed, **setup_fields)


def kill_schedule(kill_times: Iterable[float], num_peers: int, rejoin_after_s: float | None,
                  rng: random.Random) -> list[FailureEvent]:
    """A failure at each of ``kill_times`` (ascending), each hitting a uniformly random peer that is up at that
    moment (none up: the kill is skipped); it rejoins after ``rejoin_after_s`` (None: never)."""
    back_at = [0.0] * num_peers
    events = []
    for t in kill_times:
        up = [i for i in range(num_peers) if back_at[i] <= t]
        if up:
            peer = rng.choice(up)
            events.append(FailureEvent(at_s=t, peer=peer, rejoin_after_s=rejoin_after_s))
            back_at[peer] = math.inf if rejoin_after_s is None else t + rejoin_after_s
    return events


def poisson_failures(num_peers: int, duration_s: float, *, mean_interval_s: float, rejoin_after_s: float | None,
                     seed: int = 0) -> list[FailureEvent]:
    """Preemptions as one Poisson process over the swarm (mean ``mean_interval_s`` between two), each hitting
    a uniformly random peer that is up at that moment; it rejoins after ``rejoin_after_s`` (None: never)."""
    if mean_interval_s <= 0:
        raise ValueError(f"mean_interval_s must be positive, got {mean_interval_s}")
    rng = random.Random(seed)

    def arrivals() -> Iterator[float]:
        t = rng.expovariate(1.0 / mean_interval_s)
        while t < duration_s:
            yield t
            t += rng.expovariate(1.0 / mean_interval_s)

    return kill_schedule(arrivals(), num_peers, rejoin_after_s, rng)


def _poisson_times(duration_s: float, mean_interval_s: float, rng: random.Random) -> Iterator[float]:
    if mean_interval_s <= 0:
        raise ValueError(f"mean_interval_s must be positive, got {mean_interval_s}")
    t = rng.expovariate(1.0 / mean_interval_s)
    while t < duration_s:
        yield t
        t += rng.expovariate(1.0 / mean_interval_s)


def burst_failures(num_peers: int, duration_s: float, *, mean_interval_s: float, burst_size: int,
                   rejoin_after_s: float | None, seed: int = 0) -> list[FailureEvent]:
    """Correlated preemptions: bursts arrive as a Poisson process (mean ``mean_interval_s`` between two), each
    killing ``burst_size`` distinct peers that are up at that moment (all of them if fewer are up) at the same
    instant; each rejoins its stage after ``rejoin_after_s`` (None: never). With ``burst_size`` = 1 this is
    :func:`poisson_failures`' model."""
    if burst_size < 1:
        raise ValueError(f"burst_size must be at least 1, got {burst_size}")
    rng = random.Random(seed)
    back_at = [0.0] * num_peers
    events = []
    for t in _poisson_times(duration_s, mean_interval_s, rng):
        up = [i for i in range(num_peers) if back_at[i] <= t]
        for peer in rng.sample(up, min(burst_size, len(up))):
            events.append(FailureEvent(at_s=t, peer=peer, rejoin_after_s=rejoin_after_s))
            back_at[peer] = math.inf if rejoin_after_s is None else t + rejoin_after_s
    return events


def churn(num_peers: int, duration_s: float, *, mean_interval_s: float, join_after_s: float, stage: str = "random",
          speed_range: tuple[float, float] = (0.5, 1.0), seed: int = 0) -> tuple[list[FailureEvent], list[JoinEvent]]:
    """Churn: peers leave for good (a Poisson process over the swarm, mean ``mean_interval_s`` between two
    departures, each a uniformly random present peer, original or newly joined) and a new peer, of a speed
    drawn log-uniformly from ``speed_range``, arrives ``join_after_s`` after each departure and picks its stage
    by ``stage`` (``random`` | ``most_loaded``, see :class:`JoinEvent`). Returns (failures, joins); the j-th
    join is peer ``num_peers + j`` in the failure events."""
    if stage not in JOIN_STAGES:
        raise ValueError(f"stage must be one of {', '.join(JOIN_STAGES)}, got {stage!r}")
    if join_after_s < 0:
        raise ValueError(f"join_after_s must not be negative, got {join_after_s}")
    rng = random.Random(seed)
    low, high = speed_range
    arrives_at = [0.0] * num_peers   # per peer index; math.inf once it has left
    failures: list[FailureEvent] = []
    joins: list[JoinEvent] = []
    for t in _poisson_times(duration_s, mean_interval_s, rng):
        present = [i for i, at in enumerate(arrives_at) if at <= t]
        if present:
            peer = rng.choice(present)
            arrives_at[peer] = math.inf
            failures.append(FailureEvent(at_s=t, peer=peer, rejoin_after_s=None))
        if t + join_after_s < duration_s:
            speed = math.exp(rng.uniform(math.log(low), math.log(high)))
            joins.append(JoinEvent(at_s=t + join_after_s, speed=speed, stage=stage))
            arrives_at.append(t + join_after_s)
    return failures, joins


PREEMPTION_MODELS = ("independent", "burst", "churn_random", "churn_most_loaded")


def preemptions(model: str, num_peers: int, duration_s: float, *, preemptions_per_peer_hour: float,
                rejoin_after_s: float | None, burst_size: int = 4, join_after_s: float | None = None,
                speed_range: tuple[float, float] = (0.5, 1.0),
                seed: int = 0) -> tuple[list[FailureEvent], list[JoinEvent]]:
    """(failures, joins) of one preemption model at the same mean rate of preempted peers:

    * ``independent``: :func:`poisson_failures`, the peer back on its stage after ``rejoin_after_s``;
    * ``burst``: :func:`burst_failures` of ``burst_size`` peers at once, bursts ``burst_size`` times rarer;
    * ``churn_random`` / ``churn_most_loaded``: :func:`churn`, a new peer arriving ``join_after_s`` (default
      ``rejoin_after_s``) after each departure, on a random or on the most loaded stage.
    """
    if preemptions_per_peer_hour <= 0:
        raise ValueError(f"preemptions_per_peer_hour must be positive, got {preemptions_per_peer_hour}")
    interval = 3600.0 / (preemptions_per_peer_hour * num_peers)
    if model == "independent":
        return poisson_failures(num_peers, duration_s, mean_interval_s=interval, rejoin_after_s=rejoin_after_s,
                                seed=seed), []
    if model == "burst":
        return burst_failures(num_peers, duration_s, mean_interval_s=interval * burst_size, burst_size=burst_size,
                              rejoin_after_s=rejoin_after_s, seed=seed), []
    if model in ("churn_random", "churn_most_loaded"):
        delay = rejoin_after_s if join_after_s is None else join_after_s
        if delay is None:
            raise ValueError("churn needs join_after_s (or rejoin_after_s)")
        return churn(num_peers, duration_s, mean_interval_s=interval, join_after_s=delay,
                     stage=model.removeprefix("churn_"), speed_range=speed_range, seed=seed)
    raise ValueError(f"unknown preemption model {model!r}; allowed: {', '.join(PREEMPTION_MODELS)}")


def _greedy_assignment(speeds: Sequence[float], num_stages: int) -> list[int]:
    """Longest-processing-time greedy: fastest peer first, each to the stage with the least capacity so far."""
    capacity = [0.0] * num_stages
    stages = [0] * len(speeds)
    for i in sorted(range(len(speeds)), key=lambda i: -speeds[i]):
        s = min(range(num_stages), key=capacity.__getitem__)
        stages[i] = s
        capacity[s] += speeds[i]
    return stages


def optimal_throughput(speeds: Sequence[float], num_stages: int, stage_time_s: float) -> float:
    """Microbatches/s of the best assignment of peers of ``speeds`` to ``num_stages`` stages: max over
    assignments of min over stages of the stage's summed rate (a microbatch costs a peer
    ``(1 + BACKWARD_COMPUTE_FACTOR) x stage_time_s / speed``), ignoring the network.

    The max-min partition comes from the longest-processing-time greedy: exact for equal speeds, and within
    one peer's rate of the bound (sum of rates / stages) otherwise, i.e. close to exact for many peers.
    """
    if len(speeds) < num_stages:
        return 0.0
    capacity = [0.0] * num_stages
    for s, v in zip(_greedy_assignment(speeds, num_stages), speeds):
        capacity[s] += v
    return min(capacity) / (stage_time_s * (1.0 + BACKWARD_COMPUTE_FACTOR))


def optimum_over_time(setup: SwarmSetup) -> float:
    """Time average over the run of :func:`optimal_throughput` for the peers alive at each moment (a killed
    peer counts again from its rejoin, a new peer from its arrival; state downloads are ignored)."""
    all_speeds = [p.speed for p in setup.peers] + [j.speed for j in setup.joins]
    alive = [True] * len(setup.peers) + [False] * len(setup.joins)
    # (time, order, peer, rejoin delay); order 0 = (re)join before 1 = kill at the same moment.
    changes = [(e.at_s, 1, e.peer, e.rejoin_after_s) for e in setup.failures]
    changes += [(j.at_s, 0, len(setup.peers) + k, None) for k, j in enumerate(setup.joins)]
    heapq.heapify(changes)

    def optimum() -> float:
        speeds = [v for v, up in zip(all_speeds, alive) if up]
        return optimal_throughput(speeds, setup.num_stages, setup.stage_time_s)

    total, last, current = 0.0, 0.0, optimum()
    while changes and changes[0][0] < setup.duration_s:
        time, order, index, rejoin_after_s = heapq.heappop(changes)
        if order == 1 and alive[index]:
            alive[index] = False
            if rejoin_after_s is not None:
                heapq.heappush(changes, (time + rejoin_after_s, 0, index, None))
        elif order == 0:
            alive[index] = True
        else:
            continue
        total += current * (time - last)
        last, current = time, optimum()
    return (total + current * (setup.duration_s - last)) / setup.duration_s
