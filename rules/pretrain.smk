# Stage 3: pack each corpus variant into blocks per tokenizer (streamed, bounded memory), order the blocks
# (the curriculum), then pretrain (or randomly initialise) each model on its run's data recipe.


rule pack_corpus:
    """One corpus variant tokenized and packed into fixed-length blocks (documents end in [SEP])."""
    input:
        corpus=corpus_variant,
        tokenizer=TOKENIZER,
    output:
        blocks=PACKED if config["data"]["keep_packed"] else temp(PACKED),  # data.keep_packed
        report="results/packed/{corpus}/{filters}/{family}-v{vocab}/packed.report.json",
    log:
        "logs/pack/{corpus}/{filters}/{family}-v{vocab}.log",
    benchmark:
        "results/benchmarks/pack_corpus/{corpus}/{filters}/{family}-v{vocab}.tsv"
    conda:
        "../envs/cramswarm.yaml"
    resources:
        mem_mb=data_mem_mb,
        runtime=data_runtime,
        data_cap_mib=config["data"]["memory_cap_mb"],
    params:
        block_tokens=config["packing"]["block_tokens"],
        shuffle_seed=config["packing"]["shuffle_seed"],
    shell:
        "python -m cramswarm pack --corpus {input.corpus} --tokenizer {input.tokenizer} "
        "--block-tokens {params.block_tokens} --shuffle-seed {params.shuffle_seed} --out {output.blocks} "
        "--report {output.report} --memory-cap-mb {resources.data_cap_mib} > {log} 2>&1"


rule order_blocks:
    """The packed blocks in curriculum order; the last pretrain.eval_blocks rows are the same random
    held-out sample for every order."""
    input:
        packed=PACKED,
        tokenizer=TOKENIZER,
    output:
        blocks=BLOCKS,
        report="results/packed/{corpus}/{filters}/{family}-v{vocab}/{order}/report.json",
    log:
        "logs/order/{corpus}/{filters}/{family}-v{vocab}/{order}.log",
    benchmark:
        "results/benchmarks/order_blocks/{corpus}/{filters}/{family}-v{vocab}/{order}.tsv"
    conda:
        "../envs/cramswarm.yaml"
    resources:
        mem_mb=data_mem_mb,
        runtime=data_runtime,
        data_cap_mib=config["data"]["memory_cap_mb"],
    params:
        order=lambda wildcards: wildcards.order,
        seed=config["data"]["order_seed"],
        holdout=config["pretrain"]["eval_blocks"],
        cap=(f"--max-training-blocks {config['data']['max_sequences']}" if config["data"]["max_sequences"] else ""),
    shell:
        "python -m cramswarm order --packed {input.packed} --tokenizer {input.tokenizer} --order {params.order} "
        "--seed {params.seed} --holdout-blocks {params.holdout} {params.cap} --out {output.blocks} "
        "--report {output.report} --memory-cap-mb {resources.data_cap_mib} > {log} 2>&1"


rule pretrain:
    """MLM pretraining of one run to its budget (tokens, steps or wall-clock seconds), resumable."""
    input:
        unpack(run_data),  # blocks and tokenizer of the run's data recipe (cramswarm.config.data_recipe)
        sweep=lambda wildcards: list(lr_sweep_summaries(wildcards).values()),  # models.NAME.lr_from_sweep only
    output:
        model="results/pretrain/{source}/{model}/v{vocab}/model.safetensors",
        log_csv="results/pretrain/{source}/{model}/v{vocab}/train_log.csv",
        summary="results/pretrain/{source}/{model}/v{vocab}/summary.json",
    log:
        "logs/pretrain/{source}/{model}/v{vocab}.log",
    benchmark:
        "results/benchmarks/pretrain/{source}/{model}/v{vocab}.tsv"
    priority: critical_path_priority  # the longest run first
    conda:
        "../envs/cramswarm.yaml"
    # pretrain.impl.devices: one CPU per data-parallel process on each node (one torch thread each); profiles/slurm
    # multiplies its GPUs per process by this
    threads: IMPL["devices"]
    resources:
        gpu=pretrain_gpus,  # one per process where the run uses a GPU: see cramswarm.workflow.study.gpus
        nodes=IMPL["nodes"],  # pretrain.impl.nodes (profiles/slurm: sbatch --nodes; srun starts one torchrun per node)
        mem_mb=pretrain_mem_mb,
        gpu_mem_mb=pretrain_gpu_mem_mb,  # per process; 0 on a CPU
        runtime=pretrain_runtime,
        impl=PRETRAIN_IMPL,  # how the run executes (pretrain.impl): a resource, not a param, so it reruns nothing
    params:
        recipe=recipe_json,
        arch=arch_json,
        out_dir=subpath(output.model, parent=True),
        # Resumable state: outside the declared outputs (Snakemake deletes those before a rerun).
        state_dir="results/.state/pretrain/{source}/{model}/v{vocab}",
        lr_from=lr_from_arg,  # the peak LR chosen from the schedule sweep's held-out losses
    shell:
        "python -m cramswarm pretrain --recipe {params.recipe:q} --impl {resources.impl:q} --arch {params.arch:q} "
        "--blocks {input.blocks} --tokenizer {input.tokenizer} --vocab-size {wildcards.vocab} "
        "--out-dir {params.out_dir} --state-dir {params.state_dir} --run {wildcards.model} {params.lr_from} "
        "--threads 1 > {log} 2>&1"


rule init_model:
    """The no-pretraining baseline: the run's architecture with random weights."""
    input:
        tokenizer=lambda wildcards: run_data(wildcards)["tokenizer"],
    output:
        model="results/init/{source}/{model}/v{vocab}/model.safetensors",
    log:
        "logs/init_model/{source}/{model}/v{vocab}.log",
    benchmark:
        "results/benchmarks/init_model/{source}/{model}/v{vocab}.tsv"
    conda:
        "../envs/cramswarm.yaml"
    resources:
        mem_mb=init_mem_mb,
        runtime=BASE_MINUTES,
    params:
        arch=arch_json,
        seed=config["pretrain"]["seed"],
        out_dir=subpath(output.model, parent=True),
    shell:
        "python -m cramswarm init-model --arch {params.arch:q} --tokenizer {input.tokenizer} "
        "--seed {params.seed} --out-dir {params.out_dir} > {log} 2>&1"
