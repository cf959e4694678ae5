"""Renyi DP bounds of the Poisson-subsampled Gaussian: a cheap vectorised one on integer orders (domain sizes,
first guesses) and opacus' analysis on ``RDPAccountant``'s default orders (the ``"rdp"`` method)."""

from __future__ import annotations

import functools
import math
import warnings

import numpy as np
from scipy import special

from dpl.core.accounting.common import RDP_ORDERS, Segment

_INT_ORDERS = np.concatenate([np.arange(2, 129), np.arange(136, 257, 8)]).astype(np.float64)


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
