"""Privacy accounting for the Poisson-subsampled Gaussian mechanism and for one Gaussian mechanism.

Adjacency is **add/remove one example** throughout (what opacus and prv-accountant assume). A step releases
the sum of clipped per-example contributions (sensitivity C) plus N(0, sigma^2 C^2) noise, each example being
in the batch independently with probability ``sample_rate`` (Poisson sampling); ``sample_rate == 1`` is the
plain Gaussian mechanism composed ``steps`` times.

Methods
-------
``"prv"`` (default)
    Numerical composition of privacy random variables (PRVs; Gopi, Lee & Wutschitz, NeurIPS 2021), the
    algorithm of ``prv_accountant.PRVAccountant`` with its ``Domain`` and ``Heterogeneous`` (FFT) composer.
    The value returned is the **upper** bound: epsilon at ``delta - delta_error`` plus ``eps_error``, so it
    is conservative. Errors: ``delta_error = delta / 1000`` (prv-accountant's choice) and ``eps_error`` =
    :func:`prv_error_for` of a cheap RDP bound, i.e. 0.5 % of an upper bound on epsilon (at least 1e-3);
    the grid mesh is the one Theorem 5.5 of the paper requires for that ``eps_error``. So the bound is ~0.5 %
    above the PRV estimate, which matches prv-accountant's estimate to ~1e-5 (the tests check it).
    Where prv-accountant is slow (~0.5-1 s an evaluation for q=0.03, T=400, mostly Python loops), dpl
    computes the same quantities faster (~30 ms for q=0.03, T=400; ~90 ms for q=0.01, T=3000, on 2 busy
    cores). The accountant's ``epsilon`` costs one such evaluation when the history changed:

    * safe domain size (the paper's remark 5.6, ``compute_safe_domain_size``) from a vectorised RDP bound on
      integer orders (_INT_ORDERS) instead of a Python loop over fractional orders; any valid RDP bound
      gives a valid (at most slightly larger) domain;
    * the PRV's cdf (that of ``PoissonSubsampledGaussianMechanism``) in float64, once per cell edge, with
      the survival function for cells right of 0 (no cancellation) instead of long double cdf differences;
    * the mean of the truncated PRV, which makes the cell-centred discretisation mean-preserving, by
      Gauss-Legendre quadrature in the Gaussian output space instead of ``scipy.quad`` on the cdf;
    * the grid widened to an FFT-friendly (5-smooth) length, with the same [-k h, (k+1) h] layout;
    * epsilon read off the composed PRV in float64 (``compute_epsilon``'s formula, which uses long double).

    Results are cached (``functools.lru_cache``) by (merged history, delta, eps_error). Where the grid would
    exceed ``MAX_GRID_POINTS`` points, the mesh is coarsened and ``eps_error`` grows to what that mesh
    guarantees: looser, still an upper bound.
``"rdp"``
    Renyi DP with opacus' ``compute_rdp`` / ``get_privacy_spent`` on ``RDPAccountant``'s default orders:
    an upper bound, looser than PRV (10-30 % in epsilon, more for small epsilon). PRV falls back to it, with a
    logged warning, where PRV raises or returns inf/nan.

Calibration of sigma (:func:`calibrate_noise_multiplier`)
---------------------------------------------------------
Goal: the smallest sigma with ``target * (1 - tol) <= epsilon_for(sigma) <= target``.

1. Solve the cheap integer-order RDP bound g(sigma) = target (brentq in log sigma, <1 ms an evaluation).
   RDP >= PRV, so this sigma is nearly always feasible; it is the first PRV evaluation.
2. Second sigma: assume the ratio PRV / RDP stays what it is at the first one and solve on the cheap RDP
   curve. After that: secant steps in (log sigma, log epsilon), where the curve is nearly straight,
   kept inside the bracket of feasible / infeasible sigmas found so far (bisection if a step stalls at an
   end, at most a factor 2 per step while unbracketed). It stops at the first PRV evaluation inside
   ``[target * (1 - tol), target]``, aiming at ``target * (1 - tol/2)``. Measured on 120 configurations
   (q 0.001-1, T 10-3000, eps 0.3-8, delta 1e-5/1e-7): 2 PRV evaluations in 68, 3 in 30, at most 6 (small
   q*T, where epsilon is steep in sigma); ~0.05 s for q=0.03, T=400, eps=3 (prv-accountant's
   ``find_noise_multiplier``: ~14 s here). A target below what RDP orders <= 256 can certify (~0.05) skips
   step 1 and starts from sigma = 1 with slope -1.

Each PRV evaluation is the same cached computation as :func:`epsilon_for` (same default ``eps_error``),
so ``epsilon_for`` at the returned sigma is <= target, exactly, and free. If PRV fails, the calibration
falls back to RDP (a larger, still valid, sigma). :func:`calibrate_gaussian_mechanism` solves the closed
form of Balle & Wang (2018) with brentq.
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
import operator
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from scipy import fft, optimize, special

__all__ = [
    "METHODS",
    "PoissonGaussianAccountant",
    "calibrate_gaussian_mechanism",
    "calibrate_noise_multiplier",
    "epsilon_for",
    "gaussian_mechanism_epsilon",
    "prv_error_for",
]

logger = logging.getLogger(__name__)

METHODS = ("prv", "rdp")
#: RDP orders of the "rdp" method: opacus' RDPAccountant defaults.
RDP_ORDERS: tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))
#: Relative PRV error: eps_error = REL_EPS_ERROR * (an upper bound on epsilon), at least MIN_EPS_ERROR.
REL_EPS_ERROR = 0.005
MIN_EPS_ERROR = 1e-3
#: delta_error = DELTA_ERROR_FRACTION * delta (prv-accountant's own choice).
DELTA_ERROR_FRACTION = 1e-3
#: Largest PRV grid; beyond it the mesh is coarsened (and eps_error grows accordingly).
MAX_GRID_POINTS = 2**21

_INT_ORDERS = np.concatenate([np.arange(2, 129), np.arange(136, 257, 8)]).astype(np.float64)
Segment = tuple  # (noise_multiplier: float, sample_rate: float, num_steps: int)

_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        logger.warning(msg)


# ----------------------------------------------------------------------------------------------------------
# validation


def _real(x: Any, name: str) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or math.isnan(float(x)):
        raise ValueError(f"{name} must be a real number, got {x!r}")
    return float(x)


def _check_sigma(x: Any, name: str = "noise_multiplier") -> float:
    x = _real(x, name)
    if not (0 <= x < math.inf):
        raise ValueError(f"{name} must be a finite number >= 0, got {x}")
    return x


def _check_rate(x: Any) -> float:
    x = _real(x, "sample_rate")
    if not 0 < x <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], got {x}")
    return x


def _check_steps(x: Any, name: str = "steps") -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        if isinstance(x, float) and x.is_integer():
            x = int(x)
        else:
            raise ValueError(f"{name} must be an integer >= 0, got {x!r}")
    if x < 0:
        raise ValueError(f"{name} must be >= 0, got {x}")
    return int(x)


def _check_delta(x: Any) -> float:
    x = _real(x, "delta")
    if not 0 < x < 1:
        raise ValueError(f"delta must be in (0, 1), got {x}")
    return x


def _check_epsilon(x: Any, name: str = "target_epsilon") -> float:
    x = _real(x, name)
    if not 0 < x < math.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {x}")
    return x


def _check_method(method: Any) -> str:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return method


def _check_eps_error(x: Any) -> float | None:
    if x is None:
        return None
    x = _real(x, "eps_error")
    if not 0 < x < math.inf:
        raise ValueError(f"eps_error must be a finite number > 0 or None, got {x}")
    return x


def _canonical(segments: Iterable[Sequence]) -> tuple[Segment, ...]:
    """Merge segments with the same (sigma, q) (composition is commutative); drop empty ones; sort."""
    merged: dict[tuple[float, float], int] = {}
    for s, q, n in segments:
        if n > 0:
            merged[(float(s), float(q))] = merged.get((float(s), float(q)), 0) + int(n)
    return tuple(sorted((s, q, n) for (s, q), n in merged.items()))


# ----------------------------------------------------------------------------------------------------------
# RDP


@functools.lru_cache(maxsize=64)
def _int_rdp_terms(q: float) -> tuple[np.ndarray, np.ndarray]:
    """log(binom(a, i) q^i (1-q)^(a-i)) (-inf for i > a) and i^2 - i, for a in _INT_ORDERS, i = 0..max a."""
    a = _INT_ORDERS[:, None]
    i = np.arange(int(_INT_ORDERS[-1]) + 1, dtype=np.float64)[None, :]
    ok = i <= a
    with np.errstate(divide="ignore"):
        log_binom = special.gammaln(a + 1) - special.gammaln(i + 1) - special.gammaln(np.where(ok, a - i, 0) + 1)
        base = np.where(ok, log_binom + i * math.log(q) + (a - i) * math.log1p(-q), -np.inf)
    return base, i * i - i


@functools.lru_cache(maxsize=1024)
def _int_rdp_per_step(sigma: float, q: float) -> np.ndarray:
    """RDP of one subsampled-Gaussian step at _INT_ORDERS (vectorised Mironov et al. 2019 sum for integer orders)."""
    a = _INT_ORDERS
    if sigma == 0:
        out = np.full_like(a, np.inf)
    elif q == 1:
        out = a / (2 * sigma**2)
    else:
        base, quad = _int_rdp_terms(q)
        terms = base + quad / (2 * sigma**2)
        m = terms.max(axis=1)
        out = (m + np.log(np.exp(terms - m[:, None]).sum(axis=1))) / (a - 1)
    out.setflags(write=False)
    return out


def _rdp_to_epsilon(orders: np.ndarray, rdp: np.ndarray, delta: float) -> float:
    """Balle et al. 2020 (Thm 21) conversion, as in opacus and prv-accountant."""
    with np.errstate(invalid="ignore"):
        eps = rdp - (math.log(delta) + np.log(orders)) / (orders - 1) + np.log((orders - 1) / orders)
    if np.isnan(eps).all():
        return math.inf
    return max(float(np.nanmin(eps)), 0.0)


def _int_rdp_epsilon(segments: tuple[Segment, ...], delta: float) -> float:
    """Cheap RDP upper bound on epsilon (integer orders in _INT_ORDERS)."""
    if not segments:
        return 0.0
    rdp = sum(n * _int_rdp_per_step(s, q) for s, q, n in segments)
    return _rdp_to_epsilon(_INT_ORDERS, rdp, delta)


@functools.lru_cache(maxsize=512)
def _opacus_rdp_per_step(sigma: float, q: float) -> np.ndarray:
    from opacus.accountants.analysis import rdp as opacus_rdp

    out = np.asarray(opacus_rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=list(RDP_ORDERS)),
                     dtype=np.float64)
    out.setflags(write=False)
    return out


def _rdp_epsilon(segments: tuple[Segment, ...], delta: float) -> float:
    """The "rdp" method: opacus' RDP analysis with RDPAccountant's default orders."""
    if not segments:
        return 0.0
    if any(s == 0 for s, _, _ in segments):
        return math.inf
    from opacus.accountants.analysis import rdp as opacus_rdp

    rdp = sum(_opacus_rdp_per_step(s, q) * n for s, q, n in segments)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # opacus warns when the optimal order is at the edge of the list
        eps, _ = opacus_rdp.get_privacy_spent(orders=list(RDP_ORDERS), rdp=rdp, delta=delta)
    return float(eps)


# ----------------------------------------------------------------------------------------------------------
# PRV


def prv_error_for(epsilon: float) -> float:
    """The PRV ``eps_error`` dpl uses for an epsilon of about ``epsilon``: 0.5 % of it, at least 1e-3."""
    return max(REL_EPS_ERROR * float(epsilon), MIN_EPS_ERROR)


@functools.lru_cache(maxsize=1)
def _legendre(n: int = 160) -> tuple[np.ndarray, np.ndarray]:
    return np.polynomial.legendre.leggauss(n)


def _truncated_mean(sigma: float, q: float, t_min: float, t_max: float) -> float:
    """E[Y | t_min <= Y <= t_max] of the PRV Y = log((1-q) + q exp((2x-1)/(2 sigma^2))), x ~ (1-q)N(0,s^2)+qN(1,s^2).

    Y is increasing in x, so the truncation is an interval of x; integrate each Gaussian component with
    Gauss-Legendre over that interval intersected with mean +- 14 sigma.
    """
    log1mq = math.log1p(-q) if q < 1 else -math.inf

    def x_of(t: float) -> float:  # inverse of Y(x)
        if q == 1:
            return sigma**2 * t + 0.5
        if t <= log1mq:
            return -math.inf
        return sigma**2 * (math.log(math.expm1(t) + q) - math.log(q)) + 0.5 if t < 700 else math.inf

    x_lo, x_hi = x_of(t_min), x_of(t_max)
    nodes, weights = _legendre()
    num = mass = 0.0
    for w, mu in ((1 - q, 0.0), (q, 1.0)):
        if w == 0:
            continue
        a, b = max(x_lo, mu - 14 * sigma), min(x_hi, mu + 14 * sigma)
        if a < b:
            x = (b - a) / 2 * nodes + (a + b) / 2
            y = np.logaddexp(log1mq, math.log(q) + (2 * x - 1) / (2 * sigma**2))
            pdf = np.exp(-0.5 * ((x - mu) / sigma) ** 2) / (sigma * math.sqrt(2 * math.pi))
            num += w * (b - a) / 2 * float(np.dot(weights, y * pdf))
        mass += w * (special.ndtr((x_hi - mu) / sigma) - special.ndtr((x_lo - mu) / sigma))
    return num / mass


def _cell_masses(sigma: float, q: float, edges: np.ndarray) -> np.ndarray:
    """Probability of each interval [edges[i], edges[i+1]] under the PRV of the subsampled Gaussian.

    The PRV is Y = log((1-q) + q exp((2x-1)/(2 sigma^2))) with x ~ (1-q) N(0, s^2) + q N(1, s^2), so
    Y <= t  <=>  x <= x(t) = sigma^2 log((e^t - (1-q)) / q) + 1/2 (prv-accountant's
    ``PoissonSubsampledGaussianMechanism.cdf``). In float64: cdf differences left of t = 0 (x = 1/2) and
    survival-function differences right of it, so right-tail masses keep full relative precision
    (prv-accountant subtracts long-double cdf values close to 1 there).
    """
    if q == 1:
        x = sigma**2 * edges + 0.5
    else:
        above = edges > math.log1p(-q)
        with np.errstate(all="ignore"):
            x = sigma**2 * (np.log(np.expm1(np.where(above, edges, 0.0)) + q) - math.log(q)) + 0.5
        x = np.where(above, x, -np.inf)
    k = int(np.searchsorted(edges, 0.0))  # edges[:k] < 0 <= edges[k:]
    lo, hi = x[:k], x[k:]
    cdf = (1 - q) * special.ndtr(lo / sigma) + q * special.ndtr((lo - 1) / sigma)
    sf = (1 - q) * special.ndtr(-hi / sigma) + q * special.ndtr((1 - hi) / sigma)
    masses = np.empty(len(edges) - 1)
    masses[: k - 1] = np.diff(cdf)
    masses[k:] = -np.diff(sf)
    if 0 < k < len(edges):
        masses[k - 1] = (1 - sf[0]) - cdf[-1]  # the cell around 0: both values are O(1)
    return masses


def _discretise(sigma: float, q: float, domain: Any) -> Any:
    """Cell-centred, mean-preserving discretisation of the truncated PRV (prv-accountant's CellCentred)."""
    from prv_accountant.discrete_privacy_random_variable import DiscretePrivacyRandomVariable

    dt = domain.dt()
    t_min, t_max = domain.t_min(), domain.t_max()
    n = len(domain)
    edges = t_min + (np.arange(n + 1) - 0.5) * dt
    edges[0], edges[-1] = t_min, t_max  # truncation to [t_min, t_max]
    pmf = np.maximum(_cell_masses(sigma, q, edges), 0.0)
    pmf /= pmf.sum()
    ts = t_min + np.arange(n) * dt  # the nodes (float64 domain.ts())
    shift = _truncated_mean(sigma, q, t_min, t_max) - float(np.dot(ts, pmf))
    if not abs(shift) < dt / 2:
        raise RuntimeError("discrete mean of the PRV differs from its continuous mean by more than half a cell")
    return DiscretePrivacyRandomVariable(pmf, domain.shift_right(shift), log_pmc_inf=0.0)


def _fft_friendly_domain(L: float, mesh: float) -> Any:
    """The grid of ``prv_accountant.Domain.create_aligned(-L, L, mesh)``, widened to a fast FFT length.

    That grid is [-k mesh, (k+1) mesh] with 2k+2 nodes (the Fourier composer's index bookkeeping relies
    on this layout); k is increased until 2k+2 is 5-smooth, which makes the FFTs 2-3x faster.
    """
    from prv_accountant.domain import Domain

    k = math.ceil(L / mesh)
    size = fft.next_fast_len(2 * k + 2, real=True)
    while size % 2:
        size = fft.next_fast_len(size + 1, real=True)
    k = size // 2 - 1
    return Domain(-k * mesh, (k + 1) * mesh, size)


@functools.lru_cache(maxsize=256)
def _prv_bounds(segments: tuple[Segment, ...], delta: float, eps_error: float | None) -> tuple[float, float, float]:
    """(lower, estimate, upper) epsilon of the composition of ``segments`` (sigma > 0 each) with prv-accountant."""
    from prv_accountant import composers

    if not segments:
        return 0.0, 0.0, 0.0
    total = sum(n for _, _, n in segments)
    delta_error = DELTA_ERROR_FRACTION * delta
    if eps_error is None:
        eps_error = prv_error_for(_int_rdp_epsilon(segments, delta))
    # safe domain size: remark 5.6 of Gopi et al. (as prv_accountant.accountant.compute_safe_domain_size)
    L = _int_rdp_epsilon(segments, delta_error / 4)
    for s, q, _ in segments:
        L = max(L, _int_rdp_epsilon(((s, q, 1),), delta_error / 8 / total))
    L = max(L, eps_error) + 3
    if not math.isfinite(L):
        raise RuntimeError("PRV domain size is infinite")
    spread = math.sqrt(total / 2 * math.log(12 / delta_error))
    mesh = eps_error / spread  # Theorem 5.5
    if 2 * L / mesh > MAX_GRID_POINTS:
        mesh = 2 * L / MAX_GRID_POINTS
        eps_error = mesh * spread
    domain = _fft_friendly_domain(L, mesh)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        dprvs = [_discretise(s, q, domain) for s, q, _ in segments]
        composed = composers.Heterogeneous(dprvs).compute_composition([n for _, _, n in segments])
        lo, est, up = _epsilon_bounds(composed, delta, delta_error, eps_error)
    return max(lo, 0.0), max(est, 0.0), max(up, 0.0)


def _epsilon_bounds(composed: Any, delta: float, delta_error: float, eps_error: float) -> tuple[float, float, float]:
    """``DiscretePrivacyRandomVariable.compute_epsilon`` (for a PRV without mass at infinity) in float64.

    delta(eps) = sum_{t >= eps} p(t) (1 - e^(eps - t)); between grid nodes it is d1 - e^eps d2 with the
    tail sums d1 = sum p, d2 = sum p e^-t, solved for eps. prv-accountant does the same in long double.
    """
    dom = composed.domain
    t = np.linspace(dom.t_min(), dom.t_max(), len(dom))
    p = np.asarray(composed.pmf, dtype=np.float64)
    d1 = np.cumsum(p[::-1])[::-1]
    d2 = np.cumsum((p * np.exp(-t))[::-1])[::-1]
    neg_delta = np.exp(t) * d2 - d1  # -delta(t), increasing in t

    def solve(target: float) -> float:
        i = int(np.searchsorted(neg_delta, -target, side="left"))
        if i <= 0 or i >= len(t):
            raise RuntimeError("cannot compute epsilon on this PRV grid")
        return math.log((d1[i] - target) / d2[i])

    if np.finfo(np.float64).eps * len(t) > delta - delta_error:
        raise ValueError("delta is too small for floating point precision on this PRV grid")
    return solve(delta + delta_error) - eps_error, solve(delta), solve(delta - delta_error) + eps_error


def _epsilon(segments: tuple[Segment, ...], delta: float, method: str, eps_error: float | None = None,
             on_fallback: Callable[[str], None] = _warn_once) -> float:
    if not segments:
        return 0.0
    if any(s == 0 for s, _, _ in segments):
        return math.inf
    if method == "rdp":
        return _rdp_epsilon(segments, delta)
    try:
        eps = _prv_bounds(segments, delta, eps_error)[2]
        if not math.isfinite(eps):
            raise FloatingPointError(f"PRV returned epsilon={eps}")
        return eps
    except (ArithmeticError, ValueError, RuntimeError, MemoryError) as err:
        on_fallback(f"PRV accounting failed ({type(err).__name__}: {err}); falling back to RDP (a looser upper bound)")
        return _rdp_epsilon(segments, delta)


# ----------------------------------------------------------------------------------------------------------
# public functions


def epsilon_for(noise_multiplier: float, sample_rate: float, steps: int, delta: float, method: str = "prv",
                eps_error: float | None = None) -> float:
    """Epsilon after ``steps`` compositions of the Poisson-subsampled Gaussian mechanism.

    Noise std is ``noise_multiplier * C`` for sensitivity C; add/remove adjacency. ``method="prv"`` returns
    the PRV upper bound (falls back to RDP, with a logged warning, if PRV fails); ``eps_error`` overrides
    the PRV error width (default :func:`prv_error_for` of an RDP bound). ``steps == 0`` gives 0,
    ``noise_multiplier == 0`` gives inf.
    """
    sigma, q = _check_sigma(noise_multiplier), _check_rate(sample_rate)
    steps, delta = _check_steps(steps), _check_delta(delta)
    method, eps_error = _check_method(method), _check_eps_error(eps_error)
    return _epsilon(_canonical([(sigma, q, steps)]), delta, method, eps_error)


def calibrate_noise_multiplier(target_epsilon: float, delta: float, sample_rate: float, steps: int,
                               method: str = "prv", tol: float = 0.01, eps_error: float | None = None) -> float:
    """Smallest noise multiplier (within ``tol``) whose epsilon after ``steps`` steps is <= ``target_epsilon``.

    The returned sigma satisfies ``target * (1 - tol) <= epsilon_for(sigma, ...) <= target`` (same method and
    ``eps_error``); the upper inequality always holds. ``steps == 0`` returns 0. See the module docstring
    for the algorithm.
    """
    target = _check_epsilon(target_epsilon)
    delta, q, steps = _check_delta(delta), _check_rate(sample_rate), _check_steps(steps)
    method, eps_error = _check_method(method), _check_eps_error(eps_error)
    tol = _real(tol, "tol")
    if not 0 < tol < 1:
        raise ValueError(f"tol must be in (0, 1), got {tol}")
    if steps == 0:
        return 0.0

    def fallback(msg: str) -> None:
        raise _PRVFailed(msg)

    def f(sigma: float) -> float:
        return _epsilon(((sigma, q, steps),), delta, method, eps_error, on_fallback=fallback)

    try:
        return _calibrate(f, q, steps, delta, target, tol)
    except _PRVFailed as err:
        _warn_once(f"{err} (calibration)")
        return _calibrate(lambda s: _epsilon(((s, q, steps),), delta, "rdp"), q, steps, delta, target, tol)


class _PRVFailed(RuntimeError):
    pass


def _calibrate(f: Callable[[float], float], q: float, steps: int, delta: float, target: float, tol: float) -> float:
    log_target = math.log(target)
    log_low = math.log(target * (1 - tol))
    log_aim = math.log(target * (1 - tol / 2))

    def rdp(u: float) -> float:  # log of the cheap integer-order RDP bound at sigma = e^u
        return math.log(max(_int_rdp_epsilon(((math.exp(u), q, steps),), delta), 1e-300))

    g = rdp

    def solve_g(level: Callable[[float], float], lo: float, hi: float) -> float:
        """u in [lo, hi] with g(u) = level(u) (g decreasing; level slowly varying), else the nearer end."""
        def h(v: float) -> float:
            return g(v) - level(v)

        h_lo, h_hi = h(lo), h(hi)
        if h_lo <= 0:
            return lo
        if h_hi >= 0:
            return hi
        return optimize.brentq(h, lo, hi, xtol=1e-5)

    # 1. where the RDP bound hits the aim (RDP >= PRV, so this sigma is nearly always feasible)
    lo, hi = -1.0, 1.0
    while g(hi) > log_aim and hi < 12:
        lo, hi = hi, hi + 1.5
    if g(hi) > log_aim:
        # a target too small for RDP with orders <= 256 (e.g. epsilon ~0.01): model eps ~ c / sigma instead
        g = operator.neg
        u = 0.0
    else:
        while g(lo) <= log_aim:
            hi, lo = lo, lo - 1.5
            if lo < -40:
                raise ValueError("cannot calibrate the noise multiplier: epsilon <= target already at sigma < e^-40")
        u = solve_g(lambda v: log_aim, lo, hi)

    # 2. first step: log f = g + c with c (log PRV / RDP) constant; then safeguarded secant in log-log
    feasible: tuple[float, float] | None = None  # (u, log eps) with eps <= target, smallest u
    infeasible: tuple[float, float] | None = None  # with eps > target, largest u
    points: list[tuple[float, float]] = []  # (u, log eps) of the PRV evaluations with finite epsilon
    for it in range(30):
        try:
            eps = f(math.exp(u))
        except _PRVFailed:
            if it == 0:  # PRV fails where it matters most: let the caller fall back to RDP
                raise
            eps = math.inf  # a trial sigma far from the answer (tiny sigma, huge epsilon): treat as infeasible
        except (ArithmeticError, ValueError) as err:
            raise ValueError(f"cannot calibrate the noise multiplier to epsilon={target:.4g}: epsilon failed at "
                             f"sigma={math.exp(u):.4g} ({err})") from err
        y = math.log(eps) if eps > 0 else -math.inf
        if log_low <= y <= log_target:
            return math.exp(u)
        if y <= log_target and (feasible is None or u < feasible[0]):
            feasible = (u, y)
        if y > log_target and (infeasible is None or u > infeasible[0]):
            infeasible = (u, y)
        if math.isfinite(y):
            points.append((u, y))
        # search interval of the next sigma: the bracket, or at most a factor 2 away from this one
        a = infeasible[0] if infeasible is not None else u - 0.7
        b = feasible[0] if feasible is not None else u + 0.7
        if b - a < 1e-9:
            break
        if len(points) >= 2 and points[-1][1] != points[-2][1]:
            # secant on the last two PRV points (more robust than extrapolating the PRV / RDP ratio)
            (u1, y1), (u2, y2) = points[-2], points[-1]
            nxt = min(max(u2 + (log_aim - y2) * (u2 - u1) / (y2 - y1), a), b)
        elif points:
            # one PRV point: assume the PRV / RDP ratio stays what it is there, solve on the RDP curve
            c = points[-1][1] - g(points[-1][0])
            nxt = solve_g(lambda v: log_aim - c, a, b)
        else:
            nxt = (a + b) / 2
        if feasible is not None and infeasible is not None:
            margin = 0.02 * (b - a)
            if not a + margin < nxt < b - margin:  # stalling at one end of the bracket: bisect
                nxt = (a + b) / 2
        u = nxt
    if feasible is None:
        raise ValueError(f"cannot calibrate the noise multiplier: no sigma found with epsilon <= {target:.4g}")
    eps = f(math.exp(feasible[0]))
    _warn_once(f"noise multiplier calibration stopped at epsilon={eps:.4g} (target {target:.4g}, tol {tol})")
    return math.exp(feasible[0])


def _gaussian_delta(sigma: float, eps: float) -> float:
    """delta(eps) of the Gaussian mechanism with sensitivity 1 and std sigma (Balle & Wang 2018)."""
    a, b = 1 / (2 * sigma) - eps * sigma, -1 / (2 * sigma) - eps * sigma
    log1, log2 = special.log_ndtr(a), eps + special.log_ndtr(b)
    if log1 == -math.inf:
        return 0.0
    return max(-math.exp(log1) * math.expm1(log2 - log1), 0.0)


def gaussian_mechanism_epsilon(noise_multiplier: float, delta: float) -> float:
    """Exact epsilon of one Gaussian mechanism with sensitivity 1 and std ``noise_multiplier`` at ``delta``.

    Solves Balle & Wang's (2018) delta(eps) = Phi(1/(2s) - eps s) - e^eps Phi(-1/(2s) - eps s) for eps.
    For correlated-noise (FTRL) mechanisms accounted as one Gaussian mechanism on the sensitivity-normalised
    stream. ``noise_multiplier == 0`` gives inf.
    """
    sigma, delta = _check_sigma(noise_multiplier), _check_delta(delta)
    if sigma == 0:
        return math.inf
    if _gaussian_delta(sigma, 0.0) <= delta:
        return 0.0
    hi = 1.0
    while _gaussian_delta(sigma, hi) > delta:
        hi *= 2
        if hi > 1e12:
            return math.inf
    eps = optimize.brentq(lambda e: _gaussian_delta(sigma, e) - delta, 0.0, hi, xtol=1e-14, rtol=1e-14)
    while _gaussian_delta(sigma, eps) > delta:  # make sure it is an upper bound despite rounding
        eps = math.nextafter(eps, math.inf) if eps > 0 else 5e-324
    return eps


def calibrate_gaussian_mechanism(target_epsilon: float, delta: float) -> float:
    """Smallest noise multiplier (std / sensitivity) of one Gaussian mechanism that is (target_epsilon, delta)-DP."""
    eps, delta = _check_epsilon(target_epsilon), _check_delta(delta)

    def h(u: float) -> float:  # > 0 where sigma = e^u is not private enough
        return math.log(max(_gaussian_delta(math.exp(u), eps), 1e-320)) - math.log(delta)

    lo, hi = -1.0, 1.0
    while h(hi) > 0:
        lo, hi = hi, hi + 2
    while h(lo) <= 0:
        hi, lo = lo, lo - 2
    sigma = math.exp(optimize.brentq(h, lo, hi, xtol=1e-13))
    while gaussian_mechanism_epsilon(sigma, delta) > eps:
        sigma *= 1 + 1e-12
    return sigma


# ----------------------------------------------------------------------------------------------------------
# stateful accountant


class PoissonGaussianAccountant:
    """Epsilon spent by a sequence of Poisson-subsampled Gaussian steps (sigma and q may change).

    ``history`` holds ``(noise_multiplier, sample_rate, num_steps)`` segments. ``epsilon(delta)`` is cached:
    repeated calls with an unchanged history are free. ``method="prv"`` falls back to RDP (one logged
    warning per accountant) where PRV fails or returns inf/nan.
    """

    def __init__(self, method: str = "prv") -> None:
        self.method = _check_method(method)
        self.history: list[tuple[float, float, int]] = []
        self._cache: dict[tuple, float] = {}
        self._last: tuple[tuple, float] | None = None  # ((method, history, delta), epsilon) of the last call
        self._warned = False

    def step(self, noise_multiplier: float, sample_rate: float, n: int = 1) -> None:
        """Record ``n`` steps with this noise multiplier and sample rate."""
        sigma, q, n = _check_sigma(noise_multiplier), _check_rate(sample_rate), _check_steps(n, "n")
        if n == 0:
            return
        if self.history and self.history[-1][:2] == (sigma, q):
            self.history[-1] = (sigma, q, self.history[-1][2] + n)
        else:
            self.history.append((sigma, q, n))

    @property
    def steps(self) -> int:
        """Total number of steps recorded."""
        return sum(n for _, _, n in self.history)

    def _fallback(self, msg: str) -> None:
        if not self._warned:
            self._warned = True
            logger.warning(msg)

    def epsilon(self, delta: float) -> float:
        """Epsilon spent so far at ``delta`` (PRV upper bound, or RDP)."""
        fast_key = (self.method, tuple(self.history), delta)
        if self._last is not None and self._last[0] == fast_key:
            return self._last[1]
        delta = _check_delta(delta)
        key = (self.method, _canonical(self.history), delta)
        if key not in self._cache:
            if len(self._cache) > 64:
                self._cache.clear()
            self._cache[key] = _epsilon(key[1], delta, self.method, None, on_fallback=self._fallback)
        self._last = (fast_key, self._cache[key])
        return self._last[1]

    def state_dict(self) -> dict[str, Any]:
        """Plain python types: ``{"method": str, "history": [[sigma, q, n], ...]}``."""
        return {"method": self.method, "history": [[float(s), float(q), int(n)] for s, q, n in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (replaces the current history)."""
        method = _check_method(state["method"])
        history = [(_check_sigma(s), _check_rate(q), _check_steps(n, "n")) for s, q, n in state["history"]]
        self.method, self.history, self._cache, self._last = method, history, {}, None

    def __len__(self) -> int:
        return len(self.history)

    def __repr__(self) -> str:
        return f"PoissonGaussianAccountant(method={self.method!r}, steps={self.steps}, segments={len(self.history)})"
