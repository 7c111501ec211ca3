"""The stage-boundary 8-bit code (``compression.encode(..., "blockwise8")``: blockwise absmax, linear code) against
bitsandbytes' blockwise code (``bitsandbytes.functional.quantize_blockwise``: blockwise absmax, its non-uniform
"dynamic" code), side by side on the same tensors, both at 4096 values per block.

Tensors: what crosses a stage boundary of crammed BERT (the hidden states after the first of two stages and
their gradient from the MLM loss; mini shape 2 x 256 by default, a model at initialisation and one after
``--train-steps`` AdamW steps on random tokens, where outlier features may have begun to form) and two synthetic
ones (Gaussian; Student-t with 3 degrees of freedom, heavy-tailed). For each: the relative L2 error of the
round trip, the largest absolute error over the tensor's absolute maximum, bytes per value on the wire, and
encode + decode time per million values (CPU, best of ``--repeats``). Ratios are ours / bitsandbytes'.

    pip install bitsandbytes                       # optional: not a project dependency (it has a CPU backend)
    python benchmarks/codec_8bit.py [--hidden 256 --layers 2 --batch 32 --train-steps 50 --json out.json]

Without bitsandbytes the script measures our code alone and says so.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from cramswarm.swarm import compression  # noqa: E402

BLOCK = 4096


def ours(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    payload = compression.encode(t, "blockwise8", block_size=BLOCK)
    return compression.decode(payload), compression.payload_bytes(payload)


def bnb_codec():
    try:
        import bitsandbytes.functional as F
    except ImportError:
        return None

    def roundtrip(t: torch.Tensor) -> tuple[torch.Tensor, int]:
        flat = t.detach().float().reshape(-1).contiguous()
        codes, state = F.quantize_blockwise(flat, blocksize=BLOCK)
        # on the wire: the codes and one absmax per block (the 256-entry code table is a constant both sides know)
        return F.dequantize_blockwise(codes, state).reshape(t.shape), codes.numel() + state.absmax.numel() * 4

    return roundtrip


def measure(codec, t: torch.Tensor, repeats: int) -> dict:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        back, size = codec(t)
        best = min(best, time.perf_counter() - start)
    err = (back.float() - t.float())
    return {
        "rel_l2": (err.norm() / t.float().norm()).item(),
        "max_err_over_absmax": (err.abs().max() / t.abs().max()).item(),
        "bytes_per_value": size / t.numel(),
        "ms_per_million": best * 1e3 / t.numel() * 1e6,
    }


def boundary_tensors(args) -> dict[str, torch.Tensor]:
    """Stage-0 output activations and their gradient of a crammed BERT, at init and after a short training."""
    from cramswarm.models.crammed_bert import CrammedBertConfig, CrammedBertForMaskedLM
    from cramswarm.swarm.stages import split_model

    torch.manual_seed(0)
    config = CrammedBertConfig(vocab_size=args.vocab, num_hidden_layers=args.layers, hidden_size=args.hidden,
                               num_attention_heads=max(1, args.hidden // 64), intermediate_size=4 * args.hidden,
                               max_position_embeddings=args.seq)
    model = CrammedBertForMaskedLM(config)
    generator = torch.Generator().manual_seed(1)

    def batch():
        ids = torch.randint(5, args.vocab, (args.batch, args.seq), generator=generator)
        labels = torch.where(torch.rand(ids.shape, generator=generator) < 0.25, ids, torch.full_like(ids, -100))
        return ids, labels

    def capture(tag: str) -> dict[str, torch.Tensor]:
        first, rest = split_model(model, 2)
        ids, labels = batch()
        sent = first(ids).detach().requires_grad_(True)  # what stage 0 sends
        rest(sent, labels=labels).backward()  # the last stage returns the MLM loss
        return {f"activations ({tag})": sent.detach(), f"gradients ({tag})": sent.grad.detach()}

    tensors = capture("init")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(args.train_steps):
        ids, labels = batch()
        model(ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    tensors |= capture(f"after {args.train_steps} steps")
    return tensors


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--train-steps", type=int, default=50)
    parser.add_argument("--synthetic-values", type=int, default=1 << 22)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    tensors = boundary_tensors(args)
    n = args.synthetic_values
    tensors["gaussian"] = torch.randn(n)
    tensors["student-t, 3 dof"] = torch.distributions.StudentT(3.0).sample((n,))
    theirs = bnb_codec()
    if theirs is None:
        print("bitsandbytes is not installed: measuring our code alone (pip install bitsandbytes for the comparison)")
    rows = []
    header = f"{'tensor':<28} {'values':>9} {'ours rel L2':>11} {'bnb rel L2':>10} {'ratio':>6} " \
             f"{'ours max/amax':>13} {'bnb max/amax':>12} {'B/value ours/bnb':>16} {'ms/M ours/bnb':>14}"
    print(header)
    print("-" * len(header))
    for name, t in tensors.items():
        a = measure(ours, t, args.repeats)
        b = measure(theirs, t, args.repeats) if theirs else None
        rows.append({"tensor": name, "values": t.numel(), "ours": a, "bitsandbytes": b,
                     "rel_l2_ratio": a["rel_l2"] / b["rel_l2"] if b else None})
        def cell(key: str, spec: str, b=b) -> str:
            return format(b[key], spec) if b else "-"

        ratio = format(a["rel_l2"] / b["rel_l2"], ".2f") if b else "-"
        print(f"{name:<28} {t.numel():>9} {a['rel_l2']:>11.4f} {cell('rel_l2', '.4f'):>10} {ratio:>6} "
              f"{a['max_err_over_absmax']:>13.4f} {cell('max_err_over_absmax', '.4f'):>12} "
              f"{a['bytes_per_value']:>7.3f}/{cell('bytes_per_value', '.3f'):<8} "
              f"{a['ms_per_million']:>6.1f}/{cell('ms_per_million', '.1f'):<7}")
    report = {"block_size": BLOCK, "torch": torch.__version__, "args": vars(args), "rows": rows}
    if theirs:
        import bitsandbytes

        report["bitsandbytes"] = bitsandbytes.__version__
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
