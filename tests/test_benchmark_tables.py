"""The pretraining-throughput benchmark's JSON, its --profile breakdown, and the committed GPU tables the docs show
(benchmarks/throughput_table.py): the CSVs are exactly what the script writes from the committed JSON files."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU_RUNS = ROOT / "results" / "readme" / "pretrain_gpu"


def table(*args: str) -> None:
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput_table.py"), *args], check=True)


def read(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_quick_run_profile_and_table(tmp_path):
    out = tmp_path / "run.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pretrain_throughput.py"), "--quick", "--device", "cpu",
                    "--threads", "1", "--models", "crammed-static,hf", "--profile", str(tmp_path / "prof"),
                    "--json", str(out)], check=True, capture_output=True, text=True, timeout=300)
    report = json.loads(out.read_text())
    for r in report["results"]:
        assert len(r["step_s_all"]) == report["steps"] and len(r["warmup_s_all"]) == report["warmup"]
        assert r["mfu"] == pytest.approx(r["flops_per_token"] * r["tokens_per_s"] / 1e12 / report["peak_tflops_bf16"])
        families = r["profile"]["by_family_ms"]
        assert sum(families.values()) == pytest.approx(r["profile"]["ms_per_step"])
        assert families.get("matmul", 0) > 0  # the model's linear layers are counted as matmuls
        assert (tmp_path / f"prof.{r['model']}.txt").read_text().count("\n") > 5
    table(str(out), "--out", str(tmp_path / "t.csv"), "--profile-out", str(tmp_path / "k.csv"), "--commit", "abc1234")
    rows = {row["model"]: row for row in read(tmp_path / "t.csv")}
    assert rows["hf"]["vs_hf"] == "1.00" and rows["hf"]["compile"] == "eager"
    crammed = rows["crammed-static"]
    assert float(crammed["vs_hf"]) == pytest.approx(float(crammed["tokens_per_s"]) / float(rows["hf"]["tokens_per_s"]),
                                                    abs=0.01)
    assert crammed["commit"] == report["commit"] or (report["commit"] is None and crammed["commit"] == "abc1234")
    kernels = read(tmp_path / "k.csv")
    assert {k["model"] for k in kernels} == {"crammed-static", "hf"}
    assert sum(float(k["share_percent"]) for k in kernels if k["model"] == "hf") == pytest.approx(100, abs=0.5)


@pytest.mark.skipif(not GPU_RUNS.is_dir(), reason="no committed GPU runs")
def test_committed_gpu_tables_are_what_the_script_writes(tmp_path):
    runs = sorted(str(p) for p in GPU_RUNS.glob("*.json"))
    table(*runs, "--out", str(tmp_path / "t.csv"), "--profile-out", str(tmp_path / "k.csv"))
    assert (tmp_path / "t.csv").read_text() == (ROOT / "results" / "readme" / "pretrain_gpu.csv").read_text()
    assert (tmp_path / "k.csv").read_text() == (ROOT / "results" / "readme" / "pretrain_gpu_kernels.csv").read_text()
