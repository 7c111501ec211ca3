# Stage 5: the paper's tables and figures from the fine-tuning results and pretraining logs.


rule tables:
    input:
        finetune_results,
    output:
        GLUE_TABLES,
        VOCAB_SWEEP_TABLES,
        GLUE_PAPER_TABLES,  # written by `tables` from the --out-stem: <glue stem>_paper.{csv,md,tex}
    params:
        baselines=BASELINES,
        not_swept=NOT_SWEPT,
        glue_stem=subpath(output[0], strip_suffix=".csv"),  # GLUE_TABLES[0]
        sweep_stem=subpath(output[2], strip_suffix=".csv"),  # VOCAB_SWEEP_TABLES[0]
    conda:
        "../envs/cramswarm.yaml"
    log:
        f"logs/report/{SOURCE}/tables.log",
    shell:
        "python -m cramswarm tables --results {input} --baseline {params.baselines} --not-swept {params.not_swept} "
        "--out-stem {params.glue_stem} --sweep-stem {params.sweep_stem} > {log} 2>&1"


rule figures:
    input:
        results=finetune_results,
        logs=pretrain_logs,
    output:
        loss=FIGURES[0],
        tasks=FIGURES[1],
        vocab=FIGURES[2],
    params:
        baselines=BASELINES,
        not_swept=NOT_SWEPT,
    conda:
        "../envs/cramswarm.yaml"
    log:
        f"logs/report/{SOURCE}/figures.log",
    shell:
        "python -m cramswarm figures --results {input.results} --logs {input.logs} "
        "--baseline {params.baselines} --not-swept {params.not_swept} --loss-png {output.loss} --tasks-png {output.tasks} "
        "--vocab-png {output.vocab} > {log} 2>&1"
