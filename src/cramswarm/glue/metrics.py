"""GLUE metrics, the score-column key scheme, and the two GLUE averages.

All scores are percentages (x100), as the papers report them.

Key scheme
----------
A model's GLUE scores live in one flat mapping keyed by *score columns* (see :data:`SCORE_COLUMNS`):

* a task with one metric and one split is keyed by the task name: ``cola`` (Matthews), ``sst2``, ``qnli``,
  ``rte``, ``wnli`` (accuracy);
* MNLI is keyed by split: ``mnli_m`` (validation_matched), ``mnli_mm`` (validation_mismatched);
* a task with two metrics gets one key per metric: ``mrpc_f1``, ``mrpc_acc``, ``qqp_f1``, ``qqp_acc``,
  ``stsb_pearson``, ``stsb_spearman``.

:func:`score_columns` maps one fine-tuning result (task, split, ``{metric: value}``) onto these keys.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

from cramswarm.glue_tasks import get_task

# Every score column, in the Cramming paper's table order (MNLI-m, MNLI-mm, QQP, QNLI, SST-2, CoLA, STS-B,
# MRPC, RTE), with each task's second metric right after its first and WNLI (not in the paper) last.
SCORE_COLUMNS: tuple[str, ...] = (
    "mnli_m",
    "mnli_mm",
    "qqp_f1",
    "qqp_acc",
    "qnli",
    "sst2",
    "cola",
    "stsb_pearson",
    "stsb_spearman",
    "mrpc_f1",
    "mrpc_acc",
    "rte",
    "wnli",
)

# The nine numbers the Cramming paper averages (its "GLUE" column): one metric per task, MNLI twice, no WNLI.
PAPER_AVERAGE_COLUMNS: tuple[str, ...] = (
    "mnli_m",
    "mnli_mm",
    "qqp_f1",
    "qnli",
    "sst2",
    "cola",
    "stsb_pearson",
    "mrpc_f1",
    "rte",
)

# The GLUE benchmark's score: each of the nine tasks counts once, as the mean of its own numbers.
GLUE_AVERAGE_GROUPS: dict[str, tuple[str, ...]] = {
    "cola": ("cola",),
    "sst2": ("sst2",),
    "mrpc": ("mrpc_f1", "mrpc_acc"),
    "qqp": ("qqp_f1", "qqp_acc"),
    "stsb": ("stsb_pearson", "stsb_spearman"),
    "mnli": ("mnli_m", "mnli_mm"),
    "qnli": ("qnli",),
    "rte": ("rte",),
    "wnli": ("wnli",),
}

_SPLIT_SUFFIX = {"validation": "", "validation_matched": "_m", "validation_mismatched": "_mm"}
_METRIC_SUFFIX = {"accuracy": "acc", "f1": "f1", "matthews": "matthews", "pearson": "pearson", "spearman": "spearman"}

MissingPolicy = Literal["raise", "nan"]


def compute_metrics(task: str, predictions: Sequence, references: Sequence) -> dict[str, float]:
    """The task's metrics (``TASKS[task].metrics``) as percentages.

    ``predictions`` are class ids (floats for the regression task stsb); ``references`` are the gold labels
    in the same encoding. F1 is the binary F1 of class 1 (``equivalent`` for MRPC, ``duplicate`` for QQP).

    Degenerate input: empty or mismatched input raises ``ValueError``. A correlation that is undefined because
    one side is constant (e.g. a model predicting the same similarity for every pair) is reported as 0.0 — no
    linear/rank relation — rather than NaN, the same convention scikit-learn uses for Matthews correlation
    with a constant prediction, and F1 with no predicted or gold positives is 0.0.
    """
    spec = get_task(task)
    preds = np.asarray(predictions)
    refs = np.asarray(references)
    if preds.ndim != 1 or refs.ndim != 1:
        raise ValueError(f"{task}: predictions and references must be 1-D, got shapes {preds.shape} and {refs.shape}")
    if len(preds) != len(refs):
        raise ValueError(f"{task}: {len(preds)} predictions but {len(refs)} references")
    if len(preds) == 0:
        raise ValueError(f"{task}: cannot score empty predictions")

    if spec.is_regression:
        preds = preds.astype(float)
        refs = refs.astype(float)
        if not (np.isfinite(preds).all() and np.isfinite(refs).all()):
            raise ValueError(f"{task}: predictions and references must be finite numbers")
        if len(preds) < 2:
            raise ValueError(f"{task}: a correlation needs at least 2 pairs, got {len(preds)}")
    else:
        for name, values in (("predictions", preds), ("references", refs)):
            if not np.issubdtype(values.dtype, np.integer) or values.min() < 0 or values.max() >= spec.num_labels:
                raise ValueError(f"{task}: {name} must be class ids in 0..{spec.num_labels - 1}")

    scores = {name: _METRICS[name](refs, preds) for name in spec.metrics}
    return {name: 100.0 * value for name, value in scores.items()}


def _correlation(stat, refs: np.ndarray, preds: np.ndarray) -> float:
    # Constant input leaves the coefficient undefined (scipy warns and returns NaN); report 0.0 instead,
    # see compute_metrics.
    if np.ptp(refs) == 0 or np.ptp(preds) == 0:
        return 0.0
    return float(stat(refs, preds)[0])


_METRICS = {
    "accuracy": lambda refs, preds: float(accuracy_score(refs, preds)),
    "f1": lambda refs, preds: float(f1_score(refs, preds, pos_label=1, average="binary", zero_division=0.0)),
    "matthews": lambda refs, preds: float(matthews_corrcoef(refs, preds)),
    "pearson": lambda refs, preds: _correlation(pearsonr, refs, preds),
    "spearman": lambda refs, preds: _correlation(spearmanr, refs, preds),
}


def score_columns(task: str, split: str, metrics: Mapping[str, float]) -> dict[str, float]:
    """Map one task/split's ``{metric: value}`` onto score-column keys (see the module docstring).

    >>> score_columns("mnli", "validation_mismatched", {"accuracy": 70.1})
    {'mnli_mm': 70.1}
    >>> score_columns("qqp", "validation", {"f1": 80.0, "accuracy": 85.0})
    {'qqp_f1': 80.0, 'qqp_acc': 85.0}
    """
    spec = get_task(task)
    if split not in spec.eval_splits:
        raise ValueError(f"{task}: unknown eval split {split!r}; expected one of {', '.join(spec.eval_splits)}")
    unknown = sorted(set(metrics) - set(spec.metrics))
    missing = [m for m in spec.metrics if m not in metrics]
    if unknown or missing:
        raise ValueError(
            f"{task}/{split}: expected metrics {', '.join(spec.metrics)}; "
            f"missing {missing or 'none'}, unexpected {unknown or 'none'}"
        )
    prefix = task + _SPLIT_SUFFIX[split]
    if len(spec.metrics) == 1:
        return {prefix: float(metrics[spec.metrics[0]])}
    return {f"{prefix}_{_METRIC_SUFFIX[m]}": float(metrics[m]) for m in spec.metrics}


def _check_complete(scores: Mapping[str, float], keys: Sequence[str], what: str, missing: MissingPolicy) -> bool:
    """True if every key is present and not NaN; otherwise raise (``missing="raise"``) or return False."""
    if missing not in ("raise", "nan"):
        raise ValueError(f"missing must be 'raise' or 'nan', got {missing!r}")
    absent = [k for k in keys if k not in scores or scores[k] is None or math.isnan(scores[k])]
    if absent and missing == "raise":
        raise ValueError(f"{what} needs {', '.join(absent)}, which are missing")
    return not absent


def paper_average(scores: Mapping[str, float], *, missing: MissingPolicy = "raise") -> float:
    """The Cramming paper's GLUE average: the plain mean of the nine :data:`PAPER_AVERAGE_COLUMNS`.

    A missing or NaN input raises ``ValueError`` naming it, or with ``missing="nan"`` makes the result NaN —
    never an average over fewer numbers.
    """
    if not _check_complete(scores, PAPER_AVERAGE_COLUMNS, "the paper's GLUE average", missing):
        return math.nan
    return float(np.mean([scores[k] for k in PAPER_AVERAGE_COLUMNS]))


def glue_average(scores: Mapping[str, float], *, missing: MissingPolicy = "raise") -> float:
    """The GLUE benchmark's average over all nine tasks (WNLI included).

    A task with two numbers (MRPC F1/acc, QQP F1/acc, STS-B Pearson/Spearman, MNLI m/mm) counts as their mean.
    Missing inputs are handled as in :func:`paper_average`.
    """
    keys = [k for group in GLUE_AVERAGE_GROUPS.values() for k in group]
    if not _check_complete(scores, keys, "the GLUE benchmark average", missing):
        return math.nan
    return float(np.mean([np.mean([scores[k] for k in group]) for group in GLUE_AVERAGE_GROUPS.values()]))

