"""Rebalancing decided by the stage peers (``peer_rebalance``): the peer's own load measurement, the DHT-facing
driver on a fake DHT, and a starved stage recovered on real hivemind processes under the launcher (the decision
rule itself, ``rebalancing.choose_move``, is tested in test_swarm_policies)."""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import replace
from types import SimpleNamespace

import pytest

from cramswarm.swarm.rebalancing import LoadMeter, _uid_hash

pytest.importorskip("hivemind", reason="hivemind is not installed: the peers' rebalancing is untested")

from hivemind.utils import ValueWithExpiration, get_dht_time  # noqa: E402
from swarm_helpers import MICRO, brief, launch, process_config  # noqa: E402

from cramswarm.swarm.membership import stage_key  # noqa: E402
from cramswarm.swarm.peer_rebalance import (  # noqa: E402
    MOVES_FILE,
    PeerRebalancer,
    call_units,
    claims_key,
    last_move_key,
    load_key,
    moved_uid,
    read_move_events,
    stage_after_moves,
)
from cramswarm.swarm.rebalancing import LastMove, LoadRecord, Move, MoveEvent  # noqa: E402
from cramswarm.swarm.run_result import RunResult  # noqa: E402


def test_a_served_call_counts_its_work_units():
    assert call_units("forward", 4, False) == 4 and call_units("backward", 4, False) == 8
    assert call_units("backward", 4, True) == 12  # the last stage's fused forward + backward


def move_events() -> list[MoveEvent]:
    """Two peers' moves: s0r1.0 decided 0 -> 1; s0r2.0 decided 0 -> 1, arrived as s0r2.0-s1m1, decided 1 -> 2."""
    first = MoveEvent("decided", 10.0, Move("s0r2.0", 0, 1), 3)
    arrived = replace(first, event="arrived", time=12.0, new_uid="s0r2.0-s1m1", drain_s=0.5, handed_over_samples=4)
    return [MoveEvent("decided", 9.0, Move("s0r1.0", 0, 1), 3), first, arrived,
            MoveEvent("decided", 20.0, Move("s0r2.0-s1m1", 1, 2), 9)]


def test_the_moves_file_reads_back_its_complete_lines_and_skips_garbage(tmp_path):
    """``read_move_events``: the ``MoveEvent`` of each complete line, in order; a line of another layout or garbage
    is skipped, the last line while it is being written (no newline yet) left for a later read."""
    path = tmp_path / MOVES_FILE
    assert read_move_events(path) == []
    events = move_events()
    lines = [json.dumps(e.value()) for e in events]
    garbage = ["not json", "", json.dumps({"event": "decided", "uid": "s0r9.0"}), json.dumps([1, 2]), "null"]
    path.write_text("\n".join(lines[:2] + garbage + lines[2:]) + "\n" + lines[0][:20])
    assert read_move_events(path) == events
    with open(path, "a") as out:   # the half-written line is completed
        out.write(lines[0][20:] + "\n")
    assert read_move_events(path) == events + [events[0]]


def test_a_peer_process_is_followed_through_its_moves_to_the_stage_it_last_served(tmp_path):
    """An attached task restarts its dead peer where the peer last served: the uid's moves in the moves file,
    decided (new stage) and arrived (new uid), other peers' moves and a half-written last line ignored."""
    path = tmp_path / MOVES_FILE
    assert stage_after_moves(path, "s0r2.0", 0) == ("s0r2.0", 0)   # no file: no move
    path.write_text("".join(json.dumps(e.value()) + "\n" for e in move_events()) + '{"event": "arr')
    assert stage_after_moves(path, "s0r2.0", 0) == ("s0r2.0-s1m1", 2)   # decided, not yet arrived: stage 2
    assert stage_after_moves(path, "s0r3.0", 0) == ("s0r3.0", 0)


def test_the_result_lists_each_move_with_its_arrival():
    """``RunResult._moves``: a decided event opens a move, its arrival completes it (times from the run's start)."""
    launcher = SimpleNamespace(_move_events=move_events, moves_base=1, start_wall=5.0)
    assert RunResult._moves(launcher) == [
        {"t_s": 5.0, "uid": "s0r2.0", "from_stage": 0, "to_stage": 1, "period": 3, "arrived_s": 7.0,
         "new_uid": "s0r2.0-s1m1", "drain_s": 0.5, "handed_over_samples": 4, "lost_gradient_samples": 0},
        {"t_s": 15.0, "uid": "s0r2.0-s1m1", "from_stage": 1, "to_stage": 2, "period": 9}]


def test_a_moved_peer_keeps_its_process_number_in_its_new_uid():
    assert moved_uid("s0p2", 1, 1) == "s1p2m1"
    assert moved_uid("s1p2m1", 0, 2) == "s0p2m2"
    assert moved_uid("custom", 3, 1) == "custom-s3m1"


@pytest.mark.swarm
def test_peers_move_one_of_their_own_to_a_starved_stage_and_throughput_recovers():
    # stage 0: two peers of speed 0.25; stage 1: one of speed 0.025 (the bottleneck: a tenth of stage 0's rate)
    total = 160
    _, stats = launch(total, peers_per_stage=[2, 1], trainers=3, peer_speeds=[0.25, 0.25, 0.025],
                      rebalance_period_s=3.0)
    moves = stats["moves"]
    assert moves and (moves[0]["from_stage"], moves[0]["to_stage"]) == (0, 1), moves
    assert stats["moves_completed"] == len(moves), moves
    first = moves[0]
    # the mover drained: it let its admitted calls finish and handed its gradients to a replica that stays (or
    # they went into a step) before it left
    assert first["lost_gradient_samples"] == 0 and first["handed_over_samples"] >= 0, first
    # it serves stage 1 at the end, in step with the replica it downloaded the state from
    assert first["new_uid"] in stats["replica_steps"][1], stats["replica_steps"]
    # no peer was moved back to stage 0 (the gain margin: no ping-pong)
    assert all((m["from_stage"], m["uid"]) != (1, first["new_uid"]) for m in moves), moves
    # throughput from the trainers' logs: before the move (from the first microbatch done) vs after the arrival
    times = stats["microbatch_done_s"]
    before = [t for t in times if t <= first["t_s"]]
    after = [t for t in times if t > first["arrived_s"]]
    assert len(before) >= 5 and len(after) >= 40, (len(before), len(after), moves)
    rate_before = (len(before) - 1) / (before[-1] - before[0])
    rate_after = (len(after) - 1) / (after[-1] - after[0])
    assert rate_after > 1.2 * rate_before, (rate_before, rate_after, brief(stats))
    # the refused calls were re-sent: every microbatch was done once (launch checks that). Gradients: a re-sent
    # backward call may count twice on a stage; a replica left out of a step (the slow one of stage 1, whose
    # calls take seconds here) downloads the state and drops what it held, at most a global batch per resync
    batch = 4 * MICRO
    assert all(-stats["retries"] * MICRO <= n <= stats["resyncs"] * batch for n in stats["lost_gradient_samples"]), \
        brief(stats)


class FakeDHT:
    """A DHT node's store/get as the peers use them: per key, a value or sub-key -> value; of two stores under
    one (key, sub-key) the later expiration wins; expired entries are not returned."""

    def __init__(self):
        self.data: dict = {}

    async def store(self, key, value, expiration_time, subkey=None):
        slot = self.data.setdefault(key, {})
        old = slot.get(subkey)
        if old is not None and old.expiration_time > expiration_time:
            return False
        slot[subkey] = ValueWithExpiration(value, expiration_time)
        return True

    async def get(self, key, latest=True):
        now = get_dht_time()
        slot = {k: v for k, v in self.data.get(key, {}).items() if v.expiration_time >= now}
        if not slot:
            return None
        if None in slot:
            return slot[None]
        return ValueWithExpiration(slot, max(v.expiration_time for v in slot.values()))


class FakePeer:
    """What ``PeerRebalancer`` reads of a ``SyncingStagePeer``."""

    def __init__(self, node, uid: str, stage: int, tmp_path):
        self.node, self.uid, self.stage, self.run_id, self.num_stages = node, uid, stage, "run", 2
        self.cfg, self.sync_timeout_s, self.workdir = process_config(workdir=tmp_path), 5.0, tmp_path
        self.counters = {"lost_gradient_samples": 0}
        self.leaving, self.ready = False, None

    def _held_samples(self) -> int:
        return 0

    async def _flushing(self) -> bool:
        return False


async def declare(node, stage: int, uid: str) -> None:
    await node.store(stage_key("run", stage), "peer-id", get_dht_time() + 60, subkey=uid)


def test_the_driver_decides_only_on_a_complete_view_and_one_claim_wins(tmp_path):
    async def scenario():
        node = FakeDHT()
        uids = {"s0p1": 0, "s0p2": 0, "s0p3": 0, "s1p4": 1}
        peers = {uid: PeerRebalancer(FakePeer(node, uid, stage, tmp_path), period_s=1.0) for uid, stage in
                 uids.items()}
        for uid, stage in uids.items():
            await declare(node, stage, uid)
        period = int(get_dht_time()) + 1
        window = {"queue": 0.0, "units": 0.0, "busy_s": 0.0, "calls": 0, "span_s": 1.0}
        for uid in ("s0p1", "s0p2", "s0p3"):
            await peers[uid].publish(period, window | {"rate": 1.0})
        assert await peers["s0p1"].view(period) is None  # s1p4 has not published this period yet
        assert await peers["s0p1"].decide(period) is None   # nor after the second read
        counters = peers["s0p1"].peer.counters
        assert counters["incomplete_views"] == 1 and counters["incomplete_view_missing"] == {"s1p4": 1}

        async def late_publish():   # arrives between the first read of the view and the second
            await asyncio.sleep(peers["s1p4"].delay_s / 2)
            await peers["s1p4"].publish(period, window | {"rate": 0.25, "queue": 2.0})

        late, _ = await asyncio.gather(peers["s0p2"].decide(period), late_publish())
        assert late is not None and peers["s0p2"].peer.counters["late_views"] == 1
        moves = {uid: await p.decide(period) for uid, p in peers.items()}
        assert len(set(moves.values())) == 1  # every peer computes the same move
        move = moves["s1p4"]
        assert (move.from_stage, move.to_stage) == (0, 1) and move.uid in ("s0p1", "s0p2", "s0p3")
        # a peer with another view believes itself the mover too: both claim, one wins
        other = next(uid for uid in ("s0p1", "s0p2", "s0p3") if uid != move.uid)
        claims = await asyncio.gather(peers[move.uid].claim(period, move), peers[other].claim(period, move))
        winner = min((move.uid, other), key=_uid_hash)
        assert claims == [winner == move.uid, winner == other]
        # a withdrawn stage record (the mover's tombstone) drops the peer from the view
        await node.store(stage_key("run", 0), False, get_dht_time() + 61, subkey=move.uid)
        view = await peers["s1p4"].view(period)
        assert sorted(p.uid for p in view[0]) == sorted(set(uids) - {move.uid, "s1p4"})

    asyncio.run(scenario())


def test_a_peer_whose_decision_rounds_overrun_the_period_still_publishes_every_period(tmp_path):
    """Reading the DHT may take longer than a period (slow links, a busy host): the peer's load record must still
    go out every period, else it publishes every other period, out of step with the rest, and no view is ever
    complete again (a testbed run's first move came at 64 s instead of 16 s this way)."""
    period_s = 0.4

    class SlowDHT(FakeDHT):
        async def get(self, key, latest=True):
            if "_load" in key:   # a decision round: about 1.5 periods of reads
                await asyncio.sleep(0.3)
            return await super().get(key, latest)

    async def scenario():
        node = SlowDHT()
        published: dict[str, list[int]] = {"s0p1": [], "s1p2": []}
        drivers = []
        for uid, stage in (("s0p1", 0), ("s1p2", 1)):
            await declare(node, stage, uid)
            peer = FakePeer(node, uid, stage, tmp_path)
            peer.meter = LoadMeter(now=0.0)
            driver = PeerRebalancer(peer, period_s=period_s)
            original = driver.publish

            async def publish(period, window, uid=uid, original=original):
                published[uid].append(period)
                await original(period, window)

            driver.publish = publish
            drivers.append(asyncio.create_task(driver.run()))
        await asyncio.sleep(8 * period_s)
        for task in drivers:
            task.cancel()
        await asyncio.gather(*drivers, return_exceptions=True)
        for periods in published.values():   # consecutive periods, none skipped
            assert len(periods) >= 6 and periods == list(range(periods[0], periods[0] + len(periods))), published
        return published

    asyncio.run(scenario())


def test_the_last_move_holds_decisions_back_in_transit_and_until_a_period_after_its_arrival(tmp_path):
    async def scenario():
        node = FakeDHT()
        driver = PeerRebalancer(FakePeer(node, "s0p1", 0, tmp_path), period_s=1.0)
        assert driver.gate.transit_s == 60.0   # twice the trainers' give-up (30 s)
        assert not await driver.quiet(10)
        moved = {"uid": "s0p2", "from_stage": 0, "to_stage": 1, "period": 9}
        await node.store(last_move_key("run"), {**moved, "arrived": None, "t": get_dht_time()},
                         get_dht_time() + 3600)
        assert await driver.quiet(10)  # in transit
        await node.store(last_move_key("run"), {**moved, "arrived": None, "t": get_dht_time() - 61.0},
                         get_dht_time() + 3601)
        assert not await driver.quiet(10)  # in transit for longer than the bound: the mover died on its way
        await node.store(last_move_key("run"), {**moved, "arrived": 10, "t": get_dht_time()},
                         get_dht_time() + 3602)
        assert await driver.quiet(10) and not await driver.quiet(11)   # the next period's loads show the mover
        cooling = PeerRebalancer(FakePeer(node, "s0p3", 0, tmp_path), period_s=1.0, cooldown_periods=1)
        assert await cooling.quiet(11) and not await cooling.quiet(12)

    asyncio.run(scenario())


def test_a_value_that_is_no_record_is_counted_and_never_decides(tmp_path):
    """A load value that is no ``LoadRecord`` counts as the peer's missing record (no decision on that view), a
    claim value that is no ``ClaimRecord`` claims nothing, a last-move value that is no ``LastMove`` holds
    nothing back; each is counted in ``malformed_rebalance_records``."""
    async def scenario():
        node = FakeDHT()
        uids = {"s0p1": 0, "s0p2": 0, "s1p3": 1}
        peers = {uid: PeerRebalancer(FakePeer(node, uid, stage, tmp_path), period_s=1.0) for uid, stage in
                 uids.items()}
        for uid, stage in uids.items():
            await declare(node, stage, uid)
        period = int(get_dht_time()) + 1
        window = {"queue": 0.0, "units": 0.0, "busy_s": 0.0, "calls": 0, "span_s": 1.0, "rate": 1.0}
        for uid in ("s0p1", "s0p2"):
            await peers[uid].publish(period, window)
        stored = node.data[load_key("run", 0)]["s0p1"].value
        assert LoadRecord.from_value(stored) == LoadRecord.from_window(period, window)
        await node.store(load_key("run", 1), {"period": period, "queue": -1.0, "rate": 0.25}, period + 1.0,
                         subkey="s1p3")
        driver = peers["s0p1"]
        assert await driver.view(period) is None and driver.missing == ["s1p3"]
        assert driver.peer.counters["malformed_rebalance_records"] == 1
        await peers["s1p3"].publish(period, window | {"rate": 0.25, "queue": 2.0})
        assert await driver.view(period) is not None
        # garbage under the last-move key: counted, holds nothing back
        await node.store(last_move_key("run"), {"period": "9", "t": get_dht_time()}, get_dht_time() + 3600)
        assert not await driver.quiet(period)
        assert driver.peer.counters["malformed_rebalance_records"] == 2
        # a garbage claim with the smaller uid hash does not beat a real one
        move = await driver.decide(period)
        assert move is not None
        mover = peers[move.uid]
        rival = next(uid for i in itertools.count() if _uid_hash(uid := f"r{i}") < _uid_hash(move.uid))
        await node.store(claims_key("run", period), {"to": "1"}, period + 4.0, subkey=rival)
        before = mover.peer.counters.get("malformed_rebalance_records", 0)
        assert await mover.claim(period, move)
        assert mover.peer.counters["malformed_rebalance_records"] == before + 1
        await node.store(claims_key("run", period), {"to": 1}, period + 5.0, subkey=rival)
        assert not await mover.claim(period, move)   # a real claim with the smaller hash wins

    asyncio.run(scenario())


def test_an_arrived_mover_records_its_arrival_in_the_moves_file_and_the_dht(tmp_path):
    """The moved peer's driver (``arrived_from``: the decided move, its drain over) appends the arrival to the
    moves file and stores the move as arrived under ``last_move_key``: the gate holds this period back only."""
    async def scenario():
        node = FakeDHT()
        peer = FakePeer(node, "s1p2m1", 1, tmp_path)
        peer.meter = LoadMeter(now=0.0)
        decided = MoveEvent("decided", 100.0, Move("s0p2", 0, 1), 7)
        peer.arrived_from = replace(decided, drain_s=0.5, handed_over_samples=4, lost_gradient_samples=0)
        driver = PeerRebalancer(peer, period_s=1.0)
        task = asyncio.create_task(driver.run())
        await asyncio.sleep(0.2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        (event,) = read_move_events(tmp_path / MOVES_FILE)
        assert event == replace(peer.arrived_from, event="arrived", time=event.time, new_uid="s1p2m1")
        last = LastMove.from_value((await node.get(last_move_key("run"))).value)
        assert last.move == Move("s0p2", 0, 1) and last.period == 7 and last.arrived is not None
        assert await driver.quiet(last.arrived) and not await driver.quiet(last.arrived + 1)

    asyncio.run(scenario())
