"""Drawing DP noise: the only way plugins should sample from the run's secret noise source.

``normal(shape, source, device, dtype)`` returns i.i.d. N(0, 1) draws from ``source``, which is either

* a ``torch.Generator`` (default: its whole Mersenne-Twister state filled from OS entropy by
  :func:`dpl.core.sampling.secure_generator`), fast, reproducible when the user sets ``privacy.seed``; or
* a :class:`SecureNormal` (``privacy.secure_noise: true``): a ChaCha20 keystream (``cryptography``) under a fresh
  256-bit key from ``os.urandom`` for every draw, cut into 52-bit uniforms and turned into Gaussians by the
  Box-Muller transform in float64, then rounded once to the requested precision. Not reproducible, holds no state
  to leak, about twice the default generator's cost (``benchmarks/noise_cost.py``).

Floating-point attacks (Mironov 2012; Jin et al. 2022) exploit that a sampler's outputs are a sparse, uneven set
of floats at the precision the noise is used in. The float64 draws are rounded to float32 (or bfloat16/float16):
each float32 value with magnitude in [2^-60, 8.4] is reached by many float64 draws, with the Gaussian's
probability for its rounding cell up to float64 rounding errors, so the output precision shows no holes to
exploit. Where noise is asked for in float64 itself, ``normal`` returns the sum of four draws divided by two, the
mitigation opacus' secure mode uses at the sampling precision (Holohan & Braghin 2021). See docs/privacy.md.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from contextlib import contextmanager

import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from torch import Tensor

_MANTISSA = (1 << 52) - 1
_ONE = 0x3FF0_0000_0000_0000  # bit pattern of the float64 1.0: OR-ed with 52 random mantissa bits, a value in [1, 2)


class SecureNormal:
    """A stateless CSPRNG Gaussian source (nothing to checkpoint, nothing to leak)."""

    pairs = 1 << 15  # Box-Muller pairs per keystream block (512 KiB: the block's work stays in cache)

    def __repr__(self) -> str:
        return "SecureNormal(ChaCha20 keyed from os.urandom, float64 Box-Muller)"

    def standard_normal(self, n: int, dtype: torch.dtype = torch.float64) -> Tensor:
        """n independent draws of N(0, 1), computed in float64 and rounded once to ``dtype``."""
        out = torch.empty(n, dtype=dtype)
        stream = Cipher(algorithms.ChaCha20(os.urandom(32), bytes(16)), mode=None).encryptor()
        zeros, block = bytes(16 * self.pairs), bytearray(16 * self.pairs)
        bits = torch.frombuffer(block, dtype=torch.int64)
        radius, trig = torch.empty(self.pairs, dtype=torch.float64), torch.empty(self.pairs, dtype=torch.float64)
        with _one_thread():  # cache-sized blocks: forking threads for each operation costs more than it saves
            for start in range(0, n, 2 * self.pairs):  # block: cosines to out[start:][:m], then sines
                m = min(self.pairs, (n - start + 1) // 2)
                stream.update_into(memoryview(zeros)[:16 * m], block)
                uniform = bits[:2 * m].bitwise_and_(_MANTISSA).bitwise_or_(_ONE).view(torch.float64)  # [1, 2)
                r, angle = radius[:m], uniform[m:].mul_(2.0 * math.pi)  # cos(2 pi x), x in [1, 2): uniform angle
                torch.neg(uniform[:m], out=r).add_(2.0).log_().mul_(-2.0).sqrt_()  # sqrt(-2 ln u), u in (0, 1]
                for fn, first, count in ((torch.cos, start, m), (torch.sin, start + m, min(m, n - start - m))):
                    torch.mul(r[:count], fn(angle[:count], out=trig[:count]), out=out[first:first + count])
        return out


@contextmanager
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


NoiseSource = torch.Generator | SecureNormal


def normal(shape: Sequence[int] | torch.Size, source: NoiseSource, device: torch.device | str | None = None,
           dtype: torch.dtype = torch.float32) -> Tensor:
    """i.i.d. N(0, 1) of ``shape`` from the run's secret noise ``source`` (see the module docstring)."""
    shape = torch.Size(shape)
    if isinstance(source, SecureNormal):
        n = shape.numel()
        if dtype == torch.float64:  # noise used at the sampling precision: sum four draws (opacus' secure mode)
            values = source.standard_normal(n)
            for _ in range(3):
                values += source.standard_normal(n)
            values.mul_(0.5)
        else:
            values = source.standard_normal(n, dtype)
        return values.reshape(shape).to(device=device)
    if not isinstance(source, torch.Generator):
        raise TypeError(f"not a noise source: {type(source).__name__}")
    return torch.randn(shape, generator=source, device=device if device is not None else source.device,
                       dtype=dtype)
