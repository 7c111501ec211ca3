"""bf16 against fp32 on this CPU, side by side in one run: what ``precision: auto`` decides from.

Measures, for fp32 and for bf16 autocast, in one process each time:

- a square matmul (``--size``, default 1024) on one thread: GFLOP/s, best of ``--repeats``;
- crammed-BERT pretraining steps at the default study's shape (config/config.yaml: 2 x 256, vocab 2048,
  micro-batch 32 x 128, fixed 25 % masking, AdamW): tokens/s, the fastest of ``--steps`` steps after two warm-up
  steps, with as many torch threads as ``--threads`` (default 1, as every workflow job runs).

Each row names the CPU, torch's capability (``torch.backends.cpu.get_cpu_capability()``), the native bf16
features torch reports, and what ``precision: auto`` chose here and why; ``vs_fp32`` is the row's rate over the
fp32 row's. ``--also-avx2`` repeats every measurement in a child process with torch's and oneDNN's kernels
capped at AVX2 (``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``), which is how an AVX512 CPU shows what a
CPU without native bf16 does, in the same run. ``--out`` writes the CSV that docs/benchmarks.md renders
(``python -m cramswarm docs``); ``--record`` appends the run's ratios to the measured history
(``results/readme/history/benchmarks.csv``, page ``docs/history/benchmarks.md``):

    python benchmarks/precision.py --also-avx2 --out results/readme/precision_cpu.csv --record
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402

from cramswarm import precision as prec  # noqa: E402
from cramswarm.config import load_config, model_recipe  # noqa: E402
from cramswarm.io import atomic_path  # noqa: E402
from cramswarm.provenance import hardware  # noqa: E402
from cramswarm.training import build_model, make_optimizer, mask_tokens  # noqa: E402

FIELDS = ("cpu", "capability", "native_bf16", "auto_chooses", "measure", "precision", "rate", "unit", "vs_fp32",
          "threads", "commit", "date_utc")  # fmt: skip
AVX2_CAP = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def matmul_gflops(size: int, dtype: torch.dtype, repeats: int) -> float:
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def pretrain_tokens_per_s(precision: str, steps: int) -> float:
    """Fastest of ``steps`` crammed-BERT training steps (forward, backward, clip, AdamW) at the default shape."""
    config = load_config([REPO / "config" / "config.yaml"])
    arch, recipe = config["models"]["crammed"]["arch"], {**model_recipe(config, "crammed"), "precision": precision}
    vocab, micro, seq = 2048, recipe["micro_batch_sequences"], config["packing"]["block_tokens"]
    model = build_model(arch, vocab, seed=0)
    optimizer = make_optimizer(model, recipe)
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(5, vocab, (micro, seq), generator=generator)
    cpu = torch.device("cpu")
    best = float("inf")
    for step in range(steps + 2):
        inputs, labels = mask_tokens(blocks, recipe["mask_rate"], recipe["mask_mode"], vocab, generator)
        start = time.perf_counter()
        with prec.autocast(precision, cpu):
            loss = model(input_ids=inputs, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe["grad_clip_norm"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= 2:
            best = min(best, time.perf_counter() - start)
    return micro * seq / best


def measure(args: argparse.Namespace) -> list[dict]:
    """This process's rows: both precisions, both measurements."""
    chosen = prec.choose_precision("auto", torch.device("cpu"))
    flags = prec.native_bf16_flags()
    common = dict(cpu=hardware()["cpu"], capability=prec.cpu_capability(), native_bf16="+".join(flags) or "none",
                  auto_chooses=f"{chosen.name} ({chosen.reason.removeprefix('auto: ')})")  # fmt: skip
    rows = []
    for measure_name, unit, threads, rate in (
        ("matmul", "GFLOP/s", 1, lambda p: matmul_gflops(args.size, torch.bfloat16 if p == "bf16" else torch.float32,
                                                         args.repeats)),
        ("crammed pretraining", "tokens/s", args.threads, lambda p: pretrain_tokens_per_s(p, args.steps)),
    ):  # fmt: skip
        torch.set_num_threads(threads)
        rates = {p: rate(p) for p in ("fp32", "bf16")}
        for p, value in rates.items():
            rows.append(dict(common, measure=f"{measure_name} ({args.size}^3)" if measure_name == "matmul"
                             else measure_name, precision=p, rate=f"{value:.1f}", unit=unit,
                             vs_fp32=f"{value / rates['fp32']:.3g}", threads=threads))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=1024, help="square matmul size")
    parser.add_argument("--repeats", type=int, default=3, help="timed matmuls per precision (best kept)")
    parser.add_argument("--steps", type=int, default=3, help="timed training steps per precision (fastest kept)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the training steps")
    parser.add_argument("--also-avx2", action="store_true", help="repeat with kernels capped at AVX2 (child process)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON (what the child hands back)")
    parser.add_argument("--out", help="CSV to write (e.g. results/readme/precision_cpu.csv)")
    parser.add_argument("--record", action="store_true", help="append the run to the measured history "
                        "(results/readme/history/benchmarks.csv) and redraw docs/history/benchmarks.md")
    args = parser.parse_args(argv)

    rows = measure(args)
    if args.also_avx2:
        child = [sys.executable, __file__, "--json", "--size", str(args.size), "--repeats", str(args.repeats),
                 "--steps", str(args.steps), "--threads", str(args.threads)]  # fmt: skip
        out = subprocess.run(child, env={**os.environ, **AVX2_CAP}, capture_output=True, text=True, check=True)
        capped = json.loads(out.stdout.splitlines()[-1])
        for row in capped:
            row["capability"] += " (capped)"
        rows += capped
    if args.json:
        print(json.dumps(rows))
        return 0
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True)
    for row in rows:
        row.update(commit=commit.stdout.strip(), date_utc=datetime.now(UTC).strftime("%Y-%m-%d"))
        print(f"{row['capability']:<16} {row['measure']:<22} {row['precision']:<5} {float(row['rate']):>10.1f} "
              f"{row['unit']:<9} {float(row['vs_fp32']):6.3g}x fp32   auto: {row['auto_chooses']}")
    if args.out:
        with atomic_path(args.out) as tmp, tmp.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=FIELDS)
            writer.writeheader()
            writer.writerows(rows)
        print(f"wrote {args.out}")
    if args.record:
        record(rows, argv)
    return 0


def record(rows: list[dict], argv: list[str] | None) -> None:
    """Append this run to the benchmarks history: bf16 / fp32 per capability and measure."""
    from cramswarm.report.docs import record_measurement

    parts = []
    for capability in dict.fromkeys(row["capability"] for row in rows):
        mine = [row for row in rows if row["capability"] == capability and row["precision"] == "bf16"]
        ratios = ", ".join(f"{row['measure']} {float(row['vs_fp32']):.3g}×" for row in mine)
        parts.append(f"{capability}: {ratios} (`precision: auto` chooses {mine[0]['auto_chooses'].split()[0]})")
    args = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--record"]
    command = shlex.join(["python", "benchmarks/precision.py", *args])
    row = record_measurement("benchmarks", "fp32 vs bf16 autocast: a matmul and crammed pretraining steps", command,
                             "bf16 / fp32 on " + "; ".join(parts) + ".", section="Precision on the CPU", repo=REPO)
    print(f"recorded in results/readme/history/benchmarks.csv ({row['date']}, {row['commit']})")


if __name__ == "__main__":
    raise SystemExit(main())
