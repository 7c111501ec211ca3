"""Generated blocks of the README and docs/: numbers that cannot go stale.

A Markdown file marks a block with two lines of their own,

    <!-- generated:NAME -->
    ...
    <!-- /generated:NAME -->

and :func:`rewrite` replaces what lies between the markers with what :func:`render_block` makes of the committed
results folder (``results/readme/``). Every block ends with a provenance line: the file it came from and, where
the run recorded them (``provenance.json``, written by :func:`snapshot`), the run's git commit, config and date.
A block whose source file is not committed says so and names the command that writes it; it never shows a
number that was typed by hand.

Blocks:

- ``figures``: the README's two figures (``readme`` target), each with its checksum;
- ``glue``: the study's GLUE table (``glue_paper.csv``) in the paper's columns, the published rows below ours;
- ``claims:SOURCE``: the papers' claims checked on one source (``claims_<source>.csv``, `claims` target);
- ``claims-summary:SOURCE``: the same claims' verdict counts and ids in a few lines (the README's);
- ``swarm-findings``: SWARM's findings from the committed runs beside the paper's (``swarm_findings``);
- ``table:FILE``: any committed CSV, Markdown table or JSON file (benchmark output) under the results folder.

``tests/test_docs.py`` regenerates every block from the committed files and fails if a committed block differs;
``python -m cramswarm docs README.md docs/*.md`` rewrites them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path

from cramswarm.report.markdown import (  # noqa: F401 (sha256, sidecar, record_file: the docs' API too)
    PROVENANCE,
    RESULTS_DIR,
    cell,
    display,
    file_record,
    load_provenance,
    missing,
    provenance_line,
    record_file,
    sha256,
    sidecar,
)

FIGURES = ("mlm_loss_vs_tokens.png", "glue_by_task.png")
FIGURE_ALT = {
    "mlm_loss_vs_tokens.png": "MLM training loss vs tokens for every pretrained model",
    "glue_by_task.png": "GLUE dev score per task, the paper's values as markers",
}
# The paper's Table 3/4 columns, in its order, then our average and its seed spread.
GLUE_COLUMNS = (
    "model", "vocab", "mnli_m", "mnli_mm", "qqp_f1", "qnli", "sst2", "cola", "stsb_pearson", "mrpc_f1", "rte",
    "avg_paper", "avg_paper_std",
)  # fmt: skip

# A marker is a line of its own (a marker quoted inside a sentence or code span is prose, not a block).
BLOCK = re.compile(
    r"^(?P<open><!-- generated:(?P<name>[^ >]+) -->\n)(?P<body>.*?)^(?P<close><!-- /generated:(?P=name) -->)$",
    re.DOTALL | re.MULTILINE,
)
ANY_MARKER = re.compile(r"^<!-- (/?)generated:([^ >]+) -->$", re.MULTILINE)


class DocsError(ValueError):
    """A malformed or unknown generated block."""


def render_figures(results_dir: Path, doc_dir: Path, repo: Path) -> str:
    lines = []
    present = [results_dir / name for name in FIGURES if (results_dir / name).is_file()]
    if not present:
        return missing(results_dir / FIGURES[0], results_dir, "snakemake --cores 1 readme")
    for path in present:
        link = os.path.relpath(repo / RESULTS_DIR / path.name, doc_dir).replace(os.sep, "/")
        lines += [f"![{FIGURE_ALT.get(path.name, path.stem)}]({link})", ""]
    checksums = ", ".join(f"{p.name} sha256 `{sha256(p)[:12]}`" for p in present)
    lines.append(provenance_line(present, results_dir, writer="snakemake --cores 1 readme", extra=checksums))
    return "\n".join(lines)


def _markdown(df, integer_columns: Iterable[str] = ()) -> str:
    """A compact GitHub table; column headers as the study's tables name them."""
    from cramswarm.report.tables import COLUMN_LABELS

    integer = [c in set(integer_columns) for c in df.columns]
    headers = [COLUMN_LABELS.get(c, c) for c in df.columns]
    rows = [[cell(v, i) for v, i in zip(row, integer)] for row in df.astype(object).itertuples(index=False)]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def render_glue(results_dir: Path, doc_dir: Path, repo: Path) -> str:
    import pandas as pd

    path = results_dir / "glue_paper.csv"
    if not path.is_file():
        return missing(path, results_dir, "snakemake --cores 8 docs")
    df = pd.read_csv(path)
    if "kind" in df.columns:  # published rows: name and confidence tag (first word of `note`) in the model column
        paper = df["kind"] != "ours"
        notes = df["note"].fillna("").astype(str) if "note" in df.columns else pd.Series([""] * len(df))
        df["model"] = df["model"].astype(str)
        df.loc[paper, "model"] = [
            f"*paper: {m}{' ' + n.split()[0] if n.strip() else ''}*"
            for m, n in zip(df.loc[paper, "model"], notes[paper])
        ]
    columns = [c for c in GLUE_COLUMNS if c in df.columns]
    seeds = sorted({int(s) for s in df.get("n_seeds", pd.Series(dtype=float)).dropna()})
    extra = f"median over {'/'.join(map(str, seeds))} fine-tuning seeds" if seeds else ""
    table = _markdown(df[columns], integer_columns=("vocab",))
    return table + "\n\n" + provenance_line([path], results_dir, writer="snakemake --cores 8 docs", extra=extra)


def _flatten(value, prefix: str = "") -> list[tuple[str, object]]:
    if isinstance(value, dict):
        return [item for key, v in value.items() for item in _flatten(v, f"{prefix}{key}.")]
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return [item for i, v in enumerate(value) for item in _flatten(v, f"{prefix}{i}.")]
    return [(prefix.rstrip("."), json.dumps(value) if isinstance(value, list) else value)]


# The command that writes a committed table, where one is known (else the docs around the block name it).
TABLE_WRITERS = {
    "front_door.csv": "python benchmarks/front_door.py --smoke --default --out results/readme/front_door.csv",
    "pretrain_gpu.csv": "python benchmarks/throughput_table.py results/readme/pretrain_gpu/*.json "
    "--out results/readme/pretrain_gpu.csv",
    "pretrain_gpu_kernels.csv": "python benchmarks/throughput_table.py results/readme/pretrain_gpu/*.json "
    "--profile-out results/readme/pretrain_gpu_kernels.csv",
}


def render_table(results_dir: Path, doc_dir: Path, repo: Path, file: str) -> str:
    import pandas as pd

    path = (results_dir / file).resolve()
    if results_dir.resolve() not in path.parents:
        raise DocsError(f"generated:table:{file}: the file must lie under {RESULTS_DIR}")
    writer = TABLE_WRITERS.get(file)
    if not path.is_file():
        return missing(results_dir / file, results_dir, writer or "the benchmark or rule that writes it")
    if path.suffix == ".md":
        body = path.read_text().rstrip("\n")
    elif path.suffix == ".csv":
        body = _markdown(pd.read_csv(path, dtype=str, keep_default_na=False))  # cells exactly as written
    elif path.suffix == ".json":
        rows = _flatten(json.loads(path.read_text()))
        body = _markdown(pd.DataFrame(rows, columns=["key", "value"]).astype({"value": str}))
    else:
        raise DocsError(f"generated:table:{file}: only .csv, .md and .json files can be rendered")
    return (
        body
        + "\n\n"
        + provenance_line([results_dir / file], results_dir, writer=writer or "the rule or benchmark named in docs")
    )


# The claims table's columns shown in a page (the committed CSV has them all, docs/claims.md explains each).
CLAIMS_COLUMNS = ("id", "claim", "where", "paper_number", "measurement", "test", "verdict", "setup")


def _claims_block(results_dir: Path, source: str, block: str, body: Callable) -> str:
    """A block read from ``claims_<source>.csv`` (written by the `claims` target): ``body(frame)`` as its text,
    then the provenance line with the file's checksum; the missing-file note where it is not committed."""
    import pandas as pd

    if not re.fullmatch(r"[a-z0-9_]+", source):
        raise DocsError(f"generated:{block}:{source}: a source name is lowercase letters, digits and _")
    path = results_dir / f"claims_{source}.csv"
    if not path.is_file():
        return missing(path, results_dir, "snakemake --cores 8 claims")
    text = body(pd.read_csv(path, dtype=str, keep_default_na=False))
    extra = f"{path.name} sha256 `{sha256(path)[:12]}`"
    return text + "\n\n" + provenance_line([path], results_dir, writer="snakemake --cores 8 claims", extra=extra)


def render_claims(results_dir: Path, doc_dir: Path, repo: Path, source: str) -> str:
    """The claims table of one source, with the count per verdict."""
    from cramswarm.report.claims import LABELS, VERDICTS

    def table(df) -> str:
        lines = ["| " + " | ".join(LABELS[c] for c in CLAIMS_COLUMNS) + " |", "|" + "---|" * len(CLAIMS_COLUMNS)]
        lines += ["| " + " | ".join(cell(row[c]) for c in CLAIMS_COLUMNS) + " |" for _, row in df.iterrows()]
        counts = df["verdict"].value_counts()
        lines += ["", "Verdicts: " + ", ".join(f"{v} {int(counts.get(v, 0))}" for v in VERDICTS) + "."]
        return "\n".join(lines)

    return _claims_block(results_dir, source, "claims", table)


def render_claims_summary(results_dir: Path, doc_dir: Path, repo: Path, source: str) -> str:
    """The verdicts of one source's claims in a few lines (for the README; the full table is ``claims:SOURCE``):
    the count per verdict and the claim ids under each."""
    from cramswarm.report.claims import VERDICTS

    def summary(df) -> str:
        parts = []
        for verdict in VERDICTS:
            ids = list(df.loc[df["verdict"] == verdict, "id"])
            parts.append(f"**{verdict}** {len(ids)}" + (f" ({', '.join(ids)})" if ids else ""))
        return "; ".join(parts) + "."

    return _claims_block(results_dir, source, "claims-summary", summary)


def render_swarm_findings(results_dir: Path, doc_dir: Path, repo: Path) -> str:
    from cramswarm.report import swarm_findings

    return swarm_findings.render(results_dir, doc_dir, repo)


RENDERERS: dict[str, Callable[..., str]] = {
    "figures": render_figures, "glue": render_glue, "swarm-findings": render_swarm_findings,
}


def render_block(name: str, results_dir: str | os.PathLike, doc_dir: str | os.PathLike, repo: str | os.PathLike) -> str:
    """The body of block ``name`` (without markers) for a document in ``doc_dir`` of the repository ``repo``."""
    results_dir, doc_dir, repo = Path(results_dir), Path(doc_dir), Path(repo)
    if name.startswith("table:"):
        return render_table(results_dir, doc_dir, repo, name.removeprefix("table:"))
    if name.startswith("claims:"):
        return render_claims(results_dir, doc_dir, repo, name.removeprefix("claims:"))
    if name.startswith("claims-summary:"):
        return render_claims_summary(results_dir, doc_dir, repo, name.removeprefix("claims-summary:"))
    if name not in RENDERERS:
        known = ", ".join([*RENDERERS, "table:FILE", "claims:SOURCE", "claims-summary:SOURCE"])
        raise DocsError(f"unknown generated block {name!r}; known: {known}")
    return RENDERERS[name](results_dir, doc_dir, repo)


def check_markers(text: str, where: str = "") -> None:
    """Every opening marker has its closing one, in order, not nested."""
    open_name = None
    for match in ANY_MARKER.finditer(text):
        closing, name = match.group(1) == "/", match.group(2)
        line = text.count("\n", 0, match.start()) + 1
        if not closing and open_name is not None:
            raise DocsError(f"{where}:{line}: block {name!r} opens inside block {open_name!r}")
        if closing and open_name != name:
            raise DocsError(f"{where}:{line}: closing marker of {name!r} without its opening marker")
        open_name = None if closing else name
    if open_name is not None:
        raise DocsError(f"{where}: block {open_name!r} is never closed")


def rewrite(text: str, results_dir: str | os.PathLike, doc_dir: str | os.PathLike, repo: str | os.PathLike,
            where: str = "") -> str:  # fmt: skip
    """``text`` with every generated block rendered afresh."""
    check_markers(text, where)

    def fill(match: re.Match) -> str:
        body = render_block(match["name"], results_dir, doc_dir, repo)
        return f"{match['open']}{body}\n{match['close']}"

    return BLOCK.sub(fill, text)


def block_names(text: str) -> list[str]:
    return [m["name"] for m in BLOCK.finditer(text)]


def regenerate(paths: Iterable[str | os.PathLike], results_dir: str | os.PathLike, repo: str | os.PathLike,
               *, write: bool = True) -> list[Path]:  # fmt: skip
    """Rewrite the generated blocks of ``paths``; return the files whose text changed (written if ``write``)."""
    changed = []
    for path in map(Path, paths):
        text = path.read_text()
        new = rewrite(text, results_dir, path.resolve().parent, repo, where=str(path))
        if new != text:
            changed.append(path)
            if write:
                tmp = path.with_name(path.name + ".tmp")
                tmp.write_text(new)
                tmp.replace(path)
    return changed


def _git_commit_of(software_csv: Path) -> str | None:
    import pandas as pd

    rows = pd.read_csv(software_csv)
    commit = rows.loc[rows["component"] == "git commit", "version"]
    value = str(commit.iloc[0]) if len(commit) else ""
    return value if re.fullmatch(r"[0-9a-f]{7,40}", value) else None


def snapshot(files: Iterable[str | os.PathLike], record_dir: str | os.PathLike, out_dir: str | os.PathLike,
             *, source: str | None = None) -> Path:  # fmt: skip
    """Copy the study's ``files`` into ``out_dir`` (the committed results folder) with the run's config as run
    (``config.yaml`` of the study record) and write ``provenance.json``: the git commit the run recorded, the
    config's checksum, and each copied file's origin and checksum. It records these files only (rule
    ``docs_snapshot`` declares it, so Snakemake removes it before the job): any other committed file carries its own
    record in a sidecar (:func:`record_file`)."""
    out, record = Path(out_dir), Path(record_dir)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(record / "config.yaml", out / "config.yaml")
    entries = {}
    for src in map(Path, files):
        if src.resolve() != (out / src.name).resolve():  # the README figures are written into out_dir already
            shutil.copyfile(src, out / src.name)
        entries[src.name] = {"from": src.as_posix(), "sha256": sha256(out / src.name)}
    payload = {
        "written_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "run": {
            "git_commit": _git_commit_of(record / "software.csv"),
            "config": display(out / "config.yaml", out),
            "config_sha256": sha256(out / "config.yaml"),
            "source": source,
        },
        "files": entries,
    }
    path = out / PROVENANCE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return path
