"""A starved stage on the hivemind launcher (the peers decide the move) vs the emulation and the simulator.

Setup: 2 stages, 3 stage peers placed 2 + 1, speeds 0.25, 0.25 | 0.025 (the one-peer stage is the bottleneck), 3
trainers, rebalancing every ``--period`` seconds. The hivemind run trains a tiny crammed BERT under the launcher
(``hivemind_transport.run_swarm``, the launcher; ``peer_rebalance`` decides the move). The emulation
(threads, ``emulation.run``) and the simulator (``sim.run``) run a ``setups.SwarmSetup`` of the same peers,
trainers and period for as long as the hivemind run trained, with ``--stage-time`` seconds of emulated compute per
forward call at speed 1 (default: calibrated so that the starved stage's capacity, one peer of speed 0.025 doing 3
units per microbatch, equals the hivemind run's throughput before its first move). Prints, per transport, the moves
(seconds into the run, from -> to), the throughput before the first move and after it (microbatches per second;
hivemind: from the trainers' logs, between the first microbatch and the decision and after the mover arrived;
emulation and simulator: before the decision and from one period after it) and their ratio. The hivemind run's
absolute throughput is bound by its per-call and per-step overheads (p2pd, serialisation, the in-stage averaging
every global batch), which the emulation and the simulator do not have: compare the moves and the gains, not the
absolute rates across transports. The compute per work unit that the hivemind peers measured themselves (speed /
their published rate) is printed for reference.

A fourth row, ``simulator (steps)``, gives the simulator what the hivemind run measured of its in-stage steps
(``sim.run``'s ``step_s``, ``apply_s`` and ``step_microbatches``: per stage, the mean step latency, optimizer step
time and microbatches per step of the run's steps, first and last left out, from the peers' step lines; no call
waits for a step, as on the launcher's peers) and the hivemind calls' shape (the last stage's forward and backward
as one call), and calibrates only the compute per forward call (bisection) so that its rate before the move equals
the hivemind run's. Its rate after the move is then a prediction, printed beside the hivemind run's with their
ratio (issue 17: within 15 %). The emulation has no in-stage steps.

    python benchmarks/swarm_peer_rebalance.py [--microbatches 160] [--period 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import statistics
import time
from pathlib import Path

from cramswarm.config import load_config, model_recipe
from cramswarm.swarm import hivemind_transport
from cramswarm.swarm.data import CountingSource
from cramswarm.swarm.routing import RetryPolicy
from cramswarm.swarm.setups import PeerSpec, SwarmSetup
from cramswarm.swarm_sim import emulation, sim

REPO = Path(__file__).resolve().parents[1]
SPEEDS, PLACEMENT, TRAINERS = [0.25, 0.25, 0.025], [2, 1], 3
MICRO, SEQ, VOCAB = 4, 32, 128


def batches(seed: int = 0):
    """Masked microbatches of a learnable language (each sequence counts upward through 16 tokens), by index: the
    launcher's trainers make their own."""
    return CountingSource(MICRO, SEQ, seed)


def window_rates(times: list[float], decided_s: float, arrived_s: float) -> tuple[float, float]:
    """Microbatches per second from the first completion to the decision, and from the arrival to the last."""
    before = [t for t in times if t <= decided_s]
    after = [t for t in times if t > arrived_s]
    rate = lambda ts: (len(ts) - 1) / (ts[-1] - ts[0]) if len(ts) > 1 and ts[-1] > ts[0] else float("nan")  # noqa: E731
    return rate(before), rate(after)


def hivemind_run(microbatches: int, period_s: float) -> dict:
    cfg = load_config([REPO / "config" / "config.yaml"])
    arch = cfg["models"]["crammed"]["arch"] | dict(layers=2, hidden_size=64, heads=2, intermediate_size=128,
                                                    max_positions=SEQ)
    recipe = model_recipe(cfg, "crammed") | dict(budget={"unit": "steps", "value": 1000}, micro_batch_sequences=MICRO,
                                                 batch_sequences=4 * MICRO, lr=3e-3, batch_ramp_fraction=0.0,
                                                 warmup_fraction=0.0, precision="bf16")
    plan = hivemind_transport.SwarmPlan(arch=arch, vocab_size=VOCAB, recipe=recipe, device="cpu",
                                        peers_per_stage=PLACEMENT,
                                        peer_speeds=SPEEDS, trainers=TRAINERS, rebalance_period_s=period_s,
                                        retry=RetryPolicy(forward_timeout_s=5.0, give_up_after_s=30.0),
                                        startup_timeout_s=120.0)
    return hivemind_transport.run_swarm(plan, batches(), microbatches, progress=False).stats


def unit_seconds(stats: dict) -> float:
    """Compute seconds per work unit at speed 1: the median over the peers of speed / the last rate it published
    (units per second of its own compute). Peer ``s<stage>p<n>[m<moves>]`` is the launcher's n-th start, of speed
    ``SPEEDS[n - 1]``, wherever it moved."""
    estimates = [SPEEDS[int(re.match(r"s\d+p(\d+)", uid).group(1)) - 1] / load["rate"]
                 for uid, load in stats["peer_loads"].items() if load.get("rate")]
    return statistics.median(estimates)


def measured_steps(stats: dict) -> tuple[list[float], list[float], list[float]]:
    """Per stage, the mean step latency (s), microbatches per step and optimizer step time (s) over the hivemind
    run's steps, the first and last of each stage left out (start-up and the final partial batch)."""
    stalls, batches, applies = [], [], []
    for stage in range(len(PLACEMENT)):
        entries = stats["step_stalls"].get(str(stage), [])
        steady = entries[1:-1] or entries
        if not steady:
            raise RuntimeError(f"stage {stage} logged no step: raise --microbatches")
        stalls.append(statistics.fmean(e["stall_s"] for e in steady))
        batches.append(max(1.0, statistics.fmean(e["samples"] for e in steady) / MICRO))
        applies.append(statistics.fmean(e["apply_s"] for e in steady))
    return stalls, batches, applies


def sim_rates(setup: SwarmSetup, period_s: float, **options) -> tuple[list, float, float]:
    """The simulator's moves and its rates before the first decision and from one period after it."""
    result = sim.run(setup, **options)
    timeline = [t for t, _ in result["timeline"][1:]]
    moves = result["moves"]
    decided = moves[0]["t_s"] if moves else float("inf")
    return moves, *window_rates(timeline, decided, decided + period_s)


def calibrated_steps(setup: SwarmSetup, period_s: float, before_mb_s: float, stalls, batches, applies):
    """(compute per forward call, moves, rate before, rate after) of the simulator with the measured steps, the
    compute chosen so that its rate before the move is ``before_mb_s`` (it falls as the compute grows)."""
    options = dict(step_s=stalls, step_microbatches=batches, apply_s=applies, fused_last_stage=True)

    def before(stage_time_s: float) -> float:
        rate = sim_rates(dataclasses.replace(setup, stage_time_s=stage_time_s), period_s, **options)[1]
        return rate if math.isfinite(rate) else 0.0

    low, high = 1e-5, 0.05
    while before(high) > before_mb_s and high < 10:
        low, high = high, 2 * high
    for _ in range(25):
        middle = (low + high) / 2
        low, high = (middle, high) if before(middle) > before_mb_s else (low, middle)
    stage_time_s = (low + high) / 2
    return (stage_time_s, *sim_rates(dataclasses.replace(setup, stage_time_s=stage_time_s), period_s, **options))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--microbatches", type=int, default=160, help="microbatches of the hivemind run")
    parser.add_argument("--period", type=float, default=3.0, help="rebalance_period_s (seconds)")
    parser.add_argument("--stage-time", type=float, default=None,
                        help="emulation and simulator: compute seconds per forward call at speed 1 (default: "
                             "calibrated on the hivemind run's throughput before its move)")
    args = parser.parse_args()
    started = time.time()
    stats = hivemind_run(args.microbatches, args.period)
    moves = stats["moves"]
    times = stats["microbatch_done_s"]
    rows = []
    if moves:
        rows.append(("hivemind (launcher)", [(m["t_s"], m["from_stage"], m["to_stage"]) for m in moves],
                     *window_rates(times, moves[0]["t_s"], moves[0]["arrived_s"])))
    else:
        rows.append(("hivemind (launcher)", [], float("nan"), float("nan")))
    t_unit = unit_seconds(stats)
    stage_time = args.stage_time or SPEEDS[2] / (3 * rows[0][2])  # 3 units per microbatch on the starved peer
    first = times[0]
    duration = times[-1]
    setup = SwarmSetup(peers=[PeerSpec(s, v) for s, v in zip([0, 0, 1], SPEEDS)], trainers=TRAINERS,
                       stage_time_s=stage_time, rebalance_period_s=args.period, forward_timeout_s=5.0,
                       duration_s=duration - first)
    for name, result in (("emulation", emulation.run(setup)), ("simulator", sim.run(setup))):
        timeline = [t for t, _ in result["timeline"][1:]]
        result_moves = result["moves"]
        decided = result_moves[0]["t_s"] if result_moves else float("inf")
        rows.append((name, [(m["t_s"], m["from_stage"], m["to_stage"]) for m in result_moves],
                     *window_rates(timeline, decided, decided + args.period)))
    stalls, per_step, applies = measured_steps(stats)
    step_time, step_moves, step_before, step_after = calibrated_steps(setup, args.period, rows[0][2], stalls,
                                                                      per_step, applies)
    rows.append(("simulator (steps)", [(m["t_s"], m["from_stage"], m["to_stage"]) for m in step_moves],
                 step_before, step_after))
    print(f"measured {time.strftime('%Y-%m-%d', time.gmtime(started))}: {args.microbatches} microbatches, "
          f"period {args.period} s; hivemind peers' own compute per work unit at speed 1: {t_unit * 1e3:.2f} ms; "
          f"emulation and simulator: {stage_time * 1e3:.1f} ms per forward call at speed 1")
    print(f"{'transport':22s} {'moves (t_s, from, to)':44s} {'mb/s before':>12s} {'mb/s after':>11s} {'gain':>6s}")
    for name, move_list, before, after in rows:
        shown = ", ".join(f"({t:.1f}, {a}->{b})" for t, a, b in move_list) or "none"
        print(f"{name:22s} {shown:44s} {before:12.2f} {after:11.2f} {after / before:6.2f}")
    print(f"hivemind: lost microbatches {stats['lost_microbatches']}, {stats['wall_s']} s of training, "
          f"{stats['retries']} calls re-sent, lost gradient samples per stage {stats['lost_gradient_samples']}")
    print(f"simulator (steps): measured step latency {', '.join(f'{v:.2f}' for v in stalls)} s, optimizer step "
          f"{', '.join(f'{v * 1e3:.0f}' for v in applies)} ms and microbatches per step "
          f"{', '.join(f'{v:.1f}' for v in per_step)} (stages 0, 1); calibrated compute "
          f"{step_time * 1e3:.2f} ms per forward call at speed 1; after the move: simulator / hivemind = "
          f"{step_after / rows[0][3]:.3f}")


if __name__ == "__main__":
    main()
