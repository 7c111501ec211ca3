"""The launcher's swarm (real hivemind processes on localhost): independent trainer processes, stage peers that
decide their steps among themselves, a DHT joinable through any live member - and SIGKILLs of each role mid-run."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytest.importorskip("hivemind", reason="hivemind is not installed: transport 1 (real hivemind processes) is untested")

from test_swarm_hivemind import MICRO, batches, own_p2p_daemons, plan  # noqa: E402

from cramswarm.swarm import hivemind_transport as ht  # noqa: E402
from cramswarm.swarm.peer_sync import step_target  # noqa: E402
from cramswarm.swarm.trainer import shard  # noqa: E402

TESTS = Path(__file__).resolve().parent

KEYS = ("stepped_samples", "stage_steps", "retries", "timeouts", "errors", "last_error", "trainer_restarts",
        "killed", "peers_killed", "rejoins", "resyncs", "digest_mismatches", "lost_gradient_samples", "replica_steps")


def brief(stats: dict) -> dict:
    """The counters an assertion message shows."""
    return {key: stats.get(key) for key in KEYS}


def launch(total: int, **kw):
    """One run under the launcher; checks what every run must show, returns (result, stats)."""
    daemons_before = own_p2p_daemons()
    result = ht.run_swarm(plan(decentralised=True, **kw), batches(), total, progress=False)
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
    """A launcher that ran a coordinator before (StagePeer's stub built first, as in one pytest process) must still
    reach SyncingStagePeer's handlers: hivemind caches handlers per class, and a subclass must not inherit them."""
    from cramswarm.swarm.hivemind_peer import EmulatedStagePeer, StagePeer
    from cramswarm.swarm.peer_sync import SyncingStagePeer

    StagePeer._collect_rpc_handlers()
    for cls in (SyncingStagePeer, EmulatedStagePeer):
        cls._collect_rpc_handlers()
        assert cls._stub_type is not StagePeer._stub_type and cls._stub_type.__name__ == f"{cls.__name__}Stub"
        assert cls._get_handle_name("ns", "rpc_state") == f"ns::{cls.__name__}.rpc_state"


def test_shards_partition_the_microbatches_and_step_targets_follow_the_ramp():
    total, trainers = 103, 4
    owned = sorted(i for rank in range(trainers) for i in shard(total, rank, trainers))
    assert owned == list(range(total))
    recipe = plan().recipe | {"batch_ramp_fraction": 0.5, "budget": {"unit": "steps", "value": 10}}
    # steps budget: progress = steps / 10; the batch grows from 1 micro-batch to 4 over the first half
    assert step_target(recipe, 32, 0, 0) == (0.0, MICRO)
    assert step_target(recipe, 32, 0, 5) == (0.5, 4 * MICRO)
    assert step_target(recipe, 32, 0, 2)[1] == (1 + int(0.2 / 0.5 * 4)) * MICRO


def test_a_trainer_refuses_a_rank_outside_the_trainers(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({}))
    proc = subprocess.run([sys.executable, "-m", "cramswarm.swarm.trainer", "--config", str(config), "--rank", "2",
                           "--trainers", "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--rank 2 is outside 0 .. 1" in proc.stderr


@pytest.mark.slow
def test_launcher_swarm_steps_every_sample_once_with_compressed_averaging():
    total = 96
    result, stats = launch(total)
    # no failure: every sample stepped once on each stage
    # (a backward call re-sent after a timeout on a loaded machine counts twice on its stage, as in SWARM)
    assert stats["trainer_restarts"] == 0 and stats["peers_killed"] == 0, brief(stats)
    assert all(total * MICRO <= n <= (total + stats["retries"]) * MICRO for n in stats["stepped_samples"]), \
        brief(stats)
    # the steps hold the recipe's batch up to what the peers admitted between two reads of each other's counts
    # (0.25 s apart), so a step may hold more or less than the batch and the next one makes up for it
    batch = [row["batch_sequences"] for row in result.log]
    assert sum(batch) == stats["stepped_samples"][1] and max(batch) <= 2 * 4 * MICRO, batch
    assert len(batch) >= 0.75 * total / 4, batch
    assert all(1.99 <= b <= 2.0 * 1.01 for b in stats["averaging_bytes_per_param"]), stats


@pytest.mark.slow
def test_sigkill_of_a_trainer_mid_run_resumes_its_shard_and_loses_no_microbatch():
    total = 160
    _, stats = launch(total, faults=[(4.0, "trainer0")], rejoin_after_s=0.5)
    assert [k["uid"] for k in stats["killed"]] == ["trainer0"] and stats["trainer_restarts"] == 1, brief(stats)
    # a microbatch under way when the trainer died is sent again: its gradient may count twice on a stage
    assert all(total * MICRO <= n <= (total + 1) * MICRO for n in stats["stepped_samples"]), brief(stats)


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


def test_train_runs_under_the_launcher_only_where_the_launcher_supports_the_plan():
    assert ht.decentralised_supported(plan(), 96) is None
    # rebalancing runs under the launcher: the stage peers decide the moves (peer_rebalance)
    assert ht.decentralised_supported(plan(rebalance_period_s=3.0), 96) is None
    seconds = plan().recipe | {"budget": {"unit": "seconds", "value": 60}}
    reasons = {
        "placement=attach": ht.decentralised_supported(plan(placement="attach"), 96),
        "seconds budget": ht.decentralised_supported(plan(recipe=seconds), 1 << 62),
        "peers_per_stage": ht.decentralised_supported(plan(peers_per_stage=[1, 0]), 96),
        "GiB in the trainers' shard files": ht.decentralised_supported(plan(), 10**7),
    }
    assert all(reason and key in reason for key, reason in reasons.items()), reasons
    with pytest.raises(ValueError, match="the launcher cannot run this swarm: a seconds budget"):
        ht.run_swarm(plan(recipe=seconds, decentralised=True), batches(), 8, progress=False)


@pytest.mark.slow
def test_peers_and_trainers_exit_when_the_launcher_is_sigkilled(tmp_path):
    code = ("import sys; sys.path.insert(0, {tests!r}); import test_swarm_roles as t; "
            "t.ht.run_swarm(t.plan(decentralised=True), t.batches(), 2000, progress=False)")
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
