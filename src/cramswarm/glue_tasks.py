"""The nine GLUE tasks as the hub's ``nyu-mll/glue`` defines them.

One source of truth for column names, label encodings, evaluation splits and metrics. The synthetic
stand-in (``cramswarm.data.synthetic``) produces rows with exactly these columns and label encodings, so the
fine-tuning code cannot tell the two sources apart.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Task:
    name: str
    text_columns: tuple[str, ...]  # one column: single sentence; two: a sentence pair
    label_names: tuple[str, ...]  # ClassLabel names in hub order; empty for regression (stsb)
    eval_splits: tuple[str, ...]  # validation splits scored (never test)
    metrics: tuple[str, ...]  # metric names computed by cramswarm.glue.metrics, per eval split

    @property
    def is_regression(self) -> bool:
        return not self.label_names

    @property
    def num_labels(self) -> int:
        return 1 if self.is_regression else len(self.label_names)


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task("cola", ("sentence",), ("unacceptable", "acceptable"), ("validation",), ("matthews",)),
        Task("sst2", ("sentence",), ("negative", "positive"), ("validation",), ("accuracy",)),
        Task("mrpc", ("sentence1", "sentence2"), ("not_equivalent", "equivalent"), ("validation",), ("f1", "accuracy")),
        Task("qqp", ("question1", "question2"), ("not_duplicate", "duplicate"), ("validation",), ("f1", "accuracy")),
        Task("stsb", ("sentence1", "sentence2"), (), ("validation",), ("pearson", "spearman")),
        Task(
            "mnli",
            ("premise", "hypothesis"),
            ("entailment", "neutral", "contradiction"),
            ("validation_matched", "validation_mismatched"),
            ("accuracy",),
        ),
        Task("qnli", ("question", "sentence"), ("entailment", "not_entailment"), ("validation",), ("accuracy",)),
        Task("rte", ("sentence1", "sentence2"), ("entailment", "not_entailment"), ("validation",), ("accuracy",)),
        Task("wnli", ("sentence1", "sentence2"), ("not_entailment", "entailment"), ("validation",), ("accuracy",)),
    )
}

TASK_NAMES: tuple[str, ...] = tuple(TASKS)


def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown GLUE task {name!r}; allowed: {', '.join(TASK_NAMES)}") from None
