"""Drawing DP noise: the only way plugins should sample from the run's secret noise source.

``normal(shape, source, device, dtype)`` returns i.i.d. N(0, 1) draws from ``source``, which is either

* a ``torch.Generator`` (default: its whole Mersenne-Twister state filled from OS entropy by
  :func:`dpl.core.sampling.secure_generator`), fast, reproducible when the user sets ``privacy.seed``; or
* a :class:`SecureNormal` (``privacy.secure_noise: true``): uniform bits from the operating system's CSPRNG
  (``os.urandom``: ChaCha20 in Linux's ``getrandom``), turned into Gaussians by the Box-Muller transform in
  float64, and each returned value the sum of four such draws divided by two - the mitigation opacus' secure
  mode uses against floating-point attacks on sampled Gaussians (Holohan & Braghin 2021). Not reproducible,
  holds no state to leak, slower (measured in ``benchmarks/noise_cost.py``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch
from torch import Tensor


class SecureNormal:
    """A stateless CSPRNG Gaussian source (nothing to checkpoint, nothing to leak)."""

    chunk = 1 << 20  # draws per os.urandom call (8 MiB)

    def __repr__(self) -> str:
        return "SecureNormal(os.urandom, 4-sample sum)"

    @staticmethod
    def _uniform53(n: int) -> Tensor:
        """n uniforms in (0, 1) with 53 random bits each."""
        raw = torch.frombuffer(bytearray(os.urandom(8 * n)), dtype=torch.int64)
        bits = torch.bitwise_right_shift(raw, 11) & ((1 << 53) - 1)  # 53 random bits, non-negative
        return (bits.double() + 0.5) * (2.0 ** -53)

    def _box_muller(self, n: int) -> Tensor:
        half = (n + 1) // 2
        u1, u2 = self._uniform53(half), self._uniform53(half)
        radius = torch.sqrt(-2.0 * torch.log(u1))
        angle = 2.0 * math.pi * u2
        return torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)])[:n]

    def standard_normal(self, n: int) -> Tensor:
        """n draws of N(0, 1) in float64: (z1 + z2 + z3 + z4) / 2."""
        out = torch.empty(n, dtype=torch.float64)
        for start in range(0, n, self.chunk):
            size = min(self.chunk, n - start)
            total = self._box_muller(size)
            for _ in range(3):
                total += self._box_muller(size)
            out[start:start + size] = total.mul_(0.5)
        return out


NoiseSource = torch.Generator | SecureNormal


def normal(shape: Sequence[int] | torch.Size, source: NoiseSource, device: torch.device | str | None = None,
           dtype: torch.dtype = torch.float32) -> Tensor:
    """i.i.d. N(0, 1) of ``shape`` from the run's secret noise ``source`` (see the module docstring)."""
    shape = torch.Size(shape)
    if isinstance(source, SecureNormal):
        return source.standard_normal(shape.numel()).reshape(shape).to(device=device, dtype=dtype)
    if not isinstance(source, torch.Generator):
        raise TypeError(f"not a noise source: {type(source).__name__}")
    return torch.randn(shape, generator=source, device=device if device is not None else source.device,
                       dtype=dtype)
