"""``DPModule``: the Lightning adapter over the private engine, shared by every task.

Subclasses say how to build the model (:meth:`build_model`), how to compute per-example losses
(:meth:`per_example_loss`) and how to evaluate (``validation_step``). Everything private - sampling, clipping,
noise, accounting, the plugin hooks, the public/secret state - lives in :class:`~dpl.core.engine.PrivateEngine`
and the plugins; this module connects it to Lightning's loop (manual optimization: one optimizer step per logical
batch), its strategy (one small interface, :class:`~dpl.lightning.strategy.DPStrategy`: one process, or dpl's DDP
and FSDP strategies) and its checkpoints.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor, nn
from torch.utils.data import Sampler

from dpl.core.engine import PrivateEngine
from dpl.core.ledger import planned_steps
from dpl.core.plugin_manager import plugin_options_type
from dpl.core.privacy import PrivacyConfig
from dpl.core.sharding import full_parameters
from dpl.core.update import apply_direction
from dpl.errors import ConfigError
from dpl.lightning import checkpoint as ckpt_io
from dpl.lightning.precision import check_precision
from dpl.lightning.strategy import DPStrategy, dp_strategy

log = logging.getLogger("dpl")

#: the type of ``model.plugins``: one optional key per installed plugin, valued by its typed options
PluginOptions = plugin_options_type()


class DPModule(L.LightningModule):
    """Base LightningModule for differentially private training: a thin adapter over a
    :class:`~dpl.core.engine.PrivateEngine` (``self.engine``).

    Args:
        privacy: the privacy settings (:class:`~dpl.core.privacy.PrivacyConfig`).
        plugins: plugins to activate, ``{name: {options}}`` in the order their ``post_process`` runs; each
            plugin's options are checked against its constructor when the config is parsed.
        optimizer: torch optimizer (class or callable taking the trainable parameters).
        lr_scheduler: optional scheduler, stepped once per logical batch.
    """

    #: the kind of task trained (:data:`~dpl.core.regime.CLASSIFICATION`, ``GENERATION``; ``None``: not said), whose
    #: runs the noise regime's warning cites
    task_kind: ClassVar[str | None] = None

    def __init__(self, privacy: PrivacyConfig | None = None, plugins: PluginOptions | None = None,
                 optimizer: OptimizerCallable = torch.optim.AdamW,
                 lr_scheduler: LRSchedulerCallable | None = None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.engine = PrivateEngine(privacy, plugins)  # fails early on unknown plugins
        self.engine.task_kind = self.task_kind
        self.optimizer_factory = optimizer
        self.scheduler_factory = lr_scheduler
        self.model: nn.Module | None = None
        self.datamodule_ref: L.LightningDataModule | None = None
        self.stopped_by_max_epsilon = False
        self.fit_summary: str | None = None  # the one-line summary of the last fit
        self.print_fit_summary = True  # print it at the end of fit (the CLI prints it itself, below the progress bar)
        self._steps_at_train_start = 0

    # --- what a task provides -------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        """Return the network (with frozen and trainable parameters set)."""
        raise NotImplementedError

    def per_example_loss(self, batch: dict[str, Any]) -> Tensor:
        """Forward pass over ``batch``; return one loss per example (shape ``(b,)``)."""
        raise NotImplementedError

    def base_model(self) -> dict[str, Any] | None:
        """The pretrained model training starts from, for the privacy report
        (:func:`~dpl.lightning.provenance.describe_model`); ``None``: not stated."""
        return None

    @property
    def privacy(self) -> PrivacyConfig:
        """The privacy settings (the engine's; its plan, sigma and epsilon: ``self.engine``)."""
        return self.engine.privacy

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
        return getattr(attached_trainer(self), "datamodule", None)

    @property
    def trainable(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.ensure_model().named_parameters() if p.requires_grad}

    @property
    def dp(self) -> DPStrategy:
        """What the trainer's strategy does for private training (:func:`~dpl.lightning.strategy.dp_strategy`)."""
        return dp_strategy(attached_trainer(self))

    def setup(self, stage: str) -> None:
        datamodule = self.trainer.datamodule
        self.ensure_model(datamodule)
        if stage == "fit":
            install_sidecar_io(self.trainer)
            if not self.engine.configured:  # the CLI configures it before fit (before_fit); library use here
                self.prepare_privacy(datamodule.num_train_examples, self.trainer)
            datamodule.train_batch_sampler = self._train_batch_sampler

    def configure_model(self) -> None:
        """Build the model; under dpl's FSDP strategy (:class:`~dpl.lightning.fsdp.DPFSDPStrategy`) also shard it."""
        self.ensure_model(self.trainer.datamodule)
        shard = getattr(self.trainer.strategy, "shard_module", None)
        if shard is not None:
            shard(self.model)

    @staticmethod
    def planned_total_steps(trainer: L.Trainer, steps_per_epoch: int) -> int:
        """The number of steps the trainer will really run (:func:`~dpl.core.ledger.planned_steps`)."""
        return planned_steps(steps_per_epoch, max_steps=trainer.max_steps, max_epochs=trainer.max_epochs,
                             limit_train_batches=trainer.limit_train_batches)

    def prepare_privacy(self, num_examples: int, trainer: L.Trainer | None = None) -> None:
        """Set the engine up for this trainer's plan: validate the setup with every plugin, pick the mechanism and
        calibrate sigma. Called once, before fit (by the CLI, else by :meth:`setup`)."""
        trainer = trainer if trainer is not None else self.trainer
        dp = dp_strategy(trainer)  # refuses strategies dpl does not run
        check_precision(trainer)
        datamodule = self.datamodule
        self.engine.setup(self.ensure_model(), trainable=self.trainable, num_rows=num_examples,
                          steps=lambda per_epoch: self.planned_total_steps(trainer, per_epoch),
                          optimizer_factory=self.optimizer_factory, world_size=trainer.world_size,
                          sharded=dp.shards_parameters,
                          users=datamodule.train_user_keys() if datamodule is not None else None)
        if datamodule is not None:
            datamodule.train_unit = self.engine.unit

    def _train_batch_sampler(self, num_examples: int) -> Sampler:
        """The training batch sampler, handed to the data module at setup: the mechanism's own; under DDP this
        rank's share of each global batch (under FSDP padded to equal passes)."""
        if num_examples != self.engine.plan.num_rows:
            raise ConfigError(f"the training set has {num_examples} examples, the privacy plan {self.engine.plan.num_rows}")
        return self.dp.shard_train_sampler(self.engine.batch_sampler(), num_examples, unit_of=self.engine.unit_of_row())

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(list(self.trainable.values()))
        if self.scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": self.scheduler_factory(optimizer)}

    def on_fit_start(self) -> None:
        dp = self.dp
        self.engine.start(next(self.model.parameters()).device, secure_source=dp.secure_noise_source)
        dp.sync_run_state(self.engine)  # several ranks: every rank takes rank 0's generators and plugin secrets
        self._steps_at_train_start = self.engine.steps_done
        if self.privacy.physical_batch_size == "auto" and self.engine.micro_batch is None:
            self.fit_micro_batch()

    def on_train_start(self) -> None:
        self._steps_at_train_start = self.engine.steps_done  # a resume: the checkpoint's

    def fit_micro_batch(self) -> None:
        """``physical_batch_size: auto``: probe the private step on the data module's public probe batch at its
        ``max_length`` (:meth:`~dpl.lightning.data.DPDataModule.probe_batch`), under the trainer's precision."""
        datamodule = self.datamodule
        if datamodule is None:
            raise ConfigError("privacy.physical_batch_size auto needs a dpl data module (its probe batch)")
        device = next(self.model.parameters()).device
        precision = self.trainer.precision_plugin
        self.engine.fit_micro_batch(
            model=self.model, trainable=self.trainable, per_example_loss=self.per_example_loss,
            probe_batch=lambda b: {k: v.to(device) if torch.is_tensor(v) else v
                                   for k, v in datamodule.probe_batch(b).items()},
            tokens=getattr(datamodule, "max_length", None), context=precision.train_step_context)

    # --- the private step -----------------------------------------------------------------------------
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        engine = self.engine
        if engine.would_exceed_max_epsilon():
            self._stop_at_max_epsilon(self.privacy.effective_max_epsilon)
            self._log_step()
            return
        wrapped = self.optimizers()  # LightningOptimizer: stepping it advances trainer.global_step
        trainable = self.trainable
        dp = self.dp
        direction = engine.step(batch, model=self.model, trainable=full_parameters(trainable),
                                per_example_loss=self.per_example_loss, optimizer=getattr(wrapped, "optimizer", wrapped),
                                reduce_sum=dp.gradient_reducer(), log_metric=self._log_metric)
        del batch
        apply_direction(wrapped, trainable, direction)
        del direction
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        dp.after_private_step(engine, trainable)  # several ranks: the replicas still agree (first, every 100th, last)
        every, done = self.privacy.log_epsilon_every_n_steps, engine.steps_done
        if done % every == 0 or done == engine.plan.steps or done == 1:
            self.log("epsilon", engine.epsilon(), prog_bar=True, on_step=True, on_epoch=False)
        self._log_step()

    def _log_step(self) -> None:
        """Log under ``step`` the private steps taken (1 after the first), which Lightning's loggers then use as the
        step of the row (``metrics.csv``), instead of its 0-based batch index."""
        self.log("step", float(self.engine.steps_done), on_step=True, on_epoch=False)

    def on_validation_epoch_start(self) -> None:
        trainer = attached_trainer(self)
        if trainer is not None and trainer.state.fn == "fit":  # validation metrics: at the steps taken
            self.log("step", float(self.engine.steps_done), on_step=False, on_epoch=True)

    def _stop_at_max_epsilon(self, max_epsilon: float) -> None:
        if not self.stopped_by_max_epsilon:
            log.warning("dpl: stopping: step %d would spend more than privacy.max_epsilon = %g (epsilon now %.3f)",
                        self.engine.steps_done + 1, max_epsilon, self.engine.epsilon())
        self.stopped_by_max_epsilon = True
        self.trainer.should_stop = True

    def _log_metric(self, name: str, value: float) -> None:
        self.log(name, value, on_step=True, on_epoch=False)

    def configure_callbacks(self) -> list[Any]:
        """The trackers' privacy values and report (:class:`~dpl.lightning.trackers.TrackerLogging`)."""
        from dpl.lightning.trackers import TrackerLogging

        return [TrackerLogging()]

    def on_fit_end(self) -> None:
        """Compose the one-line summary (the CLI prints it below the finished progress bar; library use: here)."""
        from dpl.lightning.report import fit_summary_line

        metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items()
                   if k.startswith("val") and "/" not in k}  # per-class / per-group values stay in the logs
        self.fit_summary = fit_summary_line(self.engine, metrics, self._steps_at_train_start)
        if self.trainer.is_global_zero and self.print_fit_summary:
            print(self.fit_summary)

    # --- checkpoints (:mod:`dpl.lightning.checkpoint`) ------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        ckpt_io.save_engine_state(self.engine, checkpoint, attached_trainer(self))

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        resumed = ckpt_io.load_engine_state(self.engine, checkpoint, attached_trainer(self))
        if resumed and self.engine.noise_source is not None:  # on_fit_start already ran (restored after setup)
            self.dp.sync_run_state(self.engine)


def attached_trainer(module: L.LightningModule) -> L.Trainer | None:
    """The trainer ``module`` is attached to, ``None`` if none (Lightning's ``module.trainer`` raises then)."""
    try:
        return module.trainer
    except RuntimeError:
        return None


def install_sidecar_io(trainer: L.Trainer) -> None:
    """Make the trainer write checkpoints through :class:`~dpl.lightning.checkpoint.SidecarCheckpointIO` (idempotent)."""
    strategy = trainer.strategy
    current = strategy.checkpoint_io
    if not isinstance(current, ckpt_io.SidecarCheckpointIO):
        strategy.checkpoint_io = ckpt_io.SidecarCheckpointIO(current)
