"""Progress output of ``dpl``: a progress bar on a terminal, plain periodic lines everywhere else.

On a terminal, :class:`DPLProgressBar` is Lightning's bar without its noise (``v_num``, ``Epoch 1/-2`` when
training is bounded by ``max_steps``). When stdout is not a terminal (a log file, CI, a cluster job),
:class:`PlainProgress` prints one plain line every ``interval`` seconds (and after each validation): the step,
ε spent, throughput and the latest validation metrics - no carriage returns, no ANSI codes.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.callbacks.progress import ProgressBar, TQDMProgressBar
from lightning.pytorch.utilities import rank_zero_only
from torch import nn

RICH_AVAILABLE = importlib.util.find_spec("rich") is not None  # Lightning's default bar when rich is installed
try:
    from lightning.pytorch.callbacks.progress import RichProgressBar
except ImportError:  # pragma: no cover
    RichProgressBar = None

_HIDDEN = ("v_num",)


def _epoch_description(trainer: L.Trainer, current_epoch: int) -> str:
    text = f"Epoch {current_epoch}"
    if trainer.max_epochs is not None and trainer.max_epochs > 0:
        text += f"/{trainer.max_epochs - 1}"
    return text


def _visible(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in metrics.items() if k not in _HIDDEN}


class DPLTQDMProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar without ``v_num`` and without a negative epoch total."""

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        return _visible(super().get_metrics(trainer, pl_module))

    def on_train_epoch_start(self, trainer: L.Trainer, *_: Any) -> None:
        super().on_train_epoch_start(trainer)
        self.train_progress_bar.set_description(_epoch_description(trainer, trainer.current_epoch))


if RichProgressBar is not None:
    class DPLRichProgressBar(RichProgressBar):
        """Lightning's rich bar without ``v_num`` and without a negative epoch total."""

        def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
            return _visible(super().get_metrics(trainer, pl_module))

        described: Any = None  # the training bar whose description this bar last set

        def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            super().on_train_epoch_start(trainer, pl_module)
            self._describe_train_bar(trainer)

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
            super().on_train_batch_end(trainer, *args, **kwargs)
            if self.train_progress_bar_id != self.described:  # a bar made after a mid-epoch resume
                self._describe_train_bar(trainer)

        def _describe_train_bar(self, trainer: L.Trainer) -> None:
            if self.progress is None or self.train_progress_bar_id is None:
                return
            text = _epoch_description(trainer, trainer.current_epoch)
            if len(self.validation_description) > len(text):
                text = f"{text:{len(self.validation_description)}}"  # same width as the validation bar
            style = self.theme.description
            self.progress.update(self.train_progress_bar_id, description=f"[{style}]{text}" if style else text)
            self.described = self.train_progress_bar_id
else:  # pragma: no cover
    DPLRichProgressBar = None


def _step(trainer: L.Trainer, pl_module: L.LightningModule) -> int:
    """Private steps taken (dpl's manual optimization may not advance ``trainer.global_step``)."""
    steps = getattr(getattr(pl_module, "engine", None), "steps_done", None)
    return int(steps) if isinstance(steps, int) else int(trainer.global_step)


def _batch_size(batch: Any) -> int | None:
    """Examples in a training batch (FSDP's zero-weight fillers not counted)."""
    if isinstance(batch, dict):
        from dpl.core.step import PADDING_KEY

        fillers = batch.get(PADDING_KEY)
        if fillers is not None:
            return int((~fillers).sum())
        for value in batch.values():
            shape = getattr(value, "shape", None)
            if shape is not None and len(shape) > 0:
                return int(shape[0])
    return None


def _number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


class PlainProgress(ProgressBar):
    """Plain progress lines for logs (stdout not a terminal): every ``interval`` seconds (also while validating),
    after the first and the last step and after each validation, e.g.::

        dpl: step 40/93 (epoch 1/3) | epsilon 5.121 | 0.92 steps/s, 59.1 examples/s | val_acc 0.8125
    """

    def __init__(self, interval: float = 15.0, stream: Any = None) -> None:
        super().__init__()
        self.interval = interval
        self.stream = stream
        self._enabled = True
        self._start = 0.0
        self._last = 0.0
        self._examples = 0
        self._steps = 0
        self._planned = 0
        self._validation_start = 0.0

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    @rank_zero_only
    def _write(self, line: str) -> None:
        if self._enabled:
            stream = self.stream if self.stream is not None else sys.stdout
            stream.write(line + "\n")
            stream.flush()

    def print(self, *args: Any, sep: str = " ", **kwargs: Any) -> None:
        self._write(sep.join(map(str, args)))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start = self._last = time.monotonic()
        self._examples = self._steps = 0
        plan = getattr(getattr(pl_module, "engine", None), "plan", None)
        self._planned = int(plan.steps if plan is not None else 0) or (trainer.max_steps or 0)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._steps += 1
        self._examples += _batch_size(batch) or 0
        now = time.monotonic()
        last = self._planned > 0 and _step(trainer, pl_module) >= self._planned
        if self._steps == 1 or last or now - self._last >= self.interval:
            self._last = now
            self._write(self._line(trainer, pl_module, now))

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A line when a validation of ``fit`` starts (the last steps' line may be minutes old by its end)."""
        self._validation_start = self._last = time.monotonic()
        state = getattr(trainer, "state", None)
        if trainer.sanity_checking or getattr(state, "fn", None) != "fit":
            return
        total = self._total_batches(trainer)
        self._write(f"dpl: validating after step {_step(trainer, pl_module)}"
                    + (f": {total} batches" if total else ""))

    @staticmethod
    def _total_batches(trainer: L.Trainer, dataloader_idx: int = 0) -> int | None:
        totals = trainer.num_val_batches
        total = totals[dataloader_idx] if isinstance(totals, list) and dataloader_idx < len(totals) else totals
        return int(total) if isinstance(total, (int, float)) and total < float("inf") else None

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        """A line every ``interval`` seconds during a long validation (generating text can take minutes)."""
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            total = self._total_batches(trainer, dataloader_idx)
            of = f"/{total}" if total else ""
            self._write(f"dpl: validating: batch {batch_idx + 1}{of} after {now - self._validation_start:.0f} s")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        metrics = self._validation_metrics(trainer)
        if metrics:
            self._write(f"dpl: validation after step {_step(trainer, pl_module)} | {metrics}")

    def _line(self, trainer: L.Trainer, pl_module: L.LightningModule, now: float) -> str:
        step = _step(trainer, pl_module)
        parts = [f"step {step}" + (f"/{self._planned}" if self._planned else "")]
        if trainer.max_epochs is not None and trainer.max_epochs > 0:
            parts[0] += f" (epoch {trainer.current_epoch + 1}/{trainer.max_epochs})"
        metrics = self.get_metrics(trainer, pl_module)
        eps = _number(metrics.get("epsilon"))
        if eps is not None:
            parts.append(f"epsilon {eps:.3f}")
        elapsed = max(now - self._start, 1e-9)
        rate = f"{self._steps / elapsed:.2f} steps/s"
        if self._examples:
            rate += f", {self._examples / elapsed:.1f} examples/s"
        parts.append(rate)
        shown = self._validation_metrics(trainer)
        if shown:
            parts.append(shown)
        return "dpl: " + " | ".join(parts)

    @staticmethod
    def _validation_metrics(trainer: L.Trainer) -> str:
        values = {k: _number(v) for k, v in trainer.callback_metrics.items() if k.startswith("val")}
        return ", ".join(f"{k} {v:.4f}" for k, v in sorted(values.items()) if v is not None)

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        return _visible(super().get_metrics(trainer, pl_module))


class PlainModelSummary(ModelSummary):
    """The model summary off a terminal: one plain line (parameters, trainable parameters, size) instead of
    Lightning's box-drawn table."""

    def __init__(self, stream: Any = None) -> None:
        super().__init__(max_depth=1)
        self.stream = stream

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        from lightning.pytorch.utilities.model_summary import get_human_readable_count

        params = list(pl_module.parameters())
        total = sum(p.numel() for p in params)
        trainable = sum(p.numel() for p in params if p.requires_grad)
        model = getattr(pl_module, "model", None)
        name = type(model).__name__ if isinstance(model, nn.Module) else type(pl_module).__name__
        stream = self.stream if self.stream is not None else sys.stdout
        stream.write(f"dpl: model {name}: {get_human_readable_count(total).strip()} parameters, "
                     f"{get_human_readable_count(trainable).strip()} trainable\n")
        stream.flush()


def default_model_summary(stream: Any = None) -> ModelSummary | None:
    """The model summary for this process: ``None`` (Lightning's table) on a terminal, else
    :class:`PlainModelSummary`."""
    stream = stream if stream is not None else sys.stdout
    return None if hasattr(stream, "isatty") and stream.isatty() else PlainModelSummary()


def default_progress_bar(stream: Any = None) -> ProgressBar:
    """The progress callback for this process: a bar on a terminal, :class:`PlainProgress` otherwise."""
    stream = stream if stream is not None else sys.stdout
    if not (hasattr(stream, "isatty") and stream.isatty()):
        return PlainProgress()
    if RICH_AVAILABLE and DPLRichProgressBar is not None:
        return DPLRichProgressBar()
    return DPLTQDMProgressBar()
