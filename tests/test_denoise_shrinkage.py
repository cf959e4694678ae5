"""RMT optimal shrinkage (dpl_plugins.denoise.shrinkage) against an independent numpy implementation of the
formulas in design.md section 4 "denoise", plus the properties the denoise plugin relies on. The three methods
(``auto``: Cholesky certificate + Gram eigendecomposition, ``full``: batched SVD, ``randomized``) must agree."""

import math

import numpy as np
import pytest
import torch

from dpl_plugins.denoise.shrinkage import (DenoiseStats, ShrinkageOptions, denoise_matrices, optimal_shrinkage,
                                           optimal_shrinker, spike_inverse)

SHAPES = [(200, 200), (100, 400), (400, 100), (64, 768)]
EXACT = ["auto", "full"]  # methods that must match the numpy reference to float rounding


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These small SVDs run ~10x faster on one thread than on two when the CPU is shared (OpenMP spinning)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------ numpy reference


def np_denoise(Y: np.ndarray, s: float, kappa: float = 1.02, norm_correction: bool = True):
    """The formulas, written out with numpy: returns (estimate, shrunken singular values, denoised?)."""
    m, n = Y.shape
    big = max(m, n)
    beta = min(m, n) / big
    if np.linalg.norm(Y, 2) <= kappa * s * (np.sqrt(m) + np.sqrt(n)):
        return Y.copy(), np.zeros(min(m, n)), False
    U, S, Vt = np.linalg.svd(Y, full_matrices=False)
    y = S / (s * np.sqrt(big))
    eta = np.zeros_like(y)
    above = y > 1 + np.sqrt(beta)
    eta[above] = np.sqrt((y[above] ** 2 - beta - 1) ** 2 - 4 * beta) / y[above]
    d = eta * s * np.sqrt(big)
    X = (U * d) @ Vt
    if norm_correction:
        scale = np.linalg.norm(Y) / np.linalg.norm(X)
        X, d = X * scale, d * scale
    return X, d, True


def signal_plus_noise(m, n, xs, s=1.0, seed=0, noise_scale=1.0):
    """Rank-len(xs) signal with scaled singular values xs (units of s*sqrt(max(m, n))) plus N(0, (noise_scale*s)^2)."""
    rng = np.random.default_rng(seed)
    big = max(m, n)
    U = np.linalg.qr(rng.standard_normal((m, len(xs))))[0]
    V = np.linalg.qr(rng.standard_normal((n, len(xs))))[0]
    X = (U * (np.asarray(xs, dtype=float) * s * np.sqrt(big))) @ V.T
    return X, X + noise_scale * s * rng.standard_normal((m, n))


def rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


# ------------------------------------------------------------------------------------------ formulas


@pytest.mark.parametrize("method", EXACT)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("norm_correction", [True, False])
def test_matches_numpy_reference_float64(shape, norm_correction, method):
    s = 0.7
    _, Y = signal_plus_noise(*shape, xs=[5.0, 3.0, 2.0], s=s, seed=1)
    ref, d_ref, denoised = np_denoise(Y, s, norm_correction=norm_correction)
    assert denoised
    options = ShrinkageOptions(norm_correction=norm_correction, method=method)
    out, stats = optimal_shrinkage(torch.from_numpy(Y), s, options)
    assert out.dtype == torch.float64 and out.shape == shape
    assert rel(out.numpy(), ref) < 1e-10
    # the shrunken singular values themselves
    k = int((d_ref > 0).sum())
    assert stats == DenoiseStats(num_matrices=1, num_denoised=1, num_spikes=k, max_edge_ratio=stats.max_edge_ratio)
    sv_out = np.linalg.svd(out.numpy(), compute_uv=False)
    np.testing.assert_allclose(sv_out[:k], d_ref[:k], rtol=1e-9)
    assert sv_out[k] < 1e-8 * sv_out[0]
    top = np.linalg.svd(Y, compute_uv=False)[0]
    assert stats.max_edge_ratio == pytest.approx(top / (s * (math.sqrt(shape[0]) + math.sqrt(shape[1]))), rel=1e-12)


@pytest.mark.parametrize("method", EXACT)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_numpy_reference_float32(shape, method):
    _, Y = signal_plus_noise(*shape, xs=[6.0, 3.0], seed=2)
    ref, _, _ = np_denoise(Y, 1.0)
    out, _ = optimal_shrinkage(torch.from_numpy(Y).float(), 1.0, ShrinkageOptions(method=method))
    assert out.dtype == torch.float32
    assert rel(out.numpy(), ref) < 1e-4


@pytest.mark.parametrize("shape", SHAPES)
def test_denoising_helps(shape):
    X, Y = signal_plus_noise(*shape, xs=[4.0, 2.5, 1.8], seed=3)
    Yt = torch.from_numpy(Y)
    plain, _ = optimal_shrinkage(Yt, 1.0, ShrinkageOptions(norm_correction=False))
    corrected, _ = optimal_shrinkage(Yt, 1.0, ShrinkageOptions(norm_correction=True))
    mse_noisy = np.mean((Y - X) ** 2)
    # the optimal shrinker removes most of the noise
    assert np.mean((plain.numpy() - X) ** 2) < 0.2 * mse_noisy
    # cosine to the signal improves (same direction with and without the norm correction)
    assert cosine(plain.numpy(), X) > cosine(Y, X) + 0.2
    assert cosine(corrected.numpy(), X) == pytest.approx(cosine(plain.numpy(), X), abs=1e-9)
    # norm-corrected: same Frobenius norm as Y, closer to the signal than Y all the same
    assert np.linalg.norm(corrected.numpy()) == pytest.approx(np.linalg.norm(Y), rel=1e-10)
    assert np.mean((corrected.numpy() - X) ** 2) < mse_noisy


def test_pure_noise_is_returned_unchanged():
    s = 0.3
    Y = s * torch.randn(400, 1600, generator=torch.Generator().manual_seed(4))
    ratios = {}
    for method in ("full", "randomized", "auto"):
        out, stats = optimal_shrinkage(Y, s, ShrinkageOptions(method=method))
        assert out is Y
        assert stats.num_denoised == 0 and stats.num_spikes == 0 and stats.num_matrices == 1
        ratios[method] = stats.max_edge_ratio
    assert 0.95 < ratios["full"] < 1.02
    assert 0.85 < ratios["randomized"] <= ratios["full"]  # the sketch's estimate is a lower one
    assert 0.9 * ratios["full"] < ratios["auto"] <= ratios["full"] * (1 + 1e-6)  # so is the Lanczos estimate
    # the numpy reference agrees that the threshold is not crossed
    assert not np_denoise(Y.double().numpy(), s)[2]
    # in a batch, the noise-only matrix is copied bit for bit while the other one is denoised
    _, Z = signal_plus_noise(400, 1600, xs=[5.0], s=s, seed=5)
    batch = torch.stack([Y, torch.from_numpy(Z).float()])
    for method in ("full", "auto"):
        out, stats = optimal_shrinkage(batch, s, ShrinkageOptions(method=method))
        assert stats.num_denoised == 1
        assert torch.equal(out[0], Y) and not torch.equal(out[1], batch[1])


@pytest.mark.parametrize("method", EXACT)
def test_kappa_threshold_and_spike_count(method):
    _, Y = signal_plus_noise(200, 200, xs=[1.3], seed=6)  # weak spike: y ~ 2.15, edge 2
    Yt = torch.from_numpy(Y)
    ratio = optimal_shrinkage(Yt, 1.0, ShrinkageOptions(method="full"))[1].max_edge_ratio
    assert 1.02 < ratio < 1.2
    assert optimal_shrinkage(Yt, 1.0, ShrinkageOptions(kappa=ratio * 1.001, method=method))[0] is Yt
    out, stats = optimal_shrinkage(Yt, 1.0, ShrinkageOptions(kappa=ratio * 0.999, method=method))
    ref, d_ref, _ = np_denoise(Y, 1.0, kappa=ratio * 0.999)
    assert stats.num_denoised == 1 and stats.num_spikes == int((d_ref > 0).sum()) >= 1
    assert rel(out.numpy(), ref) < 1e-10


# ------------------------------------------------------------------------------------------ invariances


@pytest.mark.parametrize("method", ["auto", "full", "randomized"])
def test_transposition_invariance(method):
    _, Y = signal_plus_noise(120, 500, xs=[5.0, 3.0], seed=7)
    Yt = torch.from_numpy(Y).float()
    out, stats = optimal_shrinkage(Yt, 1.0, ShrinkageOptions(method=method))
    out_t, stats_t = optimal_shrinkage(Yt.T.contiguous(), 1.0, ShrinkageOptions(method=method))
    assert stats.num_denoised == 1 and stats == stats_t
    torch.testing.assert_close(out_t, out.T, rtol=1e-5, atol=1e-5 * out.abs().max().item())


@pytest.mark.parametrize("method", EXACT)
def test_batched_equals_unbatched_with_per_matrix_std(method):
    stds = [0.5, 1.0, 2.0, 1.0]
    mats = [signal_plus_noise(150, 90, xs=xs, s=s, seed=10 + i)[1]
            for i, (xs, s) in enumerate(zip([[4.0, 2.0], [3.0], [], [6.0, 1.5, 1.2]], stds))]
    batch = torch.from_numpy(np.stack(mats))
    out, stats = optimal_shrinkage(batch, torch.tensor(stds), ShrinkageOptions(method=method))
    total = DenoiseStats()
    for i, s in enumerate(stds):
        single, st = optimal_shrinkage(batch[i], s, ShrinkageOptions(method=method))
        total = total + st
        torch.testing.assert_close(out[i], single, rtol=1e-10, atol=1e-12)
    assert stats == total and stats.num_matrices == 4 and stats.num_denoised == 3
    assert torch.equal(out[2], batch[2])  # pure noise, left alone


@pytest.mark.parametrize("method", EXACT)
def test_norm_correction_preserves_frobenius_norm(method):
    for shape in SHAPES:
        _, Y = signal_plus_noise(*shape, xs=[3.0, 2.0], seed=11)
        Yt = torch.from_numpy(Y).float()
        out, stats = optimal_shrinkage(Yt, 1.0, ShrinkageOptions(method=method))
        assert stats.num_denoised == 1
        assert torch.linalg.matrix_norm(out).item() == pytest.approx(torch.linalg.matrix_norm(Yt).item(), rel=1e-5)


# ------------------------------------------------------------------------------------------ randomized


@pytest.mark.parametrize("shape", SHAPES + [(384, 1536)])
def test_randomized_equals_full(shape):
    cases = [
        [8.0, 5.0, 3.0],                 # strong spikes
        [4.0, 2.0, 1.3, 1.0, 0.8],       # spikes down to the detection threshold
        [],                              # pure noise
        [2.0 + 0.5 * i for i in range(12)],  # more spikes than the first rank (8): the rank must grow
    ]
    for j, xs in enumerate(cases):
        _, Y = signal_plus_noise(*shape, xs=xs, seed=20 + j)
        Yt = torch.from_numpy(Y).float()
        full, st_full = optimal_shrinkage(Yt, 1.0, ShrinkageOptions(method="full"))
        fast, st_fast = optimal_shrinkage(Yt, 1.0, ShrinkageOptions(method="randomized"))
        assert (st_fast.num_denoised, st_fast.num_spikes) == (st_full.num_denoised, st_full.num_spikes), xs
        if st_full.num_denoised:
            assert st_fast.max_edge_ratio == pytest.approx(st_full.max_edge_ratio, rel=1e-3)
        assert rel(fast.numpy(), full.numpy()) < 1e-3, xs


def test_randomized_sketch_path_without_fallback(monkeypatch):
    """A bulk well below the edge (the true noise is 0.7 s): the randomized path converges on the sketch alone,
    growing its rank from 8 to 16 for 12 spikes, and never runs a full SVD of the matrix."""
    shape = (400, 300)
    X, Y = signal_plus_noise(*shape, xs=[2.0 + 0.5 * i for i in range(12)], seed=30, noise_scale=0.7)
    Yt = torch.from_numpy(Y).float()
    full, st_full = optimal_shrinkage(Yt, 1.0, ShrinkageOptions(method="full"))
    calls = []
    real_svd = torch.linalg.svd

    def spy(A, *args, **kwargs):
        calls.append(tuple(A.shape[-2:]))
        return real_svd(A, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "svd", spy)
    fast, st_fast = optimal_shrinkage(Yt, 1.0, ShrinkageOptions(method="randomized"))
    assert calls and all(min(c) <= 32 for c in calls), calls  # only small projected SVDs (width <= 2 * 16)
    assert any(min(c) == 32 for c in calls)                    # the rank grew to 16 (sketch width 32)
    assert st_fast == DenoiseStats(1, 1, 12, pytest.approx(st_full.max_edge_ratio, rel=1e-5))
    assert rel(fast.numpy(), full.numpy()) < 1e-3


def test_randomized_pure_noise_is_cheap_and_keeps_global_rng(monkeypatch):
    Y = torch.randn(1536, 384, generator=torch.Generator().manual_seed(31))
    state = torch.get_rng_state()
    calls = []
    real_svd = torch.linalg.svd
    monkeypatch.setattr(torch.linalg, "svd", lambda A, *a, **k: calls.append(tuple(A.shape)) or real_svd(A, *a, **k))
    out, stats = optimal_shrinkage(Y, 1.0, ShrinkageOptions(method="randomized"))
    assert out is Y and stats.num_denoised == 0
    assert all(max(c[-2:]) <= 384 and min(c[-2:]) <= 16 for c in calls), calls
    assert torch.equal(torch.get_rng_state(), state)


# ------------------------------------------------------------------------------------------ auto (Gram + Cholesky)


@pytest.mark.parametrize("shape", SHAPES + [(384, 1536), (3000, 384)])
def test_auto_equals_full_and_is_closer_to_float64(shape):
    cases = [
        [8.0, 5.0, 3.0],                      # strong spikes
        [4.0, 2.0, 1.3, 1.0, 0.8],            # spikes down to the detection threshold
        [],                                   # pure noise
        [2.0 + 0.5 * i for i in range(12)],   # many spikes
        [1000.0, 3.0, 1.2],                   # one huge spike: float32 Gram would lose the small ones
        [1.25],                               # one spike just above the threshold
    ]
    for j, xs in enumerate(cases):
        _, Y = signal_plus_noise(*shape, xs=xs, seed=20 + j)
        truth = optimal_shrinkage(torch.from_numpy(Y), 1.0, ShrinkageOptions(method="full"))[0].numpy()   # float64 SVD
        Yt = torch.from_numpy(Y).float()
        full, st_full = optimal_shrinkage(Yt, 1.0, ShrinkageOptions(method="full"))
        auto, st_auto = optimal_shrinkage(Yt, 1.0, ShrinkageOptions(method="auto"))
        assert (st_auto.num_denoised, st_auto.num_spikes) == (st_full.num_denoised, st_full.num_spikes), xs
        if st_full.num_denoised:
            assert st_auto.max_edge_ratio == pytest.approx(st_full.max_edge_ratio, rel=1e-5)
            assert rel(auto.numpy(), full.numpy()) < 1e-4, xs
            # float64 eigh of the Gram: at least as accurate as the float32 SVD
            assert rel(auto.numpy(), truth) <= max(2 * rel(full.numpy(), truth), 1e-6), xs
        else:
            assert auto is Yt and full is Yt


def _spy(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def spy(A, *args, **kwargs):
        calls.append(tuple(A.shape))
        return real(A, *args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


def test_auto_pure_noise_needs_no_decomposition_and_keeps_global_rng(monkeypatch):
    """Pure noise: the Cholesky certificate leaves every matrix alone; no SVD, no eigendecomposition of the Gram."""
    batch = torch.randn(3, 1536, 384, generator=torch.Generator().manual_seed(31))
    state = torch.get_rng_state()
    svd, eigh, chol = (_spy(monkeypatch, torch.linalg, n) for n in ("svd", "eigh", "cholesky_ex"))
    out, stats = optimal_shrinkage(batch, 1.0, ShrinkageOptions(method="auto"))
    assert out is batch and stats.num_denoised == 0 and stats.num_matrices == 3
    assert svd == [] and eigh == [] and chol == [(3, 384, 384)]
    assert torch.equal(torch.get_rng_state(), state)
    # the logged top is a lower estimate (5 Lanczos steps) of the exact one
    exact = optimal_shrinkage(batch, 1.0, ShrinkageOptions(method="full"))[1].max_edge_ratio
    assert 0.9 * exact < stats.max_edge_ratio <= exact * (1 + 1e-6)


def test_auto_certificate_margin_falls_back_to_the_exact_decision(monkeypatch):
    """A top just below the threshold (inside the certificate's 1e-3 margin): the eigendecomposition decides, and
    decides as the full SVD does; just above it: denoised as the full SVD does."""
    _, Y = signal_plus_noise(200, 200, xs=[1.3], seed=6)
    Yt = torch.from_numpy(Y).float()
    ratio = optimal_shrinkage(Yt.double(), 1.0, ShrinkageOptions(method="full"))[1].max_edge_ratio
    eigh = _spy(monkeypatch, torch.linalg, "eigh")
    out, stats = optimal_shrinkage(Yt, 1.0, ShrinkageOptions(kappa=ratio * (1 + 1e-4), method="auto"))
    assert out is Yt and stats.num_denoised == 0
    assert eigh == [(1, 200, 200)]  # not certified below: decided by the eigenvalues
    assert stats.max_edge_ratio == pytest.approx(ratio, rel=1e-6)
    out, stats = optimal_shrinkage(Yt, 1.0, ShrinkageOptions(kappa=ratio * (1 - 1e-4), method="auto"))
    full, st_full = optimal_shrinkage(Yt, 1.0, ShrinkageOptions(kappa=ratio * (1 - 1e-4), method="full"))
    assert stats.num_denoised == st_full.num_denoised == 1
    assert rel(out.numpy(), full.numpy()) < 1e-4


def test_auto_overflowing_gram_goes_to_the_svd():
    """Finite float32 entries whose squares overflow: the Gram is not finite, the SVD path denoises the matrix."""
    _, Y = signal_plus_noise(120, 80, [6.0, 3.0], seed=70)
    big = 1e18
    Yt = (torch.from_numpy(Y) * big).float()
    assert bool(torch.isfinite(Yt).all()) and not bool(torch.isfinite(Yt.mT @ Yt).all())
    out, stats = optimal_shrinkage(Yt, big, ShrinkageOptions(method="auto"))
    full, st_full = optimal_shrinkage(Yt, big, ShrinkageOptions(method="full"))
    assert stats == st_full and stats.num_denoised == 1
    torch.testing.assert_close(out, full)


def test_auto_denoise_matrices_does_not_stack(monkeypatch):
    """Same-shaped matrices (up to transposition) share one batched certificate; no matrix is stacked or copied."""
    grads = {
        "a": torch.from_numpy(signal_plus_noise(96, 64, [5.0, 3.0], s=0.5, seed=41)[1]).float(),
        "b": torch.from_numpy(signal_plus_noise(64, 96, [4.0], s=2.0, seed=42)[1]).float(),
        "c": 0.5 * torch.randn(96, 64, generator=torch.Generator().manual_seed(43)),
        "bias": torch.randn(96),
    }
    stds = {"a": 0.5, "b": 2.0, "c": 0.5}
    chol = _spy(monkeypatch, torch.linalg, "cholesky_ex")
    stack = []
    real_stack = torch.stack
    monkeypatch.setattr(torch, "stack", lambda ts, *a, **k: stack.extend(tuple(t.shape) for t in ts)
                        or real_stack(ts, *a, **k))
    out, stats = denoise_matrices(grads, stds, ShrinkageOptions(method="auto"))
    monkeypatch.undo()
    assert chol == [(3, 64, 64)]
    assert all(shape[-2:] != (96, 64) for shape in stack)  # only (small) Gram matrices of the denoised ones
    full, st_full = denoise_matrices(grads, stds, ShrinkageOptions(method="full"))
    assert stats == DenoiseStats(3, 2, 3, pytest.approx(st_full.max_edge_ratio, rel=1e-5))
    assert out["c"] is grads["c"] and out["bias"] is grads["bias"]
    for key in ("a", "b"):
        torch.testing.assert_close(out[key], full[key], rtol=1e-4, atol=1e-5)
        assert out[key].is_contiguous()


# ------------------------------------------------------------------------------------------ denoise_matrices


def test_denoise_matrices_groups_and_passes_through(monkeypatch):
    rng = np.random.default_rng(40)
    grads = {
        "a.weight": torch.from_numpy(signal_plus_noise(96, 64, [5.0, 3.0], s=0.5, seed=41)[1]).float(),
        "a.bias": torch.randn(96),
        "b.weight": torch.from_numpy(signal_plus_noise(64, 96, [4.0], s=2.0, seed=42)[1]).float(),  # transposed
        "c.weight": torch.from_numpy(0.5 * rng.standard_normal((96, 64))).float(),  # pure noise
        "scalar": torch.tensor(3.0),
        "conv": torch.randn(4, 3, 3),
        "d.weight": torch.from_numpy(signal_plus_noise(50, 70, [6.0], s=0.5, seed=43)[1]).float(),
    }
    stds = {"a.weight": 0.5, "b.weight": 2.0, "c.weight": 0.5, "d.weight": 0.5}
    batches = []
    real_svd = torch.linalg.svd
    monkeypatch.setattr(torch.linalg, "svd", lambda A, *a, **k: batches.append(tuple(A.shape)) or real_svd(A, *a, **k))
    out, stats = denoise_matrices(grads, stds, ShrinkageOptions(method="full"))
    monkeypatch.undo()
    assert list(out) == list(grads)
    for key in ("a.bias", "scalar", "conv", "c.weight"):
        assert out[key] is grads[key]
    for key in ("a.weight", "b.weight", "d.weight"):
        single, st = optimal_shrinkage(grads[key], stds[key], ShrinkageOptions(method="full"))
        assert st.num_denoised == 1
        torch.testing.assert_close(out[key], single, rtol=1e-5, atol=1e-6)
        assert out[key].is_contiguous() and out[key].shape == grads[key].shape
    assert sorted(batches) == [(1, 70, 50), (3, 96, 64)]  # one batched SVD per shape up to transposition
    assert (stats.num_matrices, stats.num_denoised, stats.num_spikes) == (4, 3, 4)
    with pytest.raises(KeyError, match="d.weight"):
        denoise_matrices(grads, {k: v for k, v in stds.items() if k != "d.weight"})
    # one std for all, and the randomized method, agree with the per-matrix calls too
    out2, _ = denoise_matrices({"a": grads["a.weight"], "b": grads["a.bias"]}, 0.5,
                               ShrinkageOptions(method="randomized"))
    torch.testing.assert_close(out2["a"], out["a.weight"], rtol=1e-3, atol=1e-3 * out["a.weight"].abs().max().item())
    assert out2["b"] is grads["a.bias"]


@pytest.mark.parametrize("method", EXACT)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_input(dtype, method):
    _, Y = signal_plus_noise(128, 256, [6.0, 3.0], seed=50)
    Yl = torch.from_numpy(Y).to(dtype)
    out, stats = optimal_shrinkage(Yl, 1.0, ShrinkageOptions(method=method))
    assert out.dtype == dtype and stats.num_denoised == 1
    # computed in float32 from the same values
    ref, _ = optimal_shrinkage(Yl.float(), 1.0, ShrinkageOptions(method=method))
    assert torch.equal(out, ref.to(dtype))
    assert rel(out.float().numpy(), np_denoise(Yl.double().numpy(), 1.0)[0]) < 1e-2
    d, st = denoise_matrices({"w": Yl, "b": torch.ones(3, dtype=dtype)}, 1.0, ShrinkageOptions(method=method))
    assert d["w"].dtype == dtype and st.num_denoised == 1
    # batched vs single decomposition: equal up to one rounding of a low-precision value
    torch.testing.assert_close(d["w"], out)
    noise = torch.randn(128, 256, dtype=torch.float32, generator=torch.Generator().manual_seed(51)).to(dtype)
    assert optimal_shrinkage(noise, 1.0, ShrinkageOptions(method=method))[0] is noise


# ------------------------------------------------------------------------------------------ helpers and edges


@pytest.mark.parametrize("beta", [1.0, 0.25, 1 / 12])
def test_spike_inverse_and_seed_form_of_the_shrinker(beta):
    x = torch.linspace(beta ** 0.25 + 0.05, 6.0, 50, dtype=torch.float64)  # detectable spikes
    y = torch.sqrt((1 + x ** 2) * (beta + x ** 2)) / x                    # where they land (BBP / Benaych-Georges)
    assert bool((y > 1 + math.sqrt(beta)).all())
    torch.testing.assert_close(spike_inverse(y, beta), x, rtol=1e-10, atol=0)
    # the paper's form (Dadsetan and Rudzicz, 2025) eta = x * c_u * c_v is the same estimator as the closed form in y
    cu = torch.sqrt((x ** 4 - beta) / (x ** 4 + beta * x ** 2))
    cv = torch.sqrt((x ** 4 - beta) / (x ** 4 + x ** 2))
    torch.testing.assert_close(optimal_shrinker(y, beta), x * cu * cv, rtol=1e-10, atol=0)
    below = torch.tensor([0.0, 0.5, 1 + math.sqrt(beta)], dtype=torch.float64)
    assert torch.equal(optimal_shrinker(below, beta), torch.zeros(3, dtype=torch.float64))
    assert torch.equal(spike_inverse(below, beta), torch.zeros(3, dtype=torch.float64))


@pytest.mark.parametrize("method", ["auto", "full", "randomized"])
@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
def test_zero_std_and_non_finite(method, bad_value):
    _, Y = signal_plus_noise(60, 80, [5.0], seed=60)
    Yt = torch.from_numpy(Y).float()
    out, stats = optimal_shrinkage(Yt, 0.0, ShrinkageOptions(method=method))  # no noise: nothing to remove
    assert out is Yt and stats == DenoiseStats(1, 0, 0, 0.0)
    bad = Yt.clone()
    bad[3, 4] = bad_value
    out, stats = optimal_shrinkage(torch.stack([bad, Yt]), 1.0, ShrinkageOptions(method=method))
    assert stats.num_denoised == 1
    assert torch.equal(torch.isnan(out[0]), torch.isnan(bad))  # left as it was (NaN != NaN, so two checks)
    assert torch.equal(torch.nan_to_num(out[0]), torch.nan_to_num(bad))
    assert not torch.equal(out[1], Yt)
    out, stats = optimal_shrinkage(torch.stack([Yt, bad]), torch.tensor([0.0, 1.0]), ShrinkageOptions(method=method))
    assert stats.num_denoised == 0 and torch.equal(out[0], Yt)


def test_bad_arguments():
    _, Y = signal_plus_noise(60, 80, [5.0], seed=60)
    Yt = torch.from_numpy(Y).float()
    requires = Yt.clone().requires_grad_()
    assert not optimal_shrinkage(requires, 1.0)[0].requires_grad
    with pytest.raises(ValueError):
        optimal_shrinkage(Yt, -1.0)
    with pytest.raises(ValueError):
        optimal_shrinkage(Yt, float("nan"))
    with pytest.raises(ValueError):
        optimal_shrinkage(Yt, 1.0, ShrinkageOptions(kappa=0.0))
    with pytest.raises(ValueError):
        optimal_shrinkage(Yt, 1.0, ShrinkageOptions(method="lanczos"))
    with pytest.raises(ValueError):
        optimal_shrinkage(Yt, 1.0, ShrinkageOptions(method="randomized", rank=0))
    with pytest.raises(ValueError):
        optimal_shrinkage(Yt[0], 1.0)
    with pytest.raises(TypeError):
        optimal_shrinkage(torch.ones(3, 3, dtype=torch.int64), 1.0)
    with pytest.raises(ValueError):
        optimal_shrinkage(torch.stack([Yt, Yt]), torch.tensor([1.0, 1.0, 1.0]))
    for method in ("auto", "full"):
        empty, st = optimal_shrinkage(torch.zeros(0, 5), 1.0, ShrinkageOptions(method=method))
        assert empty.shape == (0, 5) and st.num_denoised == 0
        empty, st = optimal_shrinkage(torch.zeros(0, 4, 3), 1.0, ShrinkageOptions(method=method))
        assert empty.shape == (0, 4, 3) and st == DenoiseStats()
    column = torch.from_numpy(signal_plus_noise(300, 1, [4.0], seed=61)[1]).float()  # a single column: n = 1
    for method in ("auto", "full"):
        out, st = optimal_shrinkage(column, 1.0, ShrinkageOptions(method=method))
        ref, st_ref = optimal_shrinkage(column, 1.0, ShrinkageOptions(method="full"))
        assert st.num_denoised == st_ref.num_denoised and rel(out.numpy(), ref.numpy()) < 1e-5
    assert denoise_matrices({}, 1.0) == ({}, DenoiseStats())
