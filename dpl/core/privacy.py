"""The privacy settings of a run."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Literal

from dpl.core import clipping_policy as policy
from dpl.core.privacy_unit import check_setting
from dpl.errors import ConfigError, PrivacyWarning


@dataclass
class PrivacyConfig:
    """Privacy settings of a run (``model.privacy`` in the YAML config).

    Args:
        target_epsilon: epsilon to reach at the end of training; the noise multiplier is calibrated to it.
        target_delta: delta; default 1 / (10 N) for N training examples, so that N * delta = 0.1 (a warning if
            N * delta > 0.1). delta is the probability with which the guarantee may fail outright; a mechanism
            that published each example with probability delta would be (0, delta)-DP and expose N * delta
            examples on average, so N * delta must be small.
        max_epsilon: privacy budget: training stops (checkpoint written, summary printed) before a step would
            spend more, also after a resume, and a plan that would exceed it is refused before training.
            Default: ``target_epsilon`` (none if only ``noise_multiplier`` is set).
        noise_multiplier: sigma (noise std / C). If set, it is used as is (``target_epsilon`` is ignored) and
            the epsilon it gives is reported.
        max_grad_norm: clipping bound C on each example's gradient (its L2 norm); ``.inf`` disables
            clipping (only meaningful with ``noise_multiplier: 0``, i.e. non-private training).
        batch_size: expected logical batch size B; Poisson sampling rate q = B / N.
        physical_batch_size: most examples per forward/backward pass (bounds memory; no effect on privacy), or
            ``auto``: the largest that fits ``physical_batch_memory``, found before training by probing the private
            step on a public batch at the longest configured length (:mod:`dpl.core.micro_batch`; one process).
        physical_batch_memory: MiB the private step may use under ``physical_batch_size: auto``, above what the
            process holds before it (Linux: resident memory; CUDA: the allocator's reserved memory), ``auto``'s
            clipping state included; default: 90% of the free CUDA memory, half the available RAM on a CPU.
        accountant: ``prv`` (default; falls back to ``rdp`` if PRV fails) or ``rdp``.
        seed: seed of the noise and sampling generators. Only for reproducible experiments: a seed that is
            known makes the noise known. Default: OS entropy (the generators' whole state).
        secure_noise: draw the noise from the operating system's CSPRNG with the floating-point-attack
            mitigation of opacus' secure mode (see :mod:`dpl.core.noise`); slower, never reproducible.
        force_resume: resume from a checkpoint even though sigma, C, the sampling rate, delta or the mechanism
            changed; epsilon is then composed over both parts (never reset). Without it such a resume is refused.
        log_epsilon_every_n_steps: how often epsilon spent is logged (and at the end).
        unit: what one neighbouring data set adds or removes: ``example`` (one row; default) or ``user`` (all the
            rows of one user, named by the data's ``user_column``): then the guarantee, epsilon and delta (default
            1 / (10 users)) are per user, and ``batch_size`` counts users under ``user_sampling: users``.
        max_rows_per_user: k, the most rows one user contributes (``unit: user``; required there).
        user_sampling: how ``unit: user`` samples: ``users`` (user-level sampling: Poisson over users, up to k rows
            of each sampled user, the user's mean gradient clipped to C as one unit, accounted as DP-SGD over users)
            or ``rows`` (example-level sampling: each user bounded to k rows once, rows Poisson-sampled and clipped
            one by one, accounted per user with the mixture-of-Gaussians accountant).
        clipping_memory: what the per-example clipping of the default estimator holds in memory (docs/scaling.md):
            ``fast`` (one backward pass; every layer's input and output gradient held until all norms are known),
            ``low`` (norms during the backward pass, each layer's state freed at once, then a second backward pass
            for the clipped sum: the non-private step's memory, activation checkpointing included, at about one
            more backward pass) or ``auto`` (default: ``low``, except that layers whose per-example gradients fit
            ``clipping_memory_budget`` keep them; with all of them kept, one backward pass; under bf16 the others
            keep ``fast``'s state). No effect on privacy.
        clipping_memory_budget: MiB of per-example gradients and books ``auto`` may hold; default: a quarter of the
            free device memory on CUDA, of the available RAM (``MemAvailable``) on a CPU, read at the first step;
            under ``physical_batch_size: auto`` what the step leaves of ``physical_batch_memory`` (at most this).
        clipping: ``flat`` (default: each example's whole gradient clipped to C) or ``per_layer`` (group-wise: each
            group of parameters clipped to its own C_g with sum_g C_g^2 = C^2, inside the one backward pass: the
            non-private step's memory at about its time; same sigma and epsilon; ``clipping_memory`` is then unused).
        clipping_groups: ``per_layer``'s groups as parameter-name patterns (``fnmatch``; a parameter joins the first
            it matches); default: each trainable layer (its weight and bias together) is a group.
        clipping_thresholds: ``fixed`` (default: C_g proportional to the square root of the group's parameters, or
            ``clipping_split``) or ``adaptive`` (each C_g moves toward the ``clipping_quantile`` of its per-example
            norms from a noisy count each step, the C_g rescaled to sum_g C_g^2 = C^2; the counts' noise takes
            ``clipping_count_share`` of the step's privacy: docs/privacy.md).
        clipping_split: the stated thresholds C_g, one per group in order (their squares must add up to C^2); with
            ``adaptive``, the first step's.
        clipping_quantile: ``adaptive``'s target quantile of each group's per-example norms (0.5: the median).
        clipping_rate: ``adaptive``'s geometric step eta: C_g <- C_g exp(-eta (b_g - quantile)).
        clipping_count_share: ``adaptive``: the counts' part of 1/sigma^2 (the gradient's noise multiplier is then
            sigma / sqrt(1 - share), the counts' noise std sqrt(G) sigma / (2 sqrt(share)) over G groups).
        adjacency: the neighbouring relation the guarantee must hold for: ``add_remove`` (one example added or
            removed), ``zero_out`` (one example's contribution replaced by zero) or ``replace_one`` (one example
            replaced by another). Default: the mechanism's own (DP-SGD: add_remove; ftrl: zero_out). A
            mechanism that cannot give the one asked for is refused (ftrl's shuffled order gives replace_one at
            twice the noise).
    """

    target_epsilon: float | None = 3.0
    target_delta: float | None = None
    noise_multiplier: float | None = None
    max_grad_norm: float = 1.0
    batch_size: int = 64
    physical_batch_size: int | Literal["auto"] = 32
    physical_batch_memory: float | None = None
    accountant: Literal["prv", "rdp"] = "prv"
    seed: int | None = None
    max_epsilon: float | None = None
    secure_noise: bool = False
    force_resume: bool = False
    log_epsilon_every_n_steps: int = 1
    adjacency: Literal["add_remove", "zero_out", "replace_one"] | None = None
    unit: Literal["example", "user"] = "example"
    max_rows_per_user: int | None = None
    user_sampling: Literal["users", "rows"] = "users"
    clipping_memory: Literal["fast", "low", "auto"] = "auto"
    clipping_memory_budget: float | None = None
    clipping: Literal["flat", "per_layer"] = "flat"
    clipping_groups: list[str] | None = None
    clipping_thresholds: Literal["fixed", "adaptive"] = "fixed"
    clipping_split: list[float] | None = None
    clipping_quantile: float = 0.5
    clipping_rate: float = 0.2
    clipping_count_share: float = 0.1

    def validate(self) -> None:
        """Raise :class:`~dpl.errors.ConfigError` with one line for an unusable setting."""
        if self.target_epsilon is None and self.noise_multiplier is None:
            raise ConfigError("set privacy.target_epsilon (or privacy.noise_multiplier)")
        if self.target_epsilon is not None and not self.target_epsilon > 0:
            raise ConfigError(f"privacy.target_epsilon must be > 0, got {self.target_epsilon}")
        if self.target_delta is not None and not 0 < self.target_delta < 1:
            raise ConfigError(f"privacy.target_delta must be in (0, 1), got {self.target_delta}")
        if self.noise_multiplier is not None and not self.noise_multiplier >= 0:
            raise ConfigError(f"privacy.noise_multiplier must be >= 0, got {self.noise_multiplier}")
        if not self.max_grad_norm > 0:
            raise ConfigError(f"privacy.max_grad_norm (C) must be > 0, got {self.max_grad_norm}")
        if math.isinf(self.max_grad_norm) and (self.noise_multiplier or 0) > 0:
            raise ConfigError("privacy.max_grad_norm is infinite: noise would be infinite too; set a finite C")
        if self.batch_size < 1:
            raise ConfigError(f"privacy.batch_size must be >= 1, got {self.batch_size}")
        if self.physical_batch_size != "auto" and (isinstance(self.physical_batch_size, bool) or not isinstance(
                self.physical_batch_size, int) or self.physical_batch_size < 1):
            raise ConfigError(f"privacy.physical_batch_size must be an integer >= 1 or auto, got "
                              f"{self.physical_batch_size!r}")
        if self.physical_batch_memory is not None and not self.physical_batch_memory > 0:
            raise ConfigError(f"privacy.physical_batch_memory (MiB) must be > 0, got {self.physical_batch_memory}")
        if self.max_epsilon is not None and not self.max_epsilon > 0:
            raise ConfigError(f"privacy.max_epsilon must be > 0, got {self.max_epsilon}")
        if self.secure_noise and self.seed is not None:
            raise ConfigError("privacy.secure_noise draws from the OS CSPRNG and cannot be seeded: unset privacy.seed")
        if self.log_epsilon_every_n_steps < 1:
            raise ConfigError("privacy.log_epsilon_every_n_steps must be >= 1")
        check_setting(self.unit, self.max_rows_per_user)
        policy.check_choice("clipping_memory", self.clipping_memory, policy.CLIPPING_MEMORY)
        if self.clipping_memory_budget is not None and not self.clipping_memory_budget >= 0:
            raise ConfigError(f"privacy.clipping_memory_budget (MiB) must be >= 0, got {self.clipping_memory_budget}")
        self._validate_clipping()
        if self.max_rows_per_user is not None and self.max_rows_per_user < 1:
            raise ConfigError(f"privacy.max_rows_per_user must be >= 1, got {self.max_rows_per_user}")

    def _validate_clipping(self) -> None:
        policy.check_choice("clipping", self.clipping, policy.CLIPPING)
        policy.check_choice("clipping_thresholds", self.clipping_thresholds, policy.THRESHOLDS)
        if self.clipping == "flat":
            named = [name for name, value in (("clipping_groups", self.clipping_groups),
                                              ("clipping_split", self.clipping_split)) if value is not None]
            if self.clipping_thresholds != "fixed":
                named.append("clipping_thresholds")
            if named:
                raise ConfigError(f"privacy.{named[0]} needs privacy.clipping: per_layer")
            return
        if math.isinf(self.max_grad_norm):
            raise ConfigError("privacy.clipping per_layer splits a finite max_grad_norm C over the groups")
        if self.clipping_groups is not None and not self.clipping_groups:
            raise ConfigError("privacy.clipping_groups is empty: name at least one pattern (or leave it unset)")
        if not 0 < self.clipping_quantile < 1:
            raise ConfigError(f"privacy.clipping_quantile must be in (0, 1), got {self.clipping_quantile}")
        if not self.clipping_rate > 0:
            raise ConfigError(f"privacy.clipping_rate must be > 0, got {self.clipping_rate}")
        if not 0 < self.clipping_count_share < 1:
            raise ConfigError(f"privacy.clipping_count_share must be in (0, 1), got {self.clipping_count_share}")

    @property
    def adaptive_clipping(self) -> bool:
        """Whether the thresholds adapt (their noisy counts are part of the release)."""
        return self.clipping == "per_layer" and self.clipping_thresholds == "adaptive"

    def delta_for(self, num_examples: int) -> float:
        return self.target_delta if self.target_delta is not None else 0.1 / num_examples

    @property
    def effective_max_epsilon(self) -> float | None:
        """The epsilon training may never exceed (``max_epsilon``, else ``target_epsilon`` when sigma is
        calibrated to it)."""
        if self.max_epsilon is not None:
            return self.max_epsilon
        return self.target_epsilon if self.noise_multiplier is None else None


def warn_if_seeded(privacy: PrivacyConfig, stacklevel: int = 3) -> None:
    """Warn that ``privacy.seed`` makes the noise and the batches predictable (experiments only)."""
    if privacy.seed is not None:
        warnings.warn("privacy.seed is set: noise and batches are reproducible, and so predictable by anyone who "
                      "knows the seed. Use it for experiments, never in production.", PrivacyWarning,
                      stacklevel=stacklevel)
