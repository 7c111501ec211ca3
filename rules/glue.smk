# Stage 4: fine-tune every (model, vocab) of the study on every GLUE task, once per seed (one job each,
# so a cluster can fan out).


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
