"""Applying the update direction that ``precondition`` returns to the parameters.

Two paths:

* a plain mapping ``{name: tensor}`` (every estimator but DPZero): the tensors are written into the parameters'
  ``.grad`` and the configured torch optimizer takes one step, whatever it is (SGD, AdamW, ...);
* a :class:`StreamingDirection` (DPZero): a lazy direction whose tensors are produced one at a time on demand and
  never held together. It is applied tensor by tensor, in place, with the parameter group's learning rate (and
  weight decay), so no ``.grad`` buffer and no second copy of the parameters is ever allocated. This is only
  possible for optimizers without per-parameter state: plain SGD. :func:`streaming_refusal` says why another
  optimizer cannot be used; plugins that return a streaming direction call it at setup.

A streaming direction may also undo a displacement in the same pass: a zeroth-order estimator that leaves the
parameters at ``theta + displaced * u`` after its last forward pass (``u`` the direction it streams) saves the pass
that would move them back, and the update moves them from there (:class:`StreamingDirection`'s ``displaced``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn

from dpl.errors import ConfigError
from dpl.core.sharding import as_gradient_of


class StreamingDirection(Mapping):
    """An update direction ``scale * u`` computed on demand: ``direction[name]`` calls ``produce(name)`` (a fresh
    tensor of ``u``; nothing is cached) and scales it, so at most one tensor exists at a time when it is applied.

    ``displaced``: the parameters currently sit at ``theta + displaced * u`` (a zeroth-order estimator left them
    there): one number for all of them, or one per name (names it lacks: not displaced); applying the update
    (:func:`apply_streaming`, the only consumer that knows) moves them back in the same pass. Code that reads the
    tensors through the ``Mapping`` gets the update direction only.

    It is a read-only ``Mapping`` (keys: the trainable parameter names), so code that expects a dict of tensors
    still works, at the cost of materializing each tensor it reads.
    """

    def __init__(self, names: Sequence[str], produce: Callable[[str], Tensor],
                 pieces: Callable[[str], Iterator[tuple[int, Tensor]]] | None = None, *, scale: float = 1.0,
                 displaced: float | Mapping[str, float] = 0.0) -> None:
        self._names = list(names)
        self._known = set(self._names)
        self._produce = produce
        self._pieces = pieces
        self.scale = float(scale)
        self.displaced = dict(displaced) if isinstance(displaced, Mapping) else float(displaced)

    def pieces(self, name: str) -> Iterator[tuple[int, Tensor]]:
        """``(flat offset, flat piece of u)`` pairs that tile ``u[name].reshape(-1)`` in order (``u``, not
        ``scale * u``): a producer that can make a large tensor in pieces (``pieces=``) bounds the transient memory to
        one piece."""
        if name not in self._known:
            raise KeyError(name)
        if self._pieces is None:
            yield 0, self._produce(name).reshape(-1)
        else:
            yield from self._pieces(name)

    def displacement(self, name: str) -> float:
        """How far along ``u`` parameter ``name`` currently sits from ``theta``."""
        if isinstance(self.displaced, dict):
            return float(self.displaced.get(name, 0.0))
        return self.displaced

    def unit(self, name: str) -> Tensor:
        """``u[name]`` (a fresh tensor)."""
        if name not in self._known:
            raise KeyError(name)
        return self._produce(name)

    def __getitem__(self, name: str) -> Tensor:
        unit = self.unit(name)
        return unit if self.scale == 1.0 else unit.mul_(self.scale)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def streaming_refusal(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer`` cannot apply a :class:`StreamingDirection` in place, or ``None`` if it can.

    Supported: ``torch.optim.SGD`` without momentum (any learning rate per group, ``weight_decay``, ``maximize``).
    Momentum, Adam's moments and the like are buffers the size of the parameters, updated from a full gradient:
    exactly the memory a streaming direction exists to avoid.
    """
    name = type(optimizer).__name__
    if type(optimizer) is not torch.optim.SGD:
        return (f"optimizer {name} keeps per-parameter state fed by a full gradient buffer; a streaming update "
                "needs torch.optim.SGD without momentum")
    for group in optimizer.param_groups:
        if group.get("momentum", 0) or group.get("nesterov", False):
            return ("SGD with momentum keeps a momentum buffer the size of the parameters; a streaming update needs "
                    "momentum: 0")
    return None


@torch.no_grad()
def apply_streaming(optimizer: torch.optim.Optimizer, trainable: Mapping[str, nn.Parameter],
                    direction: StreamingDirection) -> None:
    """One plain-SGD step ``p <- p * (1 - lr * wd) - lr * direction[name]`` per parameter, tensor by tensor (piece
    by piece where the direction produces pieces), from ``p = theta + displaced * u`` back to ``theta`` first: one
    pass ``p <- p * (1 - lr * wd) + (-lr * scale - displaced * (1 - lr * wd)) * u`` (plus the decay's own pass).

    Equal (to float rounding) to writing the direction into ``.grad`` and calling ``torch.optim.SGD.step`` with
    ``momentum=0``; ``maximize`` flips the sign. No ``.grad`` is allocated. The optimizer's ``step()`` is then
    called with no gradient set - a no-op for SGD - so that step hooks and LR schedulers see a step.
    """
    inner = getattr(optimizer, "optimizer", optimizer)  # Lightning's LightningOptimizer wraps the torch one
    reason = streaming_refusal(inner)
    if reason is not None:
        raise ConfigError(reason)
    groups = {id(p): group for group in inner.param_groups for p in group["params"]}
    optimizer.zero_grad(set_to_none=True)
    for name, param in trainable.items():
        group = groups.get(id(param))
        if group is None:
            raise ValueError(f"parameter {name} is not in the optimizer")
        lr = float(group["lr"])
        decay = float(group.get("weight_decay", 0.0))
        if decay:
            param.mul_(1.0 - lr * decay)
        alpha = (lr if group.get("maximize", False) else -lr) * direction.scale
        alpha -= direction.displacement(name) * (1.0 - lr * decay)
        if param.is_contiguous():
            flat = param.view(-1)
            for offset, piece in direction.pieces(name):
                flat[offset:offset + piece.numel()].add_(piece.to(param.dtype), alpha=alpha)
                del piece
        else:
            param.add_(direction.unit(name).to(param.dtype), alpha=alpha)
    optimizer.step()


def apply_direction(optimizer: torch.optim.Optimizer, trainable: Mapping[str, nn.Parameter],
                    direction: Mapping[str, Tensor]) -> None:
    """Apply one update: a :class:`StreamingDirection` in place (:func:`apply_streaming`); any other mapping is
    written into each trainable parameter's ``.grad``, the optimizer takes one step, and the ``.grad`` are dropped
    (held until the next update, they would add a model-sized buffer to every later step's peak memory).

    ``optimizer`` may be Lightning's ``LightningOptimizer``: its ``step()`` is what advances the trainer's
    ``global_step`` (and so ``max_steps``) under manual optimization, so dpl always steps through it."""
    if isinstance(direction, StreamingDirection):
        apply_streaming(optimizer, trainable, direction)
        return
    optimizer.zero_grad(set_to_none=True)
    for name, param in trainable.items():
        param.grad = as_gradient_of(param, direction[name])  # FSDP: this rank's slice of the direction
    optimizer.step()
    for param in trainable.values():
        param.grad = None
