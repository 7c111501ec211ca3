"""Ablation tables and figures (architecture, LR schedule, group reset) on small hand-made run outputs."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from cramswarm.glue_tasks import TASKS
from cramswarm.report.ablations import (
    _loss_limits,
    arch_table,
    groups_table,
    plot_arch,
    plot_schedule,
    read_log,
    schedule_pivot,
    schedule_table,
    write_ablation_table,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LOG_HEADER = "step,tokens,progress,loss,lr,lr_multiplier,batch_sequences,elapsed_s,eval_loss"


# ------------------------------------------------------------------------------------------------ fixtures


def write_summary(folder, run, *, parameters=10_000_000, layers=4, hidden=256, heads=4, lr=1e-3,
                  schedule="triangle2", final_loss=2.0, eval_loss=2.1, tokens=1_000_000, steps=100,
                  tokens_per_s=5000.0, drop=()):
    summary = {
        "run": run, "steps": steps, "tokens": tokens, "elapsed_s": tokens / tokens_per_s,
        "tokens_per_s": tokens_per_s, "parameters": parameters, "final_loss": final_loss,
        "eval_loss": eval_loss, "budget": {"unit": "tokens", "value": tokens},
        "recipe": {"lr": lr, "schedule": schedule, "mask_rate": 0.4, "mask_mode": "bert"},
        "arch": {"layers": layers, "hidden_size": hidden, "heads": heads, "intermediate_size": 4 * hidden,
                 "norm_scheme": "pre"},
        "pretrained": True,
    }
    for key in drop:
        del summary[key]
    path = folder / run / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary))
    return path


def multiplier(schedule, t):
    if schedule == "triangle2":
        return np.minimum(0.25 + t, 4 * (1 - t))
    if schedule == "one-cycle":
        return np.where(t < 0.5, 2 * t, 2 * (1 - t))
    if schedule == "cosine":
        return 0.5 * (1 + np.cos(np.pi * t))
    return np.ones_like(t)


def write_log(folder, run, *, shift=1.0, schedule="triangle2", lr=1e-3, rows=60, eval_every=10, floor=1.9):
    """Rows evenly spaced in steps over 2e9 tokens; the loss falls from ~10 nats to ~``floor``, later for a
    larger ``shift`` (a bigger model)."""
    t = np.linspace(0, 1, rows)
    tokens = np.round(2e9 * t).astype(int)
    rng = np.random.default_rng(len(run))
    loss = floor + 8.5 / (1 + (tokens / (3e6 * shift)) ** 0.5) + rng.normal(0, 0.02, rows)
    mult = multiplier(schedule, t)
    lines = [LOG_HEADER]
    for i in range(rows):
        evaluated = i % eval_every == 0 or i == rows - 1
        eval_loss = f"{loss[i] + 0.08:.4f}" if evaluated else ""
        lines.append(f"{i},{tokens[i]},{t[i]:.4f},{loss[i]:.4f},{lr * mult[i]:.6g},{mult[i]:.4f},64,{i * 1.5},"
                     f"{eval_loss}")
    path = folder / run / "train_log.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def write_result(folder, model, task, seed, value, vocab=2048):
    spec = TASKS[task]
    record = {
        "model": model, "vocab": vocab, "task": task, "seed": seed,
        "scores": {split: dict.fromkeys(spec.metrics, value) for split in spec.eval_splits},
    }
    path = folder / "results" / f"{model}_{task}_{seed}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))
    return path


def write_scores(folder, model, scores):
    """``scores``: {task: [value per seed]}."""
    return [write_result(folder, model, task, seed, v) for task, values in scores.items()
            for seed, v in enumerate(values)]


# Architecture ablation: labels given out of parameter order; depth12 has no fine-tuning results.
ARCH = {
    "12 layers": dict(run="arch-depth12", parameters=90_000_000, layers=12, final_loss=1.86, eval_loss=1.85,
                      tokens_per_s=59_346.0, shift=3.0),
    "4 layers": dict(run="arch-depth4", parameters=30_000_000, layers=4, final_loss=1.95, eval_loss=1.94,
                     tokens_per_s=161_034.0, shift=1.0),
    "8 layers": dict(run="arch-depth8", parameters=60_000_000, layers=8, final_loss=1.83, eval_loss=1.84,
                     tokens_per_s=88_652.0, shift=2.0),
}


@pytest.fixture
def arch_runs(tmp_path):
    summaries, logs = {}, {}
    for label, spec in ARCH.items():
        run = spec["run"]
        summaries[label] = write_summary(tmp_path, run, parameters=spec["parameters"], layers=spec["layers"],
                                         final_loss=spec["final_loss"], eval_loss=spec["eval_loss"],
                                         tokens_per_s=spec["tokens_per_s"])
        logs[label] = write_log(tmp_path, run, shift=spec["shift"], floor=spec["eval_loss"] - 0.08)
    results = (
        write_scores(tmp_path, "arch-depth4", {"mnli": [79.0, 81.0, 80.0], "sst2": [88.0, 90.0, 86.0]})
        + write_scores(tmp_path, "arch-depth8", {"mnli": [82.0, 81.0, 83.0], "sst2": [91.0, 89.0, 90.0]})
        + write_scores(tmp_path, "unrelated-run", {"mnli": [10.0]})
    )
    return summaries, logs, results


SCHEDULE_LOSSES = {  # (schedule, peak lr) -> held-out loss
    ("triangle2", 1e-4): 2.60, ("triangle2", 1e-3): 1.95, ("triangle2", 5e-3): 2.05,
    ("cosine", 1e-4): 2.70, ("cosine", 1e-3): 2.00,
    ("one-cycle", 1e-3): 1.97,
}


@pytest.fixture
def schedule_runs(tmp_path):
    summaries, logs = {}, {}
    for (schedule, lr), loss in SCHEDULE_LOSSES.items():
        label = f"sched-{schedule}-lr{lr:g}"
        summaries[label] = write_summary(tmp_path, label, schedule=schedule, lr=lr, eval_loss=loss,
                                         final_loss=loss - 0.05)
        logs[label] = write_log(tmp_path, label, schedule=schedule, lr=lr)
    return summaries, logs


GROUP_LABELS = {
    "final": "final (crammed)",
    "groups-original_arch": "original architecture",
    "groups-original_training": "original training",
}


@pytest.fixture
def group_results(tmp_path):
    return (
        write_scores(tmp_path, "final", {"mnli": [80.0, 82.0, 81.0], "sst2": [90.0, 91.0, 89.0], "rte": [60, 70, 66]})
        + write_scores(tmp_path, "groups-original_arch", {"mnli": [78.0, 79.0, 77.0], "sst2": [88.0, 88.0, 87.0],
                                                          "rte": [55, 60, 57]})
        + write_scores(tmp_path, "groups-original_training", {"mnli": [40.0, 35.0, 33.0], "sst2": [50.0, 51.0, 52.0],
                                                              "rte": [50, 50, 50]})
    )


# ------------------------------------------------------------------------------------------------ tables


def test_arch_table_rows_sorted_by_parameters_with_seed_medians(arch_runs):
    summaries, _, results = arch_runs
    table = arch_table(summaries, results)
    assert table["label"].tolist() == ["4 layers", "8 layers", "12 layers"]
    assert list(table.columns) == [
        "label", "run", "layers", "hidden_size", "heads", "parameters", "tokens", "tokens_per_s",
        "final_loss", "eval_loss", "mnli_m", "mnli_mm", "sst2", "n_seeds",
    ]
    depth4 = table.iloc[0]
    assert (depth4["mnli_m"], depth4["mnli_mm"], depth4["sst2"]) == (80.0, 80.0, 88.0)  # medians, not means
    assert depth4["n_seeds"] == 3 and depth4["eval_loss"] == 1.94 and depth4["tokens_per_s"] == 161_034.0
    assert table.iloc[1]["mnli_m"] == 82.0
    # No fine-tuning results: the row stays, scores NaN, zero seeds.
    depth12 = table.iloc[2]
    assert math.isnan(depth12["mnli_m"]) and depth12["n_seeds"] == 0 and depth12["layers"] == 12
    # Results of runs not in the table (unrelated-run) are ignored; no results at all is fine too.
    assert arch_table(summaries)["n_seeds"].tolist() == [0, 0, 0]


def test_schedule_table_and_pivot(schedule_runs):
    summaries, _ = schedule_runs
    table = schedule_table(summaries)
    assert list(table.columns) == ["label", "run", "schedule", "lr", "final_loss", "eval_loss", "steps", "tokens"]
    assert table["schedule"].tolist() == ["triangle2"] * 3 + ["cosine"] * 2 + ["one-cycle"]
    assert table["lr"].tolist()[:3] == [1e-4, 1e-3, 5e-3]
    pivot = schedule_pivot(table)
    assert pivot.shape == (3, 3)
    assert pivot.index.tolist() == ["triangle2", "cosine", "one-cycle"]
    assert pivot.columns.tolist() == [1e-4, 1e-3, 5e-3]
    assert pivot.loc["cosine", 1e-3] == 2.00 and pivot.loc["one-cycle", 1e-3] == 1.97
    assert math.isnan(pivot.loc["one-cycle", 1e-4]) and math.isnan(pivot.loc["cosine", 5e-3])
    # The best recipe is the one the paper ships.
    assert pivot.stack().idxmin() == ("triangle2", 1e-3)


def test_schedule_pivot_rejects_duplicate_runs(schedule_runs, tmp_path):
    summaries, _ = schedule_runs
    twin = write_summary(tmp_path, "twin", schedule="cosine", lr=1e-3, eval_loss=2.2)
    with pytest.raises(ValueError, match="twin.*cosine"):
        schedule_pivot(schedule_table({**summaries, "twin": twin}))


def test_groups_table_medians_average_and_delta(group_results, tmp_path):
    summaries = {run: write_summary(tmp_path, run, eval_loss=loss)
                 for run, loss in zip(GROUP_LABELS, (1.9, 2.0, 3.5))}
    table = groups_table(group_results, GROUP_LABELS, summaries)
    assert table["label"].tolist() == list(GROUP_LABELS.values())
    assert list(table.columns) == [
        "label", "run", "mnli_m", "mnli_mm", "sst2", "rte", "avg_tasks_run", "delta_avg", "n_seeds", "eval_loss",
    ]
    final = table.iloc[0]
    assert (final["mnli_m"], final["sst2"], final["rte"]) == (81.0, 90.0, 66.0)
    # Mean of the per-task medians; MNLI counts twice (m and mm), as in the paper's average.
    assert final["avg_tasks_run"] == pytest.approx((81 + 81 + 90 + 66) / 4)
    arch = table.iloc[1]
    assert arch["avg_tasks_run"] == pytest.approx((78 + 78 + 88 + 57) / 4)
    assert arch["delta_avg"] == pytest.approx(arch["avg_tasks_run"] - final["avg_tasks_run"])
    assert final["delta_avg"] == 0.0
    assert table["eval_loss"].tolist() == [1.9, 2.0, 3.5]
    assert "eval_loss" not in groups_table(group_results, GROUP_LABELS).columns


def test_groups_table_row_missing_a_task_has_no_average(group_results, tmp_path):
    extra = write_scores(tmp_path, "groups-original_data", {"mnli": [70.0], "sst2": [80.0]})
    table = groups_table(group_results + extra, {**GROUP_LABELS, "groups-original_data": "original data"})
    last = table.iloc[-1]
    assert math.isnan(last["rte"]) and math.isnan(last["avg_tasks_run"]) and math.isnan(last["delta_avg"])
    assert last["n_seeds"] == 1


def test_groups_table_run_without_results_is_named(group_results):
    with pytest.raises(ValueError, match="groups-original_both"):
        groups_table(group_results, {**GROUP_LABELS, "groups-original_both": "original arch + training"})


def test_write_ablation_table_precision(arch_runs, schedule_runs, tmp_path):
    summaries, _, results = arch_runs
    csv_path, md_path = write_ablation_table(arch_table(summaries, results), tmp_path / "out" / "arch")
    md = md_path.read_text()
    assert "Held-out MLM loss" in md and "1.940" in md and "30,000,000" in md and "MNLI-m" in md
    assert pd.read_csv(csv_path)["eval_loss"].tolist() == [1.94, 1.84, 1.85]
    pivot = schedule_pivot(schedule_table(schedule_runs[0]))
    csv_path, md_path = write_ablation_table(pivot, tmp_path / "out" / "schedule_pivot")
    md = md_path.read_text()
    assert "peak LR 0.001" in md and "1.950" in md and "| triangle2" in md
    assert pd.read_csv(csv_path).shape == (3, 4)


# ------------------------------------------------------------------------------------------------ errors


def test_missing_files_and_fields_are_named(tmp_path, arch_runs):
    summaries, logs, _ = arch_runs
    with pytest.raises(ValueError, match="absent.json"):
        arch_table({"x": tmp_path / "absent.json"})
    no_arch = write_summary(tmp_path, "no-arch", drop=("arch",))
    with pytest.raises(ValueError, match=r"no-arch/summary.json.*arch\.layers"):
        arch_table({"x": no_arch})
    no_eval = write_summary(tmp_path, "no-eval", drop=("eval_loss",))
    with pytest.raises(ValueError, match=r"no-eval/summary.json.*eval_loss"):
        schedule_table({"x": no_eval})
    with pytest.raises(ValueError, match="absent.csv"):
        plot_arch({"x": tmp_path / "absent.csv"}, tmp_path / "f.png")
    bad_log = tmp_path / "bad_log.csv"
    bad_log.write_text("step,tokens,loss\n1,100,3.0\n")
    with pytest.raises(ValueError, match="bad_log.csv.*eval_loss"):
        plot_arch({"x": bad_log}, tmp_path / "f.png")
    with pytest.raises(ValueError, match="bad_log.csv.*progress"):
        plot_schedule({"x": bad_log}, {"x": summaries["4 layers"]}, tmp_path / "f.png")
    assert not (tmp_path / "f.png").exists()


def test_plot_schedule_needs_a_log_per_schedule(schedule_runs, tmp_path):
    summaries, logs = schedule_runs
    only_triangle = {k: v for k, v in logs.items() if "triangle2" in k}
    with pytest.raises(ValueError, match="cosine"):
        plot_schedule(only_triangle, summaries, tmp_path / "f.png")
    with pytest.raises(ValueError, match="stray"):
        plot_schedule({**logs, "stray": logs[next(iter(logs))]}, summaries, tmp_path / "f.png")


def test_read_log_parses_empty_eval_loss_as_nan(arch_runs):
    log = read_log(arch_runs[1]["4 layers"])
    assert log["eval_loss"].dtype == np.float64
    assert log["eval_loss"].isna().sum() > 0 and log["eval_loss"].notna().sum() > 0


# ------------------------------------------------------------------------------------------------ figures


def test_plots_are_written(arch_runs, schedule_runs, tmp_path):
    arch_png = plot_arch(arch_runs[1], tmp_path / "figs" / "fig1_arch.png")
    schedule_png = plot_schedule(schedule_runs[1], schedule_runs[0], tmp_path / "figs" / "fig2_schedule.png")
    for png in (arch_png, schedule_png):
        data = png.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    assert sorted(p.name for p in (tmp_path / "figs").iterdir()) == sorted(
        f"{stem}{ext}" for stem in ("fig1_arch", "fig2_schedule") for ext in (".png", ".pdf", ".caption.rst")
    )
    assert "Figure 1 of the paper" in (tmp_path / "figs" / "fig1_arch.caption.rst").read_text()
    assert "Lowest held-out loss" in (tmp_path / "figs" / "fig2_schedule.caption.rst").read_text()


def test_groups_table_markdown_and_summary_checks(group_results, tmp_path):
    table = groups_table(group_results, GROUP_LABELS)
    md = write_ablation_table(table, tmp_path / "groups")[1].read_text()
    assert "avg (tasks run)" in md and "Δ avg vs first row" in md and "+0.0" in md and "-4.2" in md
    wrong = write_summary(tmp_path, "someone-else")
    with pytest.raises(ValueError, match="someone-else.*final"):
        groups_table(group_results, GROUP_LABELS, {"final": wrong})


def test_run_with_several_vocab_sizes_is_rejected(tmp_path, arch_runs):
    summaries, _, results = arch_runs
    other = write_result(tmp_path, "arch-depth4", "rte", 0, 60.0, vocab=4096)
    with pytest.raises(ValueError, match="arch-depth4.*vocabulary"):
        arch_table(summaries, results + [other])


def test_loss_axis_cuts_only_a_long_early_tail():
    long_train = pd.Series(np.r_[[10.0, 8.0, 6.0], np.linspace(3.0, 2.0, 57)])
    bottom, top, clipped = _loss_limits(long_train, pd.Series([2.1, 9.0]))
    assert clipped and top < 4.0 and bottom < 2.0
    short = pd.Series([10.0, 5.0, 3.0])
    assert _loss_limits(short, pd.Series([3.1]))[1:] == (pytest.approx(10.35), False)
