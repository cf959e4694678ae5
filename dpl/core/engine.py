"""The private-training engine: one object that runs differentially private training, free of Lightning.

:class:`PrivateEngine` owns everything private about a run: the plugins (their manager), the mechanism (how batches
are drawn, how privacy is accounted), the noise multiplier and its calibration, the accounting history, the secret
generators (noise, sampler) and the public one (per-step seeds), the four hook calls of each step, and the split of
its state into a public part (a checkpoint a user may share) and a secret part (the owner-only sidecar).

Its life, whoever drives it (the Lightning adapter :class:`~dpl.lightning.module.DPModule`, ``dpl audit``, a
study script):

1. ``PrivateEngine(privacy, plugins)`` - plugins are loaded (an unknown plugin or hook fails here);
2. :meth:`~PrivateEngine.setup` - once the model and the data size are known: plugins validate the run and check
   each other's contracts, the mechanism is configured, sigma calibrated, the plan checked against the budget;
3. :meth:`~PrivateEngine.load_state_dict` / :meth:`~PrivateEngine.load_secret_state_dict` - only on resume;
4. :meth:`~PrivateEngine.start` - the noise source is created on the parameters' device (and the secret state of a
   resume applied to it);
5. :meth:`~PrivateEngine.step` per logical batch from :meth:`~PrivateEngine.batch_sampler`, then
   :meth:`~PrivateEngine.epsilon` to report what was spent.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pluggy
import torch
from torch import Tensor, nn
from torch.utils.data import Sampler

from dpl.core.accounting.calibration import smallest_noise_multiplier
from dpl.core.gradients import GradientSum
from dpl.core.mechanism import Mechanism, Segment, apply_adjacency
from dpl.core.noise import NoiseSource, SecureNormal, StatefulSource, noise_source
from dpl.core.plugin_manager import (active_plugin_names, check_contracts, create_plugin_manager, options_as_dict,
                                     replaced_hooks)
from dpl.core.privacy import PrivacyConfig
from dpl.core.sampling import derive_key, derive_seed, secure_generator
from dpl.core.step import RunSetup, StepContext, private_step
from dpl.errors import ConfigError, PrivacyWarning

log = logging.getLogger("dpl")

#: version of the engine's public checkpoint state; 2 stored the history as (sigma, steps, rate) triples, 3 had no
#: target epsilon
STATE_VERSION = 4


@dataclass(frozen=True)
class Plan:
    """What a run is set up for: the data size, the expected batch, the sampling rate, the steps and delta."""

    num_examples: int
    expected_batch_size: int
    sampling_rate: float
    steps: int
    steps_per_epoch: int
    delta: float


def model_is_per_example(model: nn.Module) -> None:
    """Refuse layers whose output for one example depends on the other examples of the batch."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            raise ConfigError(f"layer {name or type(module).__name__} ({type(module).__name__}) normalizes over "
                              "the batch, so one example changes the others' gradients and clipping no longer "
                              "bounds its influence; use LayerNorm/GroupNorm (or replace it before training)")
        if getattr(module, "expert_capacity", None) is not None or "Top1Router" in type(module).__name__:
            raise ConfigError(f"layer {name} ({type(module).__name__}) routes tokens with a capacity shared by "
                              "the batch (token dropping): one example changes the others' outputs")


class PrivateEngine:
    """Differentially private training, one logical batch at a time (see the module docstring for its life).

    Args:
        privacy: the privacy settings.
        plugins: plugins to activate, ``{name: options}`` in the order their ``post_process`` runs.
        plugin_manager: an already built manager instead of ``plugins`` (e.g. with extra plugins registered).
        seed_namespace: prefix of the purposes the per-purpose seeds are derived for from ``privacy.seed``
            (:func:`~dpl.core.sampling.derive_seed`), so that a driver keeps the streams of its recorded experiments
            (``dpl audit``: ``"audit/"``). No effect without ``privacy.seed``.
    """

    def __init__(self, privacy: PrivacyConfig | None = None, plugins: Mapping[str, Any] | None = None,
                 plugin_manager: pluggy.PluginManager | None = None, seed_namespace: str = "") -> None:
        self.privacy = privacy if privacy is not None else PrivacyConfig()
        self.privacy.validate()
        self.seed_namespace = seed_namespace
        self.plugin_options = {name: options_as_dict(opts) for name, opts in (plugins or {}).items()}
        self.plugin_manager = plugin_manager if plugin_manager is not None else create_plugin_manager(plugins)
        self.plan: Plan | None = None
        self.mechanism: Mechanism | None = None
        self.noise_multiplier: float | None = None
        self.history: list[Segment] = []  # earlier parts of a run resumed with changed settings
        self.steps_done = 0
        self.noise_source: NoiseSource | None = None
        self._sampler_generator: torch.Generator | None = None
        self._public_generator: torch.Generator | None = None
        self._secret_to_apply: dict[str, Any] | None = None
        self._fresh_secret_on_start = False
        self._replay_secret = False  # restore the noise and sampler generators exactly (privacy.seed, DDP ranks)
        self._replayed = False  # the generators continue a checkpoint's streams
        self._announced = False
        self.resumed_from: str | None = None  # the checkpoint this run continues (set by the driver)

    # --- setup --------------------------------------------------------------------------------------------
    @property
    def configured(self) -> bool:
        return self.mechanism is not None

    def setup(self, model: nn.Module, *, num_examples: int, steps: int, trainable: Mapping[str, Tensor] | None = None,
              sampling_rate: float | None = None, optimizer_factory: Any = None, world_size: int = 1,
              sharded: bool = False) -> None:
        """Validate the run with every plugin, configure the mechanism and calibrate sigma for ``steps`` steps over
        ``num_examples`` examples (``sampling_rate``: default ``batch_size / num_examples``). Once per engine."""
        if self.configured:
            raise RuntimeError("PrivateEngine.setup runs once; build a new engine for another run")
        cfg = self.privacy
        if cfg.batch_size > num_examples:
            raise ConfigError(f"privacy.batch_size ({cfg.batch_size}) is larger than the training set "
                              f"({num_examples} examples)")
        if steps < 1:
            raise ConfigError("the plan has no training step")
        trainable = dict(trainable) if trainable is not None else {
            n: p for n, p in model.named_parameters() if p.requires_grad}
        if not trainable:
            raise ConfigError("the model has no trainable parameter")
        model_is_per_example(model)
        plan = Plan(num_examples=num_examples, expected_batch_size=cfg.batch_size,
                    sampling_rate=sampling_rate if sampling_rate is not None else cfg.batch_size / num_examples,
                    steps=steps, steps_per_epoch=max(1, num_examples // cfg.batch_size),
                    delta=cfg.delta_for(num_examples))
        if plan.delta * num_examples > 0.1:
            warnings.warn(f"delta = {plan.delta:.3g} gives N * delta = {plan.delta * num_examples:.2f} for N = "
                          f"{num_examples}: the guarantee may fail outright with probability delta, and N * delta "
                          "should be small (default: delta = 0.1 / N)", PrivacyWarning, stacklevel=2)
        replaced = replaced_hooks(self.plugin_manager)
        if "privatize" in replaced and "configure_mechanism" not in replaced:
            raise ConfigError("a plugin replaces privatize without configure_mechanism: the default accounting "
                              "would not match its noise")
        check_contracts(self.plugin_manager, sharded=sharded)
        hook = self.plugin_manager.hook
        setup = RunSetup(model=model, trainable=trainable, plugin_names=active_plugin_names(self.plugin_manager),
                         num_examples=num_examples, expected_batch_size=cfg.batch_size, steps=steps,
                         sampling_rate=plan.sampling_rate, accountant=cfg.accountant,
                         optimizer_name=getattr(optimizer_factory, "__name__", type(optimizer_factory).__name__),
                         replaced_hooks=replaced, seed=cfg.seed, world_size=world_size,
                         optimizer_factory=optimizer_factory, secure_noise=cfg.secure_noise, sharded=sharded)
        hook.validate_setup(setup=setup)
        mechanism = hook.configure_mechanism(setup=setup)
        if mechanism is None:
            raise ConfigError("no plugin configured a privacy mechanism")
        apply_adjacency(mechanism, cfg.adjacency)  # before calibration: the adjacency sets the sensitivity
        self.plan, self.mechanism = plan, mechanism
        if cfg.noise_multiplier is not None:
            self.noise_multiplier = float(cfg.noise_multiplier)
        else:
            self.noise_multiplier = float(mechanism.calibrate(cfg.target_epsilon, plan.delta, steps))
        self._check_budget()
        if cfg.seed is not None:
            warnings.warn("privacy.seed is set: noise and batches are reproducible, and so predictable by anyone "
                          "who knows the seed. Use it for experiments, never in production.", PrivacyWarning,
                          stacklevel=2)
        self._sampler_generator = secure_generator(derive_seed(cfg.seed, self.seed_namespace + "sampler"))
        self._public_generator = secure_generator(derive_seed(cfg.seed, self.seed_namespace + "public"))

    @property
    def sampling_rate(self) -> float:
        """The rate at which an example is sampled in a step it can be sampled in: the mechanism's own where it has
        one (amplified banded samples one partition per step at B b / N), else B / N."""
        return float(getattr(self.mechanism, "sample_rate", self._configured_plan().sampling_rate))

    def _configured_plan(self) -> Plan:
        if self.plan is None:
            raise RuntimeError("the engine is not set up (PrivateEngine.setup)")
        return self.plan

    def batch_sampler(self) -> Sampler:
        """The training batch sampler the mechanism's privacy analysis assumes, continuing at the current step."""
        plan = self._configured_plan()
        return self.mechanism.batch_sampler(plan.num_examples, plan.steps_per_epoch, self._sampler_generator,
                                            start_step=self.steps_done)

    def batches(self) -> Iterator[list[int]]:
        """The index lists of the remaining planned steps, epoch after epoch of :meth:`batch_sampler` (for drivers
        without a data loader of their own, such as ``dpl audit``)."""
        sampler = self.batch_sampler()
        remaining = self._configured_plan().steps - self.steps_done
        while remaining > 0:
            empty = True
            for indices in sampler:
                empty = False
                yield list(indices)
                remaining -= 1
                if remaining == 0:
                    return
            if empty:
                raise ConfigError("the mechanism's batch sampler yields no batch")

    def start(self, device: torch.device | str = "cpu", secure_source: Callable[[], SecureNormal] = SecureNormal) -> None:
        """Create the secret noise source on ``device`` (``secure_source`` makes it under ``privacy.secure_noise``;
        multi-process training passes one that shares rank 0's draws), then apply the secret state of a resume."""
        self._configured_plan()
        device = torch.device(device)
        noise = self.noise_source
        if self.privacy.secure_noise:
            if not isinstance(noise, SecureNormal):
                self.noise_source = secure_source()
        elif not isinstance(noise, StatefulSource) or noise.device != device:
            self.noise_source = noise_source(derive_key(self.privacy.seed, self.seed_namespace + "noise"), device)
        self._apply_secret_state()
        if not self._announced:
            self._announced = True
            self._announce()

    def _announce(self) -> None:
        """Log the plan with the sigma that trains (after a resume: the sigma the checkpoint continues with)."""
        cfg, plan, mechanism = self.privacy, self._configured_plan(), self.mechanism
        resumed = (f"; resumed at step {self.steps_done} (epsilon={self.epsilon():.3f} spent), "
                   f"{'the same noise stream (privacy.seed)' if self._replayed else 'fresh noise'}"
                   if self.steps_done else "")
        log.info("dpl: N=%d, B=%d (q=%.4g), %d steps, sigma=%.4f, C=%g -> (epsilon=%.3f, delta=%.3g) [%s, %s "
                 "adjacency]%s", plan.num_examples, cfg.batch_size, self.sampling_rate, plan.steps,
                 self.noise_multiplier, cfg.max_grad_norm, self.final_epsilon(), plan.delta, mechanism.name,
                 mechanism.adjacency, resumed)

    # --- the step -----------------------------------------------------------------------------------------
    def step(self, batch: dict[str, Any], *, model: nn.Module, trainable: Mapping[str, Tensor],
             per_example_loss: Callable[[dict[str, Any]], Tensor], optimizer: torch.optim.Optimizer | None = None,
             reduce_sum: Callable[[GradientSum], None] | None = None,
             log_metric: Callable[[str, float], None] | None = None) -> Mapping[str, Tensor]:
        """One private step on a logical batch: the four hooks (:func:`~dpl.core.step.private_step`). Returns the
        update direction per trainable parameter (apply it with :func:`~dpl.core.update.apply_direction`), and
        counts the step. ``reduce_sum`` sums the clipped sum over processes (DDP/FSDP) before ``privatize``."""
        if self.noise_source is None:
            raise RuntimeError("the engine is not started (PrivateEngine.start)")
        ctx = self.step_context(model=model, trainable=trainable, per_example_loss=per_example_loss,
                                optimizer=optimizer, log_metric=log_metric)
        direction = private_step(self.plugin_manager.hook, ctx, batch, self.privacy.physical_batch_size,
                                 reduce_sum=reduce_sum, mechanism=self.mechanism.name)
        self.steps_done += 1
        return direction

    def step_context(self, *, model: nn.Module, trainable: Mapping[str, Tensor],
                     per_example_loss: Callable[[dict[str, Any]], Tensor],
                     optimizer: torch.optim.Optimizer | None = None,
                     log_metric: Callable[[str, float], None] | None = None) -> StepContext:
        """The context of the next step's private hooks (draws the step's public seed)."""
        public_seed = int(torch.randint(0, 2 ** 62, (1,), generator=self._public_generator))
        return StepContext(model=model, trainable=trainable, per_example_loss=per_example_loss,
                           max_grad_norm=self.privacy.max_grad_norm, noise_multiplier=self.noise_multiplier,
                           expected_batch_size=self.privacy.batch_size, step=self.steps_done,
                           noise_generator=self.noise_source, log=log_metric or _ignore, public_seed=public_seed,
                           optimizer=optimizer)

    # --- accounting ---------------------------------------------------------------------------------------
    def epsilon(self, steps: int | None = None, delta: float | None = None) -> float:
        """Epsilon spent after ``steps`` steps in total (default: the steps done), earlier parts included, at
        ``delta`` (default: the run's)."""
        steps = self.steps_done if steps is None else steps
        plan = self._configured_plan()
        delta = plan.delta if delta is None else float(delta)
        if self.noise_multiplier == 0 and steps > 0:
            return math.inf
        if not self.history:
            return self.mechanism.epsilon(self.noise_multiplier, delta, steps) if steps > 0 else 0.0
        done_before = sum(s.steps for s in self.history)
        current = Segment(self.noise_multiplier, plan.sampling_rate, max(0, steps - done_before))
        return self.mechanism.epsilon_of_segments([*self.history, current], delta)

    def final_epsilon(self) -> float:
        """Epsilon after the planned steps."""
        return self.epsilon(self._configured_plan().steps)

    def would_exceed_budget(self) -> bool:
        """Whether the next step would spend more than the budget: the accountant's epsilon after the steps done
        and this one (from the mechanism's precomputed schedule: no accountant evaluation on the hot path)."""
        budget = self.privacy.budget
        return budget is not None and self.epsilon(self.steps_done + 1) > budget * (1 + 1e-9)

    def _check_budget(self) -> None:
        """Refuse, in one line, a plan (after a resume: the rest of it, with the sigma that will train) that would
        end above the budget."""
        budget = self.privacy.budget
        if budget is None:  # sigma = 0 spends epsilon = inf: refused below
            return
        plan, planned = self._configured_plan(), self.final_epsilon()
        if planned <= budget * (1 + 1e-9):
            return
        if self.steps_done:
            raise ConfigError(f"resuming would end at epsilon = {planned:.3f} > privacy.max_epsilon = {budget:g} "
                              f"(epsilon = {self.epsilon():.3f} already spent in {self.steps_done} steps, sigma = "
                              f"{self.noise_multiplier:.4f} for the {plan.steps - self.steps_done} steps left)")
        raise ConfigError(f"the plan spends epsilon = {planned:.3f} > privacy.max_epsilon = {budget:g} "
                          f"(sigma = {self.noise_multiplier:.4f}, {plan.steps} steps)")

    def _calibrate_remaining(self, target: float) -> float:
        """Smallest sigma for the remaining steps whose composition with the history stays within ``target``."""
        plan = self._configured_plan()
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

    def summary(self, deltas: tuple[float, ...] = ()) -> dict[str, Any]:
        """The run's privacy as plain values, nothing secret (for the privacy report and logs): epsilon spent at the
        run's delta (and at each of ``deltas``), sigma, C, the batch and sampling, the steps planned and taken,
        the accountant, the adjacency, the mechanism, the plugins with their options, the data size."""
        from dpl import __version__

        cfg, plan, mechanism = self.privacy, self.plan, self.mechanism
        ready = self.configured
        return {
            "epsilon": self.epsilon() if ready else None,
            "epsilon_planned": self.final_epsilon() if ready else None,
            "epsilon_at_delta": {float(d): self.epsilon(delta=d) for d in deltas} if ready else {},
            "delta": plan.delta if ready else None, "noise_multiplier": self.noise_multiplier,
            "max_grad_norm": cfg.max_grad_norm, "batch_size": cfg.batch_size,
            "sampling_rate": self.sampling_rate if ready else None,
            "sampling": getattr(mechanism, "sampling", "poisson" if hasattr(mechanism, "sample_rate") else "shuffle"),
            "steps_per_epoch": plan.steps_per_epoch if ready else 0, "steps_planned": plan.steps if ready else 0,
            "steps_taken": self.steps_done, "resumed_segments": [list(s) for s in self.history],
            "resumed_from": self.resumed_from,
            "resumed_noise": None if self.resumed_from is None else ("replayed" if self._replayed else "fresh"),
            "accountant": getattr(mechanism, "accounting", None) or getattr(mechanism, "accountant", cfg.accountant),
            "adjacency": mechanism.adjacency if ready else None,
            "mechanism": mechanism.name if ready else None,
            "plugins": {name: dict(opts) for name, opts in self.plugin_options.items()},
            "num_examples": plan.num_examples if ready else 0, "target_epsilon": cfg.target_epsilon,
            "max_epsilon": cfg.budget, "secure_noise": cfg.secure_noise, "seeded": cfg.seed is not None,
            "dpl_version": __version__,
        }

    # --- state --------------------------------------------------------------------------------------------
    def _named_stateful(self) -> list[tuple[str, Any]]:
        """The plugins (by name) and the mechanism (``"mechanism"``), whose state goes into checkpoints."""
        items = list(self.plugin_manager.list_name_plugin())
        if self.mechanism is not None:
            items.append(("mechanism", self.mechanism))
        return items

    def state_dict(self) -> dict[str, Any]:
        """Public state: what a checkpoint a user may share holds (no generator state but the public one)."""
        plan = self._configured_plan()
        return {
            "version": STATE_VERSION, "noise_multiplier": self.noise_multiplier, "delta": plan.delta,
            "max_grad_norm": self.privacy.max_grad_norm, "expected_batch_size": plan.expected_batch_size,
            "num_examples": plan.num_examples, "steps_done": self.steps_done, "planned_steps": plan.steps,
            "history": [list(s) for s in self.history], "mechanism_name": self.mechanism.name,
            "target_epsilon": self.privacy.target_epsilon if self.privacy.noise_multiplier is None else None,
            "sampling_rate": plan.sampling_rate, "public_rng": self._public_generator.get_state(),
            "states": {name: obj.state_dict() for name, obj in self._named_stateful()
                       if callable(getattr(obj, "state_dict", None))},
        }

    def secret_state_dict(self) -> dict[str, Any]:
        """Secret state (owner-only sidecar): the noise and sampler generators and every plugin's secrets."""
        noise = self.noise_source
        return {
            "noise_rng": noise.get_state() if isinstance(noise, StatefulSource) else None,
            "sampler_rng": self._sampler_generator.get_state() if self._sampler_generator is not None else None,
            "states": {name: obj.secret_state_dict() for name, obj in self._named_stateful()
                       if callable(getattr(obj, "secret_state_dict", None))},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a checkpoint's public state: refuse (unless ``privacy.force_resume``) a resume whose privacy
        settings differ from the checkpoint's, account the whole history either way, restore the plugins."""
        version = state.get("version")
        if version not in (2, 3, STATE_VERSION):
            raise ConfigError("this checkpoint was written by an older dpl whose checkpoints carried secrets; "
                              "it cannot be resumed safely")
        plan = self._configured_plan()
        done = int(state["steps_done"])
        if done >= plan.steps:
            raise ConfigError(f"nothing left to train: the checkpoint took {done} steps and this run plans {plan.steps} "
                              "in all (trainer.max_steps / trainer.max_epochs count from the start of the run: raise "
                              "them to train on)")
        self._check_resume_plan(state, version)
        self.steps_done = done
        self._check_budget()
        if state.get("public_rng") is not None:
            self._public_generator.set_state(state["public_rng"])
        named = dict(self._named_stateful())
        for name, sub in state["states"].items():
            if name in named and callable(getattr(named[name], "load_state_dict", None)):
                named[name].load_state_dict(sub)

    def load_secret_state_dict(self, secret: dict[str, Any] | None, *, replay: bool | None = None) -> None:
        """Restore the secret state of a checkpoint (its sidecar), or ``None``: the sidecar is missing. Applied at
        :meth:`start`, or at once if the engine has started.

        The plugins' secrets (ftrl's buffers, its secret order) are always restored. The noise and sampler
        generators continue the checkpoint's streams only with ``replay`` (default: with ``privacy.seed``, the
        reproducible-experiment case; DDP ranks adopting rank 0's state pass ``True``); otherwise they stay fresh
        from OS entropy, so that two continuations of one checkpoint never draw the same noise (whose difference
        would reveal the clipped sums)."""
        self._secret_to_apply = secret
        self._fresh_secret_on_start = secret is None
        self._replay_secret = self.privacy.seed is not None if replay is None else replay
        if self.noise_source is not None:
            self._apply_secret_state()

    def public_rng_state(self) -> Tensor:
        return self._public_generator.get_state()

    def load_public_rng_state(self, state: Tensor) -> None:
        self._public_generator.set_state(state)

    def generator_states(self) -> list[Tensor]:
        """The states of the generators (noise, sampler, public) that every process must share (for checks)."""
        return [g.get_state() for g in (self.noise_source, self._sampler_generator, self._public_generator)
                if isinstance(g, StatefulSource)]

    def _check_resume_plan(self, state: dict[str, Any], version: int) -> None:
        cfg, plan = self.privacy, self._configured_plan()
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

    def _apply_secret_state(self) -> None:
        """Restore generators and plugin secrets from a sidecar, or start fresh from OS entropy without one."""
        secret, fresh = self._secret_to_apply, self._fresh_secret_on_start
        if secret is None and not fresh:
            return
        self._secret_to_apply, self._fresh_secret_on_start = None, False
        named = dict(self._named_stateful())
        if secret is None:
            log.info("dpl: resumed without the checkpoint's .secret sidecar: noise and sampling continue from fresh "
                     "OS entropy (as private; not bit-exact)")
            if self.privacy.seed is not None:
                warnings.warn("privacy.seed is set but the checkpoint's .secret sidecar is missing: the resumed run "
                              "is not bit-exact", PrivacyWarning, stacklevel=2)
            for obj in named.values():
                if callable(getattr(obj, "load_secret_state_dict", None)):
                    obj.load_secret_state_dict(None)
            return
        if self._replay_secret:
            self._replayed = True
            if secret["noise_rng"] is not None and isinstance(self.noise_source, StatefulSource):
                try:
                    self.noise_source.set_state(secret["noise_rng"])
                except (ValueError, RuntimeError) as exc:
                    raise ConfigError("the checkpoint's .secret sidecar holds a noise state this dpl cannot continue "
                                      "(written by an older dpl, whose noise came from torch's float32 sampler with "
                                      "tails cut at 5.77 sigma, or on another device): move the sidecar away to "
                                      "resume with fresh noise, or start a new run") from exc
            if secret["sampler_rng"] is not None and self._sampler_generator is not None:
                self._sampler_generator.set_state(secret["sampler_rng"])
        for name, sub in secret["states"].items():
            if name in named and callable(getattr(named[name], "load_secret_state_dict", None)):
                named[name].load_secret_state_dict(sub)


def _ignore(name: str, value: float) -> None:
    """A ``log`` that drops the metric."""
