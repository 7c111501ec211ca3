"""The launcher's swarm (real hivemind processes on localhost): independent trainer processes, stage peers that
decide their steps among themselves, a DHT joinable through any live member - and SIGKILLs of each role mid-run."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

pytest.importorskip("hivemind", reason="hivemind is not installed: transport 1 (real hivemind processes) is untested")

from conftest import ARCH, recipe  # noqa: E402
from test_swarm_hivemind import (  # noqa: E402
    MICRO,
    TINY,
    VOCAB,
    batches,
    own_p2p_daemons,
    plan,
    processes_naming,
    source,
    start_tasks,
    wait_all,
)

from cramswarm.swarm import hivemind_transport as ht  # noqa: E402
from cramswarm.swarm import launcher as launcher_mod  # noqa: E402
from cramswarm.swarm.peer_sync import (  # noqa: E402
    DHT_ROUNDS,
    GATHER_S,
    MIN_GATHER_S,
    PROGRESS_TTL_S,
    GatherView,
    SyncingStagePeer,
    admission_share,
    catch_up_source,
    load_shard,
    newest_shard,
    record_window_s,
    shard_files,
    stage_stalls,
    step_target,
    write_shard,
)
from cramswarm.swarm.policies import (
    NoPeersError,  # noqa: E402
    RetryPolicy,  # noqa: E402
)
from cramswarm.swarm.processes import PeerProcess, ProcessGroups  # noqa: E402
from cramswarm.swarm.stages import STATE_BYTES_PER_PARAMETER, build_swarm_model, stage_state_bytes  # noqa: E402
from cramswarm.swarm.train import UNBOUNDED  # noqa: E402
from cramswarm.swarm.trainer import shard  # noqa: E402

TESTS = Path(__file__).resolve().parent

KEYS = ("stepped_samples", "stepped_microbatches", "resumed",
        "stage_steps", "retries", "timeouts", "errors", "last_error", "trainer_restarts",
        "killed", "peers_killed", "rejoins", "resyncs", "digest_mismatches", "lost_gradient_samples", "replica_steps")


def brief(stats: dict) -> dict:
    """The counters an assertion message shows."""
    return {key: stats.get(key) for key in KEYS}


def launch(total: int, **kw):
    """One run under the launcher; checks what every run must show, returns (result, stats)."""
    daemons_before = own_p2p_daemons()
    result = ht.run_swarm(plan(decentralised=True, **kw), source(), total, progress=False)
    stats = result.stats
    assert stats["roles"] == "launcher"
    # every microbatch of every shard was trained once (re-sent on failures, resumed after a trainer restart)
    assert stats["microbatches_done"] == stats["microbatches_requested"] == total
    assert stats["lost_microbatches"] == 0 and stats["microbatches_with_loss"] == total
    # replicas of a stage hold the same parameters and step count at the end
    assert stats["replicas_equal"] and stats["replica_max_abs_diff"] == [0.0, 0.0], stats["replica_steps"]
    assert all(len(set(steps.values())) == 1 for steps in stats["replica_steps"].values()), stats["replica_steps"]
    assert len(result.stage_states) == 2 and all(result.stage_states)
    # every stage kept stepping (a stage stuck at one step would still end with one big flushed step)
    assert min(stats["stage_steps"]) >= 0.5 * max(stats["stage_steps"]), brief(stats)
    # the loss falls: the last stage's steps (one log row per step) and the trainers' microbatches
    losses = [row["loss"] for row in result.log]
    assert len(losses) >= 10 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
    mb = stats["trainer_losses"]
    assert sum(mb[-16:]) / 16 < sum(mb[:16]) / 16 - 0.3
    # nothing outlives the run
    assert ht.leftover_processes(stats["process_groups"]) == []
    assert own_p2p_daemons() == daemons_before
    return result, stats


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


def test_shards_partition_the_microbatches_and_step_targets_follow_the_ramp():
    total, trainers = 103, 4
    owned = sorted(i for rank in range(trainers) for i in shard(total, rank, trainers))
    assert owned == list(range(total))
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
    rec = {"a": {"step": 5, "samples": 8, "digest": "x", "ready": True},
           "b": {"step": 4, "samples": 0, "digest": "y", "joining": 5},
           "c": {"step": 3, "samples": 4, "digest": "z"}}
    # c is behind: it downloads a's state (b, though at a later step than c, is itself downloading)
    assert catch_up_source(rec, "c", 3, "z") == ("a", False)
    # a joiner never serves, even as the only replica ahead
    assert catch_up_source({"b": rec["b"], "c": rec["c"]}, "c", 3, "z") == (None, False)
    # the reference replica at the same step (lowest settled uid) with another digest: a mismatch
    same = {"a": {"step": 5, "digest": "x"}, "d": {"step": 5, "digest": "w"}}
    assert catch_up_source(same, "d", 5, "w") == ("a", True)
    assert catch_up_source(same, "a", 5, "x") == (None, False)
    assert catch_up_source(same | {"a": same["a"] | {"joining": 5}}, "d", 5, "w") == (None, False)

    view = GatherView(rec, 5, me="a")
    assert (view.passed, sorted(view.at_step), sorted(view.ready), view.joining) == (False, ["a"], ["a"], ["b"])
    assert not view.complete()   # b is on its way to step 5: a waits for it rather than stepping alone
    # arrived: still joining until its ready record (its first gather) is published
    arrived = GatherView(rec | {"b": {"step": 5, "samples": 0, "digest": "x", "joining": 5}}, 5, me="a")
    assert arrived.joining == ["b"] and sorted(arrived.at_step) == ["a"] and not arrived.complete()
    member = GatherView(rec | {"b": {"step": 5, "samples": 0, "digest": "x"}}, 5, me="a")
    assert member.joining == [] and member.unready == ["b"] and not member.complete()   # a member not yet ready
    assert GatherView(rec | {"b": {"step": 5, "samples": 0, "digest": "x"}}, 5, me="b").unready == []  # not itself
    both = GatherView(rec | {"b": {"step": 5, "samples": 0, "digest": "x", "ready": True}}, 5, me="a")
    assert both.complete() and sorted(both.ready) == ["a", "b"]
    # a joiner at a later step does not count as a replica past this one; a settled one does
    assert not GatherView({"b": {"step": 4, "joining": 6}}, 5).passed
    assert GatherView({"e": {"step": 6}}, 5).passed
    # a replica re-downloading its own step (digest mismatch) is on its way, not a member yet
    mismatch = GatherView({"a": rec["a"], "d": {"step": 5, "digest": "w", "joining": 5}}, 5, me="a")
    assert sorted(mismatch.at_step) == ["a"] and mismatch.joining == ["d"] and not mismatch.complete()
    # a joiner that arrived and got ready may still read its own joining record back: it does not wait for itself
    assert GatherView({"a": rec["a"], "d": {"step": 5, "digest": "w", "joining": 5}}, 5, me="d").complete()


def test_a_peer_publishes_its_record_every_period_while_its_sync_loop_is_busy_and_later_records_expire_later():
    """``publish_forever`` stores the peer's record every period whatever its synchronisation loop is doing (an
    all-reduce or a state download of seconds over a slow link), each record expiring after the one before even
    when the peer's window shrinks, and a joining peer's record says which step it joins and counts no samples."""
    import asyncio

    from cramswarm.swarm.peer_sync import COUNTERS_PERIOD_S, PROGRESS_PERIOD_S, SyncingStagePeer

    stored: list[tuple[float, dict, float]] = []
    written: list[float] = []   # the counters file, rewritten every COUNTERS_PERIOD_S

    class Node:
        async def store(self, key, subkey, value, expiration_time):
            stored.append((time.monotonic(), dict(value), expiration_time))

    class Peer:   # the record-keeping part of SyncingStagePeer, on a node that only records what it is given
        _publish, publish_forever = SyncingStagePeer._publish, SyncingStagePeer.publish_forever
        _own_carried, carried = SyncingStagePeer._own_carried, (4, 8)   # 8 samples left queued by step 3
        node, run_id, stage, uid, peer_id, step, stepped_samples, digest = Node(), "r", 1, "s1p3", "P", 4, 64, "d"
        ready, snapshot_mbs, round_s, record_expiration = None, set(), 3.0, 0.0
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
    assert joining and all(v["joining"] == 5 and v["samples"] == 0 and v["step"] == 4 for v in joining)
    assert stored[-1][1]["samples"] == 12 and "joining" not in stored[-1][1]
    assert all(v["carried"] == 8 for _, v, _ in stored)   # what its last step left queued, for the stage's target
    # and its counters file every COUNTERS_PERIOD_S (a peer cut off from its stage takes no step to write it at)
    assert len(written) == int(12 * PROGRESS_PERIOD_S // COUNTERS_PERIOD_S) and written[0] - stored[0][0] >= \
        COUNTERS_PERIOD_S, written


def test_admission_shares_deal_the_batchs_remaining_calls_by_the_replicas_rates():
    equal = {"a": 1.0, "b": 1.0}
    assert [admission_share(16, 4, u, equal) for u in "ab"] == [8, 8]
    assert [admission_share(4, 4, u, equal) for u in "ab"] == [4, 0]       # one call left: the lowest uid's
    assert [admission_share(16, 4, u, {"a": 0.0, "b": 0.0}) for u in "ab"] == [8, 8]   # nobody measured yet
    assert [admission_share(16, 4, u, {"a": 9.0, "b": 1.0}) for u in "ab"] == [16, 0]  # 3.6 + 0.4 calls
    three = {"a": 1.0, "b": 2.0, "c": 1.0}
    # 1.25 + 2.5 + 1.25 of 5 calls: 1, 2 and 1, and the fifth to the largest remainder (b's 0.5)
    assert [admission_share(20, 4, u, three) for u in "abc"] == [4, 12, 4]
    assert admission_share(3, 4, "a", equal) == 0 and admission_share(-4, 4, "a", equal) == 0
    assert admission_share(16, 4, "z", equal) == 0   # a peer whose record was not read takes no share
    # every deal hands out the remaining calls exactly, whoever reads it
    for remaining in range(0, 41):
        for rates in (equal, three, {"a": 0.3, "b": 5.0, "c": 0.0, "d": 2.2}):
            assert sum(admission_share(remaining, 4, u, rates) for u in rates) == remaining // 4 * 4


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


def test_a_backward_calls_samples_count_once_toward_the_batch_from_admission_to_reply():
    """A call's samples count as admitted while it waits and computes, then as held (accumulated): never twice (a
    computed call counted in both made steps go short of the batch), and a call whose RPC was cancelled while it
    waited counts only once it computes, on its own entry."""

    class Peer:   # SyncingStagePeer's count of held samples on state this test sets
        _held_samples, _calls_samples = SyncingStagePeer._held_samples, SyncingStagePeer._calls_samples
        _stepping = SyncingStagePeer._stepping

        def __init__(self):
            self.local_samples, self.snapshot, self.step, self.resent, self.snapshot_resent = 0, None, 0, {}, {}
            self.late: dict = {}
            self.calls: dict[int, dict] = {}

    peer = Peer()
    first, second = {"samples": 8, "state": "queued"}, {"samples": 4, "state": "queued"}
    peer.calls.update({0: first, 1: second})
    assert peer._held_samples() == 12 and peer._calls_samples("queued") == 12
    first["state"] = "computing"
    assert peer._held_samples() == 12 and peer._calls_samples("queued") == 4   # what a snapshot now carries
    first["state"], peer.local_samples = "computed", 8    # accumulated: held, no longer counted as admitted
    assert peer._held_samples() == 12
    del peer.calls[0]                                     # its reply left
    assert peer._held_samples() == 12
    del peer.calls[1]                                     # the trainer gave up on the other call while it waited
    assert peer._held_samples() == 8
    second["state"], peer.local_samples = "computed", 12  # computed later all the same: held once
    assert peer._held_samples() == 12


def test_replicas_admitting_on_stale_counts_hold_the_batch_between_them():
    """Two replicas of a stage receive a stage's calls in turn and neither reads the other's count meanwhile: each
    admits its share of what the batch lacked at the last read, then holds its calls until a read shows the other's
    count as of after their arrival. Before the shares each admitted the whole batch (32 samples for 16)."""

    class Replica:   # SyncingStagePeer's admission rules on counts this test sets
        _full, _over_share = SyncingStagePeer._full, SyncingStagePeer._over_share
        _past_share = SyncingStagePeer._past_share

        def __init__(self, uid: str):
            self.uid, self.held, self.others_pending, self.since_read = uid, 0, 0, 0
            self.read_remaining, self.read_rates, self.read_stamp = 16, {"a": 1.0, "b": 1.0}, 0.0

        def _held_samples(self):
            return self.held

        def _target(self):
            return 16

        def admit(self, samples: int, arrived: float) -> bool:
            if self._full(samples) or self._over_share(samples, arrived):
                return False
            self.held += samples
            self.since_read += samples
            return True

    a, b = Replica("a"), Replica("b")
    admitted = [r.admit(4, arrived=1.0 + i) for i in range(8) for r in (a, b)]
    assert (a.held, b.held, sum(admitted)) == (8, 8, 4)
    # a read of records published before the held call arrived lifts nothing; one published after it does, and
    # then the other's count shows the batch full
    for r, other in ((a, b), (b, a)):
        r.others_pending, r.read_remaining, r.since_read, r.read_stamp = other.held, 0, 0, 0.5
        assert not r.admit(4, arrived=1.0)
        r.read_stamp = 2.0
        assert r._over_share(4, arrived=1.0) is False and not r.admit(4, arrived=1.0)   # full
    # a replica holding nothing admits a call larger than what is left, unless the others hold the batch already
    c = Replica("c")
    c.others_pending, c.read_stamp = 14, float("inf")
    assert c.admit(4, arrived=1.0)
    c.held, c.others_pending = 0, 16
    assert not c.admit(4, arrived=1.0)


def test_records_live_and_gathers_wait_for_several_of_the_peers_own_dht_rounds():
    assert record_window_s(0.0) == record_window_s(0.3) == max(GATHER_S, PROGRESS_TTL_S)   # a fast network
    assert record_window_s(2.5) == DHT_ROUNDS * 2.5 > GATHER_S   # a round of 2.5 s over a slow link


@pytest.mark.slow
def test_a_narrowing_compression_trains_under_the_launcher_and_its_layers_reach_the_checkpoint():
    """maxout2 on the hivemind transport: the peers build their halves of the boundary layer, the narrowed tensor
    crosses the boundary, and the stage states assemble into the model the emulation would train."""
    from cramswarm.swarm.stages import assemble_model, split_model

    result, _ = launch(48, compression="maxout2")   # 12 steps: launch checks the loss falls, nothing is lost
    shape = build_swarm_model(TINY, VOCAB, 0, 2, "maxout2")
    stages = split_model(shape, 2)
    for stage, state in zip(stages, result.stage_states, strict=True):
        stage.load_state_dict(state)   # strict: the boundary layers' parameters are there, no more, no less
    model = assemble_model(stages, shape.config)
    assert any(name.startswith("bert.boundaries.") for name, _ in model.named_parameters())
    inputs, labels = source(seed=7)[0]
    assert torch.isfinite(model(input_ids=inputs, labels=labels).loss)


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
    from cramswarm.swarm.policies import StageBalancer, UniformBalancer
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


def test_a_trainers_balancer_leaves_out_the_seconds_a_peer_held_its_call_for_its_stage():
    """A backward call that a peer held back for its stage's step or batch (``peer_sync``'s admission; the reply's
    ``held_s``) is measured without that wait: the balancer rates the replica's own speed, not the stage's pause."""
    import asyncio

    from cramswarm.swarm.trainer import StageClient

    def measured(held_s: float) -> float:
        client = StageClient(None, "run", 1, RetryPolicy(), seed=0)
        client.balancers[0].update_peers({"p": time.time() + 100.0}, now=time.time())

        async def rpc(stage, uid, method, tensors, meta):
            await asyncio.sleep(0.3)
            return {}, {"samples": 4, "held_s": held_s}

        client._rpc = rpc
        asyncio.run(client._call(0, "backward", {}, {"samples": 4}, 4))
        return client.balancers[0].throughput("p")   # work units (backward: 2 per sample) per second

    assert measured(0.0) == pytest.approx(8 / 0.3, rel=0.25)
    assert measured(0.2) == pytest.approx(8 / 0.1, rel=0.25)


def test_a_peers_emulated_speed_scales_its_measured_compute_or_the_configured_floor(monkeypatch):
    """``StagePeer._emulate_speed``: a call of speed s takes compute / s (the rest slept on the compute thread); with
    ``peer_unit_time_s`` the compute counts as at least work units x that, so a loaded host's slower real compute
    does not change the call's time while it fits under the floor."""
    from cramswarm.swarm import hivemind_peer

    slept = []
    monkeypatch.setattr(hivemind_peer.time, "sleep", slept.append)
    peer = hivemind_peer.StagePeer.__new__(hivemind_peer.StagePeer)
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
        peer._emulate_speed(measured, units)
        assert slept == [pytest.approx(expected)], (speed, floor, measured, units)
    with pytest.raises(ValueError, match="peer_unit_time_s=0.0"):
        plan(peer_unit_time_s=0.0).validate()


def test_the_launcher_benchmark_counts_a_microbatch_taken_and_never_finished_as_lost(tmp_path):
    """The count of ``benchmarks/swarm_launcher.py`` and the study's testbed transport (``study_launcher``) for
    seconds budgets (where requested = done by definition): a gap in a trainer's shard before its last finished
    microbatch is lost; a record cut short by a kill is not a finish."""
    from cramswarm.swarm import study_launcher as bench
    from cramswarm.swarm.trainer import losses_path

    def write(rank: int, mbs: list[int], tail: str = "") -> None:
        lines = "".join(json.dumps({"mb": mb, "loss": 1.0, "time": 0.0}) + "\n" for mb in mbs)
        losses_path(tmp_path, rank).write_text(lines + tail)

    write(0, [0, 3, 6, 9])   # trainer 0 of 3: its whole shard up to 9
    write(1, [1, 7], tail='{"mb": 10, "lo')  # 4 never finished; 10's record was cut short
    assert bench.lost_microbatches(tmp_path, 3) == (6, 1)  # trainer 2 has no file: it finished nothing
    write(1, [1, 4, 7])
    assert bench.lost_microbatches(tmp_path, 3) == (7, 0)


def test_a_trainer_refuses_a_rank_outside_the_trainers(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({}))
    proc = subprocess.run([sys.executable, "-m", "cramswarm.swarm.trainer", "--config", str(config), "--rank", "2",
                           "--trainers", "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--rank 2 is outside 0 .. 1" in proc.stderr


@pytest.mark.slow
def test_launcher_swarm_steps_every_sample_once_with_compressed_averaging():
    total = 96
    # a cap each stage's state fits under while the whole model's does not: the peers build their stage only
    state = stage_state_bytes(plan().arch, plan().vocab_size, 2)
    whole = STATE_BYTES_PER_PARAMETER * sum(p.numel() for p in build_swarm_model(plan().arch, plan().vocab_size, 0,
                                                                                 1, "none").parameters())
    cap_mb = (max(state) + whole) / 2 / 2**20
    assert max(state) < cap_mb * 2**20 < whole
    result, stats = launch(total, peer_memory_cap_mb=cap_mb)
    # no failure: every sample stepped once on each stage (a backward call re-sent after a timeout on a loaded
    # machine is held apart by the replica that takes it and counts once: peer_sync.resent_kept)
    assert stats["trainer_restarts"] == 0 and stats["peers_killed"] == 0, brief(stats)
    assert stats["stepped_samples"] == [total * MICRO] * 2, (brief(stats), stats["duplicate_samples"])
    # the steps hold the recipe's batch up to what the peers admitted between two reads of each other's counts
    # (0.25 s apart), so a step may hold more or less than the batch and the next one makes up for it
    batch = [row["batch_sequences"] for row in result.log]
    assert sum(batch) == stats["stepped_samples"][1] and max(batch) <= 2 * 4 * MICRO, batch
    assert len(batch) >= 0.75 * total / 4, batch
    # the peers' steps are timed (a step whose lines hold no samples of their own - a member that counted another's
    # record, then failed the all-reduce - has no batch end and is left out): a stage's backward calls are held
    # for at least the gather's minimum
    stalls = stats["step_stalls"]
    assert sorted(stalls) == ["0", "1"], stalls
    assert {e["step"] for e in stalls["1"]} <= {row["step"] for row in result.log}, (stalls, result.log)
    assert len(stalls["1"]) >= 0.9 * len(batch) and stalls["0"], stalls
    assert all(e["gather_s"] >= MIN_GATHER_S and e["stall_s"] >= MIN_GATHER_S
               for entries in stalls.values() for e in entries), stalls
    assert all(1.99 <= b <= 2.0 * 1.01 for b in stats["averaging_bytes_per_param"]), stats
    # each peer holds its own stage only: its parameter count is its stage's, its AdamW state two moments of it
    memory = stats["peer_memory"]
    assert sorted(m["stage"] for m in memory) == [0, 0, 1, 1], memory
    assert len(stats["peer_devices"]) == 4 and set(stats["peer_devices"].values()) == {"cpu"}, stats["peer_devices"]
    for m in memory:
        assert m["stage_parameter_count"] == stats["stage_parameters"][m["stage"]], (m, stats["stage_parameters"])
        assert m["parameter_bytes"] == 4 * m["stage_parameter_count"], m
        assert 2 * m["parameter_bytes"] <= m["optimizer_bytes"] <= 2 * m["parameter_bytes"] + 4096, m
        assert m["peak_rss_bytes"] > m["parameter_bytes"] + m["optimizer_bytes"], m
        assert 2 * m["parameter_bytes"] + m["optimizer_bytes"] <= cap_mb * 2**20, (m, cap_mb)   # + gradients


@pytest.mark.slow
def test_a_backward_call_resent_while_the_first_replica_computes_it_is_stepped_once():
    """Stage 1's second replica takes 1.5 s per call (speed 0.1 on a 0.05 s work-unit floor) and the trainers wait
    1.25 s for a backward call: the calls it gets are re-sent to the other replica while it still computes them,
    and then it accumulates them. The re-sent copies are held apart and dropped at the step (the group's records
    show the first replica holds the microbatch), so each stage steps every sample once. Measured without the
    marking (the trainers' re-sends sent as first sends): stage 1 stepped 184 samples of 128."""
    daemons_before = own_p2p_daemons()
    total = 32
    slow = plan(decentralised=True, peers_per_stage=[1, 2], peer_speeds=[1.0, 1.0, 0.1], peer_unit_time_s=0.05,
                recipe=recipe(micro_batch_sequences=MICRO, batch_sequences=8 * MICRO, lr=3e-3,
                              batch_ramp_fraction=0.0, budget={"unit": "steps", "value": 1000}),
                retry=RetryPolicy(forward_timeout_s=0.5, give_up_after_s=120.0))
    stats = ht.run_swarm(slow, source(), total, progress=False).stats
    assert stats["microbatches_done"] == total and stats["lost_microbatches"] == 0, brief(stats)
    assert stats["timeouts"] > 0 and stats["resent_samples"][1] > 0, brief(stats)
    assert stats["duplicate_samples"][1] > 0, (stats["duplicate_samples"], stats["resent_kept_samples"])
    assert stats["stepped_samples"] == [total * MICRO] * 2, (brief(stats), stats["duplicate_samples"])
    assert stats["replica_max_abs_diff"] == [0.0, 0.0], stats["replica_steps"]
    assert ht.leftover_processes(stats["process_groups"]) == [] and own_p2p_daemons() == daemons_before


@pytest.mark.slow
def test_sigkill_of_a_trainer_mid_run_resumes_its_shard_and_loses_no_microbatch():
    total = 160
    _, stats = launch(total, faults=[(4.0, "trainer0")], rejoin_after_s=0.5)
    assert [k["uid"] for k in stats["killed"]] == ["trainer0"] and stats["trainer_restarts"] == 1, brief(stats)
    # a microbatch under way when the trainer died is sent again: its gradient may count twice on a stage
    # (and so may a call re-sent to another replica after a timeout or error: one more microbatch per re-send)
    assert all(total * MICRO <= n <= (total + 1 + stats["retries"]) * MICRO for n in stats["stepped_samples"]), \
        brief(stats)


@pytest.mark.slow
def test_sigkill_of_the_process_that_started_the_dht_does_not_stop_training_or_newcomers():
    total = 160
    # the bootstrap dies first; a peer killed later is replaced by a fresh one that must join through the
    # addresses the other processes appended to the address file
    _, stats = launch(total, faults=[(3.0, "bootstrap"), (6.0, "peer")], rejoin_after_s=0.5)
    assert stats["bootstrap_killed"] == 1 and stats["peers_killed"] == 1 and stats["rejoins"] == 1, brief(stats)
    restarted = [uid for steps in stats["replica_steps"].values() for uid in steps if int(uid.split("p")[1]) > 4]
    assert restarted, stats["replica_steps"]


@pytest.mark.slow
def test_random_peer_kills_under_the_launcher_lose_no_microbatch():
    total = 240
    _, stats = launch(total, peer_speeds=[0.5], kill_every_s=5.0, rejoin_after_s=0.2)
    assert stats["peers_killed"] >= 2 and stats["rejoins"] >= 1, brief(stats)
    # a killed peer's unaveraged gradients are lost (as in SWARM), at most a global batch per kill and stage
    lost = stats["lost_gradient_samples"]
    assert all(-MICRO <= n <= stats["peers_killed"] * 4 * MICRO for n in lost), brief(stats)


@pytest.mark.slow
def test_a_seconds_budget_under_the_launcher_ends_at_its_deadline_and_loses_no_microbatch():
    budget_s = 20.0
    timed = plan().recipe | {"budget": {"unit": "seconds", "value": budget_s}}
    daemons_before = own_p2p_daemons()
    result = ht.run_swarm(plan(decentralised=True, recipe=timed), source(), UNBOUNDED, progress=False)
    stats = result.stats
    assert stats["roles"] == "launcher" and stats["deadline_s"] == budget_s, brief(stats)
    done = stats["microbatches_done"]
    # every microbatch a trainer took before the deadline was finished, and stepped on every stage
    assert done >= 8 and stats["microbatches_requested"] == done and stats["lost_microbatches"] == 0, brief(stats)
    assert stats["microbatches_with_loss"] == done and stats["stepped_microbatches"] == [done, done], brief(stats)
    assert stats["shard_sizes"] == [None, None]  # no count: the trainers ran until the deadline
    # it ends near its budget: no microbatch was taken after the deadline, the last ones finished just after it
    finished = stats["microbatch_done_s"]
    assert budget_s - 5.0 <= finished[-1] <= budget_s + 10.0, finished[-5:]
    assert budget_s <= stats["wall_s"] <= budget_s + 15.0, stats["wall_s"]
    # the learning rate followed the training time: the last stage's steps' progress rises to about 1
    progress = [row["progress"] for row in result.log]
    assert progress == sorted(progress) and 0.75 <= progress[-1] <= 1.5, progress
    # the last partial batch was flushed and the checkpoint assembled from the stages' final shards
    assert stats["assembled_from"] == ["shard", "shard"] and stats["shard_steps"] == stats["stage_steps"]
    assert stats["replicas_equal"] and stats["replica_max_abs_diff"] == [0.0, 0.0], stats["replica_steps"]
    assert len(result.stage_states) == 2 and all(result.stage_states)
    assert ht.leftover_processes(stats["process_groups"]) == [] and own_p2p_daemons() == daemons_before


@pytest.mark.slow
def test_swarm_pretrain_under_the_launcher_trains_from_the_blocks_file_to_a_seconds_budget(tiny_run):
    """The rule's path end to end: the trainers read the packed blocks file and mask their microbatches
    themselves, until the deadline; the checkpoint and summary are written, the state folder goes."""
    import yaml

    from cramswarm.config import DEFAULT_SCHEMA
    from cramswarm.swarm.train import swarm_pretrain

    tmp_path, tok_path = tiny_run
    keys = yaml.safe_load(Path(DEFAULT_SCHEMA).read_text())["properties"]["swarm"]["properties"]
    swarm = {key: spec["default"] for key, spec in keys.items()} | {
        "transport": "hivemind", "stages": 2, "peers_per_stage": 1, "trainers": 2, "forward_timeout_s": 5.0}
    rec = recipe(budget={"unit": "seconds", "value": 15.0})
    summary = swarm_pretrain(rec, ARCH | {"layers": 2}, swarm, tmp_path / "blocks.npy", tok_path, tmp_path / "out",
                             progress=False, rendezvous=tmp_path / "rendezvous")
    stats = summary["swarm_stats"]
    done = stats["microbatches_done"]
    assert stats["roles"] == "launcher" and stats["deadline_s"] == 15.0, brief(stats)
    assert done >= 4 and stats["lost_microbatches"] == 0 and stats["stepped_microbatches"] == [done, done], \
        brief(stats)
    assert summary["tokens"] == done * rec["micro_batch_sequences"] * 32
    assert 15.0 <= summary["elapsed_s"] <= 30.0 and summary["eval_loss"] > 0, summary["elapsed_s"]
    assert stats["assembled_from"] == ["shard", "shard"]
    assert (tmp_path / "out" / "model.safetensors").exists() and (tmp_path / "out" / "summary.json").exists()
    assert not (tmp_path / "rendezvous" / "launcher").exists()  # the state folder goes once the run succeeded


def test_a_resumed_seconds_run_gets_the_budget_less_its_earlier_training_time(tmp_path):
    state, budget_s = tmp_path / "state", 60.0
    timed = plan().recipe | {"budget": {"unit": "seconds", "value": budget_s}}
    first = _prepared(state, UNBOUNDED, recipe=timed)
    first.run_id, first.start_wall = "csdead", 1000.0  # another process's run id (this one's pid is the same)
    first._write_clock()
    clock = json.loads((state / launcher_mod.CLOCK_FILE).read_text())
    assert clock == {"run_id": first.run_id, "origin_wall": 1000.0, "deadline_wall": 1000.0 + budget_s}
    # the first life trained 25 s before it was killed
    (state / launcher_mod.TIME_FILE).write_text(json.dumps({"wall_s": 25.0, "start_wall": 1000.0}))
    again = _prepared(state, UNBOUNDED, recipe=timed)
    assert not (state / launcher_mod.CLOCK_FILE).exists()  # the dead life's clock goes: its peers' origin is stale
    assert again.stats["resumed"]["wall_s_before"] == 25.0
    again.start_wall = 5000.0
    again._write_clock()
    clock = json.loads((state / launcher_mod.CLOCK_FILE).read_text())
    assert clock["origin_wall"] == 5000.0 - 25.0 and clock["deadline_wall"] == 5000.0 + budget_s - 25.0
    # a peer or trainer of another run (the dead life's run id) does not take this clock
    from cramswarm.swarm.peer_sync import read_clock

    assert read_clock(state, first.run_id)["deadline_wall"] is None
    assert read_clock(state, again.run_id)["deadline_wall"] == clock["deadline_wall"]
    # a token or step budget has no deadline
    counted = _prepared(tmp_path / "counted", 24)
    counted.start_wall = 7.0
    counted._write_clock()
    assert json.loads((tmp_path / "counted" / launcher_mod.CLOCK_FILE).read_text())["deadline_wall"] is None


def test_every_swarm_runs_under_the_launcher_and_a_plan_it_cannot_run_is_refused():
    assert ht.decentralised_supported(plan(), 96) is None
    # rebalancing runs under the launcher: the stage peers decide the moves (peer_rebalance)
    assert ht.decentralised_supported(plan(rebalance_period_s=3.0), 96) is None
    # a seconds budget (the trainers stop at the launcher's deadline) and any amount of data (the trainers read
    # the blocks themselves: no microbatch file is written before the start)
    seconds = plan().recipe | {"budget": {"unit": "seconds", "value": 60}}
    assert ht.decentralised_supported(plan(recipe=seconds), 1 << 62) is None
    assert ht.decentralised_supported(plan(), 10**9) is None
    # srun: every process the launcher starts is its own job step (srun.SrunPlacement; tests/test_slurm.py);
    # attach: the user's swarm-peer tasks serve the stages, but the launcher kills only what it started
    assert ht.decentralised_supported(plan(placement="srun", rendezvous=Path("r")), 96) is None
    assert ht.decentralised_supported(plan(placement="attach", rendezvous=Path("r")), 96) is None
    # with kill_every_s the launcher asks an attached peer to die and its task restarts it
    assert ht.decentralised_supported(plan(placement="attach", rendezvous=Path("r"), kill_every_s=4.0), 96) is None
    reason = ht.decentralised_supported(plan(peers_per_stage=[1, 0]), 96)
    assert reason and "peers_per_stage" in reason, reason
    with pytest.raises(ValueError, match=r"the launcher cannot run this swarm: swarm.peers_per_stage=\[1, 0\]"):
        ht.run_swarm(plan(peers_per_stage=[1, 0]), source(), 8, progress=False)
    # the central coordinator is gone: a plan that asks for it is refused, naming the field
    assert plan().decentralised
    with pytest.raises(ValueError, match="SwarmPlan.decentralised=False asked for the central coordinator"):
        ht.run_swarm(plan(decentralised=False), source(), 8, progress=False)
    # the launcher's trainers make their own microbatches: an iterator of them cannot be handed on
    with pytest.raises(TypeError, match="give it a microbatch source"):
        ht.run_swarm(plan(decentralised=True), batches(), 8, progress=False)


@pytest.mark.slow
def test_attached_peers_serve_the_launchers_swarm_and_their_tasks_restart_them(tmp_path):
    """placement attach under the launcher: the stage peers are `swarm-peer` tasks started apart from it (here before
    it), which find the run through its folder; the launcher starts only the bootstrap DHT and the trainers. One
    task's peer is SIGKILLed from outside once training runs: its task starts it again, nothing is lost."""
    total, state, logs = 320, tmp_path / "state", tmp_path / "logs"
    tasks = start_tasks(state, range(3), logs)  # ranks 0, 1: stage 0; rank 2: stage 1

    def kill_rank1s_peer():  # SIGKILL of the process group of rank 1's peer (the peer and its p2pd)
        deadline = time.monotonic() + 600
        while not (state / "trainer0.losses.jsonl").exists() and not (state / "done").exists():
            if time.monotonic() > deadline:
                return
            time.sleep(0.2)
        children = psutil.Process(tasks[1].pid).children()
        if children:
            os.killpg(children[0].pid, signal.SIGKILL)

    outside = threading.Thread(target=kill_rank1s_peer, daemon=True)
    outside.start()
    try:
        result, stats = launch(total, placement="attach", rendezvous=state, state_dir=state, interface="lo",
                               peers_per_stage=[2, 1], rejoin_after_s=0.2)
    finally:
        for task in tasks:
            if task.poll() is None and not (state / "done").exists():
                os.killpg(task.pid, signal.SIGKILL)
    assert stats["placement"] == "attach" and stats["peers_killed"] == 0 and stats["rejoins"] == 0  # not the launcher's
    uids = sorted(uid for steps in stats["replica_steps"].values() for uid in steps)
    assert [uid.split(".")[0] for uid in uids] == ["s0r0", "s0r1", "s1r2"], uids
    rank1 = (logs / "rank1.log").read_text()
    assert re.search(r"\[rank 1\] peer s0r1\.0 ended with code -9", rank1), rank1[-3000:]
    # the tasks read the launcher's `done` and exit 0; none of their processes, nor the launcher's, is left
    wait_all(tasks, logs)
    assert processes_naming(str(state)) == []


@pytest.mark.slow
def test_peers_and_trainers_exit_when_the_launcher_is_sigkilled(tmp_path):
    code = ("import sys; sys.path.insert(0, {tests!r}); import test_swarm_roles as t; "
            "t.ht.run_swarm(t.plan(decentralised=True), t.source(), 2000, progress=False)")
    launcher = subprocess.Popen([sys.executable, "-c", code.format(tests=str(TESTS))], start_new_session=True,
                                stdout=open(tmp_path / "launcher.log", "w"), stderr=subprocess.STDOUT)
    workdir = None
    try:
        deadline, trainers = time.monotonic() + 180, []
        while time.monotonic() < deadline and len(trainers) < 2:  # up to the trainers' start
            assert launcher.poll() is None, (tmp_path / "launcher.log").read_text()[-3000:]
            children = psutil.Process(launcher.pid).children(recursive=True)
            trainers = [c for c in children if "cramswarm.swarm.trainer" in " ".join(safe_cmdline(c))]
            time.sleep(0.5)
        assert len(trainers) == 2, (tmp_path / "launcher.log").read_text()[-3000:]
        cmdline = safe_cmdline(trainers[0])
        workdir = Path(cmdline[cmdline.index("--config") + 1]).parent  # the launcher's run folder
        time.sleep(3.0)
        started = psutil.Process(launcher.pid).children(recursive=True)
        started = [c for c in started if c.ppid() != launcher.pid or c.name() != "p2pd"]  # not the launcher's own
        assert len(started) >= 7  # bootstrap, 4 peers, 2 trainers (and their p2pd daemons)
        os.killpg(launcher.pid, signal.SIGKILL)  # the launcher and its own p2pd (the others have their own groups)
        launcher.wait()
        # each process sees its parent gone within a second and SIGKILLs its own group (itself and its p2pd)
        gone, alive = psutil.wait_procs(started, timeout=30)
        assert alive == [], [safe_cmdline(p) for p in alive]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        if workdir is not None:  # a SIGKILLed launcher cannot remove it
            shutil.rmtree(workdir, ignore_errors=True)


def safe_cmdline(proc: psutil.Process) -> list[str]:
    with contextlib.suppress(psutil.Error):
        return proc.cmdline()
    return []


# -- checkpoint and resume from stage shards ------------------------------------------------------------------
def _shard_blob(step: int, stepped_mbs: list[int]) -> bytes:
    buffer = io.BytesIO()
    torch.save({"module": {}, "optimizer": {}, "step": step, "stepped_samples": len(stepped_mbs) * MICRO,
                "stepped_mbs": stepped_mbs}, buffer)
    return buffer.getvalue()


def _prepared(state: Path, total: int, **kw) -> launcher_mod.Launcher:
    """A launcher that prepared its state folder (data, resume.json, resume set-up) and let go of its lock."""
    data = kw.pop("data", None) or source()
    launcher = launcher_mod.Launcher(plan(decentralised=True, state_dir=state, **kw), data, total, progress=False)
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


def test_a_rerun_resumes_each_trainer_at_the_first_microbatch_not_every_stage_stepped(tmp_path):
    total, state = 40, tmp_path / "state"
    first = _prepared(state, total)
    assert first.stats.get("resumed") is None and (state / "resume.json").exists()
    # the killed run: stage 0 stepped microbatches 0..9 and 12, stage 1 0..13; trainer 0 owns the even ones
    write_shard(state / "shards", 0, "s0p1", 4, _shard_blob(4, list(range(10)) + [12]))
    write_shard(state / "shards", 1, "s1p3", 6, _shard_blob(6, list(range(14))))
    (state / "dht_addrs.txt").write_text("/ip4/127.0.0.1/tcp/1/p2p/dead\n")
    (state / "s1p4.log").write_text("")
    (state / "log-s1p3.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 9)))
    # trainer 0 had reported 7 microbatches done (0 .. 12), the last loss record cut short; trainer 1 only 4
    (state / "trainer0.losses.jsonl").write_text("".join(json.dumps({"mb": i, "loss": 2.0}) + "\n"
                                                         for i in range(0, 12, 2)) + '{"mb": 12, "lo')
    for rank, done in ((0, 7), (1, 4)):
        (state / f"trainer{rank}.json").write_text(json.dumps({"rank": rank, "done": done}))
    again = _prepared(state, total)
    resumed = again.stats["resumed"]
    assert resumed["shard_steps"] == [4, 6] and resumed["trainer_done_before"] == [7, 4]
    # trainer 0 (0, 2, .., 10, 12): first not stepped by both stages is 10 (position 5); trainer 1 (1, 3, ..):
    # 11 (position 5), but it had done only 4 (microbatch 9's loss was never recorded): it redoes 9
    assert resumed["trainer_done"] == [5, 4]
    assert [json.loads((state / f"trainer{r}.json").read_text())["done"] for r in (0, 1)] == [5, 4]
    assert (state / "trainer0.losses.jsonl").read_text().splitlines()[-1] == json.dumps({"mb": 10, "loss": 2.0})
    assert not (state / "dht_addrs.txt").exists()  # the dead swarm's addresses
    assert [json.loads(line)["step"] for line in (state / "log-s1p3.jsonl").read_text().splitlines()] == \
        list(range(1, 7))  # the last stage's log keeps the steps its shard holds
    assert again.next_uid == 4  # new peers take fresh uids


def test_a_rerun_waits_for_the_interrupted_runs_processes_and_names_them(tmp_path, monkeypatch):
    total, state = 16, tmp_path / "state"
    _prepared(state, total)
    leftover = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--config",
                                 str(state / "config.json")])
    try:
        monkeypatch.setattr(launcher_mod, "STALE_WAIT_S", 1.0)
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
    with pytest.raises(launcher_mod.ResumeMismatch, match=r"recipe\.lr: 0\.003 -> 0\.0001.*remove"):
        _prepared(state, total, recipe=changed)
    with pytest.raises(launcher_mod.ResumeMismatch, match=r"microbatches: 24 -> 30; trainers: 2 -> 3"):
        _prepared(state, 30, trainers=3)
    with pytest.raises(launcher_mod.ResumeMismatch, match="training microbatches differ"):
        _prepared(state, total, data=source(seed=1))
    _prepared(state, total, kill_every_s=9.0, link_mbit_s=10.0)  # operational settings may change
    # a second launcher on the same folder at once is refused
    holder = launcher_mod.Launcher(plan(decentralised=True, state_dir=state), source(), total, progress=False)
    try:
        with pytest.raises(RuntimeError, match="another launcher is running"):
            launcher_mod.Launcher(plan(decentralised=True, state_dir=state), source(), total, progress=False)
    finally:
        os.close(holder.lock_fd)


def test_local_peers_are_spread_over_the_hosts_gpus_and_srun_peers_keep_slurms(tmp_path, monkeypatch):
    """The launcher's local placement gives peer i GPU i mod (the host's GPUs) alone, as docs/swarm.md says; a CPU
    recipe leaves the environment alone (checked on the processes' start arguments, no process started)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the launcher's run folder
    started: list[str | None] = []
    monkeypatch.setattr(ProcessGroups, "start_peer", lambda self, uid, *a, gpu=None: started.append(gpu) or
                        PeerProcess(uid, 0, 1.0, None, tmp_path / "log"))
    for device, expected in (("auto", ["2", "5", "2"]), ("cpu", [None, None, None])):
        started.clear()
        launcher = launcher_mod.Launcher(plan(decentralised=True, recipe=plan().recipe | {"device": device}), source(),
                                         8, progress=False)
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
    launcher = launcher_mod.Launcher(plan(decentralised=True), source(), 8, progress=False)
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
    silent[0] = launcher_mod.COLLECT_ATTEMPTS
    with pytest.raises(NoPeersError, match="stage 0"):
        asyncio.run(launcher._collect_states())


def start_until_shards(command: list[str], log: Path, state: Path, within_s: float, env=None) -> subprocess.Popen:
    """Start ``command`` in its own process group (output to ``log``) and return once both stages of its launcher
    (state folder ``state``) wrote a shard a few steps in; the command is killed if that fails."""
    first = subprocess.Popen(command, start_new_session=True, env=env, stdout=open(log, "w"),
                             stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + within_s
        while True:
            assert first.poll() is None, log.read_text()[-3000:]
            found = [newest_shard(state / "shards", s) for s in (0, 1)]
            if all(f is not None and f[0] >= 3 for f in found):
                return first
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)
        raise


@pytest.mark.slow
def test_a_rerun_after_the_launcher_is_sigkilled_resumes_from_the_stage_shards(tmp_path):
    """(d): SIGKILL of the launcher's process group mid-run (every process dies), then the same command again."""
    total, state = 160, tmp_path / "state"
    code = ("import sys; sys.path.insert(0, {tests!r}); import test_swarm_roles as t; from pathlib import Path; "
            "t.ht.run_swarm(t.plan(decentralised=True, state_dir=Path({state!r}), checkpoint_every_s=1.0), "
            "t.source(), {total}, progress=False)")
    first = start_until_shards([sys.executable, "-c", code.format(tests=str(TESTS), state=str(state), total=total)],
                               tmp_path / "launcher.log", state, within_s=300)
    try:
        started = psutil.Process(first.pid).children(recursive=True)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        gone, alive = psutil.wait_procs(started, timeout=30)
        assert alive == [], [safe_cmdline(p) for p in alive]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)
    done_before = sum(json.loads((state / f"trainer{r}.json").read_text())["done"] for r in (0, 1))
    assert 0 < done_before < total
    result, stats = launch(total, state_dir=state, checkpoint_every_s=1.0)
    resumed = stats["resumed"]
    # it resumed from the shards: the stages started at their shards' steps, the log goes on after them
    assert all(step >= 3 for step in resumed["shard_steps"]), resumed
    assert stats["first_logged_step"] == resumed["shard_steps"][1] + 1, (stats["first_logged_step"], resumed)
    assert all(done <= before for done, before in zip(resumed["trainer_done"], resumed["trainer_done_before"]))
    # its training time counts both lives (not the gap between them); the log's times run from the first start
    assert 0 < resumed["wall_s_before"] < stats["wall_s"], (resumed, stats["wall_s"])
    assert 0 <= result.log[0]["elapsed_s"] <= result.log[-1]["elapsed_s"]
    # the same end as an uninterrupted run: every microbatch stepped exactly once on every stage (those stepped
    # before the kill are skipped when the resumed trainers send them again), the checkpoint from the final shards
    assert stats["stepped_microbatches"] == [total, total], brief(stats)
    assert all(total * MICRO <= n <= (total + stats["retries"]) * MICRO for n in stats["stepped_samples"]), \
        brief(stats)
    assert stats["assembled_from"] == ["shard", "shard"] and stats["shard_steps"] == stats["stage_steps"]
    # the state folder outlives the run: its caller (swarm_pretrain) removes it once its outputs are written
    assert (state / launcher_mod.RESUME_FILE).exists()


@pytest.mark.slow
def test_a_rerun_on_a_finished_runs_state_folder_trains_nothing_and_gives_the_same_checkpoint(tmp_path):
    """A run killed after its training but before its caller removed the state folder, whose outputs are gone
    (Snakemake deletes a failed job's outputs): the rerun resumes from the final shards with nothing left to train."""
    total, state = 96, tmp_path / "state"
    first, stats = launch(total, state_dir=state, checkpoint_every_s=1.0)
    assert (state / launcher_mod.RESUME_FILE).exists()  # left to the caller (swarm_pretrain)
    again, stats = launch(total, state_dir=state, checkpoint_every_s=1.0)
    sizes = [len(shard(total, r, 2)) for r in range(2)]
    assert stats["resumed"]["trainer_done"] == stats["resumed"]["trainer_done_before"] == sizes, stats["resumed"]
    assert stats["first_logged_step"] is None  # no step taken in the second life
    assert stats["stepped_microbatches"] == [total, total] and stats["assembled_from"] == ["shard", "shard"]
    assert again.log == first.log
    for mine, theirs in zip(again.stage_states, first.stage_states):
        assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


@pytest.mark.slow
def test_sigkill_of_all_peers_of_a_stage_but_one_at_once_loses_no_microbatch():
    """(e): two of stage 0's three peers SIGKILLed at once; the survivor serves alone until they rejoin."""
    total = 160
    result, stats = launch(total, peers_per_stage=[3, 2], faults=[(5.0, "stage0")], rejoin_after_s=0.5)
    assert [k["stage"] for k in stats["killed"]] == [0, 0] and stats["rejoins"] == 2, brief(stats)
    assert stats["per_stage_peers"] == [3, 2], stats["replica_steps"]
    # the killed peers' unaveraged gradients are lost (as in SWARM): at most a global batch each, and so are a
    # replica's when it was left out of a step and downloaded the state (a resync; more of them under load)
    # (the count is the microbatches' samples minus those stepped: a call re-sent to another replica may count
    # twice, one microbatch per retry, and push it below 0)
    low, high = -stats["retries"] * MICRO, (2 + stats["resyncs"]) * 4 * MICRO
    assert all(low <= n <= high for n in stats["lost_gradient_samples"]), (stats["lost_gradient_samples"], low, high)


def test_swarm_pretrain_gives_the_launcher_the_rules_state_folder(monkeypatch, tmp_path):
    """Rule swarm_pretrain's --rendezvous folder holds the launcher's resumable state (launcher/); without one, no
    state folder. Without a microbatch source the hivemind transport refuses (the rule always gives one)."""
    import yaml

    from cramswarm.config import DEFAULT_SCHEMA

    keys = yaml.safe_load(Path(DEFAULT_SCHEMA).read_text())["properties"]["swarm"]["properties"]
    swarm = {key: spec["default"] for key, spec in keys.items()} | {"transport": "hivemind", "checkpoint_every_s": 7.0}
    seen = []
    handed = []
    monkeypatch.setattr(ht, "run_swarm", lambda p, data, *args, **kw: seen.append(p) or handed.append(data))
    base = plan()
    common = dict(arch=base.arch, vocab_size=base.vocab_size, recipe=base.recipe, batches=batches(),
                  total_microbatches=96, progress=False, source=source())
    ht.train(swarm=swarm, rendezvous=tmp_path, **common)
    ht.train(swarm=swarm, **common)
    ht.train(swarm=swarm | {"placement": "attach", "kill_every_s": 4.0}, rendezvous=tmp_path, **common)  # launcher's
    ht.train(swarm=swarm | {"placement": "srun"}, rendezvous=tmp_path, **common)  # the launcher's, as job steps
    ht.train(swarm=swarm | {"rebalance_period_s": 5.0}, rendezvous=tmp_path, **common)  # the peers rebalance
    with pytest.raises(ValueError, match="the hivemind transport needs a microbatch source"):
        ht.train(swarm=swarm, rendezvous=tmp_path, **(common | {"source": None}))
    launched = (True, tmp_path / "launcher")
    assert [(p.decentralised, p.state_dir) for p in seen] == [launched, (True, None), launched, launched, launched]
    assert seen[0].checkpoint_every_s == 7.0
    # the launcher gets the source (its trainers make their microbatches), never the iterator
    assert [hasattr(data, "spec") for data in handed] == [True] * 5


# -- the rule's outputs, then its state folder --------------------------------------------------------------------
class Killed(Exception):
    """A SIGKILL at the injected point: nothing after it runs."""


def test_a_kill_between_the_outputs_and_the_state_folders_removal_trains_nothing_again(tiny_run, monkeypatch):
    """swarm_pretrain writes its outputs, records them in the launcher's state folder, then removes the folder. A
    kill after the outputs: the rerun only removes the folder. A kill while writing them: the rerun resumes."""
    from test_swarm_train import SWARM
    from test_swarm_train import TINY as TINY_TRAIN

    from cramswarm.swarm import emulation_training
    from cramswarm.swarm import train as train_mod

    tmp, tok = tiny_run
    rendezvous, state = tmp / "rendezvous", tmp / "rendezvous" / train_mod.STATE_SUBDIR
    found_state = []

    def launcher_train(*, rendezvous, swarm, source, **kw):
        """The launcher's part (the same training, on the emulation): it leaves its state folder to the caller."""
        folder = Path(rendezvous) / train_mod.STATE_SUBDIR
        found_state.append(sorted(p.name for p in folder.iterdir()) if folder.exists() else None)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / launcher_mod.RESUME_FILE).write_text("{}")
        result = emulation_training.train(swarm=swarm, **kw)
        result.stats["roles"] = "launcher"
        return result

    monkeypatch.setattr(ht, "train", launcher_train)
    rec = recipe(budget={"unit": "steps", "value": 4}, eval_blocks=8)
    cfg = SWARM | {"transport": "hivemind"}

    def run(out: str, name: str = "m") -> dict:
        return train_mod.swarm_pretrain(rec, TINY_TRAIN, cfg, tmp / "blocks.npy", tok, tmp / out,
                                        progress=False, run=name, rendezvous=rendezvous)

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
    original = train_mod.write_json

    def killed_at_summary(path, obj):
        if Path(path).name == "summary.json":
            raise Killed()
        original(path, obj)

    with monkeypatch.context() as m:
        m.setattr(train_mod, "write_json", killed_at_summary)
        with pytest.raises(Killed):
            run("c")
    assert state.is_dir() and not (state / train_mod.OUTPUTS_FILE).exists()
    assert not (tmp / "c" / "summary.json").exists()
    summary = run("c")
    assert found_state[-1] == [launcher_mod.RESUME_FILE]  # the transport ran on the kept folder: it resumes there
    assert summary["steps"] == first["steps"] and (tmp / "c" / "summary.json").exists() and not state.exists()


@pytest.mark.slow
def test_sigkill_of_the_rules_own_process_leaves_nothing_behind_and_a_rerun_resumes_from_the_shards(tiny_run):
    """(d) at the rule's level: the command rule swarm_pretrain runs (its arguments; a tiny model and data),
    SIGKILLed alone - not its process group - once both stages wrote a shard: every process it started dies with it
    (its peers, trainers and DHT bootstrap see their parent gone; its own p2pd gets the kernel's parent-death
    signal). The same command again resumes from the shards and ends like an uninterrupted run."""
    import yaml

    from cramswarm.config import DEFAULT_SCHEMA
    from cramswarm.data import tokenizer as tokenization

    tmp, tok = tiny_run
    keys = yaml.safe_load(Path(DEFAULT_SCHEMA).read_text())["properties"]["swarm"]["properties"]
    swarm = {key: spec["default"] for key, spec in keys.items()} | dict(
        transport="hivemind", stages=2, peers_per_stage=2, trainers=2, peer_speeds=[1.0], compression="blockwise8",
        averaging_compression="fp16", checkpoint_every_s=1.0, forward_timeout_s=5.0, startup_timeout_s=120.0)
    steps = 40
    rec = recipe(micro_batch_sequences=MICRO, batch_sequences=4 * MICRO, lr=3e-3, batch_ramp_fraction=0.0,
                 budget={"unit": "steps", "value": steps}, log_every_steps=5, eval_blocks=16)
    total = 4 * steps
    vocab = tokenization.load(tok).get_vocab_size()
    out, rendezvous = tmp / "results" / "swarm" / "crammed", tmp / "results" / ".state" / "swarm" / "crammed"
    state = rendezvous / "launcher"
    # rules/swarm.smk's shell command, argument for argument
    command = [sys.executable, "-m", "cramswarm", "swarm-pretrain", "--recipe", json.dumps(rec),
               "--arch", json.dumps(TINY), "--swarm", json.dumps(swarm), "--blocks", str(tmp / "blocks.npy"),
               "--tokenizer", str(tok), "--vocab-size", str(vocab), "--out-dir", str(out),
               "--rendezvous", str(rendezvous), "--run", "crammed", "--threads", "2"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS.parent / "src"),
                                                                     os.environ.get("PYTHONPATH")]))}
    first = start_until_shards(command, tmp / "first.log", state, within_s=240, env=env)
    try:
        started = psutil.Process(first.pid).children(recursive=True)
        names = [" ".join(safe_cmdline(p)) for p in started]
        assert sum("cramswarm.swarm.trainer" in n for n in names) == 2, names
        assert sum(" stage " in n for n in names) == 4 and sum(" bootstrap " in n for n in names) == 1, names
        assert any(p.name() == "p2pd" and p.ppid() == first.pid for p in started), names  # the command's own
        os.kill(first.pid, signal.SIGKILL)  # the command's process only, not its group
        first.wait()
        gone, alive = psutil.wait_procs(started, timeout=30)
        assert alive == [], [safe_cmdline(p) for p in alive]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)
    assert not out.exists() or not (out / "summary.json").exists()
    done_before = sum(json.loads((state / f"trainer{r}.json").read_text())["done"] for r in (0, 1))
    assert 0 < done_before < total

    rerun = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=300)
    assert rerun.returncode == 0, rerun.stdout[-3000:]
    assert "resuming the swarm run" in rerun.stdout, rerun.stdout[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    stats = summary["swarm_stats"]
    resumed = stats["resumed"]
    # it resumed from the shards (each stage at its shard's step), not from step 0
    assert all(step >= 3 for step in resumed["shard_steps"]), resumed
    assert stats["first_logged_step"] == resumed["shard_steps"][1] + 1, (stats["first_logged_step"], resumed)
    # the budget reached, every microbatch done once and stepped exactly once on every stage
    assert summary["tokens"] == total * MICRO * 32
    assert stats["microbatches_done"] == stats["microbatches_requested"] == total, brief(stats)
    assert stats["lost_microbatches"] == 0 and stats["microbatches_with_loss"] == total, brief(stats)
    assert stats["stepped_microbatches"] == [total, total], brief(stats)
    assert stats["replicas_equal"], stats["replica_max_abs_diff"]
    # the loss falls (train_log.csv's window means, from the first life's steps to the last)
    rows = (out / "train_log.csv").read_text().splitlines()
    column = rows[0].split(",").index("loss")
    losses = [float(row.split(",")[column]) for row in rows[1:]]
    assert len(losses) >= 4 and losses[-1] < losses[0] - 0.3, losses
    assert (out / "model.safetensors").exists() and not state.exists()  # outputs written, then the folder gone
    assert ht.leftover_processes(stats["process_groups"]) == []


@pytest.mark.slow
def test_hivemind_swarm_pretraining_matches_single_process_within_the_emulations_tolerance(tiny_run):
    """Loss parity on hivemind: swarm_pretrain under the launcher (2 stages x 2 peers, 3 trainer processes, blockwise
    8-bit boundaries, fp16 averaging, bf16) against cramswarm.pretrain on the same blocks and step budget (the
    launcher's trainers draw each microbatch's masks from its own seed, cramswarm.swarm.data, at the same rate):
    within test_swarm_train's PARITY_NATS, the emulation's tolerance, in final training loss and held-out loss.
    Measured (2026-11-26, loaded 2-core machine; 3 runs): swarm minus single-process final training loss -0.027,
    -0.060, -0.032 nats (a window mean over microbatches whose masks differ from pretrain's), held-out +0.013,
    +0.026, +0.018. The swarm's steps overshoot the global batch (microbatches arriving while a stage averages join
    that step): 25-27, not 30."""
    import yaml
    from test_swarm_train import PARITY_NATS, SWARM
    from test_swarm_train import TINY as TINY_TRAIN

    from cramswarm.config import DEFAULT_SCHEMA
    from cramswarm.pretrain import pretrain
    from cramswarm.swarm.train import swarm_pretrain

    tmp, tok = tiny_run
    keys = yaml.safe_load(Path(DEFAULT_SCHEMA).read_text())["properties"]["swarm"]["properties"]
    cfg = {key: spec["default"] for key, spec in keys.items()} | SWARM | dict(
        transport="hivemind", trainers=3, forward_timeout_s=5.0, startup_timeout_s=120.0)
    rec = recipe(budget={"unit": "steps", "value": 30})
    single = pretrain(rec, TINY_TRAIN, tmp / "blocks.npy", tok, tmp / "single", progress=False)
    swarm = swarm_pretrain(rec, TINY_TRAIN, cfg, tmp / "blocks.npy", tok, tmp / "swarm", progress=False,
                           rendezvous=tmp / "rendezvous")
    stats = swarm["swarm_stats"]
    print("parity", json.dumps({"single": [single["final_loss"], single["eval_loss"], single["steps"]],
                                "swarm": [swarm["final_loss"], swarm["eval_loss"], swarm["steps"]],
                                "stage_steps": stats["stage_steps"], "wall_s": stats["wall_s"]}))
    assert stats["roles"] == "launcher" and swarm["tokens"] == single["tokens"] == 30 * 16 * 32
    assert stats["microbatches_done"] == stats["microbatches_requested"] == 60 and stats["lost_microbatches"] == 0
    # no fault is injected, but a replica left out of a step (load) downloads the state and drops the gradients it
    # held, which the run counts (lost_gradient_samples), as the kill tests allow: seen once in CI, [60, 59]; the
    # bound is a global batch per resync and one more (the last, partial batch)
    per_batch = rec["batch_sequences"] // rec["micro_batch_sequences"]
    least = 60 - (1 + stats["resyncs"]) * per_batch
    assert all(least <= n <= 60 for n in stats["stepped_microbatches"]) and stats["replicas_equal"], \
        (stats["stepped_microbatches"], stats["lost_gradient_samples"], stats["resyncs"], brief(stats))
    assert abs(swarm["final_loss"] - single["final_loss"]) < PARITY_NATS
    assert abs(swarm["eval_loss"] - single["eval_loss"]) < PARITY_NATS
