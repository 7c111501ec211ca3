"""The swarm_study experiments (swarm.md 6.2 M1-M5 and the simulator study 6.3), one CSV each.

Every experiment is a plain function with its sizes as parameters (the defaults keep each one to a minute or
two on a 2-core CPU; tests pass tiny sizes) that writes one CSV atomically, with units in the column names:

* ``square_cube``           M1: measured compute time of one crammed-BERT layer (forward + backward, bf16
                            autocast on CPU; and its FLOPs at a stated accelerator rate) vs the time of a call
                            carrying its boundary tensors, per width, bandwidth, latency and compression scheme:
                            ideal (bytes / bandwidth) or measured between two hosts of the network testbed.
* ``wiring_throughput``     M2: throughput of stochastic wiring (IWRR), uniform routing and fixed chains on
                            peers of speeds 1, 0.5, 0.25 per stage, in the emulation and the simulator (and, as
                            transport ``testbed``, the launcher's real processes on hosts of the network testbed);
                            then, simulated, the same swept over trainers per peer (the load) on those and on equal
                            peers.
* ``failures_timeline``     M3: throughput over time with one peer killed every ``kill_every_s`` (rejoining
                            after ``rejoin_after_s``) and without failures, swarm vs fixed chains (and, as
                            transport ``testbed``, the launcher's real processes: SIGKILLed peers, fresh ones).
* ``rebalancing_recovery``  M4: a stage starved by killing peers for good; rebalancing off vs several periods
                            (and, as transport ``testbed``, the launcher's real processes: the victims SIGKILLed and
                            never replaced, the peers' own rebalancing).
* ``compression_loss``      M5 (:mod:`cramswarm.swarm_study.compression_loss`, re-exported here): MLM loss vs step
                            of the tiny crammed model trained in one process with the stage boundaries compressed
                            (fp16, blockwise 8-bit) or narrowed (bottleneck, maxout), same seed and data.
* ``sim_scale``             6.3 / E4: the simulator at 100-1000 peers under each preemption model (independent,
                            correlated bursts, churn with newcomers on a random or the most loaded stage),
                            rebalancing off vs on, throughput as a percentage of the optimal assignment of live
                            peers to stages; optionally with shared NICs and link latency.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from cramswarm.swarm.setups import BACKWARD_COMPUTE_FACTOR, FailureEvent, PeerSpec, SwarmSetup
from cramswarm.swarm_sim import emulation, scenarios, sim
from cramswarm.swarm_sim.optimum import optimal_throughput, optimum_over_time
from cramswarm.swarm_study.common import torch_threads, write_csv
from cramswarm.swarm_study.compression_loss import COMPRESSION_CONFIGS, compression_loss  # noqa: F401 (M5)
from cramswarm.swarm_study.runtime import TRANSPORTS  # the default transports of wiring_throughput, ...

# ... and every one they take: testbed = the launcher's swarm of real processes, each on a testbed host of its own
# (cramswarm.swarm_study.study_launcher.run_setup; needs root, iproute2 and hivemind, skipped with the reason elsewhere)
LAUNCHER_TRANSPORTS = (*TRANSPORTS, "testbed")


def _run(setup: SwarmSetup, transport: str, time_scale: float, testbed: dict | None = None) -> tuple[dict, float]:
    """Run ``setup`` on one transport; returns (result, wall seconds). ``testbed`` (transport testbed): the keywords
    of ``study_launcher.run_setup`` (link, latency, kills)."""
    start = time.perf_counter()
    if transport == "emulation":
        result = emulation.run(setup, time_scale=time_scale)
    elif transport == "sim":
        result = sim.run(setup)
    elif transport == "testbed" and testbed is not None:
        from cramswarm.swarm_study import study_launcher

        result = study_launcher.run_setup(setup, **testbed)
    else:
        raise ValueError(f"unknown transport {transport!r}; allowed: {', '.join(TRANSPORTS)}")
    return result, time.perf_counter() - start


def _transports(transports: Sequence[str], experiment: str) -> list[str]:
    """``transports`` checked (``LAUNCHER_TRANSPORTS``), less ``testbed`` where no testbed can be built here or
    hivemind is missing (printed with the reason, as ``square_cube``'s ``link: auto`` does)."""
    unknown = sorted(set(transports) - set(LAUNCHER_TRANSPORTS))
    if unknown:
        raise ValueError(f"swarm_study.{experiment}.transports: unknown transport(s) {unknown}; allowed: "
                         f"{', '.join(LAUNCHER_TRANSPORTS)}")
    if "testbed" not in transports:
        return list(transports)
    from cramswarm.testbed import unavailable_reason

    reason = unavailable_reason()
    if reason is None:
        try:
            import hivemind  # noqa: F401
        except ImportError as err:
            reason = f"hivemind is not installed ({err})"
    if reason:
        print(f"swarm_study.{experiment}: transport testbed skipped (no testbed here: {reason})", flush=True)
        return [t for t in transports if t != "testbed"]
    return list(transports)


def _link_columns(transport: str, link_mbit_s: float | None, latency_ms: float) -> dict:
    """The link of a row: the testbed's shaped rate (NaN: unshaped) and one-way delay; NaN for the emulation and
    the simulator (no network)."""
    if transport != "testbed":
        return {"link_mbit_s": math.nan, "latency_ms": math.nan}
    return {"link_mbit_s": math.nan if link_mbit_s is None else float(link_mbit_s), "latency_ms": float(latency_ms)}


def windowed_throughput(timeline: Sequence[tuple[float, int]], duration_s: float,
                        window_s: float) -> list[tuple[float, float, int]]:
    """(window start s, microbatches/s completed in the window, completed total at its end) for consecutive
    windows of ``window_s`` covering ``[0, duration_s)``."""
    times = np.array([t for t, _ in timeline], dtype=float)
    totals = np.array([n for _, n in timeline], dtype=float)
    rows = []
    for start in np.arange(0.0, duration_s - 1e-9, window_s):
        end = min(start + window_s, duration_s)
        at_end = totals[times <= end].max(initial=0.0)
        at_start = totals[times <= start].max(initial=0.0)
        rows.append((float(start), float((at_end - at_start) / (end - start)), int(at_end)))
    return rows


def peers_up(failures: Sequence[FailureEvent], num_peers: int, t: float) -> int:
    """How many of ``num_peers`` peers are up at time ``t`` under ``failures`` (kills of dead peers ignored)."""
    down_until = [-math.inf] * num_peers
    for event in sorted(failures, key=lambda e: e.at_s):
        if event.at_s > t:
            break
        if down_until[event.peer] <= event.at_s:
            down_until[event.peer] = math.inf if event.rejoin_after_s is None else event.at_s + event.rejoin_after_s
    return sum(1 for until in down_until if until <= t)


def periodic_kills(num_peers: int, duration_s: float, every_s: float, rejoin_after_s: float | None,
                   seed: int = 0) -> list[FailureEvent]:
    """One random peer that is up killed every ``every_s`` (at every_s, 2 every_s, ...), rejoining after
    ``rejoin_after_s`` (None: never)."""
    times, t = [], every_s
    while t < duration_s:
        times.append(t)
        t += every_s
    return scenarios.kill_schedule(times, num_peers, rejoin_after_s, random.Random(seed))


# ------------------------------------------------------------------------------------------------------------
# M1: the square-cube law
# ------------------------------------------------------------------------------------------------------------

def _layer_time_s(hidden: int, heads: int, batch: int, seq_len: int, repeats: int,
                  device: torch.device | None = None) -> tuple[float, torch.Tensor, int, float]:
    """Fastest of ``repeats`` forward + backward passes of one crammed-BERT layer on ``device`` (bf16 autocast;
    on CUDA timed between synchronisations), the layer's output activation (fp32, on the CPU), its parameter
    count and its training FLOPs on the microbatch (6 x the matmul weights x tokens, plus the attention score and
    value matmuls, 3 x 4 x seq_len x hidden per token)."""
    from cramswarm.models.crammed_bert import CrammedBertConfig, Layer

    config = CrammedBertConfig(hidden_size=hidden, num_attention_heads=heads, intermediate_size=4 * hidden,
                               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    device = device or torch.device("cpu")
    torch.manual_seed(0)
    layer = Layer(config).to(device)
    x = torch.randn(batch, seq_len, hidden, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best, out = math.inf, None
    for _ in range(repeats + 1):   # the first pass warms up kernels and allocator and is not timed
        xi = x.clone().requires_grad_(True)
        sync()
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            y = layer(xi, None)
        y.float().sum().backward()
        sync()
        elapsed = time.perf_counter() - start
        if out is not None:
            best = min(best, elapsed)
        out = y.detach().float()
    tokens = batch * seq_len
    matmul_weights = sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
    flops = 6 * matmul_weights * tokens + 12 * seq_len * hidden * tokens
    return best, out.cpu(), sum(p.numel() for p in layer.parameters()), float(flops)


SQUARE_CUBE_LINKS = ("auto", "ideal", "testbed")


def _testbed_call_s(points: list[tuple[float, float]], sizes: list[int], calls: int) -> dict:
    """{(bandwidth, latency, bytes): median seconds} of hivemind calls carrying ``bytes`` each way between two
    testbed hosts, the server's link shaped to the bandwidth, through the relay at the one-way latency
    (``cramswarm.testbed.callcost.measure``)."""
    from cramswarm.testbed import callcost

    # the client makes 1 + calls calls per size and point, one at a time: time enough for all of them
    wire_s = sum(2 * size * 8 / (bw * 1e6) + 4 * ms / 1e3 for bw, ms in points for size in sizes) * (calls + 1)
    measured = callcost.measure(points, sizes, count=calls, timeout_s=120.0 + 3 * wire_s)
    return {(m["bandwidth_mbit"], m["latency_ms"], size): m["calls_ms"][str(size)]["median"] / 1e3
            for m in measured for size in sizes}


def square_cube(out_csv: str | os.PathLike, *, hidden_sizes: Sequence[int] = (256, 768, 2048, 4096),
                bandwidths_mbit_s: Sequence[float] = (100.0, 500.0), latencies_ms: Sequence[float] = (0.0,),
                schemes: Sequence[str] = ("none", "fp16", "blockwise8"), batch: int = 8, seq_len: int = 128,
                repeats: int = 3, head_dim: int = 64, threads: int | None = 1, link: str = "auto",
                calls: int = 2, device_tflops: float = 30.0, device: str = "auto") -> Path:
    """M1. Per hidden size: the measured time of forward + backward of one crammed-BERT layer (FFN 4 d, heads of
    ``head_dim``) on a ``batch x seq_len`` microbatch on ``device`` (cpu | cuda | auto: cuda where torch sees
    one), and per scheme, bandwidth and one-way latency the time of one call that carries the layer's boundary
    traffic: the encoded activation one way, a reply of the same size (the gradient) the other.

    ``link``: ``ideal`` - the call takes 2 x bytes x 8 / bandwidth + 2 x latency (no protocol, no overhead);
    ``testbed`` - the call is a real hivemind call between processes on two hosts of the multi-host testbed
    (``cramswarm.testbed``; needs root and iproute2), the server's link shaped to the bandwidth, through the relay at
    the latency: the median of ``calls`` calls; ``auto`` - the testbed where it can be built, else ideal. The
    ``link`` column says which ran.

    Utilisation is the paper's relative device utilisation for a peer that receives a microbatch, computes and
    sends it on: compute / (compute + call). ``utilisation`` uses the measured compute (on the CPU with
    ``threads`` intra-op threads, see :func:`torch_threads`; the ``device`` column names the CPU or the GPU);
    ``device_utilisation`` the layer's FLOPs at ``device_tflops`` TFLOP/s, a stated accelerator rate (the paper's
    V100s; the default 30 is about a quarter of a V100's fp16 tensor-core peak), with the same measured call.

    The keyword defaults are the schema's (``swarm_study.square_cube``).

    Columns: hidden_size, heads, batch, seq_len, device, threads, layer_params, layer_flops, compute_s, scheme,
    activation_payload_bytes, link, bandwidth_mbit_s, latency_ms, comm_s, compute_to_comm (compute_s / comm_s),
    utilisation, device_tflops, device_compute_s, device_utilisation.
    """
    from cramswarm.swarm.compression import encode, payload_bytes

    if link not in SQUARE_CUBE_LINKS:
        raise ValueError(f"swarm_study.square_cube.link={link!r}; allowed: {', '.join(SQUARE_CUBE_LINKS)}")
    if link == "auto":
        from cramswarm.testbed import unavailable_reason

        reason = unavailable_reason()
        link = "ideal" if reason else "testbed"
        if reason:
            print(f"swarm_study.square_cube.link=auto: ideal links (no testbed here: {reason})", flush=True)
    from cramswarm.training import resolve_device

    dev = resolve_device(device)
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    measured = []
    for hidden in hidden_sizes:
        heads = max(1, hidden // head_dim)
        with torch_threads(threads):
            compute_s, activation, params, flops = _layer_time_s(hidden, heads, batch, seq_len, repeats, dev)
        payloads = {scheme: payload_bytes(encode(activation, scheme)) for scheme in schemes}
        measured.append((hidden, heads, compute_s, params, flops, payloads))
    points = [(float(bw), float(ms)) for bw in bandwidths_mbit_s for ms in latencies_ms]
    if link == "testbed":
        sizes = sorted({size for *_, payloads in measured for size in payloads.values()})
        call_s = _testbed_call_s(points, sizes, calls)
    else:
        call_s = {(bw, ms, size): 2 * size * 8 / (bw * 1e6) + 2 * ms / 1e3
                  for bw, ms in points for *_, payloads in measured for size in payloads.values()}
    rows = []
    for hidden, heads, compute_s, params, flops, payloads in measured:
        device_s = flops / (device_tflops * 1e12)
        for scheme, nbytes in payloads.items():
            for bandwidth, latency in points:
                comm_s = call_s[(bandwidth, latency, nbytes)]
                rows.append({"hidden_size": hidden, "heads": heads, "batch": batch, "seq_len": seq_len,
                             "device": device_name,
                             "threads": torch.get_num_threads() if threads is None else threads,
                             "layer_params": params, "layer_flops": flops, "compute_s": compute_s,
                             "scheme": scheme, "activation_payload_bytes": nbytes, "link": link,
                             "bandwidth_mbit_s": bandwidth, "latency_ms": latency, "comm_s": comm_s,
                             "compute_to_comm": compute_s / comm_s, "utilisation": compute_s / (compute_s + comm_s),
                             "device_tflops": float(device_tflops), "device_compute_s": device_s,
                             "device_utilisation": device_s / (device_s + comm_s)})
    return write_csv(pd.DataFrame(rows), out_csv)


# ------------------------------------------------------------------------------------------------------------
# M2: stochastic wiring on heterogeneous peers
# ------------------------------------------------------------------------------------------------------------

def heterogeneous_stages(speeds: Sequence[float], stages: int) -> list[PeerSpec]:
    """``len(speeds)`` peers per stage; stage s gets ``speeds`` rotated by s, so the fixed chains (c-th peer of
    every stage) mix fast and slow peers."""
    peers = []
    for s in range(stages):
        rotated = list(speeds[s % len(speeds):]) + list(speeds[: s % len(speeds)])
        peers.extend(PeerSpec(stage=s, speed=v) for v in rotated)
    return peers


SPEED_PROFILES = ("mixed", "equal")


def wiring_throughput(out_csv: str | os.PathLike, *, speeds: Sequence[float] = (1.0, 0.5, 0.25), stages: int = 2,
                      trainers: int = 16, stage_time_s: float = 0.1, duration_s: float = 40.0,
                      forward_timeout_s: float = 5.0, routings: Sequence[str] = ("weighted", "uniform", "fixed"),
                      transports: Sequence[str] = TRANSPORTS, time_scale: float = 0.1,
                      sweep_trainers_per_peer: Sequence[float] = (0.5, 1.0, 2.0, 4.0, 8.0),
                      sweep_speeds: Sequence[str] = SPEED_PROFILES, testbed_link_mbit_s: float | None = 100.0,
                      testbed_latency_ms: float = 20.0, seed: int = 0) -> Path:
    """M2. Throughput of each routing on ``stages`` stages of peers with ``speeds`` (see
    :func:`heterogeneous_stages`), ``trainers`` concurrent trainers, no failures, on each transport (run
    ``base``); then the simulator alone (run ``sweep``) at ``trainers_per_peer x peers`` trainers (rounded up)
    for each of ``sweep_trainers_per_peer``, on peers of those speeds (``mixed``) and on as many peers of
    speed 1 (``equal``), as ``sweep_speeds`` asks: which routing wins depends on how many microbatches are in
    flight per peer.

    Transport ``testbed`` (:func:`cramswarm.swarm_study.study_launcher.run_setup`): the launcher's real processes (a
    bootstrap, one process per peer, one per trainer), each on a host of the network testbed, every link shaped to
    ``testbed_link_mbit_s`` (None: unshaped) and delayed ``testbed_latency_ms`` one way; ``stage_time_s`` is the
    peers' unit time and ``duration_s`` real seconds of training; weighted and uniform routing only (the launcher
    has no fixed chains: skipped, with a line saying so). Where no testbed can be built it is skipped with the
    reason (:func:`_transports`).

    Columns: run (base | sweep), speeds (mixed | equal), transport, routing, stages, peers, trainers,
    trainers_per_peer, throughput_mb_s, optimum_mb_s (best assignment of the peers,
    :func:`optimum.optimal_throughput`), percent_of_optimum, microbatches_done, retries, duration_s, wall_s,
    lost_microbatches, link_mbit_s and latency_ms (the testbed's link; NaN for the emulation and the simulator).
    """
    unknown = sorted(set(sweep_speeds) - set(SPEED_PROFILES))
    if unknown:
        raise ValueError(f"sweep_speeds: unknown profile(s) {unknown}; allowed: {', '.join(SPEED_PROFILES)}")
    transports = _transports(transports, "wiring")
    profiles = {"mixed": heterogeneous_stages(speeds, stages),
                "equal": [PeerSpec(stage=s) for s in range(stages) for _ in speeds]}
    runs = [("base", "mixed", transport, trainers) for transport in transports]
    runs += [("sweep", profile, "sim", math.ceil(load * len(profiles[profile])))
             for profile in sweep_speeds for load in sweep_trainers_per_peer]
    testbed = {"link_mbit_s": testbed_link_mbit_s, "latency_ms": testbed_latency_ms}
    rows = []
    for run, profile, transport, count in runs:
        peers = profiles[profile]
        optimum = optimal_throughput([p.speed for p in peers], stages, stage_time_s)
        for routing in routings:
            if transport == "testbed" and routing == "fixed":
                print("swarm_study.wiring: no fixed chains on the testbed (the launcher routes weighted or "
                      "uniform)", flush=True)
                continue
            setup = SwarmSetup(peers=peers, trainers=count, stage_time_s=stage_time_s, routing=routing,
                               forward_timeout_s=forward_timeout_s, duration_s=duration_s, seed=seed)
            result, wall = _run(setup, transport, time_scale, testbed)
            rows.append({"run": run, "speeds": profile, "transport": transport, "routing": routing,
                         "stages": stages, "peers": len(peers), "trainers": count,
                         "trainers_per_peer": count / len(peers), "throughput_mb_s": result["throughput_mb_s"],
                         "optimum_mb_s": optimum, "percent_of_optimum": 100 * result["throughput_mb_s"] / optimum,
                         "microbatches_done": result["microbatches_done"], "retries": result["retries"],
                         "duration_s": duration_s, "wall_s": wall, "lost_microbatches": result["lost_microbatches"],
                         **_link_columns(transport, testbed_link_mbit_s, testbed_latency_ms)})
    return write_csv(pd.DataFrame(rows), out_csv)


# ------------------------------------------------------------------------------------------------------------
# M3 and M4: throughput over time under failures
# ------------------------------------------------------------------------------------------------------------

def _timeline_rows(result: dict, setup: SwarmSetup, window_s: float, keys: dict, totals: dict) -> list[dict]:
    """One row per window: ``keys`` (what identifies the run), the window's numbers, ``totals`` (whole run)."""
    rows = []
    for start, rate, total in windowed_throughput(result["timeline"], setup.duration_s, window_s):
        samples = np.linspace(start, min(start + window_s, setup.duration_s), 41)[:-1]
        up = float(np.mean([peers_up(setup.failures, len(setup.peers), t) for t in samples]))
        rows.append({**keys, "t_s": start, "window_s": window_s, "throughput_mb_s": rate,
                     "completed_total": total, "peers_up": up, **totals})
    return rows


def failures_timeline(out_csv: str | os.PathLike, *, stages: int = 3, peers_per_stage: int = 3,
                      trainers: int = 12, stage_time_s: float = 1.0, kill_every_s: float = 60.0,
                      rejoin_after_s: float = 30.0, duration_s: float = 300.0, forward_timeout_s: float = 30.0,
                      window_s: float = 20.0, routings: Sequence[str] = ("weighted", "fixed"),
                      transports: Sequence[str] = TRANSPORTS, time_scale: float = 0.02,
                      testbed_link_mbit_s: float | None = 100.0, testbed_latency_ms: float = 20.0,
                      seed: int = 0) -> Path:
    """M3. ``stages x peers_per_stage`` peers of speed 1; one random live peer killed every ``kill_every_s``,
    back after ``rejoin_after_s`` (the same schedule for every routing), and a failure-free run of each routing
    for reference. Throughput per ``window_s`` window.

    Transport ``testbed`` (see :func:`wiring_throughput`; times in real seconds): the launcher kills (SIGKILL) a
    random live peer of a stage that has two or more every ``kill_every_s`` - its own schedule, at the same
    rate - and starts a fresh one ``rejoin_after_s`` later, which loads the stage's state before it serves;
    ``peers_up`` counts a killed peer down until its replacement starts. Weighted routing only (no fixed chains
    in the launcher).

    Columns: transport, routing, failures (periodic | none), t_s (window start), window_s, throughput_mb_s,
    completed_total, peers_up (mean over the window), retries, lost_microbatches (the last two over the run),
    link_mbit_s and latency_ms (the testbed's link; NaN for the emulation and the simulator).
    """
    transports = _transports(transports, "failures")
    peers = [PeerSpec(stage=s) for s in range(stages) for _ in range(peers_per_stage)]
    schedule = periodic_kills(len(peers), duration_s, kill_every_s, rejoin_after_s, seed)
    rows = []
    for transport in transports:
        for routing in routings:
            if transport == "testbed" and routing == "fixed":
                print("swarm_study.failures: no fixed chains on the testbed (the launcher routes weighted or "
                      "uniform)", flush=True)
                continue
            for label, failures in (("none", []), ("periodic", schedule)):
                testbed = None
                if transport == "testbed":   # the launcher kills by its own schedule
                    testbed = {"link_mbit_s": testbed_link_mbit_s, "latency_ms": testbed_latency_ms,
                               "kill_every_s": kill_every_s if failures else None, "rejoin_after_s": rejoin_after_s}
                    failures = []
                setup = SwarmSetup(peers=peers, trainers=trainers, stage_time_s=stage_time_s, routing=routing,
                                   failures=list(failures), forward_timeout_s=forward_timeout_s,
                                   duration_s=duration_s, seed=seed)
                result, _ = _run(setup, transport, time_scale, testbed)
                if "failures" in result:   # the kills that happened (testbed)
                    setup = dataclasses.replace(setup, failures=result["failures"])
                rows.extend(_timeline_rows(
                    result, setup, window_s, {"transport": transport, "routing": routing, "failures": label},
                    {"retries": result["retries"], "lost_microbatches": result["lost_microbatches"],
                     **_link_columns(transport, testbed_link_mbit_s, testbed_latency_ms)}))
    return write_csv(pd.DataFrame(rows), out_csv)


def rebalancing_recovery(out_csv: str | os.PathLike, *, stages: int = 3, peers_per_stage: int = 3,
                         starved_stage: int = 1, killed: int = 2, kill_at_s: float = 45.0, trainers: int = 12,
                         stage_time_s: float = 1.0, periods_s: Sequence[float | None] = (None, 10.0, 30.0),
                         state_download_s: float = 5.0, duration_s: float = 240.0, forward_timeout_s: float = 30.0,
                         window_s: float = 10.0, transports: Sequence[str] = TRANSPORTS, time_scale: float = 0.02,
                         testbed_link_mbit_s: float | None = 100.0, testbed_latency_ms: float = 20.0,
                         seed: int = 0) -> Path:
    """M4. ``stages x peers_per_stage`` peers of speed 1; at ``kill_at_s`` ``killed`` peers of
    ``starved_stage`` die for good. Rebalancing off (None) vs each period in ``periods_s``; a moving peer loads
    the new stage's state for ``state_download_s``. Weighted routing throughout.

    Transport ``testbed`` (see :func:`wiring_throughput`; times in real seconds): the launcher's real processes,
    each on a testbed host; at ``kill_at_s`` seconds of training the launcher SIGKILLs ``killed`` peers of
    ``starved_stage`` and replaces none (its ``gone<N>:stage<S>`` fault); the stage peers rebalance themselves
    every period (``peer_rebalance``: they measure their loads, agree on the move, the mover drains, downloads the
    new stage's state for real - ``state_download_s`` is not used - and serves it); ``moves`` and
    ``first_move_s`` come from the peers' moves records (the time a move was decided).

    Columns: transport, rebalance_period_s (NaN = off), kill_at_s, t_s (window start), window_s,
    throughput_mb_s, completed_total, peers_up (mean over the window), moves (over the run), first_move_s
    (time of the first move, NaN without), lost_microbatches (over the run), link_mbit_s and latency_ms (the
    testbed's link; NaN for the emulation and the simulator).
    """
    transports = _transports(transports, "rebalancing")
    peers = [PeerSpec(stage=s) for s in range(stages) for _ in range(peers_per_stage)]
    victims = [i for i, p in enumerate(peers) if p.stage == starved_stage][:killed]
    failures = [FailureEvent(at_s=kill_at_s, peer=i, rejoin_after_s=None) for i in victims]
    testbed = {"link_mbit_s": testbed_link_mbit_s, "latency_ms": testbed_latency_ms}
    rows = []
    for transport in transports:
        for period in periods_s:
            setup = SwarmSetup(peers=peers, trainers=trainers, stage_time_s=stage_time_s, failures=failures,
                               rebalance_period_s=period, forward_timeout_s=forward_timeout_s,
                               duration_s=duration_s, state_download_s=state_download_s, seed=seed)
            result, _ = _run(setup, transport, time_scale, testbed)
            if "failures" in result:   # the kills that happened (testbed)
                setup = dataclasses.replace(setup, failures=result["failures"])
            moves = result["moves"]
            keys = {"transport": transport, "rebalance_period_s": math.nan if period is None else float(period),
                    "kill_at_s": kill_at_s}
            rows.extend(_timeline_rows(result, setup, window_s, keys,
                                       {"moves": len(moves), "first_move_s": moves[0]["t_s"] if moves else math.nan,
                                        "lost_microbatches": result["lost_microbatches"],
                                        **_link_columns(transport, testbed_link_mbit_s, testbed_latency_ms)}))
    return write_csv(pd.DataFrame(rows), out_csv)


# ------------------------------------------------------------------------------------------------------------
# Simulator at scale (E4 shape)
# ------------------------------------------------------------------------------------------------------------

def sim_scale(out_csv: str | os.PathLike, *, peer_counts: Sequence[int] = (100, 300, 1000), stages: int = 4,
              duration_s: float = 1800.0, stage_time_s: float = 1.0, speed_range: tuple[float, float] = (0.5, 1.0),
              preemption_models: Sequence[str] = scenarios.PREEMPTION_MODELS, preemptions_per_peer_hour: float = 1.0,
              rejoin_after_s: float = 600.0, burst_size: int = 4,
              rebalance_periods_s: Sequence[float | None] = (None, 60.0), state_download_s: float = 30.0,
              forward_timeout_s: float = 30.0, trainers_per_peer: float = 2.0, trainer_processes: int = 8,
              nic_mbit_s: float | None = None, latency_ms: float = 0.0, activation_bytes: int = 0,
              seed: int = 0) -> Path:
    """Simulated swarms of ``peer_counts`` peers (speeds log-uniform in ``speed_range``, each put on a random
    stage), preempted at ``preemptions_per_peer_hour`` per peer and hour on average under each of
    ``preemption_models`` (:func:`scenarios.preemptions`: ``independent`` Poisson preemptions, the peer back on its
    stage after ``rejoin_after_s``; ``burst`` the same rate in bursts of ``burst_size`` peers at once;
    ``churn_random`` / ``churn_most_loaded``: preempted peers never return, a new peer of a random speed
    arrives ``rejoin_after_s`` after each departure on a random / the most loaded stage); rebalancing off
    (None) vs each period in ``rebalance_periods_s`` (Rebalancer with ``min_gain=0``: one peer cannot move a
    large swarm's bottleneck by the default 5 %). The ``trainers_per_peer x peers`` trainers run in
    ``trainer_processes`` processes whose trainers share balancers (a balancer needs enough calls to measure
    every peer of its stage: one balancer per trainer, or per few, routes almost uniformly in a swarm of
    hundreds of peers). The network is off unless ``nic_mbit_s`` (every peer's NIC, shared by its transfers),
    ``latency_ms`` (one way) and ``activation_bytes`` (per transfer) are set.

    Columns: peers, stages, preemption_model, rebalance_period_s (NaN = off), throughput_mb_s, optimum_mb_s
    (time average of the best assignment of the live peers, :func:`optimum.optimum_over_time`), percent_of_optimum,
    static_percent (the initial assignment's slowest stage as a percentage of the optimum of all peers),
    preemptions, joins, moves, retries, lost_microbatches, nic_mbit_s (NaN = unlimited), latency_ms,
    activation_bytes, events, sim_wall_s.
    """
    unknown = sorted(set(preemption_models) - set(scenarios.PREEMPTION_MODELS))
    if unknown:
        raise ValueError(f"preemption_models: unknown model(s) {unknown}; allowed: "
                         f"{', '.join(scenarios.PREEMPTION_MODELS)}")
    rows = []
    for n in peer_counts:
        trainers = math.ceil(trainers_per_peer * n)
        base = scenarios.heterogeneous_setup(n, stages, speed_range=speed_range, seed=seed, trainers=trainers,
                                             stage_time_s=stage_time_s,
                                             forward_timeout_s=forward_timeout_s, duration_s=duration_s,
                                             state_download_s=state_download_s, nic_mbit_s=nic_mbit_s,
                                             latency_s=latency_ms / 1000.0, activation_bytes=activation_bytes)
        capacity = [sum(p.speed for p in base.peers if p.stage == s) for s in range(stages)]
        best = optimal_throughput([p.speed for p in base.peers], stages, stage_time_s)
        static = 100 * min(capacity) / (stage_time_s * (1 + BACKWARD_COMPUTE_FACTOR)) / best
        for model in preemption_models:
            failures, joins = scenarios.preemptions(model, n, duration_s,
                                                    preemptions_per_peer_hour=preemptions_per_peer_hour,
                                                    rejoin_after_s=rejoin_after_s, burst_size=burst_size,
                                                    speed_range=speed_range, seed=seed + 1)
            modelled = SwarmSetup(**{**base.__dict__, "failures": failures, "joins": joins})
            optimum = optimum_over_time(modelled)
            for period in rebalance_periods_s:
                setup = SwarmSetup(**{**modelled.__dict__, "rebalance_period_s": period})
                start = time.perf_counter()
                result = sim.run(setup, trainers_per_process=math.ceil(trainers / trainer_processes),
                                 rebalancer_options={"min_gain": 0.0})
                rows.append({"peers": n, "stages": stages, "preemption_model": model,
                             "rebalance_period_s": math.nan if period is None else float(period),
                             "throughput_mb_s": result["throughput_mb_s"], "optimum_mb_s": optimum,
                             "percent_of_optimum": 100 * result["throughput_mb_s"] / optimum,
                             "static_percent": static, "preemptions": result["peers_killed"],
                             "joins": result["joins"], "moves": len(result["moves"]), "retries": result["retries"],
                             "lost_microbatches": result["lost_microbatches"],
                             "nic_mbit_s": math.nan if nic_mbit_s is None else float(nic_mbit_s),
                             "latency_ms": float(latency_ms), "activation_bytes": int(activation_bytes),
                             "events": result["events"], "sim_wall_s": time.perf_counter() - start})
    return write_csv(pd.DataFrame(rows), out_csv)
