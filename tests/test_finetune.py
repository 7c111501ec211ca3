"""Fine-tuning: the two protocol settings, the last-epoch result, and bad inputs caught before training."""

import json
import math
import os
import subprocess
import sys

import datasets
import pytest
import torch
from conftest import ARCH, DEFAULT, REPO

from cramswarm.config import glue_protocol, load_config, resolve_runs
from cramswarm.data import hub, sources
from cramswarm.data import tokenizer as tokenization
from cramswarm.data.synthetic import corpus_documents
from cramswarm.glue.finetune import finetune
from cramswarm.glue_tasks import TASKS
from cramswarm.pretrain import init_random
from cramswarm.provenance import settings_hash

SYNTHETIC = {"source": "synthetic", "synthetic": {"seed": 0, "glue_train_examples": 40, "glue_validation_examples": 24}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random-init tiny checkpoint with a real tokenizer (what init-model writes)."""
    root = tmp_path_factory.mktemp("ckpt")
    docs = list(corpus_documents(300, 0))
    tok = tokenization.train_wordpiece([docs], 256)
    tok.save(str(root / "tokenizer.json"))
    init_random(ARCH | {"max_positions": 64}, root / "tokenizer.json", root / "model", seed=0)
    return root / "model"


@pytest.fixture(scope="module")
def sst2(tmp_path_factory):
    path = tmp_path_factory.mktemp("glue") / "sst2.parquet"
    sources.write_glue(SYNTHETIC, "sst2", path)
    return path


def protocol(name: str, **overrides) -> dict:
    return glue_protocol(DEFAULT, name) | {"max_length_tokens": 64, "device": "cpu", "epochs": 2} | overrides


def test_default_config_has_both_paper_settings():
    cfg = load_config([REPO / "config" / "config.yaml", REPO / "config" / "paper.yaml"])
    crammed, bert = glue_protocol(cfg, "crammed"), glue_protocol(cfg, "bert_checkpoint")
    assert (crammed["batch_size"], crammed["lr"], crammed["schedule"], crammed["warmup_fraction"]) == (
        16,
        4e-5,
        "cosine",
        0.1,
    )
    assert (bert["batch_size"], bert["lr"], bert["schedule"]) == (32, 2e-5, "constant")
    assert crammed["epochs"] == bert["epochs"] == 5 and crammed["dropout"] == 0.1
    runs = resolve_runs(cfg)
    # The paper fine-tuned its random-init baseline with the BERT setting; ablation runs use the default protocol.
    assert runs["no_pretrain"]["glue"]["name"] == "bert_checkpoint"
    assert runs["crammed"]["glue"]["name"] == runs["arch-crammed"]["glue"]["name"] == "crammed"


def test_the_linear_schedule_decays_to_zero_after_its_warmup(checkpoint, sst2, tmp_path):
    """The ICML Izsak protocol (HEAD eval=GLUE: linear after a 6 % warmup, weight decay 0.1) on the same code path."""
    proto = protocol("bert_checkpoint", schedule="linear", warmup_fraction=0.25, weight_decay=0.1)
    result = finetune(
        checkpoint, "sst2", sst2, 0, proto, tmp_path / "r.json", {"model": "m", "vocab": 256}, "fp32", False
    )
    assert result["protocol"]["schedule"] == "linear" and result["steps"] == math.ceil(40 / 32) * 2
    assert result["final_lr"] == pytest.approx(0.0, abs=1e-12)


def test_the_references_warmup_from_its_first_task_is_an_option():
    """glue protocol warmup_from_task: the Cramming reference converts its warmup once, on CoLA (8,551 train rows,
    batch 16, 5 epochs: int(0.1 x 534 x 5) = 267 steps), and every later task reuses it."""
    from cramswarm.glue.finetune import warmup_steps

    paper = dict(warmup_fraction=0.1, batch_size=16, epochs=5)
    rte_steps = math.ceil(2490 / 16) * 5
    assert warmup_steps(paper, rte_steps) == int(0.1 * rte_steps) == 78  # the default: each task's own share
    quirk = paper | {"warmup_from_task": "cola", "warmup_reference_rows": 8551}
    assert warmup_steps(quirk, rte_steps) == warmup_steps(quirk, 10_000) == 267  # RTE: a third of its steps
    with pytest.raises(ValueError, match="warmup_from_task cola: the task's train rows are unknown"):
        warmup_steps(paper | {"warmup_from_task": "cola"}, rte_steps)


def test_finetune_takes_the_warmup_tasks_rows_from_its_data(checkpoint, sst2, tmp_path):
    """The command reads the warmup task's train rows (--warmup-data) and records them in each result's protocol:
    320 CoLA rows in batches of 32 over 2 epochs give 10 warmup steps at fraction 0.5, so SST-2's 4 constant-schedule
    steps end at 4/10 of the peak LR (its own share would be 2 steps, ending at the peak)."""
    cola = tmp_path / "cola.parquet"
    sources.write_glue({**SYNTHETIC, "synthetic": {**SYNTHETIC["synthetic"], "glue_train_examples": 320}}, "cola", cola)
    proto = protocol("bert_checkpoint", warmup_fraction=0.5, warmup_from_task="cola")
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "cramswarm", "finetune", "--checkpoint", str(checkpoint), "--task", "sst2",
           "--data", str(sst2), "--seed", "0", "--protocol", json.dumps(proto), "--model", "m", "--vocab", "256",
           "--precision", "fp32", "--warmup-data", str(cola), "--quiet", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    result = json.loads(out.read_text())
    assert result["protocol"]["warmup_reference_rows"] == 320 and result["steps"] == 4
    assert result["final_lr"] == pytest.approx(proto["lr"] * 4 / 10)


@pytest.mark.parametrize(
    "name,batch,final_lr",
    [("crammed", 16, 0.0), ("bert_checkpoint", 32, "peak")],
)
def test_protocol_switch_sets_batch_and_schedule(checkpoint, sst2, tmp_path, name, batch, final_lr):
    proto = protocol(name)
    result = finetune(
        checkpoint, "sst2", sst2, 0, proto, tmp_path / "r.json", {"model": "m", "vocab": 256}, "fp32", False
    )
    assert result["protocol"]["name"] == name
    assert result["steps"] == math.ceil(40 / batch) * 2  # 40 train rows, 2 epochs
    expected = proto["lr"] if final_lr == "peak" else 0.0
    assert result["final_lr"] == pytest.approx(expected, abs=1e-12)  # cosine decays to 0; constant stays at peak
    assert len(result["train_loss_per_epoch"]) == 2
    assert set(result["scores"]) == {"validation"}
    assert json.loads((tmp_path / "r.json").read_text())["scores"] == result["scores"]
    prov = result["provenance"]
    assert prov["settings_sha256"] == settings_hash(proto) and prov["seed"] == 0
    assert prov["packages"]["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert prov["hardware"]["cpu_count"] == os.cpu_count() and prov["hardware"]["gpu"] is None


def test_same_seed_same_scores(checkpoint, sst2, tmp_path):
    runs = [
        finetune(checkpoint, "sst2", sst2, 3, protocol("crammed"), tmp_path / f"{i}.json", None, "fp32", False)
        for i in range(2)
    ]
    assert runs[0]["scores"] == runs[1]["scores"]
    assert runs[0]["train_loss_per_epoch"] == runs[1]["train_loss_per_epoch"]
    assert runs[0]["provenance"]["settings_sha256"] == runs[1]["provenance"]["settings_sha256"]
    other = finetune(
        checkpoint, "sst2", sst2, 3, protocol("crammed", lr=1e-3), tmp_path / "o.json", None, "fp32", False
    )
    assert other["provenance"]["settings_sha256"] != runs[0]["provenance"]["settings_sha256"]


def test_incomplete_protocol_is_refused_before_training(checkpoint, sst2, tmp_path):
    proto = {k: v for k, v in protocol("crammed").items() if k != "lr"}
    with pytest.raises(ValueError, match="protocol lacks lr"):
        finetune(checkpoint, "sst2", sst2, 0, proto, tmp_path / "r.json", None, "fp32", False)
    assert not (tmp_path / "r.json").exists()


def test_task_outside_the_nine_is_refused(checkpoint, sst2, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cramswarm",
            "finetune",
            "--checkpoint",
            str(checkpoint),
            "--task",
            "squad",
            "--data",
            str(sst2),
            "--seed",
            "0",
            "--protocol",
            json.dumps(protocol("crammed")),
            "--model",
            "m",
            "--vocab",
            "256",
            "--out",
            str(tmp_path / "r.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "unknown GLUE task 'squad'; allowed: cola, sst2, mrpc, qqp, stsb, mnli, qnli, rte, wnli" in proc.stderr


def test_vocab_disagreeing_with_tokenizer_is_refused(checkpoint, sst2, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in checkpoint.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    tok = tokenization.train_wordpiece([list(corpus_documents(100, 1))], 128)
    tok.save(str(bad / "tokenizer.json"))
    with pytest.raises(ValueError, match="model vocab_size 256 disagrees with its tokenizer's 128 tokens"):
        finetune(bad, "sst2", sst2, 0, protocol("crammed"), tmp_path / "r.json", None, "fp32", False)


def test_unexpected_label_values_are_refused_when_the_data_is_written(tmp_path, monkeypatch):
    rows = {"train": [{"sentence": "good", "label": 1, "idx": 0}, {"sentence": "bad", "label": 2, "idx": 1}]}
    monkeypatch.setattr(sources, "glue_rows", lambda cfg, task, split: rows.get(split, rows["train"]))
    with pytest.raises(ValueError, match=r"sst2/train row idx=1 has label 2; expected integers 0\.\.1"):
        sources.write_glue(SYNTHETIC, "sst2", tmp_path / "x.parquet")
    assert not (tmp_path / "x.parquet").exists()
    rows["train"] = [{"sentence1": "a", "sentence2": "b", "label": float("nan"), "idx": 0}]
    with pytest.raises(ValueError, match="stsb/train row idx=0 has label nan; expected a finite number"):
        sources.write_glue(SYNTHETIC, "stsb", tmp_path / "y.parquet")


@pytest.mark.parametrize("task", list(TASKS))
def test_test_splits_are_never_requested(task, tmp_path, monkeypatch):
    """Writing a task's data from the hub asks datasets for train and validation splits only, by name."""
    requested = []

    def fake_load_dataset(path, name=None, split=None, **kwargs):
        requested.append(split)
        n = 4
        cols = {c: [f"text {i}" for i in range(n)] for c in TASKS[task].text_columns}
        labels = (
            [float(i) for i in range(n)]
            if TASKS[task].is_regression
            else [i % TASKS[task].num_labels for i in range(n)]
        )
        return datasets.Dataset.from_dict({**cols, "label": labels, "idx": list(range(n))})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    cfg = {"source": "hub", "hub": {"mirror": None, "glue": "nyu-mll/glue", "glue_max_train_examples": None}}
    counts = sources.write_glue(cfg, task, tmp_path / "t.parquet")
    assert requested == ["train", *TASKS[task].eval_splits]
    assert not any(s is None or "test" in s for s in requested)
    assert set(counts) == set(requested)
    with pytest.raises(ValueError, match="not read by this workflow"):
        hub.load_glue_split(task, "test")


def test_single_sentence_tasks_get_an_empty_second_segment_as_the_reference():
    from cramswarm.glue.finetune import encode

    tok = tokenization.train_wordpiece([["the cat sat on the mat", "a dog ran"] * 20], 64, min_frequency=1)
    single = encode(tok, "sst2", [{"sentence": "the cat sat"}], 32)[0]
    assert single[0] == tokenization.CLS_ID and single[-2:] == [tokenization.SEP_ID, tokenization.SEP_ID]
    assert single.count(tokenization.SEP_ID) == 2
    pair = encode(tok, "rte", [{"sentence1": "the cat", "sentence2": "a dog"}], 32)[0]
    assert pair.count(tokenization.SEP_ID) == 2 and pair[-1] == tokenization.SEP_ID


def test_seeds_in_one_process_equal_one_process_per_seed_and_are_cached(checkpoint, sst2, tmp_path, monkeypatch):
    """The default study runs a (model, task)'s seeds in one job; each result must be what a job of that seed alone
    writes (a fresh process, through the CLI), and a rerun reuses finished seeds from the cache."""
    import cramswarm.glue.finetune as ft

    p = protocol("crammed")
    alone = []
    for seed in (1, 2):
        out = tmp_path / f"alone{seed}.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "cramswarm",
                "finetune",
                "--checkpoint",
                str(checkpoint),
                "--task",
                "sst2",
                "--data",
                str(sst2),
                "--seed",
                str(seed),
                "--protocol",
                json.dumps(p),
                "--model",
                "m",
                "--vocab",
                "256",
                "--precision",
                "fp32",
                "--quiet",
                "--out",
                str(out),
            ],
            check=True,
        )
        alone.append(json.loads(out.read_text()))
    together = ft.finetune_seeds(
        checkpoint,
        "sst2",
        sst2,
        [1, 2],
        p,
        [tmp_path / "t1.json", tmp_path / "t2.json"],
        {"model": "m", "vocab": 256},
        "fp32",
        False,
        cache_dir=tmp_path / "cache",
    )
    for a, b in zip(alone, together):
        assert a["seed"] == b["seed"] and a["scores"] == b["scores"]
        assert a["train_loss_per_epoch"] == b["train_loss_per_epoch"]
    assert len(list((tmp_path / "cache").iterdir())) == 2

    calls = []
    monkeypatch.setattr(ft, "finetune", lambda *a, **k: calls.append(a) or pytest.fail("a cached seed was retrained"))
    again = ft.finetune_seeds(
        checkpoint,
        "sst2",
        sst2,
        [1, 2],
        p,
        [tmp_path / "r1.json", tmp_path / "r2.json"],
        {"model": "m", "vocab": 256},
        "fp32",
        False,
        cache_dir=tmp_path / "cache",
    )
    assert [r["scores"] for r in again] == [r["scores"] for r in together] and not calls
    assert json.loads((tmp_path / "r2.json").read_text())["scores"] == together[1]["scores"]
    # another protocol is another key: it trains
    monkeypatch.undo()
    other = ft.finetune_seeds(
        checkpoint,
        "sst2",
        sst2,
        [1],
        p | {"lr": 1e-3},
        [tmp_path / "o1.json"],
        {"model": "m", "vocab": 256},
        "fp32",
        False,
        cache_dir=tmp_path / "cache",
    )
    assert len(list((tmp_path / "cache").iterdir())) == 3 and other[0]["seed"] == 1


def _cli_finetune(checkpoint, tasks, data, seeds, p, outs, cache=None):
    cmd = [sys.executable, "-m", "cramswarm", "finetune", "--checkpoint", str(checkpoint), "--task", *tasks,
           "--data", *map(str, data), "--seed", *map(str, seeds), "--protocol", json.dumps(p), "--model", "m",
           "--vocab", "256", "--precision", "fp32", "--quiet", "--out", *map(str, outs)]  # fmt: skip
    if cache is not None:
        cmd += ["--cache-dir", str(cache)]
    return subprocess.run(cmd, capture_output=True, text=True)


def test_tasks_in_one_process_equal_one_job_per_task(checkpoint, sst2, tmp_path):
    """glue.jobs per_model runs a model's tasks and seeds in one process: the outputs are task-major (every seed of
    the first task, then the next) and each equals what a job of that task alone writes."""
    rte = tmp_path / "rte.parquet"
    sources.write_glue(SYNTHETIC, "rte", rte)
    p = protocol("crammed", epochs=1)
    together = [tmp_path / f"{t}-s{s}.json" for t in ("sst2", "rte") for s in (0, 1)]
    run = _cli_finetune(checkpoint, ["sst2", "rte"], [sst2, rte], [0, 1], p, together, cache=tmp_path / "cache")
    assert run.returncode == 0, run.stderr
    alone = [tmp_path / "rte-alone-s1.json"]
    assert _cli_finetune(checkpoint, ["rte"], [rte], [1], p, alone).returncode == 0
    results = [json.loads(path.read_text()) for path in together]
    assert [(r["task"], r["seed"]) for r in results] == [("sst2", 0), ("sst2", 1), ("rte", 0), ("rte", 1)]
    assert results[3]["scores"] == json.loads(alone[0].read_text())["scores"]
    assert results[3]["train_loss_per_epoch"] == json.loads(alone[0].read_text())["train_loss_per_epoch"]
    assert len(list((tmp_path / "cache").iterdir())) == 4  # one cache entry per (task, seed)


def test_task_seed_output_counts_must_agree(checkpoint, sst2, tmp_path):
    p = protocol("crammed", epochs=1)
    run = _cli_finetune(checkpoint, ["sst2", "rte"], [sst2], [0], p, [tmp_path / "a.json"])
    assert run.returncode != 0 and "2 --task values but 1 --data files" in run.stderr
    run = _cli_finetune(checkpoint, ["sst2"], [sst2], [0, 1], p, [tmp_path / "a.json"])
    assert run.returncode != 0 and "need 2 --out paths, got 1" in run.stderr
