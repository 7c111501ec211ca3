"""Workflow conventions: every rule documents itself (`snakemake --list-rules`), every job rule asks for memory
and time derived from the config, the report rules run on the submit host, `snakemake --lint` finds nothing,
and the Snakefile and rules are snakefmt-formatted. Dry runs and lint only: no job runs."""

import os
import re
import shutil
import subprocess

import pytest
from conftest import REPO, TINY, copy_workflow, snakemake

PAPER = ["--configfile", "config/config.yaml", "config/paper.yaml"]
# Every target of the workflow, so that a dry run with -F plans a job of every job rule.
TARGETS = ["all", "ablation_vocab", "ablation_arch", "ablation_schedule", "ablation_groups", "ablation_data",
           "swarm_study", "readme", "claims"]
REPORT_RULES = {
    "tables", "figures", "vocab_sweep", "study_record", "readme_figures", "swarm_report",
    "ablation_arch_report", "ablation_schedule_report", "ablation_groups_report", "ablation_data_report",
    "claims_table", "claims_available",
}
HEAVY_RULES = {"corpus", "filter_corpus", "train_tokenizer", "pack_corpus", "order_blocks", "pretrain", "finetune",
               "finetune_model", "swarm_pretrain", "swarm_experiment"}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return copy_workflow(tmp_path_factory.mktemp("conventions"))


def rule_docs(work) -> dict[str, str]:
    """{rule: its docstring ('' if none)} as `snakemake --list-rules` prints them (name, then the doc in brackets)."""
    out = snakemake(work, "--list-rules", *TINY, timeout=300).stdout
    return {m[1]: (m[2] or "").strip() for m in re.finditer(r"^(\w+)(?: \((.*?)\))?$", out, re.M | re.S)}


def planned(work, *args, env=None) -> dict[str, list[dict[str, int | str]]]:
    """{rule: [resources of each job]} of a forced dry run (-F: every job of the targets, done or not)."""
    out = snakemake(work, "-n", "-F", *args, env=env, timeout=300).stdout
    jobs: dict[str, list[dict]] = {}
    for rule, body in re.findall(r"^rule (\w+):\n((?:    .*\n)*)", out, re.M):
        line = re.search(r"^    resources: (.*)$", body, re.M)
        pairs = dict(kv.split("=", 1) for kv in line[1].split(", ")) if line else {}
        jobs.setdefault(rule, []).append({k: int(v) if v.isdigit() else v for k, v in pairs.items()})
    return jobs


def test_every_rule_has_a_docstring(work):
    docs = rule_docs(work)
    assert {"all", "pretrain", "finetune", "swarm_study", "ablation_data"} <= set(docs)
    assert [name for name, doc in docs.items() if not doc] == []


def test_every_job_rule_declares_memory_and_runtime(work):
    jobs = planned(work, *TARGETS, *TINY)
    assert HEAVY_RULES | REPORT_RULES - {"claims_available"} | {"glue_data", "init_model"} <= set(jobs), set(jobs)
    for rule, resources in jobs.items():
        if rule in TARGETS:  # collecting rules: no command, nothing to ask a cluster for
            continue
        for job in resources:
            assert isinstance(job.get("mem_mb"), int) and job["mem_mb"] >= 1000, (rule, job)
            assert isinstance(job.get("runtime"), int) and 1 <= job["runtime"], (rule, job)


def test_resources_follow_the_config(work):
    """A tiny run asks for minutes; a 24 h seconds budget for at least the budget; memory follows the data cap."""
    tiny = planned(work, "results/pretrain/synthetic/crammed/v128/summary.json", *TINY)
    assert max(job["runtime"] for job in tiny["pretrain"]) < 60
    paper = planned(work, "results/pretrain/hub/crammed/v32768/summary.json", *PAPER)
    assert 24 * 60 <= paper["pretrain"][0]["runtime"] <= 28 * 60
    # the A6000-day on a declared slower card takes longer (profiles/slurm: CRAMSWARM_SLURM_GPU_MODEL), and the job
    # asks for that; the GPU memory of its micro-batch is a resource too
    v100 = planned(work, "results/pretrain/hub/crammed/v32768/summary.json", *PAPER,
                   env={**os.environ, "CRAMSWARM_GPU_MODEL": "V100"})
    assert 29.7 * 60 <= v100["pretrain"][0]["runtime"] <= 33 * 60
    assert 8_000 <= paper["pretrain"][0]["gpu_mem_mb"] <= 48_000
    big_cap = work / "big_cap.yaml"
    big_cap.write_text("data:\n  memory_cap_mb: 8192\n")
    capped = planned(work, "results/pretrain/synthetic/crammed/v128/summary.json", *TINY, str(big_cap))
    assert capped["pack_corpus"][0]["mem_mb"] > tiny["pack_corpus"][0]["mem_mb"] + 8192
    assert capped["pack_corpus"][0]["data_cap_mib"] == 8192  # what the command gets as --memory-cap-mb


def test_report_rules_are_local_and_training_rules_are_not(repo):
    # each rules file declares its own local rules (Snakemake adds up every `localrules:` of the workflow)
    local = set()
    for path in [repo / "Snakefile", *sorted((repo / "rules").glob("*.smk"))]:
        for block in re.findall(r"^localrules:\n((?:    .*\n)+)", path.read_text(), re.M):
            local |= {name.strip().rstrip(",") for name in block.splitlines()}
    assert local == REPORT_RULES | {"docs_snapshot", "docs", "tables_apart"}  # tables_apart: only with study: false
    assert not local & HEAVY_RULES


def test_slurm_profile_holds_site_values_only(repo):
    profile = (repo / "profiles" / "slurm" / "profile.yaml").read_text()
    settings = [line.split("#")[0] for line in profile.splitlines()]
    assert not [line for line in settings if re.match(r"\s+(runtime|mem_mb|mem):", line)]


@pytest.mark.parametrize("config", [TINY, PAPER], ids=["config", "paper"])
def test_lint_finds_nothing(work, config):
    proc = snakemake(work, "--lint", *config, check=False, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Congratulations, your workflow is in a good condition!" in proc.stdout + proc.stderr


@pytest.mark.skipif(shutil.which("snakefmt") is None, reason="snakefmt not installed (pip install -e '.[dev]')")
def test_snakefiles_are_snakefmt_formatted():
    proc = subprocess.run(["snakefmt", "--check", "Snakefile", "rules"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_local_profile_caps_host_memory_at_the_machines(tmp_path):
    """profiles/default gives Snakemake this machine's memory as mem_mb: jobs running at once never ask for more
    in sum, and a job estimated above it runs alone with the machine's memory."""
    shutil.copytree(REPO / "profiles" / "default", tmp_path / "profiles" / "default")
    (tmp_path / "Snakefile").write_text(
        'rule big:\n    output: "big.txt"\n    resources: mem_mb=10**9\n'
        '    shell: "echo {resources.mem_mb} > {output}"\n'
    )
    snakemake(tmp_path, "--cores", "1", timeout=120)
    machine_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 10**6
    assert int((tmp_path / "big.txt").read_text()) == machine_mb
