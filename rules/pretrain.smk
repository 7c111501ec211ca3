# Stage 3: pack the corpus into blocks per tokenizer, then pretrain (or randomly initialise) each model.


rule pack_corpus:
    input:
        corpus=CORPUS,
        tokenizer=TOKENIZER,
    output:
        blocks=BLOCKS,
        report="results/packed/{source}/v{vocab}/report.json",
    params:
        block_tokens=config["packing"]["block_tokens"],
        shuffle_seed=config["packing"]["shuffle_seed"],
    conda:
        "../envs/cramswarm.yaml"
    log:
        "logs/pack/{source}/v{vocab}.log",
    shell:
        "python -m cramswarm pack --corpus {input.corpus} --tokenizer {input.tokenizer} "
        "--block-tokens {params.block_tokens} --shuffle-seed {params.shuffle_seed} "
        "--out {output.blocks} --report {output.report} > {log} 2>&1"


rule pretrain:
    input:
        blocks=BLOCKS,
        tokenizer=TOKENIZER,
    output:
        model="results/pretrain/{source}/{model}/v{vocab}/model.safetensors",
        log_csv="results/pretrain/{source}/{model}/v{vocab}/train_log.csv",
        summary="results/pretrain/{source}/{model}/v{vocab}/summary.json",
    params:
        recipe=recipe_json,
        arch=arch_json,
        out_dir=subpath(output.model, parent=True),
        # Resumable state: outside the declared outputs (Snakemake deletes those before a rerun).
        state_dir="results/.state/pretrain/{source}/{model}/v{vocab}",
    threads: 1
    conda:
        "../envs/cramswarm.yaml"
    log:
        "logs/pretrain/{source}/{model}/v{vocab}.log",
    shell:
        "python -m cramswarm pretrain --recipe {params.recipe:q} --arch {params.arch:q} "
        "--blocks {input.blocks} --tokenizer {input.tokenizer} --vocab-size {wildcards.vocab} "
        "--out-dir {params.out_dir} --state-dir {params.state_dir} --run {wildcards.model} "
        "--threads {threads} > {log} 2>&1"


rule init_model:  # the no-pretraining baseline: same architecture, random weights
    input:
        tokenizer=TOKENIZER,
    output:
        model="results/init/{source}/{model}/v{vocab}/model.safetensors",
    params:
        arch=arch_json,
        seed=config["pretrain"]["seed"],
        out_dir=subpath(output.model, parent=True),
    conda:
        "../envs/cramswarm.yaml"
    log:
        "logs/init_model/{source}/{model}/v{vocab}.log",
    shell:
        "python -m cramswarm init-model --arch {params.arch:q} --tokenizer {input.tokenizer} "
        "--seed {params.seed} --out-dir {params.out_dir} > {log} 2>&1"
