"""Default ``estimate_gradient``: per-example gradients by backpropagation, clipped to norm C, summed. Under
user-level sampling (``privacy.unit: user``, ``user_sampling: users``) the unit is a user: the mean of its rows'
gradients is clipped to C as one vector. With ``privacy.clipping: per_layer`` each group of parameters is clipped to
its own threshold C_g (sum_g C_g^2 = C^2) in the one backward pass; adaptive thresholds move after each step from the
released noisy counts (``post_process`` reads only the release)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from dpl.api import (CLIPPING_COUNTS_KEY, PADDING_KEY, UNITS_KEY, ConfigError, GradientSum, PerExampleClipper,
                     PrivateGradient, ReleaseContext, RunSetup, StepContext, batch_size_of, clipping_policy, hookimpl,
                     unit_sizes)

log = logging.getLogger("dpl")


class ClipPlugin:
    """Per-example clipping with one forward and one backward pass (see :mod:`dpl.core.per_example`)."""

    description = "default estimate_gradient: per-example gradients by backpropagation, each clipped to norm C, summed"

    def __init__(self) -> None:
        self._clipper: PerExampleClipper | None = None
        self.memory = "auto"  # privacy.clipping_memory
        self.budget_mib: float | None = None  # privacy.clipping_memory_budget
        self.groups: list[list[str]] | None = None  # privacy.clipping per_layer: the groups' parameter names
        self.thresholds: list[float] = []  # C_g per group (adaptive: functions of the released counts only)
        self.adaptive: tuple[float, float, float] | None = None  # (quantile, rate, C) of adaptive thresholds

    def _clipper_for(self, model: torch.nn.Module) -> PerExampleClipper:
        clipper = self._clipper
        if clipper is None or clipper.model is not model or clipper.memory != self.memory \
                or clipper.budget_mib != self.budget_mib:
            if clipper is not None:
                clipper.remove()
            self._clipper = PerExampleClipper(model, memory=self.memory, budget_mib=self.budget_mib)
            if self.groups is not None:
                self._clipper.set_groups(self.groups)
        return self._clipper

    def auto_clipper(self, model: torch.nn.Module) -> PerExampleClipper | None:
        """The clipper of flat ``clipping_memory: auto``, whose byte budget ``physical_batch_size: auto`` sets
        (``dpl.core.micro_batch``); None in another mode or under ``clipping: per_layer``."""
        return self._clipper_for(model) if self.memory == "auto" and self.groups is None else None

    def _set_up_groups(self, setup: RunSetup) -> None:
        """``privacy.clipping: per_layer``: the groups and their first thresholds; refused in one line where the
        release could not carry them."""
        privacy = setup.privacy
        if "estimate_gradient" in setup.replaced_hooks:
            raise ConfigError("privacy.clipping per_layer is dpl's default estimate_gradient; a named plugin replaces "
                              "it (use clipping: flat)")
        if privacy.adaptive_clipping and "privatize" in setup.replaced_hooks:
            raise ConfigError("privacy.clipping_thresholds adaptive releases its counts through dpl's default "
                              "privatize; a named plugin replaces it (use fixed thresholds)")
        names = [n for n in self._clipper_for(setup.model).parameter_names]
        groups = clipping_policy.clipping_groups(names, privacy.clipping_groups)
        sizes = [sum(setup.model.get_parameter(n).numel() for n in group) for group in groups]
        self.thresholds = clipping_policy.group_thresholds(privacy.max_grad_norm, sizes, privacy.clipping_split)
        self.groups = groups
        self._clipper.set_groups(groups)
        if privacy.adaptive_clipping:
            self.adaptive = (privacy.clipping_quantile, privacy.clipping_rate, privacy.max_grad_norm)
            if alone := clipping_policy.lora_a_alone(groups):
                log.warning("dpl: privacy.clipping_thresholds adaptive with %d LoRA A matrices in groups without their "
                            "B: on SmolLM2-135M LoRA (E2E) this ran 2.5 BLEU behind flat clipping, A's thresholds "
                            "falling with its near-zero gradients; prefer clipping: flat for LoRA (docs/methods.md: "
                            "which clipping when)", alone)

    @hookimpl(trylast=True)
    def validate_setup(self, setup: RunSetup) -> None:
        if setup.privacy.clipping == "per_layer":
            self._set_up_groups(setup)
        if "estimate_gradient" in setup.replaced_hooks:
            if setup.sharded:
                raise ConfigError("FSDP: only dpl's default estimate_gradient aligns the ranks' forward passes and "
                                  "weighs FSDP's filler examples zero; a plugin replacing it needs strategy ddp")
            return  # another estimator replaces this one
        self.memory, self.budget_mib = setup.clipping_memory, setup.clipping_memory_budget
        if setup.sharded and self.groups is None:  # FSDP: low/auto's second backward pass would gather the sharded
            # parameters again (per_layer needs none: each rank clips its examples' groups in its one pass)
            if self.memory == "low":
                raise ConfigError("FSDP: privacy.clipping_memory low is not supported; use fast or auto")
            self.memory = "fast"
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
            zeros = clipper.zero_sums()
            if self.adaptive is not None:
                zeros[CLIPPING_COUNTS_KEY] = torch.zeros(len(self.thresholds), device=next(iter(zeros.values())).device)
            return GradientSum(zeros, 0)

        def unit_losses(rows: dict[str, Any]) -> torch.Tensor:
            losses = ctx.per_example_loss({k: v for k, v in rows.items() if k != UNITS_KEY})
            if UNITS_KEY in rows:  # a user's gradient is the mean of its rows' gradients, clipped as one unit
                losses = losses / unit_sizes(rows[UNITS_KEY].to(losses.device)).to(losses.dtype)
            return losses

        def reforward(keep: torch.Tensor) -> torch.Tensor:
            index = torch.arange(size)  # every row not kept replaced by a kept one: the same shapes as the first pass
            index[~keep.cpu()] = int(keep.cpu().nonzero()[0, 0])
            picks = index.tolist()
            with _replaying(rng):  # the first pass's dropout masks (see _replaying)
                return unit_losses({k: v if k == UNITS_KEY else v[index.to(v.device)]
                                    if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == size
                                    else [v[i] for i in picks] if isinstance(v, list) and len(v) == size else v
                                    for k, v in batched.items()})

        batched = batch if units is None else {**batch, UNITS_KEY: units}
        with clipper.record(size):
            rng = _generator_states()
            losses = unit_losses(batched)
        if units is not None:
            units = units.to(losses.device)
        if self.groups is not None:
            thresholds = torch.tensor(self.thresholds, dtype=torch.float32, device=losses.device)
            sums, norms, counts = clipper.group_clipped_sum(losses, thresholds, exclude=fillers, units=units)
            if self.adaptive is not None:
                sums[CLIPPING_COUNTS_KEY] = counts
        else:
            sums, norms = clipper.clipped_sum(losses, ctx.max_grad_norm, exclude=fillers, units=units,
                                              reforward=reforward)
        if units is not None:
            return GradientSum(sums, int(norms.numel()))
        return GradientSum(sums, size - (int(fillers.sum()) if fillers is not None else 0))

    @hookimpl(trylast=True)
    def post_process(self, ctx: ReleaseContext, gradient: PrivateGradient) -> None:
        """Adaptive thresholds: one geometric step of each C_g from the released noisy fractions."""
        if self.adaptive is None:
            return
        fractions = gradient.info.get("clipping_fractions")
        if fractions is not None:
            quantile, rate, max_norm = self.adaptive
            self.thresholds = clipping_policy.adapted_thresholds(self.thresholds, fractions, quantile, rate, max_norm)

    def state_dict(self) -> dict[str, Any]:
        """The thresholds (public: functions of the released counts) of adaptive per_layer clipping."""
        return {"thresholds": list(self.thresholds)} if self.adaptive is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("thresholds")
        if self.adaptive is not None and saved is not None:
            if len(saved) != len(self.thresholds):
                raise ConfigError(f"the checkpoint's adaptive clipping has {len(saved)} groups, this run's "
                                  f"{len(self.thresholds)}")
            self.thresholds = [float(c) for c in saved]


def _generator_states() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The states of the default CPU and CUDA generators, which dropout draws from (public randomness: kept in memory
    for one step, never written anywhere)."""
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []


@contextmanager
def _replaying(states: tuple[torch.Tensor, list[torch.Tensor]]) -> Iterator[None]:
    """Run a forward pass again with the generators as they were before the first one, and leave them as they were
    after it. ``low``/``auto`` run a second forward pass only when an example's gradient is not finite (a zero weight
    on it would still make the retained graph's sum NaN): the clip factors come from the first pass, so the second
    must draw the same dropout masks, or an example's clipped gradient ``c_i * g_i'`` would be a gradient its norm
    was never measured on (norm above C). The masks are the same only for the same draws in the same order on tensors
    of the same shapes: the second pass runs on the whole batch, each row not kept replaced by a kept one (its weight
    is zero), and the clipper checks that every kept row's loss is the first pass's, bit for bit. Activation
    checkpointing replays its own segments (``preserve_rng_state``), in both backward passes."""
    cpu, cuda = states
    with torch.random.fork_rng(devices=range(len(cuda))):
        torch.set_rng_state(cpu)
        if cuda:
            torch.cuda.set_rng_state_all(cuda)
        yield
