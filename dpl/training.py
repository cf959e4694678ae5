"""Private training in a few lines, without Lightning: :class:`PrivateTraining` drives a
:class:`~dpl.core.engine.PrivateEngine` over a model, a per-example loss and the training data.

It sets the engine up (plugins checked, the mechanism configured, sigma calibrated, the plan checked against the
budget), starts it on the model's device, draws every batch with the mechanism's own sampler (Poisson for DP-SGD,
ftrl's shuffled or cyclic order), runs the private step, applies the update (:func:`dpl.core.update.apply_direction`:
a streaming direction such as DPZero's is applied in place) and steps the optimizer. It refuses a step that would
spend more than the budget (:class:`~dpl.errors.BudgetExceeded`). :meth:`PrivateTraining.step` also takes a batch of
the caller's (a benchmark timing one step on a fixed batch).

A run continues where it stopped from :meth:`PrivateTraining.state_dict` (public: the trainable parameters, the
optimizer and scheduler, the engine's plan, history and plugin states) and :meth:`PrivateTraining.secret_state_dict`
(owner-only: the noise and sampler generators, the plugins' secrets), given back as ``state`` and ``secret``.

What it does not do (the Lightning adapter, :class:`~dpl.lightning.module.DPModule`, does): DDP or FSDP, checkpoint
files, the privacy report, validation, logging.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any, Union

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, default_collate

from dpl.core.engine import PrivateEngine
from dpl.core.privacy import PrivacyConfig
from dpl.core.update import apply_direction
from dpl.errors import BudgetExceeded, ConfigError

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
#: a torch optimizer over the trainable parameters, or a factory that builds one from them
OptimizerLike = Union[torch.optim.Optimizer, OptimizerFactory]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


class PrivateTraining:
    """Differentially private training of ``model`` on ``data`` for ``steps`` private steps.

    Args:
        model: the model; its trainable parameters (``requires_grad``) are trained, on the device they are on.
        per_example_loss: ``per_example_loss(batch) -> Tensor[b]``, one loss per example of a collated batch.
        privacy: the privacy settings (epsilon or sigma, delta, C, the expected batch size B, ...).
        data: the training set, a map-style dataset (``len`` and ``data[i]``); or ``None`` with ``num_examples``,
            then ``collate`` receives the sampled indices themselves.
        num_examples: the number of training rows when ``data`` is ``None``.
        collate: turns a list of examples (of indices without ``data``) into a batch, a dict of tensors whose first
            dimension is the example (default: torch's ``default_collate``, for examples that are dicts).
        steps: the planned number of private steps (sigma is calibrated for them).
        optimizer: a torch optimizer over the trainable parameters, or a factory ``params -> optimizer``.
        plugins: plugins to activate, ``{name: options}`` (e.g. ``{"adambc": {}}``).
        trainable: the parameters to train by name (default: every parameter with ``requires_grad``).
        scheduler: optional factory ``optimizer -> LR scheduler``, stepped after every update.
        users: under ``privacy.unit: user``, the user of every training row.
        sampling_rate: the sampling rate, if not ``B / N``.
        log_metric: receives the metrics the plugins log during a step (``name, value``).
        seed_namespace: with ``privacy.seed`` (experiments only), the prefix of the purposes its per-purpose seeds
            are derived for (:class:`~dpl.core.engine.PrivateEngine`), so that a study keeps its own streams.
        probe_batch: under ``privacy.physical_batch_size: auto``, ``probe_batch(b) -> batch``: a collated batch of
            b *public* examples as long as the longest training example may be (e.g. random token ids at the
            tokenizer's ``max_length``), on which the private step is probed to choose the micro-batch
            (:meth:`~dpl.core.engine.PrivateEngine.fit_micro_batch`; never pass training examples).
        probe_tokens: the probe batch's sequence length, for the log line.
        state: continue a run from its :meth:`state_dict` (the same model, data size, privacy settings and plugins;
            a changed plan is refused as a checkpoint's is).
        secret: that run's :meth:`secret_state_dict`: with ``privacy.seed`` the noise and batches continue its
            streams (bit for bit); without it, or with ``None``, they continue from fresh OS entropy (still private).
    """

    def __init__(self, model: nn.Module, per_example_loss: Callable[[dict[str, Any]], Tensor],
                 privacy: PrivacyConfig, *, steps: int, optimizer: OptimizerLike, data: Dataset | Sequence | None = None,
                 num_examples: int | None = None, collate: Callable[[list], Any] | None = None,
                 plugins: Mapping[str, Any] | None = None, trainable: Mapping[str, Tensor] | None = None,
                 scheduler: SchedulerFactory | None = None, users: Sequence[Hashable] | None = None,
                 sampling_rate: float | None = None,
                 log_metric: Callable[[str, float], None] | None = None, seed_namespace: str = "",
                 probe_batch: Callable[[int], dict[str, Any]] | None = None, probe_tokens: int | None = None,
                 state: Mapping[str, Any] | None = None, secret: Mapping[str, Any] | None = None) -> None:
        if (data is None) == (num_examples is None):
            raise ConfigError("give the training data or its size (num_examples), not both")
        if data is not None and isinstance(data, dict) and hasattr(data, "column_names"):  # a datasets.DatasetDict
            raise ConfigError(f"data is a DatasetDict (splits: {', '.join(data)}): give the training split, e.g. "
                              f"data['train']")
        if data is not None:
            num_examples = len(data)
        self.model = model
        self.per_example_loss = per_example_loss
        self.data = data
        self.num_examples = int(num_examples)
        self.collate = collate if collate is not None else default_collate
        self.trainable = dict(trainable) if trainable is not None else {
            n: p for n, p in model.named_parameters() if p.requires_grad}
        self.log_metric = log_metric
        self.engine = PrivateEngine(privacy, plugins, seed_namespace=seed_namespace)
        if self.engine.privacy.physical_batch_size == "auto" and probe_batch is None:
            raise ConfigError("privacy.physical_batch_size auto needs probe_batch (b -> a collated batch of b public "
                              "examples at the longest length): the micro-batch is probed on it, never on the data")
        factory = optimizer if not isinstance(optimizer, torch.optim.Optimizer) else _answering(optimizer)
        self.engine.setup(model, num_rows=self.num_examples, steps=steps, trainable=self.trainable,
                          sampling_rate=sampling_rate, optimizer_factory=factory, users=users)
        self.optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer(
            list(self.trainable.values()))
        self.scheduler = scheduler(self.optimizer) if scheduler is not None else None
        self.device = next(iter(self.trainable.values())).device
        if state is not None:
            self._continue(state, secret)
        self.engine.start(self.device)
        if self.engine.privacy.physical_batch_size == "auto":
            self.engine.fit_micro_batch(model=model, trainable=self.trainable, per_example_loss=per_example_loss,
                                        probe_batch=lambda b: _to_device(probe_batch(b), self.device),
                                        tokens=probe_tokens)
        self._sampler = self.engine.batch_sampler()
        self._batches: Iterator[list[int]] | None = None

    # --- continuing a run ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What continues this run and may be shared: the trainable parameters, the optimizer's and scheduler's
        states and the engine's public state (no generator state: :meth:`secret_state_dict` holds those)."""
        return {"trainable": {n: p.detach().clone() for n, p in self.trainable.items()},
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "engine": self.engine.state_dict()}

    def secret_state_dict(self) -> dict[str, Any]:
        """The owner-only part of the run's state: the noise and sampler generators and the plugins' secrets (whoever
        holds it with a released model can subtract the noise; never share it)."""
        return self.engine.secret_state_dict()

    def _continue(self, state: Mapping[str, Any], secret: Mapping[str, Any] | None) -> None:
        saved = state["trainable"]
        if set(saved) != set(self.trainable):
            raise ConfigError(f"the saved run trains other parameters ({len(saved)} saved, {len(self.trainable)} "
                              "here): continue it with the same model and trainable parameters")
        with torch.no_grad():
            for name, p in self.trainable.items():
                p.copy_(saved[name])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.engine.load_state_dict(state["engine"])
        self.engine.load_secret_state_dict(None if secret is None else dict(secret))

    # --- what was spent ---------------------------------------------------------------------------------------
    @property
    def epsilon(self) -> float:
        """Epsilon spent so far (the engine's accountant, at the run's delta)."""
        return self.engine.epsilon()

    @property
    def steps_done(self) -> int:
        return self.engine.steps_done

    @property
    def steps_planned(self) -> int:
        return self.engine.plan.steps

    @property
    def noise_multiplier(self) -> float:
        return float(self.engine.noise_multiplier)

    # --- batches ----------------------------------------------------------------------------------------------
    def next_indices(self) -> list[int]:
        """The rows of the next batch, drawn by the mechanism's sampler (epoch after epoch; may be empty)."""
        for _ in range(2):
            if self._batches is None:
                self._batches = iter(self._sampler)
            try:
                return list(next(self._batches))
            except StopIteration:
                self._batches = None
        raise ConfigError("the mechanism's batch sampler yields no batch")

    def next_batch(self) -> dict[str, Any]:
        """The next batch: the sampled rows collated and moved to the model's device (with the privacy unit of
        every row under user-level sampling)."""
        rows = self.next_indices()
        batch = self.collate(rows if self.data is None else [self.data[i] for i in rows])
        if not isinstance(batch, dict):
            raise ConfigError(f"collate must return a dict of per-example tensors, got {type(batch).__name__}")
        return _to_device(self.engine.tag(batch, rows), self.device)

    # --- training ---------------------------------------------------------------------------------------------
    def step(self, batch: dict[str, Any] | None = None) -> None:
        """One private step: on ``batch`` (already collated, e.g. a fixed batch to time; the accounted epsilon
        assumes the mechanism's sampling and does not hold for batches the caller chooses), else on the next batch
        of the mechanism's sampler. Refused with :class:`~dpl.errors.BudgetExceeded` if it would spend more than
        the budget; the update is applied and the scheduler stepped."""
        if self.engine.would_exceed_max_epsilon():
            raise BudgetExceeded(f"a step beyond the {self.steps_done} taken would spend more than the budget "
                                 f"(epsilon {self.engine.privacy.effective_max_epsilon:g}; {self.epsilon:.3f} spent)")
        if batch is None:
            batch = self.next_batch()
        direction = self.engine.step(batch, model=self.model, trainable=self.trainable,
                                     per_example_loss=self.per_example_loss, optimizer=self.optimizer,
                                     log_metric=self.log_metric)
        del batch
        apply_direction(self.optimizer, self.trainable, direction)
        del direction
        if self.scheduler is not None:
            self.scheduler.step()

    def steps(self) -> Iterator[int]:
        """Train the planned steps that remain, yielding the number of steps taken after each (evaluate, log or
        stop between them)."""
        while self.steps_done < self.steps_planned:
            self.step()
            yield self.steps_done

    def run(self) -> float:
        """Train the planned steps that remain; returns the epsilon spent."""
        for _ in self.steps():
            pass
        return self.epsilon


def _answering(optimizer: torch.optim.Optimizer) -> OptimizerFactory:
    """A factory answering ``optimizer`` itself, so that plugins inspect at setup the optimizer that trains."""

    def factory(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return optimizer

    factory.__name__ = type(optimizer).__name__
    return factory


def _to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """``batch`` with its tensors on ``device``."""
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
