# SWARM parallelism (arXiv 2301.11913): models with trainer: swarm are pretrained by a pipeline of stages, each
# served by replicas, with randomized throughput-weighted routing, in-stage averaging, compression between
# stages and (optionally) injected failures. The checkpoint has the crammed layout, so rule finetune reads it as is.


def swarm_json(wildcards):
    return json.dumps(config["swarm"], sort_keys=True)


# swarm.placement srun: the job is one SLURM job of stages x peers_per_stage tasks (across nodes); the coordinator
# runs in its batch step and starts the peers as one srun job step. `mpi` tells the SLURM plugin the rule calls srun
# itself (its job step runs the rule as is, not under `srun -n1`). Other placements: one process (plus its peers).
SWARM_TASKS = config["swarm"]["stages"] * config["swarm"]["peers_per_stage"]
SWARM_SRUN = config["swarm"]["placement"] == "srun"
SWARM_SLURM = {"tasks": SWARM_TASKS, "mpi": "srun"} if SWARM_SRUN else {}


rule swarm_pretrain:
    input:
        unpack(run_data),  # the same blocks and tokenizer as a single-process run of the same data recipe
    output:
        model="results/swarm/{source}/{model}/v{vocab}/model.safetensors",
        log_csv="results/swarm/{source}/{model}/v{vocab}/train_log.csv",
        summary="results/swarm/{source}/{model}/v{vocab}/summary.json",
    params:
        recipe=recipe_json,
        arch=arch_json,
        swarm=swarm_json,
        out_dir=subpath(output.model, parent=True),
        # where attach/srun peers meet the coordinator (config.json + DHT address file); outside the outputs
        rendezvous="results/.state/swarm/{source}/{model}/v{vocab}",
    threads: 1 if SWARM_SRUN else 2  # srun: CPUs per task (one peer each); else: the local replicas and trainers
    resources:
        gpu=pretrain_gpus,
        **SWARM_SLURM,
    conda:
        "../envs/cramswarm.yaml"
    log:
        "logs/swarm_pretrain/{source}/{model}/v{vocab}.log",
    benchmark:
        bench("logs/swarm_pretrain/{source}/{model}/v{vocab}.log", "swarm_pretrain")
    shell:
        "python -m cramswarm swarm-pretrain --recipe {params.recipe:q} --arch {params.arch:q} --swarm {params.swarm:q} "
        "--blocks {input.blocks} --tokenizer {input.tokenizer} --vocab-size {wildcards.vocab} "
        "--out-dir {params.out_dir} --rendezvous {params.rendezvous} --run {wildcards.model} --threads {threads} "
        "> {log} 2>&1"


# --- named target swarm_study: the paper's experiments in miniature (one CSV each), then their tables/figures ---
SWARM_STUDY = f"results/swarm_study/{SOURCE}"
# CSV / figure name (as cramswarm.report.swarm_figures names them) -> the swarm_study config section it runs
SWARM_EXPERIMENTS = {"square_cube": "square_cube", "wiring_throughput": "wiring", "failures_timeline": "failures",
                     "rebalancing_recovery": "rebalancing", "compression_loss": "compression", "sim_scale": "sim_scale"}
SWARM_MODEL = swarm_study_model(config)  # the model the compression experiment splits (cramswarm.config)


def swarm_study_inputs(wildcards):
    """The compression experiment trains on the study's blocks at the main vocab size."""
    return data_files(STUDY_DATA, MAIN_VOCAB) if SWARM_EXPERIMENTS[wildcards.name] == "compression" else {}


def swarm_study_args(wildcards, input):
    if SWARM_EXPERIMENTS[wildcards.name] != "compression":
        return ""
    arch = shlex.quote(json.dumps(RUNS[SWARM_MODEL]["arch"], sort_keys=True))
    return f"--blocks {input.blocks} --tokenizer {input.tokenizer} --arch {arch}"


rule swarm_experiment:
    input:
        unpack(swarm_study_inputs),
    output:
        f"{SWARM_STUDY}/{{name}}.csv",
    wildcard_constraints:
        name="|".join(SWARM_EXPERIMENTS),
    params:
        settings=lambda wildcards: json.dumps(config["swarm_study"][SWARM_EXPERIMENTS[wildcards.name]], sort_keys=True),
        extra=swarm_study_args,
    threads: 1
    conda:
        "../envs/cramswarm.yaml"
    log:
        f"logs/swarm_study/{SOURCE}/{{name}}.log",
    benchmark:
        bench(f"logs/swarm_study/{SOURCE}/{{name}}.log", "swarm_experiment")
    shell:
        "python -m cramswarm swarm-study --experiment {wildcards.name} --settings {params.settings:q} "
        "{params.extra} --out {output} > {log} 2>&1"


rule swarm_report:
    input:
        [f"{SWARM_STUDY}/{name}.csv" for name in SWARM_EXPERIMENTS],
    output:
        *figure_companions(*(f"{SWARM_STUDY}/report/{name}.png" for name in SWARM_EXPERIMENTS)),
        *[f"{SWARM_STUDY}/report/{name}_table.md" for name in SWARM_EXPERIMENTS],
        figures=[figure(f"{SWARM_STUDY}/report/{name}.png", "SWARM", name) for name in SWARM_EXPERIMENTS],
        tables=[table(f"{SWARM_STUDY}/report/{name}_table.csv", "SWARM", name) for name in SWARM_EXPERIMENTS],
    conda:
        "../envs/cramswarm.yaml"
    log:
        f"logs/swarm_study/{SOURCE}/report.log",
    benchmark:
        bench(f"logs/swarm_study/{SOURCE}/report.log", "swarm_report")
    shell:
        "python -m cramswarm swarm-report --study-dir {SWARM_STUDY} --out-dir {SWARM_STUDY}/report > {log} 2>&1"
