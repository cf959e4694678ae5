"""Mechanisms: how a privatizing plugin draws batches and accounts for privacy.

A privatizing plugin returns a :class:`Mechanism` from the ``configure_mechanism`` hook. The default,
:class:`PoissonGaussian`, is DP-SGD's: Poisson sampling with rate q = B/N and the PRV accountant for T
compositions of the subsampled Gaussian (RDP as fallback).

Every mechanism states the **adjacency** its guarantee is for (``adjacency``, one of :data:`ADJACENCIES`) and
which ones it can be calibrated for (``adjacencies``); :func:`apply_adjacency` applies ``privacy.adjacency``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from dpl.core.accounting.common import Segment
from dpl.errors import ConfigError

if TYPE_CHECKING:  # torch is imported where batches are drawn, not for planning (dpl plan loads no torch)
    import torch
    from torch.utils.data import Sampler

Adjacency = Literal["add_remove", "zero_out", "replace_one"]
ADJACENCIES: tuple[str, ...] = ("add_remove", "zero_out", "replace_one")
"""``add_remove``: one example added or removed; ``zero_out``: one example's contribution replaced by zero (the
data set's size is public); ``replace_one``: one example replaced by another."""


@runtime_checkable
class Mechanism(Protocol):
    """What dpl needs from a mechanism, declared (the engine reads these attributes, it guesses none). ``steps``
    counts logical batches.

    Attributes:
        name: the name its releases carry (``PrivateGradient.mechanism``).
        adjacency: the neighbouring relation of its guarantee (set by :func:`apply_adjacency`); ``adjacencies``:
            those it can give.
        unit: what the guarantee protects: ``example`` (one row) or ``user`` (all the rows of one user).
        sampling: how batches are drawn (``poisson``, ``shuffle``, ``cyclic_poisson``): the report states it.
        sample_rate: the rate at which a unit is sampled in a step it can be sampled in.
        accounting: how epsilon is computed (the report states it).
    """

    name: str
    adjacency: str
    adjacencies: tuple[str, ...]
    unit: str
    sampling: str
    sample_rate: float
    accounting: str

    def batch_sampler(self, num_examples: int, steps_per_epoch: int, generator: torch.Generator,
                      start_step: int = 0) -> Sampler:
        """The training batch sampler its privacy analysis assumes. ``start_step`` is the global index of the
        first step the run will take (non-zero on resume); ``generator`` is secret."""

    def calibrate(self, target_epsilon: float, delta: float, steps: int) -> float:
        """Smallest noise multiplier whose (epsilon, delta) after ``steps`` is within the target."""

    def epsilon(self, noise_multiplier: float, delta: float, steps: int) -> float:
        """Epsilon spent after ``steps`` steps."""

    def epsilon_of_segments(self, segments: Sequence[Segment], delta: float) -> float:
        """Epsilon of consecutive :class:`Segment` s (a run resumed with changed settings under
        ``privacy.force_resume``). May raise :class:`~dpl.errors.ConfigError` if the mechanism has no analysis
        for it."""

    def state_dict(self) -> dict[str, Any]:
        """Public state (goes into the checkpoint)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore; raise ConfigError on a mismatch that would break the accounting."""


class PoissonGaussian:
    """Poisson-subsampled Gaussian mechanism (DP-SGD, DPZero): rate ``sample_rate``, PRV accounting. With
    ``unit="user"`` it samples users (user-level sampling: each sampled user's clipped mean gradient is one unit of
    sensitivity C), accounted exactly as DP-SGD over users."""

    name = "gaussian"
    adjacency = "add_remove"
    # zero-out follows from add/remove here: the released sum with an example zeroed out has the distribution of the
    # sum without it (the divisor is the public expected batch size)
    adjacencies = ("add_remove", "zero_out")
    sampling = "poisson"

    def __init__(self, sample_rate: float, accountant: str = "prv", unit: str = "example") -> None:
        self.sample_rate = sample_rate
        self.accountant = accountant
        self.unit = unit
        self._schedules: dict[tuple, Any] = {}  # epsilon schedules by mechanism settings

    @property
    def accounting(self) -> str:
        return self.accountant

    def batch_sampler(self, num_examples: int, steps_per_epoch: int, generator: torch.Generator,
                      start_step: int = 0) -> Sampler:
        from dpl.core.sampling import PoissonBatchSampler

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

    def epsilon_of_segments(self, segments: Sequence[Segment], delta: float) -> float:
        """Epsilon of the segments; the steps of the last one read from a schedule as :meth:`epsilon` does."""
        plain = [Segment(float(s.noise_multiplier), float(s.sample_rate), int(s.steps)) for s in segments]
        if any(s.noise_multiplier == 0 and s.steps > 0 for s in plain):
            return math.inf
        if not plain or plain[-1].steps == 0:
            return self._composed(plain, delta)
        *done, last = plain
        return self._schedule((tuple(done), last.noise_multiplier, last.sample_rate, float(delta), self.accountant),
                              lambda n: self._composed([*done, last._replace(steps=n)], delta))(last.steps)

    def _composed(self, segments: Sequence[Segment], delta: float) -> float:
        from dpl.core.accounting import PoissonGaussianAccountant

        accountant = PoissonGaussianAccountant(self.accountant)
        for segment in segments:
            accountant.step(segment.noise_multiplier, segment.sample_rate, segment.steps)
        return accountant.epsilon(delta)

    def state_dict(self) -> dict[str, Any]:
        return {"sample_rate": self.sample_rate, "accountant": self.accountant, "adjacency": self.adjacency,
                "unit": self.unit}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("adjacency", self.adjacency) != self.adjacency:
            raise ConfigError(f"the checkpoint's guarantee is for adjacency {state['adjacency']}, this run's for "
                              f"{self.adjacency}: a resume cannot change it")
        if state.get("unit", "example") != self.unit:
            raise ConfigError(f"the checkpoint's guarantee is per {state.get('unit', 'example')}, this run's per "
                              f"{self.unit}: a resume cannot change the privacy unit")
        self.accountant = state.get("accountant", self.accountant)


class UserLevelExampleSampling(PoissonGaussian):
    """Example-level sampling with a user-level accountant (ELS; Charles et al., "Fine-tuning large language models
    with user-level differential privacy", SaTML 2025): every user bounded to ``max_rows`` (k) rows, rows
    Poisson-sampled at ``sample_rate`` and clipped one by one, noise sigma C. For one user the number of its rows in a
    batch is Binomial(k, q), so a step compares a mixture of Gaussians with N(0, sigma^2) (in units of C):
    :func:`dpl.core.accounting.els_epsilon` composes it with the PRV accountant."""

    def __init__(self, sample_rate: float, max_rows: int, accountant: str = "prv") -> None:
        super().__init__(sample_rate, accountant, unit="user")
        self.max_rows = int(max_rows)

    @property
    def accounting(self) -> str:
        return f"prv (mixture of Gaussians: Binomial({self.max_rows}, q) rows of a user per step)"

    def calibrate(self, target_epsilon: float, delta: float, steps: int) -> float:
        from dpl.core.accounting import els_calibrate

        return els_calibrate(target_epsilon, delta, self.sample_rate, self.max_rows, steps)

    def epsilon(self, noise_multiplier: float, delta: float, steps: int) -> float:
        from dpl.core.accounting import els_epsilon

        rate, k = self.sample_rate, self.max_rows
        return self._schedule(("els", float(noise_multiplier), float(delta), k), lambda n: els_epsilon(
            noise_multiplier, rate, k, n, delta))(steps)

    def epsilon_of_segments(self, segments: Sequence[Segment], delta: float) -> float:
        plain = [s for s in segments if int(s.steps) > 0]
        if len({(float(s.noise_multiplier), float(s.sample_rate)) for s in plain}) > 1:
            raise ConfigError("user_sampling: rows has no accounting for a resume with changed settings (sigma or "
                              "the sampling rate): resume with the checkpoint's settings or start a new run")
        if not plain:
            return 0.0
        return self.epsilon(plain[0].noise_multiplier, delta, sum(int(s.steps) for s in plain))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "max_rows": self.max_rows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if state.get("max_rows") != self.max_rows:
            raise ConfigError(f"the checkpoint bounded users to {state.get('max_rows')} rows, this run to "
                              f"{self.max_rows}: a resume cannot change privacy.max_rows_per_user")


def apply_adjacency(mechanism: Mechanism, requested: str | None) -> str:
    """Make ``mechanism`` calibrate for ``requested`` (``privacy.adjacency``; ``None``: its own) and return the
    adjacency its guarantee is for; a mechanism that cannot give it is refused with one line."""
    if requested is None:
        return mechanism.adjacency
    if requested not in mechanism.adjacencies:
        raise ConfigError(f"privacy.adjacency={requested}: mechanism {mechanism.name} proves "
                          f"{' or '.join(mechanism.adjacencies)} only")
    mechanism.adjacency = requested
    return requested
