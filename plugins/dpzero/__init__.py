"""The ``dpzero`` plugin: private zeroth-order fine-tuning without backpropagation (DPZero, and MeZO as its
non-private special case).

Per logical step, with the core's public per-step seed (identical on every DDP rank) and a public direction
z ~ N(0, I) (or independent +-1 signs: ``direction: rademacher``) regenerated tensor by tensor from it
(:mod:`dpl_plugins.dpzero.directions`):

* ``estimate_gradient`` (per micro-batch): theta += mu z, forward; theta -= 2 mu z, forward; the parameters stay
  at theta - mu z (the next micro-batch moves them by +2 mu z, the update by (mu - lr g) z: three passes over
  the parameters per single-micro-batch step, not four). d_i = (l_i(theta + mu z) - l_i(theta - mu z)) / (2 mu)
  per example, clipped to [-C, C] and summed: a ``GradientSum`` with ONE scalar key, sensitivity C. No backward pass, no
  ``.grad``, no stored z.
* ``privatize``: not implemented here. The default ``gaussian`` adds N(0, sigma^2 C^2) to the scalar, drawn from
  the run's secret noise source (never from the direction generator), divides by B, and its Poisson/PRV
  mechanism accounts for it exactly as for DP-SGD.
* ``precondition``: the update direction g * z as a :class:`dpl.core.update.StreamingDirection` (z regenerated tensor
  by tensor), applied in place by plain SGD: theta <- theta - lr * g * z, from theta - mu z in the same pass.

MeZO is the same plugin with ``privacy.noise_multiplier: 0`` and ``privacy.max_grad_norm: .inf``.
``estimator: dpgd0`` is the Algorithm 1 baseline (DPGD-0th) of Zhang et al. (ICML 2024): it clips each example's whole
estimated gradient vector d_i z to norm C and the default ``gaussian`` adds d-dimensional noise.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch import Tensor, nn

from dpl.api import (ConfigError, Contract, GradientSum, PluginError, PrivateGradient, ReleaseContext, RunSetup,
                     UNITS_KEY, StepContext, StreamingDirection, batch_size_of, hookimpl, streaming_refusal)
from dpl_plugins.dpzero.directions import DirectionSampler, Distribution
from dpl_plugins.dpzero.lookups import RowPerturbation, lookup_tables

log = logging.getLogger("dpl")

KEY = "projected_grad"
# Plugins that need a gradient matrix (or per-parameter gradients) and cannot work on a rank-one update.

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
        keep_direction: keep the step's direction z, expanded at its first use, until the update instead of
            drawing it again for each pass: a Gaussian z rounded to bfloat16 (2 bytes per trainable parameter), a
            Rademacher z as int8 signs (1 byte per parameter, exact). Faster where the passes over the parameters
            are a large part of the step (full fine-tuning on a CPU), at that memory (``benchmarks/dpzero_memory.py``
            measures both).
        direction: the distribution of z: ``gaussian`` (N(0, I), as in the DPZero and MeZO papers) or
            ``rademacher`` (independent +-1 signs, SPSA (Spall, IEEE TAC 1992): also E[z z^T] = I; drawn once per step as 1 bit per
            parameter, each pass a table lookup instead of a Gaussian draw). The privacy analysis is the same for
            both: z is public and the release is one clipped scalar.
        sparse_embeddings: perturb a trainable embedding matrix only in the rows each forward pass looks up (the
            other rows cannot change the loss; the update still moves every row): the same step, with most of two
            passes over the matrix saved (:mod:`dpl_plugins.dpzero.lookups` says which tables qualify; a table
            the model reads other than by lookups is found in the first forward pass and stays dense).
    """

    description = "zeroth-order DP fine-tuning: two forward passes along a public random direction, no backward pass"

    def __init__(self, mu: float = 1e-3, estimator: Literal["dpzero", "dpgd0"] = "dpzero",
                 eval_forward: bool = True, keep_direction: bool = False,
                 direction: Distribution = "gaussian", sparse_embeddings: bool = True) -> None:
        if not (isinstance(mu, (int, float)) and math.isfinite(mu) and mu > 0):
            raise ConfigError(f"dpzero: mu must be a finite number > 0, got {mu!r}")
        self.mu = float(mu)
        self.estimator = estimator
        self.eval_forward = bool(eval_forward)
        # Both estimators perturb every parameter in place by a direction drawn per full tensor (no FSDP shards);
        # ``dpzero`` releases one scalar along that public direction.
        self.contract = Contract(rank_one_release=estimator == "dpzero", full_tensors=True,
                                 clips_units=estimator == "dpzero")
        self.keep_direction = bool(keep_direction)
        self.direction = direction
        self.sparse_embeddings = bool(sparse_embeddings)
        self._sampler: DirectionSampler | None = None  # this step's (public) direction
        self._rows: RowPerturbation | None = None  # this step's embedding tables, perturbed row by row
        self._verified: set[str] | None = None  # tables seen to be read only by lookups (None: not checked yet)
        self._tables: tuple[nn.Module, list[str], dict[str, nn.Embedding]] | None = None  # model, trainable, tables
        self._offset = 0.0  # the other parameters sit at theta + offset * z (z: this step's direction)

    def _direction(self, ctx: StepContext | ReleaseContext) -> DirectionSampler:
        """The step's direction sampler, shared by its micro-batches and its update."""
        if self._sampler is None or self._sampler.public_seed != ctx.public_seed:
            if self._offset or (self._rows is not None and self._rows.displaced):
                raise PluginError("dpzero: the parameters are still displaced along the previous step's direction "
                                  "(its update was never applied); the model is off by mu * z")
            self._sampler = DirectionSampler(ctx.public_seed, self.keep_direction, self.direction)
            # (a release context has no model: a step whose update comes first perturbed nothing)
            sparse = self.sparse_embeddings and isinstance(ctx, StepContext)
            tables = self._lookup_tables(ctx) if sparse else {}
            if self._verified is not None:
                tables = {name: module for name, module in tables.items() if name in self._verified}
            self._rows = RowPerturbation(tables, self._sampler)
        return self._sampler

    def _lookup_tables(self, ctx: StepContext) -> dict[str, nn.Embedding]:
        """:func:`lookup_tables` of the step's model, found once per model and set of trainable parameters."""
        names = list(ctx.trainable)
        if self._tables is None or self._tables[0] is not ctx.model or self._tables[1] != names:
            self._tables = (ctx.model, names, lookup_tables(ctx.model, ctx.trainable))
        return self._tables[2]

    # --- setup ------------------------------------------------------------------------------------------
    @hookimpl
    def validate_setup(self, setup: RunSetup) -> None:
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
        """d_i = (l_i(theta + mu z) - l_i(theta - mu z)) / (2 mu).

        The parameters are left at theta - mu z (``self._offset``): the next micro-batch starts from there, and the
        update moves them back in its own pass (:class:`StreamingDirection`'s ``displaced``), which saves one pass
        over the parameters per micro-batch. Embedding tables move only in the rows each forward pass looks up
        (``self._rows``). On an error everything is restored at once."""
        rows = self._rows
        with torch.no_grad(), no_dropout(ctx.model, self.eval_forward), rows.hooked():
            try:
                sampler.perturb_(self._dense(ctx.trainable), self.mu - self._offset)
                self._offset = rows.target = self.mu
                plus = self._forward_plus(ctx, batch, sampler)
                sampler.perturb_(self._dense(ctx.trainable), -2.0 * self.mu)
                self._offset = rows.target = -self.mu
                minus = ctx.per_example_loss(batch).detach().double()
            except BaseException:
                self._restore(ctx.trainable, sampler)
                raise
        diffs = (plus - minus) / (2.0 * self.mu)
        return torch.where(torch.isfinite(diffs), diffs, torch.zeros_like(diffs))  # non-finite: contributes 0

    def _forward_plus(self, ctx: StepContext, batch: dict[str, Any], sampler: DirectionSampler) -> Tensor:
        """The per-example losses at theta + mu z. The run's first such forward also watches how the row-wise
        tables are read (:class:`~dpl_plugins.dpzero.lookups.WeightUses`): a table that the model reads other than
        by its own module's lookup is moved densely to theta + mu z, perturbed densely from then on, and the
        forward runs again."""
        rows = self._rows
        if self._verified is not None or not rows.tables:
            return ctx.per_example_loss(batch).detach().double()
        with rows.watching() as uses:
            plus = ctx.per_example_loss(batch).detach().double()
        self._verified = set(rows.tables) - uses.read_directly
        if not uses.read_directly:
            return plus
        log.info("dpl: dpzero perturbs %s densely: the model reads it other than by embedding lookups",
                 ", ".join(sorted(uses.read_directly)))
        moved = {name: rows.tables[name].weight for name in sorted(uses.read_directly)}
        rows.drop(moved)
        sampler.perturb_(moved, self.mu)  # at theta + mu z, like every other dense parameter
        return ctx.per_example_loss(batch).detach().double()

    def _dense(self, params: dict[str, nn.Parameter]) -> dict[str, nn.Parameter]:
        """The parameters perturbed whole (all but the tables perturbed row by row)."""
        return {name: p for name, p in params.items() if name not in self._rows.tables}

    def _restore(self, params: dict[str, nn.Parameter], sampler: DirectionSampler) -> None:
        """Move the parameters back to theta (an error, or an update that cannot carry the displacement)."""
        if self._offset:
            sampler.perturb_(self._dense(params), -self._offset)
            self._offset = 0.0
        self._rows.restore()

    @hookimpl
    def estimate_gradient(self, ctx: StepContext, batch: dict[str, Any]) -> GradientSum:
        sampler = self._direction(ctx)
        batch = dict(batch)
        units = batch.pop(UNITS_KEY, None)  # user-level sampling: the user of every row
        size = batch_size_of(batch)
        device = next(iter(ctx.trainable.values())).device
        if self.estimator == "dpgd0":
            if units is not None:
                raise ConfigError("dpzero: estimator dpgd0 does not support user-level sampling")
            return self._dpgd0(ctx, batch, sampler, size)
        if size == 0:
            return GradientSum({KEY: torch.zeros(1, dtype=torch.float64, device=device)}, 0)
        diffs = self._finite_differences(ctx, batch, sampler)
        if units is not None:  # a user's difference is the mean of its rows', clipped as one unit
            _, inverse, counts = torch.unique_consecutive(units.to(diffs.device), return_inverse=True,
                                                          return_counts=True)
            diffs = torch.zeros(counts.numel(), dtype=diffs.dtype, device=diffs.device).index_add_(
                0, inverse, diffs) / counts.to(diffs.dtype)
        clipped = diffs.clamp(-ctx.max_grad_norm, ctx.max_grad_norm)
        return GradientSum({KEY: clipped.sum().reshape(1).to(device)}, int(diffs.numel()))

    def _dpgd0(self, ctx: StepContext, batch: dict[str, Any], sampler: DirectionSampler, size: int) -> GradientSum:
        """DPGD-0th: clip each example's vector d_i z to norm C (a per-example scalar factor), sum: s * z."""
        if size == 0:
            scale = 0.0
        else:
            diffs = self._finite_differences(ctx, batch, sampler)
            self._restore(ctx.trainable, sampler)  # the update goes through .grad and the optimizer
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
        sampler, self._sampler = self._direction(ctx), None  # the update holds it until applied
        self._rows.restore()  # the embedding rows are back at theta exactly; the rest moves back in the update's pass
        params = ctx.trainable
        displaced = dict.fromkeys(self._dense(params), self._offset)
        self._offset = 0.0
        return StreamingDirection(list(params), lambda name: sampler.z(name, params[name]),
                                  lambda name: sampler.chunks(name, params[name]), scale=g, displaced=displaced)

    # --- state --------------------------------------------------------------------------------------------
    # Nothing to keep: the direction seed is the core's public per-step seed (checkpointed by the core), and the
    # noise comes from the core's secret noise source. So there is no secret state and no public state.
