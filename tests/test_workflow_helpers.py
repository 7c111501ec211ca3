"""The workflow's helpers (cramswarm.workflow) without Snakemake: the shipped config, validated as rules/common.smk
validates it, and wildcards as plain objects. What each job reads, passes and asks a cluster for."""

import io
import json
import re
import tokenize
from pathlib import Path
from types import SimpleNamespace as Wildcards

import pytest
from conftest import REPO

import cramswarm.workflow as wf
from cramswarm.config import deep_merge, load_yaml, validate_config
from cramswarm.resources import BASE_MINUTES, TORCH_MB, mb
from cramswarm.workflow import Study, rule_names
from cramswarm.workflow import study as shared

CONFIG = "config/config.yaml"


@pytest.fixture(autouse=True)
def no_gpu_driver(monkeypatch):
    """A machine without nvidia-smi or rocm-smi: device auto estimates for the CPU and holds no GPU."""
    monkeypatch.setattr(shared.shutil, "which", lambda tool: None)


def names(*overlays: dict | str, environ: dict | None = None) -> dict:
    """rule_names of the shipped config with `overlays` (dicts or config files) merged over it, validated against
    the schema with the checkout as the working directory, as rules/common.smk does."""
    config = load_yaml(REPO / CONFIG)
    for overlay in overlays:
        config = deep_merge(config, load_yaml(REPO / overlay) if isinstance(overlay, str) else overlay)
    validate_config(config, REPO / "config" / "schema.yaml", base_dir=REPO)
    files = [CONFIG, *(o for o in overlays if isinstance(o, str))]
    return rule_names(Study.from_config(config, files, cwd=REPO, environ=environ or {}))


def run(model="crammed", vocab="2048", source="synthetic", **more):
    return Wildcards(model=model, vocab=vocab, source=source, **more)


def test_every_name_the_rule_files_use_is_bound_and_every_bound_name_is_used():
    sources = [REPO / "Snakefile", *sorted((REPO / "rules").glob("*.smk"))]
    text = "\n".join(path.read_text() for path in sources)
    used = {  # upper-case names in code (not in strings or comments)
        tok.string
        for path in sources
        for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        if tok.type == tokenize.NAME and re.fullmatch(r"[A-Z][A-Z0-9_]+", tok.string)
    }
    bound = names()
    # the rule files' own, an import, the environment variable common.smk sets
    assigned = set(re.findall(r"^([A-Z][A-Z0-9_]*) =", text, re.M)) | {"TASK_NAMES", "PYTHONPATH"}
    assert used - set(bound) - assigned == set()
    assert [name for name in bound if not re.search(rf"\b{name}\b", text)] == []


def test_a_name_given_by_two_stages_is_an_error(monkeypatch):
    twice = Wildcards(__name__="twice", names=lambda study: {"SOURCE": "hub"})
    monkeypatch.setattr(wf, "STAGES", (*wf.STAGES, twice))
    with pytest.raises(ValueError, match="SOURCE: given by twice"):
        names()


def test_config_files_are_listed_once_each_relative_to_the_working_directory(tmp_path):
    config = validate_config(load_yaml(REPO / CONFIG), REPO / "config" / "schema.yaml", base_dir=REPO)
    files = [CONFIG, REPO / CONFIG, tmp_path / "site.yaml", "config/test/tiny.yaml"]
    study = Study.from_config(config, files, cwd=REPO, environ={})
    assert study.config_files == [CONFIG, (tmp_path / "site.yaml").as_posix(), "config/test/tiny.yaml"]


def test_the_study_lists_its_runs_the_sweep_and_the_models_kept_apart():
    n = names({"models": {"izsak": {"study": False}}})
    assert n["STUDY_RUNS"] == [(m, 2048) for m in ("crammed", "bert_original", "swarm", "no_pretrain")]
    assert n["APART_RUNS"] == [("izsak", 2048)]
    assert n["SWEEP_RUNS"] == [("crammed", 512), ("crammed", 1024), ("crammed", 2048), ("no_pretrain", 2048)]
    assert n["checkpoint_dir"]("swarm", 2048) == "results/swarm/synthetic/swarm/v2048"
    assert n["checkpoint_dir"]("no_pretrain", 2048) == "results/init/synthetic/no_pretrain/v2048"
    assert json.loads(n["PRETRAIN_IMPL"])["devices"] == 1 and " " not in n["PRETRAIN_IMPL"]  # one printout token
    assert "impl" not in n["COMPUTED"]["pretrain"] and "impl" not in n["COMPUTED"]["swarm"]


def test_a_filter_step_reads_the_chain_before_it_and_a_trash_step_the_corpus_tokenizer():
    n = names()
    trash = Wildcards(corpus="synthetic", filters="trash0.72")
    dedup = Wildcards(corpus="synthetic", filters="trash0.72-dedup0.8")
    assert n["filter_inputs"](trash) == {
        "corpus": "results/data/synthetic/corpus.parquet",
        "tokenizer": "results/tokenizers/synthetic/raw/wordpiece-v2048/tokenizer.json",
    }
    assert n["filter_inputs"](dedup) == {"corpus": "results/data/synthetic/trash0.72/corpus.parquet"}
    assert n["filter_args"](trash) == "--kind trash --trash-cutoff 0.72"
    assert n["filter_args"](dedup) == "--kind dedup --dedup-threshold 0.8 --shingle-words 5 --num-perm 128"
    assert (n["filter_threads"](trash), n["filter_threads"](dedup)) == (1, 4)
    assert n["filter_mem_mb"](dedup) > n["filter_mem_mb"](trash) == n["data_mem_mb"](trash)
    assert n["corpus_variant"](dedup) == "results/data/synthetic/trash0.72-dedup0.8/corpus.parquet"


def test_data_stages_memory_follows_the_cap_and_time_the_corpus_size():
    small, big = names(), names({"data": {"memory_cap_mb": 4096}, "synthetic": {"corpus_documents": 10_000_000}})
    corpus = Wildcards(corpus="synthetic", filters="raw", family="wordpiece", vocab="2048")
    cap = small["data_mem_mb"](corpus)
    assert big["data_mem_mb"](corpus) >= cap + 2 * (4096 - load_yaml(REPO / CONFIG)["data"]["memory_cap_mb"])
    assert small["tokenizer_mem_mb"](corpus) > cap  # counts words outside the cap
    assert big["data_runtime"](corpus) > small["data_runtime"](corpus) >= BASE_MINUTES
    spec = json.loads(small["corpus_spec_json"](corpus))
    assert spec["source"] == "synthetic" and "glue_train_examples" not in spec["synthetic"]
    assert set(json.loads(small["glue_source_spec"]())["synthetic"]) == {"seed", "glue_train_examples",
                                                                          "glue_validation_examples"}


def test_pretraining_time_and_priority_grow_with_the_budget():
    n, twice = names(), names({"pretrain": {"budget": {"value": 18.8}}})  # the default's 9.4 model TFLOP, doubled
    assert twice["pretrain_runtime"](run()) > n["pretrain_runtime"](run()) >= BASE_MINUTES
    assert twice["critical_path_priority"](run()) > 1.9 * n["critical_path_priority"](run()) > 0


def test_a_normalised_budget_takes_longer_on_a_slower_card():
    """The paper's A6000-day: a day and margins on the card it is written for, more on a declared V100."""
    hub = run(vocab="32768", source="hub")
    assert 24 * 60 <= names("config/paper.yaml")["pretrain_runtime"](hub) <= 28 * 60
    v100 = names("config/paper.yaml", environ={"CRAMSWARM_GPU_MODEL": "V100"})
    assert 29.7 * 60 <= v100["pretrain_runtime"](hub) <= 33 * 60


def test_pretraining_memory_grows_with_the_vocab_and_the_gpus_follow_the_site():
    n = names()
    assert n["pretrain_mem_mb"](run(vocab="32768")) > n["pretrain_mem_mb"](run(vocab="512"))
    assert (n["pretrain_gpus"](run()), n["pretrain_gpu_mem_mb"](run())) == (0, 0)  # no GPU here
    site = names({"pretrain": {"impl": {"devices": 2}}}, environ={"CRAMSWARM_GPUS_PER_PROCESS": "2"})
    assert site["pretrain_gpus"](run()) == 4  # 2 GPUs per process x 2 processes
    assert site["pretrain_gpu_mem_mb"](run()) > 0
    assert n["pretrain_mem_mb"](run()) < site["pretrain_mem_mb"](run()) < 2 * n["pretrain_mem_mb"](run())
    assert n["init_mem_mb"](run()) < n["pretrain_mem_mb"](run())


def test_a_model_taking_its_lr_from_the_sweep_reads_the_sweeps_summaries():
    n = names({"models": {"crammed": {"lr_from_sweep": True}}})
    sweep = n["lr_sweep_summaries"](run())
    assert sweep["0.002"] == "results/pretrain/synthetic/sched-triangle-lr0.002/v2048/summary.json"
    assert json.loads(n["lr_from_arg"](run()).removeprefix("--lr-from ").strip("'")) == sweep
    assert names()["lr_sweep_summaries"](run()) == {} and names()["lr_from_arg"](run()) == ""


def test_finetuning_reads_the_runs_checkpoint_and_the_warmup_tasks_data():
    n = names({"glue": {"protocols": {"crammed": {"warmup_from_task": "cola"}}}})
    assert n["checkpoint_of"](run()) == "results/pretrain/synthetic/crammed/v2048/model.safetensors"
    assert n["checkpoint_of"](run("swarm")) == "results/swarm/synthetic/swarm/v2048/model.safetensors"
    assert n["checkpoint_of"](run("no_pretrain")) == "results/init/synthetic/no_pretrain/v2048/model.safetensors"
    assert n["warmup_data"](run()) == ["results/data/synthetic/glue/cola.parquet"]
    assert n["warmup_data"](run("izsak")) == []
    assert n["warmup_arg"](run(), Wildcards(warmup_data=["cola.parquet"])) == "--warmup-data ['cola.parquet']"
    assert n["warmup_arg"](run(), Wildcards(warmup_data=[])) == ""
    assert json.loads(n["protocol_json"](run()))["warmup_from_task"] == "cola"


def test_finetuning_time_covers_the_tasks_and_seeds_a_job_runs():
    per_model, per_seed = names(), names({"glue": {"jobs": "per_seed"}})
    every_task, one_task = per_model["finetune_runtime"](run()), per_model["finetune_runtime"](run(task="sst2"))
    assert every_task > one_task > per_seed["finetune_runtime"](run(task="sst2", seed="0"))
    bigger = names({"glue": {"protocols": {"crammed": {"batch_size": 256}}}})
    assert bigger["finetune_mem_mb"](run(task="sst2")) > per_model["finetune_mem_mb"](run(task="sst2"))
    assert per_model["finetune_gpus"](run()) == 0


def test_swarm_resources_follow_the_transport_and_the_placement():
    emulation, hivemind = names(), names({"swarm": {"transport": "hivemind"}})
    swarm = run("swarm")
    assert (emulation["SWARM_THREADS"], hivemind["SWARM_THREADS"]) == (1, 2)
    # 2 stages x 2 peers: four hivemind peers, each a torch process of its own
    assert hivemind["swarm_mem_mb"](swarm) - emulation["swarm_mem_mb"](swarm) == mb(4 * TORCH_MB * 1e6)
    assert emulation["SWARM_SLURM"] == {}
    srun = names({"swarm": {"transport": "hivemind", "impl": {"placement": "srun"}}})
    assert (srun["SWARM_SLURM"], srun["SWARM_THREADS"]) == ({"tasks": 4, "mpi": "srun"}, 1)
    # twice the single-process estimate, times the job's threads; the peers' start-up on top of the time
    single = emulation["critical_path_priority"](swarm)
    assert abs(hivemind["swarm_priority"](swarm) - 4 * single) <= 4
    assert emulation["swarm_runtime"](swarm) >= BASE_MINUTES + 180 / 60 + 2 * single / 60
    assert "impl" not in json.loads(emulation["swarm_json"](swarm))


def test_only_the_compression_experiment_reads_the_study_blocks():
    n = names()
    compression, square = Wildcards(name="compression_loss"), Wildcards(name="square_cube")
    assert n["swarm_study_inputs"](compression) == {
        "tokenizer": "results/tokenizers/synthetic/raw/wordpiece-v2048/tokenizer.json",
        "blocks": "results/packed/synthetic/raw/wordpiece-v2048/random/blocks.npy",
    }
    assert n["swarm_study_inputs"](square) == {} and n["swarm_study_args"](square, None) == ""
    args = n["swarm_study_args"](compression, Wildcards(blocks="b.npy", tokenizer="t.json"))
    assert args.startswith("--blocks b.npy --tokenizer t.json --arch ")
    assert json.loads(n["swarm_study_settings"](square)) == load_yaml(REPO / CONFIG)["swarm_study"]["square_cube"]
    assert n["swarm_experiment_runtime"](compression) >= BASE_MINUTES


def test_the_report_reads_every_result_of_the_study_and_the_claims_their_experiments():
    n = names()
    results = n["finetune_results"]()
    assert len(results) == 5 * 9 * 3 and results[0] == "results/glue/synthetic/crammed/v2048/cola/s0.json"
    assert [m for m, _, _ in n["pretraining"](n["STUDY_RUNS"])] == ["crammed", "bert_original", "izsak", "swarm"]
    assert len(n["pretrain_logs"]()) == 4
    manifest = n["claims_manifest"]()
    assert manifest["roles"] == {"crammed": "crammed", "bert_original": "bert_original", "izsak": "izsak",
                                 "no_pretrain": "no_pretrain", "swarm": "swarm"}
    assert manifest["swarm_study"]["compression_loss"] == "results/swarm_study/synthetic/compression_loss.csv"
    gap = n["claim_inputs"]("C5")  # pretraining >> no pretraining: both models' fine-tuning results
    assert "results/glue/synthetic/no_pretrain/v2048/cola/s0.json" in gap
    assert "results/glue/synthetic/crammed/v2048/cola/s0.json" in gap
    assert set(gap) <= set(n["claims_inputs"]())


def test_ablation_reports_read_each_runs_chain_and_fine_tuning():
    n = names()
    reports = n["data_reports"](n["RUNS"]["data-synthetic-filtered_dedup"]["data"])
    assert list(reports) == ["corpus", "trash", "dedup", "pack", "order"]
    assert reports["dedup"].endswith("/trash0.35-dedup0.8/report.json")
    assert list(n["data_reports"](n["RUNS"]["data-synthetic-none"]["data"])) == ["corpus", "pack", "order"]
    arch = json.loads(n["run_dirs_json"]("arch"))
    assert arch["wide"] == "results/pretrain/synthetic/arch-wide/v2048"
    assert len(n["ablation_finetunes"]("arch")) == len(arch) * 2 * 3  # ablations.glue_tasks x seeds
    assert Path(n["ablation_checkpoints"]("schedule")[0]).name == "summary.json"
    assert n["preflight_mem_mb"](None) >= n["data_mem_mb"](None, factor=2)
