"""A small probabilistic grammar: clauses with subject-verb agreement, their rendering, and the
meaning-preserving / meaning-changing edits the pair tasks are built from.

A clause is ``[in the PLACE ,] DET [ADJ] NOUN VERB-GROUP [DET [ADJ] NOUN [that VERB ...]] [in the PLACE]``.
The finite verb always agrees with the subject noun, and a relative clause only ever modifies the
object (sentence-finally), so "the nearest preceding noun" is always the agreement controller. Place
phrases stand at the start or the end, never between a subject and its verb.
"""

from __future__ import annotations

import random
from typing import Callable, NamedTuple, TypeVar

from cramswarm.data.synthetic.lexicon import CLASSES, HYPERNYMS, Adj, Noun, Pool, Verb

T = TypeVar("T")

# determiner -> (singular form, plural form)
_DET = {"the": ("the", "the"), "a": ("a", "some"), "this": ("this", "these"), "my": ("my", "my")}


class NP(NamedTuple):
    noun: Noun
    plural: bool
    det: str  # a key of _DET; rendered by number ("a" -> "some", "this" -> "these")
    adj: Adj | None = None


class Clause(NamedTuple):
    subj: NP
    verb: Verb | None  # None: a copular clause, "SUBJ is PRED"
    obj: NP | None
    pred: Adj | None
    place: Noun | None
    negated: bool
    past: bool
    front: bool = False  # the place phrase opens the clause: "in the park , the dog slept"
    rel: Verb | None = None  # relative clause on the object: "a cat that eats a pie"
    rel_obj: NP | None = None


class Ctx(NamedTuple):
    """What a task generator draws from. ``label`` feeds the label-deciding slots and falls back to ``base``
    (every other slot) where it has no fitting word."""

    rng: random.Random
    base: Pool
    label: Pool


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def np_words(np: NP) -> list[str]:
    noun = np.noun.pl if np.plural else np.noun.sg
    words = [np.adj.word, noun] if np.adj else [noun]
    det = _DET[np.det][np.plural]
    return [article(words[0]) if det == "a" else det, *words]


def np_text(np: NP) -> str:
    return " ".join(np_words(np))


def be(plural: bool, past: bool) -> str:
    return ("were" if plural else "was") if past else ("are" if plural else "is")


def verb_words(verb: Verb | None, pred: Adj | None, plural: bool, past: bool, negated: bool) -> list[str]:
    """The verb group agreeing with a subject of the given number; ``verb`` None: copula + ``pred``."""
    if verb is None:
        return [be(plural, past), "not", pred.word] if negated else [be(plural, past), pred.word]
    if negated:
        return ["did" if past else ("do" if plural else "does"), "not", verb.base]
    return [verb.past if past else (verb.base if plural else verb.s3)]


def clause_words(c: Clause) -> tuple[list[str], int]:
    """The clause's tokens, and the index of its finite verb (the agreement site)."""
    words = np_words(c.subj)
    if c.place is not None and c.front:
        words = ["in", "the", c.place.sg, ",", *words]
    verb_at = len(words)
    words += verb_words(c.verb, c.pred, c.subj.plural, c.past, c.negated)
    if c.obj is not None:
        words += np_words(c.obj)
        if c.rel is not None:
            words += ["that", *verb_words(c.rel, None, c.obj.plural, c.past, False)]
            if c.rel_obj is not None:
                words += np_words(c.rel_obj)
    if c.place is not None and not c.front:
        words += ["in", "the", c.place.sg]
    return words, verb_at


def clause_text(c: Clause) -> str:
    return " ".join(clause_words(c)[0])


def pick(rng: random.Random, primary: tuple[T, ...], fallback: tuple[T, ...]) -> T:
    return rng.choice(primary or fallback)


def determiner(rng: random.Random) -> str:
    r = rng.random()
    return "the" if r < 0.6 else "a" if r < 0.85 else "this" if r < 0.93 else "my"


def modifier(rng: random.Random, pool: Pool, cls: str, p: float, avoid: Adj | None = None) -> Adj | None:
    """An adjective for a noun of class ``cls`` with probability ``p``, never on the same scale as ``avoid``
    ("the big dog was tiny" would contradict itself)."""
    if rng.random() >= p:
        return None
    adj = rng.choice(pool.adjs_for[cls])
    return None if avoid is not None and adj.scale == avoid.scale else adj


def sample_clause(rng: random.Random, pool: Pool, *, key: Pool | None = None, subj: NP | None = None,
                  subj_class: str | None = None, verb: Verb | None = None, transitive: bool | None = None,
                  copular: float = 0.3, adj: float = 0.4, obj_adj: float = 0.3, place: float = 0.4,
                  front: float = 0.3, past: float = 0.5, neg: float = 0.0, plural: float = 0.3,
                  rel: float = 0.0) -> Clause:
    """A random well-formed clause. ``key`` (default ``pool``) feeds the subject noun, the verb and the
    predicate adjective. ``transitive`` None allows a copular clause, with probability ``copular`` or
    whenever the subject class takes no verb (places, food, ...)."""
    key = key or pool
    cls = subj.noun.cls if subj is not None else subj_class
    pred = None
    if verb is None:
        verbs = key.verbs_for(cls, transitive) or pool.verbs_for(cls, transitive)
        if transitive is None and (not verbs or rng.random() < copular):
            cls = cls or rng.choice(CLASSES)
            pred = pick(rng, key.adjs_for[cls], pool.adjs_for[cls])
        else:
            verb = rng.choice(verbs)
    if verb is not None:
        cls = cls or rng.choice(verb.subj)
    if subj is None:
        noun = pick(rng, key.nouns[cls], pool.nouns[cls])
        subj = NP(noun, rng.random() < plural, determiner(rng), modifier(rng, pool, cls, adj, pred))
    elif pred is not None and subj.adj is not None and subj.adj.scale == pred.scale:
        subj = subj._replace(adj=None)
    obj = rel_verb = rel_obj = None
    if verb is not None and verb.obj is not None:
        ocls = rng.choice(verb.obj)
        obj = NP(rng.choice(pool.nouns[ocls]), rng.random() < plural, determiner(rng),
                 modifier(rng, pool, ocls, obj_adj))
        if rng.random() < rel and pool.verbs_for(ocls):
            rel_verb = rng.choice(pool.verbs_for(ocls))
            if rel_verb.obj is not None:
                rcls = rng.choice(rel_verb.obj)
                rel_obj = NP(rng.choice(pool.nouns[rcls]), rng.random() < plural, "a")
    where = rng.choice(pool.nouns["place"]) if rng.random() < place and cls != "place" else None
    return Clause(subj, verb, obj, pred, where, rng.random() < neg, rng.random() < past,
                  where is not None and rng.random() < front, rel_verb, rel_obj)


# ---------------------------------------------------------------------------------------------------------
# Edits. Each takes (ctx, clause, slot) and returns (premise, hypothesis, label-deciding words) or None when
# it does not apply. The premise is the input clause, except for edits whose deciding word is the premise's
# own noun (hyper / wrong_hyper), which redraw that noun from the label pool.

Edit = tuple[Clause, Clause, tuple[str, ...]]
ADJ_SLOTS = ("subj_adj", "obj_adj", "pred")


def _choose(ctx: Ctx, get: Callable[[Pool], tuple[T, ...]], ok: Callable[[T], bool]) -> T | None:
    for pool in (ctx.label, ctx.base):
        candidates = [x for x in get(pool) if ok(x)]
        if candidates:
            return ctx.rng.choice(candidates)
    return None


def _np(c: Clause, slot: str) -> NP | None:
    return c.subj if slot.startswith("subj") or slot == "pred" else c.obj


def _with_np(c: Clause, slot: str, np: NP) -> Clause:
    return c._replace(subj=np) if slot.startswith("subj") else c._replace(obj=np)


def _adj(c: Clause, slot: str) -> Adj | None:
    if slot == "pred":
        return c.pred
    np = _np(c, slot)
    return np.adj if np is not None else None


def _with_adj(c: Clause, slot: str, adj: Adj | None) -> Clause:
    return c._replace(pred=adj) if slot == "pred" else _with_np(c, slot, _np(c, slot)._replace(adj=adj))


def _taken_scales(c: Clause, slot: str) -> tuple[str, ...]:
    """Scales already describing the noun of ``slot`` (subject adjective and predicate share a noun)."""
    if slot.startswith("obj"):
        return ()
    return tuple(a.scale for a in (c.subj.adj, c.pred) if a is not None)


def fits(verb: Verb, c: Clause) -> bool:
    """Whether ``verb`` can replace the clause's verb without breaking selectional restrictions."""
    if c.subj.noun.cls not in verb.subj or (verb.obj is None) != (c.obj is None):
        return False
    return c.obj is None or c.obj.noun.cls in verb.obj


def slot_classes(c: Clause, slot: str) -> tuple[str, ...]:
    """Noun classes that keep the clause well-formed in noun slot ``slot`` ("subj" or "obj")."""
    np = _np(c, slot)
    if slot == "subj":
        allowed = c.verb.subj if c.verb is not None else c.pred.classes
    else:
        allowed = c.verb.obj
        if c.rel is not None:
            allowed = tuple(k for k in allowed if k in c.rel.subj)
    if np.adj is not None:
        allowed = tuple(k for k in allowed if k in np.adj.classes)
    return allowed


def syn(ctx: Ctx, c: Clause, slot: str) -> Edit | None:
    """Replace an adjective or the verb by a synonym (meaning-preserving)."""
    if slot == "verb":
        v = c.verb
        r = v and _choose(ctx, lambda p: p.verb_synset[v.synset], lambda x: x is not v)
        return r and (c, c._replace(verb=r), (v.base, r.base))
    a = _adj(c, slot)
    r = a and _choose(ctx, lambda p: p.adj_synset[a.synset], lambda x: x is not a)
    return r and (c, _with_adj(c, slot, r), (a.word, r.word))


def ant(ctx: Ctx, c: Clause, slot: str) -> Edit | None:
    """Replace an adjective or the verb by an antonym (contradicting)."""
    if slot == "verb":
        v = c.verb
        r = v and v.antonym and _choose(ctx, lambda p: p.verb_synset[v.antonym], lambda x: fits(x, c))
        return r and (c, c._replace(verb=r), (v.base, r.base))
    a = _adj(c, slot)
    r = a and _choose(ctx, lambda p: p.adj_synset[a.antonym], lambda x: True)
    return r and (c, _with_adj(c, slot, r), (a.word, r.word))


def other(ctx: Ctx, c: Clause, slot: str) -> Edit | None:
    """Replace an adjective or the verb by an unrelated one: neither implied nor contradicted (NLI neutral).
    Sentiment words of opposite polarity, and verbs of one semantic group, count as related."""
    if slot == "verb":
        v = c.verb
        r = v and _choose(ctx, lambda p: p.verbs, lambda x: x.group != v.group and fits(x, c))
        return r and (c, c._replace(verb=r), (v.base, r.base))
    a = _adj(c, slot)
    if a is None:
        return None
    taken = _taken_scales(c, slot)
    r = _choose(ctx, lambda p: p.adjs_for[_np(c, slot).noun.cls],
                lambda x: x.scale not in taken and x.polarity * a.polarity >= 0)
    return r and (c, _with_adj(c, slot, r), (a.word, r.word))


def cohypo(ctx: Ctx, c: Clause, slot: str) -> Edit | None:
    """Replace a noun by another noun of its class (the dog -> the cat: a different referent)."""
    np = _np(c, slot)
    if np is None or np.noun.hyper:
        return None
    r = _choose(ctx, lambda p: p.nouns[np.noun.cls], lambda x: x is not np.noun)
    return r and (c, _with_np(c, slot, np._replace(noun=r)), (np.noun.sg, r.sg))


def _generalise(ctx: Ctx, c: Clause, slot: str, hyper_class: Callable[[Noun], str | None]) -> Edit | None:
    np = _np(c, slot)
    if np is None or np.noun.hyper:
        return None
    target = hyper_class(np.noun)
    if target is None:
        return None
    noun = _choose(ctx, lambda p: p.nouns[np.noun.cls], lambda x: True)
    premise = _with_np(c, slot, np._replace(noun=noun))
    return premise, _with_np(c, slot, np._replace(noun=HYPERNYMS[target], det="a")), (noun.sg,)


def hyper(ctx: Ctx, c: Clause, slot: str) -> Edit | None:
    """Replace a noun by its hypernym (the ferret -> an animal: entailed). Deciding word: the noun."""
    return _generalise(ctx, c, slot, lambda n: n.cls if n.cls in HYPERNYMS else None)


def wrong_hyper(ctx: Ctx, c: Clause, slot: str) -> Edit | None:
    """Replace a noun by the hypernym of another class that fits the slot (the ferret -> a person)."""
    np = _np(c, slot)
    if np is None:
        return None
    wrong = tuple(k for k in slot_classes(c, slot) if k != np.noun.cls and k in HYPERNYMS)
    return _generalise(ctx, c, slot, lambda n: ctx.rng.choice(wrong) if wrong and n.cls in HYPERNYMS else None)


def negate(ctx: Ctx, c: Clause, slot: str) -> Edit | None:
    return c, c._replace(negated=not c.negated), ()


def drop_adj(ctx: Ctx, c: Clause, slot: str) -> Edit | None:
    np = _np(c, slot)
    return np is not None and np.adj is not None and (c, _with_np(c, slot, np._replace(adj=None)), ()) or None


def add_adj(ctx: Ctx, c: Clause, slot: str) -> Edit | None:
    np = _np(c, slot)
    if np is None or np.adj is not None:
        return None
    taken = _taken_scales(c, slot)
    r = _choose(ctx, lambda p: p.adjs_for[np.noun.cls], lambda x: x.scale not in taken)
    return r and (c, _with_np(c, slot, np._replace(adj=r)), ())


def drop_place(ctx: Ctx, c: Clause, slot: str) -> Edit | None:
    return c.place is not None and (c, c._replace(place=None, front=False), ()) or None


def add_place(ctx: Ctx, c: Clause, slot: str) -> Edit | None:
    if c.place is not None or c.subj.noun.cls == "place":
        return None
    return c, c._replace(place=ctx.rng.choice(ctx.base.nouns["place"])), ()


def reorder(ctx: Ctx, c: Clause, slot: str) -> Edit | None:
    """Move the place phrase to the other end of the clause (meaning-preserving)."""
    return c.place is not None and (c, c._replace(front=not c.front), ()) or None


# edit kind -> (function, the slots it may act on)
EDITS: dict[str, tuple[Callable[[Ctx, Clause, str], Edit | None], tuple[str, ...]]] = {
    "syn": (syn, (*ADJ_SLOTS, "verb")),
    "ant": (ant, (*ADJ_SLOTS, "verb")),
    "other": (other, (*ADJ_SLOTS, "verb")),
    "cohypo": (cohypo, ("subj", "obj")),
    "hyper": (hyper, ("subj", "obj")),
    "wrong_hyper": (wrong_hyper, ("subj", "obj")),
    "negate": (negate, ("neg",)),
    "drop_adj": (drop_adj, ("subj", "obj")),
    "add_adj": (add_adj, ("subj", "obj")),
    "drop_place": (drop_place, ("place",)),
    "add_place": (add_place, ("place",)),
    "reorder": (reorder, ("place",)),
}


def apply_edit(ctx: Ctx, c: Clause, kind: str, used: set[str] | None = None) -> Edit | None:
    """Apply edit ``kind`` to a random applicable slot not in ``used`` (which gets the chosen slot added)."""
    fn, slots = EDITS[kind]
    order = list(slots)
    ctx.rng.shuffle(order)
    for slot in order:
        if used is not None and slot in used:
            continue
        out = fn(ctx, c, slot)
        if out:
            if used is not None:
                used.add(slot)
            return out
    return None


# Question forms by intent. "howto" / "where" ask about a person's action on an object, "why" about the
# habit of the (possessed) subject; forms of one intent ask the same thing.
QUESTION_FORMS = {
    "howto": ("how can i {vp} ?", "how do i {vp} ?", "what is the best way to {vp} ?", "what should i do to {vp} ?"),
    "where": ("where can i {vp} ?", "where is the best place to {vp} ?", "where should i go to {vp} ?"),
    "why": ("why {do} {np} {vp} so often ?", "what makes {np} {vp} so often ?"),
}


def ask(form: str, c: Clause) -> str:
    vp = c.verb.base if c.obj is None else f"{c.verb.base} {np_text(c.obj)}"
    return form.format(vp=vp, do="do" if c.subj.plural else "does", np=np_text(c.subj))
