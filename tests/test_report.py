"""Result loading, seed aggregation, table writing and figures, on small synthetic results."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from cramswarm.glue.metrics import SCORE_COLUMNS, paper_average
from cramswarm.glue.tasks import TASKS
from cramswarm.report.figures import plot_glue_by_task, plot_loss_curves, plot_vocab_sweep
from cramswarm.report.tables import glue_table, load_results, vocab_sweep_table, write_table

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# Every metric of every task scores BASE + the seed's offset. Offsets 0, 10, 4 are deliberately not sorted
# by seed: the median over seeds is BASE + 4 (the mean would be BASE + 4.67).
BASE = 50.0
SEED_OFFSETS = {0: 0.0, 1: 10.0, 2: 4.0}


def write_result(folder, model, vocab, task, seed, value, **extra):
    spec = TASKS[task]
    record = {
        "model": model, "vocab": vocab, "task": task, "seed": seed,
        "scores": {split: dict.fromkeys(spec.metrics, value) for split in spec.eval_splits},
        "epochs": 3, "train_examples": 100, "wall_s": 1.0, **extra,
    }
    path = folder / f"{model}_{vocab}_{task}_{seed}.json"
    path.write_text(json.dumps(record))
    return path


def write_runs(folder, model, vocab, seeds=SEED_OFFSETS, skip=(), base=BASE):
    return [
        write_result(folder, model, vocab, task, seed, base + offset)
        for task in TASKS
        if task not in skip
        for seed, offset in seeds.items()
    ]


@pytest.fixture
def results(tmp_path):
    """crammed/2048 complete with 3 seeds; scratch/2048 with 3 seeds but no RTE results."""
    folder = tmp_path / "results"
    folder.mkdir()
    paths = write_runs(folder, "crammed", 2048) + write_runs(folder, "scratch", 2048, skip=("rte",), base=30.0)
    return load_results(paths)


def test_load_results_long_form(results):
    assert list(results.columns) == ["model", "vocab", "task", "seed", "column", "value"]
    crammed = results[results["model"] == "crammed"]
    # 13 score columns per seed (MNLI gives two rows, MRPC/QQP/STS-B two metrics each).
    assert len(crammed) == len(SCORE_COLUMNS) * len(SEED_OFFSETS)
    row = crammed[(crammed["column"] == "mnli_mm") & (crammed["seed"] == 1)]
    assert row["value"].tolist() == [BASE + 10.0]


def test_load_results_errors_name_the_file(tmp_path):
    good = write_result(tmp_path, "m", 2048, "cola", 0, 10.0)
    with pytest.raises(FileNotFoundError, match="absent.json"):
        load_results([good, tmp_path / "absent.json"])
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{"model": "m", "vocab": ')
    with pytest.raises(ValueError, match="corrupt.json"):
        load_results([corrupt])
    no_scores = tmp_path / "no_scores.json"
    no_scores.write_text(json.dumps({"model": "m", "vocab": 2048, "task": "cola", "seed": 0}))
    with pytest.raises(ValueError, match="no_scores.json.*scores"):
        load_results([no_scores])
    wrong_metric = tmp_path / "wrong_metric.json"
    wrong_metric.write_text(
        json.dumps({"model": "m", "vocab": 2048, "task": "cola", "seed": 0, "scores": {"validation": {"f1": 1.0}}})
    )
    with pytest.raises(ValueError, match="wrong_metric.json"):
        load_results([wrong_metric])
    copy = tmp_path / "copy.json"
    copy.write_text(good.read_text())
    with pytest.raises(ValueError, match="copy.json.*duplicates"):
        load_results([good, copy])


def test_glue_table_medians_over_three_seeds(results):
    table = glue_table(results)
    expected = ["model", "vocab", *SCORE_COLUMNS, "avg_paper", "avg_paper_std", "avg_glue", "n_seeds"]
    assert list(table.columns) == expected
    assert list(table.columns[2:12]) == [
        "mnli_m", "mnli_mm", "qqp_f1", "qqp_acc", "qnli", "sst2", "cola", "stsb_pearson", "stsb_spearman", "mrpc_f1"
    ]
    crammed = table.set_index("model").loc["crammed"]
    for column in SCORE_COLUMNS:
        assert crammed[column] == pytest.approx(54.0)  # median of 50, 60, 54
    # Per-seed paper averages are 50, 60, 54: median 54; sample std sqrt(((−14/3)² + (16/3)² + (−2/3)²) / 2)
    # = sqrt(76/3) ≈ 5.033.
    assert crammed["avg_paper"] == pytest.approx(54.0)
    assert crammed["avg_paper_std"] == pytest.approx(math.sqrt(76 / 3))
    assert crammed["avg_glue"] == pytest.approx(54.0)
    assert crammed["n_seeds"] == 3


def test_glue_table_median_differs_from_mean_per_column(tmp_path):
    # CoLA over seeds 30, 50, 35 -> median 35 (mean 38.3); every other task constant at 70.
    cola = {0: 30.0, 1: 50.0, 2: 35.0}
    paths = write_runs(tmp_path, "m", 1024, skip=("cola",), base=70.0, seeds=dict.fromkeys(cola, 0.0))
    paths += [write_result(tmp_path, "m", 1024, "cola", seed, value) for seed, value in cola.items()]
    row = glue_table(load_results(paths)).iloc[0]
    assert row["cola"] == pytest.approx(35.0)
    # Per-seed paper averages (8*70 + cola)/9: median of those is (560 + 35)/9.
    assert row["avg_paper"] == pytest.approx(595 / 9)


def test_missing_task_gives_nan_not_a_shorter_average(results):
    scratch = glue_table(results).set_index("model").loc["scratch"]
    assert math.isnan(scratch["rte"])
    assert math.isnan(scratch["avg_paper"]) and math.isnan(scratch["avg_glue"])
    assert scratch["cola"] == pytest.approx(34.0)


def test_average_matches_paper_rule_per_seed(results):
    row = glue_table(results).iloc[0]
    assert row["avg_paper"] == pytest.approx(paper_average(row))


def test_write_table_csv_and_markdown(results, tmp_path):
    table = glue_table(results)
    csv_path, md_path = write_table(table, tmp_path / "out" / "glue")
    assert (csv_path.name, md_path.name) == ("glue.csv", "glue.md")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["glue.csv", "glue.md"]  # no temp leftovers

    back = pd.read_csv(csv_path)
    assert list(back.columns) == list(table.columns)
    assert back.loc[back["model"] == "crammed", "avg_paper_std"].item() == pytest.approx(math.sqrt(76 / 3))
    assert math.isnan(back.loc[back["model"] == "scratch", "rte"].item())

    lines = md_path.read_text().splitlines()
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert header[:4] == ["Model", "Vocab", "MNLI-m", "MNLI-mm"]
    assert "GLUE avg (paper)" in header and "Seeds" in header
    crammed = [cell.strip() for cell in next(l for l in lines if "crammed" in l).strip("|").split("|")]
    assert crammed[:3] == ["crammed", "2048", "54.0"]
    assert crammed[header.index("± seed std")] == "5.0"
    assert crammed[header.index("Seeds")] == "3"
    scratch = [cell.strip() for cell in next(l for l in lines if "scratch" in l).strip("|").split("|")]
    assert scratch[header.index("RTE")] == "NaN"


def test_vocab_sweep_table(tmp_path):
    paths = []
    for vocab, base in ((8192, 60.0), (512, 40.0), (2048, 55.0)):
        paths += write_runs(tmp_path, "crammed", vocab, base=base)
    paths += write_runs(tmp_path, "scratch", 2048, base=30.0)
    sweep = vocab_sweep_table(load_results(paths), exclude=["scratch"])
    assert list(sweep.columns) == ["model", "vocab", "avg_paper", "avg_paper_std", "mnli_m", "mnli_m_std", "n_seeds"]
    assert sweep["vocab"].tolist() == [512, 2048, 8192]
    assert sweep["avg_paper"].tolist() == pytest.approx([44.0, 59.0, 64.0])
    assert sweep["mnli_m_std"].tolist() == pytest.approx([math.sqrt(76 / 3)] * 3)


def assert_png(path):
    data = path.read_bytes()
    assert len(data) > 1000 and data.startswith(PNG_MAGIC)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # the temp file was renamed, not left behind


def test_plot_loss_curves(tmp_path):
    tokens = np.arange(1, 51) * 4096
    log = pd.DataFrame(
        {"step": np.arange(50), "tokens": tokens, "loss": 9.0 / np.log(tokens), "lr": 1e-3, "elapsed_s": 0.1}
    )
    csv = tmp_path / "v512.csv"
    log.assign(loss=log["loss"] + 0.5).to_csv(csv, index=False)
    out = plot_loss_curves({"vocab 2048": log, "vocab 512": csv}, tmp_path / "fig" / "loss.png", log_x=True)
    assert_png(out)
    with pytest.raises(ValueError, match="tokens"):
        plot_loss_curves({"bad": log.drop(columns="tokens")}, tmp_path / "bad.png")


def test_plot_vocab_sweep(tmp_path):
    sweep = pd.DataFrame(
        {
            "model": "crammed",
            "vocab": [512, 2048, 8192],
            "avg_paper": [60.0, 66.0, 68.0],
            "avg_paper_std": [1.0, float("nan"), 0.5],  # NaN: a single-seed point without an error bar
            "mnli_m": [62.0, 68.0, 70.0],
            "mnli_m_std": [0.8, 1.2, 0.4],
            "n_seeds": [3, 1, 3],
        }
    )
    baseline = pd.Series({"avg_paper": 45.0, "mnli_m": 55.0})
    assert_png(plot_vocab_sweep(sweep, tmp_path / "fig" / "sweep.png", baseline=baseline))


def test_plot_glue_by_task(results, tmp_path):
    assert_png(plot_glue_by_task(results, tmp_path / "fig" / "tasks.png"))
