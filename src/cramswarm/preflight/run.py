"""The preflight of a study: rehearse it (:mod:`.rehearse`), project it (:mod:`.project`), write the report.

``results/preflight/{source}/report.json`` holds every measurement and projection; ``report.md`` the same as a
page: per data stage the measured rate and the projected hours, memory and disk; per pretraining model tokens/s,
MFU, peak memory, the projected hours and tokens and where the data wraps; the fine-tuning GPU-hours; and a verdict
per job (fits / will not fit, with the key to change). The command exits 1 when any job will not fit.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

from cramswarm import budget as budgets
from cramswarm import resources
from cramswarm.preflight import project


def resolved_budget(recipe: dict, arch: dict, vocab: int, block_tokens: int, peak_tflops: float) -> dict:
    """The budget as tokens or seconds on this device (steps: the recipe's tokens per step)."""
    budget = budgets.for_model(recipe, arch, vocab, block_tokens)["budget"]
    if budget["unit"] == "steps":
        return {"unit": "tokens", "value": budget["value"] * recipe["batch_sequences"] * block_tokens}
    if budgets.is_normalised(budget):
        return budgets.resolve(budget, recipe["budget"].get("device_peak_tflops") or peak_tflops)
    return {"unit": budget["unit"], "value": budget["value"]}


def preflight(cfg: dict, results: Path = Path("results")) -> dict:
    """Rehearse the study of ``cfg`` here and project it to the full run; the report (see the module)."""
    from cramswarm.config import resolve_runs
    from cramswarm.glue_tasks import TASKS
    from cramswarm.preflight import rehearse

    pf, vocab, block_tokens = cfg["preflight"], cfg["tokenizer"]["main_vocab_size"], cfg["packing"]["block_tokens"]
    documents, vocabs = resources.corpus_documents(cfg), len(cfg["tokenizer"]["vocab_sizes"])
    with tempfile.TemporaryDirectory(prefix="preflight-") as work:
        records, facts = rehearse.data_stages(cfg, Path(work))
    if facts["documents"] < pf["documents"]:  # the slice is the whole corpus (not the uncapped bound)
        documents = facts["documents"]
    tokenizers = vocabs + int(cfg["data"]["trash_filter"])  # the sweep, and the raw one the trash filter counts with
    copies = {"pack_corpus": vocabs, "order_blocks": vocabs, "train_tokenizer": tokenizers}
    stages = [project.stage_projection(r["name"], r["documents"], r["seconds"], r["peak_rss"], r["out_bytes"],
                                       round(documents * r["documents"] / facts["documents"]),
                                       copies.get(r["name"], 1)) for r in records]
    blocks = facts["blocks"] * documents / facts["documents"]
    if cfg["data"]["max_sequences"]:
        blocks = min(blocks, cfg["data"]["max_sequences"])
    limit_hours = pf["time_limit_hours"]
    corpus_key = "synthetic.corpus_documents" if cfg["source"] == "synthetic" else "hub.corpus[].max_documents"
    verdicts = [project.time_verdict(f"{s['stage']} ({s['copies']} job{'s' * (s['copies'] > 1)})",
                                     s["projected_hours"] / s["copies"], limit_hours, corpus_key)
                for s in stages]
    host_limit = pf["host_memory_gb"] * 2**30 if pf["host_memory_gb"] else None
    verdicts += [project.memory_verdict(s["stage"], s["peak_rss_gib"] * 2**30, host_limit, "data.memory_cap_mb",
                                        "host memory") for s in stages]
    runs = resolve_runs(cfg)
    models, disk_gb = {}, sum(s["projected_disk_gb"] for s in stages)
    for name, run in runs.items():
        if run["study"] != "models" or not run["pretrain"]:
            continue
        job = f"pretrain {name} v{vocab}"
        if run["trainer"] == "swarm":
            models[name] = {"skipped": "a SWARM run: rehearsed by the swarm tier (python -m pytest -m swarm)"}
            continue
        measured = rehearse.train_steps(run, vocab, block_tokens, cfg)
        key = f"models.{name}.recipe.micro_batch_sequences"
        needed = measured["peak_memory_bytes"] if measured["ran"] else measured["memory_estimate_bytes"]
        verdicts.append(project.memory_verdict(job, needed, measured["memory_limit_bytes"], key,
                                               measured["memory_limit"]))
        params = resources.model_params(run["arch"], vocab)[1]
        disk_gb += params * (4 + 16) / 1e9  # the checkpoint (fp32) and the resumable state (+ Adam moments)
        if not measured["ran"]:
            models[name] = measured
            continue
        budget = resolved_budget(run["recipe"], run["arch"], vocab, block_tokens, measured["peak_tflops"])
        models[name] = measured | {"budget": budget} | project.pretrain_projection(measured, budget, block_tokens,
                                                                                    blocks)
        hours = resources.SECONDS_BUDGET_MARGIN * models[name]["projected_hours"] + resources.BASE_MINUTES / 60
        verdicts.append(project.time_verdict(job, hours, limit_hours, "pretrain.budget.value"))
    task = pf["glue_task"]
    finetune = {}
    for name, run in runs.items():
        if run["study"] != "models":
            continue
        seconds = rehearse.finetune_step_seconds(run, vocab, cfg, TASKS[task].num_labels)
        rows = {t: resources.glue_rows(t, cfg["source"], cfg[cfg["source"]])[0] for t in cfg["glue"]["tasks"]}
        finetune[name] = project.finetune_projection(seconds, rows, run["glue"]["batch_size"], run["glue"]["epochs"],
                                                     len(cfg["glue"]["seeds"]))
    free = pf["disk_gb"] if pf["disk_gb"] else rehearse.free_disk_bytes(results) / 1e9
    verdicts.append(project.disk_verdict(disk_gb, free))
    return {
        "source": cfg["source"],
        "slice": facts | {"corpus_documents": documents, "projected_training_blocks": blocks},
        "stages": stages,
        "pretrain": models,
        "finetune": {"timed_task": task, "per_model": finetune,
                     "projected_hours": sum(f["projected_hours"] for f in finetune.values())},
        "projected_disk_gb": disk_gb,
        "limits": {k: pf[k] for k in ("gpu_memory_gb", "host_memory_gb", "time_limit_hours", "disk_gb")},
        "verdicts": verdicts,
        "fits": all(v["verdict"] == "fits" for v in verdicts),
    }


def _num(value, digits: int = 2) -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and (math.isinf(value) or abs(value) >= 1e5):
        return f"{value:.3g}"
    return f"{value:,.{digits}f}" if isinstance(value, float) else f"{value:,}"


def markdown(report: dict) -> str:
    """The report as a page: the verdicts first, then the stages, the models and fine-tuning."""
    lines = [f"# Preflight of the `{report['source']}` study", "",
             "Verdict: **every job fits**" if report["fits"] else "Verdict: **some jobs will not fit** (below)", "",
             "| Job | Check | Verdict | Detail |", "|---|---|---|---|"]
    lines += [f"| {v['job']} | {v['check']} | {v['verdict']} | {v['detail']} |" for v in report["verdicts"]]
    s = report["slice"]
    lines += ["", f"## Data stages (slice of {s['documents']:,} of {s['corpus_documents']:,} documents)", "",
              "| Stage | Jobs | Documents/s | Projected hours | Peak RSS (GiB) | Projected disk (GB) |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {r['stage']} | {r['copies']} | {_num(r['documents_per_s'], 0)} | {_num(r['projected_hours'])} | "
              f"{_num(r['peak_rss_gib'])} | {_num(r['projected_disk_gb'])} |" for r in report["stages"]]
    lines += ["", f"Projected training blocks: {_num(s['projected_training_blocks'], 0)}; disk for every output: "
              f"{_num(report['projected_disk_gb'], 1)} GB.", "", "## Pretraining (main vocab size)", "",
              "| Model | Device | Precision | Micro-batch | Tokens/s | MFU | Peak memory (GiB) | Hours | Tokens | "
              "Data passes | Wraps at budget share |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in report["pretrain"].items():
        if "skipped" in m:
            lines.append(f"| {name} | {m['skipped']} |" + " |" * 9)
        elif not m["ran"]:
            lines.append(f"| {name} | {m['device']} | {m['precision']} | {m['micro_batch']} | not run: estimated "
                         f"{m['memory_estimate_bytes'] / 2**30:.1f} GiB |" + " |" * 6)
        else:
            share = m["wraps_at_budget_share"]
            lines.append(f"| {name} | {m['device']} | {m['precision']} | {m['micro_batch']} | "
                         f"{_num(m['tokens_per_s'], 0)} | {m['mfu']:.1%} | {_num(m['peak_memory_gib'])} | "
                         f"{_num(m['projected_hours'])} | {_num(m['projected_tokens'], 0)} | "
                         f"{_num(m['data_passes'])} | {'—' if share is None else format(share, '.0%')} |")
    f = report["finetune"]
    lines += ["", f"## Fine-tuning (step timed on {f['timed_task']}, projected to every task and seed)", "",
              "| Model | Step (s) | Steps per seed | Hours |", "|---|---|---|---|"]
    lines += [f"| {n} | {p['step_seconds']:.4f} | {p['steps_per_seed']:,} | {_num(p['projected_hours'])} |"
              for n, p in f["per_model"].items()]
    lines += ["", f"Fine-tuning in all: {_num(f['projected_hours'])} hours.", ""]
    return "\n".join(lines)
