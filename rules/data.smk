# Stage 1: materialise the corpora and the GLUE splits from the configured source (synthetic | hub), and the
# raw-text filters (Cramming §3.2: trash, then dedup), each filter step its own cached corpus with a report.
# Corpora are written one bounded row group at a time. data.memory_cap_mb reaches the commands through the
# shell template, not params: it bounds memory and changes no output, so a new cap reruns nothing.


rule corpus:  # the study's corpus ({corpus} = synthetic | hub) or a data.corpora entry, streamed
    output:
        corpus=CORPUS,
        report="results/data/{corpus}/corpus.report.json",
    params:
        spec=corpus_spec_json,
    conda:
        "../envs/cramswarm.yaml"
    log:
        "logs/corpus/{corpus}.log",
    benchmark:
        bench("logs/corpus/{corpus}.log", "corpus")
    shell:
        "python -m cramswarm corpus --source-spec {params.spec:q} --out {output.corpus} "
        "--report {output.report} > {log} 2>&1"


def filter_step(wildcards):
    """The last filter of a {filters} chain (the step this job applies) and the corpus it reads."""
    *before, step = wildcards.filters.split("-")
    parent = "-".join(before) or "raw"
    return step, (CORPUS if parent == "raw" else FILTERED).format(corpus=wildcards.corpus, filters=parent)


def filter_inputs(wildcards):
    step, parent = filter_step(wildcards)
    inputs = {"corpus": parent}
    if step.startswith("trash"):  # the corpus's own tokenizer: study family, main vocab, unfiltered corpus
        inputs["tokenizer"] = TOKENIZER.format(corpus=wildcards.corpus, filters="raw",
                                               family=config["tokenizer"]["family"], vocab=MAIN_VOCAB)
    return inputs


def filter_args(wildcards):
    step, _ = filter_step(wildcards)
    if step.startswith("trash"):
        return f"--kind trash --trash-cutoff {step[len('trash'):]}"
    d = config["data"]
    return (f"--kind dedup --dedup-threshold {step[len('dedup'):]} --shingle-words {d['dedup_shingle_words']} "
            f"--num-perm {d['dedup_permutations']}")


rule filter_corpus:  # one filter step: trash<cutoff> or dedup<threshold>, applied to the chain before it
    input:
        unpack(filter_inputs),
    output:
        corpus=FILTERED,
        report="results/data/{corpus}/{filters}/report.json",
    params:
        args=filter_args,  # the step and its settings (dedup shingles and permutations included)
        tokenizer=lambda wildcards, input: f"--tokenizer {input.tokenizer}" if "tokenizer" in input.keys() else "",
    wildcard_constraints:
        filters=r"trash[0-9.]+|dedup[0-9.]+|trash[0-9.]+-dedup[0-9.]+",
    conda:
        "../envs/cramswarm.yaml"
    log:
        "logs/filter/{corpus}/{filters}.log",
    benchmark:
        bench("logs/filter/{corpus}/{filters}.log", "filter_corpus")
    shell:
        "python -m cramswarm filter {params.args} --corpus {input.corpus} {params.tokenizer} --out {output.corpus} "
        "--report {output.report} --memory-cap-mb {config[data][memory_cap_mb]} > {log} 2>&1"


rule glue_data:
    output:
        data=GLUE_DATA,
        report="results/data/{source}/glue/{task}.report.json",
    params:
        spec=glue_source_spec,
    conda:
        "../envs/cramswarm.yaml"
    log:
        "logs/glue_data/{source}/{task}.log",
    benchmark:
        bench("logs/glue_data/{source}/{task}.log", "glue_data")
    shell:
        "python -m cramswarm glue-data --source-spec {params.spec:q} --task {wildcards.task} "
        "--out {output.data} --report {output.report} > {log} 2>&1"
