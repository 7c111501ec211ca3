# What each of the papers' claims reads, named in one manifest (read by claims_table and claims_available in
# rules/report.smk; the claims themselves: src/cramswarm/report/claims.py): the study's fine-tuning results and
# checkpoints, the ablation runs and the SWARM study.


CLAIMS = f"results/claims/{SOURCE}"


# the config files this run merged, in order, once each, relative to the working directory where they lie under it
CONFIG_FILES = list(
    dict.fromkeys(
        (
            Path(f).resolve().relative_to(Path.cwd())
            if Path(f).resolve().is_relative_to(Path.cwd())
            else Path(f).resolve()
        ).as_posix()
        for f in workflow.configfiles
    )
)


def claim_roles():
    """{role: model name} of the models the claims compare; a role the config lacks is left out."""
    groups = config["ablations"]["groups"]
    roles = {"crammed": groups["final_model"], "bert_original": groups["original_model"]}
    if "izsak" in MODELS:
        roles["izsak"] = "izsak"
    if BASELINES:
        roles["no_pretrain"] = BASELINES[0]
    swarm = [name for name, spec in MODELS.items() if spec["trainer"] == "swarm"]
    if swarm:
        roles["swarm"] = swarm[0]
    return roles


def claims_manifest():
    """What each claim reads (the manifest of cramswarm.report.claims): the study's fine-tuning results and
    checkpoints, the arch (the base recipe's shapes only), schedule and data ablation runs, the SWARM study."""
    glue, checkpoints = {}, {}
    for model, vocab in dict.fromkeys(STUDY_RUNS + SWEEP_RUNS):
        glue.setdefault(model, []).append(vocab)
        if MODELS[model]["pretrain"]:
            checkpoints.setdefault(model, {})[str(vocab)] = checkpoint_dir(model, vocab)
    own_recipe = {f"arch-{name}" for name in config["ablations"]["arch"]["models"]}  # not the base recipe
    data = {run: dict(zip(("source", "cell"), RUNS[run]["label"].split(" / "))) for run in runs_of("data")}
    finetune = {
        "pattern": FINETUNE.replace("{source}", SOURCE),
        "tasks": TASKS,
        "seeds": SEEDS,
        "ablation_tasks": config["ablations"]["glue_tasks"],
    }
    return {
        "source": SOURCE,
        "main_vocab": MAIN_VOCAB,
        "roles": claim_roles(),
        "finetune": finetune,
        "glue": glue,
        "checkpoints": checkpoints,
        "arch": {RUNS[r]["label"]: checkpoint_dir(r, MAIN_VOCAB) for r in runs_of("arch") if r not in own_recipe},
        "schedule": {RUNS[r]["label"]: checkpoint_dir(r, MAIN_VOCAB) for r in runs_of("schedule")},
        "data": data,
        "swarm_study": {name: f"{SWARM_STUDY}/{name}.csv" for name in SWARM_EXPERIMENTS},
    }


def claim_inputs(claim_id):
    """The files one claim reads (its experiment alone); empty when the config defines nothing for it."""
    from cramswarm.report.claims import CLAIMS as CLAIM_LIST, MissingInput

    claim = next(c for c in CLAIM_LIST if c.id == claim_id)
    try:
        return sorted(set(claim.inputs(claims_manifest())))
    except MissingInput:
        return []


def claims_inputs(wildcards=None):
    """Every file a claim reads: the experiments `snakemake claims` runs."""
    from cramswarm.report.claims import CLAIMS as CLAIM_LIST, MissingInput

    manifest, paths = claims_manifest(), []
    for claim in CLAIM_LIST:
        try:
            paths += claim.inputs(manifest)
        except MissingInput:  # a role or experiment this config lacks: the claim's row says not run
            pass
    return sorted(set(paths))
