"""dpl's private step inside Hugging Face ``Trainer``: :class:`PrivateTrainerMixin` and :class:`PrivateTrainer`.

The trainer keeps its loop, optimizer, scheduler, callbacks, logging (``report_to``) and saving; dpl owns what the
guarantee rests on, through the same :class:`~dpl.core.engine.PrivateEngine` as ``dpl fit`` and
:class:`dpl.PrivateTraining`:

* **setup, at construction**: the settings that would break the guarantee are refused in one line
  (:mod:`dpl.hf.checks`); the engine is set up with the trainer's own optimizer and the trainer's planned steps
  (``max_steps``, else ``ceil(num_train_epochs x floor(N / B))``), so sigma is calibrated and the plan checked against
  the budget before ``train()``;
* **batches**: the engine's sampler (Poisson at rate B / N; users under ``privacy.unit: user`` with ``user_column``)
  over the rows, collated by the trainer's collator (:mod:`dpl.hf.data`); ``privacy.batch_size`` is the expected
  logical batch, ``per_device_train_batch_size`` the micro-batch of the per-example passes;
* **the step** (:meth:`PrivateTrainerMixin.training_step`): the four hooks (plugins included) on the per-example loss
  from the model's outputs and the batch's labels (:mod:`dpl.hf.losses`); the released direction goes into ``.grad``
  and the trainer's optimizer and scheduler apply it (the trainer's ``max_grad_norm`` is not applied: dpl clips each
  example at ``privacy.max_grad_norm``);
* **the budget**: training stops before a step would spend more than ``privacy.max_epsilon``;
* **logs**: ``epsilon`` at every log line and the privacy plan (``privacy/sigma``, ...) once, so every ``report_to``
  tracker gets them; the training loss, computed from the private examples, is not logged;
* **saving and resuming**: :mod:`dpl.hf.saving` (the report and ledger line with every save, the secret sidecar out
  of the checkpoint folder, dpl's resume rules through ``train(resume_from_checkpoint=...)``).
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback

from dpl.core.engine import PrivateEngine
from dpl.core.privacy import PrivacyConfig
from dpl.core.regime import CLASSIFICATION, GENERATION
from dpl.core.sharding import as_gradient_of
from dpl.core.update import StreamingDirection, apply_streaming
from dpl.errors import BudgetExceeded, ConfigError
from dpl.hf import checks, losses
from dpl.hf.data import EngineBatches, RowCollate, RowIndices, describe_rows, user_keys
from dpl.hf.saving import RunRecord, load_engine, save_engine
from dpl.training import _answering

log = logging.getLogger("dpl")

#: the plan's values logged once, as ``privacy/<name>`` (public values only)
PLAN_VALUES = {"sigma": "noise_multiplier", "delta": "delta", "max_grad_norm": "max_grad_norm",
               "batch_size": "batch_size", "sampling_rate": "sampling_rate", "steps_planned": "steps_planned",
               "epsilon_planned": "epsilon_planned", "num_examples": "num_examples"}


class PrivateTrainerMixin:
    """Differentially private training inside a Hugging Face trainer (the module docstring says what changes).

    Keyword arguments, besides the trainer's own:
        privacy: the privacy settings (:class:`dpl.PrivacyConfig`; ``physical_batch_size`` is the trainer's
            ``per_device_train_batch_size``).
        plugins: dpl plugins to activate, ``{name: options}`` (as ``model.plugins`` in a dpl config).
        user_column: the training set's column naming each row's user (with ``privacy.unit: user``).
        task: the per-example loss: ``auto`` (from the model), ``causal_lm``, ``sequence_classification`` or
            ``token_classification``; or override :meth:`per_example_loss`.
    """

    def __init__(self, *args: Any, privacy: PrivacyConfig | None = None, plugins: Mapping[str, Any] | None = None,
                 user_column: str | None = None, task: str = "auto", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._dpl_prepare(privacy if privacy is not None else PrivacyConfig(), plugins, user_column, task)

    # --- setup --------------------------------------------------------------------------------------------------
    def _dpl_prepare(self, privacy: PrivacyConfig, plugins: Mapping[str, Any] | None, user_column: str | None,
                     task: str) -> None:
        args = self.args
        checks.check_args(args, privacy.batch_size)
        checks.check_own_sampler(self)
        if getattr(self, "model_init", None) is not None:
            raise ConfigError("model_init rebuilds the model inside train(): pass the model itself")
        num_rows = checks.check_dataset(self.train_dataset)
        if args.max_grad_norm:
            log.info("dpl: the trainer's max_grad_norm (%g) is not applied: dpl clips each example's gradient at "
                     "privacy.max_grad_norm (%g)", args.max_grad_norm, privacy.max_grad_norm)
            args.max_grad_norm = 0.0
        args.ignore_data_skip = True  # dpl's sampler continues at the checkpoint's step itself
        privacy = replace(privacy, physical_batch_size=args.per_device_train_batch_size)
        self.dpl_task = losses.resolve_task(task, self.model)
        keys = user_keys(self.train_dataset, user_column)

        def steps(per_epoch: int) -> int:  # the trainer's planned steps, from the unit's population (engine.setup)
            planned = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * per_epoch)
            if planned < 1:
                raise ConfigError("the trainer settings leave no training step (max_steps / num_train_epochs)")
            return planned

        self.dpl_engine = PrivateEngine(privacy, plugins)
        kinds = {"causal_lm": GENERATION, "sequence_classification": CLASSIFICATION}
        self.dpl_engine.task_kind = kinds.get(self.dpl_task)  # the words of the noise regime's warning
        optimizer = self.create_optimizer()  # the trainer's own: the plugins check it at setup
        self._dpl_trainable = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        self.dpl_engine.setup(self.model, num_rows=num_rows, steps=steps, trainable=self._dpl_trainable,
                              optimizer_factory=_answering(optimizer), users=keys)
        self._dpl_record = RunRecord(self.dpl_engine, self.dpl_task, self._dpl_sources(user_column), args.output_dir)
        self._dpl_plan_logged = False
        self._dpl_metrics: dict[str, float] = {}
        self._dpl_started = False
        self.add_callback(BudgetGuard(self.dpl_engine))

    def _dpl_sources(self, user_column: str | None) -> dict[str, Any]:
        """The base model and the training data of the privacy report."""
        from dpl.lightning.provenance import describe_model

        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        location = getattr(getattr(base, "config", None), "_name_or_path", None) or None
        unit = self.dpl_engine.unit.describe("training rows", f"column {user_column!r}", "one row of the training set")
        return {"base_model": describe_model(location), "training_data": describe_rows(self.train_dataset),
                "unit_description": unit}

    # --- what a subclass may change -------------------------------------------------------------------------------
    def per_example_loss(self, model: nn.Module, batch: dict[str, Any]) -> Tensor:
        """One loss per example of ``batch`` (shape ``(b,)``): by default from the model's outputs and the batch's
        labels for the trainer's task (:mod:`dpl.hf.losses`)."""
        return losses.per_example_loss(self.dpl_task, model, batch)

    # --- batches --------------------------------------------------------------------------------------------------
    def get_train_dataloader(self) -> DataLoader:
        """The training batches drawn by the engine's sampler, collated by the trainer's collator."""
        dataset, collate = self.train_dataset, self.data_collator
        try:
            import datasets

            is_hf = isinstance(dataset, datasets.Dataset)
        except ImportError:  # pragma: no cover
            is_hf = False
        if is_hf:
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collate = self._get_collator_with_removed_columns(collate, description="training")
        return DataLoader(RowIndices(len(dataset)), batch_sampler=EngineBatches(self.dpl_engine),
                          collate_fn=RowCollate(dataset, collate, self.dpl_engine),
                          num_workers=self.args.dataloader_num_workers, pin_memory=self.args.dataloader_pin_memory)

    # --- training -------------------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, **kwargs: Any) -> Any:
        """The trainer's ``train``, after the engine resumed from the checkpoint (dpl's rules) and started."""
        from transformers.trainer_utils import get_last_checkpoint

        if self._dpl_started:
            raise ConfigError("train() runs once per dpl trainer (its privacy plan covers one run): build a new "
                              "trainer, resuming from a checkpoint")
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ConfigError(f"resume_from_checkpoint=True: no checkpoint in {self.args.output_dir}")
        engine = self.dpl_engine
        if resume_from_checkpoint:
            load_engine(engine, resume_from_checkpoint, _checkpoint_step(resume_from_checkpoint))
            if engine.steps_done >= engine.plan.steps:
                raise ConfigError(f"{resume_from_checkpoint} already took all {engine.plan.steps} planned steps: "
                                  "nothing left to train")
        engine.start(next(iter(self._dpl_trainable.values())).device)
        self._dpl_started = True
        self._dpl_record.started()
        try:
            output = super().train(resume_from_checkpoint=resume_from_checkpoint or None, trial=trial, **kwargs)
        except BaseException as exc:
            self._dpl_stopped(exc)
            raise
        self._dpl_record.write(self.args.output_dir, "finished")
        return output

    def _dpl_stopped(self, exc: BaseException) -> None:
        """Ctrl+C or an error: the report says so, the steps taken are recorded, one line names the last checkpoint."""
        from transformers.trainer_utils import get_last_checkpoint

        from dpl.lightning.data_ledger import stop_line

        status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
        if self.dpl_engine.steps_done - self._dpl_record.start_steps < 1:
            return
        try:
            report = self._dpl_record.write(self.args.output_dir, status)
        except Exception as err:  # noqa: BLE001 - the run's own exception is the one to raise
            print(f"dpl: warning: the {status} run could not be recorded in the privacy ledger ({err})",
                  file=sys.stderr, flush=True)
            return
        last = get_last_checkpoint(self.args.output_dir) if os.path.isdir(self.args.output_dir) else None
        where = (f"; last checkpoint {last} (step {_checkpoint_step(last)}; resume_from_checkpoint continues it)"
                 if last else "; no checkpoint written")
        print(stop_line(report, status, self._dpl_record.root / "privacy_ledger.jsonl") + where, file=sys.stderr,
              flush=True)

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Tensor:
        """One private step on the logical batch ``inputs``: the released direction into ``.grad`` (the trainer's
        optimizer and scheduler then apply it). Returns 0: the training loss is not released."""
        engine = self.dpl_engine
        if engine.would_exceed_max_epsilon():
            raise BudgetExceeded(f"a step beyond the {engine.steps_done} taken would spend more than the budget "
                                 f"(epsilon {engine.privacy.effective_max_epsilon:g})")
        model.train()
        inputs = self._prepare_inputs(inputs)
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        trainable = self._dpl_trainable
        with self.compute_loss_context_manager():
            direction = engine.step(inputs, model=self.model, trainable=trainable,
                                    per_example_loss=lambda batch: self.per_example_loss(self.model, batch),
                                    optimizer=optimizer, log_metric=self._dpl_metric)
        del inputs
        if isinstance(direction, StreamingDirection):  # DPZero: applied in place; the trainer's step is then a no-op
            apply_streaming(optimizer, trainable, direction)
        else:
            for name, param in trainable.items():
                param.grad = as_gradient_of(param, direction[name])
        del direction
        return torch.zeros((), device=self.args.device)

    def _dpl_metric(self, name: str, value: float) -> None:
        self._dpl_metrics[name] = float(value)

    # --- what the trainer does not see ------------------------------------------------------------------------------
    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """0: the trainer's count would follow the secret realized batch sizes."""
        return 0

    def _track_num_input_tokens(self, inputs: dict[str, Any]) -> None:
        """Nothing: the tokens seen would follow the secret realized batch sizes."""

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The trainer's log line with epsilon spent (and the privacy plan once), without the training loss."""
        engine = self.dpl_engine
        if self._dpl_started:
            logs = {k: v for k, v in logs.items() if k not in ("loss", "train_loss")}
            if not self._dpl_plan_logged:
                summary = engine.summary()
                logs.update({f"privacy/{k}": float(summary[v]) for k, v in PLAN_VALUES.items()
                             if summary.get(v) is not None})
                self._dpl_plan_logged = True
            logs.update(self._dpl_metrics)
            self._dpl_metrics = {}
            logs["epsilon"] = engine.epsilon()
        super().log(logs, *args, **kwargs)

    # --- saving ---------------------------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The trainer's save, with the privacy report beside the model (and the run's ledger line)."""
        super().save_model(output_dir, _internal_call=_internal_call)
        if self._dpl_started and self.args.should_save:
            self._dpl_record.write(output_dir if output_dir is not None else self.args.output_dir)

    def create_model_card(self, *args: Any, **kwargs: Any) -> None:
        """The trainer's model card (README.md), without the path on this machine of a base model loaded from a local
        file (a ``.gguf``): the card names it as the trainer names a model from a local folder, not at all."""
        config = getattr(self.model, "config", None)
        name = getattr(config, "name_or_path", None)
        local = isinstance(name, str) and bool(name) and os.path.exists(name)
        if local:
            config.name_or_path = ""
        try:
            super().create_model_card(*args, **kwargs)
        finally:
            if local:
                config.name_or_path = name

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
            save_engine(self.dpl_engine, folder)


class PrivateTrainer(PrivateTrainerMixin, Trainer):
    """``transformers.Trainer`` with dpl's private step (:class:`PrivateTrainerMixin`)::

        trainer = PrivateTrainer(model=model, args=TrainingArguments(...), train_dataset=train,
                                 data_collator=collator, privacy=PrivacyConfig(target_epsilon=8, batch_size=256))
        trainer.train()
    """


class BudgetGuard(TrainerCallback):
    """Stops training (and saves) before a step would spend more than ``privacy.max_epsilon``."""

    def __init__(self, engine: PrivateEngine) -> None:
        self.engine = engine
        self.stopped = False

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step < state.max_steps and self.engine.would_exceed_max_epsilon():
            if not self.stopped:
                log.warning("dpl: stopping: step %d would spend more than privacy.max_epsilon = %g (epsilon now "
                            "%.3f)", self.engine.steps_done + 1, self.engine.privacy.effective_max_epsilon,
                            self.engine.epsilon())
            self.stopped = True
            control.should_training_stop = True
            control.should_save = True
        return control


def _checkpoint_step(path: str | os.PathLike | None) -> int | None:
    """The global step of a checkpoint folder, from its ``trainer_state.json``."""
    import json

    try:
        with open(os.path.join(path, "trainer_state.json"), encoding="utf-8") as f:
            return int(json.load(f)["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
