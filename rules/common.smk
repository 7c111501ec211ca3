# Config validation and every helper function of the workflow, so that the other .smk files hold rules only:
# paths, input and params functions (the resources each job asks a cluster for: rules/resources.smk).
import json
import math
import os
import re
import shlex
import shutil
import sys
from pathlib import Path

# Import the package from this checkout (not from whichever checkout pip's editable install points at).
sys.path.insert(0, str(Path(workflow.basedir) / "src"))

from cramswarm.config import (
    ConfigError,
    corpus_spec,
    data_recipe,
    data_wildcards,
    resolve_runs,
    swarm_study_model,
    validate_config,
)
from cramswarm.glue.tasks import TASK_NAMES

try:
    validate_config(config, Path(workflow.basedir) / "config" / "schema.yaml", base_dir=Path.cwd())
except ConfigError as err:
    raise WorkflowError(str(err))

# Jobs import the package from this checkout even inside a conda env (--sdm conda) that lacks it; cluster jobs
# inherit it (the SLURM plugin exports the environment). No `envvars:` declaration: that directive asserts
# variables the user must set, and PYTHONPATH is optional (extended here, never required).
os.environ.update(
    PYTHONPATH=os.pathsep.join(filter(None, [str(Path(workflow.basedir) / "src"), os.environ.get("PYTHONPATH")]))
)

SOURCE = config["source"]
VOCABS = config["tokenizer"]["vocab_sizes"]
MAIN_VOCAB = config["tokenizer"]["main_vocab_size"]
TASKS = config["glue"]["tasks"]
SEEDS = config["glue"]["seeds"]
GLUE_JOBS = config["glue"]["jobs"]  # per_seed | per_task | per_model: the fine-tuning runs one job holds
MODELS = config["models"]
BASELINES = [name for name, spec in MODELS.items() if not spec["pretrain"]]
NOT_SWEPT = [name for name, spec in MODELS.items() if spec["pretrain"] and not spec["vocab_sweep"]]
# Every checkpoint the workflow can build: the study's models plus the ablation runs, each with its full
# arch and recipe (cramswarm.config.resolve_runs names them: arch-*, sched-*, groups-*).
RUNS = resolve_runs(config)

# (model, vocab) pairs of the study: vocab-sweep models at every size, the others at the main size.
STUDY_RUNS = [
    (name, vocab) for name, spec in MODELS.items() for vocab in (VOCABS if spec["vocab_sweep"] else [MAIN_VOCAB])
]

# The data chain (docs/data.md), each file keyed by exactly the settings it depends on:
# {corpus} a corpus name; {filters} raw | trash<cutoff> | dedup<threshold> | trash<cutoff>-dedup<threshold>;
# {family} the tokenizer model; {order} the block order. Runs that share these share the files.
CORPUS = "results/data/{corpus}/corpus.parquet"
FILTERED = "results/data/{corpus}/{filters}/corpus.parquet"
TOKENIZER = "results/tokenizers/{corpus}/{filters}/{family}-v{vocab}/tokenizer.json"
PACKED = "results/packed/{corpus}/{filters}/{family}-v{vocab}/packed.npy"
BLOCKS = "results/packed/{corpus}/{filters}/{family}-v{vocab}/{order}/blocks.npy"
GLUE_DATA = "results/data/{source}/glue/{task}.parquet"
STUDY_DATA = data_recipe(config)  # the data recipe of the study's models
CORPORA = ["synthetic", "hub", *config["data"]["corpora"]]
FINETUNE = "results/glue/{source}/{model}/v{vocab}/{task}/s{seed}.json"
# Tables and figures are kept per source, so the synthetic and the real-data study never overwrite each other.
GLUE_TABLES = [f"results/tables/{SOURCE}/glue.{ext}" for ext in ("csv", "md")]
# Our GLUE table with the published rows (report/paper_glue.csv) below it, and LaTeX.
GLUE_PAPER_TABLES = [f"results/tables/{SOURCE}/glue_paper.{ext}" for ext in ("csv", "md", "tex")]
VOCAB_SWEEP_TABLES = [f"results/tables/{SOURCE}/vocab_sweep.{ext}" for ext in ("csv", "md")]
FIGURES = [f"results/figures/{SOURCE}/{name}.png" for name in ("mlm_loss_vs_tokens", "glue_by_task", "glue_vs_vocab")]
RECORD = f"results/report/{SOURCE}"  # config used, software versions, benchmark summary (rule study_record)


wildcard_constraints:
    source="synthetic|hub",
    corpus="|".join(map(re.escape, CORPORA)),
    filters=r"raw|trash[0-9.]+|dedup[0-9.]+|trash[0-9.]+-dedup[0-9.]+",
    family="wordpiece|bpe|unigram",
    order="random|sentence-length|unigram|unigram-reverse",
    vocab=r"\d+",
    seed=r"\d+",
    task="|".join(TASK_NAMES),
    model="|".join(map(re.escape, RUNS)),


def checkpoint_dir(model, vocab):
    """results/pretrain/... (rule pretrain), results/swarm/... (rule swarm_pretrain) or results/init/... (init_model)."""
    spec = RUNS[model]
    kind = ("swarm" if spec["trainer"] == "swarm" else "pretrain") if spec["pretrain"] else "init"
    return f"results/{kind}/{SOURCE}/{model}/v{vocab}"


def corpus_variant(wildcards):
    """The corpus file a tokenizer or packing job reads: the raw corpus or one of its filtered variants."""
    pattern = CORPUS if wildcards.filters == "raw" else FILTERED
    return pattern.format(corpus=wildcards.corpus, filters=wildcards.filters)


def data_files(recipe, vocab):
    """{tokenizer, blocks} of a data recipe at one vocab size."""
    keys = {**data_wildcards(recipe), "vocab": vocab}
    return {"tokenizer": TOKENIZER.format(**keys), "blocks": BLOCKS.format(**keys)}


def run_data(wildcards):
    """{tokenizer, blocks} a run's pretraining (or random init) reads."""
    return data_files(RUNS[wildcards.model]["data"], wildcards.vocab)


def lr_sweep_summaries(wildcards):
    """{peak LR: summary.json} of the schedule-sweep runs a model with lr_from_sweep takes its LR from (else empty)."""
    runs = RUNS[wildcards.model]["lr_from"] or {}
    return {str(lr): f"{checkpoint_dir(run, MAIN_VOCAB)}/summary.json" for lr, run in runs.items()}


def lr_from_arg(wildcards):
    """The pretrain command's --lr-from option for a model with lr_from_sweep ('' for the others)."""
    summaries = lr_sweep_summaries(wildcards)
    return f"--lr-from {shlex.quote(json.dumps(summaries, sort_keys=True))}" if summaries else ""


def checkpoint_of(wildcards):
    return f"{checkpoint_dir(wildcards.model, wildcards.vocab)}/model.safetensors"


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


def arch_json(wildcards):
    return json.dumps(RUNS[wildcards.model]["arch"], sort_keys=True)


def recipe_json(wildcards):
    return json.dumps(RUNS[wildcards.model]["recipe"], sort_keys=True)


def protocol_json(wildcards):
    """The run's GLUE fine-tuning protocol (glue.protocols entry with its name, plus the shared settings)."""
    return json.dumps(RUNS[wildcards.model]["glue"], sort_keys=True)


def runs_of(study):
    return [name for name, run in RUNS.items() if run["study"] == study]


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


def finetune_results(wildcards=None):
    return [
        FINETUNE.format(source=SOURCE, model=model, vocab=vocab, task=task, seed=seed)
        for model, vocab in STUDY_RUNS
        for task in TASKS
        for seed in SEEDS
    ]


def pretrain_logs(wildcards=None):
    return [f"{checkpoint_dir(m, v)}/train_log.csv" for m, v in STUDY_RUNS if MODELS[m]["pretrain"]]


def vocab_size(wildcards):
    return int(wildcards.vocab)


def gpus(device):
    """GPUs a job holds (the `gpu` resource): none for device cpu, one for cuda, and for auto one only where
    this machine has a GPU driver. profiles/default caps the sum at 1, so local GPU jobs run one at a time
    while CPU-only machines keep running them in parallel; profiles/slurm sets the count on a cluster."""
    if device == "auto":
        return int(any(shutil.which(tool) for tool in ("nvidia-smi", "rocm-smi")))
    return int(device == "cuda")


def pretrain_processes_per_node(wildcards):
    """Data-parallel processes of a pretraining job on each node (pretrain.devices): the rule's threads, one CPU
    each; profiles/slurm multiplies its GPUs per process by this."""
    return RUNS[wildcards.model]["recipe"]["devices"]


def pretrain_nodes(wildcards):
    return RUNS[wildcards.model]["recipe"]["nodes"]


def pretrain_gpus(wildcards):
    """GPUs per data-parallel process (gpus(); under profiles/slurm its CRAMSWARM_SLURM_GPUS, which the profile
    passes on as CRAMSWARM_GPUS_PER_PROCESS) x processes (pretrain.devices x pretrain.nodes)."""
    recipe = RUNS[wildcards.model]["recipe"]
    site = os.environ.get("CRAMSWARM_GPUS_PER_PROCESS")
    per_process = int(site) if site is not None else gpus(recipe["device"])
    return per_process * recipe["devices"] * recipe["nodes"]


def finetune_gpus(wildcards):
    return gpus(RUNS[wildcards.model]["glue"]["device"])


# --- Functions of single rules, kept here so the rule files hold rules only -----------------------------------


def filter_step(wildcards):
    """The last filter of a {filters} chain (the step this job applies) and the corpus it reads."""
    *before, step = wildcards.filters.split("-")
    parent = "-".join(before) or "raw"
    return step, (CORPUS if parent == "raw" else FILTERED).format(corpus=wildcards.corpus, filters=parent)


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


def swarm_json(wildcards):
    return json.dumps(config["swarm"], sort_keys=True)


# swarm.placement srun: the job is one SLURM job of stages x peers_per_stage tasks (across nodes: one CPU per stage
# peer); the launcher runs in its batch step and starts every process (bootstrap, peers, trainers) as its own srun
# job step (--overlap: the trainers and the bootstrap share the peers' CPUs). `mpi` tells the SLURM plugin the rule
# calls srun itself (its job step runs the rule as is, not under `srun -n1`). Other placements run one process.
SWARM_TASKS = config["swarm"]["stages"] * config["swarm"]["peers_per_stage"]
SWARM_SRUN = config["swarm"]["placement"] == "srun"
SWARM_SLURM = {"tasks": SWARM_TASKS, "mpi": "srun"} if SWARM_SRUN else {}

# named target swarm_study: the paper's experiments in miniature (one CSV each), then their tables and figures
SWARM_STUDY = f"results/swarm_study/{SOURCE}"
# CSV / figure name (as cramswarm.report.swarm_figures names them) -> the swarm_study config section it runs
SWARM_EXPERIMENTS = {
    "square_cube": "square_cube",
    "wiring_throughput": "wiring",
    "failures_timeline": "failures",
    "rebalancing_recovery": "rebalancing",
    "compression_loss": "compression",
    "sim_scale": "sim_scale",
}
SWARM_MODEL = swarm_study_model(config)  # the model the compression experiment splits (cramswarm.config)


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


ABLATIONS = f"results/ablations/{SOURCE}"


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


# --- The papers' claims, checked (rule claims_table, src/cramswarm/report/claims.py) ----------------------------
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
    for model, vocab in STUDY_RUNS:
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
