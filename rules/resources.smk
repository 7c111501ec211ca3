# The resources every job rule asks a cluster for (mem_mb, runtime), estimated from the config. Included by the
# Snakefile right after common.smk (whose names it uses) and before the rule files (which call it).

# Every job rule declares `mem_mb` (MB, sbatch --mem) and `runtime` (minutes, sbatch --time) with the functions
# below; profiles/slurm adds only site values (partition, account, GPUs). The estimates err on the generous side
# (a job cut off at its time limit loses its allocation; only pretraining resumes). They assume the slowest rates
# below, far under the measured ones (README: the 2-core CPU trains the default crammed model, 1.4-1.8 M
# parameters, at 18-20 k tokens/s, about 2e11 FLOP/s). A site that knows better sets a rule's values in a copy
# of profiles/slurm (set-resources: <rule>: {runtime: ..., mem_mb: ...}), which takes precedence over these.
FLOPS_FLOOR = {"cpu": 2e10, "cuda": 5e12}  # model FLOP/s assumed per device (cuda: an older GPU at low utilisation)
DOCS_PER_S_FLOOR = 500  # documents per second a streaming data stage gets through (C4-sized documents)
UNCAPPED_DOCUMENTS = 100_000_000  # documents assumed of a hub dataset with max_documents: null
DEDUP_BYTES_PER_DOC = 64  # dedup's in-memory band column and its sort (cramswarm.data.filters.dedup: ~25 B)
PYTHON_MB = 1000  # memory floor of a job: Python, pyarrow, tokenizers
TORCH_MB = 2000  # memory floor of a job that imports torch
BASE_MINUTES = 10  # start-up, imports and writing outputs, every job
TRAINING_MARGIN = 1.25  # pretraining and fine-tuning: estimated time x this (evaluations, saves, stragglers)
SECONDS_BUDGET_MARGIN = 1.05  # a seconds budget x this: loading before its clock starts, the step in flight at its end
REPORT_RESOURCES = {"mem_mb": 2 * PYTHON_MB, "runtime": BASE_MINUTES}  # tables and figures: seconds of work
# GLUE train / validation rows per task (the hub's nyu-mll/glue; MNLI: matched + mismatched validation)
GLUE_ROWS = {
    "cola": (8551, 1043),
    "sst2": (67349, 872),
    "mrpc": (3668, 408),
    "qqp": (363846, 40430),
    "stsb": (5749, 1500),
    "mnli": (392702, 19647),
    "qnli": (104743, 5463),
    "rte": (2490, 277),
    "wnli": (635, 71),
}


def mb(n_bytes):
    """Bytes -> MB (SLURM's --mem unit), rounded up to 100 MB."""
    return 100 * math.ceil(n_bytes / 1e8)


def minutes(seconds):
    """Seconds of work -> a job's runtime in minutes (what Snakemake >= 9.20 reads), plus the start-up allowance."""
    return BASE_MINUTES + math.ceil(seconds / 60)


def device_of(device):
    """cpu | cuda: the device a job's time is estimated for (auto: cuda only where gpus() sees a GPU here)."""
    return "cuda" if gpus(device) else "cpu"


def corpus_documents(corpus):
    """Documents in corpus `corpus` (a bound: hub datasets with max_documents: null count UNCAPPED_DOCUMENTS)."""
    spec = corpus_spec(config, corpus)
    if spec["source"] == "synthetic":
        return spec["synthetic"]["corpus_documents"]
    return sum(d["max_documents"] or UNCAPPED_DOCUMENTS for d in spec["hub"]["corpus"])


def data_mem_mb(wildcards, factor=1):
    """A streaming data stage: its batches stay within data.memory_cap_mb (MiB); pyarrow's buffers and the
    written row groups come on top, hence twice the cap (`factor` times that for a stage with more to hold)."""
    return mb(PYTHON_MB * 1e6 + factor * 2 * config["data"]["memory_cap_mb"] * 2**20)


def data_runtime(wildcards):
    """A streaming data stage: every document of the corpus at DOCS_PER_S_FLOOR."""
    return minutes(corpus_documents(wildcards.corpus) / DOCS_PER_S_FLOOR)


def filter_mem_mb(wildcards):
    """A filter step; dedup also holds a band column per document in memory."""
    step, _ = filter_step(wildcards)
    extra = DEDUP_BYTES_PER_DOC * corpus_documents(wildcards.corpus) if step.startswith("dedup") else 0
    return data_mem_mb(wildcards) + mb(extra)


def tokenizer_mem_mb(wildcards):
    """Tokenizer training counts words and pairs over the whole corpus, outside the data cap: twice a stage's."""
    return data_mem_mb(wildcards, factor=2)


def model_params(arch, vocab):
    """(matmul parameters a token passes through, all parameters) of a crammed-BERT arch at `vocab`: per layer
    the attention projections (4 h^2) and the FFN (2 h x intermediate, the gated FFN's halving ignored), plus the
    decoder (h x vocab); all parameters add the embeddings. An upper bound of cramswarm.models' exact count."""
    h, layers = arch["hidden_size"], arch["layers"]
    matmul = layers * (4 * h * h + 2 * h * arch["intermediate_size"]) + h * vocab
    return matmul, matmul + h * (vocab + arch["max_positions"])


def training_seconds(arch, vocab, tokens, seq_len, device):
    """Forward and backward over `tokens` tokens: 6 FLOPs per matmul parameter and token, plus attention
    (12 x layers x seq_len x h per token), at the device's FLOPS_FLOOR."""
    matmul, _ = model_params(arch, vocab)
    per_token = 6 * matmul + 12 * arch["layers"] * seq_len * arch["hidden_size"]
    return per_token * tokens / FLOPS_FLOOR[device_of(device)]


def training_mem_mb(arch, vocab, sequences, seq_len, device, copies=1, bytes_per_param=28):
    """Host memory of a training job: torch, and per model copy its weights, gradients, two Adam moments and a
    saved-state copy (`bytes_per_param`: 28 in training). On the CPU also the activations of `sequences` x `seq_len` tokens
    (fp32, about 64 B per token and width plus the attention maps per layer); on a GPU they stay there."""
    _, params = model_params(arch, vocab)
    n_bytes = copies * bytes_per_param * params
    if device_of(device) == "cpu":
        per_layer = sequences * seq_len * (64 * arch["hidden_size"] + 8 * arch["heads"] * seq_len)
        n_bytes += copies * arch["layers"] * per_layer
    return mb(TORCH_MB * 1e6 + 2 * n_bytes)  # x2: allocator slack and the copies made while saving


def budget_tokens(recipe):
    """Tokens a token or step budget trains on (a seconds budget: None)."""
    budget = recipe["budget"]
    if budget["unit"] == "seconds":
        return None
    per_step = recipe["batch_sequences"] * config["packing"]["block_tokens"]
    return budget["value"] * (per_step if budget["unit"] == "steps" else 1)


def pretrain_seconds(run, vocab):
    """A run's pretraining: a seconds budget as it is (compile time counts against it), a token or step budget
    at the FLOPS_FLOOR; plus the held-out evaluations (forward passes only)."""
    recipe, arch = RUNS[run]["recipe"], RUNS[run]["arch"]
    seq = config["packing"]["block_tokens"]
    evals = (
        training_seconds(arch, vocab, recipe["eval_points"] * recipe["eval_blocks"] * seq, seq, recipe["device"]) / 3
    )
    tokens = budget_tokens(recipe)
    if tokens is None:
        return SECONDS_BUDGET_MARGIN * recipe["budget"]["value"] + TRAINING_MARGIN * evals
    return TRAINING_MARGIN * (training_seconds(arch, vocab, tokens, seq, recipe["device"]) + evals)


def pretrain_runtime(wildcards):
    return minutes(pretrain_seconds(wildcards.model, int(wildcards.vocab)))


def pretrain_mem_mb(wildcards):
    """Per node (sbatch --mem): one training process per pretrain.devices, each with its slice of a micro-batch."""
    recipe = RUNS[wildcards.model]["recipe"]
    seq = config["packing"]["block_tokens"]
    share = recipe["micro_batch_sequences"] // (recipe["devices"] * recipe["nodes"])
    return recipe["devices"] * training_mem_mb(
        RUNS[wildcards.model]["arch"], int(wildcards.vocab), share, seq, recipe["device"]
    )


def init_mem_mb(wildcards):
    """Random weights and their saved copy (fp32): 8 B per parameter."""
    return training_mem_mb(RUNS[wildcards.model]["arch"], int(wildcards.vocab), 0, 0, "cuda", bytes_per_param=8)


def swarm_runtime(wildcards):
    """SWARM pretraining: a seconds budget as it is plus the peers' start-up; a token or step budget at half the
    single-process estimate's rate (pipeline, compression, routing, every peer on the job's own CPUs or GPUs)."""
    seconds = pretrain_seconds(wildcards.model, int(wildcards.vocab))
    if budget_tokens(RUNS[wildcards.model]["recipe"]) is not None:
        seconds *= 2
    return minutes(seconds + config["swarm"]["startup_timeout_s"])


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
        config["packing"]["block_tokens"],
        recipe["device"],
        copies=1 + swarm["peers_per_stage"],
    )
    return model + mb((processes - 1) * TORCH_MB * 1e6)


def glue_rows(task):
    """(train, validation) rows the fine-tuning of `task` reads."""
    if SOURCE == "synthetic":
        syn = config["synthetic"]
        return syn["glue_train_examples"], syn["glue_validation_examples"] * (2 if task == "mnli" else 1)
    train, validation = GLUE_ROWS[task]
    cap = config["hub"]["glue_max_train_examples"]
    return (min(train, cap) if cap else train), validation


def glue_data_runtime(wildcards):
    return minutes(sum(glue_rows(wildcards.task)) / DOCS_PER_S_FLOOR)


def glue_data_mem_mb(wildcards):
    return mb(2 * PYTHON_MB * 1e6)


def finetune_tasks(wildcards):
    """The GLUE tasks one fine-tuning job runs: its own task, or (rule finetune_model) every task."""
    return [wildcards.task] if "task" in wildcards.keys() else TASKS


def finetune_runtime(wildcards):
    """Every epoch over the train rows (padded to max_length_tokens) plus a validation pass per epoch, for each
    task and seed the job runs."""
    protocol, arch = RUNS[wildcards.model]["glue"], RUNS[wildcards.model]["arch"]
    seq, device, vocab = protocol["max_length_tokens"], protocol["device"], int(wildcards.vocab)
    epochs = protocol["epochs"]
    seconds = 0.0
    for task in finetune_tasks(wildcards):
        train, validation = glue_rows(task)
        seconds += training_seconds(arch, vocab, epochs * train * seq, seq, device)
        seconds += training_seconds(arch, vocab, epochs * validation * seq, seq, device) / 3
    seeds = 1 if GLUE_JOBS == "per_seed" else len(SEEDS)  # per_task and per_model jobs run every seed
    return minutes(TRAINING_MARGIN * seconds * seeds)


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
    """The emulated experiments: runs x duration_s x time_scale wall seconds (testbed runs: real seconds plus
    their start-up, study.transports_runtime_s); compression trains the SWARM
    model once per boundary treatment; sim_scale grows with peers x simulated seconds x runs; square_cube's compute
    grows with width squared and its calls with bytes and delay. Three times that."""
    section = SWARM_EXPERIMENTS[wildcards.name]
    settings = config["swarm_study"][section]
    seconds = 60.0
    if section in ("wiring", "failures", "rebalancing"):
        from cramswarm.swarm.study import transports_runtime_s

        seconds += transports_runtime_s(section, settings)
    elif section == "sim_scale":
        # measured about 1e-5 wall seconds per simulated peer-second (1000 peers x 1800 s: 17 s); twice that
        runs = len(settings.get("preemption_models", [None])) * len(settings["rebalance_periods_s"])
        seconds += 2e-5 * sum(settings["peer_counts"]) * settings["duration_s"] * runs
    elif section == "square_cube":
        from cramswarm.swarm.study import square_cube_runtime_s

        seconds += square_cube_runtime_s(settings)
    elif section == "compression":
        tokens = settings["steps"] * settings["micro_batch_sequences"] * config["packing"]["block_tokens"]
        seq = config["packing"]["block_tokens"]
        per_treatment = training_seconds(RUNS[SWARM_MODEL]["arch"], MAIN_VOCAB, tokens, seq, "auto")
        seconds += len(settings["configs"]) * per_treatment
    return minutes(3 * seconds)
