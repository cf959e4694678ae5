"""Batch samplers that the privacy analysis depends on.

Poisson sampling (each example joins each logical batch independently with probability q) is what the
subsampled-Gaussian accountant assumes. A mechanism that needs another scheme (FTRL: fixed-size batches
from one shuffled order) brings its own sampler through the ``configure_mechanism`` hook.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
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
            mask = torch.rand(self.num_examples, generator=self.generator) < self.sample_rate
            yield mask.nonzero().flatten().tolist()


def secure_generator(seed: int | None = None, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch.Generator seeded from OS entropy (``seed=None``) or, for reproducibility only, from ``seed``."""
    import secrets

    gen = torch.Generator(device=device)
    gen.manual_seed(secrets.randbits(63) if seed is None else seed)
    return gen
