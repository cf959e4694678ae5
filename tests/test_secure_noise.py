"""``privacy.secure_noise``: the ChaCha20 Gaussian source of :mod:`dpl.core.noise` is a standard normal, independent
across draws and instances, keyed only from the OS CSPRNG; the checks reject deliberately broken generators."""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import pytest
import torch

from dpl.core.noise import SecureNormal, normal

N = 400_000
Sampler = Callable[[int], torch.Tensor]


def _normal_cdf(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1 + torch.erf(x / math.sqrt(2)))


def gaussian_failures(sample: Sampler) -> list[str]:
    """The checks a N(0, 1) stream must pass (each at about 5 standard errors); returns those that fail."""
    first, second = sample(N).double(), sample(N).double()
    failures = []
    if abs(first.mean().item()) > 5 / math.sqrt(N):
        failures.append("mean")
    if abs(first.std().item() - 1) > 5 / math.sqrt(2 * N):
        failures.append("std")
    for bound, prob in ((2.0, 0.0455), (3.0, 0.0027), (4.0, 6.33e-5)):
        count = (first.abs() > bound).sum().item()
        if abs(count - N * prob) > 5 * math.sqrt(N * prob) + 1:
            failures.append(f"tail {bound}")
    ks = (torch.arange(1, N + 1, dtype=torch.float64) / N - _normal_cdf(first.sort().values)).abs().max().item()
    if ks > 2.69 / math.sqrt(N):  # Kolmogorov-Smirnov at level 1e-6
        failures.append("distribution")
    for lag in (1, 2, N // 2):  # N // 2: a value and its Box-Muller partner within a block or across blocks
        if abs((first[lag:] * first[:-lag]).mean().item()) > 5 / math.sqrt(N - lag):
            failures.append(f"lag {lag}")
    if abs((first * second).mean().item()) > 5 / math.sqrt(N) or torch.isin(first, second).any():
        failures.append("independence across draws")
    return failures


def test_secure_noise_passes_the_gaussian_checks():
    assert gaussian_failures(SecureNormal().standard_normal) == []


def test_no_repetition_across_instances_and_draws():
    values = torch.cat([SecureNormal().standard_normal(50_000) for _ in range(4)] +
                       [normal((50_000,), SecureNormal(), dtype=torch.float64)])
    assert values.unique().numel() == values.numel()


BROKEN: dict[str, Sampler] = {
    "uniform": lambda n: (torch.rand(n, dtype=torch.float64) - 0.5) * math.sqrt(12),
    "too wide": lambda n: 1.02 * torch.randn(n, dtype=torch.float64),
    "fixed key": lambda n: torch.randn(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64),
    "correlated": lambda n: (lambda z: (z[1:] + z[:-1]) / math.sqrt(2))(torch.randn(n + 1, dtype=torch.float64)),
    "student t": lambda n: torch.distributions.StudentT(30.0).sample((n,)).double(),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_the_checks_reject_a_broken_generator(name):
    assert gaussian_failures(BROKEN[name]) != []


def test_key_comes_from_os_urandom_only(monkeypatch):
    """Two draws differ because of the OS CSPRNG alone: with os.urandom fixed, they repeat."""
    monkeypatch.setattr(os, "urandom", lambda k: bytes(range(k)))
    source = SecureNormal()
    assert torch.equal(source.standard_normal(1000), SecureNormal().standard_normal(1000))
    # float32 noise is the float64 draw rounded once
    assert torch.equal(source.standard_normal(70_001, torch.float32), source.standard_normal(70_001).float())


def test_float64_noise_sums_four_draws(monkeypatch):
    calls = []
    draw = SecureNormal.standard_normal
    monkeypatch.setattr(SecureNormal, "standard_normal", lambda self, n, *a: calls.append(n) or draw(self, n, *a))
    values = normal((300, 1000), SecureNormal(), dtype=torch.float64)
    assert calls == [300_000] * 4 and values.shape == (300, 1000)
    assert values.std().item() == pytest.approx(1.0, abs=5 / math.sqrt(6e5))
    normal((10,), SecureNormal(), dtype=torch.bfloat16)
    assert calls[4:] == [10]
