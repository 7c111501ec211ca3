# Stage 6 (named targets only): the training ablations of Cramming, every run at ablations.budget.
# Runs are named by cramswarm.config.resolve_runs and built by the same pretrain/finetune rules as the study.

ABLATIONS = f"results/ablations/{SOURCE}"


rule ablation_arch_report:  # Figure 1 + per-variant table (loss, tokens/s, fine-tuned scores)
    input:
        summaries=ablation_checkpoints("arch"),
        results=ablation_finetunes("arch"),
    output:
        *figure_companions(f"{ABLATIONS}/figure1_loss_vs_tokens.png"),
        table=table(f"{ABLATIONS}/arch.csv", "Cramming ablations", "Architecture (Figure 1)"),
        markdown=f"{ABLATIONS}/arch.md",
        figure=figure(f"{ABLATIONS}/figure1_loss_vs_tokens.png", "Cramming ablations", "Architecture (Figure 1)"),
    params:
        runs=run_dirs_json("arch"),
        stem=subpath(output.table, strip_suffix=".csv"),
    conda:
        "../envs/cramswarm.yaml"
    log:
        f"logs/report/{SOURCE}/ablation_arch.log",
    benchmark:
        bench(f"logs/report/{SOURCE}/ablation_arch.log", "ablation_arch_report")
    shell:
        "python -m cramswarm ablation-report --kind arch --runs {params.runs:q} --results {input.results} "
        "--out-stem {params.stem} --png {output.figure} > {log} 2>&1"


rule ablation_schedule_report:  # Figure 2: LR multiplier over the budget, held-out loss per schedule x peak LR
    input:
        ablation_checkpoints("schedule"),
    output:
        *figure_companions(f"{ABLATIONS}/figure2_schedules.png"),
        table=table(f"{ABLATIONS}/schedule.csv", "Cramming ablations", "Schedule (Figure 2)"),
        markdown=f"{ABLATIONS}/schedule.md",
        pivot=table(f"{ABLATIONS}/schedule_pivot.csv", "Cramming ablations", "Schedule (Figure 2)"),
        figure=figure(f"{ABLATIONS}/figure2_schedules.png", "Cramming ablations", "Schedule (Figure 2)"),
    params:
        runs=run_dirs_json("schedule"),
        stem=subpath(output.table, strip_suffix=".csv"),
    conda:
        "../envs/cramswarm.yaml"
    log:
        f"logs/report/{SOURCE}/ablation_schedule.log",
    benchmark:
        bench(f"logs/report/{SOURCE}/ablation_schedule.log", "ablation_schedule_report")
    shell:
        "python -m cramswarm ablation-report --kind schedule --runs {params.runs:q} "
        "--out-stem {params.stem} --png {output.figure} > {log} 2>&1"


rule ablation_groups_report:  # Table 5: architecture / training recipe reset to BERT's
    input:
        summaries=ablation_checkpoints("groups"),
        results=ablation_finetunes("groups"),
    output:
        table=table(f"{ABLATIONS}/groups.csv", "Cramming ablations", "Recipe groups (Table 5)"),
        markdown=f"{ABLATIONS}/groups.md",
    params:
        runs=run_dirs_json("groups"),
        stem=subpath(output.table, strip_suffix=".csv"),
    conda:
        "../envs/cramswarm.yaml"
    log:
        f"logs/report/{SOURCE}/ablation_groups.log",
    benchmark:
        bench(f"logs/report/{SOURCE}/ablation_groups.log", "ablation_groups_report")
    shell:
        "python -m cramswarm ablation-report --kind groups --runs {params.runs:q} --results {input.results} "
        "--out-stem {params.stem} > {log} 2>&1"


def data_reports(recipe):
    """The stage reports of a data recipe's chain at the main vocab size (only the filters it switches on)."""
    keys = {**data_wildcards(recipe), "vocab": MAIN_VOCAB}
    reports = {"corpus": "results/data/{corpus}/corpus.report.json".format(**keys)}
    steps = keys["filters"].split("-") if keys["filters"] != "raw" else []
    for i, step in enumerate(steps):
        kind = "trash" if step.startswith("trash") else "dedup"
        reports[kind] = "results/data/{corpus}/{chain}/report.json".format(chain="-".join(steps[: i + 1]), **keys)
    packed = "results/packed/{corpus}/{filters}/{family}-v{vocab}".format(**keys)
    reports["pack"] = f"{packed}/packed.report.json"
    reports["order"] = f"{packed}/{keys['order']}/report.json"
    return reports


def data_runs_json():
    """{run: label, source, cell, data recipe, summary, stage reports} of the Table 2 runs."""
    runs = {}
    for run in runs_of("data"):
        spec = RUNS[run]
        source, cell = spec["label"].split(" / ")
        runs[run] = {"label": spec["label"], "source": source, "cell": cell, "data": spec["data"],
                     "summary": f"{checkpoint_dir(run, MAIN_VOCAB)}/summary.json", "reports": data_reports(spec["data"])}
    return json.dumps(runs)  # in config order (sources, then cells): the table's row order


rule ablation_data_report:  # Table 2: sources x {none, filtered, filtered + sorted, + dedup} at ablations.budget
    input:
        summaries=ablation_checkpoints("data"),
        results=ablation_finetunes("data"),
        reports=[path for run in runs_of("data") for path in data_reports(RUNS[run]["data"]).values()],
    output:
        table=table(f"{ABLATIONS}/data.csv", "Cramming ablations", "Data (Table 2)"),
        markdown=f"{ABLATIONS}/data.md",
        table2=table(f"{ABLATIONS}/data_table2.csv", "Cramming ablations", "Data (Table 2)"),
        table2_markdown=f"{ABLATIONS}/data_table2.md",
    params:
        runs=data_runs_json(),
        stem=subpath(output.table, strip_suffix=".csv"),
    conda:
        "../envs/cramswarm.yaml"
    log:
        f"logs/report/{SOURCE}/ablation_data.log",
    benchmark:
        bench(f"logs/report/{SOURCE}/ablation_data.log", "ablation_data_report")
    shell:
        "python -m cramswarm data-ablation-report --runs {params.runs:q} --results {input.results} "
        "--out-stem {params.stem} > {log} 2>&1"
