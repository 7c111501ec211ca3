"""The SWARM paper's claims: their inputs and verdict functions (listed in :data:`cramswarm.report.claims.CLAIMS`)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd

from cramswarm.report.claim_tests import (
    FAILS,
    HOLDS,
    INCONCLUSIVE,
    MissingInput,
    Outcome,
    checkpoint_folder,
    common_columns,
    equivalent,
    eval_loss_of,
    glue_paths,
    glue_setup,
    loss_noise,
    paired_greater,
    per_seed_average,
    read_summary,
    role_model,
    run_files,
    shape_label,
    signed,
    tokens_label,
    trend,
)
from cramswarm.report.recovery import late_windows
from cramswarm.report.tables import load_results, per_seed_scores


def swarm_inputs(manifest):
    return [*run_files(checkpoint_folder(manifest, role_model(manifest, "swarm"))),
            *run_files(checkpoint_folder(manifest, role_model(manifest, "crammed")))]


LOSS_MARGIN_NATS = 0.05  # "about equal" in held-out / training MLM loss (nats per token)
GLUE_MARGIN_POINTS = 1.0  # "about equal" in GLUE average (points)


def _same_arch(a: dict, b: dict) -> bool:
    return a.get("arch") == b.get("arch") and a.get("parameters") == b.get("parameters")


def swarm_loss_evaluate(manifest):
    names = role_model(manifest, "swarm"), role_model(manifest, "crammed")
    folders = [checkpoint_folder(manifest, m) for m in names]
    summaries = [read_summary(f) for f in folders]
    losses = [eval_loss_of(s) for s in summaries]
    noise = max(loss_noise(f) for f in folders)
    delta = losses[0] - losses[1]
    measurement = (f"held-out MLM loss {names[0]} {losses[0]:.3f}, {names[1]} {losses[1]:.3f} nats; "
                   f"Δ = {signed(delta, 3)} (1 pretraining seed each)")
    statistic = f"|Δ| vs margin {LOSS_MARGIN_NATS:g} nats; noise {noise:.3f} nats"
    shapes = "; ".join(f"{n} {shape_label(s)}, {tokens_label(s)}" for n, s in zip(names, summaries))
    setup = (f"{manifest['source']}; " + shapes
             + "; swarm: " + ", ".join(f"{k} {summaries[0].get('swarm', {}).get(k)}"
                                       for k in ("stages", "peers_per_stage", "compression")))
    if not _same_arch(*summaries):
        return Outcome(INCONCLUSIVE, measurement, statistic + "; the two models differ in shape: not comparable",
                       setup)
    if not np.isfinite(delta):
        verdict = INCONCLUSIVE
    elif abs(delta) <= LOSS_MARGIN_NATS:
        verdict = HOLDS
    elif abs(delta) > LOSS_MARGIN_NATS + noise:
        verdict = FAILS
    else:
        verdict = INCONCLUSIVE
    return Outcome(verdict, measurement, statistic, setup)


def swarm_glue_inputs(manifest):
    swarm, crammed = role_model(manifest, "swarm"), role_model(manifest, "crammed")
    return [*glue_paths(manifest, swarm), *glue_paths(manifest, crammed), *swarm_inputs(manifest)]


def swarm_glue_evaluate(manifest):
    a, b = role_model(manifest, "swarm"), role_model(manifest, "crammed")
    frames = [per_seed_scores(load_results(glue_paths(manifest, m))) for m in (a, b)]
    seeds = per_seed_average([*glue_paths(manifest, a), *glue_paths(manifest, b)], common_columns(frames))
    wide = seeds.pivot(index="seed", columns="model", values="avg").dropna()
    outcome = equivalent(wide[a] - wide[b], margin=GLUE_MARGIN_POINTS, what="paired fine-tuning seeds")
    summaries = [read_summary(checkpoint_folder(manifest, m)) for m in (a, b)]
    setup = glue_setup(manifest, seeds, (a, b))
    if not _same_arch(*summaries):
        return Outcome(INCONCLUSIVE, outcome.measurement,
                       outcome.statistic + "; the two models differ in shape: not comparable", setup)
    return Outcome(outcome.verdict, outcome.measurement, outcome.statistic, setup)


def study_csv(name: str) -> Callable:
    def inputs(manifest):
        path = manifest.get("swarm_study", {}).get(name)
        if not path:
            raise MissingInput(f"the swarm study has no {name} experiment")
        return [path]

    return inputs


def _read_study(manifest, name) -> pd.DataFrame:
    return pd.read_csv(study_csv(name)(manifest)[0], na_values=["NaN"])


WIRING_RATIO = 1.1  # weighted must beat uniform by this factor in every transport


def wiring_evaluate(manifest):
    data = _read_study(manifest, "wiring_throughput")
    if "run" in data.columns:   # the claim is about the configured setup; the load sweep is reported beside it
        data = data[data["run"] == "base"]
    ratios = {}
    for transport, rows in data.groupby("transport", sort=False):
        by = rows.set_index("routing")["throughput_mb_s"]
        if "weighted" in by and "uniform" in by and by["uniform"] > 0:
            ratios[transport] = float(by["weighted"] / by["uniform"])
    first = data.iloc[0]
    setup = (f"{int(first['stages'])} stages, {int(first['peers'])} peers of mixed speed, {int(first['trainers'])} "
             f"trainers, {first['duration_s']:g} emulated s; 1 run per routing and transport")
    measurement = "weighted / uniform throughput: " + (", ".join(f"{t} {r:.2f}x" for t, r in ratios.items())
                                                        or "no pair")
    statistic = f"threshold: ratio ≥ {WIRING_RATIO:g} in every transport (one run each: no spread)"
    if not ratios:
        verdict = INCONCLUSIVE
    elif all(r >= WIRING_RATIO for r in ratios.values()):
        verdict = HOLDS
    elif all(r <= 1.0 for r in ratios.values()):
        verdict = FAILS
    else:
        verdict = INCONCLUSIVE
    return Outcome(verdict, measurement, statistic, setup)


def failures_evaluate(manifest):
    data = _read_study(manifest, "failures_timeline")
    killed = data[data["failures"] == "periodic"]
    wide = killed.pivot_table(index=["transport", "t_s"], columns="routing", values="throughput_mb_s")
    if not {"weighted", "fixed"} <= set(wide.columns):
        return Outcome(INCONCLUSIVE, "needs weighted and fixed routing under failures", "no comparison",
                       f"{killed['transport'].nunique()} transport(s); periodic kills")
    wide = wide.dropna()  # a transport without fixed chains (the testbed's launcher) has no pair
    paired = list(dict.fromkeys(wide.index.get_level_values("transport")))
    unpaired = sorted(set(killed["transport"]) - set(paired))
    setup = (f"transports {', '.join(paired)}; periodic kills; {killed['t_s'].nunique()} windows of "
             f"{killed['window_s'].iloc[0]:g} s (emulated s in the emulation and the simulator)"
             + (f"; {', '.join(unpaired)} left out: no fixed chains" if unpaired else ""))
    later = killed[(killed["routing"] == "weighted") & (killed["t_s"] > killed["t_s"].min())]
    stalls = int((later["throughput_mb_s"] <= 0).sum())
    lost = int(killed.loc[killed["routing"] == "weighted", "lost_microbatches"].max())
    outcome = paired_greater(wide["weighted"] - wide["fixed"], unit="microbatches/s", what="(transport, window) pairs")
    measurement = (f"under kills: weighted {wide['weighted'].mean():.2f}, fixed chains {wide['fixed'].mean():.2f} "
                   f"microbatches/s; {outcome.measurement}; weighted windows at zero after the first: {stalls}; "
                   f"lost microbatches: {lost}")
    statistic = outcome.statistic + "; and no window after the first at zero throughput"
    if stalls:
        verdict = FAILS
    else:
        verdict = outcome.verdict
    return Outcome(verdict, measurement, statistic, setup)


def rebalancing_evaluate(manifest):
    data = _read_study(manifest, "rebalancing_recovery")
    kill_at, late = late_windows(data)
    late["period"] = late["rebalance_period_s"].map(lambda p: "off" if pd.isna(p) else f"{p:g}")
    wide = late.pivot_table(index=["transport", "t_s"], columns="period", values="throughput_mb_s")
    periods = [c for c in wide.columns if c != "off"]
    setup = (f"{data['transport'].nunique()} transport(s); a stage starved at {kill_at:g} emulated s; rebalancing "
             f"off vs every {', '.join(periods)} s; windows of the last half after the kill")
    if "off" not in wide.columns or not periods:
        return Outcome(INCONCLUSIVE, "needs rebalancing off and on", "no comparison", setup)
    diffs = pd.concat([wide[p] - wide["off"] for p in periods]).dropna()
    outcome = paired_greater(diffs, unit="microbatches/s", what="(transport, period, window) pairs")
    means = ", ".join(f"{p}: {wide[p].mean():.2f}" for p in ["off", *periods])
    return Outcome(outcome.verdict, f"late throughput {means} microbatches/s; {outcome.measurement}",
                   outcome.statistic, setup)


def square_cube_evaluate(manifest):
    data = _read_study(manifest, "square_cube")
    bandwidth = data["bandwidth_mbit_s"].min()  # the ratio at one link (the slowest, with no added delay)
    rows = data[data["bandwidth_mbit_s"] == bandwidth]
    if "latency_ms" in rows:
        rows = rows[rows["latency_ms"] == rows["latency_ms"].min()]
    results = {}
    for scheme, group in rows.groupby("scheme", sort=False):
        results[scheme] = trend(group["hidden_size"], group["compute_to_comm"], increasing=True, what="widths")
    verdicts = [v for v, _ in results.values()]
    verdict = HOLDS if all(v == HOLDS for v in verdicts) else FAILS if FAILS in verdicts else INCONCLUSIVE
    sizes = sorted(rows["hidden_size"].unique())
    ratio = rows.pivot_table(index="hidden_size", columns="scheme", values="compute_to_comm")
    measurement = "compute / comm. at " + f"{bandwidth:g} Mbit/s: " + "; ".join(
        f"{scheme} " + " → ".join(f"{ratio.loc[d, scheme]:.3g}" for d in sizes) for scheme in ratio.columns)
    measurement += f" (widths {', '.join(map(str, sizes))}; median of {int(data['repeats'].iloc[0])} timings)" \
        if "repeats" in data else f" (widths {', '.join(map(str, sizes))})"
    statistic = "; ".join(f"{scheme}: {s}" for scheme, (_, s) in results.items())
    first = data.iloc[0]
    link = f", {first['link']} link (docs/swarm.md)" if "link" in data else ""
    setup = (f"one crammed-BERT layer, microbatch {int(first['batch'])} x {int(first['seq_len'])} tokens, "
             f"{int(first['threads'])} CPU thread(s){link}; every scheme must rise")
    return Outcome(verdict, measurement, statistic, setup)


def compression_evaluate(manifest):
    data = _read_study(manifest, "compression_loss")
    steps = int(data["step"].max())
    tail = data[data["step"] > steps / 2]
    wide = tail.pivot_table(index="step", columns="config", values="loss")
    setup = (f"the swarm model split into {int(data['stages'].iloc[0])} stages, one process; {steps} steps, same "
             f"batches and masks per config; paired over the last half of the steps")
    if not {"none", "blockwise8"} <= set(wide.columns):
        return Outcome(INCONCLUSIVE, "needs configs none and blockwise8", "no comparison", setup)
    outcome = equivalent(wide["blockwise8"] - wide["none"], margin=LOSS_MARGIN_NATS, unit="nats",
                         what="paired steps")
    measurement = (f"mean loss none {wide['none'].mean():.3f}, blockwise8 {wide['blockwise8'].mean():.3f} nats; "
                   + outcome.measurement)
    return Outcome(outcome.verdict, measurement, outcome.statistic + " (steps are autocorrelated)", setup)
