"""GLUE fine-tuning throughput (examples/s) per task, with and without dynamic padding, side by side.

For each task the same checkpoint is fine-tuned for ``--steps`` optimizer steps twice in one process:
``dynamic``, the workflow's batching (length-bucketed batches padded to their longest example, see
``cramswarm.glue.finetune.bucketed_batches``), and ``padded``, shuffled batches padded to ``--max-length``
tokens (what a fixed-shape collator does). Both use bf16 autocast, AdamW and the task's own head, on the CPU
or a CUDA GPU (``--device``). The reported number is training examples per second over the timed steps (after
``--warmup`` steps; on CUDA the clock is read after a device synchronisation).

    python benchmarks/finetune_throughput.py --checkpoint results/pretrain/synthetic/crammed/v2048 \\
        --glue-dir results/data/synthetic/glue
    python benchmarks/finetune_throughput.py ... --tasks rte mnli --steps 30 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers.utils import logging as hf_logging

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # this checkout's package

from cramswarm.data.sources import read_glue  # noqa: E402
from cramswarm.glue.finetune import attention_backends, bucketed_batches, collate, encode, load_model  # noqa: E402
from cramswarm.glue_tasks import TASK_NAMES, get_task  # noqa: E402
from cramswarm.precision import autocast  # noqa: E402
from cramswarm.training import resolve_device  # noqa: E402


def padded_batches(n: int, batch_size: int, rng: np.random.Generator) -> list[np.ndarray]:
    order = rng.permutation(n)
    return [order[i : i + batch_size] for i in range(0, n, batch_size)]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(model, batches, ids, labels, width, warmup: int, device: torch.device) -> tuple[float, float]:
    """Examples/s over the timed batches, and the share of real (non-pad) tokens in them."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model.train()
    examples, real, total, start = 0, 0, 0, None
    for step, index in enumerate(batches):
        if step == warmup:
            synchronize(device)
            start = time.perf_counter()
        input_ids, mask = collate(ids, index, width)
        with autocast("bf16", device), attention_backends(device):
            loss = model(input_ids.to(device), attention_mask=mask.to(device), labels=labels[index].to(device)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= warmup:
            examples += len(index)
            real, total = real + int(mask.sum()), total + mask.numel()
    synchronize(device)
    return examples / (time.perf_counter() - start), real / total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="a checkpoint folder (model + tokenizer)")
    parser.add_argument("--glue-dir", required=True, help="folder with <task>.parquet files (the glue_data rule)")
    parser.add_argument("--tasks", nargs="*", default=list(TASK_NAMES))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps per task and mode")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--max-length", type=int, default=128, help="tokens; the padded mode pads to this")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: cuda when available")
    parser.add_argument("--json", help="also write the numbers here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    hf_logging.set_verbosity_error()  # the fresh classification head's load report, once per task
    hf_logging.disable_progress_bar()

    rows_out = []
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{args.threads} thread(s)"
    print(f"torch {torch.__version__}, {where}, batch {args.batch}, {args.steps} timed steps")
    print(f"{'task':6} {'mean len':>8} {'dyn ex/s':>9} {'pad ex/s':>9} {'speedup':>8} {'dyn real-token share':>21}")
    for task in args.tasks:
        spec = get_task(task)
        rows = read_glue(Path(args.glue_dir) / f"{task}.parquet", "train")
        torch.manual_seed(0)
        model, tok = load_model(args.checkpoint, task, dropout=0.1)
        model.to(device)
        ids = encode(tok, task, rows, args.max_length)
        dtype = torch.float32 if spec.is_regression else torch.long
        labels = torch.tensor([row["label"] for row in rows], dtype=dtype)
        lengths = np.array([len(x) for x in ids])
        n = args.warmup + args.steps
        rng = np.random.default_rng(0)
        dynamic = (bucketed_batches(lengths, args.batch, rng) * n)[:n]
        padded = (padded_batches(len(ids), args.batch, rng) * n)[:n]
        dyn_rate, dyn_real = run(model, dynamic, ids, labels, None, args.warmup, device)
        pad_rate, _ = run(model, padded, ids, labels, args.max_length, args.warmup, device)
        rows_out.append(
            dict(
                task=task,
                mean_tokens=float(lengths.mean()),
                dynamic_examples_per_s=dyn_rate,
                padded_examples_per_s=pad_rate,
                speedup=dyn_rate / pad_rate,
                dynamic_real_share=dyn_real,
            )
        )
        print(
            f"{task:6} {lengths.mean():8.1f} {dyn_rate:9.1f} {pad_rate:9.1f} "
            f"{dyn_rate / pad_rate:7.2f}x {dyn_real:21.2f}"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "torch": torch.__version__, "device": where, "tasks": rows_out}, indent=2)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
