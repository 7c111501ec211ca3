"""What several stages of the workflow share: the validated config as a :class:`Study`, the file patterns of the
data chain and of the fine-tuning results, the run folders, the job's GPU count and the names every rule file reads.

Every function takes the study first and a job's wildcards (any object with the wildcards as attributes) after it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from cramswarm import resources as est
from cramswarm.config import data_recipe, data_wildcards, resolve_runs
from cramswarm.impl import computed

# The data chain (docs/data.md), each file keyed by exactly the settings it depends on:
# {corpus} a corpus name; {filters} raw | trash<cutoff> | dedup<threshold> | trash<cutoff>-dedup<threshold>;
# {family} the tokenizer model; {order} the block order. Runs that share these share the files.
CORPUS = "results/data/{corpus}/corpus.parquet"
FILTERED = "results/data/{corpus}/{filters}/corpus.parquet"
TOKENIZER = "results/tokenizers/{corpus}/{filters}/{family}-v{vocab}/tokenizer.json"
PACKED = "results/packed/{corpus}/{filters}/{family}-v{vocab}/packed.npy"
BLOCKS = "results/packed/{corpus}/{filters}/{family}-v{vocab}/{order}/blocks.npy"
GLUE_DATA = "results/data/{source}/glue/{task}.parquet"
FINETUNE = "results/glue/{source}/{model}/v{vocab}/{task}/s{seed}.json"


def _compact(section: dict) -> str:
    return json.dumps(section, sort_keys=True, separators=(",", ":"))  # one token in a job's printout


@dataclasses.dataclass(frozen=True, eq=False)
class Study:
    """The validated config and what the rules read of it, built once per Snakemake run (:meth:`from_config`).

    The environment is read once, there. CRAMSWARM_GPU_MODEL (profiles/slurm: CRAMSWARM_SLURM_GPU_MODEL, e.g. A100,
    V100, "H100 PCIe"): a normalised budget (reference_card, exaflop) runs value x peak(reference) / peak(this card)
    seconds, and the job asks for that; unset, the card the budget is written for (an A6000-day runs 24 h), which a
    faster card only shortens, while a slower one (V100: 29.7 h) needs the model declared or its jobs hit the time
    limit. CRAMSWARM_GPUS_PER_PROCESS (profiles/slurm: CRAMSWARM_SLURM_GPUS): a pretraining process's GPUs."""

    config: dict
    runs: dict[str, dict]  # every checkpoint the workflow can build (cramswarm.config.resolve_runs)
    config_files: list[str]  # the config files merged, in order, once each (relative to the working directory)
    gpu_peak_tflops: float | None  # CRAMSWARM_GPU_MODEL's peak TFLOP/s; None: unset
    gpus_per_process: int | None  # CRAMSWARM_GPUS_PER_PROCESS; None: unset (gpus() of pretrain.impl.device)

    @classmethod
    def from_config(
        cls, config: dict, config_files: Iterable[str | Path] = (), cwd: Path | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> Study:  # fmt: skip
        """The study of a config validated by cramswarm.config.validate_config; ``environ`` defaults to os.environ."""
        cwd, environ = (cwd or Path.cwd()).resolve(), os.environ if environ is None else environ
        files = []
        for f in config_files:
            path = Path(cwd, f).resolve()
            files.append((path.relative_to(cwd) if path.is_relative_to(cwd) else path).as_posix())
        site = environ.get("CRAMSWARM_GPUS_PER_PROCESS")
        return cls(
            config=config,
            runs=resolve_runs(config),
            config_files=list(dict.fromkeys(files)),
            gpu_peak_tflops=est.card_peak(environ.get("CRAMSWARM_GPU_MODEL")),
            gpus_per_process=int(site) if site is not None else None,
        )

    source = property(lambda self: self.config["source"])
    vocabs = property(lambda self: self.config["tokenizer"]["vocab_sizes"])
    main_vocab = property(lambda self: self.config["tokenizer"]["main_vocab_size"])
    tasks = property(lambda self: self.config["glue"]["tasks"])
    seeds = property(lambda self: self.config["glue"]["seeds"])
    glue_jobs = property(lambda self: self.config["glue"]["jobs"])  # per_seed | per_task | per_model
    models = property(lambda self: self.config["models"])
    impl = property(lambda self: self.config["pretrain"]["impl"])
    block_tokens = property(lambda self: self.config["packing"]["block_tokens"])

    @property
    def study_data(self) -> dict:
        """The data recipe of the study's models (cramswarm.config.data_recipe)."""
        return data_recipe(self.config)

    @property
    def baselines(self) -> list[str]:
        """The models without pretraining (random init)."""
        return [name for name, spec in self.models.items() if not spec["pretrain"]]

    @property
    def study_runs(self) -> list[tuple[str, int]]:
        """(model, vocab) of the study (`all`): every model at the main vocab size but those with study: false."""
        return [(name, self.main_vocab) for name, spec in self.models.items() if spec["study"]]

    @property
    def apart_runs(self) -> list[tuple[str, int]]:
        """(model, vocab) of the models kept apart (study: false; named target `apart`)."""
        return [(name, self.main_vocab) for name, spec in self.models.items() if not spec["study"]]

    @property
    def sweep_runs(self) -> list[tuple[str, int]]:
        """(model, vocab) of the vocab sweep (Figure 3): the vocab-sweep models at every size, then the baselines at
        the main size (the figure's reference line)."""
        swept = [(name, vocab) for name in self.models for vocab in self.vocabs if self.models[name]["vocab_sweep"]]
        return swept + [(name, self.main_vocab) for name in self.baselines]


def checkpoint_dir(study: Study, model: str, vocab: int | str) -> str:
    """The run's folder: results/pretrain/... (rule pretrain), results/swarm/... (swarm_pretrain) or results/init/...
    (init_model)."""
    spec = study.runs[model]
    kind = ("swarm" if spec["trainer"] == "swarm" else "pretrain") if spec["pretrain"] else "init"
    return f"results/{kind}/{study.source}/{model}/v{vocab}"


def data_files(recipe: dict, vocab: int | str) -> dict[str, str]:
    """{tokenizer, blocks} of a data recipe at one vocab size."""
    keys = {**data_wildcards(recipe), "vocab": vocab}
    return {"tokenizer": TOKENIZER.format(**keys), "blocks": BLOCKS.format(**keys)}


def run_data(study: Study, wildcards) -> dict[str, str]:
    """{tokenizer, blocks} a run's pretraining (or random init) reads."""
    return data_files(study.runs[wildcards.model]["data"], wildcards.vocab)


def arch_json(study: Study, wildcards) -> str:
    return json.dumps(study.runs[wildcards.model]["arch"], sort_keys=True)


def recipe_json(study: Study, wildcards) -> str:
    return json.dumps(study.runs[wildcards.model]["recipe"], sort_keys=True)


def runs_of(study: Study, kind: str) -> list[str]:
    """The runs of one kind (cramswarm.config.resolve_runs' `study`): models | arch | schedule | groups | data."""
    return [name for name, run in study.runs.items() if run["study"] == kind]


def gpus(device: str) -> int:
    """GPUs a job holds (the `gpu` resource): none for device cpu, one for cuda, and for auto one only where
    this machine has a GPU driver. profiles/default caps the sum at 1, so local GPU jobs run one at a time
    while CPU-only machines keep running them in parallel; profiles/slurm sets the count on a cluster."""
    if device == "auto":
        return int(any(shutil.which(tool) for tool in ("nvidia-smi", "rocm-smi")))
    return int(device == "cuda")


def device_of(device: str) -> str:
    """cpu | cuda: the device a job's time is estimated for (auto: cuda only where gpus() sees a GPU here)."""
    return "cuda" if gpus(device) else "cpu"


def training_mem_mb(arch: dict, vocab: int, sequences: int, seq_len: int, device: str, **kwargs) -> int:
    """cramswarm.resources.training_mem_mb on the device `device` (cpu | cuda | auto) resolves to."""
    return est.training_mem_mb(arch, vocab, sequences, seq_len, device_of(device), **kwargs)


def bind(study: Study, *functions: Callable) -> dict[str, Callable]:
    """{name: the function with the study bound} for the rule files (Snakemake reads the remaining parameters)."""
    return {f.__name__: functools.partial(f, study) for f in functions}


def names(study: Study) -> dict[str, Any]:
    """The shared names the rule files and the Snakefile use."""
    config = study.config
    return {
        "SOURCE": study.source,
        "VOCABS": study.vocabs,
        "TASKS": study.tasks,
        "SEEDS": study.seeds,
        "GLUE_JOBS": study.glue_jobs,
        "MODELS": study.models,
        "BASELINES": study.baselines,
        "NOT_SWEPT": [name for name, spec in study.models.items() if spec["pretrain"] and not spec["vocab_sweep"]],
        "RUNS": study.runs,
        "IMPL": study.impl,
        # How the runs execute (pretrain.impl, swarm.impl), handed to the commands as string resources (Snakemake's
        # rerun triggers read params, never resources), so changing one reruns nothing.
        "PRETRAIN_IMPL": _compact(study.impl),
        "SWARM_IMPL": _compact(config["swarm"]["impl"]),
        # the config less its impl sections: what the study computed, as its record holds it
        "COMPUTED": {**config, "pretrain": computed(config["pretrain"]), "swarm": computed(config["swarm"])},
        "STUDY_RUNS": study.study_runs,
        "APART_RUNS": study.apart_runs,
        "SWEEP_RUNS": study.sweep_runs,
        "CORPUS": CORPUS,
        "FILTERED": FILTERED,
        "TOKENIZER": TOKENIZER,
        "PACKED": PACKED,
        "BLOCKS": BLOCKS,
        "GLUE_DATA": GLUE_DATA,
        "FINETUNE": FINETUNE,
        "STUDY_DATA": study.study_data,
        "CORPORA": ["synthetic", "hub", *config["data"]["corpora"]],
        "CONFIG_FILES": study.config_files,
        "BASE_MINUTES": est.BASE_MINUTES,
        "TORCH_MB": est.TORCH_MB,
        "data_files": data_files,
        "gpus": gpus,
        **bind(study, checkpoint_dir, run_data, arch_json, recipe_json, runs_of),
    }
