"""The SVD paths of the shrinkage (``method="full"``: batched SVD; ``"randomized"``: a randomized truncated SVD
that grows its rank and refines until it denoises as the full SVD would, see :func:`leading_svd`)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dpl_plugins.denoise.options import DEFAULT_RANK, DenoiseStats, ShrinkageOptions
from dpl_plugins.denoise.shrinker import optimal_shrinker, shrinker_slope


def sketch(a: Tensor, width: int, power_iters: int, generator: torch.Generator) -> Tensor:
    """Orthonormal basis (k, M, width) of the range of ``a @ omega`` after ``power_iters`` power iterations."""
    k, _, n = a.shape
    omega = torch.randn(k, n, width, generator=generator, device=a.device, dtype=a.dtype)
    q = torch.linalg.qr(a @ omega).Q
    for _ in range(power_iters):
        q = _power_step(a, q)
    return q


def _power_step(a: Tensor, q: Tensor) -> Tensor:
    """One QR-stabilized subspace (power) iteration on the left basis ``q``."""
    return torch.linalg.qr(a @ torch.linalg.qr(a.mT @ q).Q).Q


def _ritz(a: Tensor, q: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Ritz triplets of ``a`` on the left basis ``q``: ``a.mT @ U == V diag(S)`` holds exactly; the estimated
    singular values never exceed the true ones."""
    u_small, sv, vh = torch.linalg.svd(q.mT @ a, full_matrices=False)
    return q @ u_small, sv, vh


def _error_estimate(a: Tensor, u: Tensor, sv: Tensor, vh: Tensor, scale: Tensor, beta: float) -> Tensor:
    """Estimated relative Frobenius error of the shrunken reconstruction from Ritz triplets, per matrix.

    With the residuals ``r_j = ||a v_j - s_j u_j||`` (``a.mT u_j = s_j v_j`` holds exactly), the Ritz triplets
    above the edge are exact singular triplets of ``a - E`` with ``||E||_F = ||R||_F``. Two terms:
    * kept components: the reconstruction moves by at most about ``L_i r_i``, ``L_i`` the largest divided
      difference of the shrinker between ``y_i`` and the other Ritz values (or its slope at ``y_i``, or 1);
    * components estimated below the edge: a true singular value may lie up to ``r_j`` above the Ritz value,
      so one of size ``eta(y_j + r_j)`` may be missing.
    Everything is in units of ``s * sqrt(max(m, n))`` and relative to the norm of the shrunken values.
    """
    y = sv / scale[:, None]
    eta = optimal_shrinker(y, beta)
    residual = a @ vh.mT - u * sv[:, None, :]
    res = torch.linalg.vector_norm(residual, dim=1) / scale[:, None]                      # (k, width)
    missed = torch.where(eta > 0, torch.zeros_like(eta), optimal_shrinker(y + res, beta))
    err2 = (missed * missed).sum(dim=1)
    keep = int((eta > 0).sum(dim=1).max())
    if keep:
        yi, yj = y[:, :keep, None], y[:, None, :]
        ei, ej = eta[:, :keep, None], eta[:, None, :]
        gap = (yi - yj).abs()
        divided = torch.where(gap > 0, (ei - ej).abs() / gap, torch.full_like(gap, math.inf))
        self_pair = torch.eye(keep, y.shape[1], dtype=torch.bool, device=a.device)
        divided = torch.where(self_pair, torch.zeros_like(divided), divided).amax(dim=2)  # (k, keep)
        lipschitz = torch.maximum(torch.maximum(divided, shrinker_slope(y[:, :keep], beta).abs()),
                                  torch.ones_like(divided))
        kept = torch.where(eta[:, :keep] > 0, lipschitz * res[:, :keep], torch.zeros_like(divided))
        err2 = err2 + (kept * kept).sum(dim=1)
    eta_norm = torch.linalg.vector_norm(eta, dim=1)
    err = err2.sqrt() / torch.where(eta_norm > 0, eta_norm, torch.ones_like(eta_norm))
    return torch.nan_to_num(err, nan=math.inf)


_DECISION_BAND = 0.05  # Ritz tops this close below the threshold are refined before a matrix is left unchanged


def leading_svd(a: Tensor, scale: Tensor, edge_sv: Tensor, apply_sv: Tensor, beta: float,
                opts: ShrinkageOptions) -> tuple[Tensor, Tensor, Tensor]:
    """Singular triplets of ``a`` (k, M, N), M >= N, enough to denoise it as the full SVD would.

    Per matrix: a randomized sketch of width ``r + oversample`` (``opts``: ``rank``, ``oversample``,
    ``power_iters``, ``tol``, ``max_refine``, ``seed``) gives Ritz triplets (lower estimates of the
    singular values). A matrix whose top Ritz value is below the threshold ``apply_sv`` (by more than the decision
    band) is left to the caller as not denoised. Otherwise it is refined by further power iterations until (a) the
    top Ritz value is above the threshold, (b) the r-th (last kept) Ritz value is at or below the edge ``edge_sv``
    (else the rank doubles and a fresh, wider sketch starts), and (c) the estimated relative error of the
    shrunken reconstruction is at most ``tol``. Matrices that do not get there within ``max_refine`` iterations,
    or whose sketch would be wider than half of N, get a full SVD.
    Returns U (k, M, R), S (k, R), Vh (k, R, N), zero-padded where a matrix has fewer than R triplets.
    """
    k, m, n = a.shape
    oversample, power_iters, tol, max_refine = opts.oversample, opts.power_iters, opts.tol, opts.max_refine
    generator = torch.Generator(device=a.device)
    generator.manual_seed(opts.seed)
    pieces: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []  # (batch indices, U, S, Vh)
    todo = torch.arange(k, device=a.device)
    r = min(opts.rank or DEFAULT_RANK, n)
    while todo.numel():
        width = r + (oversample if oversample is not None else max(r, 8))
        if 2 * width > n:  # a sketch this wide costs about as much as the full SVD: do that instead
            pieces.append((todo, *torch.linalg.svd(a[todo], full_matrices=False)))
            break
        idx, sub = todo, a[todo]
        q = sketch(sub, width, power_iters, generator)
        grown: list[Tensor] = []
        hopeless: list[Tensor] = []
        for it in range(max_refine + 1):
            u, sv, vh = _ritz(sub, q)
            top = sv[:, 0]
            certain = top > apply_sv[idx]
            in_band = ~certain & (top > apply_sv[idx] * (1.0 - _DECISION_BAND))
            rank_ok = sv[:, r - 1] <= edge_sv[idx]
            err = _error_estimate(sub, u, sv, vh, scale[idx], beta)
            done = (~certain & ~in_band) | (certain & rank_ok & (err <= tol))
            grow = certain & ~rank_ok
            slow = ~done & ~grow if it == max_refine else torch.zeros_like(done)
            if done.any():
                pieces.append((idx[done], u[done][..., :r], sv[done][:, :r], vh[done][:, :r]))
            grown.append(idx[grow])
            hopeless.append(idx[slow])
            rest = ~done & ~grow & ~slow
            idx, sub, q = idx[rest], sub[rest], q[rest]
            if not idx.numel():
                break
            q = _power_step(sub, q)
        fallback = torch.cat(hopeless)
        if fallback.numel():  # not settled by the sketch: full SVD
            pieces.append((fallback, *torch.linalg.svd(a[fallback], full_matrices=False)))
        todo = torch.cat(grown)
        r *= 2
    # only the values above the edge (and the top one) are used: drop the rest before padding
    trimmed = []
    for idx, u, sv, vh in pieces:
        w = max(1, int((sv > edge_sv[idx][:, None]).sum(dim=1).max()))
        trimmed.append((idx, u[..., :w], sv[:, :w], vh[:, :w, :]))
    pieces = trimmed
    width = max(piece[2].shape[1] for piece in pieces)
    u_all = a.new_zeros(k, m, width)
    s_all = a.new_zeros(k, width)
    vh_all = a.new_zeros(k, width, n)
    for idx, u, sv, vh in pieces:
        w = sv.shape[1]
        u_all[idx, :, :w] = u
        s_all[idx, :w] = sv
        vh_all[idx, :w, :] = vh
    return u_all, s_all, vh_all


def shrink_tall(a: Tensor, s: Tensor, opts: ShrinkageOptions) -> tuple[Tensor | None, Tensor, DenoiseStats]:
    """``method="full"`` / ``"randomized"`` on a batch ``a`` (k, M, N), M >= N, already in the compute dtype; ``s``
    (k,) noise std.

    Returns (estimate (k, M, N) in the compute dtype, or None when no matrix is denoised; applied mask (k,);
    stats). Rows of the estimate where ``applied`` is False are meaningless.
    """
    k, m, n = a.shape
    if k == 0 or n == 0:
        return None, torch.zeros(k, dtype=torch.bool, device=a.device), DenoiseStats(num_matrices=k)
    finite = torch.isfinite(a).flatten(1).all(dim=1)
    if not bool(finite.all()):  # keep the SVD well defined; these matrices are returned unchanged
        a = torch.where(finite[:, None, None], a, torch.zeros((), dtype=a.dtype, device=a.device))
    beta = n / m
    valid = finite & (s > 0)
    scale = torch.where(valid, s * math.sqrt(m), torch.ones_like(s))       # s * sqrt(max(m, n))
    edge_sv = s * (math.sqrt(m) + math.sqrt(n))                              # bulk edge, singular-value units
    # matrices with no noise or non-finite entries are never denoised: an infinite threshold says so
    apply_sv = torch.where(valid, opts.kappa * edge_sv, torch.full_like(edge_sv, math.inf))

    if opts.method == "full":
        u, sv, vh = torch.linalg.svd(a, full_matrices=False)
    else:
        u, sv, vh = leading_svd(a, scale, edge_sv, apply_sv, beta, opts)

    top = sv[:, 0]
    eta = optimal_shrinker(sv / scale[:, None], beta)
    spikes = (eta > 0).sum(dim=1)
    applied = valid & (top > apply_sv) & (spikes > 0)
    ratio = torch.where(valid, top / torch.where(valid, edge_sv, torch.ones_like(edge_sv)), torch.zeros_like(top))
    num_denoised, num_spikes, max_ratio = torch.stack(
        [applied.sum().to(a.dtype), torch.where(applied, spikes, 0).sum().to(a.dtype), ratio.max()]).tolist()
    stats = DenoiseStats(num_matrices=k, num_denoised=int(num_denoised), num_spikes=int(num_spikes),
                         max_edge_ratio=float(max_ratio))
    if stats.num_denoised == 0:
        return None, applied, stats

    if opts.norm_correction:
        eta_norm = torch.linalg.vector_norm(eta, dim=1)
        target = torch.linalg.matrix_norm(a / scale[:, None, None]) * scale   # Frobenius norm of Y (no overflow)
        factor = target / torch.where(eta_norm > 0, eta_norm, torch.ones_like(eta_norm))
    else:
        factor = scale
    d = eta * torch.where(applied, factor, torch.zeros_like(factor))[:, None]
    keep = int(torch.where(applied, spikes, 0).max())  # singular values are sorted: the spikes come first
    estimate = (u[..., :keep] * d[:, None, :keep]) @ vh[:, :keep, :]
    return estimate, applied, stats
