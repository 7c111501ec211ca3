# Stage 2: one WordPiece tokenizer per vocab size, trained on the corpus.


rule train_tokenizer:
    input:
        corpus=CORPUS,
    output:
        TOKENIZER,
    params:
        vocab=vocab_size,  # a param, not only a wildcard, so the between-workflow cache hashes it
        min_frequency=config["tokenizer"]["min_frequency"],
        case="" if config["tokenizer"]["lowercase"] else "--cased",
    conda:
        "../envs/cramswarm.yaml"
    log:
        "logs/tokenizer/{source}/v{vocab}.log",
    shell:
        "python -m cramswarm tokenizer --corpus {input.corpus} --vocab-size {params.vocab} "
        "--min-frequency {params.min_frequency} {params.case} --out {output} > {log} 2>&1"
