"""Mechanisms: how a privatizing plugin draws batches and accounts for privacy.

A privatizing plugin returns a :class:`Mechanism` from the ``configure_mechanism`` hook. The default,
:class:`PoissonGaussian`, is DP-SGD's: Poisson sampling with rate q = B/N and the PRV accountant for T
compositions of the subsampled Gaussian (RDP as fallback).
"""

from __future__ import annotations

import math
from typing import Any, Protocol, runtime_checkable

import torch
from torch.utils.data import Sampler

from dpl.core.sampling import PoissonBatchSampler


@runtime_checkable
class Mechanism(Protocol):
    """What dpl needs from a mechanism. ``steps`` counts logical batches."""

    name: str

    def batch_sampler(self, num_examples: int, steps_per_epoch: int, generator: torch.Generator,
                      start_step: int = 0) -> Sampler:
        """The training batch sampler its privacy analysis assumes. ``start_step`` is the global index of the
        first step the run will take (non-zero on resume); ``generator`` is secret."""

    def calibrate(self, target_epsilon: float, delta: float, steps: int) -> float:
        """Smallest noise multiplier whose (epsilon, delta) after ``steps`` is within the target."""

    def epsilon(self, noise_multiplier: float, delta: float, steps: int) -> float:
        """Epsilon spent after ``steps`` steps."""

    def epsilon_of_segments(self, segments: list[tuple[float, int, float]], delta: float) -> float:
        """Epsilon of consecutive segments ``(noise_multiplier, steps, sampling_rate)`` (a run resumed with
        changed settings under ``privacy.force_resume``). May raise :class:`~dpl.errors.ConfigError` if the
        mechanism has no analysis for it."""

    def state_dict(self) -> dict[str, Any]:
        """Public state (goes into the checkpoint)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore; raise ConfigError on a mismatch that would break the accounting."""


class PoissonGaussian:
    """Poisson-subsampled Gaussian mechanism (DP-SGD, DPZero): rate ``sample_rate``, PRV accounting."""

    name = "gaussian"

    def __init__(self, sample_rate: float, accountant: str = "prv") -> None:
        self.sample_rate = sample_rate
        self.accountant = accountant
        self._schedules: dict[tuple, Any] = {}  # epsilon schedules by mechanism settings

    def batch_sampler(self, num_examples: int, steps_per_epoch: int, generator: torch.Generator,
                      start_step: int = 0) -> Sampler:
        # Every Poisson batch is a fresh draw: where the run resumes does not matter.
        return PoissonBatchSampler(num_examples, self.sample_rate, steps_per_epoch, generator)

    def calibrate(self, target_epsilon: float, delta: float, steps: int) -> float:
        from dpl.core import accounting

        return accounting.calibrate_noise_multiplier(target_epsilon, delta, self.sample_rate, steps,
                                                     method=self.accountant)

    def _schedule(self, key: tuple, epsilon_of) -> Any:
        from dpl.core.accounting import EpsilonSchedule

        if key not in self._schedules:
            self._schedules[key] = EpsilonSchedule(epsilon_of)
        return self._schedules[key]

    def epsilon(self, noise_multiplier: float, delta: float, steps: int) -> float:
        """Epsilon after ``steps`` steps from an :class:`~dpl.core.accounting.EpsilonSchedule` computed ahead:
        exact on a grid 5% apart and at counts first asked beyond it (the plan's total, asked at setup), otherwise
        the next grid point's value (at most ~2.5% above), computed ahead by a background thread."""
        from dpl.core import accounting

        rate, method = self.sample_rate, self.accountant
        return self._schedule((float(noise_multiplier), float(delta), method), lambda n: accounting.epsilon_for(
            noise_multiplier, rate, n, delta, method=method))(steps)

    def __getstate__(self) -> dict[str, Any]:  # schedules hold a thread: copies start without them
        return {**self.__dict__, "_schedules": {}}

    def epsilon_of_segments(self, segments: list[tuple[float, int, float]], delta: float) -> float:
        """Epsilon of the segments; the steps of the last one read from a schedule as :meth:`epsilon` does."""
        plain = [(float(sigma), int(steps), float(rate[0]) if rate else self.sample_rate)
                 for sigma, steps, *rate in segments]
        if any(sigma == 0 and steps > 0 for sigma, steps, _ in plain):
            return math.inf
        if not plain or plain[-1][1] == 0:
            return self._composed(plain, delta)
        *done, (sigma, steps, rate) = plain
        return self._schedule((tuple(done), sigma, rate, float(delta), self.accountant),
                              lambda n: self._composed([*done, (sigma, n, rate)], delta))(steps)

    def _composed(self, segments: list[tuple[float, int, float]], delta: float) -> float:
        from dpl.core.accounting import PoissonGaussianAccountant

        accountant = PoissonGaussianAccountant(self.accountant)
        for sigma, steps, rate in segments:
            accountant.step(sigma, rate, steps)
        return accountant.epsilon(delta)

    def state_dict(self) -> dict[str, Any]:
        return {"sample_rate": self.sample_rate, "accountant": self.accountant}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.accountant = state.get("accountant", self.accountant)
