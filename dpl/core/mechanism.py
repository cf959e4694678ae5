"""Mechanisms: how a privatizing plugin draws batches and accounts for privacy.

A privatizing plugin returns a :class:`Mechanism` from the ``configure_mechanism`` hook. The default,
:class:`PoissonGaussian`, is DP-SGD's: Poisson sampling with rate q = B/N and the PRV accountant for T
compositions of the subsampled Gaussian (RDP as fallback).

Every mechanism states the **adjacency** its guarantee is for (``adjacency``, one of :data:`ADJACENCIES`) and
which ones it can be calibrated for (``adjacencies``); :func:`apply_adjacency` applies ``privacy.adjacency``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from dpl.core.accounting import events
from dpl.core.accounting.events import Event
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
        accountant: ``prv`` or ``rdp``, for its Poisson-subsampled Gaussian steps.
        resumable_with_changes: whether a resume may change sigma or the sampling rate (``privacy.force_resume``):
            true where its segments compose as independent events; false for one analysis over the whole stream.
        noise_scale: the factor of sigma * C in one step's released noise (1 for DP-SGD; ftrl: its sensitivity);
            ``dpl plan`` and the noise-regime warning read it.

    Everything else about its privacy is the *event* it declares (:meth:`event`): calibration, composition, resume and
    the data ledger are generic over events (:mod:`dpl.core.accounting.events`).
    """

    name: str
    adjacency: str
    adjacencies: tuple[str, ...]
    unit: str
    sampling: str
    sample_rate: float
    accounting: str
    accountant: str
    resumable_with_changes: bool
    noise_scale: float

    def batch_sampler(self, num_examples: int, steps_per_epoch: int, generator: torch.Generator,
                      start_step: int = 0) -> Sampler:
        """The training batch sampler its privacy analysis assumes. ``start_step`` is the global index of the
        first step the run will take (non-zero on resume); ``generator`` is secret."""

    def settle_choices(self, target_epsilon: float | None, delta: float, steps: int) -> None:
        """Fix whatever the mechanism chooses by its accounting (ftrl: the strategy with the least error at the target)
        before sigma is calibrated; ``target_epsilon`` is None where sigma is given."""

    def event(self, noise_multiplier: float, steps: int) -> Event:
        """The accounting event of ``steps`` consecutive steps with noise multiplier sigma, from the start of a run
        (or of a part of a resumed run)."""

    @property
    def scope(self) -> dict[str, Any]:
        """What its events mean beyond their numbers, which a resume can never change: the mechanism, the sampling,
        the unit, the adjacency (and whatever else the mechanism's analysis fixes)."""

    def state_dict(self) -> dict[str, Any]:
        """Public state (goes into the checkpoint)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore; raise ConfigError on a mismatch that would break the accounting."""


def steps_event(step: Event, noise_multiplier: float, steps: int) -> Event:
    """``steps`` compositions of ``step`` (whose noise multiplier is ``noise_multiplier``): non-private where sigma is
    0 and there is a step."""
    if steps > 0 and noise_multiplier == 0:
        return events.NonPrivate()
    return events.SelfComposed(step, int(steps))


class PoissonGaussian:
    """Poisson-subsampled Gaussian mechanism (DP-SGD, DPZero): rate ``sample_rate``, PRV accounting. With
    ``unit="user"`` it samples users (user-level sampling: each sampled user's clipped mean gradient is one unit of
    sensitivity C), accounted exactly as DP-SGD over users. Its event: ``PoissonGaussian(sigma, q)`` per step."""

    name = "gaussian"
    adjacency = "add_remove"
    # zero-out follows from add/remove here: the released sum with an example zeroed out has the distribution of the
    # sum without it (the divisor is the public expected batch size)
    adjacencies = ("add_remove", "zero_out")
    sampling = "poisson"
    resumable_with_changes = True
    noise_scale = 1.0
    #: adaptive clipping thresholds (``privacy.clipping_thresholds: adaptive``): how the step's privacy is split
    #: between the gradient and the thresholds' counts (the event is the pair's; docs/privacy.md)
    clipping: str | None = None

    def __init__(self, sample_rate: float, accountant: str = "prv", unit: str = "example") -> None:
        self.sample_rate = sample_rate
        self.accountant = accountant
        self.unit = unit

    @property
    def accounting(self) -> str:
        return self.accountant

    @property
    def scope(self) -> dict[str, Any]:
        sampled = {"example": "rows", "user": "users"}[self.unit]
        return {"mechanism": self.name, "sampling": f"{self.sampling} ({sampled})", "unit": self.unit,
                "adjacency": self.adjacency, **({"clipping": self.clipping} if self.clipping else {})}

    def batch_sampler(self, num_examples: int, steps_per_epoch: int, generator: torch.Generator,
                      start_step: int = 0) -> Sampler:
        from dpl.core.sampling import PoissonBatchSampler

        # Every Poisson batch is a fresh draw: where the run resumes does not matter.
        return PoissonBatchSampler(num_examples, self.sample_rate, steps_per_epoch, generator)

    def settle_choices(self, target_epsilon: float | None, delta: float, steps: int) -> None:
        """Nothing to choose."""

    def event(self, noise_multiplier: float, steps: int) -> Event:
        return steps_event(events.PoissonGaussian(float(noise_multiplier), float(self.sample_rate)), noise_multiplier,
                           steps)

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
    batch is Binomial(k, q), so a step is a ``MixtureOfGaussians(sigma, q, k)`` event, composed with the PRV
    accountant."""

    def __init__(self, sample_rate: float, max_rows: int, accountant: str = "prv") -> None:
        super().__init__(sample_rate, accountant, unit="user")
        self.max_rows = int(max_rows)

    @property
    def accounting(self) -> str:
        return f"prv (mixture of Gaussians: Binomial({self.max_rows}, q) rows of a user per step)"

    @property
    def scope(self) -> dict[str, Any]:
        return {**super().scope, "sampling": f"{self.sampling} (rows, at most {self.max_rows} per user)",
                "max_rows": self.max_rows}

    def event(self, noise_multiplier: float, steps: int) -> Event:
        return steps_event(events.MixtureOfGaussians(float(noise_multiplier), float(self.sample_rate),
                                                     self.max_rows), noise_multiplier, steps)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "max_rows": self.max_rows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("max_rows") != self.max_rows:
            raise ConfigError(f"the checkpoint's steps were accounted with users bounded to {state.get('max_rows')} "
                              f"rows sampled one by one, this run's with {self.max_rows}: a resume cannot change "
                              "privacy.max_rows_per_user or privacy.user_sampling")
        super().load_state_dict(state)


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


def epsilon_of(mechanism: Mechanism, noise_multiplier: float, delta: float, steps: int) -> float:
    """Epsilon of ``steps`` steps of ``mechanism`` at sigma: its declared event, composed generically."""
    return events.epsilon(mechanism.event(noise_multiplier, steps), delta, mechanism.accountant)


def calibrate(mechanism: Mechanism, target_epsilon: float, delta: float, steps: int) -> float:
    """The smallest sigma whose ``steps`` steps of ``mechanism`` spend at most ``target_epsilon`` (its choices settled
    at that target first)."""
    mechanism.settle_choices(target_epsilon, delta, steps)
    return events.calibrate(lambda sigma: mechanism.event(sigma, steps), target_epsilon, delta, mechanism.accountant)
