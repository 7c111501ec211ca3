"""Tokenizer, packing and the real (hub) loaders, the latter on the offline mirror in ../shared/data/hub."""

import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import mirror_corpus, requires_mirror

from cramswarm.data import hub, packing, sources
from cramswarm.data import tokenizer as tokenization
from cramswarm.glue_tasks import TASKS

DOCS = [
    f"the {a} saw a {b} near the river . it was {c} ."
    for a in ("dog", "cat", "fox")
    for b in ("bird", "horse")
    for c in ("late", "early", "cold", "warm")
] * 5


def write_corpus(path, docs=DOCS):
    sources.write_corpus(docs, path)
    return path


def test_special_token_ids_are_fixed_across_corpora():
    for docs in (DOCS, list(reversed(DOCS)), ["zebra apple"] * 50):
        tok = tokenization.train_wordpiece([docs], 80, min_frequency=1)
        assert [tok.token_to_id(t) for t in tokenization.SPECIAL_TOKENS] == [0, 1, 2, 3, 4]


def test_pair_encoding_has_cls_and_seps_and_no_type_ids(tmp_path):
    tok = tokenization.train_wordpiece([DOCS], 80, min_frequency=1)
    enc = tok.encode("the dog", "a cat")
    assert enc.ids[0] == tokenization.CLS_ID and enc.ids.count(tokenization.SEP_ID) == 2
    wrapped = tokenization.to_transformers(tok, 128)
    assert set(wrapped("the dog", "a cat")) == {"input_ids", "attention_mask"}


def test_packing_is_deterministic_and_separates_documents(tmp_path):
    corpus = write_corpus(tmp_path / "c.parquet")
    tok = tokenization.train_wordpiece(tokenization.iter_corpus_batches(corpus), 80, min_frequency=1)
    a = packing.pack(corpus, tok, tmp_path / "a.npy", 16, shuffle_seed=3)
    packing.pack(corpus, tok, tmp_path / "b.npy", 16, shuffle_seed=3)
    packing.pack(corpus, tok, tmp_path / "c.npy", 16, shuffle_seed=4)
    blocks = np.load(tmp_path / "a.npy")
    assert np.array_equal(blocks, np.load(tmp_path / "b.npy"))
    assert not np.array_equal(blocks, np.load(tmp_path / "c.npy"))
    assert blocks.shape == (a["blocks"], 16) and blocks.dtype == np.uint16
    assert a["tokens"] == a["blocks"] * 16 + a["tokens_dropped_in_tail"]
    assert (blocks == tokenization.SEP_ID).sum() >= len(DOCS) - 1  # one [SEP] ends each document
    assert not (blocks == tokenization.CLS_ID).any()


def test_corpus_too_small_for_one_block_is_an_error(tmp_path):
    corpus = write_corpus(tmp_path / "c.parquet", ["a b c"])
    tok = tokenization.train_wordpiece([["a b c"] * 3], 70, min_frequency=1)
    with pytest.raises(ValueError, match="fewer than one block"):
        packing.pack(corpus, tok, tmp_path / "x.npy", 128, 0)
    assert not (tmp_path / "x.npy").exists()  # nothing half-written


def test_empty_corpus_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="corpus is empty"):
        sources.write_corpus(["", "   "], tmp_path / "c.parquet")
    assert list(tmp_path.iterdir()) == []


def test_missing_and_corrupt_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing corpus file"):
        next(tokenization.iter_corpus_batches(tmp_path / "nope.parquet"))
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match=f"corrupt corpus file {bad}"):
        next(tokenization.iter_corpus_batches(bad))
    (tmp_path / "tok.json").write_text("{")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cramswarm",
            "pack",
            "--corpus",
            str(bad),
            "--tokenizer",
            str(tmp_path / "tok.json"),
            "--out",
            str(tmp_path / "o.npy"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "corrupt tokenizer file" in proc.stderr


def test_bad_glue_labels_are_rejected():
    rows = [{"sentence": "fine", "label": 0, "idx": 0}, {"sentence": "odd", "label": 7, "idx": 1}]
    with pytest.raises(ValueError, match=r"sst2/train row idx=1 has label 7"):
        sources.check_rows("sst2", "train", rows)
    with pytest.raises(ValueError, match="lacks columns"):
        sources.check_rows("mrpc", "train", rows)


def test_test_splits_are_refused():
    with pytest.raises(ValueError, match="not read by this workflow"):
        hub.load_glue_split("cola", "test")


def test_missing_mirror_entry_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no folder for 'nyu-mll/glue'"):
        hub.resolve("nyu-mll/glue", tmp_path)


@requires_mirror
@pytest.mark.parametrize("task", list(TASKS))
def test_real_glue_from_the_mirror(task, mirror, tmp_path):
    cfg = {"source": "hub", "hub": {"mirror": str(mirror), "glue": "nyu-mll/glue", "glue_max_train_examples": 300}}
    counts = sources.write_glue(cfg, task, tmp_path / f"{task}.parquet")
    assert set(counts) == {"train", *TASKS[task].eval_splits}
    assert counts["train"] == 300 and all(n > 0 for n in counts.values())
    table = pq.read_table(tmp_path / f"{task}.parquet").to_pylist()
    assert {row["split"] for row in table} == set(counts)  # never a test split
    assert set(TASKS[task].text_columns) <= set(table[0])
    if not TASKS[task].is_regression:
        assert {row["label"] for row in table} <= set(range(TASKS[task].num_labels))


@requires_mirror
def test_real_corpora_from_the_mirror(mirror, tmp_path):
    spec = mirror_corpus(20, 2)
    counts = sources.write_corpus(hub.iter_corpus(spec, mirror), tmp_path / "c.parquet")
    assert counts["documents"] == 22 and counts["characters"] > 100_000
    tok = tokenization.train_wordpiece(tokenization.iter_corpus_batches(tmp_path / "c.parquet"), 1024)
    assert tok.get_vocab_size() == 1024
    assert "the" in tok.get_vocab()
