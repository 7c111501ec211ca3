# Stage 6 (named targets only): the training ablations of Cramming, every run at ablations.budget.
# Runs are named by cramswarm.config.resolve_runs and built by the same pretrain/finetune rules as the study.

ABLATIONS = f"results/ablations/{SOURCE}"


rule ablation_arch_report:  # Figure 1 + per-variant table (loss, tokens/s, fine-tuned scores)
    input:
        summaries=ablation_checkpoints("arch"),
        results=ablation_finetunes("arch"),
    output:
        table=f"{ABLATIONS}/arch.csv",
        markdown=f"{ABLATIONS}/arch.md",
        figure=f"{ABLATIONS}/figure1_loss_vs_tokens.png",
    params:
        runs=run_dirs_json("arch"),
        stem=subpath(output.table, strip_suffix=".csv"),
    conda:
        "../envs/cramswarm.yaml"
    log:
        f"logs/report/{SOURCE}/ablation_arch.log",
    shell:
        "python -m cramswarm ablation-report --kind arch --runs {params.runs:q} --results {input.results} "
        "--out-stem {params.stem} --png {output.figure} > {log} 2>&1"


rule ablation_schedule_report:  # Figure 2: LR multiplier over the budget, held-out loss per schedule x peak LR
    input:
        ablation_checkpoints("schedule"),
    output:
        table=f"{ABLATIONS}/schedule.csv",
        markdown=f"{ABLATIONS}/schedule.md",
        pivot=f"{ABLATIONS}/schedule_pivot.csv",
        figure=f"{ABLATIONS}/figure2_schedules.png",
    params:
        runs=run_dirs_json("schedule"),
        stem=subpath(output.table, strip_suffix=".csv"),
    conda:
        "../envs/cramswarm.yaml"
    log:
        f"logs/report/{SOURCE}/ablation_schedule.log",
    shell:
        "python -m cramswarm ablation-report --kind schedule --runs {params.runs:q} "
        "--out-stem {params.stem} --png {output.figure} > {log} 2>&1"


rule ablation_groups_report:  # Table 5: architecture / training recipe reset to BERT's
    input:
        summaries=ablation_checkpoints("groups"),
        results=ablation_finetunes("groups"),
    output:
        table=f"{ABLATIONS}/groups.csv",
        markdown=f"{ABLATIONS}/groups.md",
    params:
        runs=run_dirs_json("groups"),
        stem=subpath(output.table, strip_suffix=".csv"),
    conda:
        "../envs/cramswarm.yaml"
    log:
        f"logs/report/{SOURCE}/ablation_groups.log",
    shell:
        "python -m cramswarm ablation-report --kind groups --runs {params.runs:q} --results {input.results} "
        "--out-stem {params.stem} > {log} 2>&1"
