# Stage 1: materialise the corpus and the GLUE splits from the configured source (synthetic | hub).


rule corpus:
    output:
        corpus=CORPUS,
        report="results/data/{source}/corpus.report.json",
    params:
        spec=source_spec("corpus"),
    conda:
        "../envs/cramswarm.yaml"
    log:
        "logs/corpus/{source}.log",
    shell:
        "python -m cramswarm corpus --source-spec {params.spec:q} --out {output.corpus} "
        "--report {output.report} > {log} 2>&1"


rule glue_data:
    output:
        data=GLUE_DATA,
        report="results/data/{source}/glue/{task}.report.json",
    params:
        spec=source_spec("glue"),
    conda:
        "../envs/cramswarm.yaml"
    log:
        "logs/glue_data/{source}/{task}.log",
    shell:
        "python -m cramswarm glue-data --source-spec {params.spec:q} --task {wildcards.task} "
        "--out {output.data} --report {output.report} > {log} 2>&1"
