"""METEOR 1.0 (Banerjee & Lavie, "METEOR: An Automatic Metric for MT Evaluation with Improved Correlation with
Human Judgments", 2005) in pure Python: exact and Porter-stem matching, no synonyms or paraphrases."""

from __future__ import annotations

import functools
import itertools
import math
from collections import defaultdict
from collections.abc import Iterable

# METEOR 1.0 parameters (Banerjee & Lavie, 2005).
_METEOR_ALPHA = 0.9
_METEOR_BETA = 3.0
_METEOR_GAMMA = 0.5
# Exhaustive search over equally large alignments up to this many candidates, greedy beyond.
_ALIGN_SEARCH_LIMIT = 64


@functools.cache
def _porter_stemmer():
    from nltk.stem.porter import PorterStemmer

    return PorterStemmer(mode=PorterStemmer.ORIGINAL_ALGORITHM)


@functools.lru_cache(maxsize=100_000)
def _stem(word: str) -> str:
    return _porter_stemmer().stem(word)


def meteor_python(hyps: list[list[str]], refs: list[list[list[str]]]) -> float:
    """Corpus METEOR 1.0 from the summed statistics of each input's best-scoring reference."""
    matches = hyp_len = ref_len = chunks = 0
    for hyp, input_refs in zip(hyps, refs):
        best = max((_meteor_stats(hyp, ref) for ref in input_refs), key=lambda s: s[0])
        _, m, h, r, ch = best
        matches, hyp_len, ref_len, chunks = matches + m, hyp_len + h, ref_len + r, chunks + ch
    return _meteor_score(matches, hyp_len, ref_len, chunks)


def _meteor_score(matches: int, hyp_len: int, ref_len: int, chunks: int) -> float:
    if matches == 0:
        return 0.0
    precision, recall = matches / hyp_len, matches / ref_len
    fmean = precision * recall / (_METEOR_ALPHA * precision + (1 - _METEOR_ALPHA) * recall)
    penalty = _METEOR_GAMMA * (chunks / matches) ** _METEOR_BETA
    return fmean * (1 - penalty)


def _meteor_stats(hyp: list[str], ref: list[str]) -> tuple[float, int, int, int, int]:
    """(segment score, matches, prediction length, reference length, chunks) of one pair."""
    alignment = meteor_align(hyp, ref)
    chunks = _count_chunks(alignment)
    return _meteor_score(len(alignment), len(hyp), len(ref), chunks), len(alignment), len(hyp), len(ref), chunks


def meteor_align(hyp: list[str], ref: list[str]) -> list[tuple[int, int]]:
    """METEOR 1.0 word alignment: an exact stage, then a Porter-stem stage on the unaligned words.

    In each stage only words with the same key (the word, then its stem) can be linked; the stage
    links as many words as possible and, among such alignments, picks one with the fewest crossing
    links (together with the links of earlier stages), then the fewest chunks.
    """
    aligned: list[tuple[int, int]] = []
    free_hyp, free_ref = set(range(len(hyp))), set(range(len(ref)))
    stem_hyp, stem_ref = [_stem(w) for w in hyp], [_stem(w) for w in ref]
    for hyp_keys, ref_keys in ((hyp, ref), (stem_hyp, stem_ref)):
        hyp_pos: dict[str, list[int]] = defaultdict(list)
        ref_pos: dict[str, list[int]] = defaultdict(list)
        for i in sorted(free_hyp):
            hyp_pos[hyp_keys[i]].append(i)
        for j in sorted(free_ref):
            ref_pos[ref_keys[j]].append(j)
        # Per key, the candidate link sets of maximal size. Linking a fixed subset of positions in
        # order never adds crossings, so only the choice of subset on the longer side matters.
        options: list[list[list[tuple[int, int]]]] = []
        for key, hs in hyp_pos.items():
            rs = ref_pos.get(key)
            if not rs:
                continue
            options.append(_subset_links(hs, rs))
        if not options:
            continue
        if math.prod(len(o) for o in options) <= _ALIGN_SEARCH_LIMIT:
            best = min(itertools.product(*options), key=lambda combo: _alignment_cost(aligned, _flat(combo)))
            chosen = _flat(best)
        else:  # too many combinations: choose key by key, in order of first occurrence
            chosen = []
            for key_options in options:
                chosen += min(key_options, key=lambda links: _alignment_cost(aligned + chosen, links))
        aligned += chosen
        free_hyp -= {i for i, _ in chosen}
        free_ref -= {j for _, j in chosen}
    return sorted(aligned)


def _subset_links(hs: list[int], rs: list[int]) -> list[list[tuple[int, int]]]:
    if len(hs) == len(rs):
        return [list(zip(hs, rs))]
    if math.comb(max(len(hs), len(rs)), min(len(hs), len(rs))) > _ALIGN_SEARCH_LIMIT:
        # Pathological repetition: keep the order-preserving alignment of the first occurrences.
        return [list(zip(hs, rs))]
    if len(hs) > len(rs):
        return [list(zip(sub, rs)) for sub in itertools.combinations(hs, len(rs))]
    return [list(zip(hs, sub)) for sub in itertools.combinations(rs, len(hs))]


def _flat(combo: Iterable[list[tuple[int, int]]]) -> list[tuple[int, int]]:
    return [link for links in combo for link in links]


def _alignment_cost(fixed: list[tuple[int, int]], new: list[tuple[int, int]]) -> tuple[int, int]:
    crossings = sum(1 for a, b in itertools.combinations(new, 2) if (a[0] - b[0]) * (a[1] - b[1]) < 0)
    crossings += sum(1 for a in new for b in fixed if (a[0] - b[0]) * (a[1] - b[1]) < 0)
    return crossings, _count_chunks(sorted(fixed + new))


def _count_chunks(alignment: list[tuple[int, int]]) -> int:
    """Fewest runs of links adjacent in both the prediction and the reference (sorted input)."""
    chunks = 0
    previous = None
    for i, j in alignment:
        if previous is None or (i, j) != (previous[0] + 1, previous[1] + 1):
            chunks += 1
        previous = (i, j)
    return chunks
