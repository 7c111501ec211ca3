# Stage 1: materialise the corpora and the GLUE splits from the configured source (synthetic | hub), and the
# raw-text filters (Cramming §3.2: trash, then dedup), each filter step its own cached corpus with a report.
# Corpora are written one bounded row group at a time. data.memory_cap_mb reaches the commands as the resource
# data_cap_mib, not as a param: it bounds memory and changes no output, so a new cap reruns nothing.


rule corpus:
    """The study's corpus ({corpus} = synthetic | hub) or a data.corpora entry, streamed to parquet."""
    output:
        corpus=CORPUS,
        report="results/data/{corpus}/corpus.report.json",
    log:
        "logs/corpus/{corpus}.log",
    benchmark:
        "results/benchmarks/corpus/{corpus}.tsv"
    conda:
        "../envs/cramswarm.yaml"
    resources:
        mem_mb=data_mem_mb,
        runtime=data_runtime,
    params:
        spec=corpus_spec_json,
        # a hub stream's progress, so that a killed job resumes: outside the outputs (Snakemake deletes those)
        state_dir="results/.state/corpus/{corpus}",
    shell:
        "python -m cramswarm corpus --source-spec {params.spec:q} --out {output.corpus} "
        "--report {output.report} --state-dir {params.state_dir} > {log} 2>&1"


rule filter_corpus:
    """One filter step, trash<cutoff> or dedup<threshold>, applied to the corpus of the chain before it."""
    input:
        unpack(filter_inputs),
    output:
        corpus=FILTERED,
        report="results/data/{corpus}/{filters}/report.json",
    log:
        "logs/filter/{corpus}/{filters}.log",
    benchmark:
        "results/benchmarks/filter_corpus/{corpus}/{filters}.tsv"
    wildcard_constraints:
        filters=r"trash[0-9.]+|dedup[0-9.]+|trash[0-9.]+-dedup[0-9.]+",
    conda:
        "../envs/cramswarm.yaml"
    threads: filter_threads  # dedup hashes in this many processes; the trash filter runs in one
    resources:
        mem_mb=filter_mem_mb,
        runtime=data_runtime,
        data_cap_mib=config["data"]["memory_cap_mb"],
    params:
        args=filter_args,  # the step and its settings (dedup shingles and permutations included)
        tokenizer=lambda wildcards, input: (f"--tokenizer {input.tokenizer}" if "tokenizer" in input.keys() else ""),
    shell:
        "python -m cramswarm filter {params.args} --corpus {input.corpus} {params.tokenizer} --out {output.corpus} "
        "--report {output.report} --memory-cap-mb {resources.data_cap_mib} --workers {threads} > {log} 2>&1"


rule glue_data:
    """One GLUE task's train and validation splits from the configured source, as parquet."""
    output:
        data=GLUE_DATA,
        report="results/data/{source}/glue/{task}.report.json",
    log:
        "logs/glue_data/{source}/{task}.log",
    benchmark:
        "results/benchmarks/glue_data/{source}/{task}.tsv"
    conda:
        "../envs/cramswarm.yaml"
    resources:
        mem_mb=glue_data_mem_mb,
        runtime=glue_data_runtime,
    params:
        spec=glue_source_spec,
    shell:
        "python -m cramswarm glue-data --source-spec {params.spec:q} --task {wildcards.task} "
        "--out {output.data} --report {output.report} > {log} 2>&1"
