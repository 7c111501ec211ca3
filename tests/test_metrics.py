"""GLUE metrics, score-column keys and the two averages, against hand-worked numbers."""

from __future__ import annotations

import math
import warnings

import pytest

from cramswarm.glue.metrics import (
    GLUE_AVERAGE_GROUPS,
    PAPER_AVERAGE_COLUMNS,
    SCORE_COLUMNS,
    compute_metrics,
    glue_average,
    paper_average,
    score_columns,
)
from cramswarm.glue_tasks import TASKS


def test_matthews_by_hand():
    # refs  1 1 1 0 0 0
    # preds 1 1 0 0 0 1   ->  TP=2, FN=1, TN=2, FP=1
    # MCC = (TP*TN - FP*FN) / sqrt((TP+FP)(TP+FN)(TN+FP)(TN+FN)) = (4 - 1) / sqrt(3*3*3*3) = 3/9 = 1/3
    scores = compute_metrics("cola", [1, 1, 0, 0, 0, 1], [1, 1, 1, 0, 0, 0])
    assert scores == {"matthews": pytest.approx(100 / 3)}


def test_f1_is_for_the_positive_class_and_accuracy_by_hand():
    # refs  1 1 1 0 0 0
    # preds 1 0 0 0 0 1   ->  class 1: TP=1, FP=1, FN=2; P=1/2, R=1/3, F1 = 2PR/(P+R) = (1/3)/(5/6) = 0.4
    # (class 0 would give P=1/2, R=2/3, F1=4/7, so this also pins pos_label=1). Accuracy: 3 of 6 correct.
    scores = compute_metrics("mrpc", [1, 0, 0, 0, 0, 1], [1, 1, 1, 0, 0, 0])
    assert scores == {"f1": pytest.approx(40.0), "accuracy": pytest.approx(50.0)}
    assert compute_metrics("qqp", [1, 0, 0, 0, 0, 1], [1, 1, 1, 0, 0, 0]) == scores


def test_three_class_accuracy():
    assert compute_metrics("mnli", [0, 1, 2, 2], [0, 1, 1, 2]) == {"accuracy": pytest.approx(75.0)}


def test_pearson_and_spearman_by_hand():
    # x = 1 2 3, y = 2 4 7: dx = -1 0 1, dy = -7/3 -1/3 8/3; sum dx*dy = 5, sum dx^2 = 2, sum dy^2 = 114/9
    # r = 5 / sqrt(2 * 114/9) = 15 / sqrt(228) = 0.993399...; the ranks agree exactly, so Spearman = 1.
    scores = compute_metrics("stsb", [2.0, 4.0, 7.0], [1.0, 2.0, 3.0])
    assert scores["pearson"] == pytest.approx(100 * 15 / math.sqrt(228))
    assert scores["spearman"] == pytest.approx(100.0)
    # ranks 1 2 3 4 vs 1 3 2 4: sum d^2 = 2, rho = 1 - 6*2 / (4*(16-1)) = 0.8
    assert compute_metrics("stsb", [1.0, 3.0, 2.0, 4.0], [1.0, 2.0, 3.0, 4.0])["spearman"] == pytest.approx(80.0)


def test_constant_predictions_score_zero_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compute_metrics("stsb", [2.5, 2.5, 2.5], [1.0, 2.0, 4.0]) == {"pearson": 0.0, "spearman": 0.0}
        assert compute_metrics("cola", [1, 1, 1, 1], [0, 1, 0, 1]) == {"matthews": 0.0}
        assert compute_metrics("mrpc", [0, 0, 0], [1, 0, 1])["f1"] == 0.0


@pytest.mark.parametrize(
    ("task", "preds", "refs", "match"),
    [
        ("sst2", [], [], "empty"),
        ("sst2", [0, 1], [0], "2 predictions but 1 references"),
        ("sst2", [0, 2], [0, 1], "class ids in 0..1"),
        ("sst2", [0.0, 1.0], [0, 1], "class ids"),
        ("stsb", [1.0], [2.0], "at least 2"),
        ("stsb", [1.0, float("nan")], [2.0, 3.0], "finite"),
        ("nope", [0], [0], "unknown GLUE task"),
    ],
)
def test_bad_input_raises(task, preds, refs, match):
    with pytest.raises(ValueError, match=match):
        compute_metrics(task, preds, refs)


def test_score_columns_key_scheme():
    assert score_columns("mnli", "validation_matched", {"accuracy": 71.2}) == {"mnli_m": 71.2}
    assert score_columns("mnli", "validation_mismatched", {"accuracy": 70.1}) == {"mnli_mm": 70.1}
    assert score_columns("cola", "validation", {"matthews": 12.0}) == {"cola": 12.0}
    assert score_columns("stsb", "validation", {"pearson": 80.0, "spearman": 79.0}) == {
        "stsb_pearson": 80.0,
        "stsb_spearman": 79.0,
    }
    with pytest.raises(ValueError, match="eval split"):
        score_columns("mnli", "validation", {"accuracy": 1.0})
    with pytest.raises(ValueError, match="missing \\['accuracy'\\]"):
        score_columns("qqp", "validation", {"f1": 1.0})


def test_key_scheme_covers_every_task_metric_and_split():
    produced = {
        key
        for task in TASKS.values()
        for split in task.eval_splits
        for key in score_columns(task.name, split, dict.fromkeys(task.metrics, 0.0))
    }
    assert produced == set(SCORE_COLUMNS)
    assert set(GLUE_AVERAGE_GROUPS) == set(TASKS)
    assert set(PAPER_AVERAGE_COLUMNS) <= set(SCORE_COLUMNS)


# The Cramming paper's crammed (A6000) row: MNLI 83.9/84.1, SST-2 92.2, STS-B 84.6, RTE 53.8, QNLI 89.5,
# QQP 87.3, MRPC 87.5, CoLA 44.5 -> GLUE 78.6 (= 707.4 / 9).
PAPER_ROW = {
    "mnli_m": 83.9, "mnli_mm": 84.1, "sst2": 92.2, "stsb_pearson": 84.6, "rte": 53.8,
    "qnli": 89.5, "qqp_f1": 87.3, "mrpc_f1": 87.5, "cola": 44.5,
}


def test_paper_average_reproduces_the_paper():
    # Columns outside the paper's nine (second metrics, WNLI) must not count.
    extra = {"qqp_acc": 0.0, "mrpc_acc": 0.0, "stsb_spearman": 0.0, "wnli": 0.0}
    assert paper_average({**PAPER_ROW, **extra}) == pytest.approx(78.6)


# Hand-worked benchmark example. Per-task numbers: CoLA 40, SST-2 90, MRPC (80+70)/2 = 75, QQP (60+80)/2 = 70,
# STS-B (85+83)/2 = 84, MNLI (76+78)/2 = 77, QNLI 85, RTE 60, WNLI 50; sum 631, average 631/9 = 70.111...
# Paper rule on the same scores: 76+78+60+85+90+40+85+80+60 = 654, 654/9 = 72.666...
FULL_ROW = {
    "cola": 40.0, "sst2": 90.0, "mrpc_f1": 80.0, "mrpc_acc": 70.0, "qqp_f1": 60.0, "qqp_acc": 80.0,
    "stsb_pearson": 85.0, "stsb_spearman": 83.0, "mnli_m": 76.0, "mnli_mm": 78.0, "qnli": 85.0,
    "rte": 60.0, "wnli": 50.0,
}


def test_glue_average_by_hand():
    assert glue_average(FULL_ROW) == pytest.approx(631 / 9)
    assert paper_average(FULL_ROW) == pytest.approx(654 / 9)


@pytest.mark.parametrize("average", [paper_average, glue_average])
def test_missing_scores_raise_or_give_nan(average):
    partial = {k: v for k, v in FULL_ROW.items() if k not in ("rte", "mnli_mm")}
    with pytest.raises(ValueError, match="mnli_mm, rte"):
        average(partial)
    assert math.isnan(average(partial, missing="nan"))
    with pytest.raises(ValueError, match="rte"):
        average({**FULL_ROW, "rte": float("nan")})


def test_wnli_only_missing_breaks_only_the_benchmark_average():
    no_wnli = {k: v for k, v in FULL_ROW.items() if k != "wnli"}
    assert paper_average(no_wnli) == pytest.approx(654 / 9)
    with pytest.raises(ValueError, match="wnli"):
        glue_average(no_wnli)
