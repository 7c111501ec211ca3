# Stage 5: the paper's tables and figures from the fine-tuning results and pretraining logs, and the study
# record (config, software versions, per-rule benchmark summary) that heads `snakemake --report`.


# Seconds of work on the submit host rather than sbatch jobs of their own (with --executor slurm).
localrules:
    tables,
    tables_apart,
    figures,
    vocab_sweep,
    study_record,
    readme_figures,
    claims_table,
    claims_available,


rule tables:
    """The GLUE tables (median over seeds; Tables 3/4) and the GLUE table with the paper's published rows below ours
    (CSV, Markdown, LaTeX)."""
    input:
        results=finetune_results,
        summaries=[path for _, _, path in pretraining(STUDY_RUNS)],  # tokens and passes over the data, by the delta
    output:
        table(GLUE_TABLES[0], "Cramming", "GLUE (Tables 3/4)"),
        GLUE_TABLES[1],
        table(GLUE_PAPER_TABLES[0], "Cramming", "GLUE (Tables 3/4)"),  # `tables` writes <glue stem>_paper.{csv,md,tex}
        *GLUE_PAPER_TABLES[1:],
    log:
        f"logs/report/{SOURCE}/tables.log",
    benchmark:
        f"results/benchmarks/tables/{SOURCE}/tables.tsv"
    conda:
        "../envs/cramswarm.yaml"
    resources:
        **REPORT_RESOURCES,
    params:
        glue_stem=subpath(output[0], strip_suffix=".csv"),  # GLUE_TABLES[0]
        paper_reference=config["glue"]["paper_reference"],
        pretraining=json.dumps(pretraining(STUDY_RUNS)),
    shell:
        "python -m cramswarm tables --results {input.results} --out-stem {params.glue_stem} "
        "--paper-reference '{params.paper_reference}' --pretraining {params.pretraining:q} > {log} 2>&1"


use rule tables as tables_apart with:
    input:
        results=finetune_results(runs=APART_RUNS),
        summaries=[path for _, _, path in pretraining(APART_RUNS)],
    output:
        APART_TABLES,
    log:
        f"logs/report/{SOURCE}/tables_apart.log",
    benchmark:
        f"results/benchmarks/tables/{SOURCE}/tables_apart.tsv"
    params:
        pretraining=json.dumps(pretraining(APART_RUNS)),


rule vocab_sweep:
    """Figure 3 and its table: GLUE average and MNLI vs vocab size, the random-init baseline as the reference line
    (named target ablation_vocab)."""
    input:
        lambda wildcards: finetune_results(runs=SWEEP_RUNS),
    output:
        table(VOCAB_SWEEP_TABLES[0], "Cramming", "Vocabulary size (Figure 3)"),
        VOCAB_SWEEP_TABLES[1],
        *figure_companions(VOCAB_FIGURE),
        png=figure(VOCAB_FIGURE, "Cramming", "Vocabulary size (Figure 3)"),
    log:
        f"logs/report/{SOURCE}/vocab_sweep.log",
    benchmark:
        f"results/benchmarks/vocab_sweep/{SOURCE}/vocab_sweep.tsv"
    conda:
        "../envs/cramswarm.yaml"
    resources:
        **REPORT_RESOURCES,
    params:
        baselines=BASELINES,
        not_swept=NOT_SWEPT,
        stem=subpath(output[0], strip_suffix=".csv"),
    shell:
        "python -m cramswarm vocab-sweep --results {input} --baseline {params.baselines} --not-swept "
        "{params.not_swept} --out-stem {params.stem} --png {output.png} > {log} 2>&1"


rule figures:
    """The study's figures: MLM loss vs tokens and GLUE score per task."""
    input:
        results=finetune_results,
        logs=pretrain_logs,
    output:
        *figure_companions(*FIGURES),
        loss=figure(FIGURES[0], "Cramming", "Pretraining"),
        tasks=figure(FIGURES[1], "Cramming", "GLUE (Tables 3/4)"),
    log:
        f"logs/report/{SOURCE}/figures.log",
    benchmark:
        f"results/benchmarks/figures/{SOURCE}/figures.tsv"
    conda:
        "../envs/cramswarm.yaml"
    resources:
        **REPORT_RESOURCES,
    params:
        source=SOURCE,
    shell:
        "python -m cramswarm figures --results {input.results} --logs {input.logs} --loss-png {output.loss} "
        "--tasks-png {output.tasks} --source {params.source} > {log} 2>&1"


rule study_record:
    """The study record that heads the report: config used, software versions, per-rule benchmark summary.
    Runs last: it summarises the benchmark files of every job before it."""
    input:
        GLUE_TABLES,
        GLUE_PAPER_TABLES,
        FIGURES,
    output:
        config=report(f"{RECORD}/config.yaml", category="Study record"),
        software=table(f"{RECORD}/software.csv", "Study record"),
        software_md=f"{RECORD}/software.md",
        benchmarks=table(f"{RECORD}/benchmarks.csv", "Study record"),
        benchmarks_md=f"{RECORD}/benchmarks.md",
        rule_times=figure(f"{RECORD}/rule_times.png", "Study record"),
        companions=figure_companions(f"{RECORD}/rule_times.png"),
    log:
        f"logs/report/{SOURCE}/study_record.log",
    conda:
        "../envs/cramswarm.yaml"
    resources:
        **REPORT_RESOURCES,
    params:
        config=json.dumps(COMPUTED),  # less the impl sections: how the runs executed reruns nothing
        benchmarks=BENCHMARKS,
        out_dir=subpath(output.config, parent=True),
    shell:
        "python -m cramswarm study-record --config {params.config:q} --benchmarks {params.benchmarks} "
        "--out-dir {params.out_dir} > {log} 2>&1"


rule readme_figures:
    """Small copies of the README's figures under results/readme/ (committed; named target `readme`)."""
    input:
        FIGURES[:2],
    output:
        [f"results/readme/{Path(png).name}" for png in FIGURES[:2]],
    log:
        f"logs/report/{SOURCE}/readme_figures.log",
    conda:
        "../envs/cramswarm.yaml"
    resources:
        **REPORT_RESOURCES,
    params:
        out_dir=lambda wildcards, output: Path(output[0]).parent,
    shell:
        "python -m cramswarm readme-figures --figures {input} --out-dir {params.out_dir} > {log} 2>&1"


rule claims_table:
    """The papers' claims, checked: one row per claim of Cramming and SWARM with our measurement, the test and a
    verdict derived from the result files (named target `claims` runs every experiment they need)."""
    input:
        claims_inputs,
    output:
        table=table(f"{CLAIMS}/claims.csv", "Claims"),
        markdown=f"{CLAIMS}/claims.md",
        readme=f"results/readme/claims_{SOURCE}.csv",  # committed; the README's generated claims block reads it
        readme_record=f"results/readme/claims_{SOURCE}.csv.provenance.json",  # where its inputs were made
    log:
        f"logs/report/{SOURCE}/claims.log",
    benchmark:
        f"results/benchmarks/claims_table/{SOURCE}/claims.tsv"
    conda:
        "../envs/cramswarm.yaml"
    resources:
        **REPORT_RESOURCES,
    params:
        manifest=lambda wildcards: json.dumps(claims_manifest()),  # a function: the pattern has {braces}
        stem=subpath(output.table, strip_suffix=".csv"),
        configs=CONFIG_FILES,  # recorded with the committed copy (its provenance)
    shell:
        "python -m cramswarm claims --manifest {params.manifest:q} --out-stem {params.stem} "
        "--copy-to {output.readme} --config-files {params.configs:q} > {log} 2>&1"


rule claims_available:  # no input or output: runs whenever asked, on whatever results exist
    """claims_table's files from the results already on disk (a claim without its inputs: not run), no experiment."""
    log:
        f"logs/report/{SOURCE}/claims_available.log",
    conda:
        "../envs/cramswarm.yaml"
    resources:
        **REPORT_RESOURCES,
    params:
        manifest=lambda wildcards: json.dumps(claims_manifest()),  # a function: the pattern has {braces}
        stem=f"{CLAIMS}/claims",
        readme=f"results/readme/claims_{SOURCE}.csv",
        configs=CONFIG_FILES,
    shell:
        "python -m cramswarm claims --manifest {params.manifest:q} --out-stem {params.stem} "
        "--copy-to {params.readme} --config-files {params.configs:q} > {log} 2>&1"
