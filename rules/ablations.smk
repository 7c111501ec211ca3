# Stage 6 (named targets only): the training ablations of Cramming, every run at ablations.budget.
# Runs are named by cramswarm.config.resolve_runs and built by the same pretrain/finetune rules as the study.
# Their functions (ABLATIONS, data_reports, data_runs_json): src/cramswarm/workflow/ablations.py.


# The reports: seconds of work on the submit host rather than sbatch jobs of their own (with --executor slurm).
localrules:
    ablation_arch_report,
    ablation_schedule_report,
    ablation_groups_report,
    ablation_data_report,


rule ablation_arch_report:
    """Figure 1 and the per-variant table (loss, tokens/s, fine-tuned scores) of the architecture ablation."""
    input:
        summaries=ablation_checkpoints("arch"),
        results=ablation_finetunes("arch"),
    output:
        *figure_companions(f"{ABLATIONS}/figure1_loss_vs_tokens.png"),
        table=table(f"{ABLATIONS}/arch.csv", "Cramming ablations", "Architecture (Figure 1)"),
        markdown=f"{ABLATIONS}/arch.md",
        figure=figure(f"{ABLATIONS}/figure1_loss_vs_tokens.png", "Cramming ablations", "Architecture (Figure 1)"),
    log:
        f"logs/report/{SOURCE}/ablation_arch.log",
    benchmark:
        f"results/benchmarks/ablation_arch_report/{SOURCE}/ablation_arch.tsv"
    conda:
        "../envs/cramswarm.yaml"
    resources:
        **REPORT_RESOURCES,
    params:
        runs=run_dirs_json("arch"),
        stem=subpath(output.table, strip_suffix=".csv"),
    shell:
        "python -m cramswarm ablation-report --kind arch --runs {params.runs:q} --results {input.results} "
        "--out-stem {params.stem} --png {output.figure} > {log} 2>&1"


rule ablation_schedule_report:
    """Figure 2: LR multiplier over the budget, held-out loss per schedule x peak LR."""
    input:
        ablation_checkpoints("schedule"),
    output:
        *figure_companions(f"{ABLATIONS}/figure2_schedules.png"),
        table=table(f"{ABLATIONS}/schedule.csv", "Cramming ablations", "Schedule (Figure 2)"),
        markdown=f"{ABLATIONS}/schedule.md",
        pivot=table(f"{ABLATIONS}/schedule_pivot.csv", "Cramming ablations", "Schedule (Figure 2)"),
        figure=figure(f"{ABLATIONS}/figure2_schedules.png", "Cramming ablations", "Schedule (Figure 2)"),
    log:
        f"logs/report/{SOURCE}/ablation_schedule.log",
    benchmark:
        f"results/benchmarks/ablation_schedule_report/{SOURCE}/ablation_schedule.tsv"
    conda:
        "../envs/cramswarm.yaml"
    resources:
        **REPORT_RESOURCES,
    params:
        runs=run_dirs_json("schedule"),
        stem=subpath(output.table, strip_suffix=".csv"),
    shell:
        "python -m cramswarm ablation-report --kind schedule --runs {params.runs:q} "
        "--out-stem {params.stem} --png {output.figure} > {log} 2>&1"


rule ablation_groups_report:
    """Table 5: the crammed architecture and training recipe, each reset to BERT's."""
    input:
        summaries=ablation_checkpoints("groups"),
        results=ablation_finetunes("groups"),
    output:
        table=table(f"{ABLATIONS}/groups.csv", "Cramming ablations", "Recipe groups (Table 5)"),
        markdown=f"{ABLATIONS}/groups.md",
    log:
        f"logs/report/{SOURCE}/ablation_groups.log",
    benchmark:
        f"results/benchmarks/ablation_groups_report/{SOURCE}/ablation_groups.tsv"
    conda:
        "../envs/cramswarm.yaml"
    resources:
        **REPORT_RESOURCES,
    params:
        runs=run_dirs_json("groups"),
        stem=subpath(output.table, strip_suffix=".csv"),
    shell:
        "python -m cramswarm ablation-report --kind groups --runs {params.runs:q} --results {input.results} "
        "--out-stem {params.stem} > {log} 2>&1"


rule ablation_data_report:
    """Table 2: corpus sources x data recipes (none, filtered, filtered + sorted, + dedup) at ablations.budget."""
    input:
        summaries=ablation_checkpoints("data"),
        results=ablation_finetunes("data"),
        reports=[path for run in runs_of("data") for path in data_reports(RUNS[run]["data"]).values()],
    output:
        table=table(f"{ABLATIONS}/data.csv", "Cramming ablations", "Data (Table 2)"),
        markdown=f"{ABLATIONS}/data.md",
        table2=table(f"{ABLATIONS}/data_table2.csv", "Cramming ablations", "Data (Table 2)"),
        table2_markdown=f"{ABLATIONS}/data_table2.md",
    log:
        f"logs/report/{SOURCE}/ablation_data.log",
    benchmark:
        f"results/benchmarks/ablation_data_report/{SOURCE}/ablation_data.tsv"
    conda:
        "../envs/cramswarm.yaml"
    resources:
        **REPORT_RESOURCES,
    params:
        runs=data_runs_json(),
        stem=subpath(output.table, strip_suffix=".csv"),
    shell:
        "python -m cramswarm data-ablation-report --runs {params.runs:q} --results {input.results} "
        "--out-stem {params.stem} > {log} 2>&1"
