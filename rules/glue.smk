# Stage 4: fine-tune every (model, vocab) of the study on every GLUE task and seed. glue.job_per_seed: one job per
# seed (a cluster fans them out), or one job per (model, vocab, task) that runs its seeds in one process.


if config["glue"]["job_per_seed"]:

    rule finetune:
        """One (model, vocab, task, seed) GLUE fine-tuning run, scored on the task's validation split(s)."""
        input:
            checkpoint=checkpoint_of,
            data=GLUE_DATA,
        output:
            FINETUNE,
        log:
            "logs/finetune/{source}/{model}/v{vocab}/{task}/s{seed}.log",
        benchmark:
            "results/benchmarks/finetune/{source}/{model}/v{vocab}/{task}/s{seed}.tsv"
        conda:
            "../envs/cramswarm.yaml"
        threads: 1
        resources:
            gpu=finetune_gpus,  # see gpus() in common.smk
            mem_mb=finetune_mem_mb,
            runtime=finetune_runtime,
        params:
            protocol=protocol_json,
            precision=config["pretrain"]["precision"],
            checkpoint_dir=subpath(input.checkpoint, parent=True),
        shell:
            "python -m cramswarm finetune --checkpoint {params.checkpoint_dir} --task {wildcards.task} "
            "--data {input.data} --seed {wildcards.seed} --protocol {params.protocol:q} "
            "--model {wildcards.model} --vocab {wildcards.vocab} --precision {params.precision} "
            "--threads {threads} --quiet --out {output} > {log} 2>&1"

else:

    rule finetune:
        """Every seed of one (model, vocab, task) GLUE fine-tuning in one process (one start-up of torch and
        transformers), each seed's result as a run of it alone; finished seeds are reused from results/.cache/."""
        input:
            checkpoint=checkpoint_of,
            data=GLUE_DATA,
        output:
            expand(FINETUNE, seed=SEEDS, allow_missing=True),
        log:
            "logs/finetune/{source}/{model}/v{vocab}/{task}/seeds.log",
        benchmark:
            "results/benchmarks/finetune/{source}/{model}/v{vocab}/{task}/seeds.tsv"
        conda:
            "../envs/cramswarm.yaml"
        threads: 1
        resources:
            gpu=finetune_gpus,  # see gpus() in common.smk
            mem_mb=finetune_mem_mb,
            runtime=finetune_runtime,
        params:
            protocol=protocol_json,
            precision=config["pretrain"]["precision"],
            checkpoint_dir=subpath(input.checkpoint, parent=True),
            seeds=" ".join(map(str, SEEDS)),
            cache="results/.cache/finetune/{source}/{model}/v{vocab}",
        shell:
            "python -m cramswarm finetune --checkpoint {params.checkpoint_dir} --task {wildcards.task} "
            "--data {input.data} --seed {params.seeds} --protocol {params.protocol:q} "
            "--model {wildcards.model} --vocab {wildcards.vocab} --precision {params.precision} "
            "--threads {threads} --quiet --cache-dir {params.cache} --out {output} > {log} 2>&1"
