"""Random-matrix-theory optimal shrinkage of noisy gradient matrices (the math of the ``denoise`` plugin).

Dadsetan and Rudzicz, "Sample-Efficient Differentially Private Fine-Tuning via Gradient Matrix Denoising" (arXiv
2510.01137, 2025). The estimator is the Shabalin-Nobel / Gavish-Donoho optimal shrinker for the Frobenius loss under
known noise level; the paper's form (lambda_hat = F^-1(y), eta = lambda_hat * c_u * c_v) is the same estimator.

The code: :mod:`~dpl_plugins.denoise.shrinker` (the shrinker), :mod:`~dpl_plugins.denoise.gram` (``"auto"``),
:mod:`~dpl_plugins.denoise.svd` (``"full"``, ``"randomized"``), :mod:`~dpl_plugins.denoise.options` (options and
statistics); this module batches the matrices and drives them.

For a noisy matrix Y (m x n) whose entries carry i.i.d. noise of known std ``s``:

* ``M = max(m, n)``, ``beta = min(m, n) / M``, scaled singular values ``y_i = sv_i / (s * sqrt(M))``;
* bulk edge ``1 + sqrt(beta)`` (in singular-value units: ``s * (sqrt(m) + sqrt(n))``);
* the matrix is denoised only if its top singular value exceeds ``kappa * s * (sqrt(m) + sqrt(n))``; otherwise
  it is returned unchanged, bit for bit;
* shrinker ``eta(y) = sqrt((y^2 - beta - 1)^2 - 4 beta) / y`` for ``y > 1 + sqrt(beta)``, else 0 (computed
  here in the equivalent, cancellation-free form ``sqrt((y^2 - (1+sqrt(beta))^2)(y^2 - (1-sqrt(beta))^2)) / y``);
* estimate ``U diag(eta(y) * s * sqrt(M)) V^T``; with ``norm_correction`` it is rescaled to the Frobenius norm
  of Y (the paper's Theorem 1 needs this).

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

from collections.abc import Mapping

import torch
from torch import Tensor

from dpl_plugins.denoise.gram import gram_shrink
from dpl_plugins.denoise.options import DenoiseStats, Method, ShrinkageOptions
from dpl_plugins.denoise.shrinker import optimal_shrinker, spike_inverse
from dpl_plugins.denoise.svd import shrink_tall

__all__ = [
    "DenoiseStats",
    "Method",
    "ShrinkageOptions",
    "denoise_matrices",
    "optimal_shrinkage",
    "optimal_shrinker",
    "spike_inverse",
]

DEFAULTS = ShrinkageOptions()
_BATCH_ELEMENTS = 1 << 26  # denoise_matrices stacks at most this many entries (or one matrix) per batched SVD


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


def _as_tall(t: Tensor) -> tuple[Tensor, bool]:
    """View with rows >= columns (LAPACK's SVD is several times faster that way), and whether it is transposed."""
    return (t.mT, True) if t.shape[-2] < t.shape[-1] else (t, False)


@torch.no_grad()
def optimal_shrinkage(
    Y: Tensor,
    noise_std: float | Tensor,
    options: ShrinkageOptions = DEFAULTS,
) -> tuple[Tensor, DenoiseStats]:
    """Denoise one matrix (m, n) or a batch (k, m, n) of same-shaped matrices by optimal singular-value shrinkage.

    Args:
        Y: the noisy matrix or batch of matrices (floating point; any dtype, any device).
        noise_std: per-entry noise std ``s``: a float, a 0-d tensor, or a (k,) tensor (one per batched matrix).
            A matrix with ``s == 0`` has no noise to remove and is returned unchanged.
        options: kappa, method, ... (see :class:`~dpl_plugins.denoise.options.ShrinkageOptions`).

    Returns:
        ``(denoised, stats)``: ``denoised`` has the shape, dtype and device of ``Y``; matrices that are not
        denoised are copied bit for bit (if none is, ``Y`` itself is returned). Matrices with non-finite entries
        are left unchanged. ``stats`` is a :class:`DenoiseStats`.
    """
    if not isinstance(Y, Tensor) or Y.ndim not in (2, 3):
        raise ValueError(f"Y must be a tensor of shape (m, n) or (k, m, n), got {getattr(Y, 'shape', type(Y))}")
    if not Y.is_floating_point():
        raise TypeError(f"Y must be a floating-point tensor, got {Y.dtype}")
    batched = Y.ndim == 3
    batch = Y if batched else Y.unsqueeze(0)
    tall, transposed = _as_tall(batch)
    cdtype = _compute_dtype(Y.dtype)
    s = _std_vector(noise_std, batch.shape[0], Y.device, cdtype)
    if options.method == "auto":
        results, stats = gram_shrink(list(tall.unbind(0)), s, options)
        if all(r is None for r in results):
            return Y, stats
        out = tall.clone()
        for i, result in enumerate(results):
            if result is not None:
                out[i] = result.to(Y.dtype)
    else:
        estimate, applied, stats = shrink_tall(tall.to(cdtype), s, options)
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
    options: ShrinkageOptions = DEFAULTS,
) -> tuple[dict[str, Tensor], DenoiseStats]:
    """Denoise every 2-D tensor of ``grads``; other tensors (biases, LayerNorm weights, scalars) pass through.

    Matrices with the same shape up to transposition (so 1536x384 and 384x1536 share a batch), device and compute
    dtype run in one batch (``"full"``, ``"randomized"``: one batched SVD in chunks of at most 2**26 entries;
    ``"auto"``: one batched Cholesky of their Gram matrices, without stacking or copying the matrices themselves);
    each keeps its own noise std.
    ``noise_std`` is one value for all, or a mapping by key that covers every 2-D tensor. ``options`` are
    those of :func:`optimal_shrinkage`.

    Returns a new dict (same keys, same order; tensors left unchanged are the same objects) and the summed
    :class:`DenoiseStats`.
    """
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
        if options.method == "auto":  # no stacking: a (k, n, n) batch of Gram matrices is what is held at once
            size = max(1, _BATCH_ELEMENTS // max(1, n * n))
            for i in range(0, len(keys), size):
                part = keys[i:i + size]
                views = [_as_tall(grads[key]) for key in part]
                s = _std_vector(torch.tensor([stds[key] for key in part], dtype=torch.float64), len(part), device,
                                cdtype)
                results, group_stats = gram_shrink([view for view, _ in views], s, options)
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
        estimate, applied, group_stats = shrink_tall(batch, s, options)
        del batch
        stats = stats + group_stats
        if estimate is None:
            continue
        for i in applied.nonzero().flatten().tolist():
            key = keys[i]
            result = estimate[i].to(grads[key].dtype)
            out[key] = (result.mT if views[i][1] else result).contiguous()
    return out, stats
