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

from dpl.errors import ConfigError
from dpl.mechanism import Mechanism
from dpl.plugin_manager import active_plugin_names, create_plugin_manager, replaced_hooks
from dpl.privacy import PrivacyConfig
from dpl.sampling import secure_generator
from dpl.step import RunSetup, StepContext, private_step

log = logging.getLogger("dpl")


class DPModule(L.LightningModule):
    """Base LightningModule for differentially private training.

    Args:
        privacy: the privacy settings (:class:`~dpl.privacy.PrivacyConfig`).
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
        self._noise_generator: torch.Generator | None = None
        self._sampler_generator: torch.Generator | None = None
        self._pending_rng: dict[str, Tensor] | None = None

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
        if stage == "fit":
            self.prepare_privacy(self.trainer.datamodule.num_train_examples, self.trainer)

    @staticmethod
    def planned_total_steps(trainer: L.Trainer, steps_per_epoch: int) -> int:
        if trainer.max_steps is not None and trainer.max_steps > 0:
            return int(trainer.max_steps)
        if trainer.max_epochs is None or trainer.max_epochs < 0:
            raise ConfigError("set trainer.max_steps or trainer.max_epochs: privacy accounting needs the number "
                              "of steps up front")
        return int(trainer.max_epochs) * steps_per_epoch

    def prepare_privacy(self, num_examples: int, trainer: L.Trainer | None = None) -> None:
        """Validate the setup with every plugin, pick the mechanism and calibrate sigma (idempotent)."""
        if self.mechanism is not None and self.num_train_examples == num_examples:
            return
        cfg = self.privacy
        if cfg.batch_size > num_examples:
            raise ConfigError(f"privacy.batch_size ({cfg.batch_size}) is larger than the training set "
                              f"({num_examples} examples)")
        trainer = trainer if trainer is not None else self.trainer
        if trainer.world_size > 1:
            raise ConfigError("multi-process training (DDP) is not supported yet: noise and sampling would be "
                              "drawn per process")
        self.num_train_examples = num_examples
        self.steps_per_epoch = max(1, num_examples // cfg.batch_size)
        self.planned_steps = self.planned_total_steps(trainer, self.steps_per_epoch)
        self.delta = cfg.delta_for(num_examples)
        if self.delta >= 1.0 / num_examples:
            warnings.warn(f"delta = {self.delta:.3g} >= 1/N = {1 / num_examples:.3g}: this allows releasing an "
                          "example outright; use delta << 1/N", stacklevel=2)
        trainable = self.trainable
        if not trainable:
            raise ConfigError("the model has no trainable parameter")
        hook = self.plugin_manager.hook
        setup = RunSetup(model=self.model, trainable=trainable, plugin_names=active_plugin_names(self.plugin_manager),
                         num_examples=num_examples, expected_batch_size=cfg.batch_size, steps=self.planned_steps,
                         sampling_rate=cfg.batch_size / num_examples, accountant=cfg.accountant,
                         optimizer_name=getattr(self.optimizer_factory, "__name__", type(self.optimizer_factory).__name__),
                         task=self.task, replaced_hooks=replaced_hooks(self.plugin_manager))
        hook.validate_setup(setup=setup)
        self.mechanism = hook.configure_mechanism(setup=setup)
        if self.mechanism is None:
            raise ConfigError("no plugin configured a privacy mechanism")
        if cfg.noise_multiplier is not None:
            self.noise_multiplier = float(cfg.noise_multiplier)
        else:
            self.noise_multiplier = self.mechanism.calibrate(cfg.target_epsilon, self.delta, self.planned_steps)
        if cfg.seed is not None:
            warnings.warn("privacy.seed is set: noise and batches are reproducible, and so predictable by anyone "
                          "who knows the seed. Use it for experiments, never in production.", stacklevel=2)
        self._sampler_generator = secure_generator(None if cfg.seed is None else cfg.seed + 1)
        eps = self.final_epsilon()
        log.info("dpl: N=%d, B=%d (q=%.4g), %d steps, sigma=%.4f, C=%g -> (epsilon=%.3f, delta=%.3g) [%s]",
                 num_examples, cfg.batch_size, cfg.batch_size / num_examples, self.planned_steps,
                 self.noise_multiplier, cfg.max_grad_norm, eps, self.delta, self.mechanism.name)

    def final_epsilon(self) -> float:
        return self.epsilon_after(self.planned_steps)

    def epsilon_after(self, steps: int) -> float:
        if self.noise_multiplier == 0:
            return math.inf
        return self.mechanism.epsilon(self.noise_multiplier, self.delta, steps)

    def make_batch_sampler(self, num_examples: int) -> Sampler:
        """The training batch sampler (called by :class:`~dpl.data.DPDataModule`)."""
        self.prepare_privacy(num_examples)
        return self.mechanism.batch_sampler(num_examples, self.steps_per_epoch, self._sampler_generator)

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(list(self.trainable.values()))
        if self.scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": self.scheduler_factory(optimizer)}

    def on_fit_start(self) -> None:
        device = next(self.model.parameters()).device
        if self._noise_generator is None or self._noise_generator.device != device:
            seed = self.privacy.seed
            self._noise_generator = secure_generator(seed, device=device)
        if self._pending_rng is not None:
            self._noise_generator.set_state(self._pending_rng["noise"])
            self._sampler_generator.set_state(self._pending_rng["sampler"])
            self._pending_rng = None

    # --- the private step -----------------------------------------------------------------------------
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        ctx = StepContext(model=self.model, trainable=self.trainable, per_example_loss=self.per_example_loss,
                          max_grad_norm=self.privacy.max_grad_norm, noise_multiplier=self.noise_multiplier,
                          expected_batch_size=self.privacy.batch_size, step=self.steps_done,
                          noise_generator=self._noise_generator, log=self._log_metric)
        direction = private_step(self.plugin_manager.hook, ctx, batch, self.privacy.physical_batch_size)
        optimizer = self.optimizers()
        optimizer.zero_grad(set_to_none=True)
        for name, param in ctx.trainable.items():
            param.grad = direction[name].to(param.dtype)
        optimizer.step()
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        self.steps_done += 1
        every = self.privacy.log_epsilon_every_n_steps
        if self.steps_done % every == 0 or self.steps_done == self.planned_steps or self.steps_done == 1:
            self.log("epsilon", self.epsilon_after(self.steps_done), prog_bar=True, on_step=True, on_epoch=False)

    def _log_metric(self, name: str, value: float) -> None:
        self.log(name, value, on_step=True, on_epoch=False)

    def on_fit_end(self) -> None:
        eps = self.epsilon_after(self.steps_done)
        metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items() if k.startswith("val")}
        shown = ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items()))
        if self.trainer.is_global_zero:
            print(f"dpl: trained {self.steps_done} private steps; privacy spent (epsilon={eps:.3f}, "
                  f"delta={self.delta:.3g}); sigma={self.noise_multiplier:.4f}, C={self.privacy.max_grad_norm:g}"
                  + (f"; {shown}" if shown else ""))

    # --- checkpoints ----------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["dpl"] = {
            "noise_multiplier": self.noise_multiplier, "delta": self.delta, "steps_done": self.steps_done,
            "planned_steps": self.planned_steps,
            "mechanism": self.mechanism.state_dict() if self.mechanism is not None else None,
            "rng": {"noise": self._noise_generator.get_state() if self._noise_generator is not None else None,
                    "sampler": self._sampler_generator.get_state() if self._sampler_generator is not None else None},
            "plugins": {name: plugin.state_dict() for name, plugin in self.plugin_manager.list_name_plugin()
                        if callable(getattr(plugin, "state_dict", None))},
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("dpl")
        if state is None:
            return
        self.steps_done = state["steps_done"]
        if state["noise_multiplier"] is not None:
            self.noise_multiplier = state["noise_multiplier"]
            self.delta = state["delta"]
        if self.mechanism is not None and state["mechanism"] is not None:
            self.mechanism.load_state_dict(state["mechanism"])
        rng = state["rng"]
        if rng["noise"] is not None:
            self._pending_rng = rng
        plugins = dict(self.plugin_manager.list_name_plugin())
        for name, plugin_state in state["plugins"].items():
            if name in plugins and callable(getattr(plugins[name], "load_state_dict", None)):
                plugins[name].load_state_dict(plugin_state)
