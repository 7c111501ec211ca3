"""Tokenizers trained on the study's corpus with the ``tokenizers`` library: WordPiece (the paper's), BPE, Unigram.

Special tokens sit at fixed ids whatever the family, corpus or build order (the model relies on pad = 0):
``[PAD]=0, [UNK]=1, [CLS]=2, [SEP]=3, [MASK]=4``. Every trainer gets them first, in this order, and the ids
are checked after training (a mismatch is an error, never a shifted model).

Normalisation follows the reference (``cramming/data/tokenizer_preparation.py``): two backticks and two
apostrophes become ``"``, NFD, lowercase, strip accents, runs of spaces collapse to one, and (``ascii_only``)
every non-ASCII character is deleted. Every family splits on whitespace and punctuation first (BERT's
pre-tokenizer, where the reference uses ``Whitespace``), so no token spans a space: a long document can be
encoded in whitespace-cut pieces with the same ids. Inputs are encoded as ``[CLS] A [SEP]`` or
``[CLS] A [SEP] B [SEP]``; no token-type ids.

Size and reproducibility (docs/data.md): the corpus is read twice. The first pass counts the characters words are
made of; the alphabet is the ``limit_alphabet`` most frequent (ties: lower code point), and a tokenizer that
cannot fit its alphabet is refused before training. WordPiece and BPE then get the alphabet and its ``##``
continuations as fixed entries after the special tokens, sorted by code point, so every id the trainer hands out
is a function of the corpus alone: ``tokenizers`` 0.23 otherwise numbers the ``##`` characters in hash-map order,
and its merge queue breaks count ties by id, so two trainings differed. Unigram's EM sums in parallel; its piece
scores differ in the last bits between runs, so it is reported as not reproducible.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tqdm.auto import tqdm

from cramswarm.data.stream import open_corpus

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = range(len(SPECIAL_TOKENS))
BATCH_DOCUMENTS = 1024  # documents read per batch while training or encoding
LIMIT_ALPHABET = 1000  # default alphabet limit (characters): BERT's; the reference has none (ASCII only instead)
CONTINUATION = "##"
COUNT_CHARS = 1 << 20  # characters counted at once while counting the alphabet (4 bytes each as code points)
UNICODE = 0x110000  # code points
# families whose training is byte-for-byte a function of the corpus and settings (see the module docstring)
REPRODUCIBLE = {"wordpiece": True, "bpe": True, "unigram": False}


class TokenizerSizeError(ValueError):
    """The requested vocab size cannot be met; the message names the reason and the config key to change."""


def iter_corpus_batches(path: str | Path, batch: int = BATCH_DOCUMENTS, progress: bool = False) -> Iterator[list[str]]:
    """The corpus's documents in batches of ``batch``; ``progress`` draws a tqdm bar over documents read (the
    tokenizer trainer counts words as it reads, so this is most of its time; the merges follow)."""
    reader = open_corpus(path)
    with tqdm(
        total=reader.metadata.num_rows,
        unit="doc",
        desc=f"tokenizer: reading {Path(path).name}",
        disable=not progress,
        mininterval=2.0,
    ) as bar:
        for record_batch in reader.iter_batches(batch_size=batch, columns=["text"]):
            yield record_batch.column(0).to_pylist()
            bar.update(record_batch.num_rows)


FAMILIES = ("wordpiece", "bpe", "unigram")
Batches = Iterable[list[str]]


def normalizer(lowercase: bool = True, ascii_only: bool = True) -> normalizers.Normalizer:
    """The reference's normaliser: quote rules, NFD, [lowercase, strip accents], collapsed spaces, [ASCII only].

    NFD comes first in both cases (the reference uses NFKC when it keeps accents), so that with ``ascii_only`` an
    accented letter keeps its base letter instead of vanishing."""
    steps = [normalizers.Replace("``", '"'), normalizers.Replace("''", '"'), normalizers.NFD()]
    if lowercase:
        steps += [normalizers.Lowercase(), normalizers.StripAccents()]
    steps.append(normalizers.Replace(Regex(" {2,}"), " "))
    if ascii_only:
        steps.append(normalizers.Replace(Regex(r"[^\x00-\x7F]+"), ""))
    return normalizers.Sequence(steps)


PRE_TOKENIZER = pre_tokenizers.BertPreTokenizer()


@dataclass
class Alphabet:
    """The characters words are made of after normalisation, as the trainers see them."""

    counts: dict[str, int]  # occurrences of every character inside words (whitespace excluded)
    kept: list[str]  # the limit's most frequent characters (ties: lower code point), sorted by code point
    inner: list[str] = field(default_factory=list)  # kept characters that can continue a word (a "##" entry each)

    @property
    def dropped(self) -> int:
        return len(self.counts) - len(self.kept)


def count_alphabet(batches: Batches, norm: normalizers.Normalizer, limit: int) -> Alphabet:
    """One pass over the corpus: how often each character occurs in words once normalised (whitespace, which the
    pre-tokenizer drops, excluded).

    Code points of the raw text are counted (numpy) and each distinct one is normalised on its own: every step of
    the normaliser but the quote rules maps one character to a fixed string (NFD only reorders combining marks;
    collapsing spaces touches spaces, which are not counted), and the quote rules are counted as pairs. Running the
    normaliser over the text itself gives the same counts (tested), several times slower."""
    raw = np.zeros(UNICODE, dtype=np.int64)
    backticks = apostrophes = 0  # "``" and "''", each becomes one '"' before anything else
    for batch in batches:
        for text in _chunks(batch):
            raw += np.bincount(np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32), minlength=UNICODE)
            backticks += text.count("``")
            apostrophes += text.count("''")
    raw[ord("`")] -= 2 * backticks
    raw[ord("'")] -= 2 * apostrophes
    raw[ord('"')] += backticks + apostrophes
    counts: Counter[str] = Counter()
    for code in np.flatnonzero(raw):
        for c in norm.normalize_str(chr(code)):
            counts[c] += int(raw[code])
    counts = Counter({c: n for c, n in counts.items() if PRE_TOKENIZER.pre_tokenize_str(c)})
    kept = sorted(sorted(counts, key=lambda c: (-counts[c], ord(c)))[:limit])
    # a character that the pre-tokenizer splits off on its own (punctuation) never continues a word
    inner = [c for c in kept if len(PRE_TOKENIZER.pre_tokenize_str(f"a{c}a")) == 1]
    return Alphabet(dict(counts), kept, inner)


def _chunks(batch: list[str]) -> Iterator[str]:
    """The batch's documents joined by newlines into strings of about :data:`COUNT_CHARS` characters."""
    buffer: list[str] = []
    size = 0
    for doc in batch:
        buffer.append(doc)
        size += len(doc) + 1
        if size >= COUNT_CHARS:
            yield "\n".join(buffer)
            buffer, size = [], 0
    if buffer:
        yield "\n".join(buffer)


def smallest_size(family: str, alphabet: Alphabet) -> int:
    """Entries a ``family`` tokenizer holds before its first merge or piece: special tokens and the alphabet
    (WordPiece and BPE: plus a ``##`` copy of each character that can continue a word)."""
    inner = len(alphabet.inner) if family != "unigram" else 0
    return len(SPECIAL_TOKENS) + len(alphabet.kept) + inner


def _model_and_trainer(family: str, vocab_size: int, min_frequency: int, alphabet: Alphabet):
    if family == "wordpiece" or family == "bpe":
        # alphabet and "##" continuations as fixed entries (ids by code point, not by hash order); the limit keeps
        # exactly them (the initial alphabet outranks every counted character)
        fixed = [*SPECIAL_TOKENS, *alphabet.kept, *(CONTINUATION + c for c in alphabet.inner)]
        common = dict(
            vocab_size=vocab_size,
            special_tokens=fixed,
            show_progress=False,
            min_frequency=min_frequency,
            limit_alphabet=len(alphabet.kept),
            initial_alphabet=alphabet.kept,
            continuing_subword_prefix=CONTINUATION,
        )
        if family == "wordpiece":
            model = models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=100)
            return model, trainers.WordPieceTrainer(**common)
        # word-internal merges marked "##" as WordPiece does, so the same decoder applies
        return models.BPE(unk_token="[UNK]", continuing_subword_prefix=CONTINUATION), trainers.BpeTrainer(**common)
    if family == "unigram":  # the Unigram trainer has no min_frequency (it prunes by likelihood instead)
        trainer = trainers.UnigramTrainer(
            unk_token="[UNK]",
            vocab_size=vocab_size,
            special_tokens=list(SPECIAL_TOKENS),
            show_progress=False,
            initial_alphabet=alphabet.kept,
        )
        return models.Unigram(), trainer
    raise ValueError(f"unknown tokenizer family {family!r}; allowed: {', '.join(FAMILIES)}")


def _passes(batches: Batches | Callable[[], Batches]) -> Callable[[], Batches]:
    """A callable giving the corpus's batches afresh for each pass; a one-shot iterator is read into memory."""
    if callable(batches):
        return batches
    if iter(batches) is batches:
        batches = list(batches)
    return lambda: batches


def _keep_only_special_added_tokens(tok: Tokenizer) -> Tokenizer:
    """The fixed alphabet entries went in as trainer special tokens; as added tokens they would be matched in raw
    text and skipped when decoding, so only the five real special tokens stay added tokens (the model keeps ids)."""
    state = json.loads(tok.to_str())
    state["added_tokens"] = [t for t in state["added_tokens"] if t["content"] in SPECIAL_TOKENS]
    return Tokenizer.from_str(json.dumps(state))


def train(
    batches: Batches | Callable[[], Batches],
    vocab_size: int,
    family: str = "wordpiece",
    lowercase: bool = True,
    min_frequency: int = 2,
    ascii_only: bool = True,
    limit_alphabet: int = LIMIT_ALPHABET,
    exact: bool = False,
) -> Tokenizer:
    """Train a ``family`` tokenizer on batches of documents; special tokens at ids 0-4 (checked).

    ``batches`` is read twice (alphabet, then training): pass a callable that yields them afresh for a corpus
    that does not fit in memory. Never larger than ``vocab_size``: an alphabet that does not fit is a
    :class:`TokenizerSizeError` before training; with ``exact`` so is a corpus that fills fewer entries."""
    if family not in FAMILIES:
        raise ValueError(f"unknown tokenizer family {family!r}; allowed: {', '.join(FAMILIES)}")
    corpus = _passes(batches)
    norm = normalizer(lowercase, ascii_only)
    alphabet = count_alphabet(corpus(), norm, limit_alphabet)
    floor = smallest_size(family, alphabet)
    if floor > vocab_size:
        continuation = f" and {len(alphabet.inner)} '##' continuations" if family != "unigram" else ""
        raise TokenizerSizeError(
            f"a {family} vocab of {vocab_size} cannot hold its alphabet: {len(SPECIAL_TOKENS)} special tokens, "
            f"{len(alphabet.kept)} characters{continuation} make {floor} entries before any merge; lower "
            f"tokenizer.limit_alphabet (now {limit_alphabet}), set tokenizer.ascii_only: true (now {ascii_only}) "
            f"or raise tokenizer.vocab_sizes"
        )
    if family == "unigram" and alphabet.dropped:  # its trainer keeps every character it sees
        raise TokenizerSizeError(
            f"the corpus has {len(alphabet.counts)} distinct characters and the unigram trainer keeps them all, "
            f"beyond tokenizer.limit_alphabet ({limit_alphabet}); set tokenizer.ascii_only: true (now {ascii_only}), "
            f"raise tokenizer.limit_alphabet or use the wordpiece or bpe family"
        )
    model, trainer = _model_and_trainer(family, vocab_size, min_frequency, alphabet)
    tok = Tokenizer(model)
    tok.normalizer = norm
    tok.pre_tokenizer = PRE_TOKENIZER
    tok.decoder = decoders.WordPiece(prefix=CONTINUATION) if family != "unigram" else None
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok = _keep_only_special_added_tokens(tok)
    for token_id, token in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(token) != token_id:
            raise RuntimeError(f"special token {token} landed at id {tok.token_to_id(token)}, expected {token_id}")
    size = tok.get_vocab_size()
    if size > vocab_size:  # the checks above make this impossible; never hand out a larger vocab
        raise TokenizerSizeError(f"the {family} trainer returned {size} entries for a requested {vocab_size}")
    if exact and size < vocab_size:
        why = f"min_frequency {min_frequency}: tokenizer.min_frequency" if family != "unigram" else "no min_frequency"
        raise TokenizerSizeError(
            f"the corpus filled only {size} of {vocab_size} {family} vocab entries ({why}); lower "
            f"tokenizer.vocab_sizes or tokenizer.min_frequency, or use a larger corpus"
        )
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:0 [SEP]:0",
        special_tokens=[("[CLS]", CLS_ID), ("[SEP]", SEP_ID)],
    )
    return tok


def train_wordpiece(
    batches: Batches | Callable[[], Batches], vocab_size: int, lowercase: bool = True, min_frequency: int = 2
) -> Tokenizer:
    return train(batches, vocab_size, "wordpiece", lowercase, min_frequency)


def vocab_facts(tok: Tokenizer) -> dict:
    """What a vocab is made of: its size, single characters (the alphabet, special tokens excluded), the share of
    ``##`` continuation entries and the entries holding a non-ASCII character."""
    entries = [t for t in tok.get_vocab() if t not in SPECIAL_TOKENS]
    size = tok.get_vocab_size()
    continuations = sum(t.startswith(CONTINUATION) and len(t) > len(CONTINUATION) for t in entries)
    return {
        "vocab_size": size,
        "alphabet_size": sum(len(t) == 1 for t in entries),
        "continuation_entries": continuations,
        "continuation_share": round(continuations / size, 6) if size else 0.0,
        "non_ascii_entries": sum(not t.isascii() for t in entries),
    }


def load(path: str | Path) -> Tokenizer:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"missing tokenizer file: {path}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:
        raise ValueError(f"corrupt tokenizer file {path}: {err}") from None


def to_transformers(tok: Tokenizer, max_length: int):
    """Wrap for ``save_pretrained``/``AutoTokenizer``; emits input_ids and attention_mask only."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=max_length,
        model_input_names=["input_ids", "attention_mask"],
    )
