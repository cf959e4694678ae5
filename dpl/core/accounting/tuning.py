"""Privacy of private hyperparameter tuning: run K independent private trainings, K random, release only the best.

Papernot & Steinke, "Hyperparameter tuning with Rényi differential privacy" (ICLR 2022, arXiv 2110.03620): let Q be a
randomized algorithm (one trial: a configuration drawn uniformly from a fixed search space, one private training,
its score) whose outputs are totally ordered by the score. A draws K from a distribution, runs Q K times with fresh
randomness and outputs only the best run (with its score); nothing else - not K, not the other runs.

* **Theorem 2** (truncated negative binomial K ~ D_{η,γ}, η > -1, γ ∈ (0, 1)): if Q is (λ, ε)-RDP and (λ̂, ε̂)-RDP
  (λ ∈ (1, ∞), λ̂ ∈ [1, ∞)), A is (λ, ε')-RDP with
  ε' = ε + (1 + η)(1 - 1/λ̂) ε̂ + (1 + η) log(1/γ) / λ̂ + log(E[K]) / (λ - 1).
  η = 1 is the geometric distribution, η = 0 the logarithmic one. **Corollary 3**: for ε-DP Q, A is (2 + η)ε-DP.
  **Corollary 4**: for ρ-zCDP Q (ρ ≤ log(1/γ)), ε'(λ) = ρ(λ - 1) + log E[K]/(λ - 1) + 2(1 + η)√(ρ log(1/γ)) - ηρ.
* **Theorem 6** (K ~ Poisson(μ), μ > 0; K = 0 releases nothing): if Q is (λ, ε)-RDP and (ε̂, δ̂)-DP with
  e^ε̂ ≤ 1 + 1/(λ - 1), A is (λ, ε')-RDP with ε' = ε + μ δ̂ + log(μ) / (λ - 1).

Liu & Talwar, "Private selection from private candidates" (STOC 2019): with geometric K (stop after each run with
probability γ) and ε-DP candidates (δ = 0), the best is 3ε-DP (Papernot & Steinke's Corollary 3 with η = 1).

Here Q's RDP curve is given on a grid of orders (:data:`ORDERS`); λ̂ ranges over the grid and 1, λ over the grid, the
tuned curve is made monotone in the order (Rényi divergences do not decrease with the order) and converted to (ε, δ)
with the conversion dpl uses everywhere (:func:`dpl.core.accounting.rdp._rdp_to_epsilon`). Nothing here is secret
except the value of K, which :meth:`TrialDistribution.sample` draws from OS entropy.
"""

from __future__ import annotations

import functools
import math
import secrets
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from dpl.core.accounting.common import RDP_ORDERS, Segment, _check_delta
from dpl.core.accounting.rdp import _INT_ORDERS, _int_rdp_per_step, _rdp_to_epsilon

#: Fractional orders (opacus' analysis): 1.05 to 2.95 by 0.05 (a trial with a large epsilon has its best orders
#: there), then opacus' own up to 10.9.
FRACTIONAL_ORDERS: tuple[float, ...] = tuple(sorted({round(1 + x / 20, 2) for x in range(1, 40)}
                                                    | {a for a in RDP_ORDERS if a < 11}))
#: Orders of the tuned release: :data:`FRACTIONAL_ORDERS` and dpl's integer orders from 2 to 256.
ORDERS: np.ndarray = np.array(sorted(set(FRACTIONAL_ORDERS) | set(_INT_ORDERS.tolist())), dtype=np.float64)
#: Largest mean number of trials accepted (the Poisson pmf's first term e^-μ must stay a normal float).
MAX_MEAN = 500.0


def secure_uniform() -> float:
    """A uniform in [0, 1) with 53 random bits from OS entropy."""
    return secrets.randbits(53) / 2.0**53


@dataclass(frozen=True)
class TrialDistribution:
    """The distribution of the number of trials K: ``poisson`` (parameter ``mu``) or the truncated negative binomial
    ``negative_binomial`` D_{η,γ} on {1, 2, ...} (Papernot & Steinke, Definition 1), of which ``geometric`` (η = 1)
    and ``logarithmic`` (η = 0) are special cases; or ``fixed`` (K = ``trials``, public: plain composition).

    D_{η,γ}: P[K = k] = (1-γ)^k / (γ^-η - 1) · ∏_{l<k} (l + η)/(l + 1) for η ≠ 0, (1-γ)^k / (k log(1/γ)) for η = 0;
    E[K] = η(1 - γ) / (γ(1 - γ^η)) for η ≠ 0, (1/γ - 1) / log(1/γ) for η = 0.
    """

    kind: str
    eta: float | None = None
    gamma: float | None = None
    mu: float | None = None
    trials: int | None = None

    @property
    def mean(self) -> float:
        """E[K]."""
        if self.kind == "poisson":
            return float(self.mu)
        if self.kind == "fixed":
            return float(self.trials)
        return _tnb_mean(self.eta, self.gamma)

    def pmf(self, k: int) -> float:
        """P[K = k]."""
        return float(self.pmf_table(k + 1)[k]) if k >= 0 else 0.0

    def pmf_table(self, n: int) -> np.ndarray:
        """P[K = k] for k = 0 .. n-1."""
        out = np.zeros(n)
        if self.kind == "fixed":
            out[self.trials:self.trials + 1] = 1.0
            return out
        k, p = self._start(), self._first()
        while k < n and p > 0.0:
            out[k] = p
            p *= self._ratio(k)
            k += 1
        return out

    def sample(self, uniform: Callable[[], float] = secure_uniform) -> int:
        """One draw of K by inversion of the cumulative distribution at ``uniform()`` (OS entropy by default)."""
        if self.kind == "fixed":
            return int(self.trials)
        u = uniform()
        k, p = self._start(), self._first()
        total = p
        while u >= total and p > 0.0:
            p *= self._ratio(k)
            k += 1
            total += p
        return k

    def describe(self) -> dict[str, float | str]:
        """The parameters, for the report."""
        if self.kind == "poisson":
            return {"distribution": "poisson", "mu": self.mu, "expected_trials": self.mean}
        if self.kind == "fixed":
            return {"distribution": "fixed", "trials": self.trials, "expected_trials": self.mean}
        name = {1.0: "geometric", 0.0: "logarithmic"}.get(float(self.eta), "negative-binomial")
        return {"distribution": name, "eta": self.eta, "gamma": self.gamma, "expected_trials": self.mean}

    def _start(self) -> int:
        return 0 if self.kind == "poisson" else 1

    def _first(self) -> float:
        if self.kind == "poisson":
            return math.exp(-self.mu)
        eta, gamma = self.eta, self.gamma
        if eta == 0:
            return (1 - gamma) / -math.log(gamma)
        return (1 - gamma) * eta / math.expm1(-eta * math.log(gamma))  # (1-γ) η / (γ^-η - 1)

    def _ratio(self, k: int) -> float:
        """P[K = k + 1] / P[K = k]."""
        if self.kind == "poisson":
            return self.mu / (k + 1)
        return (1 - self.gamma) * (k + self.eta) / (k + 1)


def poisson(mean: float) -> TrialDistribution:
    """K ~ Poisson(``mean``) (K = 0 possible: then nothing is released)."""
    mean = _check_mean(mean, 0.0)
    return TrialDistribution("poisson", mu=mean)


def fixed(trials: int) -> TrialDistribution:
    """K = ``trials``, not random: the release costs the composition of the trials (for comparison, and for few or
    very private trials, where the composition can be the smaller bound)."""
    if isinstance(trials, bool) or not float(trials).is_integer() or trials < 1:
        raise ValueError(f"a fixed number of trials must be an integer >= 1, got {trials!r}")
    return TrialDistribution("fixed", trials=int(trials))


def negative_binomial(mean: float, eta: float) -> TrialDistribution:
    """K ~ D_{η,γ} with γ chosen so that E[K] = ``mean`` (> 1); η > -1."""
    if not (isinstance(eta, (int, float)) and math.isfinite(eta) and eta > -1):
        raise ValueError(f"the shape eta must be a number > -1, got {eta!r}")
    mean = _check_mean(mean, 1.0)
    return TrialDistribution("negative_binomial", eta=float(eta), gamma=_gamma_for_mean(mean, float(eta)))


def geometric(mean: float) -> TrialDistribution:
    """K geometric on {1, 2, ...} with E[K] = ``mean``: D_{1,γ}, γ = 1/mean."""
    mean = _check_mean(mean, 1.0)
    return TrialDistribution("negative_binomial", eta=1.0, gamma=1.0 / mean)


def logarithmic(mean: float) -> TrialDistribution:
    """K logarithmic on {1, 2, ...} with E[K] = ``mean``: D_{0,γ}."""
    return negative_binomial(mean, 0.0)


def _check_mean(mean: float, above: float) -> float:
    if isinstance(mean, bool) or not isinstance(mean, (int, float)) or not math.isfinite(mean) or mean <= above:
        kind = "positive" if above == 0 else f"above {above:g} (K >= 1 always)"
        raise ValueError(f"the mean number of trials must be {kind}, got {mean!r}")
    if mean > MAX_MEAN:
        raise ValueError(f"the mean number of trials must be at most {MAX_MEAN:g}, got {mean!r}")
    return float(mean)


def _tnb_mean(eta: float, gamma: float) -> float:
    log_gamma = math.log(gamma)
    if log_gamma == 0:
        return 1.0  # γ = 1: K = 1
    if eta == 0:
        return (1 / gamma - 1) / -log_gamma
    return eta * (1 / gamma - 1) / -math.expm1(eta * log_gamma)  # η(1-γ) / (γ(1 - γ^η))


def _gamma_for_mean(mean: float, eta: float) -> float:
    """γ ∈ (0, 1) with E[K] = mean under D_{η,γ} (E[K] decreases in γ), by bisection on log γ."""
    lo, hi = -745.0, -1e-300  # log γ; E[K] is +inf-like at lo and 1 at hi
    for _ in range(200):
        mid = (lo + hi) / 2
        if _tnb_mean(eta, math.exp(mid)) > mean:
            lo = mid
        else:
            hi = mid
    return math.exp(hi)


# ------------------------------------------------------------------------------------------------ one trial's curve


def subsampled_gaussian_rdp(segments: Sequence[Segment | tuple[float, float, int]]) -> np.ndarray:
    """RDP at :data:`ORDERS` of one trial: the composition of its Poisson-subsampled Gaussian steps, each segment
    ``(noise_multiplier, sample_rate, steps)``. Per step: opacus' analysis at :data:`FRACTIONAL_ORDERS`, the exact
    integer-order sum (Mironov, Talwar & Zhang 2019) at the integer orders; the smaller where both apply."""
    total = np.zeros(len(ORDERS))
    for sigma, q, steps in segments:
        if steps:
            total = total + int(steps) * (_per_step(float(sigma), float(q)) if sigma > 0 else np.inf)
    return total


@functools.lru_cache(maxsize=64)
def _per_step(sigma: float, q: float) -> np.ndarray:
    from opacus.accountants.analysis import rdp as opacus_rdp

    per_order: dict[float, float] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fractional = opacus_rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=list(FRACTIONAL_ORDERS))
    for a, v in zip(FRACTIONAL_ORDERS, fractional):
        per_order[float(a)] = float(v)
    for a, v in zip(_INT_ORDERS.tolist(), _int_rdp_per_step(sigma, q)):
        per_order[float(a)] = min(per_order.get(float(a), math.inf), float(v))
    out = np.array([per_order[float(a)] for a in ORDERS])
    out.setflags(write=False)
    return out


# ------------------------------------------------------------------------------------------- the tuned release


def negative_binomial_rdp(orders: np.ndarray, rdp: np.ndarray, eta: float, gamma: float) -> np.ndarray:
    """RDP at ``orders`` of the best of K ~ D_{η,γ} runs of a mechanism with RDP ``rdp`` at ``orders`` (Papernot &
    Steinke, Theorem 2): ε'(λ) = ε(λ) + (1+η) min_λ̂ [(1 - 1/λ̂) ε(λ̂) + log(1/γ)/λ̂] + log E[K]/(λ - 1), λ̂ over
    ``orders`` and λ̂ = 1 (where the first term vanishes: any finite KL divergence will do), then made monotone."""
    orders, rdp = _curve(orders, rdp)
    log_inv_gamma = -math.log(gamma)
    with np.errstate(invalid="ignore"):
        hat = np.min(np.append((1 - 1 / orders) * rdp + log_inv_gamma / orders, log_inv_gamma))
        out = rdp + (1 + eta) * hat + math.log(_tnb_mean(eta, gamma)) / (orders - 1)
    return _monotone(orders, np.where(orders > 1, out, np.inf))


def poisson_rdp(orders: np.ndarray, rdp: np.ndarray, mu: float,
                trial_delta: Callable[[float], float] | None = None) -> np.ndarray:
    """RDP at ``orders`` of the best of K ~ Poisson(μ) runs (nothing when K = 0) of a mechanism with RDP ``rdp`` at
    ``orders`` (Papernot & Steinke, Theorem 6): ε'(λ) = ε(λ) + μ δ̂ + log(μ)/(λ - 1), where the mechanism is
    (ε̂, δ̂)-DP with ε̂ = log(1 + 1/(λ - 1)) (the largest the theorem allows). ``trial_delta(ε̂)`` gives δ̂; by default
    the RDP curve's own conversion (:func:`rdp_to_delta`). Made monotone in the order."""
    orders, rdp = _curve(orders, rdp)
    delta_of = trial_delta if trial_delta is not None else (lambda eps: rdp_to_delta(orders, rdp, eps))
    out = np.full(len(orders), np.inf)
    for i, lam in enumerate(orders):
        if lam <= 1 or not math.isfinite(rdp[i]):
            continue
        eps_hat = math.log1p(1 / (lam - 1))
        out[i] = rdp[i] + mu * min(1.0, delta_of(eps_hat)) + math.log(mu) / (lam - 1)
    return _monotone(orders, out)


def rdp_to_delta(orders: np.ndarray, rdp: np.ndarray, epsilon: float) -> float:
    """δ such that RDP ``rdp`` at ``orders`` implies (ε, δ)-DP: the inverse of the conversion
    :func:`~dpl.core.accounting.rdp._rdp_to_epsilon` uses (Balle et al. 2020, Theorem 21), minimised over orders."""
    orders, rdp = _curve(orders, rdp)
    ok = (orders > 1) & np.isfinite(rdp)
    if not ok.any():
        return 1.0
    a, r = orders[ok], rdp[ok]
    log_delta = (a - 1) * (r - epsilon + np.log1p(-1 / a)) - np.log(a)
    return float(min(1.0, math.exp(min(0.0, float(np.min(log_delta))))))


def tuned_epsilon(distribution: TrialDistribution, orders: np.ndarray, rdp: np.ndarray, delta: float,
                  trial_delta: Callable[[float], float] | None = None) -> float:
    """ε at ``delta`` of the best of K ~ ``distribution`` runs of a mechanism with RDP ``rdp`` at ``orders``."""
    delta = _check_delta(delta)
    orders, rdp = _curve(orders, rdp)
    if distribution.kind == "fixed":
        return fixed_trials_epsilon(orders, rdp, distribution.trials, delta)
    if distribution.kind == "poisson":
        tuned = poisson_rdp(orders, rdp, distribution.mu, trial_delta)
    else:
        tuned = negative_binomial_rdp(orders, rdp, distribution.eta, distribution.gamma)
    return _rdp_to_epsilon(orders, tuned, delta)


def fixed_trials_epsilon(orders: np.ndarray, rdp: np.ndarray, trials: int, delta: float) -> float:
    """ε at ``delta`` of releasing (the best of) a fixed number of runs: their composition, for comparison."""
    orders, rdp = _curve(orders, rdp)
    return _rdp_to_epsilon(orders, trials * rdp, _check_delta(delta))


def liu_talwar_epsilon(trial_epsilon: float, trial_delta: float = 0.0) -> float:
    """ε of the best of a geometric number of ε-DP runs (Liu & Talwar, STOC 2019; Papernot & Steinke's Corollary 3
    with η = 1): 3ε, for pure DP only. Runs with δ > 0 (every Gaussian mechanism, so DP-SGD) are refused: the pure
    bound does not hold for them."""
    if trial_delta > 0:
        raise ValueError(f"liu-talwar needs trials that are epsilon-DP with delta = 0 (pure DP); these trials have "
                         f"delta = {trial_delta:.3g} (the Gaussian mechanism is never pure DP): use papernot-steinke")
    if not trial_epsilon >= 0:
        raise ValueError(f"the trials' epsilon must be >= 0, got {trial_epsilon!r}")
    return 3.0 * trial_epsilon


def _curve(orders: np.ndarray, rdp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    orders, rdp = np.asarray(orders, dtype=np.float64), np.asarray(rdp, dtype=np.float64)
    if orders.shape != rdp.shape or orders.ndim != 1 or not len(orders):
        raise ValueError("orders and rdp must be 1-D arrays of the same, non-zero length")
    if (orders < 1).any():
        raise ValueError("RDP orders must be >= 1")
    return orders, rdp


def _monotone(orders: np.ndarray, values: np.ndarray) -> np.ndarray:
    """RDP at order λ is at most RDP at any larger order: at each order, the smallest value at it or above."""
    idx = np.argsort(orders, kind="stable")
    out = np.empty_like(values)
    out[idx] = np.minimum.accumulate(values[idx][::-1])[::-1]
    return out
