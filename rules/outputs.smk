# How outputs are declared across stages: each job's benchmark file, and the figures and tables that
# `snakemake --report` shows (every figure command writes <stem>.png, <stem>.pdf and <stem>.caption.rst).

BENCHMARKS = "results/benchmarks"  # one Snakemake benchmark TSV per job, mirroring its log path under logs/


def bench(log, rule):
    """The benchmark file of a job of `rule` whose log is `log`: logs/<folder>/<rest>.log ->
    results/benchmarks/<rule>/<rest>.tsv (the study record sums them per rule, by that folder)."""
    rest = log.removeprefix("logs/").split("/", 1)[1].removesuffix(".log")
    return f"{BENCHMARKS}/{rule}/{rest}.tsv"


def figure(png, category, subcategory=None):
    """A figure's PNG, shown in `snakemake --report` with the caption its command writes beside it."""
    caption = f"../{png.removesuffix('.png')}.caption.rst"  # relative to rules/, read when the report is built
    return report(png, caption=caption, category=category, subcategory=subcategory)


def figure_companions(*pngs):
    """The PDF and caption file written beside each figure (declared so Snakemake tracks and cleans them)."""
    return [f"{png.removesuffix('.png')}{ext}" for png in pngs for ext in (".pdf", ".caption.rst")]


def table(csv, category, subcategory=None):
    """A table's CSV, shown in `snakemake --report` as a sortable table."""
    return report(csv, category=category, subcategory=subcategory)
