"""Rebalancing decided by the stage peers of the launcher's swarm (``launcher``): no process tells a peer to move.

Every ``swarm.rebalance_period_s`` each ``peer_sync.SyncingStagePeer``'s ``PeerRebalancer`` publishes its own
``rebalancing.LoadMeter`` window as a ``rebalancing.LoadRecord`` (``load_key``), reads every stage's records of the
period ``decide_delay_s`` later and, on a complete view only (``read_loads``), evaluates ``rebalancing.choose_move``,
so the peers decide on the same records. The peer the move names claims it (``claims_key``) and moves only if its
claim wins: at most one move per period; ``rebalancing.MoveGate`` holds decisions back while the last move
(``last_move_key``) is in transit. The mover refuses new calls, withdraws its stage record, lets its calls finish,
hands its held gradients to a replica that stays (``hand_over``), and ``peer_process.move_peer`` rebuilds it on the
new stage as ``moved_uid``. Each move is appended to ``MOVES_FILE`` (``read_move_events``); the launcher reads it and
decides nothing. The rule and its numbers in full: docs/swarm-internals.md, "Rebalancing decided by the peers".
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from dataclasses import replace
from pathlib import Path

from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from cramswarm.swarm.membership import RECORD_TTL_S, stage_key, stage_records
from cramswarm.swarm.rebalancing import (
    TRANSIT_GIVE_UPS,
    WORK_UNITS,
    ClaimRecord,
    LastMove,
    LoadRecord,
    MoveEvent,
    MoveGate,
    PeerLoad,
    _uid_hash,
    choose_move,
)
from cramswarm.swarm.wire import request, unpack

MOVES_FILE = "moves.jsonl"  # in the run's folder: one line per move event, appended by the moving peer


def load_key(run_id: str, stage: int) -> str:
    """DHT key of a stage's load records (sub-key: peer uid)."""
    return f"{run_id}_load{stage}"


def claims_key(run_id: str, period: int) -> str:
    """DHT key of the move claims of one period (sub-key: the claiming peer's uid)."""
    return f"{run_id}_claims{period}"


def last_move_key(run_id: str) -> str:
    """DHT key of the swarm's latest move (decided, then arrived): the cool-down every peer reads."""
    return f"{run_id}_lastmove"


async def read_loads(node, run_id: str, stages: int, period: int) -> tuple[dict[int, list[PeerLoad]] | None,
                                                                         list[str], int]:
    """(every stage's period-``period`` loads or None, the declared peers whose record is missing, the values that
    are no ``LoadRecord``). The loads are None unless every declared peer published one. The stages' load and stage
    records are read at once (one round trip over a slow link, not one per key)."""
    found = await asyncio.gather(*(node.get(load_key(run_id, s), latest=True) for s in range(stages)))
    declared = await asyncio.gather(*(stage_records(node, run_id, s) for s in range(stages)))
    loads, malformed = {}, 0
    for stage, load, peers in zip(range(stages), found, declared):
        entries = load.value if load is not None and isinstance(load.value, dict) else {}
        parsed = {uid: LoadRecord.from_value(e.value) for uid, e in entries.items()}
        malformed += sum(r is None for r in parsed.values())
        records = {uid: r for uid, r in parsed.items() if r is not None and r.period == period}
        missing = sorted(set(peers) - set(records))
        if missing:
            return None, missing, malformed
        loads[stage] = [r.peer_load(uid) for uid, r in sorted(records.items()) if uid in peers]
    return loads, [], malformed


def decide_delay_s(period_s: float) -> float:
    """How long after a period's end the peers read its records (and, once more, the claims)."""
    return min(0.3 * period_s, 2.0)


def moved_uid(uid: str, to_stage: int, moves: int) -> str:
    """The uid of a peer after its ``moves``-th move: the launcher's ``s<stage>p<n>`` keeps its ``p<n>`` (the
    process) and names the new stage and the move (``s1p2m1``); any other uid gets the suffix."""
    match = re.fullmatch(r"s\d+(p\d+)(m\d+)?", uid)
    return f"s{to_stage}{match.group(1)}m{moves}" if match else f"{uid}-s{to_stage}m{moves}"


def read_move_events(moves_file: Path) -> list[MoveEvent]:
    """The events of the moves file's complete lines, in order (none without the file). A line that holds no
    ``MoveEvent`` (garbage, another layout) is skipped; the last line, while it is being written (no newline
    yet), is left for a later read."""
    text = moves_file.read_text() if moves_file.exists() else ""
    events = []
    for line in text.split("\n")[:-1]:
        try:
            event = MoveEvent.from_value(json.loads(line))
        except ValueError:
            continue
        if event is not None:
            events.append(event)
    return events


def stage_after_moves(moves_file: Path, uid: str, stage: int) -> tuple[str, int]:
    """The uid and stage a peer process last served: ``uid`` (serving ``stage``) followed through the moves file
    (``read_move_events``: a decided move names the new stage, an arrival the new uid)."""
    for event in read_move_events(moves_file):
        if event.move.uid == uid:
            stage = event.move.to_stage
            if event.event == "arrived":
                uid = event.new_uid
    return uid, stage


def call_units(method: str, samples: int, last_stage: bool) -> float:
    """Work units of one served call (``rebalancing.WORK_UNITS``)."""
    return samples * WORK_UNITS["last" if method == "backward" and last_stage else method]


class PeerRebalancer:
    """One stage peer's rebalancing loop (a background task of ``SyncingStagePeer``; see the module docstring)."""

    def __init__(self, peer, period_s: float, *, cooldown_periods: int = MoveGate.cooldown_periods):
        self.peer, self.period_s = peer, period_s
        self.missing: list[str] = []   # the uids the last incomplete view lacked a record of
        self.delay_s = decide_delay_s(period_s)
        # the timing rule of every driver; a move record older than transit_s no longer holds decisions
        self.gate = MoveGate(cooldown_periods, TRANSIT_GIVE_UPS * peer.cfg.retry.give_up_after_s)
        self.run_id, self.node = peer.run_id, peer.node

    # -- records ----------------------------------------------------------------------------------------------
    def _malformed(self, count: int = 1) -> None:
        """Count records read that hold none of the type expected there (``malformed_rebalance_records``)."""
        if count:
            counters = self.peer.counters
            counters["malformed_rebalance_records"] = counters.get("malformed_rebalance_records", 0) + count

    async def publish(self, period: int, window: dict) -> None:
        """Store this peer's ``LoadRecord`` of period ``period`` (its meter's ``window``)."""
        await self.node.store(load_key(self.run_id, self.peer.stage), subkey=self.peer.uid,
                              value=LoadRecord.from_window(period, window).value(),
                              expiration_time=(period + 2) * self.period_s)

    async def view(self, period: int) -> dict[int, list[PeerLoad]] | None:
        """Every stage's period-``period`` loads; None unless every declared peer published one (``read_loads``; a
        value that is no ``LoadRecord`` counts as missing, and as malformed)."""
        loads, self.missing, malformed = await read_loads(self.node, self.run_id, self.peer.num_stages, period)
        self._malformed(malformed)
        return loads

    async def quiet(self, period: int) -> bool:
        """Whether the last move holds decisions back (``rebalancing.MoveGate``: in transit, or period ``period`` did
        not end after its arrival plus ``cooldown_periods``). A value that is no ``LastMove`` is counted as
        malformed and holds nothing back."""
        found = await self.node.get(last_move_key(self.run_id), latest=True)
        last = None if found is None else LastMove.from_value(found.value)
        self._malformed(int(found is not None and last is None))
        return self.gate.quiet(last, period, get_dht_time())

    async def claim(self, period: int, move) -> bool:
        """Claim period ``period``'s move; True if this peer's claim has the smallest uid hash once all are read (a
        value that is no ``ClaimRecord`` claims nothing and is counted as malformed)."""
        key = claims_key(self.run_id, period)
        await self.node.store(key, subkey=self.peer.uid, value=ClaimRecord(move.to_stage).value(),
                              expiration_time=(period + 4) * self.period_s)
        await asyncio.sleep(self.delay_s)
        found = await self.node.get(key, latest=True)
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        claimants = [uid for uid, e in entries.items()
                     if isinstance(uid, str) and ClaimRecord.from_value(e.value) is not None]
        self._malformed(len(entries) - len(claimants))
        return min(claimants + [self.peer.uid], key=_uid_hash) == self.peer.uid

    def log_move(self, event: MoveEvent) -> None:
        """Append ``event`` to the run's moves file (one line)."""
        with open(Path(self.peer.workdir) / MOVES_FILE, "a") as out:
            out.write(json.dumps(event.value()) + "\n")

    # -- the loop ---------------------------------------------------------------------------------------------
    async def publish_every_period(self) -> None:
        """At each period's start: close the meter's window and publish it. A task of its own, so a decision round
        that overruns its period (slow DHT reads over a slow link, a busy host) never costs a period's record (a
        peer that skipped periods would leave every view incomplete)."""
        peer = self.peer
        while True:
            period = math.floor(get_dht_time() / self.period_s) + 1
            await asyncio.sleep(max(period * self.period_s - get_dht_time(), 0.0))
            window = peer.meter.window(time.monotonic())
            peer.counters["load"] = {"period": period, **window}
            try:
                await self.publish(period, window)
            except Exception as e:  # a DHT hiccup: this period's record is missing, the views of it incomplete
                print(f"[{peer.uid}] load record of period {period} not stored: {e!r}", flush=True)

    async def run(self) -> None:
        """Publish every period (``publish_every_period``), and read, decide every period; returns (with
        ``peer.migrate_to`` set) once this peer moves. A round that ends after the next period's reading time
        skips to the latest period whose reading time has not passed."""
        peer = self.peer
        arrival: MoveEvent | None = getattr(peer, "arrived_from", None)   # the decided move, its drain done
        if arrival is not None:  # this peer just moved here: the move is over, the cool-down starts
            period = math.floor(get_dht_time() / self.period_s)
            await self.node.store(last_move_key(self.run_id),
                                  LastMove(arrival.period, get_dht_time(), arrived=period, move=arrival.move).value(),
                                  get_dht_time() + 3600)
            self.log_move(replace(arrival, event="arrived", time=time.time(), new_uid=peer.uid))
        publisher = asyncio.create_task(self.publish_every_period())
        try:
            move, period = await self.next_move()
            publisher.cancel()   # this peer leaves its stage: no more records under it
            decided = MoveEvent("decided", time.time(), move, period)
            self.log_move(decided)
            print(f"[{peer.uid}] moving from stage {move.from_stage} to {move.to_stage} (period {period})",
                  flush=True)
            drain_s, handed, lost = await self.leave()
            peer.migrate_to.set_result((move.to_stage, replace(decided, drain_s=drain_s, handed_over_samples=handed,
                                                               lost_gradient_samples=lost)))
        finally:
            publisher.cancel()

    async def next_move(self):
        """Read and decide each period ``decide_delay_s`` after it started, until this peer is the one to move and
        its claim won: returns (move, period), the move recorded as in transit under ``last_move_key``."""
        peer = self.peer
        while True:
            now = get_dht_time()
            period = math.floor((now - self.delay_s) / self.period_s) + 1
            await asyncio.sleep(max(period * self.period_s + self.delay_s - get_dht_time(), 0.0))
            try:
                move = await self.decide(period)
                if move is None or move.uid != peer.uid or not await self.claim(period, move):
                    continue
                await self.node.store(last_move_key(self.run_id), LastMove(period, get_dht_time(), move=move).value(),
                                      get_dht_time() + 3600)
            except Exception as e:  # a DHT hiccup: this period is skipped
                print(f"[{peer.uid}] rebalancing round {period} failed: {e!r}", flush=True)
                continue
            return move, period

    async def decide(self, period: int):
        """The period's move, or None: also while the last move holds decisions back and once the launcher asked
        for the last, partial batch (training is over)."""
        if await self.quiet(period) or await self.peer._flushing():
            return None
        loads = await self.view(period)
        if loads is None:  # a record may still be on its way (a slow link, a busy host): read once more
            await asyncio.sleep(self.delay_s)
            loads = await self.view(period)
            counters = self.peer.counters
            if loads is None:   # counted, with the uids whose records were missing (dead peers, or late ones)
                counters["incomplete_views"] = counters.get("incomplete_views", 0) + 1
                missing = counters.setdefault("incomplete_view_missing", {})
                for uid in self.missing:
                    missing[uid] = missing.get(uid, 0) + 1
                return None
            counters["late_views"] = counters.get("late_views", 0) + 1
        return choose_move(loads)

    async def leave(self) -> tuple[float, int, int]:
        """Stop serving this stage: refuse new calls, withdraw the stage record, let the admitted calls finish, hand
        the held gradients to a replica that stays (else let them go into the stage's step). Returns (seconds it
        took, gradient samples handed over, gradient samples dropped)."""
        peer, started = self.peer, time.monotonic()
        peer.leaving = True
        try:  # else its record expires (RECORD_TTL_S); until then the trainers' calls are refused and re-sent
            await self.node.store(stage_key(self.run_id, peer.stage), subkey=peer.uid, value=False,
                                  expiration_time=get_dht_time() + RECORD_TTL_S + 1.0)
        except Exception as e:
            print(f"[{peer.uid}] could not withdraw its stage record: {e!r}", flush=True)
        deadline = started + 4 * peer.sync_timeout_s

        while time.monotonic() < deadline and peer.busy():   # calls waiting or computing, or a step under way
            await asyncio.sleep(0.05)
        handed = 0
        if not peer.busy():  # hand what it holds to a replica that stays, as the emulation's mover does
            handed = await hand_over(peer, max(deadline - time.monotonic(), 1.0))
        while time.monotonic() < deadline and (peer.busy() or peer._held_samples()):  # else the stage's step takes it
            await asyncio.sleep(0.05)
        lost = peer._held_samples()
        peer.counters["lost_gradient_samples"] += lost
        return round(time.monotonic() - started, 3), handed, lost


async def hand_over(peer, timeout_s: float) -> int:
    """Give the gradients a leaving ``peer`` accumulated since its last step to another replica of its stage, the
    first (by uid) that accepts (its ``rpc_handover``): a peer that leaves its stage loses no samples and need not
    wait for the stage's step. Only between steps. Returns the samples handed over; what no replica took stays
    with ``peer`` (restored, if still at the same step)."""
    records = await stage_records(peer.node, peer.run_id, peer.stage)
    heirs = sorted(uid for uid in records if uid != peer.uid)
    if not heirs or peer.replica.local_samples == 0 or peer.busy():   # checked after the last await before the take
        return 0
    tensors, meta = await peer._run(peer._take_held)
    for uid in heirs:
        stub = type(peer).get_stub(peer.node.p2p, PeerID.from_base58(records[uid][0]), namespace=peer.namespace)
        try:
            _, reply = await asyncio.wait_for(unpack(await stub.rpc_handover(request(tensors, meta))), timeout_s)
        except Exception as e:
            print(f"[{peer.uid}] handing its gradients to {uid} failed: {e!r}", flush=True)
            continue
        if reply.get("status") == "ok":
            peer.counters["handed_over_samples"] += int(meta["samples"])
            print(f"[{peer.uid}] handed {meta['samples']} samples' gradients to {uid}", flush=True)
            await peer._publish()   # its record no longer counts them
            return int(meta["samples"])
        print(f"[{peer.uid}] {uid} refused its gradients: {reply.get('reason')}", flush=True)
    if peer.ready is not None or (await peer._run(peer._add_held, tensors, meta))["status"] != "ok":
        peer.counters["lost_gradient_samples"] += int(meta["samples"])   # the stage stepped meanwhile
    return 0
