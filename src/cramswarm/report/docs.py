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
- ``table:FILE``: any committed CSV, Markdown table or JSON file (benchmark output) under the results folder;
- ``history:TOPIC``: the measured history of one topic (``history/<topic>.csv``, :mod:`cramswarm.report.history`),
  newest first, grouped by section: the body of the page ``docs/history/<topic>.md``.

``tests/test_docs.py`` regenerates every block from the committed files and fails if a committed block differs;
``python -m cramswarm docs README.md docs/*.md docs/history/*.md`` rewrites them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path

from cramswarm.report.history import history_file, read_history, record_history
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
    "precision_cpu.csv": "python benchmarks/precision.py --also-avx2 --out results/readme/precision_cpu.csv",
    "pretrain_gpu.csv": "python benchmarks/throughput_table.py results/readme/pretrain_gpu/*.json "
    "--out results/readme/pretrain_gpu.csv",
    "pretrain_gpu_kernels.csv": "python benchmarks/throughput_table.py results/readme/pretrain_gpu/*.json "
    "--profile-out results/readme/pretrain_gpu_kernels.csv",
}


def _under_results(results_dir: Path, file: str, block: str) -> Path:
    path = (results_dir / file).resolve()
    if results_dir.resolve() not in path.parents:
        raise DocsError(f"generated:{block}: {file} must lie under {RESULTS_DIR}")
    return path


def _file_body(path: Path, block: str) -> str:
    """A committed .md file as written, a .csv as a table of its cells exactly as written, a .json flattened to
    key/value rows."""
    import pandas as pd

    if path.suffix == ".md":
        return path.read_text().rstrip("\n")
    if path.suffix == ".csv":
        return _markdown(pd.read_csv(path, dtype=str, keep_default_na=False))
    if path.suffix == ".json":
        rows = _flatten(json.loads(path.read_text()))
        return _markdown(pd.DataFrame(rows, columns=["key", "value"]).astype({"value": str}))
    raise DocsError(f"generated:{block}: only .csv, .md and .json files can be rendered")


def render_table(results_dir: Path, doc_dir: Path, repo: Path, file: str) -> str:
    path = _under_results(results_dir, file, f"table:{file}")
    writer = TABLE_WRITERS.get(file)
    if not path.is_file():
        return missing(results_dir / file, results_dir, writer or "the benchmark or rule that writes it")
    return (
        _file_body(path, f"table:{file}")
        + "\n\n"
        + provenance_line([results_dir / file], results_dir, writer=writer or "the rule or benchmark named in docs")
    )


HISTORY_WRITER = "a benchmark's `--record`, or `cramswarm.report.history.record_history`"
COMMIT = re.compile(r"\b[0-9a-f]{7,40}(?:-dirty)?\b")


def _code(text: str) -> str:
    """``text`` as an inline code span (a fenced block where it spans lines)."""
    if "\n" in text:
        return "\n```bash\n" + text.strip("\n") + "\n```"
    fence = "``" if "`" in text else "`"
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _history_row(row: dict, results_dir: Path, record: dict, block: str) -> str:
    commits = len(COMMIT.findall(row["commit"]))
    commit = COMMIT.sub(lambda m: f"`{m[0]}`", row["commit"]) if row["commit"].strip() else "not recorded"
    meta = f"Commit{'s' if commits > 1 else ''} {commit}" + (f"; {row['machine']}" if row["machine"].strip() else "")
    lines = [f"### {row['date']}: {row['what']}", "", meta + "."]
    if row["command"].strip():
        command = _code(row["command"])
        lines[-1] += " Command:" + ("" if command.startswith("\n") else " ") + command
    lines += ["", row["result"].strip()]
    if row["details"].strip():
        path = _under_results(results_dir, row["details"], block)
        if not path.is_file():
            raise DocsError(f"generated:{block}: details file {row['details']} is not committed")
        lines += ["", _file_body(path, block)]
        if file_record(path, record):  # a committed result with its own run record: name it
            lines += ["", provenance_line([results_dir / row["details"]], results_dir,
                                          writer="the rule or benchmark named in docs")]  # fmt: skip
    return "\n".join(lines)


def render_history(results_dir: Path, doc_dir: Path, repo: Path, topic: str) -> str:
    """One topic's measured history: sections ordered by their newest measurement, newest first, and within each
    the rows newest first (by date, then the later row of the file first), each with its commit, machine, command,
    result and details; then a provenance line. A details file's links are written for ``docs/history/``."""
    block = f"history:{topic}"
    try:
        path = history_file(results_dir, topic)
        rows = read_history(path) if path.is_file() else None
    except ValueError as error:
        raise DocsError(f"generated:{block}: {error}") from error
    if rows is None:
        return missing(path, results_dir, HISTORY_WRITER)
    ordered = sorted(enumerate(rows), key=lambda item: (item[1]["date"], item[0]), reverse=True)
    sections: dict[str, list[dict]] = {}
    for _, row in ordered:
        sections.setdefault(row["section"], []).append(row)
    record = load_provenance(results_dir)
    parts = []
    for section, members in sections.items():
        parts.append(f"## {section}")
        parts += [_history_row(row, results_dir, record, block) for row in members]
    dates = sorted(row["date"] for row in rows)
    extra = f"{len(rows)} measurements" + (f", {dates[0]} to {dates[-1]}" if rows else "")
    provenance = (f"<sub>Generated by `python -m cramswarm docs` from `{display(path, results_dir)}` (rows written "
                  f"by {HISTORY_WRITER}); {extra}, each with the commit and machine it was measured on.</sub>")
    return "\n\n".join([*parts, provenance])


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
    if name.startswith("history:"):
        return render_history(results_dir, doc_dir, repo, name.removeprefix("history:"))
    if name not in RENDERERS:
        known = ", ".join([*RENDERERS, "table:FILE", "claims:SOURCE", "claims-summary:SOURCE", "history:TOPIC"])
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


def history_page(repo: str | os.PathLike, topic: str) -> Path:
    """The page of a topic's measured history: ``docs/history/<topic>.md``."""
    return Path(repo) / "docs" / "history" / f"{topic}.md"


def record_measurement(topic: str, what: str, command: str, result: str, *, section: str,
                       repo: str | os.PathLike = ".", details: str = "", **fields) -> dict:  # fmt: skip
    """Append a measurement to the topic's history (:func:`cramswarm.report.history.record_history`, ``fields``
    passed on) and redraw the topic's page where it exists, so that the committed page stays what the file gives."""
    row = record_history(topic, what, command, result, section=section, details=details, repo=repo, **fields)
    page = history_page(repo, topic)
    if page.is_file():
        regenerate([page], fields.get("results_dir") or Path(repo) / RESULTS_DIR, repo)
    return row
