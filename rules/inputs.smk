# The input and params functions of single stages (each section names the rule file that calls it), so that the
# rule files hold rules only (snakemake --lint); what several stages share is in rules/common.smk, the resources in
# rules/resources.smk, what each of the papers' claims reads in rules/claims_manifest.smk.


# --- Stage 1, data (rules/data.smk): the corpus stage's and the GLUE data's settings, the filter steps -------------


# The keys of the source's section the GLUE stage reads, so that a change to another (say, the corpus size)
# does not rerun it. (The corpus stage's keys, for every corpus name: cramswarm.config.corpus_spec.)
GLUE_SOURCE_KEYS = {
    "synthetic": ["seed", "glue_train_examples", "glue_validation_examples"],
    "hub": ["mirror", "glue", "glue_max_train_examples"],
}


def glue_source_spec(wildcards=None):
    """JSON of the chosen source with only the keys the GLUE stage reads."""
    section = {key: config[SOURCE][key] for key in GLUE_SOURCE_KEYS[SOURCE]}
    return json.dumps({"source": SOURCE, SOURCE: section}, sort_keys=True)


def corpus_spec_json(wildcards):
    """JSON of what the corpus stage reads for corpus ``wildcards.corpus`` (and nothing else)."""
    return json.dumps(corpus_spec(config, wildcards.corpus), sort_keys=True)


def filter_inputs(wildcards):
    """For filter_corpus, the corpus the step reads, and for a trash step the tokenizer that counts tokens."""
    step, parent = filter_step(wildcards)
    inputs = {"corpus": parent}
    if step.startswith("trash"):  # the corpus's own tokenizer: study family, main vocab, unfiltered corpus
        inputs["tokenizer"] = TOKENIZER.format(
            corpus=wildcards.corpus, filters="raw", family=config["tokenizer"]["family"], vocab=MAIN_VOCAB
        )
    return inputs


def filter_args(wildcards):
    """For filter_corpus, the step and its settings (dedup shingles and permutations included)."""
    step, _ = filter_step(wildcards)
    if step.startswith("trash"):
        return f"--kind trash --trash-cutoff {step[len('trash'):]}"
    d = config["data"]
    return (
        f"--kind dedup --dedup-threshold {step[len('dedup'):]} --shingle-words {d['dedup_shingle_words']} "
        f"--num-perm {d['dedup_permutations']}"
    )


# --- Stage 3, pretraining (rules/pretrain.smk): the LR taken from a sweep ------------------------------------------


def lr_sweep_summaries(wildcards):
    """{peak LR: summary.json} of the schedule-sweep runs a model with lr_from_sweep takes its LR from (else empty)."""
    runs = RUNS[wildcards.model]["lr_from"] or {}
    return {str(lr): f"{checkpoint_dir(run, MAIN_VOCAB)}/summary.json" for lr, run in runs.items()}


def lr_from_arg(wildcards):
    """The pretrain command's --lr-from option for a model with lr_from_sweep ('' for the others)."""
    summaries = lr_sweep_summaries(wildcards)
    return f"--lr-from {shlex.quote(json.dumps(summaries, sort_keys=True))}" if summaries else ""


# --- Stage 4, GLUE fine-tuning (rules/glue.smk) --------------------------------------------------------------------


def checkpoint_of(wildcards):
    return f"{checkpoint_dir(wildcards.model, wildcards.vocab)}/model.safetensors"


def protocol_json(wildcards):
    """The run's GLUE fine-tuning protocol (glue.protocols entry with its name, plus the shared settings)."""
    return json.dumps(RUNS[wildcards.model]["glue"], sort_keys=True)


def finetune_gpus(wildcards):
    return gpus(RUNS[wildcards.model]["glue"]["device"])


def warmup_data(wildcards):
    """The GLUE data whose train split sets every task's warmup (the protocol's warmup_from_task), or none."""
    task = RUNS[wildcards.model]["glue"].get("warmup_from_task")
    return [GLUE_DATA.format(source=wildcards.source, task=task)] if task else []


def warmup_arg(wildcards, input):
    return f"--warmup-data {input.warmup_data}" if input.warmup_data else ""


# --- SWARM (rules/swarm.smk): the swarm's settings, the srun placement, the swarm_study experiments ----------------


def swarm_json(wildcards):
    """What the swarm computes (its impl reaches the command as the resource SWARM_IMPL)."""
    return json.dumps(computed(config["swarm"]), sort_keys=True)


# swarm.impl.placement srun: one SLURM job of SWARM_TASKS (stages x peers_per_stage) tasks, one CPU per stage peer
# across nodes; the launcher runs in its batch step and starts every process as its own srun job step (--overlap;
# `mpi`: it calls srun itself). Threads - srun: one CPU per task; the emulation: one process; hivemind here: its
# processes.
SWARM_SRUN = config["swarm"]["impl"]["placement"] == "srun"
SWARM_THREADS = 1 if SWARM_SRUN or config["swarm"]["transport"] == "emulation" else 2
SWARM_SLURM = {"tasks": SWARM_TASKS, "mpi": "srun"} if SWARM_SRUN else {}


def swarm_study_inputs(wildcards):
    """The compression experiment trains on the study's blocks at the main vocab size."""
    return data_files(STUDY_DATA, MAIN_VOCAB) if SWARM_EXPERIMENTS[wildcards.name] == "compression" else {}


def swarm_study_settings(wildcards):
    return json.dumps(config["swarm_study"][SWARM_EXPERIMENTS[wildcards.name]], sort_keys=True)


def swarm_study_args(wildcards, input):
    if SWARM_EXPERIMENTS[wildcards.name] != "compression":
        return ""
    arch = shlex.quote(json.dumps(RUNS[SWARM_MODEL]["arch"], sort_keys=True))
    return f"--blocks {input.blocks} --tokenizer {input.tokenizer} --arch {arch}"


# --- Stage 5, report (rules/report.smk) ----------------------------------------------------------------------------


def finetune_results(wildcards=None, runs=STUDY_RUNS):
    return [
        FINETUNE.format(source=SOURCE, model=model, vocab=vocab, task=task, seed=seed)
        for model, vocab in runs
        for task in TASKS
        for seed in SEEDS
    ]


def pretrain_logs(wildcards=None):
    return [f"{checkpoint_dir(m, v)}/train_log.csv" for m, v in STUDY_RUNS if MODELS[m]["pretrain"]]


def pretraining(runs):
    """[model, vocab, summary.json] of the pretrained runs among `runs`: a GLUE table's tokens and data passes."""
    return [[m, v, f"{checkpoint_dir(m, v)}/summary.json"] for m, v in runs if MODELS[m]["pretrain"]]


# --- Stage 6, ablations (rules/ablations.smk): each study's runs and the data table's stage reports ----------------


ABLATIONS = f"results/ablations/{SOURCE}"


def run_dirs_json(study):
    """{label: checkpoint folder} of one ablation study's runs, for the report command."""
    return json.dumps({RUNS[r]["label"]: checkpoint_dir(r, MAIN_VOCAB) for r in runs_of(study)})


def ablation_checkpoints(study):
    return [f"{checkpoint_dir(r, MAIN_VOCAB)}/summary.json" for r in runs_of(study)]


def ablation_finetunes(study):
    return [
        FINETUNE.format(source=SOURCE, model=r, vocab=MAIN_VOCAB, task=task, seed=seed)
        for r in runs_of(study)
        for task in config["ablations"]["glue_tasks"]
        for seed in SEEDS
    ]


def data_reports(recipe):
    """The stage reports of a data recipe's chain at the main vocab size (only the filters it switches on)."""
    keys = {**data_wildcards(recipe), "vocab": MAIN_VOCAB}
    reports = {"corpus": "results/data/{corpus}/corpus.report.json".format(**keys)}
    steps = keys["filters"].split("-") if keys["filters"] != "raw" else []
    for i, step in enumerate(steps):
        kind = "trash" if step.startswith("trash") else "dedup"
        reports[kind] = "results/data/{corpus}/{chain}/report.json".format(chain="-".join(steps[: i + 1]), **keys)
    packed = "results/packed/{corpus}/{filters}/{family}-v{vocab}".format(**keys)
    reports["pack"] = f"{packed}/packed.report.json"
    reports["order"] = f"{packed}/{keys['order']}/report.json"
    return reports


def data_runs_json():
    """{run: label, source, cell, data recipe, summary, stage reports} of the Table 2 runs."""
    runs = {}
    for run in runs_of("data"):
        spec = RUNS[run]
        source, cell = spec["label"].split(" / ")
        runs[run] = {
            "label": spec["label"],
            "source": source,
            "cell": cell,
            "data": spec["data"],
            "summary": f"{checkpoint_dir(run, MAIN_VOCAB)}/summary.json",
            "reports": data_reports(spec["data"]),
        }
    return json.dumps(runs)  # in config order (sources, then cells): the table's row order
