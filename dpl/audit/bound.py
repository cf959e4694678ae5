"""The statistics of a one-run audit: from membership guesses to a lower bound on epsilon.

Steinke, Nasr & Jagielski, "Privacy auditing with one (1) training run" (NeurIPS 2023), Theorem 5.2 /
Corollary 5.4: with ``r`` guesses of which ``v`` are right among ``m`` canaries, any (eps, delta)-DP mechanism gives
``P[v correct] <= f(v) + 2 m delta max_i (f(v - i) - f(v)) / i``, ``f(v) = P[Binomial(r, e^eps/(1+e^eps)) >= v]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import special, stats

from dpl.errors import ConfigError

# Fractions of m guessed "in" (k+) and "out" (k-) tried by default (Bonferroni over all of them).
DEFAULT_GUESS_FRACTIONS: tuple[tuple[float, float], ...] = (
    (0.01, 0.0), (0.02, 0.0), (0.05, 0.0), (0.1, 0.0), (0.2, 0.0), (0.3, 0.0), (0.45, 0.0), (0.05, 0.05))


def p_value(m: int, r: int, v: int, epsilon: float, delta: float = 0.0) -> float:
    """Probability bound of ``v`` or more correct guesses out of ``r`` (``m`` canaries) for an
    (epsilon, delta)-DP mechanism: ``f(v) + 2 m delta max_{i >= 1} (f(v - i) - f(v)) / i`` with
    ``f(v) = P[Binomial(r, e^eps / (1 + e^eps)) >= v]`` (the maximum is attained at some i <= v)."""
    m, r, v = int(m), int(r), int(v)
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got m={m}, r={r}, v={v}")
    if not (epsilon >= 0 and 0 <= delta <= 1):
        raise ValueError(f"need epsilon >= 0 and delta in [0, 1], got {epsilon}, {delta}")
    if v == 0:
        return 1.0
    q = float(special.expit(epsilon))
    beta = float(stats.binom.sf(v - 1, r, q))  # f(v) = P[W >= v]
    if delta == 0:
        return min(beta, 1.0)
    shifts = np.arange(1, v + 1)
    tails = stats.binom.sf(v - shifts - 1, r, q)  # f(v - i) = P[W >= v - i]
    alpha = float(np.max((tails - beta) / shifts))
    return min(beta + 2.0 * m * delta * alpha, 1.0)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float = 0.0, confidence: float = 0.95,
                        iterations: int = 60) -> float:
    """The largest epsilon rejected by ``v`` correct guesses out of ``r``: an (epsilon, delta)-DP mechanism with
    epsilon below it yields that many correct guesses with probability at most ``1 - confidence`` (the paper's
    test, Lemma 4.7 / Appendix D). Bisection on ``p_value`` (increasing in epsilon); returns the low end of the
    final bracket (conservative)."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    significance = 1.0 - confidence
    if p_value(m, r, v, 0.0, delta) > significance:
        return 0.0
    lo, hi = 0.0, 1.0
    while p_value(m, r, v, hi, delta) <= significance:
        lo, hi = hi, hi * 2
        if hi > 1e3:
            return lo
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        if p_value(m, r, v, mid, delta) <= significance:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class Guess:
    """One (k+, k-) candidate: ``r = k+ + k-`` guesses, ``v`` of them right, and the bound it gives alone at
    the Bonferroni-corrected confidence."""

    k_plus: int
    k_minus: int
    correct: int
    bound: float

    @property
    def guesses(self) -> int:
        return self.k_plus + self.k_minus


def guesses_for(m: int, fractions: Sequence[tuple[float, float]] | None = None,
                explicit: Sequence[Sequence[int]] | None = None) -> list[tuple[int, int]]:
    """The (k+, k-) candidates: ``explicit`` pairs, or ``fractions`` of m (default DEFAULT_GUESS_FRACTIONS)."""
    if explicit:
        pairs = [(int(p[0]), int(p[1])) for p in explicit]
    else:
        pairs = [(max(1, round(fp * m)) if fp > 0 else 0, max(1, round(fm * m)) if fm > 0 else 0)
                 for fp, fm in (fractions or DEFAULT_GUESS_FRACTIONS)]
    out = []
    for kp, km in pairs:
        if kp < 0 or km < 0 or kp + km == 0 or kp + km > m:
            raise ConfigError(f"bad guess counts (k+={kp}, k-={km}) for {m} canaries: need k+, k- >= 0 and "
                              f"1 <= k+ + k- <= m")
        if (kp, km) not in out:
            out.append((kp, km))
    return out


def score_guesses(scores: np.ndarray, included: np.ndarray, candidates: Sequence[tuple[int, int]], delta: float,
                  confidence: float) -> tuple[list[Guess], Guess]:
    """Guess "in" for the k+ highest scores and "out" for the k- lowest, for each candidate; the bound of each
    at confidence ``1 - (1 - confidence) / len(candidates)`` (Bonferroni); returns all and the best."""
    scores = np.asarray(scores, dtype=np.float64)
    included = np.asarray(included, dtype=bool)
    m = len(scores)
    # Ties are broken at random (a fixed permutation), so equal scores carry no information about membership.
    tie_break = np.random.default_rng(0).permutation(m)
    order = np.lexsort((tie_break, scores))[::-1]  # highest first
    per_test = 1.0 - (1.0 - confidence) / len(candidates)
    results = []
    for kp, km in candidates:
        if kp + km > m:
            raise ConfigError(f"k+ + k- = {kp + km} > m = {m}")
        top, bottom = order[:kp], order[m - km:] if km else order[:0]
        correct = int(included[top].sum() + (~included[bottom]).sum())
        results.append(Guess(kp, km, correct, epsilon_lower_bound(m, kp + km, correct, delta, per_test)))
    best = max(results, key=lambda g: (g.bound, g.correct))
    return results, best


def perfect_guess_ceiling(m: int, candidates: Sequence[tuple[int, int]], delta: float, confidence: float) -> float:
    """The largest bound these settings can give at all (every guess right): the audit's resolution."""
    per_test = 1.0 - (1.0 - confidence) / len(candidates)
    return max(epsilon_lower_bound(m, kp + km, kp + km, delta, per_test) for kp, km in candidates)
