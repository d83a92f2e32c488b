"""Random news-like texts for tests that need many distinct documents (seeded)."""

from __future__ import annotations

import random

WORDS = [
    "harbour",
    "ferry",
    "council",
    "minister",
    "budget",
    "election",
    "storm",
    "river",
    "bank",
    "market",
    "price",
    "oil",
    "gas",
    "court",
    "judge",
    "police",
    "report",
    "school",
    "hospital",
    "train",
    "station",
    "airport",
    "strike",
    "union",
    "vote",
]


def random_text(rng: random.Random, chars: int) -> str:
    """A sentence of at least ``chars`` characters drawn from WORDS."""
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < chars:
        words.append(rng.choice(WORDS))
    return " ".join(words).capitalize() + "."
