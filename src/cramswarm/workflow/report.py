"""Stage 5, rules/report.smk: the tables' and figures' paths and inputs, the study record, and the manifest of
what each of the papers' claims reads (the claims themselves: cramswarm.report.claims)."""

from __future__ import annotations

from typing import Any

from cramswarm.resources import BASE_MINUTES, PYTHON_MB
from cramswarm.workflow.study import FINETUNE, Study, bind, checkpoint_dir, runs_of
from cramswarm.workflow.swarm import SWARM_EXPERIMENTS, swarm_study_dir

REPORT_RESOURCES = {"mem_mb": 2 * PYTHON_MB, "runtime": BASE_MINUTES}  # tables and figures: seconds of work


def finetune_results(study: Study, wildcards=None, runs: list[tuple[str, int]] | None = None) -> list[str]:
    """Every fine-tuning result (task x seed) of ``runs``, (model, vocab) pairs: the study's by default."""
    return [
        FINETUNE.format(source=study.source, model=model, vocab=vocab, task=task, seed=seed)
        for model, vocab in (study.study_runs if runs is None else runs)
        for task in study.tasks
        for seed in study.seeds
    ]


def pretrain_logs(study: Study, wildcards=None) -> list[str]:
    """The train_log.csv of every pretrained run of the study (the loss figure)."""
    return [f"{checkpoint_dir(study, m, v)}/train_log.csv" for m, v in study.study_runs if study.models[m]["pretrain"]]


def pretraining(study: Study, runs: list[tuple[str, int]]) -> list[list]:
    """[model, vocab, summary.json] of the pretrained runs among `runs`: a GLUE table's tokens and data passes."""
    return [[m, v, f"{checkpoint_dir(study, m, v)}/summary.json"] for m, v in runs if study.models[m]["pretrain"]]


def claim_roles(study: Study) -> dict[str, str]:
    """{role: model name} of the models the claims compare; a role the config lacks is left out."""
    groups = study.config["ablations"]["groups"]
    roles = {"crammed": groups["final_model"], "bert_original": groups["original_model"]}
    if "izsak" in study.models:
        roles["izsak"] = "izsak"
    if study.baselines:
        roles["no_pretrain"] = study.baselines[0]
    swarm = [name for name, spec in study.models.items() if spec["trainer"] == "swarm"]
    if swarm:
        roles["swarm"] = swarm[0]
    return roles


def claims_manifest(study: Study) -> dict[str, Any]:
    """What each claim reads (the manifest of cramswarm.report.claims): the study's fine-tuning results and
    checkpoints, the arch (the base recipe's shapes only), schedule and data ablation runs, the SWARM study."""
    glue, checkpoints, main = {}, {}, study.main_vocab
    for model, vocab in dict.fromkeys(study.study_runs + study.sweep_runs):
        glue.setdefault(model, []).append(vocab)
        if study.models[model]["pretrain"]:
            checkpoints.setdefault(model, {})[str(vocab)] = checkpoint_dir(study, model, vocab)
    ablations = study.config["ablations"]
    own_recipe = {f"arch-{name}" for name in ablations["arch"]["models"]}  # not the base recipe
    data = {run: dict(zip(("source", "cell"), study.runs[run]["label"].split(" / "))) for run in runs_of(study, "data")}
    finetune = {
        "pattern": FINETUNE.replace("{source}", study.source),
        "tasks": study.tasks,
        "seeds": study.seeds,
        "ablation_tasks": ablations["glue_tasks"],
    }
    arch = [run for run in runs_of(study, "arch") if run not in own_recipe]
    return {
        "source": study.source,
        "main_vocab": main,
        "roles": claim_roles(study),
        "finetune": finetune,
        "glue": glue,
        "checkpoints": checkpoints,
        "arch": {study.runs[r]["label"]: checkpoint_dir(study, r, main) for r in arch},
        "schedule": {study.runs[r]["label"]: checkpoint_dir(study, r, main) for r in runs_of(study, "schedule")},
        "data": data,
        "swarm_study": {name: f"{swarm_study_dir(study)}/{name}.csv" for name in SWARM_EXPERIMENTS},
    }


def claim_inputs(study: Study, claim_id: str) -> list[str]:
    """The files one claim reads (its experiment alone); empty when the config defines nothing for it."""
    from cramswarm.report.claims import CLAIMS, MissingInput

    claim = next(c for c in CLAIMS if c.id == claim_id)
    try:
        return sorted(set(claim.inputs(claims_manifest(study))))
    except MissingInput:
        return []


def claims_inputs(study: Study, wildcards=None) -> list[str]:
    """Every file a claim reads: the experiments `snakemake claims` runs."""
    from cramswarm.report.claims import CLAIMS, MissingInput

    manifest, paths = claims_manifest(study), []
    for claim in CLAIMS:
        try:
            paths += claim.inputs(manifest)
        except MissingInput:  # a role or experiment this config lacks: the claim's row says not run
            pass
    return sorted(set(paths))


def names(study: Study) -> dict[str, Any]:
    """The names rules/report.smk and the Snakefile use: tables and figures are kept per source, so the synthetic
    and the real-data study never overwrite each other."""
    source = study.source
    return {
        "REPORT_RESOURCES": REPORT_RESOURCES,
        "GLUE_TABLES": [f"results/tables/{source}/glue.{ext}" for ext in ("csv", "md")],
        # our GLUE table with the published rows (report/paper_glue.csv) below it, and LaTeX
        "GLUE_PAPER_TABLES": [f"results/tables/{source}/glue_paper.{ext}" for ext in ("csv", "md", "tex")],
        "APART_TABLES": [  # the GLUE tables of the models kept apart (study: false)
            f"results/tables/{source}/glue_apart{end}"
            for end in (".csv", ".md", "_paper.csv", "_paper.md", "_paper.tex")
        ],
        "VOCAB_SWEEP_TABLES": [f"results/tables/{source}/vocab_sweep.{ext}" for ext in ("csv", "md")],
        "FIGURES": [f"results/figures/{source}/{name}.png" for name in ("mlm_loss_vs_tokens", "glue_by_task")],
        "VOCAB_FIGURE": f"results/figures/{source}/glue_vs_vocab.png",
        "RECORD": f"results/report/{source}",  # config used, software versions, benchmark summary (rule study_record)
        "CLAIMS": f"results/claims/{source}",
        **bind(study, finetune_results, pretrain_logs, pretraining, claims_manifest, claim_inputs, claims_inputs),
    }
