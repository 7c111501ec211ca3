"""The discrete-event simulator's peer lifecycle (``sim``, mixed into ``Simulator``): peers dying and rejoining
(failure events), new peers joining (churn) and peers moving between stages (rebalancing)."""

from __future__ import annotations

import math
from collections import deque

from cramswarm.swarm.rebalancing import LoadMeter
from cramswarm.swarm.setups import FailureEvent, JoinEvent, PeerSpec
from cramswarm.swarm_sim.sim_state import ERROR, READY, REBALANCE, REJOIN, TIMEOUT, SimCall, SimPeer


class PeerLifecycle:
    """``Simulator``'s peer events: it uses the simulator's ``now``, ``setup``, ``peers``, ``by_uid``, ``counters``,
    ``rebalancer``, ``moves``, ``join_rng``, ``_push``, ``_schedule``, ``_new_peer`` and ``_declare``."""

    def _on_kill(self, event: FailureEvent) -> None:
        if event.peer >= len(self.peers):   # a peer that has not joined yet
            return
        peer, now = self.peers[event.peer], self.now
        if peer.status == "down":
            return
        self.counters["peers_killed"] += 1
        for call in peer.pending:   # dropped: a call due to be answered times out instead
            if call.finish > now and not call.resolved and call.answered:
                self._schedule(call, call.deadline, TIMEOUT)
        peer.pending.clear()
        peer.status, peer.free_at = "down", now
        peer.epoch += 1
        peer.stopped_at = min(peer.stopped_at, now)
        if event.rejoin_after_s is not None:
            self._push(now + event.rejoin_after_s, REJOIN, peer)

    def _on_rejoin(self, peer: SimPeer) -> None:
        if peer.status != "down":
            return
        self.counters["rejoins"] += 1
        peer.status = "joining"
        peer.free_at = self.now + self.setup.state_download_s
        self._push(peer.free_at, READY, (peer, peer.epoch))

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
        self._push(peer.free_at, READY, (peer, peer.epoch))

    def _on_ready(self, payload: tuple[SimPeer, int]) -> None:
        peer, epoch = payload
        if epoch != peer.epoch or peer.status not in ("joining", "moving"):
            return
        if peer.status == "moving" and self.rebalancer is not None:
            self.rebalancer.arrived(self.now)   # the mover serves its new stage: the cool-down starts
        peer.status = "up"
        peer.meter = LoadMeter(self.now)
        self._declare(peer)

    def _move(self, peer: SimPeer, to_stage: int) -> None:
        now = self.now
        keep: deque[SimCall] = deque()
        for call in peer.pending:
            if call.start <= now:
                keep.append(call)   # computing (it finishes) or done
            elif not call.resolved:
                self._schedule(call, now, ERROR)   # queued: refused now, its trainer re-sends it
        peer.pending = keep
        peer.free_at = max([now, *(c.finish for c in keep)]) + self.setup.state_download_s
        peer.status, peer.stage, peer.withdrawn = "moving", to_stage, True
        peer.epoch += 1
        self._push(peer.free_at, READY, (peer, peer.epoch))

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
        self._push(now + self.rebalancer.period_s, REBALANCE)

