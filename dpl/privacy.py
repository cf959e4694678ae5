"""The privacy settings of a run."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from dpl.errors import ConfigError


@dataclass
class PrivacyConfig:
    """Privacy settings of a run (``model.privacy`` in the YAML config).

    Args:
        target_epsilon: epsilon to reach at the end of training; the noise multiplier is calibrated to it.
        target_delta: delta; default 1 / N^1.1 for N training examples (a warning if >= 1/N).
        noise_multiplier: sigma (noise std / C). If set, it is used as is (``target_epsilon`` is ignored) and
            the epsilon it gives is reported.
        max_grad_norm: clipping bound C on each example's gradient (its L2 norm); ``.inf`` disables
            clipping (only meaningful with ``noise_multiplier: 0``, i.e. non-private training).
        batch_size: expected logical batch size B; Poisson sampling rate q = B / N.
        physical_batch_size: most examples per forward/backward pass (bounds memory; no effect on privacy).
        accountant: ``prv`` (default; falls back to ``rdp`` if PRV fails) or ``rdp``.
        seed: seed of the noise and sampling generators. Only for reproducible experiments: a seed that is
            known makes the noise known. Default: OS entropy.
        log_epsilon_every_n_steps: how often epsilon spent is logged (and at the end).
    """

    target_epsilon: float | None = 3.0
    target_delta: float | None = None
    noise_multiplier: float | None = None
    max_grad_norm: float = 1.0
    batch_size: int = 64
    physical_batch_size: int = 32
    accountant: Literal["prv", "rdp"] = "prv"
    seed: int | None = None
    log_epsilon_every_n_steps: int = 10

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
        if self.batch_size < 1 or self.physical_batch_size < 1:
            raise ConfigError("privacy.batch_size and privacy.physical_batch_size must be >= 1")
        if self.log_epsilon_every_n_steps < 1:
            raise ConfigError("privacy.log_epsilon_every_n_steps must be >= 1")

    def delta_for(self, num_examples: int) -> float:
        return self.target_delta if self.target_delta is not None else 1.0 / num_examples ** 1.1
