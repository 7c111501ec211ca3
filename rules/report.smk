# Stage 5: the paper's tables and figures from the fine-tuning results and pretraining logs.


rule tables:
    input:
        finetune_results,
    output:
        GLUE_TABLES,
        VOCAB_SWEEP_TABLES,
    params:
        baselines=BASELINES,
    conda:
        "../envs/cramswarm.yaml"
    log:
        "logs/report/tables.log",
    shell:
        "python -m cramswarm tables --results {input} --baseline {params.baselines} "
        "--out-stem results/tables/glue --sweep-stem results/tables/vocab_sweep > {log} 2>&1"


rule figures:
    input:
        results=finetune_results,
        logs=pretrain_logs,
    output:
        loss="results/figures/mlm_loss_vs_tokens.png",
        tasks="results/figures/glue_by_task.png",
        vocab="results/figures/glue_vs_vocab.png",
    params:
        baselines=BASELINES,
    conda:
        "../envs/cramswarm.yaml"
    log:
        "logs/report/figures.log",
    shell:
        "python -m cramswarm figures --results {input.results} --logs {input.logs} "
        "--baseline {params.baselines} --loss-png {output.loss} --tasks-png {output.tasks} "
        "--vocab-png {output.vocab} > {log} 2>&1"
