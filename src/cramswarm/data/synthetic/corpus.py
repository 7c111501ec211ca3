"""The pretraining corpus: documents whose contexts reveal every word's attributes to a masked LM.

Five document kinds, all drawing from the whole lexicon (held-out words included):

* stories: a protagonist keeps one trait through the document, described with changing synonyms of it,
  negated antonyms and what such things do ("once , there was a huge dog in the park . ... the dog was not
  tiny but enormous . the large dog filled the whole room .");
* reviews: one sentiment polarity per document, carried by sentiment adjectives and verbs
  ("i loved this film . it is a superb film . it was not awful at all .");
* lessons: hypernym, synonym and antonym statements about one noun class, adjective set or verb set
  ("every ferret is an animal .", "superb means splendid .", "hot is the opposite of cold .");
* forum threads: questions with answers ("which animal eats a pie ? the ferret eats a pie .");
* news: narrative clauses in reporting frames, with contrasts and causal explanations.

Plain narrative clauses (subject-verb agreement, selectional restrictions) are mixed into all of them.
"""

from __future__ import annotations

import random
from typing import Iterator

from cramswarm.data.synthetic.grammar import NP, QUESTION_FORMS, article, ask, be, clause_text, np_text, sample_clause
from cramswarm.data.synthetic.lexicon import ANIMATE, CLASSES, FULL, HYPERNYMS, LEXICON, NEUTRAL, Adj, Noun
from cramswarm.data.synthetic.tasks import ANIMATE_SCALES, FIT_HOLDERS, FIT_THINGS, GENRES, INANIMATE_SCALES

P = FULL  # the corpus uses every word
_HYPER_CLASSES = tuple(HYPERNYMS)
_ADJ_SYNSETS = tuple(LEXICON.adj_synsets)
_VERB_SYNSETS = tuple(LEXICON.verb_synsets)
_TRAITS = {c: tuple(s for s, m in LEXICON.adj_synsets.items() if c in m[0].classes) for c in CLASSES}
_SENTIMENT_SYNSETS = {p: tuple(s for s, m in LEXICON.adj_synsets.items() if m[0].polarity == p) for p in (1, -1)}
_OBJECT_OF = {c: tuple(v for v in NEUTRAL.verbs if v.obj is not None and c in v.obj) for c in CLASSES}
_HERO_CLASSES = ("animal", "animal", "person", "person", "vehicle", "instrument", "food", "tool", "container")
_REVIEW_ITEMS = ("work", "work", "work", "food", "place", "instrument", "vehicle")
# Sentence-local polar cues for review sentences. Real reviews signal sentiment inside the sentence too;
# a small MLM learns such one-hop evidence far sooner than document-level consistency. The cue words are
# outside the lexicon and never occur in task rows, so they teach polarity without leaking labels.
POLAR_CUES = {
    1: ("happily", "luckily", "thankfully", "wonderfully"),
    -1: ("sadly", "unluckily", "regrettably", "annoyingly"),
}
# What things at each pole of a scale do or undergo: the world knowledge that, in real text, tells "huge"
# from "tiny" although both describe the same nouns. Past-tense phrases (no agreement), free of lexicon
# words; sentiment adjectives share one list per polarity ("+" / "-").
CUES: dict[str, tuple[str, ...]] = {
    "size+": ("filled the whole room", "towered over everyone"),
    "size-": ("fit in a pocket", "hid under a leaf"),
    "temperature+": ("steamed in the sun", "made everyone sweat"),
    "temperature-": ("made everyone shiver", "sparkled with frost"),
    "age+": ("showed many years of use", "gathered dust for decades"),
    "age-": ("came straight from the factory", "smelled of fresh paint"),
    "youth+": ("had just been born", "arrived only this season"),
    "youth-": ("had grey hair", "had lived for many years"),
    "speed+": ("finished first", "outran the wind"),
    "speed-": ("finished last", "took forever"),
    "weight+": ("barely moved an inch", "needed a crane to move"),
    "weight-": ("floated in the breeze", "weighed almost nothing"),
    "cleanliness+": ("gleamed from top to bottom", "had no stain"),
    "cleanliness-": ("had mud everywhere", "needed a bath"),
    "loudness+": ("woke the whole street", "rattled the windows"),
    "loudness-": ("made no sound", "barely made a sound"),
    "hardness+": ("could not be bent", "hurt to touch"),
    "hardness-": ("sank under a finger", "squeezed easily"),
    "wetness+": ("dripped with water", "came in from the rain"),
    "wetness-": ("had no water at all", "crumbled to powder"),
    "strength+": ("never gave up", "held up the roof"),
    "strength-": ("could barely stand", "shook in the breeze"),
    "hunger+": ("had an empty stomach", "kept looking for a meal"),
    "hunger-": ("had just had dinner", "refused another bite"),
    "tiredness+": ("yawned all day", "wanted to go to bed"),
    "tiredness-": ("greeted the morning", "had energy for hours"),
    "damage+": ("no longer worked", "lay in pieces"),
    "damage-": ("worked perfectly", "had not a scratch"),
    "brightness+": ("glowed with sunshine", "needed no lamps"),
    "brightness-": ("needed a lamp", "hid in the shadows"),
    "taste+": ("tasted of candy", "dripped with honey"),
    "taste-": ("tasted of lemon", "made faces pucker"),
    "+": ("made everyone smile", "earned a standing ovation", "left everyone happy"),
    "-": ("made everyone groan", "left everyone upset", "earned nothing but complaints"),
}
_FRAMES = (
    "officials said that {c}",
    "according to the report , {c}",
    "{c} , the report said",
    "yesterday , {c}",
    *(frame for _, _, frames in GENRES.values() for frame in frames),
)


def _pronoun(noun: Noun, plural: bool, rng: random.Random) -> str:
    if plural:
        return "they"
    return rng.choice(("he", "she")) if noun.cls == "person" else "it"


def _cue(rng: random.Random, adj: Adj) -> str:
    return rng.choice(CUES["+" if adj.polarity > 0 else "-"] if adj.polarity else CUES[adj.synset])


def _narrative(rng: random.Random, subj: NP | None = None) -> str:
    # mostly without sentiment words: those appear where their polarity is consistent (reviews, lessons)
    pool = P if rng.random() < 0.2 else NEUTRAL
    return (
        clause_text(
            sample_clause(
                rng,
                pool,
                subj=subj,
                copular=0.25,
                adj=0.35,
                obj_adj=0.3,
                place=0.35,
                past=0.6,
                neg=0.08,
                plural=0.3,
                rel=0.12,
            )
        )
        + " ."
    )


def _explanation(rng: random.Random) -> str:
    """A causal sentence that names its referent, teaching what wnli's pronouns resolve by: big things do
    not fit into small holders, and adjectives of animate beings describe animals, not tools."""
    if rng.random() < 0.5:
        x = rng.choice(P.nouns[rng.choice(FIT_THINGS)]).sg
        y = rng.choice(P.nouns[rng.choice(FIT_HOLDERS)]).sg
        if rng.random() < 0.5:
            return f"the {x} did not fit in the {y} because the {x} was too {rng.choice(P.adj_synset['size+']).word} ."
        return f"the {x} did not fit in the {y} because the {y} was too {rng.choice(P.adj_synset['size-']).word} ."
    animal = rng.choice(P.nouns["animal"]).sg
    cls = rng.choice(("vehicle", "tool", "container", "instrument"))
    thing = rng.choice(P.nouns[cls]).sg
    animate = rng.random() < 0.5
    scale = rng.choice(ANIMATE_SCALES if animate else INANIMATE_SCALES)
    adj = rng.choice(P.adj_synset[scale + rng.choice("+-")]).word
    referent = animal if animate else thing
    if rng.random() < 0.5:
        verb = rng.choice(tuple(v for v in _OBJECT_OF[cls] if "animal" in v.subj))
        return f"the {animal} {verb.past} the {thing} because the {referent} was {adj} ."
    first, second = (animal, thing) if rng.random() < 0.5 else (thing, animal)
    return f"the {first} was next to the {second} , and the {referent} was {adj} ."


def _story(rng: random.Random, n: int) -> list[str]:
    cls = rng.choice(_HERO_CLASSES)
    noun = rng.choice(P.nouns[cls])
    plural = rng.random() < 0.2
    trait = rng.choice(_TRAITS[cls])
    same, opposite = P.adj_synset[trait], P.adj_synset[LEXICON.adj_synsets[trait][0].antonym]
    name = noun.pl if plural else noun.sg
    was = be(plural, True)
    pron = _pronoun(noun, plural, rng)
    intro = np_text(NP(noun, plural, "a", rng.choice(same)))
    out = [f"once , there {was} {intro} in the {rng.choice(P.nouns['place']).sg} ."]
    while len(out) < n:
        r = rng.random()
        adj, opp = rng.choice(same).word, rng.choice(opposite).word
        if r < 0.3:
            out.append(_narrative(rng, NP(noun, plural, "the", rng.choice(same) if rng.random() < 0.5 else None)))
        elif r < 0.55:
            d = rng.randrange(6)
            if d == 0:
                out.append(f"the {name} {was} {adj} .")
            elif d == 1:
                out.append(f"{pron} {was} not {opp} .")
            elif d == 2:
                out.append(f"the {name} {was} not {opp} but {adj} .")
            elif d == 3:
                out.append(f"everyone said that the {name} {was} {adj} .")
            elif d == 4:
                out.append(f"{pron} {was} {adj} , not {opp} .")
            else:
                out.append(f"the {adj} {name} {_cue(rng, same[0])} .")
        elif r < 0.7 and _OBJECT_OF[cls]:
            verb = rng.choice(_OBJECT_OF[cls])
            subj = NP(rng.choice(P.nouns[rng.choice(verb.subj)]), rng.random() < 0.3, "the")
            out.append(f"{np_text(subj)} {verb.past} the {adj} {name} .")
        elif r < 0.8 and cls in ANIMATE:
            verb = rng.choice(NEUTRAL.verbs_for(cls))
            obj = f" {np_text(NP(rng.choice(P.nouns[rng.choice(verb.obj)]), False, 'the'))}" if verb.obj else ""
            out.append(f"{pron} {verb.past}{obj} .")
        elif r < 0.9:
            out.append(_explanation(rng))
        else:
            out.append(_narrative(rng))
    return out


def _review(rng: random.Random, n: int) -> list[str]:
    polarity = rng.choice((1, -1))
    item = rng.choice(P.nouns[rng.choice(_REVIEW_ITEMS)]).sg
    synsets = rng.sample(_SENTIMENT_SYNSETS[polarity], 2)  # a document keeps to a couple of synonym sets

    def good() -> str:
        return rng.choice(P.adj_synset[rng.choice(synsets)]).word

    def feel(p: int) -> str:
        return rng.choice(P.sentiment_verbs[p]).past

    out: list[str] = []
    while len(out) < n:
        d = rng.randrange(11)
        if d == 0:
            out.append(f"i {feel(polarity)} this {item} .")
        elif d == 10:
            out.append(f"the {good()} {item} {_cue(rng, P.sentiment_adjs[polarity][0])} .")
        elif d == 1:
            out.append(f"{rng.choice(POLAR_CUES[polarity])} , the {item} was {good()} .")
        elif d == 2:
            g = good()
            out.append(f"it is {article(g)} {g} {item} , {rng.choice(POLAR_CUES[polarity])} .")
        elif d == 3:
            out.append(f"critics {feel(polarity)} the {item} .")
        elif d == 4:
            a, b = (rng.choice(P.nouns[rng.choice(CLASSES)]).sg for _ in range(2))
            out.append(f"{rng.choice(POLAR_CUES[polarity])} , the {a} was {good()} and the {b} was {good()} .")
        elif d == 5:
            out.append(f"the {item} was not {rng.choice(P.sentiment_adjs[-polarity]).word} ; it was {good()} .")
        elif d == 6:
            out.append(f"it was not {rng.choice(P.sentiment_adjs[-polarity]).word} at all .")
        elif d == 7:
            rec = rng.choice(P.verb_synset["recommend"]).base
            out.append(f"i would {rec} it to everyone ." if polarity > 0 else f"i would not {rec} it to anyone .")
        elif d == 8:
            out.append(f"my friends {feel(polarity)} it too .")
        else:
            out.append(_narrative(rng))
    return out


def _class_lesson(rng: random.Random, n: int) -> list[str]:
    cls = rng.choice(_HYPER_CLASSES)
    hyper, members = HYPERNYMS[cls], P.nouns[cls]
    others = tuple(HYPERNYMS[k] for k in _HYPER_CLASSES if k != cls)
    out: list[str] = []
    while len(out) < n:
        x = rng.choice(members)
        o = rng.choice(others)
        d = rng.randrange(8)
        if d == 0:
            out.append(f"every {x.sg} is {article(hyper.sg)} {hyper.sg} .")
        elif d == 1:
            out.append(f"{x.pl} are {hyper.pl} .")
        elif d == 2:
            out.append(f"{article(x.sg)} {x.sg} is a kind of {hyper.sg} .")
        elif d == 3:
            y, z = rng.choice(members), rng.choice(members)
            out.append(f"{x.pl} , {y.pl} and {z.pl} are all {hyper.pl} .")
        elif d == 4:
            out.append(f"{article(x.sg)} {x.sg} is not {article(o.sg)} {o.sg} .")
        elif d == 5:
            out.append(f"no {x.sg} is {article(o.sg)} {o.sg} .")
        else:
            out.append(_narrative(rng, NP(x, rng.random() < 0.3, "the")))
    return out


def _adjective_lesson(rng: random.Random, n: int) -> list[str]:
    synset = rng.choice(_ADJ_SYNSETS)
    same = P.adj_synset[synset]
    opposite = P.adj_synset[same[0].antonym]
    classes = same[0].classes
    out: list[str] = []
    while len(out) < n:
        x, y = rng.sample(same, 2)
        z = rng.choice(opposite)
        noun = rng.choice(P.nouns[rng.choice(classes)])
        d = rng.randrange(10)
        if d == 0:
            out.append(f"{x.word} means {y.word} .")
        elif d == 1:
            out.append(f"{x.word} is another word for {y.word} .")
        elif d == 2:
            out.append(f"{x.word} is the opposite of {z.word} .")
        elif d == 3:
            out.append(f"something {x.word} is never {z.word} .")
        elif d == 4:
            out.append(f"{article(x.word)} {x.word} {noun.sg} is {article(y.word)} {y.word} {noun.sg} .")
        elif d == 5:
            pron = _pronoun(noun, False, rng)
            out.append(f"if {article(noun.sg)} {noun.sg} is {x.word} , {pron} is not {z.word} .")
        elif d == 6:
            out.append(f"the {noun.sg} was not {z.word} but {x.word} .")
        elif d == 7:
            out.append(f"{x.word} and {y.word} mean the same thing .")
        elif d == 8:
            out.append(
                f"{article(x.word)} {x.word} {noun.sg} {_cue(rng, x)} , but {article(z.word)} {z.word} one "
                f"{_cue(rng, z)} ."
            )
        elif x.polarity:
            like, hate = ("love", "hate") if rng.random() < 0.5 else ("praise", "criticize")
            if x.polarity < 0:
                like, hate = hate, like
            like, hate = rng.choice(P.verb_synset[like]).base, rng.choice(P.verb_synset[hate]).base
            if rng.random() < 0.5:
                out.append(f"people {like} {x.word} {noun.pl} and {hate} {z.word} ones .")
            else:
                out.append(f"to call something {x.word} is to {like} it .")
        else:
            out.append(f"the {x.word} {noun.sg} {_cue(rng, x)} .")
    return out


def _verb_lesson(rng: random.Random, n: int) -> list[str]:
    synset = rng.choice(_VERB_SYNSETS)
    same = P.verb_synset[synset]
    antonym = same[0].antonym
    out: list[str] = []
    while len(out) < n:
        x, y = rng.sample(same, 2)
        it = " something" if x.obj else ""
        d = rng.randrange(5)
        if d == 0:
            out.append(f"to {x.base}{it} is to {y.base}{' it' if x.obj else ''} .")
        elif d == 1:
            out.append(f"{x.base} means {y.base} .")
        elif d == 2 and antonym:
            z = rng.choice(P.verb_synset[antonym])
            out.append(f"if you {x.base}{it} , you do not {z.base}{' it' if x.obj else ''} .")
        elif d == 3:
            c = sample_clause(rng, NEUTRAL, verb=x, adj=0.3, obj_adj=0.3, place=0.0, past=1.0)
            it_ = f" {'them' if c.obj.plural else 'it'}" if c.obj else ""
            pron = _pronoun(c.subj.noun, c.subj.plural, rng)
            out.append(f"{clause_text(c)} ; in other words , {pron} {y.past}{it_} .")
        else:
            out.append(clause_text(sample_clause(rng, NEUTRAL, verb=x, place=0.3, past=0.5, neg=0.1)) + " .")
    return out


def _forum(rng: random.Random, n: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        d = rng.randrange(6)
        if d == 0:
            intent = rng.choice(tuple(QUESTION_FORMS))
            subj_class = "person" if intent != "why" else rng.choice(ANIMATE)
            c = sample_clause(
                rng,
                NEUTRAL,
                subj_class=subj_class,
                transitive=intent != "why" or None,
                copular=0.0,
                adj=0.5,
                obj_adj=0.6,
                place=0.0,
                past=0.0,
                plural=0.0,
            )
            if intent == "why":
                c = c._replace(subj=c.subj._replace(det="my"))
                answer = f"maybe it is {rng.choice(NEUTRAL.adjs_for[c.subj.noun.cls]).word} ."
            else:
                c = c._replace(obj=c.obj._replace(det="a", plural=False))
                verb = rng.choice(P.verb_synset[c.verb.synset])
                answer = f"you can {verb.base} it in the {rng.choice(P.nouns['place']).sg} ."
            out += [ask(rng.choice(QUESTION_FORMS[intent]), c), answer]
        elif d == 1:
            c = sample_clause(rng, NEUTRAL, transitive=True, adj=0.0, obj_adj=0.4, place=0.0, past=0.0, plural=0.0)
            hyper = HYPERNYMS[c.subj.noun.cls]
            answer = clause_text(c._replace(subj=c.subj._replace(det="the")))
            out += [f"which {hyper.sg} {c.verb.s3} {np_text(c.obj)} ?", answer + " ."]
        elif d == 2:
            c = sample_clause(rng, NEUTRAL, transitive=True, adj=0.3, obj_adj=0.3, place=0.0, past=1.0, plural=0.2)
            pron, them = _pronoun(c.subj.noun, c.subj.plural, rng), "them" if c.obj.plural else "it"
            out += [
                f"where did {np_text(c.subj)} {c.verb.base} {np_text(c.obj)} ?",
                f"{pron} {c.verb.past} {them} in the {rng.choice(P.nouns['place']).sg} .",
            ]
        elif d == 3:
            cls = rng.choice(_HYPER_CLASSES)
            x = rng.choice(P.nouns[cls])
            hyper = HYPERNYMS[cls]
            if rng.random() < 0.5:
                out += [
                    f"is {article(x.sg)} {x.sg} {article(hyper.sg)} {hyper.sg} ?",
                    f"yes , every {x.sg} is {article(hyper.sg)} {hyper.sg} .",
                ]
            else:
                o = HYPERNYMS[rng.choice(tuple(k for k in _HYPER_CLASSES if k != cls))]
                out += [
                    f"is {article(x.sg)} {x.sg} {article(o.sg)} {o.sg} ?",
                    f"no , {article(x.sg)} {x.sg} is {article(hyper.sg)} {hyper.sg} .",
                ]
        elif d == 4:
            x, y = rng.sample(LEXICON.adj_synsets[rng.choice(_ADJ_SYNSETS)], 2)
            out += [f"what does {x.word} mean ?", f"it means {y.word} ."]
        else:
            out.append(_narrative(rng))
    return out


def _news(rng: random.Random, n: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        r = rng.random()
        if r < 0.75:
            pool = P if rng.random() < 0.2 else NEUTRAL
            c = sample_clause(rng, pool, copular=0.25, adj=0.4, obj_adj=0.3, place=0.4, past=0.8, neg=0.1, rel=0.15)
            out.append(rng.choice(_FRAMES).format(c=clause_text(c)) + " .")
        elif r < 0.85:
            out.append(_explanation(rng))
        elif r < 0.92:
            cls = rng.choice(CLASSES)
            adj = rng.choice(P.adjs_for[cls])
            out.append(f"the {adj.word} {rng.choice(P.nouns[cls]).sg} {_cue(rng, adj)} .")
        else:
            synset = rng.choice(_ADJ_SYNSETS)
            x, z = rng.choice(P.adj_synset[synset]), rng.choice(P.adj_synset[LEXICON.adj_synsets[synset][0].antonym])
            noun = rng.choice(P.nouns[rng.choice(x.classes)])
            out.append(f"the {noun.sg} was not {z.word} but {x.word} .")
    return out


# cumulative share -> document kind
_KINDS = (
    (0.28, _story),
    (0.5, _review),
    (0.62, _class_lesson),
    (0.72, _adjective_lesson),
    (0.78, _verb_lesson),
    (0.88, _forum),
    (1.0, _news),
)


def document(rng: random.Random) -> str:
    n = rng.randint(3, 15)
    r = rng.random()
    make = next(kind for share, kind in _KINDS if r < share)
    return " ".join(make(rng, n))


def corpus_documents(n_documents: int, seed: int) -> Iterator[str]:
    """``n_documents`` documents (3-15 sentences each, lowercase, punctuation as separate tokens).
    Deterministic per seed; the first k documents are the same for every ``n_documents`` >= k."""
    if not isinstance(n_documents, int) or n_documents < 0:
        raise ValueError(f"n_documents must be a non-negative int, got {n_documents!r}")
    rng = random.Random(f"corpus/{seed}")
    return (document(rng) for _ in range(n_documents))
