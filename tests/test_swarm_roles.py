"""The launcher's roles (trainers, stage peers, the launcher) tested piece by piece: their records, shards,
step rules, reruns and refusals, with stand-ins and short-lived processes. Whole runs under the
launcher, with SIGKILLs of each role, are in test_swarm_launcher.py."""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("hivemind", reason="hivemind is not installed: transport 1 (real hivemind processes) is untested")

from conftest import impl, recipe  # noqa: E402
from swarm_helpers import (  # noqa: E402
    MICRO,
    batches,
    plan,
    process_config,
    source,
)

from cramswarm.swarm import hivemind_transport as ht  # noqa: E402
from cramswarm.swarm import launcher as launcher_mod  # noqa: E402
from cramswarm.swarm import run_result, run_state  # noqa: E402
from cramswarm.swarm.processes import PeerProcess, ProcessGroups  # noqa: E402
from cramswarm.swarm.progress import (  # noqa: E402
    CLOCK_FILE,
    DHT_ROUNDS,
    GATHER_S,
    PROGRESS_TTL_S,
    GatherView,
    ProgressRecord,
    catch_up_source,
    collective_samples,
    overshoot,
    read_clock,
    record_window_s,
    stage_stalls,
    step_target,
)
from cramswarm.swarm.routing import (
    NoPeersError,  # noqa: E402
    RetryPolicy,  # noqa: E402
)
from cramswarm.swarm.settings import SwarmPlan  # noqa: E402
from cramswarm.swarm.shards import ForeignShard, load_shard, newest_shard, shard_files, write_shard  # noqa: E402
from cramswarm.swarm.train import UNBOUNDED  # noqa: E402
from cramswarm.swarm.work import WorkOrder  # noqa: E402

TESTS = Path(__file__).resolve().parent


def test_each_peer_class_calls_its_own_handlers_whichever_built_its_stub_first():
    """With StagePeer's stub built first (as by an earlier test in one pytest process), the launcher's peers must
    still reach SyncingStagePeer's handlers: hivemind caches handlers per class, and a subclass must not inherit
    them."""
    from cramswarm.swarm.hivemind_peer import StagePeer
    from cramswarm.swarm.peer_sync import SyncingStagePeer

    StagePeer._collect_rpc_handlers()
    SyncingStagePeer._collect_rpc_handlers()
    assert SyncingStagePeer._stub_type is not StagePeer._stub_type
    assert SyncingStagePeer._stub_type.__name__ == "SyncingStagePeerStub"
    assert SyncingStagePeer._get_handle_name("ns", "rpc_state") == "ns::SyncingStagePeer.rpc_state"


def test_step_targets_follow_the_ramp():
    recipe = plan().recipe | {"batch_ramp_fraction": 0.5, "budget": {"unit": "steps", "value": 10}}
    # steps budget: progress = steps / 10; the batch grows from 1 micro-batch to 4 over the first half
    assert step_target(recipe, 32, 0, 0) == (0.0, MICRO)
    assert step_target(recipe, 32, 0, 5) == (0.5, 4 * MICRO)
    assert step_target(recipe, 32, 0, 2)[1] == (1 + int(0.2 / 0.5 * 4)) * MICRO
    # Cramming v1's ramp counted in micro-batch steps (pretrain's rule, training.step_accumulation): it follows the
    # stage's stepped samples, whatever the budget's progress
    v1 = recipe | {"batch_ramp_micro_steps": 8}
    assert [step_target(v1, 32, n * MICRO, 5)[1] for n in (0, 2, 4, 8)] == [MICRO, 2 * MICRO, 3 * MICRO, 4 * MICRO]


def test_a_replica_downloading_a_step_is_waited_for_and_never_downloaded_from():
    """The in-stage step's catch-up rules (peer_sync): a replica behind downloads the most advanced settled
    replica's state, publishing a ``joining`` record meanwhile; the peers at that step count it as on its way
    (their group is not complete until it has arrived and is ready), and nobody downloads from it."""
    def as_records(recs: dict) -> dict[str, ProgressRecord]:
        return {uid: ProgressRecord(**fields) for uid, fields in recs.items()}

    def cus(recs: dict, *args):
        return catch_up_source(as_records(recs), *args)

    def view(recs: dict, *args, **kwargs):
        return GatherView(as_records(recs), *args, **kwargs)

    rec = {"a": {"step": 5, "samples": 8, "digest": "x", "ready": True},
           "b": {"step": 4, "samples": 0, "digest": "y", "joining": 5},
           "c": {"step": 3, "samples": 4, "digest": "z"}}
    # c is behind: it downloads a's state (b, though at a later step than c, is itself downloading)
    assert cus(rec, "c", 3, "z") == ("a", False)
    # a joiner never serves, even as the only replica ahead
    assert cus({"b": rec["b"], "c": rec["c"]}, "c", 3, "z") == (None, False)
    # the reference replica at the same step (lowest settled uid) with another digest: a mismatch
    same = {"a": {"step": 5, "digest": "x"}, "d": {"step": 5, "digest": "w"}}
    assert cus(same, "d", 5, "w") == ("a", True)
    assert cus(same, "a", 5, "x") == (None, False)
    assert cus(same | {"a": same["a"] | {"joining": 5}}, "d", 5, "w") == (None, False)

    first = view(rec, 5, me="a")
    assert (first.passed, sorted(first.at_step), sorted(first.ready), first.joining) == (False, ["a"], ["a"], ["b"])
    assert not first.complete()   # b is on its way to step 5: a waits for it rather than stepping alone
    # arrived: still joining until its ready record (its first gather) is published
    arrived = view(rec | {"b": {"step": 5, "samples": 0, "digest": "x", "joining": 5}}, 5, me="a")
    assert arrived.joining == ["b"] and sorted(arrived.at_step) == ["a"] and not arrived.complete()
    member = view(rec | {"b": {"step": 5, "samples": 0, "digest": "x"}}, 5, me="a")
    assert member.joining == [] and member.unready == ["b"] and not member.complete()   # a member not yet ready
    assert view(rec | {"b": {"step": 5, "samples": 0, "digest": "x"}}, 5, me="b").unready == []  # not itself
    both = view(rec | {"b": {"step": 5, "samples": 0, "digest": "x", "ready": True}}, 5, me="a")
    assert both.complete() and sorted(both.ready) == ["a", "b"]
    # a joiner at a later step does not count as a replica past this one; a settled one does
    assert not view({"b": {"step": 4, "joining": 6}}, 5).passed
    assert view({"e": {"step": 6}}, 5).passed
    # a member of the last group still applying it (its record shows the step before) is awaited
    assert view(rec | {"e": {"step": 4, "digest": "y"}}, 5, me="a").behind == ["e"]
    # a replica re-downloading its own step (digest mismatch) is on its way, not a member yet
    mismatch = view({"a": rec["a"], "d": {"step": 5, "digest": "w", "joining": 5}}, 5, me="a")
    assert sorted(mismatch.at_step) == ["a"] and mismatch.joining == ["d"] and not mismatch.complete()
    # a joiner that arrived and got ready may still read its own joining record back: it does not wait for itself
    assert view({"a": rec["a"], "d": {"step": 5, "digest": "w", "joining": 5}}, 5, me="d").complete()


def test_a_peer_publishes_its_record_every_period_while_its_sync_loop_is_busy_and_later_records_expire_later():
    """``publish_forever`` stores the peer's record every period whatever its synchronisation loop is doing (an
    all-reduce or a state download of seconds over a slow link), each record expiring after the one before even
    when the peer's window shrinks, and a joining peer's record says which step it joins and counts no samples."""
    import asyncio

    from cramswarm.swarm.peer_sync import COUNTERS_PERIOD_S, SyncingStagePeer
    from cramswarm.swarm.progress import PROGRESS_PERIOD_S

    stored: list[tuple[float, dict, float]] = []
    written: list[float] = []   # the counters file, rewritten every COUNTERS_PERIOD_S

    class Node:
        async def store(self, key, subkey, value, expiration_time):
            stored.append((time.monotonic(), dict(value), expiration_time))

    class Peer:   # the record-keeping part of SyncingStagePeer, on a node that only records what it is given
        _publish, publish_forever, _record = SyncingStagePeer._publish, SyncingStagePeer.publish_forever, \
            SyncingStagePeer._record
        node, run_id, stage, uid, peer_id, step, stepped_samples, digest = Node(), "r", 1, "s1p3", "P", 4, 64, "d"
        ready, snapshot_mbs, round_s, record_expiration = None, [], 3.0, 0.0
        joining: int | None = 5

        def _held_samples(self):
            return 12

        def _rate(self):
            return 0.0

        def _write_counters(self):
            written.append(time.monotonic())

    async def run() -> None:
        peer = Peer()
        task = asyncio.create_task(peer.publish_forever())
        await asyncio.sleep(6 * PROGRESS_PERIOD_S)   # the sync loop would be downloading meanwhile
        peer.round_s, peer.joining = 0.0, None       # arrived; its window shrinks from 12 s to 2 s
        await asyncio.sleep(6 * PROGRESS_PERIOD_S)
        task.cancel()

    asyncio.run(run())
    gaps = [b[0] - a[0] for a, b in zip(stored, stored[1:])]
    assert len(stored) >= 9 and max(gaps) < 2 * PROGRESS_PERIOD_S, gaps
    expirations = [e for _, _, e in stored]
    assert all(b > a for a, b in zip(expirations, expirations[1:])), expirations
    joining = [v for _, v, _ in stored if "joining" in v]
    assert joining and all(v["joining"] == 5 and v.get("samples", 0) == 0 and v["step"] == 4 for v in joining)
    assert stored[-1][1]["samples"] == 12 and "joining" not in stored[-1][1]
    assert all(ProgressRecord.from_value(v).stepped == 64 for _, v, _ in stored)   # every one a valid record
    # and its counters file every COUNTERS_PERIOD_S (a peer cut off from its stage takes no step to write it at)
    assert len(written) == int(12 * PROGRESS_PERIOD_S // COUNTERS_PERIOD_S) and written[0] - stored[0][0] >= \
        COUNTERS_PERIOD_S, written


def test_a_steps_snapshot_runs_after_the_call_computing_and_before_the_calls_queued():
    """A step moves the accumulated gradients aside as soon as the call computing ends (``StagePeer._run_next``);
    the calls queued on the compute thread wait for it and count toward the next step. Before, the step waited for
    every call its peer had admitted, so at each step every replica waited for the slowest replica's queue."""
    from concurrent.futures import ThreadPoolExecutor

    from cramswarm.swarm.hivemind_peer import StagePeer

    class Peer:   # StagePeer's compute scheduling alone
        _run, _run_next, _in_turn, _first = StagePeer._run, StagePeer._run_next, StagePeer._in_turn, StagePeer._first

        def __init__(self):
            self.compute, self.next_thread = ThreadPoolExecutor(1), ThreadPoolExecutor(1)
            self.state_lock, self.next_waiting = threading.Lock(), False

    order: list[str] = []

    def job(name: str, seconds: float) -> str:
        order.append(f"{name} starts")
        time.sleep(seconds)
        order.append(f"{name} ends")
        return name

    async def main() -> list[str]:
        peer = Peer()
        computing = asyncio.ensure_future(peer._run(job, "call", 0.3))
        queued = [asyncio.ensure_future(peer._run(job, f"queued{i}", 0.02)) for i in range(3)]
        await asyncio.sleep(0.1)
        snapshot = await peer._run_next(job, "snapshot", 0.0)
        assert not peer.next_waiting
        return [snapshot] + list(await asyncio.gather(computing, *queued))

    assert asyncio.run(main()) == ["snapshot", "call", "queued0", "queued1", "queued2"]
    assert order == ["call starts", "call ends", "snapshot starts", "snapshot ends"] + [
        f"queued{i} {e}" for i in range(3) for e in ("starts", "ends")], order


def test_a_stage_steps_on_its_collective_count_extrapolated_by_each_peers_rate():
    """``progress.collective_samples``, hivemind ``ProgressTracker``'s estimate: each other peer's samples plus its
    rate times its record's age, a ready peer's snapshot as it is, and this peer's own count."""
    others = {"b": ProgressRecord(step=3, samples=8, rate=4.0, t=10.0),    # 2 s old: 8 + 8 more by now
              "c": ProgressRecord(step=3, ready=True, snap=12, rate=9.0, t=9.0),   # ready: its snapshot only
              "d": ProgressRecord(step=3, samples=4, rate=2.0, t=13.0)}    # from the future (clock skew): as is
    assert collective_samples(others, 6, now=12.0) == 6 + 16 + 12 + 4
    assert collective_samples({}, 6, now=12.0) == 6


def test_progress_records_are_typed_and_anything_else_is_not_a_record():
    record = ProgressRecord(step=4, peer="P", samples=8, rate=2.5, t=1.0, ready=True, snap=8, mbs=(3, 1))
    stored = record.value()
    assert "joining" not in stored and stored["mbs"] == [3, 1]   # defaults left out of the DHT value
    assert ProgressRecord.from_value(stored) == record
    for garbage in ({"left": True}, {"step": "4"}, {"step": 1, "mbs": ["x"]}, "text", None):
        assert ProgressRecord.from_value(garbage) is None, garbage
    assert ProgressRecord.from_value({"step": 2, "unknown": 1}) == ProgressRecord(step=2)   # a newer field ignored


def test_the_overshoot_of_each_step_is_measured_from_the_sync_lines():
    """A step takes its target plus what arrived meanwhile (at least once): ``progress.overshoot`` reports it per
    stage, one line per step (the group's members log the same numbers), a flush's partial batch left out."""
    def line(stage, step, group, target, flush=False):
        return {"stage": stage, "step": step, "group_samples": group, "target": target, "flush": flush}

    rows = [line(0, 1, 16, 16), line(0, 1, 16, 16), line(0, 2, 24, 16), line(0, 3, 4, 16, flush=True),
            line(1, 1, 12, 16)]
    assert overshoot(rows) == {0: {"steps": 2, "mean": 1.25, "max": 1.5, "under": 0},
                               1: {"steps": 1, "mean": 0.75, "max": 0.75, "under": 1}}


def test_a_shard_of_another_run_is_refused_naming_both_runs(tmp_path):
    path = write_shard(tmp_path, 0, "s0p1", 3, {"step": 3, "run_id": "csOLD"})
    with pytest.raises(ForeignShard, match="csOLD.*csA or csB"):
        load_shard(path, ("csA", "csB"))
    assert load_shard(path, ("csOLD", "csNEW"))["step"] == 3 and load_shard(path)["run_id"] == "csOLD"


def test_records_live_and_gathers_wait_for_several_of_the_peers_own_dht_rounds():
    assert record_window_s(0.0) == record_window_s(0.3) == max(GATHER_S, PROGRESS_TTL_S)   # a fast network
    assert record_window_s(2.5) == DHT_ROUNDS * 2.5 > GATHER_S   # a round of 2.5 s over a slow link


def test_stage_stalls_run_from_the_batchs_last_backward_to_the_peers_step():
    def line(uid, stage, step, last_backward, close, applied, samples=4):
        return {"uid": uid, "stage": stage, "step": step, "samples": samples, "group_samples": 8,
                "last_backward": last_backward, "close": close, "snapshot": close + 0.01, "gathered": close + 0.4,
                "reduced": close + 0.6, "applied": applied}

    rows = [line("s0p1", 0, 1, 10.0, 10.1, 10.8), line("s0p2", 0, 1, 10.2, 10.25, 11.0),
            line("s1p3", 1, 1, 9.5, 9.6, 10.0),
            line("s1p3", 1, 2, None, 12.0, 12.5, samples=0)]   # a flush with nothing held: left out
    stalls = stage_stalls(rows)
    assert sorted(stalls) == [0, 1] and len(stalls[1]) == 1
    (first,) = stalls[0]
    # from the later of the two last backward computations (10.2) to the mean of the two steps (10.9)
    assert first["stall_s"] == pytest.approx(0.7)
    assert first["trigger_s"] == pytest.approx(10.1 - 10.2)   # the first peer closed before the other's last call
    assert first["gather_s"] == pytest.approx((10.5 + 10.65) / 2 - 10.1)
    assert first["reduce_s"] == pytest.approx(0.2)
    assert first["trigger_s"] + first["gather_s"] + first["reduce_s"] + first["apply_s"] == pytest.approx(0.7)
    assert (first["samples"], first["peers"], first["end"]) == (8, 2, pytest.approx(10.9))
    assert stalls[1][0]["stall_s"] == pytest.approx(0.5)


def test_the_runs_routing_reaches_every_trainers_balancers_and_unknown_routings_are_refused():
    """``SwarmPlan.routing`` (the launcher writes it to the run's config): a trainer routes by measured throughput
    (weighted) or uniformly at random (uniform, the routing benchmark's baseline), on every stage."""
    from cramswarm.swarm.routing import StageBalancer, UniformBalancer
    from cramswarm.swarm.trainer import StageClient

    speeds = {"fast": 1.0, "half": 0.5, "quarter": 0.25}
    shares = {}
    for routing in ("weighted", "uniform"):
        client = StageClient(None, "run", 2, RetryPolicy(), seed=0, routing=routing)
        assert all(type(b) is (UniformBalancer if routing == "uniform" else StageBalancer) for b in client.balancers)
        balancer = client.balancers[1]
        balancer.update_peers(dict.fromkeys(speeds, 100.0), now=0.0)
        counts = dict.fromkeys(speeds, 0)
        for _ in range(1400):
            uid = balancer.choose(1.0, 0.0)
            balancer.report_success(uid, 1.0, 1.0 / speeds[uid])
            counts[uid] += 1
        shares[routing] = {uid: n / 1400 for uid, n in counts.items()}
    assert shares["weighted"]["fast"] > 0.5 and shares["weighted"]["quarter"] < 0.2, shares
    assert all(abs(share - 1 / 3) < 0.05 for share in shares["uniform"].values()), shares
    assert StageClient(None, "run", 1, RetryPolicy(), seed=0).balancers[0].__class__ is StageBalancer
    with pytest.raises(ValueError, match="routing must be one of weighted, uniform, got 'random'"):
        StageClient(None, "run", 1, RetryPolicy(), seed=0, routing="random")
    with pytest.raises(ValueError, match="swarm routing='random'"):
        plan(routing="random").validate()


def test_a_peers_emulated_speed_scales_its_measured_compute_or_the_configured_floor(monkeypatch):
    """``StageReplica.emulate_speed`` (a stage peer's, on its compute thread): a call of speed s takes compute / s;
    with ``peer_unit_time_s`` the compute counts as at least work units x that, so a loaded host's slower real compute
    does not change the call's time while it fits under the floor."""
    from cramswarm.swarm import replica

    slept = []
    monkeypatch.setattr(replica.time, "sleep", slept.append)
    peer = replica.StageReplica.__new__(replica.StageReplica)
    for speed, floor, measured, units, expected in [
        (1.0, None, 0.01, 1.0, 0.0),     # full speed, no floor: no sleep
        (0.5, None, 0.01, 3.0, 0.01),    # half speed: as long again as it measured
        (0.25, None, 0.02, 2.0, 0.06),   # quarter speed: 3x more
        (1.0, 0.05, 0.01, 1.0, 0.04),    # the floor: a forward call takes 1 x 0.05 s
        (0.5, 0.05, 0.01, 2.0, 0.19),    # a backward call at half speed: 2 x 0.05 / 0.5
        (0.5, 0.05, 0.03, 2.0, 0.17),    # more real compute (a loaded host), the same call time
        (0.25, 0.05, 0.02, 3.0, 0.58),   # the last stage's fused call: 3 units
        (0.5, 0.01, 0.04, 1.0, 0.04),    # real compute over the floor: it counts
    ]:
        peer.speed, peer.unit_time_s = speed, floor
        slept.clear()
        peer.emulate_speed(measured, units)
        assert slept == [pytest.approx(expected)], (speed, floor, measured, units)
    with pytest.raises(ValueError, match="peer_unit_time_s=0.0"):
        plan(peer_unit_time_s=0.0).validate()


def test_the_launcher_benchmark_counts_a_microbatch_taken_and_never_finished_as_lost(tmp_path):
    """The count of ``benchmarks/swarm_launcher.py`` and the study's testbed transport (``study_launcher``) for
    seconds budgets (where requested = done by definition): a gap in a lease before its last finished microbatch
    is lost, the untaken end of a lease is not; a record cut short by a kill is not a finish."""
    from cramswarm.swarm.trainer import losses_path
    from cramswarm.swarm.work import LEASE_MICROBATCHES as L
    from cramswarm.swarm_study import study_launcher as bench

    def write(name: str, mbs: list[int], tail: str = "") -> None:
        lines = "".join(json.dumps({"mb": mb, "loss": 1.0, "time": 0.0}) + "\n" for mb in mbs)
        losses_path(tmp_path, name).write_text(lines + tail)

    write("0", [0, 1, 2, 3, 2 * L])          # lease 0 whole; lease 2 begun at the deadline (its end untaken)
    write("1", [L, L + 2], tail=f'{{"mb": {L + 3}, "lo')   # L + 1 never finished; L + 3's record was cut short
    assert bench.lost_microbatches(tmp_path) == (7, 1)
    write("j1", [L + 1])   # a trainer that adopted the lease finished it
    assert bench.lost_microbatches(tmp_path) == (8, 0)


def test_a_trainer_refuses_a_negative_rank(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({}))
    proc = subprocess.run([sys.executable, "-m", "cramswarm.swarm.trainer", "--config", str(config), "--rank", "-1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--rank -1 is negative" in proc.stderr


def test_a_resumed_seconds_run_gets_the_budget_less_its_earlier_training_time(tmp_path):
    state, budget_s = tmp_path / "state", 60.0
    timed = plan().recipe | {"budget": {"unit": "seconds", "value": budget_s}}
    first = _prepared(state, UNBOUNDED, recipe=timed)
    first.run_id, first.start_wall = "csdead", 1000.0  # another process's run id (this one's pid is the same)
    first._write_clock()
    clock = json.loads((state / CLOCK_FILE).read_text())
    assert clock == {"run_id": first.run_id, "origin_wall": 1000.0, "deadline_wall": 1000.0 + budget_s}
    # the first life trained 25 s before it was killed
    (state / run_state.TIME_FILE).write_text(json.dumps({"wall_s": 25.0, "start_wall": 1000.0}))
    again = _prepared(state, UNBOUNDED, recipe=timed)
    assert not (state / CLOCK_FILE).exists()  # the dead life's clock goes: its peers' origin is stale
    assert again.stats["resumed"]["wall_s_before"] == 25.0
    again.start_wall = 5000.0
    again._write_clock()
    clock = json.loads((state / CLOCK_FILE).read_text())
    assert clock["origin_wall"] == 5000.0 - 25.0 and clock["deadline_wall"] == 5000.0 + budget_s - 25.0
    # a peer or trainer of another run (the dead life's run id) does not take this clock
    assert read_clock(state, first.run_id)["deadline_wall"] is None
    assert read_clock(state, again.run_id)["deadline_wall"] == clock["deadline_wall"]
    # a token or step budget has no deadline
    counted = _prepared(tmp_path / "counted", 24)
    counted.start_wall = 7.0
    counted._write_clock()
    assert json.loads((tmp_path / "counted" / CLOCK_FILE).read_text())["deadline_wall"] is None


def test_a_swarm_plan_the_launcher_cannot_run_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"swarm.peers_per_stage=\[1, 0\]: every stage needs at least one peer"):
        ht.run_swarm(plan(peers_per_stage=[1, 0]), source(), 8, progress=False)
    with pytest.raises(ValueError, match=r"swarm.trainers=0: need at least one trainer"):
        ht.run_swarm(plan(trainers=0), source(), 8, progress=False)
    # the launcher's trainers make their own microbatches: an iterator of them cannot be handed on
    with pytest.raises(TypeError, match="give it a microbatch source"):
        ht.run_swarm(plan(), batches(), 8, progress=False)


# -- checkpoint and resume from stage shards ------------------------------------------------------------------
def _shard_blob(step: int, stepped_mbs: list[int], run_id: str) -> bytes:
    buffer = io.BytesIO()
    torch.save({"module": {}, "optimizer": {}, "step": step, "stepped_samples": len(stepped_mbs) * MICRO,
                "stepped_mbs": stepped_mbs, "run_id": run_id}, buffer)
    return buffer.getvalue()


def _prepared(state: Path, total: int, **kw) -> launcher_mod.Launcher:
    """A launcher that prepared its state folder (data, resume.json, resume set-up) and let go of its lock."""
    data = kw.pop("data", None) or source()
    launcher = launcher_mod.Launcher(plan(state_dir=state, **kw), data, total, progress=False)
    try:
        launcher._prepare()
    finally:
        os.close(launcher.lock_fd)
    return launcher


def test_shard_files_keep_the_newest_step_of_each_stage(tmp_path):
    write_shard(tmp_path, 0, "s0p2", 3, b"a")
    write_shard(tmp_path, 0, "s0p1", 5, b"b")
    write_shard(tmp_path, 1, "s1p3", 4, b"c")
    assert [(step, uid) for step, uid, _ in shard_files(tmp_path, 0)] == [(5, "s0p1")]  # step 3 pruned
    write_shard(tmp_path, 0, "s0p3", 5, b"d")  # same step by another replica: both kept, lowest uid first
    assert newest_shard(tmp_path, 0) == (5, tmp_path / "stage0.step00000005.s0p1.pt")
    assert newest_shard(tmp_path, 1)[0] == 4 and newest_shard(tmp_path, 2) is None
    write_shard(tmp_path, 2, "s2r1.0", 7, b"e")  # a task's uid (s<stage>r<rank>.<incarnation>)
    assert shard_files(tmp_path, 2) == [(7, "s2r1.0", tmp_path / "stage2.step00000007.s2r1.0.pt")]
    assert not list(tmp_path.glob(".*"))  # no temporary file left


def test_a_shard_written_from_the_state_itself_loads_as_the_serialised_one(tmp_path):
    """A peer hands ``write_shard`` its live state (streamed to the file, no serialised copy in memory); the shard
    loads to the same values as one written from the serialised bytes."""
    layer = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    layer(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    state = {"module": layer.state_dict(), "optimizer": optimizer.state_dict(), "step": 2, "stepped_samples": 16,
             "stepped_mbs": [0, 1]}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    from_bytes = load_shard(write_shard(tmp_path / "a", 0, "s0p1", 2, buffer.getvalue()))
    from_state = load_shard(write_shard(tmp_path / "b", 0, "s0p1", 2, state))
    assert from_state.keys() == from_bytes.keys() and from_state["stepped_mbs"] == [0, 1]
    assert all(torch.equal(from_state["module"][k], v) for k, v in from_bytes["module"].items())
    assert torch.equal(from_state["optimizer"]["state"][0]["exp_avg_sq"],
                       from_bytes["optimizer"]["state"][0]["exp_avg_sq"])
    assert not list((tmp_path / "b").glob(".*"))  # no temporary file left


def test_a_rerun_owes_every_microbatch_not_stepped_by_every_stage_or_without_a_loss_record(tmp_path):
    total, state = 40, tmp_path / "state"
    first = _prepared(state, total)
    assert first.stats.get("resumed") is None and (state / "resume.json").exists()
    assert first.order == WorkOrder(total)   # a fresh run: every microbatch in order
    # the killed run: stage 0 stepped microbatches 0..9 and 12, stage 1 0..13
    write_shard(state / "shards", 0, "s0p1", 4, _shard_blob(4, list(range(10)) + [12], first.run_id))
    write_shard(state / "shards", 1, "s1p3", 6, _shard_blob(6, list(range(14)), first.run_id))
    (state / "dht_addrs.txt").write_text("/ip4/127.0.0.1/tcp/1/p2p/dead\n")
    (state / "s1p4.log").write_text("")
    (state / "log-s1p3.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 9)))
    # the trainers' loss records: 0..12 but 5 (its record never written), 12's cut short by the kill
    (state / "trainer0.losses.jsonl").write_text("".join(json.dumps({"mb": i, "loss": 2.0}) + "\n"
                                                         for i in range(0, 12, 2)) + '{"mb": 12, "lo')
    (state / "trainerj7.losses.jsonl").write_text("".join(json.dumps({"mb": i, "loss": 2.0}) + "\n"
                                                          for i in (1, 3, 7, 9, 11)))
    again = _prepared(state, total)
    resumed = again.stats["resumed"]
    # finished (stepped everywhere, with a loss): 0..9 but 5; owed first: 5; then on from 10
    assert resumed["shard_steps"] == [4, 6] and resumed["finished_before"] == 9, resumed
    assert again.order == WorkOrder(total, (5,), 10) and resumed["owed_first"] == 1 and resumed["from_microbatch"] == 10
    assert resumed["retrained"] == [2, 5]   # stage 0 steps 5 and 12 again, stage 1 5 and 10..13
    assert json.loads(again._write_config(8).read_text())["order"] == {"holes": [5], "start": 10}  # for trainers
    assert (state / "trainer0.losses.jsonl").read_text().splitlines()[-1] == json.dumps({"mb": 10, "loss": 2.0})
    assert not (state / "dht_addrs.txt").exists()  # the dead swarm's addresses
    assert [json.loads(line)["step"] for line in (state / "log-s1p3.jsonl").read_text().splitlines()] == \
        list(range(1, 7))  # the last stage's log keeps the steps its shard holds
    assert again.next_uid == 4  # new peers take fresh uids
    # the run's lives: the config handed to the peers lists both, and a third life accepts both lives' shards
    assert again.run_ids == [first.run_id, again.run_id]
    assert _prepared(state, total).run_ids[:2] == [first.run_id, again.run_id]
    # a shard another run wrote into the folder is refused, naming both runs
    write_shard(state / "shards", 0, "s0p9", 9, _shard_blob(9, [], "csOTHER"))
    with pytest.raises(ForeignShard, match="csOTHER"):
        _prepared(state, total)


def test_a_rerun_waits_for_the_interrupted_runs_processes_and_names_them(tmp_path, monkeypatch):
    total, state = 16, tmp_path / "state"
    _prepared(state, total)
    leftover = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--config",
                                 str(state / "config.json")])
    try:
        monkeypatch.setattr(run_state, "STALE_WAIT_S", 1.0)
        with pytest.raises(RuntimeError, match=rf"processes \[{leftover.pid}\] of the interrupted swarm run"):
            _prepared(state, total)
    finally:
        leftover.kill()
        leftover.wait()
    assert _prepared(state, total).stats["resumed"]["shard_steps"] == [0, 0]


def test_a_rerun_with_other_settings_or_data_is_refused_naming_what_differs(tmp_path):
    total, state = 24, tmp_path / "state"
    _prepared(state, total)
    changed = plan().recipe | {"lr": 1e-4}
    with pytest.raises(run_state.ResumeMismatch, match=r"recipe\.lr: 0\.003 -> 0\.0001.*remove"):
        _prepared(state, total, recipe=changed)
    with pytest.raises(run_state.ResumeMismatch, match=r"microbatches: 24 -> 30; trainers: 2 -> 3"):
        _prepared(state, 30, trainers=3)
    with pytest.raises(run_state.ResumeMismatch, match="training microbatches differ"):
        _prepared(state, total, data=source(seed=1))
    _prepared(state, total, kill_every_s=9.0, link_mbit_s=10.0)  # operational settings may change
    # a second launcher on the same folder at once is refused
    holder = launcher_mod.Launcher(plan(state_dir=state), source(), total, progress=False)
    try:
        with pytest.raises(RuntimeError, match="another launcher is running"):
            launcher_mod.Launcher(plan(state_dir=state), source(), total, progress=False)
    finally:
        os.close(holder.lock_fd)


def test_local_peers_are_spread_over_the_hosts_gpus_and_srun_peers_keep_slurms(tmp_path, monkeypatch):
    """The launcher's local placement gives peer i GPU i mod (the host's GPUs) alone, as docs/swarm.md says; a CPU
    run (pretrain.impl.device cpu) leaves the environment alone (checked on the processes' start arguments, no
    process started)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the launcher's run folder
    started: list[str | None] = []
    monkeypatch.setattr(ProcessGroups, "start_peer", lambda self, uid, *a, gpu=None: started.append(gpu) or
                        PeerProcess(uid, 0, 1.0, None, tmp_path / "log"))
    for device, expected in (("auto", ["2", "5", "2"]), ("cpu", [None, None, None])):
        started.clear()
        launcher = launcher_mod.Launcher(plan(device=device), source(), 8, progress=False)
        launcher.config, launcher.addr_file = tmp_path / "config.json", tmp_path / "addresses"  # run() writes them
        for stage in (0, 1, 0):
            launcher._start_peer(stage, 1.0, load_state=False)
        assert started == expected, device
        launcher.place = object()  # any placement of its own (testbed host, srun step): no GPU chosen here
        launcher._start_peer(1, 1.0, load_state=False)
        assert started[-1] is None


def test_the_end_of_a_run_asks_a_silent_stage_again_with_a_longer_wait(monkeypatch):
    """A stage whose only replica did not answer in time (a loaded host) is asked again, twice the wait each time,
    before the run fails with NoPeersError; a stage that answers is asked once."""
    launcher = launcher_mod.Launcher(plan(), source(), 8, progress=False)
    asked: list[tuple[int, float]] = []
    silent = {0: 2, 1: 0}  # stage -> how many times it gives no state before it answers

    async def replicas(stage, floor_s):
        asked.append((stage, floor_s))
        if silent[stage]:
            silent[stage] -= 1
            return []
        return [(f"s{stage}p1", 7, {"w": torch.zeros(2)})]

    monkeypatch.setattr(launcher, "_stage_replicas", replicas)
    states, steps, spread = asyncio.run(launcher._collect_states())
    floor = 2 * launcher.plan.sync_timeout_s
    assert asked == [(0, floor), (0, 2 * floor), (0, 4 * floor), (1, floor)]
    assert steps == {0: {"s0p1": 7}, 1: {"s1p1": 7}} and spread == [0.0, 0.0] and len(states) == 2
    silent[0] = run_result.COLLECT_ATTEMPTS
    with pytest.raises(NoPeersError, match="stage 0"):
        asyncio.run(launcher._collect_states())


def test_the_end_of_a_run_reads_a_stage_with_no_declared_replica_again_before_it_gives_up(monkeypatch):
    """A replica whose re-declaration was slow on a loaded host lapses for a moment: an empty read of the stage's
    records is read again (for up to two record lifetimes), not taken as a stage without replicas."""
    launcher = launcher_mod.Launcher(plan(), source(), 8, progress=False)
    reads = []

    async def records(node, run_id, stage):
        reads.append(stage)
        return {"s0p1": ("peer", 1.0)} if len(reads) >= 3 else {}

    async def no_wait(seconds):
        return None

    monkeypatch.setattr(run_result, "stage_records", records)
    monkeypatch.setattr(run_result.asyncio, "sleep", no_wait)
    assert asyncio.run(launcher._declared(0)) == {"s0p1": ("peer", 1.0)} and reads == [0, 0, 0]
    reads.clear()
    monkeypatch.setattr(run_result.time, "monotonic", iter(range(0, 10_000, 5)).__next__)  # 5 s per read

    async def none_declared(node, run_id, stage):
        reads.append(stage)
        return {}

    monkeypatch.setattr(run_result, "stage_records", none_declared)
    assert asyncio.run(launcher._declared(0)) == {}   # gives up after 2 x RECORD_TTL_S (20 s): 4 reads
    assert len(reads) == 2 * run_result.RECORD_TTL_S / 5, reads


def test_the_end_of_a_run_names_the_stage_whose_last_shard_is_missing(monkeypatch, tmp_path):
    """A stage whose replicas reached a step no shard holds within the wait fails the run with a message naming the
    stage and its newest shard file."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the launcher's run folder
    launcher = launcher_mod.Launcher(plan(), source(), 8, progress=False)
    launcher.shard_dir.mkdir()
    write_shard(launcher.shard_dir, 0, "s0p1", 3, {"module": {"w": torch.zeros(1)}, "run_id": launcher.run_id})
    write_shard(launcher.shard_dir, 1, "s1p2", 4, {"module": {"w": torch.zeros(1)}, "run_id": launcher.run_id})
    monkeypatch.setattr(run_result.time, "monotonic", iter(range(0, 10_000_000, 10_000)).__next__)  # past the bound
    lacking = r"stages \[0\] wrote no shard of their last step .*stage0\.step0+3\.s0p1\.pt"
    with pytest.raises(RuntimeError, match=lacking):
        asyncio.run(launcher._final_shards({0: {"s0p1": 5}, 1: {"s1p2": 4}}))


def test_a_process_joining_from_a_host_without_the_run_folder_runs_on_the_swarms_training_clock(monkeypatch, tmp_path):
    """A peer (``swarm-join``) or trainer (``swarm-train``) that joins through an address from a host without the
    run's folder keeps its files in its own folder and finds the swarm's training clock there (from the DHT
    description), so a seconds budget's batch and learning rate run on the clock every other replica reads; on a
    host with the run's folder it uses that folder and writes no clock."""
    from cramswarm.swarm import membership

    clock = {"run_id": "t", "origin_wall": 1234.5, "deadline_wall": 1300.0}
    described = process_config(workdir=tmp_path / "launcher-host", clock=clock)

    async def joined(initial_peers, **kwargs):
        return "node"

    async def description(node, wait_s):
        return described

    monkeypatch.setattr(membership, "join_dht", joined)
    monkeypatch.setattr(membership, "read_swarm", description)
    mine = tmp_path / "mine"
    node, cfg = asyncio.run(membership.join_through("/ip4/10.0.0.1/tcp/1", host="127.0.0.1", wait_s=1.0,
                                                    workdir=str(mine), prefix="x-"))
    assert node == "node" and cfg.workdir == cfg.shard_dir == str(mine)
    assert read_clock(mine, "t") == clock
    (tmp_path / "launcher-host").mkdir()   # this host has the run's folder
    node, cfg = asyncio.run(membership.join_through("/ip4/10.0.0.1/tcp/1", host="127.0.0.1", wait_s=1.0,
                                                    workdir=str(tmp_path / "unused"), prefix="x-"))
    assert Path(cfg.workdir) == tmp_path / "launcher-host" and not (tmp_path / "launcher-host" / CLOCK_FILE).exists()


def test_a_resumed_runs_stage_state_is_its_most_advanced_replicas_not_an_earlier_lifes():
    """The result reads a stage's stepped samples and duplicates from one replica, its most advanced: the counters an
    earlier life's peers left (past the shard the run resumed from, stepped again since) do not add their duplicates
    to this life's samples."""
    counters = [{"uid": "s0p1", "stage": 0, "step": 3, "stepped_samples": 72, "duplicate_microbatches": 1},
                {"uid": "s0p5", "stage": 0, "step": 31, "stepped_samples": 640, "duplicate_microbatches": 0},
                {"uid": "s1p3", "stage": 1, "step": 3, "stepped_samples": 72, "duplicate_microbatches": 1},
                {"uid": "s1p7", "stage": 1, "step": 31, "stepped_samples": 680, "duplicate_microbatches": 10},
                {"uid": "s1p8", "stage": 1, "step": 31, "stepped_samples": 676, "duplicate_microbatches": 9}]
    latest = run_result.latest_stage_state(counters, 3)
    assert [c.get("uid") for c in latest] == ["s0p5", "s1p7", None]
    assert [(c.get("stepped_samples", 0), c.get("duplicate_microbatches", 0)) for c in latest] == [(640, 0), (680, 10),
                                                                                                 (0, 0)]


def test_the_hivemind_transport_gives_the_launcher_its_state_folder(monkeypatch, tmp_path):
    """The hivemind transport hands the launcher the plan with its resumable state folder (None: no such state) and
    the microbatch source; without a source it refuses (the rule always gives one)."""
    from swarm_helpers import schema_swarm

    swarm = schema_swarm(transport="hivemind", checkpoint_every_s=7.0)
    seen, handed = [], []
    monkeypatch.setattr(ht, "run_swarm", lambda p, data, *args, **kw: seen.append(p) or handed.append(data))
    base = plan()
    configured = SwarmPlan.from_config(base.arch, base.vocab_size, base.recipe, swarm, tmp_path)
    common = dict(total_microbatches=96, progress=False, source=source())
    ht.train(configured, state_dir=tmp_path / "launcher", **common)
    ht.train(configured, **common)
    with pytest.raises(ValueError, match="the hivemind transport needs a microbatch source"):
        ht.train(configured, state_dir=tmp_path / "launcher", **(common | {"source": None}))
    assert [p.state_dir for p in seen] == [tmp_path / "launcher", None]
    assert seen[0].checkpoint_every_s == 7.0 and seen[0].rendezvous == tmp_path
    assert [hasattr(data, "spec") for data in handed] == [True] * 2   # the source, never an iterator


# -- the rule's outputs, then its state folder --------------------------------------------------------------------
class Killed(Exception):
    """A SIGKILL at the injected point: nothing after it runs."""


def test_a_kill_between_the_outputs_and_the_state_folders_removal_trains_nothing_again(tiny_run, monkeypatch):
    """swarm_pretrain writes its outputs, records them in the launcher's state folder, then removes the folder. A
    kill after the outputs: the rerun only removes the folder. A kill while writing them: the rerun resumes."""
    from swarm_helpers import SWARM
    from swarm_helpers import TRAIN_TINY as TINY_TRAIN

    from cramswarm.swarm import emulation_training
    from cramswarm.swarm import train as train_mod

    tmp, tok = tiny_run
    rendezvous, state = tmp / "rendezvous", tmp / "rendezvous" / train_mod.STATE_SUBDIR
    found_state = []

    def launcher_train(plan, *, source, state_dir, **kw):
        """The launcher's part (the same training, on the emulation): it leaves its state folder to the caller."""
        folder = Path(state_dir)
        assert folder == Path(plan.rendezvous) / train_mod.STATE_SUBDIR
        found_state.append(sorted(p.name for p in folder.iterdir()) if folder.exists() else None)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / run_state.RESUME_FILE).write_text("{}")
        result = emulation_training.train(plan, batches=(source[i] for i in itertools.count()), **kw)
        result.stats["roles"] = "launcher"
        return result

    monkeypatch.setattr(ht, "train", launcher_train)
    rec = recipe(budget={"unit": "steps", "value": 4}, eval_blocks=8)
    cfg = SWARM | {"transport": "hivemind"}

    def run(out: str, name: str = "m") -> dict:
        return train_mod.swarm_pretrain(rec, TINY_TRAIN, cfg, tmp / "blocks.npy", tok, tmp / out,
                                        progress=False, run=name, rendezvous=rendezvous, impl=impl())

    # killed after every output is written and recorded, before the state folder goes
    with monkeypatch.context() as m:
        m.setattr(train_mod, "remove_state", lambda folder: (_ for _ in ()).throw(Killed()))
        with pytest.raises(Killed):
            run("a")
    assert found_state == [None]
    outputs = {"model.safetensors", "train_log.csv", "summary.json"}
    assert outputs <= {p.name for p in (tmp / "a").iterdir()}
    record = json.loads((state / train_mod.OUTPUTS_FILE).read_text())
    assert outputs <= set(record["files"])
    first = json.loads((tmp / "a" / "summary.json").read_text())
    # another run name, or other outputs: not this run's record
    assert not train_mod.outputs_complete(state, tmp / "a", train_mod._settings(rec, TINY_TRAIN, cfg, "other"))
    assert not train_mod.outputs_complete(state, tmp / "b", train_mod._settings(rec, TINY_TRAIN, cfg, "m"))
    # the rerun trains nothing (the transport is not called), keeps the outputs and removes the folder
    assert run("a") == first
    assert found_state == [None] and not state.exists()
    assert json.loads((tmp / "a" / "summary.json").read_text()) == first
    assert [p.name for p in rendezvous.iterdir()] == []  # nothing renamed for removal is left either

    # killed while writing the outputs (before summary.json): no record, the rerun resumes in the state folder
    from cramswarm import run_outputs

    original = run_outputs.write_json

    def killed_at_summary(path, obj):
        if Path(path).name == "summary.json":
            raise Killed()
        original(path, obj)

    with monkeypatch.context() as m:
        m.setattr(run_outputs, "write_json", killed_at_summary)
        with pytest.raises(Killed):
            run("c")
    assert state.is_dir() and not (state / train_mod.OUTPUTS_FILE).exists()
    assert not (tmp / "c" / "summary.json").exists()
    summary = run("c")
    assert found_state[-1] == [run_state.RESUME_FILE]  # the transport ran on the kept folder: it resumes there
    assert summary["steps"] == first["steps"] and (tmp / "c" / "summary.json").exists() and not state.exists()




@pytest.mark.parametrize("address", ["/ip4/127.0.0.1/tcp/9/p2p/12D3KooWJWoaqZhDaoEFshF7Rh1bpY9ohihFhzcW6d69Lr2NASuq",
                                     "not-an-address"])
def test_a_peer_joining_through_a_dead_or_wrong_address_says_so_and_exits_2(address):
    """``swarm-join`` with an address no swarm answers on: an error naming the address, exit code 2, no hang."""
    done = subprocess.run([sys.executable, "-m", "cramswarm", "swarm-join", "--peer", address, "--wait-s", "5"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
                              str(Path(__file__).resolve().parents[1] / "src"), os.environ.get("PYTHONPATH")]))})
    assert done.returncode == 2 and f"cannot join through {address}" in done.stderr, (done.returncode, done.stderr)


def test_the_planned_peer_slots_give_each_peer_its_own_speed():
    """The plan's (stage, speed) slots: the i-th planned peer in stage order has ``peer_speeds[i mod len]`` (the
    launcher's start, the attach placement's rank table and a re-attach's missing peers all read them)."""
    assert plan(peers_per_stage=[2, 1], peer_speeds=[1.0, 0.5]).slots() == [(0, 1.0), (0, 0.5), (1, 1.0)]


def test_a_joining_replica_downloads_from_the_newest_replica_first():
    """As hivemind's ``load_state_from_peers``: the replica whose progress record is at the highest step is tried
    first; ties (and replicas without a record, last) in random order."""
    from cramswarm.swarm.peer_sync import SyncingStagePeer
    from cramswarm.swarm.progress import ProgressRecord

    peer = object.__new__(SyncingStagePeer)   # only the record reader is needed

    async def records():
        return {uid: ProgressRecord(step=step) for uid, step in (("s0p1", 3), ("s0p2", 5), ("s0p3", 3))}

    peer._read_records = records
    sources = [("s0p1", "a"), ("s0p2", "b"), ("s0p3", "c"), ("s0p9", "z")]
    orders = {tuple(asyncio.run(peer._source_order(sources))) for _ in range(40)}
    assert {order[0] for order in orders} == {("s0p2", "b")} and {order[-1] for order in orders} == {("s0p9", "z")}
    assert len(orders) == 2   # s0p1 and s0p3 (both at step 3) in either order
