"""What stage-boundary compression is worth over a slow link: swarm training on the multi-host testbed with each
``swarm.compression`` scheme, several seeds, side by side in one run.

Every process of the launcher's hivemind swarm (2 stages x 2 peers and 2 trainers by default) runs on a testbed host
of its own (``cramswarm.testbed.swarm``), every host's link shaped to ``--mbit`` megabits per second and ``--ms``
milliseconds one way (through the testbed's relay). The model is a tiny crammed BERT (``--hidden``) on the
counting language of ``cramswarm.swarm.data``. Per scheme and seed the script records:

* the steady throughput, two ways (the start and the final flush left out of both):
  ``mb_s``, microbatches per second stepped by the last stage between its second and its last-but-one optimizer
  step (gradients a stage dropped do not count), and ``done_mb_s``, microbatches per second the trainers finished
  (forward and backward through every stage) from the end of the first global batch to the start of the last;
* what the in-stage steps lost: per stage the gradient samples not stepped, net (a replica left out of its
  stage's step downloads the state of the one that stepped, and the gradients it held are lost, as in SWARM;
  negative: a microbatch's gradient stepped twice), state downloads (``resyncs``) and steps taken by a group of
  one peer (``solo_steps``);
* the training loss: the mean of the trainers' losses over the last quarter of the microbatches;
* the held-out loss of the assembled model on 16 microbatches the run never trained on (seed + 1000);
* microbatches lost (must be 0) and the bytes of one boundary crossing (activations of one microbatch as sent).

Runs go seed by seed, every scheme within a seed, so that a change of the machine's speed during the run is
spread over the schemes instead of landing on one. It prints one row per scheme: mean and spread (sample
standard deviation over the seeds) of throughput and of both losses, the throughput relative to ``none``, and
Welch's t-test of each mean against ``none``'s (two-sided p; ``--summarize`` redoes this from a saved ``--json``).

    python benchmarks/swarm_compression_link.py [--mbit 10 --ms 20] [--seeds 3] [--microbatches 64]
        [--schemes none,fp16,blockwise8,bottleneck2,maxout2] [--json out.json] [--keep-logs DIR]
    python benchmarks/swarm_compression_link.py --summarize out.json

Needs root and iproute2 (network namespaces); prints why not and exits 1 elsewhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from scipy import stats as scipy_stats

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from cramswarm.config import load_config, model_recipe  # noqa: E402
from cramswarm.io import write_json  # noqa: E402
from cramswarm.swarm import compression, hivemind_transport  # noqa: E402
from cramswarm.swarm.data import CountingSource  # noqa: E402
from cramswarm.swarm.routing import RetryPolicy  # noqa: E402
from cramswarm.swarm.stages import assemble_model, build_swarm_model, split_model  # noqa: E402
from cramswarm.testbed import Unavailable, unavailable_reason  # noqa: E402
from cramswarm.testbed import swarm as tbswarm  # noqa: E402

VOCAB, SEQ = 128, 32
HELDOUT_SEED_OFFSET, HELDOUT_MICROBATCHES = 1000, 16


def make_plan(args, scheme: str, seed: int) -> hivemind_transport.SwarmPlan:
    config = load_config([ROOT / "config" / "config.yaml"])
    arch = config["models"]["crammed"]["arch"] | dict(layers=2, hidden_size=args.hidden, heads=2,
                                                      intermediate_size=2 * args.hidden, max_positions=SEQ)
    recipe = model_recipe(config, "crammed") | dict(
        micro_batch_sequences=args.micro, batch_sequences=args.batch * args.micro, lr=3e-3, batch_ramp_fraction=0.0,
        warmup_fraction=0.0, precision="bf16", seed=seed, budget={"unit": "steps", "value": 1000})
    return hivemind_transport.SwarmPlan(
        arch=arch, vocab_size=VOCAB, recipe=recipe, device="cpu",
        peers_per_stage=[args.peers] * 2, trainers=args.trainers,
        compression=scheme, retry=RetryPolicy(forward_timeout_s=10.0, give_up_after_s=60.0),
        startup_timeout_s=300.0, seed=seed)  # link_mbit_s: the testbed sets the shaped rate (testbed.swarm.link_plan)


def steady_mb_s(log: list[dict], micro: int) -> float:
    """Microbatches per second stepped by the last stage between its second and its last-but-one step."""
    rows = log[:-1] if len(log) > 3 else log
    if len(rows) < 2 or rows[-1]["elapsed_s"] <= rows[0]["elapsed_s"]:
        raise RuntimeError(f"too few steps to measure a rate ({len(log)}): raise --microbatches")
    return sum(r["batch_sequences"] for r in rows[1:]) / micro / (rows[-1]["elapsed_s"] - rows[0]["elapsed_s"])


def steady_done_mb_s(done_s: list[float], batch: int) -> float:
    """Microbatches per second the trainers finished, from the ``batch``-th finished microbatch to the
    ``batch``-th last (the first global batch and the last one, flushed at the end, left out)."""
    first, last = batch - 1, len(done_s) - batch
    if last <= first or done_s[last] <= done_s[first]:
        raise RuntimeError(f"too few microbatches to measure a rate ({len(done_s)}): raise --microbatches")
    return (last - first) / (done_s[last] - done_s[first])


def heldout_loss(plan, states, seed: int) -> float:
    """Masked-LM loss of the assembled model (the boundary layers of a narrowing scheme included) on microbatches
    drawn with another seed than training's."""
    shape = build_swarm_model(plan.arch, VOCAB, seed, 2, plan.compression)
    stages = split_model(shape, 2)
    for stage, state in zip(stages, states, strict=True):
        stage.load_state_dict(state)
    model = assemble_model(stages, shape.config).eval()
    source = CountingSource(plan.recipe["micro_batch_sequences"], SEQ, seed + HELDOUT_SEED_OFFSET)
    with torch.no_grad():
        losses = [model(input_ids=inputs, labels=labels).loss.item()
                  for inputs, labels in (source[i] for i in range(HELDOUT_MICROBATCHES))]
    return statistics.fmean(losses)


def boundary_bytes(plan) -> int:
    """Bytes of one microbatch's activations at a stage boundary as the scheme sends them (a narrowing scheme's
    narrowed width, in its wire scheme: ``compression.wire_scheme``)."""
    narrow = compression.narrowing(plan.compression)
    width = plan.arch["hidden_size"] // (narrow[1] if narrow else 1)
    hidden = torch.randn(plan.recipe["micro_batch_sequences"], SEQ, width)
    return compression.payload_bytes(compression.encode(hidden, compression.wire_scheme(plan.compression)))


def one_run(args, scheme: str, seed: int) -> dict:
    plan = make_plan(args, scheme, seed)
    if args.keep_logs:  # the run's folder (the processes' logs, the peers' step lines) stays there
        plan = dataclasses.replace(plan, state_dir=Path(args.keep_logs) / f"{scheme}-seed{seed}")
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    result = tbswarm.run(plan, CountingSource(args.micro, SEQ, seed), args.microbatches, bandwidth_mbit=args.mbit,
                         latency_ms=args.ms, relay=True)
    stats = result.stats
    losses = stats["trainer_losses"]
    tail = losses[-max(1, len(losses) // 4):]
    done_s = sorted(stats["microbatch_done_s"])
    return {"scheme": scheme, "seed": seed, "mb_s": steady_mb_s(result.log, args.micro),
            "done_mb_s": steady_done_mb_s(done_s, args.batch),
            "train_loss": statistics.fmean(tail), "heldout_loss": heldout_loss(plan, result.stage_states, seed),
            "boundary_bytes": boundary_bytes(plan), "microbatches_done": stats["microbatches_done"],
            "lost_microbatches": stats["lost_microbatches"], "steps": len(result.log),
            "stage_steps": stats["stage_steps"], "lost_gradient_samples": stats["lost_gradient_samples"],
            "resyncs": stats["resyncs"],
            "solo_steps": sum(e["peers"] == 1 for entries in stats["step_stalls"].values() for e in entries),
            "link_mbit_s": stats["testbed"]["link_mbit_s"], "log": result.log, "microbatch_done_s": done_s,
            "wall_s": round(time.perf_counter() - started, 1), "load": [load_before, os.getloadavg()[0]]}


def spread(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else float("nan")


def summarize(runs: list[dict], schemes: list[str]) -> list[dict]:
    rows = []
    for scheme in schemes:
        mine = [r for r in runs if r["scheme"] == scheme]
        row = {"scheme": scheme, "seeds": len(mine), "boundary_bytes": mine[0]["boundary_bytes"],
               "lost_microbatches": sum(r["lost_microbatches"] for r in mine),
               "lost_gradient_samples": sum(sum(r["lost_gradient_samples"]) for r in mine),
               "resyncs": sum(r["resyncs"] for r in mine), "solo_steps": sum(r["solo_steps"] for r in mine)}
        for key in ("mb_s", "done_mb_s", "train_loss", "heldout_loss"):
            values = [r[key] for r in mine]
            row[key], row[f"{key}_sd"] = statistics.fmean(values), spread(values)
        rows.append(row)
    for key in ("mb_s", "done_mb_s"):
        base = next((r[key] for r in rows if r["scheme"] == "none"), None)
        for row in rows:
            row[f"{key}_vs_none"] = row[key] / base if base else None
    baseline = [r for r in runs if r["scheme"] == "none"]
    for row in rows:
        mine = [r for r in runs if r["scheme"] == row["scheme"]]
        for key in COMPARED:
            row[f"{key}_p_vs_none"] = welch_p([r[key] for r in mine], [r[key] for r in baseline])
    return rows


COMPARED = ("mb_s", "done_mb_s", "train_loss", "heldout_loss")  # the keys tested against ``none``


def welch_p(values: list[float], baseline: list[float]) -> float | None:
    """Two-sided p-value of Welch's t-test that ``values`` and ``baseline`` have the same mean (None with fewer
    than 2 of either, or where both are constant)."""
    if len(values) < 2 or len(baseline) < 2 or (spread(values) == 0 and spread(baseline) == 0):
        return None
    return float(scipy_stats.ttest_ind(values, baseline, equal_var=False).pvalue)


def markdown(rows: list[dict]) -> str:
    """The summary as a Markdown table (mean +- sd over the seeds; Welch's p against ``none`` in brackets)."""
    def cell(row, key, digits=3):
        p = row.get(f"{key}_p_vs_none")
        tail = f" (p {p:.2f})" if p is not None and row["scheme"] != "none" else ""
        return f"{row[key]:.{digits}f} ± {row[f'{key}_sd']:.{digits}f}{tail}"

    lines = ["| scheme | bytes per crossing | stepped mb/s | vs none | done mb/s | vs none | training loss | "
             "held-out loss | lost | samples not stepped | state downloads | one-peer steps |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratios = [f"{r[k]:.2f}" if r[k] else "-" for k in ("mb_s_vs_none", "done_mb_s_vs_none")]
        lines.append(f"| {r['scheme']} | {r['boundary_bytes']:,} | {cell(r, 'mb_s')} | {ratios[0]} | "
                     f"{cell(r, 'done_mb_s')} | {ratios[1]} | {cell(r, 'train_loss')} | {cell(r, 'heldout_loss')} | "
                     f"{r['lost_microbatches']} | {r['lost_gradient_samples']} | {r['resyncs']} | {r['solo_steps']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mbit", type=float, default=10.0, help="every host's link, megabits per second")
    parser.add_argument("--ms", type=float, default=20.0, help="one-way delay through the relay, milliseconds")
    parser.add_argument("--schemes", default="none,fp16,blockwise8,bottleneck2,maxout2",
                        help=f"comma-separated swarm.compression values ({', '.join(compression.COMPRESSIONS)})")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=64, help="microbatches per run (the budget)")
    parser.add_argument("--micro", type=int, default=4, help="sequences per microbatch")
    parser.add_argument("--batch", type=int, default=4, help="microbatches per global batch")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size of the tiny model")
    parser.add_argument("--peers", type=int, default=2, help="peers per stage (2 stages)")
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--json", help="also write every run and the summary here")
    parser.add_argument("--keep-logs", metavar="DIR", help="keep each run's folder (logs) under DIR/<scheme>-seed<N>")
    parser.add_argument("--summarize", metavar="JSON",
                        help="run nothing: summarize the runs of an earlier --json (a stopped sweep's too)")
    args = parser.parse_args(argv)
    if args.summarize:
        runs = json.loads(Path(args.summarize).read_text())["runs"]
        schemes = list(dict.fromkeys(r["scheme"] for r in runs))
        print(markdown(summarize(runs, schemes)))
        return 0
    schemes = args.schemes.split(",")
    unknown = set(schemes) - set(compression.COMPRESSIONS)
    if unknown:
        parser.error(f"--schemes: unknown {', '.join(sorted(unknown))}")
    reason = unavailable_reason()
    if reason:
        print(f"the testbed cannot run here: {reason}")
        return 1
    runs = []
    for seed in range(args.seeds):
        for scheme in schemes:
            try:
                run = one_run(args, scheme, seed)
            except Unavailable as error:
                print(f"the testbed cannot run here: {error}")
                return 1
            runs.append(run)
            if args.json:  # every run so far, in case the sweep is stopped
                write_json(args.json, {"args": vars(args), "runs": runs})
            print(f"seed {seed} {scheme:<12} {run['mb_s']:.3f} mb/s stepped, {run['done_mb_s']:.3f} done, train "
                  f"loss {run['train_loss']:.3f}, held-out {run['heldout_loss']:.3f}, lost {run['lost_microbatches']}"
                  f", gradient samples dropped {run['lost_gradient_samples']}, resyncs {run['resyncs']}, solo steps "
                  f"{run['solo_steps']}, {run['wall_s']} s, load {run['load'][0]:.1f}-{run['load'][1]:.1f}",
                  flush=True)
    rows = summarize(runs, schemes)
    print(f"\n{args.mbit:g} Mb/s, {args.ms:g} ms one way; 2 stages x {args.peers} peers, {args.trainers} trainers, "
          f"hidden {args.hidden}, {args.micro} x {SEQ} tokens per microbatch, {args.microbatches} microbatches, "
          f"{args.seeds} seeds (mean +- sd)")
    print(f"{'scheme':<12} {'bytes/mb':>9} {'stepped mb/s':>14} {'vs none':>7} {'done mb/s':>14} {'vs none':>7} "
          f"{'train loss':>15} {'held-out loss':>15} {'lost':>4} {'dropped':>7} {'resyncs':>7}")
    for r in rows:
        ratios = [f"{r[k]:.2f}" if r[k] else "-" for k in ("mb_s_vs_none", "done_mb_s_vs_none")]
        print(f"{r['scheme']:<12} {r['boundary_bytes']:>9} {r['mb_s']:>7.3f} +- {r['mb_s_sd']:<4.3f} {ratios[0]:>7} "
              f"{r['done_mb_s']:>7.3f} +- {r['done_mb_s_sd']:<4.3f} {ratios[1]:>7} "
              f"{r['train_loss']:>7.3f} +- {r['train_loss_sd']:<4.3f} {r['heldout_loss']:>7.3f} +- "
              f"{r['heldout_loss_sd']:<4.3f} {r['lost_microbatches']:>4} {r['lost_gradient_samples']:>7} "
              f"{r['resyncs']:>7}")
    print("\n" + markdown(rows))
    if args.json:
        write_json(args.json, {"args": vars(args), "runs": runs, "summary": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
