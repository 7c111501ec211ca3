"""The workflow's helpers: the input, params and resource functions of the rules, one module per rule file
(rules/pretrain.smk: :mod:`cramswarm.workflow.pretrain`), what several share in :mod:`cramswarm.workflow.study`.

Plain Python over a :class:`Study` built once from the validated config, with wildcards as any object with
attributes; rules/common.smk binds them (:func:`rule_names`). The package's top layer: only the rule files and the
tests import it. Every job rule declares ``mem_mb`` (MB, sbatch --mem) and ``runtime`` (minutes, sbatch --time) from
these, the arithmetic being cramswarm.resources; a site's set-resources in a copy of profiles/slurm take precedence.
"""

from __future__ import annotations

from typing import Any

from cramswarm.workflow import ablations, data, glue, preflight, pretrain, report, swarm, tokenizers
from cramswarm.workflow import study as shared
from cramswarm.workflow.study import Study

__all__ = ["STAGES", "Study", "rule_names"]

STAGES = (shared, data, tokenizers, pretrain, swarm, glue, report, ablations, preflight)


def rule_names(study: Study) -> dict[str, Any]:
    """Every name the Snakefile and the rule files use, each stage's ``names(study)``; a name two stages give is
    an error."""
    names: dict[str, Any] = {}
    for stage in STAGES:
        for name, value in stage.names(study).items():
            if name in names:
                raise ValueError(f"{name}: given by {stage.__name__} and an earlier stage")
            names[name] = value
    return names
