# Stage 4: fine-tune every (model, vocab) of the study on every GLUE task and seed. glue.job_per_seed: one job per
# seed (a cluster fans them out), or one job per (model, vocab, task) that runs its seeds in one process.


if config["glue"]["job_per_seed"]:

    rule finetune:
        input:
            checkpoint=checkpoint_of,
            data=GLUE_DATA,
        output:
            FINETUNE,
        params:
            protocol=protocol_json,
            precision=config["pretrain"]["precision"],
            checkpoint_dir=subpath(input.checkpoint, parent=True),
        threads: 1
        resources:
            gpu=finetune_gpus,  # see gpus() in common.smk
        conda:
            "../envs/cramswarm.yaml"
        log:
            "logs/finetune/{source}/{model}/v{vocab}/{task}/s{seed}.log",
        benchmark:
            bench("logs/finetune/{source}/{model}/v{vocab}/{task}/s{seed}.log", "finetune")
        shell:
            "python -m cramswarm finetune --checkpoint {params.checkpoint_dir} --task {wildcards.task} "
            "--data {input.data} --seed {wildcards.seed} --protocol {params.protocol:q} "
            "--model {wildcards.model} --vocab {wildcards.vocab} --precision {params.precision} "
            "--threads {threads} --quiet --out {output} > {log} 2>&1"

else:

    rule finetune:
        input:
            checkpoint=checkpoint_of,
            data=GLUE_DATA,
        output:
            expand(FINETUNE, seed=SEEDS, allow_missing=True),
        params:
            protocol=protocol_json,
            precision=config["pretrain"]["precision"],
            checkpoint_dir=subpath(input.checkpoint, parent=True),
            seeds=" ".join(map(str, SEEDS)),
            cache="results/.cache/finetune/{source}/{model}/v{vocab}",
        threads: 1
        resources:
            gpu=finetune_gpus,  # see gpus() in common.smk
        conda:
            "../envs/cramswarm.yaml"
        log:
            "logs/finetune/{source}/{model}/v{vocab}/{task}/seeds.log",
        benchmark:
            bench("logs/finetune/{source}/{model}/v{vocab}/{task}/seeds.log", "finetune")
        shell:
            "python -m cramswarm finetune --checkpoint {params.checkpoint_dir} --task {wildcards.task} "
            "--data {input.data} --seed {params.seeds} --protocol {params.protocol:q} "
            "--model {wildcards.model} --vocab {wildcards.vocab} --precision {params.precision} "
            "--threads {threads} --quiet --cache-dir {params.cache} --out {output} > {log} 2>&1"
