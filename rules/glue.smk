# Stage 4: fine-tune every (model, vocab) of the study on every GLUE task and seed. glue.jobs sets how many runs share
# one process: per_seed (one job per seed, for a cluster to fan out), per_task (one job per (model, vocab, task) runs
# its seeds) or per_model (one job per study (model, vocab) runs every task and seed: one torch start-up, not 27).
# Every seed's result is the same whichever it is (docs/glue.md).


if GLUE_JOBS == "per_seed":

    rule finetune:
        """One (model, vocab, task, seed) GLUE fine-tuning run, scored on the task's validation split(s)."""
        input:
            checkpoint=checkpoint_of,
            data=GLUE_DATA,
            warmup_data=warmup_data,  # glue protocol warmup_from_task: that task's data
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
            gpu=finetune_gpus,  # see cramswarm.workflow.study.gpus
            mem_mb=finetune_mem_mb,
            runtime=finetune_runtime,
        params:
            protocol=protocol_json,
            precision=config["pretrain"]["precision"],
            checkpoint_dir=subpath(input.checkpoint, parent=True),
            warmup=warmup_arg,
        shell:
            "python -m cramswarm finetune --checkpoint {params.checkpoint_dir} --task {wildcards.task} "
            "--data {input.data} --seed {wildcards.seed} --protocol {params.protocol:q} "
            "--model {wildcards.model} --vocab {wildcards.vocab} --precision {params.precision} {params.warmup} "
            "--threads {threads} --quiet --out {output} > {log} 2>&1"

else:

    rule finetune:
        """Every seed of one (model, vocab, task) GLUE fine-tuning in one process (one start-up of torch and
        transformers), each seed's result as a run of it alone; finished seeds are reused from results/.cache/."""
        input:
            checkpoint=checkpoint_of,
            data=GLUE_DATA,
            warmup_data=warmup_data,  # glue protocol warmup_from_task: that task's data
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
            gpu=finetune_gpus,  # see cramswarm.workflow.study.gpus
            mem_mb=finetune_mem_mb,
            runtime=finetune_runtime,
        params:
            protocol=protocol_json,
            precision=config["pretrain"]["precision"],
            checkpoint_dir=subpath(input.checkpoint, parent=True),
            warmup=warmup_arg,
            seeds=" ".join(map(str, SEEDS)),
            cache="results/.cache/finetune/{source}/{model}/v{vocab}",
        shell:
            "python -m cramswarm finetune --checkpoint {params.checkpoint_dir} --task {wildcards.task} "
            "--data {input.data} --seed {params.seeds} --protocol {params.protocol:q} "
            "--model {wildcards.model} --vocab {wildcards.vocab} --precision {params.precision} {params.warmup} "
            "--threads {threads} --quiet --cache-dir {params.cache} --out {output} > {log} 2>&1"


if GLUE_JOBS == "per_model":

    # The study's (model, vocab) runs take this rule; the ablation runs, which fine-tune on ablations.glue_tasks
    # only, keep one job per task (rule finetune above).
    ruleorder: finetune_model > finetune

    rule finetune_model:
        """Every GLUE task and seed of one study (model, vocab) in one process, each result as a run of that task
        and seed alone; finished runs are reused from results/.cache/."""
        input:
            checkpoint=checkpoint_of,
            data=expand(GLUE_DATA, task=TASKS, allow_missing=True),
            warmup_data=warmup_data,  # glue protocol warmup_from_task: that task's data
        output:
            expand(FINETUNE, task=TASKS, seed=SEEDS, allow_missing=True),
        log:
            "logs/finetune_model/{source}/{model}/v{vocab}.log",
        benchmark:
            "results/benchmarks/finetune_model/{source}/{model}/v{vocab}.tsv"
        wildcard_constraints:
            model="|".join(MODELS),
        conda:
            "../envs/cramswarm.yaml"
        threads: 1
        resources:
            gpu=finetune_gpus,  # see cramswarm.workflow.study.gpus
            mem_mb=finetune_mem_mb,
            runtime=finetune_runtime,
        params:
            protocol=protocol_json,
            precision=config["pretrain"]["precision"],
            checkpoint_dir=subpath(input.checkpoint, parent=True),
            warmup=warmup_arg,
            tasks=" ".join(TASKS),
            seeds=" ".join(map(str, SEEDS)),
            cache="results/.cache/finetune/{source}/{model}/v{vocab}",
        shell:
            "python -m cramswarm finetune --checkpoint {params.checkpoint_dir} --task {params.tasks} "
            "--data {input.data} --seed {params.seeds} --protocol {params.protocol:q} "
            "--model {wildcards.model} --vocab {wildcards.vocab} --precision {params.precision} {params.warmup} "
            "--threads {threads} --quiet --cache-dir {params.cache} --out {output} > {log} 2>&1"
