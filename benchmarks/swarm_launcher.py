"""SWARM on the hivemind transport itself: the launcher's swarm of real processes (issue 17's benchmarks).

Every run is ``hivemind_transport.run_swarm`` (``launcher``): a bootstrap DHT process,
stage-peer processes that decide their steps among themselves, trainer processes with their own balancers, all on
this host over loopback, training a tiny crammed BERT on the toy counting language for a seconds budget (the
trainers take microbatches until the launcher's deadline). A peer's speed s is emulated by the peer itself
(``replica.StageReplica.emulate_speed``): a call takes compute / s, the rest slept on its compute thread, where
the compute is at least ``--unit-time`` (``SwarmPlan.peer_unit_time_s``) x the call's work units (a microbatch's
forward 1, backward 2, the last stage's fused call 3). The model's real compute (milliseconds) fits under that
floor, so call times, and the peers' speed ratios, do not move with the host's load: scaling the measured compute
alone (no floor) made the fast peer slower the more work it got on this loaded 2-core machine.
The global batch (``--batch-micro``) is by default more than a run takes: the stage steps once, at the end, and
the runs measure routing and failures, not the in-stage averaging rounds (``--batch-micro 12``: a step every 12
microbatches).

1. Routing: 1 stage (``--stages``) of three peers of speed 1 / 0.5 / 0.25, ``--trainers`` trainer processes, each
   routing by the throughput it measured (``StageBalancer``, SWARM's) vs uniformly at random (``UniformBalancer``,
   ``SwarmPlan.routing``). Prints microbatches per second of each and their ratio (target >= 1.8x).
2. Failures: the same swarm with weighted routing for ``--failure-duration`` seconds, failure-free vs one random
   peer SIGKILLed every ``--kill-every`` seconds (the launcher's fault injection; it never kills the last replica of
   a stage) and a fresh peer of the same speed started ``--rejoin-after`` seconds later, which downloads the stage's
   state before it serves. Prints the ratio (target >= 70 %) and the microbatches lost: a microbatch a trainer took
   and never finished, i.e. a gap in a trainer's shard before its last finished microbatch (must be 0).
3. Memory: ``--memory-stages`` stages x 1 peer of a model whose stages differ in size (the embeddings on the first
   stage, the untied decoder on the last), trained briefly; per peer (its ``peer_memory`` counters): its peak RSS
   (``ru_maxrss``), its runtime (the RSS its process held before it built its stage: Python, PyTorch, hivemind
   and the joined DHT node; the ``p2pd`` daemon is a process of its own, not counted), the stage's peak (peak RSS
   less runtime) against the stage's predicted bytes (``stages.PEAK_BYTES_PER_PARAMETER`` x its parameters + the
   activations one backward call saved for backward, as the peer measured them), and the ratio of the two. Also
   the least-squares line peak RSS = a + b x parameters over the peers.

Throughput is microbatches finished per second of training time (the launcher's clock starts once every trainer
has joined, so process start-up does not count); ``steady`` also leaves out the first ``--warmup`` seconds.
Each run is bounded by its budget (plus the end's last step and state collection); every process it started is
gone when it returns (``run_swarm`` kills its process groups and p2pd daemons; ``leftover`` counts any process of
the run's groups still alive after it, from ``/proc``). Runs are sequential.

    python benchmarks/swarm_launcher.py                                # all three, ~15 min on 2 cores
    python benchmarks/swarm_launcher.py --parts routing --duration 60
    python benchmarks/swarm_launcher.py --out swarm_launcher.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# Benchmark this checkout's code, whichever checkout the editable install points at.
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from cramswarm.swarm import hivemind_transport as ht  # noqa: E402
from cramswarm.swarm.data import BOUNDED, CountingSource  # noqa: E402
from cramswarm.swarm.routing import RetryPolicy  # noqa: E402
from cramswarm.swarm.stages import PEAK_BYTES_PER_PARAMETER, STATE_BYTES_PER_PARAMETER  # noqa: E402
from cramswarm.swarm_study.study_launcher import SEQ_TOKENS, VOCAB, rate_in, run_launcher, toy_arch, toy_recipe  # noqa: E402

SPEEDS = [1.0, 0.5, 0.25]
TARGETS = {"weighted_over_uniform": 1.8, "fraction_under_failures": 0.70}
SEQ = SEQ_TOKENS


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def arch(hidden: int, layers: int) -> dict:
    return toy_arch(hidden, layers, SEQ)


def recipe(seconds: float, micro: int, batch_micro: int, microbatches: int | None = None) -> dict:
    budget = ({"unit": "seconds", "value": seconds} if microbatches is None
              else {"unit": "tokens", "value": microbatches * micro * SEQ})
    return toy_recipe(micro, batch_micro, budget)


def run(name: str, args, *, speeds: list[float], peers_per_stage: list[int], seconds: float, routing: str = "weighted",
        kill_every_s: float | None = None, model: dict | None = None, vocab: int = VOCAB,
        trainers: int | None = None, batch_micro: int | None = None, unit_time_s: float | None = -1.0,
        microbatches: int | None = None) -> dict:
    """One launcher run (a seconds budget, or with ``microbatches`` that many microbatches); returns its
    throughput, losses and counters."""
    trainers = trainers or args.trainers
    plan = ht.SwarmPlan(arch=model or arch(args.hidden, args.layers), vocab_size=vocab, device="cpu",
                        recipe=recipe(seconds, args.micro, batch_micro or args.batch_micro, microbatches),
                        peers_per_stage=peers_per_stage, peer_speeds=speeds, trainers=trainers, routing=routing,
                        peer_unit_time_s=args.unit_time if unit_time_s == -1.0 else unit_time_s,
                        kill_every_s=kill_every_s, rejoin_after_s=args.rejoin_after, seed=args.seed,
                        checkpoint_every_s=3600.0, startup_timeout_s=300.0,
                        retry=RetryPolicy(forward_timeout_s=args.forward_timeout, give_up_after_s=120.0))
    load_before = os.getloadavg()
    result, finished, lost, wall = run_launcher(plan, CountingSource(args.micro, SEQ, args.seed),
                                                microbatches or BOUNDED, keep=args.keep, name=name)
    stats = result.stats
    times = stats["microbatch_done_s"]
    deadline = stats.get("deadline_s") or seconds
    losses = stats["trainer_losses"]
    k = max(1, min(16, len(losses) // 4))
    row = {
        "name": name, "routing": routing, "speeds": speeds, "peers_per_stage": peers_per_stage, "trainers": trainers,
        "kill_every_s": kill_every_s, "rejoin_after_s": args.rejoin_after if kill_every_s else None,
        "budget_s": seconds, "training_s": stats["wall_s"], "run_wall_s": round(wall, 1),
        "microbatches_done": stats["microbatches_done"], "microbatches_with_loss": finished, "lost_microbatches": lost,
        "throughput_mb_s": stats["throughput_mb_s"],
        "steady_mb_s": round(rate_in(times, args.warmup, deadline), 4) if deadline > args.warmup else None,
        "loss_first": round(sum(losses[:k]) / k, 4) if losses else None,
        "loss_last": round(sum(losses[-k:]) / k, 4) if losses else None,
        "killed": stats["killed"], "rejoins": stats["rejoins"], "retries": stats["retries"],
        "timeouts": stats["timeouts"], "errors": stats["errors"], "resyncs": stats["resyncs"],
        "stage_steps": stats["stage_steps"], "replicas_equal": stats["replicas_equal"],
        "stepped_samples": stats["stepped_samples"], "lost_gradient_samples": stats["lost_gradient_samples"],
        "stage_parameters": stats["stage_parameters"], "peer_memory": stats["peer_memory"],
        "peer_backward_samples": stats.get("peer_backward_samples", {}),
        "leftover": len(ht.leftover_processes(stats["process_groups"])),
        "load_avg_before": [round(x, 2) for x in load_before], "load_avg_after": [round(x, 2) for x in os.getloadavg()],
    }
    print(f"   [{name}] {row['microbatches_done']} mb in {row['training_s']:.1f} s: {row['throughput_mb_s']:.3f} mb/s "
          f"(steady {row['steady_mb_s']}), lost {lost}, kills {len(row['killed'])}, rejoins {row['rejoins']}, "
          f"retries {row['retries']}, leftover processes {row['leftover']}, loss {row['loss_first']} -> "
          f"{row['loss_last']}, load "
          f"{row['load_avg_before'][0]} -> {row['load_avg_after'][0]}", flush=True)
    served = row["peer_backward_samples"]
    if served and sum(served.values()):
        print("   [{}] share of the samples each peer computed: {}".format(name, ", ".join(
            f"{uid} {n / sum(served.values()):.0%}" for uid, n in sorted(served.items()))), flush=True)
    return row


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else float("nan")
    return my - b * mx, b


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def memory_table(peers: list[dict]) -> list[dict]:
    """Per peer (its ``peer_memory`` counters): its stage's peak, the peak RSS less the runtime the process held
    before it built its stage, against the prediction ``PEAK_BYTES_PER_PARAMETER`` x the stage's parameters + the
    activations of one backward call (what its forward saved for backward, the last stage's logits included), and
    their ratio."""
    rows = []
    for p in peers:
        runtime, peak = p.get("runtime_rss_bytes"), p["peak_rss_bytes"]
        stage_peak = peak - runtime if runtime is not None else None
        predicted = PEAK_BYTES_PER_PARAMETER * p["stage_parameter_count"] + (p.get("activation_bytes") or 0)
        rows.append({"uid": p["uid"], "stage": p["stage"], "parameters": p["stage_parameter_count"],
                     "runtime_rss_bytes": runtime, "peak_rss_bytes": peak, "stage_peak_bytes": stage_peak,
                     "activation_bytes": p.get("activation_bytes"), "predicted_bytes": predicted,
                     "ratio": round(stage_peak / predicted, 2) if stage_peak is not None else None})
    return rows


def commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="routing,failures,memory", help="comma-separated: routing,failures,memory")
    parser.add_argument("--stages", type=int, default=1, help="stages of the routing and failure swarms (each "
                                                             "stage gets three peers of speed 1 / 0.5 / 0.25)")
    parser.add_argument("--speed-scale", type=float, default=1.0, help="multiplies the speeds 1 / 0.5 / 0.25 (below 1: "
                        "every peer sleeps more per call, so the compute the peers really do needs less CPU)")
    parser.add_argument("--unit-time", type=float, default=0.1, help="peer_unit_time_s: a call computes at least "
                        "this x its work units (forward 1, backward 2, the last stage's fused call 3) at speed 1")
    parser.add_argument("--trainers", type=int, default=8, help="trainer processes (microbatches in flight)")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size of the routing/failure model")
    parser.add_argument("--layers", type=int, default=2, help="layers of the routing/failure model")
    parser.add_argument("--micro", type=int, default=8, help="sequences per microbatch")
    parser.add_argument("--batch-micro", type=int, default=100_000, help="microbatches per global batch (the default "
                        "is more than a run takes: no in-stage step before the end's, routing alone is measured)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of training per routing run")
    parser.add_argument("--failure-duration", type=float, default=240.0, help="seconds of training per failure run")
    parser.add_argument("--failure-runs", default="none,kills", help="which failure runs: none (failure-free), "
                        "kills, or both (the ratio needs both)")
    parser.add_argument("--kill-every", type=float, default=60.0, help="seconds between SIGKILLs of a random peer")
    parser.add_argument("--rejoin-after", type=float, default=5.0, help="seconds until a fresh peer replaces a "
                                                                        "killed one (it then downloads the state)")
    parser.add_argument("--forward-timeout", type=float, default=10.0, help="seconds per forward call (backward x2.5)")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds left out of the steady rate")
    parser.add_argument("--memory-stages", type=int, default=4, help="stages (1 peer each) of the memory run")
    parser.add_argument("--memory-hidden", type=int, default=256)
    parser.add_argument("--memory-vocab", type=int, default=32768, help="vocabulary of the memory run (the "
                                                                        "embeddings and decoder make its end "
                                                                        "stages large)")
    parser.add_argument("--memory-microbatches", type=int, default=48, help="microbatches of the memory run (global "
                        "batch 4 microbatches, so that every peer steps and holds its AdamW state; a count, not "
                        "seconds, so that runs on a loaded host make the same calls); 0: --memory-duration seconds")
    parser.add_argument("--memory-duration", type=float, default=20.0, help="seconds of training of the memory run "
                        "with --memory-microbatches 0")
    parser.add_argument("--mmap-threshold", type=int, help="bytes: glibc serves allocations of at least this many "
                        "bytes with their own mappings and unmaps them when freed (MALLOC_MMAP_THRESHOLD_ in the "
                        "environment of every process the runs start); default: glibc's own, a threshold that rises "
                        "with the largest block freed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep each run's folder (logs, counters) for a look")
    parser.add_argument("--out", type=Path, help="also write every number to this JSON file")
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    if args.mmap_threshold is not None:   # the launcher's processes inherit this process's environment
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    start = time.perf_counter()
    report: dict = {"targets": TARGETS, "args": {k: str(v) for k, v in vars(args).items()}, "commit": commit(),
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cores": os.cpu_count()}
    placement = [3] * args.stages
    speeds = [args.speed_scale * s for s in SPEEDS]  # cycled over each stage's three peers

    if "routing" in parts:
        print(f"1. Routing: {args.stages} stage(s) x peers of speed {' / '.join(f'{v:g}' for v in speeds)}, "
              f"{args.trainers} trainers, global batch {args.batch_micro} microbatches, "
              f"{args.duration:.0f} s each", flush=True)
        rows = {r: run(f"routing-{r}", args, speeds=speeds, peers_per_stage=placement, seconds=args.duration,
                       routing=r) for r in ("weighted", "uniform")}
        ratio = rows["weighted"]["throughput_mb_s"] / rows["uniform"]["throughput_mb_s"]
        steady = rows["weighted"]["steady_mb_s"] / rows["uniform"]["steady_mb_s"]
        print(f"   weighted / uniform: {ratio:.2f}x (steady {steady:.2f}x; target >= "
              f"{TARGETS['weighted_over_uniform']}x): {verdict(ratio >= TARGETS['weighted_over_uniform'])}", flush=True)
        report["routing"] = {"runs": rows, "weighted_over_uniform": round(ratio, 3),
                             "steady_weighted_over_uniform": round(steady, 3)}

    if "failures" in parts:
        print(f"2. Failures: the same swarm, weighted, {args.failure_duration:.0f} s, one peer SIGKILLed every "
              f"{args.kill_every:.0f} s, a fresh one {args.rejoin_after:.0f} s later", flush=True)
        labels = args.failure_runs.split(",")
        rows = {label: run(f"failures-{label}", args, speeds=speeds, peers_per_stage=placement,
                           seconds=args.failure_duration, kill_every_s=args.kill_every if label == "kills" else None)
                for label in labels}
        lost = sum(row["lost_microbatches"] for row in rows.values())
        report["failures"] = {"runs": rows, "lost": lost}
        for row in rows.values():
            victims = ", ".join(f"{k['uid']} at {k['t_s']:.0f} s" for k in row["killed"]) or "none"
            print(f"   [{row['name']}] killed: {victims}", flush=True)
        if {"none", "kills"} <= set(rows):
            fraction = rows["kills"]["throughput_mb_s"] / rows["none"]["throughput_mb_s"]
            target = TARGETS["fraction_under_failures"]
            print(f"   under failures / failure-free: {fraction:.1%} (target >= {target:.0%}): "
                  f"{verdict(fraction >= target)}; microbatches lost: {lost} ({verdict(lost == 0)})", flush=True)
            report["failures"]["fraction_of_failure_free"] = round(fraction, 4)

    if "memory" in parts:
        stages = args.memory_stages
        model = arch(args.memory_hidden, 2 * stages)
        count = args.memory_microbatches or None
        print(f"3. Memory: {stages} stages x 1 peer, hidden {args.memory_hidden}, {2 * stages} layers, vocabulary "
              f"{args.memory_vocab}, " + (f"{count} microbatches" if count else f"{args.memory_duration:.0f} s"),
              flush=True)
        row = run("memory", args, speeds=[1.0], peers_per_stage=[1] * stages, seconds=args.memory_duration,
                  model=model, vocab=args.memory_vocab, trainers=2, batch_micro=4, unit_time_s=None,
                  microbatches=count)
        peers = sorted((p for p in row["peer_memory"] if p.get("peak_rss_bytes")), key=lambda p: p["stage"])
        table = memory_table(peers)
        print(f"   {'peer':<8}{'stage':>6}{'parameters':>12}{'runtime':>9}{'peak RSS':>10}{'stage peak':>12}"
              f"{'activations':>13}{'predicted':>11}{'ratio':>7}   (MiB)")
        for e in table:
            print(f"   {e['uid']:<8}{e['stage']:>6}{e['parameters']:>12,}{mib(e['runtime_rss_bytes']):>9}"
                  f"{mib(e['peak_rss_bytes']):>10}{mib(e['stage_peak_bytes']):>12}{mib(e['activation_bytes']):>13}"
                  f"{mib(e['predicted_bytes']):>11}{e['ratio'] if e['ratio'] is not None else '-':>7}")
        xs = [p["stage_parameter_count"] for p in peers]
        a, b = fit_line(xs, [p["peak_rss_bytes"] for p in peers])
        measured = [e for e in table if e["stage_peak_bytes"] is not None]
        c, r = fit_line([e["predicted_bytes"] for e in measured], [e["stage_peak_bytes"] for e in measured])
        print(f"   stage peak = peak RSS - the peer's runtime (its RSS before it built its stage); predicted = "
              f"{PEAK_BYTES_PER_PARAMETER} bytes x parameters + activations (the most one backward call saved)\n"
              f"   least squares over the peers: stage peak = {c / 2**20:.0f} MiB + {r:.2f} x predicted; "
              f"peak RSS = {a / 2**20:.0f} MiB + {b:.1f} bytes x parameters", flush=True)
        report["memory"] = {"run": row, "table": table, "peak_bytes_per_parameter": PEAK_BYTES_PER_PARAMETER,
                            "state_bytes_per_parameter": STATE_BYTES_PER_PARAMETER,
                            "stage_peak_fit": {"intercept_bytes": round(c), "slope": round(r, 3)},
                            "intercept_bytes": round(a), "bytes_per_parameter": round(b, 2)}

    report["wall_s"] = round(time.perf_counter() - start, 1)
    print(f"done in {report['wall_s']:.0f} s (commit {report['commit']}, {report['date']}, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())})")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
