"""Throughput of the launcher's hivemind swarm on the multi-host testbed, against the simulator on the same setup.

Every process (the launcher and the DHT bootstrap, each stage peer, each trainer) runs on a host of its own
(``cramswarm.testbed.swarm``), training a tiny crammed BERT on a counting language. Testbed runs:

1. **calibration**: links unshaped, every connection through the relay with no delay (the relay's own cost
   on this machine is part of the calibration, not of the network);
2. one run per ``--setup MBIT:MS``: every host's link shaped to MBIT megabits per second, MS milliseconds one
   way through the relay;
3. the calibration again: other jobs on the machine change its speed, so the simulator is calibrated on the
   mean of the two calibrations' per-microbatch times, and both are printed (their ratio is the drift).

Before them, the per-call network cost is measured on its own testbed (``cramswarm.testbed.callcost``): hivemind
calls of the boundary payload's size (and of 64 bytes) between two hosts through the relay, unshaped at 0, 20
and 50 ms one way (the round trips per call and the fixed time per call: the line of call time against the round
trip) and at every ``--setup`` (a check of that line plus the shaped link's transfer time).

Throughput is the steady rate of the last stage's optimizer steps (microbatches stepped between its second and
its last-but-one step, over that time): the trainers' start (seconds of imports on a loaded machine) and the
final flush are left out. The simulator (``sim.run``) gets the same swarm (stages x peers, trainers, the
boundary payload of one microbatch, the shaped rate as link and NIC rate, the relay's one-way latency), twice:

* ``sim (1 RTT)``: the simulator's plain model - one round trip per call, no fixed time, the last stage's
  forward and backward two calls;
* ``sim (measured calls)``: the measured round trips per call and fixed time per call (``sim.run``'s
  ``round_trips_per_call``, ``call_overhead_s``) and the last stage's forward + backward as one call
  (``fused_last_stage``), as the hivemind trainer makes it.

* ``sim (measured calls + step)``: the measured calls and the in-stage step (``sim.run``'s ``step_s``,
  ``apply_s``, ``step_microbatches``; double-buffered: no call waits for a step): per stage, the step's latency
  and its optimizer step's time as measured in the same testbed run (the calibration's in the calibration runs,
  their mean) from the peers' step lines (``progress.stage_stalls``: ``stall_s``, from the end of the batch's
  last backward computation to the peers' optimizer step, and ``apply_s``; the means over the steady steps, those
  the throughput is measured over), and a step every ``--batch`` microbatches (the global batch: column
  ``+ step``) or every as many as the stage's steady steps held on average (the peers read each other's counts
  late and admit more, the later the longer the delay: column ``+ step, mb/step``).

Each gets one compute time per call calibrated from the calibration runs, so that the simulator reproduces the
calibration by construction and predicts the shaped runs from the network (and the steps) alone: for the
first two, the per-microbatch time of a trainer there, less the fixed time of the microbatch's calls in that
model, spread over ``3 x stages`` work units (forward 1, backward 2 per stage); for the third, the compute time
at which the simulator with the calibration's steps gives the calibration's throughput (bisection). A step
costs the simulator's throughput only its optimizer step's compute on each peer (``apply_s``). Not modelled: the
averaging's, the DHT's and the relay's share of the CPU.

    python benchmarks/swarm_testbed.py --setup 100:20 [--setup 10:50 ...] [--microbatches 80] [--batch 4]
        [--json out.json]
    python benchmarks/swarm_testbed.py --replay out.json   # an earlier run's measurements, simulated again

Needs root and iproute2 (network namespaces); prints why not and exits 1 elsewhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from cramswarm.swarm import compression, hivemind_transport  # noqa: E402
from cramswarm.swarm.data import CountingSource  # noqa: E402
from cramswarm.swarm.routing import RetryPolicy  # noqa: E402
from cramswarm.swarm.setups import BACKWARD_COMPUTE_FACTOR, PeerSpec, SwarmSetup  # noqa: E402
from cramswarm.swarm_sim import sim  # noqa: E402
from cramswarm.swarm_study.study_launcher import VOCAB, toy_arch, toy_recipe  # noqa: E402
from cramswarm.testbed import Unavailable, callcost, unavailable_reason  # noqa: E402
from cramswarm.testbed import swarm as tbswarm  # noqa: E402

SEQ = 32
CALL_DELAYS_MS = (0.0, 20.0, 50.0)   # the unshaped one-way delays the per-call cost is read from


def counting_batches(micro: int, seed: int = 0):
    """Masked microbatches of a learnable language (each sequence counts upward through 16 tokens), by index: the
    launcher's trainers make their own."""
    return CountingSource(micro, SEQ, seed)


def parse_setup(text: str) -> tuple[float, float]:
    try:
        mbit, ms = (float(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--setup takes MBIT:MS (e.g. 100:20), not {text!r}") from None
    if not mbit > 0 or ms < 0:
        raise argparse.ArgumentTypeError(f"--setup {text}: the rate must be positive, the delay not negative")
    return mbit, ms


def make_plan(args) -> hivemind_transport.SwarmPlan:
    return hivemind_transport.SwarmPlan(
        arch=toy_arch(args.hidden, max(2, args.stages), SEQ), vocab_size=VOCAB, device="cpu",
        recipe=toy_recipe(args.micro, args.batch, {"unit": "steps", "value": 1000}),
        peers_per_stage=[args.peers] * args.stages,
        trainers=args.trainers, compression=args.compression, retry=RetryPolicy(forward_timeout_s=5.0,
                                                                                give_up_after_s=30.0),
        startup_timeout_s=240.0, seed=args.seed)


def steady_mb_s(log: list[dict], micro: int) -> float:
    """Microbatches per second stepped by the last stage between its second and its last-but-one step."""
    rows = log[:-1] if len(log) > 3 else log
    if len(rows) < 2 or rows[-1]["elapsed_s"] <= rows[0]["elapsed_s"]:
        raise RuntimeError(f"too few steps to measure a rate ({len(log)}): raise --microbatches")
    return sum(r["batch_sequences"] for r in rows[1:]) / micro / (rows[-1]["elapsed_s"] - rows[0]["elapsed_s"])


def step_stalls(stalls: dict[str, list[dict]], micro: int) -> list[dict]:
    """Per stage, the mean of its steady steps' stalls and their parts (``progress.stage_stalls``; the launcher's
    ``step_stalls``): its steps but the first and the last, as the throughput leaves them out; with the steps'
    mean microbatches and the share of the steady steps' time the stage spent stepping."""
    found = []
    for stage in sorted(stalls, key=int):
        entries = stalls[stage]
        steady = entries[1:-1] if len(entries) > 3 else entries
        if not steady:
            raise RuntimeError(f"stage {stage} logged no step with samples: raise --microbatches")
        span = steady[-1]["end"] - steady[0]["end"]
        summary = {key: sum(e[key] for e in steady) / len(steady)
                   for key in ("stall_s", "trigger_s", "gather_s", "reduce_s", "apply_s")}
        found.append(summary | {"stage": int(stage), "steps": len(steady),
                                "microbatches_per_step": sum(e["samples"] for e in steady) / len(steady) / micro,
                                "stepping_share": sum(e["stall_s"] for e in steady[1:]) / span if span > 0 else None,
                                "max_stall_s": max(e["stall_s"] for e in steady)})
    return found


def testbed_run(plan, args, bandwidth_mbit, latency_ms) -> dict:
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    result = tbswarm.run(plan, counting_batches(args.micro, args.seed), args.microbatches,
                         bandwidth_mbit=bandwidth_mbit, latency_ms=latency_ms, relay=True)
    stats = result.stats
    return {"bandwidth_mbit": bandwidth_mbit, "latency_ms": latency_ms, "mb_s": steady_mb_s(result.log, args.micro),
            "microbatches_done": stats["microbatches_done"], "lost_microbatches": stats["lost_microbatches"],
            "retries": stats["retries"], "timeouts": stats["timeouts"], "steps": len(result.log),
            "stalls": step_stalls(stats["step_stalls"], args.micro),
            "overshoot": stats["step_overshoot"],
            "resyncs": stats["resyncs"],
            "wall_s": round(time.perf_counter() - started, 1), "load": [load_before, os.getloadavg()[0]]}


def boundary_bytes(plan) -> int:
    """Bytes of one microbatch's stage-boundary payload (hidden states, compressed as the swarm sends them)."""
    hidden = torch.randn(plan.recipe["micro_batch_sequences"], SEQ, plan.arch["hidden_size"])
    return compression.payload_bytes(compression.encode(hidden, plan.compression))


def call_costs(setups, payload: int, count: int) -> tuple[list[dict], dict, dict]:
    """The measured hivemind calls (``callcost.measure``) and the per-call models at the echo and payload sizes."""
    points = [(None, d) for d in CALL_DELAYS_MS] + [(mbit, ms) for mbit, ms in setups]
    measured = callcost.measure(points, [callcost.ECHO_BYTES, payload], count=count)
    return measured, callcost.call_model(measured, callcost.ECHO_BYTES), callcost.call_model(measured, payload)


def simulate(base: SwarmSetup, setups, per_mb_s: float, stages: int, *, round_trips: float = 1.0,
             overhead_s: float = 0.0, fused: bool = False) -> tuple[float, float, list[float]]:
    """(compute per forward call, simulated calibration, simulated shaped setups) for one per-call model; the
    compute is what is left of a trainer's unshaped microbatch time after its calls' fixed time."""
    calls = 2 * stages - (1 if fused else 0)
    stage_time_s = (per_mb_s - calls * overhead_s) / ((1 + BACKWARD_COMPUTE_FACTOR) * stages)
    if stage_time_s <= 0:
        raise RuntimeError(f"the calls' fixed time ({calls} x {overhead_s:.4f} s) exceeds a microbatch's "
                           f"({per_mb_s:.4f} s): no compute left to calibrate")
    options = dict(round_trips_per_call=round_trips, call_overhead_s=overhead_s, fused_last_stage=fused)
    base = dataclasses.replace(base, stage_time_s=stage_time_s)
    calibration = sim.run(base, **options)["throughput_mb_s"]
    shaped = [sim.run(dataclasses.replace(base, bandwidth_mbit_s=mbit, nic_mbit_s=mbit, latency_s=ms / 1000),
                      **options)["throughput_mb_s"] for mbit, ms in setups]
    return stage_time_s, calibration, shaped


def simulate_steps(base: SwarmSetup, setups, mb_s: float, calibration: tuple[list[float], list[float]],
                   shaped: list[tuple[list[float], list[float]]], *, round_trips: float, overhead_s: float
                   ) -> tuple[float, float, list[float]]:
    """(compute per forward call, simulated calibration, simulated shaped setups) with the measured calls and the
    in-stage step, given per run its stages' (step latencies, microbatches per step, optimizer step times): the
    compute is the one at which the simulator, given the calibration's, reproduces the calibration's ``mb_s``
    (bisection); each shaped setup gets its own."""
    options = dict(round_trips_per_call=round_trips, call_overhead_s=overhead_s, fused_last_stage=True)

    def calibrated(stage_time_s: float) -> float:
        return sim.run(dataclasses.replace(base, stage_time_s=stage_time_s), step_s=calibration[0],
                       step_microbatches=calibration[1], apply_s=calibration[2], **options)["throughput_mb_s"]

    low, high = 1e-4, 1.0
    if calibrated(low) < mb_s:
        raise RuntimeError(f"the calibration's steps {calibration} alone leave less than its {mb_s:.3f} mb/s")
    while calibrated(high) > mb_s:
        low, high = high, 2 * high
    for _ in range(30):   # the simulated throughput falls as the compute per call grows
        middle = (low + high) / 2
        low, high = (middle, high) if calibrated(middle) > mb_s else (low, middle)
    stage_time_s = (low + high) / 2
    base = dataclasses.replace(base, stage_time_s=stage_time_s)
    shaped = [sim.run(dataclasses.replace(base, bandwidth_mbit_s=mbit, nic_mbit_s=mbit, latency_s=ms / 1000),
                      step_s=stalls, step_microbatches=batches, apply_s=applies, **options)["throughput_mb_s"]
              for (mbit, ms), (stalls, batches, applies) in zip(setups, shaped)]
    return stage_time_s, calibrated(stage_time_s), shaped


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--setup", action="append", type=parse_setup, help="MBIT:MS - each host's link in megabits "
                        "per second and the relay's one-way delay in milliseconds (repeatable; default 100:20)")
    parser.add_argument("--microbatches", type=int, default=80, help="microbatches per run (the budget)")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--peers", type=int, default=2, help="peers per stage")
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--micro", type=int, default=4, help="sequences per microbatch")
    parser.add_argument("--batch", type=int, default=4, help="microbatches per global batch (one in-stage step "
                        "each)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size of the tiny model")
    parser.add_argument("--compression", default="blockwise8", help="stage-boundary compression")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--call-count", type=int, default=15, help="timed hivemind calls per size and point")
    parser.add_argument("--json", help="also write every number here")
    parser.add_argument("--replay", help="no testbed: the measurements of an earlier run's --json file (its "
                        "settings too) through this script's simulator models")
    args = parser.parse_args()
    if args.replay:
        recorded = json.loads(Path(args.replay).read_text())
        args = argparse.Namespace(**(recorded["args"] | {"json": args.json, "replay": args.replay}))
        args.setup = [tuple(setup) for setup in args.setup] if args.setup else None
    else:
        reason = unavailable_reason()
        if reason:
            print(f"no testbed here: {reason}", file=sys.stderr)
            return 1
    plan = make_plan(args)
    setups = args.setup or [(100.0, 20.0)]
    payload = boundary_bytes(plan)
    if args.replay:
        calls, echo_model, payload_model = (recorded["calls"][k] for k in ("measured", "echo_model", "payload_model"))
        before, after = (recorded["testbed"]["calibration"][k] for k in ("before", "after"))
        shaped = recorded["testbed"]["shaped"]
        print(f"replayed: the measurements of {args.replay}")
    else:
        try:
            calls, echo_model, payload_model = call_costs(setups, payload, args.call_count)
            before = testbed_run(plan, args, None, 0.0)
            shaped = [testbed_run(plan, args, mbit, ms) for mbit, ms in setups]
            after = testbed_run(plan, args, None, 0.0)
        except Unavailable as err:
            print(f"no testbed here: {err}", file=sys.stderr)
            return 1
    # one trainer's seconds per microbatch, unshaped: the mean of the calibrations before and after
    per_mb_s = args.trainers * (1 / before["mb_s"] + 1 / after["mb_s"]) / 2
    calibration = before | {"mb_s": args.trainers / per_mb_s, "before": before, "after": after,
                            "lost_microbatches": before["lost_microbatches"] + after["lost_microbatches"],
                            "timeouts": before["timeouts"] + after["timeouts"],
                            "wall_s": before["wall_s"] + after["wall_s"], "load": before["load"] + after["load"]}
    base = SwarmSetup(peers=[PeerSpec(s) for s in range(args.stages) for _ in range(args.peers)],
                      trainers=args.trainers, stage_time_s=1.0, activation_bytes=payload,
                      forward_timeout_s=plan.retry.forward_timeout_s, duration_s=600.0, seed=args.seed)
    # a call costs at least its request's and its reply's way: a slope below 1 is the measurement's noise
    round_trips = max(1.0, payload_model["round_trips_per_call"])
    overhead_s = max(0.0, payload_model["call_overhead_s"])
    plain = simulate(base, setups, per_mb_s, args.stages)
    calls_model = simulate(base, setups, per_mb_s, args.stages, round_trips=round_trips, overhead_s=overhead_s,
                           fused=True)
    # each stage's step latency, microbatches per step and optimizer step time: the calibration's the mean of its
    # two runs'
    step_keys = ("stall_s", "microbatches_per_step", "apply_s")
    calibration_steps = tuple([(b[key] + a[key]) / 2 for b, a in zip(before["stalls"], after["stalls"])]
                              for key in step_keys)
    shaped_steps = [tuple([st[key] for st in run["stalls"]] for key in step_keys) for run in shaped]
    step_model = simulate_steps(base, setups, calibration["mb_s"],
                                (calibration_steps[0], args.batch, calibration_steps[2]),
                                [(stalls, args.batch, applies) for stalls, _, applies in shaped_steps],
                                round_trips=round_trips, overhead_s=overhead_s)
    step_mb_model = simulate_steps(base, setups, calibration["mb_s"], calibration_steps, shaped_steps,
                                   round_trips=round_trips, overhead_s=overhead_s)
    print(f"swarm: {args.stages} stages x {args.peers} peers, {args.trainers} trainers, {args.microbatches} "
          f"microbatches of {args.micro} x {SEQ} tokens, {args.batch} per step, hidden {args.hidden}; boundary "
          f"payload {payload} B")
    print("one hivemind call between two testbed hosts through the relay (median ms of "
          f"{args.call_count}; model: fixed + round trips x 2 x delay + 2 x bytes x 8 / rate):")
    print(f"{'link':>10s} {'delay ms':>9s} {f'{callcost.ECHO_BYTES} B ms':>10s} {f'{payload} B ms':>12s} "
          f"{'model/measured':>15s}")
    for m, check in zip(calls, payload_model["checks"]):
        link = "unshaped" if m["bandwidth_mbit"] is None else f"{m['bandwidth_mbit']:g} Mb/s"
        print(f"{link:>10s} {m['latency_ms']:9g} {m['calls_ms'][str(callcost.ECHO_BYTES)]['median']:10.2f} "
              f"{m['calls_ms'][str(payload)]['median']:12.2f} {check['model_over_measured']:15.3f}")
    print(f"  calls that failed and were made again (not timed): {sum(m['failed_calls'] for m in calls)}")
    for model in (echo_model, payload_model):
        print(f"  {model['bytes']} B: {model['round_trips_per_call']:.3f} round trips per call, "
              f"{model['call_overhead_s'] * 1e3:.2f} ms fixed per call")
    print(f"simulator compute per forward call: {plain[0] * 1e3:.1f} ms (1 RTT), {calls_model[0] * 1e3:.1f} ms "
          f"(measured calls: {round_trips:.3f} round trips, {overhead_s * 1e3:.2f} ms fixed, last stage fused), "
          f"{step_model[0] * 1e3:.1f} ms (measured calls + step), {step_mb_model[0] * 1e3:.1f} ms (+ step, mb/step)")
    print(f"the in-stage step, per stage (mean over the steady steps; ms; a step every {args.batch} microbatches "
          "by the global batch): stall = trigger (batch computed -> a peer begins its step) + gather + all-reduce + "
          "apply; 'share' is the part of the steady time the stage spent stepping; 'over' the mean and largest "
          "batch over its target (the calls that arrived while a step was decided and averaged)")
    print(f"{'run':36s} {'stage':>5s} {'steps':>5s} {'mb/step':>7s} {'stall':>7s} {'max':>7s} {'trigger':>7s} "
          f"{'gather':>7s} {'reduce':>7s} {'apply':>7s} {'share':>6s} {'over':>6s} {'max':>6s}")
    runs = [("calibration before", before), *((f"{m:g} Mb/s, {d:g} ms", r) for (m, d), r in zip(setups, shaped)),
            ("calibration after", after)]
    for name, run in runs:
        for st in run["stalls"]:
            over = run.get("overshoot", {}).get(str(st["stage"]), {"mean": float("nan"), "max": float("nan")})
            share = "" if st["stepping_share"] is None else f"{st['stepping_share']:6.3f}"
            print(f"{name:36s} {st['stage']:5d} {st['steps']:5d} {st['microbatches_per_step']:7.2f} "
                  f"{st['stall_s'] * 1e3:7.0f} {st['max_stall_s'] * 1e3:7.0f} {st['trigger_s'] * 1e3:7.0f} "
                  f"{st['gather_s'] * 1e3:7.0f} {st['reduce_s'] * 1e3:7.0f} {st['apply_s'] * 1e3:7.0f} {share:>6s} "
                  f"{over['mean']:6.2f} {over['max']:6.2f}")
    print("throughput in microbatches per second (mb/s)")
    print(f"calibration (unshaped, relay, 0 ms): {before['mb_s']:.3f} mb/s before the shaped runs, "
          f"{after['mb_s']:.3f} after (after/before {after['mb_s'] / before['mb_s']:.3f}); the simulator is "
          "calibrated on their mean per-microbatch time")
    rows = [("calibration (mean of before, after)", calibration, plain[1], calls_model[1], step_model[1],
             step_mb_model[1])]
    rows += [(f"{mbit:g} Mb/s, {ms:g} ms one way", real, a, b, c, d) for (mbit, ms), real, a, b, c, d
             in zip(setups, shaped, plain[2], calls_model[2], step_model[2], step_mb_model[2])]
    print(f"{'setup':36s} {'testbed mb/s':>13s} {'sim/testbed: 1 RTT':>19s} {'measured calls':>15s} {'+ step':>7s} "
          f"{'+ step, mb/step':>16s} {'lost':>5s} {'timeouts':>9s} {'wall s':>7s} {'load':>10s}")
    for name, real, a, b, c, d in rows:
        print(f"{name:36s} {real['mb_s']:13.3f} {a / real['mb_s']:19.3f} {b / real['mb_s']:15.3f} "
              f"{c / real['mb_s']:7.3f} {d / real['mb_s']:16.3f} {real['lost_microbatches']:5d} "
              f"{real['timeouts']:9d} {real['wall_s']:7.1f} {min(real['load']):4.1f}-{max(real['load']):4.1f}")
    print("load: the lowest and highest 1-minute load average at the starts and ends of the run(s) (other jobs share "
          "the cores: a calibration holds for the shaped runs only as far as the load stays the same)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "args": vars(args), "boundary_bytes": payload,
            "calls": {"measured": calls, "echo_model": echo_model, "payload_model": payload_model},
            "testbed": {"calibration": calibration, "shaped": shaped},
            "sim_1rtt": {"stage_time_s": plain[0], "calibration": plain[1], "shaped": plain[2]},
            "sim_measured_calls": {"stage_time_s": calls_model[0], "round_trips_per_call": round_trips,
                                   "call_overhead_s": overhead_s, "fused_last_stage": True,
                                   "calibration": calls_model[1], "shaped": calls_model[2]},
            "sim_step": {"stage_time_s": step_model[0], "step_microbatches": args.batch,
                         "calibration_stalls_s": calibration_steps[0], "calibration_apply_s": calibration_steps[2],
                         "calibration": step_model[1],
                         "shaped": step_model[2]},
            "sim_step_mb": {"stage_time_s": step_mb_model[0], "calibration_steps": calibration_steps,
                            "shaped_steps": shaped_steps, "calibration": step_mb_model[1],
                            "shaped": step_mb_model[2]}},
            indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
