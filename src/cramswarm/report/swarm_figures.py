"""Tables (CSV + Markdown) and figures (PNG + PDF + caption) of the swarm_study experiments.

Each experiment of :mod:`cramswarm.swarm_study.study` writes one CSV; here each becomes a summary table
``<name>_table.csv`` / ``<name>_table.md`` (:mod:`cramswarm.report.swarm_tables`), a figure ``<name>.png`` /
``<name>.pdf`` (150 dpi, the report's one seaborn style from :mod:`cramswarm.report.figures`) and a caption
``<name>.caption.rst`` saying what is shown, the setup read from the CSV, and the paper's number where swarm.md gives
one, with its confidence tag. :func:`swarm_report` does all experiments whose CSV is present. Every file is written
atomically.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from cramswarm.report.figures import PALETTE, _new_figure, _save, _style, figure_paths
from cramswarm.report.recovery import late_windows
from cramswarm.report.swarm_tables import write_swarm_table

EXPERIMENTS = ("square_cube", "wiring_throughput", "failures_timeline", "rebalancing_recovery", "compression_loss",
               "sim_scale")

# Published numbers quoted in captions (swarm.md section 3; tags as there).
PAPER_E4 = ("SWARM paper, E4 (simulation on T4 preemption logs): rebalancing every T = 300 s reaches 95.8 % of the "
            "optimal throughput, no rebalancing 82.7 % [secondary: third-party summary, not verified against the "
            "paper].")


# ---------------------------------------------------------------------------------------------------- helpers

def _save_all(fig: Figure, stem: Path, caption: str) -> list[Path]:
    """``<stem>.png`` (150 dpi), ``<stem>.pdf`` and ``<stem>.caption.rst``, as every report figure
    (:func:`cramswarm.report.figures._save`)."""
    return list(figure_paths(_save(fig, stem.with_name(stem.name + ".png"), caption)).values())


def _read(csv: str | os.PathLike, columns: tuple[str, ...]) -> pd.DataFrame:
    frame = pd.read_csv(csv, na_values=["NaN"])
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ValueError(f"{csv}: missing column(s) {', '.join(missing)}")
    if frame.empty:
        raise ValueError(f"{csv}: no rows")
    return frame


def _legend_outside(ax, title: str | None = None) -> None:
    """One legend right of the axes with every labelled artist (bars, lines and reference lines)."""
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles, labels, title=title, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)


def _periods(column: pd.Series) -> list[float]:
    """Distinct rebalancing periods, off (NaN) first, then ascending."""
    values = sorted(column.dropna().unique())
    return ([math.nan] if column.isna().any() else []) + values


def _same_period(column: pd.Series, period: float) -> pd.Series:
    return column.isna() if pd.isna(period) else column == period


def _period_label(period: float) -> str:
    return "off" if pd.isna(period) else f"T = {period:g} s"


def _stairs(ax, rows: pd.DataFrame, **style) -> None:
    """Windowed throughput as a step line spanning each window (``t_s`` = window start)."""
    rows = rows.sort_values("t_s")
    if rows.empty:
        return
    edges = [*rows["t_s"], rows["t_s"].iloc[-1] + rows["window_s"].iloc[-1]]
    ax.stairs(rows["throughput_mb_s"], edges, baseline=None, **style)


# ------------------------------------------------------------------------------------------------ square-cube

# The paper's Figure 1 (right): one layer of each width on a V100 at 500 Mbit/s, share of time computing
# [paper: figure image, arXiv layout; docs/swarm.md]
PAPER_UTILISATION = {768: 0.18, 4096: 0.32, 12288: 0.82}
PAPER_BANDWIDTH_MBIT_S = 500.0


def square_cube_figure(csv: str | os.PathLike, out_dir: str | os.PathLike) -> list[Path]:
    """M1: relative device utilisation (compute / (compute + call)) vs hidden size, one panel per bandwidth and
    latency, one colour per scheme; solid: the measured compute (CPU or GPU: the device column), dashed: the layer's
    FLOPs at the stated accelerator rate; the paper's Figure 1 values as black crosses on its bandwidth."""
    data = _read(csv, ("hidden_size", "scheme", "bandwidth_mbit_s", "latency_ms", "link", "compute_s", "comm_s",
                       "utilisation", "device_tflops", "device_utilisation"))
    out = Path(out_dir)
    table = data.assign(percent=100 * data["utilisation"]).pivot_table(
        index=["hidden_size", "compute_s"], columns=["bandwidth_mbit_s", "latency_ms", "scheme"], values="percent")
    table.columns = [f"util_{b:g}mbit_{ms:g}ms_{s}" for b, ms, s in table.columns]
    paths = list(write_swarm_table(table.reset_index(), out / "square_cube_table"))
    panels = sorted({(b, ms) for b, ms in zip(data["bandwidth_mbit_s"], data["latency_ms"])})
    schemes = list(dict.fromkeys(data["scheme"]))
    first = data.iloc[0]
    # where the compute was measured (the device column; CSVs written before it existed are the CPU's)
    device = str(first["device"]) if "device" in data.columns else "cpu"
    measured = "this CPU" if device == "cpu" else device
    with _style():
        colors = dict(zip(schemes, sns.color_palette(PALETTE, len(schemes))))
        fig = _new_figure(3.2 * len(panels) + 1.8, 3.8)
        axes = np.atleast_1d(fig.subplots(1, len(panels), sharey=True))
        for ax, (bandwidth, latency) in zip(axes, panels):
            rows = data[(data["bandwidth_mbit_s"] == bandwidth) & (data["latency_ms"] == latency)]
            for scheme in schemes:
                line = rows[rows["scheme"] == scheme].sort_values("hidden_size")
                ax.plot(line["hidden_size"], 100 * line["utilisation"], marker="o", color=colors[scheme],
                        label=f"{scheme}, {measured}")
                ax.plot(line["hidden_size"], 100 * line["device_utilisation"], marker=".", linestyle="--",
                        color=colors[scheme], label=f"{scheme}, {first['device_tflops']:g} TFLOP/s")
            if bandwidth == PAPER_BANDWIDTH_MBIT_S:
                ax.plot(list(PAPER_UTILISATION), [100 * v for v in PAPER_UTILISATION.values()], "kx",
                        markersize=8, label="paper, V100")
            ax.set_xscale("log", base=2)
            sizes = sorted(set(rows["hidden_size"]) | (set(PAPER_UTILISATION) if bandwidth ==
                                                       PAPER_BANDWIDTH_MBIT_S else set()))
            ax.set_xticks(sizes, [str(s) for s in sizes], rotation=45)
            ax.minorticks_off()
            ax.set_ylim(0, 100)
            ax.set_title(f"{bandwidth:g} Mbit/s, {latency:g} ms")
            ax.set_xlabel("hidden size d (log2 scale)")
        axes[0].set_ylabel("time computing (%)")
        handles, labels = [], []
        for ax in axes:
            for handle, label in zip(*ax.get_legend_handles_labels()):
                if label not in labels:
                    handles.append(handle)
                    labels.append(label)
        fig.legend(handles, labels, loc="outside right upper", fontsize="small")
        fig.suptitle("Square-cube law: one crammed-BERT layer's share of time computing, per boundary call")
    links = ", ".join(sorted(set(data["link"])))
    how = ("a real hivemind call between processes on two hosts of the network testbed, the server's link shaped "
           "to the panel's bandwidth and delayed through the relay by its latency (the median of the calls made)"
           if links == "testbed" else
           "an ideal link: payload bytes both ways over the panel's bandwidth plus one round trip, no protocol"
           if links == "ideal" else f"links: {links}")
    where = (f"this CPU ({int(first['threads'])} thread(s))" if device == "cpu" else
             f"the {device} (timed between CUDA synchronisations)")
    solid = ("the solid lines compare a CPU, tens of times slower than a V100, and so sit higher at every width." if
             device == "cpu" else f"the solid lines use the {device}'s achieved rate, which itself rises with\nthe "
             "width (small layers leave it idle between kernels), so they need not rise with d.")
    caption = f"""
**Square-cube law (M1).** Relative device utilisation, the paper's Figure 1 metric: for a peer that receives a
microbatch, computes one crammed-BERT layer (FFN 4d, heads of 64 features) forward and backward on it
({int(first['batch'])} x {int(first['seq_len'])} tokens) and sends the result on, compute / (compute + call). The call
carries the encoded activation one way and a reply of the same size (the gradient) the other: {how}.
Solid lines: compute measured under bf16 autocast on {where}; dashed: the
layer's FLOPs at a stated {first['device_tflops']:g} TFLOP/s (an assumed accelerator rate, about a quarter of a
V100's fp16 tensor-core peak), with the same measured call. Compute grows as d^2 per token and the traffic as d,
so utilisation rises with d; fp16 halves and blockwise 8-bit quarters the traffic; latency adds a fixed time per
call that only more compute per call hides.
Paper, Figure 1 (right), black crosses (V100, 500 Mbit/s, one layer, its own microbatch size, not stated in the
figure): 768 units 18 %, 4096 units 32 %, 12288 units 82 %, and the paper's 12 layers of 4096 units 89 % [paper:
figure image, arXiv layout]; with 100 ms of latency, "base" layers 1.5-18 % and GPT-3-sized 48-82 % [secondary:
third-party notes]. Like with like is the dashed line at 500 Mbit/s: a device rate against the same call;
{solid}
"""
    return paths + _save_all(fig, out / "square_cube", caption)


# ------------------------------------------------------------------------------------------------ transports

def _transport_note(data: pd.DataFrame, routing: str = "weighted and uniform routing only (no fixed chains)") -> str:
    """What each transport of a wiring/failures/rebalancing CSV is, and for testbed rows, on what link they ran
    and with what routing."""
    notes = {"emulation": "emulation: threads in one process, emulated seconds, no network",
             "sim": "sim: the discrete-event simulator, no network"}
    parts = [notes[t] for t in dict.fromkeys(data["transport"]) if t in notes]
    testbed = data[data["transport"] == "testbed"]
    if len(testbed):
        links = []
        for (rate, delay), _ in testbed.groupby(["link_mbit_s", "latency_ms"], dropna=False, sort=False):
            speed = "unshaped links" if pd.isna(rate) else f"links shaped to {rate:g} Mbit/s"
            links.append(f"{speed}, {delay:g} ms one way through the relay")
        parts.append("testbed: real processes of the launcher (a DHT bootstrap, one process per stage peer and per "
                     "trainer, each on a host of its own: a Linux network namespace) training a tiny crammed BERT "
                     f"on a toy language, {'; '.join(links)}; the peers' speeds are a compute floor of the stage "
                     f"time per work unit, real seconds; {routing}")
    return "Transports - " + "; ".join(parts) + "." if parts else ""


def _testbed_kills(data: pd.DataFrame) -> str:
    if not (data["transport"] == "testbed").any():
        return ""
    return (" On the testbed the launcher SIGKILLs a random live peer of a stage that has two or more at the same "
            "interval (its own draw, not the schedule above) and starts a fresh one after the rejoin delay, which "
            "loads the stage's state before it serves; peers up counts the killed peer down until then.")


# --------------------------------------------------------------------------------------------------- wiring

def _wiring_winners(sweep: pd.DataFrame) -> str:
    """Per speed profile: which routing had the highest throughput at each load of the simulated sweep."""
    parts = []
    for profile, rows in sweep.groupby("speeds", sort=False):
        best: dict[str, list[str]] = {}
        for load, at_load in rows.groupby("trainers_per_peer"):
            top = at_load.loc[at_load["throughput_mb_s"].idxmax()]
            best.setdefault(top["routing"], []).append(f"{load:g} ({top['percent_of_optimum']:.0f} %)")
        wins = "; ".join(f"{routing} at {', '.join(loads)}" for routing, loads in best.items())
        parts.append(f"{profile} speeds: {wins}")
    return ". ".join(parts)


def wiring_figure(csv: str | os.PathLike, out_dir: str | os.PathLike) -> list[Path]:
    """M2: throughput per routing policy and transport, with the optimum as a line; beside it the simulated
    sweep over trainers per peer (share of the optimum per routing, mixed and equal peer speeds)."""
    data = _read(csv, ("transport", "routing", "throughput_mb_s", "optimum_mb_s", "percent_of_optimum"))
    if "run" not in data.columns:
        data = data.assign(run="base", speeds="mixed")
    if "trainers_per_peer" not in data.columns:
        data = data.assign(trainers_per_peer=data["trainers"] / data["peers"])
    base, sweep = data[data["run"] == "base"], data[data["run"] == "sweep"]
    out = Path(out_dir)
    columns = ["run", "speeds", "transport", "routing", "trainers", "trainers_per_peer", "throughput_mb_s",
               "optimum_mb_s", "percent_of_optimum", "retries"]
    paths = list(write_swarm_table(data[[c for c in columns if c in data.columns]], out / "wiring_throughput_table"))
    with _style():
        fig = _new_figure(12.0 if len(sweep) else 6.5, 4.0)
        axes = np.atleast_1d(fig.subplots(1, 2 if len(sweep) else 1))
        ax = axes[0]
        sns.barplot(data=base, x="routing", y="throughput_mb_s", hue="transport", ax=ax)
        ax.axhline(base["optimum_mb_s"].iloc[0], color="0.3", linestyle="--", linewidth=1,
                   label="optimum (every peer busy)")
        for container in ax.containers:
            ax.bar_label(container, fmt="%.2f", fontsize=7, padding=2)
        ax.set_xlabel("routing policy")
        ax.set_ylabel("throughput (microbatches/s)")
        ax.set_title(f"Mixed speeds, {int(base['trainers'].iloc[0])} trainers")
        ax.set_ylim(0, base["optimum_mb_s"].iloc[0] * 1.15)
        _legend_outside(ax)
        if len(sweep):
            ax = axes[1]
            sns.lineplot(data=sweep, x="trainers_per_peer", y="percent_of_optimum", hue="routing", style="speeds",
                         markers=True, ax=ax)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("trainers per peer (microbatches in flight per peer)")
            ax.set_ylabel("throughput (% of optimum)")
            ax.set_ylim(0, 105)
            ax.set_title("Simulator: routing vs load")
            _legend_outside(ax)
    first = base.iloc[0]
    ratio = _ratio(base, "weighted", "uniform")
    sweep_text = ""
    if len(sweep):
        loads = ", ".join(f"{v:g}" for v in sorted(sweep["trainers_per_peer"].unique()))
        sweep_text = f"""
Right: the simulator alone, the same stages at {loads} trainers per peer (trainers = that x peers, rounded up),
on the mixed-speed peers and on as many peers of speed 1 (equal); share of each setup's optimum. Highest
throughput at each load (trainers per peer, its % of optimum): {_wiring_winners(sweep)}. Which routing wins
depends on the load and the speeds: read each result with its setup."""
    caption = f"""
**Stochastic wiring (M2).** Throughput (completed forward + backward microbatches per second) of SWARM's weighted
routing (interleaved weighted round-robin on measured peer throughput), uniform random routing and fixed chains
(the c-th peer of every stage). Left: {int(first['stages'])} stages of peers with speeds 1, 0.5 and 0.25 (rotated
per stage so that fixed chains mix fast and slow peers), {int(first['trainers'])} concurrent trainers
({first['trainers_per_peer']:.2g} per peer), no failures, {first['duration_s']:g} seconds per run; the transports
side by side. Dashed: the optimum, every stage's summed peer rate (all
peers busy). Weighted / uniform throughput: {ratio}. {_transport_note(base)}{sweep_text}
Expected shape (swarm.md 6.2 M2 [proposal]): weighted approaches the sum of the rates, uniform tends to
3 x the slowest peer, up to ~2.3x apart. swarm.md gives no published number for this experiment.
"""
    return paths + _save_all(fig, out / "wiring_throughput", caption)


def _ratio(data: pd.DataFrame, a: str, b: str) -> str:
    parts = []
    for transport, rows in data.groupby("transport", sort=False):
        by_routing = rows.set_index("routing")["throughput_mb_s"]
        if a in by_routing and b in by_routing and by_routing[b] > 0:
            parts.append(f"{by_routing[a] / by_routing[b]:.2f}x ({transport})")
    return ", ".join(parts) or "n/a"


# ------------------------------------------------------------------------------------------------- failures

def failures_figure(csv: str | os.PathLike, out_dir: str | os.PathLike) -> list[Path]:
    """M3: throughput over time with periodic kills, swarm vs fixed chains, per transport; failure-free dotted."""
    data = _read(csv, ("transport", "routing", "failures", "t_s", "throughput_mb_s", "peers_up"))
    out = Path(out_dir)
    summary = (data.groupby(["transport", "routing", "failures"], sort=False)
               .agg(throughput_mb_s=("throughput_mb_s", "mean"), retries=("retries", "first"),
                    lost_microbatches=("lost_microbatches", "first")).reset_index())
    free = summary[summary["failures"] == "none"].set_index(["transport", "routing"])["throughput_mb_s"]
    summary["percent_of_failure_free"] = [
        100 * row.throughput_mb_s / free.get((row.transport, row.routing), np.nan) for row in summary.itertuples()
    ]
    paths = list(write_swarm_table(summary, out / "failures_timeline_table"))
    transports = list(dict.fromkeys(data["transport"]))
    routings = list(dict.fromkeys(data["routing"]))
    with _style():
        colors = dict(zip(routings, sns.color_palette(PALETTE, len(routings))))
        fig = _new_figure(5.0 * len(transports) + 1.8, 4.6)
        axes = np.atleast_1d(fig.subplots(2, len(transports), sharex=True, height_ratios=(3, 1), squeeze=False))
        for col, transport in enumerate(transports):
            ax, lower = axes[0, col], axes[1, col]
            for routing in routings:
                for label, style in (("periodic", "-"), ("none", ":")):
                    rows = data[(data["transport"] == transport) & (data["routing"] == routing)
                                & (data["failures"] == label)]
                    _stairs(ax, rows, linestyle=style, color=colors[routing], linewidth=1.6 if style == "-" else 1.0)
            ax.set_title(f"{transport}")
            ax.set_ylabel("throughput (microbatches/s)")
            ax.set_ylim(bottom=0)
            up = data[(data["transport"] == transport) & (data["failures"] == "periodic")].drop_duplicates("t_s")
            lower.stairs(up["peers_up"], [*up["t_s"], up["t_s"].iloc[-1] + up["window_s"].iloc[-1]], color="0.3",
                         baseline=None)
            lower.yaxis.set_major_locator(MaxNLocator(integer=True))
            lower.set_ylabel("peers up\n(window mean)")
            lower.set_xlabel("time (real s; window start)" if transport == "testbed"
                             else "time (emulated s; window start)")
        handles = [Line2D([], [], color=colors[r], label="swarm (weighted)" if r == "weighted" else r)
                   for r in routings]
        handles += [Line2D([], [], color="0.3", linestyle="-", label="with kills"),
                    Line2D([], [], color="0.3", linestyle=":", label="failure-free")]
        fig.legend(handles=handles, loc="outside right upper")
        fig.suptitle("Throughput under failures: swarm vs fixed pipeline chains")
    first = data.iloc[0]
    window = first["window_s"]
    lines = [f"{r.transport} {r.routing}: {r.percent_of_failure_free:.0f} %" for r in summary.itertuples()
             if r.failures == "periodic"]
    caption = f"""
**Throughput under failures (M3).** Microbatches completed per {window:g} s window for SWARM's weighted routing and
for fixed GPipe-style chains, with one random live peer killed at regular intervals and restarted later (solid; the
same kill schedule for both) and without failures (dotted); lower panels: peers up. A killed peer drops its queue
(those calls time out and are re-sent to another replica by the swarm; a fixed chain waits for its member).
Throughput under failures as a percentage of the same routing's failure-free run: {'; '.join(lines)}.
{_transport_note(data)}{_testbed_kills(data)}
swarm.md 6.2 M3 [proposal]: SWARM keeps the remaining capacity minus timeout waste, static chains lose a whole chain
per failure. The paper's throughput-over-time figure (E6) has no number in swarm.md [unverified].
"""
    return paths + _save_all(fig, out / "failures_timeline", caption)


# ---------------------------------------------------------------------------------------------- rebalancing

def rebalancing_figure(csv: str | os.PathLike, out_dir: str | os.PathLike) -> list[Path]:
    """M4: throughput over time after a stage is starved, rebalancing off vs periods, per transport."""
    data = _read(csv, ("transport", "rebalance_period_s", "kill_at_s", "t_s", "window_s", "throughput_mb_s",
                       "peers_up", "moves", "first_move_s"))
    out = Path(out_dir)
    kill_at, late = late_windows(data)
    rows = []
    for (transport, period), group in data.groupby(["transport", "rebalance_period_s"], sort=False, dropna=False):
        # windows wholly before the kill, skipping the first (pipeline fill: no microbatch is done yet)
        before = group[(group["t_s"] > 0) & (group["t_s"] + group["window_s"] <= kill_at)]["throughput_mb_s"].mean()
        after = late.loc[late.index.intersection(group.index), "throughput_mb_s"].mean()
        rows.append({"transport": transport, "rebalance_period_s": period, "before_mb_s": before,
                     "after_mb_s": after, "moves": int(group["moves"].iloc[0]),
                     "first_move_s": group["first_move_s"].iloc[0]})
    paths = list(write_swarm_table(pd.DataFrame(rows), out / "rebalancing_recovery_table"))
    transports = list(dict.fromkeys(data["transport"]))
    periods = _periods(data["rebalance_period_s"])
    labels = [_period_label(p) for p in periods]
    with _style():
        colors = dict(zip(labels, sns.color_palette(PALETTE, len(labels))))
        fig = _new_figure(4.6 * len(transports) + 1.6, 3.8)
        axes = np.atleast_1d(fig.subplots(1, len(transports), sharey=True))
        for ax, transport in zip(axes, transports):
            for period, label in zip(periods, labels):
                rows = data[(data["transport"] == transport) & _same_period(data["rebalance_period_s"], period)]
                _stairs(ax, rows, color=colors[label], label=label)
            ax.axvline(kill_at, color="0.3", linestyle="--", linewidth=1)
            ax.annotate("stage starved", (kill_at, 0.98), xycoords=ax.get_xaxis_transform(), xytext=(3, 0),
                        textcoords="offset points", va="top", fontsize=7, color="0.3")
            ax.set_title(transport)
            ax.set_xlabel("time (real s; window start)" if transport == "testbed"
                          else "time (emulated s; window start)")
            ax.set_ylim(bottom=0)
        axes[0].set_ylabel("throughput (microbatches/s)")
        handles = [Line2D([], [], color=colors[label], label=label) for label in labels]
        fig.legend(handles=handles, title="rebalancing", loc="outside right upper")
        fig.suptitle("Recovery of a starved stage by adaptive rebalancing")
    caption = f"""
**Rebalancing recovery (M4).** Microbatches completed per {data['window_s'].iloc[0]:g} s window (weighted routing).
At the dashed line peers of one stage die for good (peers up: {data['peers_up'].max():g} ->
{data['peers_up'].min():g}), leaving that stage the bottleneck. Without rebalancing the swarm stays at the
starved stage's rate; with rebalancing every T seconds a peer of the least loaded stage moves to the most loaded one
(Rebalancer: hysteresis 1.5 on the backlog ratio, only if the bottleneck rate improves), loads the stage state and
serves it, and throughput recovers after about T + the state download. The table gives the mean throughput before
the kill and over the last half of the run after it, the number of moves and the time of the first.
{_transport_note(data, "weighted routing")}{_testbed_rebalancing(data)}
{PAPER_E4}
"""
    return paths + _save_all(fig, out / "rebalancing_recovery", caption)


def _testbed_rebalancing(data: pd.DataFrame) -> str:
    if not (data["transport"] == "testbed").any():
        return ""
    return (" On the testbed the launcher SIGKILLs the peers at the dashed line and replaces none; the stage peers "
            "decide the move themselves (each publishes its measured load, all evaluate the same rule), the mover "
            "drains, downloads the new stage's state from a live replica and serves it; the first move's time is "
            "when it was decided.")


# ---------------------------------------------------------------------------------------------- compression

def compression_figure(csv: str | os.PathLike, out_dir: str | os.PathLike) -> list[Path]:
    """M5: MLM loss vs step per boundary compression config (rolling mean)."""
    data = _read(csv, ("config", "step", "loss"))
    out = Path(out_dir)
    steps = int(data["step"].max())
    tail = max(1, steps // 10)
    final = data[data["step"] > steps - tail].groupby("config", sort=False)["loss"].mean()
    table = pd.DataFrame({"config": final.index, "final_loss": final.values})
    table["delta_vs_none"] = table["final_loss"] - final.get("none", np.nan)
    paths = list(write_swarm_table(table, out / "compression_loss_table"))
    window = max(1, steps // 20)
    configs = list(dict.fromkeys(data["config"]))
    with _style():
        colors = dict(zip(configs, sns.color_palette(PALETTE, len(configs))))
        fig = _new_figure(7.0, 4.0)
        ax = fig.subplots()
        for config in configs:
            rows = data[data["config"] == config].sort_values("step")
            smooth = rows["loss"].rolling(window, min_periods=1).mean()
            ax.plot(rows["step"], smooth, color=colors[config], label=config, linewidth=1.4,
                    linestyle={"fp16": "--", "blockwise8": ":"}.get(config, "-"))
        ax.set_xlabel("optimizer step (count)")
        ax.set_ylabel(f"MLM loss (nats/token, rolling mean of {window} steps)")
        ax.set_title(f"Stage-boundary compression vs loss ({int(data['stages'].iloc[0])} stages)")
        ax.legend(title="boundary", loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
    caption = f"""
**Compression at stage boundaries (M5).** Masked-LM training loss of the tiny crammed-BERT model split into
{int(data['stages'].iloc[0])} stages and trained in one process with every stage boundary compressed: `none` (fp32),
`fp16`, `blockwise8` (blockwise absmax 8-bit; activations forward and gradients backward), or narrowed by SWARM's
compression-aware layers `bottleneck<f>` / `maxout<k>` (factor in the name, no quantisation, as the paper's
published runs). Same initial weights, batches and masks; {steps} steps; rolling mean of {window} steps. The table
gives the mean loss over the last {tail} steps and its difference from `none`.
Paper (E5): perplexities not in swarm.md; qualitatively 8-bit quantisation of activations and gradients costs
essentially nothing, maxout degrades less than bottleneck at the same factor, 2x is cheap and 4x hurts more
[unverified].
"""
    return paths + _save_all(fig, out / "compression_loss", caption)


# ------------------------------------------------------------------------------------------------ sim scale

def _rebalancing_gains(data: pd.DataFrame) -> str:
    """Per preemption model: the change of % of optimum that rebalancing brings, over the swarm sizes."""
    parts = []
    for model, rows in data.groupby("preemption_model", sort=False):
        off = rows[rows["rebalance_period_s"].isna()].set_index("peers")["percent_of_optimum"]
        for period, on_rows in rows[rows["rebalance_period_s"].notna()].groupby("rebalance_period_s"):
            gain = (on_rows.set_index("peers")["percent_of_optimum"] - off).dropna()
            if len(gain):
                cells = ", ".join(f"{g:+.1f} at {int(n)}" for n, g in gain.items())
                parts.append(f"{model}, T = {period:g} s: {cells} (points at peers)")
    return "; ".join(parts) or "no run with rebalancing off and on"


def sim_scale_figure(csv: str | os.PathLike, out_dir: str | os.PathLike) -> list[Path]:
    """Simulator at scale: throughput as % of optimum vs swarm size, rebalancing off vs on, one panel per
    preemption model."""
    data = _read(csv, ("peers", "rebalance_period_s", "throughput_mb_s", "optimum_mb_s", "percent_of_optimum"))
    if "preemption_model" not in data.columns:
        data = data.assign(preemption_model="independent")
    out = Path(out_dir)
    columns = ["peers", "preemption_model", "rebalance_period_s", "throughput_mb_s", "optimum_mb_s",
               "percent_of_optimum", "static_percent", "preemptions", "joins", "moves", "retries",
               "lost_microbatches", "nic_mbit_s", "latency_ms", "events", "sim_wall_s"]
    paths = list(write_swarm_table(data[[c for c in columns if c in data.columns]], out / "sim_scale_table"))
    plot = data.assign(rebalancing=data["rebalance_period_s"].map(_period_label), peers=data["peers"].astype(str))
    models = list(dict.fromkeys(data["preemption_model"]))
    with _style():
        fig = _new_figure(3.6 * len(models) + 2.4, 4.0)
        axes = np.atleast_1d(fig.subplots(1, len(models), sharey=True))
        for ax, model in zip(axes, models):
            sns.barplot(data=plot[plot["preemption_model"] == model], x="peers", y="percent_of_optimum",
                        hue="rebalancing", ax=ax)
            for container in ax.containers:
                ax.bar_label(container, fmt="%.1f", fontsize=6, padding=2)
            ax.axhline(95.8, color="0.25", linestyle="--", linewidth=1, label="paper, T = 300 s: 95.8 % [secondary]")
            ax.axhline(82.7, color="0.55", linestyle=":", linewidth=1,
                       label="paper, no rebalancing: 82.7 % [secondary]")
            ax.set_ylim(0, 110)
            ax.set_xlabel("swarm size (peers)")
            ax.set_title(model.replace("_", " "))
            if ax is axes[-1]:
                _legend_outside(ax, "rebalancing")
            elif ax.get_legend() is not None:
                ax.get_legend().remove()
        axes[0].set_ylabel("throughput (% of optimal assignment)")
    first = data.iloc[0]
    sizes = ", ".join(map(str, sorted(data["peers"].unique())))
    network = "no network (transfers take no time)"
    if "nic_mbit_s" in data.columns and pd.notna(first["nic_mbit_s"]):
        network = (f"every peer's NIC {first['nic_mbit_s']:g} Mbit/s shared by its transfers, "
                   f"{first['latency_ms']:g} ms one-way latency, {int(first['activation_bytes']):,} bytes per transfer")
    caption = f"""
**Simulated swarms at scale (E4 shape).** Discrete-event simulation of swarms of {sizes}
peers on {int(first['stages'])} stages (random initial stage per peer, heterogeneous speeds), {network}, under
each preemption model at the same rate of preempted peers: independent (Poisson, the peer back on its own stage),
burst (several peers at once), churn random / churn most loaded (preempted peers never return; newcomers arrive
on a random / the most loaded stage). Throughput as a percentage of the optimum, the time average of the best
assignment of the live peers to stages (max over assignments of the slowest stage's summed rate). Bars:
rebalancing off vs on (one move per period at most). Change that rebalancing brings, in points of the optimum:
{_rebalancing_gains(data)}. The table adds the initial assignment's bottleneck as a percentage of the optimum
(what a swarm that never moves peers is capped at), preemptions, joins, moves, retries, lost microbatches and
simulator cost. {PAPER_E4} The paper's swarm size and preemption trace (recorded T4 preemptions) differ from
these synthetic models.
"""
    return paths + _save_all(fig, out / "sim_scale", caption)


FIGURES: dict[str, Callable[[str | os.PathLike, str | os.PathLike], list[Path]]] = {
    "square_cube": square_cube_figure,
    "wiring_throughput": wiring_figure,
    "failures_timeline": failures_figure,
    "rebalancing_recovery": rebalancing_figure,
    "compression_loss": compression_figure,
    "sim_scale": sim_scale_figure,
}


def swarm_report(study_dir: str | os.PathLike, out_dir: str | os.PathLike) -> list[Path]:
    """Tables, figures and captions for every ``<experiment>.csv`` of :data:`EXPERIMENTS` in ``study_dir``;
    returns the paths written. No CSV at all is an error."""
    study_dir = Path(study_dir)
    present = [name for name in EXPERIMENTS if (study_dir / f"{name}.csv").is_file()]
    if not present:
        raise FileNotFoundError(f"{study_dir}: none of {', '.join(f'{n}.csv' for n in EXPERIMENTS)}")
    paths: list[Path] = []
    for name in present:
        paths.extend(FIGURES[name](study_dir / f"{name}.csv", out_dir))
    return paths
