"""The discrete-event simulator's network (``sim``, mixed into ``Simulator``): every byte a peer receives or sends
goes through its NIC (``Nic``), shared equally by all its transfers in flight (processor sharing); a transfer
arrives the link's one-way latency after its last bit left the NIC. Off unless the setup sets ``nic_mbit_s``."""

from __future__ import annotations

import heapq

from cramswarm.swarm_sim.sim_state import ARRIVE, NIC, REPLY, Nic, SimCall, SimPeer


class NicNetwork:
    """``Simulator``'s NIC transfers: it uses the simulator's ``now``, ``bits``, ``_seq``, ``_push`` and
    ``_schedule``."""

    def _transmit(self, peer: SimPeer, delivery: tuple) -> None:
        """Put ``delivery`` = (kind, call, token) through ``peer``'s NIC; it happens the latency after."""
        nic, now = peer.nic, self.now
        nic.advance(now)
        self._seq += 1
        heapq.heappush(nic.flows, (nic.virtual + self.bits, self._seq, delivery))
        self._reschedule_nic(nic)

    def _reschedule_nic(self, nic: Nic) -> None:
        nic.token += 1
        if nic.flows:
            self._push(self.now + max(nic.flows[0][0] - nic.virtual, 0.0) / nic.rate(), NIC, (nic, nic.token))

    def _on_nic(self, payload: tuple[Nic, int]) -> None:
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
            if kind == ARRIVE:
                self._push(arrival + call.peer.call_extra_s, ARRIVE, call)
            elif token == call.token:   # a reply: delivered unless its call was settled otherwise meanwhile
                self._schedule(call, arrival, REPLY)

    def _on_send(self, call: SimCall) -> None:
        """The peer finished computing ``call``: its reply enters the NIC."""
        self._transmit(call.peer, (REPLY, call, call.token))

