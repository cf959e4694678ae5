"""Random-matrix-theory optimal shrinkage of noisy gradient matrices (the math of the ``denoise`` plugin).

Seed paper: "Sample-efficient differentially private fine-tuning via gradient matrix denoising". The estimator is
the Shabalin-Nobel / Gavish-Donoho optimal shrinker for the Frobenius loss under known noise level; the seed's form
(lambda_hat = F^-1(y), eta = lambda_hat * c_u * c_v) is the same estimator.

For a noisy matrix Y (m x n) whose entries carry i.i.d. noise of known std ``s``:

* ``M = max(m, n)``, ``beta = min(m, n) / M``, scaled singular values ``y_i = sv_i / (s * sqrt(M))``;
* bulk edge ``1 + sqrt(beta)`` (in singular-value units: ``s * (sqrt(m) + sqrt(n))``);
* the matrix is denoised only if its top singular value exceeds ``kappa * s * (sqrt(m) + sqrt(n))``; otherwise
  it is returned unchanged, bit for bit;
* shrinker ``eta(y) = sqrt((y^2 - beta - 1)^2 - 4 beta) / y`` for ``y > 1 + sqrt(beta)``, else 0 (computed
  here in the equivalent, cancellation-free form ``sqrt((y^2 - (1+sqrt(beta))^2)(y^2 - (1-sqrt(beta))^2)) / y``);
* estimate ``U diag(eta(y) * s * sqrt(M)) V^T``; with ``norm_correction`` it is rescaled to the Frobenius norm
  of Y (the seed's Theorem 1 needs this).

Everything here is a function of the noisy matrix and the (public) noise std only: post-processing of a DP
release, no privacy logic. The functions are pure torch and run on any device. Computations run in float32
(float64 if the input is float64), never in half precision, whatever the input dtype; results are cast back.

Three methods give the same result. ``method="full"`` (the reference) runs a batched SVD of every matrix.

``method="auto"`` (the default) uses that the decision needs only the top singular value and the estimate only the
spikes above the edge. Per matrix, in the tall orientation (M >= N):

1. Certificate. ``sv_max(Y) < t`` iff ``t^2 I - Y^T Y`` is positive definite, which a Cholesky factorization
   decides exactly (up to rounding). One BLAS call forms ``t^2 (1 - 1e-3) I - Y^T Y`` (N x N) and a batched
   Cholesky per shape tests it at the threshold ``t = kappa * s * (sqrt(M) + sqrt(N))``; the 1e-3 margin is far
   above the measured float32 rounding of the Gram (~4e-7 relative, MiniLM shapes up to 30522 x 384). A matrix
   that passes is pure-noise-dominated and returned unchanged, bit for bit, without any decomposition. On a DP
   gradient that is most matrices, and it costs one Gram matrix (2 M N^2 flops) and one N x N Cholesky.
2. The others (top within 0.05% of the threshold or above it): ``eigh`` of the float64 Gram ``Y^T Y`` gives the
   singular values ``sqrt(lambda)`` and ``V``; the decision is taken on the exact top, as ``full`` does, and
   ``U_r = Y V_r / sigma_r`` is formed for the r kept spikes only. In float64 the spikes are exact to ~1e-7
   relative, so this path is more accurate than a float32 SVD (measured: 3e-7 vs 6e-6..4e-5 against a float64 SVD).

For the logged statistics, the top of a certified matrix is a 5-step Lanczos estimate on the shifted Gram (a
lower bound, typically 1-4% below the true value); denoised matrices report the exact top.

Only components above the bulk edge survive the shrinker, so ``method="randomized"`` starts from the leading
singular triplets of a batched randomized range finder (power iterations, a private seeded generator) and:

1. leaves a matrix unchanged when its top estimated singular value is below ``kappa`` times the edge by more than
   a 5% band (estimates from a sketch never exceed the true values, so the threshold test errs only there);
2. grows the rank (doubling, fresh sketch) until the last kept singular value is at or below the edge;
3. refines with further power iterations until an a-posteriori estimate of the reconstruction error (from the
   Ritz residuals) is below ``tol``, and otherwise falls back to the full SVD of that matrix.

So a denoised matrix equals the full-SVD result to about ``tol`` (default 1e-3; the estimate was 1-3x the
measured error where the bulk is separated from the edge; the same computation when it fell back), and a matrix
is left unchanged by "randomized" but denoised by "full" only if the sketch underestimated its top singular value
by more than the band. Caveat, measured: components just above the edge are ill-conditioned (the shrinker has
infinite slope there and the top of the noise bulk is nearly degenerate), and the top noise singular value is
usually within a few percent of the edge, so denoised matrices usually end in the fallback (which costs the
sketch on top of the SVD). The speed-up is for matrices that are not denoised (pure noise): a sketch instead of
an SVD.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "DenoiseStats",
    "denoise_matrices",
    "optimal_shrinkage",
    "optimal_shrinker",
    "spike_inverse",
]

Method = Literal["auto", "full", "randomized"]
_METHODS = ("auto", "full", "randomized")
_DEFAULT_RANK = 8
_BATCH_ELEMENTS = 1 << 26  # denoise_matrices stacks at most this many entries (or one matrix) per batched SVD


@dataclass(frozen=True)
class DenoiseStats:
    """Public statistics of one denoising call (functions of the noisy matrices and the noise std only).

    Attributes:
        num_matrices: 2-D matrices seen (denoised or not).
        num_denoised: matrices whose top singular value exceeded ``kappa`` times the bulk edge (and that had at
            least one component above the edge), i.e. that were replaced by their shrunken estimate.
        num_spikes: components kept (scaled singular value above the bulk edge ``1 + sqrt(beta)``), summed over
            the denoised matrices.
        max_edge_ratio: max over the matrices of ``top singular value / (s * (sqrt(m) + sqrt(n)))``; matrices
            with noise std 0 or non-finite entries are left out. 0.0 when no matrix counts. The top value of a
            matrix that is not denoised is a lower estimate with ``method="auto"`` (5 Lanczos steps on its Gram
            matrix: typically 1-4% low on pure noise) and ``method="randomized"`` (the sketch's: 2-8% low).
    """

    num_matrices: int = 0
    num_denoised: int = 0
    num_spikes: int = 0
    max_edge_ratio: float = 0.0

    def __add__(self, other: DenoiseStats) -> DenoiseStats:
        if not isinstance(other, DenoiseStats):
            return NotImplemented
        return DenoiseStats(
            num_matrices=self.num_matrices + other.num_matrices,
            num_denoised=self.num_denoised + other.num_denoised,
            num_spikes=self.num_spikes + other.num_spikes,
            max_edge_ratio=max(self.max_edge_ratio, other.max_edge_ratio),
        )

    def as_dict(self) -> dict[str, float]:
        """The fields as a flat dict (for logging)."""
        return {key: float(value) for key, value in asdict(self).items()}


# ----------------------------------------------------------------------------------------------- formulas


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


# ----------------------------------------------------------------------------------------------- internals


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _std_vector(noise_std: float | Tensor, k: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """Noise std as a (k,) tensor; validated finite and >= 0."""
    if isinstance(noise_std, Tensor):
        s = noise_std.detach().to(device=device, dtype=dtype)
        if s.ndim == 0:
            s = s.expand(k)
        elif s.shape != (k,):
            raise ValueError(f"noise_std must be a scalar or have shape ({k},), got {tuple(s.shape)}")
    else:
        if isinstance(noise_std, bool) or not isinstance(noise_std, (int, float)):
            raise TypeError(f"noise_std must be a float or a tensor, got {type(noise_std).__name__}")
        s = torch.full((k,), float(noise_std), device=device, dtype=dtype)
    if k and not bool(torch.all(torch.isfinite(s) & (s >= 0))):
        raise ValueError(f"noise_std must be finite and >= 0, got {noise_std!r}")
    return s


def _shrinker_slope(y: Tensor, beta: float) -> Tensor:
    """d eta / d y for y above the bulk edge (inf at the edge), 0 below it."""
    root = math.sqrt(beta)
    y2 = y * y
    p = (y2 - (1.0 + root) ** 2).clamp_min(0.0) * (y2 - (1.0 - root) ** 2).clamp_min(0.0)
    sp = p.sqrt()
    slope = (2.0 * y2 - (1.0 + root) ** 2 - (1.0 - root) ** 2) / sp - sp / y2
    return torch.where(y > 1.0 + root, slope, torch.zeros_like(slope))


def _sketch(a: Tensor, width: int, power_iters: int, generator: torch.Generator) -> Tensor:
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
        lipschitz = torch.maximum(torch.maximum(divided, _shrinker_slope(y[:, :keep], beta).abs()),
                                  torch.ones_like(divided))
        kept = torch.where(eta[:, :keep] > 0, lipschitz * res[:, :keep], torch.zeros_like(divided))
        err2 = err2 + (kept * kept).sum(dim=1)
    eta_norm = torch.linalg.vector_norm(eta, dim=1)
    err = err2.sqrt() / torch.where(eta_norm > 0, eta_norm, torch.ones_like(eta_norm))
    return torch.nan_to_num(err, nan=math.inf)


_DECISION_BAND = 0.05  # Ritz tops this close below the threshold are refined before a matrix is left unchanged


def _leading_svd(a: Tensor, scale: Tensor, edge_sv: Tensor, apply_sv: Tensor, beta: float, rank: int,
                 oversample: int | None, power_iters: int, tol: float, max_refine: int, seed: int
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """Singular triplets of ``a`` (k, M, N), M >= N, enough to denoise it as the full SVD would.

    Per matrix: a randomized sketch of width ``r + oversample`` gives Ritz triplets (lower estimates of the
    singular values). A matrix whose top Ritz value is below the threshold ``apply_sv`` (by more than the decision
    band) is left to the caller as not denoised. Otherwise it is refined by further power iterations until (a) the
    top Ritz value is above the threshold, (b) the r-th (last kept) Ritz value is at or below the edge ``edge_sv``
    (else the rank doubles and a fresh, wider sketch starts), and (c) the estimated relative error of the
    shrunken reconstruction is at most ``tol``. Matrices that do not get there within ``max_refine`` iterations,
    or whose sketch would be wider than half of N, get a full SVD.
    Returns U (k, M, R), S (k, R), Vh (k, R, N), zero-padded where a matrix has fewer than R triplets.
    """
    k, m, n = a.shape
    generator = torch.Generator(device=a.device)
    generator.manual_seed(seed)
    pieces: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []  # (batch indices, U, S, Vh)
    todo = torch.arange(k, device=a.device)
    r = min(rank, n)
    while todo.numel():
        width = r + (oversample if oversample is not None else max(r, 8))
        if 2 * width > n:  # a sketch this wide costs about as much as the full SVD: do that instead
            pieces.append((todo, *torch.linalg.svd(a[todo], full_matrices=False)))
            break
        idx, sub = todo, a[todo]
        q = _sketch(sub, width, power_iters, generator)
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


def _shrink_tall(a: Tensor, s: Tensor, opts: _Options) -> tuple[Tensor | None, Tensor, DenoiseStats]:
    """Core on a batch ``a`` (k, M, N), M >= N, already in the compute dtype; ``s`` (k,) noise std.

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
        u, sv, vh = _leading_svd(a, scale, edge_sv, apply_sv, beta, opts.rank or _DEFAULT_RANK, opts.oversample,
                                 opts.power_iters, opts.tol, opts.max_refine, opts.seed)

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


def _gram_shrink(views: Sequence[Tensor], s: Tensor, opts: _Options) -> tuple[list[Tensor | None], DenoiseStats]:
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
            estimate, applied, stats = _shrink_tall(torch.stack([views[i].to(cdtype) for i in overflow]),
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


@dataclass(frozen=True)
class _Options:
    kappa: float
    norm_correction: bool
    method: str
    rank: int | None
    oversample: int | None
    power_iters: int
    tol: float
    max_refine: int
    seed: int

    def __post_init__(self) -> None:
        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not (isinstance(self.kappa, (int, float)) and math.isfinite(self.kappa) and self.kappa > 0):
            raise ValueError(f"kappa must be a positive finite number, got {self.kappa!r}")
        if self.method not in _METHODS:
            raise ValueError(f"method must be one of {_METHODS}, got {self.method!r}")
        if self.rank is not None and not (is_int(self.rank) and self.rank >= 1):
            raise ValueError(f"rank must be a positive int or None, got {self.rank!r}")
        if self.oversample is not None and not (is_int(self.oversample) and self.oversample >= 0):
            raise ValueError(f"oversample must be a non-negative int or None, got {self.oversample!r}")
        for name in ("power_iters", "max_refine"):
            value = getattr(self, name)
            if not (is_int(value) and value >= 0):
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if not (isinstance(self.tol, (int, float)) and self.tol > 0):
            raise ValueError(f"tol must be a positive number, got {self.tol!r}")


def _as_tall(t: Tensor) -> tuple[Tensor, bool]:
    """View with rows >= columns (LAPACK's SVD is several times faster that way), and whether it is transposed."""
    return (t.mT, True) if t.shape[-2] < t.shape[-1] else (t, False)


# ----------------------------------------------------------------------------------------------- public API


@torch.no_grad()
def optimal_shrinkage(
    Y: Tensor,
    noise_std: float | Tensor,
    kappa: float = 1.02,
    norm_correction: bool = True,
    method: Method = "auto",
    rank: int | None = None,
    *,
    oversample: int | None = None,
    power_iters: int = 2,
    tol: float = 1e-3,
    max_refine: int = 2,
    seed: int = 0,
) -> tuple[Tensor, DenoiseStats]:
    """Denoise one matrix (m, n) or a batch (k, m, n) of same-shaped matrices by optimal singular-value shrinkage.

    Args:
        Y: the noisy matrix or batch of matrices (floating point; any dtype, any device).
        noise_std: per-entry noise std ``s``: a float, a 0-d tensor, or a (k,) tensor (one per batched matrix).
            A matrix with ``s == 0`` has no noise to remove and is returned unchanged.
        kappa: denoise a matrix only if its top singular value exceeds ``kappa * s * (sqrt(m) + sqrt(n))``.
        norm_correction: rescale each estimate to the Frobenius norm of its noisy matrix.
        method: ``"auto"`` (Cholesky certificate on the Gram matrix, then ``eigh`` of the float64 Gram of the
            matrices to denoise; equals ``"full"`` to float rounding), ``"full"`` (batched ``torch.linalg.svd``)
            or ``"randomized"`` (leading components only; see the module docstring and :func:`_leading_svd`;
            equals ``"full"`` to about ``tol``).
        rank: first rank tried by ``"randomized"`` (default 8; doubled as needed); ignored by ``"full"``.
        oversample: extra sketch columns for ``"randomized"`` (default ``max(rank, 8)``).
        power_iters: power iterations of the first sketch (``"randomized"``).
        tol: estimated relative Frobenius error at which ``"randomized"`` stops refining a denoised matrix.
        max_refine: extra power iterations ``"randomized"`` may spend on a matrix before a full SVD of it.
        seed: seed of the private generator of the randomized sketch and of the Lanczos start of ``"auto"``'s
            statistics (the global RNG is not touched; the denoised values never depend on it with ``"auto"``).

    Returns:
        ``(denoised, stats)``: ``denoised`` has the shape, dtype and device of ``Y``; matrices that are not
        denoised are copied bit for bit (if none is, ``Y`` itself is returned). Matrices with non-finite entries
        are left unchanged. ``stats`` is a :class:`DenoiseStats`.
    """
    opts = _Options(kappa, norm_correction, method, rank, oversample, power_iters, tol, max_refine, seed)
    if not isinstance(Y, Tensor) or Y.ndim not in (2, 3):
        raise ValueError(f"Y must be a tensor of shape (m, n) or (k, m, n), got {getattr(Y, 'shape', type(Y))}")
    if not Y.is_floating_point():
        raise TypeError(f"Y must be a floating-point tensor, got {Y.dtype}")
    batched = Y.ndim == 3
    batch = Y if batched else Y.unsqueeze(0)
    tall, transposed = _as_tall(batch)
    cdtype = _compute_dtype(Y.dtype)
    s = _std_vector(noise_std, batch.shape[0], Y.device, cdtype)
    if method == "auto":
        results, stats = _gram_shrink(list(tall.unbind(0)), s, opts)
        if all(r is None for r in results):
            return Y, stats
        out = tall.clone()
        for i, result in enumerate(results):
            if result is not None:
                out[i] = result.to(Y.dtype)
    else:
        estimate, applied, stats = _shrink_tall(tall.to(cdtype), s, opts)
        if estimate is None:
            return Y, stats
        out = torch.where(applied[:, None, None], estimate.to(Y.dtype), tall)
    if transposed:
        out = out.mT
    out = out.contiguous()
    return (out if batched else out[0]), stats


@torch.no_grad()
def denoise_matrices(
    grads: Mapping[str, Tensor],
    noise_std: float | Tensor | Mapping[str, float | Tensor],
    kappa: float = 1.02,
    norm_correction: bool = True,
    method: Method = "auto",
    rank: int | None = None,
    *,
    oversample: int | None = None,
    power_iters: int = 2,
    tol: float = 1e-3,
    max_refine: int = 2,
    seed: int = 0,
) -> tuple[dict[str, Tensor], DenoiseStats]:
    """Denoise every 2-D tensor of ``grads``; other tensors (biases, LayerNorm weights, scalars) pass through.

    Matrices with the same shape up to transposition (so 1536x384 and 384x1536 share a batch), device and compute
    dtype run in one batch (``"full"``, ``"randomized"``: one batched SVD in chunks of at most 2**26 entries;
    ``"auto"``: one batched Cholesky of their Gram matrices, without stacking or copying the matrices themselves);
    each keeps its own noise std.
    ``noise_std`` is one value for all, or a mapping by key that covers every 2-D tensor. The other arguments are
    those of :func:`optimal_shrinkage`.

    Returns a new dict (same keys, same order; tensors left unchanged are the same objects) and the summed
    :class:`DenoiseStats`.
    """
    opts = _Options(kappa, norm_correction, method, rank, oversample, power_iters, tol, max_refine, seed)
    out = dict(grads)
    groups: dict[tuple, list[str]] = {}
    stds: dict[str, float] = {}
    for key, tensor in grads.items():
        if tensor.ndim != 2:
            continue
        if not tensor.is_floating_point():
            raise TypeError(f"gradient {key!r} must be floating point to be denoised, got {tensor.dtype}")
        if isinstance(noise_std, Mapping):
            if key not in noise_std:
                raise KeyError(f"noise_std has no entry for the matrix {key!r}")
            stds[key] = float(noise_std[key])
        else:
            stds[key] = float(noise_std)
        m, n = tensor.shape
        groups.setdefault((max(m, n), min(m, n), tensor.device, _compute_dtype(tensor.dtype)), []).append(key)

    stats = DenoiseStats()
    chunks = []
    for (m, n, device, cdtype), keys in groups.items():
        if method == "auto":  # no stacking: a (k, n, n) batch of Gram matrices is what is held at once
            size = max(1, _BATCH_ELEMENTS // max(1, n * n))
            for i in range(0, len(keys), size):
                part = keys[i:i + size]
                views = [_as_tall(grads[key]) for key in part]
                s = _std_vector(torch.tensor([stds[key] for key in part], dtype=torch.float64), len(part), device,
                                cdtype)
                results, group_stats = _gram_shrink([view for view, _ in views], s, opts)
                stats = stats + group_stats
                for key, (_, transposed), result in zip(part, views, results):
                    if result is not None:
                        result = result.to(grads[key].dtype)
                        out[key] = (result.mT if transposed else result).contiguous()
            continue
        size = max(1, _BATCH_ELEMENTS // max(1, m * n))  # bound the memory of one batched SVD
        chunks.extend((device, cdtype, keys[i:i + size]) for i in range(0, len(keys), size))
    for device, cdtype, keys in chunks:
        views = [_as_tall(grads[key]) for key in keys]
        batch = torch.stack([view.to(cdtype) for view, _ in views])
        s = _std_vector(torch.tensor([stds[key] for key in keys], dtype=torch.float64), len(keys), device, cdtype)
        estimate, applied, group_stats = _shrink_tall(batch, s, opts)
        del batch
        stats = stats + group_stats
        if estimate is None:
            continue
        for i in applied.nonzero().flatten().tolist():
            key = keys[i]
            result = estimate[i].to(grads[key].dtype)
            out[key] = (result.mT if views[i][1] else result).contiguous()
    return out, stats
