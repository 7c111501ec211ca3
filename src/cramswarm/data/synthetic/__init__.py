"""A seeded synthetic stand-in for the pretraining corpus and the nine GLUE tasks.

This is *not* GLUE. It is an honest, offline, CPU-sized substitute for the default study: an English-like
corpus generated from a hard-coded lexicon of real words (``lexicon``) by a small probabilistic grammar
(``grammar``), and nine tasks with exactly the hub ``nyu-mll/glue`` columns and label encodings
(``cramswarm.glue_tasks.TASKS``) whose labels are decided by the same lexical semantics:

========  ===========================================================================================
cola      grammatical clause vs. a corrupted one (agreement / determiner-number violation, swapped,
          dropped or duplicated word); the subject noun and verb decide the agreement
sst2      sentiment of the last sentiment adjective or verb, flipped by "not" / "never"
mrpc      synonym substitutions (equivalent) vs. an antonym, unrelated word, other noun or negation
qqp       the same on questions, which may also be asked with another question form of the same intent
stsb      5 - 0.15 per synonym - 0.2 per moved phrase - 1.2 per meaning change (+ noise); unrelated ~0-0.8
mnli      synonym / hypernym / dropped modifier => entailment; unrelated word / added modifier => neutral;
          antonym / wrong hypernym / negation => contradiction. validation_matched shares the train genres
          (premise frames and topics), validation_mismatched uses two other genres
qnli      "which ANIMAL did ..." answered iff the sentence's object is an animal; "who bought ..." iff the
          sentence's verb is a synonym
rte       like mnli, with a two-sentence text; neutral and contradiction are both not_entailment
wnli      Winograd-like pronoun resolution: "too big" vs "too small" to fit, adjectives of animate beings
          vs of artifacts
========  ===========================================================================================

Corpus-only knowledge decides the labels: the content words of every semantic class are split, once and
for all, into a train-visible and a held-out half (``lexicon``). Train rows contain no held-out word at
all; in validation rows the label-deciding words are held out with probability ``HELD_SHARE`` (and every
validation row contains some held-out word, so no validation text equals a train text). The corpus uses
every word in contexts that reveal its class, synonyms, antonyms and polarity. A model fine-tuned from
random initialisation has never seen a held-out word, so it cannot know its polarity or class; a model
pretrained on the corpus can.

Contradictions follow the SNLI convention that premise and hypothesis describe the same scene ("the dog
slept" vs "the cat slept" contradict). Scores on these tasks measure what pretraining on this corpus
teaches a model; they are not comparable to numbers on the real GLUE benchmark.

Everything is deterministic: local ``random.Random`` instances seeded from the arguments (task and split
names are mixed into the seed), never global state.
"""

from __future__ import annotations

from cramswarm.data.synthetic.corpus import corpus_documents
from cramswarm.data.synthetic.lexicon import summary as lexicon_summary
from cramswarm.data.synthetic.tasks import HELD_SHARE, examples

__all__ = ["HELD_SHARE", "corpus_documents", "glue_split", "lexicon_summary"]


def glue_split(task: str, split: str, n_examples: int, seed: int) -> list[dict]:
    """``n_examples`` rows of ``task``'s ``split`` ("train" or one of the task's eval splits), each with the
    task's text columns, ``label`` (int class index; float in [0, 5] for stsb) and ``idx``. Labels are
    balanced. Raises ValueError naming the allowed values for an unknown task or split."""
    return [e.row for e in examples(task, split, n_examples, seed)]
