"""The private step: the four hooks, in order, once per logical batch."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pluggy
import torch
from torch import Tensor, nn

from dpl.errors import PluginError
from dpl.gradients import GradientSum, PrivateGradient


@dataclass
class RunSetup:
    """What plugins see at setup (``validate_setup``, ``configure_mechanism``)."""

    model: nn.Module
    trainable: dict[str, nn.Parameter]
    plugin_names: list[str]
    num_examples: int
    expected_batch_size: int
    steps: int
    sampling_rate: float
    accountant: str
    optimizer_name: str
    task: str  # "classification" | "generation"
    replaced_hooks: frozenset[str] = frozenset()  # exclusive hooks a named plugin implements (replacing a default)


@dataclass
class StepContext:
    """What the step hooks see. ``per_example_loss(batch) -> Tensor[b]`` runs the model's forward pass."""

    model: nn.Module
    trainable: dict[str, nn.Parameter]
    per_example_loss: Callable[[dict[str, Any]], Tensor]
    max_grad_norm: float
    noise_multiplier: float
    expected_batch_size: int
    step: int
    noise_generator: torch.Generator
    log: Callable[[str, float], None]
    scratch: dict[str, Any] = field(default_factory=dict)  # per-step values shared between hooks (public)


def batch_size_of(batch: dict[str, Any]) -> int:
    for value in batch.values():
        if torch.is_tensor(value):
            return int(value.shape[0])
    raise ValueError("batch has no tensor to read its size from")


def split_batch(batch: dict[str, Any], size: int) -> Iterator[dict[str, Any]]:
    """Physical micro-batches of at most ``size`` examples (one empty batch if ``batch`` is empty)."""
    total = batch_size_of(batch)
    if total == 0:
        yield batch
        return
    for start in range(0, total, size):
        yield {k: v[start:start + size] if torch.is_tensor(v) or isinstance(v, list) else v
               for k, v in batch.items()}


def private_step(hook: pluggy.HookRelay, ctx: StepContext, batch: dict[str, Any],
                 physical_batch_size: int) -> dict[str, Tensor]:
    """Run estimate_gradient (per micro-batch, summed), privatize, post_process and precondition.

    Returns the update direction per trainable parameter. The clipped sum is wiped once privatize returns.
    """
    total: GradientSum | None = None
    for micro in split_batch(batch, physical_batch_size):
        part = hook.estimate_gradient(ctx=ctx, batch=micro)
        if part is None:
            raise PluginError("no plugin answered estimate_gradient")
        total = part if total is None else total.add_(part)
    private: PrivateGradient | None = hook.privatize(ctx=ctx, gradient_sum=total)
    total.wipe()
    if private is None:
        raise PluginError("no plugin answered privatize")
    del total
    hook.post_process(ctx=ctx, gradient=private)
    direction = hook.precondition(ctx=ctx, gradient=private)
    return private.values if direction is None else direction
