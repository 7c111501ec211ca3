# The resources every job rule asks a cluster for (mem_mb, runtime), estimated from the config. Included by the
# Snakefile after common.smk (whose names it uses) and before the rule files (which call it). Every job rule
# declares `mem_mb` (MB, sbatch --mem) and `runtime` (minutes, sbatch --time) with the functions below: they read
# the config and the wildcards, the arithmetic (rates, floors, margins) is cramswarm.resources.
# profiles/slurm adds only site values (partition, account, GPUs). A site that knows better sets a rule's values in
# a copy of profiles/slurm (set-resources: <rule>: {runtime: ..., mem_mb: ...}), which takes precedence over these.
from cramswarm import resources as est
from cramswarm.resources import BASE_MINUTES, PYTHON_MB, TORCH_MB, mb, minutes

REPORT_RESOURCES = {"mem_mb": 2 * PYTHON_MB, "runtime": BASE_MINUTES}  # tables and figures: seconds of work
BLOCK_TOKENS = config["packing"]["block_tokens"]


def device_of(device):
    """cpu | cuda: the device a job's time is estimated for (auto: cuda only where gpus() sees a GPU here)."""
    return "cuda" if gpus(device) else "cpu"


def corpus_documents(corpus):
    """Documents in corpus `corpus` (cramswarm.resources.corpus_documents)."""
    return est.corpus_documents(corpus_spec(config, corpus))


def data_mem_mb(wildcards, factor=1):
    """A streaming data stage: its batches stay within data.memory_cap_mb (MiB); pyarrow's buffers and the
    written row groups come on top, hence twice the cap (`factor` times that for a stage with more to hold)."""
    return mb(PYTHON_MB * 1e6 + factor * 2 * config["data"]["memory_cap_mb"] * 2**20)


def data_runtime(wildcards):
    """A streaming data stage: every document of the corpus at DOCS_PER_S_FLOOR."""
    return minutes(corpus_documents(wildcards.corpus) / est.DOCS_PER_S_FLOOR)


def filter_mem_mb(wildcards):
    """A filter step; dedup also holds a band column per document in memory."""
    step, _ = filter_step(wildcards)
    extra = est.DEDUP_BYTES_PER_DOC * corpus_documents(wildcards.corpus) if step.startswith("dedup") else 0
    return data_mem_mb(wildcards) + mb(extra)


def filter_threads(wildcards):
    """Processes of a filter step: dedup's MinHash pass runs in up to 4 (the same output for any number)."""
    step, _ = filter_step(wildcards)
    return 4 if step.startswith("dedup") else 1


def tokenizer_mem_mb(wildcards):
    """Tokenizer training counts words and pairs over the whole corpus, outside the data cap: twice a stage's."""
    return data_mem_mb(wildcards, factor=2)


def training_mem_mb(arch, vocab, sequences, seq_len, device, **kwargs):
    """cramswarm.resources.training_mem_mb on the device `device` (cpu | cuda | auto) resolves to."""
    return est.training_mem_mb(arch, vocab, sequences, seq_len, device_of(device), **kwargs)


def critical_path_priority(wildcards):
    """A pretraining job's priority: its estimated seconds, so the longest (the study's critical path: the run, then
    its fine-tuning) starts first when cores are scarce; fine-tuning and data jobs keep priority 0."""
    return int(pretrain_seconds(wildcards.model, int(wildcards.vocab)))


# The GPU model a cluster's jobs run on (profiles/slurm: CRAMSWARM_SLURM_GPU_MODEL, e.g. A100, V100, "H100 PCIe"): a
# normalised budget (reference_card, exaflop) runs value x peak(reference) / peak(this card) seconds, so the job's
# runtime is that. Unset: the card the budget is written for (an A6000-day runs 24 h), which a faster card only
# shortens; a slower one (V100: 29.7 h, A4000: 42 h) needs the model declared or its jobs hit the time limit.
GPU_PEAK_TFLOPS = est.card_peak(os.environ.get("CRAMSWARM_GPU_MODEL"))


def pretrain_seconds(run, vocab):
    device = device_of(IMPL["device"])
    return est.pretrain_seconds(RUNS[run]["recipe"], RUNS[run]["arch"], vocab, BLOCK_TOKENS, device, GPU_PEAK_TFLOPS)


def pretrain_runtime(wildcards):
    return minutes(pretrain_seconds(wildcards.model, int(wildcards.vocab)))


def pretrain_mem_mb(wildcards):
    """Per node (sbatch --mem): one training process per pretrain.impl.devices, each with its micro-batch slice."""
    share = RUNS[wildcards.model]["recipe"]["micro_batch_sequences"] // (IMPL["devices"] * IMPL["nodes"])
    return IMPL["devices"] * training_mem_mb(
        RUNS[wildcards.model]["arch"], int(wildcards.vocab), share, BLOCK_TOKENS, IMPL["device"]
    )


def pretrain_gpu_mem_mb(wildcards):
    """GPU memory (MB) one data-parallel process of a pretraining run holds at its share of the micro-batch: the
    `gpu_mem_mb` resource (0 for a CPU run). A cluster maps it to a card (a constraint or gres in a copy of
    profiles/slurm); the estimate is cramswarm.resources.gpu_mem_mb."""
    if not pretrain_gpus(wildcards):
        return 0
    share = RUNS[wildcards.model]["recipe"]["micro_batch_sequences"] // (IMPL["devices"] * IMPL["nodes"])
    fused = IMPL["attention_backend"] != "math"
    return est.gpu_mem_mb(RUNS[wildcards.model]["arch"], int(wildcards.vocab), share, BLOCK_TOKENS, fused)


def init_mem_mb(wildcards):
    """Random weights and their saved copy (fp32): 8 B per parameter."""
    return training_mem_mb(RUNS[wildcards.model]["arch"], int(wildcards.vocab), 0, 0, "cuda", bytes_per_param=8)


def swarm_seconds(wildcards):
    """SWARM pretraining: a seconds budget as it is; any other at half the single-process estimate's rate (pipeline,
    compression, routing, every peer on the job's own CPUs or GPUs)."""
    seconds = pretrain_seconds(wildcards.model, int(wildcards.vocab))
    return seconds if RUNS[wildcards.model]["recipe"]["budget"]["unit"] == "seconds" else 2 * seconds


def swarm_priority(wildcards):
    """The swarm run's priority: the core-seconds it claims (its estimated seconds x its threads). Snakemake's
    scheduler weighs the jobs it starts together by the sum of their priorities, so two single-core runs of the same
    budget outweigh a two-core job of their own estimate; with this weight the swarm run starts first, before
    single-core jobs keep one of its cores busy to the end of the study."""
    return int(swarm_seconds(wildcards) * SWARM_THREADS)


def swarm_runtime(wildcards):
    """SWARM pretraining's runtime: its estimated seconds plus the peers' start-up."""
    return minutes(swarm_seconds(wildcards) + config["swarm"]["impl"]["startup_timeout_s"])


def swarm_mem_mb(wildcards):
    """Every peer holds one stage's share of the model (a replica of the whole model per peers_per_stage), each
    hivemind peer is a torch process of its own; the rule's process assembles the whole model. Per node of the job
    (sbatch --mem), counted as if every peer ran on one node."""
    recipe, swarm = RUNS[wildcards.model]["recipe"], config["swarm"]
    processes = 1 + (SWARM_TASKS if swarm["transport"] == "hivemind" else 0)
    model = training_mem_mb(
        RUNS[wildcards.model]["arch"],
        int(wildcards.vocab),
        recipe["micro_batch_sequences"],
        BLOCK_TOKENS,
        IMPL["device"],
        copies=1 + swarm["peers_per_stage"],
    )
    return model + mb((processes - 1) * TORCH_MB * 1e6)


def glue_rows(task):
    """(train, validation) rows the fine-tuning of `task` reads."""
    return est.glue_rows(task, SOURCE, config[SOURCE])


def glue_data_runtime(wildcards):
    return minutes(sum(glue_rows(wildcards.task)) / est.DOCS_PER_S_FLOOR)


def glue_data_mem_mb(wildcards):
    return mb(2 * PYTHON_MB * 1e6)


def finetune_tasks(wildcards):
    """The GLUE tasks one fine-tuning job runs: its own task, or (rule finetune_model) every task."""
    return [wildcards.task] if "task" in wildcards.keys() else TASKS


def finetune_runtime(wildcards):
    """Every epoch over the train rows (padded to max_length_tokens) plus a validation pass per epoch, for each
    task and seed the job runs."""
    protocol = RUNS[wildcards.model]["glue"]
    seeds = 1 if GLUE_JOBS == "per_seed" else len(SEEDS)  # per_task and per_model jobs run every seed
    rows = [glue_rows(task) for task in finetune_tasks(wildcards)]
    arch, vocab, device = RUNS[wildcards.model]["arch"], int(wildcards.vocab), device_of(protocol["device"])
    return minutes(est.finetune_seconds(arch, vocab, protocol, rows, device, seeds))


def finetune_mem_mb(wildcards):
    """The model in training at the protocol's batch size, plus the largest task's rows as token ids (8 B per
    token; a job holds one task's rows at a time)."""
    protocol = RUNS[wildcards.model]["glue"]
    seq = protocol["max_length_tokens"]
    model = training_mem_mb(
        RUNS[wildcards.model]["arch"], int(wildcards.vocab), protocol["batch_size"], seq, protocol["device"]
    )
    return model + mb(8 * seq * max(sum(glue_rows(task)) for task in finetune_tasks(wildcards)))


def swarm_experiment_runtime(wildcards):
    """A swarm_study experiment's runtime (cramswarm.swarm_study.runtime.experiment_seconds, the compression
    experiment on the study's SWARM model)."""
    from cramswarm.swarm_study.runtime import experiment_seconds

    section = SWARM_EXPERIMENTS[wildcards.name]
    arch = RUNS[SWARM_MODEL]["arch"]
    settings = config["swarm_study"][section]
    return minutes(experiment_seconds(section, settings, arch, MAIN_VOCAB, BLOCK_TOKENS, device_of("auto")))


def preflight_mem_mb(wildcards):
    """The preflight holds one model at a time at its micro-batch, and a data stage's working set."""
    return max(
        [data_mem_mb(wildcards, factor=2)]
        + [
            training_mem_mb(run["arch"], MAIN_VOCAB, run["recipe"]["micro_batch_sequences"], BLOCK_TOKENS, "cpu")
            for run in RUNS.values()
            if run["study"] == "models"
        ]
    )
