"""The data stages of Cramming §3.2: filters, tokenizer families, streaming packing, block orders, bad input."""

import itertools
import json
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import mirror_corpus, requires_mirror

from cramswarm.data import filters, hub, ordering, packing, sources
from cramswarm.data import tokenizer as tokenization
from cramswarm.data.stream import iter_documents, split_long
from cramswarm.data.synthetic import corpus_documents
from cramswarm.data.synthetic.noise import BOILERPLATE, trash_document, with_noise

CLEAN = list(corpus_documents(400, 0))


def texts(path):
    return pq.read_table(path).column("text").to_pylist()


def corpus(tmp_path, docs, name="c.parquet"):
    sources.write_corpus(docs, tmp_path / name)
    return tmp_path / name


@pytest.fixture(scope="module")
def tok():
    return tokenization.train([CLEAN], 512)


# ----------------------------------------------------------------------------------------------- filters


def test_trash_filter_removes_exactly_the_trash(tmp_path, tok):
    import random

    rng = random.Random(3)
    trash = [trash_document(rng) for _ in range(30)]
    docs = CLEAN[:100] + trash
    ratio = lambda d: len(tok.encode(d, add_special_tokens=False).ids) / len(d)  # noqa: E731
    worst_clean, best_trash = max(map(ratio, CLEAN[:100])), min(map(ratio, trash))
    assert worst_clean < best_trash  # trash is cut into many more tokens per character
    cutoff = (worst_clean + best_trash) / 2
    report = filters.trash_filter(corpus(tmp_path, docs), tok, tmp_path / "out.parquet", cutoff=cutoff)
    assert texts(tmp_path / "out.parquet") == CLEAN[:100]  # order kept, every trash document gone
    assert (report["documents_in"], report["documents_out"], report["documents_removed"]) == (130, 100, 30)
    assert report["documents_removed_share"] == pytest.approx(30 / 130)
    removed_chars = sum(map(len, trash)) / sum(map(len, docs))
    assert report["characters_removed_share"] == pytest.approx(removed_chars)
    assert report["tokens_per_char_kept"]["max"] == pytest.approx(worst_clean, abs=1e-4)
    assert report["tokens_per_char_removed"]["min"] == pytest.approx(best_trash, abs=1e-4)
    assert report["characters_out"] == sum(map(len, CLEAN[:100]))


def test_trash_cutoff_is_strict_token_count_below_cutoff_times_characters(tmp_path, tok):
    doc = CLEAN[0]
    n_tokens = len(tok.encode(doc, add_special_tokens=False).ids)
    exact = n_tokens / len(doc)
    path = corpus(tmp_path, [doc, CLEAN[1]])
    kept = filters.trash_filter(path, tok, tmp_path / "a.parquet", cutoff=exact + 1e-9)
    assert kept["documents_out"] == 2 and texts(tmp_path / "a.parquet")[0] == doc
    with pytest.raises(ValueError, match="removed all"):  # equal counts as trash (#tokens < cutoff x #chars keeps)
        filters.trash_filter(corpus(tmp_path, [doc], "one.parquet"), tok, tmp_path / "b.parquet", cutoff=exact)


def test_a_filter_that_removes_everything_is_an_error_and_writes_nothing(tmp_path, tok):
    path = corpus(tmp_path, CLEAN[:20])
    with pytest.raises(
        ValueError, match=r"trash filter removed all 20 documents \(cutoff 0.01 .*lowest ratio is 0\.\d+"
    ):
        filters.trash_filter(path, tok, tmp_path / "out.parquet", cutoff=0.01)
    assert not (tmp_path / "out.parquet").exists()


def test_dedup_drops_copies_and_near_copies_and_keeps_the_first(tmp_path):
    a, b, c = (" ".join(CLEAN[i : i + 3]) for i in (0, 3, 6))  # long enough that one appended phrase is a near-copy
    docs = [a, b, a, f"{a} read more .", BOILERPLATE[0], c, BOILERPLATE[0], "short one", "short one", "short two"]
    report = filters.dedup(corpus(tmp_path, docs), tmp_path / "out.parquet", threshold=0.8)
    assert texts(tmp_path / "out.parquet") == [a, b, BOILERPLATE[0], c, "short one", "short two"]
    assert (report["documents_in"], report["documents_out"], report["documents_removed"]) == (10, 6, 4)
    assert report["documents_removed_share"] == pytest.approx(0.4)
    assert report["lsh_bands"] * report["lsh_rows"] <= report["num_perm"]


def test_dedup_in_worker_processes_keeps_the_same_documents(tmp_path):
    """Pass 1 in 2 processes over small batches (a tiny memory cap: many batches, out of order in flight) drops
    exactly what one process drops."""
    docs = [*CLEAN[:40], *CLEAN[:5], *BOILERPLATE[:3], *BOILERPLATE[:3]]
    path = corpus(tmp_path, docs)
    one = filters.dedup(path, tmp_path / "one.parquet", threshold=0.8)
    two = filters.dedup(path, tmp_path / "two.parquet", threshold=0.8, workers=2, memory_cap_mb=0.001)
    assert texts(tmp_path / "two.parquet") == texts(tmp_path / "one.parquet") == [*CLEAN[:40], *BOILERPLATE[:3]]
    assert two["documents_removed"] == one["documents_removed"] == 8


def test_dedup_keeps_documents_that_only_share_a_few_sentences(tmp_path):
    docs = CLEAN[:50]
    report = filters.dedup(corpus(tmp_path, docs), tmp_path / "out.parquet", threshold=0.8)
    assert report["documents_removed"] == 0 and texts(tmp_path / "out.parquet") == docs


def test_noisy_synthetic_corpus_is_deterministic_and_has_the_configured_shares():
    a = list(with_noise(corpus_documents(2000, 0), 0.15, 0.1, 0))
    assert a == list(with_noise(corpus_documents(2000, 0), 0.15, 0.1, 0)) and len(a) == 2000
    clean = set(corpus_documents(2000, 0))
    noise = [d for d in a if d not in clean]
    assert 0.18 < len(noise) / len(a) < 0.32  # trash plus the near-copies (exact copies look clean)
    assert len(a) - len(set(a)) > 50  # exact duplicates and repeated boilerplate


# ----------------------------------------------------------------------------------------------- tokenizers


@pytest.mark.parametrize("family", tokenization.FAMILIES)
def test_special_token_ids_are_fixed_in_every_family_across_rebuilds(family):
    for docs in (CLEAN[:200], CLEAN[:200][::-1], CLEAN[200:], ["zebra apple . mango"] * 40 + CLEAN[:50]):
        tok = tokenization.train([docs], 300, family, min_frequency=1)
        assert [tok.token_to_id(t) for t in tokenization.SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
        assert (
            tok.encode("the dog .").ids[0] == tokenization.CLS_ID
            and tok.encode("the dog .").ids[-1] == tokenization.SEP_ID
        )
        assert tok.token_to_id(".") is not None


def test_whitespace_cut_pieces_encode_like_the_whole_document(tok):
    doc = " ".join(CLEAN[:40])
    pieces = split_long(doc, 500)
    assert len(pieces) > 10 and "".join(pieces) == doc
    whole = tok.encode(doc, add_special_tokens=False).ids
    assert [i for p in pieces for i in tok.encode(p, add_special_tokens=False).ids] == whole


def test_a_vocab_larger_than_the_corpus_can_fill_is_a_clear_error(tmp_path):
    path = corpus(tmp_path, ["a tiny corpus . with few words ."] * 10)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cramswarm",
            "tokenizer",
            "--corpus",
            str(path),
            "--vocab-size",
            "4096",
            "--out",
            str(tmp_path / "tok.json"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "filled only" in proc.stderr and "of 4096 wordpiece vocab entries" in proc.stderr
    assert not (tmp_path / "tok.json").exists()


# ----------------------------------------------------------------------------------------------- packing


def test_packing_is_deterministic_and_independent_of_the_memory_cap(tmp_path, tok):
    long_doc = " ".join(CLEAN[:300])  # longer than a batch at the small cap: encoded in pieces
    path = corpus(tmp_path, CLEAN + [long_doc])
    small = packing.pack(path, tok, tmp_path / "small.npy", 128, shuffle_seed=1, memory_cap_mb=0.5)
    packing.pack(path, tok, tmp_path / "big.npy", 128, shuffle_seed=1, memory_cap_mb=512)
    packing.pack(path, tok, tmp_path / "again.npy", 128, shuffle_seed=1, memory_cap_mb=0.5)
    assert (
        (tmp_path / "small.npy").read_bytes()
        == (tmp_path / "big.npy").read_bytes()
        == (tmp_path / "again.npy").read_bytes()
    )
    blocks = np.load(tmp_path / "small.npy", mmap_mode="r")
    assert isinstance(blocks, np.memmap) and blocks.shape == (small["blocks"], 128)
    ids = [
        i for d in tok.encode_batch(CLEAN + [long_doc], add_special_tokens=False) for i in d.ids + [tokenization.SEP_ID]
    ]
    assert small["tokens"] == len(ids) == small["blocks"] * 128 + small["tokens_dropped_in_tail"]
    assert (blocks == tokenization.SEP_ID).sum() >= len(CLEAN) + 1 - small["tokens_dropped_in_tail"]
    assert small["documents_shorter_than_block"] == sum(
        len(tok.encode(d, add_special_tokens=False).ids) + 1 < 128 for d in CLEAN
    )


def test_documents_shorter_than_a_block_are_packed_together_and_counted(tmp_path, tok):
    docs = ["the dog slept ."] * 100
    report = packing.pack(corpus(tmp_path, docs), tok, tmp_path / "b.npy", 32, shuffle_seed=0)
    assert report["documents"] == 100 and report["documents_shorter_than_block"] == 100
    per_doc = len(tok.encode(docs[0], add_special_tokens=False).ids) + 1
    assert report["tokens"] == 100 * per_doc  # none dropped: they share blocks, separated by [SEP]


def test_bounded_memory_a_corpus_much_larger_than_the_cap_streams_through(tmp_path, tok):
    """Peak memory of packing does not grow with the corpus: 20x the text, about the same peak."""
    tok.save(str(tmp_path / "tok.json"))
    book = " ".join(CLEAN) * 3  # a book-length document, larger than a batch at this cap
    unit = list(corpus_documents(3000, 1))
    small = corpus(tmp_path, unit + [book], "small.parquet")
    large = corpus(
        tmp_path,
        itertools.chain(itertools.chain.from_iterable(itertools.repeat(unit, 30)), [book] * 4),
        "large.parquet",
    )
    text_mb = {p.stem: sum(len(t) for t in iter_documents(p)) / 2**20 for p in (small, large)}
    cap = 2
    assert text_mb["large"] > 15 * cap and text_mb["large"] > 20 * text_mb["small"]
    # Peak RSS (VmHWM; ru_maxrss would carry this process's peak over through fork + exec) of a fresh process
    # without torch (blocked: the package then skips registering the model), so the packer's own memory shows.
    probe = (
        "import sys; sys.modules['torch'] = None; from cramswarm.cli import main; main({args!r}); "
        "print([int(l.split()[1]) // 1024 for l in open('/proc/self/status') if l.startswith('VmHWM')][0])"
    )
    peaks = {}
    for path in (small, large):
        args = [
            "pack",
            "--corpus",
            str(path),
            "--tokenizer",
            str(tmp_path / "tok.json"),
            "--out",
            str(tmp_path / f"{path.stem}.npy"),
            "--memory-cap-mb",
            str(cap),
        ]
        out = subprocess.run(
            [sys.executable, "-c", probe.format(args=args)], capture_output=True, text=True, check=True
        )
        peaks[path.stem] = int(out.stdout.strip().splitlines()[-1])  # MiB
    blocks = np.load(tmp_path / "large.npy", mmap_mode="r").shape[0]
    assert blocks * 128 > 0.15 * text_mb["large"] * 2**20  # everything was packed (~0.2 tokens per character)
    # measured +8 and +17 MiB (allocator noise) for 30 MiB more text; the previous packer, which held the corpus
    # in memory, grew by 168 MiB here
    growth = peaks["large"] - peaks["small"]
    assert growth < 24, f"{text_mb} MiB of text, cap {cap} MiB: peak RSS {peaks} MiB"


# ----------------------------------------------------------------------------------------------- orders


@pytest.fixture(scope="module")
def packed(tmp_path_factory, tok):
    tmp = tmp_path_factory.mktemp("order")
    docs = list(corpus_documents(1500, 2)) + ["a . b . c . d . e . f . g . h ."] * 40  # some period-dense text
    path = tmp / "c.parquet"
    sources.write_corpus(docs, path)
    packing.pack(path, tok, tmp / "packed.npy", 32, shuffle_seed=0)
    return tmp, np.load(tmp / "packed.npy")


def ordered(packed, tok, order, seed=0, holdout=20):
    tmp, _ = packed
    out = tmp / f"{order}-{seed}-{holdout}.npy"
    report = ordering.order_blocks(tmp / "packed.npy", tok, out, order, seed, holdout, memory_cap_mb=0.5)
    return np.load(out), report


def rows(a):
    return sorted(map(bytes, a))


@pytest.mark.parametrize("order", ordering.ORDERS)
def test_every_order_is_a_permutation_with_the_same_held_out_sample_last(packed, tok, order):
    _, blocks = packed
    out, report = ordered(packed, tok, order)
    assert out.shape == blocks.shape and rows(out) == rows(blocks)
    random_out, _ = ordered(packed, tok, "random")
    assert np.array_equal(out[-20:], random_out[-20:])  # same held-out blocks, same (packed) order
    assert report["training_blocks"] == len(blocks) - 20 and report["held_out_blocks"] == 20


def test_random_order_follows_its_seed(packed, tok):
    a, _ = ordered(packed, tok, "random", seed=1)
    assert np.array_equal(a, ordered(packed, tok, "random", seed=1)[0])
    assert not np.array_equal(a, ordered(packed, tok, "random", seed=2)[0])


def test_sentence_length_order_puts_period_dense_blocks_first(packed, tok):
    out, report = ordered(packed, tok, "sentence-length")
    dots = (out[:-20] == tok.token_to_id(".")).sum(axis=1)
    assert (np.diff(dots) <= 0).all() and dots[0] > dots[-1]
    assert report["dot_token_id"] == tok.token_to_id(".")


@pytest.mark.parametrize("order,direction", [("unigram", 1), ("unigram-reverse", -1)])
def test_unigram_orders_sort_by_mean_log_probability(packed, tok, order, direction):
    _, blocks = packed
    out, _ = ordered(packed, tok, order)
    train = out[:-20]
    counts = np.bincount(train.ravel(), minlength=tok.get_vocab_size())
    log2p = np.log2((counts + 1) / (counts.sum() + tok.get_vocab_size()))
    score = log2p[train].mean(axis=1)
    assert (direction * np.diff(score) >= -1e-12).all() and score[0] != score[-1]


def test_data_cap_keeps_the_head_of_the_order_and_the_held_out_sample(packed, tok):
    tmp, blocks = packed
    full, _ = ordered(packed, tok, "sentence-length")
    out = tmp / "capped.npy"
    report = ordering.order_blocks(
        tmp / "packed.npy", tok, out, "sentence-length", 0, 20, memory_cap_mb=0.5, max_training_blocks=50
    )
    capped = np.load(out)
    assert capped.shape == (70, blocks.shape[1])
    assert np.array_equal(capped[:50], full[:50])  # the first 50 of the curriculum
    assert np.array_equal(capped[-20:], full[-20:])  # the same held-out blocks
    assert report["training_blocks"] == 50 and report["dropped_by_cap"] == len(blocks) - 20 - 50


def test_holding_out_every_block_is_an_error(packed, tok):
    tmp, blocks = packed
    with pytest.raises(ValueError, match="leaves none to train on"):
        ordering.order_blocks(tmp / "packed.npy", tok, tmp / "x.npy", "random", 0, len(blocks))


# ----------------------------------------------------------------------------------------------- bad input


def test_non_utf8_bytes_are_repaired_and_counted_not_dropped(tmp_path):
    docs = [
        "fine text .",
        b"caf\xe9 au lait",
        "ok \udce9 surrogate",
        "valid ".encode() + "\u00e9t\u00e9".encode(),
        None,
        "  ",
    ]
    report = sources.write_corpus(docs, tmp_path / "c.parquet")
    assert texts(tmp_path / "c.parquet") == [
        "fine text .",
        "caf\ufffd au lait",
        "ok \ufffd\ufffd\ufffd surrogate",
        "valid \u00e9t\u00e9",
    ]
    assert (
        report["documents"],
        report["invalid_utf8_repaired"],
        report["non_text_dropped"],
        report["empty_documents_dropped"],
    ) == (4, 2, 1, 1)
    assert len(report["warnings"]) == 3


def test_empty_corpus_through_the_cli_is_a_clear_error(tmp_path):
    spec = json.dumps({"source": "synthetic", "synthetic": {"seed": 0, "corpus_documents": 0}})
    proc = subprocess.run(
        [sys.executable, "-m", "cramswarm", "corpus", "--source-spec", spec, "--out", str(tmp_path / "c.parquet")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "the corpus is empty" in proc.stderr and not (tmp_path / "c.parquet").exists()


# ----------------------------------------------------------------------------------------------- real text


@requires_mirror
def test_real_text_through_every_data_stage(mirror, tmp_path):
    """The mirror's Wikipedia and Gutenberg configs: corpus, tokenizer, trash, dedup, pack, order."""
    spec = mirror_corpus(300, 3)
    raw = sources.write_corpus(hub.iter_corpus(spec, mirror), tmp_path / "raw.parquet")
    assert raw["documents"] == 303 and raw["warnings"] == []
    tok = tokenization.train(tokenization.iter_corpus_batches(tmp_path / "raw.parquet"), 2048)
    # at vocab 2048 real prose sits at 0.35-0.5 tokens per character; disambiguation stubs and IPA-heavy text above
    trash = filters.trash_filter(tmp_path / "raw.parquet", tok, tmp_path / "trash.parquet", 0.5, memory_cap_mb=16)
    assert 0 < trash["documents_removed"] < 0.1 * trash["documents_in"]
    assert trash["tokens_per_char_kept"]["q50"] < 0.45 and trash["tokens_per_char_removed"]["min"] >= 0.5
    dedup = filters.dedup(tmp_path / "trash.parquet", tmp_path / "dedup.parquet", 0.8)
    assert dedup["documents_in"] == trash["documents_out"] and dedup["documents_removed"] <= 3
    packed = packing.pack(tmp_path / "dedup.parquet", tok, tmp_path / "packed.npy", 128, 0, memory_cap_mb=16)
    assert packed["documents"] == dedup["documents_out"] and packed["blocks"] > 5000
    report = ordering.order_blocks(tmp_path / "packed.npy", tok, tmp_path / "blocks.npy", "sentence-length", 0, 64)
    assert report["key_mean_first_tenth"] < report["key_mean_last_tenth"]  # more periods first


# ----------------------------------------------------------------------------------------------- config


def test_data_config_errors_name_the_key(repo):
    from cramswarm.config import ConfigError, deep_merge, load_yaml, validate_config

    base = load_yaml(repo / "config" / "config.yaml")
    bad = {
        "ablations": {"data": {"sources": ["synthetic", "c4"], "cells": [{"name": "x"}, {"name": "x"}]}},
        "data": {"corpora": {"hub": {"synthetic": {"seed": 1}}}, "order": "by-length"},
    }
    with pytest.raises(ConfigError) as err:
        validate_config(deep_merge(base, bad), repo / "config" / "schema.yaml")
    assert "'data.order': 'by-length' is not allowed" in str(err.value)
    bad["data"].pop("order")
    with pytest.raises(ConfigError) as err:
        validate_config(deep_merge(base, bad), repo / "config" / "schema.yaml")
    message = str(err.value)
    assert "'ablations.data.sources[1]': 'c4' is not a corpus" in message
    assert "'ablations.data.cells[1].name': 'x' is used twice" in message
    assert "'data.corpora.hub': the name is taken" in message


def test_data_runs_and_their_file_keys(repo):
    from cramswarm.config import data_wildcards, filters_key, load_config, resolve_runs

    cfg = load_config([repo / "config" / "config.yaml"])
    runs = resolve_runs(cfg)
    cells = {name: run["data"] for name, run in runs.items() if run["study"] == "data"}
    assert len(cells) == 2 * 4 and runs["crammed"]["data"] == cells["data-synthetic-none"]  # the study's recipe
    assert filters_key(cells["data-noisy-filtered_dedup"]) == "trash0.35-dedup0.8"
    sorted_, filtered = (
        data_wildcards(cells["data-noisy-filtered_sorted"]),
        data_wildcards(cells["data-noisy-filtered"]),
    )
    assert {k: v for k, v in sorted_.items() if k != "order"} == {k: v for k, v in filtered.items() if k != "order"}
    assert filters_key({**cells["data-noisy-none"], "trash_cutoff": 0.9, "dedup_threshold": 0.1}) == "raw"
    assert runs["data-noisy-none"]["recipe"]["budget"] == cfg["ablations"]["budget"]
