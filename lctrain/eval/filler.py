"""Offline haystack text: seeded essay-like prose, a repeated noise paragraph, and pseudo-words.

RULER fills its haystacks with a repeated noise paragraph and Paul Graham essays. Neither may be downloaded here, so
the essays are generated from a small grammar: varied, natural-looking English whose content never answers a task's
question, deterministic for a given seed.
"""

from __future__ import annotations

import random

NOISE_PARAGRAPH = (
    "The river runs down to the sea. The hills are quiet in the evening. The wind moves across the field. "
    "Here the road bends again. Back and forth we go."
)

_SUBJECTS = (
    "the founder",
    "a small team",
    "the engineer",
    "every investor",
    "the committee",
    "a curious student",
    "the old gardener",
    "the city council",
    "a good editor",
    "the new manager",
    "most writers",
    "the teacher",
    "a careful reader",
    "the board",
    "our neighbour",
    "the historian",
    "a young painter",
    "the mechanic",
    "the crew",
    "a patient doctor",
    "the village",
    "the startup",
    "the library",
    "an early customer",
)
_VERBS = (
    "noticed",
    "built",
    "questioned",
    "described",
    "ignored",
    "rewrote",
    "measured",
    "planned",
    "discovered",
    "explained",
    "admired",
    "postponed",
    "simplified",
    "copied",
    "defended",
    "tested",
    "sketched",
    "funded",
    "remembered",
    "shared",
    "doubted",
    "studied",
    "repaired",
    "finished",
)
_OBJECTS = (
    "the first draft",
    "an unusual idea",
    "the old bridge",
    "a quiet garden",
    "the weekly report",
    "a simple tool",
    "the map of the valley",
    "a long letter",
    "the budget",
    "an honest answer",
    "the prototype",
    "a familiar song",
    "the morning schedule",
    "the broken clock",
    "a hard problem",
    "the museum guide",
    "a better method",
    "the harvest",
    "the winter plan",
    "a short essay",
    "the kitchen table",
    "the recipe",
)
_TAILS = (
    "before anyone else did",
    "without much help",
    "after a long winter",
    "in the spring",
    "for the second time",
    "with surprising care",
    "while the rain kept falling",
    "because it seemed useful",
    "in a single afternoon",
    "despite the noise outside",
    "as everyone expected",
    "long after the deadline",
    "on a Tuesday",
    "with a borrowed pencil",
    "near the harbour",
    "at the end of the season",
    "for reasons nobody recalled",
)
_OPENERS = (
    "",
    "",
    "",
    "In practice, ",
    "Of course, ",
    "Later, ",
    "Surprisingly, ",
    "At first, ",
    "Even so, ",
    "For a while, ",
    "In the end, ",
    "Meanwhile, ",
)
_REMARKS = (
    "It is easy to forget how much work that takes.",
    "Nobody wrote it down at the time.",
    "That is usually how these things begin.",
    "The lesson was not obvious then.",
    "It took years to see why it mattered.",
    "Most people would have stopped there.",
    "The details turned out to be the hard part.",
    "It was not the last time this happened.",
)

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gl", "pl", "st", "tr")
_VOWELS = ("a", "e", "i", "o", "u")


def essay_sentence(rng: random.Random) -> str:
    if rng.random() < 0.12:
        return rng.choice(_REMARKS)
    opener = rng.choice(_OPENERS)
    subject = rng.choice(_SUBJECTS)
    if opener:
        first = subject
    else:
        first = subject[0].upper() + subject[1:]
    return f"{opener}{first} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}."


class Essay:
    """An endless, seeded stream of essay sentences; `sentences(n)` is always a prefix of `sentences(n + 1)`."""

    def __init__(self, seed: int | str):
        self._rng = random.Random(f"essay:{seed}")
        self._cache: list[str] = []

    def sentences(self, n: int) -> list[str]:
        while len(self._cache) < n:
            self._cache.append(essay_sentence(self._rng))
        return self._cache[:n]


def pseudo_words(rng: random.Random, n: int, syllables: tuple[int, int] = (2, 3)) -> list[str]:
    """`n` distinct pronounceable made-up words (lower case), e.g. 'dravomi'."""
    seen: set[str] = set()
    out: list[str] = []
    while len(out) < n:
        k = rng.randint(*syllables)
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(k))
        if word not in seen:
            seen.add(word)
            out.append(word)
    return out
