"""The README and docs/: generated blocks match the committed results, the generator on small fixtures, and
every relative link and anchor resolves."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from conftest import TINY, copy_workflow, snakemake

from cramswarm.report import docs, history

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "results" / "readme"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "docs" / "history").glob("*.md")),
         REPO / "config" / "README.md"]
HISTORY_PAGES = sorted((REPO / "docs" / "history").glob("*.md"))


# --- the committed documents -------------------------------------------------------------------------------------


def test_every_page_exists():
    for name in ("data", "models-and-recipes", "glue", "ablations", "swarm", "cluster", "benchmarks",
                 "results-layout", "index"):  # fmt: skip
        assert (REPO / "docs" / f"{name}.md").is_file(), name
    assert (REPO / "config" / "README.md").is_file()


def test_readme_is_a_front_door():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    first_screen = "\n".join(text.splitlines()[:60])
    assert "config/test/tiny.yaml" in first_screen  # the smoke run comes first
    assert 'pip install -e ".[dev]"' in text and "python -m pytest" in text  # what .ci/run does


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_committed_blocks_match_committed_results(page):
    text = page.read_text()
    fresh = docs.rewrite(text, RESULTS, page.parent, REPO, where=str(page))
    assert fresh == text, (
        f"{page.relative_to(REPO)} has generated blocks that differ from results/readme/: "
        f"run `python -m cramswarm docs README.md docs/*.md docs/history/*.md` (or `snakemake --cores 1 docs`)"
    )


def test_readme_has_generated_results():
    names = docs.block_names((REPO / "README.md").read_text())
    assert {"figures", "glue"} <= set(names)


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _slugs(markdown: str) -> set[str]:
    """GitHub's heading anchors: lowercase, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    slugs = set()
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip()
        slug = re.sub(r"[^\w\- ]", "", title.lower().replace("`", "")).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        slugs.add(slug if n == 0 else f"{slug}-{n}")
    return slugs


def _links(page: Path):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)  # links in code blocks are not links
    text = re.sub(r"`[^`\n]*`", "", text)
    return LINK.findall(text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    broken = []
    for target in _links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: {dest} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in _slugs(dest.read_text()):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}:\n" + "\n".join(broken)


def test_link_checker_catches_a_broken_link(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n[ok](#title) [gone](b.md) [bad anchor](#nope) `[code](x.md)`\n")
    assert _links(tmp_path / "a.md") == ["#title", "b.md", "#nope"]
    assert "nope" not in _slugs((tmp_path / "a.md").read_text())


def test_slugs_follow_github():
    assert _slugs("# Cluster (SLURM)\n## Models, recipes and budgets\n## `swarm_study`\n## A\n## A\n") == {
        "cluster-slurm", "models-recipes-and-budgets", "swarm_study", "a", "a-1"}  # fmt: skip


def test_every_history_file_has_its_page_and_every_page_its_file():
    """results/readme/history/<topic>.csv and docs/history/<topic>.md come in pairs; each file's rows are well formed
    and name committed details; the guide pages hold no dated-measurement paragraph (they link to the history)."""
    topics = {p.stem for p in (RESULTS / "history").glob("*.csv")}
    assert topics and topics == {p.stem for p in HISTORY_PAGES}
    for topic in sorted(topics):
        rows = history.read_history(history.history_file(RESULTS, topic))
        assert rows, topic
        assert all((RESULTS / r["details"]).is_file() for r in rows if r["details"]), topic
        assert docs.block_names((REPO / "docs" / "history" / f"{topic}.md").read_text()) == [f"history:{topic}"]
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        prose = re.sub(r"<!-- generated:(\S+) -->.*?<!-- /generated:\1 -->", "", page.read_text(), flags=re.DOTALL)
        dated = r"\(dated measurement|Dated measurement[ ,(]|[Rr]ecorded at commit|[Mm]easured \(?(at commit|20\d\d-)"
        assert not re.search(dated, prose), page


@pytest.mark.parametrize("page", [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *HISTORY_PAGES],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_pages_stay_short(page):
    assert len(page.read_text().splitlines()) <= (200 if page.name == "README.md" else 400)


# --- the generator on fixtures -----------------------------------------------------------------------------------


def _glue_csv(path: Path) -> None:
    rows = [
        {"kind": "ours", "model": "crammed", "vocab": 2048, "mnli_m": 51.04, "mnli_mm": 45.8, "qqp_f1": 55.8,
         "qnli": 52.2, "sst2": 69.2, "cola": 24.1, "stsb_pearson": 9.2, "mrpc_f1": 59.0, "rte": 58.2,
         "avg_paper": 47.36, "avg_paper_std": 0.94, "n_seeds": 5, "note": None},
        {"kind": "paper", "model": "Crammed BERT (A6000, 24 h, v1)", "vocab": None, "mnli_m": 83.9, "mnli_mm": 84.1,
         "qqp_f1": 87.3, "qnli": 89.5, "sst2": 92.2, "cola": 44.5, "stsb_pearson": 84.6, "mrpc_f1": 87.5,
         "rte": 53.8, "avg_paper": 78.6, "avg_paper_std": None, "n_seeds": None, "note": "[paper] printed"},
    ]  # fmt: skip
    pd.DataFrame(rows).to_csv(path, index=False, na_rep="NaN")


def _record(folder: Path, commit="0123456789abcdef0123456789abcdef01234567") -> Path:
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text("source: synthetic\nglue:\n  seeds: [0, 1, 2, 3, 4]\n")
    pd.DataFrame([{"component": "torch", "version": "2.13.0"}, {"component": "git commit", "version": commit}]).to_csv(
        folder / "software.csv", index=False
    )
    return folder


def test_glue_block_from_a_snapshot(tmp_path):
    _glue_csv(tmp_path / "glue_paper.csv")
    out = tmp_path / "repo" / "results" / "readme"
    docs.snapshot([tmp_path / "glue_paper.csv"], _record(tmp_path / "record"), out, source="synthetic")
    record = json.loads((out / "provenance.json").read_text())
    assert record["run"]["git_commit"] == "0123456789abcdef0123456789abcdef01234567"
    assert record["run"]["config_sha256"] == docs.sha256(out / "config.yaml")
    assert record["files"]["glue_paper.csv"]["sha256"] == docs.sha256(out / "glue_paper.csv")

    body = docs.render_block("glue", out, tmp_path / "repo", tmp_path / "repo")
    lines = body.splitlines()
    assert lines[0].startswith("| Model") and "MNLI-m" in lines[0] and "WNLI" not in lines[0]
    assert "| crammed | 2048 | 51.0 | 45.8 |" in body and "| 47.4 | 0.9 |" in body  # 1 decimal, vocab whole
    assert "| 78.6 | — |" in body  # no seed spread for a published row
    assert "*paper: Crammed BERT (A6000, 24 h, v1) [paper]*" in body
    assert "`results/readme/glue_paper.csv`" in lines[-1]
    assert "commit `0123456789ab`" in lines[-1] and "source `synthetic`" in lines[-1]
    assert "median over 5 fine-tuning seeds" in lines[-1]


def test_a_changed_result_makes_the_block_stale(tmp_path):
    out = tmp_path / "results" / "readme"
    out.mkdir(parents=True)
    _glue_csv(out / "glue_paper.csv")
    page = tmp_path / "README.md"
    page.write_text("intro\n<!-- generated:glue -->\nhand-typed 99.9\n<!-- /generated:glue -->\noutro\n")
    assert docs.regenerate([page], out, tmp_path) == [page]
    text = page.read_text()
    assert (
        "hand-typed" not in text and text.startswith("intro\n") and text.endswith("<!-- /generated:glue -->\noutro\n")
    )
    assert docs.regenerate([page], out, tmp_path) == []  # idempotent
    df = pd.read_csv(out / "glue_paper.csv")
    df.loc[0, "mnli_m"] = 12.34
    df.to_csv(out / "glue_paper.csv", index=False, na_rep="NaN")
    assert docs.regenerate([page], out, tmp_path, write=False) == [page]
    assert "12.3" not in page.read_text()  # write=False leaves the file alone


def test_missing_source_says_so_and_names_the_command(tmp_path):
    body = docs.render_block("glue", tmp_path, tmp_path, tmp_path)
    assert "Not committed yet" in body and "results/readme/glue_paper.csv" in body and "snakemake" in body
    assert not re.search(r"\d+\.\d", body)  # no number without its source


def test_figure_links_are_relative_to_the_page(tmp_path):
    out = tmp_path / "results" / "readme"
    out.mkdir(parents=True)
    (out / "glue_by_task.png").write_bytes(b"png one")
    (out / "mlm_loss_vs_tokens.png").write_bytes(b"png two")
    root = docs.render_block("figures", out, tmp_path, tmp_path)
    nested = docs.render_block("figures", out, tmp_path / "docs", tmp_path)
    assert "(results/readme/glue_by_task.png)" in root and "(../results/readme/glue_by_task.png)" in nested
    assert docs.sha256(out / "glue_by_task.png")[:12] in root
    assert "no run record was committed" in root
    (out / "glue_by_task.png").write_bytes(b"png one, redrawn")
    assert docs.render_block("figures", out, tmp_path, tmp_path) != root  # a new figure changes the block


def test_table_blocks_from_csv_markdown_and_json(tmp_path):
    out = tmp_path / "results" / "readme"
    (out / "bench").mkdir(parents=True)
    pd.DataFrame({"setup": ["a", "b"], "microbatches_s": [9.8, 6.4]}).to_csv(out / "bench" / "t.csv", index=False)
    (out / "t.md").write_text("| x |\n|---|\n| 1 |\n")
    (out / "b.json").write_text(json.dumps({"torch": "2.13.0", "results": [{"tokens_s": 1546.2}]}))
    csv = docs.render_block("table:bench/t.csv", out, tmp_path, tmp_path)
    assert "| a " in csv and "9.8" in csv and "`results/readme/bench/t.csv`" in csv
    assert docs.render_block("table:t.md", out, tmp_path, tmp_path).startswith("| x |\n|---|\n| 1 |\n\n<sub>")
    js = docs.render_block("table:b.json", out, tmp_path, tmp_path)
    assert "results.0.tokens_s" in js and "1546.2" in js and "2.13.0" in js
    with pytest.raises(docs.DocsError, match="must lie under"):
        docs.render_block("table:../../etc.csv", out, tmp_path, tmp_path)


@pytest.mark.parametrize(
    "text, message",
    [
        ("<!-- generated:nope -->\nx\n<!-- /generated:nope -->\n", "unknown generated block 'nope'"),
        ("<!-- generated:glue -->\nx\n", "never closed"),
        ("x\n<!-- /generated:glue -->\n", "without its opening marker"),
        ("<!-- generated:glue -->\n<!-- generated:figures -->\n", "opens inside"),
    ],
)
def test_malformed_blocks_are_refused(tmp_path, text, message):
    with pytest.raises(docs.DocsError, match=message):
        docs.rewrite(text, tmp_path, tmp_path, tmp_path, where="page.md")


def test_markers_quoted_in_prose_are_not_blocks(tmp_path):
    text = "Blocks look like `<!-- generated:NAME -->` in the source.\n"
    assert docs.rewrite(text, tmp_path, tmp_path, tmp_path) == text
    assert docs.block_names(text) == []


def test_cli_check_exits_1_on_a_stale_page(tmp_path):
    out = tmp_path / "results" / "readme"
    out.mkdir(parents=True)
    _glue_csv(out / "glue_paper.csv")
    page = tmp_path / "page.md"
    page.write_text("<!-- generated:glue -->\nold\n<!-- /generated:glue -->\n")
    cmd = [sys.executable, "-m", "cramswarm", "docs", str(page), "--results-dir", str(out), "--repo", str(tmp_path)]
    check = subprocess.run([*cmd, "--check"], capture_output=True, text=True, check=False)
    assert check.returncode == 1 and "stale" in check.stdout and "old" in page.read_text()
    assert subprocess.run(cmd, capture_output=True, text=True, check=False).returncode == 0
    assert subprocess.run([*cmd, "--check"], capture_output=True, text=True, check=False).returncode == 0


def test_docs_target_snapshots_then_rewrites_every_page(tmp_path):
    """`snakemake docs` (dry run): the study's GLUE table and run record go to results/readme/, then every page."""
    work = copy_workflow(tmp_path)
    (work / "docs").mkdir()
    for page in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        (work / page.relative_to(REPO)).write_text(page.read_text())
    out = snakemake(work, "-n", "-p", "docs", *TINY).stdout
    snap = out[out.index("python -m cramswarm docs-snapshot") :].splitlines()[0]
    assert "--files results/tables/synthetic/glue_paper.csv results/readme/" in snap
    assert "--record results/report/synthetic" in snap and "--out-dir results/readme" in snap
    rewrite = out[out.index("python -m cramswarm docs --results-dir") :].splitlines()[0]
    assert "README.md" in rewrite and all(f"docs/{p.name}" in rewrite for p in (REPO / "docs").glob("*.md"))


def _history_row(**fields) -> dict:
    return {"date": "2026-01-02", "commit": "abc1234", "machine": "2 cores", "section": "Routing", "what": "a run",
            "command": "python bench.py", "result": "1.5x", "details": ""} | fields


def _write_history(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows, columns=history.COLUMNS).to_csv(path, index=False)


def test_history_block_newest_first_grouped_by_section(tmp_path):
    out = tmp_path / "results" / "readme"
    (out / "history" / "bench").mkdir(parents=True)
    (out / "history" / "bench" / "table.md").write_text("| setup | rate |\n|---|---|\n| a | 9.8 |\n")
    _write_history(out / "history" / "bench.csv", [
        _history_row(date="2026-01-01", what="oldest routing run", result="1.1x"),
        _history_row(date="2026-01-05", section="Memory", what="memory run", commit="def5678 0123abc",
                     command="a\nb", result="306 MiB", details="history/bench/table.md"),
        _history_row(date="2026-01-03", what="newer routing run", result="2.1x", machine=""),
    ])  # fmt: skip
    body = docs.render_block("history:bench", out, tmp_path / "docs" / "history", tmp_path)
    lines = body.splitlines()
    assert lines[0] == "## Memory"  # the section of the newest row first
    assert body.index("## Memory") < body.index("## Routing") < body.index("newer routing run") < body.index("oldest")
    assert "### 2026-01-05: memory run" in lines and "| a | 9.8 |" in lines  # the details file below its row
    assert "Commits `def5678` `0123abc`; 2 cores." in body and "```bash\na\nb\n```" in body
    assert "Commit `abc1234`. Command: `python bench.py`" in body  # no machine recorded: none shown
    assert lines[-1].startswith("<sub>") and "`results/readme/history/bench.csv`" in lines[-1]
    assert "3 measurements, 2026-01-01 to 2026-01-05" in lines[-1]
    page = tmp_path / "bench.md"
    page.write_text("# History\n\n<!-- generated:history:bench -->\n<!-- /generated:history:bench -->\n")
    assert docs.regenerate([page], out, tmp_path) == [page] and docs.regenerate([page], out, tmp_path) == []


def test_history_block_refuses_bad_rows_and_names_a_missing_file(tmp_path):
    missing_note = docs.render_block("history:nothing", tmp_path, tmp_path, tmp_path)
    assert "Not committed yet" in missing_note and "results/readme/history/nothing.csv" in missing_note
    _write_history(tmp_path / "history" / "bad.csv", [_history_row(date="yesterday")])
    with pytest.raises(docs.DocsError, match="not YYYY-MM-DD"):
        docs.render_block("history:bad", tmp_path, tmp_path, tmp_path)
    _write_history(tmp_path / "history" / "gone.csv", [_history_row(details="history/gone/table.md")])
    with pytest.raises(docs.DocsError, match="not committed"):
        docs.render_block("history:gone", tmp_path, tmp_path, tmp_path)
    with pytest.raises(docs.DocsError, match="lowercase"):
        docs.render_block("history:Bad Topic", tmp_path, tmp_path, tmp_path)


def _git(repo: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "HOME": str(repo), "PATH": "/usr/bin:/bin"}  # fmt: skip
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True, env=env).stdout


def test_record_history_appends_a_row_with_the_commit(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.txt").write_text("one\n")
    _git(repo, "add", "a.txt")
    _git(repo, "commit", "-q", "-m", "one")
    head = _git(repo, "rev-parse", "--short", "HEAD").strip()

    first = history.record_history("bench", "a run", "python bench.py --x", "1.5x", section="Routing", repo=repo,
                                   machine="test machine")  # fmt: skip
    (repo / "a.txt").write_text("two\n")  # a tracked file changed: the next row says so
    second = history.record_history("bench", "another run", "python bench.py", "1.6x", section="Routing", repo=repo)
    path = repo / "results" / "readme" / "history" / "bench.csv"
    assert path.read_text().count("date,commit,machine") == 1
    rows = history.read_history(path)
    assert [r["result"] for r in rows] == ["1.5x", "1.6x"] and rows == [first, second]
    assert rows[0]["commit"] == head and rows[1]["commit"] == f"{head}-dirty"
    assert rows[0]["machine"] == "test machine" and "cores" in rows[1]["machine"]
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", rows[0]["date"])
    with pytest.raises(history.HistoryError, match="result empty"):
        history.record_history("bench", "no result", "cmd", " ", section="Routing", repo=repo)
    assert len(history.read_history(path)) == 2  # a refused row writes nothing

    page = repo / "docs" / "history" / "bench.md"
    page.parent.mkdir(parents=True)
    page.write_text("# History\n\n<!-- generated:history:bench -->\n<!-- /generated:history:bench -->\n")
    docs.record_measurement("bench", "third run", "python bench.py", "1.7x", section="Memory", repo=repo)
    text = page.read_text()  # the page is redrawn with the new row on top
    assert text.index("## Memory") < text.index("## Routing") and "1.7x" in text and "3 measurements" in text
