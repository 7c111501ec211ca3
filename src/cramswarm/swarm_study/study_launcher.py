"""Runs of the launcher's swarm of real processes at toy size: the ``testbed`` transport of the swarm_study
experiments (:mod:`cramswarm.swarm_study.study`) and the benchmarks ``benchmarks/swarm_launcher.py`` (loopback),
``benchmarks/swarm_testbed.py`` and ``benchmarks/swarm_churn.py`` (every process on a testbed host of its own).

The swarm trains a tiny crammed BERT (:func:`toy_arch`, the default config's ``models.crammed.arch`` shrunk) on
the toy counting language (``toy.CountingSource``) under the launcher (``hivemind_transport.run_swarm``: a
bootstrap DHT process, stage-peer processes, trainer processes with their own balancers).
A peer's speed is emulated by the peer (``SwarmPlan.peer_unit_time_s``): a call computes at least the unit time x
its work units (forward 1, backward 2, the last stage's fused call 3) / its speed, the rest slept, so the peers'
speed ratios hold on a loaded host.

:func:`run_launcher` runs a plan with a state folder of its own and reads the microbatches lost from the trainers'
loss records (:func:`lost_microbatches`); :func:`run_setup` runs an emulation ``SwarmSetup`` (peers and speeds,
trainers, stage time, routing, seconds, timeout) this way on the testbed and returns what ``emulation.run``
returns, so the study's tables take its rows as they are.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import tempfile
import time
from pathlib import Path

from cramswarm.impl import computed

VOCAB = 128        # the toy language's vocabulary (ids 5-20 used)
SEQ_TOKENS = 64    # tokens per sequence of the study's swarm
HIDDEN = 64        # hidden size of the study's toy model (2 heads, FFN 2 x hidden)
MICRO = 4          # sequences per microbatch of the study's swarm
NO_STEP_BATCH = 100_000  # microbatches per global batch: more than a run takes, so a stage steps once, at the end


@functools.lru_cache(maxsize=1)
def _default_config() -> dict:
    from cramswarm.config import REPO_ROOT, load_config

    return load_config([REPO_ROOT / "config" / "config.yaml"])


def toy_arch(hidden: int, layers: int, seq_len: int = SEQ_TOKENS) -> dict:
    """The default config's ``models.crammed.arch`` at ``hidden`` x ``layers`` (2 heads, FFN 2 x hidden)."""
    base = _default_config()["models"]["crammed"]["arch"]
    return base | dict(layers=layers, hidden_size=hidden, heads=2, intermediate_size=2 * hidden,
                       max_positions=seq_len)


def toy_recipe(micro: int, batch_micro: int, budget: dict) -> dict:
    """The default config's ``pretrain`` recipe (less its impl) with ``micro`` sequences per microbatch,
    ``batch_micro`` microbatches per global batch, ``budget``, a constant LR of 3e-3, bf16."""
    return computed(_default_config()["pretrain"]) | dict(
        budget=budget, micro_batch_sequences=micro, batch_sequences=batch_micro * micro, lr=3e-3,
        batch_ramp_fraction=0.0, warmup_fraction=0.0, precision="bf16")


def lost_microbatches(state_dir: Path) -> tuple[int, int]:
    """(microbatches with a loss record, microbatches lost) of a fresh run: a trainer goes through its lease
    (``work.LEASE_MICROBATCHES`` consecutive microbatches) in order, and whoever adopts the lease goes on where it
    stopped, so a gap before a lease's last finished microbatch was taken and never finished; a lease's end left
    untaken at the deadline is not lost. A record cut short by a kill is no finish."""
    from cramswarm.swarm.run_state import mb_of
    from cramswarm.swarm.work import LEASE_MICROBATCHES

    done = {mb for path in Path(state_dir).glob("trainer*.losses.jsonl")
            for mb in map(mb_of, path.read_text().splitlines()) if mb is not None}
    last: dict[int, int] = {}
    for mb in done:
        last[mb // LEASE_MICROBATCHES] = max(last.get(mb // LEASE_MICROBATCHES, mb), mb)
    lost = sum(i not in done for lease, end in last.items() for i in range(lease * LEASE_MICROBATCHES, end))
    return len(done), lost


def run_launcher(plan, source, total_microbatches: int, *, testbed: tuple[float | None, float] | None = None,
                 keep: bool = False, name: str = "run"):
    """Run ``plan`` under the launcher with a fresh state folder (the trainers' loss records are read from it);
    ``testbed``: (link Mbit/s or None for unshaped, one-way latency ms) puts every process on a testbed host of its
    own (``cramswarm.testbed.swarm.run``), None runs them here on loopback. Returns (``TrainResult``, microbatches
    with a loss record, microbatches lost, wall seconds). The state folder (the processes' logs)
    is deleted afterwards unless ``keep`` or the run failed (then its path is printed)."""
    from cramswarm.swarm import hivemind_transport as ht

    state_dir = Path(tempfile.mkdtemp(prefix=f"cramswarm-launcher-{name}-"))
    plan = dataclasses.replace(plan, state_dir=state_dir)
    started = time.perf_counter()
    try:
        if testbed is None:
            result = ht.run_swarm(plan, source, total_microbatches, progress=False)
        else:
            from cramswarm.testbed import swarm as tbswarm

            bandwidth_mbit, latency_ms = testbed
            result = tbswarm.run(plan, source, total_microbatches, bandwidth_mbit=bandwidth_mbit,
                                 latency_ms=latency_ms, seed=plan.seed)
        finished, lost = lost_microbatches(state_dir)
    except BaseException:
        keep = True
        raise
    finally:
        if keep:
            print(f"   [{name}] run folder kept: {state_dir}", flush=True)
        else:
            shutil.rmtree(state_dir, ignore_errors=True)
    return result, finished, lost, time.perf_counter() - started


def rate_in(done_times: list[float], start_s: float, end_s: float) -> float:
    """Microbatches per second finished in ``[start_s, end_s]`` (seconds into training)."""
    if not end_s > start_s:
        raise ValueError(f"an empty window [{start_s}, {end_s}]")
    return sum(start_s <= t <= end_s for t in done_times) / (end_s - start_s)


def killed_as_failures(killed: list[dict], num_peers: int, rejoin_after_s: float,
                       stages: list[int] | None = None) -> list:
    """The launcher's kills (``stats["killed"]``: uid, stage and seconds into training) as ``FailureEvent`` s on
    ``num_peers`` slots, each back ``rejoin_after_s`` later (when the launcher starts its replacement, which then
    loads the stage's state) or never (a kill marked ``"replaced": False``, a ``gone<N>:stage<S>`` fault): every
    kill takes a slot that is up, so ``study.peers_up`` counts the peers up. With ``stages`` (the slots' stages,
    the setup's ``peers`` in order) a kill takes an up slot of its own stage where one is up, so the simulator
    given these events starves the stage the launcher starved."""
    from cramswarm.swarm.setups import FailureEvent

    down_until, events = [float("-inf")] * num_peers, []
    for kill in sorted(killed, key=lambda k: k["t_s"]):
        if not str(kill["uid"]).startswith("s"):   # a trainer (the study kills peers only)
            continue
        at = float(kill["t_s"])
        back = rejoin_after_s if kill.get("replaced", True) else None
        up = [i for i, until in enumerate(down_until) if until <= at]
        same = [i for i in up if stages is not None and stages[i] == kill.get("stage")]
        slot = (same or up)[0]
        down_until[slot] = float("inf") if back is None else at + back
        events.append(FailureEvent(at_s=at, peer=slot, rejoin_after_s=back))
    return events


def gone_faults(setup) -> list[tuple[float, str]]:
    """``setup.failures`` (peers that die for good: ``rejoin_after_s`` None) as the launcher's faults: per time and
    stage, ``gone<N>:stage<S>`` for the N peers of stage S that die then (the launcher picks which of the stage's
    peers; they are alike here)."""
    counts: dict[tuple[float, int], int] = {}
    for event in setup.failures:
        if event.rejoin_after_s is not None:
            raise ValueError("the testbed transport takes failures for good only (rejoin_after_s None); periodic "
                             "kills come from kill_every_s")
        key = (float(event.at_s), setup.peers[event.peer].stage)
        counts[key] = counts.get(key, 0) + 1
    return [(at, f"gone{n}:stage{stage}") for (at, stage), n in sorted(counts.items())]


def join_faults(setup) -> list[tuple[float, str]]:
    """``setup.joins`` as the launcher's faults: a ``join`` (speed 1) or ``join:<speed>`` at each join's time. The
    joining peer picks its stage itself (``peer_process.serve_joined``: the most loaded one), so only joins with
    ``stage="most_loaded"`` run on the testbed."""
    faults = []
    for join in setup.joins:
        if join.stage != "most_loaded":
            raise ValueError(f"{join}: a peer joining on the testbed picks the most loaded stage itself "
                             "(JoinEvent.stage 'most_loaded')")
        faults.append((float(join.at_s), "join" if join.speed == 1.0 else f"join:{join.speed!r}"))
    return faults


def joined_as_joins(joined: list[dict]) -> list:
    """The launcher's joins (``stats["joined"]``) as ``JoinEvent`` s for the simulator: each at the second its
    peer declared itself (it has downloaded its stage's state and serves), of its speed, on the most loaded
    stage (the rule the joining peer picked its stage by)."""
    from cramswarm.swarm.setups import JoinEvent

    return [JoinEvent(at_s=float(j["declared_s"]), speed=float(j["speed"]), stage="most_loaded")
            for j in sorted(joined, key=lambda j: j["declared_s"])]


def run_setup(setup, *, link_mbit_s: float | None, latency_ms: float, kill_every_s: float | None = None,
              rejoin_after_s: float = 5.0, hidden: int = HIDDEN, micro: int = MICRO,
              step_microbatches: int | None = None) -> dict:
    """Run an emulation ``SwarmSetup`` as the launcher's swarm with every process on a testbed host of its own:
    its peers (stage, speed) as stage peers, ``setup.trainers`` trainer processes routing by ``setup.routing``
    (weighted or uniform: the launcher has no fixed chains), ``setup.stage_time_s`` as the peers' unit time (a
    forward call at speed 1 computes that long, a backward twice as long), ``setup.duration_s`` seconds of
    training (a seconds budget; the clock starts once every trainer has joined), ``setup.forward_timeout_s`` per
    forward call, the links shaped to ``link_mbit_s`` (None: unshaped) and delayed ``latency_ms`` one way by the
    relay. Kills come from the launcher: ``kill_every_s`` (a random live peer of a stage with two or more SIGKILLed
    every that many seconds, a fresh one started ``rejoin_after_s`` later) and ``setup.failures``, which may only
    hold peers that die for good (``rejoin_after_s`` None; :func:`gone_faults`: the launcher SIGKILLs that many
    peers of their stage at that second of training and replaces none). ``setup.joins`` (``stage="most_loaded"``
    only, :func:`join_faults`) are new peers of their speed that join at that second of training through the
    swarm's address file (``swarm-join``), each on a spare testbed host, on the stage they pick themselves.
    ``setup.rebalance_period_s`` is the peers' own rebalancing period (``peer_rebalance``; None: off);
    ``setup.state_download_s`` is not used (a moving or joining peer downloads the stage's state for real).
    ``step_microbatches``: the global batch in microbatches, so each stage steps in-stage every that many
    (None: ``NO_STEP_BATCH``, a stage steps once, at the end).

    Returns what ``emulation.run`` returns for the study (``throughput_mb_s``: microbatches finished within
    ``duration_s`` per second; ``timeline``; ``microbatches_done``; ``retries``; ``lost_microbatches``: taken and
    never finished, from the trainers' loss records; ``moves``: the peers' moves, ``t_s`` seconds into training)
    and ``failures`` (the kills as ``FailureEvent`` s on the setup's peers, of the killed peers' stages, see
    :func:`killed_as_failures`), ``joins`` (the joins that happened as ``JoinEvent`` s, :func:`joined_as_joins`),
    ``joined`` and ``join_failures`` (the launcher's records), ``step_overshoot`` and ``step_stalls`` (the peers'
    step lines: ``progress.overshoot`` and ``progress.stage_stalls``), ``stage_steps``, ``per_stage_peers`` (live
    replicas at the end), ``leftover_processes``, ``timeouts``, ``wall_s``, ``load_avg``, ``testbed``."""
    from cramswarm.swarm import hivemind_transport as ht
    from cramswarm.swarm.data import BOUNDED, CountingSource
    from cramswarm.swarm.routing import ROUTINGS, RetryPolicy

    if setup.routing not in ROUTINGS:
        raise ValueError(f"routing {setup.routing!r}: the launcher routes {' or '.join(ROUTINGS)} only")
    faults = sorted(gone_faults(setup) + join_faults(setup))
    stages = max(p.stage for p in setup.peers) + 1
    peers = sorted(setup.peers, key=lambda p: p.stage)   # the launcher gives peer i speed peer_speeds[i]
    plan = ht.SwarmPlan(
        arch=toy_arch(hidden, max(2, stages)), vocab_size=VOCAB, device="cpu",
        recipe=toy_recipe(micro, step_microbatches or NO_STEP_BATCH,
                          {"unit": "seconds", "value": float(setup.duration_s)}),
        peers_per_stage=[sum(p.stage == s for p in peers) for s in range(stages)],
        peer_speeds=[p.speed for p in peers], trainers=setup.trainers, routing=setup.routing,
        peer_unit_time_s=setup.stage_time_s, kill_every_s=kill_every_s, rejoin_after_s=rejoin_after_s,
        rebalance_period_s=setup.rebalance_period_s, faults=faults,
        seed=setup.seed, checkpoint_every_s=3600.0, startup_timeout_s=300.0,
        retry=RetryPolicy(forward_timeout_s=setup.forward_timeout_s, give_up_after_s=120.0))
    load = os.getloadavg()[0]
    result, _, lost, wall = run_launcher(plan, CountingSource(micro, SEQ_TOKENS, setup.seed), BOUNDED,
                                         testbed=(link_mbit_s, latency_ms), name=f"study-{setup.routing}")
    stats = result.stats
    times = [t for t in stats["microbatch_done_s"] if t <= setup.duration_s]
    return {"throughput_mb_s": rate_in(times, 0.0, setup.duration_s), "microbatches_done": len(times),
            "timeline": [(t, i + 1) for i, t in enumerate(times)], "retries": stats["retries"],
            "timeouts": stats["timeouts"], "lost_microbatches": lost, "moves": stats["moves"],
            "failures": killed_as_failures(stats["killed"], len(peers), rejoin_after_s,
                                           [p.stage for p in setup.peers]),
            "joins": joined_as_joins(stats["joined"]), "joined": stats["joined"],
            "join_failures": stats.get("join_failures", []), "step_overshoot": stats["step_overshoot"],
            "step_stalls": stats["step_stalls"], "stage_steps": stats["stage_steps"],
            "per_stage_peers": stats["per_stage_peers"],
            "leftover_processes": len(ht.leftover_processes(stats["process_groups"])),
            "wall_s": wall, "load_avg": [load, os.getloadavg()[0]], "testbed": stats["testbed"]}
