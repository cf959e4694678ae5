"""One Gaussian mechanism, exactly (Balle & Wang 2018): epsilon of a noise multiplier and its calibration."""

from __future__ import annotations

import math

from scipy import optimize, special

from dpl.core.accounting.calibration import smallest_noise_multiplier
from dpl.core.accounting.common import _check_delta, _check_epsilon, _check_sigma


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
    """Smallest noise multiplier (std / sensitivity) of one Gaussian mechanism that is (target_epsilon, delta)-DP,
    to a relative 1e-9 in epsilon."""
    eps, delta = _check_epsilon(target_epsilon), _check_delta(delta)
    return smallest_noise_multiplier(lambda sigma: gaussian_mechanism_epsilon(sigma, delta), eps, tol=1e-9)
