"""The hard-coded English lexicon behind the synthetic corpus and tasks, and its held-out split.

Every content word carries the attributes that the task labels depend on: a noun's class (and with it
its hypernym), an adjective's synonym set, antonym set and sentiment polarity, a verb's synonym and
antonym sets and the noun classes it accepts as subject and object (selectional restrictions).

The held-out split is deterministic and independent of any seed: within each semantic class (a noun
class, an adjective synonym set, a verb synonym set) every second word, in the order listed here, is
*held out*. Fine-tuning train rows never contain a held-out word, validation rows mostly put held-out
words in their label-deciding slots, and the pretraining corpus uses every word. A held-out word's
attributes can therefore only be learned from the corpus.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

CLASSES = ("animal", "person", "food", "vehicle", "tool", "place", "container", "instrument", "work")
ANIMATE = ("animal", "person")
PERSON = ("person",)
PHYSICAL = CLASSES[:-1]  # everything but "work" (films, songs, ...)
ARTIFACT = ("vehicle", "tool", "container", "instrument")
PORTABLE = ("food", "tool", "container", "instrument")
GOODS = ("food", "vehicle", "tool", "container", "instrument", "work")
FINDABLE = ("animal",) + GOODS
MOVABLE = ("animal",) + ARTIFACT
BUILT = ("vehicle", "container", "place")


class Noun(NamedTuple):
    sg: str
    pl: str
    cls: str  # noun class, one of CLASSES
    held_out: bool
    hyper: bool = False  # the class's own hypernym word ("animal", "tool", ...)


class Adj(NamedTuple):
    word: str
    scale: str  # "size", "quality", ...; the two poles of a scale are antonym sets
    synset: str  # "<scale>+" or "<scale>-"
    antonym: str  # the other pole's synset
    polarity: int  # sentiment: +1 / -1; 0 for neutral adjectives
    classes: tuple[str, ...]  # noun classes the adjective applies to
    held_out: bool


class Verb(NamedTuple):
    base: str  # also the plural present form
    s3: str  # third person singular present
    past: str
    synset: str
    antonym: str | None
    group: str  # verbs of one group are too related in meaning to count as "unrelated" (NLI neutral)
    subj: tuple[str, ...]  # noun classes accepted as subject
    obj: tuple[str, ...] | None  # noun classes accepted as object; None: intransitive
    polarity: int  # sentiment verbs (love / hate, ...): +1 / -1
    held_out: bool


# class, hypernym ("" when the class has none), members; "sg/pl" spells an irregular plural
_NOUNS = (
    ("animal", "animal", "dog cat horse cow sheep/sheep goat pig rabbit mouse/mice fox wolf/wolves bear lion tiger "
     "duck goose/geese owl eagle ferret donkey monkey squirrel"),
    ("person", "person/people", "teacher doctor farmer baker nurse pilot lawyer artist student soldier sailor "
     "singer chef child/children woman/women man/men dancer judge"),
    ("food", "food", "muffin soup cake apple melon pie salad egg banana cookie sandwich pizza carrot "
     "potato/potatoes tomato/tomatoes pear orange"),
    ("vehicle", "vehicle", "car bus truck bike train boat ship van plane tractor taxi wagon scooter canoe jeep tram"),
    ("tool", "tool", "hammer wrench drill shovel knife/knives rake axe ladder brush chisel needle spade "
     "screwdriver funnel trowel"),
    ("place", "place", "park school market library museum hospital church castle village city beach garden forest "
     "farm kitchen station"),
    ("container", "container", "box basket bag bottle jar bucket barrel crate jug bowl cup pot chest sack vase tub"),
    ("instrument", "instrument", "piano guitar violin drum flute trumpet harp cello banjo clarinet organ tuba"),
    ("work", "", "film movie book novel song album show concert story poem painting comedy"),
)

# scale, noun classes it applies to, sentiment scale?, positive pole, negative pole. The poles are antonym
# sets; the words of one pole are synonyms. Sentiment poles carry polarity +1 / -1.
_SCALES = (
    ("quality", CLASSES, True, "good fine nice decent", "bad poor lousy inferior"),
    ("excellence", CLASSES, True, "excellent superb splendid outstanding", "awful terrible dreadful horrible"),
    ("wonder", CLASSES, True, "wonderful marvelous fantastic terrific", "boring dull tedious bland"),
    ("beauty", CLASSES, True, "beautiful lovely pretty gorgeous", "ugly hideous unsightly grotesque"),
    ("wit", CLASSES, True, "clever brilliant smart witty", "stupid silly foolish dumb"),
    ("pleasure", CLASSES, True, "pleasant delightful charming agreeable", "unpleasant nasty annoying irritating"),
    ("humour", CLASSES, True, "funny hilarious amusing entertaining", "sad gloomy depressing bleak"),
    ("size", PHYSICAL, False, "big large huge enormous", "small little tiny miniature"),
    ("temperature", ("food", "place"), False, "hot warm scorching boiling", "cold chilly icy freezing"),
    ("age", ARTIFACT + ("place", "work"), False, "old ancient antique vintage", "new modern contemporary recent"),
    ("youth", ANIMATE, False, "young youthful juvenile", "elderly aged senior"),
    ("speed", ("animal", "person", "vehicle"), False, "fast quick rapid swift", "slow sluggish unhurried leisurely"),
    ("weight", MOVABLE, False, "heavy weighty hefty bulky", "light lightweight airy"),
    ("cleanliness", ANIMATE + ARTIFACT + ("place",), False, "clean spotless tidy neat", "dirty filthy grimy messy"),
    ("loudness", ANIMATE + ("vehicle", "instrument", "place"), False, "loud noisy deafening booming",
     "quiet silent hushed peaceful"),
    ("hardness", ("food", "container"), False, "hard firm solid rigid", "soft tender squishy supple"),
    ("wetness", ANIMATE + ("food", "place", "tool", "container"), False, "wet damp soaked soggy", "dry arid parched"),
    ("strength", ANIMATE + ("vehicle", "tool", "container"), False, "strong powerful mighty sturdy",
     "weak feeble frail puny"),
    ("hunger", ANIMATE, False, "hungry starving famished ravenous", "full sated satisfied stuffed"),
    ("tiredness", ANIMATE, False, "tired sleepy weary exhausted", "awake alert energetic lively"),
    ("damage", ARTIFACT, False, "broken faulty defective busted", "intact unbroken undamaged functional"),
    ("brightness", ("place",), False, "bright sunny luminous radiant", "dark dim shadowy murky"),
    ("taste", ("food",), False, "sweet sugary honeyed syrupy", "sour bitter tart acidic"),
)

# synset, antonym synset, group, subject classes, object classes (None: intransitive), polarity, members.
# A member is "base" or "base|past" (irregular or consonant-doubling past tense).
_VERBS = (
    ("sleep", None, "rest", ANIMATE, None, 0, "sleep|slept rest doze nap|napped"),
    ("run", None, "move", ANIMATE, None, 0, "run|ran sprint race dash"),
    ("walk", None, "move", ANIMATE, None, 0, "walk stroll wander amble"),
    ("jump", None, "move", ANIMATE, None, 0, "jump leap hop|hopped spring|sprang"),
    ("laugh", "cry", "mood", PERSON, None, 0, "laugh giggle chuckle"),
    ("cry", "laugh", "mood", PERSON, None, 0, "cry weep|wept sob|sobbed"),
    ("shout", "whisper", "voice", PERSON, None, 0, "shout yell scream holler"),
    ("whisper", "shout", "voice", PERSON, None, 0, "whisper murmur mutter"),
    ("eat", None, "eat", ANIMATE, ("food",), 0, "eat|ate devour consume munch"),
    ("chase", None, "chase", ANIMATE, ("animal",), 0, "chase pursue follow hunt"),
    ("see", None, "see", ANIMATE, CLASSES, 0, "see|saw notice spot|spotted observe"),
    ("fix", "break", "repair", PERSON, ARTIFACT, 0, "fix repair mend"),
    ("break", "fix", "repair", ANIMATE, ARTIFACT, 0, "break|broke smash shatter damage"),
    ("build", "destroy", "repair", PERSON, BUILT, 0, "build|built construct assemble erect"),
    ("destroy", "build", "repair", PERSON, BUILT, 0, "destroy demolish ruin wreck"),
    ("buy", "sell", "trade", PERSON, GOODS, 0, "buy|bought purchase acquire"),
    ("sell", "buy", "trade", PERSON, GOODS, 0, "sell|sold trade peddle"),
    ("wash", None, "wash", PERSON, MOVABLE, 0, "wash scrub|scrubbed rinse cleanse"),
    ("visit", None, "visit", PERSON, ("place",), 0, "visit tour explore"),
    ("carry", None, "hold", ANIMATE, PORTABLE, 0, "carry haul lug|lugged tote"),
    ("cook", None, "cook", PERSON, ("food",), 0, "cook prepare bake roast"),
    ("find", "lose", "find", ANIMATE, FINDABLE, 0, "find|found discover locate uncover"),
    ("lose", "find", "find", PERSON, FINDABLE, 0, "lose|lost misplace mislay|mislaid"),
    ("love", "hate", "opinion", ANIMATE, CLASSES, 1, "love adore cherish treasure"),
    ("hate", "love", "opinion", ANIMATE, CLASSES, -1, "hate despise loathe detest"),
    ("enjoy", "dislike", "opinion", PERSON, CLASSES, 1, "enjoy like relish appreciate"),
    ("dislike", "enjoy", "opinion", PERSON, CLASSES, -1, "dislike resent deplore abhor|abhorred"),
    ("praise", "criticize", "opinion", PERSON, CLASSES, 1, "praise applaud commend acclaim"),
    ("criticize", "praise", "opinion", PERSON, CLASSES, -1, "criticize condemn denounce slam|slammed"),
    ("recommend", None, "opinion", PERSON, CLASSES, 1, "recommend endorse advocate"),
    ("push", "pull", "push", ANIMATE, MOVABLE, 0, "push shove nudge press"),
    ("pull", "push", "push", ANIMATE, MOVABLE, 0, "pull drag|dragged tug|tugged yank"),
    ("lift", "drop", "hold", ANIMATE, PORTABLE + ("animal",), 0, "lift raise hoist heave"),
    ("drop", "lift", "hold", ANIMATE, PORTABLE + ("animal",), 0, "drop|dropped lower release"),
    ("drive", None, "drive", PERSON, ("vehicle",), 0, "drive|drove steer operate"),
    ("feed", None, "feed", PERSON, ("animal",), 0, "feed|fed nourish"),
    ("play", None, "play", PERSON, ("instrument",), 0, "play perform"),
)


def _plural(sg: str) -> str:
    if sg.endswith(("s", "x", "z", "ch", "sh")):
        return sg + "es"
    if sg.endswith("y") and sg[-2] not in "aeiou":
        return sg[:-1] + "ies"
    return sg + "s"


def _third_person(base: str) -> str:
    return _plural(base)  # the same spelling rules: fix -> fixes, carry -> carries, play -> plays


def _past(base: str) -> str:
    if base.endswith("e"):
        return base + "d"
    if base.endswith("y") and base[-2] not in "aeiou":
        return base[:-1] + "ied"
    return base + "ed"


class Lexicon:
    """All words with their attributes, indexed the ways the generators need."""

    def __init__(self) -> None:
        self.nouns: list[Noun] = []
        self.hypernyms: dict[str, Noun] = {}  # class -> its hypernym noun (classes that have one)
        for cls, hyper, members in _NOUNS:
            if hyper:
                sg, _, pl = hyper.partition("/")
                self.hypernyms[cls] = Noun(sg, pl or _plural(sg), cls, False, hyper=True)
            for i, spec in enumerate(members.split()):
                sg, _, pl = spec.partition("/")
                self.nouns.append(Noun(sg, pl or _plural(sg), cls, held_out=i % 2 == 1))

        self.adjs: list[Adj] = []
        self.adj_synsets: dict[str, tuple[Adj, ...]] = {}
        for scale, classes, sentiment, pos, neg in _SCALES:
            for sign, words in (("+", pos), ("-", neg)):
                synset, antonym = scale + sign, scale + ("-" if sign == "+" else "+")
                polarity = (1 if sign == "+" else -1) if sentiment else 0
                members = tuple(
                    Adj(w, scale, synset, antonym, polarity, classes, held_out=i % 2 == 1)
                    for i, w in enumerate(words.split())
                )
                self.adj_synsets[synset] = members
                self.adjs.extend(members)

        self.verbs: list[Verb] = []
        self.verb_synsets: dict[str, tuple[Verb, ...]] = {}
        for synset, antonym, group, subj, obj, polarity, members in _VERBS:
            entries = []
            for i, spec in enumerate(members.split()):
                base, _, past = spec.partition("|")
                entries.append(Verb(base, _third_person(base), past or _past(base), synset, antonym, group,
                                    subj, obj, polarity, held_out=i % 2 == 1))
            self.verb_synsets[synset] = tuple(entries)
            self.verbs.extend(entries)

        # surface form -> the word it belongs to; every form must belong to exactly one word, so that a
        # token in a text identifies its word (and whether it is held out) without ambiguity
        self.forms: dict[str, Noun | Adj | Verb] = {}
        for word in [*self.nouns, *self.hypernyms.values(), *self.adjs, *self.verbs]:
            for form in forms_of(word):
                owner = self.forms.setdefault(form, word)
                if owner is not word:
                    raise AssertionError(f"lexicon form {form!r} belongs to both {owner} and {word}")
        self.held_out_forms = frozenset(f for f, w in self.forms.items() if w.held_out)


def forms_of(word: Noun | Adj | Verb) -> tuple[str, ...]:
    if isinstance(word, Noun):
        return (word.sg, word.pl)
    if isinstance(word, Adj):
        return (word.word,)
    return (word.base, word.s3, word.past)


class Pool:
    """The words one kind of slot may draw from (those ``keep`` accepts): the whole lexicon, its
    train-visible half, its held-out half, or its words without sentiment. Every index the generators
    sample from is precomputed (tuples, so that order is deterministic)."""

    def __init__(self, lex: Lexicon, keep: Callable[[Noun | Adj | Verb], bool]) -> None:
        self.nouns = {c: tuple(n for n in lex.nouns if n.cls == c and keep(n)) for c in CLASSES}
        self.adj_synset = {s: tuple(a for a in m if keep(a)) for s, m in lex.adj_synsets.items()}
        self.adjs_for = {c: tuple(a for a in lex.adjs if c in a.classes and keep(a)) for c in CLASSES}
        self.neutral_adjs_for = {c: tuple(a for a in self.adjs_for[c] if a.polarity == 0) for c in CLASSES}
        self.sentiment_adjs = {p: tuple(a for a in lex.adjs if a.polarity == p and keep(a)) for p in (1, -1)}
        self.verb_synset = {s: tuple(v for v in m if keep(v)) for s, m in lex.verb_synsets.items()}
        self.verbs = tuple(v for v in lex.verbs if keep(v))
        self.sentiment_verbs = {
            p: tuple(v for v in self.verbs if v.polarity == p and "person" in v.subj) for p in (1, -1)
        }
        # (subject class or None for any, transitive True / False / None for either) -> verbs
        self._verbs_for: dict[tuple[str | None, bool | None], tuple[Verb, ...]] = {}
        for cls in (None, *CLASSES):
            for trans in (None, True, False):
                self._verbs_for[cls, trans] = tuple(
                    v for v in self.verbs
                    if (cls is None or cls in v.subj) and (trans is None or (v.obj is not None) == trans)
                )

    def verbs_for(self, cls: str | None, transitive: bool | None = None) -> tuple[Verb, ...]:
        return self._verbs_for[cls, transitive]


LEXICON = Lexicon()
HYPERNYMS = LEXICON.hypernyms
FULL = Pool(LEXICON, lambda w: True)  # the corpus and non-deciding validation slots
VISIBLE = Pool(LEXICON, lambda w: not w.held_out)  # everything in train rows
HELD = Pool(LEXICON, lambda w: w.held_out)  # validation label-deciding slots (mostly)
NEUTRAL = Pool(LEXICON, lambda w: isinstance(w, Noun) or not w.polarity)  # the corpus's plain narrative


def summary() -> dict[str, int]:
    """Word counts per class of the lexicon (for the docs and tests)."""
    lex = LEXICON
    content = [*lex.nouns, *lex.adjs, *lex.verbs]
    return {
        "noun_classes": len(CLASSES),
        "nouns": len(lex.nouns),
        "hypernyms": len(lex.hypernyms),
        "adjectives": len(lex.adjs),
        "sentiment_adjectives": sum(1 for a in lex.adjs if a.polarity),
        "neutral_adjectives": sum(1 for a in lex.adjs if not a.polarity),
        "adjective_synsets": len(lex.adj_synsets),
        "antonym_pairs": len(lex.adj_synsets) // 2 + sum(1 for s in _VERBS if s[1]) // 2,
        "verbs": len(lex.verbs),
        "verb_synsets": len(lex.verb_synsets),
        "content_words": len(content),
        "surface_forms": len(lex.forms),
        "held_out_words": sum(1 for w in content if w.held_out),
    }
