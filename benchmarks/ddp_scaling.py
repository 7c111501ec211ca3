"""Data-parallel scaling on the CPU: 1 vs 2 gloo processes training the same tiny crammed BERT, side by side.

Each measurement is a real ``python -m cramswarm pretrain`` run (2 processes: the command relaunches itself
through torchrun) on the same synthetic packed blocks, at the same global batch and token budget, one torch thread
per process. Throughput is the run's own ``tokens_per_s`` (tokens trained / seconds of its training loop, from
summary.json). The two settings alternate ``--repeats`` times and the fastest run of each is kept (on a shared
machine other processes only slow a run down); the ratio 2-process / 1-process tokens/s is printed. On 2 cores
the ideal is 2.0; gradient all-reduce over gloo, the duplicated masking and the process start-up eat into it.

    python benchmarks/ddp_scaling.py                        # ~1-2 minutes on 2 cores
    python benchmarks/ddp_scaling.py --repeats 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
# Benchmark this checkout's code, whichever checkout the editable install points at (here and in the runs).
sys.path.insert(0, str(REPO / "src"))


def synthetic_data(folder: Path, vocab: int, block_tokens: int, documents: int, seed: int = 0) -> tuple[Path, Path]:
    """A WordPiece tokenizer and packed blocks of a corpus with learnable structure (word pairs)."""
    from cramswarm.data import tokenizer as tokenization

    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(200)]
    docs = [" ".join(rng.choice(words[:100]) + " " + words[100 + i % 100] for i in range(40)) for _ in range(documents)]
    tok = tokenization.train_wordpiece([docs], vocab, min_frequency=1)
    tok_path = folder / "tokenizer.json"
    tok.save(str(tok_path))
    ids = [i for d in tok.encode_batch(docs, add_special_tokens=False) for i in d.ids + [tokenization.SEP_ID]]
    usable = len(ids) // block_tokens * block_tokens
    blocks = np.array(ids[:usable], dtype=np.uint16).reshape(-1, block_tokens)
    np.save(folder / "blocks.npy", blocks)
    return tok_path, folder / "blocks.npy"


def run(processes: int, args, recipe: dict, arch: dict, tok_path: Path, blocks: Path, out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    impl = {"device": "cpu", "log_every_steps": 10, "devices": processes}
    command = [sys.executable, "-m", "cramswarm", "pretrain", "--recipe", json.dumps(recipe),
               "--impl", json.dumps(impl), "--arch", json.dumps(arch), "--blocks", str(blocks),
               "--tokenizer", str(tok_path), "--out-dir", str(out), "--threads", "1", "--quiet"]  # fmt: skip
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{processes}-process run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads((out / "summary.json").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64, help="tokens per block")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--micro", type=int, default=32, help="micro-batch sequences (split over the processes)")
    parser.add_argument("--batch", type=int, default=64, help="sequences per optimizer step")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run (a token budget)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each setting, alternating; the best is kept")
    parser.add_argument("--json", help="also write every number here")
    args = parser.parse_args()

    import torch.distributed as dist

    from cramswarm.config import load_config
    from cramswarm.impl import computed

    if not (dist.is_available() and dist.is_gloo_available()):
        raise SystemExit("torch.distributed with gloo is unavailable")
    cfg = load_config([REPO / "config" / "config.yaml"])
    shape = dict(layers=args.layers, hidden_size=args.hidden, heads=args.heads, intermediate_size=4 * args.hidden,
                 max_positions=args.seq)  # fmt: skip
    arch = cfg["models"]["crammed"]["arch"] | shape
    tokens = args.steps * args.batch * args.seq
    # what the runs compute (how they run: run()'s --impl)
    recipe = computed(cfg["pretrain"]) | dict(budget={"unit": "tokens", "value": tokens},
                                              micro_batch_sequences=args.micro, batch_sequences=args.batch,
                                              precision="bf16", eval_blocks=0, warmup_fraction=0.0)
    results: dict[int, list[dict]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory(prefix="ddp-scaling-") as tmp:
        folder = Path(tmp)
        tok_path, blocks = synthetic_data(folder, args.vocab, args.seq, documents=600)
        for repeat in range(args.repeats):
            for processes in (1, 2):
                summary = run(processes, args, recipe, arch, tok_path, blocks, folder / f"p{processes}-{repeat}")
                results[processes].append(summary)
                rate, steps, loss = summary["tokens_per_s"], summary["steps"], summary["final_loss"]
                print(f"run {repeat + 1}/{args.repeats}, {processes} process(es): {rate:,.0f} tokens/s "
                      f"({steps} steps, final loss {loss})", flush=True)  # fmt: skip
    best = {p: max(s["tokens_per_s"] for s in runs) for p, runs in results.items()}
    ratio = best[2] / best[1]
    cpu = platform.processor() or platform.machine()
    print(f"\nshape: {args.layers} x {args.hidden}, seq {args.seq}, vocab {args.vocab}, micro {args.micro}, "
          f"batch {args.batch}, {args.steps} steps; {os.cpu_count()} CPUs ({cpu})")  # fmt: skip
    print(f"1 process : {best[1]:,.0f} tokens/s (best of {args.repeats})")
    print(f"2 processes: {best[2]:,.0f} tokens/s (best of {args.repeats})")
    print(f"ratio 2 / 1: {ratio:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "tokens_per_s": best, "ratio": ratio,
                                               "runs": {p: [s["tokens_per_s"] for s in r] for p, r in results.items()}},
                                              indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
