"""rules/preflight.smk: the preflight job's memory (it rehearses the study on a slice, one model at a time)."""

from __future__ import annotations

from typing import Any

from cramswarm.workflow.data import data_mem_mb
from cramswarm.workflow.study import Study, bind, training_mem_mb


def preflight_mem_mb(study: Study, wildcards) -> int:
    """The preflight holds one model at a time at its micro-batch, and a data stage's working set."""
    models = [
        training_mem_mb(arch, study.main_vocab, recipe["micro_batch_sequences"], study.block_tokens, "cpu")
        for arch, recipe in ((run["arch"], run["recipe"]) for run in study.runs.values() if run["study"] == "models")
    ]
    return max([data_mem_mb(study, wildcards, factor=2), *models])


def names(study: Study) -> dict[str, Any]:
    """The names rules/preflight.smk uses."""
    return bind(study, preflight_mem_mb)
