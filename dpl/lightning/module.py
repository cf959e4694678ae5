"""``DPModule``: the one private training loop, shared by every task.

Subclasses say how to build the model (:meth:`build_model`), how to compute per-example losses
(:meth:`per_example_loss`) and how to evaluate (``validation_step``). Everything private - sampling,
clipping, noise, accounting, the plugin hooks - lives here and in the plugins, with manual optimization
(one optimizer step per logical batch).
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor, nn
from torch.utils.data import Sampler

from dpl.lightning import checkpoint as ckpt_io
from dpl.lightning import distributed
from dpl.errors import ConfigError, PrivacyWarning
from dpl.lightning.fsdp import full_parameters
from dpl.core.mechanism import Mechanism
from dpl.core.noise import NoiseSource, SecureNormal
from dpl.core.plugin_manager import (active_plugin_names, create_plugin_manager, normalize_plugin_config,
                                     replaced_hooks)
from dpl.core.privacy import PrivacyConfig
from dpl.core.sampling import derive_seed, secure_generator
from dpl.core.step import RunSetup, StepContext, private_step
from dpl.core.update import apply_direction

log = logging.getLogger("dpl")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices natively (AVX512-BF16, AMX, Arm BF16), per oneDNN."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class DPModule(L.LightningModule):
    """Base LightningModule for differentially private training.

    Args:
        privacy: the privacy settings (:class:`~dpl.core.privacy.PrivacyConfig`).
        plugins: plugins to activate, ``{name: {options}}`` in the order their ``post_process`` runs.
        optimizer: torch optimizer (class or callable taking the trainable parameters).
        lr_scheduler: optional scheduler, stepped once per logical batch.
    """

    task = "base"

    def __init__(self, privacy: PrivacyConfig | None = None, plugins: dict[str, dict[str, Any] | None] | None = None,
                 optimizer: OptimizerCallable = torch.optim.AdamW,
                 lr_scheduler: LRSchedulerCallable | None = None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.privacy = privacy if privacy is not None else PrivacyConfig()
        self.privacy.validate()
        self.plugin_config = plugins or {}
        self.optimizer_factory = optimizer
        self.scheduler_factory = lr_scheduler
        self.model: nn.Module | None = None
        self.datamodule_ref: L.LightningDataModule | None = None
        self.plugin_manager = create_plugin_manager(self.plugin_config)  # fails early on unknown plugins
        self.mechanism: Mechanism | None = None
        self.noise_multiplier: float | None = None
        self.delta: float | None = None
        self.planned_steps = 0
        self.steps_per_epoch = 0
        self.steps_done = 0
        self.num_train_examples = 0
        self.history: list[tuple[float, int]] = []  # (sigma, steps) of earlier runs this one resumes
        self.stopped_by_budget = False
        self._noise_generator: NoiseSource | None = None
        self._sampler_generator: torch.Generator | None = None
        self._public_generator: torch.Generator | None = None
        self._pending_secret: dict[str, Any] | None = None
        self._resumed_without_secret = False

    # --- what a task provides -------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        """Return the network (with frozen and trainable parameters set)."""
        raise NotImplementedError

    def per_example_loss(self, batch: dict[str, Any]) -> Tensor:
        """Forward pass over ``batch``; return one loss per example (shape ``(b,)``)."""
        raise NotImplementedError

    # --- setup ----------------------------------------------------------------------------------------
    def ensure_model(self, datamodule: L.LightningDataModule | None = None) -> nn.Module:
        """Build the model once (``datamodule`` may provide what it needs, e.g. the number of labels)."""
        if datamodule is not None:
            self.datamodule_ref = datamodule
        if self.model is None:
            self.model = self.build_model()
        return self.model

    @property
    def datamodule(self) -> L.LightningDataModule | None:
        if self.datamodule_ref is not None:
            return self.datamodule_ref
        return getattr(self._trainer, "datamodule", None) if self._trainer is not None else None

    @property
    def trainable(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.ensure_model().named_parameters() if p.requires_grad}

    def setup(self, stage: str) -> None:
        self.ensure_model(self.trainer.datamodule)
        distributed.keep_dpl_batch_sampler(self.trainer)  # DDP: dpl shards its own batches
        if stage == "fit":
            install_sidecar_io(self.trainer)
            self.prepare_privacy(self.trainer.datamodule.num_train_examples, self.trainer)

    def configure_model(self) -> None:
        """Build the model; under dpl's FSDP strategy (:class:`~dpl.lightning.fsdp.DPFSDPStrategy`) also shard it."""
        self.ensure_model(self.trainer.datamodule)
        shard = getattr(self.trainer.strategy, "shard_module", None)
        if shard is not None:
            shard(self.model)

    @staticmethod
    def planned_total_steps(trainer: L.Trainer, steps_per_epoch: int) -> int:
        """The number of steps the trainer will really run: the smallest of ``max_steps`` and ``max_epochs``
        times the batches per epoch (``limit_train_batches`` applied); a warning when the settings disagree."""
        per_epoch = steps_per_epoch
        limit = trainer.limit_train_batches
        if isinstance(limit, int) and not isinstance(limit, bool):
            per_epoch = min(per_epoch, limit)
        elif limit is not None and limit != 1.0:
            per_epoch = int(per_epoch * float(limit))
        candidates = {}
        if trainer.max_steps is not None and trainer.max_steps > 0:
            candidates["trainer.max_steps"] = int(trainer.max_steps)
        if trainer.max_epochs is not None and trainer.max_epochs >= 0:
            candidates[f"trainer.max_epochs ({trainer.max_epochs} x {per_epoch} steps)"] = int(trainer.max_epochs) * per_epoch
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

    def _check_model_is_per_example(self) -> None:
        """Refuse layers whose output for one example depends on the other examples of the batch."""
        for name, module in self.model.named_modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                raise ConfigError(f"layer {name or type(module).__name__} ({type(module).__name__}) normalizes over "
                                  "the batch, so one example changes the others' gradients and clipping no longer "
                                  "bounds its influence; use LayerNorm/GroupNorm (or replace it before training)")
            if getattr(module, "expert_capacity", None) is not None or "Top1Router" in type(module).__name__:
                raise ConfigError(f"layer {name} ({type(module).__name__}) routes tokens with a capacity shared by "
                                  "the batch (token dropping): one example changes the others' outputs")

    def _check_precision(self, trainer: L.Trainer) -> None:
        precision = str(getattr(trainer, "precision", "32"))
        if precision.startswith("16"):
            raise ConfigError(f"trainer.precision={precision} is not supported: float16 needs loss scaling, which "
                              "per-example clipping does not do; use bf16-mixed (or 32)")
        device = getattr(getattr(trainer, "strategy", None), "root_device", None)
        if precision.startswith("bf16") and getattr(device, "type", None) == "cpu" and not cpu_has_native_bf16():
            log.info("dpl: this CPU has no native bfloat16 arithmetic: trainer.precision=%s is emulated and slower "
                     "than float32 here (--trainer.precision 32-true)", precision)

    def prepare_privacy(self, num_examples: int, trainer: L.Trainer | None = None) -> None:
        """Validate the setup with every plugin, pick the mechanism and calibrate sigma (idempotent)."""
        if self.mechanism is not None and self.num_train_examples == num_examples:
            return
        cfg = self.privacy
        if cfg.batch_size > num_examples:
            raise ConfigError(f"privacy.batch_size ({cfg.batch_size}) is larger than the training set "
                              f"({num_examples} examples)")
        trainer = trainer if trainer is not None else self.trainer
        distributed.check_strategy(trainer)
        self._check_precision(trainer)
        self.num_train_examples = num_examples
        self.steps_per_epoch = max(1, num_examples // cfg.batch_size)
        self.planned_steps = self.planned_total_steps(trainer, self.steps_per_epoch)
        self.delta = cfg.delta_for(num_examples)
        if self.delta * num_examples > 0.1:
            warnings.warn(f"delta = {self.delta:.3g} gives N * delta = {self.delta * num_examples:.2f} for N = "
                          f"{num_examples}: the guarantee may fail outright with probability delta, and N * delta "
                          "should be small (default: delta = 0.1 / N)", PrivacyWarning, stacklevel=2)
        trainable = self.trainable
        if not trainable:
            raise ConfigError("the model has no trainable parameter")
        self._check_model_is_per_example()
        hook = self.plugin_manager.hook
        replaced = replaced_hooks(self.plugin_manager)
        if "privatize" in replaced and "configure_mechanism" not in replaced:
            raise ConfigError("a plugin replaces privatize without configure_mechanism: the default accounting "
                              "would not match its noise")
        setup = RunSetup(model=self.model, trainable=trainable, plugin_names=active_plugin_names(self.plugin_manager),
                         num_examples=num_examples, expected_batch_size=cfg.batch_size, steps=self.planned_steps,
                         sampling_rate=cfg.batch_size / num_examples, accountant=cfg.accountant,
                         optimizer_name=getattr(self.optimizer_factory, "__name__", type(self.optimizer_factory).__name__),
                         task=self.task, replaced_hooks=replaced, seed=cfg.seed, world_size=trainer.world_size,
                         optimizer_factory=self.optimizer_factory, secure_noise=cfg.secure_noise,
                         sharded=distributed.shards_parameters(trainer))
        hook.validate_setup(setup=setup)
        self.mechanism = hook.configure_mechanism(setup=setup)
        if self.mechanism is None:
            raise ConfigError("no plugin configured a privacy mechanism")
        if cfg.noise_multiplier is not None:
            self.noise_multiplier = float(cfg.noise_multiplier)
        else:
            self.noise_multiplier = self.mechanism.calibrate(cfg.target_epsilon, self.delta, self.planned_steps)
        budget = cfg.budget
        if budget is not None:  # sigma = 0 spends epsilon = inf: refused
            planned = self.final_epsilon()
            if planned > budget * (1 + 1e-9):
                raise ConfigError(f"the plan spends epsilon = {planned:.3f} > privacy.max_epsilon = {budget:g} "
                                  f"(sigma = {self.noise_multiplier:.4f}, {self.planned_steps} steps)")
        if cfg.seed is not None:
            warnings.warn("privacy.seed is set: noise and batches are reproducible, and so predictable by anyone "
                          "who knows the seed. Use it for experiments, never in production.", PrivacyWarning,
                          stacklevel=2)
        self._sampler_generator = secure_generator(derive_seed(cfg.seed, "sampler"))
        self._public_generator = secure_generator(derive_seed(cfg.seed, "public"))
        eps = self.final_epsilon()
        log.info("dpl: N=%d, B=%d (q=%.4g), %d steps, sigma=%.4f, C=%g -> (epsilon=%.3f, delta=%.3g) [%s]",
                 num_examples, cfg.batch_size, cfg.batch_size / num_examples, self.planned_steps,
                 self.noise_multiplier, cfg.max_grad_norm, eps, self.delta, self.mechanism.name)

    def final_epsilon(self) -> float:
        return self.epsilon_after(self.planned_steps)

    def epsilon_after(self, steps: int) -> float:
        """Epsilon spent after ``steps`` steps in total (earlier runs this one resumed included)."""
        if self.noise_multiplier == 0 and steps > 0:
            return math.inf
        if not self.history:
            return self.mechanism.epsilon(self.noise_multiplier, self.delta, steps) if steps > 0 else 0.0
        done_before = sum(h[1] for h in self.history)
        rate = self.privacy.batch_size / self.num_train_examples
        segments = [*self.history, (self.noise_multiplier, max(0, steps - done_before), rate)]
        return self.mechanism.epsilon_of_segments(segments, self.delta)

    def privacy_summary(self, deltas: tuple[float, ...] = ()) -> dict[str, Any]:
        """The run's privacy, as plain values (for :mod:`dpl.lightning.report`; nothing secret): epsilon spent at
        the run's delta (and at each of ``deltas``: ``epsilon_at_delta``), sigma, C, the batch and sampling, the
        steps planned and taken, the accountant, adjacency, mechanism, plugins with options and the data size."""
        from dpl import __version__

        mechanism, cfg, n = self.mechanism, self.privacy, self.num_train_examples
        ready = mechanism is not None
        at_delta = {}
        for other in deltas if ready else ():
            saved, self.delta = self.delta, float(other)
            try:
                at_delta[float(other)] = self.epsilon_after(self.steps_done)
            finally:
                self.delta = saved
        return {
            "epsilon": self.epsilon_after(self.steps_done) if ready else None,
            "epsilon_planned": self.final_epsilon() if ready else None,
            "epsilon_at_delta": at_delta,
            "delta": self.delta, "noise_multiplier": self.noise_multiplier, "max_grad_norm": cfg.max_grad_norm,
            "batch_size": cfg.batch_size, "sampling_rate": cfg.batch_size / n if n else None,
            "sampling": getattr(mechanism, "sampling", "poisson" if hasattr(mechanism, "sample_rate") else "shuffle"),
            "steps_per_epoch": self.steps_per_epoch, "steps_planned": self.planned_steps,
            "steps_taken": self.steps_done, "resumed_segments": [list(h) for h in self.history],
            "accountant": getattr(mechanism, "accountant", "exact Gaussian mechanism"),
            "adjacency": getattr(mechanism, "adjacency", "add/remove"),
            "mechanism": mechanism.name if ready else None,
            "plugins": {name: normalize_plugin_config(self.plugin_config).get(name, {})
                        for name in active_plugin_names(self.plugin_manager)},
            "num_examples": n, "target_epsilon": cfg.target_epsilon, "max_epsilon": cfg.budget,
            "secure_noise": cfg.secure_noise, "seeded": cfg.seed is not None, "dpl_version": __version__,
        }

    def make_batch_sampler(self, num_examples: int) -> Sampler:
        """The training batch sampler (called by :class:`~dpl.tasks.data.DPDataModule`)."""
        self.prepare_privacy(num_examples)
        return distributed.shard_batch_sampler(  # DDP: this rank's share of the global batch (FSDP: padded)
            self.mechanism.batch_sampler(num_examples, self.steps_per_epoch, self._sampler_generator,
                                         start_step=self.steps_done),
            num_examples, pad=distributed.shards_parameters(self.trainer))

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(list(self.trainable.values()))
        if self.scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": self.scheduler_factory(optimizer)}

    def _new_noise_source(self, device: torch.device) -> NoiseSource:
        if self.privacy.secure_noise:
            return SecureNormal()
        return secure_generator(derive_seed(self.privacy.seed, "noise") if self.privacy.seed is not None else None,
                                device=device)

    def on_fit_start(self) -> None:
        device = next(self.model.parameters()).device
        if self._noise_generator is None or (isinstance(self._noise_generator, torch.Generator)
                                             and self._noise_generator.device != device):
            self._noise_generator = self._new_noise_source(device)
        self._apply_secret_state()
        distributed.sync_run_state(self)  # DDP: every rank takes rank 0's generators and plugin secrets

    # --- the private step -----------------------------------------------------------------------------
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        if self._would_exceed_budget():
            self._stop_for_budget(self.privacy.budget)
            return
        wrapped = self.optimizers()  # LightningOptimizer: stepping it advances trainer.global_step
        optimizer = getattr(wrapped, "optimizer", wrapped)
        trainable = self.trainable
        public_seed = int(torch.randint(0, 2 ** 62, (1,), generator=self._public_generator))
        ctx = StepContext(model=self.model, trainable=full_parameters(trainable), per_example_loss=self.per_example_loss,
                          max_grad_norm=self.privacy.max_grad_norm, noise_multiplier=self.noise_multiplier,
                          expected_batch_size=self.privacy.batch_size, step=self.steps_done,
                          noise_generator=self._noise_generator, log=self._log_metric, public_seed=public_seed,
                          optimizer=optimizer)
        direction = private_step(self.plugin_manager.hook, ctx, batch, self.privacy.physical_batch_size,
                                 reduce_sum=distributed.gradient_reducer(), mechanism=self.mechanism.name)
        del batch, ctx
        apply_direction(wrapped, trainable, direction)
        del direction
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        self.steps_done += 1
        distributed.after_step(self)  # DDP: check the replicas still agree (first, every 100th, last step)
        every = self.privacy.log_epsilon_every_n_steps
        if self.steps_done % every == 0 or self.steps_done == self.planned_steps or self.steps_done == 1:
            self.log("epsilon", self.epsilon_after(self.steps_done), prog_bar=True, on_step=True, on_epoch=False)

    def _would_exceed_budget(self) -> bool:
        """Whether the next step would spend more than the budget. Within a plan that setup checked against the
        budget (no resumed history), epsilon is monotone in the steps, so no accountant evaluation is needed."""
        budget = self.privacy.budget
        if budget is None or (not self.history and self.steps_done + 1 <= self.planned_steps):
            return False
        return self.epsilon_after(self.steps_done + 1) > budget * (1 + 1e-9)

    def _stop_for_budget(self, budget: float) -> None:
        if not self.stopped_by_budget:
            log.warning("dpl: stopping: step %d would spend more than privacy.max_epsilon = %g (epsilon now %.3f)",
                        self.steps_done + 1, budget, self.epsilon_after(self.steps_done))
        self.stopped_by_budget = True
        self.trainer.should_stop = True

    def _log_metric(self, name: str, value: float) -> None:
        self.log(name, value, on_step=True, on_epoch=False)

    def on_fit_end(self) -> None:
        eps = self.epsilon_after(self.steps_done)
        metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items()
                   if k.startswith("val") and "/" not in k}  # per-class / per-group values stay in the logs
        shown = ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items()))
        self.fit_summary = (f"dpl: trained {self.steps_done} private steps; privacy spent (epsilon={eps:.3f}, "
                            f"delta={self.delta:.3g}); sigma={self.noise_multiplier:.4f}, "
                            f"C={self.privacy.max_grad_norm:g}" + (f"; {shown}" if shown else ""))
        if self.trainer.is_global_zero and not getattr(self, "defer_fit_summary", False):  # the CLI prints it last
            print(self.fit_summary)

    # --- checkpoints ----------------------------------------------------------------------------------
    def _named_stateful(self) -> list[tuple[str, Any]]:
        """The plugins (by name) and the mechanism (``"mechanism"``), whose state goes into checkpoints."""
        items = list(self.plugin_manager.list_name_plugin())
        if self.mechanism is not None:
            items.append(("mechanism", self.mechanism))
        return items

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Public state into the checkpoint; secret state under ``dpl.lightning.checkpoint.SECRET_KEY`` only when the
        trainer writes it to an owner-only sidecar (:class:`~dpl.lightning.checkpoint.SidecarCheckpointIO`) and the
        checkpoint is a full one (not weights-only)."""
        secret_id = ckpt_io.new_secret_id()
        checkpoint["dpl"] = {
            "version": 2, "noise_multiplier": self.noise_multiplier, "delta": self.delta,
            "max_grad_norm": self.privacy.max_grad_norm, "expected_batch_size": self.privacy.batch_size,
            "num_examples": self.num_train_examples, "steps_done": self.steps_done,
            "planned_steps": self.planned_steps, "history": [list(h) for h in self.history],
            "mechanism_name": self.mechanism.name if self.mechanism is not None else None,
            "sampling_rate": self.privacy.batch_size / self.num_train_examples if self.num_train_examples else None,
            "public_rng": self._public_generator.get_state() if self._public_generator is not None else None,
            "states": {name: obj.state_dict() for name, obj in self._named_stateful()
                       if callable(getattr(obj, "state_dict", None))},
            "secret_id": secret_id,
        }
        full = "optimizer_states" in checkpoint
        trainer = self._trainer
        if full and trainer is not None and isinstance(trainer.strategy.checkpoint_io, ckpt_io.SidecarCheckpointIO):
            checkpoint[ckpt_io.SECRET_KEY] = self._secret_state(secret_id)

    def _secret_state(self, secret_id: str) -> dict[str, Any]:
        noise = self._noise_generator
        return {
            "secret_id": secret_id,
            "noise_rng": noise.get_state() if isinstance(noise, torch.Generator) else None,
            "sampler_rng": self._sampler_generator.get_state() if self._sampler_generator is not None else None,
            "states": {name: obj.secret_state_dict() for name, obj in self._named_stateful()
                       if callable(getattr(obj, "secret_state_dict", None))},
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("dpl")
        if state is None:
            return
        if state.get("version") != 2:
            raise ConfigError("this checkpoint was written by an older dpl whose checkpoints carried secrets; "
                              "it cannot be resumed safely")
        if self.mechanism is None:  # validate / test / predict: the weights are all that is needed
            return
        self._check_resume_plan(state)
        self.steps_done = int(state["steps_done"])
        if state.get("public_rng") is not None and self._public_generator is not None:
            self._public_generator.set_state(state["public_rng"])
        named = dict(self._named_stateful())
        for name, sub in state["states"].items():
            if name in named and callable(getattr(named[name], "load_state_dict", None)):
                named[name].load_state_dict(sub)
        self._pending_secret = checkpoint.pop(ckpt_io.SECRET_KEY, None)
        self._resumed_without_secret = self._pending_secret is None
        if self._noise_generator is not None:  # on_fit_start already ran (strategies restoring after setup)
            self._apply_secret_state()
            distributed.sync_run_state(self)

    def _check_resume_plan(self, state: dict[str, Any]) -> None:
        """Refuse (unless ``privacy.force_resume``) a resume whose privacy settings differ from the checkpoint's;
        account the whole history either way."""
        cfg = self.privacy
        old_sigma = float(state["noise_multiplier"])
        done = int(state["steps_done"])
        changes = []
        if state["mechanism_name"] != self.mechanism.name:
            changes.append(f"mechanism {state['mechanism_name']} -> {self.mechanism.name}")
        if state["max_grad_norm"] != cfg.max_grad_norm:
            changes.append(f"C {state['max_grad_norm']:g} -> {cfg.max_grad_norm:g}")
        if state["expected_batch_size"] != cfg.batch_size or state["num_examples"] != self.num_train_examples:
            changes.append(f"q = {state['expected_batch_size']}/{state['num_examples']} -> "
                           f"{cfg.batch_size}/{self.num_train_examples}")
        if not math.isclose(state["delta"], self.delta, rel_tol=1e-12):
            changes.append(f"delta {state['delta']:.3g} -> {self.delta:.3g}")
        same_plan = int(state["planned_steps"]) == self.planned_steps
        if cfg.noise_multiplier is None and same_plan:
            self.noise_multiplier = old_sigma  # same plan, same calibration: keep the exact value
        if not math.isclose(old_sigma, self.noise_multiplier, rel_tol=1e-12):
            changes.append(f"sigma {old_sigma:.4f} -> {self.noise_multiplier:.4f}"
                           + ("" if same_plan else f" (plan {state['planned_steps']} -> {self.planned_steps} steps)"))
        old_rate = state["sampling_rate"]
        history = [(float(h[0]), int(h[1]), float(h[2])) for h in state.get("history", [])]
        history.append((old_sigma, done - sum(h[1] for h in history), old_rate))
        if changes and not cfg.force_resume:
            raise ConfigError("resuming would change the privacy settings (" + "; ".join(changes) + "); set "
                              "privacy.force_resume=true to resume anyway (epsilon is then composed over both parts)")
        if state["mechanism_name"] != self.mechanism.name:
            raise ConfigError("a resume cannot change the privacy mechanism: there is no accounting for the "
                              "composition; start a new run")
        history = [h for h in history if h[1] > 0]
        if changes:
            self.history = history
            if cfg.noise_multiplier is None:  # recalibrate sigma for what is left of the budget
                self.noise_multiplier = self._calibrate_remaining(cfg.target_epsilon)
            log.warning("dpl: resuming with changed privacy settings (%s); epsilon is composed over both parts: "
                        "%.3f after %d steps, %.3f planned", "; ".join(changes), self.epsilon_after(done), done,
                        self.final_epsilon())
        else:
            self.history = history[:-1]  # unchanged settings: the last segment continues

    def _calibrate_remaining(self, target: float) -> float:
        """Smallest sigma for the remaining steps whose composition with the history stays within ``target``."""
        done = sum(h[1] for h in self.history)
        rate = self.privacy.batch_size / self.num_train_examples
        remaining = self.planned_steps - done
        if remaining <= 0:
            return self.history[-1][0]
        if self.mechanism.epsilon_of_segments(list(self.history), self.delta) >= target:
            raise ConfigError(f"the checkpoint already spent epsilon >= target {target:g}: nothing left to train with")

        def eps(sigma: float) -> float:
            return self.mechanism.epsilon_of_segments([*self.history, (sigma, remaining, rate)], self.delta)

        lo, hi = 0.05, 1.0
        while eps(hi) > target:
            lo, hi = hi, hi * 2
            if hi > 1e4:
                raise ConfigError("cannot calibrate sigma for the remaining steps")
        for _ in range(40):
            mid = math.sqrt(lo * hi)
            if eps(mid) > target:
                lo = mid
            else:
                hi = mid
            if hi / lo < 1 + 1e-4:
                break
        return hi

    def _apply_secret_state(self) -> None:
        """Restore generators and plugin secrets from the sidecar, or start fresh from OS entropy without it."""
        if self._pending_secret is None and not self._resumed_without_secret:
            return
        secret, self._pending_secret = self._pending_secret, None
        named = dict(self._named_stateful())
        if secret is None:
            self._resumed_without_secret = False
            log.info("dpl: resumed without the checkpoint's .secret sidecar: noise and sampling continue from fresh "
                     "OS entropy (as private; not bit-exact)")
            if self.privacy.seed is not None:
                warnings.warn("privacy.seed is set but the checkpoint's .secret sidecar is missing: the resumed run "
                              "is not bit-exact", PrivacyWarning, stacklevel=2)
            for obj in named.values():
                if callable(getattr(obj, "load_secret_state_dict", None)):
                    obj.load_secret_state_dict(None)
            return
        if secret["noise_rng"] is not None and isinstance(self._noise_generator, torch.Generator):
            self._noise_generator.set_state(secret["noise_rng"])
        if secret["sampler_rng"] is not None and self._sampler_generator is not None:
            self._sampler_generator.set_state(secret["sampler_rng"])
        for name, sub in secret["states"].items():
            if name in named and callable(getattr(named[name], "load_secret_state_dict", None)):
                named[name].load_secret_state_dict(sub)


def install_sidecar_io(trainer: L.Trainer) -> None:
    """Make the trainer write checkpoints through :class:`~dpl.lightning.checkpoint.SidecarCheckpointIO` (idempotent)."""
    strategy = trainer.strategy
    current = strategy.checkpoint_io
    if not isinstance(current, ckpt_io.SidecarCheckpointIO):
        strategy.checkpoint_io = ckpt_io.SidecarCheckpointIO(current)
