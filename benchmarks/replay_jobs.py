"""Run a Snakemake plan on a machine without Snakemake: the jobs of a dry run, replayed in dependency order.

A lent GPU machine has torch and this package's dependencies but not Snakemake (nor the hub mirror). There the
workflow's jobs are run from a plan exported here, where Snakemake and the data are:

    # here: build what needs the mirror, then export the rest of the plan (jobs whose outputs are missing)
    python benchmarks/replay_jobs.py export --out jobs.json -- pretraining_gap --configfile ... config/realtext_gpu.yaml
    # on the GPU machine, in a copy of this tree with the prepared inputs carried along
    python benchmarks/replay_jobs.py run jobs.json --slots 12 --deadline-s 480

Each job is a rule's shell command exactly as Snakemake would run it (`snakemake -n -p`), so the outputs are the
workflow's own, and `snakemake` here accepts them afterwards (their inputs are older). `run` starts a job once
every job writing one of its inputs has succeeded, at most ``--slots`` at a time, longest rules first
(pretraining, then fine-tuning); a failed job fails its dependants; nothing starts after the deadline and jobs
still running then are stopped. It writes a JSON record (per job: rule, command, exit status, seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

RULE_ORDER = {"pretrain": 0, "init_model": 1, "finetune": 2}  # which ready job starts first (default: after these)


def parse_dry_run(text: str) -> list[dict]:
    """The jobs of ``snakemake -n -p`` output: rule, inputs, outputs, log and shell command of each."""
    jobs, job = [], None
    for line in text.splitlines():
        if m := re.match(r"^(?:local)?rule (\w+):$", line):
            job = {"rule": m.group(1), "input": [], "output": [], "log": [], "command": None}
            jobs.append(job)
        elif job is not None and (m := re.match(r"^    (input|output|log): (.*)$", line)):
            job[m.group(1)] = [p.strip() for p in m.group(2).split(", ") if p.strip()]
        elif job is not None and line.startswith("Shell command: "):
            job["command"] = line.removeprefix("Shell command: ")
    return [j for j in jobs if j["command"] not in (None, "None")]  # target rules (no shell command) are left out


def export(args) -> int:
    cmd = ["snakemake", "-n", "-p", *args.snakemake]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        return proc.returncode
    jobs = parse_dry_run(proc.stdout + proc.stderr)
    Path(args.out).write_text(json.dumps({"snakemake": cmd, "jobs": jobs}, indent=1) + "\n")
    counts = {}
    for job in jobs:
        counts[job["rule"]] = counts.get(job["rule"], 0) + 1
    print(f"{len(jobs)} jobs -> {args.out}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return 0


def run(args) -> int:
    plan = json.loads(Path(args.plan).read_text())
    jobs = plan["jobs"]
    writer = {out: i for i, job in enumerate(jobs) for out in job["output"]}
    needs = [{writer[p] for p in job["input"] if p in writer} for job in jobs]
    state = ["waiting"] * len(jobs)
    record = [{"rule": j["rule"], "output": j["output"][0], "command": j["command"]} for j in jobs]
    running: dict[int, tuple[subprocess.Popen, float]] = {}
    start = time.monotonic()

    def launch(i: int) -> None:
        for path in jobs[i]["output"] + jobs[i]["log"]:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(["bash", "-c", jobs[i]["command"]], start_new_session=True)
        running[i] = (proc, time.monotonic())
        state[i] = "running"
        print(f"[{time.monotonic() - start:6.0f} s] start {jobs[i]['rule']} -> {jobs[i]['output'][0]}", flush=True)

    while True:
        for i, (proc, t0) in list(running.items()):
            if proc.poll() is not None:
                del running[i]
                ok = proc.returncode == 0 and all(Path(p).exists() for p in jobs[i]["output"])
                state[i] = "done" if ok else "failed"
                record[i].update(returncode=proc.returncode, seconds=round(time.monotonic() - t0, 1))
                print(f"[{time.monotonic() - start:6.0f} s] {state[i]} {jobs[i]['rule']} -> {jobs[i]['output'][0]} "
                      f"({record[i]['seconds']} s)", flush=True)
        for i, s in enumerate(state):
            if s == "waiting" and any(state[d] in ("failed", "skipped") for d in needs[i]):
                state[i] = "skipped"
        late = time.monotonic() - start > args.deadline_s
        ready = [i for i, s in enumerate(state) if s == "waiting" and all(state[d] == "done" for d in needs[i])]
        ready.sort(key=lambda i: (RULE_ORDER.get(jobs[i]["rule"], 9), i))
        while ready and len(running) < args.slots and not late:
            launch(ready.pop(0))
        if late:
            for proc, _ in running.values():
                # SIGTERM, as Snakemake stops its jobs (the swarm launcher passes it on to its processes); not SIGINT,
                # which a shell started with `nohup ... &` has its children ignore. Pretraining's resumable state is
                # the one it saved last (pretrain.impl.resume_every_seconds).
                os.killpg(proc.pid, signal.SIGTERM)
            for i, (proc, _) in list(running.items()):
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                state[i] = "stopped"
                record[i].update(returncode=proc.returncode, seconds=None)
            running.clear()
        if not running and (late or not any(s == "waiting" and all(state[d] == "done" for d in needs[i])
                                            for i, s in enumerate(state))):
            break
        time.sleep(0.5)
    for i, s in enumerate(state):
        record[i]["state"] = "not started" if s == "waiting" else s
    summary = {s: state.count(s) for s in sorted(set(state))}
    print(f"[{time.monotonic() - start:6.0f} s] finished: {summary}", flush=True)
    if args.record:
        Path(args.record).write_text(json.dumps({"wall_s": round(time.monotonic() - start, 1), "slots": args.slots,
                                                 "states": summary, "jobs": record}, indent=1) + "\n")
    return 0 if set(state) == {"done"} else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    ex = sub.add_parser("export", help="write the jobs of a dry run (snakemake -n -p) as JSON")
    ex.add_argument("--out", required=True, help="JSON file to write")
    ex.add_argument("snakemake", nargs=argparse.REMAINDER, help="snakemake arguments (after --)")
    rn = sub.add_parser("run", help="run an exported plan's jobs in dependency order")
    rn.add_argument("plan", help="JSON written by export")
    rn.add_argument("--slots", type=int, default=4, help="jobs at a time")
    rn.add_argument("--deadline-s", type=float, default=float("inf"), help="start nothing after this many seconds")
    rn.add_argument("--record", help="JSON file for each job's state, exit status and seconds")
    args = parser.parse_args(argv)
    if args.mode == "export":
        args.snakemake = args.snakemake[1:] if args.snakemake[:1] == ["--"] else args.snakemake
        return export(args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
