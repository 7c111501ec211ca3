"""One CSV row per model and run from ``pretrain_throughput.py --json`` files, for the docs' generated tables.

    python benchmarks/throughput_table.py results/readme/pretrain_gpu/*.json --out results/readme/pretrain_gpu.csv
    python benchmarks/throughput_table.py RUN.json ... --profile-out results/readme/pretrain_gpu_kernels.csv

Rows are grouped by device, shape, micro-batch and compile mode (eager first). Columns: device, layers x hidden,
micro-batch, compile mode (``+coordinate-descent`` for ``--coordinate-descent`` runs), model, fastest and median
step, tokens/s, MFU, tokens/s against HF in the same run, peak GPU memory, the first step (compilation
included), the bf16 matmul peak measured in the same run, and the commit (``--commit`` fills it where a JSON names
none: runs on a copied tree without git). The rest of each run (vocab, sequence length, torch version, date,
every step) stays in its JSON.
With ``--profile-out``, the runs made with ``--profile`` also give one row per model and kernel family (ms/step).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import tempfile
from pathlib import Path

MODES = ("eager", "default", "default+coordinate-descent", "reduce-overhead", "max-autotune")


def compile_label(report: dict) -> str:
    mode = report.get("compile_mode") or ("default" if report.get("compile") else "eager")
    return mode + ("+coordinate-descent" if report.get("coordinate_descent_tuning") else "")


def table_order(row: dict) -> tuple:
    """Rows grouped by shape, micro-batch and mode (a run's rows stay together, in their run's order)."""
    mode = MODES.index(row["compile"]) if row["compile"] in MODES else len(MODES)
    return row["device"], row.get("shape", ""), int(row["micro_batch"]), mode


def rows(report: dict, commit: str | None) -> list[dict]:
    shape = report["shape"]
    mode = compile_label(report)
    out = []
    for r in report["results"]:
        memory = r.get("cuda_peak_memory_bytes")
        warmup = r.get("warmup_s_all") or []
        out.append({
            "device": report["device"],
            "shape": f"{shape['layers']}x{shape['hidden']}",
            "micro_batch": shape["batch"],
            "compile": mode,
            "model": r["model"],
            "step_ms_best": f"{r['step_s_best'] * 1e3:.1f}",
            "step_ms_median": f"{r['step_s_median'] * 1e3:.1f}",
            "tokens_per_s": f"{r['tokens_per_s']:.0f}",
            "mfu_percent": f"{r['mfu'] * 100:.1f}",
            "vs_hf": "" if r.get("ratio_vs_hf") is None or r["ratio_vs_hf"] != r["ratio_vs_hf"] else
            f"{r['ratio_vs_hf']:.2f}",
            "peak_memory_gib": "" if memory is None else f"{memory / 2**30:.1f}",
            "first_step_s": f"{warmup[0]:.1f}" if warmup else "",
            "peak_tflops": f"{report['peak_tflops_bf16']:.1f}",
            "commit": report.get("commit") or commit or "",
        })
    return out


def profile_rows(report: dict) -> list[dict]:
    out = []
    for r in report["results"]:
        profile = r.get("profile")
        if not profile:
            continue
        for family, ms in profile["by_family_ms"].items():
            out.append({
                "device": report["device"],
                "micro_batch": report["shape"]["batch"],
                "compile": compile_label(report),
                "model": r["model"],
                "kernel_family": family,
                "ms_per_step": f"{ms:.1f}",
                "share_percent": f"{100 * ms / profile['ms_per_step']:.1f}",
                "commit": report.get("commit") or "",
            })
    return out


def write_csv(path: str, table: list[dict]) -> None:
    """Write atomically: a temporary file beside the target, then a rename."""
    if not table:
        raise SystemExit(f"{path}: no rows to write")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    with os.fdopen(fd, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    os.replace(tmp, target)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", nargs="+", help="pretrain_throughput.py --json files")
    parser.add_argument("--out", help="the throughput CSV")
    parser.add_argument("--profile-out", help="the kernel-family CSV (runs made with --profile)")
    parser.add_argument("--commit", help="the commit of runs whose JSON names none")
    args = parser.parse_args(argv)
    reports = [json.loads(Path(p).read_text()) for p in sorted(args.json)]  # one order whatever the shell gives
    if args.out:
        write_csv(args.out, sorted((row for report in reports for row in rows(report, args.commit)), key=table_order))
    if args.profile_out:
        profiled = (row for report in reports for row in profile_rows(report))
        write_csv(args.profile_out, sorted(profiled, key=table_order))


if __name__ == "__main__":
    main()
