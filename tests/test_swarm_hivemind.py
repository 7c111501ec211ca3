"""Transport 1 (real hivemind processes on localhost): joining the DHT, bounded calls, the attach placement's
tasks (started apart from the launcher), clean-up. The launcher's training, kills, averaging and resume are in
test_swarm_roles.py; peer-decided rebalancing in test_swarm_peer_rebalance.py; the in-stage all-reduce's traffic per
codec in test_swarm_averaging.py. Their shared helpers are in swarm_helpers.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

pytest.importorskip("hivemind", reason="hivemind is not installed: transport 1 (real hivemind processes) is untested")

from swarm_helpers import (
    MICRO,
    NOWHERE,
    job_tasks,
    own_p2p_daemons,
    plan,
    process_config,
    processes_left,  # noqa: E402
    source,
    start_tasks,
    wait_all,
)

from cramswarm.swarm import hivemind_transport as ht  # noqa: E402
from cramswarm.swarm.launcher_faults import rank_of_uid  # noqa: E402
from cramswarm.swarm.membership import BootstrapError, RankTaken, join_swarm, listen_host
from cramswarm.swarm.peer_process import claim_rank  # noqa: E402
from cramswarm.swarm.routing import RetryPolicy  # noqa: E402
from cramswarm.swarm.settings import ProcessConfig, SwarmPlan  # noqa: E402
from cramswarm.swarm.trainer import StageClient  # noqa: E402

TESTS = Path(__file__).resolve().parent


def test_unreachable_or_garbage_bootstrap_fails_fast_with_a_clear_error(tmp_path):
    """Every process of the swarm joins through the run's address file (``join_swarm``); an entry nothing answers,
    garbage, or no file at all fails within the join timeout, naming the cause."""
    def join(addr_file, timeout_s):
        return asyncio.run(join_swarm(addr_file, host="127.0.0.1", timeout_s=timeout_s, announce=False))

    daemons_before = own_p2p_daemons()
    addr_file = tmp_path / "dht_addrs.txt"
    addr_file.write_text(NOWHERE + "\n")
    started = time.monotonic()
    try:
        with pytest.raises(BootstrapError, match="could not join the swarm DHT"):
            join(addr_file, 5.0)
        assert time.monotonic() - started < 20
        addr_file.write_text("not-a-multiaddr\n")
        with pytest.raises(BootstrapError, match="no valid multiaddr"):
            join(addr_file, 5.0)
        with pytest.raises(BootstrapError, match="did not appear"):
            join(tmp_path / "missing.txt", 1.0)
    finally:  # a failed join may leave its p2pd daemon to this process
        for pid in set(own_p2p_daemons()) - set(daemons_before):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    # a stage peer of the launcher's swarm pointed at an unreachable bootstrap exits with the same clear error
    addr_file.write_text(NOWHERE + "\n")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(process_config(join_timeout_s=5.0).to_dict()))
    proc = subprocess.run([sys.executable, "-m", "cramswarm.swarm.peer_process", "stage", "--config", str(config),
                           "--stage", "0", "--uid", "s0p1", "--addr-file", str(addr_file)],
                          capture_output=True, text=True, timeout=90, start_new_session=True)
    assert proc.returncode == 2 and "could not join the swarm DHT" in proc.stderr, proc.stderr[-2000:]


def test_declared_peers_that_never_answer_fail_the_trainers_call_within_the_bound():
    """A trainer's stage call (``StageClient._call``) to a declared peer that never answers (as one whose declared
    address cannot be reached) is re-sent, and raises once ``RetryPolicy`` is exhausted: at least 3 attempts and
    longer than ``give_up_after_s``."""
    from hivemind.utils import get_dht_time

    client = StageClient(None, "x", 1, RetryPolicy(forward_timeout_s=0.3, give_up_after_s=1.0), seed=0)
    client.balancers[0].update_peers({"s0p1": get_dht_time() + 3600}, get_dht_time())
    calls = []

    async def never_answers(stage, uid, method, tensors, meta):
        calls.append((stage, uid, method))
        await asyncio.sleep(3600)

    client._rpc = never_answers
    started = time.monotonic()
    bound = r"stage 0: \d+ forward calls in a row failed or timed out .* \(last on s0p1\)"
    with pytest.raises(TimeoutError, match=bound):
        asyncio.run(asyncio.wait_for(client._call(0, "forward", {}, {}, 1), timeout=60))
    waited = time.monotonic() - started
    assert len(calls) >= 3 and calls[0] == (0, "s0p1", "forward"), calls
    assert client.stats["timeouts"] == client.stats["retries"] == len(calls)
    assert 1.0 < waited < 30, waited


@pytest.mark.swarm
def test_peers_started_as_separate_tasks_train_through_kills_and_exit_with_the_run(tmp_path):
    """attach with kill_every_s under the launcher: it asks a random peer to die (its ``die`` RPC), the peer's task
    restarts it; one more peer is SIGKILLed from outside. The launcher started neither."""
    def kill_a_peer_from_outside():  # SIGKILL of one task's peer process group (the peer and its p2pd)
        children = psutil.Process(tasks[1].pid).children()
        if children:
            os.killpg(children[0].pid, signal.SIGKILL)

    # a restarted peer needs about 6 s on 2 loaded cores to import, join and load the state; 480 microbatches
    # (60 s of training at load 14-19, 8 peers killed and 6 back) leave it time to serve again
    total = 480
    with job_tasks(tmp_path, range(4)) as (rendezvous, logs, tasks):
        outside = threading.Timer(8.0, kill_a_peer_from_outside)
        outside.start()
        try:
            # a global batch of 16 microbatches: the peers' own steps (a gather of ~1 s each on a loaded machine)
            # would otherwise take most of the run (120 steps of 4: 183 s of training at load 19, 60 s with 16)
            result = ht.run_swarm(plan(placement="attach", rendezvous=rendezvous, state_dir=rendezvous,
                                       interface="lo", peer_speeds=[0.5], kill_every_s=4.0,
                                       rejoin_after_s=0.2, recipe=plan().recipe | {"batch_sequences": 16 * MICRO}),
                                  source(), total, progress=False)
        finally:
            outside.cancel()
    stats = result.stats
    assert stats["placement"] == "attach" and stats["roles"] == "launcher"
    assert stats["microbatches_requested"] == stats["microbatches_done"] == total and stats["lost_microbatches"] == 0
    assert stats["peers_killed"] >= 1 and stats["rejoins"] >= 1, stats
    # the uids are s<stage>r<rank>.<incarnation>: every rank served, a restarted one under a new incarnation
    uids = [uid for steps in stats["replica_steps"].values() for uid in steps]
    assert all(uid.startswith(("s0r0.", "s0r1.", "s1r2.", "s1r3.")) for uid in uids), uids
    # a task restarted its killed peer as a new incarnation, which downloaded the stage's state before serving
    everything = "".join(p.read_text() for p in sorted(logs.glob("*.log")))
    assert re.search(r"\[s\dr\d\.[1-9]\d*\] loaded stage \d state at step \d+", everything), everything[-3000:]
    assert re.search(r"\[s\dr\d\.[1-9]\d*\] serving stage", everything), everything[-3000:]
    assert stats["replicas_equal"], stats["replica_steps"]
    losses = [row["loss"] for row in result.log]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
    # the tasks read the launcher's `done` and exit 0; none of their processes is left
    wait_all(tasks, logs)
    assert processes_left(str(rendezvous)) == []


@pytest.mark.swarm
def test_tasks_exit_when_their_launcher_dies_without_a_word(tmp_path):
    """attach: the tasks are not the launcher's children, so they leave on its DHT heartbeat (``launcher_key``),
    once it has been missing ``launcher_grace_s`` (exit code 3)."""
    rendezvous, logs = tmp_path / "rendezvous", tmp_path / "logs"
    tasks = start_tasks(rendezvous, range(2), logs)
    script = (f"import sys; sys.path.insert(0, {str(TESTS)!r}); import swarm_helpers as t; "
              f"t.ht.run_swarm(t.plan(placement='attach', rendezvous={str(rendezvous)!r}, "
              f"state_dir={str(rendezvous)!r}, peers_per_stage=[1, 1], launcher_grace_s=4.0), t.source(), 10**6, "
              f"progress=False)")
    launcher = subprocess.Popen([sys.executable, "-c", script], start_new_session=True,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while "serving stage" not in "".join(p.read_text() for p in logs.glob("*.log")).replace("\n", " ") \
                or sum("serving stage" in p.read_text() for p in logs.glob("*.log")) < 2:
            assert time.monotonic() < deadline and launcher.poll() is None, "the swarm never came up"
            time.sleep(0.5)
        time.sleep(3.0)  # training
        os.killpg(launcher.pid, signal.SIGKILL)  # no clean-up, no `done`: only the heartbeat stops
        started = time.monotonic()
        codes = [task.wait(timeout=90) for task in tasks]
    finally:
        for proc in [launcher, *tasks]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    assert codes == [3, 3], [p.read_text()[-1500:] for p in logs.glob("*.log")]
    assert time.monotonic() - started < 60
    assert "has not been seen for 4 s" in (logs / "rank0.log").read_text()
    assert processes_left(str(rendezvous)) == []


@pytest.mark.swarm
def test_missing_tasks_fail_within_the_startup_timeout_naming_the_stages(tmp_path):
    with job_tasks(tmp_path, [0]) as (rendezvous, logs, tasks):  # one of the two peers ever starts
        started = time.monotonic()
        # the bound covers the launcher's bootstrap too (it took over 30 s to write its addresses at load 15-21), and
        # the started task may not have declared its peer yet either (over 20 s at load 6): the missing stage must
        # be named
        with pytest.raises(TimeoutError, match=r"within 60 s \((stage 0: 0 of 1, )?stage 1: 0 of 1\)"):
            # no state_dir: the launcher's run folder is the rendezvous folder, where the task reads the config
            ht.run_swarm(plan(placement="attach", rendezvous=rendezvous, peers_per_stage=[1, 1],
                              startup_timeout_s=60.0), source(), 4, progress=False)
        assert time.monotonic() - started < 150
    wait_all(tasks, logs)  # it read the launcher's `done` and left
    assert processes_left(str(rendezvous)) == []


def test_task_ranks_map_to_stages_and_bad_placements_fail_with_the_key(tmp_path, monkeypatch):
    assert [rank_of_uid(u) for u in ("s0r3.0", "s12r10.7", "s0p1")] == [3, 10, None]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 5")  # local placement spreads peers over these (SLURM's list)
    assert ht.visible_gpus() == ["2", "5"]
    assert listen_host(None, "lo") == "127.0.0.1" and listen_host("0.0.0.0", None) == "0.0.0.0"
    with pytest.raises(BootstrapError, match="swarm.impl.interface='no-such-if0': no such network interface"):
        listen_host("127.0.0.1", "no-such-if0")
    with pytest.raises(ValueError, match="swarm.impl.placement=attach needs a rendezvous folder"):
        ht.run_swarm(plan(placement="attach"), source(), 4, progress=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(ValueError, match="swarm.impl.placement=srun .* SLURM_JOB_ID is unset"):
        ht.run_swarm(plan(placement="srun", rendezvous=tmp_path), source(), 4, progress=False)
    # a task whose rank is beyond the swarm's peers says so and exits at once
    (tmp_path / "config.json").write_text(json.dumps(process_config(plan(peers_per_stage=[1, 1]), run_id="x",
                                                                 rejoin_after_s=0).to_dict()))
    (tmp_path / "dht_addrs.txt").write_text(NOWHERE + "\n")
    proc = subprocess.run([sys.executable, "-m", "cramswarm", "swarm-peer", "--rendezvous", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "SLURM_PROCID": "2"})
    assert proc.returncode == 2 and "rank 2 is outside the swarm's 2 peers" in proc.stderr, proc.stderr


def test_a_second_task_with_a_taken_rank_exits_naming_the_holder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(process_config(plan(peers_per_stage=[1, 1]), run_id="x",
                                                                 rejoin_after_s=0).to_dict()))
    (tmp_path / "dht_addrs.txt").write_text(NOWHERE + "\n")
    held = claim_rank(tmp_path, 1)  # a live task of rank 1 (this process)
    with pytest.raises(RankTaken, match=f"rank 1 is already taken by a running task \\(host .* pid {os.getpid()};"):
        claim_rank(tmp_path, 1)
    proc = subprocess.run([sys.executable, "-m", "cramswarm", "swarm-peer", "--rendezvous", str(tmp_path),
                           "--rank", "1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and f"rank 1 is already taken by a running task (host {socket.gethostname()} " \
        f"pid {os.getpid()}; lock {tmp_path / 'rank1.lock'})" in proc.stderr, proc.stderr
    os.close(held)  # the holder is gone (its lock went with it): the rank is free again, another one never was
    os.close(claim_rank(tmp_path, 1))
    os.close(claim_rank(tmp_path, 0))


def test_the_give_up_and_launcher_grace_are_settings():
    """swarm.impl.give_up_after_s (a stage with no live peer) and swarm.impl.launcher_grace_s (a vanished launcher)
    reach the plan every process is handed; the defaults are the former fixed 120 s and 30 s."""
    from cramswarm.config import load_config, model_recipe
    from cramswarm.impl import PretrainImpl
    from cramswarm.swarm.train import runtime_settings

    cfg = load_config([TESTS.parent / "config" / "config.yaml"])
    arch, recipe = cfg["models"]["swarm"]["arch"], model_recipe(cfg, "swarm")
    swarm = runtime_settings({k: v for k, v in cfg["swarm"].items() if k != "impl"}, cfg["swarm"]["impl"],
                             PretrainImpl.parse(cfg["pretrain"]["impl"]))
    default = SwarmPlan.from_config(arch, 512, recipe, swarm)
    assert (default.retry.give_up_after_s, default.launcher_grace_s) == (120.0, 30.0)
    patient = SwarmPlan.from_config(arch, 512, recipe, {**swarm, "give_up_after_s": 900.0, "launcher_grace_s": 300.0})
    assert (patient.retry.give_up_after_s, patient.launcher_grace_s) == (900.0, 300.0)
    assert patient.retry.forward_timeout_s == swarm["forward_timeout_s"]
    handed = process_config(patient)
    assert (handed.retry.give_up_after_s, handed.launcher_grace_s) == (900.0, 300.0)


def test_every_process_reads_the_plan_typed_and_refuses_a_config_of_another_version(tmp_path):
    """The launcher's ``config.json`` round-trips into the same ``ProcessConfig``; one with a key missing or
    unknown is refused naming the keys, by a stage process too (exit 2 before it joins anything)."""
    cfg = process_config(plan(peers_per_stage=[1, 2], peer_speeds=[1.0, 0.5]), tmp_path, link_mbit_s=None)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_dict()))
    back = ProcessConfig.read(path)
    assert back == cfg and isinstance(back.retry, RetryPolicy)
    assert back.placement_specs == [[0, 1.0], [1, 0.5], [1, 1.0]]
    assert cfg.elsewhere(str(tmp_path / "b")).shard_dir == str(tmp_path / "b")
    values = cfg.to_dict()
    del values["seq_len"]
    values["stage_count"] = 3
    with pytest.raises(ValueError, match="lacks seq_len; has unknown keys stage_count"):
        ProcessConfig.from_dict(values)
    path.write_text(json.dumps(values))
    (tmp_path / "dht_addrs.txt").write_text(NOWHERE + "\n")
    proc = subprocess.run([sys.executable, "-m", "cramswarm.swarm.peer_process", "stage", "--config", str(path),
                           "--stage", "0", "--uid", "s0p1", "--addr-file", str(tmp_path / "dht_addrs.txt")],
                          capture_output=True, text=True, timeout=120, start_new_session=True)
    assert proc.returncode == 2 and "lacks seq_len; has unknown keys stage_count" in proc.stderr, proc.stderr[-2000:]
