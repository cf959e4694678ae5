"""Does synthetic text copy its training records? Exact duplicates, near duplicates by the longest common substring
(in words) with any training record, and canaries: records inserted into the training data on purpose (Carlini et
al., "The secret sharer: evaluating and testing unintended memorization in neural networks", USENIX Security 2019),
and how much of each a synthetic record reproduces.

The longest common substring of a text with a whole training set is found through an index of the training set's
word 4-grams: only records sharing a 4-gram with the text can share 4 or more consecutive words, and the longest
match with each of those is computed exactly (``difflib``); below 4 words it is reported as 3 or less ("< 4").
"""

from __future__ import annotations

import random
import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence
from difflib import SequenceMatcher
from typing import Any

SHINGLE = 4


def normalise(text: str) -> str:
    return " ".join(text.lower().split())


class TrainingIndex:
    """The training texts, their normalised set, and an index of their word 4-grams."""

    def __init__(self, texts: Sequence[str], candidates: int = 20) -> None:
        self.words = [normalise(t).split() for t in texts]
        self.exact = {" ".join(w) for w in self.words}
        self.candidates = candidates
        self.index: dict[tuple[str, ...], list[int]] = defaultdict(list)
        for i, w in enumerate(self.words):
            for gram in {tuple(w[j:j + SHINGLE]) for j in range(len(w) - SHINGLE + 1)}:
                self.index[gram].append(i)

    def longest_match(self, text: str) -> int:
        """The most consecutive words ``text`` shares with one training text (0 when below :data:`SHINGLE`)."""
        w = normalise(text).split()
        shared: Counter = Counter()
        for gram in {tuple(w[j:j + SHINGLE]) for j in range(len(w) - SHINGLE + 1)}:
            shared.update(self.index.get(gram, ()))
        best = 0
        for i, _ in shared.most_common(self.candidates):
            match = SequenceMatcher(None, w, self.words[i], autojunk=False).find_longest_match(0, len(w), 0,
                                                                                             len(self.words[i]))
            best = max(best, match.size)
        return best


def duplicates(texts: Sequence[str], index: TrainingIndex, near_words: int = 8) -> dict[str, Any]:
    """Exact duplicates of training records, near duplicates (a common substring of at least ``near_words`` words,
    or of the whole text when it is shorter and at least 4 words) and the distribution of the longest match."""
    matches = [index.longest_match(t) for t in texts]
    exact = [normalise(t) in index.exact for t in texts]
    lengths = [len(normalise(t).split()) for t in texts]
    near = [not e and m >= SHINGLE and (m >= near_words or m == n) for e, m, n in zip(exact, matches, lengths)]
    longest = sorted(range(len(texts)), key=lambda i: -matches[i])[:5]
    return {"texts": len(texts), "exact": sum(exact), "exact_fraction": sum(exact) / max(len(texts), 1),
            "near": sum(near), "near_fraction": sum(near) / max(len(texts), 1), "near_words": near_words,
            "longest_match_median": statistics.median(matches) if matches else 0,
            "longest_match_max": max(matches) if matches else 0, "longest_matches": matches,
            "examples": [{"text": texts[i], "longest_match": matches[i]} for i in longest if matches[i] >= SHINGLE]}


def canary_texts(count: int, seed: int) -> list[str]:
    """``count`` canary sentences, unlike any natural record: a fixed frame with random words and a random number
    (``seed``: which canaries; they are public test records, not secrets)."""
    rng = random.Random(seed)
    nouns = ["violet", "harbor", "quartz", "lantern", "meadow", "copper", "falcon", "orchid", "glacier", "saddle",
             "thimble", "walnut", "pepper", "anchor", "velvet", "ember"]
    return [f"my secret {rng.choice(nouns)} {rng.choice(nouns)} code is {rng.randrange(10**6):06d} "
            f"{rng.choice(nouns)}" for _ in range(count)]


def secret_of(text: str) -> str | None:
    """A canary's secret: its first word of at least 4 digits (``None`` without one)."""
    return next((w for w in text.split() if w.isdigit() and len(w) >= 4), None)


def canaries(texts: Sequence[str], inserted: Sequence[str]) -> dict[str, Any]:
    """For each canary: how many synthetic texts contain it whole, how many contain its secret (its number: a word
    of 6 digits), and the most consecutive words of it that one synthetic text reproduces."""
    normalised = [normalise(t) for t in texts]
    found = []
    for canary in inserted:
        c = normalise(canary)
        secret = secret_of(c)
        index = TrainingIndex([canary])
        found.append({"canary": canary, "words": len(c.split()), "reproduced": sum(c in t for t in normalised),
                      "secret_reproduced": sum(secret in t.split() for t in normalised) if secret else None,
                      "longest_match": max((index.longest_match(t) for t in texts), default=0)})
    return {"canaries": len(found), "reproduced": sum(1 for f in found if f["reproduced"]),
            "secrets_reproduced": sum(1 for f in found if f["secret_reproduced"]), "each": found}
