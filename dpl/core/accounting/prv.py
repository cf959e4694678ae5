"""PRV accounting of the Poisson-subsampled Gaussian (Gopi, Lee & Wutschitz, NeurIPS 2021), faster than
prv-accountant's own evaluation with the same algorithm; see :mod:`dpl.core.accounting` for what differs."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
from scipy import fft, special

from dpl.core.accounting.common import (
    _canonical,
    _check_delta,
    _check_eps_error,
    _check_method,
    _check_rate,
    _check_sigma,
    _check_steps,
    DELTA_ERROR_FRACTION,
    MAX_GRID_POINTS,
    MIN_EPS_ERROR,
    REL_EPS_ERROR,
    Segment,
    _warn_once,
)
from dpl.core.accounting.rdp import _int_rdp_epsilon, _rdp_epsilon


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


def grid_domain(L: float, eps_error: float, steps: int, delta_error: float) -> tuple[Any, float]:
    """The PRV grid for a safe domain half-width ``L`` and ``eps_error`` over ``steps`` compositions, with the mesh
    Theorem 5.5 of Gopi et al. requires (coarsened beyond ``MAX_GRID_POINTS``), and the eps_error it guarantees."""
    L = max(L, eps_error) + 3
    if not math.isfinite(L):
        raise RuntimeError("PRV domain size is infinite")
    spread = math.sqrt(steps / 2 * math.log(12 / delta_error))
    mesh = eps_error / spread  # Theorem 5.5
    if 2 * L / mesh > MAX_GRID_POINTS:
        mesh = 2 * L / MAX_GRID_POINTS
        eps_error = mesh * spread
    return _fft_friendly_domain(L, mesh), eps_error


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
    domain, eps_error = grid_domain(L, eps_error, total, delta_error)
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
