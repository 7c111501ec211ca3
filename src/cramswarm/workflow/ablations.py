"""Stage 6, rules/ablations.smk: each ablation study's runs, fine-tuning results and, for the data table, the
stage reports of each run's data chain (the runs themselves: cramswarm.config.resolve_runs)."""

from __future__ import annotations

import json
from typing import Any

from cramswarm.config import data_wildcards
from cramswarm.workflow.study import FINETUNE, Study, bind, checkpoint_dir, runs_of


def run_dirs_json(study: Study, kind: str) -> str:
    """{label: checkpoint folder} of one ablation study's runs, for the report command."""
    runs = runs_of(study, kind)
    return json.dumps({study.runs[r]["label"]: checkpoint_dir(study, r, study.main_vocab) for r in runs})


def ablation_checkpoints(study: Study, kind: str) -> list[str]:
    """The summary.json of every run of one ablation study."""
    return [f"{checkpoint_dir(study, r, study.main_vocab)}/summary.json" for r in runs_of(study, kind)]


def ablation_finetunes(study: Study, kind: str) -> list[str]:
    """The fine-tuning results of one ablation study's runs (ablations.glue_tasks x glue.seeds)."""
    return [
        FINETUNE.format(source=study.source, model=r, vocab=study.main_vocab, task=task, seed=seed)
        for r in runs_of(study, kind)
        for task in study.config["ablations"]["glue_tasks"]
        for seed in study.seeds
    ]


def data_reports(study: Study, recipe: dict) -> dict[str, str]:
    """The stage reports of a data recipe's chain at the main vocab size (only the filters it switches on)."""
    keys = {**data_wildcards(recipe), "vocab": study.main_vocab}
    reports = {"corpus": "results/data/{corpus}/corpus.report.json".format(**keys)}
    steps = keys["filters"].split("-") if keys["filters"] != "raw" else []
    for i, step in enumerate(steps):
        kind = "trash" if step.startswith("trash") else "dedup"
        reports[kind] = "results/data/{corpus}/{chain}/report.json".format(chain="-".join(steps[: i + 1]), **keys)
    packed = "results/packed/{corpus}/{filters}/{family}-v{vocab}".format(**keys)
    reports["pack"] = f"{packed}/packed.report.json"
    reports["order"] = f"{packed}/{keys['order']}/report.json"
    return reports


def data_runs_json(study: Study) -> str:
    """{run: label, source, cell, data recipe, summary, stage reports} of the Table 2 runs, in config order
    (sources, then cells): the table's row order."""
    runs = {}
    for run in runs_of(study, "data"):
        spec = study.runs[run]
        source, cell = spec["label"].split(" / ")
        runs[run] = {
            "label": spec["label"],
            "source": source,
            "cell": cell,
            "data": spec["data"],
            "summary": f"{checkpoint_dir(study, run, study.main_vocab)}/summary.json",
            "reports": data_reports(study, spec["data"]),
        }
    return json.dumps(runs)


def names(study: Study) -> dict[str, Any]:
    """The names rules/ablations.smk uses."""
    return {
        "ABLATIONS": f"results/ablations/{study.source}",
        **bind(study, run_dirs_json, ablation_checkpoints, ablation_finetunes, data_reports, data_runs_json),
    }
