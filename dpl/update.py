"""Applying the update direction that ``precondition`` returns to the parameters."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn


def apply_direction(optimizer: torch.optim.Optimizer, trainable: Mapping[str, nn.Parameter],
                    direction: Mapping[str, Tensor]) -> None:
    """Write ``direction[name]`` into each trainable parameter's ``.grad`` and take one optimizer step."""
    optimizer.zero_grad(set_to_none=True)
    for name, param in trainable.items():
        param.grad = direction[name].to(param.dtype)
    optimizer.step()
