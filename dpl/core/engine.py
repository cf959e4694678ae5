"""The private-training engine: one object that runs differentially private training, free of Lightning.

:class:`PrivateEngine` owns everything private about a run: the plugins (their manager), the mechanism (how batches
are drawn, how privacy is accounted), its :class:`~dpl.core.ledger.PrivacyLedger` (the plan, sigma, what was spent,
the budget, the resume check), the privacy unit (rows, or users: :mod:`dpl.core.units`), the secret generators
(noise, sampler) and the public one (per-step seeds), the four hook calls of each step, and the split of its state
into a public part (a checkpoint a user may share) and a secret part (the owner-only sidecar).

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
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pluggy
import torch
from torch import Tensor, nn
from torch.utils.data import Sampler

from dpl.core.gradients import GradientSum
from dpl.core.ledger import Plan, PrivacyLedger, make_plan, steps_per_epoch
from dpl.core.micro_batch import MicroBatch, probe_micro_batch
from dpl.core.mechanism import Mechanism, apply_adjacency
from dpl.core.noise import NoiseSource, SecureNormal, StatefulSource, noise_source, rekey_
from dpl.core.per_example import model_is_per_example
from dpl.core.plugin_manager import (active_plugin_names, check_contracts, create_plugin_manager, options_as_dict,
                                     replaced_hooks)
from dpl.core.privacy import PrivacyConfig, warn_if_seeded
from dpl.core.regime import NoiseRegime
from dpl.core.sampling import derive_key, derive_seed, secure_generator
from dpl.core.step import RunSetup, StepContext, private_step
from dpl.core.privacy_unit import PrivacyUnit
from dpl.core.units import Users
from dpl.errors import ConfigError, PrivacyWarning

log = logging.getLogger("dpl")


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
        self.mechanism: Mechanism | None = None
        self.ledger: PrivacyLedger | None = None
        self.unit = PrivacyUnit()  # the privacy unit (built at setup)
        self._bounded_rows: list[int] | None = None  # ELS: each user bounded to k rows (secret choice)
        self.noise_source: NoiseSource | None = None
        self._sampler_generator: torch.Generator | None = None
        self._public_generator: torch.Generator | None = None
        self._secret_to_apply: dict[str, Any] | None = None
        self._fresh_secret_on_start = False
        self._replay_secret = False  # restore the noise and sampler generators exactly (privacy.seed, DDP ranks)
        self._replayed = False  # the generators continue a checkpoint's streams
        self._announced = False
        self.resumed_from: str | None = None  # the checkpoint this run continues (set by the driver)
        self.task_kind: str | None = None  # the driver's kind of task (regime.CLASSIFICATION ...): the regime warning's
        self.release_dimension: int | None = None  # coordinates the noise goes on (None: a plugin's own estimate)
        self.micro_batch: MicroBatch | None = None  # what physical_batch_size: auto chose (fit_micro_batch)

    # --- setup --------------------------------------------------------------------------------------------
    @property
    def configured(self) -> bool:
        return self.mechanism is not None

    def setup(self, model: nn.Module, *, num_rows: int, steps: int | Callable[[int], int],
              trainable: Mapping[str, Tensor] | None = None, sampling_rate: float | None = None,
              optimizer_factory: Any = None, world_size: int = 1, sharded: bool = False,
              users: Users | Sequence[Any] | None = None) -> None:
        """Validate the run with every plugin, build the privacy unit (:meth:`PrivacyUnit.of
        <dpl.core.privacy_unit.PrivacyUnit.of>`: the one place it is built), configure the mechanism and calibrate
        sigma for ``steps`` steps (or ``steps(steps_per_epoch)``, the steps a trainer runs with that many batches per
        epoch) over ``num_rows`` training rows (``sampling_rate``: default ``batch_size / population``). ``users``
        (the rows of each user, or the user key of every row) is required with ``privacy.unit: user``, where the
        population the mechanism samples is the users (user-level sampling) or the rows left after bounding each user
        to k (example-level sampling). Once per engine."""
        if self.configured:
            raise RuntimeError("PrivateEngine.setup runs once; build a new engine for another run")
        cfg = self.privacy
        trainable = dict(trainable) if trainable is not None else {
            n: p for n, p in model.named_parameters() if p.requires_grad}
        if not trainable:
            raise ConfigError("the model has no trainable parameter")
        model_is_per_example(model)
        self._sampler_generator = secure_generator(derive_seed(cfg.seed, self.seed_namespace + "sampler"))
        self._public_generator = secure_generator(derive_seed(cfg.seed, self.seed_namespace + "public"))
        unit = PrivacyUnit.of(cfg, num_rows, users)
        if unit.samples_users and sharded:
            raise ConfigError("privacy.unit: user with user_sampling: users is not supported under FSDP yet (its "
                              "filler rows would split users); use strategy ddp or one process")
        if cfg.physical_batch_size == "auto" and world_size > 1:
            raise ConfigError("privacy.physical_batch_size auto runs in one process (each rank would probe its own "
                              "device): set a number under several processes")
        self.unit, self._bounded_rows = unit, unit.bound(self._sampler_generator)
        if unit.users is not None:
            log.info("dpl: privacy unit: user (%s): %s", unit.data_text(), unit.users.describe())
        steps = steps(steps_per_epoch(unit.population, cfg.batch_size)) if callable(steps) else steps
        plan = make_plan(cfg, population=unit.population, steps=steps, num_rows=num_rows, num_units=unit.num_units,
                         sampling_rate=sampling_rate, population_name=unit.population_name)
        replaced = replaced_hooks(self.plugin_manager)
        if "privatize" in replaced and "configure_mechanism" not in replaced:
            raise ConfigError("a plugin replaces privatize without configure_mechanism: the default accounting "
                              "would not match its noise")
        check_contracts(self.plugin_manager, sharded=sharded, user_units=unit.samples_users)
        hook = self.plugin_manager.hook
        setup = RunSetup(model=model, trainable=trainable, plugin_names=active_plugin_names(self.plugin_manager),
                         population=unit.population, expected_batch_size=cfg.batch_size, steps=steps,
                         sampling_rate=plan.sampling_rate, accountant=cfg.accountant,
                         optimizer_name=getattr(optimizer_factory, "__name__", type(optimizer_factory).__name__),
                         replaced_hooks=replaced, seed=cfg.seed, world_size=world_size,
                         optimizer_factory=optimizer_factory, secure_noise=cfg.secure_noise, sharded=sharded,
                         unit=unit, clipping_memory=cfg.clipping_memory,
                         clipping_memory_budget=cfg.clipping_memory_budget, privacy=cfg)
        hook.validate_setup(setup=setup)
        mechanism = hook.configure_mechanism(setup=setup)
        if mechanism is None:
            raise ConfigError("no plugin configured a privacy mechanism")
        if mechanism.unit != cfg.unit:
            raise ConfigError(f"mechanism {mechanism.name} accounts per {mechanism.unit}, privacy.unit is {cfg.unit}: "
                              "its plugin does not support this privacy unit")
        apply_adjacency(mechanism, cfg.adjacency)  # before calibration: the adjacency sets the sensitivity
        self.mechanism = mechanism
        # the default estimate releases one value per trainable coordinate; a replaced one releases its own
        self.release_dimension = None if "estimate_gradient" in replaced else sum(t.numel() for t in trainable.values())
        self.ledger = PrivacyLedger(cfg, plan, mechanism)
        warn_if_seeded(cfg)

    def noise_regime(self) -> NoiseRegime | None:
        """One step's noise against its clipped signal (:mod:`dpl.core.regime`) with the sigma that trains; the
        noise multiplier of a step is sigma times the mechanism's ``noise_scale`` (:meth:`NoiseRegime.of`).
        ``None`` where a plugin replaces ``estimate_gradient`` (its release need not have one coordinate per
        trainable parameter)."""
        ledger = self._configured_ledger()
        if self.release_dimension is None:
            return None
        return NoiseRegime.of(ledger.noise_multiplier, self.mechanism, self.privacy, self.release_dimension)

    # --- what the ledger holds ----------------------------------------------------------------------------
    @property
    def plan(self) -> Plan | None:
        return self.ledger.plan if self.ledger is not None else None

    @property
    def noise_multiplier(self) -> float | None:
        return self.ledger.noise_multiplier if self.ledger is not None else None

    @property
    def steps_done(self) -> int:
        return self.ledger.steps_done if self.ledger is not None else 0

    @property
    def sampling_rate(self) -> float:
        """The rate at which a unit is sampled in a step it can be sampled in (the mechanism's, declared: amplified
        banded samples one partition per step at B b / N)."""
        return float(self.mechanism.sample_rate)

    def _configured_plan(self) -> Plan:
        return self._configured_ledger().plan

    def batch_sampler(self) -> Sampler:
        """The training batch sampler the mechanism's privacy analysis assumes, continuing at the current step."""
        plan = self._configured_plan()
        sampler = self.mechanism.batch_sampler(plan.population, plan.steps_per_epoch, self._sampler_generator,
                                               start_step=self.steps_done)
        return self.unit.sampler(sampler, self._sampler_generator, self._bounded_rows)

    def unit_of_row(self) -> list[int] | None:
        """Under user-level sampling, the user of every training row (the batches' ``dpl_units``); else None."""
        return self.unit.unit_of_row()

    def tag(self, batch: dict[str, Any], rows: list[int]) -> dict[str, Any]:
        """``batch``, collated from the training ``rows``, tagged with each row's privacy unit where the step needs it
        (:meth:`~dpl.core.privacy_unit.PrivacyUnit.tag`)."""
        return self.unit.tag(batch, rows)

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
                 "adjacency]%s", plan.population, cfg.batch_size, self.sampling_rate, plan.steps,
                 self.noise_multiplier, cfg.max_grad_norm, self.final_epsilon(), plan.delta, mechanism.name,
                 mechanism.adjacency, resumed)
        if (regime := self.noise_regime()) is not None and regime.hopeless:
            log.warning(regime.warning(self.task_kind))

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
        direction = private_step(self.plugin_manager.hook, ctx, batch, self.physical_batch_size,
                                 reduce_sum=reduce_sum, mechanism=self.mechanism.name)
        self.ledger.steps_done += 1
        return direction

    @property
    def physical_batch_size(self) -> int:
        """The examples per forward/backward pass: ``privacy.physical_batch_size``, or under ``auto`` what
        :meth:`fit_micro_batch` chose."""
        size = self.privacy.physical_batch_size
        if size != "auto":
            return int(size)
        if self.micro_batch is None:
            raise RuntimeError("privacy.physical_batch_size is auto: call PrivateEngine.fit_micro_batch before the "
                               "first step")
        return self.micro_batch.size

    def fit_micro_batch(self, *, model: nn.Module, trainable: Mapping[str, Tensor],
                        per_example_loss: Callable[[dict[str, Any]], Tensor],
                        probe_batch: Callable[[int], dict[str, Any]], tokens: int | None = None,
                        context: Callable[[], Any] | None = None) -> MicroBatch:
        """Choose the micro-batch of ``physical_batch_size: auto`` (:mod:`dpl.core.micro_batch`) by running
        ``estimate_gradient`` on ``probe_batch(b)``, a public batch of b examples at the longest configured length
        (``tokens``), never training data; ``context`` (e.g. the trainer's autocast) wraps each probe as it wraps
        the step. No ledger step, no noise, no generator of the run is drawn from; torch's global generators are
        restored after. Logs the choice (public figures only) and returns it."""
        cfg = self.privacy
        if cfg.physical_batch_size != "auto":
            raise RuntimeError("fit_micro_batch is for privacy.physical_batch_size: auto")
        self._configured_plan()
        # no noise source: nothing secret is drawn (an estimator that would draw noise fails here, not silently)
        ctx = StepContext(model=model, trainable=dict(trainable), per_example_loss=per_example_loss,
                          max_grad_norm=cfg.max_grad_norm, noise_multiplier=self.noise_multiplier,
                          expected_batch_size=cfg.batch_size, step=self.steps_done, noise_source=None,
                          log=_ignore, public_seed=0, optimizer=None)
        choice = probe_micro_batch(self.plugin_manager, ctx, probe_batch,
                                   upper=cfg.batch_size * (self.unit.max_rows or 1), per_unit=self.unit.samples_users,
                                   memory_mib=cfg.physical_batch_memory, tokens=tokens, context=context)
        self.micro_batch = choice
        log.info("dpl: %s", choice.describe())
        return choice

    def step_context(self, *, model: nn.Module, trainable: Mapping[str, Tensor],
                     per_example_loss: Callable[[dict[str, Any]], Tensor],
                     optimizer: torch.optim.Optimizer | None = None,
                     log_metric: Callable[[str, float], None] | None = None) -> StepContext:
        """The context of the next step's private hooks (draws the step's public seed)."""
        public_seed = int(torch.randint(0, 2 ** 62, (1,), generator=self._public_generator))
        return StepContext(model=model, trainable=trainable, per_example_loss=per_example_loss,
                           max_grad_norm=self.privacy.max_grad_norm, noise_multiplier=self.noise_multiplier,
                           expected_batch_size=self.privacy.batch_size, step=self.steps_done,
                           noise_source=self.noise_source, log=log_metric or _ignore, public_seed=public_seed,
                           optimizer=optimizer)

    # --- accounting (the ledger) ----------------------------------------------------------------------------
    def epsilon(self, steps: int | None = None, delta: float | None = None) -> float:
        """Epsilon spent after ``steps`` steps in total (default: the steps done), earlier parts included, at
        ``delta`` (default: the run's)."""
        return self._configured_ledger().epsilon(steps, delta)

    def final_epsilon(self) -> float:
        """Epsilon after the planned steps."""
        return self._configured_ledger().final_epsilon()

    def would_exceed_max_epsilon(self) -> bool:
        """Whether the next step would spend more than ``privacy.max_epsilon`` (asked before every step)."""
        return self._configured_ledger().would_exceed_max_epsilon()

    def _configured_ledger(self) -> PrivacyLedger:
        if self.ledger is None:
            raise RuntimeError("the engine is not set up (PrivateEngine.setup)")
        return self.ledger

    def summary(self, deltas: tuple[float, ...] = ()) -> dict[str, Any]:
        """The run's privacy as plain values, nothing secret (for the privacy report and logs): the ledger's
        accounting (epsilon spent at the run's delta and at each of ``deltas``, sigma, C, the plan, the unit, the
        mechanism's sampling and accounting), the users, the plugins with their options, the resume."""
        from dpl.version import __version__

        cfg = self.privacy
        accounting = self.ledger.summary(deltas) if self.ledger is not None else {
            "epsilon": None, "epsilon_planned": None, "epsilon_at_delta": {}, "delta": None,
            "noise_multiplier": None, "max_grad_norm": cfg.max_grad_norm, "batch_size": cfg.batch_size,
            "sampling_rate": None, "sampling": None, "steps_per_epoch": 0, "steps_planned": 0, "steps_taken": 0,
            "resumed_parts": 0, "events": [], "scope": None, "accountant": cfg.accountant, "adjacency": None, "mechanism": None,
            "unit": cfg.unit, "num_examples": 0, "num_units": 0, "target_epsilon": cfg.target_epsilon,
            "max_epsilon": cfg.effective_max_epsilon}
        unit = self.unit
        accounting["unit_text"] = unit.wording(accounting["adjacency"], accounting["sampling_rate"], cfg.batch_size)
        # the count and k only: rows per user describe single users (the largest), so they stay in the log
        users = None if unit.users is None else {"users": unit.num_units, "max_rows_per_user": unit.max_rows,
                                                 "sampling": unit.setup_fields()["user_sampling"]}
        return {
            **accounting, "users": users,
            "plugins": {name: dict(opts) for name, opts in self.plugin_options.items()},
            "resumed_from": self.resumed_from,
            "resumed_noise": None if self.resumed_from is None else ("replayed" if self._replayed else "fresh"),
            "secure_noise": cfg.secure_noise, "seeded": cfg.seed is not None, "dpl_version": __version__,
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
        return {
            **self._configured_ledger().state_dict(), "public_rng": self._public_generator.get_state(),
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
        """Resume from a checkpoint's public state: the ledger checks the plan and the budget (refusing changed
        privacy settings unless ``privacy.force_resume``), then the plugins' states are restored."""
        named = dict(self._named_stateful())
        if "mechanism" in state["states"]:  # first: the mechanism settles what its events are (ftrl's strategy)
            named["mechanism"].load_state_dict(state["states"]["mechanism"])
        self._configured_ledger().load_state_dict(state)
        if state.get("public_rng") is not None:
            self._public_generator.set_state(state["public_rng"])
        for name, sub in state["states"].items():
            if name != "mechanism" and name in named and callable(getattr(named[name], "load_state_dict", None)):
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

    def _apply_secret_state(self) -> None:
        """Restore generators and plugin secrets from a sidecar, or start fresh from OS entropy without one."""
        secret, fresh = self._secret_to_apply, self._fresh_secret_on_start
        if secret is None and not fresh:
            return
        self._secret_to_apply, self._fresh_secret_on_start = None, False
        named = dict(self._named_stateful())
        if secret is None:
            log.info("dpl: resumed without the .secret sidecar: noise and sampling continue from fresh OS entropy")
            if self.privacy.seed is not None:  # the seeded generators would draw the first steps' noise again
                rekey_(self.noise_source)
                self._sampler_generator.set_state(secure_generator().get_state())
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
