"""The preflight: the study rehearsed on a slice and projected (cramswarm.preflight), and the verdicts that stop a
run that cannot fit before anything full starts."""

import json
import subprocess
import sys

import pytest
from conftest import REPO, SHARED_HUB, mirror_corpus, requires_mirror

from cramswarm.preflight import project

TINY = ["config/config.yaml", "config/test/tiny.yaml"]


def run_preflight(tmp_path, overlay: str, configs=TINY) -> tuple[subprocess.CompletedProcess, dict | None]:
    extra = tmp_path / "preflight.yaml"
    extra.write_text("preflight:\n  documents: 300\n  steps: 1\n  glue_task: sst2\n" + overlay)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "cramswarm", "preflight", "--configfile", *configs, str(extra),
                           "--out-dir", str(out), "--results", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    report = out / "report.json"
    return proc, json.loads(report.read_text()) if report.exists() else None


def test_the_tiny_study_fits_and_its_report_projects_every_stage_and_model(tmp_path):
    proc, report = run_preflight(tmp_path, "")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["fits"] and (tmp_path / "out" / "report.md").exists()
    assert [s["stage"] for s in report["stages"]] == ["corpus", "train_tokenizer", "pack_corpus", "order_blocks"]
    assert report["slice"]["documents"] == 300 and report["slice"]["corpus_documents"] == 1500
    assert {s["stage"]: s["copies"] for s in report["stages"]}["pack_corpus"] == 2  # one per vocab size
    models = report["pretrain"]
    assert set(models) == {"crammed", "bert_original", "izsak", "swarm"} and "skipped" in models["swarm"]
    for name in ("crammed", "bert_original", "izsak"):
        m = models[name]
        assert m["ran"] and m["tokens_per_s"] > 0 and 0 < m["mfu"] and m["peak_memory_gib"] > 0
        assert m["projected_tokens"] == 16384
        assert m["projected_hours"] == pytest.approx(16384 / m["tokens_per_s"] / 3600)
    assert set(report["finetune"]["per_model"]) == {"crammed", "bert_original", "izsak", "swarm", "no_pretrain"}
    assert report["finetune"]["projected_hours"] > 0


@requires_mirror
def test_the_mirror_study_is_rehearsed_on_real_text(tmp_path):
    """The mirror's real English text (400 Wikipedia articles) through the same stages: the slice of 300
    documents is projected to the 400 the capped corpus streams."""
    hub = {"mirror": str(SHARED_HUB), "corpus": mirror_corpus(400, 0)[:1], "glue_max_train_examples": 64}
    configs = ["config/config.yaml", "config/mirror.yaml", "config/test/tiny.yaml"]
    proc, report = run_preflight(tmp_path, f"hub: {json.dumps(hub)}\n", configs)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["source"] == "hub" and report["fits"]
    assert report["slice"]["documents"] == 300 and report["slice"]["corpus_documents"] == 400
    corpus = report["stages"][0]
    assert corpus["stage"] == "corpus" and corpus["projected_hours"] == pytest.approx(
        corpus["slice_seconds"] * 400 / 300 / 3600)
    assert all(m["ran"] and m["tokens_per_s"] > 0 for n, m in report["pretrain"].items() if n != "swarm")


def test_jobs_that_cannot_fit_are_named_with_their_keys_before_anything_full_runs(tmp_path):
    """crammed at a micro-batch whose estimate is beyond the declared host memory is named and not run; the other
    models run, and beyond a declared time limit they, and the data stages, are named with the key to change."""
    overlay = ("  host_memory_gb: 4.0\n  time_limit_hours: 1.0e-7\n"
               "models:\n  crammed:\n    recipe: {micro_batch_sequences: 4096, batch_sequences: 4096}\n")
    proc, report = run_preflight(tmp_path, overlay)
    assert proc.returncode == 1 and not report["fits"]
    assert "will not fit: pretrain crammed v128 (host memory (preflight.host_memory_gb))" in proc.stdout
    failed = {(v["job"], v["check"]): v for v in report["verdicts"] if v["verdict"] != "fits"}
    crammed = failed[("pretrain crammed v128", "host memory (preflight.host_memory_gb)")]
    assert crammed["key"] == "models.crammed.recipe.micro_batch_sequences"
    assert report["pretrain"]["crammed"]["ran"] is False and report["pretrain"]["izsak"]["ran"] is True
    assert failed[("pretrain izsak v128", "time limit")]["key"] == "pretrain.budget.value"
    assert failed[("corpus (1 job)", "time limit")]["key"] == "synthetic.corpus_documents"
    assert ("pretrain izsak v128", "host memory (preflight.host_memory_gb)") not in failed


def test_projection_scales_the_slice_and_finds_the_wrap():
    stage = project.stage_projection("pack_corpus", 1000, 2.0, 2**30, 10**6, documents=10**6, copies=3)
    assert stage["documents_per_s"] == 500 and stage["projected_hours"] == pytest.approx(3 * 2000 / 3600)
    assert stage["projected_disk_gb"] == pytest.approx(3.0)
    measured = {"tokens_per_s": 1000.0, "flops_per_token": 1e9, "peak_tflops": 10.0, "peak_memory_bytes": 2**31}
    seconds = project.pretrain_projection(measured, {"unit": "seconds", "value": 3600}, 128, training_blocks=10_000)
    assert seconds["projected_tokens"] == 3.6e6 and seconds["mfu"] == pytest.approx(0.1)
    assert seconds["data_passes"] == pytest.approx(3.6e6 / 1.28e6)
    assert seconds["wraps_at_budget_share"] == pytest.approx(1.28e6 / 3.6e6)
    tokens = project.pretrain_projection(measured, {"unit": "tokens", "value": 1e6}, 128, training_blocks=10_000)
    assert tokens["projected_hours"] == pytest.approx(1000 / 3600) and tokens["wraps_at_budget_share"] is None
    fine = project.finetune_projection(0.5, {"a": 100, "b": 33}, batch_size=32, epochs=2, seeds=3)
    assert fine["steps_per_seed"] == (4 + 2) * 2 and fine["projected_hours"] == pytest.approx(1.1 * 12 * 0.5 * 3 / 3600)


def test_verdicts_name_the_key_only_when_a_job_does_not_fit():
    assert project.memory_verdict("j", 2**30, 2**31, "k", "GPU memory")["verdict"] == "fits"
    over = project.memory_verdict("j", 2**32, 2**31, "models.x.recipe.micro_batch_sequences", "GPU memory")
    assert over["verdict"] == "will not fit" and over["key"] == "models.x.recipe.micro_batch_sequences"
    assert project.time_verdict("j", 30.0, None, "k")["verdict"] == "fits"
    late = project.time_verdict("j", 30.0, 24.0, "pretrain.budget.value")
    assert late["verdict"] == "will not fit" and "2 submissions" in late["detail"]
    assert project.disk_verdict(10.0, 5.0)["verdict"] == "will not fit"
    assert project.disk_verdict(1.0, None)["verdict"] == "fits"
