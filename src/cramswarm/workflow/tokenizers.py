"""Stage 2, rules/tokenizers.smk: a tokenizer job's memory (its input: data.corpus_variant; its time:
data.data_runtime)."""

from __future__ import annotations

from typing import Any

from cramswarm.workflow.data import data_mem_mb
from cramswarm.workflow.study import Study, bind


def tokenizer_mem_mb(study: Study, wildcards) -> int:
    """Tokenizer training counts words and pairs over the whole corpus, outside the data cap: twice a stage's."""
    return data_mem_mb(study, wildcards, factor=2)


def names(study: Study) -> dict[str, Any]:
    """The names rules/tokenizers.smk uses."""
    return bind(study, tokenizer_mem_mb)
