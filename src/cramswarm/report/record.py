"""The study record shown at the top of ``snakemake --report``: the config used, the software versions and
a summary of every job's ``benchmark:`` file (wall time, CPU time, peak memory per rule).

Snakemake writes one benchmark TSV per job (``results/benchmarks/<rule>/<wildcards>.tsv``, columns ``s``,
``max_rss`` in MB, ``cpu_time`` in seconds, ...). :func:`benchmark_table` sums them per rule;
:func:`plot_rule_times` draws where the study's time went.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import pandas as pd
import seaborn as sns
import yaml

from cramswarm.provenance import git_commit, hardware, package_versions
from cramswarm.report.figures import _new_figure, _save, _style
from cramswarm.report.tables import atomic_write, write_table

BENCHMARK_COLUMNS = ("s", "max_rss", "cpu_time")
RULE_TABLE_COLUMNS = ("rule", "jobs", "wall_s_total", "wall_s_mean", "wall_s_max", "cpu_s_total", "max_rss_mb")


def write_config(config: dict, path: str | os.PathLike) -> Path:
    """The validated config (defaults filled in), as YAML with keys in config order."""
    text = "# The config this study ran with (config/*.yaml overlays merged, schema defaults filled in).\n"
    text += yaml.safe_dump(config, sort_keys=False, default_flow_style=None, width=110)
    return atomic_write(path, lambda tmp: tmp.write_text(text))


def software_table() -> pd.DataFrame:
    """One row per package the study depends on (version, or ``not installed``), plus Python, platform, CPU
    and the git commit of the checkout."""
    rows = [{"component": name, "version": version or "not installed"} for name, version in package_versions().items()]
    machine = hardware()
    rows += [
        {"component": "python", "version": sys.version.split()[0]},
        {"component": "platform", "version": platform.platform()},
        {"component": "cpu", "version": f"{machine['cpu']} ({machine['cpu_count']} logical cores)"},
        {"component": "git commit", "version": git_commit() or "not a git checkout"},
    ]
    return pd.DataFrame(rows)


def read_benchmarks(folder: str | os.PathLike) -> pd.DataFrame:
    """Every benchmark TSV under ``folder``: columns ``rule`` (the first folder below ``folder``), ``job``
    (the rest of the path) and :data:`BENCHMARK_COLUMNS`. A file missing those columns raises ValueError
    naming it. Snakemake writes ``NA`` for values it could not measure; those stay NaN."""
    folder = Path(folder)
    frames = []
    for path in sorted(folder.rglob("*.tsv")):
        frame = pd.read_csv(path, sep="\t", na_values=["NA", "-"])
        missing = [c for c in BENCHMARK_COLUMNS if c not in frame.columns]
        if missing:
            raise ValueError(f"benchmark file {path}: missing column(s) {', '.join(missing)}")
        relative = path.relative_to(folder)
        frame = frame[list(BENCHMARK_COLUMNS)].assign(rule=relative.parts[0], job=str(relative.with_suffix("")))
        frames.append(frame)
    if not frames:
        return pd.DataFrame(columns=["rule", "job", *BENCHMARK_COLUMNS])
    return pd.concat(frames, ignore_index=True)


def benchmark_table(benchmarks: pd.DataFrame) -> pd.DataFrame:
    """Per rule: jobs, total / mean / max wall seconds, total CPU seconds and the largest peak RSS (MB),
    sorted by total wall time (largest first)."""
    if benchmarks.empty:
        return pd.DataFrame(columns=list(RULE_TABLE_COLUMNS))
    groups = benchmarks.groupby("rule")
    table = pd.DataFrame({
        "jobs": groups.size(),
        "wall_s_total": groups["s"].sum(),
        "wall_s_mean": groups["s"].mean(),
        "wall_s_max": groups["s"].max(),
        "cpu_s_total": groups["cpu_time"].sum(min_count=1),
        "max_rss_mb": groups["max_rss"].max(),
    })
    return table.reset_index().sort_values("wall_s_total", ascending=False, ignore_index=True)


def plot_rule_times(table: pd.DataFrame, out_png: str | os.PathLike) -> Path:
    """Horizontal bars: total wall seconds per rule (summed over its jobs), jobs counted in the labels."""
    if table.empty:
        raise ValueError("plot_rule_times: no benchmark files to summarise")
    data = table.assign(label=table["rule"] + " (" + table["jobs"].astype(str) + " jobs)")
    with _style():
        fig = _new_figure(7, 0.9 + 0.32 * len(data))
        ax = fig.subplots()
        sns.barplot(data=data, y="label", x="wall_s_total", color=sns.color_palette()[0], ax=ax)
        ax.set_xlabel("wall time summed over the rule's jobs (seconds)")
        ax.set_ylabel("rule (jobs)")
        ax.set_title("Where the study's time went (Snakemake benchmark files)")
    total = float(table["wall_s_total"].sum())
    top = table.iloc[0]
    caption = (
        f"Wall time per rule, summed over its jobs, from the benchmark files of {int(table['jobs'].sum())} job(s) "
        f"({total:,.0f} s of job time in all; jobs run in parallel, so the study's elapsed time is shorter). "
        f"The largest share is {top['rule']} ({top['wall_s_total']:,.0f} s over {int(top['jobs'])} job(s), "
        f"{100 * top['wall_s_total'] / total:.0f} %). Peak memory per rule is in the benchmark table."
    )
    return _save(fig, out_png, caption)


def shrink_png(src: str | os.PathLike, dst: str | os.PathLike, max_width_px: int = 900) -> Path:
    """A copy of the PNG ``src`` at most ``max_width_px`` wide (aspect kept, optimised), for the README."""
    from PIL import Image

    with Image.open(src) as image:
        if image.width > max_width_px:
            image = image.resize((max_width_px, round(image.height * max_width_px / image.width)), Image.LANCZOS)
        return atomic_write(dst, lambda tmp: image.save(tmp, format="png", optimize=True))


def write_record(config: dict, benchmarks_dir: str | os.PathLike, out_dir: str | os.PathLike) -> dict[str, Path]:
    """config.yaml, software.{csv,md}, benchmarks.{csv,md} and rule_times.{png,pdf,caption.rst} in ``out_dir``."""
    out = Path(out_dir)
    table = benchmark_table(read_benchmarks(benchmarks_dir))
    return {
        "config": write_config(config, out / "config.yaml"),
        "software": write_table(software_table(), out / "software")[0],
        "benchmarks": write_table(table, out / "benchmarks")[0],
        "rule_times": plot_rule_times(table, out / "rule_times.png"),
    }
