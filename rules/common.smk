# Config validation and what several stages share: the config's names, the file paths, the wildcards and the
# functions more than one rule file calls. A function of one stage's rules is in rules/inputs.smk, what the claims
# read in rules/claims_manifest.smk, the resources each job asks a cluster for in rules/resources.smk.
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
from cramswarm.impl import computed
from cramswarm.glue_tasks import TASK_NAMES

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
# How the runs execute (pretrain.impl, swarm.impl; cramswarm.impl): the same for every run, handed to the commands as
# string resources of their rules (Snakemake's rerun triggers read params, never resources), so changing one reruns
# nothing.
IMPL = config["pretrain"]["impl"]
PRETRAIN_IMPL = json.dumps(IMPL, sort_keys=True, separators=(",", ":"))  # compact: one token in a job's printout
SWARM_IMPL = json.dumps(config["swarm"]["impl"], sort_keys=True, separators=(",", ":"))
# The config less its impl sections: what the study computed, as its record holds it (each summary.json holds its
# run's impl)
COMPUTED = {**config, "pretrain": computed(config["pretrain"]), "swarm": computed(config["swarm"])}

# (model, vocab) pairs of the study (`all`): every model at the main vocab size, but those kept apart (study: false:
# the named target `apart`)
STUDY_RUNS = [(name, MAIN_VOCAB) for name in MODELS if MODELS[name]["study"]]
APART_RUNS = [(name, MAIN_VOCAB) for name in MODELS if not MODELS[name]["study"]]
APART_TABLES = [
    f"results/tables/{SOURCE}/glue_apart{end}" for end in (".csv", ".md", "_paper.csv", "_paper.md", "_paper.tex")
]
# ... and of the vocab sweep (`ablation_vocab`, Figure 3): the vocab-sweep models at every size, and the random-init
# baselines at the main size (the figure's reference line).
SWEEP_RUNS = [(name, vocab) for name in MODELS for vocab in VOCABS if MODELS[name]["vocab_sweep"]] + [
    (name, MAIN_VOCAB) for name in BASELINES
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
FIGURES = [f"results/figures/{SOURCE}/{name}.png" for name in ("mlm_loss_vs_tokens", "glue_by_task")]
VOCAB_FIGURE = f"results/figures/{SOURCE}/glue_vs_vocab.png"
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


def arch_json(wildcards):
    return json.dumps(RUNS[wildcards.model]["arch"], sort_keys=True)


def recipe_json(wildcards):
    return json.dumps(RUNS[wildcards.model]["recipe"], sort_keys=True)


def runs_of(study):
    return [name for name, run in RUNS.items() if run["study"] == study]


# Local runs: every job holds `cpu_cores` (its threads; profiles/default) out of this machine's cores, whatever --cores
# says, so `snakemake --cores 8` on 2 cores runs two one-thread jobs at a time, the longest first (`priority`), instead
# of eight at a quarter of a core each with the longest (the critical path) finishing last. Cluster runs (--jobs) and
# an explicit --resources cpu_cores=N are left as they are.
if workflow.global_resources["_nodes"].value is None and "cpu_cores" not in workflow.global_resources:
    workflow.register_resource("cpu_cores", max(len(os.sched_getaffinity(0)), 2))  # 2: the swarm rule's threads


def gpus(device):
    """GPUs a job holds (the `gpu` resource): none for device cpu, one for cuda, and for auto one only where
    this machine has a GPU driver. profiles/default caps the sum at 1, so local GPU jobs run one at a time
    while CPU-only machines keep running them in parallel; profiles/slurm sets the count on a cluster."""
    if device == "auto":
        return int(any(shutil.which(tool) for tool in ("nvidia-smi", "rocm-smi")))
    return int(device == "cuda")


def pretrain_gpus(wildcards):
    """GPUs per data-parallel process (gpus(); under profiles/slurm its CRAMSWARM_SLURM_GPUS, which the profile
    passes on as CRAMSWARM_GPUS_PER_PROCESS) x processes (pretrain.impl devices x nodes)."""
    site = os.environ.get("CRAMSWARM_GPUS_PER_PROCESS")
    per_process = int(site) if site is not None else gpus(IMPL["device"])
    return per_process * IMPL["devices"] * IMPL["nodes"]


def filter_step(wildcards):
    """The last filter of a {filters} chain (the step this job applies) and the corpus it reads."""
    *before, step = wildcards.filters.split("-")
    parent = "-".join(before) or "raw"
    return step, (CORPUS if parent == "raw" else FILTERED).format(corpus=wildcards.corpus, filters=parent)


# --- SWARM's names that the resources and the claims read too (rules/swarm.smk; its functions: rules/inputs.smk) ---
# the stage peers of a swarm job (with swarm.impl.placement srun, its SLURM tasks)
SWARM_TASKS = config["swarm"]["stages"] * config["swarm"]["peers_per_stage"]
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
