"""How long the swarm_study experiments take, from their config sections: the workflow's runtime requests
(``cramswarm.workflow.swarm``). Plain arithmetic; imports neither torch nor the experiments."""

from __future__ import annotations

from cramswarm import resources

TRANSPORTS = ("emulation", "sim")   # the default transports of wiring_throughput, failures_timeline, ...


TESTBED_START_S = 180.0   # a bound on one testbed run's start-up and teardown (namespaces; ~20 processes' imports)


def transports_runtime_s(section: str, settings: dict) -> float:
    """A bound on ``study.wiring_throughput``'s / ``failures_timeline``'s / ``rebalancing_recovery``'s
    seconds (``section``: wiring | failures | rebalancing) for their ``swarm_study`` config section, without the
    sweep: per emulated transport (the simulator's counted alike) each run's ``duration_s x time_scale`` over 3
    routings (wiring), 2 routings x with and without failures, or the rebalancing periods; per testbed run (2:
    weighted and uniform, or weighted with and without failures; one per rebalancing period) ``duration_s`` real
    seconds plus ``TESTBED_START_S``."""
    if section == "rebalancing":
        runs = testbed_runs = len(settings["periods_s"])
    else:
        runs, testbed_runs = {"wiring": 3, "failures": 4}[section], 2
    seconds = 0.0
    for transport in settings.get("transports", TRANSPORTS):
        if transport == "testbed":
            seconds += testbed_runs * (settings["duration_s"] + TESTBED_START_S)
        else:
            seconds += runs * settings["duration_s"] * settings["time_scale"]
    return seconds


def square_cube_runtime_s(settings: dict) -> float:
    """A generous bound on ``study.square_cube``'s seconds for a ``swarm_study.square_cube`` config section (the
    workflow's runtime request): (repeats + 1) passes per width at about 0.15 TFLOP/s (one CPU thread: 6.4 s for
    4096 x 1024 tokens; a GPU is far faster), and (calls + 1) calls per payload and link at up to twice their bytes'
    wire time plus 30 x the one-way delay (TCP through the testbed's relay)."""
    tokens = settings["batch_sequences"] * settings["seq_len_tokens"]
    value_bytes = {"none": 4, "fp16": 2, "blockwise8": 1}
    seconds = 0.0
    for width in settings["hidden_sizes"]:
        seconds += (settings["repeats"] + 1) * 60 * width * width * tokens / 1.5e11
        for scheme in settings["schemes"]:
            for bandwidth in settings["bandwidths_mbit_s"]:
                for latency in settings["latencies_ms"]:
                    wire = 2 * tokens * width * value_bytes[scheme] * 8 / (bandwidth * 1e6)
                    seconds += (settings["calls"] + 1) * (2 * wire + 30 * latency / 1e3)
    return seconds


def experiment_seconds(section: str, settings: dict, arch: dict, vocab: int, block_tokens: int, device: str) -> float:
    """Three times a bound on one experiment's seconds (``section``: its swarm_study config section): 60 s of
    start-up plus the emulated runs (``duration_s x time_scale``; testbed runs in real seconds plus their start-up,
    :func:`transports_runtime_s`); sim_scale grows with peers x simulated seconds x runs; square_cube's compute
    with width squared and its calls with bytes and delay (:func:`square_cube_runtime_s`); compression trains the
    SWARM model (``arch`` at ``vocab``) once per boundary treatment on ``device``."""
    seconds = 60.0
    if section in ("wiring", "failures", "rebalancing"):
        seconds += transports_runtime_s(section, settings)
    elif section == "sim_scale":
        # measured about 1e-5 wall seconds per simulated peer-second (1000 peers x 1800 s: 17 s); twice that
        runs = len(settings.get("preemption_models", [None])) * len(settings["rebalance_periods_s"])
        seconds += 2e-5 * sum(settings["peer_counts"]) * settings["duration_s"] * runs
    elif section == "square_cube":
        seconds += square_cube_runtime_s(settings)
    elif section == "compression":
        tokens = settings["steps"] * settings["micro_batch_sequences"] * block_tokens
        seconds += len(settings["configs"]) * resources.training_seconds(arch, vocab, tokens, block_tokens, device)
    return 3 * seconds
