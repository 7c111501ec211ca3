# Stage 2: one tokenizer per (corpus variant, family, vocab size), trained on that corpus variant (the paper
# trains its tokenizer after filtering). Special tokens keep ids 0-4 in every family.


rule train_tokenizer:
    """A tokenizer of exactly one vocab size and family, trained on one corpus variant (raw or filtered), and its
    report (size, alphabet, share of ## entries, non-ASCII entries, settings)."""
    input:
        corpus=corpus_variant,
    output:
        tokenizer=TOKENIZER,
        report="results/tokenizers/{corpus}/{filters}/{family}-v{vocab}/report.json",
    log:
        "logs/tokenizer/{corpus}/{filters}/{family}-v{vocab}.log",
    benchmark:
        "results/benchmarks/train_tokenizer/{corpus}/{filters}/{family}-v{vocab}.tsv"
    conda:
        "../envs/cramswarm.yaml"
    resources:
        mem_mb=tokenizer_mem_mb,
        runtime=data_runtime,
    params:
        # a param, not only a wildcard, so the between-workflow cache hashes it
        vocab=lambda wildcards: int(wildcards.vocab),
        family=lambda wildcards: wildcards.family,
        min_frequency=config["tokenizer"]["min_frequency"],
        case="" if config["tokenizer"]["lowercase"] else "--cased",
        ascii="" if config["tokenizer"]["ascii_only"] else "--keep-non-ascii",
        limit_alphabet=config["tokenizer"]["limit_alphabet"],
    shell:
        "python -m cramswarm tokenizer --corpus {input.corpus} --vocab-size {params.vocab} --family {params.family} "
        "--min-frequency {params.min_frequency} {params.case} {params.ascii} --limit-alphabet {params.limit_alphabet} "
        "--out {output.tokenizer} --report {output.report} > {log} 2>&1"
