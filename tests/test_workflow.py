"""The whole DAG through Snakemake on the tiny overlay: outputs, caching, and what a config change reruns."""
import re
import shutil
import subprocess

import pandas as pd
import pytest

TINY = ["--configfile", "config/config.yaml", "config/test/tiny.yaml"]


def snakemake(cwd, *args, check=True):
    proc = subprocess.run(["snakemake", *args], cwd=cwd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def planned_jobs(cwd, *args) -> dict[str, int]:
    """Job counts per rule from a dry run's summary table."""
    out = snakemake(cwd, "-n", *args).stdout
    if "Nothing to be done" in out:
        return {}
    table = out.split("Job stats:")[1].split("total")[0]
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M)}


@pytest.fixture(scope="module")
def workdir(repo, tmp_path_factory):
    """A copy of the workflow (not of results/) run once with the tiny overlay."""
    work = tmp_path_factory.mktemp("wf")
    for item in ("Snakefile", "rules", "config", "profiles", "envs", "src"):
        src = repo / item
        (shutil.copytree if src.is_dir() else shutil.copy)(src, work / item)
    snakemake(work, "--cores", "2", *TINY)
    return work


@pytest.mark.slow
def test_tiny_study_writes_tables_and_figures(workdir):
    table = pd.read_csv(workdir / "results" / "tables" / "synthetic" / "glue.csv")
    assert set(zip(table["model"], table["vocab"])) == {
        ("crammed", 128), ("crammed", 160), ("bert_original", 128), ("izsak", 128), ("no_pretrain", 128)
    }
    assert (table["n_seeds"] == 2).all()
    assert table[["mnli_m", "mnli_mm", "sst2", "stsb_pearson"]].notna().all().all()
    sweep = pd.read_csv(workdir / "results" / "tables" / "synthetic" / "vocab_sweep.csv")
    assert sorted(sweep["vocab"]) == [128, 160] and set(sweep["model"]) == {"crammed"}
    for png in ("mlm_loss_vs_tokens", "glue_by_task", "glue_vs_vocab"):
        assert (workdir / "results" / "figures" / "synthetic" / f"{png}.png").read_bytes()[:4] == b"\x89PNG"
    assert (workdir / "logs" / "pretrain" / "synthetic" / "crammed" / "v128.log").is_file()
    leftovers = [p for p in (workdir / "results").rglob(".*") if p.is_file()]
    assert leftovers == []  # no temporary files left behind by atomic writes
    assert [p for p in (workdir / "results" / ".state").rglob("*") if p.is_file()] == []  # resume state removed


@pytest.mark.slow
def test_finished_run_reruns_nothing(workdir):
    assert planned_jobs(workdir, *TINY) == {}


@pytest.mark.slow
def test_changing_one_vocab_size_reruns_only_its_dependents(workdir):
    overlay = workdir / "config" / "test" / "vocab.yaml"
    overlay.write_text("tokenizer:\n  vocab_sizes: [128, 192]\n")
    jobs = planned_jobs(workdir, *TINY, str(overlay.relative_to(workdir)))
    assert jobs == {
        "train_tokenizer": 1,  # v192 only
        "pack_corpus": 1,
        "pretrain": 1,
        "finetune": 3 * 2,  # 3 tasks x 2 seeds for crammed v192; nothing for v128 or no_pretrain
        "tables": 1,
        "figures": 1,
        "all": 1,
    }


@pytest.mark.slow
def test_changing_a_finetuning_value_reruns_finetuning_only(workdir):
    overlay = workdir / "config" / "test" / "lr.yaml"
    overlay.write_text("glue:\n  protocols:\n    crammed:\n      lr: 1.0e-4\n")
    jobs = planned_jobs(workdir, *TINY, str(overlay.relative_to(workdir)))
    assert jobs == {"finetune": 5 * 3 * 2, "tables": 1, "figures": 1, "all": 1}  # 5 (model, vocab) x 3 tasks x 2 seeds


@pytest.mark.slow
def test_switching_one_models_protocol_reruns_its_finetuning_only(workdir):
    overlay = workdir / "config" / "test" / "protocol.yaml"
    overlay.write_text("models:\n  no_pretrain:\n    glue_protocol: bert_checkpoint\n")
    jobs = planned_jobs(workdir, *TINY, str(overlay.relative_to(workdir)))
    assert jobs == {"finetune": 3 * 2, "tables": 1, "figures": 1, "all": 1}


@pytest.mark.slow
def test_changing_the_glue_data_size_keeps_the_corpus_and_checkpoints(workdir):
    overlay = workdir / "config" / "test" / "rows.yaml"
    overlay.write_text("synthetic:\n  glue_train_examples: 48\n")
    jobs = planned_jobs(workdir, *TINY, str(overlay.relative_to(workdir)))
    assert jobs == {"glue_data": 3, "finetune": 5 * 3 * 2, "tables": 1, "figures": 1, "all": 1}


@pytest.mark.slow
def test_named_targets_resolve(workdir):
    for target in ("tokenizers", "pretrain_all", "glue", "ablation_vocab"):
        assert planned_jobs(workdir, target, *TINY) == {}  # already built by the full run (target first: --configfile takes every following word)


@pytest.mark.slow
def test_ablation_targets_build_tables_and_figures(workdir):
    jobs = planned_jobs(workdir, "ablation_arch", "ablation_schedule", "ablation_groups", *TINY)
    # tiny overlay: arch = base + depth2 + bert_original; schedule = 2 x 2; groups = 4 rows; no study run is reused
    assert jobs["pretrain"] == 3 + 4 + 4
    assert jobs["finetune"] == (3 + 4) * 1 * 2  # ablations.glue_tasks [sst2] x glue.seeds [0, 1]
    snakemake(workdir, "--cores", "2", "ablation_arch", "ablation_schedule", "ablation_groups", *TINY)
    out = workdir / "results" / "ablations" / "synthetic"
    arch = pd.read_csv(out / "arch.csv")
    assert set(arch["label"]) == {"crammed", "depth2", "bert_original"}
    assert (arch["tokens"] == 8192).all() and arch["eval_loss"].notna().all()
    assert arch.set_index("label").loc["depth2", "layers"] == 2
    schedule = pd.read_csv(out / "schedule.csv")
    assert set(zip(schedule["schedule"], schedule["lr"])) == {(s, lr) for s in ("triangle", "constant") for lr in (1e-3, 4e-3)}
    groups = pd.read_csv(out / "groups.csv")
    assert list(groups["run"]) == ["groups-final", "groups-original_arch", "groups-original_training", "groups-original_both"]
    for png in ("figure1_loss_vs_tokens", "figure2_schedules"):
        assert (out / f"{png}.png").read_bytes()[:4] == b"\x89PNG"
    summary = (workdir / "results" / "pretrain" / "synthetic" / "arch-bert_original" / "v128" / "summary.json").read_text()
    assert '"mask_rate": 0.15' in summary and '"norm_scheme": "post"' in summary
