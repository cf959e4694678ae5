"""Batch samplers that the privacy analysis depends on.

Poisson sampling (each example joins each logical batch independently with probability q) is what the
subsampled-Gaussian accountant assumes. A mechanism that needs another scheme (FTRL: fixed-size batches
from one shuffled order) brings its own sampler through the ``configure_mechanism`` hook.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor
from torch.utils.data import Sampler


class PoissonBatchSampler(Sampler[list[int]]):
    """Yields ``steps_per_epoch`` logical batches; example i joins each batch with probability ``sample_rate``.

    Batches have random size (possibly zero). The generator is seeded from OS entropy unless a seed is given:
    the batch composition is secret, like the noise.
    """

    def __init__(self, num_examples: int, sample_rate: float, steps_per_epoch: int,
                 generator: torch.Generator | None = None) -> None:
        if num_examples <= 0:
            raise ValueError("PoissonBatchSampler needs a non-empty data set")
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        self.num_examples = num_examples
        self.sample_rate = sample_rate
        self.steps_per_epoch = steps_per_epoch
        self.generator = generator if generator is not None else secure_generator()

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps_per_epoch):
            yield poisson_mask(self.num_examples, self.sample_rate, self.generator).nonzero().flatten().tolist()


def poisson_mask(n: int, rate: float, generator: torch.Generator) -> Tensor:
    """n independent inclusions with probability ``rate``, exactly as accounted: the uniforms are float64 (53 bits),
    so P(include) is ``rate`` to 2^-53. (float32 ``rand`` has 24-bit uniforms: P(include) = ceil(rate 2^24) / 2^24,
    above the accounted rate by up to 6e-8 - twice the rate for a rate below 2^-24.)"""
    return torch.rand(n, generator=generator, dtype=torch.float64) < rate


_MT_WORDS = 624  # MT19937 state words (32 bits each)
_MT_WORDS_OFFSET = 24  # byte offset of the state words in torch's CPU generator state (uint64 each)


def secure_generator(seed: int | None = None, device: str | torch.device = "cpu") -> torch.Generator:
    """A secret ``torch.Generator``: with ``seed=None`` its whole state comes from OS entropy; with a seed,
    it is reproducible (for experiments only: whoever knows the seed knows the noise and the batches).

    ``manual_seed`` would keep only 32 bits of entropy on the CPU (torch's MT19937 is seeded by a 32-bit
    integer), i.e. 2^32 possible streams. Here all 624 state words (19,968 bits) are filled from ``secrets``.
    CUDA generators (Philox) take a 64-bit key: they are seeded with 64 bits from ``secrets``.
    """
    import secrets

    gen = torch.Generator(device=device)
    if seed is not None:
        gen.manual_seed(seed)
        return gen
    if gen.device.type != "cpu":
        gen.manual_seed(secrets.randbits(64))
        return gen
    gen.manual_seed(0)
    state = gen.get_state().clone()
    words = torch.frombuffer(bytearray(secrets.token_bytes(4 * _MT_WORDS)), dtype=torch.int32).to(torch.int64)
    words = words & 0xFFFFFFFF  # unsigned 32-bit values, stored as uint64 in the state
    state[_MT_WORDS_OFFSET:_MT_WORDS_OFFSET + 8 * _MT_WORDS] = words.view(torch.uint8)
    gen.set_state(state)  # "left" is 1: the first draw regenerates the whole state from these words
    return gen


def derive_seed(seed: int | None, purpose: str) -> int | None:
    """A per-purpose seed derived from the user's ``privacy.seed`` (``None`` stays ``None``: OS entropy)."""
    if seed is None:
        return None
    import hashlib

    digest = hashlib.sha256(f"{seed}:{purpose}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def derive_key(seed: int | None, purpose: str) -> bytes | None:
    """A per-purpose 256-bit key derived from the user's ``privacy.seed`` (``None`` stays ``None``: OS entropy)."""
    if seed is None:
        return None
    import hashlib

    return hashlib.sha256(f"{seed}:{purpose}:key".encode()).digest()
