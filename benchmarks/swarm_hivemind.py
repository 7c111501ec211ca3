"""Throughput of a small real hivemind swarm vs the discrete-event simulator on the same SwarmSetup.

Both run ``cramswarm.swarm.emulation.SwarmSetup`` with emulated compute (peers sleep ``stage_time_s / speed``
per forward call, ``BACKWARD_COMPUTE_FACTOR`` times that per backward call): ``hivemind_transport.run`` on real
processes, DHT and localhost RPCs, ``sim.run`` in virtual time. The real per-call overhead (serialisation,
p2pd, asyncio) is calibrated first with a near-zero-compute swarm and given to the simulator as ``latency_s``
(half of it each way), and the simulator's trainers share their balancers (``trainers_per_process``) as the
hivemind transport's trainer coroutines share one balancer per stage in the coordinator. Prints one row per
setup with both throughputs and their ratio (the acceptance target for the simulator is within 15 %).

    python benchmarks/swarm_hivemind.py [--duration 20]
"""

from __future__ import annotations

import argparse
import dataclasses

from cramswarm.swarm import hivemind_transport, sim
from cramswarm.swarm.emulation import PeerSpec, SwarmSetup


def setups(duration_s: float, latency_s: float) -> dict[str, SwarmSetup]:
    base = dict(trainers=4, stage_time_s=0.05, activation_bytes=65536, forward_timeout_s=2.0, duration_s=duration_s,
                latency_s=latency_s)
    return {
        "2x2 homogeneous": SwarmSetup(peers=[PeerSpec(0), PeerSpec(0), PeerSpec(1), PeerSpec(1)], **base),
        "2x2 heterogeneous (1, .5 | 1, .25)": SwarmSetup(
            peers=[PeerSpec(0, 1.0), PeerSpec(0, 0.5), PeerSpec(1, 1.0), PeerSpec(1, 0.25)], **base),
        "3 peers, 1 stage (1, .5, .25)": SwarmSetup(
            peers=[PeerSpec(0, 1.0), PeerSpec(0, 0.5), PeerSpec(0, 0.25)], **base),
    }


def calibrate(duration_s: float) -> float:
    """Seconds of real overhead per call (request + reply) with ~no compute, one peer per stage, one trainer."""
    setup = SwarmSetup(peers=[PeerSpec(0), PeerSpec(1)], trainers=1, stage_time_s=1e-4, activation_bytes=65536,
                       forward_timeout_s=2.0, duration_s=duration_s)
    result = hivemind_transport.run(setup)
    calls = result["microbatches_done"] * 2 * setup.num_stages
    return result["wall_s"] / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per hivemind run")
    args = parser.parse_args()
    overhead = calibrate(min(args.duration, 10.0))
    print(f"calibrated real overhead per call: {overhead * 1e3:.1f} ms (simulator latency_s = half of it each way)")
    print(f"{'setup':40s} {'hivemind mb/s':>14s} {'sim mb/s':>10s} {'sim/hivemind':>13s}")
    for name, setup in setups(args.duration, overhead / 2).items():
        real = hivemind_transport.run(dataclasses.replace(setup, latency_s=0.0))
        simulated = sim.run(setup, trainers_per_process=setup.trainers)
        ratio = simulated["throughput_mb_s"] / real["throughput_mb_s"]
        print(f"{name:40s} {real['throughput_mb_s']:14.2f} {simulated['throughput_mb_s']:10.2f} {ratio:13.3f}",
              flush=True)


if __name__ == "__main__":
    main()
