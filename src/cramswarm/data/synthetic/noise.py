"""A noisier variant of the synthetic corpus, for the data ablation (Table 2) at mini scale.

Web corpora such as C4 carry what the paper's filters remove. :func:`with_noise` mixes three kinds into the
clean synthetic documents:

* **trash** (share ``trash_share``): number tables, markup with random ids, lists of URLs and hashes, text
  that a tokenizer trained on the corpus cuts into many short tokens (the trash filter's target);
* **duplicates** (share ``duplicate_share``): exact copies of an earlier document, copies with a short
  tail appended ("read more ."), and site boilerplate repeated verbatim (the dedup filter's target).

Each document slot holds either a clean document or a noise one, so ``corpus_documents`` stays the total.
Deterministic per seed.
"""

from __future__ import annotations

import random
import string
from collections import deque
from typing import Iterable, Iterator

BOILERPLATE = (
    "we use cookies to improve your experience . by continuing to browse you accept our cookie policy . "
    "privacy settings . accept all . reject all . manage preferences .",
    "subscribe to our newsletter for the latest news and offers . enter your email address . sign up now . "
    "you can unsubscribe at any time . all rights reserved .",
    "home | about us | contact | terms of service | privacy policy | sitemap | follow us on social media . "
    "copyright all rights reserved .",
)
TAILS = ("read more .", "share this story .", "click here to continue reading .", "continue .")
_ALNUM = string.ascii_lowercase + string.digits


def _token(rng: random.Random, k: int) -> str:
    return "".join(rng.choice(_ALNUM) for _ in range(k))


def _number(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.4:
        return f"{rng.uniform(0, 1000):.{rng.randint(1, 4)}f}"
    if kind < 0.7:
        return f"{rng.randint(1000, 9_999_999):,}"
    return f"{rng.randint(0, 100)}%"


def trash_document(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:  # a number table
        cols = rng.randint(3, 7)
        rows = [" | ".join(_number(rng) for _ in range(cols)) for _ in range(rng.randint(5, 20))]
        return f"table {rng.randint(1, 99)} . " + " ; ".join(rows)
    if kind == 1:  # markup with generated ids
        items = [
            f'<div class="{_token(rng, 6)}"><a href="/{_token(rng, 4)}/{_token(rng, 8)}.html" id="{_token(rng, 5)}">'
            f"{_token(rng, rng.randint(3, 9))}</a></div>"
            for _ in range(rng.randint(4, 15))
        ]
        return "".join(items)
    urls = [
        f"https://{_token(rng, 5)}.{rng.choice(('com', 'net', 'org'))}/{_token(rng, 3)}/{_token(rng, 12)}"
        f"?id={rng.randint(0, 10**8)}&v={_token(rng, 6)}"
        for _ in range(rng.randint(4, 15))
    ]
    return " ".join(urls)


def with_noise(documents: Iterable[str], trash_share: float, duplicate_share: float, seed: int) -> Iterator[str]:
    """Replace a ``trash_share`` of the documents by trash and a ``duplicate_share`` by (near-)duplicates."""
    if not (0 <= trash_share and 0 <= duplicate_share and trash_share + duplicate_share <= 1):
        raise ValueError(f"noise shares must be >= 0 and sum to <= 1, got {trash_share} + {duplicate_share}")
    rng = random.Random(f"noise/{seed}")
    recent: deque[str] = deque(maxlen=512)  # clean documents a duplicate copies (bounded memory)
    for doc in documents:
        draw = rng.random()
        if draw < trash_share:
            yield trash_document(rng)
        elif draw < trash_share + duplicate_share and recent:
            kind = rng.random()
            if kind < 0.25:
                yield rng.choice(BOILERPLATE)
            elif kind < 0.6:
                yield rng.choice(recent)
            else:
                yield f"{rng.choice(recent)} {rng.choice(TAILS)}"
        else:
            recent.append(doc)
            yield doc
