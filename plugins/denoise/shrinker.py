"""The optimal shrinker of singular values (Shabalin-Nobel / Gavish-Donoho, Frobenius loss, known noise level)
and the spike inverse, on scaled singular values ``y = sv / (s * sqrt(max(m, n)))``, with
``beta = min(m, n) / max(m, n)``."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def optimal_shrinker(y: Tensor, beta: float) -> Tensor:
    """Frobenius-optimal shrinker ``eta(y) = sqrt((y^2 - beta - 1)^2 - 4 beta) / y`` for ``y > 1 + sqrt(beta)``,
    else 0, on scaled singular values ``y = sv / (s * sqrt(max(m, n)))``, elementwise."""
    if not 0.0 < beta <= 1.0:
        raise ValueError(f"beta must be in (0, 1], got {beta}")
    root = math.sqrt(beta)
    y2 = y * y
    # (y^2 - beta - 1)^2 - 4 beta == (y^2 - (1 + sqrt(beta))^2) * (y^2 - (1 - sqrt(beta))^2); the product form
    # avoids the cancellation of the difference of squares near the edge.
    value = ((y2 - (1.0 + root) ** 2).clamp_min(0.0) * (y2 - (1.0 - root) ** 2).clamp_min(0.0)).sqrt() / y
    return torch.where(y > 1.0 + root, value, torch.zeros_like(value))


def spike_inverse(y: Tensor, beta: float) -> Tensor:
    """Spike inverse ``x(y) = sqrt(((y^2 - beta - 1) + sqrt((y^2 - beta - 1)^2 - 4 beta)) / 2)`` for
    ``y > 1 + sqrt(beta)``, else 0 (no detectable spike).

    ``x`` is the scaled signal singular value whose noisy counterpart has (asymptotically) the scaled singular
    value ``y = sqrt((1 + x^2)(beta + x^2)) / x``. Not used by the shrinker; useful for diagnostics.
    """
    if not 0.0 < beta <= 1.0:
        raise ValueError(f"beta must be in (0, 1], got {beta}")
    root = math.sqrt(beta)
    y2 = y * y
    disc = ((y2 - (1.0 + root) ** 2).clamp_min(0.0) * (y2 - (1.0 - root) ** 2).clamp_min(0.0)).sqrt()
    value = (0.5 * ((y2 - beta - 1.0) + disc)).clamp_min(0.0).sqrt()
    return torch.where(y > 1.0 + root, value, torch.zeros_like(value))


def shrinker_slope(y: Tensor, beta: float) -> Tensor:
    """d eta / d y for y above the bulk edge (inf at the edge), 0 below it."""
    root = math.sqrt(beta)
    y2 = y * y
    p = (y2 - (1.0 + root) ** 2).clamp_min(0.0) * (y2 - (1.0 - root) ** 2).clamp_min(0.0)
    sp = p.sqrt()
    slope = (2.0 * y2 - (1.0 + root) ** 2 - (1.0 - root) ** 2) / sp - sp / y2
    return torch.where(y > 1.0 + root, slope, torch.zeros_like(slope))
