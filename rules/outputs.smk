# How outputs are declared across stages: the benchmark folder, and the figures and tables that
# `snakemake --report` shows (every figure command writes <stem>.png, <stem>.pdf and <stem>.caption.rst).

# One Snakemake benchmark TSV per job: results/benchmarks/<rule>/<the job's wildcards>.tsv, written literally in each
# rule (the study record sums them per rule, by that folder).
BENCHMARKS = "results/benchmarks"


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
