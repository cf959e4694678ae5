"""Accounting by events: what a mechanism releases, declared as a small frozen value that every accountant reads.

A mechanism declares the *event* of a segment of its steps (``Mechanism.event(noise_multiplier, steps)``); a run's
history is a list of ``(event, steps)``; epsilon of a history is the composition of its events (:func:`epsilon`) and
calibration is one search over an event builder (:func:`calibrate`). Every field an accountant needs (sigma, the
sampling rate, the rows k a user may contribute) lives in the event, so a resume that changes one is composed exactly
or refused: it cannot be forgotten. The classes follow Google's dp-accounting (``GaussianDpEvent``,
``PoissonSampledDpEvent``, ``MixtureOfGaussiansDpEvent``, ``SelfComposedDpEvent``, ``ComposedDpEvent``,
``RepeatAndSelectDpEvent``, ``NonPrivateDpEvent``), which the tests use as the oracle; dpl composes them with its own
accountants (faster, and the same PRV machinery everywhere), so dp-accounting is not a runtime dependency.

Noise multipliers are in units of the sensitivity (C). Composition:

* only :class:`Gaussian` events: one Gaussian mechanism with sigma = (sum sigma_i^-2)^-1/2, exactly (Balle & Wang);
* :class:`PoissonGaussian` (and Gaussian, its rate-1 case) steps: the PRV accountant of
  :mod:`~dpl.core.accounting.prv` (``method="rdp"``: RDP);
* with :class:`MixtureOfGaussians` steps (user-level ELS): the PRV accountant of both directions of every step,
  heterogeneous composition (:mod:`~dpl.core.accounting.users`);
* :class:`RepeatAndSelect` (private tuning, Papernot & Steinke, "Hyperparameter tuning with Rényi differential
  privacy", ICLR 2022): its own RDP bound (:mod:`~dpl.core.accounting.tuning`), added to the rest by sequential
  composition (epsilons and deltas add up; delta split evenly between the parts): no tighter theorem composes a
  tuned release with other mechanisms. :func:`composition_method` says which applied.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Union

from dpl.core.accounting.common import _check_delta, _check_method


@dataclass(frozen=True)
class Gaussian:
    """One Gaussian mechanism with sensitivity 1 and noise std ``noise_multiplier``."""

    noise_multiplier: float


@dataclass(frozen=True)
class PoissonGaussian:
    """One step: every unit in the batch independently with probability ``sample_rate``, its clipped contribution
    (sensitivity 1) summed, Gaussian noise ``noise_multiplier``."""

    noise_multiplier: float
    sample_rate: float


@dataclass(frozen=True)
class MixtureOfGaussians:
    """One step of example-level sampling with a user-level guarantee (ELS): a user's rows, at most ``max_rows`` (k),
    each in the batch with probability ``sample_rate``, so its shift is Binomial(k, q): the pair
    sum_m Binom(m; k, q) N(m, sigma^2) against N(0, sigma^2)."""

    noise_multiplier: float
    sample_rate: float
    max_rows: int


@dataclass(frozen=True)
class SelfComposed:
    """``event`` composed ``count`` times."""

    event: Event
    count: int


@dataclass(frozen=True)
class Composed:
    """The composition of ``events``."""

    events: tuple[Event, ...]


@dataclass(frozen=True)
class RepeatAndSelect:
    """The best of K runs of ``event``, K random with mean ``mean``: a truncated negative binomial of shape ``shape``
    (eta: 0 logarithmic, 1 geometric) or, with ``shape`` inf, Poisson."""

    event: Event
    mean: float
    shape: float


@dataclass(frozen=True)
class AnyOf:
    """One of ``events``, chosen without looking at the data (a tuning trial's configuration drawn from a fixed search
    space): bounded by the largest of their RDP curves (Rényi divergence is quasi-convex in the mechanism's output
    distribution), and by the largest of their epsilons."""

    events: tuple[Event, ...]


@dataclass(frozen=True)
class NonPrivate:
    """A release with no privacy guarantee (sigma = 0): epsilon is inf."""


Event = Union[Gaussian, PoissonGaussian, MixtureOfGaussians, SelfComposed, Composed, RepeatAndSelect, AnyOf,
              NonPrivate]
_KINDS: dict[str, type] = {"gaussian": Gaussian, "poisson_gaussian": PoissonGaussian,
                           "mixture_of_gaussians": MixtureOfGaussians, "self_composed": SelfComposed,
                           "composed": Composed, "repeat_and_select": RepeatAndSelect, "any_of": AnyOf,
                           "non_private": NonPrivate}
_NAMES = {cls: name for name, cls in _KINDS.items()}

#: how composed epsilons are combined (:func:`composition_method`)
TIGHT, SEQUENTIAL = "tight", "sequential"


def kind(event: Event) -> str:
    """The event's kind as serialized (``poisson_gaussian``, ...)."""
    return _NAMES[type(event)]


def to_dict(event: Event) -> dict[str, Any]:
    """Plain JSON-safe values (``kind`` names the class)."""
    out: dict[str, Any] = {"kind": kind(event)}
    if isinstance(event, SelfComposed):
        return {**out, "event": to_dict(event.event), "count": event.count}
    if isinstance(event, (Composed, AnyOf)):
        return {**out, "events": [to_dict(e) for e in event.events]}
    if isinstance(event, RepeatAndSelect):
        return {**out, "event": to_dict(event.event), "mean": event.mean,
                "shape": "inf" if math.isinf(event.shape) else event.shape}
    return {**out, **{k: v for k, v in vars(event).items()}}


def from_dict(data: dict[str, Any]) -> Event:
    """The event of :func:`to_dict`; ValueError for anything else."""
    try:
        cls = _KINDS[data["kind"]]
        if cls is SelfComposed:
            return SelfComposed(from_dict(data["event"]), int(data["count"]))
        if cls in (Composed, AnyOf):
            return cls(tuple(from_dict(e) for e in data["events"]))
        if cls is RepeatAndSelect:
            return RepeatAndSelect(from_dict(data["event"]), float(data["mean"]), float(data["shape"]))
        if cls is MixtureOfGaussians:
            return MixtureOfGaussians(float(data["noise_multiplier"]), float(data["sample_rate"]),
                                      int(data["max_rows"]))
        if cls is PoissonGaussian:
            return PoissonGaussian(float(data["noise_multiplier"]), float(data["sample_rate"]))
        if cls is Gaussian:
            return Gaussian(float(data["noise_multiplier"]))
        return NonPrivate()
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not an accounting event: {data!r}") from exc


def history_event(history: list[tuple[Event, int]] | tuple[tuple[Event, int], ...]) -> Event:
    """The event of a history of ``(event, steps)`` segments (the steps are bookkeeping; the events say it all)."""
    return Composed(tuple(event for event, _ in history))


def history_to_json(history: list[tuple[Event, int]]) -> list[dict[str, Any]]:
    return [{"event": to_dict(event), "steps": int(steps)} for event, steps in history]


def history_from_json(data: list[dict[str, Any]]) -> list[tuple[Event, int]]:
    return [(from_dict(item["event"]), int(item["steps"])) for item in data]


def row_level(event: Event) -> Event:
    """The event of the same steps for one *row* of a user-level run that samples and clips rows (ELS): every
    ``MixtureOfGaussians(sigma, q, k)`` step becomes ``PoissonGaussian(sigma, q)`` (a row is in a batch with
    probability q, its clipped gradient of norm at most C); everything else is kept. The per-row epsilon of such a
    run is the composition of its parts' row-level events, whatever sigma each part trained with."""
    if isinstance(event, MixtureOfGaussians):
        return PoissonGaussian(event.noise_multiplier, event.sample_rate)
    if isinstance(event, SelfComposed):
        return SelfComposed(row_level(event.event), event.count)
    if isinstance(event, Composed):
        return Composed(tuple(row_level(e) for e in event.events))
    return event


def group_size(event: Event) -> int:
    """k, the most rows one user contributes to a step of ``event`` (its ``MixtureOfGaussians`` steps); 1 without
    any."""
    return max((k for (_, _, k) in _flatten(event).steps), default=1) or 1


# ------------------------------------------------------------------------------------------------ flattening


@dataclass
class _Atoms:
    """An event flattened into counts of its steps: ``(sigma, q, k) -> count`` (Gaussian: q = 1, k = 0;
    PoissonGaussian: k = 1), the tuned releases, and whether anything is non-private."""

    steps: Counter
    selects: list[RepeatAndSelect]
    non_private: bool = False
    choices: Counter = field(default_factory=Counter)  # AnyOf -> times


def _flatten(event: Event, times: int = 1, into: _Atoms | None = None) -> _Atoms:
    atoms = into if into is not None else _Atoms(Counter(), [])
    if times == 0:
        return atoms
    if isinstance(event, NonPrivate):
        atoms.non_private = True
    elif isinstance(event, Gaussian):
        _add(atoms, event.noise_multiplier, 1.0, 0, times)
    elif isinstance(event, PoissonGaussian):
        _add(atoms, event.noise_multiplier, event.sample_rate, 1, times)
    elif isinstance(event, MixtureOfGaussians):
        _add(atoms, event.noise_multiplier, event.sample_rate, event.max_rows, times)
    elif isinstance(event, SelfComposed):
        _flatten(event.event, times * int(event.count), atoms)
    elif isinstance(event, Composed):
        for inner in event.events:
            _flatten(inner, times, atoms)
    elif isinstance(event, RepeatAndSelect):
        atoms.selects += [event] * times
    elif isinstance(event, AnyOf):
        atoms.choices[event] += times
    else:
        raise TypeError(f"not an accounting event: {event!r}")
    return atoms


def _add(atoms: _Atoms, sigma: float, q: float, k: int, n: int) -> None:
    if sigma == 0:
        atoms.non_private = True
    else:
        atoms.steps[(float(sigma), float(q), int(k))] += int(n)


def composition_method(event: Event) -> str:
    """``tight`` where one accountant composes every part of ``event`` (PRV, or the exact Gaussian), ``sequential``
    where a tuned release is added to other parts (or to another tuned release) by sequential composition."""
    atoms = _flatten(event)
    return SEQUENTIAL if _parts(atoms) > 1 else TIGHT


def _parts(atoms: _Atoms) -> int:
    return len(atoms.selects) + len(atoms.choices) + (1 if atoms.steps else 0)


# ------------------------------------------------------------------------------------------------ epsilon


def epsilon(event: Event, delta: float, method: str = "prv", on_fallback: Callable[[str], None] | None = None,
            eps_error: float | None = None) -> float:
    """Epsilon at ``delta`` of ``event`` (see the module docstring for how each part is composed); inf if any part
    is non-private. ``method``: ``prv`` (default) or ``rdp`` for Poisson-subsampled Gaussian steps; ``eps_error``
    overrides their PRV error width. Where PRV fails the accountant falls back to a looser bound and calls
    ``on_fallback`` with why (default: one logged warning)."""
    delta, method = _check_delta(delta), _check_method(method)
    atoms = _flatten(event)
    if atoms.non_private:
        return math.inf
    parts = _parts(atoms)
    if parts == 0:
        return 0.0
    share = delta / parts
    total = _steps_epsilon(atoms.steps, share, method, on_fallback, eps_error) if atoms.steps else 0.0
    for select in atoms.selects:
        total += _select_epsilon(select, share)
    for choice, times in atoms.choices.items():
        total += _choice_epsilon(choice, times, share)
    return total


def _steps_epsilon(steps: Counter, delta: float, method: str, on_fallback: Callable[[str], None] | None = None,
                   eps_error: float | None = None) -> float:
    from dpl.core.accounting.common import _warn_once
    from dpl.core.accounting.gaussian import gaussian_mechanism_epsilon
    from dpl.core.accounting.prv import _epsilon
    from dpl.core.accounting.users import _mixture_epsilon

    on_fallback = on_fallback or _warn_once
    if all(k == 0 for (_, _, k) in steps):  # Gaussians compose into one Gaussian, exactly
        return gaussian_mechanism_epsilon(sum(n / s**2 for (s, _, _), n in steps.items()) ** -0.5, delta)
    if all(k <= 1 for (_, _, k) in steps):  # a Gaussian is the rate-1 subsampled Gaussian
        return _epsilon(_merged(steps), delta, method, eps_error, on_fallback=on_fallback)
    return _mixture_epsilon(tuple(sorted((s, q, max(k, 1), n) for (s, q, k), n in steps.items())), delta, on_fallback)


def _merged(steps: Counter) -> tuple[tuple[float, float, int], ...]:
    """``(sigma, q, count)`` of Gaussian and subsampled Gaussian steps, same (sigma, q) merged."""
    merged: Counter = Counter()
    for (s, q, _), n in steps.items():
        merged[(s, q)] += n
    return tuple(sorted((s, q, n) for (s, q), n in merged.items()))


def trial_rdp(event: Event) -> Any:
    """The RDP curve (at :data:`~dpl.core.accounting.tuning.ORDERS`) of one trial's ``event``: its Gaussian and
    Poisson-subsampled Gaussian steps composed. ValueError for user-level ELS steps (their Rényi divergences grow
    like alpha k^2: no useful curve) and non-private ones."""
    import numpy as np

    from dpl.core.accounting.tuning import subsampled_gaussian_rdp

    if isinstance(event, AnyOf):
        return np.max(np.stack([trial_rdp(e) for e in event.events]), axis=0)
    atoms = _flatten(event)
    if len(atoms.choices) == 1 and not atoms.steps and not atoms.selects and not atoms.non_private:
        ((choice, times),) = atoms.choices.items()
        return times * trial_rdp(choice)
    if atoms.non_private or atoms.selects or atoms.choices or any(k > 1 for (_, _, k) in atoms.steps):
        raise ValueError("a tuned trial must consist of Gaussian or Poisson-subsampled Gaussian steps (no ELS, "
                         "no nested tuning, sigma > 0)")
    return subsampled_gaussian_rdp(list(_merged(atoms.steps)))


def _choice_epsilon(choice: AnyOf, times: int, delta: float) -> float:
    """``times`` compositions of one of ``choice``'s events: by RDP (``times`` x the largest curve)."""
    from dpl.core.accounting import tuning

    return tuning.fixed_trials_epsilon(tuning.ORDERS, trial_rdp(choice), times, delta)


def _select_epsilon(select: RepeatAndSelect, delta: float) -> float:
    from dpl.core.accounting import tuning

    rdp = trial_rdp(select.event)
    if math.isinf(select.shape):
        distribution = tuning.poisson(select.mean)
    else:
        distribution = tuning.negative_binomial(select.mean, select.shape)
    return tuning.tuned_epsilon(distribution, tuning.ORDERS, rdp, delta)


# ------------------------------------------------------------------------------------------------ calibration


def bound(event: Event, delta: float) -> float | None:
    """A cheap upper bound on :func:`epsilon` with roughly its shape in sigma (the calibration's proxy), or ``None``
    where there is none: the integer-order RDP bound for Poisson-subsampled Gaussian steps, the Chernoff bound of one
    ELS segment, the exact value for Gaussians."""
    from dpl.core.accounting.rdp import _int_rdp_epsilon
    from dpl.core.accounting.users import _els_rdp_epsilon

    atoms = _flatten(event)
    if atoms.non_private or atoms.selects or atoms.choices or not atoms.steps:
        return None
    if all(k == 0 for (_, _, k) in atoms.steps):
        return _steps_epsilon(atoms.steps, delta, "prv")
    if all(k <= 1 for (_, _, k) in atoms.steps):
        return _int_rdp_epsilon(_merged(atoms.steps), delta)
    if len(atoms.steps) == 1:
        ((s, q, k), n), = atoms.steps.items()
        return _els_rdp_epsilon(s, q, k, n, delta, cells=1000)
    return None


class _PRVFailed(RuntimeError):
    pass


def calibrate(build: Callable[[float], Event], target_epsilon: float, delta: float, method: str = "prv",
              tol: float | None = None, guess: float = 1.0, eps_error: float | None = None) -> float:
    """The smallest noise multiplier sigma (within ``tol``) with ``epsilon(build(sigma), delta) <= target_epsilon``:
    one search for every mechanism (:func:`~dpl.core.accounting.calibration.smallest_noise_multiplier`, with
    :func:`bound` as its proxy where there is one). ``tol`` defaults to 1e-9 where epsilon is exact and cheap (only
    Gaussian events), 0.01 otherwise. If PRV fails at the first sigma tried, the search runs on the fallback bound;
    a later failure (a trial sigma far from the answer) counts as infeasible. ValueError if no sigma reaches the
    target."""
    from dpl.core.accounting.calibration import smallest_noise_multiplier
    from dpl.core.accounting.common import _warn_once

    delta = _check_delta(delta)
    probe = _flatten(build(guess))
    if not probe.steps and not probe.selects and not probe.choices:
        return 0.0
    gaussians_only = not probe.selects and not probe.choices and all(k == 0 for (_, _, k) in probe.steps)
    if tol is None:
        tol = 1e-9 if gaussians_only else 0.01

    def proxy(sigma: float) -> float:
        value = bound(build(sigma), delta)
        return math.inf if value is None else value

    has_proxy = not gaussians_only and bound(build(guess), delta) is not None
    evaluations = 0

    def failed(msg: str) -> None:
        raise _PRVFailed(msg)

    def exact(sigma: float) -> float:
        nonlocal evaluations
        evaluations += 1
        try:
            return epsilon(build(sigma), delta, method, on_fallback=failed, eps_error=eps_error)
        except _PRVFailed:
            if evaluations == 1:
                raise
            return math.inf

    options = dict(tol=tol, guess=guess, proxy=proxy if has_proxy else None)
    try:
        return smallest_noise_multiplier(exact, target_epsilon, **options)
    except _PRVFailed as err:
        _warn_once(f"{err} (calibration)")
        return smallest_noise_multiplier(lambda s: epsilon(build(s), delta, "rdp" if method == "prv" else method),
                                         target_epsilon, **options)


def calibrate_noise_multiplier(target_epsilon: float, delta: float, sample_rate: float, steps: int,
                               method: str = "prv", tol: float = 0.01, eps_error: float | None = None) -> float:
    """Smallest noise multiplier (within ``tol``) whose epsilon after ``steps`` Poisson-subsampled Gaussian steps at
    ``sample_rate`` is <= ``target_epsilon``: :func:`calibrate` over those steps.

    The returned sigma satisfies ``target * (1 - tol) <= epsilon_for(sigma, ...) <= target`` (same method and
    ``eps_error``); the upper inequality always holds. ``steps == 0`` returns 0.
    """
    from dpl.core.accounting.common import _check_epsilon, _check_eps_error, _check_rate, _check_steps

    target = _check_epsilon(target_epsilon)
    delta, q, steps = _check_delta(delta), _check_rate(sample_rate), _check_steps(steps)
    method, eps_error = _check_method(method), _check_eps_error(eps_error)
    if steps == 0:
        return 0.0
    return calibrate(lambda s: SelfComposed(PoissonGaussian(s, q), steps), target, delta, method, tol=tol,
                     eps_error=eps_error)
