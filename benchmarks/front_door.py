"""The front door's timings, measured as a new user meets them: from a fresh clone of HEAD.

Measures, each with the command a user types:

- ``python -m cramswarm --help`` (median of ``--repeats`` runs; target 1 s);
- ``snakemake -n`` with ``config/paper.yaml`` and with each published-recipe overlay stacked on it (median of
  ``--repeats`` runs in the fresh clone; target 5 s);
- with ``--smoke``: the README's smoke run (``snakemake --cores 2 --configfile config/config.yaml
  config/test/tiny.yaml``; target 3 min);
- with ``--default``: the default study (``snakemake --cores 8``; target 20 min; it takes as long as the study).

Every command runs in the clone with ``PYTHONPATH`` set to the clone's ``src/``, so the code measured is the
commit's, whatever is installed. Writes one CSV row per measurement (the measured wall time, the target, whether
it was met, the job count where Snakemake planned jobs, the commit, the cores and the load average when it
started, torch's CPU capability and the precision ``precision: auto`` chose there, so that nobody reads another
CPU's number as theirs); ``python -m cramswarm docs`` renders it in the README (block ``table:front_door.csv``).
Run it on an otherwise idle machine: the load column says whether it was. ``ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2`` in its environment measures an AVX512 CPU as one without native bf16; its rows then say
so in their name and command. ``--update`` keeps the rows of an existing ``--out`` file that this run did not
measure (the rows of another ISA cap, say).

    python benchmarks/front_door.py --smoke --out results/readme/front_door.csv
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/front_door.py --smoke --default --update \
        --out results/readme/front_door.csv
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAPER_OVERLAYS = {
    "config/paper.yaml": ["config/config.yaml", "config/paper.yaml"],
    "+ recipes/cramming-v1.yaml": ["config/config.yaml", "config/paper.yaml", "config/recipes/cramming-v1.yaml"],
    "+ recipes/cramming-icml.yaml": ["config/config.yaml", "config/paper.yaml", "config/recipes/cramming-icml.yaml"],
}
SMOKE = ["--cores", "2", "--configfile", "config/config.yaml", "config/test/tiny.yaml"]
DEFAULT = ["--cores", "8"]
CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")  # the environment that caps torch's kernels below the CPU's
FIELDS = ("measurement", "command", "wall_s", "target_s", "met", "jobs", "commit", "date_utc", "cores", "load_1min",
          "cpu_capability", "auto_precision")  # fmt: skip


def timed(cmd: list[str], cwd: Path, env: dict) -> tuple[float, str]:
    """Wall seconds of one command (it must succeed) and its combined output."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return wall, proc.stdout + proc.stderr


def planned_jobs(clone: Path, env: dict, args: list[str]) -> int:
    _, out = timed(["snakemake", "-n", "--quiet", "rules", *args], clone, env)
    match = re.search(r"^total\s+(\d+)", out, re.MULTILINE)
    return int(match.group(1)) if match else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each short command (the median is kept)")
    parser.add_argument("--smoke", action="store_true", help="also time the smoke run (about 3 minutes)")
    parser.add_argument("--default", action="store_true", help="also time the default study (as long as it takes)")
    parser.add_argument("--out", help="CSV to write (e.g. results/readme/front_door.csv)")
    parser.add_argument("--runs-only", action="store_true", help="time only the runs asked for (--smoke, --default), "
                        "not the CLI help and the dry runs")
    parser.add_argument("--update", action="store_true", help="keep the rows of an existing --out file whose "
                        "measurement this run did not repeat")
    parser.add_argument("--keep", help="copy the smoke run's and the default study's results/ here (per-job benchmark "
                        "files, tables), as KEEP/smoke and KEEP/default")
    args = parser.parse_args(argv)

    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True)
    commit = commit.stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True)
    if dirty.stdout.strip():
        print("note: the working tree has uncommitted changes; the clone measures HEAD only", file=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory(prefix="front-door-") as tmp:
        clone = Path(tmp) / "clone"
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
        shared = REPO.parent / "shared"  # the offline mirror beside the project, where it exists
        if shared.is_dir() and not (clone.parent / "shared").exists():
            (clone.parent / "shared").symlink_to(shared)
        env = {**os.environ, "PYTHONPATH": str(clone / "src")}
        # what the machine is: torch's CPU capability and what precision: auto picks on it (bf16 only where native)
        probe = ("import torch; from cramswarm import precision as p; "
                 "print(p.cpu_capability(), p.choose_precision('auto', torch.device('cpu')).name)")
        _, machine = timed([sys.executable, "-c", probe], clone, env)
        capability, auto_precision = machine.split()[-2:]

        caps = [f"{key}={os.environ[key]}" for key in CAPS if os.environ.get(key)]

        def record(name: str, command: list[str], wall: float, target: float, jobs: int | None, load: float) -> None:
            if caps:
                cap = os.environ.get("ATEN_CPU_CAPABILITY", "a lower ISA").upper()
                name, command = f"{name}, kernels capped at {cap}", [*caps, *command]
            row = dict(measurement=name, command=" ".join(command), wall_s=f"{wall:.2f}", target_s=f"{target:g}",
                       met="yes" if wall <= target else "no", jobs="" if jobs is None else jobs, commit=commit,
                       date_utc=datetime.now(UTC).strftime("%Y-%m-%d"), cores=os.cpu_count(),
                       load_1min=f"{load:.1f}", cpu_capability=capability, auto_precision=auto_precision)  # fmt: skip
            rows.append(row)
            print(f"{name:<36} {wall:8.2f} s (target {target:g} s) {'' if jobs is None else f'{jobs} jobs'}")

        help_cmd = [sys.executable, "-m", "cramswarm", "--help"]
        load = os.getloadavg()[0]
        walls = [timed(help_cmd, clone, env)[0] for _ in range(0 if args.runs_only else args.repeats)]
        if walls:
            record("CLI help", ["python", "-m", "cramswarm", "--help"], statistics.median(walls), 1, None, load)
        for name, files in {} if args.runs_only else PAPER_OVERLAYS.items():
            cmd = ["snakemake", "-n", "--configfile", *files]
            load = os.getloadavg()[0]
            walls = [timed(cmd, clone, env)[0] for _ in range(args.repeats)]
            record(f"dry run, {name}", cmd, statistics.median(walls), 5, planned_jobs(clone, env, cmd[2:]), load)
        for flag, name, run_args, target in ((args.smoke, "smoke run", SMOKE, 180),
                                             (args.default, "default study", DEFAULT, 1200)):  # fmt: skip
            if not flag:
                continue
            shutil.rmtree(clone / "results", ignore_errors=True)
            subprocess.run(["git", "checkout", "-q", "--", "results"], cwd=clone, check=False)  # committed files back
            jobs = planned_jobs(clone, env, run_args)
            load = os.getloadavg()[0]
            wall, _ = timed(["snakemake", *run_args], clone, env)
            record(name, ["snakemake", *run_args], wall, target, jobs, load)
            if args.keep:
                kept = Path(args.keep) / name.split()[0]
                shutil.rmtree(kept, ignore_errors=True)
                shutil.copytree(clone / "results", kept, symlinks=True)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        if args.update and out.is_file():
            with out.open(newline="") as handle:
                measured = {row["measurement"] for row in rows}
                rows = [row for row in csv.DictReader(handle) if row["measurement"] not in measured] + rows
        tmp_out = out.with_name(out.name + ".tmp")
        with tmp_out.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=FIELDS)
            writer.writeheader()
            writer.writerows(rows)
        tmp_out.replace(out)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
