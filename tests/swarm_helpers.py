"""Helpers of the real-process SWARM tests (hivemind processes on localhost): the tiny plan and its microbatch
source, the attach placement's stand-in tasks, process look-ups, and ``launch`` (one run under the launcher with
the checks every such run must pass)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from conftest import ARCH, recipe

from cramswarm.swarm import hivemind_transport as ht
from cramswarm.swarm.data import CountingSource, counting_microbatches
from cramswarm.swarm.peer_sync import newest_shard
from cramswarm.swarm.routing import RetryPolicy
from cramswarm.swarm.settings import ProcessConfig

TINY = ARCH | dict(layers=2, hidden_size=64, heads=2, intermediate_size=128, max_positions=32)


VOCAB, MICRO, SEQ = 128, 4, 32


# A well-formed multiaddr of a peer that does not exist (nothing listens on port 1).
NOWHERE = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWEpV7iEfzTwJ4NkkVYcuRhqCVNppEeuuE5eAqRXZUePKk"


def batches(seed: int = 0):
    """Masked microbatches of a learnable language: each sequence counts upward through 16 tokens (in order: what
    the launcher refuses, its trainers make their own from a ``source``)."""
    return counting_microbatches(MICRO, SEQ, seed)


def source(seed: int = 0) -> CountingSource:
    """The same language by microbatch index: the launcher's trainers make their own microbatches from it."""
    return CountingSource(MICRO, SEQ, seed)


def plan(**kw) -> ht.SwarmPlan:
    base = dict(arch=TINY, vocab_size=VOCAB, device="cpu", peers_per_stage=[2, 2], trainers=2, compression="blockwise8",
                recipe=recipe(micro_batch_sequences=MICRO, batch_sequences=4 * MICRO, lr=3e-3, batch_ramp_fraction=0.0,
                              budget={"unit": "steps", "value": 1000}),
                retry=RetryPolicy(forward_timeout_s=5.0, give_up_after_s=30.0), startup_timeout_s=120.0)
    return ht.SwarmPlan(**(base | kw))


def process_config(swarm_plan: ht.SwarmPlan | None = None, workdir: str | Path = ".", **fields) -> ProcessConfig:
    """What the launcher hands its processes for ``swarm_plan`` (default ``plan()``; run ``t``, files in
    ``workdir``), with ``fields`` replaced."""
    cfg = ProcessConfig.of_plan(swarm_plan or plan(), run_id="t", run_ids=["t"], seq_len=SEQ, workdir=workdir,
                                shard_dir=Path(workdir) / "shards", data=source().spec(), microbatches=0, order=None)
    return dataclasses.replace(cfg, **fields)


def own_p2p_daemons() -> list[int]:
    return sorted(ht.own_daemons())


# --------------------------------------------------------------------------------------------------------------
# Peers the launcher did not start (placements attach and srun): the tasks of a multi-node job
# --------------------------------------------------------------------------------------------------------------
def start_tasks(rendezvous, ranks, logs):
    """Stand-ins for the tasks of one multi-node job: `swarm-peer` processes started apart from the launcher
    (here before it, as the tasks of an srun step may be), each knowing only the rendezvous folder and its rank."""
    logs.mkdir(exist_ok=True)
    return [subprocess.Popen([sys.executable, "-m", "cramswarm", "swarm-peer", "--rendezvous", str(rendezvous),
                              "--rank", str(rank)], stdout=open(logs / f"rank{rank}.log", "w"),
                             stderr=subprocess.STDOUT, start_new_session=True) for rank in ranks]


@contextlib.contextmanager
def job_tasks(tmp_path, ranks):
    """``start_tasks`` in ``tmp_path``; on leaving, tasks still running are SIGKILLed unless the launcher has
    written its ``done`` file (they are leaving by themselves then). Yields (rendezvous, logs, tasks)."""
    rendezvous, logs = tmp_path / "rendezvous", tmp_path / "logs"
    tasks = start_tasks(rendezvous, ranks, logs)
    try:
        yield rendezvous, logs, tasks
    finally:
        for task in tasks:
            if task.poll() is None and not (rendezvous / "done").exists():
                os.killpg(task.pid, signal.SIGKILL)


def processes_naming(text):
    """Live processes whose command line mentions ``text`` (the tasks' peers and p2pd daemons carry the folder)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        with contextlib.suppress(psutil.Error):
            if proc.info["status"] != psutil.STATUS_ZOMBIE and any(text in part for part in proc.info["cmdline"] or []):
                found.append(proc.pid)
    return found


def processes_left(text, within_s=30.0):
    """``processes_naming(text)`` once it is empty or ``within_s`` seconds have passed: processes that were told to
    end (or lost their parent) take a moment to go, longer on a loaded machine."""
    deadline = time.monotonic() + within_s
    while (found := processes_naming(text)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return found


def wait_all(tasks, logs, timeout_s=60):
    codes = []
    for task in tasks:
        try:
            codes.append(task.wait(timeout=timeout_s))
        except subprocess.TimeoutExpired:
            task.kill()
            codes.append(None)
    assert codes == [0] * len(tasks), "\n".join(p.read_text()[-1500:] for p in sorted(logs.glob("*.log")))


KEYS = ("stepped_samples", "stepped_microbatches", "resumed",
        "stage_steps", "retries", "timeouts", "errors", "last_error", "trainer_restarts",
        "killed", "peers_killed", "rejoins", "resyncs", "digest_mismatches", "lost_gradient_samples", "replica_steps",
        "duplicate_microbatches", "step_overshoot", "trainer_microbatches")


def brief(stats: dict) -> dict:
    """The counters an assertion message shows."""
    return {key: stats.get(key) for key in KEYS}


def launch(total: int, **kw):
    """One run under the launcher; checks what every run must show, returns (result, stats)."""
    daemons_before = own_p2p_daemons()
    result = ht.run_swarm(plan(**kw), source(), total, progress=False)
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
    # (a step holds its batch plus what arrived while it was taken: fewer steps than microbatches / batch)
    assert len(losses) >= 6 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
    mb = stats["trainer_losses"]
    assert sum(mb[-16:]) / 16 < sum(mb[:16]) / 16 - 0.3
    # nothing outlives the run
    assert ht.leftover_processes(stats["process_groups"]) == []
    assert own_p2p_daemons() == daemons_before
    return result, stats


# the swarm-trained model's tests (test_swarm_train.py, the launcher's parity run): the single-process parity bound
PARITY_NATS = 0.1
TRAIN_TINY = ARCH | dict(layers=2, hidden_size=64, heads=2, intermediate_size=128)
def schema_swarm(**kw) -> dict:
    """The settings the transports read (cramswarm.swarm.train.runtime_settings) at config/schema.yaml's defaults:
    the swarm section and its impl in one dict, then ``kw``."""
    import yaml

    from cramswarm.config import DEFAULT_SCHEMA

    keys = yaml.safe_load(Path(DEFAULT_SCHEMA).read_text())["properties"]["swarm"]["properties"]
    computes = {key: spec["default"] for key, spec in keys.items() if key != "impl"}
    return computes | {key: spec["default"] for key, spec in keys["impl"]["properties"].items()} | kw


SWARM = dict(transport="emulation", stages=2, peers_per_stage=2, peer_speeds=[1.0], trainers=2,
             compression="blockwise8", averaging_compression="fp16", link_mbit_s=100.0, forward_timeout_s=30.0,
             kill_every_s=None, rejoin_after_s=5.0, rebalance_period_s=None, seed=0, placement="local",
             host="127.0.0.1", interface=None, srun_args=[], startup_timeout_s=180.0, checkpoint_every_s=60.0)


def safe_cmdline(proc: psutil.Process) -> list[str]:
    with contextlib.suppress(psutil.Error):
        return proc.cmdline()
    return []


def start_until_shards(command: list[str], log: Path, state: Path, within_s: float, env=None,
                       min_step: int = 3) -> subprocess.Popen:
    """Start ``command`` in its own process group (output to ``log``) and return once both stages of its launcher
    (state folder ``state``) wrote a shard at ``min_step`` or later; the command is killed if that fails."""
    first = subprocess.Popen(command, start_new_session=True, env=env, stdout=open(log, "w"),
                             stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + within_s
        while True:
            assert first.poll() is None, log.read_text()[-3000:]
            found = [newest_shard(state / "shards", s) for s in (0, 1)]
            if all(f is not None and f[0] >= min_step for f in found):
                return first
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)
        raise


def running(procs: list[psutil.Process]) -> list[psutil.Process]:
    """The processes of ``procs`` still running: a zombie has exited (its parent died before reaping it, and a
    container's PID 1 may never reap it), so it is left out."""
    alive = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
    return alive
