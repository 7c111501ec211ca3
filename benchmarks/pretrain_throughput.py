"""Pretraining throughput of crammed BERT vs HF ``BertForMaskedLM`` at the same shape, in one process.

One training step = forward + backward + fused AdamW step under bf16 autocast, on the CPU or a CUDA GPU
(``--device``), masked-LM on random token blocks with a fixed number of masked positions per sequence
(25 % of 128 = 32 by default). Crammed BERT decodes only the masked positions (sparse prediction); HF
decodes every position and ignores the rest through ``labels == -100``. Both models see the same inputs and
masks. Variants of crammed (``--models``):

- ``crammed-static``: ``sparse_prediction: static`` (a fixed number of decoded positions: no ``nonzero`` host
  sync, no graph break under ``--compile``), on the same batches;
- ``crammed-fed``: static sparse prediction fed the way pretraining feeds it, inside the timed step: the blocks
  taken from host memory by the pretraining loader (pinned and copied without blocking on CUDA) and masked on
  the device (:func:`cramswarm.training.mask_tokens`, fixed shapes); ``crammed-fed-prefetch``: the same with
  the loader gathering the next batch in a background thread (``pretrain.impl.prefetch``).

Step time is the fastest timed step (the median is printed too): on a shared machine other processes only
ever slow a step down. MFU is model FLOPs / (step time x peak), with the peak measured here, on the same device,
from large square bf16 matmuls of random data. On CUDA every timed region ends with a device synchronisation.
Model FLOPs per token are counted analytically (see ``flops_per_token``): 6 x the matmul parameters
each token passes through (2 forward, 4 backward), the decoder only on the positions actually decoded,
plus the attention score and value matmuls (2 x 2 x seq x hidden per layer per token forward, x3 for
forward + backward). Embedding lookups, LayerNorms, activations, softmax and the optimizer count zero.

    python benchmarks/pretrain_throughput.py                       # BERT-base shape, all five rows
    python benchmarks/pretrain_throughput.py --layers 2 --batch 4 --steps 2 --warmup 1 --json out.json
    python benchmarks/pretrain_throughput.py --device cuda --batch 128 --steps 20 --warmup 3 [--compile]
    python benchmarks/pretrain_throughput.py --quick               # a tiny shape: checks the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

# Benchmark this checkout's model, whichever checkout the editable install points at.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"
KINDS = ("crammed", "crammed-static", "crammed-fed", "crammed-fed-prefetch", "hf")
# --quick: a shape that runs in seconds on a CPU (checks the script, measures nothing worth quoting)
QUICK = dict(layers=2, hidden=128, heads=2, intermediate=512, vocab=1024, batch=4, steps=2, warmup=1, peak_size=512)


def git_commit() -> str | None:
    """This checkout's commit, with ``+dirty`` where src/ or benchmarks/ differ from it (None where it is no git
    checkout, e.g. a copied tree on a GPU machine)."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--", "src", "benchmarks"], cwd=root,
                                 capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+dirty" if changed else "")) or None


def physical_cores() -> int:
    try:
        import psutil

        count = psutil.cpu_count(logical=False)
        if count:
            return count
    except ImportError:
        pass
    return os.cpu_count() or 1


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously; the CPU needs nothing)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_peak(size: int, device: torch.device, repeats: int = 5, dtype=torch.bfloat16) -> float:
    """Best-of-``repeats`` TFLOP/s of a size^3 matmul in ``dtype`` on ``device`` (random data, never zeros)."""
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    inner = 10 if device.type == "cuda" else 1  # an 8192^3 bf16 matmul takes ~1.4 ms on an H100: time ten
    for _ in range(2):
        a @ b
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            a @ b
        synchronize(device)
        best = min(best, (time.perf_counter() - start) / inner)
    return 2 * size**3 / best / 1e12


def flops_per_token(kind: str, args: argparse.Namespace) -> float:
    """Training FLOPs per input token (forward + backward = 3 x forward, forward = 2 x MACs)."""
    h, inter, layers, vocab, seq = args.hidden, args.intermediate, args.layers, args.vocab, args.seq
    if kind.startswith("crammed"):  # fused qkv, out proj, gated FFN (h -> inter, inter/2 -> h), no head transform
        layer_params = 3 * h * h + h * h + h * inter + (inter // 2) * h
        head_params = 0
        decoded = args.masked / seq  # sparse prediction: only masked positions reach the decoder (static: as many)
    else:  # HF BERT: q, k, v, out, FFN (h -> inter -> h); head transform dense h x h; dense decoding
        layer_params = 4 * h * h + 2 * h * inter
        head_params = h * h
        decoded = 1.0
    encoder = 6 * layers * layer_params
    head = 6 * (head_params + h * vocab) * decoded
    attention = 3 * layers * 2 * 2 * seq * h
    return encoder + head + attention


def build(kind: str, args: argparse.Namespace) -> torch.nn.Module:
    if kind.startswith("crammed"):
        from cramswarm.models.crammed_bert import CrammedBertConfig, CrammedBertForMaskedLM

        config = CrammedBertConfig(
            vocab_size=args.vocab,
            num_hidden_layers=args.layers,
            hidden_size=args.hidden,
            num_attention_heads=args.heads,
            intermediate_size=args.intermediate,
            max_position_embeddings=args.seq,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            sparse_prediction=True if kind == "crammed" else "static",
            sparse_prediction_rate=args.masked / args.seq,
        )
        return CrammedBertForMaskedLM(config)
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=args.vocab,
        num_hidden_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        intermediate_size=args.intermediate,
        max_position_embeddings=max(512, args.seq),
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="sdpa",
    )
    return BertForMaskedLM(config)


def make_batches(args: argparse.Namespace, count: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(count):
        ids = torch.randint(5, args.vocab, (args.batch, args.seq), generator=generator)
        order = torch.rand(args.batch, args.seq, generator=generator).argsort(dim=1)
        selected = torch.zeros(args.batch, args.seq, dtype=torch.bool).scatter_(1, order[:, : args.masked], True)
        labels = torch.where(selected, ids, torch.full_like(ids, -100))
        inputs = torch.where(selected, torch.full_like(ids, 4), ids)  # 4 = a stand-in <mask> id
        batches.append((inputs.to(device), labels.to(device)))  # on the device before timing starts
    return batches


def feeder(kind: str, args: argparse.Namespace, device: torch.device):
    """(take, loader) for the fed variants: ``take(i)`` gives step i's (inputs, labels) the way pretraining
    makes them (the loader's micro-batch of host blocks on the device, masked there)."""
    from cramswarm.pretrain import MicroBatches
    from cramswarm.training import mask_tokens

    rows = args.batch * (args.warmup + args.steps)
    blocks = np.random.default_rng(0).integers(5, args.vocab, (rows, args.seq)).astype(np.int32)
    loader = MicroBatches(blocks, rows, args.batch, device, prefetch=kind.endswith("prefetch"))
    generator = torch.Generator(device=device).manual_seed(0)

    def take(i: int):
        block = loader.take(i * args.batch % rows)
        return mask_tokens(block, args.mask_rate, "fixed", args.vocab, generator, static=True)

    return take, loader


# Kernel families for the profile's breakdown, matched in order on the lower-cased kernel name.
KERNEL_FAMILIES = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "matmul", "wgmma", "aten::mm", "addmm", "bmm")),
    ("optimizer", ("adam", "foreach", "multi_tensor")),
    ("fused elementwise/reduction (inductor)", ("triton",)),
)


def kernel_family(name: str) -> str:
    lowered = name.lower()
    return next((family for family, keys in KERNEL_FAMILIES if any(k in lowered for k in keys)), "other")


def profile_steps(step, count: int, device: torch.device, path: str) -> dict:
    """Run ``count`` more training steps under torch.profiler; write the top kernels (self time on the device, or
    on the CPU without CUDA) to ``path`` and return the time per step by kernel family."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        for _ in range(count):
            step()
        synchronize(device)
    on_device = device.type == "cuda"
    events = prof.key_averages()

    def self_us(evt) -> float:
        if on_device:
            return getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0)
        return evt.self_cpu_time_total

    cuda = torch.autograd.DeviceType.CUDA
    kernels = [e for e in events if self_us(e) > 0 and (not on_device or e.device_type == cuda)]
    kernels.sort(key=self_us, reverse=True)
    families: dict[str, float] = {}
    for e in kernels:
        families[kernel_family(e.key)] = families.get(kernel_family(e.key), 0.0) + self_us(e) / 1e3 / count
    total = sum(families.values())
    with open(path, "w") as f:
        f.write(f"{'ms/step':>9} {'share':>6} {'calls/step':>10}  kernel (self time on {device.type})\n")
        for e in kernels[:40]:
            f.write(f"{self_us(e) / 1e3 / count:>9.3f} {self_us(e) / 1e3 / count / total:>6.1%} "
                    f"{e.count / count:>10.1f}  {e.key[:150]}\n")
    return {"ms_per_step": total, "by_family_ms": dict(sorted(families.items(), key=lambda kv: -kv[1]))}


def run(kind: str, args: argparse.Namespace, batches, device: torch.device) -> dict:
    torch.manual_seed(0)
    model = build(kind, args).to(device).train()
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    step_model = torch.compile(model, mode=args.compile_mode) if args.compile else model
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    take, loader = feeder(kind, args, device) if kind.startswith("crammed-fed") else (batches.__getitem__, None)
    times, warmup_times = [], []

    def train_step(i: int) -> torch.Tensor:
        inputs, labels = take(i)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = step_model(input_ids=inputs, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    for i in range(len(batches)):
        synchronize(device)
        start = time.perf_counter()
        loss = train_step(i)
        synchronize(device)
        elapsed = time.perf_counter() - start
        (times if i >= args.warmup else warmup_times).append(elapsed)
        if args.verbose:
            print(f"  {kind} step {i}: {elapsed:.3f} s, loss {loss.item():.3f}", flush=True)
    profiled = None
    if args.profile:
        # reuse the timed batches (the fed variants' loader holds exactly warmup + steps micro-batches)
        steps = iter(range(args.warmup, args.warmup + args.steps))
        profiled = profile_steps(lambda: train_step(next(steps)), min(3, args.steps), device,
                                 f"{args.profile}.{kind}.txt")
    # The fastest timed step: on a shared machine other processes only ever slow a step down.
    if loader is not None:
        loader.close()
    step = min(times)
    peak_memory = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    model = step_model = optimizer = train_step = None  # free the GPU memory before the next model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    tokens = args.batch * args.seq
    flops = flops_per_token(kind, args)
    achieved = flops * tokens / step / 1e12
    return {
        "model": kind,
        "parameters": params,
        "step_s_best": step,
        "step_s_median": statistics.median(times),
        "step_s_all": times,
        "warmup_s_all": warmup_times,  # the first holds torch.compile's compilation when --compile
        "tokens_per_s": tokens / step,
        "flops_per_token": flops,
        "achieved_tflops": achieved,
        "mfu": achieved / args.peak_tflops,
        "final_loss": loss.item(),
        "cuda_peak_memory_bytes": peak_memory,
        "profile": profiled,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32, help="sequences per step (config.yaml micro batch: 32)")
    parser.add_argument("--mask-rate", type=float, default=0.25)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per model")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per model before timing")
    parser.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="where to train (auto: cuda when available); the peak is measured on the same device",
    )
    parser.add_argument("--threads", type=int, default=physical_cores(), help="CPU threads; default: physical cores")
    parser.add_argument("--compile", action="store_true", help="torch.compile both models")
    parser.add_argument(
        "--compile-mode",
        default="default",
        choices=("default", "max-autotune", "reduce-overhead"),
        help="torch.compile mode with --compile (the recipe key compile_mode): reduce-overhead uses CUDA graphs",
    )
    parser.add_argument(
        "--coordinate-descent",
        action="store_true",
        help="with --compile: inductor's coordinate-descent tuning of its generated kernels' launch configs "
        "(torch._inductor.config.coordinate_descent_tuning; a longer compile, not max-autotune's GEMM search)",
    )
    parser.add_argument(
        "--peak-size",
        type=int,
        default=None,
        help="square bf16 matmul size for the peak (default: 4096 on CPU, 8192 on CUDA)",
    )
    parser.add_argument("--models", default=",".join(KINDS), help=f"comma-separated subset of {','.join(KINDS)}")
    parser.add_argument("--quick", action="store_true", help="a tiny shape, a few seconds (checks the script runs)")
    parser.add_argument(
        "--no-malloc-trim",
        action="store_true",
        help="re-run under GLIBC_TUNABLES that keep freed memory in the heap (no mmap, no trim), so big activation "
        "buffers are not page-faulted in again every step",
    )
    parser.add_argument("--json", help="write the results here")
    parser.add_argument(
        "--profile",
        metavar="PREFIX",
        help="after timing, profile 3 more steps per model: the top kernels go to PREFIX.MODEL.txt, the time per "
        "step by kernel family (matmul, attention, optimizer, inductor's fused kernels, other) to the JSON",
    )
    parser.add_argument("--verbose", action="store_true", help="print every step")
    args = parser.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    unknown = set(args.models.split(",")) - set(KINDS)
    if unknown:
        parser.error(f"--models: unknown {', '.join(sorted(unknown))}; allowed: {', '.join(KINDS)}")
    args.masked = round(args.mask_rate * args.seq)
    if args.no_malloc_trim and TUNABLES not in os.environ.get("GLIBC_TUNABLES", ""):
        env = dict(os.environ, GLIBC_TUNABLES=TUNABLES)
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *(argv or sys.argv[1:])], env)

    from cramswarm.training import resolve_device

    if args.coordinate_descent:
        import torch._inductor.config as inductor_config

        inductor_config.coordinate_descent_tuning = True

    device = resolve_device(args.device)
    if args.peak_size is None:
        args.peak_size = 8192 if device.type == "cuda" else 4096
    torch.set_num_threads(args.threads)
    args.peak_tflops = measure_matmul_peak(args.peak_size, device)
    malloc = f", GLIBC_TUNABLES={os.environ['GLIBC_TUNABLES']}" if "GLIBC_TUNABLES" in os.environ else ""
    if device.type == "cuda":
        where = f"{torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}"
    else:
        where = f"{args.threads} threads, {platform.processor() or platform.machine()}"
    print(
        f"torch {torch.__version__}, {where}{malloc}; "
        f"bf16 matmul peak ({args.peak_size}^3): {args.peak_tflops:.3f} TFLOP/s"
    )
    print(
        f"shape: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, intermediate {args.intermediate}, "
        f"vocab {args.vocab}, seq {args.seq}, batch {args.batch}, {args.masked} masked/seq, "
        f"{args.warmup} warmup + {args.steps} timed steps"
        f"{f', compiled ({args.compile_mode})' if args.compile else ''}"
        f"{', coordinate-descent tuning' if args.compile and args.coordinate_descent else ''}"
    )
    batches = make_batches(args, args.warmup + args.steps, device)
    results = [run(kind, args, batches, device) for kind in args.models.split(",")]

    by_kind = {r["model"]: r for r in results}
    header = (
        f"{'model':<20} {'params':>8} {'best s':>7} {'median s':>8} {'tokens/s':>9} {'GFLOP/tok':>9} "
        f"{'TFLOP/s':>8} {'MFU':>6} {'vs HF':>6}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        ratio = r["tokens_per_s"] / by_kind["hf"]["tokens_per_s"] if "hf" in by_kind else float("nan")
        r["ratio_vs_hf"] = ratio
        print(
            f"{r['model']:<20} {r['parameters'] / 1e6:>7.1f}M {r['step_s_best']:>7.3f} {r['step_s_median']:>8.3f} "
            f"{r['tokens_per_s']:>9.0f} "
            f"{r['flops_per_token'] / 1e9:>9.3f} {r['achieved_tflops']:>8.3f} {r['mfu']:>6.1%} {ratio:>6.2f}"
            + (f"  peak mem {r['cuda_peak_memory_bytes'] / 2**30:.1f} GiB" if r["cuda_peak_memory_bytes"] else "")
            + (f"  first step {r['warmup_s_all'][0]:.1f} s" if r["warmup_s_all"] else "")
        )
    for r in results:
        if r["profile"]:
            shares = ", ".join(f"{k} {v:.1f} ms" for k, v in r["profile"]["by_family_ms"].items())
            print(f"{r['model']} kernel time {r['profile']['ms_per_step']:.1f} ms/step: {shares}")
    report = {
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "threads": args.threads,
        "peak_tflops_bf16": args.peak_tflops,
        "shape": {
            k: getattr(args, k)
            for k in ("layers", "hidden", "heads", "intermediate", "vocab", "seq", "batch", "masked")
        },
        "compile": args.compile,
        "compile_mode": args.compile_mode if args.compile else None,
        "coordinate_descent_tuning": bool(args.compile and args.coordinate_descent),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        "steps": args.steps,
        "warmup": args.warmup,
        "results": results,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
