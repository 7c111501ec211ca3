"""SWARM's findings as our runs measured them, beside the paper's: the ``swarm-findings`` block of docs/swarm.md.

Each finding is read from a committed results file under ``results/readme/`` (the testbed's ``swarm_study`` runs,
the square-cube runs, the compression-over-a-slow-link benchmark, the simulator-vs-testbed benchmarks with and
without churn, and the GPU run), so the table is rewritten by ``python -m cramswarm docs`` whenever a run is
committed again and can never carry a number typed by hand. The paper's column comes from the claims table
(``claims.CLAIMS``), the one place where the papers' numbers are written down with their confidence tag. A
finding whose file is not committed says which command writes it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from cramswarm.report.recovery import late_windows

SIM_TOLERANCE = 0.15  # issue 19: the simulator within 15 % of the testbed


@dataclass(frozen=True)
class Finding:
    finding: str
    setup: str
    ours: str
    paper: str
    files: tuple[Path, ...]


def _paper(claim_id: str) -> str:
    from cramswarm.report.claims import CLAIMS

    return next(c.paper_number for c in CLAIMS if c.id == claim_id) + f" ({claim_id})"


def _link(frame: pd.DataFrame) -> str:
    rows = frame.dropna(subset=["link_mbit_s"]) if "link_mbit_s" in frame else frame.iloc[0:0]
    if rows.empty:
        return ""
    first = rows.iloc[0]
    return f"; testbed links {first['link_mbit_s']:g} Mbit/s, {first['latency_ms']:g} ms one way"


def _per_transport(values: dict[str, str]) -> str:
    return "; ".join(f"{transport}: {text}" for transport, text in values.items())


def _host(folder: Path) -> str:
    """``; host: N CPU cores`` from the folder's ``run.json`` (``host.cpu_cores``), or nothing where unrecorded:
    the testbed runs every process on one machine, so its core count bounds the real-process rows."""
    record = folder / "run.json"
    cores = json.loads(record.read_text()).get("host", {}).get("cpu_cores") if record.is_file() else None
    return f"; host: {cores} CPU cores" if cores else ""


def wiring(results: Path, folder: str = "swarm_study_testbed") -> Finding | None:
    """Weighted against uniform routing, per transport, from ``<folder>/wiring_throughput.csv``."""
    path = results / folder / "wiring_throughput.csv"
    if not path.is_file():
        return None
    data = pd.read_csv(path, na_values=["NaN"])
    data = data[data["run"] == "base"] if "run" in data else data
    ratios = {}
    for transport, rows in data.groupby("transport", sort=False):
        by = rows.set_index("routing")
        if {"weighted", "uniform"} <= set(by.index) and by.loc["uniform", "throughput_mb_s"] > 0:
            w, u = by.loc["weighted"], by.loc["uniform"]
            ratios[transport] = (f"{w['throughput_mb_s'] / u['throughput_mb_s']:.2f}x "
                                 f"({w['percent_of_optimum']:.0f} vs {u['percent_of_optimum']:.0f} % of optimum, "
                                 f"{int(w['lost_microbatches']) + int(u['lost_microbatches'])} lost)")
    first = data.iloc[0]
    setup = (f"{int(first['stages'])} stages of peers of speed 1 / 0.5 / 0.25, {int(first['trainers'])} trainers, "
             f"{first['duration_s']:g} s per run{_link(data)}{_host(path.parent)}; one run each")
    return Finding("Throughput-weighted routing beats uniform routing on mixed peers (weighted / uniform)", setup,
                   _per_transport(ratios), _paper("S3"), (path,))


def failures(results: Path) -> Finding | None:
    path = results / "swarm_study_testbed" / "failures_timeline.csv"
    if not path.is_file():
        return None
    data = pd.read_csv(path, na_values=["NaN"])
    weighted = data[data["routing"] == "weighted"]
    kept = {}
    for transport, rows in weighted.groupby("transport", sort=False):
        means = rows.groupby("failures")["throughput_mb_s"].mean()
        if {"none", "periodic"} <= set(means.index) and means["none"] > 0:
            lost = int(rows.loc[rows["failures"] == "periodic", "lost_microbatches"].max())
            kept[transport] = f"{100 * means['periodic'] / means['none']:.0f} % ({lost} lost)"
    periodic = weighted[weighted["failures"] == "periodic"]
    peers = int(periodic["peers_up"].max())
    setup = (f"{peers} peers of speed 1, one killed at regular intervals and replaced; "
             f"{periodic['t_s'].nunique()} windows of {periodic['window_s'].iloc[0]:g} s{_link(data)}; one run each")
    return Finding("The swarm keeps training through peer failures (throughput under kills / failure-free)", setup,
                   _per_transport(kept), _paper("S4"), (path,))


def rebalancing(results: Path) -> Finding | None:
    path = results / "swarm_study_testbed" / "rebalancing_recovery.csv"
    if not path.is_file():
        return None
    data = pd.read_csv(path, na_values=["NaN"])
    kill_at, late = late_windows(data)
    out = {}
    for transport, rows in late.groupby("transport", sort=False):
        off = rows[rows["rebalance_period_s"].isna()]
        on = rows[rows["rebalance_period_s"].notna()]
        if off.empty or on.empty:
            continue
        parts = [f"off {off['throughput_mb_s'].mean():.2f}"]
        for period, group in on.groupby("rebalance_period_s"):
            moves = int(group["moves"].iloc[0])
            parts.append(f"every {period:g} s {group['throughput_mb_s'].mean():.2f} ({moves} "
                         f"move{'' if moves == 1 else 's'})")
        out[transport] = ", ".join(parts) + " microbatches/s"
    setup = (f"{int(data['peers_up'].max())} peers of speed 1; peers of one stage die for good at {kill_at:g} s; "
             f"mean of the windows in the last half after it{_link(data)}; one run each")
    return Finding("Rebalancing restores the throughput of a starved stage", setup, _per_transport(out),
                   _paper("S5"), (path,))


def sim_scale(results: Path) -> Finding | None:
    path = results / "sim_scale" / "sim_scale.csv"
    if not path.is_file():
        return None
    data = pd.read_csv(path, na_values=["NaN"])
    data["period"] = data["rebalance_period_s"].map(lambda p: "off" if pd.isna(p) else f"T = {p:g} s")
    periods = list(dict.fromkeys(data.sort_values("rebalance_period_s", na_position="first")["period"]))
    parts = []
    for peers, rows in data.groupby("peers"):
        share = rows.groupby("period")["percent_of_optimum"]
        low, high = share.min(), share.max()
        parts.append(f"{peers} peers: " + ", ".join(
            f"{p} {low[p]:.1f}-{high[p]:.1f} %" if round(low[p], 1) != round(high[p], 1) else f"{p} {low[p]:.1f} %"
            for p in periods))
    first = data.iloc[0]
    network = "no network" if pd.isna(first["nic_mbit_s"]) else f"NICs of {first['nic_mbit_s']:g} Mbit/s"
    setup = (f"simulator, {int(first['stages'])} stages, peers of random speed, about one preemption per peer-hour "
             f"under each of {data['preemption_model'].nunique()} preemption models "
             f"({', '.join(dict.fromkeys(data['preemption_model']))}; the range over them is shown), {network}")
    return Finding("Rebalancing keeps a large swarm near its optimum (share of the optimal assignment)", setup,
                   "; ".join(parts), _paper("S5"), (path,))


def _utilisation(frame: pd.DataFrame, column: str, widths: list[int]) -> str:
    by = frame.set_index("hidden_size")[column]
    return " → ".join(_percent(by[w]) for w in widths) + " %"


def _percent(share: float) -> str:
    """A share as a percentage: whole numbers, one decimal below 10 %."""
    if math.isnan(share):
        return "—"
    return f"{100 * share:.1f}" if share < 0.1 else f"{100 * share:.0f}"


def square_cube(results: Path, name: str, where: str) -> Finding | None:
    path = results / name
    if not path.is_file():
        return None
    data = pd.read_csv(path, na_values=["NaN"])
    bandwidth = 500.0 if (data["bandwidth_mbit_s"] == 500.0).any() else float(data["bandwidth_mbit_s"].max())
    rows = data[(data["bandwidth_mbit_s"] == bandwidth) & (data["latency_ms"] == data["latency_ms"].min())]
    widths = sorted(int(w) for w in rows["hidden_size"].unique())
    device = str(rows["device"].iloc[0]) if "device" in rows else "the CPU (1 thread)"
    tflops = float(rows["device_tflops"].iloc[0])
    parts = []
    for scheme in ("none", "blockwise8"):
        scheme_rows = rows[rows["scheme"] == scheme]
        if scheme_rows.empty:
            continue
        parts.append(f"{scheme}: measured {_utilisation(scheme_rows, 'utilisation', widths)}, at {tflops:g} TFLOP/s "
                     f"{_utilisation(scheme_rows, 'device_utilisation', widths)}")
    first = rows.iloc[0]
    setup = (f"one crammed-BERT layer, widths {' / '.join(map(str, widths))}, {int(first['batch'])} x "
             f"{int(first['seq_len'])} tokens per call, {bandwidth:g} Mbit/s, {first['latency_ms']:g} ms, "
             f"{first['link']} link; compute on {device}")
    return Finding(f"Share of time computing rises with layer width ({where})", setup, "; ".join(parts),
                   _paper("S6"), (path,))


def compression(results: Path) -> list[Finding]:
    found = []
    for path in sorted((results / "swarm_compression_link").glob("*_seeds*.json")):
        record = json.loads(path.read_text())
        args, summary = record["args"], record["summary"]
        if args.get("seeds", 1) < 2 or len(summary) < 2:  # one seed, or one scheme: nothing compared
            continue
        # `done`: what the trainers finished (recorded since the slow-link fix); before it, the stepped rate
        rate, what = ("done_mb_s_vs_none", "the trainers' finished") if "done_mb_s_vs_none" in summary[0] \
            else ("mb_s_vs_none", "the last stage's stepped")
        parts = [f"{s['scheme']} {s[rate]:.2f}x, loss {s['heldout_loss']:.2f} ± {s['heldout_loss_sd']:.2f}"
                 for s in summary]
        setup = (f"launcher swarm on the testbed, 2 stages x {args['peers']} peers, {args['trainers']} trainers, "
                 f"width {args['hidden']}, {args['microbatches']} microbatches; {args['mbit']:g} Mbit/s, "
                 f"{args['ms']:g} ms; mean ± sd of {args['seeds']} seeds; rate: {what} microbatches/s vs none")
        found.append(Finding("Compression between stages over a slow link (rate vs none; held-out loss, nats)",
                             setup, "; ".join(parts), _paper("S7"), (path,)))
    return found


def simulator(results: Path) -> Finding | None:
    paths = sorted((results / "swarm_testbed").glob("*.json"))
    if not paths:
        return None
    ratios: dict[tuple[float, float], list[float]] = {}
    used = []
    for path in paths:
        record = json.loads(path.read_text())
        predicted = record.get("sim_step_mb", {}).get("shaped")
        if not predicted:  # a run from before the model with the measured microbatches per step
            continue
        used.append(path)
        for run, sim_mb_s in zip(record["testbed"]["shaped"], predicted):
            key = (run["bandwidth_mbit"], run["latency_ms"])
            ratios.setdefault(key, []).append(sim_mb_s / run["mb_s"])
    if not ratios:
        return None
    within = sum(abs(r - 1) <= SIM_TOLERANCE for values in ratios.values() for r in values)
    total = sum(len(values) for values in ratios.values())
    parts = [f"{b:g} Mbit/s {ms:g} ms: " + ", ".join(f"{r:.2f}" for r in values)
             for (b, ms), values in ratios.items()]
    args = json.loads(used[0].read_text())["args"]
    runs = f"{len(used)} run" + ("s" if len(used) != 1 else "")
    setup = (f"launcher swarm on the testbed ({args['stages']} stages x {args['peers']} peers, {args['trainers']} "
             f"trainers, {args['compression']}) vs the simulator given the call cost and the in-stage step "
             f"measured in the same run; {runs} (of {len(paths)} committed, the others before this model)")
    ours = f"simulated / measured throughput {'; '.join(parts)}: {within} of {total} within {SIM_TOLERANCE:.0%}"
    return Finding("The simulator predicts the testbed's throughput", setup, ours,
                   "the paper validates no simulator against real runs (our check)", tuple(used))


def _rate(timeline: list, start_s: float, end_s: float) -> float:
    """Microbatches per second finished in ``[start_s, end_s]`` of a timeline of (seconds, total) points."""
    return sum(start_s <= t <= end_s for t, total in timeline if total > 0) / (end_s - start_s)


def churn(results: Path) -> list[Finding]:
    """One row per ``benchmarks/swarm_churn.py --json`` run under ``swarm_churn/``: the simulator's throughput over
    the testbed's for the churn run (and the calibration run it was fitted on), per calibration model, after the
    warm-up; joins, moves and losses on the testbed; its steps' batch over target. A file holding the testbed's
    measurements only (the run stopped before simulating) is left out."""
    found = []
    for path in sorted((results / "swarm_churn").glob("*.json")):
        record = json.loads(path.read_text())
        if "sim" not in record:
            continue
        args, tb, sim = record["args"], record["testbed"], record["sim"]
        start, end = float(args["warmup"]), float(args["duration"])
        models = [m for m in ("compute", "calls") if m in sim]
        if not models:
            continue
        churned, calibrated = ([_rate(sim[m][run]["timeline"], start, end) / _rate(tb[run]["timeline"], start, end)
                                for m in models] for run in ("churn", "calibration"))
        within = sum(abs(r - 1) <= SIM_TOLERANCE for r in churned)
        run = tb["churn"]
        overshoot = [v for v in run["step_overshoot"].values() if v]
        steps = (f"; its steps' batch / target on the testbed mean {min(v['mean'] for v in overshoot):.2f}-"
                 f"{max(v['mean'] for v in overshoot):.2f}, max {max(v['max'] for v in overshoot):.2f} per stage"
                 if overshoot else "")
        setup = (f"launcher swarm on the testbed, {args['stages']} stages x {args['peers']} peers, "
                 f"{args['trainers']} trainers, {args['link']:g} Mbit/s, {args['latency']:g} ms one way, a step "
                 f"every {args['batch']} microbatches, rebalancing every {args['rebalance']:g} s; {args['killed']} "
                 f"peers of stage {args['starved']} leave for good at {args['kill_at']:g} s, "
                 f"{len(args['join_at'])} join by swarm-join; the simulator, calibrated on a run without churn "
                 f"({' and '.join(models)} models), replays the schedule that happened; {end:g} s, rates after "
                 f"{start:g} s; one run")
        ours = (f"simulated / measured throughput under churn {', '.join(f'{r:.2f}' for r in churned)} "
                f"({within} of {len(churned)} within {SIM_TOLERANCE:.0%}; calibration run "
                f"{', '.join(f'{r:.2f}' for r in calibrated)}); {len(run['joined'])} of {len(args['join_at'])} "
                f"joiners served, {len(run['moves'])} move{'' if len(run['moves']) == 1 else 's'}, "
                f"{run['lost_microbatches']} microbatches lost{steps}")
        found.append(Finding("The simulator predicts the testbed's throughput while peers leave and join", setup,
                             ours, "the paper validates no simulator against real runs (our check)", (path,)))
    return found


def gpu(results: Path) -> Finding | None:
    path = results / "swarm_gpu_launcher" / "summaries.json"   # the launcher's swarm (no coordinator)
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    single, swarm = record["single"], record["swarm"]
    gpu_name = single.get("provenance", {}).get("hardware", {}).get("gpu", "a GPU")
    arch = single["arch"]
    ours = (f"swarm {swarm['tokens_per_s']:,.0f} vs single {single['tokens_per_s']:,.0f} tokens/s "
            f"({swarm['tokens_per_s'] / single['tokens_per_s']:.3f}x)")
    setup = (f"{arch['layers']} layers x {arch['hidden_size']} on one {gpu_name}, {single['tokens']:,} tokens; "
             f"the swarm's peers and trainers share the one GPU over loopback")
    return Finding("Swarm training's throughput against single-GPU pretraining at the same shape", setup, ours,
                   "SWARM vs GPipe, no single-GPU comparison [secondary]", (path,))


FINDINGS: tuple[Callable[[Path], Finding | list[Finding] | None], ...] = (
    wiring, lambda r: wiring(r, "swarm_study_testbed_16cores"), failures, rebalancing, sim_scale,
    lambda r: square_cube(r, "square_cube_testbed.csv", "CPU, real calls on the testbed"),
    lambda r: square_cube(r, "square_cube_gpu.csv", "GPU, ideal links"),
    compression, simulator, churn, gpu,
)


def findings(results: Path) -> list[Finding]:
    out: list[Finding] = []
    for make in FINDINGS:
        found = make(results)
        out.extend(found if isinstance(found, list) else [found] if found else [])
    return out


def render(results_dir: Path, doc_dir: Path, repo: Path) -> str:
    """The ``swarm-findings`` block: one row per finding, then the provenance line naming every file read."""
    from cramswarm.report.markdown import cell, missing, provenance_line

    rows = findings(results_dir)
    if not rows:
        return missing(results_dir / "swarm_study_testbed", results_dir, "the commands in docs/swarm.md")
    lines = ["| the paper's claim | setup | ours | paper's number |", "|---|---|---|---|"]
    lines += [f"| {cell(f.finding)} | {cell(f.setup)} | {cell(f.ours)} | {cell(f.paper)} |" for f in rows]
    files = [path for f in rows for path in f.files]
    return "\n".join(lines) + "\n\n" + provenance_line(files, results_dir, writer="the commands in docs/swarm.md")
