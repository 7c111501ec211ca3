"""SWARM routing benchmark: stochastic wiring vs uniform routing, failures vs a fixed pipeline, simulator vs
emulation, measured side by side in one run.

1. Routing: one stage of three peers of speeds 1, 0.5 and 0.25, eight concurrent trainers, weighted routing
   (SWARM's interleaved weighted round-robin, ``StageBalancer``) vs uniform random routing
   (``UniformBalancer``), in the thread emulation. Target: weighted >= 1.8x uniform.
2. Failures: three stages x three peers of speed 1, twelve trainers, one random live peer killed every emulated
   minute and restarted 30 s later; throughput as a fraction of the same routing's failure-free run, for the
   swarm (weighted routing) and for fixed GPipe-style chains under the same kill schedule. Target: swarm >= 70 %.
3. Simulator vs emulation: the discrete-event simulator (``cramswarm.swarm_sim.sim``) and the emulation on the same
   setups (the routing setups above, plus two stages of heterogeneous peers). Target: within 15 %.

The emulation runs on a scaled wall clock (``--time-scale``: emulated seconds x scale = wall seconds), so its
numbers carry thread-scheduling jitter; the simulator is exact. ~1-2 minutes on 2 cores with the defaults.

    python benchmarks/swarm_routing.py
    python benchmarks/swarm_routing.py --out swarm_routing.json
    python benchmarks/swarm_routing.py --record   # append the run to results/readme/history/swarm.csv
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

# Benchmark this checkout's code, whichever checkout the editable install points at.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from cramswarm.swarm.setups import PeerSpec, SwarmSetup  # noqa: E402
from cramswarm.swarm_sim import emulation, sim  # noqa: E402
from cramswarm.swarm_sim.optimum import optimal_throughput  # noqa: E402
from cramswarm.swarm_study.study import heterogeneous_stages, periodic_kills  # noqa: E402

SPEEDS = (1.0, 0.5, 0.25)
TARGETS = {"weighted_over_uniform": 1.8, "swarm_fraction_under_failures": 0.70, "sim_vs_emulation_rel_diff": 0.15}


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def emulate(setup: SwarmSetup, time_scale: float) -> dict:
    return emulation.run(setup, time_scale=time_scale)


def routing_setups(duration_s: float) -> dict[str, SwarmSetup]:
    one = [PeerSpec(0, v) for v in SPEEDS]
    two = heterogeneous_stages(SPEEDS, 2)
    return {
        "1 stage, weighted": SwarmSetup(peers=one, trainers=8, stage_time_s=0.1, routing="weighted",
                                        forward_timeout_s=5.0, duration_s=duration_s),
        "1 stage, uniform": SwarmSetup(peers=one, trainers=8, stage_time_s=0.1, routing="uniform",
                                       forward_timeout_s=5.0, duration_s=duration_s),
        "2 stages, weighted": SwarmSetup(peers=two, trainers=16, stage_time_s=0.1, routing="weighted",
                                         forward_timeout_s=5.0, duration_s=duration_s),
    }


def failure_setups(duration_s: float, seed: int) -> dict[tuple[str, str], SwarmSetup]:
    peers = [PeerSpec(s) for s in range(3) for _ in range(3)]
    schedule = periodic_kills(len(peers), duration_s, every_s=60.0, rejoin_after_s=30.0, seed=seed)
    return {
        (routing, label): SwarmSetup(peers=peers, trainers=12, stage_time_s=1.0, routing=routing,
                                     failures=list(failures), forward_timeout_s=30.0, duration_s=duration_s,
                                     seed=seed)
        for routing in ("weighted", "fixed")
        for label, failures in (("none", []), ("kills", schedule))
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--routing-duration", type=float, default=60.0, help="emulated seconds per routing run")
    parser.add_argument("--routing-time-scale", type=float, default=0.1, help="wall seconds per emulated second")
    parser.add_argument("--failure-duration", type=float, default=300.0, help="emulated seconds per failure run")
    parser.add_argument("--failure-time-scale", type=float, default=0.02, help="wall seconds per emulated second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="also write every number to this JSON file")
    parser.add_argument("--record", action="store_true", help="append the run to the measured history "
                        "(results/readme/history/swarm.csv) and redraw docs/history/swarm.md")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    report: dict = {"targets": TARGETS, "args": {k: str(v) for k, v in vars(args).items()}}

    routing = {}
    for name, setup in routing_setups(args.routing_duration).items():
        routing[name] = {"emulation": emulate(setup, args.routing_time_scale)["throughput_mb_s"],
                         "sim": sim.run(setup)["throughput_mb_s"],
                         "optimum": optimal_throughput([p.speed for p in setup.peers], setup.num_stages,
                                                       setup.stage_time_s)}
    failures = {}
    for key, setup in failure_setups(args.failure_duration, args.seed).items():
        emulated = emulate(setup, args.failure_time_scale)
        simulated = sim.run(setup)
        failures[key] = {"emulation": emulated["throughput_mb_s"], "sim": simulated["throughput_mb_s"],
                         "emulation_retries": emulated["retries"], "sim_retries": simulated["retries"],
                         "emulation_lost": emulated["lost_microbatches"], "sim_lost": simulated["lost_microbatches"]}

    print(f"SWARM routing benchmark ({time.perf_counter() - start:.0f} s wall)")
    print("\n1. Weighted (IWRR) vs uniform routing, 1 stage, peers of speed 1 / 0.5 / 0.25, 8 trainers")
    print(f"   {'routing':<22}{'emulation mb/s':>16}{'sim mb/s':>12}{'optimum mb/s':>14}")
    for name, row in routing.items():
        print(f"   {name:<22}{row['emulation']:>16.3f}{row['sim']:>12.3f}{row['optimum']:>14.3f}")
    ratio = {t: routing["1 stage, weighted"][t] / routing["1 stage, uniform"][t] for t in ("emulation", "sim")}
    target = TARGETS["weighted_over_uniform"]
    print(f"   weighted / uniform: emulation {ratio['emulation']:.2f}x, sim {ratio['sim']:.2f}x "
          f"(target >= {target}x): {verdict(ratio['emulation'] >= target)}")

    print("\n2. One peer killed per emulated minute (back after 30 s), 3 stages x 3 peers, 12 trainers")
    print(f"   {'routing':<10}{'failures':<10}{'emulation mb/s':>16}{'sim mb/s':>12}{'retries (emu/sim)':>20}"
          f"{'lost (emu/sim)':>16}")
    for (name, label), row in failures.items():
        print(f"   {name:<10}{label:<10}{row['emulation']:>16.3f}{row['sim']:>12.3f}"
              f"{row['emulation_retries']:>11}/{row['sim_retries']:<8}{row['emulation_lost']:>9}/{row['sim_lost']}")
    fraction = {(name, t): failures[(name, "kills")][t] / failures[(name, "none")][t]
                for name in ("weighted", "fixed") for t in ("emulation", "sim")}
    target = TARGETS["swarm_fraction_under_failures"]
    print(f"   swarm under failures / failure-free: emulation {fraction[('weighted', 'emulation')]:.1%}, sim "
          f"{fraction[('weighted', 'sim')]:.1%} (target >= {target:.0%}): "
          f"{verdict(fraction[('weighted', 'emulation')] >= target)}")
    print(f"   fixed pipeline, same kills:          emulation {fraction[('fixed', 'emulation')]:.1%}, sim "
          f"{fraction[('fixed', 'sim')]:.1%}")
    print(f"   swarm / fixed throughput under kills: emulation "
          f"{failures[('weighted', 'kills')]['emulation'] / failures[('fixed', 'kills')]['emulation']:.2f}x")

    print("\n3. Simulator vs emulation, same setups (relative difference, sim / emulation - 1)")
    target = TARGETS["sim_vs_emulation_rel_diff"]
    agreement = {}
    rows = [(name, row) for name, row in routing.items()]
    rows += [(f"{name}, {label}", row) for (name, label), row in failures.items()]
    for name, row in rows:
        diff = row["sim"] / row["emulation"] - 1.0
        agreement[name] = diff
        print(f"   {name:<22}{diff:>+8.1%}  (target within {target:.0%}): {verdict(abs(diff) <= target)}")

    report.update({
        "routing_mb_s": routing,
        "weighted_over_uniform": ratio,
        "failures_mb_s": {f"{name}/{label}": row for (name, label), row in failures.items()},
        "fraction_of_failure_free": {f"{name}/{t}": v for (name, t), v in fraction.items()},
        "sim_vs_emulation_rel_diff": agreement,
        "wall_s": time.perf_counter() - start,
    })
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.out}")
    if args.record:
        record(report, argv)
    return 0


def record(report: dict, argv: list[str] | None) -> None:
    """Append this run to the SWARM history: the three targets' numbers in a line."""
    from cramswarm.report.docs import record_measurement

    ratio, fraction = report["weighted_over_uniform"], report["fraction_of_failure_free"]
    agreement = [100 * v for v in report["sim_vs_emulation_rel_diff"].values()]
    kept, within = 100 * TARGETS["swarm_fraction_under_failures"], 100 * TARGETS["sim_vs_emulation_rel_diff"]
    result = (f"Weighted / uniform routing {ratio['emulation']:.2f}× in the emulation ({ratio['sim']:.2f}× in the "
              f"simulator; target ≥ {TARGETS['weighted_over_uniform']}×); one peer killed per emulated minute: "
              f"{100 * fraction['weighted/emulation']:.1f} % of failure-free throughput, fixed pipeline "
              f"{100 * fraction['fixed/emulation']:.1f} % (target ≥ {kept:.0f} %); the simulator within "
              f"{min(agreement):+.1f} % to {max(agreement):+.1f} % of the emulation on {len(agreement)} setups "
              f"(target {within:.0f} %); {report['wall_s']:.0f} s wall.")
    args = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--record"]
    command = shlex.join(["python", "benchmarks/swarm_routing.py", *args])
    row = record_measurement("swarm", "SWARM's routing in the emulation and the simulator side by side", command,
                             result, section="SWARM routing", repo=Path(__file__).resolve().parents[1])
    print(f"recorded in results/readme/history/swarm.csv ({row['date']}, {row['commit']})")


if __name__ == "__main__":
    raise SystemExit(main())
