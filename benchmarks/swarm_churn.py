"""SWARM under churn on the multi-host testbed (peers leave for good and new ones join, the peers rebalancing
themselves, in-stage steps on), against the simulator on the same schedule.

The launcher's hivemind swarm (``study_launcher.run_setup``: every process on a testbed host of its own, the links
shaped to ``--link`` Mbit/s and delayed ``--latency`` ms one way by the relay) trains a tiny crammed BERT on the
counting language for ``--duration`` seconds (the clock starts once every trainer has joined); each peer emulates
its speed (a forward call computes at least ``--stage-time`` seconds, a backward twice that). On a machine with
few cores the swarm's two dozen processes and their ``p2pd`` daemons (a few % of a core each while idle) saturate
the CPU whatever the unit time: the testbed then measures the CPU's share as much as the peers' (peers that leave
free CPU for the others), which the simulator does not model. Two testbed runs:

1. **calibration**: ``--stages`` x ``--peers`` peers, ``--trainers`` trainers, a step every ``--batch``
   microbatches, rebalancing every ``--rebalance`` seconds, no churn;
2. **churn**: the same swarm; at ``--kill-at`` seconds the launcher SIGKILLs ``--killed`` peers of stage
   ``--starved`` for good (its ``gone<N>:stage<S>`` fault), and at each ``--join-at`` second a new peer joins as
   anyone would (the launcher's ``join`` fault: ``swarm-join`` through a live entry of the address file, on a
   spare host; it picks the most loaded stage itself and downloads its state).

The simulator (``sim.run``) gets the same swarm: the stages' boundary payload of one microbatch, the shaped rate as
link and NIC rate, the relay's one-way latency, the peers' rebalancing period, the last stage's forward and
backward as one call (the hivemind trainer's), in-stage steps every ``--batch`` microbatches with each run's own
measured step latency and optimizer-step time per stage (``progress.stage_stalls``, the means over the steady
steps, ``swarm_testbed.step_stalls``), and for the churn run the schedule that happened: the kills as
``FailureEvent`` s on peers of the killed peers' stage at their times, the joins as ``JoinEvent`` s (most loaded
stage) at the second each joiner declared itself, and a moving peer's state download as long as the testbed's
moves took on average (decided -> arrived).

Throughput is microbatches finished from ``--warmup`` seconds to the end of the run, per second, on both sides
(the trainers start at 0; on a loaded machine the testbed's first calls are slow, which the simulator does not
model). The simulator is calibrated on the calibration run's throughput in two ways, both printed, so that the
churn run is predicted from the schedule alone: ``compute`` (the compute per forward call found by bisection, each
call one round trip, as ``swarm_testbed.py``'s "+ step" column: the testbed's slowness taken as the peers') and
``calls`` (the peers' emulated compute per call and a fixed time per call found by bisection: taken as the calls',
which occupies no peer). Printed per run and model: testbed and simulated mb/s, their ratio and whether it is
within ``--tolerance``; the churn run's throughput per phase (before the kills, until the first join, after it)
and per 20 s window; moves, joins, microbatches lost, each stage's step overshoot (a step's batch over its target:
mean and max, testbed and simulator) and the processes left behind.

    python benchmarks/swarm_churn.py [--duration 180] [--link 100] [--latency 20] [--stage-time 0.5] [--json out.json]
    python benchmarks/swarm_churn.py --replay out.json     # an earlier run's testbed measurements, simulated again

Needs root and iproute2 (network namespaces); prints why not and exits 1 elsewhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from swarm_testbed import step_stalls  # noqa: E402

from cramswarm.swarm import compression  # noqa: E402
from cramswarm.swarm.settings import SwarmPlan  # noqa: E402
from cramswarm.swarm.setups import FailureEvent, JoinEvent, PeerSpec, SwarmSetup  # noqa: E402
from cramswarm.swarm_sim import sim  # noqa: E402
from cramswarm.swarm_study import study_launcher  # noqa: E402
from cramswarm.testbed import Unavailable, unavailable_reason  # noqa: E402

KEPT = ("throughput_mb_s", "microbatches_done", "timeline", "retries", "timeouts", "lost_microbatches", "moves",
        "joined", "join_failures", "step_overshoot", "step_stalls", "stage_steps", "per_stage_peers",
        "leftover_processes", "wall_s", "load_avg")


def swarm_setup(args, churn: bool) -> SwarmSetup:
    """The run's ``SwarmSetup`` for ``run_setup``: the churn run's kills for good and joins, or none."""
    peers = [PeerSpec(stage=s) for s in range(args.stages) for _ in range(args.peers)]
    victims = [i for i, p in enumerate(peers) if p.stage == args.starved][:args.killed]
    return SwarmSetup(
        peers=peers, trainers=args.trainers, stage_time_s=args.stage_time, routing="weighted",
        failures=[FailureEvent(at_s=args.kill_at, peer=i, rejoin_after_s=None) for i in victims] if churn else [],
        joins=[JoinEvent(at_s=t, stage="most_loaded") for t in args.join_at] if churn else [],
        rebalance_period_s=args.rebalance, forward_timeout_s=args.forward_timeout, duration_s=args.duration,
        seed=args.seed)


def testbed_run(args, churn: bool) -> dict:
    """One testbed run; its measurements as JSON-able values (the kills and joins as dicts)."""
    print(f"[swarm_churn] testbed run: {'churn' if churn else 'calibration'} ...", flush=True)
    result = study_launcher.run_setup(swarm_setup(args, churn), link_mbit_s=args.link, latency_ms=args.latency,
                                      step_microbatches=args.batch)
    kept = {key: result.get(key) for key in KEPT}
    kept["failures"] = [dataclasses.asdict(e) for e in result["failures"]]
    kept["joins"] = [dataclasses.asdict(e) for e in result["joins"]]
    kept["stalls"] = step_stalls(result["step_stalls"], study_launcher.MICRO)
    print(f"[swarm_churn]   {kept['throughput_mb_s']:.3f} mb/s, {kept['microbatches_done']} microbatches, "
          f"wall {kept['wall_s']:.0f} s", flush=True)
    return kept


def boundary_bytes(args) -> int:
    """Bytes of one microbatch's stage-boundary payload as the swarm sends it (the plan's compression)."""
    hidden = torch.randn(study_launcher.MICRO, study_launcher.SEQ_TOKENS, study_launcher.HIDDEN)
    return compression.payload_bytes(compression.encode(hidden, SwarmPlan.compression))  # run_setup's default


def move_seconds(moves: list[dict]) -> float:
    """The mean time of the testbed's moves that arrived, from the decision to serving the new stage (0: none)."""
    spans = [m["arrived_s"] - m["t_s"] for m in moves if "arrived_s" in m]
    return sum(spans) / len(spans) if spans else 0.0


def steps_of(run: dict) -> tuple[list[float], list[float]]:
    """Per stage, the run's mean steady step latency and optimizer-step time (``step_stalls``)."""
    return [st["stall_s"] for st in run["stalls"]], [st["apply_s"] for st in run["stalls"]]


def windowed(args, timeline: list) -> float:
    """Microbatches per second finished from ``--warmup`` seconds to the end of the run."""
    return rate(timeline, args.warmup, args.duration)


def bisect(rate_at, target: float, low: float, high: float) -> float | None:
    """The ``x`` at which ``rate_at(x)`` (falling as ``x`` grows) is ``target``; None where even ``rate_at(low)``
    is below it."""
    if rate_at(low) < target:
        return None
    while rate_at(high) > target:
        low, high = high, 2 * high
    for _ in range(30):
        middle = (low + high) / 2
        low, high = (middle, high) if rate_at(middle) > target else (low, middle)
    return (low + high) / 2


def simulate(args, calibration: dict, churn: dict, payload: int) -> dict:
    """The simulator on both runs in two calibrations on the calibration run's throughput after ``--warmup``:
    ``compute`` (the compute per forward call found by bisection, the calls one round trip, as
    ``swarm_testbed.py``'s "+ step" column) and ``calls`` (the peers' emulated compute per call, a fixed time per
    call - ``sim.run``'s ``call_overhead_s``: time that takes no peer's - found by bisection)."""
    base = dataclasses.replace(swarm_setup(args, churn=False), bandwidth_mbit_s=args.link, nic_mbit_s=args.link,
                               latency_s=args.latency / 1000, activation_bytes=payload)
    target = windowed(args, calibration["timeline"])

    def run(setup: SwarmSetup, steps: tuple[list[float], list[float]], overhead_s: float) -> dict:
        return sim.run(setup, step_s=steps[0], apply_s=steps[1], step_microbatches=args.batch,
                       fused_last_stage=True, call_overhead_s=overhead_s)

    steps = steps_of(calibration)
    stage_time_s = bisect(lambda x: windowed(args, run(dataclasses.replace(base, stage_time_s=x), steps, 0.0)
                                             ["timeline"]), target, 1e-3, 1.0)
    overhead_s = bisect(lambda x: windowed(args, run(base, steps, x)["timeline"]), target, 0.0, 1.0)
    found = {"stage_time_s": stage_time_s, "call_overhead_s": overhead_s,
             "state_download_s": move_seconds(churn["moves"]), "failures": churn["failures"], "joins": churn["joins"]}
    models = {"compute": (dataclasses.replace(base, stage_time_s=stage_time_s or 0.0), 0.0),
              "calls": (base, overhead_s)}
    for name, (setup, overhead) in models.items():
        if not setup.stage_time_s or overhead is None:   # no compute or call time reproduces the calibration
            continue
        churned = dataclasses.replace(
            setup, failures=[FailureEvent(**e) for e in churn["failures"]],
            joins=[JoinEvent(**e) for e in churn["joins"]], state_download_s=found["state_download_s"])
        found[name] = {"calibration": run(setup, steps, overhead), "churn": run(churned, steps_of(churn), overhead)}
    return found


def rate(timeline: list, start_s: float, end_s: float) -> float:
    """Microbatches per second finished in ``[start_s, end_s]`` of a timeline of (t_s, total) points."""
    return study_launcher.rate_in([t for t, total in timeline if total > 0], start_s, end_s)


def overshoot_cell(entry: dict | None) -> str:
    return "-" if not entry else f"{entry['mean']:.2f}/{entry['max']:.2f} ({entry['steps']})"


MODELS = {"compute": "sim, compute calibrated", "calls": "sim, call time calibrated"}
WINDOW_S = 20   # seconds per window of the printed timelines


def report(args, payload: int, tb: dict, simulated: dict) -> None:
    churn = tb["churn"]
    models = [m for m in MODELS if m in simulated]
    print(f"swarm: {args.stages} stages x {args.peers} peers, {args.trainers} trainers, links {args.link:g} Mbit/s, "
          f"{args.latency:g} ms one way (relay); {args.duration:g} s of training; a step every {args.batch} "
          f"microbatches of {study_launcher.MICRO} x {study_launcher.SEQ_TOKENS} tokens; rebalancing every "
          f"{args.rebalance:g} s; boundary payload {payload} B; peer unit time {args.stage_time:g} s")
    print(f"churn schedule (testbed, as it happened): kills {[(e['at_s'], e['peer']) for e in churn['failures']]} "
          f"(s, setup peer); joins {[(j['t_s'], j['declared_s'], j['uid'], j['stage']) for j in churn['joined']]} "
          f"(started s, serving s, uid, stage); join failures {len(churn['join_failures'] or [])}")
    overhead, compute = simulated["call_overhead_s"], simulated["stage_time_s"]
    print("simulator: 'compute' - compute per forward call "
          + (f"{compute * 1e3:.1f} ms found on the calibration" if compute is not None else "none fits")
          + f", one round trip per call; 'calls' - compute per forward call the peers' emulated "
          f"{args.stage_time * 1e3:.0f} ms, fixed time per call "
          + (f"{overhead * 1e3:.1f} ms found on the calibration" if overhead is not None else
             "none fits (the emulated compute alone is slower than the calibration)")
          + f"; a move's state download {simulated['state_download_s']:.2f} s (the testbed's mean move); joins at "
          f"{[round(j['at_s'], 1) for j in simulated['joins']]} s")
    print(f"throughput: microbatches finished from {args.warmup:g} s (--warmup) to {args.duration:g} s, per second "
          "(testbed whole run: from 0 s)")
    print(f"{'run':12s} {'model':26s} {'whole run':>9s} {'testbed mb/s':>12s} {'sim mb/s':>9s} {'sim/testbed':>11s} "
          f"{'within':>7s} "
          f"{'moves tb/sim':>12s} {'joins tb/sim':>12s} {'lost tb/sim':>11s} {'leftover':>8s} {'wall s':>7s} "
          f"{'load':>9s}")
    for name in ("calibration", "churn"):
        real = tb[name]
        for key in models:
            model = simulated[key][name]
            real_mb_s, model_mb_s = windowed(args, real["timeline"]), windowed(args, model["timeline"])
            ratio = model_mb_s / real_mb_s
            within = "yes" if abs(ratio - 1) <= args.tolerance else "NO"
            load = real["load_avg"]
            print(f"{name:12s} {MODELS[key]:26s} {real['throughput_mb_s']:9.3f} {real_mb_s:12.3f} {model_mb_s:9.3f} "
                  f"{ratio:11.3f} {within:>7s} {len(real['moves']):>5d}/{len(model['moves']):<6d} "
                  f"{len(real['joined']):>5d}/{model['joins']:<6d} {real['lost_microbatches']:>5d}/"
                  f"{model['lost_microbatches']:<5d} {real['leftover_processes']:8d} {real['wall_s']:7.0f} "
                  f"{min(load):4.1f}-{max(load):4.1f}")
    print(f"within: |sim/testbed - 1| <= {args.tolerance:g}")
    first_join = min([j["declared_s"] for j in churn["joined"]] or [args.duration])
    kill_at = min([e["at_s"] for e in churn["failures"]] or [args.kill_at])
    phases = [("before the kills", 0.0, kill_at), ("kills -> first join", kill_at, first_join),
              ("first join -> end", first_join, args.duration)]
    print("churn run per phase (mb/s; sim/testbed per model):")
    print(f"{'phase':22s} {'from s':>7s} {'to s':>7s} {'testbed':>8s} "
          + " ".join(f"{'sim ' + key:>12s} {'ratio':>6s}" for key in models))
    for name, start, end in phases:
        if end <= start:
            continue
        real = rate(churn["timeline"], start, end)
        cells = []
        for key in models:
            model = rate(simulated[key]["churn"]["timeline"], start, end)
            cells.append(f"{model:12.3f} " + (f"{model / real:6.3f}" if real > 0 else f"{'-':>6s}"))
        print(f"{name:22s} {start:7.1f} {end:7.1f} {real:8.3f} " + " ".join(cells))
    print(f"microbatches finished per {WINDOW_S:g} s window (testbed | sim per model):")
    for name in ("calibration", "churn"):
        starts = range(0, int(args.duration), WINDOW_S)
        rows = [("testbed", tb[name]["timeline"])] + [(f"sim {key}", simulated[key][name]["timeline"])
                                                      for key in models]
        for label, timeline in rows:
            done = [t for t, total in timeline if total > 0]
            counts = [sum(a <= t < a + WINDOW_S for t in done) for a in starts]
            print(f"  {name:12s} {label:12s} " + " ".join(f"{c:3d}" for c in counts))
    print("moves (testbed: decided s, uid, from -> to, arrived s; sim: s, from -> to):")
    for name in ("calibration", "churn"):
        real = [(m["t_s"], m["uid"], m["from_stage"], m["to_stage"], m.get("arrived_s")) for m in tb[name]["moves"]]
        print(f"  {name}: testbed {real}")
        for key in models:
            model = [(round(m["t_s"], 1), m["from_stage"], m["to_stage"]) for m in simulated[key][name]["moves"]]
            print(f"  {name}: sim {key} {model}")
    print("step overshoot per stage (a step's batch over its target: mean/max (steps)); the steady step latency and "
          "optimizer step (ms) given to the simulator:")
    print(f"{'run':12s} {'stage':>5s} {'testbed':>17s} " + " ".join(f"{'sim ' + key:>17s}" for key in models)
          + f" {'stall ms':>9s} {'apply ms':>9s}")
    for name in ("calibration", "churn"):
        for st in tb[name]["stalls"]:
            stage = st["stage"]
            cells = [overshoot_cell(simulated[key][name]["step_overshoot"].get(stage)) for key in models]
            print(f"{name:12s} {stage:5d} {overshoot_cell(tb[name]['step_overshoot'].get(str(stage))):>17s} "
                  + " ".join(f"{c:>17s}" for c in cells) + f" {st['stall_s'] * 1e3:9.0f} {st['apply_s'] * 1e3:9.0f}")
        ends = ", ".join(f"sim {key} {[len(simulated[key][name]['per_stage_peers'][s]) for s in range(args.stages)]}"
                         for key in models)
        print(f"{name:12s} peers per stage at the end: testbed {tb[name]['per_stage_peers']}, {ends}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--peers", type=int, default=3, help="peers per stage at the start")
    parser.add_argument("--trainers", type=int, default=6, help="trainer processes (12 and more saturate "
                        "2 cores with the peers: the testbed then measures the CPU's share, see above)")
    parser.add_argument("--link", type=float, default=100.0, help="every host's link, Mbit/s")
    parser.add_argument("--latency", type=float, default=20.0, help="the relay's one-way delay, ms")
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of training per run")
    parser.add_argument("--stage-time", type=float, default=0.5, help="a peer's emulated forward call at speed 1, "
                        "seconds (a backward twice that)")
    parser.add_argument("--batch", type=int, default=24, help="microbatches per global batch (one in-stage step)")
    parser.add_argument("--rebalance", type=float, default=10.0, help="the peers' rebalancing period, seconds")
    parser.add_argument("--starved", type=int, default=1, help="the stage whose peers leave")
    parser.add_argument("--killed", type=int, default=2, help="peers of that stage that leave for good")
    parser.add_argument("--kill-at", type=float, default=40.0, help="when they leave, seconds into training")
    parser.add_argument("--join-at", type=float, nargs="*", default=[80.0, 100.0],
                        help="when new peers join, seconds into training (one each)")
    parser.add_argument("--forward-timeout", type=float, default=10.0, help="a forward call's timeout, seconds")
    parser.add_argument("--warmup", type=float, default=40.0, help="seconds at the start left out of the "
                        "throughput on both sides (the trainers' and peers' first calls on a loaded machine)")
    parser.add_argument("--tolerance", type=float, default=0.15, help="the sim/testbed ratio's allowed distance "
                        "from 1 (printed, not enforced)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write every number here")
    parser.add_argument("--replay", help="no testbed: the measurements of an earlier run's --json file (its "
                        "settings too) through the simulator again")
    args = parser.parse_args()
    if args.replay:
        recorded = json.loads(Path(args.replay).read_text())
        args = argparse.Namespace(**(vars(args) | recorded["args"] | {"json": args.json, "replay": args.replay}))
        tb = recorded["testbed"]
        print(f"replayed: the testbed measurements of {args.replay}")
    else:
        reason = unavailable_reason()
        if reason:
            print(f"no testbed here: {reason}", file=sys.stderr)
            return 1
        started = time.perf_counter()
        try:
            tb = {"calibration": testbed_run(args, churn=False)}
            tb["churn"] = testbed_run(args, churn=True)
        except Unavailable as err:
            print(f"no testbed here: {err}", file=sys.stderr)
            return 1
        tb["wall_s"] = round(time.perf_counter() - started, 1)
        if args.json:   # the testbed's measurements first: a replay can simulate them again
            Path(args.json).write_text(json.dumps({"args": vars(args), "testbed": tb}, indent=1, default=str))
    payload = boundary_bytes(args)
    simulated = simulate(args, tb["calibration"], tb["churn"], payload)
    report(args, payload, tb, simulated)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "boundary_bytes": payload, "testbed": tb,
                                               "sim": simulated}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
