"""Throughput of the launcher's hivemind swarm on the multi-host testbed, against the simulator on the same setup.

Every process (the launcher and the DHT bootstrap, each stage peer, each trainer) runs on a host of its own
(``cramswarm.testbed.swarm``), training a tiny crammed BERT on a counting language. Two testbed runs:

1. **calibration**: links unshaped, every connection through the relay with no delay (the relay's own cost
   on this machine is part of the calibration, not of the network);
2. one run per ``--setup MBIT:MS``: every host's link shaped to MBIT megabits per second, MS milliseconds one
   way through the relay.

Throughput is the steady rate of the last stage's optimizer steps (microbatches stepped between its second and
its last-but-one step, over that time): the trainers' start (seconds of imports on a loaded machine) and the
final flush are left out. The simulator (``sim.run``) gets the same swarm (stages x peers, trainers, the
boundary payload of one microbatch, the shaped rate as link and NIC rate, the relay's one-way latency) and one
compute time per call calibrated from run 1: the per-microbatch time of a trainer there, spread over the
simulator's ``3 x stages`` work units (forward 1, backward 2 per stage), so that the simulator reproduces run 1
by construction and predicts the shaped runs from the network alone. Differences the simulator does not model: the last
stage's forward and backward are one call on the testbed (two in the simulator), the in-stage averaging and
the DHT traffic share the links and the CPU, and the relay's own CPU time adds delay.

    python benchmarks/swarm_testbed.py --setup 100:20 [--setup 10:50 ...] [--microbatches 80] [--json out.json]

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

from cramswarm.config import load_config  # noqa: E402
from cramswarm.swarm import compression, hivemind_transport, sim  # noqa: E402
from cramswarm.swarm.emulation import BACKWARD_COMPUTE_FACTOR, PeerSpec, SwarmSetup  # noqa: E402
from cramswarm.swarm.policies import RetryPolicy  # noqa: E402
from cramswarm.swarm.toy import CountingSource  # noqa: E402
from cramswarm.testbed import Unavailable, unavailable_reason  # noqa: E402
from cramswarm.testbed import swarm as tbswarm  # noqa: E402

VOCAB, SEQ = 128, 32


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
    config = load_config([ROOT / "config" / "config.yaml"])
    arch = config["models"]["crammed"]["arch"] | dict(layers=max(2, args.stages), hidden_size=args.hidden,
                                                      heads=2, intermediate_size=2 * args.hidden, max_positions=SEQ)
    recipe = config["pretrain"] | dict(micro_batch_sequences=args.micro, batch_sequences=4 * args.micro, lr=3e-3,
                                       batch_ramp_fraction=0.0, warmup_fraction=0.0, precision="bf16", device="cpu",
                                       budget={"unit": "steps", "value": 1000})
    return hivemind_transport.SwarmPlan(
        arch=arch, vocab_size=VOCAB, recipe=recipe, peers_per_stage=[args.peers] * args.stages,
        trainers=args.trainers, compression=args.compression, retry=RetryPolicy(forward_timeout_s=5.0,
                                                                                give_up_after_s=30.0),
        startup_timeout_s=240.0, seed=args.seed)


def steady_mb_s(log: list[dict], micro: int) -> float:
    """Microbatches per second stepped by the last stage between its second and its last-but-one step."""
    rows = log[:-1] if len(log) > 3 else log
    if len(rows) < 2 or rows[-1]["elapsed_s"] <= rows[0]["elapsed_s"]:
        raise RuntimeError(f"too few steps to measure a rate ({len(log)}): raise --microbatches")
    return sum(r["batch_sequences"] for r in rows[1:]) / micro / (rows[-1]["elapsed_s"] - rows[0]["elapsed_s"])


def testbed_run(plan, args, bandwidth_mbit, latency_ms) -> dict:
    started = time.perf_counter()
    result = tbswarm.run(plan, counting_batches(args.micro, args.seed), args.microbatches,
                         bandwidth_mbit=bandwidth_mbit, latency_ms=latency_ms, relay=True)
    stats = result.stats
    return {"bandwidth_mbit": bandwidth_mbit, "latency_ms": latency_ms, "mb_s": steady_mb_s(result.log, args.micro),
            "microbatches_done": stats["microbatches_done"], "lost_microbatches": stats["lost_microbatches"],
            "retries": stats["retries"], "timeouts": stats["timeouts"], "steps": len(result.log),
            "wall_s": round(time.perf_counter() - started, 1)}


def boundary_bytes(plan) -> int:
    """Bytes of one microbatch's stage-boundary payload (hidden states, compressed as the swarm sends them)."""
    hidden = torch.randn(plan.recipe["micro_batch_sequences"], SEQ, plan.arch["hidden_size"])
    return compression.payload_bytes(compression.encode(hidden, plan.compression))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--setup", action="append", type=parse_setup, help="MBIT:MS - each host's link in megabits "
                        "per second and the relay's one-way delay in milliseconds (repeatable; default 100:20)")
    parser.add_argument("--microbatches", type=int, default=80, help="microbatches per run (the budget)")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--peers", type=int, default=2, help="peers per stage")
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--micro", type=int, default=4, help="sequences per microbatch")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size of the tiny model")
    parser.add_argument("--compression", default="blockwise8", help="stage-boundary compression")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write every number here")
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason:
        print(f"no testbed here: {reason}", file=sys.stderr)
        return 1
    plan = make_plan(args)
    setups = args.setup or [(100.0, 20.0)]
    try:
        calibration = testbed_run(plan, args, None, 0.0)
        shaped = [testbed_run(plan, args, mbit, ms) for mbit, ms in setups]
    except Unavailable as err:
        print(f"no testbed here: {err}", file=sys.stderr)
        return 1
    per_mb_s = args.trainers / calibration["mb_s"]  # one trainer's seconds per microbatch, unshaped
    stage_time_s = per_mb_s / ((1 + BACKWARD_COMPUTE_FACTOR) * args.stages)
    payload = boundary_bytes(plan)
    base = SwarmSetup(peers=[PeerSpec(s) for s in range(args.stages) for _ in range(args.peers)],
                      trainers=args.trainers, stage_time_s=stage_time_s, activation_bytes=payload,
                      forward_timeout_s=plan.retry.forward_timeout_s, duration_s=600.0, seed=args.seed)
    sim_calibration = sim.run(base)["throughput_mb_s"]
    sim_shaped = [sim.run(dataclasses.replace(base, bandwidth_mbit_s=mbit, nic_mbit_s=mbit, latency_s=ms / 1000))
                  ["throughput_mb_s"] for mbit, ms in setups]
    rows = [("calibration (unshaped, relay, 0 ms)", calibration, sim_calibration)]
    rows += [(f"{mbit:g} Mb/s, {ms:g} ms one way", real, simulated)
             for (mbit, ms), real, simulated in zip(setups, shaped, sim_shaped)]
    print(f"swarm: {args.stages} stages x {args.peers} peers, {args.trainers} trainers, {args.microbatches} "
          f"microbatches of {args.micro} x {SEQ} tokens, hidden {args.hidden}; boundary payload {payload} B; "
          f"simulator compute per forward call {stage_time_s * 1e3:.1f} ms (from the calibration)")
    print("throughput in microbatches per second (mb/s)")
    print(f"{'setup':36s} {'testbed mb/s':>13s} {'sim mb/s':>9s} {'sim/testbed':>12s} {'lost':>5s} {'timeouts':>9s} "
          f"{'wall s':>7s}")
    for name, real, simulated in rows:
        print(f"{name:36s} {real['mb_s']:13.3f} {simulated:9.3f} {simulated / real['mb_s']:12.3f} "
              f"{real['lost_microbatches']:5d} {real['timeouts']:9d} {real['wall_s']:7.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "args": vars(args), "boundary_bytes": payload, "stage_time_s": stage_time_s,
            "testbed": {"calibration": calibration, "shaped": shaped},
            "sim": {"calibration": sim_calibration, "shaped": sim_shaped}}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
