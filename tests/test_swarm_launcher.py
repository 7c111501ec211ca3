"""The launcher's swarm run for real (hivemind processes on localhost): independent trainer processes, stage peers
that decide their steps among themselves, a DHT joinable through any live member - and SIGKILLs of each role
mid-run. The roles' logic without a run (records, shards, step rules, reruns) is in test_swarm_roles.py."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

pytest.importorskip("hivemind", reason="hivemind is not installed: transport 1 (real hivemind processes) is untested")

from conftest import ARCH, impl, recipe  # noqa: E402
from swarm_helpers import (
    MICRO,
    TINY,
    VOCAB,
    brief,
    launch,
    own_p2p_daemons,
    plan,
    processes_left,
    running,
    safe_cmdline,
    source,
    start_tasks,
    start_until_shards,  # noqa: E402
    wait_all,
)

from cramswarm.swarm import hivemind_transport as ht  # noqa: E402
from cramswarm.swarm import run_state  # noqa: E402
from cramswarm.swarm.routing import (
    RetryPolicy,  # noqa: E402
)
from cramswarm.swarm.shards import newest_shard  # noqa: E402
from cramswarm.swarm.stages import STATE_BYTES_PER_PARAMETER, build_swarm_model, stage_state_bytes  # noqa: E402
from cramswarm.swarm.train import UNBOUNDED  # noqa: E402

TESTS = Path(__file__).resolve().parent


@pytest.mark.swarm
def test_a_narrowing_compression_trains_under_the_launcher_and_its_layers_reach_the_checkpoint():
    """maxout2 on the hivemind transport: the peers build their halves of the boundary layer, the narrowed tensor
    crosses the boundary, and the stage states assemble into the model the emulation would train."""
    from cramswarm.swarm.stages import assemble_model, split_model

    result, _ = launch(48, compression="maxout2")   # launch checks the loss falls, nothing is lost
    shape = build_swarm_model(TINY, VOCAB, 0, 2, "maxout2")
    stages = split_model(shape, 2)
    for stage, state in zip(stages, result.stage_states, strict=True):
        stage.load_state_dict(state)   # strict: the boundary layers' parameters are there, no more, no less
    model = assemble_model(stages, shape.config)
    assert any(name.startswith("bert.boundaries.") for name, _ in model.named_parameters())
    inputs, labels = source(seed=7)[0]
    assert torch.isfinite(model(input_ids=inputs, labels=labels).loss)


def test_launcher_swarm_steps_every_sample_at_least_once_with_compressed_averaging():
    total = 96
    # a cap each stage's state fits under while the whole model's does not: the peers build their stage only
    state = stage_state_bytes(plan().arch, plan().vocab_size, 2)
    whole = STATE_BYTES_PER_PARAMETER * sum(p.numel() for p in build_swarm_model(plan().arch, plan().vocab_size, 0,
                                                                                 1, "none").parameters())
    cap_mb = (max(state) + whole) / 2 / 2**20
    assert max(state) < cap_mb * 2**20 < whole
    result, stats = launch(total, peer_memory_cap_mb=cap_mb)
    # no failure: every microbatch stepped on each stage, at least once (a backward call re-sent after a timeout
    # on a loaded machine counts on both replicas: counted in duplicate_microbatches, as SWARM tolerates)
    assert stats["trainer_restarts"] == 0 and stats["peers_killed"] == 0, brief(stats)
    assert stats["stepped_microbatches"] == [total, total] and stats["lost_gradient_samples"] == [0, 0], brief(stats)
    assert stats["stepped_samples"] == [(total + d) * MICRO for d in stats["duplicate_microbatches"]], brief(stats)
    # a step takes its target (4 microbatches) plus what arrived meanwhile: the overshoot is measured per stage
    batch = [row["batch_sequences"] for row in result.log]
    assert sum(batch) == stats["stepped_samples"][1] and all(row["target_sequences"] == 4 * MICRO
                                                             for row in result.log), result.log
    over = stats["step_overshoot"]
    assert sorted(over) == ["0", "1"] and all(o["steps"] >= 1 and o["mean"] >= 1.0 and o["under"] <= o["steps"] // 4
                                              for o in over.values()), over
    assert over["1"]["steps"] >= len(batch) - 1 and over["1"]["max"] == max(batch[:-1]) / (4 * MICRO), (over, batch)
    # the peers' steps are timed (a step whose lines hold no samples of their own - a member that counted another's
    # record, then failed the all-reduce - has no batch end and is left out): each gathers its group from the
    # records (a DHT read at least), all-reduces and applies, while the stage's backward calls go on toward the next
    stalls = stats["step_stalls"]
    assert sorted(stalls) == ["0", "1"], stalls
    assert {e["step"] for e in stalls["1"]} <= {row["step"] for row in result.log}, (stalls, result.log)
    assert len(stalls["1"]) >= 0.9 * len(batch) and stalls["0"], stalls
    assert all(e["gather_s"] > 0 and e["reduce_s"] >= 0 and e["apply_s"] >= 0
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


@pytest.mark.swarm
def test_a_backward_call_resent_while_the_first_replica_computes_it_counts_at_least_once():
    """Stage 1's second replica takes 1.5 s per call (speed 0.1 on a 0.05 s work-unit floor) and the trainers wait
    1.25 s for a backward call: the calls it gets are re-sent to the other replica while it still computes them,
    and then it accumulates them too. As in SWARM both copies count: every microbatch is stepped, the second copies
    are counted (``duplicate_microbatches``) and the replicas stay equal."""
    daemons_before = own_p2p_daemons()
    total = 32
    slow = plan(peers_per_stage=[1, 2], peer_speeds=[1.0, 1.0, 0.1], peer_unit_time_s=0.05,
                recipe=recipe(micro_batch_sequences=MICRO, batch_sequences=8 * MICRO, lr=3e-3,
                              batch_ramp_fraction=0.0, budget={"unit": "steps", "value": 1000}),
                retry=RetryPolicy(forward_timeout_s=0.5, give_up_after_s=120.0))
    stats = ht.run_swarm(slow, source(), total, progress=False).stats
    assert stats["microbatches_done"] == total and stats["lost_microbatches"] == 0, brief(stats)
    assert stats["timeouts"] > 0 and stats["resent_samples"][1] > 0, brief(stats)
    assert stats["stepped_microbatches"] == [total, total] and stats["lost_gradient_samples"] == [0, 0], brief(stats)
    assert stats["duplicate_microbatches"][1] > 0, brief(stats)
    assert stats["stepped_samples"] == [(total + d) * MICRO for d in stats["duplicate_microbatches"]], brief(stats)
    assert stats["replica_max_abs_diff"] == [0.0, 0.0], stats["replica_steps"]
    assert ht.leftover_processes(stats["process_groups"]) == [] and own_p2p_daemons() == daemons_before


@pytest.mark.swarm
def test_sigkill_of_a_trainer_mid_run_resumes_its_shard_and_loses_no_microbatch():
    total = 160
    _, stats = launch(total, faults=[(4.0, "trainer0")], rejoin_after_s=0.5)
    assert [k["uid"] for k in stats["killed"]] == ["trainer0"] and stats["trainer_restarts"] == 1, brief(stats)
    # at least once, as in SWARM: every microbatch stepped, each repeat counted. A repeat is a microbatch the restarted
    # trainer trained again (its claim read back from the DHT may lag its last microbatches: done - total), the one
    # under way when it died, or a call re-sent to another replica after a timeout or error
    done = sum(stats["trainer_microbatches"].values())
    assert done >= total and stats["lost_gradient_samples"] == [0, 0], brief(stats)
    assert stats["stepped_samples"] == [(total + d) * MICRO for d in stats["duplicate_microbatches"]], brief(stats)
    assert all(d <= done - total + 1 + stats["retries"] for d in stats["duplicate_microbatches"]), brief(stats)


@pytest.mark.swarm
def test_sigkill_of_the_process_that_started_the_dht_does_not_stop_training_or_newcomers():
    total = 480   # long enough for the replacement (a new process: 10-20 s to start on a busy 2-core host) to join
    # the bootstrap dies first; a peer killed later is replaced by a fresh one that must join through the
    # addresses the other processes appended to the address file
    _, stats = launch(total, faults=[(3.0, "bootstrap"), (6.0, "peer")], rejoin_after_s=0.5)
    assert stats["bootstrap_killed"] == 1 and stats["peers_killed"] == 1 and stats["rejoins"] == 1, brief(stats)
    restarted = [uid for steps in stats["replica_steps"].values() for uid in steps if int(uid.split("p")[1]) > 4]
    assert restarted, stats["replica_steps"]


@pytest.mark.swarm
def test_random_peer_kills_under_the_launcher_lose_no_microbatch():
    total = 240
    _, stats = launch(total, peer_speeds=[0.5], kill_every_s=5.0, rejoin_after_s=0.2)
    assert stats["peers_killed"] >= 2 and stats["rejoins"] >= 1, brief(stats)
    # a killed peer's unaveraged gradients are lost (as in SWARM), at most a global batch per kill and stage
    lost = stats["lost_gradient_samples"]
    assert all(-MICRO <= n <= stats["peers_killed"] * 4 * MICRO for n in lost), brief(stats)


@pytest.mark.swarm
def test_a_seconds_budget_under_the_launcher_ends_at_its_deadline_and_loses_no_microbatch():
    budget_s = 20.0
    timed = plan().recipe | {"budget": {"unit": "seconds", "value": budget_s}}
    daemons_before = own_p2p_daemons()
    result = ht.run_swarm(plan(recipe=timed), source(), UNBOUNDED, progress=False)
    stats = result.stats
    assert stats["roles"] == "launcher" and stats["deadline_s"] == budget_s, brief(stats)
    done = stats["microbatches_done"]
    # every microbatch a trainer took before the deadline was finished, and stepped on every stage
    assert done >= 8 and stats["microbatches_requested"] == done and stats["lost_microbatches"] == 0, brief(stats)
    assert stats["microbatches_with_loss"] == done and stats["stepped_microbatches"] == [done, done], brief(stats)
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


@pytest.mark.swarm
def test_swarm_pretrain_under_the_launcher_trains_from_the_blocks_file_to_a_seconds_budget(tiny_run):
    """The rule's path end to end: the trainers read the packed blocks file and mask their microbatches
    themselves, until the deadline; the checkpoint and summary are written, the state folder goes."""
    from swarm_helpers import schema_swarm

    from cramswarm.swarm.train import swarm_pretrain

    tmp_path, tok_path = tiny_run
    swarm = schema_swarm(transport="hivemind", stages=2, peers_per_stage=1, trainers=2, forward_timeout_s=5.0)
    rec = recipe(budget={"unit": "seconds", "value": 15.0})
    summary = swarm_pretrain(rec, ARCH | {"layers": 2}, swarm, tmp_path / "blocks.npy", tok_path, tmp_path / "out",
                             progress=False, rendezvous=tmp_path / "rendezvous", impl=impl())
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


@pytest.mark.swarm
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
    assert processes_left(str(state)) == []


@pytest.mark.swarm
def test_peers_and_trainers_leave_after_their_grace_when_the_launcher_is_sigkilled_for_good(tmp_path):
    """The launcher SIGKILLed and never started again (a temporary run folder: nothing to re-attach to): its
    processes train on for ``launcher_grace_s`` (5 s here) without its heartbeat, then every one exits - nothing is
    left behind for good."""
    code = ("import sys; sys.path.insert(0, {tests!r}); import swarm_helpers as t; "
            "t.ht.run_swarm(t.plan(launcher_grace_s=5.0), t.source(), 2000, progress=False)")
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
        started, deadline = [], time.monotonic() + 60
        while time.monotonic() < deadline and len(started) < 7:  # bootstrap, 4 peers, 2 trainers (+ p2pd daemons)
            time.sleep(0.5)
            started = psutil.Process(launcher.pid).children(recursive=True)
            started = [c for c in started if c.ppid() != launcher.pid or c.name() != "p2pd"]  # not the launcher's own
        assert len(started) >= 7, (tmp_path / "launcher.log").read_text()[-3000:]
        os.killpg(launcher.pid, signal.SIGKILL)  # the launcher and its own p2pd (the others have their own groups)
        launcher.wait()
        # each process leaves once the heartbeat record (10 s) has been missing its grace (5 s), the peers after
        # their stages' shards: waited for, not timed
        gone, alive = psutil.wait_procs(started, timeout=120)
        assert running(alive) == [], [safe_cmdline(p) for p in alive]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        if workdir is not None:  # a SIGKILLed launcher cannot remove it
            shutil.rmtree(workdir, ignore_errors=True)


def start_launcher_until_shards(tmp_path, total: int, state: Path, **kw) -> subprocess.Popen:
    """A launcher run (2 stages x 2 peers, 2 trainers) in its own process, returned once both stages wrote a shard
    (at any step: on a loaded host the steps come late, and waiting for a later one may outlast the training)."""
    code = ("import sys; sys.path.insert(0, {tests!r}); import swarm_helpers as t; from pathlib import Path; "
            "t.ht.run_swarm(t.plan(state_dir=Path({state!r}), checkpoint_every_s=1.0, **{kw!r}), "
            "t.source(), {total}, progress=False)")
    return start_until_shards([sys.executable, "-c", code.format(tests=str(TESTS), state=str(state), total=total,
                                                                 kw=kw)],
                              tmp_path / "launcher.log", state, within_s=300, min_step=1)


def trainers_done(state: Path) -> int:
    """Microbatches the two trainers have done, by their progress files (0 for one not written yet)."""
    done = 0
    for rank in (0, 1):
        with contextlib.suppress(OSError, ValueError, KeyError):
            done += json.loads((state / f"trainer{rank}.json").read_text())["done"]
    return done


def test_a_launcher_sigkilled_mid_run_leaves_the_swarm_training_and_a_rerun_reattaches_to_it(tmp_path):
    """SIGKILL of the launcher's process group mid-run: the swarm (its own process groups) trains on without it, and
    the same command again within ``launcher_grace_s`` re-attaches to the live swarm and finishes it: nothing is
    resumed, trained again or lost."""
    total, state = 240, tmp_path / "state"
    first = start_launcher_until_shards(tmp_path, total, state, launcher_grace_s=120.0)
    try:
        started = psutil.Process(first.pid).children(recursive=True)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)
    try:
        # the trainers go on: their count grows with no launcher (waited for, not timed)
        at_kill, deadline = trainers_done(state), time.monotonic() + 120
        while trainers_done(state) <= at_kill + 4:
            assert time.monotonic() < deadline and running(started), (at_kill, trainers_done(state))
            time.sleep(0.5)
        result, stats = launch(total, state_dir=state, checkpoint_every_s=1.0, launcher_grace_s=120.0)
    finally:
        for proc in running(started):   # whatever happened, nothing of the first launcher's swarm outlives the test
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    attached = stats["reattached"]
    assert "resumed" not in stats and attached["run_id"] == json.loads((state / "config.json").read_text())["run_id"]
    # its peers (a trainer whose shard was done meanwhile has exited)
    assert len(attached["peers"]) == 4 and set(attached["trainers"]) <= {0, 1}, attached
    assert stats["peers_killed"] == 0 and stats["rejoins"] == 0, brief(stats)
    # its training time runs from the first launcher's start, through the time without a launcher
    assert 0 < attached["training_s_before"] < stats["wall_s"], (attached, stats["wall_s"])
    assert stats["stepped_microbatches"] == [total, total] and stats["lost_gradient_samples"] == [0, 0], brief(stats)
    assert stats["stepped_samples"] == [(total + d) * MICRO for d in stats["duplicate_microbatches"]], brief(stats)
    assert all(d <= 2 + stats["retries"] for d in stats["duplicate_microbatches"]), brief(stats)
    assert stats["assembled_from"] == ["shard", "shard"] and stats["shard_steps"] == stats["stage_steps"]
    assert running(started) == [], [safe_cmdline(p) for p in running(started)]   # the adopted processes ended


def test_a_rerun_after_the_whole_swarm_is_sigkilled_resumes_from_the_stage_shards(tmp_path):
    """(d): SIGKILL of every process of the run at once (the launcher's group and each of its processes' groups),
    then the same command again: no swarm is left to re-attach to, so it resumes from the stages' shards."""
    total, state = 160, tmp_path / "state"
    first = start_launcher_until_shards(tmp_path, total, state)
    try:
        started = psutil.Process(first.pid).children(recursive=True)
        for pid in [first.pid, *(p.pid for p in started)]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        first.wait()
        gone, alive = psutil.wait_procs(started, timeout=30)
        assert running(alive) == [], [safe_cmdline(p) for p in alive]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)
    assert 0 < trainers_done(state) < total
    result, stats = launch(total, state_dir=state, checkpoint_every_s=1.0)
    resumed = stats["resumed"]
    # it resumed from the shards: the stages started at their shards' steps, the log goes on after them
    assert all(step >= 1 for step in resumed["shard_steps"]), resumed
    assert stats["first_logged_step"] == resumed["shard_steps"][1] + 1, (stats["first_logged_step"], resumed)
    assert 0 < resumed["finished_before"] < total, resumed
    # its training time counts both lives (not the gap between them); the log's times run from the first start
    assert 0 < resumed["wall_s_before"] < stats["wall_s"], (resumed, stats["wall_s"])
    assert 0 <= result.log[0]["elapsed_s"] <= result.log[-1]["elapsed_s"]
    # the same end as an uninterrupted run: every microbatch stepped on every stage, at least once (a stage whose
    # shard was ahead steps again what the rewound trainers send again, and one in flight per trainer: counted),
    # the checkpoint from the final shards
    assert stats["stepped_microbatches"] == [total, total], brief(stats)
    assert stats["stepped_samples"] == [(total + d) * MICRO for d in stats["duplicate_microbatches"]], brief(stats)
    # a stage steps again what its shard stepped and the new order owes, and one in flight per trainer
    assert all(d <= again + 2 + stats["retries"] for d, again in zip(stats["duplicate_microbatches"],
                                                                      resumed["retrained"])), brief(stats)
    assert stats["assembled_from"] == ["shard", "shard"] and stats["shard_steps"] == stats["stage_steps"]
    # the state folder outlives the run: its caller (swarm_pretrain) removes it once its outputs are written
    assert (state / run_state.RESUME_FILE).exists()


@pytest.mark.swarm
def test_sigterm_stops_the_swarm_with_each_stages_shard_at_its_last_step_and_a_rerun_resumes_there(tmp_path):
    """A deliberate stop (SIGTERM to the launcher, as ``scancel`` or Snakemake's own stop send it) during training:
    the heartbeat says ``stopping``, each stage's lowest uid at its latest step writes the stage's shard (the
    periodic shards are 600 s apart here: none before) and every process exits; the launcher exits as SIGTERM does,
    and the same command again resumes from those shards."""
    total, state = 400, tmp_path / "state"
    code = ("import sys; sys.path.insert(0, {tests!r}); import swarm_helpers as t; from pathlib import Path; "
            "t.ht.run_swarm(t.plan(state_dir=Path({state!r}), checkpoint_every_s=600.0), "
            "t.source(), {total}, progress=False)")
    first = subprocess.Popen([sys.executable, "-c", code.format(tests=str(TESTS), state=str(state), total=total)],
                             start_new_session=True, stdout=open(tmp_path / "launcher.log", "w"),
                             stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while trainers_done(state) < 40:  # training (waited for)
            assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "launcher.log").read_text()[-3000:]
            time.sleep(0.5)
        started = psutil.Process(first.pid).children(recursive=True)
        first.send_signal(signal.SIGTERM)
        code = first.wait(timeout=120)
        gone, alive = psutil.wait_procs(started, timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)
    log = (tmp_path / "launcher.log").read_text()
    assert code == 128 + signal.SIGTERM and "was stopped" in log, log[-3000:]
    assert running(alive) == [], [safe_cmdline(p) for p in alive]
    steps = {0: 0, 1: 0}
    for path in state.glob("sync-*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            steps[row["stage"]] = max(steps[row["stage"]], row["step"])
    shards = {s: newest_shard(state / "shards", s) for s in (0, 1)}
    assert all(shards[s] is not None and shards[s][0] == steps[s] >= 1 for s in (0, 1)), (shards, steps)
    assert 0 < trainers_done(state) < total
    result, stats = launch(total, state_dir=state, checkpoint_every_s=1.0)
    assert stats["resumed"]["shard_steps"] == [steps[0], steps[1]], (stats["resumed"], steps)
    assert stats["stepped_microbatches"] == [total, total], brief(stats)


@pytest.mark.swarm
def test_a_peer_started_mid_run_with_only_an_address_joins_the_stage_that_needs_it_and_serves(tmp_path):
    """Stages of 2 and 1 peers; ``cramswarm swarm-join --peer <a line of the address file>`` with nothing else,
    started as soon as that file exists: it finds the swarm's description in the DHT once training runs (the
    launcher stores it from then on; the process's start-up overlaps the launcher's), takes the stage with the
    fewest declared peers (rebalancing is off: no load records), downloads the stage's state, serves backward
    calls, and leaves with the run (exit 0); the replicas, its own included, end equal (launch's checks)."""
    total, state, log = 480, tmp_path / "state", tmp_path / "joiner.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS.parent / "src"),
                                                                     os.environ.get("PYTHONPATH")]))}
    joiner: list[subprocess.Popen] = []

    def join_once_addressed() -> None:
        deadline = time.monotonic() + 300
        while not (state / "dht_addrs.txt").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        address = (state / "dht_addrs.txt").read_text().split()[-1]
        command = [sys.executable, "-m", "cramswarm", "swarm-join", "--peer", address, "--wait-s", "300"]
        joiner.append(subprocess.Popen(command, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                       start_new_session=True))

    thread = threading.Thread(target=join_once_addressed)
    thread.start()
    try:
        result, stats = launch(total, peers_per_stage=[2, 1], state_dir=state)
        thread.join()
        code = joiner[0].wait(timeout=60)
    finally:
        thread.join()
        for proc in joiner:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert code == 0 and "stage 1 (declared peers [2, 1]" in text and "the launcher is done" in text, text[-3000:]
    uid = re.search(r"\[(s1q\d+)\] joined swarm", text).group(1)
    assert stats["per_stage_peers"] == [2, 2], stats["replica_steps"]
    assert any(uid in steps for steps in stats["replica_steps"].values()), stats["replica_steps"]
    assert stats["peer_backward_samples"][uid] > 0, stats["peer_backward_samples"]


@pytest.mark.swarm
def test_a_join_fault_starts_a_peer_that_joins_the_stage_that_needs_it_and_goes_with_the_run():
    """Stages of 2 and 1 peers; the launcher's ``join`` fault at 1 s starts ``swarm-join`` through a live entry of
    the address file: the new peer takes stage 1 (the fewest declared peers), serves backward calls, is counted in
    ``stats["joined"]`` and is one of the run's process groups (launch: none outlives the run)."""
    _, stats = launch(320, peers_per_stage=[2, 1], faults=[(1.0, "join")])
    assert [(j["stage"], j["speed"]) for j in stats["joined"]] == [(1, 1.0)], stats["joined"]
    joined = stats["joined"][0]
    assert joined["uid"].startswith("s1q") and 1.0 <= joined["t_s"] <= joined["declared_s"], joined
    assert stats["per_stage_peers"] == [2, 2], stats["replica_steps"]
    assert stats["peer_backward_samples"][joined["uid"]] > 0, stats["peer_backward_samples"]
    assert "join_failures" not in stats or not stats["join_failures"], stats["join_failures"]


def loss_records(losses: Path) -> list[int]:
    """The microbatches of a trainer's whole loss records, in order."""
    found = []
    with contextlib.suppress(OSError):
        for line in losses.read_text().splitlines():
            with contextlib.suppress(ValueError, KeyError):
                found.append(json.loads(line)["mb"])
    return found


@pytest.mark.swarm
def test_trainers_added_mid_run_with_only_an_address_share_the_work_and_the_removed_ones_leases_are_adopted(tmp_path):
    """One launcher trainer; two more started by hand once training runs (``cramswarm swarm-train --peer <a line of
    the address file> --name ..``) take leases of the same work. One of them is SIGKILLed in the middle of a lease
    (its claim goes stale and its lease is adopted), the other is told to leave (SIGTERM: it finishes its
    microbatch, releases its lease at once and exits ``EXIT_LEFT``). The run still trains every microbatch (launch's
    checks), each added trainer trained some, and leases were adopted."""
    from cramswarm.swarm.trainer import EXIT_LEFT, losses_path

    total, state = 320, tmp_path / "state"
    added: dict[str, subprocess.Popen] = {}
    events: dict[str, int] = {}

    def add_then_remove() -> None:
        deadline = time.monotonic() + 300
        while not loss_records(losses_path(state, 0)) and time.monotonic() < deadline:   # training runs
            time.sleep(0.2)
        address = (state / "dht_addrs.txt").read_text().split()[-1]
        for name in ("jA", "jB"):
            command = [sys.executable, "-m", "cramswarm", "swarm-train", "--peer", address, "--name", name]
            added[name] = subprocess.Popen(
                command, stdout=open(tmp_path / f"{name}.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
        for name, sig in (("jA", signal.SIGKILL), ("jB", signal.SIGTERM)):
            # after a whole lease, in the middle of another: its next microbatch is in the same lease (waited for)
            while len(mbs := loss_records(losses_path(state, name))) < 5 or mbs[-1] % 4 > 1:
                if time.monotonic() > deadline or added[name].poll() is not None:
                    return
                time.sleep(0.05)
            added[name].send_signal(sig)
            events[name] = mbs[-1]

    thread = threading.Thread(target=add_then_remove)
    thread.start()
    try:
        result, stats = launch(total, trainers=1, state_dir=state)
        thread.join()
        codes = {name: proc.wait(timeout=60) for name, proc in added.items()}
    finally:
        thread.join()
        for proc in added.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in added}
    assert set(events) == {"jA", "jB"}, (events, logs)
    assert codes == {"jA": -signal.SIGKILL, "jB": EXIT_LEFT} and "[trainer jB] left" in logs["jB"], (codes, logs)
    done = stats["trainer_microbatches"]
    assert set(done) == {"0", "jA", "jB"} and all(n > 0 for n in done.values()) and sum(done.values()) >= total, done
    # jA's lease (stale after work.CLAIM_STALE_S) and jB's (released) were taken over by the others
    assert stats["adopted_leases"] >= 2, brief(stats)
    # at least once: a microbatch under way when jA died is trained again, and so may be one per raced lease
    assert all(d <= 2 + stats["retries"] + stats["yielded_leases"] for d in stats["duplicate_microbatches"]), \
        brief(stats)


@pytest.mark.swarm
def test_a_rerun_on_a_finished_runs_state_folder_trains_nothing_and_gives_the_same_checkpoint(tmp_path):
    """A run killed after its training but before its caller removed the state folder, whose outputs are gone
    (Snakemake deletes a failed job's outputs): the rerun resumes from the final shards with nothing left to train."""
    total, state = 96, tmp_path / "state"
    first, stats = launch(total, state_dir=state, checkpoint_every_s=1.0)
    assert (state / run_state.RESUME_FILE).exists()  # left to the caller (swarm_pretrain)
    again, stats = launch(total, state_dir=state, checkpoint_every_s=1.0)
    resumed = stats["resumed"]
    assert resumed["finished_before"] == total and resumed["owed_first"] == 0 and resumed["retrained"] == [0, 0], \
        resumed   # nothing owed: every microbatch stepped everywhere, with its loss
    assert resumed["from_microbatch"] == total
    assert stats["first_logged_step"] is None  # no step taken in the second life
    assert stats["stepped_microbatches"] == [total, total] and stats["assembled_from"] == ["shard", "shard"]
    assert again.log == first.log
    for mine, theirs in zip(again.stage_states, first.stage_states):
        assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


@pytest.mark.swarm
def test_the_last_replicas_of_a_stage_killed_come_back_from_its_shard():
    """Every peer of stage 1 SIGKILLed at once, after the stages wrote shards: a restart that finds no live replica to
    download from serves the stage's newest shard (peer_sync.ALONE_AFTER_S after the dead records expired), and the
    run finishes with every microbatch trained (launch's checks); the stage's steps since its shard are lost."""
    total = 200
    result, stats = launch(total, faults=[(6.0, "allofstage1")], rejoin_after_s=0.5, checkpoint_every_s=1.0,
                           retry=RetryPolicy(forward_timeout_s=5.0, give_up_after_s=90.0))
    assert [k["stage"] for k in stats["killed"]] == [1, 1] and stats["rejoins"] == 2, brief(stats)
    # the first restart to find the stage empty serves the shard; the other either does the same (same newest shard)
    # or, if the first declared itself already, downloads from it (launch checked that the replicas are equal)
    restored = stats["served_from_shard_alone"]
    assert 1 <= len(restored) <= 2 and all(step >= 1 for step in restored.values()), restored
    assert len(set(restored.values())) == 1, restored


@pytest.mark.swarm
def test_sigkill_of_all_peers_of_a_stage_but_one_at_once_loses_no_microbatch():
    """(e): two of stage 0's three peers SIGKILLed at once; the survivor serves alone until they rejoin."""
    total = 480   # long enough for both replacements (new processes: 10-20 s to start on a busy 2-core host)
    result, stats = launch(total, peers_per_stage=[3, 2], faults=[(5.0, "stage0")], rejoin_after_s=0.5)
    assert [k["stage"] for k in stats["killed"]] == [0, 0] and stats["rejoins"] == 2, brief(stats)
    assert stats["per_stage_peers"] == [3, 2], stats["replica_steps"]
    # the killed peers' unaveraged gradients are lost (as in SWARM): at most a step's batch each (its target and
    # what arrived while it was taken), and so are a replica's when it was left out of a step and downloaded the
    # state (a resync; more of them under load)
    low, high = 0, (2 + stats["resyncs"]) * 2 * 4 * MICRO
    assert all(low <= n <= high for n in stats["lost_gradient_samples"]), (stats["lost_gradient_samples"], low, high)


@pytest.mark.swarm
def test_the_swarm_of_a_sigkilled_rule_leaves_after_its_grace_with_its_shards_and_a_rerun_resumes_from_them(tiny_run):
    """(d) at the rule's level: the command rule swarm_pretrain runs (its arguments; a tiny model and data),
    SIGKILLed alone - not its process group - once both stages wrote a shard. Its own p2pd gets the kernel's
    parent-death signal; its swarm trains on until the heartbeat has been missing ``launcher_grace_s`` (5 s here),
    then each stage's lowest uid at its latest step writes the stage's shard and every process exits. The same
    command again, with no swarm left, resumes from those shards and ends like an uninterrupted run."""
    import yaml

    from cramswarm.config import DEFAULT_SCHEMA
    from cramswarm.data import tokenizer as tokenization

    tmp, tok = tiny_run
    keys = yaml.safe_load(Path(DEFAULT_SCHEMA).read_text())["properties"]["swarm"]["properties"]
    swarm = {key: spec["default"] for key, spec in keys.items() if key != "impl"} | dict(
        transport="hivemind", stages=2, peers_per_stage=2, trainers=2, peer_speeds=[1.0], compression="blockwise8",
        averaging_compression="fp16", forward_timeout_s=5.0)
    swarm_impl = {key: spec["default"] for key, spec in keys["impl"]["properties"].items()} | dict(
        checkpoint_every_s=1.0, startup_timeout_s=120.0, launcher_grace_s=5.0)
    steps = 100   # the swarm trains on for the grace and the heartbeat record's life (15 s): not to the end
    rec = recipe(micro_batch_sequences=MICRO, batch_sequences=4 * MICRO, lr=3e-3, batch_ramp_fraction=0.0,
                 budget={"unit": "steps", "value": steps}, eval_blocks=16)
    total = 4 * steps
    vocab = tokenization.load(tok).get_vocab_size()
    out, rendezvous = tmp / "results" / "swarm" / "crammed", tmp / "results" / ".state" / "swarm" / "crammed"
    state = rendezvous / "launcher"
    # rules/swarm.smk's shell command, argument for argument
    command = [sys.executable, "-m", "cramswarm", "swarm-pretrain", "--recipe", json.dumps(rec),
               "--arch", json.dumps(TINY), "--swarm", json.dumps(swarm), "--blocks", str(tmp / "blocks.npy"),
               "--impl", json.dumps({"device": "cpu", "log_every_steps": 5}), "--swarm-impl", json.dumps(swarm_impl),
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
        gone, alive = psutil.wait_procs(started, timeout=120)   # the grace, the shards, the exits (not timed)
        assert running(alive) == [], [safe_cmdline(p) for p in alive]
        logs = "".join(path.read_text(errors="replace") for path in state.glob("s*p*.log"))
        assert "writing the stage's shard if it is this peer's" in logs, logs[-3000:]
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
    # the budget reached, every microbatch done once and stepped on every stage
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


def test_hivemind_swarm_pretraining_matches_single_process_within_the_emulations_tolerance(tiny_run, monkeypatch):
    """Loss parity on hivemind: swarm_pretrain under the launcher (2 stages x 2 peers, 3 trainer processes, blockwise
    8-bit boundaries, fp16 averaging, bf16) against cramswarm.pretrain on the same blocks and step budget (the
    launcher's trainers draw each microbatch's masks from its own seed, cramswarm.swarm.data, at the same rate):
    within test_swarm_train's PARITY_NATS, the emulation's tolerance, in final training loss and held-out loss.

    A stage steps at its target batch plus what arrived while the step was decided and averaged (SWARM's and
    hivemind's semantics): the overshoot is the calls of that latency. SWARM's regime is a batch far larger than
    that (4096 samples, calls of seconds); the miniature's calls take milliseconds, and with a batch of two
    microbatches its steps held 3-4 batches (8 steps for 30). So the peers' calls here take at least a fifth of a
    second per work unit (``SwarmPlan.peer_unit_time_s``), as a slow peer's would, and the steps stay near the
    batch."""
    from swarm_helpers import PARITY_NATS, SWARM, schema_swarm
    from swarm_helpers import TRAIN_TINY as TINY_TRAIN

    from cramswarm.pretrain import pretrain
    from cramswarm.swarm.train import swarm_pretrain

    launch = ht.run_swarm
    monkeypatch.setattr(ht, "run_swarm", lambda plan, *a, **k: launch(dataclasses.replace(plan, peer_unit_time_s=0.2),
                                                                      *a, **k))
    tmp, tok = tiny_run
    cfg = schema_swarm(**SWARM) | dict(transport="hivemind", trainers=3, forward_timeout_s=5.0, startup_timeout_s=120.0)
    rec = recipe(budget={"unit": "steps", "value": 30})
    single = pretrain(rec, TINY_TRAIN, tmp / "blocks.npy", tok, tmp / "single", progress=False, impl=impl())
    swarm = swarm_pretrain(rec, TINY_TRAIN, cfg, tmp / "blocks.npy", tok, tmp / "swarm", progress=False,
                           rendezvous=tmp / "rendezvous", impl=impl())
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
    over = stats["step_overshoot"]
    assert all(1.0 <= o["mean"] <= 2.0 for o in over.values()), (over, stats["stage_steps"])
    assert abs(swarm["final_loss"] - single["final_loss"]) < PARITY_NATS
    assert abs(swarm["eval_loss"] - single["eval_loss"]) < PARITY_NATS
