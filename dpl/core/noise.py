"""Drawing DP noise: the only way plugins should sample from the run's secret noise source.

``normal(shape, source, device, dtype)`` returns i.i.d. N(0, 1) draws from ``source`` (``normals(shapes, ...)``:
one per shape, drawn together), one of

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
from collections.abc import Mapping, Sequence
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


def _gaussian_draws(draws: Sequence[tuple[bytes, int, int]], dtype: torch.dtype) -> list[Tensor]:
    """One tensor of N(0, 1) per (key, nonce, n): the ChaCha20 keystream of (key, nonce) as 52-bit uniforms,
    Box-Muller in float64, each value rounded once to ``dtype``. Block k of a draw
    (``_PAIRS`` pairs) starts at ChaCha20 block ``k * _BLOCKS`` of its keystream, so the blocks of all draws are
    shared out among several threads (torch's thread count) as one job, with the same result as by one thread:
    many small draws (a model's biases, norms and matrices) then cost what one draw of their total size costs."""
    for _, _, n in draws:
        if n > _MAX_DRAW:
            raise ValueError(f"one noise draw is limited to {_MAX_DRAW:,} values, asked for {n:,}")
    outs = [torch.empty(n, dtype=dtype) for _, _, n in draws]
    blocks = [(i, k) for i, (_, _, n) in enumerate(draws) for k in range(-(-n // (2 * _PAIRS)))]
    sizes = [min(2 * _PAIRS, draws[i][2] - 2 * _PAIRS * k) for i, k in blocks]
    total = sum(sizes)
    workers = max(1, min(torch.get_num_threads(), total // (2 * _PAIRS * _BLOCKS_PER_WORKER)))
    spans, begin, done = [], 0, 0  # contiguous runs of blocks with about total / workers values each
    for j, size in enumerate(sizes):
        done += size
        if done * workers >= total * (len(spans) + 1) or j == len(sizes) - 1:
            spans.append(blocks[begin:j + 1])
            begin = j + 1

    def fill(span: list[tuple[int, int]], most: int) -> None:
        block = bytearray(16 * _PAIRS * most)
        bits = torch.frombuffer(block, dtype=torch.int64)
        radius = torch.empty(_PAIRS * most, dtype=torch.float64)
        trig = torch.empty(_PAIRS * most, dtype=torch.float64)
        stream, at, j = None, None, 0
        while j < len(span):
            i, k = span[j]
            key, nonce, n = draws[i]
            if at != (i, k):  # a new draw, or a run of blocks not starting at this one: position the keystream
                # cryptography's 16-byte ChaCha20 nonce: a 32-bit little-endian block counter, then the 96-bit nonce
                counter = (k * _BLOCKS).to_bytes(4, "little")
                stream = Cipher(algorithms.ChaCha20(key, counter + nonce.to_bytes(12, "little")), mode=None).encryptor()
            start = 2 * _PAIRS * k
            m = min(_PAIRS, (n - start + 1) // 2)
            group = 1  # up to `most` full blocks of this draw in one pass of each operation, as (group, 2m) views
            while (m == _PAIRS and group < most and j + group < len(span) and span[j + group] == (i, k + group)
                   and n - start >= 2 * _PAIRS * (group + 1)):
                group += 1
            stream.update_into(_ZEROS[:16 * m * group], block)
            if group == 1:
                box_muller(bits[:2 * m], outs[i][start:start + 2 * m], radius, trig)
            else:
                box_muller(bits[:2 * m * group].view(group, 2 * m),
                           outs[i][start:start + 2 * m * group].view(group, 2 * m), radius, trig)
            at, j = (i, k + group), j + group

    with _one_thread():  # cache-sized blocks: forking threads for each operation costs more than it saves
        if len(spans) == 1:
            fill(spans[0], 1)
        else:
            for future in [_pool(len(spans)).submit(fill, span, _GROUP) for span in spans]:
                future.result()
    return outs


_TWO = torch.tensor(2.0, dtype=torch.float64)  # 2 - x as one operation (a Python scalar cannot come first)
_GROUP = 8  # full blocks per operation when several threads draw (fewer calls, each of which takes the GIL)
_ZEROS = memoryview(bytes(16 * _PAIRS * _GROUP))  # the plaintext: ChaCha20 of zeros is its keystream
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
    """Turn 2m random int64 words (the last dimension of ``bits``, consumed) into Gaussians along the last dimension
    of ``out``: ``out[..., :m]`` the cosines, ``out[..., m:]`` the sines (one fewer when ``out`` is odd-sized). Word
    i < m gives u = 2 - [1, 2) in (0, 1] from 52 bits (radius sqrt(-2 ln u) <= sqrt(104 ln 2) = 8.49), word m + i
    the angle. ``radius``/``trig``: flat float64 scratch of at least ``bits.numel() / 2`` values."""
    m = bits.shape[-1] // 2
    shape, count = (*bits.shape[:-1], m), bits.numel() // 2
    radius = (torch.empty(count, dtype=torch.float64) if radius is None else radius[:count]).view(shape)
    trig = (torch.empty(count, dtype=torch.float64) if trig is None else trig[:count]).view(shape)
    uniform = bits.bitwise_and_(_MANTISSA).bitwise_or_(_ONE).view(torch.float64)  # [1, 2)
    angle = uniform[..., m:].mul_(2.0 * math.pi)  # cos(2 pi x), x in [1, 2): a uniform angle
    torch.sub(_TWO, uniform[..., :m], out=radius).log_().mul_(-2.0).sqrt_()  # sqrt(-2 ln u), u in (0, 1]
    for fn, first, size in ((torch.cos, 0, m), (torch.sin, m, min(m, out.shape[-1] - m))):
        torch.mul(radius[..., :size], fn(angle[..., :size], out=trig[..., :size]), out=out[..., first:first + size])
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
        return self.standard_normals([n], dtype)[0]

    def standard_normals(self, sizes: Sequence[int], dtype: torch.dtype = torch.float64) -> list[Tensor]:
        """One draw per size, equal to successive :meth:`standard_normal` calls, computed together."""
        values = _gaussian_draws([(self._key, self.draws + i, n) for i, n in enumerate(sizes)], dtype)
        self.draws += len(sizes)
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
        return self.standard_normals([n], dtype)[0]

    def standard_normals(self, sizes: Sequence[int], dtype: torch.dtype = torch.float64) -> list[Tensor]:
        """One draw per size, each under a fresh key, computed together."""
        return _gaussian_draws([(os.urandom(_KEY_BYTES), 0, n) for n in sizes], dtype)


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
    gen.manual_seed(philox_seed(key))
    return gen


def philox_seed(key: bytes | None) -> int:
    """The 64-bit seed of a CUDA (Philox) generator from the first 8 bytes of ``key`` (``None``: ``os.urandom``):
    all 64 bits, as an unsigned integer (``manual_seed`` takes 0 to 2^64 - 1)."""
    return int.from_bytes((os.urandom(_KEY_BYTES) if key is None else key)[:8], "little")


def rekey_(source: NoiseSource) -> None:
    """Re-key ``source`` in place from OS entropy (a seeded run continued without its secret state: its generators,
    made again from the seed, would draw the noise of its first steps a second time)."""
    if isinstance(source, KeyedNormal):
        source.set_state(KeyedNormal().get_state())
    elif isinstance(source, torch.Generator):
        source.manual_seed(philox_seed(None))


def replay_source(source: StatefulSource, state: Tensor) -> StatefulSource:
    """A new source of ``source``'s kind at ``state`` (from its ``get_state``): it draws what ``source`` drew then."""
    copy: StatefulSource
    copy = KeyedNormal(device=source.device) if isinstance(source, KeyedNormal) else torch.Generator(source.device)
    copy.set_state(state)
    return copy


def normal(shape: Sequence[int] | torch.Size, source: NoiseSource, device: torch.device | str | None = None,
           dtype: torch.dtype = torch.float32) -> Tensor:
    """i.i.d. N(0, 1) of ``shape`` from the run's secret noise ``source`` (see the module docstring)."""
    return normals([shape], source, device, dtype)[0]


def normals(shapes: Sequence[Sequence[int] | torch.Size], source: NoiseSource,
            device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> list[Tensor]:
    """``[normal(shape, source, device, dtype) for shape in shapes]``, the same values, drawn together: the
    ChaCha20 sources share the blocks of all draws among their threads (a model's many small tensors cost what one
    tensor of their total size costs)."""
    shapes = [torch.Size(shape) for shape in shapes]
    if isinstance(source, KeyedNormal | SecureNormal):
        target = device if device is not None else source.device
        if dtype == torch.float64:  # noise used at the sampling precision: sum four draws (opacus' secure mode)
            drawn = []
            for shape in shapes:
                values = source.standard_normal(shape.numel())
                for _ in range(3):
                    values += source.standard_normal(shape.numel())
                drawn.append(values.mul_(0.5))
        else:
            drawn = source.standard_normals([shape.numel() for shape in shapes], dtype)
        return [values.reshape(shape).to(device=target) for values, shape in zip(drawn, shapes)]
    if not isinstance(source, torch.Generator):
        raise TypeError(f"not a noise source: {type(source).__name__}")
    # float64 draws (53-bit uniforms), rounded once: torch's float32 randn has tails cut at 5.77 sigma (CPU)
    drawn = [torch.randn(shape, generator=source, device=device if device is not None else source.device,
                         dtype=torch.float64) for shape in shapes]
    return drawn if dtype == torch.float64 else [values.to(dtype) for values in drawn]


def normals_like(tensors: Mapping[str, Tensor], source: NoiseSource) -> dict[str, Tensor]:
    """N(0, 1) noise shaped, placed and typed like each of ``tensors``, drawn in their order (the same values as
    one :func:`normal` per tensor), each run of tensors on one device in one dtype drawn together (:func:`normals`)."""
    out: dict[str, Tensor] = {}
    items = list(tensors.items())
    start = 0
    while start < len(items):
        like = items[start][1]
        end = start + 1
        while end < len(items) and (items[end][1].device, items[end][1].dtype) == (like.device, like.dtype):
            end += 1
        run = items[start:end]
        out.update(zip([key for key, _ in run], normals([t.shape for _, t in run], source, like.device, like.dtype)))
        start = end
    return out


def noisy_means_(sums: Mapping[str, Tensor], scale: float, batch: float, source: NoiseSource,
                 group_numel: int = 1 << 24) -> dict[str, Tensor]:
    """The release of each clipped sum, ``(total + scale * N(0, 1)) / batch``, written into the sum itself (which is
    then gone): the noise is drawn a group of tensors at a time (about ``group_numel`` values at most, one larger
    tensor alone), with the values :func:`normals_like` draws for all of them, so no model-sized noise buffer is
    ever held beside the sums."""
    out: dict[str, Tensor] = {}
    items = list(sums.items())
    start = 0
    while start < len(items):
        end, numel = start + 1, items[start][1].numel()
        while end < len(items) and numel + items[end][1].numel() <= group_numel:
            numel += items[end][1].numel()
            end += 1
        group = dict(items[start:end])
        noise = normals_like(group, source)
        totals, draws = list(group.values()), [noise.pop(key) for key in group]
        # three fused launches per group rather than three per tensor; bit for bit what noisy_mean_ gives
        torch._foreach_mul_(draws, scale)
        torch._foreach_add_(totals, draws)
        torch._foreach_div_(totals, batch)
        del draws
        out.update(group)
        start = end
    return out


def noisy_mean_(noise: Tensor, scale: float, total: Tensor, batch: float) -> Tensor:
    """The release of one clipped sum, ``(total + scale * noise) / batch``, written into ``noise`` (overwritten,
    returned): no second tensor of the gradient's size. ``noise`` is N(0, 1) (or correlated noise in its units),
    ``scale`` its std on the sum (sigma C, times a sensitivity), ``batch`` the expected batch size."""
    return noise.mul_(scale).add_(total).div_(batch)
