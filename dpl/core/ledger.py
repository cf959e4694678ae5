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

from dpl.core.accounting.calibration import smallest_noise_multiplier
from dpl.core.mechanism import Mechanism, Segment
from dpl.core.privacy import PrivacyConfig
from dpl.errors import ConfigError, PrivacyWarning

log = logging.getLogger("dpl")

#: version of the ledger's checkpoint state; 2 stored the history as (sigma, steps, rate) triples, 3 had no target
STATE_VERSION = 4


@dataclass(frozen=True)
class Plan:
    """What a run is set up for. ``num_examples`` counts what the mechanism samples (rows; users under user-level
    sampling; the bounded rows under example-level sampling), ``num_rows`` the training rows, ``num_units`` the
    privacy units (rows or users: delta's N)."""

    num_examples: int
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
              num_units: int | None = None, sampling_rate: float | None = None) -> Plan:
    """The plan of ``steps`` steps drawing expected batches of ``privacy.batch_size`` out of ``population``; delta
    defaults to 0.1 / (number of privacy units), with a warning if N delta > 0.1."""
    if privacy.batch_size > population:
        raise ConfigError(f"privacy.batch_size ({privacy.batch_size}) is larger than the training set "
                          f"({population} {'users' if privacy.unit == 'user' and privacy.user_sampling == 'users' else 'examples'})")
    if steps < 1:
        raise ConfigError("the plan has no training step")
    units = population if num_units is None else num_units
    plan = Plan(num_examples=population, expected_batch_size=privacy.batch_size,
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
    """Sigma, the steps taken and epsilon for one run of ``mechanism`` under ``plan`` (see the module docstring)."""

    def __init__(self, privacy: PrivacyConfig, plan: Plan, mechanism: Mechanism) -> None:
        self.privacy, self.plan, self.mechanism = privacy, plan, mechanism
        if privacy.noise_multiplier is not None:
            self.noise_multiplier = float(privacy.noise_multiplier)
        else:
            self.noise_multiplier = float(mechanism.calibrate(privacy.target_epsilon, plan.delta, plan.steps))
        self.history: list[Segment] = []  # earlier parts of a run resumed with changed settings
        self.steps_done = 0
        self.check_max_epsilon()

    # --- epsilon ------------------------------------------------------------------------------------------
    def epsilon(self, steps: int | None = None, delta: float | None = None) -> float:
        """Epsilon spent after ``steps`` steps in total (default: the steps done), earlier parts included, at
        ``delta`` (default: the run's)."""
        steps = self.steps_done if steps is None else steps
        delta = self.plan.delta if delta is None else float(delta)
        if self.noise_multiplier == 0 and steps > 0:
            return math.inf
        if not self.history:
            return self.mechanism.epsilon(self.noise_multiplier, delta, steps) if steps > 0 else 0.0
        done_before = sum(s.steps for s in self.history)
        current = Segment(self.noise_multiplier, self.plan.sampling_rate, max(0, steps - done_before))
        return self.mechanism.epsilon_of_segments([*self.history, current], delta)

    def final_epsilon(self) -> float:
        """Epsilon after the planned steps."""
        return self.epsilon(self.plan.steps)

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

    def _calibrate_remaining(self, target: float) -> float:
        """Smallest sigma for the remaining steps whose composition with the history stays within ``target``."""
        plan = self.plan
        remaining = plan.steps - sum(s.steps for s in self.history)
        if remaining <= 0:
            return self.history[-1].noise_multiplier
        spent = self.mechanism.epsilon_of_segments(list(self.history), plan.delta)
        if spent >= target:
            raise ConfigError(f"the checkpoint already spent epsilon = {spent:.3f} >= privacy.target_epsilon = "
                              f"{target:g}: nothing left to train with")

        def eps(sigma: float) -> float:
            return self.mechanism.epsilon_of_segments(
                [*self.history, Segment(sigma, plan.sampling_rate, remaining)], plan.delta)

        try:
            return smallest_noise_multiplier(eps, target, guess=self.noise_multiplier or 1.0)
        except ValueError as exc:
            raise ConfigError(f"cannot calibrate sigma for the remaining steps ({exc})") from None

    # --- checkpoints --------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        plan, cfg = self.plan, self.privacy
        return {
            "version": STATE_VERSION, "noise_multiplier": self.noise_multiplier, "delta": plan.delta,
            "max_grad_norm": cfg.max_grad_norm, "expected_batch_size": plan.expected_batch_size,
            "num_examples": plan.num_examples, "steps_done": self.steps_done, "planned_steps": plan.steps,
            "history": [list(s) for s in self.history], "mechanism_name": self.mechanism.name,
            "target_epsilon": cfg.target_epsilon if cfg.noise_multiplier is None else None,
            "sampling_rate": plan.sampling_rate, "unit": plan.unit,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a checkpoint's state: refuse (unless ``privacy.force_resume``) changed privacy settings,
        account the whole history either way, and refuse a resume with nothing left or one that would end above
        the budget."""
        version = state.get("version")
        if version not in (2, 3, STATE_VERSION):
            raise ConfigError("this checkpoint was written by an older dpl whose checkpoints carried secrets; "
                              "it cannot be resumed safely")
        done = int(state["steps_done"])
        if done >= self.plan.steps:
            raise ConfigError(f"nothing left to train: the checkpoint took {done} steps and this run plans "
                              f"{self.plan.steps} in all (trainer.max_steps / trainer.max_epochs count from the start "
                              "of the run: raise them to train on)")
        if state.get("unit", "example") != self.plan.unit:
            raise ConfigError(f"the checkpoint's guarantee is per {state.get('unit', 'example')}, this run's per "
                              f"{self.plan.unit}: a resume cannot change the privacy unit")
        self._check_resume_plan(state, version)
        self.steps_done = done
        self.check_max_epsilon()

    def _check_resume_plan(self, state: dict[str, Any], version: int) -> None:
        cfg, plan = self.privacy, self.plan
        old_sigma = float(state["noise_multiplier"])
        done = int(state["steps_done"])
        changes = []
        if state["mechanism_name"] != self.mechanism.name:
            changes.append(f"mechanism {state['mechanism_name']} -> {self.mechanism.name}")
        if state["max_grad_norm"] != cfg.max_grad_norm:
            changes.append(f"C {state['max_grad_norm']:g} -> {cfg.max_grad_norm:g}")
        if state["expected_batch_size"] != cfg.batch_size or state["num_examples"] != plan.num_examples:
            changes.append(f"q = {state['expected_batch_size']}/{state['num_examples']} -> "
                           f"{cfg.batch_size}/{plan.num_examples}")
        if not math.isclose(state["delta"], plan.delta, rel_tol=1e-12):
            changes.append(f"delta {state['delta']:.3g} -> {plan.delta:.3g}")
        same_plan = int(state["planned_steps"]) == plan.steps
        old_target = state.get("target_epsilon", cfg.target_epsilon if version < 4 else None)
        calibrated = cfg.noise_multiplier is None
        if calibrated and old_target != cfg.target_epsilon:
            changes.append(f"target epsilon {old_target} -> {cfg.target_epsilon:g}" if old_target is not None else
                           f"sigma fixed at {old_sigma:.4f} -> target epsilon {cfg.target_epsilon:g}")
        elif calibrated and same_plan:
            self.noise_multiplier = old_sigma  # same plan, same target: keep the exact value
        if not math.isclose(old_sigma, self.noise_multiplier, rel_tol=1e-12):
            changes.append(f"sigma {old_sigma:.4f} -> {self.noise_multiplier:.4f}"
                           + ("" if same_plan else f" (plan {state['planned_steps']} -> {plan.steps} steps)"))
        stored = state.get("history", [])
        history = [Segment(float(h[0]), float(h[2]), int(h[1])) if version == 2 else Segment(float(h[0]), float(h[1]),
                                                                                               int(h[2]))
                   for h in stored]
        history.append(Segment(old_sigma, float(state["sampling_rate"]), done - sum(s.steps for s in history)))
        if changes and not cfg.force_resume:
            raise ConfigError("resuming would change the privacy settings (" + "; ".join(changes) + "); set "
                              "privacy.force_resume=true to resume anyway (epsilon is then composed over both parts)")
        if state["mechanism_name"] != self.mechanism.name:
            raise ConfigError("a resume cannot change the privacy mechanism: there is no accounting for the "
                              "composition; start a new run")
        history = [s for s in history if s.steps > 0]
        if changes:
            self.history = history
            if cfg.noise_multiplier is None:  # recalibrate sigma for what is left of the budget
                self.noise_multiplier = self._calibrate_remaining(cfg.target_epsilon)
            log.warning("dpl: resuming with changed privacy settings (%s); epsilon is composed over both parts: "
                        "%.3f after %d steps, %.3f planned", "; ".join(changes), self.epsilon(done), done,
                        self.final_epsilon())
        else:
            self.history = history[:-1]  # unchanged settings: the last segment continues

    # --- the report ---------------------------------------------------------------------------------------
    def summary(self, deltas: tuple[float, ...] = ()) -> dict[str, Any]:
        """The accounting as plain values: epsilon spent (at the run's delta and at each of ``deltas``), sigma,
        the plan, the unit, the mechanism's declared sampling and accounting."""
        cfg, plan, mechanism = self.privacy, self.plan, self.mechanism
        return {
            "epsilon": self.epsilon(), "epsilon_planned": self.final_epsilon(),
            "epsilon_at_delta": {float(d): self.epsilon(delta=d) for d in deltas},
            "delta": plan.delta, "noise_multiplier": self.noise_multiplier, "max_grad_norm": cfg.max_grad_norm,
            "batch_size": cfg.batch_size, "sampling_rate": float(mechanism.sample_rate),
            "sampling": mechanism.sampling, "steps_per_epoch": plan.steps_per_epoch, "steps_planned": plan.steps,
            "steps_taken": self.steps_done, "resumed_segments": [list(s) for s in self.history],
            "accountant": mechanism.accounting, "adjacency": mechanism.adjacency, "mechanism": mechanism.name,
            "unit": mechanism.unit, "num_examples": plan.num_rows, "num_units": plan.num_units,
            "target_epsilon": cfg.target_epsilon, "max_epsilon": cfg.effective_max_epsilon,
        }
