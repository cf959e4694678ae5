"""The Gram path of the shrinkage (``method="auto"``): a Cholesky certificate leaves pure-noise matrices alone,
``eigh`` of the float64 Gram matrix denoises the others (see :func:`gram_shrink`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from dpl_plugins.denoise.options import DenoiseStats, ShrinkageOptions
from dpl_plugins.denoise.shrinker import optimal_shrinker
from dpl_plugins.denoise.svd import shrink_tall


_SKIP_MARGIN = 1e-3     # the Cholesky certificate is tested at (1 - this) * threshold^2 (float32 Gram error: ~4e-7)
_LANCZOS_STEPS = 5      # Lanczos steps of the (logged only) top estimate of a matrix the certificate leaves alone


def _shifted_grams(views: Sequence[Tensor], shift: Tensor) -> Tensor:
    """``shift_i I - V_i^T V_i`` for each tall view (M, N) as a (k, N, N) batch in ``shift``'s dtype: one BLAS call
    per matrix (stacking the views first would cost a pass over all of them), no copy of a view already in that
    dtype."""
    n = views[0].shape[1]
    out = torch.empty(len(views), n, n, dtype=shift.dtype, device=shift.device)
    for i, view in enumerate(views):
        view = view.to(shift.dtype)
        torch.addmm(out[i], view.mT, view, beta=0, alpha=-1, out=out[i])  # beta=0: the (empty) input is ignored
    out.diagonal(dim1=-2, dim2=-1).add_(shift[:, None])
    return out


def _gram64(view: Tensor) -> Tensor:
    """``V^T V`` in float64 (eigh of it gives the spikes to the accuracy of a float64 SVD of V)."""
    view = view.to(torch.float64)
    return view.mT @ view


def _lanczos_min(a: Tensor, steps: int, generator: torch.Generator) -> Tensor:
    """Smallest Ritz value of each symmetric (k, N, N) ``a`` after ``steps`` Lanczos steps from a random start: an
    upper estimate of ``lambda_min`` (used for the logged statistics only)."""
    k, n, _ = a.shape
    steps = max(1, min(steps, n))
    q = torch.randn(k, n, 1, generator=generator, device=a.device, dtype=a.dtype)
    q = q / torch.linalg.vector_norm(q, dim=1, keepdim=True)
    q_prev = torch.zeros_like(q)
    beta = a.new_zeros(k, 1, 1)
    alphas, betas = [], []
    tiny = torch.finfo(a.dtype).tiny
    for j in range(steps):
        w = a @ q
        alpha = (q * w).sum(dim=1, keepdim=True)
        alphas.append(alpha)
        if j == steps - 1:
            break
        w = w - alpha * q - beta * q_prev
        beta = torch.linalg.vector_norm(w, dim=1, keepdim=True)
        betas.append(beta)
        q_prev, q = q, w / beta.clamp_min(tiny)
    tri = torch.diag_embed(torch.cat(alphas, dim=1)[..., 0])
    if betas:
        off = torch.cat(betas, dim=1)[..., 0]
        tri = tri + torch.diag_embed(off, offset=1) + torch.diag_embed(off, offset=-1)
    return torch.linalg.eigvalsh(tri)[:, 0]


def gram_shrink(views: Sequence[Tensor], s: Tensor, opts: ShrinkageOptions) -> tuple[list[Tensor | None], DenoiseStats]:
    """``method="auto"`` on tall views (M, N), M >= N, of one shape, dtype and device; ``s`` (k,) noise std in the
    compute dtype. Returns one estimate per view (compute dtype) or None where the view is left unchanged.

    1. Certificate: the top singular value of Y is below the threshold ``kappa * s * (sqrt(M) + sqrt(N))`` iff
       ``t I - Y^T Y`` is positive definite (t = threshold^2). One BLAS call per matrix forms it (N x N, compute
       dtype) and a batched Cholesky factorization decides; it is tested at ``(1 - 1e-3) t``, far above the float32
       rounding of the Gram (~4e-7 relative, measured). Pure-noise matrices stop here, unchanged.
    2. The others: ``G = Y^T Y`` in float64, ``eigh``; singular values ``sqrt(lambda)``, ``V`` the eigenvectors,
       and ``U_r = Y V_r / sigma_r`` for the r kept spikes only. Same decision and estimate as the full SVD (more
       accurate than a float32 SVD: the float64 Gram keeps every value above the edge to ~1e-7 relative).
    Matrices with non-finite entries are left unchanged; finite ones whose Gram overflows go to the full SVD.
    """
    k = len(views)
    if k == 0 or views[0].shape[1] == 0:
        return [None] * k, DenoiseStats(num_matrices=k)
    m, n = views[0].shape
    device, cdtype = views[0].device, s.dtype
    beta = n / m
    scale = s * math.sqrt(m)                                                  # s * sqrt(max(m, n))
    edge_sv = s * (math.sqrt(m) + math.sqrt(n))                               # bulk edge, singular-value units
    apply_sv = opts.kappa * edge_sv
    shift = apply_sv * apply_sv * (1.0 - _SKIP_MARGIN)
    shifted = _shifted_grams(views, shift)
    # Y has a non-finite entry iff the diagonal (t - ||column||^2) is not finite, or the Gram overflowed; |G_ij| is
    # at most sqrt(G_ii G_jj), so a finite diagonal means a finite Gram.
    finite = torch.isfinite(torch.diagonal(shifted, dim1=-2, dim2=-1)).all(dim=1)
    results: list[Tensor | None] = [None] * k
    stats = DenoiseStats()
    if not bool(finite.all()):
        overflow = [i for i in (~finite).nonzero().flatten().tolist() if bool(torch.isfinite(views[i]).all())]
        if overflow:  # finite entries but an overflowing Gram: the SVD path handles these
            estimate, applied, stats = shrink_tall(torch.stack([views[i].to(cdtype) for i in overflow]),
                                                    s[overflow], replace(opts, method="full"))
            stats = replace(stats, num_matrices=0)  # counted below with the others
            for j, i in enumerate(overflow):
                if bool(applied[j]):
                    results[i] = estimate[j]
    valid = finite & (s > 0)
    top = torch.zeros_like(s)
    num_denoised = num_spikes = 0
    all_valid = bool(valid.all())
    idx = torch.arange(k, device=device) if all_valid else valid.nonzero().flatten()
    if idx.numel():
        tested = shifted if all_valid else shifted[idx]
        below = torch.linalg.cholesky_ex(tested, upper=True).info == 0     # upper: no transposed copy
        quiet, todo = idx[below], idx[~below]
        if quiet.numel():
            generator = torch.Generator(device=device)
            generator.manual_seed(opts.seed)
            low = _lanczos_min(tested if bool(below.all()) else tested[below], _LANCZOS_STEPS, generator)
            top[quiet] = (shift[quiet] - low).clamp_min(0.0).sqrt()
        del shifted, tested
        if todo.numel():
            todo_list = todo.tolist()
            g64 = torch.stack([_gram64(views[i]) for i in todo_list])
            evals, evecs = torch.linalg.eigh(g64)
            sv = evals.flip(-1).clamp_min(0.0).sqrt()                       # descending singular values
            vecs = evecs.flip(-1)
            top[todo] = sv[:, 0].to(cdtype)
            sub_scale = scale[todo].double()
            eta = optimal_shrinker(sv / sub_scale[:, None], beta)
            spikes = (eta > 0).sum(dim=1)
            applied = (sv[:, 0] > apply_sv[todo].double()) & (spikes > 0)
            if opts.norm_correction:
                fro = torch.diagonal(g64, dim1=-2, dim2=-1).sum(-1).clamp_min(0.0).sqrt()   # ||Y||_F
                factor = fro / torch.linalg.vector_norm(eta, dim=1).clamp_min(torch.finfo(torch.float64).tiny)
            else:
                factor = sub_scale
            for j in applied.nonzero().flatten().tolist():
                r = int(spikes[j])
                coeff = (eta[j, :r] * factor[j] / sv[j, :r]).to(cdtype)      # U_r diag(d) = Y V_r diag(d / sigma)
                v_r = vecs[j, :, :r].to(cdtype)
                view = views[todo_list[j]].to(cdtype)
                results[todo_list[j]] = ((view @ v_r) * coeff) @ v_r.mT
                num_denoised += 1
                num_spikes += r
    ratio = torch.where(valid, top / torch.where(valid, edge_sv, torch.ones_like(edge_sv)), torch.zeros_like(top))
    stats = stats + DenoiseStats(num_matrices=k, num_denoised=num_denoised, num_spikes=num_spikes,
                                 max_edge_ratio=float(ratio.max()))
    return results, stats
