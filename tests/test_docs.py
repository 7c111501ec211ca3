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

from cramswarm.report import docs

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "results" / "readme"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "config" / "README.md"]


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
        f"run `python -m cramswarm docs README.md docs/*.md` (or `snakemake --cores 1 docs`)"
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
