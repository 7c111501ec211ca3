# Stage 4: fine-tune every (model, vocab) of the study on every GLUE task, once per seed (one job each,
# so a cluster can fan out).


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
