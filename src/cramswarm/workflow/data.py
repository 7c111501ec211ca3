"""Stage 1, rules/data.smk: the corpus stage's and the GLUE data's settings, the filter steps, and the memory and
time of the streaming data stages (the arithmetic: cramswarm.resources)."""

from __future__ import annotations

import json
from typing import Any

from cramswarm import resources as est
from cramswarm.config import corpus_spec
from cramswarm.resources import PYTHON_MB, mb, minutes
from cramswarm.workflow.study import CORPUS, FILTERED, TOKENIZER, Study, bind

# The keys of the source's section the GLUE stage reads, so that a change to another (say, the corpus size)
# does not rerun it. (The corpus stage's keys, for every corpus name: cramswarm.config.corpus_spec.)
GLUE_SOURCE_KEYS = {
    "synthetic": ["seed", "glue_train_examples", "glue_validation_examples"],
    "hub": ["mirror", "glue", "glue_max_train_examples"],
}


def glue_source_spec(study: Study, wildcards=None) -> str:
    """JSON of the chosen source with only the keys the GLUE stage reads."""
    section = {key: study.config[study.source][key] for key in GLUE_SOURCE_KEYS[study.source]}
    return json.dumps({"source": study.source, study.source: section}, sort_keys=True)


def corpus_spec_json(study: Study, wildcards) -> str:
    """JSON of what the corpus stage reads for corpus ``wildcards.corpus`` (and nothing else)."""
    return json.dumps(corpus_spec(study.config, wildcards.corpus), sort_keys=True)


def corpus_variant(study: Study, wildcards) -> str:
    """The corpus file a tokenizer or packing job reads: the raw corpus or one of its filtered variants."""
    pattern = CORPUS if wildcards.filters == "raw" else FILTERED
    return pattern.format(corpus=wildcards.corpus, filters=wildcards.filters)


def filter_step(wildcards) -> tuple[str, str]:
    """The last filter of a {filters} chain (the step this job applies) and the corpus it reads."""
    *before, step = wildcards.filters.split("-")
    parent = "-".join(before) or "raw"
    return step, (CORPUS if parent == "raw" else FILTERED).format(corpus=wildcards.corpus, filters=parent)


def filter_inputs(study: Study, wildcards) -> dict[str, str]:
    """For filter_corpus, the corpus the step reads, and for a trash step the tokenizer that counts tokens."""
    step, parent = filter_step(wildcards)
    inputs = {"corpus": parent}
    if step.startswith("trash"):  # the corpus's own tokenizer: study family, main vocab, unfiltered corpus
        inputs["tokenizer"] = TOKENIZER.format(
            corpus=wildcards.corpus, filters="raw", family=study.config["tokenizer"]["family"], vocab=study.main_vocab
        )
    return inputs


def filter_args(study: Study, wildcards) -> str:
    """For filter_corpus, the step and its settings (dedup shingles and permutations included)."""
    step, _ = filter_step(wildcards)
    if step.startswith("trash"):
        return f"--kind trash --trash-cutoff {step[len('trash'):]}"
    d = study.config["data"]
    return (
        f"--kind dedup --dedup-threshold {step[len('dedup'):]} --shingle-words {d['dedup_shingle_words']} "
        f"--num-perm {d['dedup_permutations']}"
    )


def filter_threads(study: Study, wildcards) -> int:
    """Processes of a filter step: dedup's MinHash pass runs in up to 4 (the same output for any number)."""
    step, _ = filter_step(wildcards)
    return 4 if step.startswith("dedup") else 1


def corpus_documents(study: Study, corpus: str) -> int:
    """Documents in corpus `corpus` (cramswarm.resources.corpus_documents)."""
    return est.corpus_documents(corpus_spec(study.config, corpus))


def data_mem_mb(study: Study, wildcards=None, factor: int = 1) -> int:
    """A streaming data stage: its batches stay within data.memory_cap_mb (MiB); pyarrow's buffers and the
    written row groups come on top, hence twice the cap (`factor` times that for a stage with more to hold)."""
    return mb(PYTHON_MB * 1e6 + factor * 2 * study.config["data"]["memory_cap_mb"] * 2**20)


def data_runtime(study: Study, wildcards) -> int:
    """A streaming data stage: every document of the corpus at DOCS_PER_S_FLOOR."""
    return minutes(corpus_documents(study, wildcards.corpus) / est.DOCS_PER_S_FLOOR)


def filter_mem_mb(study: Study, wildcards) -> int:
    """A filter step; dedup also holds a band column per document in memory."""
    step, _ = filter_step(wildcards)
    extra = est.DEDUP_BYTES_PER_DOC * corpus_documents(study, wildcards.corpus) if step.startswith("dedup") else 0
    return data_mem_mb(study) + mb(extra)


def glue_rows(study: Study, task: str) -> tuple[int, int]:
    """(train, validation) rows the fine-tuning of `task` reads."""
    return est.glue_rows(task, study.source, study.config[study.source])


def glue_data_runtime(study: Study, wildcards) -> int:
    return minutes(sum(glue_rows(study, wildcards.task)) / est.DOCS_PER_S_FLOOR)


def glue_data_mem_mb(study: Study, wildcards) -> int:
    return mb(2 * PYTHON_MB * 1e6)


def names(study: Study) -> dict[str, Any]:
    """The names rules/data.smk uses (and corpus_variant, data_mem_mb, data_runtime: rules/tokenizers.smk and
    rules/pretrain.smk too)."""
    return bind(
        study, glue_source_spec, corpus_spec_json, corpus_variant, filter_inputs, filter_args, filter_threads,
        data_mem_mb, data_runtime, filter_mem_mb, glue_data_runtime, glue_data_mem_mb,
    )  # fmt: skip
