"""Transport 3: a discrete-event simulator of a SWARM swarm (virtual time, one heapq event loop, no threads).

It runs the same ``SwarmSetup`` as the thread emulation (``cramswarm.swarm_sim.emulation.run``) and returns the same
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
  A call's extra costs (``round_trips_per_call``, ``call_overhead_s``, ``fused_last_stage``) and the in-stage
  step (``step_microbatches``, ``step_s``, ``apply_s``; off by default) are ``run``'s options.
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

``run(setup)`` simulates one setup. Large setups and their failure and join events come from ``scenarios``
(``heterogeneous_setup``, the preemption models); the throughput of the best assignment of the live peers to stages,
the yardstick of the paper's rebalancing experiment (E4), from ``optimum``.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Sequence

from cramswarm.swarm.rebalancing import Rebalancer
from cramswarm.swarm.routing import NoPeersError, RetryPolicy, StageBalancer, UniformBalancer
from cramswarm.swarm.setups import BACKWARD_COMPUTE_FACTOR, RECORD_TTL_TIMEOUTS, PeerSpec, SwarmSetup
from cramswarm.swarm_sim.sim_lifecycle import PeerLifecycle
from cramswarm.swarm_sim.sim_network import NicNetwork
from cramswarm.swarm_sim.sim_state import (
    ARRIVE,
    COMPUTED,
    ERROR,
    JOIN,
    KILL,
    REBALANCE,
    REPLY,
    RETRY,
    SEND,
    STEPPED,
    TIMEOUT,
    Nic,
    SimCall,
    SimPeer,
    SimTrainer,
)


class Simulator(NicNetwork, PeerLifecycle):
    """One simulated run of a ``SwarmSetup``; :meth:`run` returns the result dict (see :func:`run`)."""

    def __init__(self, setup: SwarmSetup, *, trainers_per_process: int = 1,
                 rebalancer_options: dict | None = None, round_trips_per_call: float = 1.0,
                 call_overhead_s: float = 0.0, fused_last_stage: bool = False,
                 step_microbatches: float | Sequence[float] | None = None, step_s: float | Sequence[float] = 0.0,
                 apply_s: float | Sequence[float] = 0.0):
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
        self.step_s, self.apply_s = self._seconds("step_s", step_s), self._seconds("apply_s", apply_s)
        batches = None if step_microbatches is None else self._per_stage(step_microbatches)
        if step_microbatches is not None and (batches is None or not all(v >= 1.0 for v in batches)):
            raise ValueError(f"step_microbatches must be None, or one number of at least 1 or one per stage "
                             f"({self.num_stages}), got {step_microbatches}")
        self.step_microbatches = batches
        self.accumulated = [0] * self.num_stages   # backward calls computed toward the stage's next step
        self.stepping = [False] * self.num_stages  # a step of the stage is under way
        self.steps = [0] * self.num_stages
        self.step_ratios: list[list[float]] = [[] for _ in range(self.num_stages)]   # per step: batch / target
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
        self.trainers: list[SimTrainer] = []
        for t in range(setup.trainers):
            if t % trainers_per_process == 0:
                balancers = [balancer_cls(s, rng=random.Random(rng.random())) for s in range(self.num_stages)]
                refreshed = [-math.inf] * self.num_stages
            trainer = SimTrainer(balancers, refreshed, chain=t % len(self.chains) if self.chains else 0)
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

    def _seconds(self, name: str, value: float | Sequence[float]) -> list[float]:
        seconds = self._per_stage(value)
        if seconds is None or not all(v >= 0.0 for v in seconds):
            raise ValueError(f"{name} must be one non-negative number or one per stage ({self.num_stages}), "
                             f"got {value}")
        return seconds

    def _chains(self) -> list[list[SimPeer]]:
        by_stage = [[p for p in self.peers if p.stage == s] for s in range(self.num_stages)]
        count = min(len(members) for members in by_stage)
        return [[by_stage[s][c] for s in range(self.num_stages)] for c in range(count)]

    def _new_peer(self, uid: str, spec: PeerSpec) -> SimPeer:
        setup = self.setup
        latency = setup.latency_s if spec.latency_s is None else spec.latency_s
        link = setup.bandwidth_mbit_s
        transfer = latency if not link else self.bits / (link * 1e6) + latency
        nic_mbit_s = spec.nic_mbit_s if spec.nic_mbit_s is not None else setup.nic_mbit_s
        nic = Nic(nic_mbit_s * 1e6, link * 1e6 if link else math.inf) if nic_mbit_s is not None else None
        extra = (self.round_trips_per_call - 1.0) * 2.0 * latency + self.call_overhead_s
        return SimPeer(uid, spec.stage, spec.speed, record_stage=spec.stage, latency_s=latency,
                       transfer_s=transfer, nic=nic, call_extra_s=extra)

    def _push(self, time: float, kind: int, payload: object = None) -> None:
        self._seq += 1
        heapq.heappush(self._events, (time, self._seq, kind, payload))

    def _schedule(self, call: SimCall, time: float, kind: int) -> None:
        call.token += 1
        call.answered = kind in (REPLY, SEND)
        self._push(time, kind, (call, call.token))

    def _units(self, stage: int, backward: bool) -> float:
        """A call's compute in forward-call units: forward 1, backward ``BACKWARD_COMPUTE_FACTOR``, and both for
        the last stage's backward call where ``fused_last_stage`` makes it the stage's only call."""
        if not backward:
            return 1.0
        return BACKWARD_COMPUTE_FACTOR + (1.0 if self.fused_last_stage and stage == self.num_stages - 1 else 0.0)

    def _service_s(self, peer: SimPeer, stage: int, backward: bool) -> float:
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

    def _declare(self, peer: SimPeer) -> None:
        peer.record_stage, peer.declared_at, peer.stopped_at, peer.withdrawn = peer.stage, self.now, math.inf, False

    # -- trainer side ----------------------------------------------------------------------------------
    def _send(self, trainer: SimTrainer) -> None:
        """Issue the trainer's current call (stage, direction) to the peer its routing picks."""
        stage, backward, now = trainer.stage, trainer.backward, self.now
        if self.chains:
            peer = self.chains[trainer.chain][stage]
            if peer.status != "up":   # a fixed pipeline waits for its member to come back
                self._push(now + min(self.retry.timeout(backward), 0.1 * self.declare_period_s), RETRY, trainer)
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
        call = SimCall(trainer, stage, backward, peer, now)
        if peer.nic is None:
            self._push(now + peer.transfer_s + peer.call_extra_s, ARRIVE, call)
        else:
            self._transmit(peer, (ARRIVE, call, 0))

    def _stranded(self, trainer: SimTrainer) -> None:
        now = self.now
        if trainer.stranded_since is None:
            trainer.stranded_since = now
        elif now - trainer.stranded_since >= self.retry.give_up_after_s:
            self.counters["lost"] += 1   # the bounded wait is over: drop the microbatch, start a new one
            trainer.stranded_since = None
            self._first_call(trainer)
        trainer.force_refresh = True
        self._push(now + 0.1 * self.declare_period_s, RETRY, trainer)

    def _first_call(self, trainer: SimTrainer) -> None:
        """A new microbatch: stage 0's forward call (its fused forward + backward call if it is the last)."""
        trainer.stage = 0
        trainer.backward = self.fused_last_stage and self.num_stages == 1

    def _advance(self, trainer: SimTrainer) -> None:
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

    def _on_arrive(self, call: SimCall) -> None:
        peer, now = call.peer, self.now
        call.deadline = now + self.retry.timeout(call.backward)
        if peer.status == "moving":   # queued until the move ends, then refused (wrong stage)
            if peer.free_at < call.deadline:
                self._schedule(call, peer.free_at, ERROR)
            else:
                self._schedule(call, call.deadline, TIMEOUT)
            return
        if peer.status != "up":       # dead or restarting: never answered
            self._schedule(call, call.deadline, TIMEOUT)
            return
        if peer.stage != call.stage:  # moved away meanwhile: refused
            self._schedule(call, now, ERROR)
            return
        service = self._service_s(peer, call.stage, call.backward)
        call.start = max(now, peer.free_at)
        call.finish = peer.free_at = call.start + service
        peer.pending.append(call)
        peer.meter.enter(now)
        peer.meter.exit_at(call.finish)
        if call.backward and self.step_microbatches is not None:
            self._push(call.finish, COMPUTED, (peer, peer.epoch, call.stage))
        peer.meter.served(self._units(call.stage, call.backward), service)
        if call.finish <= call.deadline:
            if peer.nic is None:
                self._schedule(call, call.finish + peer.transfer_s, REPLY)
            else:
                self._schedule(call, call.finish, SEND)
        else:
            self._schedule(call, call.deadline, TIMEOUT)

    def _on_computed(self, payload: tuple[SimPeer, int, int]) -> None:
        """A backward call's computation ended: it counts toward its stage's next step unless its peer died or
        moved meanwhile (a timed-out call counts: its peer computed it)."""
        peer, epoch, stage = payload
        if epoch == peer.epoch:
            self.accumulated[stage] += 1
            self._try_step(stage)

    def _try_step(self, stage: int) -> None:
        """Start the stage's next step if none is under way and its computed calls reach the step's target: step
        k's is ``ceil(k x step_microbatches) - ceil((k - 1) x step_microbatches)``, so a fraction alternates the
        neighbouring whole numbers to its mean. The step takes every call computed so far (batch / target >= 1)."""
        per_step, k = self.step_microbatches[stage], self.steps[stage] + 1
        target = math.ceil(k * per_step - 1e-9) - math.ceil((k - 1) * per_step - 1e-9)
        if self.stepping[stage] or self.accumulated[stage] < target:
            return
        self.step_ratios[stage].append(self.accumulated[stage] / target)
        self.accumulated[stage] = 0
        self.steps[stage] += 1
        self.stepping[stage] = True
        self._push(self.now + self.step_s[stage], STEPPED, stage)

    def _on_stepped(self, stage: int) -> None:
        """The stage's step ended: each of its serving peers computes the optimizer step (``apply_s``) after the
        calls it has admitted, and the next step starts if the calls computed meanwhile reached its target."""
        self.stepping[stage] = False
        if self.apply_s[stage] > 0.0:
            for peer in self.peers:
                if peer.status == "up" and peer.stage == stage:
                    peer.free_at = max(self.now, peer.free_at) + self.apply_s[stage]
        self._try_step(stage)

    def _on_reply(self, call: SimCall) -> None:
        call.resolved = True
        trainer = call.trainer
        units = self._units(call.stage, call.backward)   # work units, as the real transports count
        call.peer.work += units
        if not call.backward or units > BACKWARD_COMPUTE_FACTOR:   # a fused call holds the stage's forward
            call.peer.served += 1
        if not self.chains:
            trainer.balancers[call.stage].report_success(call.peer.uid, units, self.now - call.sent_at)
        self._advance(trainer)

    def _on_timeout(self, call: SimCall) -> None:
        call.resolved = True
        self.counters["timeouts"] += 1
        self.counters["retries"] += 1
        if not self.chains:
            call.trainer.balancers[call.stage].report_timeout(call.peer.uid)
        self._send(call.trainer)

    def _on_error(self, call: SimCall) -> None:
        call.resolved = True
        self.counters["errors"] += 1
        self.counters["retries"] += 1
        if not self.chains:
            call.trainer.balancers[call.stage].report_error(call.peer.uid, self.now)
        self._send(call.trainer)

    def _on_retry(self, trainer: SimTrainer) -> None:
        self._send(trainer)

    # -- main loop -------------------------------------------------------------------------------------
    def run(self) -> dict:
        duration = self.setup.duration_s
        handlers = (self._on_arrive, self._on_reply, self._on_timeout, self._on_error, self._on_send)
        others = (None, None, None, None, None, self._on_retry, self._on_kill, self._on_rejoin, self._on_ready,
                  self._on_rebalance, self._on_nic, self._on_join, self._on_stepped, self._on_computed)
        for event in self.setup.failures:
            self._push(event.at_s, KILL, event)
        for join in self.setup.joins:
            self._push(join.at_s, JOIN, join)
        if self.rebalancer is not None:
            self._push(self.rebalancer.period_s, REBALANCE)
        for trainer in self.trainers:
            self._send(trainer)
        events, pop = self._events, heapq.heappop
        processed = 0
        while events and events[0][0] <= duration:
            self.now, _, kind, payload = pop(events)
            processed += 1
            if kind == ARRIVE:
                self._on_arrive(payload)
            elif kind <= SEND:
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
            "step_overshoot": {stage: {"steps": len(ratios), "mean": round(sum(ratios) / len(ratios), 4),
                                       "max": round(max(ratios), 4), "under": 0}
                               for stage, ratios in enumerate(self.step_ratios) if ratios},
        }


def run(setup: SwarmSetup, *, trainers_per_process: int = 1, rebalancer_options: dict | None = None,
        round_trips_per_call: float = 1.0, call_overhead_s: float = 0.0, fused_last_stage: bool = False,
        step_microbatches: float | Sequence[float] | None = None, step_s: float | Sequence[float] = 0.0,
        apply_s: float | Sequence[float] = 0.0) -> dict:
    """Simulate ``setup`` for ``setup.duration_s`` virtual seconds; returns the emulation's result keys.

    ``microbatches_done`` (forward + backward through every stage), ``throughput_mb_s`` (microbatches per
    second over the run), ``timeline`` [(t_s, completed_total) at every completion, from (0, 0)],
    ``lost_microbatches`` (given up: no usable peer for ``give_up_after_s``), ``retries`` (re-sent calls),
    ``moves`` (list of {t_s, uid, from_stage, to_stage}), ``timeouts``, ``errors``, ``peers_killed``,
    ``rejoins``, ``joins`` (new peers arrived), ``served`` (uid -> forward calls answered), ``work_units``
    (uid -> compute of its answered calls in forward-call units, backward = ``BACKWARD_COMPUTE_FACTOR``),
    ``per_stage_peers`` (stage -> serving uids at the end), ``events`` (events processed), ``stage_steps``
    (per stage, the in-stage steps begun; zeros without ``step_microbatches``), ``step_overshoot`` (stage ->
    ``steps``, ``mean`` and ``max`` of a step's batch over its target, ``under`` the steps below it: always 0 here;
    the real runs' ``step_overshoot``, ``progress.overshoot``; stages that stepped only).
    ``trainers_per_process`` trainers share one set of balancers; ``rebalancer_options`` go to ``Rebalancer``
    (e.g. ``min_gain`` for large swarms).

    What one call costs on the network beyond its transfers (defaults: the module docstring's model, as the
    emulation):

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

    The in-stage step (``peer_sync``: a stage's peers gather, all-reduce and step once their backward calls reach
    the global batch; default: not modelled). No call is held: a step's batch is what its stage's peers computed
    until it started, and the backward calls computed while it runs count toward the next one (double buffering):

    * ``step_microbatches``: the step's target in backward calls computed at the stage's peers (None: no steps;
      the last stage's fused call counts as its backward); one number or one per stage. A fraction alternates the
      neighbouring whole numbers to its mean (step k's target: ``ceil(k x n) - ceil((k - 1) x n)``). A step starts
      as soon as its target is reached and the stage's previous step has ended; it takes every call computed by
      then, so a step that waited for the previous one to end overshoots its target (``step_overshoot``). A call
      whose peer died or moved before its computation ended does not count;
    * ``step_s``: seconds from a step's start to its end (the gather, the all-reduce and the optimizer step; one
      number, or one per stage): no step of the stage starts meanwhile. ``benchmarks/swarm_testbed.py`` measures
      it on the testbed from the peers' step lines (``progress.stage_stalls``: from the end of the batch's last
      backward computation to the optimizer step);
    * ``apply_s``: seconds of compute the optimizer step takes on each of the stage's serving peers at the step's
      end, after the calls the peer has admitted (one number, or one per stage; default 0: the step takes no peer
      time and steps cost no throughput).
    """
    return Simulator(setup, trainers_per_process=trainers_per_process, rebalancer_options=rebalancer_options,
                     round_trips_per_call=round_trips_per_call, call_overhead_s=call_overhead_s,
                     fused_last_stage=fused_last_stage, step_microbatches=step_microbatches,
                     step_s=step_s, apply_s=apply_s).run()

