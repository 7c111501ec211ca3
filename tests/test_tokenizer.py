"""The tokenizer stage at the reference's fidelity: its normaliser, a vocab of exactly the requested size or a
refusal before anything is written, byte-identical files from two processes, the report beside each tokenizer."""

import json
import random
import subprocess
import sys

import pytest
from conftest import requires_mirror

from cramswarm.data import sources
from cramswarm.data import tokenizer as tokenization
from cramswarm.data.synthetic import corpus_documents

CJK = [chr(c) for c in range(0x4E00, 0x4E00 + 3000)]
EMOJI = [chr(c) for c in range(0x1F600, 0x1F650)]


def sprinkled(n: int = 3000, seed: int = 0) -> list[str]:
    """``n`` English lines with CJK characters inside and between words and emoji between them: about 8,000
    distinct characters, most seen once or twice (the issue's case)."""
    rng = random.Random(seed)
    lines = []
    for doc in corpus_documents(n, seed):
        words = doc.split(" ")
        for _ in range(3):
            i = rng.randrange(len(words))
            words[i] = words[i] + rng.choice(CJK) + rng.choice(CJK)  # inside a word: also a "##" candidate
        words.insert(rng.randrange(len(words)), rng.choice(EMOJI))
        words.insert(rng.randrange(len(words)), "".join(rng.choices(CJK, k=3)))
        lines.append(" ".join(words))
    return lines


@pytest.fixture(scope="module")
def sprinkled_corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "sprinkled.parquet"
    sources.write_corpus(sprinkled(), path)
    return path


def cli(*args, check=True):
    command = [sys.executable, "-m", "cramswarm", "tokenizer", *map(str, args)]
    proc = subprocess.run(command, capture_output=True, text=True)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


# ----------------------------------------------------------------------------------------------- normaliser


def test_normaliser_is_the_references_with_ascii_deletion():
    norm = tokenization.normalizer()
    assert norm.normalize_str("``Héllo''   Wörld  字😀 Ñandú") == '"hello" world  nandu'
    keep = tokenization.normalizer(ascii_only=False)
    assert keep.normalize_str("``Héllo''   Wörld  字😀") == '"hello" world 字😀'
    cased = tokenization.normalizer(lowercase=False)
    assert cased.normalize_str("Héllo  Wörld 字") == "Hello World "  # accents decomposed (NFD), then deleted


@pytest.mark.parametrize("ascii_only", [True, False])
def test_alphabet_counts_are_those_of_the_normalised_text(ascii_only):
    """The per-character shortcut of count_alphabet against the normaliser run over each document."""
    from collections import Counter

    docs = sprinkled(200, 4) + [
        "``quoted'' ```three'''' `` '' `x` 'y' \"",
        "Ünïcödé İstanbul ǅemal ﬁne Ⅻ Å Ω ᾿ ῾ \u1fef`` ``\u1fef",
        "tabs\tand\u00a0no-break\u2003spaces    many   ",
        "한국어 日本語 ελληνικά русский 😀👍🏽",
    ]
    norm = tokenization.normalizer(ascii_only=ascii_only)
    direct = Counter()
    for doc in docs:
        direct.update(c for c in norm.normalize_str(doc) if tokenization.PRE_TOKENIZER.pre_tokenize_str(c))
    assert tokenization.count_alphabet([docs[:50], docs[50:]], norm, 10**6).counts == dict(direct)


def test_trained_tokenizer_carries_the_normaliser_and_decodes_single_characters():
    tok = tokenization.train([sprinkled(300)], 300, min_frequency=1)
    plain = tok.encode("hello world", add_special_tokens=False).tokens
    assert tok.encode("Héllo 字字 wörld😀", add_special_tokens=False).tokens == plain
    # the alphabet went into the trainer as fixed entries; only the five special tokens stay added tokens
    assert sorted(tok.get_added_tokens_decoder()) == [0, 1, 2, 3, 4]
    assert tok.decode(tok.encode("a b . x").ids) == "a b. x"
    assert tok.encode("a").ids == [tokenization.CLS_ID, tok.token_to_id("a"), tokenization.SEP_ID]


# ----------------------------------------------------------------------------------------------- exact size


def test_the_issues_case_gives_exactly_the_requested_size(sprinkled_corpus, tmp_path):
    """3,000 English lines with CJK and emoji at 512: 13,973 entries and exit 0 before (issue 16)."""
    out, report = tmp_path / "tokenizer.json", tmp_path / "report.json"
    cli("--corpus", sprinkled_corpus, "--vocab-size", 512, "--out", out, "--report", report)
    tok = tokenization.load(out)
    facts = json.loads(report.read_text())
    assert tok.get_vocab_size() == 512 == facts["vocab_size"]
    assert facts["non_ascii_entries"] == 0 and all(t.isascii() for t in tok.get_vocab())
    assert 26 <= facts["alphabet_size"] < 128 and 0 < facts["continuation_share"] < 1
    assert facts["settings"] == {
        "family": "wordpiece",
        "requested": 512,
        "min_frequency": 2,
        "lowercase": True,
        "ascii_only": True,
        "limit_alphabet": 1000,
    }
    assert facts["bit_reproducible"] is True and "warnings" not in facts


def test_an_alphabet_too_large_for_the_size_is_refused_before_writing(sprinkled_corpus, tmp_path):
    out = tmp_path / "tokenizer.json"
    proc = cli("--corpus", sprinkled_corpus, "--vocab-size", 512, "--keep-non-ascii", "--out", out, check=False)
    assert proc.returncode != 0 and not out.exists()
    assert "cannot hold its alphabet" in proc.stderr and "tokenizer.limit_alphabet" in proc.stderr
    assert "tokenizer.ascii_only" in proc.stderr


def test_alphabet_limit_keeps_the_most_frequent_characters(sprinkled_corpus):
    batches = lambda: tokenization.iter_corpus_batches(sprinkled_corpus)  # noqa: E731
    alphabet = tokenization.count_alphabet(batches(), tokenization.normalizer(ascii_only=False), 60)
    assert len(alphabet.counts) > 3000 and len(alphabet.kept) == 60 and alphabet.dropped == len(alphabet.counts) - 60
    cut = min(alphabet.counts[c] for c in alphabet.kept)
    assert all(n <= cut for c, n in alphabet.counts.items() if c not in alphabet.kept)
    assert set("abcdefghijklmnopqrstuvwxyz") <= set(alphabet.kept) and "." in alphabet.kept
    assert "." not in alphabet.inner and "e" in alphabet.inner  # punctuation never continues a word
    tok = tokenization.train(batches, 512, ascii_only=False, limit_alphabet=60, exact=True)
    facts = tokenization.vocab_facts(tok)
    assert facts["vocab_size"] == 512 and facts["alphabet_size"] == 60
    kept_non_ascii = [c for c in alphabet.kept if not c.isascii()]
    assert facts["non_ascii_entries"] >= len(kept_non_ascii)


def test_a_corpus_too_small_for_the_size_is_refused_before_writing(tmp_path):
    corpus = tmp_path / "small.parquet"
    sources.write_corpus(list(corpus_documents(40, 1)), corpus)
    out = tmp_path / "tokenizer.json"
    proc = cli("--corpus", corpus, "--vocab-size", 4096, "--out", out, check=False)
    assert proc.returncode != 0 and not out.exists()
    assert "filled only" in proc.stderr and "tokenizer.min_frequency" in proc.stderr
    with pytest.raises(tokenization.TokenizerSizeError, match="filled only"):
        tokenization.train([list(corpus_documents(40, 1))], 4096, exact=True)
    assert tokenization.train([list(corpus_documents(40, 1))], 4096).get_vocab_size() < 4096  # not exact: allowed


@pytest.mark.parametrize("family", tokenization.FAMILIES)
def test_never_larger_than_requested_and_special_ids_fixed(family):
    docs = sprinkled(400, 2)
    for vocab in (200, 333):
        tok = tokenization.train([docs], vocab, family, min_frequency=1)
        assert tok.get_vocab_size() == vocab
        assert [tok.token_to_id(t) for t in tokenization.SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    with pytest.raises(tokenization.TokenizerSizeError, match="tokenizer.limit_alphabet"):
        tokenization.train([docs], 333, family, ascii_only=False)


# ----------------------------------------------------------------------------------------------- reproducibility


@pytest.mark.parametrize("family", ["wordpiece", "bpe"])
def test_two_processes_write_byte_identical_tokenizers(sprinkled_corpus, tmp_path, family):
    files = []
    for run in ("a", "b"):
        out = tmp_path / run / "tokenizer.json"
        cli("--corpus", sprinkled_corpus, "--vocab-size", 1024, "--family", family, "--out", out)
        files.append(out.read_bytes())
    assert files[0] == files[1]


@requires_mirror
@pytest.mark.parametrize("family", ["wordpiece", "bpe"])
def test_real_text_trains_byte_identically_in_two_processes(mirror, tmp_path, family):
    """The mirror's Wikipedia sample at 2048: tokenizers 0.23's own ordering gave a different file each run."""
    from conftest import mirror_corpus

    from cramswarm.data import hub

    sources.write_corpus(hub.iter_corpus(mirror_corpus(150, 0), mirror), tmp_path / "wiki.parquet")
    files = []
    for run in ("a", "b"):
        out = tmp_path / run / "tokenizer.json"
        cli("--corpus", tmp_path / "wiki.parquet", "--vocab-size", 2048, "--family", family, "--out", out)
        files.append(out.read_bytes())
    assert files[0] == files[1]


def test_unigram_is_reported_as_not_reproducible(sprinkled_corpus, tmp_path):
    report = tmp_path / "report.json"
    out = tmp_path / "t.json"
    proc = cli(
        "--corpus", sprinkled_corpus, "--vocab-size", 512, "--family", "unigram", "--out", out, "--report", report
    )
    facts = json.loads(report.read_text())
    assert facts["bit_reproducible"] is False and facts["vocab_size"] == 512
    assert "not bit-reproducible" in facts["warnings"][0] and "not bit-reproducible" in proc.stderr
