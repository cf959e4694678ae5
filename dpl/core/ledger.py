"""The privacy ledger of a run: its plan, the noise multiplier that trains, what was spent, the budget, resumes.

:class:`PrivacyLedger` is the one place that knows how much privacy a run spends: the :class:`Plan` (computed once,
by :func:`make_plan`), sigma (calibrated to the target, or given), the history of earlier segments of a resumed
run, the steps taken, the budget (``privacy.max_epsilon``) and the comparison of a checkpoint's plan with this
run's. The mechanism it accounts for is declared (:class:`~dpl.core.mechanism.Mechanism`): its sample rate, unit,
sampling and accounting are read from it, never guessed.
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass
from typing import Any

from dpl.core.accounting import EpsilonSchedule, events
from dpl.core.mechanism import Mechanism
from dpl.core.privacy import PrivacyConfig
from dpl.errors import ConfigError, PrivacyWarning

log = logging.getLogger("dpl")

#: version of the ledger's checkpoint state (5: the history as declared events)
STATE_VERSION = 5


@dataclass(frozen=True)
class Plan:
    """What a run is set up for. ``population`` counts what the mechanism samples (rows; users under user-level
    sampling; the bounded rows under example-level sampling), ``num_rows`` the training rows, ``num_units`` the
    privacy units (rows or users: delta's N)."""

    population: int
    expected_batch_size: int
    sampling_rate: float
    steps: int
    steps_per_epoch: int
    delta: float
    num_rows: int
    num_units: int
    unit: str = "example"


def steps_per_epoch(population: int, batch_size: int) -> int:
    """Logical batches per epoch: floor(N / B), at least one (the plan's arithmetic, here only)."""
    return max(1, population // batch_size)


def planned_steps(steps_per_epoch: int, *, max_steps: int | None, max_epochs: int | None,
                  limit_train_batches: int | float | None = 1.0) -> int:
    """The number of steps a Lightning trainer with these settings really runs: the smallest of ``max_steps`` and
    ``max_epochs`` times the batches per epoch (``limit_train_batches`` applied); a warning when they disagree."""
    per_epoch = steps_per_epoch
    limit = limit_train_batches
    if isinstance(limit, int) and not isinstance(limit, bool):
        per_epoch = min(per_epoch, limit)
    elif limit is not None and limit != 1.0:
        per_epoch = int(per_epoch * float(limit))
    candidates = {}
    if max_steps is not None and max_steps > 0:
        candidates["trainer.max_steps"] = int(max_steps)
    if max_epochs is not None and max_epochs >= 0:
        candidates[f"trainer.max_epochs ({max_epochs} x {per_epoch} steps)"] = int(max_epochs) * per_epoch
    if not candidates:
        raise ConfigError("set trainer.max_steps or trainer.max_epochs: privacy accounting needs the number "
                          "of steps up front")
    steps = min(candidates.values())
    if len(set(candidates.values())) > 1:
        log.warning("dpl: %s; training stops after %d steps, and privacy is accounted for %d steps",
                    " vs ".join(f"{k} = {v}" for k, v in candidates.items()), steps, steps)
    if steps < 1:
        raise ConfigError("the trainer settings leave no training step (max_steps / max_epochs / "
                          "limit_train_batches)")
    return steps


def make_plan(privacy: PrivacyConfig, *, population: int, steps: int, num_rows: int | None = None,
              num_units: int | None = None, sampling_rate: float | None = None,
              population_name: str = "examples") -> Plan:
    """The plan of ``steps`` steps drawing expected batches of ``privacy.batch_size`` out of ``population``; delta
    defaults to 0.1 / (number of privacy units), with a warning if N delta > 0.1."""
    if privacy.batch_size > population:
        raise ConfigError(f"privacy.batch_size ({privacy.batch_size}) is larger than the training set "
                          f"({population} {population_name})")
    if steps < 1:
        raise ConfigError("the plan has no training step")
    units = population if num_units is None else num_units
    plan = Plan(population=population, expected_batch_size=privacy.batch_size,
                sampling_rate=sampling_rate if sampling_rate is not None else privacy.batch_size / population,
                steps=steps, steps_per_epoch=steps_per_epoch(population, privacy.batch_size),
                delta=privacy.delta_for(units), num_rows=population if num_rows is None else num_rows,
                num_units=units, unit=privacy.unit)
    if plan.delta * units > 0.1 * (1 + 1e-9):  # the default 0.1 / N times N may round above 0.1
        warnings.warn(f"delta = {plan.delta:.3g} gives N * delta = {plan.delta * units:.2f} for N = {units} "
                      f"{privacy.unit}s: the guarantee may fail outright with probability delta, and N * delta should "
                      "be small (default: delta = 0.1 / N)", PrivacyWarning, stacklevel=3)
    return plan


class PrivacyLedger:
    """Sigma, the steps taken and epsilon for one run of ``mechanism`` under ``plan`` (see the module docstring).

    ``history`` holds the ``(event, steps)`` of earlier parts of a run resumed with changed settings; the current part
    is ``mechanism.event(sigma, steps)``. Epsilon is the composition of those events
    (:func:`dpl.core.accounting.events.epsilon`)."""

    def __init__(self, privacy: PrivacyConfig, plan: Plan, mechanism: Mechanism) -> None:
        self.privacy, self.plan, self.mechanism = privacy, plan, mechanism
        self.history: list[tuple[events.Event, int]] = []  # earlier parts of a run resumed with changed settings
        self.steps_done = 0
        self._schedules: dict[tuple, EpsilonSchedule] = {}
        mechanism.settle_choices(privacy.target_epsilon if privacy.noise_multiplier is None else None, plan.delta,
                                 plan.steps)
        if privacy.noise_multiplier is not None:
            self.noise_multiplier = float(privacy.noise_multiplier)
        else:
            self.noise_multiplier = self._calibrate(privacy.target_epsilon, plan.steps)
        self.check_max_epsilon()

    def __getstate__(self) -> dict[str, Any]:  # schedules hold a thread: copies start without them
        return {**self.__dict__, "_schedules": {}}

    # --- events -------------------------------------------------------------------------------------------
    @property
    def steps_before(self) -> int:
        """Steps of the earlier parts (a resume with changed settings)."""
        return sum(steps for _, steps in self.history)

    def event(self, steps: int | None = None, noise_multiplier: float | None = None) -> events.Event:
        """The event of the first ``steps`` steps in total (default: the steps done): the earlier parts, then the
        current one at ``noise_multiplier`` (default: the run's sigma)."""
        steps = self.steps_done if steps is None else int(steps)
        sigma = self.noise_multiplier if noise_multiplier is None else float(noise_multiplier)
        current = max(0, steps - self.steps_before)
        return events.history_event([*self.history, (self.mechanism.event(sigma, current), current)])

    def history_of_steps(self) -> list[tuple[events.Event, int]]:
        """``(event, steps)`` of every part of the steps done, the current part last."""
        current = self.steps_done - self.steps_before
        return [*self.history, *([(self.mechanism.event(self.noise_multiplier, current), current)] if current else [])]

    def _calibrate(self, target: float, steps: int, guess: float = 1.0) -> float:
        """Smallest sigma for the steps left of ``steps`` whose composition with the history is within ``target``."""
        try:
            return events.calibrate(lambda sigma: self.event(steps, sigma), target, self.plan.delta,
                                    self.privacy.accountant, guess=guess)
        except ValueError as exc:
            raise ConfigError(f"cannot calibrate sigma ({exc})") from None

    # --- epsilon ------------------------------------------------------------------------------------------
    def epsilon(self, steps: int | None = None, delta: float | None = None) -> float:
        """Epsilon spent after ``steps`` steps in total (default: the steps done), earlier parts included, at
        ``delta`` (default: the run's). Read from an :class:`~dpl.core.accounting.EpsilonSchedule` of the current
        part: exact on a grid 5% apart and at counts first asked beyond it (the plan's total, asked at setup),
        otherwise the next grid point's value (at most ~2.5% above), computed ahead by a background thread."""
        steps = self.steps_done if steps is None else steps
        delta = self.plan.delta if delta is None else float(delta)
        if steps <= 0 and not self.history:
            return 0.0
        before = self.steps_before
        if steps <= before:  # the earlier parts only
            return events.epsilon(events.history_event(self.history), delta, self.privacy.accountant)
        key = (tuple(self.history), self.noise_multiplier, delta)
        if key not in self._schedules:
            sigma, method = self.noise_multiplier, self.privacy.accountant
            self._schedules[key] = EpsilonSchedule(lambda n: events.epsilon(self.event(before + n, sigma), delta,
                                                                            method))
        return self._schedules[key](steps - before)

    def final_epsilon(self) -> float:
        """Epsilon after the planned steps."""
        return self.epsilon(self.plan.steps)

    def per_row(self) -> dict[str, float]:
        """Where rows are sampled and clipped under a user-level guarantee (example-level sampling: the events are
        mixtures of Gaussians), the per-row epsilon, for reference: the composition of every part's row-level event
        (:func:`~dpl.core.accounting.events.row_level`, each part at the sigma it trained with), and its loose
        group-privacy conversion to the k rows of a user. Empty otherwise (under user-level sampling a row's removal
        changes its user's clipped mean by up to 2C: no row-level event is declared)."""
        event = self.event()
        rows = events.row_level(event)
        if rows == event:
            return {}
        from dpl.core.accounting.users import group_privacy

        delta = self.plan.delta
        row = events.epsilon(rows, delta, self.privacy.accountant)
        group_eps, group_delta = group_privacy(row, delta, events.group_size(event))
        return {"epsilon_per_row": row, "epsilon_group_privacy": group_eps, "delta_group_privacy": group_delta}

    # --- max_epsilon (the budget) ---------------------------------------------------------------------------
    def would_exceed_max_epsilon(self) -> bool:
        """Whether the next step would spend more than ``privacy.max_epsilon``. Within the plan this is proven, not
        evaluated: epsilon never decreases with the steps, and :meth:`check_max_epsilon` verified the plan's last
        step against it with this sigma and history (at setup and at every resume). A step beyond the plan asks
        the accountant (a mechanism with no analysis there answers inf)."""
        max_epsilon = self.privacy.effective_max_epsilon
        if max_epsilon is None or self.steps_done + 1 <= self.plan.steps:
            return False
        return self.epsilon(self.steps_done + 1) > max_epsilon * (1 + 1e-9)

    def check_max_epsilon(self) -> None:
        """Refuse, in one line, a plan (after a resume: the rest of it, with the sigma that will train) that would
        end above ``privacy.max_epsilon``."""
        max_epsilon = self.privacy.effective_max_epsilon
        if max_epsilon is None:  # sigma = 0 spends epsilon = inf: refused below
            return
        planned = self.final_epsilon()
        if planned <= max_epsilon * (1 + 1e-9):
            return
        if self.steps_done:
            raise ConfigError(f"resuming would end at epsilon = {planned:.3f} > privacy.max_epsilon = "
                              f"{max_epsilon:g} (epsilon = {self.epsilon():.3f} already spent in {self.steps_done} "
                              f"steps, sigma = {self.noise_multiplier:.4f} for the {self.plan.steps - self.steps_done} steps left)")
        raise ConfigError(f"the plan spends epsilon = {planned:.3f} > privacy.max_epsilon = {max_epsilon:g} "
                          f"(sigma = {self.noise_multiplier:.4f}, {self.plan.steps} steps)")

    # --- checkpoints --------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        plan, cfg = self.plan, self.privacy
        return {
            "version": STATE_VERSION, "noise_multiplier": self.noise_multiplier, "delta": plan.delta,
            "max_grad_norm": cfg.max_grad_norm, "expected_batch_size": plan.expected_batch_size,
            "population": plan.population, "steps_done": self.steps_done, "planned_steps": plan.steps,
            "history": events.history_to_json(self.history_of_steps()), "scope": self.mechanism.scope,
            "mechanism_name": self.mechanism.name,
            "target_epsilon": cfg.target_epsilon if cfg.noise_multiplier is None else None,
            "sampling_rate": plan.sampling_rate, "unit": plan.unit,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a checkpoint's state: refuse, in one line naming both, a change the accounting cannot compose
        (the mechanism's scope: mechanism, sampling, unit, k, adjacency), with or without ``privacy.force_resume``;
        refuse other changed privacy settings unless ``privacy.force_resume``, then compose the checkpoint's events
        with this run's; refuse a resume with nothing left or one that would end above the budget."""
        version = state.get("version")
        if version != STATE_VERSION:
            raise ConfigError("this checkpoint was written by an older dpl whose accounting state does not declare its "
                              "events (sampling mode, k, unit): it cannot be resumed with exact accounting; resume it "
                              "with the dpl that wrote it, or start a new run")
        done = int(state["steps_done"])
        if done >= self.plan.steps:
            raise ConfigError(f"nothing left to train: the checkpoint took {done} steps and this run plans "
                              f"{self.plan.steps} in all (trainer.max_steps / trainer.max_epochs count from the start "
                              "of the run: raise them to train on)")
        scope, mine = state["scope"], self.mechanism.scope
        if scope != mine:
            differ = sorted(k for k in set(scope) | set(mine) if scope.get(k) != mine.get(k))
            raise ConfigError("a resume cannot change how the privacy is accounted: the checkpoint's steps are "
                              + ", ".join(f"{k} {scope.get(k)}" for k in differ) + "; this run's "
                              + ", ".join(f"{k} {mine.get(k)}" for k in differ)
                              + " (with or without privacy.force_resume); start a new run")
        self._check_resume_plan(state)
        self.steps_done = done
        self.check_max_epsilon()

    def _check_resume_plan(self, state: dict[str, Any]) -> None:
        cfg, plan = self.privacy, self.plan
        old_sigma = float(state["noise_multiplier"])
        done = int(state["steps_done"])
        stored = events.history_from_json(state["history"])
        if sum(steps for _, steps in stored) != done:
            raise ConfigError("the checkpoint's accounting history does not cover its steps: it cannot be resumed")
        changes = []
        if state["max_grad_norm"] != cfg.max_grad_norm:
            changes.append(f"C {state['max_grad_norm']:g} -> {cfg.max_grad_norm:g}")
        if state["expected_batch_size"] != cfg.batch_size or state["population"] != plan.population:
            changes.append(f"q = {state['expected_batch_size']}/{state['population']} -> "
                           f"{cfg.batch_size}/{plan.population}")
        if not math.isclose(state["delta"], plan.delta, rel_tol=1e-12):
            changes.append(f"delta {state['delta']:.3g} -> {plan.delta:.3g}")
        same_plan = int(state["planned_steps"]) == plan.steps
        old_target = state.get("target_epsilon")
        calibrated = cfg.noise_multiplier is None
        if calibrated and old_target != cfg.target_epsilon:
            changes.append(f"target epsilon {old_target} -> {cfg.target_epsilon:g}" if old_target is not None else
                           f"sigma fixed at {old_sigma:.4f} -> target epsilon {cfg.target_epsilon:g}")
        elif calibrated and same_plan:
            self.noise_multiplier = old_sigma  # same plan, same target: keep the exact value
        def sigma_change() -> str:
            return (f"sigma {old_sigma:.4f} -> {self.noise_multiplier:.4f}"
                    + ("" if same_plan else f" (plan {state['planned_steps']} -> {plan.steps} steps)"))

        sigma_at = len(changes) if not math.isclose(old_sigma, self.noise_multiplier, rel_tol=1e-12) else None
        if sigma_at is not None:
            changes.append(sigma_change())
        # whatever the settings say, the events decide: the last part continues only if this run's mechanism
        # declares the same event for it
        earlier, (last_event, last_steps) = stored[:-1], stored[-1]
        if not changes and self.mechanism.event(self.noise_multiplier, last_steps) != last_event:
            changes.append("the accounting event of a step")
        if changes and not cfg.force_resume:
            raise ConfigError("resuming would change the privacy settings (" + "; ".join(changes) + "); set "
                              "privacy.force_resume=true to resume anyway (epsilon is then composed over both parts)")
        if changes and not self.mechanism.resumable_with_changes:
            raise ConfigError(f"mechanism {self.mechanism.name} is accounted as one analysis over the whole run: a "
                              "resume cannot change its settings (" + "; ".join(changes) + "); resume with the "
                              "checkpoint's settings or start a new run")
        if changes:
            self.history = stored
            if cfg.noise_multiplier is None:  # recalibrate sigma for what is left of the budget
                spent = events.epsilon(events.history_event(stored), plan.delta, cfg.accountant)
                if spent >= cfg.target_epsilon:
                    raise ConfigError(f"the checkpoint already spent epsilon = {spent:.3f} >= privacy.target_epsilon "
                                      f"= {cfg.target_epsilon:g}: nothing left to train with")
                self.noise_multiplier = self._calibrate(cfg.target_epsilon, plan.steps, self.noise_multiplier or 1.0)
                if sigma_at is not None:  # the warning names the sigma that trains
                    del changes[sigma_at]
                if not math.isclose(old_sigma, self.noise_multiplier, rel_tol=1e-12):
                    changes.append(sigma_change())
            log.warning("dpl: resuming with changed privacy settings (%s); epsilon is composed over both parts: "
                        "%.3f after %d steps, %.3f planned", "; ".join(changes), self.epsilon(done), done,
                        self.final_epsilon())
        else:
            self.history = earlier  # unchanged settings: the last part continues

    # --- the report ---------------------------------------------------------------------------------------
    def summary(self, deltas: tuple[float, ...] = ()) -> dict[str, Any]:
        """The accounting as plain values: epsilon spent (at the run's delta and at each of ``deltas``), sigma,
        the plan, the unit, the mechanism's declared sampling and accounting, and the history of events."""
        cfg, plan, mechanism = self.privacy, self.plan, self.mechanism
        return {
            "epsilon": self.epsilon(), "epsilon_planned": self.final_epsilon(),
            "epsilon_at_delta": {float(d): self.epsilon(delta=d) for d in deltas},
            "delta": plan.delta, "noise_multiplier": self.noise_multiplier, "max_grad_norm": cfg.max_grad_norm,
            "batch_size": cfg.batch_size, "sampling_rate": float(mechanism.sample_rate),
            "sampling": mechanism.sampling, "steps_per_epoch": plan.steps_per_epoch, "steps_planned": plan.steps,
            "steps_taken": self.steps_done, "resumed_parts": len(self.history) + 1 if self.history else 0,
            "events": events.history_to_json(self.history_of_steps()), "scope": mechanism.scope,
            "accountant": mechanism.accounting, "adjacency": mechanism.adjacency, "mechanism": mechanism.name,
            "unit": mechanism.unit, "num_examples": plan.num_rows, "num_units": plan.num_units,
            "target_epsilon": cfg.target_epsilon, "max_epsilon": cfg.effective_max_epsilon, **self.per_row(),
        }
