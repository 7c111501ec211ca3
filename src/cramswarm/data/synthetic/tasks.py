"""The nine GLUE-shaped tasks, each generated from the grammar with labels decided by lexical attributes.

Every generator gets a :class:`Ctx` and the label to produce, and returns ``(texts, label value,
deciding words)`` or None when the random draw does not support that label (the driver then redraws).
``deciding words`` are the words whose attributes decide the label; they are drawn from ``ctx.label``.
"""

from __future__ import annotations

import random
from functools import partial
from typing import Callable, NamedTuple

from cramswarm.data.synthetic.grammar import (
    NP,
    QUESTION_FORMS,
    Clause,
    Ctx,
    Edit,
    ant,
    apply_edit,
    article,
    ask,
    clause_text,
    clause_words,
    modifier,
    np_text,
    other,
    pick,
    sample_clause,
    syn,
)
from cramswarm.data.synthetic.lexicon import ARTIFACT, FULL, HELD, HYPERNYMS, LEXICON, VISIBLE
from cramswarm.glue_tasks import get_task

HELD_SHARE = 0.7  # share of validation rows whose label-deciding words are drawn from the held-out half
STSB_BUCKETS = 5  # stsb rows are spread evenly over the score ranges [0,1), [1,2), ... [4,5]
_MAX_TRIES = 200

Row = tuple[tuple[str, ...], int | float, tuple[str, ...]]  # texts, label, deciding words


class Example(NamedTuple):
    row: dict  # the hub-shaped row: text columns, label, idx
    deciding: tuple[str, ...]  # the words whose lexical attributes decide the label


def _weighted(rng: random.Random, options: tuple[tuple[str, float], ...]) -> list[str]:
    """The option names in a random order, weighted: the first is drawn by weight, the rest follow."""
    names = [name for name, _ in options]
    first = rng.choices(names, weights=[w for _, w in options])[0]
    rest = [n for n in names if n != first]
    rng.shuffle(rest)
    return [first, *rest]


def _first_edit(ctx: Ctx, c: Clause, kinds: list[str], used: set[str] | None = None) -> Edit | None:
    """The first of the edit kinds, in order, that applies."""
    for kind in kinds:
        edit = apply_edit(ctx, c, kind, used)
        if edit:
            return edit
    return None


# --- cola -----------------------------------------------------------------------------------------------

_SG_DETS = ("a", "this", "every", "each")
_PL_DETS = ("these", "those", "many", "several", "two")
# a finite form -> the same form with the other number (the agreement-violation corruption)
_OTHER_NUMBER = {"is": "are", "are": "is", "was": "were", "were": "was", "does": "do", "do": "does"}
for _v in LEXICON.verbs:
    _OTHER_NUMBER[_v.s3], _OTHER_NUMBER[_v.base] = _v.base, _v.s3


def _corrupt(rng: random.Random, words: list[str], verb_at: int, c: Clause) -> list[str]:
    """Make a grammatical clause ungrammatical: break subject-verb or determiner-noun agreement, swap two
    adjacent words, drop the finite verb or a singular noun's determiner, or duplicate a word."""
    det_at = verb_at - (3 if c.subj.adj is not None else 2)
    # "sheep" is singular and plural alike: no agreement error can be made with it
    invariant = c.subj.noun.sg == c.subj.noun.pl
    kinds = ["agree", "det", "swap", "drop", "dup"]
    rng.shuffle(kinds)
    for kind in kinds:
        if invariant and kind in ("agree", "det"):
            continue
        if kind == "agree" and words[verb_at] in _OTHER_NUMBER:
            words[verb_at] = _OTHER_NUMBER[words[verb_at]]
        elif kind == "det":
            det = rng.choice(_SG_DETS if c.subj.plural else _PL_DETS)
            words[det_at] = article(words[det_at + 1]) if det == "a" else det
        elif kind == "swap":
            i = rng.choice((det_at, verb_at - 1))  # determiner + next word, or subject noun + verb
            words[i], words[i + 1] = words[i + 1], words[i]
        elif kind == "drop":
            del words[det_at if not c.subj.plural and rng.random() < 0.5 else verb_at]
        elif kind == "dup":
            i = rng.choice((det_at, verb_at))
            words.insert(i, words[i])
        else:
            continue
        return words
    raise AssertionError("unreachable: swap, drop and dup always apply")


def _cola(ctx: Ctx, label: int) -> Row:
    c = sample_clause(ctx.rng, ctx.base, key=ctx.label, copular=0.3, adj=0.35, obj_adj=0.25, place=0.3, past=0.4,
                      neg=0.15, plural=0.45, rel=0.2)
    words, verb_at = clause_words(c)
    if label == 0:
        words = _corrupt(ctx.rng, words, verb_at, c)
    deciding = (c.subj.noun.sg, c.verb.base) if c.verb is not None else (c.subj.noun.sg,)
    return (" ".join(words) + " .",), label, deciding


# --- sst2 -----------------------------------------------------------------------------------------------

_SST_ITEMS = ("work", "work", "work", "work", "food", "place", "instrument", "vehicle")


def _sst2(ctx: Ctx, label: int) -> Row:
    """A review sentence. The label is the polarity of its last sentiment word, flipped when "not" or "never"
    negates it; the word is held out in most validation rows, so its polarity must come from the corpus."""
    rng = ctx.rng
    negated = rng.random() < 0.35
    target = 1 if label == 1 else -1
    polarity = -target if negated else target  # of the deciding word
    cls = rng.choice(_SST_ITEMS)
    item = rng.choice(ctx.base.nouns[cls]).sg
    if rng.random() < 0.3:  # a neutral adjective never changes the sentiment
        item = f"{rng.choice(ctx.base.neutral_adjs_for[cls]).word} {item}"
    if rng.random() < 0.6:
        word = pick(rng, ctx.label.sentiment_adjs[polarity], ctx.base.sentiment_adjs[polarity]).word
        form = rng.randrange(4 if negated else 5)
        neg = rng.choice(("not ", "never ")) if negated else ""
        if form == 0:
            text = f"the {item} was {neg}{word}"
        elif form == 1:
            text = f"it is {'not ' if negated else ''}{article(word)} {word} {item}"
        elif form == 2:
            opposite = rng.choice(ctx.base.sentiment_adjs[-target]).word
            aspect = rng.choice(ctx.base.nouns[rng.choice(_SST_ITEMS)]).sg
            text = f"the {aspect} was {opposite} , but the {item} was {neg}{word}"
        elif form == 3:
            text = f"this {item} is {'not ' if negated else ''}{word}"
        else:
            second = rng.choice(ctx.base.sentiment_adjs[polarity]).word
            text = f"{article(word)} {word} and {second} {item}"
        deciding = (word,)
    else:
        verb = pick(rng, ctx.label.sentiment_verbs[polarity], ctx.base.sentiment_verbs[polarity])
        who = rng.choice(("i", "critics", "my friends"))
        det = "this" if who == "i" else "the"
        text = f"{who} did not {verb.base} {det} {item}" if negated else f"{who} {verb.past} {det} {item}"
        deciding = (verb.base,)
    return (text + " .",), label, deciding


# --- paraphrase tasks: mrpc, qqp -------------------------------------------------------------------------

_SOURCES = ("officials", "the police", "witnesses", "reporters", "the neighbours")
_REPORTS = ("{s} said that {c}", "according to {s} , {c}", "{c} , {s} said", "{c}")
# meaning-changing edits of the paraphrase tasks, with weights; mostly lexical (antonyms, unrelated words)
_CHANGES = (("ant", 0.55), ("other", 0.15), ("cohypo", 0.15), ("negate", 0.15))


def _synonyms(ctx: Ctx, c: Clause, n: int, used: set[str]) -> tuple[Clause, tuple[str, ...]]:
    """Up to ``n`` synonym substitutions on distinct slots; returns the clause and the words involved."""
    words: tuple[str, ...] = ()
    for _ in range(n):
        edit = apply_edit(ctx, c, "syn", used)
        if edit is None:
            break
        c, words = edit[1], words + edit[2]
    return c, words


def _mrpc(ctx: Ctx, label: int) -> Row | None:
    """Equivalent: synonym substitutions (and maybe a moved place phrase). Not equivalent: one
    meaning-changing edit, mostly an antonym, plus maybe synonyms."""
    rng = ctx.rng
    c = sample_clause(rng, ctx.base, copular=0.25, adj=0.6, obj_adj=0.5, place=0.5, past=0.7, neg=0.1)
    used: set[str] = set()
    if label == 1:
        h, deciding = _synonyms(ctx, c, rng.choice((1, 1, 2)), used)
        if not deciding:
            return None
    else:
        edit = _first_edit(ctx, c, _weighted(rng, _CHANGES), used)
        if edit is None:
            return None
        h, deciding = edit[1], edit[2]
        if rng.random() < 0.5:
            h = _synonyms(ctx, h, 1, used)[0]
    if h.place is not None and rng.random() < 0.3:
        h = h._replace(front=not h.front)
    source = rng.choice(_SOURCES)
    s1, s2 = (rng.choice(_REPORTS).format(s=source, c=clause_text(x)) + " ." for x in (c, h))
    return (s1, s2), label, deciding


def _question_clause(ctx: Ctx, intent: str) -> Clause:
    rng = ctx.rng
    if intent == "why":
        c = sample_clause(rng, ctx.base, subj_class=rng.choice(("animal", "person")), copular=0.0, adj=0.6,
                          obj_adj=0.3, place=0.0, past=0.0, plural=0.3)
        return c._replace(subj=c.subj._replace(det="my"))
    c = sample_clause(rng, ctx.base, subj_class="person", transitive=True, adj=0.0, obj_adj=0.7, place=0.0,
                      past=0.0, plural=0.0)
    return c._replace(obj=c.obj._replace(det="a", plural=False))


def _qqp(ctx: Ctx, label: int) -> Row | None:
    """Duplicate: the same intent, maybe asked with another form, with synonym substitutions. Not
    duplicate: a meaning-changing edit (antonym, unrelated word, other noun) or, rarely, another intent."""
    rng = ctx.rng
    intent = rng.choice(tuple(QUESTION_FORMS))
    c = _question_clause(ctx, intent)
    forms = QUESTION_FORMS[intent]
    form1 = rng.choice(forms)
    form2 = rng.choice(forms) if rng.random() < 0.6 else form1
    used = set() if intent == "why" else {"subj"}  # "how can i ..." does not render the clause's subject
    if label == 1:
        h, deciding = _synonyms(ctx, c, rng.choice((1, 1, 2)), used)
        if not deciding:
            return None
    elif intent != "why" and rng.random() < 0.15:
        form2 = rng.choice(QUESTION_FORMS["where" if intent == "howto" else "howto"])
        h, deciding = c, ()
    else:
        edit = _first_edit(ctx, c, _weighted(rng, (("ant", 0.5), ("other", 0.25), ("cohypo", 0.25))), used)
        if edit is None:
            return None
        h, deciding = edit[1], edit[2]
        if rng.random() < 0.4:
            h = _synonyms(ctx, h, 1, used)[0]
    return (ask(form1, c), ask(form2, h)), label, deciding


# --- stsb -----------------------------------------------------------------------------------------------


def _stsb(ctx: Ctx, bucket: int) -> Row | None:
    """Similarity 5 minus 0.15 per synonym substitution, 0.2 for a moved place phrase and 1.2 per
    meaning-changing edit (plus a little rater noise); bucket 0 pairs two unrelated sentences."""
    rng = ctx.rng
    c = sample_clause(rng, ctx.base, copular=0.2, adj=0.7, obj_adj=0.6, place=0.5, past=0.6, neg=0.1)
    if bucket == 0:
        h = sample_clause(rng, ctx.base, copular=0.2, adj=0.7, obj_adj=0.6, place=0.5, past=0.6, neg=0.1)
        if h.subj.noun is c.subj.noun:
            return None
        score, deciding = rng.uniform(0.0, 0.8), ()
    else:
        changes = STSB_BUCKETS - 1 - bucket
        used: set[str] = set()
        h, deciding = c, ()
        for _ in range(changes):
            edit = _first_edit(ctx, h, _weighted(rng, _CHANGES), used)
            if edit is None:
                return None
            h, deciding = edit[1], deciding + edit[2]
        h, synonyms = _synonyms(ctx, h, rng.randrange(3), used)
        deciding += synonyms
        moved = h.place is not None and rng.random() < 0.3
        if moved:
            h = h._replace(front=not h.front)
        if h == c:
            return None
        score = 5.0 - 0.15 * len(synonyms) - 0.2 * moved - 1.2 * changes + rng.uniform(-0.15, 0.15)
    score = round(min(5.0, max(0.0, score)), 2)
    return (clause_text(c) + " .", clause_text(h) + " ."), score, deciding


# --- inference tasks: mnli, rte, qnli --------------------------------------------------------------------

# genre -> (share of past-tense premises, subject classes, premise frames)
GENRES: dict[str, tuple[float, tuple[str, ...], tuple[str, ...]]] = {
    "fiction": (0.9, ("animal", "person"),
                ("{c}", "that night , {c}", "suddenly , {c}", "{c} , and nobody said a word")),
    "travel": (0.1, ("place", "food", "vehicle", "person"),
               ("{c}", "visitors say that {c}", "in summer , {c}", "{c} , which surprises many tourists")),
    "government": (0.4, ("person", "vehicle", "place", "container"),
                   ("the report states that {c}", "according to the office , {c}", "{c} , the committee noted",
                    "officials confirmed that {c}")),
    "telephone": (0.5, ("animal", "person", "food", "tool", "instrument"),
                  ("well , i think {c} , you know", "yeah , {c} , right", "uh , {c} , i guess")),
    "letters": (0.7, ("person", "food", "work", "animal"),
                ("dear friend , {c}", "i am writing to say that {c}", "{c} , and we send our thanks")),
}
MATCHED = ("fiction", "travel", "government")  # train and validation_matched
MISMATCHED = ("telephone", "letters")  # validation_mismatched only

# NLI label -> (lexical edit kinds, structural edit kinds). Premises are never negated, so dropping a
# modifier or generalising a noun (upward-monotone edits) keeps the premise's truth.
_ENTAIL = (("syn", "hyper"), ("drop_adj", "drop_place"))
_NEUTRAL = (("other",), ("add_adj", "add_place"))
_CONTRADICT = (("ant", "wrong_hyper"), ("negate",))
_STRUCTURAL_SHARE = 0.2


def _nli_edit(ctx: Ctx, c: Clause, kinds: tuple[tuple[str, ...], tuple[str, ...]]) -> Edit | None:
    """A lexical edit of the label's kinds, or with probability _STRUCTURAL_SHARE a structural one."""
    lexical, structural = list(kinds[0]), list(kinds[1])
    ctx.rng.shuffle(lexical)
    ctx.rng.shuffle(structural)
    order = structural + lexical if ctx.rng.random() < _STRUCTURAL_SHARE else lexical + structural
    return _first_edit(ctx, c, order)


def _mnli(ctx: Ctx, label: int, genres: tuple[str, ...]) -> Row | None:
    rng = ctx.rng
    past, subjects, frames = GENRES[rng.choice(genres)]
    c = sample_clause(rng, ctx.base, subj_class=rng.choice(subjects), copular=0.3, adj=0.5, obj_adj=0.4,
                      place=0.5, front=0.0, past=past)
    edit = _nli_edit(ctx, c, (_ENTAIL, _NEUTRAL, _CONTRADICT)[label])
    if edit is None:
        return None
    premise, hypothesis, deciding = edit
    return (rng.choice(frames).format(c=clause_text(premise)) + " .", clause_text(hypothesis) + " ."), label, deciding


def _rte(ctx: Ctx, label: int) -> Row | None:
    """A two-sentence text (one of them unrelated context) and a hypothesis; not_entailment pools the
    contradicting and the neutral edits."""
    rng = ctx.rng
    c = sample_clause(rng, ctx.base, copular=0.3, adj=0.5, obj_adj=0.4, place=0.5, front=0.0, past=0.6)
    if label == 0:
        kinds = _ENTAIL
    else:
        kinds = (_CONTRADICT[0] + _NEUTRAL[0], _CONTRADICT[1] + _NEUTRAL[1])
    edit = _nli_edit(ctx, c, kinds)
    if edit is None:
        return None
    premise, hypothesis, deciding = edit
    context = clause_text(sample_clause(rng, ctx.base, past=0.6, place=0.3))
    parts = [clause_text(premise), context]
    rng.shuffle(parts)
    return (" . ".join(parts) + " .", clause_text(hypothesis) + " ."), label, deciding


def _qnli(ctx: Ctx, label: int) -> Row | None:
    """Does the sentence answer the question? "which ANIMAL did ..." is answered by a sentence whose object
    is an animal (the noun's class decides); "who bought ..." by a sentence whose verb is a synonym."""
    rng = ctx.rng
    entail = label == 0
    place = rng.choice(ctx.base.nouns["place"]) if rng.random() < 0.5 else None
    pp = f" in the {place.sg}" if place else ""
    if rng.random() < 0.5:
        # a person's verb whose objects span at least two classes with a hypernym
        verb = rng.choice([v for v in ctx.base.verbs_for("person", True) if sum(k in HYPERNYMS for k in v.obj) >= 2])
        classes = tuple(k for k in verb.obj if k in HYPERNYMS)
        asked = rng.choice(classes)
        cls = asked if entail else rng.choice(tuple(k for k in classes if k != asked))
        noun = pick(rng, ctx.label.nouns[cls], ctx.base.nouns[cls])
        subj = NP(rng.choice(ctx.base.nouns["person"]), rng.random() < 0.3, "the")
        obj = NP(noun, rng.random() < 0.3, rng.choice(("a", "the")), modifier(rng, ctx.base, cls, 0.4))
        form = rng.choice(("which {h} did {s} {v}{pp} ?", "what kind of {h} did {s} {v}{pp} ?"))
        question = form.format(h=HYPERNYMS[asked].sg, s=np_text(subj), v=verb.base, pp=pp)
        answer = Clause(subj, verb, obj, None, place, False, True, front=rng.random() < 0.3)
        return (question, clause_text(answer) + " ."), label, (noun.sg,)
    c = sample_clause(rng, ctx.base, subj_class="person", transitive=True, adj=0.3, obj_adj=0.4, place=0.0,
                      past=1.0, plural=0.2)
    c = c._replace(place=place)
    edit = syn(ctx, c, "verb") if entail else (ant(ctx, c, "verb") or other(ctx, c, "verb"))
    if edit is None:
        return None
    if rng.random() < 0.5:
        question = f"who {c.verb.past} {np_text(c.obj)}{pp} ?"
    else:
        question = f"what did {np_text(c.subj)} {c.verb.base}{pp} ?"
    return (question, clause_text(edit[1]) + " ."), label, edit[2]


# --- wnli -----------------------------------------------------------------------------------------------

FIT_THINGS = ("animal", "food", "tool", "instrument", "container")
FIT_HOLDERS = ("container", "vehicle")
ANIMATE_SCALES = ("hunger", "tiredness", "youth")
INANIMATE_SCALES = ("damage", "age")


def _wnli(ctx: Ctx, label: int) -> Row:
    """Pronoun resolution decided by lexical attributes; sentence2 replaces "it" by one candidate.
    "the X did not fit in the Y because it was too ADJ": ADJ big-like -> X, small-like -> Y.
    "the ANIMAL ... the THING ... it was ADJ": an adjective of animate beings -> the animal, else the thing."""
    rng = ctx.rng
    if rng.random() < 0.5:
        x = rng.choice(ctx.base.nouns[rng.choice(FIT_THINGS)])
        y = rng.choice(tuple(n for n in ctx.base.nouns[rng.choice(FIT_HOLDERS)] if n is not x))
        big = rng.random() < 0.5
        synset = "size+" if big else "size-"
        adj = pick(rng, ctx.label.adj_synset[synset], ctx.base.adj_synset[synset])
        text = f"the {x.sg} did not fit in the {y.sg} because it was too {adj.word} ."
        referent, distractor = (x, y) if big else (y, x)
        predicate, deciding = f"too {adj.word}", (adj.word,)
    else:
        animal = pick(rng, ctx.label.nouns["animal"], ctx.base.nouns["animal"])
        cls = rng.choice(ARTIFACT)
        thing = pick(rng, ctx.label.nouns[cls], ctx.base.nouns[cls])
        animate = rng.random() < 0.5
        synset = rng.choice(ANIMATE_SCALES if animate else INANIMATE_SCALES) + rng.choice("+-")
        adj = pick(rng, ctx.label.adj_synset[synset], ctx.base.adj_synset[synset])
        if rng.random() < 0.5:
            verb = rng.choice(tuple(v for v in ctx.base.verbs_for("animal", True) if cls in v.obj))
            text = f"the {animal.sg} {verb.past} the {thing.sg} because it was {adj.word} ."
        else:
            first, second = (animal, thing) if rng.random() < 0.5 else (thing, animal)
            text = f"the {first.sg} was next to the {second.sg} , and it was {adj.word} ."
        referent, distractor = (animal, thing) if animate else (thing, animal)
        predicate, deciding = adj.word, (adj.word, animal.sg, thing.sg)
    candidate = referent if label == 1 else distractor
    return (text, f"the {candidate.sg} was {predicate} ."), label, deciding


# --- driver ---------------------------------------------------------------------------------------------

_GENERATORS: dict[str, Callable[[Ctx, int], Row | None]] = {
    "cola": _cola, "sst2": _sst2, "mrpc": _mrpc, "qqp": _qqp, "stsb": _stsb,
    "mnli": partial(_mnli, genres=MATCHED), "qnli": _qnli, "rte": _rte, "wnli": _wnli,
}


def examples(task: str, split: str, n_examples: int, seed: int) -> list[Example]:
    """The rows of one split with the words that decide each label (see ``glue_split``)."""
    spec = get_task(task)  # ValueError naming the allowed tasks
    splits = ("train", *spec.eval_splits)
    if split not in splits:
        raise ValueError(f"unknown split {split!r} for GLUE task {task!r}; allowed: {', '.join(splits)}")
    if not isinstance(n_examples, int) or n_examples < 0:
        raise ValueError(f"n_examples must be a non-negative int, got {n_examples!r}")
    rng = random.Random(f"glue/{task}/{split}/{seed}")
    train = split == "train"
    base = VISIBLE if train else FULL
    generate = partial(_mnli, genres=MISMATCHED) if split == "validation_mismatched" else _GENERATORS[task]
    classes = STSB_BUCKETS if spec.is_regression else spec.num_labels
    labels = [i % classes for i in range(n_examples)]
    rng.shuffle(labels)
    held_forms = LEXICON.held_out_forms
    out = []
    for idx, label in enumerate(labels):
        for _ in range(_MAX_TRIES):
            label_pool = base if train else HELD if rng.random() < HELD_SHARE else VISIBLE
            row = generate(Ctx(rng, base, label_pool), label)
            # a validation row must contain a held-out word somewhere: train rows never do, so no
            # validation text can equal a train text
            if row is not None and (train or any(t in held_forms for text in row[0] for t in text.split())):
                break
        else:
            raise RuntimeError(f"could not generate a {task}/{split} row with label {label} in {_MAX_TRIES} tries")
        texts, value, deciding = row
        out.append(Example({**dict(zip(spec.text_columns, texts)), "label": value, "idx": idx}, deciding))
    return out
