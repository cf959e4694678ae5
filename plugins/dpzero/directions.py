"""DPZero's public random direction z ~ N(0, I), regenerated tensor by tensor, never stored.

Each trainable tensor gets its own seed derived from the step's public seed and the parameter's name, and its
slice of z is drawn from one dedicated ``torch.Generator`` reseeded with it. So any tensor of z can be
regenerated alone, in any order, on any DDP rank (the public seed is the same everywhere), and the whole of z
never exists in memory: perturbing, restoring and updating each touch one tensor at a time.

This generator is public (its seed is the core's public per-step seed). It never draws DP noise, and nothing
here ever touches the run's noise generator.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch
from torch import Tensor, nn


def tensor_seed(public_seed: int, name: str) -> int:
    """A 63-bit seed for the slice of z that belongs to parameter ``name`` at this step."""
    digest = hashlib.blake2b(f"dpzero:{int(public_seed)}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class DirectionSampler:
    """Regenerates z for one step: ``z(name, param)`` is the same tensor every time it is asked for."""

    def __init__(self, public_seed: int) -> None:
        self.public_seed = int(public_seed)
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device]

    def z(self, name: str, param: Tensor) -> Tensor:
        gen = self._generator(param.device)
        gen.manual_seed(tensor_seed(self.public_seed, name))
        return torch.randn(param.shape, generator=gen, device=param.device, dtype=param.dtype)

    @torch.no_grad()
    def perturb_(self, params: Mapping[str, nn.Parameter], scale: float) -> None:
        """theta <- theta + scale * z, in place, one tensor at a time."""
        for name, param in params.items():
            param.add_(self.z(name, param), alpha=scale)

    @torch.no_grad()
    def squared_norm(self, params: Mapping[str, nn.Parameter]) -> float:
        """||z||^2 over all trainable tensors (DPGD-0th clips the whole vector d_i * z)."""
        return float(sum(float(self.z(name, p).double().pow(2).sum()) for name, p in params.items()))
