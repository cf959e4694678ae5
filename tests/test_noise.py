"""The noise sources of :mod:`dpl.core.noise`: the default (``KeyedNormal``) and ``privacy.secure_noise``
(``SecureNormal``) ChaCha20 sources are standard normal, independent across draws and instances, with tails not cut
where torch's float32 sampler cuts them; ``SecureNormal`` is keyed only from the OS CSPRNG, ``KeyedNormal`` is a
function of its key and counter; the checks reject deliberately broken generators."""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import pytest
import torch

from dpl.core.noise import (KeyedNormal, SecureNormal, box_muller, noise_source, normal, normals, normals_like,
                            replay_source)
from dpl.core.sampling import PoissonBatchSampler, poisson_mask

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


@pytest.mark.parametrize("source", [SecureNormal(), KeyedNormal()], ids=["secure", "keyed"])
def test_noise_sources_pass_the_gaussian_checks(source):
    assert gaussian_failures(source.standard_normal) == []


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
    draw = SecureNormal.standard_normals
    monkeypatch.setattr(SecureNormal, "standard_normals",
                        lambda self, sizes, *a: calls.append(list(sizes)) or draw(self, sizes, *a))
    values = normal((300, 1000), SecureNormal(), dtype=torch.float64)
    assert calls == [[300_000]] * 4 and values.shape == (300, 1000)
    assert values.std().item() == pytest.approx(1.0, abs=5 / math.sqrt(6e5))
    normal((10,), SecureNormal(), dtype=torch.bfloat16)
    assert calls[4:] == [[10]]


# --- tails --------------------------------------------------------------------------------------------------
def _tail_grid_distance(radius_sq: torch.Tensor, bits: int) -> float:
    """Mean distance to the nearest integer of u * 2^bits, u = exp(-r^2 / 2) the Box-Muller uniform of each pair
    with r > 4.5: about 0 when the uniforms lie on a 2^-bits grid, about 1/4 when they are finer."""
    u = torch.exp(-radius_sq[radius_sq > 4.5 ** 2] / 2)
    assert u.numel() > 100
    k = u * 2.0 ** bits
    return (k - k.round()).abs().mean().item()


def test_torch_float32_randn_has_tails_cut_at_5_77_sigma():
    """Why dpl does not use torch's float32 ``randn`` for noise: its Box-Muller uniforms (pairs j, j + 8 of each
    16 values) have 24 bits, so u >= 2^-24 and |z| <= sqrt(48 ln 2) = 5.768 by construction. If this fails, torch
    changed its CPU sampler: revisit dpl.core.noise."""
    x = torch.randn(1 << 24, generator=torch.Generator().manual_seed(0)).view(-1, 16).double()
    assert _tail_grid_distance(x[:, :8] ** 2 + x[:, 8:] ** 2, 24) < 0.01
    x = torch.randn(1 << 24, generator=torch.Generator().manual_seed(0), dtype=torch.float64).view(-1, 16)
    assert _tail_grid_distance(x[:, :8] ** 2 + x[:, 8:] ** 2, 24) > 0.15  # float64: 53-bit uniforms


@pytest.mark.parametrize("source", [SecureNormal(), KeyedNormal()], ids=["secure", "keyed"])
def test_noise_tails_are_not_on_a_coarse_grid(source):
    """The float32 noise (rounded from float64) keeps uniforms finer than 2^-32 in its tail: not cut at 5.77
    (CPU float32) or 6.77 (CUDA float32) standard deviations. Pairs: the cosines, then the sines, of each block."""
    pairs = 1 << 15
    x = torch.cat([source.standard_normal(2 * pairs, torch.float32) for _ in range(256)]).view(-1, 2, pairs).double()
    radius_sq = x[:, 0] ** 2 + x[:, 1] ** 2
    assert _tail_grid_distance(radius_sq, 24) > 0.15 and _tail_grid_distance(radius_sq, 32) > 0.15


def test_box_muller_reaches_8_49_sigma():
    """The smallest uniform (52 mantissa bits all set: u = 2^-52) gives the radius sqrt(104 ln 2) = 8.49; all
    bits clear gives u = 1 (radius 0). The angle words give cos/sin of 2 pi x."""
    words = torch.tensor([(1 << 52) - 1, 0, 0, 1 << 50], dtype=torch.int64)  # radii: max, 0; angles: 0, pi / 2
    out = box_muller(words, torch.empty(4, dtype=torch.float64))
    assert out[0].item() == pytest.approx(math.sqrt(104 * math.log(2)), rel=1e-12)
    assert out.tolist()[1:] == [0.0, pytest.approx(0.0, abs=1e-12), 0.0]
    high_bits = torch.tensor([-1, -1], dtype=torch.int64)  # bits above the mantissa are ignored
    assert box_muller(high_bits, torch.empty(2, dtype=torch.float64))[0].item() == out[0].item()


# --- the default source ---------------------------------------------------------------------------------------
def test_keyed_normal_is_a_function_of_key_and_counter():
    key = bytes(range(32))
    a, b = KeyedNormal(key), KeyedNormal(key)
    first = normal((1000,), a)
    assert torch.equal(normal((1000,), b), first)  # same key, same counter: same draw
    state = a.get_state()
    second = normal((70_001,), a, dtype=torch.bfloat16)
    assert not torch.isin(a.standard_normal(1000), KeyedNormal(key).standard_normal(1000)).any()  # another stream
    assert torch.equal(normal((70_001,), replay_source(a, state), dtype=torch.bfloat16), second)
    assert torch.equal(b.get_state(), state) and torch.equal(normal((70_001,), b, dtype=torch.bfloat16), second)
    assert not torch.equal(normal((1000,), KeyedNormal(key[:-1] + b"x")), first)
    with pytest.raises(ValueError, match="not a KeyedNormal state"):
        a.set_state(torch.zeros(5056, dtype=torch.uint8))  # a torch CPU generator's state


def test_keyed_draws_do_not_depend_on_the_thread_count():
    """Blocks of the keystream are computed by torch's thread count of workers; the values must not change."""
    threads = torch.get_num_threads()
    try:
        draws = []
        for count in (1, 3):
            torch.set_num_threads(count)
            draws.append(normal((1_000_003,), KeyedNormal(bytes(32))))  # 16 blocks: 3 workers
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(*draws)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_normals_draw_what_one_normal_per_shape_draws(threads):
    """Drawn together (the blocks of all draws shared among threads, full blocks grouped per operation), the values
    and the counter are those of one ``normal`` per shape, in order, for every dtype."""
    shapes = [(3,), (384,), (0,), (65_537,), (147_456,), (1_000_003,), (7, 5), (589_824,)]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            one, together = KeyedNormal(bytes(range(32))), KeyedNormal(bytes(range(32)))
            expected = [normal(shape, one, dtype=dtype) for shape in shapes]
            drawn = normals(shapes, together, dtype=dtype)
            assert [t.shape for t in drawn] == [torch.Size(s) for s in shapes]
            assert all(torch.equal(a, b) for a, b in zip(expected, drawn)) and one.draws == together.draws
    finally:
        torch.set_num_threads(previous)
    generator = torch.Generator().manual_seed(3)
    expected = [normal(s, generator) for s in shapes[:3]]
    assert all(torch.equal(a, b) for a, b in zip(expected, normals(shapes[:3], torch.Generator().manual_seed(3))))
    secure = normals([(10,), (70_001,)], SecureNormal())
    assert [t.numel() for t in secure] == [10, 70_001]
    # the second draw does not repeat the first anywhere (a single float32 value may recur by chance, ~1% of runs;
    # ten in a row may not)
    assert not (secure[1].unfold(0, 10, 1) == secure[0]).all(dim=1).any()


def test_normals_like_follows_the_order_device_and_dtype_of_its_tensors():
    like = {"a": torch.zeros(5), "b": torch.zeros(2, 3, dtype=torch.bfloat16), "c": torch.zeros(4)}
    drawn = normals_like(like, KeyedNormal(bytes(32)))
    one = KeyedNormal(bytes(32))
    expected = {k: normal(v.shape, one, dtype=v.dtype) for k, v in like.items()}
    assert list(drawn) == ["a", "b", "c"] and all(drawn[k].dtype == like[k].dtype for k in like)
    assert all(torch.equal(drawn[k], expected[k]) for k in like)


def test_unkeyed_sources_take_their_key_from_os_urandom(monkeypatch):
    monkeypatch.setattr(os, "urandom", lambda k: bytes(range(k)))
    assert torch.equal(normal((100,), KeyedNormal()), normal((100,), KeyedNormal(bytes(range(32)))))
    assert isinstance(noise_source(None), KeyedNormal)


def test_a_torch_generator_source_draws_float64_rounded_once():
    """A torch.Generator (the CUDA default) is drawn in float64 and rounded, never with float32 ``randn``."""
    source, copy = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    values = normal((1000,), source)
    assert values.dtype == torch.float32
    assert torch.equal(values, torch.randn(1000, generator=copy, dtype=torch.float64).float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)")
def test_cuda_noise_source_draws_float64_rounded_once():
    """On CUDA the source is a Philox generator drawn in float64 (curand's Box-Muller from 53-bit uniforms) and
    rounded once; its float32 ``randn`` (32-bit uniforms) would cut the tails at 6.77 standard deviations."""
    source = noise_source(None, "cuda")
    assert isinstance(source, torch.Generator) and source.device.type == "cuda"
    copy = replay_source(source, source.get_state())
    values = normal((1 << 20,), source)
    assert values.dtype == torch.float32 and values.device.type == "cuda"
    assert torch.equal(values, torch.randn(1 << 20, generator=copy, device="cuda", dtype=torch.float64).float())


# --- sampling ---------------------------------------------------------------------------------------------------
def test_poisson_inclusion_uses_53_bit_uniforms():
    """Inclusion compares float64 uniforms, so P(include) is the accounted rate. float32 ``rand`` returns u = 0 with
    probability 2^-24: a rate of 2^-30 would include examples 64 times too often. Seeded: deterministic."""
    g, copy = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(poisson_mask(1000, 0.3, g), torch.rand(1000, generator=copy, dtype=torch.float64) < 0.3)
    rate, n, steps = 2.0 ** -30, 1 << 22, 16  # expected inclusions: 1/16 (float32 uniforms: 4)
    assert (torch.rand(n * steps, generator=torch.Generator().manual_seed(1)) < rate).sum() > 0
    assert sum(map(len, PoissonBatchSampler(n, rate, steps, torch.Generator().manual_seed(1)))) == 0



def test_the_cuda_generator_seed_keeps_all_64_key_bits():
    """The CUDA (Philox) noise generator is seeded with the key's first 8 bytes as an unsigned 64-bit integer: all
    64 bits, which torch's manual_seed accepts (up to 2^64 - 1); a shift would keep 63."""
    from dpl.core.noise import philox_seed

    assert philox_seed(b"\xff" * 32) == 2 ** 64 - 1
    assert philox_seed(bytes([1] + [0] * 31)) == 1
    assert torch.Generator().manual_seed(philox_seed(b"\xff" * 32)).initial_seed() == 2 ** 64 - 1
    assert len({philox_seed(None) >> 63 for _ in range(64)}) == 2  # the top bit varies


def test_noisy_means_write_the_release_into_the_sums_in_groups(monkeypatch):
    """The default release: bit for bit ``noisy_mean_`` of ``normals_like``'s noise, written into the sums
    themselves (no new model-sized tensor), the noise drawn a bounded group of tensors at a time."""
    import dpl.core.noise as noise_module
    from dpl.core.noise import KeyedNormal, noisy_mean_, noisy_means_, normals_like

    gen = torch.Generator().manual_seed(0)
    sums = {f"p{i}": torch.randn(shape, generator=gen) for i, shape in enumerate([(30, 20), (7,), (50, 40), (3, 3)])}
    key = bytes(range(32))
    noise = normals_like(sums, KeyedNormal(key))
    expected = {k: noisy_mean_(noise[k], 0.7, v.clone(), 8.0) for k, v in sums.items()}
    ids = {k: id(v) for k, v in sums.items()}
    groups = []
    monkeypatch.setattr(noise_module, "normals_like", lambda g, s: groups.append(list(g)) or normals_like(g, s))
    released = noisy_means_(sums, 0.7, 8.0, KeyedNormal(key), group_numel=1000)
    assert groups == [["p0", "p1"], ["p2"], ["p3"]]  # 607 values; one tensor over the bound alone; the rest
    assert list(released) == list(sums) and all(id(released[k]) == ids[k] for k in sums)  # in place
    assert all(torch.equal(released[k], expected[k]) for k in sums)
