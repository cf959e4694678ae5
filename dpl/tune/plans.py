"""The privacy plan of a search space, made before any trial runs, and the epsilon of the tuned release from it.

One trial of Papernot & Steinke ("Hyperparameter tuning with Rényi differential privacy", ICLR 2022) draws a
configuration uniformly, independently of the data, and trains it. The Rényi divergence of such a mixture is at most
the largest of its components' (it is jointly quasi-convex), so at every order the trial's RDP is at most the maximum
of the RDP curves of all the configurations of the space. Only the options of
:data:`~dpl.tune.search.PLANNED_KEYS` change a configuration's accounting: each combination of their values is planned
by ``dpl plan``'s planner (sigma as ``dpl fit`` calibrates it, the sampling rate and the steps), and the bound uses
all of them - never only the drawn ones, whose choice and number K are secret.

A trial's plan (:data:`TrialPlan`; not the engine's :class:`dpl.core.ledger.Plan`) is a dict: ``config`` (the
planned keys' values), ``noise_multiplier``, ``sampling_rate``, ``steps``, ``delta``, ``accountant``, ``mechanism``,
``sampling``, ``unit``, ``adjacency``, ``num_examples`` and ``epsilon`` (the trial's own, by its accountant).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from dpl.core.accounting import events, tuning as accounting
from dpl.errors import ConfigError
from dpl.tune.search import SearchSpace, accounting_part, config_args, short

#: the plan of one accounting-distinct configuration (a plain dict: it is stored in the tuning folder's state)
TrialPlan = dict[str, Any]
#: what every configuration of a space must share for one bound to cover them
SHARED = ("mechanism", "sampling", "accountant", "unit", "adjacency", "delta", "num_examples")
#: the target epsilon of a trial is passed to ``dpl fit`` as this option
TARGET_OPTION = "--model.privacy.target_epsilon"
#: ``--total-epsilon``: the solved total lies in [(1 - TOTAL_TOL) E, E] when the calibration allows
TOTAL_TOL = 0.005
#: the smallest per-trial epsilon tried, as a fraction of the total asked for
SMALLEST_FRACTION = 1e-3


def tunable(summary: dict[str, Any], seeded: bool) -> str | None:
    """Why a run with this privacy summary cannot be a trial, or ``None``: the bound needs the RDP curve of the
    Poisson-subsampled Gaussian (DP-SGD, DPZero, user-level sampling) and independent trials."""
    users = summary.get("users") or {}
    if summary.get("mechanism") != "gaussian" or summary.get("sampling") != "poisson" or \
            summary.get("accountant") not in ("prv", "rdp"):
        return (f"mechanism {summary.get('mechanism')} ({summary.get('sampling')} sampling, "
                f"{summary.get('accountant')} accounting) has no RDP curve in dpl, which the tuning bound needs "
                f"(supported: the Poisson-subsampled Gaussian of DP-SGD and DPZero)")
    if summary.get("unit") == "user" and users.get("sampling") != "users":
        return ("privacy.unit: user with user_sampling: rows (example-level sampling) is accounted as a mixture of "
                "Gaussians, which has no RDP curve in dpl: use user_sampling: users")
    if seeded:
        return "privacy.seed makes every trial draw the same noise and batches; the bound needs independent trials"
    if summary.get("resumed_from"):
        return "a trial must be a fresh run (not resumed from a checkpoint)"
    return None


def plan_configuration(fit_args: list[str], config: dict[str, str], target: float | None = None) -> TrialPlan:
    """The plan of the trial ``dpl fit FIT_ARGS CONFIG`` (``target``: its target epsilon, else the config's)."""
    from dpl.errors import dpl_error_in
    from dpl.planning.command import plan_config

    argv = [*fit_args, *config_args(config), *([TARGET_OPTION, repr(float(target))] if target is not None else [])]
    try:
        report = plan_config(argv)
    except Exception as exc:  # noqa: BLE001 - dpl's own errors in one line, anything else as is
        error = dpl_error_in(exc)
        if error is None:
            raise
        raise ConfigError(f"dpl tune: planning {short(config) or 'the trials'}: {error}") from None
    plan = {"config": dict(config), "noise_multiplier": float(report.current.noise_multiplier),
            "sampling_rate": float(report.sampling_rate), "steps": int(report.current.steps),
            "delta": float(report.delta), "accountant": report.accounting, "mechanism": report.mechanism,
            "sampling": report.sampling, "unit": report.unit, "adjacency": report.adjacency,
            "num_examples": int(report.population), "epsilon": float(report.current.epsilon)}
    reason = tunable({**plan, "users": {"sampling": report.user_sampling}}, False)
    if reason:
        raise ConfigError(f"dpl tune: {reason}")
    return plan


def plan_space(fit_args: list[str], space: SearchSpace, target: float | None = None) -> list[TrialPlan]:
    """The plan of every accounting-distinct configuration of ``space`` (one-line ``ConfigError`` if they differ in
    more than sigma, the sampling rate and the steps)."""
    plans = [plan_configuration(fit_args, config, target) for config in space.accounting_configurations()]
    differ = [key for key in SHARED if len({plan[key] for plan in plans}) > 1]
    if differ:
        raise ConfigError(f"dpl tune: the configurations differ in {', '.join(differ)}: one bound cannot cover them "
                          f"(search the batch size and the steps or epochs, which change only sigma, the sampling "
                          f"rate and the steps)")
    return plans


def trial_event(plan: TrialPlan) -> events.Event:
    """One trial of ``plan``: its steps of the Poisson-subsampled Gaussian (the only mechanism a trial may have)."""
    return events.SelfComposed(events.PoissonGaussian(float(plan["noise_multiplier"]), float(plan["sampling_rate"])),
                               int(plan["steps"]))


def one_trial(plans: list[TrialPlan]) -> events.Event:
    """One trial of the space: any of the plans' configurations, drawn without looking at the data (``AnyOf``:
    bounded by the largest of their RDP curves); the plan's own event where they all have one."""
    if not plans:
        raise ValueError("no plan: the bound needs the plan of every configuration")
    trials = list(dict.fromkeys(trial_event(plan) for plan in plans))
    return trials[0] if len(trials) == 1 else events.AnyOf(tuple(trials))


def tuning_event(plans: list[TrialPlan], dist: accounting.TrialDistribution) -> events.Event:
    """The event of the whole search: the best of K ~ ``dist`` trials (``RepeatAndSelect``; a fixed K: their
    composition)."""
    return _select(one_trial(plans), dist)


def _select(trial: events.Event, dist: accounting.TrialDistribution) -> events.Event:
    if dist.kind == "fixed":
        return events.SelfComposed(trial, int(dist.trials))
    if dist.kind == "poisson":
        return events.RepeatAndSelect(trial, float(dist.mu), math.inf)
    return events.RepeatAndSelect(trial, float(dist.mean), float(dist.eta))


def one_trial_rdp(plans: list[TrialPlan]) -> np.ndarray:
    """The RDP curve of one trial at :data:`~dpl.core.accounting.tuning.ORDERS` (the largest of the plans')."""
    return events.trial_rdp(one_trial(plans))


def composed_epsilon(plans: list[TrialPlan], trials: int, delta: float) -> float:
    """Epsilon of ``trials`` trials composed: by the trials' own accountant when all configurations share one
    accounting (the steps of all the trials), else by RDP (``trials`` times the largest curve)."""
    return events.epsilon(events.SelfComposed(one_trial(plans), int(trials)), delta, plans[0]["accountant"])


def tuned_epsilon(plans: list[TrialPlan], dist: accounting.TrialDistribution, delta: float) -> float:
    """Epsilon at ``delta`` of the tuned release: the event of the search (:func:`tuning_event`) composed."""
    return events.epsilon(tuning_event(plans, dist), delta, plans[0]["accountant"])


def plan_for(plans: list[TrialPlan], config: dict[str, str]) -> TrialPlan:
    """The plan covering the trial of ``config`` (``ConfigError`` if none does)."""
    part = accounting_part(config)
    for plan in plans:
        if plan["config"] == part:
            return plan
    raise ConfigError(f"dpl tune: no plan covers the configuration {short(config)}: the bound does not hold for it")


def mismatch(plan: TrialPlan, summary: dict[str, Any]) -> str | None:
    """How a trial's privacy summary (or report) differs from its plan in sigma, sampling rate, steps or delta, or
    ``None``: a difference means the bound, computed from the plans, does not cover the trial."""
    checks = [("noise_multiplier", summary.get("noise_multiplier"), plan["noise_multiplier"]),
              ("sampling_rate", summary.get("sampling_rate"), plan["sampling_rate"]),
              ("delta", summary.get("delta"), plan["delta"])]
    for name, got, planned in checks:
        if got is None or not math.isclose(float(got), planned, rel_tol=1e-9, abs_tol=0.0):
            return f"{name} {got} where the plan has {planned:.6g}"
    steps = max(int(summary.get("steps_planned") or 0), int(summary.get("steps_taken") or 0))
    if steps != plan["steps"]:
        return f"{steps} steps where the plan has {plan['steps']}"
    return None


# ------------------------------------------------------------------------------------------- --total-epsilon


def calibrated(plans: list[TrialPlan], target: float) -> list[TrialPlan]:
    """``plans`` with sigma calibrated to ``target`` by each configuration's mechanism, as ``dpl fit`` does
    (the Poisson-subsampled Gaussian, the only mechanism a trial may have)."""
    from dpl.core.mechanism import PoissonGaussian

    def sigma(plan: TrialPlan) -> float:
        mechanism = PoissonGaussian(plan["sampling_rate"], plan["accountant"])
        return events.calibrate(lambda s: mechanism.event(s, plan["steps"]), target, plan["delta"], plan["accountant"])

    return [{**plan, "noise_multiplier": float(sigma(plan)), "epsilon": None} for plan in plans]


def solve_total(fit_args: list[str], space: SearchSpace, dist: accounting.TrialDistribution,
                total: float) -> tuple[float, list[TrialPlan], float]:
    """The largest per-trial target epsilon whose tuned epsilon is at most ``total`` (at the trials' delta), by a
    safeguarded secant search on logarithms; each step calibrates sigma for every accounting-distinct configuration,
    and the answer is planned again by the planner. Returns ``(per-trial target, plans, tuned epsilon)``."""
    if not (math.isfinite(total) and total > 0):
        raise ConfigError(f"dpl tune: --total-epsilon must be a positive number, got {total!r}")
    base = plan_space(fit_args, space)
    delta = base[0]["delta"]
    if dist.kind != "fixed":  # trials with no privacy loss at all: the least the search can cost
        floor = events.epsilon(_select(events.Composed(()), dist), delta)
        if floor > total:
            raise ConfigError(f"dpl tune: --total-epsilon {total:g} cannot be met: with K ~ {dist.describe()} "
                              f"trials the search costs at least epsilon {floor:.4g} at delta = {delta:.3g}, even "
                              f"with trials that spend nothing (raise it, or lower --trials-mean)")

    def total_at(target: float) -> float:
        try:
            return tuned_epsilon(calibrated(base, target), dist, delta)
        except ValueError:  # no sigma reaches this target
            return math.inf

    start = total / dist.trials if dist.kind == "fixed" else total / 2
    target = _largest_below(total_at, total, start)
    if target is None:
        smallest = total * SMALLEST_FRACTION
        raise ConfigError(f"dpl tune: --total-epsilon {total:g} cannot be met: even a per-trial epsilon of "
                          f"{smallest:.3g} exceeds it at delta = {delta:.3g} (raise it, or lower --trials-mean)")
    for _ in range(5):  # the planner's sigma is the calibration's: this loop guards against any difference
        plans = plan_space(fit_args, space, target)
        tuned = tuned_epsilon(plans, dist, delta)
        if tuned <= total:
            return target, plans, tuned
        target *= 0.99
    raise ConfigError(f"dpl tune: --total-epsilon {total:g}: the planned trials exceed it ({tuned:.4g})")


def _largest_below(total_at: Callable[[float], float], total: float, start: float) -> float | None:
    """A target with ``total_at(target)`` in [(1 - TOTAL_TOL) total, total] (``total_at`` increases), else the one
    with the largest value at most ``total`` found in 40 evaluations; ``None`` if even ``total * SMALLEST_FRACTION``
    exceeds ``total``. Secant steps on (log target, log total), kept inside the bracket found so far."""
    aim, smallest = math.log(total * (1 - TOTAL_TOL / 2)), math.log(total * SMALLEST_FRACTION)
    best: tuple[float, float] | None = None  # (target, value) with the largest value <= total
    lo = hi = None  # largest log target feasible, smallest infeasible
    points: list[tuple[float, float]] = []
    u = max(math.log(start), smallest)
    for _ in range(40):
        value = total_at(math.exp(u))
        if value <= total:
            if best is None or value > best[1]:
                best = (math.exp(u), value)
            if value >= total * (1 - TOTAL_TOL):
                break
            lo = u if lo is None else max(lo, u)
        else:
            if u <= smallest:
                return None
            hi = u if hi is None else min(hi, u)
        if 0 < value < math.inf:
            points.append((u, math.log(value)))
        if len(points) >= 2 and points[-1][1] != points[-2][1]:
            (u1, y1), (u2, y2) = points[-2], points[-1]
            nxt = u2 + (aim - y2) * (u2 - u1) / (y2 - y1)
        elif points and points[-1][0] == u:
            nxt = u + aim - points[-1][1]  # epsilon roughly proportional to the target
        else:
            nxt = u - 0.7
        if lo is not None and hi is not None:
            if hi - lo < 1e-9:
                break
            if not lo < nxt < hi:
                nxt = (lo + hi) / 2
        u = max(nxt, smallest)
    return best[0] if best is not None else None
