"""The preflight's arithmetic: what the measurements on a slice mean for the full run, and whether each job fits.

Pure functions of plain numbers (no torch, no I/O): :mod:`cramswarm.preflight.rehearse` measures, this module
projects. A stage measured at ``rate`` documents per second on the slice takes ``documents / rate`` on the whole
corpus; its bytes per document scale the same way. A pretraining run measured at ``tokens_per_s`` trains
``tokens_per_s x seconds`` tokens on a seconds budget, or takes ``tokens / tokens_per_s`` on a token budget; it
wraps its data where the tokens exceed the training blocks. A job does not fit where its memory exceeds the
limit, its time the cluster's longest job, or the outputs the disk; each verdict names the key to change.
"""

from __future__ import annotations

import math

GIB = 2**30
HOUR = 3600.0


def stage_projection(name: str, slice_documents: int, seconds: float, peak_rss_bytes: int, out_bytes: int,
                     documents: int, copies: int = 1) -> dict:
    """A data stage run once per ``copies`` (a pack or order per vocab size) on the whole corpus of ``documents``,
    from its run on the slice: seconds and output bytes scale with the documents, memory is bounded by the
    stage's cap and stays as measured."""
    scale = documents / max(slice_documents, 1)
    return {
        "stage": name,
        "copies": copies,
        "slice_documents": slice_documents,
        "slice_seconds": seconds,
        "documents_per_s": slice_documents / seconds if seconds > 0 else math.inf,
        "projected_hours": copies * seconds * scale / HOUR,
        "peak_rss_gib": peak_rss_bytes / GIB,
        "projected_disk_gb": copies * out_bytes * scale / 1e9,
    }


def pretrain_projection(measured: dict, budget: dict, block_tokens: int, training_blocks: float) -> dict:
    """A pretraining run from its timed steps. ``measured``: tokens_per_s, flops_per_token, peak_tflops,
    peak_memory_bytes. ``budget``: the resolved budget (unit tokens or seconds, see ``budget.resolve`` and
    ``budget.counted``; steps already turned into tokens). ``training_blocks``: blocks the full data recipe yields
    (after the cap). Gives the hours, the tokens, the MFU and where the data wraps (share of the budget)."""
    rate = measured["tokens_per_s"]
    if budget["unit"] == "seconds":
        seconds, tokens = budget["value"], rate * budget["value"]
    else:
        tokens, seconds = budget["value"], budget["value"] / rate
    data_tokens = training_blocks * block_tokens
    passes = tokens / data_tokens if data_tokens else math.inf
    return {
        "tokens_per_s": rate,
        "mfu": rate * measured["flops_per_token"] / (measured["peak_tflops"] * 1e12),
        "peak_memory_gib": measured["peak_memory_bytes"] / GIB,
        "projected_hours": seconds / HOUR,
        "projected_tokens": tokens,
        "training_blocks": training_blocks,
        "data_passes": passes,
        "wraps_at_budget_share": 1.0 / passes if passes > 1 else None,
    }


def finetune_projection(step_seconds: float, rows: dict[str, int], batch_size: int, epochs: int, seeds: int) -> dict:
    """Every task of ``rows`` (task -> train rows) fine-tuned for ``epochs`` at ``batch_size``, ``seeds`` times, at
    the timed step (validation passes, a third of a training step per row, on top: 10 %)."""
    steps = sum(math.ceil(n / batch_size) * epochs for n in rows.values())
    return {"step_seconds": step_seconds, "steps_per_seed": steps,
            "projected_hours": 1.1 * steps * step_seconds * seeds / HOUR}


def memory_verdict(job: str, needed_bytes: float, limit_bytes: float | None, key: str, what: str) -> dict:
    """Fits where the memory a job needs (measured or estimated) is within the limit (none: fits)."""
    if limit_bytes is None or needed_bytes <= limit_bytes:
        return {"job": job, "verdict": "fits", "check": what,
                "detail": f"{needed_bytes / GIB:.1f} GiB" + (f" of {limit_bytes / GIB:.1f}" if limit_bytes else "")}
    return {"job": job, "verdict": "will not fit", "check": what, "key": key,
            "detail": f"needs {needed_bytes / GIB:.1f} GiB, the limit is {limit_bytes / GIB:.1f} GiB: lower {key}"}


def time_verdict(job: str, hours: float, limit_hours: float | None, key: str) -> dict:
    """Fits where the job's projected hours (with the workflow's margin) are within the cluster's longest job."""
    if limit_hours is None or hours <= limit_hours:
        return {"job": job, "verdict": "fits", "check": "time limit",
                "detail": f"{hours:.2f} h" + (f" of {limit_hours:g} h" if limit_hours else "")}
    return {"job": job, "verdict": "will not fit", "check": "time limit", "key": key,
            "detail": f"projected {hours:.1f} h, the limit is {limit_hours:g} h: change {key}, or let the job resume "
                      f"across {math.ceil(hours / limit_hours)} submissions (profile retries)"}


def disk_verdict(total_gb: float, free_gb: float | None) -> dict:
    if free_gb is None or total_gb <= free_gb:
        return {"job": "all outputs", "verdict": "fits", "check": "disk",
                "detail": f"{total_gb:.1f} GB" + (f" of {free_gb:.0f} GB free" if free_gb is not None else "")}
    return {"job": "all outputs", "verdict": "will not fit", "check": "disk", "key": "preflight.disk_gb",
            "detail": f"projected {total_gb:.1f} GB, {free_gb:.0f} GB free: fewer tokenizer.vocab_sizes or "
                      "data.max_sequences, or more disk"}
