"""Drawing DP noise: the only way plugins should sample from the run's secret noise source.

``normal(shape, source, device, dtype)`` returns i.i.d. N(0, 1) draws from ``source``, one of

* :class:`KeyedNormal` (the default on the CPU): a ChaCha20 keystream (``cryptography``, i.e. OpenSSL) under a
  256-bit secret key from ``os.urandom`` (derived from ``privacy.seed`` when the user sets one); draw number t
  uses nonce t, so each draw is a function of (key, t) alone and the state to checkpoint (secret sidecar) or to
  share between DDP ranks is the key and the counter;
* :class:`SecureNormal` (``privacy.secure_noise: true``): the same stream under a fresh key from ``os.urandom``
  for every draw: nothing to checkpoint or leak, never reproducible;
* a ``torch.Generator`` (the default on CUDA: Philox with a 64-bit key from ``secrets``), drawn in float64 and
  rounded once to the requested precision.

Tails. Box-Muller turns a uniform u into the radius sqrt(-2 ln u), so the largest value a sampler can return is
set by its smallest uniform. torch's float32 ``randn`` builds u from 24 random bits on the CPU (32 on CUDA): its
values never exceed 5.77 (6.77 on CUDA) standard deviations. Noise cut there has a bounded support, and an output
near the edge is possible under one neighbouring dataset and impossible under the other: a privacy loss of
infinity with probability about phi(5.77) * ||g||_1 / (sigma C) = 2.4e-8 * ||g||_1 / (sigma C) per step, far
above a typical delta for a large model. ``tests/test_noise.py`` shows torch's float32 uniforms on that grid.
Every source here builds u from 52 (torch float64: 53) bits: tails reach 8.49 standard deviations.

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
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from torch import Tensor

_MANTISSA = (1 << 52) - 1
_ONE = 0x3FF0_0000_0000_0000  # bit pattern of the float64 1.0: OR-ed with 52 random mantissa bits, a value in [1, 2)
_PAIRS = 1 << 15  # Box-Muller pairs per keystream block (512 KiB: the block's work stays in cache)
_BLOCKS = 16 * _PAIRS // 64  # ChaCha20 blocks (64 bytes) per keystream block
_KEY_BYTES = 32
_MAX_DRAW = (1 << 32) * 64 // 16 * 2  # values per nonce: ChaCha20's 32-bit block counter, 16 bytes per pair


def _gaussians(key: bytes, nonce: int, n: int, dtype: torch.dtype) -> Tensor:
    """n draws of N(0, 1) from the ChaCha20 keystream of (key, nonce): 52-bit uniforms, Box-Muller in float64,
    each value rounded once to ``dtype``. Block k (``_PAIRS`` pairs) starts at ChaCha20 block ``k * _BLOCKS``, so the
    blocks can be computed by several threads (torch's thread count) with the same result as by one."""
    if n > _MAX_DRAW:
        raise ValueError(f"one noise draw is limited to {_MAX_DRAW:,} values, asked for {n:,}")
    out = torch.empty(n, dtype=dtype)
    blocks = -(-n // (2 * _PAIRS))
    workers = max(1, min(torch.get_num_threads(), blocks // _BLOCKS_PER_WORKER))
    spans = [(blocks * w // workers, blocks * (w + 1) // workers) for w in range(workers)]

    def fill(first: int, last: int) -> None:
        # cryptography's 16-byte ChaCha20 nonce: a 32-bit little-endian block counter, then the 96-bit nonce
        counter = (first * _BLOCKS).to_bytes(4, "little")
        stream = Cipher(algorithms.ChaCha20(key, counter + nonce.to_bytes(12, "little")), mode=None).encryptor()
        size = min(_PAIRS, (n + 1) // 2)
        zeros, block = bytes(16 * size), bytearray(16 * size)
        bits = torch.frombuffer(block, dtype=torch.int64)
        radius, trig = torch.empty(size, dtype=torch.float64), torch.empty(size, dtype=torch.float64)
        for start in range(2 * _PAIRS * first, min(n, 2 * _PAIRS * last), 2 * _PAIRS):
            m = min(_PAIRS, (n - start + 1) // 2)
            stream.update_into(memoryview(zeros)[:16 * m], block)
            box_muller(bits[:2 * m], out[start:start + 2 * m], radius, trig)

    with _one_thread():  # cache-sized blocks: forking threads for each operation costs more than it saves
        if workers == 1:
            fill(0, blocks)
        else:
            for done in [_pool(workers).submit(fill, *span) for span in spans]:
                done.result()
    return out


_BLOCKS_PER_WORKER = 4  # a worker gets at least 4 blocks (262,144 values): below that a thread costs more than it saves
_POOLS: dict[int, ThreadPoolExecutor] = {}
os.register_at_fork(after_in_child=_POOLS.clear)  # a forked child has none of the parent's threads


def _pool(workers: int) -> ThreadPoolExecutor:
    """A persistent pool of ``workers`` threads (started once: starting threads for every draw is slower than the
    draw of a typical parameter tensor)."""
    if workers not in _POOLS:
        _POOLS[workers] = ThreadPoolExecutor(workers, thread_name_prefix="dpl-noise")
    return _POOLS[workers]


def box_muller(bits: Tensor, out: Tensor, radius: Tensor | None = None, trig: Tensor | None = None) -> Tensor:
    """Turn 2m random int64 words (consumed) into Gaussians: ``out[:m]`` the cosines, ``out[m:]`` the sines (one
    fewer when ``out`` is odd-sized). Word i < m gives u = 2 - [1, 2) in (0, 1] from 52 bits (radius
    sqrt(-2 ln u) <= sqrt(104 ln 2) = 8.49), word m + i the angle. ``radius``/``trig``: float64 scratch of >= m."""
    m = bits.numel() // 2
    radius = torch.empty(m, dtype=torch.float64) if radius is None else radius[:m]
    trig = torch.empty(m, dtype=torch.float64) if trig is None else trig
    uniform = bits.bitwise_and_(_MANTISSA).bitwise_or_(_ONE).view(torch.float64)  # [1, 2)
    angle = uniform[m:].mul_(2.0 * math.pi)  # cos(2 pi x), x in [1, 2): a uniform angle
    torch.neg(uniform[:m], out=radius).add_(2.0).log_().mul_(-2.0).sqrt_()  # sqrt(-2 ln u), u in (0, 1]
    for fn, first, count in ((torch.cos, 0, m), (torch.sin, m, min(m, out.numel() - m))):
        torch.mul(radius[:count], fn(angle[:count], out=trig[:count]), out=out[first:first + count])
    return out


class KeyedNormal:
    """The run's secret Gaussian source: ChaCha20 under a secret 256-bit key, one nonce per draw (a counter).

    ``get_state``/``set_state`` carry the key and the counter (a uint8 tensor, secret: it determines all the
    noise), like a ``torch.Generator``'s, so resume, DDP synchronisation and FTRL's replay treat both alike.
    """

    def __init__(self, key: bytes | None = None, device: torch.device | str = "cpu") -> None:
        self._key = os.urandom(_KEY_BYTES) if key is None else bytes(key)
        if len(self._key) != _KEY_BYTES:
            raise ValueError(f"a KeyedNormal key has {_KEY_BYTES} bytes, got {len(self._key)}")
        self.draws = 0
        self.device = torch.device(device)

    def __repr__(self) -> str:
        return f"KeyedNormal(ChaCha20, secret key, draw {self.draws})"

    def standard_normal(self, n: int, dtype: torch.dtype = torch.float64) -> Tensor:
        """n independent draws of N(0, 1), computed in float64 and rounded once to ``dtype``."""
        values = _gaussians(self._key, self.draws, n, dtype)
        self.draws += 1
        return values

    def get_state(self) -> Tensor:
        return torch.tensor(list(self._key + self.draws.to_bytes(8, "little")), dtype=torch.uint8)

    def set_state(self, state: Tensor) -> None:
        raw = bytes(state.to(torch.uint8).tolist())
        if len(raw) != _KEY_BYTES + 8:
            raise ValueError("not a KeyedNormal state (a checkpoint from a dpl whose noise came from torch's "
                             "float32 generator cannot continue its noise stream: resume without the .secret sidecar)")
        self._key, self.draws = raw[:_KEY_BYTES], int.from_bytes(raw[_KEY_BYTES:], "little")


class SecureNormal:
    """A stateless CSPRNG Gaussian source (nothing to checkpoint, nothing to leak): a fresh key every draw."""

    device = torch.device("cpu")

    def __repr__(self) -> str:
        return "SecureNormal(ChaCha20 keyed from os.urandom, float64 Box-Muller)"

    def standard_normal(self, n: int, dtype: torch.dtype = torch.float64) -> Tensor:
        """n independent draws of N(0, 1), computed in float64 and rounded once to ``dtype``."""
        return _gaussians(os.urandom(_KEY_BYTES), 0, n, dtype)


@contextmanager
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


StatefulSource = KeyedNormal | torch.Generator  # sources with get_state/set_state (replayable, checkpointed)
NoiseSource = StatefulSource | SecureNormal


def noise_source(key: bytes | None, device: torch.device | str = "cpu") -> StatefulSource:
    """The run's secret noise source on ``device``: a CUDA (Philox) generator keyed with 64 bits of ``key``
    (``None``: fresh from ``os.urandom``), drawn in float64; elsewhere (CPU, or a device without float64 such as
    MPS) a :class:`KeyedNormal` under ``key`` whose draws are moved to ``device``."""
    device = torch.device(device)
    if device.type != "cuda":
        return KeyedNormal(key, device)
    gen = torch.Generator(device=device)
    gen.manual_seed(int.from_bytes((os.urandom(_KEY_BYTES) if key is None else key)[:8], "little") >> 1)
    return gen


def replay_source(source: StatefulSource, state: Tensor) -> StatefulSource:
    """A new source of ``source``'s kind at ``state`` (from its ``get_state``): it draws what ``source`` drew then."""
    copy: StatefulSource
    copy = KeyedNormal(device=source.device) if isinstance(source, KeyedNormal) else torch.Generator(source.device)
    copy.set_state(state)
    return copy


def normal(shape: Sequence[int] | torch.Size, source: NoiseSource, device: torch.device | str | None = None,
           dtype: torch.dtype = torch.float32) -> Tensor:
    """i.i.d. N(0, 1) of ``shape`` from the run's secret noise ``source`` (see the module docstring)."""
    shape = torch.Size(shape)
    if isinstance(source, KeyedNormal | SecureNormal):
        n = shape.numel()
        if dtype == torch.float64:  # noise used at the sampling precision: sum four draws (opacus' secure mode)
            values = source.standard_normal(n)
            for _ in range(3):
                values += source.standard_normal(n)
            values.mul_(0.5)
        else:
            values = source.standard_normal(n, dtype)
        return values.reshape(shape).to(device=device if device is not None else source.device)
    if not isinstance(source, torch.Generator):
        raise TypeError(f"not a noise source: {type(source).__name__}")
    # float64 draws (53-bit uniforms), rounded once: torch's float32 randn has tails cut at 5.77 sigma (CPU)
    values = torch.randn(shape, generator=source, device=device if device is not None else source.device,
                         dtype=torch.float64)
    return values if dtype == torch.float64 else values.to(dtype)
