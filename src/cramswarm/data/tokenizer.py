"""Tokenizers trained on the study's corpus with the ``tokenizers`` library: WordPiece (the paper's), BPE, Unigram.

Special tokens sit at fixed ids whatever the family, corpus or build order (the model relies on pad = 0):
``[PAD]=0, [UNK]=1, [CLS]=2, [SEP]=3, [MASK]=4``. Every trainer gets them first, in this order, and the ids
are checked after training (a mismatch is an error, never a shifted model). Normalisation follows the paper:
NFD, lowercase, strip accents. Every family splits on whitespace and punctuation first (BERT's
pre-tokenizer), so no token spans a space: a long document can be encoded in whitespace-cut pieces with the
same ids. Inputs are encoded as ``[CLS] A [SEP]`` or ``[CLS] A [SEP] B [SEP]``; no token-type ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tqdm.auto import tqdm

from cramswarm.data.stream import open_corpus

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = range(len(SPECIAL_TOKENS))
BATCH_DOCUMENTS = 1024  # documents read per batch while training or encoding


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


def _model_and_trainer(family: str, vocab_size: int, min_frequency: int):
    common = dict(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False)
    if family == "wordpiece":
        model = models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=100)
        return model, trainers.WordPieceTrainer(min_frequency=min_frequency, **common)
    if family == "bpe":  # word-internal merges marked "##" as WordPiece does, so the same decoder applies
        model = models.BPE(unk_token="[UNK]", continuing_subword_prefix="##")
        return model, trainers.BpeTrainer(min_frequency=min_frequency, continuing_subword_prefix="##", **common)
    if family == "unigram":  # the Unigram trainer has no min_frequency (it prunes by likelihood instead)
        return models.Unigram(), trainers.UnigramTrainer(unk_token="[UNK]", **common)
    raise ValueError(f"unknown tokenizer family {family!r}; allowed: {', '.join(FAMILIES)}")


def train(
    batches: Iterable[list[str]],
    vocab_size: int,
    family: str = "wordpiece",
    lowercase: bool = True,
    min_frequency: int = 2,
) -> Tokenizer:
    """Train a ``family`` tokenizer on batches of documents; special tokens at ids 0-4 (checked)."""
    model, trainer = _model_and_trainer(family, vocab_size, min_frequency)
    tok = Tokenizer(model)
    steps = [normalizers.NFD()]
    if lowercase:
        steps += [normalizers.Lowercase(), normalizers.StripAccents()]
    tok.normalizer = normalizers.Sequence(steps)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##") if family != "unigram" else None
    tok.train_from_iterator(batches, trainer=trainer)
    for token_id, token in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(token) != token_id:
            raise RuntimeError(f"special token {token} landed at id {tok.token_to_id(token)}, expected {token_id}")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:0 [SEP]:0",
        special_tokens=[("[CLS]", CLS_ID), ("[SEP]", SEP_ID)],
    )
    return tok


def train_wordpiece(
    batches: Iterable[list[str]], vocab_size: int, lowercase: bool = True, min_frequency: int = 2
) -> Tokenizer:
    return train(batches, vocab_size, "wordpiece", lowercase, min_frequency)


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
