"""The whole DAG through Snakemake on the tiny overlay: outputs, caching, and what a config change reruns."""

import json

import pandas as pd
import pytest
from conftest import TINY, copy_workflow, planned_jobs, snakemake

from cramswarm.report.claims import CLAIMS, NOT_RUN, VERDICTS

# What retraining every pretrained model of the tiny study reruns: the three single-process models and the swarm
# model, their fine-tuning, the tables and figures, the record
RETRAINED = {"pretrain": 3, "swarm_pretrain": 1, "finetune_model": 4, "tables": 1, "figures": 1, "study_record": 1,
             "all": 1}


def build_study(work):
    """The tiny study (`all`), then its vocab sweep (`ablation_vocab`): two runs, so the study record of the first
    sums the study's jobs only."""
    snakemake(work, "--cores", "2", *TINY)
    snakemake(work, "ablation_vocab", "--cores", "2", *TINY)
    return work


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A copy of the workflow (not of results/) run once with the tiny overlay: the study and its vocab sweep."""
    return build_study(copy_workflow(tmp_path_factory.mktemp("wf")))


def test_tiny_study_writes_tables_and_figures(workdir):
    table = pd.read_csv(workdir / "results" / "tables" / "synthetic" / "glue.csv")
    assert set(zip(table["model"], table["vocab"])) == {  # every model at the main vocab size
        ("crammed", 128),
        ("bert_original", 128),
        ("izsak", 128),
        ("swarm", 128),
        ("no_pretrain", 128),
    }
    assert (table["n_seeds"] == 2).all()
    assert table[["mnli_m", "mnli_mm", "sst2", "stsb_pearson"]].notna().all().all()
    sweep = pd.read_csv(workdir / "results" / "tables" / "synthetic" / "vocab_sweep.csv")
    assert sorted(sweep["vocab"]) == [128, 160] and set(sweep["model"]) == {"crammed"}  # ablation_vocab
    for png in ("mlm_loss_vs_tokens", "glue_by_task", "glue_vs_vocab"):
        figure = workdir / "results" / "figures" / "synthetic" / f"{png}.png"
        assert figure.read_bytes()[:4] == b"\x89PNG" and figure.with_suffix(".pdf").read_bytes()[:4] == b"%PDF"
        assert figure.with_suffix(".caption.rst").read_text().strip()
    assert (workdir / "logs" / "pretrain" / "synthetic" / "crammed" / "v128.log").is_file()
    # one benchmark file per job, mirroring its log; the study record sums them per rule
    assert (workdir / "results" / "benchmarks" / "pretrain" / "synthetic" / "crammed" / "v128.tsv").is_file()
    rules = pd.read_csv(workdir / "results" / "report" / "synthetic" / "benchmarks.csv").set_index("rule")
    assert rules.loc["finetune_model", "jobs"] == 5  # glue.jobs per_model: one job per (model, vocab) runs every task
    assert "finetune" not in rules.index  # (the tiny study has no ablation runs, which keep a job per task)
    assert rules.loc["pretrain", "jobs"] == 3  # crammed, bert_original, izsak at the main vocab (`all` alone)
    assert rules.loc["swarm_pretrain", "jobs"] == 1
    # the swarm-trained model: a crammed-layout checkpoint from 2 stages x 2 replicas, no microbatch lost
    swarm = json.loads((workdir / "results" / "swarm" / "synthetic" / "swarm" / "v128" / "summary.json").read_text())
    stats = swarm["swarm_stats"]
    assert stats["microbatches_done"] == stats["microbatches_requested"] > 0 and stats["lost_microbatches"] == 0
    assert swarm["tokens"] == 16384 and swarm["swarm"]["stages"] == 2
    software = pd.read_csv(workdir / "results" / "report" / "synthetic" / "software.csv").set_index("component")
    assert software.loc["torch", "version"].startswith("2.13.0")
    assert "main_vocab_size: 128" in (workdir / "results" / "report" / "synthetic" / "config.yaml").read_text()
    leftovers = [p for p in (workdir / "results").rglob(".*") if p.is_file()]
    assert leftovers == []  # no temporary files left behind by atomic writes
    assert [p for p in (workdir / "results" / ".state").rglob("*") if p.is_file()] == []  # resume state removed


SWARM_MODELS = {"swarm"}  # trained by concurrent peers: their accumulation order varies (docs/data.md#determinism)


def _tables_without_swarm(root):
    """Every GLUE table CSV of the study, rows of swarm-trained models dropped, as text."""
    tables = {}
    for path in sorted((root / "results" / "tables" / "synthetic").glob("*.csv")):
        df = pd.read_csv(path, dtype=str, keep_default_na=False)
        if "model" in df.columns:
            df = df[~df["model"].isin(SWARM_MODELS)]
        tables[path.name] = df.to_csv(index=False)
    return tables


@pytest.mark.e2e
def test_a_second_run_from_scratch_writes_the_same_bytes(workdir, tmp_path):
    """Tokenizers, blocks, single-process checkpoints and GLUE tables are bit-reproducible on a CPU."""
    again = build_study(copy_workflow(tmp_path))
    patterns = ("results/tokenizers/**/tokenizer.json", "results/packed/**/*.npy", "results/pretrain/**/*.safetensors")
    for pattern in patterns:
        files = sorted(p.relative_to(workdir) for p in workdir.glob(pattern))
        assert files and files == sorted(p.relative_to(again) for p in again.glob(pattern)), pattern
        for rel in files:
            if rel.parts[1] == "pretrain" and rel.parts[3] in SWARM_MODELS:
                continue
            assert (workdir / rel).read_bytes() == (again / rel).read_bytes(), rel
    first, second = _tables_without_swarm(workdir), _tables_without_swarm(again)
    assert first and first == second
    # the swarm row is the one that may differ: how much is printed (docs/data.md states a measured value)
    rows = [pd.read_csv(root / "results" / "tables" / "synthetic" / "glue.csv").set_index("model").loc["swarm"]
            for root in (workdir, again)]
    numeric = [c for c in rows[0].index if pd.api.types.is_number(rows[0][c]) and c != "vocab"]
    print("swarm row, largest difference between two runs:", max(abs(rows[0][c] - rows[1][c]) for c in numeric))


def test_report_builds_with_every_table_figure_and_the_study_record(workdir):
    snakemake(workdir, "all", "ablation_vocab", "--report", "results/report.html", *TINY)
    html = (workdir / "results" / "report.html").read_text()
    for name in (
        "glue.csv",
        "glue_paper.csv",
        "vocab_sweep.csv",
        "mlm_loss_vs_tokens.png",
        "glue_by_task.png",
        "glue_vs_vocab.png",
        "config.yaml",
        "software.csv",
        "benchmarks.csv",
        "rule_times.png",
    ):
        assert name in html, name
    assert "Study record" in html and "Cramming" in html  # report categories
    # the front page (rules/workflow.rst), rendered with this run's config
    assert "Geiping &amp; Goldstein 2022" in html and "vocab sizes 128, 160" in html


def test_finished_run_reruns_nothing(workdir):
    assert planned_jobs(workdir, *TINY) == {}


def test_changing_one_vocab_size_reruns_only_its_dependents(workdir):
    overlay = workdir / "config" / "test" / "vocab.yaml"
    overlay.write_text("tokenizer:\n  vocab_sizes: [128, 192]\n")
    jobs = planned_jobs(workdir, "ablation_vocab", *TINY, str(overlay.relative_to(workdir)))
    assert jobs == {
        "train_tokenizer": 1,  # v192 only
        "pack_corpus": 1,
        "order_blocks": 1,
        "pretrain": 1,
        "finetune_model": 1,  # crammed v192 (one job runs every task and seed); nothing for v128 or no_pretrain
        "vocab_sweep": 1,
        "ablation_vocab": 1,
    }
    # the study itself is at the main vocab size: only its record, which holds the config, is rewritten
    assert planned_jobs(workdir, *TINY, str(overlay.relative_to(workdir))) == {"study_record": 1, "all": 1}


def test_changing_a_finetuning_value_reruns_finetuning_only(workdir):
    overlay = workdir / "config" / "test" / "lr.yaml"
    overlay.write_text("glue:\n  protocols:\n    crammed:\n      lr: 1.0e-4\n")
    jobs = planned_jobs(workdir, *TINY, str(overlay.relative_to(workdir)))
    # 4 models, one job each for its 3 tasks: all but izsak, which the reference tunes with the BERT protocol
    assert jobs == {"finetune_model": 4, "tables": 1, "figures": 1, "study_record": 1, "all": 1}


def test_the_references_warmup_quirk_adds_its_tasks_data_and_reruns_finetuning_only(workdir):
    overlay = workdir / "config" / "test" / "warmup.yaml"
    overlay.write_text("glue:\n  protocols:\n    crammed:\n      warmup_from_task: cola\n")
    jobs = planned_jobs(workdir, *TINY, str(overlay.relative_to(workdir)))
    # CoLA's data (not one of the tiny study's tasks) sets the warmup of the 4 models on the crammed protocol
    assert jobs == {"glue_data": 1, "finetune_model": 4, "tables": 1, "figures": 1, "study_record": 1, "all": 1}


def test_a_model_kept_apart_leaves_the_study_for_its_own_target(workdir):
    overlay = workdir / "config" / "test" / "apart.yaml"
    overlay.write_text("models:\n  swarm:\n    study: false\n")
    args = (*TINY, str(overlay.relative_to(workdir)))
    # the study's table and figures are made again without it; nothing is trained again
    assert planned_jobs(workdir, *args) == {"tables": 1, "figures": 1, "study_record": 1, "all": 1}
    # its own target: its run and fine-tuning are there already, so only its own table
    assert planned_jobs(workdir, "apart", *args) == {"tables_apart": 1, "apart": 1}
    tables = [workdir / "results" / "tables" / "synthetic" / f"glue_apart{end}"
              for end in (".csv", ".md", "_paper.csv", "_paper.md", "_paper.tex")]
    try:
        snakemake(workdir, "--cores", "1", "apart", *args)
        apart = pd.read_csv(tables[0])
        assert apart["model"].tolist() == ["swarm"] and apart["pretrain_tokens"].notna().all()
    finally:   # the module's shared study as it was: a repeat (pytest --count) plans the same jobs
        for table in tables:
            table.unlink(missing_ok=True)


def test_switching_one_models_protocol_reruns_its_finetuning_only(workdir):
    overlay = workdir / "config" / "test" / "protocol.yaml"
    overlay.write_text("models:\n  no_pretrain:\n    glue_protocol: bert_checkpoint\n")
    jobs = planned_jobs(workdir, *TINY, str(overlay.relative_to(workdir)))
    assert jobs == {"finetune_model": 1, "tables": 1, "figures": 1, "study_record": 1, "all": 1}


def test_changing_the_glue_data_size_keeps_the_corpus_and_checkpoints(workdir):
    overlay = workdir / "config" / "test" / "rows.yaml"
    overlay.write_text("synthetic:\n  glue_train_examples: 48\n")
    jobs = planned_jobs(workdir, *TINY, str(overlay.relative_to(workdir)))
    assert jobs == {"glue_data": 3, "finetune_model": 5, "tables": 1, "figures": 1, "study_record": 1, "all": 1}


def test_named_targets_resolve(workdir):
    for target in ("tokenizers", "pretrain_all", "glue", "ablation_vocab"):
        # already built by the full run (target first: --configfile takes every following word)
        assert planned_jobs(workdir, target, *TINY) == {}


@pytest.mark.e2e
def test_ablation_targets_build_tables_and_figures(workdir):
    jobs = planned_jobs(workdir, "ablation_arch", "ablation_schedule", "ablation_groups", *TINY)
    # tiny overlay: arch = base + depth2 + bert_original; schedule = 2 x 2; groups = 4 rows; no study run is reused
    assert jobs["pretrain"] == 3 + 4 + 4
    assert jobs["finetune"] == (3 + 4) * 1  # ablations.glue_tasks [sst2], one job for glue.seeds [0, 1]
    snakemake(workdir, "--cores", "2", "ablation_arch", "ablation_schedule", "ablation_groups", *TINY)
    out = workdir / "results" / "ablations" / "synthetic"
    arch = pd.read_csv(out / "arch.csv")
    assert set(arch["label"]) == {"crammed", "depth2", "bert_original"}
    assert (arch["tokens"] == 8192).all() and arch["eval_loss"].notna().all()
    assert arch.set_index("label").loc["depth2", "layers"] == 2
    schedule = pd.read_csv(out / "schedule.csv")
    assert set(zip(schedule["schedule"], schedule["lr"])) == {
        (s, lr) for s in ("triangle", "constant") for lr in (1e-3, 4e-3)
    }
    groups = pd.read_csv(out / "groups.csv")
    assert list(groups["run"]) == [
        "groups-final",
        "groups-original_arch",
        "groups-original_training",
        "groups-original_both",
    ]
    for png in ("figure1_loss_vs_tokens", "figure2_schedules"):
        assert (out / f"{png}.png").read_bytes()[:4] == b"\x89PNG"
    summary = (
        workdir / "results" / "pretrain" / "synthetic" / "arch-bert_original" / "v128" / "summary.json"
    ).read_text()
    assert '"mask_rate": 0.15' in summary and '"norm_scheme": "post"' in summary


def test_settings_that_change_no_file_rerun_nothing(workdir):
    # the memory cap bounds memory only; the study's filters are off, so their settings are in no file's key
    overlay = workdir / "config" / "test" / "cap.yaml"
    overlay.write_text("data:\n  memory_cap_mb: 128\n  trash_cutoff: 0.5\n  dedup_threshold: 0.7\n")
    # only the study record, which holds the config as run, is rewritten
    assert planned_jobs(workdir, *TINY, str(overlay.relative_to(workdir))) == {"study_record": 1, "all": 1}


def test_changing_how_runs_execute_reruns_nothing(workdir):
    # every key of both impl sections changed (cramswarm.impl): none reaches a rule's params, so nothing reruns
    overlay = workdir / "config" / "test" / "impl.yaml"
    overlay.write_text(
        "pretrain:\n  impl:\n    compile: true\n    compile_mode: max-autotune\n    device: cpu\n"
        "    attention_backend: math\n    prefetch: false\n    devices: 2\n    log_every_steps: 3\n"
        "    resume_every_seconds: 30\n    resume_every_steps: 4\n"
        "swarm:\n  impl:\n    placement: local\n    host: 127.0.0.2\n    interface: lo\n    srun_args: [--exclusive]\n"
        "    startup_timeout_s: 60.0\n    checkpoint_every_s: 5.0\n    give_up_after_s: 600.0\n"
        "    launcher_grace_s: 90.0\n"
    )
    assert planned_jobs(workdir, *TINY, str(overlay.relative_to(workdir))) == {}


def test_changing_what_a_run_computes_reruns_exactly_its_dependents(workdir):
    overlay = workdir / "config" / "test" / "train.yaml"
    overlay.write_text("pretrain:\n  weight_decay: 0.02\n")  # no model overrides it
    jobs = planned_jobs(workdir, *TINY, str(overlay.relative_to(workdir)))
    # not the data chain, the random-init baseline or its fine-tuning
    assert jobs == RETRAINED


def test_changing_the_block_order_reorders_and_retrains_only(workdir):
    overlay = workdir / "config" / "test" / "order.yaml"
    overlay.write_text("data:\n  order: sentence-length\n")
    jobs = planned_jobs(workdir, *TINY, str(overlay.relative_to(workdir)))
    # one order job (the main vocab), then what any retraining reruns; no corpus, tokenizer, packing or init job
    assert jobs == {"order_blocks": 1, **RETRAINED}


def test_ablation_data_reuses_files_shared_with_the_study_and_between_cells(workdir):
    jobs = planned_jobs(workdir, "ablation_data", *TINY)
    # sources synthetic + noisy x cells none / filtered / filtered_sorted / filtered_dedup (tiny overlay)
    assert jobs == {
        "corpus": 1,  # noisy; the study's synthetic corpus is reused
        "filter_corpus": 2 * 2,  # trash, then dedup of the trash-filtered corpus, per source
        "train_tokenizer": 5,  # raw, trash, trash-dedup per source, less the study's synthetic raw one
        "pack_corpus": 5,  # one per tokenizer: filtered and filtered_sorted share theirs
        "order_blocks": 7,  # one per (packed file, order), less the study's synthetic raw / random
        "pretrain": 8,
        "finetune": 8 * 1,  # ablations.glue_tasks [sst2], one job for glue.seeds [0, 1]
        "ablation_data_report": 1,
        "ablation_data": 1,
    }


@pytest.mark.e2e
def test_ablation_data_writes_table2_with_stage_counts(workdir):
    overlay = workdir / "config" / "test" / "table2.yaml"
    overlay.write_text(
        "ablations:\n  data:\n    sources: [noisy]\n    cells:\n"
        "      - {name: none, trash_filter: false, dedup: false, order: random}\n"
        "      - {name: filtered_sorted, trash_filter: true, dedup: false, order: sentence-length}\n"
        "      - {name: filtered_dedup, trash_filter: true, dedup: true, order: random}\n"
    )
    snakemake(workdir, "--cores", "2", "ablation_data", *TINY, str(overlay.relative_to(workdir)))
    out = workdir / "results" / "ablations" / "synthetic"
    table = pd.read_csv(out / "data.csv").set_index("cell")
    assert list(table.index) == ["none", "filtered_sorted", "filtered_dedup"]  # config order
    assert (table["documents_raw"] == 1500).all() and (table["pretrain_tokens"] == 8192).all()
    raw, trash, dedup = table.loc["filtered_dedup", ["documents_raw", "documents_after_trash", "documents_after_dedup"]]
    assert 1500 * 0.1 < raw - trash < 1500 * 0.2  # ~15 % trash documents in the noisy corpus
    assert table.loc["filtered_dedup", "trash_removed_share"] == pytest.approx((raw - trash) / raw)
    assert pd.isna(table.loc["none", "trash_removed_share"])  # no trash filter in this cell
    assert "Trash removed (% docs)" in (out / "data.md").read_text()
    assert 1500 * 0.05 < trash - dedup < 1500 * 0.1  # ~10 % duplicates, near-copies partly kept
    assert table.loc["none", "blocks"] > table.loc["filtered_sorted", "blocks"] > table.loc["filtered_dedup", "blocks"]
    assert table["sst2"].notna().all() and (table["n_seeds"] == 2).all()
    table2 = pd.read_csv(out / "data_table2.csv")
    assert (
        list(table2.columns) == ["source", "none", "filtered_sorted", "filtered_dedup"]
        and table2["source"][0] == "noisy"
    )
    paper = table2.set_index("source").loc[
        "paper (ICML, [third-party]): bookcorpus-wikipedia"
    ]  # published rows below ours
    assert (paper["none"], paper["filtered_sorted"]) == (78.1, 78.8) and pd.isna(paper["filtered_dedup"])
    assert len(table2) == 1 + 5
    reports = workdir / "results" / "data" / "noisy"
    trash_report = json.loads((reports / "trash0.72" / "report.json").read_text())
    # its own tokenizer
    assert trash_report["tokenizer"] == "results/tokenizers/noisy/raw/wordpiece-v128/tokenizer.json"
    assert "GLUE scores" in (out / "data_table2.md").read_text()


@pytest.mark.e2e
def test_swarm_study_builds_every_experiment_table_and_figure(workdir):
    jobs = planned_jobs(workdir, "swarm_study", *TINY)
    assert jobs == {"swarm_experiment": 6, "swarm_report": 1, "swarm_study": 1}  # the study's blocks are reused
    snakemake(workdir, "--cores", "2", "swarm_study", *TINY)
    out = workdir / "results" / "swarm_study" / "synthetic"
    compression = pd.read_csv(out / "compression_loss.csv")
    assert set(compression["config"]) == {"none", "blockwise8", "maxout2"} and compression["step"].max() == 20
    assert sorted(pd.read_csv(out / "square_cube.csv")["hidden_size"].unique()) == [64, 128]
    for name in (
        "square_cube",
        "wiring_throughput",
        "failures_timeline",
        "rebalancing_recovery",
        "compression_loss",
        "sim_scale",
    ):
        figure = out / "report" / f"{name}.png"
        assert figure.read_bytes()[:4] == b"\x89PNG" and figure.with_suffix(".caption.rst").read_text().strip()
        assert (out / "report" / f"{name}_table.csv").is_file()
    snakemake(workdir, "--report", "results/swarm.html", "swarm_study", *TINY)
    html = (workdir / "results" / "swarm.html").read_text()
    assert "SWARM" in html and "rebalancing_recovery.png" in html


@pytest.mark.e2e
def test_claims_target_writes_a_verdict_per_claim_from_the_files(workdir):
    # after the study, the ablations and the swarm study above, the claims need no experiment of their own beyond
    # the Table 2 cells that the data ablation test above left out (it ran 3 cells of one source)
    planned = planned_jobs(workdir, "claims", *TINY)
    data_cells = {"filter_corpus", "train_tokenizer", "pack_corpus", "order_blocks", "pretrain", "finetune"}
    assert planned.keys() - data_cells == {"claims_table", "claims"}, planned
    snakemake(workdir, "--cores", "2", "claims", *TINY)
    out = workdir / "results" / "claims" / "synthetic"
    table = pd.read_csv(out / "claims.csv", dtype=str, keep_default_na=False).set_index("id")
    assert list(table.index) == [claim.id for claim in CLAIMS]
    assert set(table["verdict"]) <= set(VERDICTS) - {NOT_RUN}  # every file a claim reads was built
    assert (table["measurement"].str.len() > 0).all() and (table["setup"].str.len() > 0).all()
    assert (workdir / "results" / "readme" / "claims_synthetic.csv").read_bytes() == (out / "claims.csv").read_bytes()
    # the verdicts follow the files: without the wiring experiment's CSV, its claim says not run
    wiring = workdir / "results" / "swarm_study" / "synthetic" / "wiring_throughput.csv"
    kept = wiring.read_bytes()
    wiring.unlink()
    try:
        snakemake(workdir, "--cores", "1", "claims_available", *TINY)
    finally:
        wiring.write_bytes(kept)
    available = pd.read_csv(out / "claims.csv", dtype=str, keep_default_na=False).set_index("id")
    assert available.loc["S3", "verdict"] == NOT_RUN
    assert available.drop(index="S3")["verdict"].equals(table.drop(index="S3")["verdict"])


def test_packed_files_are_deleted_once_ordered_when_not_kept(tmp_path):
    """data.keep_packed false: the packed file (the blocks before ordering) is a temp() output, gone once its order
    is written; the ordered blocks and the packing report stay."""
    work = copy_workflow(tmp_path)
    overlay = work / "config" / "test" / "drop_packed.yaml"
    overlay.write_text("data:\n  keep_packed: false\n")
    packed = work / "results" / "packed" / "synthetic" / "raw" / "wordpiece-v128"
    snakemake(work, "--cores", "2", str((packed / "random" / "blocks.npy").relative_to(work)), *TINY,
              str(overlay.relative_to(work)))
    assert (packed / "random" / "blocks.npy").is_file() and (packed / "packed.report.json").is_file()
    assert not (packed / "packed.npy").exists()
