"""User-level accounting of example-level sampling (ELS): Charles et al., "Fine-tuning large language models with
user-level differential privacy" (SaTML 2025).

Each user is bounded to at most ``k`` rows; rows are Poisson-sampled at rate ``q``, clipped to C, and N(0, sigma^2 C^2)
noise is added to the sum. Adjacency: add/remove one whole user. The number M of the user's rows in a batch is
Binomial(k, q); in the worst case their clipped gradients align, so one step is the pair (in units of C)

    P = sum_m w_m N(m, sigma^2),  w_m = Binom(m; k, q),        Q = N(0, sigma^2),

a mixture-of-Gaussians mechanism (``k = 1``: the Poisson-subsampled Gaussian). Its privacy loss
L(x) = log(P(x) / Q(x)) = log sum_m w_m exp((2 m x - m^2) / (2 sigma^2)) is increasing (and convex) in x, so the
privacy random variable of *remove* (Y = L(x), x ~ P) has cdf sum_m w_m Phi((x(t) - m) / sigma), and that of *add*
(Y' = -L(x), x ~ Q) has cdf Phi(-x(-t) / sigma), with x(t) the inverse of L (vectorised Newton on the convex
log-sum-exp, started from a point right of the root). Both directions are composed ``steps`` times with the PRV
machinery of :mod:`~dpl.core.accounting.prv` (Gopi, Lee & Wutschitz, "Numerical composition of differential privacy",
NeurIPS 2021: same grid, mean-preserving cell-centred discretisation, FFT composition, error terms) and the larger
upper bound (epsilon at ``delta - delta_error`` plus ``eps_error``) is returned: no dominance of one direction is
assumed.

Domain size, ``eps_error`` and the calibration's proxy come from a Chernoff bound on the composed loss,
P(sum Y > eps) <= steps * P(Y > t_cap) + exp(steps log E[e^(lam Y); Y <= t_cap] - lam eps), with the moment
generating function bounded from the exact cell masses of one step (``k == 1``: the subsampled Gaussian's RDP bound,
as in :mod:`~dpl.core.accounting.prv`). Renyi divergences themselves are useless here: the event that all k rows are
sampled (probability q^k) makes them grow like alpha k^2 / (2 sigma^2). Where PRV fails, the Chernoff bound (a valid,
looser upper bound) is returned with a logged warning.

:func:`group_privacy` is the loose alternative: a row-level guarantee converted to a group of k rows.
"""

from __future__ import annotations

import functools
import math
import numbers
import warnings
from typing import Any

import numpy as np
from scipy import special

from dpl.core.accounting.calibration import smallest_noise_multiplier
from dpl.core.accounting.common import (
    DELTA_ERROR_FRACTION,
    _check_delta,
    _check_epsilon,
    _check_rate,
    _check_sigma,
    _check_steps,
    _real,
    _warn_once,
)
from dpl.core.accounting.prv import _epsilon_bounds, _legendre, grid_domain, prv_error_for
from dpl.core.accounting.rdp import _int_rdp_epsilon

_NEWTON_MAX_ITER = 100


def _logsumexp(z: np.ndarray) -> np.ndarray:
    """log sum exp along the last axis (finite maxima; faster than scipy's for these shapes)."""
    zmax = z.max(axis=-1)
    with np.errstate(invalid="ignore"):
        out = zmax + np.log(np.exp(z - zmax[..., None]).sum(axis=-1))
    return np.where(np.isneginf(zmax), -np.inf, out)


def _check_rows(x: Any) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 1:
        raise ValueError(f"max_rows must be an integer >= 1, got {x!r}")
    return int(x)


class _Mixture:
    """The ELS pair for (sigma, q, k): weights w_m = Binom(m; k, q) of N(m, sigma^2) against N(0, sigma^2)."""

    def __init__(self, sigma: float, q: float, k: int) -> None:
        self.sigma, self.q, self.k = sigma, q, k
        m = np.arange(k + 1, dtype=np.float64)
        with np.errstate(divide="ignore"):
            log_w = special.gammaln(k + 1) - special.gammaln(m + 1) - special.gammaln(k - m + 1) \
                + special.xlogy(m, q) + special.xlog1py(k - m, -q)
        keep = np.isfinite(log_w)  # q == 1: only m == k
        self.m, self.log_w = m[keep], log_w[keep]
        self.w = np.exp(self.log_w)
        self.log_w0 = float(log_w[0])  # inf L(x) = log w_0 (-inf when q == 1)
        # L(x) = log(w_0 + exp(G(y))), y = x / sigma^2, G(y) = logsumexp_{m >= 1}(a_m + m y)
        pos = self.m > 0
        self.mp, self.a = self.m[pos], self.log_w[pos] - self.m[pos] ** 2 / (2 * sigma**2)

    def loss(self, x: np.ndarray) -> np.ndarray:
        """L(x) = log(P(x) / Q(x))."""
        z = self.log_w[None, :] + (2 * self.m[None, :] * x[:, None] - self.m[None, :] ** 2) / (2 * self.sigma**2)
        return _logsumexp(z)

    def x_of(self, levels: np.ndarray) -> np.ndarray:
        """The inverse of L: x with L(x) = level; -inf where level <= log w_0, +inf where level is +inf.

        Solves G(y) = tau = log(e^level - w_0) by Newton's method on the convex, increasing G (slope in [1, k]),
        started at y0 = min_m (tau - a_m) / m, where every term is <= tau, so G(y0) in [tau, tau + log k]: the
        iterates decrease monotonically to the root (at most log k away).
        """
        levels = np.asarray(levels, dtype=np.float64)
        out = np.full(levels.shape, -np.inf)
        with np.errstate(all="ignore"):
            tau = levels + np.log(-np.expm1(self.log_w0 - levels))
        ok = np.isfinite(tau) & (levels > self.log_w0)
        out[levels == np.inf] = np.inf
        tau = tau[ok]
        y = np.min((tau[:, None] - self.a[None, :]) / self.mp[None, :], axis=1)
        active = np.arange(len(y))
        for _ in range(_NEWTON_MAX_ITER):
            if not len(active):
                break
            ya = y[active]
            z = self.a[None, :] + self.mp[None, :] * ya[:, None]
            zmax = z.max(axis=1)
            e = np.exp(z - zmax[:, None])
            s = e.sum(axis=1)
            g = zmax + np.log(s)
            slope = (e @ self.mp) / s
            step = (g - tau[active]) / slope
            y[active] = ya - step
            done = ~(np.abs(step) > 1e-9 * np.maximum(1.0, np.abs(ya)))  # quadratic: the next step is < 1e-16
            active = active[~done]
        out[ok] = self.sigma**2 * y
        return out

    # ----- the two privacy random variables: remove (Y = L(x), x ~ P) and add (Y' = -L(x), x ~ Q)

    def cell_masses(self, edges: np.ndarray, add: bool) -> np.ndarray:
        """Probability of each [edges[i], edges[i+1]] under the PRV of one direction.

        Cdf differences left of t = 0, survival-function differences right of it (full relative precision in the
        right tail), the cell around 0 from both; as :func:`dpl.core.accounting.prv._cell_masses`.
        """
        sigma = self.sigma
        c = int(np.searchsorted(edges, 0.0))  # edges[:c] < 0 <= edges[c:]
        lo, hi = edges[:c], edges[c:]
        if add:  # Y' <= t  <=>  L(x) >= -t  <=>  x >= x(-t), x ~ N(0, sigma^2)
            x_lo, x_hi = self.x_of(-lo), self.x_of(-hi)
            cdf = special.ndtr(-x_lo / sigma)
            sf = special.ndtr(x_hi / sigma)
        else:  # Y <= t  <=>  x <= x(t), x ~ sum_m w_m N(m, sigma^2)
            x_lo, x_hi = self.x_of(lo), self.x_of(hi)
            cdf = special.ndtr((x_lo[:, None] - self.m[None, :]) / sigma) @ self.w
            sf = special.ndtr((self.m[None, :] - x_hi[:, None]) / sigma) @ self.w
        masses = np.empty(len(edges) - 1)
        masses[: c - 1] = np.diff(cdf)
        masses[c:] = -np.diff(sf)
        if 0 < c < len(edges):
            masses[c - 1] = (1 - sf[0]) - cdf[-1]
        return masses

    def truncated_mean(self, t_min: float, t_max: float, add: bool) -> float:
        """E[Y | t_min <= Y <= t_max] of one direction's PRV: Gauss-Legendre over the interval of x (L is
        monotone), per Gaussian component, intersected with its mean +- 14 sigma."""
        sigma = self.sigma
        if add:
            x_lo, x_hi = (float(v) for v in self.x_of(np.array([-t_max, -t_min])))
            components, sign = ((1.0, 0.0),), -1.0
        else:
            x_lo, x_hi = (float(v) for v in self.x_of(np.array([t_min, t_max])))
            components, sign = tuple(zip(self.w.tolist(), self.m.tolist())), 1.0
        nodes, weights = _legendre()
        num = mass = 0.0
        for w, mu in components:
            a, b = max(x_lo, mu - 14 * sigma), min(x_hi, mu + 14 * sigma)
            if a < b:
                x = (b - a) / 2 * nodes + (a + b) / 2
                pdf = np.exp(-0.5 * ((x - mu) / sigma) ** 2) / (sigma * math.sqrt(2 * math.pi))
                num += w * (b - a) / 2 * float(np.dot(weights, sign * self.loss(x) * pdf))
            mass += w * (special.ndtr((x_hi - mu) / sigma) - special.ndtr((x_lo - mu) / sigma))
        return num / mass

    def discretise(self, domain: Any, add: bool) -> Any:
        """Cell-centred, mean-preserving discretisation (as :func:`dpl.core.accounting.prv._discretise`)."""
        from prv_accountant.discrete_privacy_random_variable import DiscretePrivacyRandomVariable

        dt = domain.dt()
        t_min, t_max = domain.t_min(), domain.t_max()
        n = len(domain)
        edges = t_min + (np.arange(n + 1) - 0.5) * dt
        edges[0], edges[-1] = t_min, t_max
        pmf = np.maximum(self.cell_masses(edges, add), 0.0)
        pmf /= pmf.sum()
        ts = t_min + np.arange(n) * dt
        shift = self.truncated_mean(t_min, t_max, add) - float(np.dot(ts, pmf))
        if not abs(shift) < dt / 2:
            raise RuntimeError("discrete mean of the PRV differs from its continuous mean by more than half a cell")
        return DiscretePrivacyRandomVariable(pmf, domain.shift_right(shift), log_pmc_inf=0.0)


_LAMBDAS = np.concatenate([np.arange(0.25, 4, 0.25), np.arange(4, 64, 1.0), np.arange(64, 257, 8.0)])
_MGF_CELLS = 20000


@functools.lru_cache(maxsize=1024)
def _step_mgf(sigma: float, q: float, k: int, tail: float, add: bool, cells: int) -> tuple[np.ndarray, float]:
    """(log E[e^(lam Y); Y <= t_cap] at ``_LAMBDAS``, t_cap) for one step's PRV Y of one direction, where
    P(Y > t_cap) = ``tail``.

    Upper bounds from the exact cell masses of ``cells`` cells of [t_lo, t_cap], each cell's loss taken at its
    upper edge; t_lo is the loss at 40 sigma from every component (mass below it < 1e-300, neglected).
    """
    mix = _Mixture(sigma, q, k)
    if add:  # Y' = -L(x), x ~ N(0, sigma^2): P(Y' > -L(x_c)) = Phi(x_c / sigma)
        x_c = sigma * float(special.ndtri(tail))
        t_cap, t_lo = -float(mix.loss(np.array([x_c]))[0]), -float(mix.loss(np.array([40 * sigma]))[0])
    else:  # Y = L(x), x ~ P: P(Y > L(x_c)) = sum_m w_m Phi((m - x_c) / sigma); bisection for x_c
        lo, hi = -40 * sigma, k + 40 * sigma
        for _ in range(200):
            mid = (lo + hi) / 2
            if float(special.ndtr((mix.m - mid) / sigma) @ mix.w) > tail:
                lo = mid
            else:
                hi = mid
        x_c = hi
        t_cap, t_lo = float(mix.loss(np.array([x_c]))[0]), float(mix.loss(np.array([-40 * sigma]))[0])
    edges = np.linspace(t_lo, t_cap, cells + 1)
    with np.errstate(all="ignore"):
        masses = np.maximum(mix.cell_masses(edges, add), 0.0)
        keep = masses > 0
        log_mgf = _logsumexp(np.log(masses[keep])[None, :] + _LAMBDAS[:, None] * edges[1:][keep][None, :])
    log_mgf.setflags(write=False)
    return log_mgf, t_cap


def _chernoff_epsilon(segments: tuple[tuple[float, float, int, int], ...], delta: float, tail: float,
                      cells: int = _MGF_CELLS) -> tuple[float, float]:
    """(epsilon, largest per-step cap): an upper bound on the epsilon of the ``(sigma, q, k, steps)`` segments
    composed (both directions), and the largest loss a step has with probability > ``tail``.

    delta(eps) <= P(sum Y > eps) <= n * tail + exp(sum_i steps_i log E[e^(lam Y_i); Y_i <= t_cap,i] - lam eps)
    (Chernoff on the event that no step exceeds its cap; n steps in all), minimised over lam. Requires
    n * tail < delta.
    """
    total = sum(n for *_, n in segments)
    eps = cap = 0.0
    for add in (False, True):
        log_mgf = np.zeros(len(_LAMBDAS))
        for sigma, q, k, n in segments:
            step_mgf, t_cap = _step_mgf(sigma, q, k, tail, add, cells)
            log_mgf = log_mgf + n * step_mgf
            cap = max(cap, t_cap)
        eps = max(eps, float(np.min((log_mgf - math.log(delta - total * tail)) / _LAMBDAS)))
    return max(eps, 0.0), cap


def _els_rdp_epsilon(sigma: float, q: float, k: int, steps: int, delta: float, cells: int = _MGF_CELLS) -> float:
    """A cheap upper bound on the ELS epsilon (the RDP bound for ``k == 1``, the Chernoff bound otherwise, with the
    per-step tail of the PRV domain, delta * DELTA_ERROR_FRACTION / 16 / steps)."""
    if sigma == 0:
        return math.inf
    if k == 1:
        return _int_rdp_epsilon(((sigma, q, steps),), delta)
    return _chernoff_epsilon(((sigma, q, k, steps),), delta, delta * DELTA_ERROR_FRACTION / 16 / steps, cells)[0]


def _mixture_bound(segments: tuple[tuple[float, float, int, int], ...], delta: float) -> float:
    """A cheap upper bound on the composition of mixture segments (RDP where every k is 1, else Chernoff)."""
    if all(k == 1 for _, _, k, _ in segments):
        return _int_rdp_epsilon(tuple((s, q, n) for s, q, _, n in segments), delta)
    total = sum(n for *_, n in segments)
    return _chernoff_epsilon(segments, delta, delta * DELTA_ERROR_FRACTION / 16 / total)[0]


@functools.lru_cache(maxsize=256)
def _mixture_bounds(segments: tuple[tuple[float, float, int, int], ...], delta: float,
                    eps_error: float | None = None) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """(lower, estimate, upper) epsilon of the composition of the ``(sigma, q, k, steps)`` mixture segments (sigma
    > 0, steps > 0 each), for remove and for add: every step's two directions discretised on one grid and composed
    (heterogeneous composition)."""
    from prv_accountant import composers

    delta_error = DELTA_ERROR_FRACTION * delta
    total = sum(n for *_, n in segments)
    if eps_error is None:
        eps_error = prv_error_for(_mixture_bound(segments, delta))
    if all(k == 1 for _, _, k, _ in segments):  # safe domain size (remark 5.6 of Gopi et al.) from the RDP bound
        plain = tuple((s, q, n) for s, q, _, n in segments)
        L = _int_rdp_epsilon(plain, delta_error / 4)
        for s, q, _ in plain:
            L = max(L, _int_rdp_epsilon(((s, q, 1),), delta_error / 8 / total))
    else:  # the same from the Chernoff bound: mass beyond L at most delta_error / 16 + delta_error / 8
        L = max(_chernoff_epsilon(segments, delta_error / 16 * 3, delta_error / 16 / total))
    domain, eps_error = grid_domain(L, eps_error, total, delta_error)
    out = []
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for add in (False, True):
            dprvs = [_Mixture(s, q, k).discretise(domain, add) for s, q, k, _ in segments]
            composed = composers.Heterogeneous(dprvs).compute_composition([n for *_, n in segments])
            lo, est, up = _epsilon_bounds(composed, delta, delta_error, eps_error)
            out.append((max(lo, 0.0), max(est, 0.0), max(up, 0.0)))
    return out[0], out[1]


def _els_bounds(sigma: float, q: float, k: int, steps: int, delta: float,
                eps_error: float | None = None) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """(lower, estimate, upper) epsilon of ``steps`` ELS steps, for remove and for add (sigma > 0, steps > 0)."""
    return _mixture_bounds(((sigma, q, k, steps),), delta, eps_error)


def _mixture_epsilon(segments: tuple[tuple[float, float, int, int], ...], delta: float,
                     on_fallback=_warn_once) -> float:
    """Epsilon of the composed ``(sigma, q, k, steps)`` segments: the PRV upper bound (the larger direction); the
    Chernoff / RDP bound, with a logged warning, where PRV fails."""
    segments = tuple(s for s in segments if s[3] > 0)
    if not segments:
        return 0.0
    if any(s[0] == 0 for s in segments):
        return math.inf
    try:
        remove, add = _mixture_bounds(segments, delta)
        eps = max(remove[2], add[2])
        if not math.isfinite(eps):
            raise FloatingPointError(f"PRV returned epsilon={eps}")
        return eps
    except (ArithmeticError, ValueError, RuntimeError, MemoryError) as err:
        on_fallback(f"ELS PRV accounting failed ({type(err).__name__}: {err}); falling back to a looser upper bound")
        return _mixture_bound(segments, delta)


def _els_epsilon(sigma: float, q: float, k: int, steps: int, delta: float, on_fallback=_warn_once) -> float:
    return _mixture_epsilon(((sigma, q, k, steps),), delta, on_fallback)


def els_epsilon(noise_multiplier: float, sample_rate: float, max_rows: int, steps: int, delta: float) -> float:
    """User-level epsilon of ``steps`` ELS steps: rows Poisson-sampled at ``sample_rate``, at most ``max_rows`` rows
    per user, noise ``noise_multiplier * C``; add/remove one user.

    The PRV upper bound (the larger of the add and remove directions); ``max_rows == 1`` is the Poisson-subsampled
    Gaussian (:func:`~dpl.core.accounting.prv.epsilon_for`). ``steps == 0`` gives 0, ``noise_multiplier == 0`` inf.
    Cached by arguments.
    """
    sigma, q = _check_sigma(noise_multiplier), _check_rate(sample_rate)
    k, steps, delta = _check_rows(max_rows), _check_steps(steps), _check_delta(delta)
    return _els_epsilon(sigma, q, k, steps, delta)


def els_calibrate(target_epsilon: float, delta: float, sample_rate: float, max_rows: int, steps: int,
                  tol: float = 0.01) -> float:
    """Smallest noise multiplier (within ``tol``) with :func:`els_epsilon` <= ``target_epsilon``.

    Returns sigma with ``target * (1 - tol) <= els_epsilon(sigma, ...) <= target`` (the upper inequality always
    holds), by :func:`~dpl.core.accounting.calibration.smallest_noise_multiplier` with the RDP bound of the module
    docstring as proxy. ``steps == 0`` returns 0.
    """
    target = _check_epsilon(target_epsilon)
    delta, q, k, steps = _check_delta(delta), _check_rate(sample_rate), _check_rows(max_rows), _check_steps(steps)
    if steps == 0:
        return 0.0

    def proxy(sigma: float) -> float:
        return _els_rdp_epsilon(sigma, q, k, steps, delta, cells=1000)

    return smallest_noise_multiplier(lambda s: _els_epsilon(s, q, k, steps, delta), target, tol=tol, proxy=proxy)


def group_privacy(epsilon: float, delta: float, group_size: int) -> tuple[float, float]:
    """(k eps, k e^((k-1) eps) delta): an (eps, delta) guarantee for neighbours differing in one row, converted to
    neighbours differing in ``group_size`` = k rows.

    The group-privacy lemma (Dwork & Roth, "The Algorithmic Foundations of Differential Privacy", 2014, Sec. 2.3;
    Vadhan, "The Complexity of Differential Privacy", 2017, Lemma 2.2): along a chain of k neighbouring data sets,
    delta_k = delta + e^eps delta_(k-1), so delta_k = delta sum_(i<k) e^(i eps) <= k e^((k-1) eps) delta. Loose next
    to :func:`els_epsilon`; printed beside it for comparison.
    """
    eps, d = _real(epsilon, "epsilon"), _real(delta, "delta")
    if not (eps >= 0 and 0 <= d <= 1):
        raise ValueError(f"need epsilon >= 0 and delta in [0, 1], got {epsilon}, {delta}")
    k = _check_rows(group_size)
    try:
        return k * eps, k * math.exp((k - 1) * eps) * d
    except OverflowError:  # a per-row epsilon in the hundreds: no useful delta
        return k * eps, math.inf
