"""Tests of the synthetic corpus and GLUE stand-in (cramswarm.data.synthetic).

The checkers below (agreement, well-formedness, sentiment, pronoun resolution) are written independently
of the generator: they read only the lexicon's word attributes and the text.
"""

import statistics
import subprocess
import sys
from collections import Counter

import pytest

from cramswarm.data import synthetic as syn
from cramswarm.data.synthetic.lexicon import LEXICON, Adj, Noun, Verb
from cramswarm.data.synthetic.tasks import examples
from cramswarm.glue_tasks import TASKS

HELD = LEXICON.held_out_forms
SPLITS = [(task, split) for task, spec in TASKS.items() for split in ("train", *spec.eval_splits)]

# --- independent checkers -------------------------------------------------------------------------------

NOUN_NUMBER: dict[str, str | None] = {}  # form -> "sg" / "pl"; None where both (sheep)
for _n in [*LEXICON.nouns, *LEXICON.hypernyms.values()]:
    if _n.sg == _n.pl:
        NOUN_NUMBER[_n.sg] = None
    else:
        NOUN_NUMBER[_n.sg], NOUN_NUMBER[_n.pl] = "sg", "pl"
PRONOUN_NUMBER = {"he": "sg", "she": "sg", "it": "sg", "they": "pl", "we": "pl", "you": "pl"}
FINITE_NUMBER = {"is": "sg", "was": "sg", "does": "sg", "are": "pl", "were": "pl", "do": "pl"}
for _v in LEXICON.verbs:
    FINITE_NUMBER[_v.s3], FINITE_NUMBER[_v.base] = "sg", "pl"
INFINITIVE_AFTER = {"to", "can", "could", "would", "will", "should", "did", "does", "do", "i"}
ADJECTIVES = {a.word for a in LEXICON.adjs}
SG_DETS = {"a", "an", "this", "every", "each"}
PL_DETS = {"these", "those", "some", "many", "several", "two"}
DETS = SG_DETS | PL_DETS | {"the", "my"}


def sentences(text: str) -> list[list[str]]:
    """Declarative sentences (questions are skipped) as token lists."""
    out, current = [], []
    for tok in text.split():
        if tok in (".", "?", "!"):
            if tok == "." and current:
                out.append(current)
            current = []
        else:
            current.append(tok)
    return out


def agreement_errors(tokens: list[str]) -> tuple[int, int]:
    """(finite verbs checked, finite verbs disagreeing with the nearest preceding noun or pronoun)."""
    checked = errors = 0
    for i, tok in enumerate(tokens):
        number = FINITE_NUMBER.get(tok)
        if number is None:
            continue
        k = i - 1
        while k >= 0 and tokens[k] in ("not", "never"):
            k -= 1
        if k >= 0 and tokens[k] in INFINITIVE_AFTER:
            continue  # an infinitive: "does not sleep", "can fix", "to repair"
        for j in range(i - 1, -1, -1):
            if tokens[j] in NOUN_NUMBER or tokens[j] in PRONOUN_NUMBER:
                subject = NOUN_NUMBER.get(tokens[j]) or PRONOUN_NUMBER.get(tokens[j])
                if subject is not None:
                    checked += 1
                    errors += subject != number
                break
    return checked, errors


def determiner_errors(tokens: list[str]) -> int:
    """Determiner-noun number mismatches ("a dogs", "these dog") and a/an mistakes."""
    errors = 0
    for i, tok in enumerate(tokens[:-1]):
        if tok in ("a", "an"):
            errors += (tok == "an") != (tokens[i + 1][0] in "aeiou")
        if tok in SG_DETS or tok in PL_DETS:
            j = i + 1
            while j < len(tokens) and tokens[j] in ADJECTIVES:
                j += 1
            if j < len(tokens) and NOUN_NUMBER.get(tokens[j]):
                errors += NOUN_NUMBER[tokens[j]] != ("sg" if tok in SG_DETS else "pl")
    return errors


def well_formed(sentence: str) -> bool:
    """A recogniser for the cola clause shapes: '[in the N ,] DET ADJ* N VERB-GROUP [DET ADJ* N [that ...]]
    [in the N] .' with agreement."""
    tokens = sentence.split()
    assert tokens[-1] == "."
    tokens = tokens[:-1]
    start = 4 if tokens[0] == "in" else 0
    if tokens[start] not in DETS:
        return False  # the subject lacks its determiner, or a word was swapped before it
    if any(a == b for a, b in zip(tokens, tokens[1:])):
        return False  # a duplicated word
    for i, tok in enumerate(tokens):
        nxt = tokens[i + 1] if i + 1 < len(tokens) else None
        if tok in DETS:
            j = i + 1
            while j < len(tokens) and tokens[j] in ADJECTIVES:
                j += 1
            if j == len(tokens) or tokens[j] not in NOUN_NUMBER:
                return False  # a determiner not followed by adjectives and a noun
        if tok in NOUN_NUMBER and nxt is not None and (nxt in DETS or nxt in ADJECTIVES):
            return False  # the verb between a subject and its object or predicate is missing
        if tok == "not" and (i == 0 or tokens[i - 1] not in ("is", "are", "was", "were", "does", "do", "did")):
            return False
    if not any(t in FINITE_NUMBER or t == "did" or isinstance(LEXICON.forms.get(t), Verb) for t in tokens):
        return False
    return agreement_errors(tokens)[1] == 0 and determiner_errors(tokens) == 0


def sentiment_label(sentence: str) -> int:
    """sst2 rule: polarity of the last sentiment word, flipped by not/never in its clause."""
    tokens = sentence.split()
    for i in range(len(tokens) - 1, -1, -1):
        word = LEXICON.forms.get(tokens[i])
        if isinstance(word, (Adj, Verb)) and word.polarity:
            break
    else:
        raise AssertionError(f"no sentiment word in {sentence!r}")
    start = max((k for k, t in enumerate(tokens[:i]) if t in (",", "but")), default=0)
    negated = any(t in ("not", "never") for t in tokens[start:i])
    return int((word.polarity > 0) != negated)


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return list(syn.corpus_documents(1500, 0))


def texts(row: dict, task: str) -> tuple[str, ...]:
    return tuple(row[c] for c in TASKS[task].text_columns)


# --- API, determinism, shapes -----------------------------------------------------------------------------


def test_corpus_is_deterministic_and_seeded(corpus):
    assert list(syn.corpus_documents(1500, 0)) == corpus
    assert list(syn.corpus_documents(50, 1)) != corpus[:50]
    assert list(syn.corpus_documents(20, 0)) == corpus[:20]  # a prefix does not depend on n
    assert len(set(corpus)) > 0.99 * len(corpus)
    for doc in corpus:
        n = doc.count(" .") + doc.count(" ?")
        assert 3 <= n <= 16, doc
        assert doc == doc.lower() and "  " not in doc


def test_glue_is_deterministic_and_seeded():
    for task, split in SPLITS:
        rows = syn.glue_split(task, split, 50, 7)
        assert rows == syn.glue_split(task, split, 50, 7)
        assert rows != syn.glue_split(task, split, 50, 8)
    assert syn.glue_split("rte", "train", 50, 0) != syn.glue_split("mrpc", "train", 50, 0)


def test_output_does_not_depend_on_hash_seed(corpus):
    """No set/dict-of-strings iteration order leaks into the output (PYTHONHASHSEED varies by process)."""
    # (cramswarm's package import registers the torch model; a None module entry skips it, for speed)
    code = ("import hashlib, json, sys; sys.modules['cramswarm.models.crammed_bert'] = None; "
            "from cramswarm.data import synthetic as s; "
            "d = list(s.corpus_documents(200, 0)) + [json.dumps(s.glue_split(t, 'train', 100, 0)) for t in "
            "('mnli', 'qnli', 'wnli', 'cola')]; print(hashlib.sha256(repr(d).encode()).hexdigest())")
    digests = set()
    for hash_seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={"PYTHONHASHSEED": hash_seed, "PYTHONPATH": ":".join(sys.path)})
        digests.add(out.stdout.strip())
    assert len(digests) == 1


@pytest.mark.parametrize("task,split", SPLITS)
def test_columns_and_label_types_match_the_hub(task, split):
    spec = TASKS[task]
    rows = syn.glue_split(task, split, 120, 0)
    assert len(rows) == 120
    for i, row in enumerate(rows):
        assert set(row) == {*spec.text_columns, "label", "idx"}
        assert row["idx"] == i
        assert all(isinstance(t, str) and t.strip() for t in texts(row, task))
        if spec.is_regression:
            assert isinstance(row["label"], float) and 0.0 <= row["label"] <= 5.0
        else:
            assert type(row["label"]) is int and 0 <= row["label"] < spec.num_labels


@pytest.mark.parametrize("task", TASKS)
def test_labels_are_balanced(task):
    spec = TASKS[task]
    labels = [r["label"] for r in syn.glue_split(task, "train", 1000, 0)]
    if spec.is_regression:
        assert 1.8 < statistics.mean(labels) < 3.2 and statistics.stdev(labels) > 1.2
        per_unit = Counter(min(int(x), 4) for x in labels)
        assert all(per_unit[u] > 120 for u in range(5)), per_unit
    else:
        counts = Counter(labels)
        assert all(abs(counts[k] / len(labels) - 1 / spec.num_labels) < 0.05 for k in range(spec.num_labels))


def test_stsb_scores_follow_the_edits():
    rows = syn.glue_split("stsb", "train", 600, 0)
    assert all(0.0 <= r["label"] <= 5.0 for r in rows)
    for r in rows:  # identical sentences never appear; near-copies score high
        assert r["sentence1"] != r["sentence2"]
    diffs = [(len(set(r["sentence1"].split()) ^ set(r["sentence2"].split())), r["label"]) for r in rows]
    near = [s for d, s in diffs if d <= 2]
    far = [s for d, s in diffs if d >= 8]
    assert statistics.mean(near) > statistics.mean(far) + 1.5


def test_unknown_task_or_split_raises_with_allowed_names():
    with pytest.raises(ValueError, match="cola.*sst2.*wnli"):
        syn.glue_split("squad", "train", 10, 0)
    with pytest.raises(ValueError, match="validation_matched, validation_mismatched"):
        syn.glue_split("mnli", "validation", 10, 0)
    with pytest.raises(ValueError, match="train, validation"):
        syn.glue_split("sst2", "test", 10, 0)
    with pytest.raises(ValueError):
        syn.glue_split("sst2", "train", -1, 0)
    with pytest.raises(ValueError):
        syn.corpus_documents(-1, 0)


def test_lexicon_summary():
    summary = syn.lexicon_summary()
    assert all(type(v) is int and v > 0 for v in summary.values())
    assert summary["nouns"] >= 100 and summary["adjectives"] >= 100 and summary["verbs"] >= 80
    assert summary["sentiment_adjectives"] + summary["neutral_adjectives"] == summary["adjectives"]
    assert summary["content_words"] == summary["nouns"] + summary["adjectives"] + summary["verbs"]
    assert 0.4 < summary["held_out_words"] / summary["content_words"] < 0.6


# --- the held-out split ---------------------------------------------------------------------------------


def test_train_rows_never_contain_held_out_words():
    for task, _ in SPLITS:
        for e in examples(task, "train", 400, 0):
            tokens = {t for text in texts(e.row, task) for t in text.split()}
            assert not tokens & HELD, (task, e.row)
            assert not set(e.deciding) & HELD


@pytest.mark.parametrize("task,split", [s for s in SPLITS if s[1] != "train"])
def test_validation_deciding_words_are_mostly_held_out(task, split):
    ex = examples(task, split, 400, 0)
    held = sum(bool(set(e.deciding) & HELD) for e in ex) / len(ex)
    assert held >= 0.5, held
    for e in ex:  # every validation row has some held-out word: no text can equal a train text
        assert {t for text in texts(e.row, task) for t in text.split()} & HELD


@pytest.mark.parametrize("task,split", [s for s in SPLITS if s[1] != "train"])
def test_train_and_validation_texts_are_disjoint(task, split):
    train = {texts(r, task) for r in syn.glue_split(task, "train", 1000, 0)}
    valid = {texts(r, task) for r in syn.glue_split(task, split, 600, 0)}
    assert not train & valid


def test_corpus_uses_every_word_including_held_out_ones(corpus):
    tokens = {t for doc in corpus for t in doc.split()}
    for word in [*LEXICON.nouns, *LEXICON.adjs, *LEXICON.verbs]:
        forms = (word.sg, word.pl) if isinstance(word, Noun) else (word.word,) if isinstance(word, Adj) else (
            word.base, word.s3, word.past)
        assert tokens & set(forms), word
    assert HELD & tokens


def test_corpus_reveals_attributes_of_held_out_words(corpus):
    """Held-out words appear in the contexts that define them: hypernym, synonym and antonym statements, and
    reviews whose sentiment verbs agree with their polarity."""
    text = " ".join(corpus)
    held_nouns = [n for n in LEXICON.nouns if n.held_out and n.cls in LEXICON.hypernyms]
    stated = sum(f"every {n.sg} is" in text or f"{n.pl} are" in text for n in held_nouns)
    assert stated > 0.8 * len(held_nouns)
    held_adjs = [a for a in LEXICON.adjs if a.held_out]
    defined = sum(f"{a.word} means" in text or f"{a.word} is the opposite" in text for a in held_adjs)
    assert defined > 0.6 * len(held_adjs)
    # sentiment adjectives co-occur with same-polarity sentiment verbs in a document
    agree = disagree = 0
    for doc in corpus:
        tokens = doc.split()
        verbs = {w.polarity for w in map(LEXICON.forms.get, tokens) if isinstance(w, Verb) and w.polarity}
        if len(verbs) != 1 or "not" in tokens:
            continue
        (pol,) = verbs
        for w in map(LEXICON.forms.get, tokens):
            if isinstance(w, Adj) and w.polarity and w.held_out:
                agree += w.polarity == pol
                disagree += w.polarity != pol
    assert agree > 5 * max(disagree, 1)


def test_corpus_cues_use_no_lexicon_words():
    """Scale-pole cues ("filled the whole room") must not add uses of lexicon words (nor held-out ones)."""
    from cramswarm.data.synthetic.corpus import CUES

    assert {w for cues in CUES.values() for cue in cues for w in cue.split()}.isdisjoint(LEXICON.forms)
    assert {s for s in LEXICON.adj_synsets if not LEXICON.adj_synsets[s][0].polarity} <= set(CUES)


# --- grammar ---------------------------------------------------------------------------------------------


def test_corpus_sentences_agree(corpus):
    checked = errors = det_errors = 0
    for doc in corpus:
        for tokens in sentences(doc):
            c, e = agreement_errors(tokens)
            checked, errors = checked + c, errors + e
            det_errors += determiner_errors(tokens)
    assert checked > 5000  # the checker is not vacuous
    assert errors == 0 and det_errors == 0
    # and it does catch violations
    assert agreement_errors("the dogs sleeps in the park".split()) == (1, 1)
    assert agreement_errors("in the park , the dog sleep".split())[1] == 1
    assert determiner_errors("a dogs saw an cat".split()) == 2


def test_cola_acceptable_rows_are_grammatical_and_corrupted_rows_are_not():
    for split in ("train", "validation"):
        rows = syn.glue_split("cola", split, 800, 0)
        good = [r["sentence"] for r in rows if r["label"] == 1]
        bad = [r["sentence"] for r in rows if r["label"] == 0]
        assert all(well_formed(s) for s in good), [s for s in good if not well_formed(s)][:5]
        assert not any(well_formed(s) for s in bad), [s for s in bad if well_formed(s)][:5]
        assert not set(good) & set(bad)
    assert not well_formed("the dog the cat .") and not well_formed("dog sleeps .")


def test_sst2_labels_follow_sentiment_words_and_negation():
    rows = syn.glue_split("sst2", "train", 1000, 0) + syn.glue_split("sst2", "validation", 500, 0)
    for r in rows:
        assert sentiment_label(r["sentence"]) == r["label"], r
    negated = [r for r in rows if {"not", "never"} & set(r["sentence"].split())]
    assert len(negated) > 0.2 * len(rows)
    assert {r["label"] for r in negated} == {0, 1}
    # negation flips: a negated positive word is negative and vice versa
    assert sentiment_label("the film was not superb .") == 0 and sentiment_label("the film was superb .") == 1
    assert sentiment_label("the song was awful , but the film was never boring .") == 1


# --- lexical semantics decide the labels ----------------------------------------------------------------


def test_qnli_which_questions_are_answered_by_the_object_class():
    checked = 0
    for split in ("train", "validation"):
        for r in syn.glue_split("qnli", split, 600, 0):
            q = r["question"].split()
            if q[0] != "which" and q[:3] != ["what", "kind", "of"]:
                continue
            asked = LEXICON.forms[q[1] if q[0] == "which" else q[3]]
            tokens = r["sentence"].split()
            verb_at = next(i for i, t in enumerate(tokens) if isinstance(LEXICON.forms.get(t), Verb))
            obj = next(LEXICON.forms[t] for t in tokens[verb_at:] if isinstance(LEXICON.forms.get(t), Noun))
            assert r["label"] == (0 if obj.cls == asked.cls else 1), r
            checked += 1
    assert checked > 400


def test_wnli_labels_follow_the_referent_of_it():
    size_big = {a.word for a in LEXICON.adj_synsets["size+"]}
    checked = 0
    for split in ("train", "validation"):
        for r in syn.glue_split("wnli", split, 600, 0):
            s1, s2 = r["sentence1"].split(), r["sentence2"].split()
            nouns = [LEXICON.forms[t] for t in s1 if isinstance(LEXICON.forms.get(t), Noun)]
            adj = LEXICON.forms[s1[-2]]
            if "fit" in s1:
                referent = nouns[0] if adj.word in size_big else nouns[1]
            else:
                animate = set(adj.classes) <= {"animal", "person"}
                referent = next(n for n in nouns if (n.cls == "animal") == animate)
            assert r["label"] == int(s2[1] == referent.sg), r
            checked += 1
    assert checked == 1200


def test_mnli_hypernym_edits_depend_on_the_noun_class():
    """A hypothesis that swaps a noun for a hypernym is entailment iff the noun belongs to that class."""
    checked = 0
    for r in syn.glue_split("mnli", "validation_matched", 600, 0) + syn.glue_split("mnli", "train", 600, 0):
        p, h = r["premise"].split(), r["hypothesis"].split()
        hypers = [LEXICON.forms[t] for t in h if isinstance(LEXICON.forms.get(t), Noun) and LEXICON.forms[t].hyper]
        if len(hypers) != 1:
            continue
        premise_nouns = {LEXICON.forms[t] for t in p if isinstance(LEXICON.forms.get(t), Noun)}
        hypo_nouns = {LEXICON.forms[t] for t in h if isinstance(LEXICON.forms.get(t), Noun)}
        (replaced,) = premise_nouns - hypo_nouns
        assert r["label"] == (0 if replaced.cls == hypers[0].cls else 2), r
        checked += 1
    assert checked > 60


def test_mnli_mismatched_uses_other_genres_than_train():
    clause_words = DETS | {"in", ",", "that", "did", "does", "do", "not", "is", "are", "was", "were", "."}

    def frame(premise: str) -> frozenset:
        return frozenset(t for t in premise.split() if t not in LEXICON.forms and t not in clause_words)

    train = {frame(r["premise"]) for r in syn.glue_split("mnli", "train", 1000, 0)}
    matched = {frame(r["premise"]) for r in syn.glue_split("mnli", "validation_matched", 400, 0)}
    mismatched = {frame(r["premise"]) for r in syn.glue_split("mnli", "validation_mismatched", 400, 0)}
    assert matched <= train
    assert not mismatched & train


def test_paraphrase_pairs_differ_by_lexical_edits():
    for task in ("mrpc", "qqp"):
        ex = examples(task, "validation", 400, 0)
        a, b = TASKS[task].text_columns
        for e in ex:
            assert e.row[a] != e.row[b]
            if e.row["label"] == 1:  # equivalent pairs always rest on synonym substitutions
                words = [LEXICON.forms[w] for w in e.deciding]
                assert words and all(x.synset == y.synset and x is not y for x, y in zip(words[::2], words[1::2]))


def test_generation_yields_the_sizes_asked_for():
    """Sizes only: generation speed is measured by benchmarks/synthetic_generation.py, not asserted here."""
    assert sum(1 for _ in syn.corpus_documents(5000, 3)) == 5000
    for task, split in SPLITS:
        assert len(syn.glue_split(task, split, 2000, 3)) == 2000, (task, split)
