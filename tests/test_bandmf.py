"""Amplified banded matrix factorization (ftrl ``noise: banded``, ``sampling: cyclic_poisson``): b = 1 is DP-SGD
bit for bit, the sampler's participation pattern and Poisson rate, epsilon against prv-accountant and RDP, the
released noise covariance, planted bugs caught, the automatic choices, adjacency, and 2 processes == 1."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from opacus.accountants.analysis import rdp as opacus_rdp
from prv_accountant import PRVAccountant
from prv_accountant.privacy_random_variables import PoissonSubsampledGaussianMechanism
from test_ftrl import _ctx, _dense, _setup

from dpl.core.gradients import GradientSum
from dpl.core.mechanism import PoissonGaussian, apply_adjacency, calibrate, epsilon_of
from dpl.core.sampling import PoissonBatchSampler
from dpl.errors import ConfigError
from dpl_plugins.ftrl import FTRLPlugin
from dpl_plugins.ftrl import choice
from dpl_plugins.ftrl.mechanism import CyclicPoissonSampler
from dpl_plugins.gaussian import GaussianPlugin


def _amplified(n=64, batch=8, steps=12, bands=3, seed=None, **kw):
    plugin = FTRLPlugin(noise="banded", sampling="cyclic_poisson", bands=bands, **kw)
    return plugin, plugin.configure_mechanism(setup=_setup(n=n, batch=batch, steps=steps, seed=seed))


# ---------------------------------------------------------------------------------------------------------
# b = 1 is DP-SGD with amplification


def test_one_band_is_dp_sgd_exactly():
    n, batch, T = 64, 8, 12
    plugin, mech = _amplified(n, batch, T, bands=1)
    default = PoissonGaussian(batch / n)
    assert mech.sample_rate == default.sample_rate and mech.strategy.sensitivity == 1.0
    # the step: the same released tensors and noise std, bit for bit
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for t in range(3):
        total = {"a": torch.randn(4, 3), "b": torch.randn(5)}
        ours = plugin.privatize(ctx=_ctx(t, g1, sigma=1.3), gradient_sum=GradientSum({k: v.clone() for k, v in total.items()}, 8))
        theirs = GaussianPlugin().privatize(ctx=_ctx(t, g2, sigma=1.3), gradient_sum=GradientSum(total, 8))
        for key in total:
            assert torch.equal(ours.values[key], theirs.values[key])
        assert ours.noise_std == theirs.noise_std
    # epsilon and sigma: the same accountant calls
    for t in (1, 5, T):
        assert epsilon_of(mech, 1.3, 1e-5, t) == epsilon_of(default, 1.3, 1e-5, t)
    assert calibrate(mech, 2.0, 1e-5, T) == calibrate(default, 2.0, 1e-5, T)
    # the batches: the same draws as the default Poisson sampler from the same generator state
    ours = list(mech.batch_sampler(n, n // batch, torch.Generator().manual_seed(4)))
    theirs = list(PoissonBatchSampler(n, batch / n, n // batch, torch.Generator().manual_seed(4)))
    assert ours == theirs and mech.permutation is None


# ---------------------------------------------------------------------------------------------------------
# the sampler


def check_participation(mech, batches: list[list[int]]) -> None:
    """Every example only in steps of one residue class mod b (its partition's), the partitions are the secret
    permutation's b blocks of floor(N / b), and the columns of C one example touches are orthogonal."""
    b, m = mech.bands, mech.num_examples // mech.bands
    blocks = [set(mech.permutation[j * m:(j + 1) * m].tolist()) for j in range(b)]
    C = _dense(mech.strategy.c[:len(batches)]) if len(batches) <= mech.steps else None
    for t, batch in enumerate(batches):
        assert set(batch) <= blocks[t % b], f"step {t} sampled outside partition {t % b}"
    for i in range(mech.num_examples):
        steps = [t for t, x in enumerate(batches) if i in x]
        assert len({t % b for t in steps}) <= 1
        if C is not None and len(steps) > 1:
            gram = C[:, steps].T @ C[:, steps]
            assert np.allclose(gram - np.diag(np.diag(gram)), 0)


class _WrongPartition(CyclicPoissonSampler):
    """A planted bug: every fifth step samples the next step's partition."""

    def _batch(self, step):
        return super()._batch(step + 1 if step % 5 == 4 else step)


def test_cyclic_poisson_participation_and_rate():
    n, batch, bands, T = 62, 5, 4, 4000  # 12 batches per epoch; partitions of m = 15 (2 never sampled), q = 1/3
    _, mech = _amplified(n, batch, T, bands=bands)
    assert mech.sample_rate == pytest.approx(batch / 15)
    sampler = mech.batch_sampler(n, n // batch, torch.Generator().manual_seed(0))
    batches = []
    while len(batches) < T:
        batches.extend(sampler)
    check_participation(mech, batches)
    left_out = set(mech.permutation[4 * 15:].tolist())
    assert len(left_out) == 2 and not left_out & set().union(*map(set, batches))
    # the Poisson rate: every example of partition j joins each of its T / b steps independently with q = 1/3
    counts = np.zeros(n)
    for batch_ in batches:
        counts[batch_] += 1
    chances = T // bands
    used = counts[[i for i in range(n) if i not in left_out]]
    rate = used / chances
    se = math.sqrt(mech.sample_rate * (1 - mech.sample_rate) / chances)
    assert np.all(np.abs(rate - mech.sample_rate) < 5 * se)
    assert abs(used.mean() / chances - mech.sample_rate) < 5 * se / math.sqrt(len(used))
    assert np.mean([len(x) for x in batches]) == pytest.approx(batch, rel=0.03)  # expected batch size B
    # the planted bug is caught
    _, broken_mech = _amplified(n, batch, T, bands=bands)
    broken = _WrongPartition(broken_mech, torch.Generator().manual_seed(0))
    with pytest.raises(AssertionError, match="outside partition"):
        check_participation(broken_mech, list(broken))


def test_resumed_sampler_redraws_the_same_batches_only_when_seeded():
    """A seeded run (privacy.seed) records the sampler's state before each draw, so its resume redraws the batches it
    resumes at; any other run records nothing, and its resume draws fresh batches from the same partitions."""
    _, mech = _amplified(64, 8, 24, bands=3, seed=7)
    gen = torch.Generator().manual_seed(1)
    first = list(mech.batch_sampler(64, 8, gen))  # one epoch: steps 0..7
    secret = mech.secret_state_dict()
    _, clone = _amplified(64, 8, 24, bands=3, seed=7)
    clone.load_secret_state_dict(secret)
    again = list(clone.batch_sampler(64, 8, torch.Generator().manual_seed(99), start_step=5))
    assert again[:3] == first[5:8]
    assert len(again) == 3  # then the epoch ends
    _, unseeded = _amplified(64, 8, 24, bands=3)
    list(unseeded.batch_sampler(64, 8, torch.Generator().manual_seed(1)))
    assert unseeded.secret_state_dict()["sampler_states"] == {}
    _, fresh = _amplified(64, 8, 24, bands=3)
    fresh.load_secret_state_dict(unseeded.secret_state_dict())
    redrawn = list(fresh.batch_sampler(64, 8, torch.Generator().manual_seed(99), start_step=5))
    assert redrawn[:3] != first[5:8]
    members = [set(fresh.permutation[(t % 3) * 21:(t % 3 + 1) * 21].tolist()) for t in (5, 6, 7)]
    assert all(set(batch) <= part for batch, part in zip(redrawn, members))  # the same partitions


# ---------------------------------------------------------------------------------------------------------
# accounting


@pytest.mark.parametrize("bands, n, batch, steps, sigma", [(2, 1000, 50, 60, 1.0), (4, 1000, 25, 100, 0.8),
                                                            (8, 4096, 64, 130, 1.5), (3, 600, 20, 31, 2.0)])
def test_epsilon_equals_prv_accountant_and_is_below_rdp(bands, n, batch, steps, sigma):
    _, mech = _amplified(n, batch, steps, bands=bands)
    delta = 1e-5
    q, rounds = batch / (n // bands), math.ceil(steps / bands)  # computed here from first principles
    ours = epsilon_of(mech, sigma, delta, steps)
    prv = PRVAccountant([PoissonSubsampledGaussianMechanism(q, sigma)], eps_error=1e-2, delta_error=delta / 1000,
                        max_self_compositions=[rounds])
    low, est, up = prv.compute_epsilon(delta, [rounds])
    assert low <= ours <= up * 1.01 and ours == pytest.approx(est, rel=0.015)  # dpl: an upper bound ~0.5 % above
    orders = np.array([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))
    rdp = opacus_rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=rounds, orders=orders)
    assert ours <= opacus_rdp.get_privacy_spent(orders=orders, rdp=rdp, delta=delta)[0]
    # the wrong compositions are far off: T steps, or DP-SGD's rate B / N
    assert epsilon_of(mech, sigma, delta, steps) < epsilon_of(PoissonGaussian(q), sigma, delta, steps) / 1.2
    # calibration: the target exactly from below; epsilon after t steps counts ceil(t / b) rounds
    sigma_cal = calibrate(mech, 2.0, delta, steps)
    assert 1.97 <= epsilon_of(mech, sigma_cal, delta, steps) <= 2.0
    assert epsilon_of(mech, sigma, delta, bands + 1) == epsilon_of(PoissonGaussian(q), sigma, delta, 2)


# ---------------------------------------------------------------------------------------------------------
# the released noise


def check_covariance(plugin, mech, T=10, d=40000, sigma=1.5, clip=0.7, batch=8):
    """Zero gradients: over d i.i.d. coordinates the release's covariance across steps must be
    (sigma C_clip ||c|| / B)^2 C^-1 C^-T, C the b-banded Toeplitz strategy with c_0 = 1."""
    gen = torch.Generator().manual_seed(2)
    rows, stds = [], []
    for t in range(T):
        out = plugin.privatize(ctx=_ctx(t, gen, sigma=sigma, clip=clip, batch=batch),
                               gradient_sum=GradientSum({"g": torch.zeros(d, dtype=torch.float64)}, batch))
        rows.append(out.values["g"].numpy())
        stds.append(out.noise_std)
    X = np.stack(rows)
    c = mech.strategy.c
    Cinv = np.linalg.inv(_dense(c[:T]))
    scale = sigma * clip * float(np.linalg.norm(c[:mech.bands])) / batch
    expected = scale ** 2 * Cinv @ Cinv.T
    tol = 5 * np.sqrt((np.outer(np.diag(expected), np.diag(expected)) + expected ** 2) / d)  # 5 standard errors
    assert np.all(np.abs(X @ X.T / d - expected) < tol), "released covariance"
    np.testing.assert_allclose(np.array(stds), np.sqrt(np.diag(expected)), rtol=1e-12)


def test_released_noise_covariance_matches_the_banded_strategy(monkeypatch):
    plugin, mech = _amplified(40, 8, 10, bands=4)
    assert mech.strategy.c[1] > 0 and np.all(mech.strategy.c[4:] == 0)  # a real 4-banded strategy
    check_covariance(plugin, mech)
    # planted bug: sigma applied to the unnormalised strategy (not divided by its column norm)
    plugin, mech = _amplified(40, 8, 10, bands=4)
    monkeypatch.setattr(type(mech), "noise_scale", property(lambda self: 1.0))
    with pytest.raises(AssertionError, match="released covariance"):
        check_covariance(plugin, mech)


# ---------------------------------------------------------------------------------------------------------
# automatic choices


def test_band_range():
    assert choice.band_range(32, 1000, 16) == [16, 1, 2, 4, 8]
    assert choice.band_range(12, 1000, 16) == [12, 1, 2, 4, 8]
    assert choice.band_range(40, 3, 16) == [3, 1, 2]
    assert choice.band_range(1, 100, 16) == [1]


def test_automatic_choice_minimises_the_expected_error(caplog):
    n, batch, T = 2048, 64, 96  # 32 steps per epoch, 3 epochs
    plugin = FTRLPlugin()  # noise chosen among blt, independent and amplified banded b = 1..16
    mech = plugin.configure_mechanism(setup=_setup(n=n, batch=batch, steps=T))
    candidates = [mech.sampled_strategy, *mech.candidates]
    assert {(p.sampling, p.strategy.family, p.bands) for p in candidates} == {
        ("cyclic_poisson", "banded", b) for b in (1, 2, 4, 8, 16)} | {("shuffle", "blt", 0), ("shuffle", "independent", 0)}
    errors = {}
    for p in candidates:
        errors[p.label()] = mech.calibrate_strategy(p, 1.0, 1e-5, T) * p.strategy.expected_error
    with caplog.at_level("INFO", logger="dpl"):
        sigma = calibrate(mech, 1.0, 1e-5, T)
    assert mech.sampled_strategy.label() == min(errors, key=errors.get) and not mech.candidates
    assert "ftrl chose" in caplog.text and "amplified DP-SGD (b=1)" in caplog.text
    assert epsilon_of(mech, sigma, 1e-5, T) <= 1.0
    # the amplified strategies beat independent (shuffled) noise at small epsilon
    assert errors["amplified DP-SGD (b=1)"] < errors["independent (shuffled, no amplification)"]
    # without a target epsilon (fixed sigma): amplified banded with the largest b tried
    fixed = FTRLPlugin().configure_mechanism(setup=_setup(n=n, batch=batch, steps=T))
    epsilon_of(fixed, 1.0, 1e-5, T)
    assert fixed.sampled_strategy.label() == "amplified banded (b=16)"
    # shuffled only: sigma does not depend on the strategy, the least strategy error wins (BLT over independent)
    shuffled = FTRLPlugin(sampling="shuffle").configure_mechanism(setup=_setup(n=n, batch=batch, steps=T))
    assert shuffled.sampled_strategy.strategy.family == "blt" and not shuffled.candidates


def test_chosen_strategy_survives_a_checkpoint():
    plugin = FTRLPlugin(noise="banded")
    mech = plugin.configure_mechanism(setup=_setup(n=2048, batch=64, steps=96))
    calibrate(mech, 8.0, 1e-5, 96)
    state = mech.state_dict()
    other = FTRLPlugin(noise="banded").configure_mechanism(setup=_setup(n=2048, batch=64, steps=96))
    other.load_state_dict(state)
    assert other.sampled_strategy.bands == mech.sampled_strategy.bands
    assert np.array_equal(other.strategy.c, mech.strategy.c)


# ---------------------------------------------------------------------------------------------------------
# adjacency


def test_adjacency_is_stated_and_refused_where_not_proved():
    assert PoissonGaussian(0.1).adjacency == "add_remove"
    _, amplified = _amplified()
    assert amplified.adjacency == "zero_out"
    with pytest.raises(ConfigError, match="replace_one") as info:
        apply_adjacency(amplified, "replace_one")
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="add_remove"):
        apply_adjacency(amplified, "add_remove")
    apply_adjacency(PoissonGaussian(0.1), "zero_out")  # implied by add/remove for the Poisson-sampled sum
    with pytest.raises(ConfigError, match="replace_one"):
        apply_adjacency(PoissonGaussian(0.1), "replace_one")


def test_replace_one_doubles_the_noise_at_the_same_epsilon():
    setup = _setup(n=80, batch=8, steps=40)
    zero = FTRLPlugin(noise="blt", sampling="shuffle")
    replace = FTRLPlugin(noise="blt", sampling="shuffle")
    m0, m1 = zero.configure_mechanism(setup=setup), replace.configure_mechanism(setup=setup)
    assert m0.adjacency == "zero_out"
    apply_adjacency(m1, "replace_one")
    assert m1.adjacency == "replace_one" and m1.state_dict()["adjacency"] == "replace_one"
    sigma = calibrate(m1, 3.0, 1e-5, 40)
    assert sigma == calibrate(m0, 3.0, 1e-5, 40) and epsilon_of(m1, sigma, 1e-5, 40) == epsilon_of(m0, sigma, 1e-5, 40)
    g0, g1 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a = zero.privatize(ctx=_ctx(0, g0, sigma=sigma), gradient_sum=GradientSum({"g": torch.zeros(50)}, 8))
    b = replace.privatize(ctx=_ctx(0, g1, sigma=sigma), gradient_sum=GradientSum({"g": torch.zeros(50)}, 8))
    torch.testing.assert_close(b.values["g"], 2 * a.values["g"], rtol=1e-6, atol=0)
    assert b.noise_std == pytest.approx(2 * a.noise_std, rel=1e-12)
    with pytest.raises(ConfigError, match="adjacency"):
        m0.load_state_dict(m1.state_dict())  # a resume cannot change it


# ---------------------------------------------------------------------------------------------------------
# 2 processes == 1 process


def test_two_processes_equal_one(tmp_path):
    from test_ddp import assert_same_params, run, summation_tolerance

    plugins = {"ftrl": {"noise": "banded", "bands": 3}}
    one = run(tmp_path / "one", 1, plugins=plugins)[0]
    two = run(tmp_path / "two", 2, plugins=plugins)
    assert len(one["batches"]) == 4 and any(one["batches"])
    for step, batch in enumerate(one["batches"]):
        shards = [set(r["batches"][step]) for r in two]
        assert not shards[0] & shards[1] and sorted(shards[0] | shards[1]) == sorted(batch)
    for rank in two:
        assert rank["epsilon"] == one["epsilon"] and rank["sigma"] == one["sigma"]
        assert_same_params(rank["params"], one["params"], atol=summation_tolerance(one, steps=4, lr=0.5))


def test_the_readmes_error_table_is_what_bandmf_error_py_computes(tmp_path):
    """plugins/ftrl/README.md's prefix-sum error table: the committed results as the script computes them now."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "bandmf_error.json"
    subprocess.run([sys.executable, str(root / "benchmarks" / "bandmf_error.py"), "--json", str(out)], check=True,
                   capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    committed = json.loads((root / "benchmarks" / "results" / "bandmf_error.json").read_text())["results"]
    fresh = json.loads(out.read_text())["results"]
    assert [sorted(r["plans"]) for r in fresh] == [sorted(r["plans"]) for r in committed]
    for now, then in zip(fresh, committed):
        for label, plan in now["plans"].items():
            assert plan["error"] == pytest.approx(then["plans"][label]["error"], rel=1e-6), label
    sys.path.insert(0, str(root / "benchmarks"))
    from bandmf_error import table

    assert table(committed) in (root / "plugins" / "ftrl" / "README.md").read_text()
