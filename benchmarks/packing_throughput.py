"""Packing throughput (MB of text per second) and peak memory: the workflow's streaming packer against a plain
``datasets.map`` tokenize-then-group pipeline, side by side in one run on the same corpus and tokenizer.

* ``cramswarm``: :func:`cramswarm.data.packing.pack` — streamed row groups, batches sized from ``--memory-cap-mb``,
  blocks appended to a memory-mapped ``.npy``.
* ``datasets.map``: what the public Cramming code does — ``Dataset.from_parquet``, ``map`` (batched tokenize,
  each document + ``[SEP]``), ``map`` (concatenate each 1024-document batch, cut 128-token blocks, drop the
  batch's remainder), ``save_to_disk``. Arrow caches go to a temporary folder.

Each method runs in its own fresh Python process (torch blocked, see ``CHILD``), so its peak RSS (``VmHWM``) is its
own; the time is the packing call alone (imports and tokenizer loading excluded). MB/s counts UTF-8 bytes of text.

    python benchmarks/packing_throughput.py                       # synthetic corpus, 60,000 documents (~20 MB)
    python benchmarks/packing_throughput.py --documents 200000    # larger
    python benchmarks/packing_throughput.py --mirror ../shared/data/hub   # the mirror's Wikipedia + Gutenberg
    python benchmarks/packing_throughput.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))  # this checkout's package

from cramswarm.data.tokenizer import SEP_ID  # noqa: E402

# Neither child loads torch: the cramswarm child blocks it (importing the package would load it to register the
# model with transformers, ~0.5 GB that would swamp the packer's own peak RSS); the datasets child never imports
# cramswarm (it reads the tokenizer with `tokenizers` itself) and datasets does not import torch for this.
CHILD = r"""
import json, sys, time
method, corpus, tokenizer, out, cap, block, SEP = {args!r}
if method == "cramswarm":
    sys.modules["torch"] = None
    sys.path.insert(0, {src!r})
    from cramswarm.data import packing, tokenizer as tokenization
    tok = tokenization.load(tokenizer)
    start = time.perf_counter()
    report = packing.pack(corpus, tok, out, block, shuffle_seed=0, memory_cap_mb=cap)
    seconds, blocks = time.perf_counter() - start, report["blocks"]
else:
    import datasets
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(tokenizer)
    datasets.disable_progress_bars()
    start = time.perf_counter()
    ds = datasets.Dataset.from_parquet(corpus, cache_dir=out + ".cache")
    def encode(batch):
        return {{"input_ids": [e.ids + [SEP] for e in tok.encode_batch(batch["text"], add_special_tokens=False)]}}
    def group(batch):
        ids = [i for doc in batch["input_ids"] for i in doc]
        n = len(ids) // block * block
        return {{"input_ids": [ids[i : i + block] for i in range(0, n, block)]}}
    ds = ds.map(encode, batched=True, batch_size=1024, remove_columns=["text"])
    ds = ds.map(group, batched=True, batch_size=1024)
    ds.save_to_disk(out)
    seconds, blocks = time.perf_counter() - start, len(ds)
peak = [int(line.split()[1]) / 1024 for line in open("/proc/self/status") if line.startswith("VmHWM")][0]
print(json.dumps({{"seconds": seconds, "blocks": blocks, "peak_rss_mb": peak}}))
"""


def build_corpus(args, folder: Path) -> tuple[Path, Path, float]:
    from cramswarm.data import hub, sources
    from cramswarm.data import tokenizer as tokenization
    from cramswarm.data.stream import iter_documents

    corpus = folder / "corpus.parquet"
    if args.mirror:
        spec = [{"path": "wikimedia/wikipedia", "name": "en-2015-sample"}, {"path": "bookcorpus-like/gutenberg"}]
        sources.write_corpus(hub.iter_corpus(spec, args.mirror), corpus)
    else:
        from cramswarm.data.synthetic import corpus_documents

        sources.write_corpus(corpus_documents(args.documents, 0), corpus)
    text_mb = sum(len(t.encode("utf-8")) for t in iter_documents(corpus)) / 1e6
    tok = tokenization.train(tokenization.iter_corpus_batches(corpus), args.vocab)
    tok.save(str(folder / "tokenizer.json"))
    return corpus, folder / "tokenizer.json", text_mb


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=60_000, help="synthetic corpus size (documents)")
    parser.add_argument("--mirror", help="hub-layout mirror: use its Wikipedia sample + Gutenberg books instead")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--block-tokens", type=int, default=128)
    parser.add_argument("--memory-cap-mb", type=float, default=512, help="the packer's cap (MiB; config.yaml: 512)")
    parser.add_argument("--methods", default="cramswarm,datasets.map")
    parser.add_argument("--json", help="also write the numbers here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        corpus, tokenizer, text_mb = build_corpus(args, folder)
        print(f"corpus: {text_mb:.1f} MB of text; tokenizer: wordpiece, vocab {args.vocab}")
        results = {}
        for method in args.methods.split(","):
            child_args = (
                method,
                str(corpus),
                str(tokenizer),
                str(folder / method),
                args.memory_cap_mb,
                args.block_tokens,
                SEP_ID,
            )
            proc = subprocess.run(
                [sys.executable, "-c", CHILD.format(src=str(SRC), args=child_args)], capture_output=True, text=True
            )
            if proc.returncode:
                raise RuntimeError(f"{method} failed:\n{proc.stderr[-3000:]}")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            r["mb_per_s"] = text_mb / r["seconds"]
            results[method] = r
            print(
                f"{method:>14}: {r['mb_per_s']:6.2f} MB/s ({r['seconds']:.1f} s), "
                f"peak RSS {r['peak_rss_mb']:7.0f} MiB, "
                f"{r['blocks']:,} blocks",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"text_mb": text_mb, **vars(args), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
