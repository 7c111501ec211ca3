"""Transport 2's training: crammed BERT trained by the emulation's threads (``thread_swarm``'s peers, directory,
clock and routers), one process.

Real training of crammed BERT split into stages (``stages.split_model``): each peer holds a replica of its stage
(``replica.StageReplica``: module, the recipe's optimizer, the forward and backward compute); activations and
gradients cross stage boundaries encoded with ``compression.encode``/``decode`` (a narrowing ``swarm.compression``,
bottleneck/maxout, puts a trained layer at each boundary, ``stages.build_swarm_model``, and the narrowed tensor
travels in fp32); backward goes to any replica of the stage and recomputes the stage forward (as in SWARM's code).
Each stage accumulates gradients across its replicas until the recipe's global batch (``StageSync``), then takes one
synchronous step: the gradient average weighted by local samples, the same clipping and the same optimizer step (the
recipe's, ``StageReplica.apply``) on every live replica, so replicas stay bitwise equal. Stages step independently
(bounded staleness across stages, inherent to SWARM). Gradient clipping is therefore per stage, not over the whole
model as in single-process pretraining. A stage processes each microbatch's gradient once (a resent request is
recognised by its microbatch id). A killed peer's unaveraged gradients are lost, as in SWARM (counted in
``lost_gradient_samples``); the fault injector never kills the last live replica of a stage (its state would be
gone); a rejoining peer downloads parameters and optimizer state from a live replica. Emulated speed
(``StageReplica.emulate_speed``, no floor): a peer of speed s < 1 sleeps ``t_compute * (1/s - 1)`` after each call.
"""

from __future__ import annotations

import copy
import math
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from tqdm.auto import tqdm

from cramswarm.precision import resolve_precision
from cramswarm.swarm.compression import decode, encode, payload_bytes, wire_scheme
from cramswarm.swarm.rebalancing import WORK_UNITS, Rebalancer
from cramswarm.swarm.replica import StageReplica
from cramswarm.swarm.routing import NoPeersError, PathCall, drive_path, microbatch_path
from cramswarm.swarm.settings import SwarmPlan
from cramswarm.swarm.setups import PeerSpec
from cramswarm.swarm.stage_sync import StageSync
from cramswarm.swarm.stages import build_swarm_model, split_model
from cramswarm.swarm.thread_swarm import Dropped, Peer, Request, Router, ScaledClock, StopRun, Swarm
from cramswarm.training import budget_progress, step_accumulation, step_lr


@dataclass
class TrainResult:
    stage_states: list[dict[str, torch.Tensor]]  # final parameters of each stage (replicas are equal)
    log: list[dict]  # one row per optimizer step (of the last stage)
    stats: dict


class _Replica:
    """One peer's ``StageReplica``, the gradient sums of the microbatches it counted (flat, ``take_grads``' layout),
    and the lock its compute and its stage's steps take."""

    def __init__(self, replica: StageReplica):
        self.replica = replica
        self.sums = torch.zeros(replica.num_params)
        self.mbs: set[int] = set()  # microbatches whose gradients sit in ``sums``
        self.member = True  # takes part in its stage's synchronous steps
        self.lock = threading.Lock()


class _StageState:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.sync = StageSync(1)
        self.target_set = False
        self.step = 0
        self.seen: set[int] = set()
        self.losses: list[float] = []


class Dispatcher:
    """Hands out microbatches step by step, counting the budget exactly as ``pretrain.pretrain`` does.

    Before each step's first microbatch: progress t = budget_progress(tokens, steps, elapsed); stop at t >= 1
    or when ``total`` microbatches were issued; else the step gets ``training.step_accumulation`` microbatches
    and its learning rate is ``training.step_lr`` at t (both as pretrain's). ``plan`` lists (t, microbatches)
    per step; stage k-th steps use it.
    """

    def __init__(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], total: int, recipe: dict):
        self.batches, self.total, self.recipe = batches, total, recipe
        self.plan: list[tuple[float, int]] = []
        self.issued = self.tokens = 0
        self.left_in_step = 0
        self.lock = threading.Lock()
        self.start = time.perf_counter()

    def next(self) -> tuple[int, torch.Tensor, torch.Tensor] | None:
        with self.lock:
            if self.left_in_step == 0:
                if self.issued >= self.total:
                    return None
                t = budget_progress(
                    self.recipe["budget"], self.tokens, len(self.plan), time.perf_counter() - self.start
                )
                if t >= 1.0:
                    return None
                size = step_accumulation(self.recipe, t, self.issued * self.recipe["micro_batch_sequences"])
                size = min(size, self.total - self.issued)
                self.plan.append((t, size))
                self.left_in_step = size
            try:
                inputs, labels = next(self.batches)
            except StopIteration:
                raise ValueError(
                    f"the batch iterator ran out after {self.issued} of {self.total} microbatches"
                ) from None
            mb = self.issued
            self.issued += 1
            self.left_in_step -= 1
            self.tokens += inputs.numel()
            return mb, inputs, labels


class _TrainingSwarm(Swarm):
    """Peers that really compute their stage (see the module docstring for the synchronisation rules)."""

    def __init__(self, specs: list[PeerSpec], clock: ScaledClock, stages: list[torch.nn.Module], plan: SwarmPlan,
                 precision: str, dispatcher: Dispatcher):
        super().__init__(specs, clock, plan.retry.forward_timeout_s, 0.0)
        recipe = plan.recipe
        self.recipe, self.scheme, self.dispatcher = recipe, wire_scheme(plan.compression), dispatcher
        self.num_stages = len(stages)
        self.stage_state = [_StageState() for _ in stages]
        self.log: list[dict] = []
        self.boundary_bytes = 0
        self.flushed_steps = 0
        for peer in self.peers:
            peer.state = _Replica(StageReplica(copy.deepcopy(stages[peer.stage]), recipe, precision,
                                               torch.device("cpu"), peer.stage == self.num_stages - 1, peer.speed))

    # -- compute ---------------------------------------------------------------------------------------
    def _input(self, stage: int, data: Any) -> torch.Tensor:
        return data if stage == 0 else decode(data)

    def _encode(self, t: torch.Tensor) -> dict:
        payload = encode(t.detach(), self.scheme)
        with self.lock:
            self.boundary_bytes += payload_bytes(payload)
        return payload

    def work_units(self, request: Request) -> float:
        return WORK_UNITS[request.kind]

    def serve(self, peer: Peer, request: Request, incarnation: int) -> Any:
        rep: _Replica = peer.state
        start = time.perf_counter()
        if request.kind == "forward":
            x = self._input(request.stage, request.data)
            with rep.lock:
                out = rep.replica.forward(x)
            result: Any = self._encode(out)
        else:   # the last stage's data: (inputs, labels); the others': (inputs, the output gradient's payload)
            data, target = request.data
            x = self._input(request.stage, data)
            with rep.lock:
                grad, loss = rep.replica.backward(x, target if request.kind == "last" else decode(target))
            result = self._encode(grad) if grad is not None else None
            if request.kind == "last":
                result = (loss, result)
        rep.replica.emulate_speed(time.perf_counter() - start, self.work_units(request))
        if request.kind != "forward":
            self._accumulate(peer, incarnation, request.stage, request.mb, loss, int(x.shape[0]))
        elif not peer.alive or peer.incarnation != incarnation:
            raise Dropped
        return result

    # -- in-stage synchronisation ----------------------------------------------------------------------
    def _accumulate(self, peer: Peer, incarnation: int, stage: int, mb: int, loss: float | None, samples: int) -> None:
        """Count the gradients the backward call left in ``peer``'s replica once per microbatch and stage."""
        st = self.stage_state[stage]
        with st.lock:
            rep: _Replica = peer.state
            grads, _ = rep.replica.take_grads()
            if not peer.alive or peer.incarnation != incarnation:
                raise Dropped
            if mb in st.seen:  # a resent request already counted on another replica
                return
            st.seen.add(mb)
            rep.mbs.add(mb)
            rep.sums.add_(grads)
            if loss is not None:
                st.losses.append(loss)
            if not st.target_set:
                st.sync.target_batch_samples = self.dispatcher.plan[st.step][1] * samples
                st.target_set = True
            if st.sync.add(peer.uid, samples):
                self._step(stage)

    def members(self, stage: int) -> list[Peer]:
        return sorted((p for p in self.peers if p.stage == stage and p.state.member), key=lambda p: p.uid)

    def _step(self, stage: int) -> None:
        """One synchronous optimizer step of ``stage`` on every member replica (stage lock held)."""
        st, recipe = self.stage_state[stage], self.recipe
        weights, total = st.sync.weights(), st.sync.total
        members = self.members(stage)
        by_uid = {p.uid: p.state for p in members}
        # weighted average of the replicas' local mean gradients (weights = local samples / total)
        averaged = torch.zeros_like(members[0].state.sums)
        for uid, weight in weights.items():
            averaged.add_(by_uid[uid].sums, alpha=weight / (weight * total))
        plan = self.dispatcher.plan
        t, size = plan[min(st.step, len(plan) - 1)]
        lr, multiplier = step_lr(recipe, t, sum(n for _, n in plan[: st.step]) * recipe["micro_batch_sequences"])
        for peer in members:
            rep: _Replica = peer.state
            with rep.lock:   # its own copy of the average: clipping changes the gradients in place
                rep.replica.apply(averaged.clone(), lr)
                rep.sums.zero_()
                rep.mbs.clear()
        st.step += 1
        st.sync.reset()
        st.target_set = False
        if stage == self.num_stages - 1:
            loss = sum(st.losses) / len(st.losses) if st.losses else float("nan")
            if not math.isfinite(loss):
                raise FloatingPointError(f"swarm pretraining loss became {loss} at step {st.step}; lower pretrain.lr")
            tokens_per_mb = self.dispatcher.tokens // max(self.dispatcher.issued, 1)
            self.log.append(
                {
                    "step": st.step,
                    "tokens": sum(n for _, n in plan[: st.step]) * tokens_per_mb,
                    "progress": t,
                    "loss": loss,
                    "lr": lr,
                    "lr_multiplier": multiplier,
                    "batch_sequences": total,
                    "elapsed_s": time.perf_counter() - self.dispatcher.start,
                }
            )
            st.losses.clear()

    def flush(self) -> None:
        """After the last microbatch: a stage that lost gradients to a crash steps on what it holds."""
        for stage, st in enumerate(self.stage_state):
            with st.lock:
                if st.sync.total > 0:
                    self._step(stage)
                    self.flushed_steps += 1

    # -- membership changes ----------------------------------------------------------------------------
    def kill(self, peer: Peer) -> None:
        st = self.stage_state[peer.stage]
        with st.lock:
            peer.kill()
            rep: _Replica = peer.state
            rep.member = False
            st.sync.remove(peer.uid)
            st.seen -= rep.mbs  # their gradients are gone: a resent request may count them again
            rep.mbs.clear()
            rep.sums.zero_()

    def _source(self, stage: int, exclude: Peer) -> Peer:
        sources = [p for p in self.members(stage) if p is not exclude and p.alive]
        if not sources:
            raise NoPeersError(stage)
        return sources[0]

    def join_state(self, peer: Peer) -> None:  # noqa: B027 (a no-op by default, not abstract)
        st = self.stage_state[peer.stage]
        with st.lock:
            peer.state = _Replica(self._source(peer.stage, peer).state.replica.clone(peer.speed))

    def move_state(self, peer: Peer, from_stage: int, to_stage: int) -> None:  # noqa: B027 (a no-op by default)
        st = self.stage_state[from_stage]
        with st.lock:  # hand the unaveraged gradients to a replica that stays
            rep: _Replica = peer.state
            heir = self._source(from_stage, peer)
            heir.state.sums.add_(rep.sums)
            heir.state.mbs |= rep.mbs
            samples = st.sync.remove(peer.uid)
            if samples:
                st.sync.add(heir.uid, samples)
            rep.member = False
        with self.stage_state[to_stage].lock:  # joins the new stage's steps from here on
            peer.state = _Replica(self._source(to_stage, peer).state.replica.clone(peer.speed))
            peer.stage = to_stage

    def lost_gradients(self, requested: int) -> list[int]:
        return [requested - len(st.seen) for st in self.stage_state]

    def replica_spread(self) -> list[float]:
        """Per stage: the largest absolute parameter difference between live replicas (0.0 = equal)."""
        spread = []
        for stage in range(self.num_stages):
            flat = [torch.cat([p.detach().float().reshape(-1) for p in peer.state.replica.module.state_dict().values()])
                    for peer in self.members(stage) if peer.alive]
            spread.append(max((float((f - flat[0]).abs().max()) for f in flat[1:]), default=0.0))
        return spread


def train(plan: SwarmPlan, *, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], total_microbatches: int,
          progress: bool = True) -> TrainResult:
    """Train crammed BERT with SWARM on peer and trainer threads (see the module docstring), with ``plan``'s model,
    recipe, peers, speeds, trainers, compression, retry, faults, rebalancing and seed.

    ``batches`` yields already-masked (input_ids, labels) microbatches; at most ``total_microbatches`` are
    used (exactly that many for token or step budgets, which ``train.swarm_pretrain`` computes; a seconds budget
    stops at the first step boundary past the time). Compute runs on the CPU.
    """
    plan.validate()
    recipe = plan.recipe
    model = build_swarm_model(plan.arch, plan.vocab_size, recipe["seed"], plan.stages, plan.compression)
    stages = split_model(model, plan.stages)
    specs = [PeerSpec(stage, speed) for stage, speed in plan.slots()]
    precision = resolve_precision(recipe["precision"], torch.device("cpu"))
    clock = ScaledClock(1.0)
    dispatcher = Dispatcher(batches, total_microbatches, recipe)
    sw = _TrainingSwarm(specs, clock, stages, plan, precision, dispatcher)
    retry = plan.retry
    rng = random.Random(plan.seed)
    counts = {"done": 0, "lost": 0, "tokens": 0}

    def trainer(index: int, seed: float) -> None:
        router = Router(sw, len(stages), "weighted", retry, random.Random(seed))
        try:
            while (item := dispatcher.next()) is not None:
                mb, inputs, labels = item
                samples = int(inputs.shape[0])

                def send(request: PathCall, mb=mb, labels=labels, samples=samples):
                    payload = (request.payload, labels) if request.kind == "last" else request.payload
                    return router.call(request.stage, request.kind, mb, payload, samples, (0, 0))

                try:
                    drive_path(microbatch_path(len(stages), inputs), send)
                except NoPeersError:
                    with sw.lock:
                        counts["lost"] += 1
                    continue
                with sw.lock:
                    counts["done"] += 1
                    counts["tokens"] += inputs.numel()
        except StopRun:
            return
        except BaseException as exc:  # surfaced by the main thread
            sw.record_error(exc)

    trainers = [
        threading.Thread(target=trainer, args=(i, rng.random()), name=f"trainer{i}", daemon=True)
        for i in range(plan.trainers)
    ]
    helpers = []
    if plan.kill_every_s:
        faults = ([], plan.kill_every_s, plan.rejoin_after_s, plan.seed, sw.clock.now())
        helpers.append(threading.Thread(target=sw.fault_loop, daemon=True, args=faults))
    if plan.rebalance_period_s:
        helpers.append(
            threading.Thread(
                target=sw.rebalance_loop, daemon=True, args=(Rebalancer(plan.rebalance_period_s), len(stages))
            )
        )
    bar = tqdm(
        total=total_microbatches if total_microbatches < 1 << 40 else None,
        desc="swarm",
        unit="mb",
        disable=not progress,
        mininterval=2.0,
    )
    wall_start = dispatcher.start = time.perf_counter()
    sw.start()
    for thread in trainers + helpers:
        thread.start()
    try:
        while True:
            running = any(t.is_alive() for t in trainers)   # before the error check: a trainer records, then ends
            if running:
                time.sleep(0.1)
            if sw.errors:
                raise RuntimeError("swarm training failed in a peer or trainer thread") from sw.errors[0]
            if not running:
                break
            if progress:
                elapsed = time.perf_counter() - wall_start
                row = sw.log[-1] if sw.log else None
                bar.update(counts["done"] - bar.n)
                bar.set_postfix(
                    tokens=f"{counts['tokens']:,}",
                    loss=f"{row['loss']:.3f}" if row else "-",
                    lr=f"{row['lr']:.2e}" if row else "-",
                    tok_s=f"{counts['tokens'] / elapsed:,.0f}",
                )
        sw.flush()
    finally:
        sw.shutdown()
        bar.close()
    for thread in helpers:
        thread.join(timeout=5.0)
    stage_states = [
        {k: v.detach().clone() for k, v in sw.members(s)[0].state.replica.module.state_dict().items()}
        for s in range(len(stages))
    ]
    stats = {
        "transport": "emulation",
        "microbatches_requested": dispatcher.issued,
        "microbatches_done": counts["done"],
        "lost_microbatches": counts["lost"],
        "lost_gradient_microbatches": sw.lost_gradients(dispatcher.issued),
        "steps": len(dispatcher.plan),
        "steps_per_stage": [st.step for st in sw.stage_state],
        "flushed_steps": sw.flushed_steps,
        "tokens": dispatcher.tokens,
        **sw.counters,  # retries, timeouts, errors, peers_killed, rejoins
        "moves": list(sw.moves),
        "per_stage_peers": sw.stage_peers(),
        "replica_max_abs_diff": sw.replica_spread(),
        "boundary_bytes": sw.boundary_bytes,
        "compression": plan.compression,
        "precision": precision,
        "wall_s": round(time.perf_counter() - wall_start, 3),
    }
    return TrainResult(stage_states=stage_states, log=list(sw.log), stats=stats)
