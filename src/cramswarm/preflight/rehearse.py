"""The preflight's measurements: the study's data stages on a slice of its real corpus, each model's training step
at its real micro-batch on this device, and one GLUE task's fine-tuning step.

Every measurement is of the package's own code (the data stages' functions, the models, the recipe's optimizer
and precision) in this process; :mod:`cramswarm.preflight.project` turns them into the full run's hours, tokens,
memory and disk. A model whose estimated memory (``resources.gpu_mem_mb`` on a GPU, ``training_mem_mb`` on a
CPU) is above the limit is not run: it would only be killed, so its estimate stands in for the measurement.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import psutil
import pyarrow.parquet as pq
import torch

from cramswarm import budget as budgets
from cramswarm import resources
from cramswarm.precision import autocast, resolve_precision
from cramswarm.training import build_model, make_optimizer, mask_tokens, resolve_device


class PeakRss:
    """This process's peak resident memory while the block runs, sampled every 20 ms (the stages run in this
    process, so ``ru_maxrss`` would report the peak of the whole preflight)."""

    def __enter__(self):
        self.proc, self.peak, self.done = psutil.Process(), 0, threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.done.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            self.done.wait(0.02)

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)


def timed(fn: Callable) -> tuple[object, float, int]:
    """(result, seconds, peak RSS bytes) of ``fn()``."""
    with PeakRss() as rss:
        start = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - start
    return result, seconds, rss.peak


def size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def data_stages(cfg: dict, work: Path) -> tuple[list[dict], dict]:
    """The study's data recipe on the first ``preflight.documents`` documents of its corpus: stream, tokenizer (at
    the main vocab size; on a slice it may come out smaller), trash filter and dedup where the recipe has them,
    pack, order. Returns one record per stage (name, slice documents, seconds, peak RSS, output bytes) and the
    slice's facts (documents in and after the filters, training blocks)."""
    from cramswarm.data import filters, ordering, packing
    from cramswarm.data import tokenizer as tokenization
    from cramswarm.data.sources import corpus_documents, write_corpus

    n, data, tok_cfg = cfg["preflight"]["documents"], cfg["data"], cfg["tokenizer"]
    cap = data["memory_cap_mb"]
    records = []

    def stage(name: str, fn: Callable, out: Path, documents: int):
        result, seconds, peak = timed(fn)
        records.append({"name": name, "documents": documents, "seconds": seconds, "peak_rss": peak,
                        "out_bytes": size(out)})
        return result

    raw = work / "raw.parquet"
    stage("corpus", lambda: write_corpus(itertools.islice(corpus_documents(cfg), n), raw), raw, n)
    docs = pq.ParquetFile(raw).metadata.num_rows
    tokenizer_path = work / "tokenizer.json"

    def train_tokenizer():
        tok = tokenization.train(lambda: tokenization.iter_corpus_batches(raw), tok_cfg["main_vocab_size"],
                                 tok_cfg["family"], tok_cfg["lowercase"], tok_cfg["min_frequency"],
                                 tok_cfg["ascii_only"], tok_cfg["limit_alphabet"])
        tok.save(str(tokenizer_path))
        return tok

    tok = stage("train_tokenizer", train_tokenizer, tokenizer_path, docs)
    corpus = raw
    if data["trash_filter"]:
        out = work / "trash.parquet"
        stage("filter_corpus (trash)", lambda: filters.trash_filter(corpus, tok, out, data["trash_cutoff"], cap),
              out, docs)
        corpus = out
    if data["dedup"]:
        out, before = work / "dedup.parquet", pq.ParquetFile(corpus).metadata.num_rows
        stage("filter_corpus (dedup)", lambda: filters.dedup(corpus, out, data["dedup_threshold"],
                                                             data["dedup_shingle_words"], data["dedup_permutations"]),
              out, before)
        corpus = out
    kept = pq.ParquetFile(corpus).metadata.num_rows
    packed, ordered = work / "packed.npy", work / "ordered.npy"
    block_tokens = cfg["packing"]["block_tokens"]
    stage("pack_corpus", lambda: packing.pack(corpus, tok, packed, block_tokens, cfg["packing"]["shuffle_seed"], cap),
          packed, kept)
    blocks = np.load(packed, mmap_mode="r").shape[0]
    holdout = min(cfg["pretrain"]["eval_blocks"], blocks // 2)
    stage("order_blocks", lambda: ordering.order_blocks(packed, tok, ordered, data["order"], data["order_seed"],
                                                        holdout, cap), ordered, kept)
    return records, {"documents": docs, "kept_documents": kept, "blocks": blocks}


def matmul_peak_tflops(device: torch.device, precision: str) -> tuple[float, str]:
    """The device's peak: the datasheet of a known CUDA card (``budget.device_peak``), else a measured square
    matmul in the run's own precision (a CPU without native bf16 is measured in fp32, not in emulated bf16)."""
    if device.type == "cuda":
        return budgets.device_peak({}, device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    return budgets.measure_matmul_tflops(device, 1024, 3, dtype), f"measured {precision} matmul on {device}"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_limit(cfg: dict, device: torch.device) -> tuple[float | None, str]:
    """(bytes, what) a training process may hold: the declared GPU memory, else this CUDA device's; on a CPU the
    declared host memory, else what this machine has available now."""
    pf = cfg["preflight"]
    if device.type == "cuda":
        if pf["gpu_memory_gb"]:
            return pf["gpu_memory_gb"] * 2**30, "GPU memory (preflight.gpu_memory_gb)"
        return torch.cuda.get_device_properties(device).total_memory, f"GPU memory of {torch.cuda.get_device_name()}"
    if pf["host_memory_gb"]:
        return pf["host_memory_gb"] * 2**30, "host memory (preflight.host_memory_gb)"
    return psutil.virtual_memory().available, "host memory available here"


def train_steps(run: dict, vocab: int, block_tokens: int, cfg: dict) -> dict:
    """A model's training steps at its real micro-batch (per data-parallel process) on its device: forward, backward
    and the recipe's optimizer step per micro-batch, under the run's precision, on random blocks masked as the
    recipe masks. One untimed step, then ``preflight.steps`` timed. Not run where the estimate is above the limit."""
    recipe, arch, impl = run["recipe"], run["arch"], cfg["pretrain"]["impl"]
    device = resolve_device(impl["device"])
    micro = max(1, recipe["micro_batch_sequences"] // (impl["devices"] * impl["nodes"]))
    fused = impl["attention_backend"] != "math"
    if device.type == "cuda":
        estimate = resources.gpu_mem_mb(arch, vocab, micro, block_tokens, fused) * 1e6
    else:
        estimate = resources.training_mem_mb(arch, vocab, micro, block_tokens, "cpu") * 1e6
    limit, what = memory_limit(cfg, device)
    precision = resolve_precision(recipe["precision"], device)
    flops = budgets.training_flops_per_token(arch, vocab, block_tokens, recipe["mask_rate"])
    facts = {"device": str(device), "precision": precision, "micro_batch": micro, "flops_per_token": flops,
             "memory_estimate_bytes": estimate, "memory_limit_bytes": limit, "memory_limit": what}
    if limit is not None and estimate > limit:
        return facts | {"ran": False}
    model = build_model(arch, vocab, recipe["seed"], recipe["dropout"]).to(device).train()
    optimizer = make_optimizer(model, recipe)
    generator = torch.Generator(device=device).manual_seed(0)
    blocks = torch.randint(5, vocab, (micro, block_tokens), generator=generator, device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def step():
        inputs, labels = mask_tokens(blocks, recipe["mask_rate"], recipe["mask_mode"], vocab, generator)
        with autocast(precision, device):
            loss = model(inputs, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    with PeakRss() as rss:
        step()
        synchronize(device)
        start = time.perf_counter()
        for _ in range(cfg["preflight"]["steps"]):
            step()
        synchronize(device)
        seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else rss.peak
    tflops, source = matmul_peak_tflops(device, precision)
    return facts | {"ran": True, "tokens_per_s": cfg["preflight"]["steps"] * micro * block_tokens / seconds,
                    "peak_memory_bytes": peak, "peak_tflops": tflops, "peak_source": source}


def finetune_step_seconds(run: dict, vocab: int, cfg: dict, num_labels: int) -> float:
    """Seconds of one fine-tuning step of the run's model: the sequence classifier at the protocol's batch size and
    max length, AdamW, under the run's precision, on random tokens (the fastest of ``preflight.steps``)."""
    from cramswarm.models.crammed_bert import CrammedBertConfig, CrammedBertForSequenceClassification

    protocol = run["glue"]
    device = resolve_device(protocol["device"])
    precision = resolve_precision(run["recipe"]["precision"], device)
    config = CrammedBertConfig.from_arch(run["arch"], vocab, num_labels=num_labels)
    model = CrammedBertForSequenceClassification(config).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=protocol["lr"], weight_decay=protocol["weight_decay"])
    generator = torch.Generator(device=device).manual_seed(0)
    shape = (protocol["batch_size"], protocol["max_length_tokens"])
    ids = torch.randint(5, vocab, shape, generator=generator, device=device)
    labels = (torch.randn(shape[0], device=device) if num_labels == 1
              else torch.randint(0, num_labels, (shape[0],), generator=generator, device=device))
    times = []
    for _ in range(cfg["preflight"]["steps"] + 1):
        synchronize(device)
        start = time.perf_counter()
        with autocast(precision, device):
            loss = model(ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times[1:])


def free_disk_bytes(path: Path) -> int:
    path = Path(path)
    while not path.exists():
        path = path.parent
    return os.statvfs(path).f_bavail * os.statvfs(path).f_frsize
