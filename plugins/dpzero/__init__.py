"""The ``dpzero`` plugin: private zeroth-order fine-tuning without backpropagation (DPZero, and MeZO as its
non-private special case).

Per logical step, with the core's public per-step seed (identical on every DDP rank) and a public direction
z ~ N(0, I) regenerated tensor by tensor from it (:mod:`dpl_plugins.dpzero.directions`):

* ``estimate_gradient`` (per micro-batch): theta += mu z, forward; theta -= 2 mu z, forward; theta += mu z
  (restores theta to float rounding). d_i = (l_i(theta + mu z) - l_i(theta - mu z)) / (2 mu) per example,
  clipped to [-C, C] and summed: a ``GradientSum`` with ONE scalar key, sensitivity C. No backward pass, no
  ``.grad``, no stored z.
* ``privatize``: not implemented here. The default ``gaussian`` adds N(0, sigma^2 C^2) to the scalar, drawn from
  the run's secret noise source (never from the direction generator), divides by B, and its Poisson/PRV
  mechanism accounts for it exactly as for DP-SGD.
* ``precondition``: the update direction g * z as a :class:`dpl.core.update.StreamingDirection` (z regenerated tensor
  by tensor), applied in place by plain SGD: theta <- theta - lr * g * z.

MeZO is the same plugin with ``privacy.noise_multiplier: 0`` and ``privacy.max_grad_norm: .inf``.
``estimator: dpgd0`` is the Algorithm 1 baseline (DPGD-0th) of Zhang et al. (ICML 2024): it clips each example's whole
estimated gradient vector d_i z to norm C and the default ``gaussian`` adds d-dimensional noise.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch import Tensor, nn

from dpl.errors import ConfigError
from dpl.core.gradients import GradientSum, PrivateGradient
from dpl.core.hookspecs import hookimpl
from dpl.core.step import ReleaseContext, RunSetup, StepContext, batch_size_of
from dpl.core.update import StreamingDirection, streaming_refusal
from dpl_plugins.dpzero.directions import DirectionSampler

KEY = "projected_grad"
ESTIMATORS = ("dpzero", "dpgd0")
# Plugins that need a gradient matrix (or per-parameter gradients) and cannot work on a rank-one update.
NEEDS_GRADIENT_MATRIX = {"denoise": "it denoises gradient matrices, and a DPZero update is rank one along a public "
                                    "direction: there is no noisy matrix to denoise"}


@contextlib.contextmanager
def no_dropout(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Both forward passes must evaluate the same function: switch dropout off (eval mode), then restore."""
    if not enabled:
        yield
        return
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


class DPZeroPlugin:
    """DPZero (``estimate_gradient`` + ``precondition``).

    Args:
        mu: perturbation scale (Zhang et al.'s default 1e-3).
        estimator: ``dpzero`` (clip the per-example scalar finite difference; one scalar of noise) or ``dpgd0``
            (baseline: clip the per-example vector d_i z to norm C; d-dimensional noise; the update goes through
            ``.grad`` and any optimizer).
        eval_forward: run the two forward passes in eval mode (dropout off) so that both see the same function,
            as MeZO does. Turning it off makes the finite difference mostly dropout noise.
    """

    def __init__(self, mu: float = 1e-3, estimator: Literal["dpzero", "dpgd0"] = "dpzero",
                 eval_forward: bool = True) -> None:
        if not (isinstance(mu, (int, float)) and math.isfinite(mu) and mu > 0):
            raise ConfigError(f"dpzero: mu must be a finite number > 0, got {mu!r}")
        if estimator not in ESTIMATORS:
            raise ConfigError(f"dpzero: estimator must be one of {', '.join(ESTIMATORS)}, got {estimator!r}")
        self.mu = float(mu)
        self.estimator = estimator
        self.eval_forward = bool(eval_forward)

    # --- setup ------------------------------------------------------------------------------------------
    @hookimpl
    def validate_setup(self, setup: RunSetup) -> None:
        for name in setup.plugin_names:
            if name in NEEDS_GRADIENT_MATRIX:
                raise ConfigError(f"dpzero cannot be combined with {name!r}: {NEEDS_GRADIENT_MATRIX[name]}")
        if setup.sharded:
            raise ConfigError("dpzero perturbs every parameter in place by a direction drawn per full tensor; "
                              "sharded parameters (FSDP) are not supported: use strategy ddp (dpzero keeps no "
                              "gradient or optimizer state to shard)")
        if "privatize" in setup.replaced_hooks:
            raise ConfigError("dpzero releases one scalar per step and is accounted as the default Gaussian "
                              "mechanism; a plugin replacing privatize is not supported with it")
        if self.estimator == "dpzero" and setup.optimizer_factory is not None:
            probe = setup.optimizer_factory([nn.Parameter(torch.zeros(1))])
            reason = streaming_refusal(probe)
            if reason is not None:
                raise ConfigError(f"dpzero applies lr * g * z in place without gradient buffers: {reason}")
        for name, param in setup.trainable.items():
            if not param.is_floating_point():
                raise ConfigError(f"dpzero: trainable parameter {name} is not floating point")

    # --- the step ---------------------------------------------------------------------------------------
    def _finite_differences(self, ctx: StepContext, batch: dict[str, Any], sampler: DirectionSampler) -> Tensor:
        """d_i = (l_i(theta + mu z) - l_i(theta - mu z)) / (2 mu), theta restored afterwards (even on error)."""
        params = ctx.trainable
        offset = 0.0
        with torch.no_grad(), no_dropout(ctx.model, self.eval_forward):
            try:
                sampler.perturb_(params, self.mu)
                offset = self.mu
                plus = ctx.per_example_loss(batch).detach().double()
                sampler.perturb_(params, -2.0 * self.mu)
                offset = -self.mu
                minus = ctx.per_example_loss(batch).detach().double()
            finally:
                if offset:
                    sampler.perturb_(params, -offset)
        diffs = (plus - minus) / (2.0 * self.mu)
        return torch.where(torch.isfinite(diffs), diffs, torch.zeros_like(diffs))  # non-finite: contributes 0

    @hookimpl
    def estimate_gradient(self, ctx: StepContext, batch: dict[str, Any]) -> GradientSum:
        sampler = DirectionSampler(ctx.public_seed)
        size = batch_size_of(batch)
        device = next(iter(ctx.trainable.values())).device
        if self.estimator == "dpgd0":
            return self._dpgd0(ctx, batch, sampler, size)
        if size == 0:
            return GradientSum({KEY: torch.zeros(1, dtype=torch.float64, device=device)}, 0)
        diffs = self._finite_differences(ctx, batch, sampler)
        clipped = diffs.clamp(-ctx.max_grad_norm, ctx.max_grad_norm)
        return GradientSum({KEY: clipped.sum().reshape(1).to(device)}, size)

    def _dpgd0(self, ctx: StepContext, batch: dict[str, Any], sampler: DirectionSampler, size: int) -> GradientSum:
        """DPGD-0th: clip each example's vector d_i z to norm C (a per-example scalar factor), sum: s * z."""
        if size == 0:
            scale = 0.0
        else:
            diffs = self._finite_differences(ctx, batch, sampler)
            key = ("dpzero/z_norm", ctx.public_seed)
            if key not in ctx.scratch:  # public: a function of the public seed only
                ctx.scratch[key] = math.sqrt(sampler.squared_norm(ctx.trainable))
            norms = diffs.abs() * ctx.scratch[key]
            factors = (ctx.max_grad_norm / norms.clamp(min=1e-300)).clamp(max=1.0)
            scale = float((diffs * factors).sum())
        values = {name: sampler.z(name, p).mul_(scale) for name, p in ctx.trainable.items()}
        return GradientSum(values, size)

    @hookimpl
    def precondition(self, ctx: ReleaseContext, gradient: PrivateGradient) -> StreamingDirection | None:
        if self.estimator == "dpgd0":
            return None  # the private gradient (dense) is the direction
        g = float(gradient.values[KEY].reshape(()))  # the DP release: public
        ctx.log("dpzero/projected_grad", g)
        sampler = DirectionSampler(ctx.public_seed)
        params = ctx.trainable

        def produce(name: str) -> Tensor:
            return sampler.z(name, params[name]).mul_(g)

        def pieces(name: str) -> Iterator[tuple[int, Tensor]]:
            for offset, chunk in sampler.chunks(name, params[name]):
                yield offset, chunk.mul_(g)

        return StreamingDirection(list(params), produce, pieces)

    # --- state --------------------------------------------------------------------------------------------
    # Nothing to keep: the direction seed is the core's public per-step seed (checkpointed by the core), and the
    # noise comes from the core's secret noise source. So there is no secret state and no public state.
