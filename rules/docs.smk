# Named target `docs`: the numbers of README.md and docs/ come from the workflow, never typed by hand.
# It snapshots the study's GLUE table and the run's config into results/readme/ (committed, beside the README
# figures of `readme_figures`) with provenance.json (git commit, config checksum), then rewrites every
# <!-- generated:NAME --> block of README.md and docs/*.md from those committed files (src/cramswarm/report/docs.py).
# tests/test_docs.py fails when a committed block differs from what the committed results give.


localrules:
    docs_snapshot,
    docs,


DOCS_PAGES = ["README.md", *sorted(str(p) for p in Path(workflow.basedir, "docs").glob("*.md"))]


rule docs_snapshot:
    """The study's GLUE table, figures and config as run, copied into results/readme/ with provenance.json."""
    input:
        glue=GLUE_PAPER_TABLES[0],
        figures=rules.readme_figures.output,
        config=rules.study_record.output.config,
        software=rules.study_record.output.software,
    output:
        "results/readme/glue_paper.csv",
        "results/readme/config.yaml",
        "results/readme/provenance.json",
    log:
        f"logs/report/{SOURCE}/docs_snapshot.log",
    conda:
        "../envs/cramswarm.yaml"
    params:
        record=subpath(input.config, parent=True),  # the study record folder (RECORD)
        source=SOURCE,
    shell:
        "python -m cramswarm docs-snapshot --files {input.glue} {input.figures} --record {params.record} "
        "--source {params.source} --out-dir results/readme > {log} 2>&1"


rule docs:  # no output: runs whenever it is asked for, and rewrites the generated blocks in place
    """Rewrite the generated blocks of README.md and docs/*.md from the committed results/readme/ files."""
    input:
        rules.docs_snapshot.output,
        pages=DOCS_PAGES,
    log:
        f"logs/report/{SOURCE}/docs.log",
    conda:
        "../envs/cramswarm.yaml"
    shell:
        "python -m cramswarm docs --results-dir results/readme {input.pages} > {log} 2>&1"
