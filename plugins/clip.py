"""Default ``estimate_gradient``: per-example gradients by backpropagation, clipped to norm C, summed. Under
user-level sampling (``privacy.unit: user``, ``user_sampling: users``) the unit is a user: the mean of its rows'
gradients is clipped to C as one vector."""

from __future__ import annotations

from typing import Any

import torch

from dpl.api import (PADDING_KEY, UNITS_KEY, ConfigError, GradientSum, PerExampleClipper, RunSetup, StepContext,
                     batch_size_of, hookimpl, unit_sizes)


class ClipPlugin:
    """Per-example clipping with one forward and one backward pass (see :mod:`dpl.core.per_example`)."""

    description = "default estimate_gradient: per-example gradients by backpropagation, each clipped to norm C, summed"

    def __init__(self) -> None:
        self._clipper: PerExampleClipper | None = None

    def _clipper_for(self, model: torch.nn.Module) -> PerExampleClipper:
        if self._clipper is None or self._clipper.model is not model:
            if self._clipper is not None:
                self._clipper.remove()
            self._clipper = PerExampleClipper(model)
        return self._clipper

    @hookimpl(trylast=True)
    def validate_setup(self, setup: RunSetup) -> None:
        if "estimate_gradient" in setup.replaced_hooks:
            if setup.sharded:
                raise ConfigError("FSDP: only dpl's default estimate_gradient aligns the ranks' forward passes and "
                                  "weighs FSDP's filler examples zero; a plugin replacing it needs strategy ddp")
            return  # another estimator replaces this one
        clipper = self._clipper_for(setup.model)
        missing = set(setup.trainable) - set(clipper.parameter_names)
        if missing:
            raise ConfigError(f"no per-example gradient for trainable parameters {sorted(missing)[:3]}")
        if setup.sharded:
            generic = clipper.modules_needing_parameter_values()
            if generic:
                raise ConfigError(f"FSDP: per-example gradients of {generic[0]} need its parameter values, which FSDP "
                                  "shards (Linear, Embedding, LayerNorm and RMSNorm work from activations alone); freeze "
                                  "its parameters (finetuning.freeze) or use strategy ddp")

    @hookimpl(trylast=True)
    def estimate_gradient(self, ctx: StepContext, batch: dict[str, Any]) -> GradientSum:
        clipper = self._clipper_for(ctx.model)
        batch = dict(batch)
        fillers = batch.pop(PADDING_KEY, None)  # FSDP: zero-weight examples that align the ranks' passes
        units = batch.pop(UNITS_KEY, None)  # user-level sampling: the user of every row
        size = batch_size_of(batch)
        if size == 0:
            return GradientSum(clipper.zero_sums(), 0)
        with clipper.record(size):
            losses = ctx.per_example_loss(batch)
        if units is not None:  # a user's gradient is the mean of its rows' gradients, clipped as one unit
            units = units.to(losses.device)
            losses = losses / unit_sizes(units).to(losses.dtype)
        sums, norms = clipper.clipped_sum(losses, ctx.max_grad_norm, exclude=fillers, units=units)
        if units is not None:
            return GradientSum(sums, int(norms.numel()))
        return GradientSum(sums, size - (int(fillers.sum()) if fillers is not None else 0))
