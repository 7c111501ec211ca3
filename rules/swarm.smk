# SWARM parallelism (arXiv 2301.11913): models with trainer: swarm are pretrained by a pipeline of stages, each
# served by replicas, with randomized throughput-weighted routing, in-stage averaging, compression between
# stages and (optionally) injected failures. The checkpoint has the crammed layout, so rule finetune reads it as is.
# Its functions (the placement's SWARM_SLURM, the swarm_study experiments' settings): src/cramswarm/workflow/swarm.py.


# The study's report: seconds of work on the submit host rather than an sbatch job of its own (--executor slurm).
localrules:
    swarm_report,


rule swarm_pretrain:
    """SWARM pretraining of one run: a pipeline of stages served by replicas (emulated or over hivemind),
    to the same budget and data as a single-process run; with swarm.impl.placement srun one multi-task SLURM job.
    Under the launcher a rerun after this job was killed resumes from the stage shards (docs/swarm.md)."""
    input:
        unpack(run_data),  # the same blocks and tokenizer as a single-process run of the same data recipe
    output:
        model="results/swarm/{source}/{model}/v{vocab}/model.safetensors",
        log_csv="results/swarm/{source}/{model}/v{vocab}/train_log.csv",
        summary="results/swarm/{source}/{model}/v{vocab}/summary.json",
    log:
        "logs/swarm_pretrain/{source}/{model}/v{vocab}.log",
    benchmark:
        "results/benchmarks/swarm_pretrain/{source}/{model}/v{vocab}.tsv"
    priority: swarm_priority  # the longest run first: before the single-process runs of the same budget
    conda:
        "../envs/cramswarm.yaml"
    threads: SWARM_THREADS
    resources:
        **SWARM_SLURM,
        gpu=pretrain_gpus,
        mem_mb=swarm_mem_mb,
        runtime=swarm_runtime,
        impl=PRETRAIN_IMPL,  # how the run executes (pretrain.impl, swarm.impl): resources, not params, so they
        swarm_impl=SWARM_IMPL,  # rerun nothing
    params:
        recipe=recipe_json,
        arch=arch_json,
        swarm=swarm_json,
        out_dir=subpath(output.model, parent=True),
        # where attach peers meet the launcher (config.json + DHT address file), and the launcher's
        # resumable state (stage shards, trainer progress: a rerun after this job was killed resumes); not an output
        rendezvous="results/.state/swarm/{source}/{model}/v{vocab}",
    shell:
        "python -m cramswarm swarm-pretrain --recipe {params.recipe:q} --arch {params.arch:q} --swarm {params.swarm:q} "
        "--impl {resources.impl:q} --swarm-impl {resources.swarm_impl:q} "
        "--blocks {input.blocks} --tokenizer {input.tokenizer} --vocab-size {wildcards.vocab} "
        "--out-dir {params.out_dir} --rendezvous {params.rendezvous} --run {wildcards.model} --threads {threads} "
        "> {log} 2>&1"


rule swarm_experiment:
    """One of the SWARM paper's experiments in miniature (swarm_study.<section>), as one CSV."""
    input:
        unpack(swarm_study_inputs),
    output:
        f"{SWARM_STUDY}/{{name}}.csv",
    log:
        f"logs/swarm_study/{SOURCE}/{{name}}.log",
    benchmark:
        f"results/benchmarks/swarm_experiment/{SOURCE}/{{name}}.tsv"
    wildcard_constraints:
        name="|".join(SWARM_EXPERIMENTS),
    conda:
        "../envs/cramswarm.yaml"
    threads: 1
    resources:
        mem_mb=2 * TORCH_MB,
        runtime=swarm_experiment_runtime,
    params:
        settings=swarm_study_settings,
        extra=swarm_study_args,
    shell:
        "python -m cramswarm swarm-study --experiment {wildcards.name} --settings {params.settings:q} "
        "{params.extra} --out {output} > {log} 2>&1"


rule swarm_report:
    """The SWARM experiments' figures and tables (with the paper's numbers beside ours)."""
    input:
        [f"{SWARM_STUDY}/{name}.csv" for name in SWARM_EXPERIMENTS],
    output:
        *figure_companions(*(f"{SWARM_STUDY}/report/{name}.png" for name in SWARM_EXPERIMENTS)),
        *[f"{SWARM_STUDY}/report/{name}_table.md" for name in SWARM_EXPERIMENTS],
        figures=[figure(f"{SWARM_STUDY}/report/{name}.png", "SWARM", name) for name in SWARM_EXPERIMENTS],
        tables=[table(f"{SWARM_STUDY}/report/{name}_table.csv", "SWARM", name) for name in SWARM_EXPERIMENTS],
    log:
        f"logs/swarm_study/{SOURCE}/report.log",
    benchmark:
        f"results/benchmarks/swarm_report/{SOURCE}/report.tsv"
    conda:
        "../envs/cramswarm.yaml"
    resources:
        **REPORT_RESOURCES,
    params:
        study_dir=subpath(input[0], parent=True),
        out_dir=lambda wildcards, output: Path(output.figures[0]).parent,
    shell:
        "python -m cramswarm swarm-report --study-dir {params.study_dir} --out-dir {params.out_dir} > {log} 2>&1"
