"""The noise regime of a private step: the noise on the mean update against the clipped signal.

A step releases the mean of clipped per-unit gradients, each of norm at most C, plus Gaussian noise of std
sigma C / B per coordinate (sigma: the step's noise multiplier, B: the expected batch). Over d coordinates the
noise has norm about sigma C sqrt(d) / B, against a mean clipped signal of norm at most C. Their ratio,
``sigma sqrt(d) / B`` (:attr:`NoiseRegime.relative_noise`), is the quantity checked here; Sander, Stock & Sablayrolles,
"TAN without a burn: scaling laws of DP-SGD" (ICML 2023) show that at a fixed number of steps utility is governed
by the noise-batch ratio sigma / B.

:data:`HOPELESS` and :data:`QUIET` are read against this project's runs (``benchmarks/noise_regimes.py``, from the
committed results of the current studies; docs/planning.md): every run at a relative noise of 1 or less learned; the
frozen-feature classification runs up to 5.8 learned, less the noisier (61-64 % on SST-2 at 5.6-5.8, where the same
users reach 75-79 % at 0.4-1); correlated noise at 8.5 per step learned (BLT on MiniLM LoRA: 77.4 %), and full
fine-tuning of MiniLM at 14-14.8 learned (69.7-75.5 % on SST-2 at epsilon 1). No classification run lies above 14.8,
so the evidence does not place :data:`HOPELESS`: it marks "noisier than any classification run the project has seen
learn", not a measured edge. The check does not see how concentrated the gradients are: the one run above it, a
pretrained language model's LoRA on E2E generation (20), learned. So its words depend on the kind of task the driver
names (:data:`CLASSIFICATION`, :data:`GENERATION`, or none): only a classification run is told it is noisier than
any classification run seen to learn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

#: relative noise sigma sqrt(d) / B above which ``dpl fit`` warns: beyond every classification run seen to learn
HOPELESS = 16.0
#: relative noise at or below which the noise on a step is at most the largest clipped signal
QUIET = 1.0
#: the kinds of task the evidence behind :data:`HOPELESS` speaks of (a driver names its run's, or none)
CLASSIFICATION, GENERATION = "classification", "generation"


def hopeless_evidence(task_kind: str | None, unit: str = "") -> str:
    """What the project's runs say of a relative noise above :data:`HOPELESS` (``unit``: after the figures), for a
    run of ``task_kind``."""
    if task_kind == CLASSIFICATION:
        return f"above {HOPELESS:g}{unit}, noisier than any classification run the project has seen learn"
    return (f"above {HOPELESS:g}{unit}, where no classification run the project has seen learned and its one "
            f"generation run (a pretrained language model's LoRA on E2E, at 20{unit}) did")


@dataclass(frozen=True)
class NoiseRegime:
    """One step's noise against its clipped signal.

    Args:
        noise_multiplier: the noise std of one step's release per coordinate, in units of C, times B (sigma for
            DP-SGD; sigma times the mechanism's ``noise_scale`` for correlated noise).
        batch_size: the expected batch B the noisy sum is divided by.
        dimension: d, the number of coordinates the noise is added to (the trainable parameters).
        max_grad_norm: C, the clipping bound.
    """

    noise_multiplier: float
    batch_size: float
    dimension: int
    max_grad_norm: float

    @classmethod
    def of(cls, noise_multiplier: float, mechanism: Any, privacy: Any, dimension: int) -> NoiseRegime:
        """A run's regime: its sigma times the mechanism's declared ``noise_scale`` (1 for DP-SGD; ftrl: its
        sensitivity; the first step's marginal, later steps' are at least as large), B and C from ``privacy``."""
        return cls(noise_multiplier * float(mechanism.noise_scale), float(privacy.batch_size),
                   dimension, float(privacy.max_grad_norm))

    @property
    def noise_batch_ratio(self) -> float:
        """sigma / B."""
        return self.noise_multiplier / self.batch_size

    @property
    def relative_noise(self) -> float:
        """sigma sqrt(d) / B: the expected noise norm on the mean update in units of C (the clipped signal's bound)."""
        return self.noise_batch_ratio * math.sqrt(self.dimension)

    @property
    def noise_norm(self) -> float:
        """sigma C sqrt(d) / B: the expected norm of the noise on the mean update."""
        return self.relative_noise * self.max_grad_norm

    @property
    def hopeless(self) -> bool:
        """Whether the relative noise is above :data:`HOPELESS`."""
        return self.relative_noise > HOPELESS

    @property
    def quiet(self) -> bool:
        """Whether the relative noise is at most :data:`QUIET`."""
        return self.relative_noise <= QUIET

    def warning(self, task_kind: str | None = None) -> str:
        """The one line ``dpl fit`` logs when :attr:`hopeless`, citing the evidence for a run of ``task_kind``
        (:data:`CLASSIFICATION`, :data:`GENERATION`; ``None``: not said)."""
        advice = ("raise B or train fewer parameters" if task_kind == CLASSIFICATION else
                  "if the validation loss does not fall, raise B or train fewer parameters")
        return (f"dpl: the noise on each step's mean update, sigma C sqrt(d)/B = {self.relative_noise:.3g} C (sigma "
                f"{self.noise_multiplier:.3g}, B {self.batch_size:g}, d {self.dimension:,}), dwarfs the clipped signal "
                f"(<= C): {hopeless_evidence(task_kind, ' C')}; {advice} (dpl plan shows how; docs/planning.md)")


def needed_dimension(noise_multiplier: float, batch_size: float, relative_noise: float = QUIET) -> int:
    """The largest d whose relative noise sigma sqrt(d) / B is at most ``relative_noise`` (sigma does not depend
    on d)."""
    if noise_multiplier <= 0:
        return 2 ** 62
    return int((relative_noise * batch_size / noise_multiplier) ** 2)
