"""The gated-GELU feed-forward's up-projection in isolation: forward + backward of formulations that compute the
same function, compiled, side by side in one process.

The H200 profile of crammed BERT at the paper's shape (docs/benchmarks.md) put inductor's fused gated-GELU backward
kernel at 11.7 ms of a 104 ms step, moving about 1.4 TB/s on a 4.8 TB/s part: the largest kernel that is not a
matmul. This script times ``x -> Linear(hidden, intermediate, no bias) -> GLU`` (what ``crammed_bert`` does before
its down-projection) forward and backward, per variant:

- ``chunk``: the model's own code, ``h, gate = h.chunk(2, -1); gelu(gate) * h``;
- ``unbind``: the same tensor viewed as ``(..., 2, intermediate / 2)`` and unbound (same weights, same layout);
- ``two-linear``: two half-size projections (the same parameters split in two; no concatenation in the backward);
- ``tanh``: ``chunk`` with the tanh approximation of GELU. Not the model's function: it says whether the erf
  backward's arithmetic is what limits the kernel.

Each variant's time is the fastest of ``--steps`` timed iterations after ``--warmup`` (the first compiles), the
projection's matmuls included. Prints one row per variant with its time / ``chunk``'s and its largest deviation
from the ``chunk`` function computed in fp32 on the same inputs.

    python benchmarks/glu_backward.py --device cuda --tokens 65536          # micro-batch 512 x 128
    python benchmarks/glu_backward.py --quick                               # tiny, checks the script runs
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

VARIANTS = ("chunk", "unbind", "two-linear", "tanh")


def glu_fn(variant: str):
    def chunk(x, w):
        h, gate = F.linear(x, w).chunk(2, dim=-1)
        return F.gelu(gate) * h

    def unbind(x, w):
        y = F.linear(x, w)
        h, gate = y.view(*y.shape[:-1], 2, y.shape[-1] // 2).unbind(-2)
        return F.gelu(gate) * h

    def two_linear(x, w):
        w_h, w_gate = w.chunk(2, dim=0)
        return F.gelu(F.linear(x, w_gate)) * F.linear(x, w_h)

    def tanh(x, w):
        h, gate = F.linear(x, w).chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * h

    return {"chunk": chunk, "unbind": unbind, "two-linear": two_linear, "tanh": tanh}[variant]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_variant(variant: str, args, device: torch.device) -> dict:
    torch.manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(args.intermediate, args.hidden, device=device, dtype=torch.bfloat16) * args.hidden**-0.5
    w.requires_grad_(True)
    grad_out = torch.randn(args.tokens, args.intermediate // 2, device=device, dtype=torch.bfloat16)
    fn = torch.compile(glu_fn(variant)) if args.compile else glu_fn(variant)
    times = []
    for i in range(args.warmup + args.steps):
        x.grad = w.grad = None
        sync(device)
        start = time.perf_counter()
        out = fn(x, w)
        out.backward(grad_out)
        sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    reference = glu_fn("chunk")(x.detach().float(), w.detach().float())
    error = (out.detach().float() - reference).abs().max().item()
    return {"variant": variant, "best_s": min(times), "step_s_all": times, "max_abs_error_vs_fp32": error}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=65536, help="rows (micro-batch x sequence length)")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=3072, help="projection width before the GLU halves it")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="eager instead of compiled")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--quick", action="store_true", help="a tiny shape, a few seconds (checks the script runs)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.hidden, args.intermediate, args.steps, args.warmup = 256, 64, 128, 2, 1
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"--variants: unknown {', '.join(sorted(unknown))}; allowed: {', '.join(VARIANTS)}")
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    results = [time_variant(v, args, device) for v in args.variants.split(",")]
    base = next((r["best_s"] for r in results if r["variant"] == "chunk"), None)
    print(f"{args.tokens} x {args.hidden} -> {args.intermediate} -> GLU, bf16, {device}"
          f"{', compiled' if args.compile else ', eager'}; fastest of {args.steps}")
    print(f"{'variant':<12} {'fwd+bwd ms':>10} {'vs chunk':>8} {'max err':>8}")
    for r in results:
        r["vs_chunk"] = r["best_s"] / base if base else None
        print(f"{r['variant']:<12} {r['best_s'] * 1e3:>10.3f} {r['vs_chunk'] or float('nan'):>8.2f} "
              f"{r['max_abs_error_vs_fp32']:>8.3f}")
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "compile": args.compile, "tokens": args.tokens, "hidden": args.hidden,
              "intermediate": args.intermediate, "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
