"""What a shrinkage call is asked to do (:class:`ShrinkageOptions`) and what it reports (:class:`DenoiseStats`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal, get_args

Method = Literal["auto", "full", "randomized"]
METHODS: tuple[str, ...] = get_args(Method)
#: first rank tried by ``method="randomized"`` when ``rank`` is not set
DEFAULT_RANK = 8


@dataclass(frozen=True)
class ShrinkageOptions:
    """How :func:`~dpl_plugins.denoise.shrinkage.optimal_shrinkage` and
    :func:`~dpl_plugins.denoise.shrinkage.denoise_matrices` denoise (validated on construction).

    Attributes:
        kappa: denoise a matrix only if its top singular value exceeds ``kappa * s * (sqrt(m) + sqrt(n))``.
        norm_correction: rescale each estimate to the Frobenius norm of its noisy matrix.
        method: ``"auto"`` (Cholesky certificate on the Gram matrix, then ``eigh`` of the float64 Gram of the
            matrices to denoise; equals ``"full"`` to float rounding), ``"full"`` (batched ``torch.linalg.svd``)
            or ``"randomized"`` (leading components only; see :func:`~dpl_plugins.denoise.svd.leading_svd`;
            equals ``"full"`` to about ``tol``).
        rank: first rank tried by ``"randomized"`` (default 8; doubled as needed); ignored by the others.
        oversample: extra sketch columns for ``"randomized"`` (default ``max(rank, 8)``).
        power_iters: power iterations of the first sketch (``"randomized"``).
        tol: estimated relative Frobenius error at which ``"randomized"`` stops refining a denoised matrix.
        max_refine: extra power iterations ``"randomized"`` may spend on a matrix before a full SVD of it.
        seed: seed of the private generator of the randomized sketch and of the Lanczos start of ``"auto"``'s
            statistics (the global RNG is not touched; the denoised values never depend on it with ``"auto"``).
    """

    kappa: float = 1.02
    norm_correction: bool = True
    method: Method = "auto"
    rank: int | None = None
    oversample: int | None = None
    power_iters: int = 2
    tol: float = 1e-3
    max_refine: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not (isinstance(self.kappa, (int, float)) and math.isfinite(self.kappa) and self.kappa > 0):
            raise ValueError(f"kappa must be a positive finite number, got {self.kappa!r}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
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
