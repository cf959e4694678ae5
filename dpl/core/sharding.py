"""Sharded parameters (``DTensor``, as FSDP2 makes them) seen from the private core, in plain torch.

The private step works on full-size tensors (the clipped sum and the release are the same on every rank); these
helpers give plugins full parameter values (:class:`FullParameters`) and turn a full-size update direction into
this rank's shard of it (:func:`as_gradient_of`). Without sharded parameters they are the identity.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import Tensor


def _dtensor_type():
    from torch.distributed.tensor import DTensor

    return DTensor


def is_sharded(param: Tensor) -> bool:
    """Whether ``param`` is a sharded (``DTensor``) parameter."""
    return isinstance(param, _dtensor_type())


def as_gradient_of(param: Tensor, full: Tensor) -> Tensor:
    """``full`` (a full-size tensor, identical on every rank) as the gradient of ``param``: itself for a plain
    parameter; this rank's slice, as a ``DTensor`` with ``param``'s placements, for a sharded one."""
    if not is_sharded(param):
        return full.to(param.dtype)
    DTensor = _dtensor_type()
    mesh = param.device_mesh
    local = param.to_local()
    piece = full
    coordinate = mesh.get_coordinate()
    for mesh_dim, placement in enumerate(param.placements):
        if placement.is_shard():
            chunks = torch.chunk(piece, mesh.size(mesh_dim), dim=placement.dim)
            index = coordinate[mesh_dim]
            piece = chunks[index] if index < len(chunks) else piece.narrow(placement.dim, 0, 0)
    if tuple(piece.shape) != tuple(local.shape):
        raise RuntimeError(f"dpl: cannot slice a {tuple(full.shape)} gradient into this rank's shard "
                           f"{tuple(local.shape)} (placements {param.placements})")
    piece = piece.to(device=local.device, dtype=local.dtype).contiguous()
    return DTensor.from_local(piece, mesh, param.placements, shape=param.shape, stride=param.stride())


class FullParameters(Mapping):
    """The trainable parameters as plugins see them: full values. A sharded parameter is gathered on first access
    (a collective: every rank must read the same keys in the same order, which holds in the hooks after
    ``privatize``, where every rank processes the same release) and cached for the step."""

    def __init__(self, params: Mapping[str, Tensor]) -> None:
        self._params = dict(params)
        self._full: dict[str, Tensor] = {}

    def __getitem__(self, name: str) -> Tensor:
        param = self._params[name]
        if not is_sharded(param):
            return param
        if name not in self._full:
            self._full[name] = param.detach().full_tensor()
        return self._full[name]

    def __contains__(self, name: object) -> bool:
        return name in self._params

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


def full_parameters(trainable: dict[str, Tensor]) -> Mapping[str, Tensor]:
    """``trainable`` itself, or its :class:`FullParameters` view when a parameter is sharded."""
    return FullParameters(trainable) if any(is_sharded(p) for p in trainable.values()) else trainable
