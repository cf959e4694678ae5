"""The ftrl plugin: coefficients and sensitivity (design.md anchors, brute force), the streamed noise (dense product,
covariance, BLT inverse), the mechanism (calibration, sampler), its place in the step (independent == gaussian,
denoise reads its noise_std), refusals, a `dpl fit` run and the exact resume."""

from __future__ import annotations

import csv
import itertools
import math
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import scipy.linalg
import torch
import torch.nn.functional as F
from helpers import SaveAndStopAt, VectorDataModule, VectorModule
from scipy import optimize, stats
from torch import nn

from dpl.errors import ConfigError
from dpl.core.gradients import GradientSum
from dpl.core.mechanism import calibrate, epsilon_of
from dpl.core.plugin_manager import create_plugin_manager
from dpl.core.privacy import PrivacyConfig
from dpl.core.step import RunSetup, StepContext, private_step
from dpl_plugins.ftrl import FTRLPlugin
from dpl_plugins.ftrl import strategies as S
from dpl_plugins.ftrl import streams
from dpl_plugins.ftrl.mechanism import FTRLMechanism
from dpl_plugins.ftrl.streams import BandedStream, BLTStream, DenseKeepStream, DenseRegenerateStream
from dpl_plugins.gaussian import GaussianPlugin

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("nu_ftrl", "banded", "blt", "independent")


def _dense(col: np.ndarray) -> np.ndarray:
    return scipy.linalg.toeplitz(col, np.zeros(len(col)))


# ---------------------------------------------------------------------------------------------------------
# coefficients and sensitivity


def test_design_note_anchors():
    c0 = S.nu_strategy_coefficients(1000, 0.0)
    assert float(np.sum(c0 ** 2)) == pytest.approx(3.265, abs=5e-4)
    assert S.sensitivity_prefix(c0, 1000)[-1] ** 2 == pytest.approx(3.265, abs=5e-4)
    assert S.sensitivity_prefix(c0, 100)[-1] ** 2 == pytest.approx(83.8, abs=0.05)
    assert S.sensitivity_prefix(S.nu_strategy_coefficients(1000, 0.01), 100)[-1] ** 2 == pytest.approx(24.5, abs=0.05)
    beta = S.nu_noising_coefficients(200, 0.05)
    np.testing.assert_allclose(_dense(S.nu_strategy_coefficients(200, 0.05)) @ _dense(beta), np.eye(200), atol=1e-12)
    assert float(np.sum(S.nu_noising_coefficients(200000, 0.05))) == pytest.approx(math.sqrt(0.05), rel=1e-6)


def _patterns_min_separation(n: int, k: int, b: int):
    for size in range(1, k + 1):
        for steps in itertools.combinations(range(n), size):
            if all(y - x >= b for x, y in zip(steps, steps[1:])):
                yield steps


@pytest.mark.parametrize("family", FAMILIES)
def test_sensitivity_equals_brute_force_over_participation_patterns(family):
    n, b = 12, 4  # k = 3 participations
    strat = S.make_strategy(family, n, b)
    C = _dense(strat.c)
    # the sampler's patterns: offset i, then every b steps; worst gradients: identical unit vectors (C >= 0) ...
    periodic = max(float(np.sum(C[:, list(range(i, n, b))].sum(axis=1) ** 2)) for i in range(b))
    assert strat.sensitivity ** 2 == pytest.approx(periodic, rel=1e-12)
    # ... no choice of unit gradients does worse (random directions in 5 dimensions)
    gen = np.random.default_rng(0)
    for i in range(b):
        cols = C[:, list(range(i, n, b))]
        for _ in range(200):
            g = gen.normal(size=(cols.shape[1], 5))
            g /= np.linalg.norm(g, axis=1, keepdims=True)
            assert float(np.sum((cols @ g) ** 2)) <= strat.sensitivity ** 2 * (1 + 1e-12)
    # prefix sensitivities: the first t rows
    for t in range(1, n + 1):
        best = max(float(np.sum(C[:t][:, list(range(i, n, b))].sum(axis=1) ** 2)) for i in range(b))
        assert strat.sens_prefix[t - 1] ** 2 == pytest.approx(best, rel=1e-12)
    if family == "nu_ftrl":  # non-increasing c: the periodic pattern is the worst of all min-separation patterns
        worst = max(float(np.sum(C[:, list(p)].sum(axis=1) ** 2)) for p in _patterns_min_separation(n, 3, b))
        assert strat.sensitivity ** 2 == pytest.approx(worst, rel=1e-12)


def test_fitted_strategies_beat_independent_noise_and_are_fast():
    T, b = 600, 60
    errors = {}
    for family in FAMILIES:
        strat = S.make_strategy(family, T, b)
        assert strat.fit_seconds < 10
        assert np.all(strat.c >= 0)
        errors[family] = strat.expected_error
    assert errors["independent"] == pytest.approx(S.independent_error(T, b))
    assert errors["blt"] < 0.5 * errors["independent"]
    assert errors["nu_ftrl"] < 0.5 * errors["independent"]
    trunc = S.make_strategy("banded", T, b, bands=4, banded_coefficients="truncated")
    assert errors["banded"] <= trunc.expected_error * (1 + 1e-9)  # the fit starts there and only improves


def test_blt_keeps_the_fewest_buffers_within_tolerance_of_the_best_fit():
    """nbuf is a maximum: one fit per buffer count, the fewest buffers within 1% of the best error are kept (each
    buffer is a model-size vector read and written every step). At T = 2000 with 10 participations the 4-buffer
    fit ends in a worse optimum than a 2-buffer one: the choice is never worse than any count's fit."""
    T, every = 2000, 200
    fits = {n: S._blt_strategy(T, every, n, S.default_nu(T)).expected_error for n in (1, 2, 3, 4)}
    chosen = S.make_strategy("blt", T, every, nbuf=4)
    n = chosen.params["nbuf"]
    assert len(chosen.params["omega"]) == n and fits[n] == pytest.approx(chosen.expected_error)
    assert chosen.expected_error <= min(fits.values()) * (1 + S.BLT_TOLERANCE)
    assert all(fits[m] > min(fits.values()) * (1 + S.BLT_TOLERANCE) for m in range(1, n))
    assert chosen.expected_error < fits[4]  # the 4-buffer fit alone is worse here
    assert S.make_strategy("blt", T, every, nbuf=1).params["nbuf"] == 1


def test_blt_and_its_inverse_compose_to_identity():
    omega, theta, _ = S.fit_blt(300, 300, 3, S.default_nu(300))
    assert np.all(omega > 0) and np.all((theta > 0) & (theta < 1))
    omega_hat, theta_hat = S.blt_inverse_parameters(omega, theta)
    assert np.isrealobj(omega_hat) and len(theta_hat) == 3
    C = _dense(S.blt_toeplitz_coefficients(omega, theta, 300))
    C_inv = _dense(S.blt_toeplitz_coefficients(omega_hat, theta_hat, 300))
    np.testing.assert_allclose(C @ C_inv, np.eye(300), atol=1e-9)
    np.testing.assert_allclose(C_inv, _dense(S.blt_coefficients(omega, theta, 300)[1]), atol=1e-9)


# ---------------------------------------------------------------------------------------------------------
# streams


def _stream(strat: S.Strategy, memory: str = "keep"):
    if strat.family == "banded":
        return BandedStream(strat.c[:strat.params["bands"]])
    if strat.family == "blt":
        return BLTStream(strat.params["omega"], strat.params["theta"])
    return DenseKeepStream(strat.beta) if memory == "keep" else DenseRegenerateStream(strat.beta)


@pytest.mark.parametrize("family,memory,chunk", [("nu_ftrl", "keep", None), ("nu_ftrl", "regenerate", None),
                                                 ("banded", None, None), ("blt", None, None), ("banded", None, 3),
                                                 ("blt", None, 3)])
def test_streaming_equals_the_dense_matrix_product(family, memory, chunk, monkeypatch):
    """Chunk 3: the fused streams' chunked pass (7 columns: chunks of 3, 3, 1) gives the same product."""
    if chunk is not None:
        monkeypatch.setattr(streams, "CHUNK", chunk)
    T, d = 25, 7
    strat = S.make_strategy(family, T, 10, bands=5, banded_coefficients="truncated", nbuf=3)
    stream = _stream(strat, memory)
    gen = torch.Generator().manual_seed(1)

    def draw(source):
        return {"a": torch.randn(d, generator=source, dtype=torch.float64),
                "b": torch.randn(2, 2, generator=source, dtype=torch.float64)}

    Z, W = [], []
    for _ in range(T):
        if memory == "regenerate":
            stream.record(gen)
            z = draw(gen)
            w = stream.push(z, draw)
        else:
            z = draw(gen)
            w = {k: stream.push(k, v.clone()).clone() for k, v in z.items()}
            stream.end_step()
        Z.append(torch.cat([z["a"], z["b"].flatten()]).numpy())
        W.append(torch.cat([w["a"], w["b"].flatten()]).numpy())
    expected = scipy.linalg.solve_triangular(_dense(strat.c), np.stack(Z), lower=True)
    np.testing.assert_allclose(np.stack(W), expected, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(np.stack(W), _dense(strat.beta) @ np.stack(Z), rtol=1e-9, atol=1e-9)


def _setup(n=64, batch=8, steps=12, trainable=None, secure_noise=False, model=None, seed=None):
    trainable = trainable if trainable is not None else {"w": nn.Parameter(torch.zeros(3))}
    return RunSetup(model=model if model is not None else nn.Linear(1, 1), trainable=trainable, plugin_names=["ftrl"], population=n,
                    expected_batch_size=batch, steps=steps, sampling_rate=batch / n, accountant="prv",
                    optimizer_name="SGD", secure_noise=secure_noise, seed=seed)


def _ctx(step, gen, sigma=1.5, clip=0.7, batch=8, logs=None):
    logs = {} if logs is None else logs
    return StepContext(model=None, trainable={}, per_example_loss=None, max_grad_norm=clip, noise_multiplier=sigma,
                       expected_batch_size=batch, step=step, noise_source=gen,
                       log=lambda k, v: logs.__setitem__(k, v))


@pytest.mark.parametrize("family", ["nu_ftrl", "blt", "banded"])
def test_empirical_covariance_of_the_released_noise(family):
    """Zero gradients: the release is sigma C sens (C^-1 Z)_t / B; over 40k i.i.d. coordinates its covariance across
    steps must be (sigma C sens / B)^2 (C^-1)(C^-1)^T, and noise_std its diagonal's root."""
    T, d = 10, 40000
    plugin = FTRLPlugin(noise=family, sampling="shuffle", bands=3)
    mech = plugin.configure_mechanism(setup=_setup(n=40, batch=8, steps=T))  # b = 5, k = 2
    strat = mech.strategy
    gen = torch.Generator().manual_seed(2)
    rows, stds = [], []
    for t in range(T):
        out = plugin.privatize(ctx=_ctx(t, gen), gradient_sum=GradientSum({"g": torch.zeros(d, dtype=torch.float64)}, 8))
        rows.append(out.values["g"].numpy())
        stds.append(out.noise_std)
        assert out.mechanism == "ftrl" and out.step == t
    X = np.stack(rows)
    scale = 1.5 * 0.7 * strat.sensitivity / 8
    expected = scale ** 2 * _dense(strat.beta) @ _dense(strat.beta).T
    empirical = X @ X.T / d
    tol = 5 * np.sqrt((np.outer(np.diag(expected), np.diag(expected)) + expected ** 2) / d)  # 5 standard errors
    assert np.all(np.abs(empirical - expected) < tol)
    np.testing.assert_allclose(np.array(stds), np.sqrt(np.diag(expected)), rtol=1e-12)
    assert len(set(np.round(stds, 12))) > 1  # the marginal std changes with t


@pytest.mark.parametrize("family,memory", [("nu_ftrl", "keep"), ("nu_ftrl", "regenerate"), ("blt", "keep"),
                                           ("banded", "keep")])
def test_correlated_noise_across_a_resume_with_fresh_noise(family, memory):
    """A resume without privacy.seed draws fresh noise (another generator) and keeps the stream's secret state (the
    buffers, or for ``memory: regenerate`` the generator states of every earlier draw, each segment's key among
    them): the covariance across the segment boundary is the uninterrupted run's, (sigma C sens / B)^2 beta beta^T
    over 40k i.i.d. coordinates (5 standard errors). Without the stream state the cross-boundary terms are 0."""
    T, d, k = 10, 40000, 4
    plugin = FTRLPlugin(noise=family, sampling="shuffle", bands=3, memory=memory)
    mech = plugin.configure_mechanism(setup=_setup(n=40, batch=8, steps=T))
    strat = mech.strategy
    gen = torch.Generator().manual_seed(2)
    rows = []
    for t in range(T):
        if t == k:  # the resume: a new plugin from the public and secret state, and a generator of its own
            public, secret = plugin.state_dict(), plugin.secret_state_dict()
            plugin = FTRLPlugin(noise=family, sampling="shuffle", bands=3, memory=memory)
            plugin.configure_mechanism(setup=_setup(n=40, batch=8, steps=T))
            plugin.load_state_dict(public)
            plugin.load_secret_state_dict(secret)
            gen = torch.Generator().manual_seed(3)
        out = plugin.privatize(ctx=_ctx(t, gen), gradient_sum=GradientSum({"g": torch.zeros(d, dtype=torch.float64)}, 8))
        rows.append(out.values["g"].numpy())
    X = np.stack(rows)
    scale = 1.5 * 0.7 * strat.sensitivity / 8
    expected = scale ** 2 * _dense(strat.beta) @ _dense(strat.beta).T
    tol = 5 * np.sqrt((np.outer(np.diag(expected), np.diag(expected)) + expected ** 2) / d)
    assert np.all(np.abs(X @ X.T / d - expected) < tol)
    assert abs(expected[k, k - 1]) > 10 * tol[k, k - 1]  # the cross-boundary covariance is there to be checked


def test_independent_reproduces_the_default_gaussian_step_exactly():
    T = 12  # N = 64, B = 8: k = 2 participations
    plugin = FTRLPlugin(noise="independent")
    mech = plugin.configure_mechanism(setup=_setup(steps=T))
    sens = mech.strategy.sensitivity
    assert sens == pytest.approx(math.sqrt(2), rel=1e-15)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    sigma = 1.3
    for t in range(3):
        total = {"a": torch.randn(4, 3), "b": torch.randn(5)}
        ours = plugin.privatize(ctx=_ctx(t, g1, sigma=sigma), gradient_sum=GradientSum({k: v.clone() for k, v in total.items()}, 8))
        theirs = GaussianPlugin().privatize(ctx=_ctx(t, g2, sigma=sigma * sens), gradient_sum=GradientSum(total, 8))
        for key in total:
            assert torch.equal(ours.values[key], theirs.values[key])
        assert ours.noise_std == theirs.noise_std
    # and its accounting is DP-SGD without amplification: k compositions of the Gaussian mechanism
    assert epsilon_of(mech, sigma, 1e-5, T) == pytest.approx(_analytic_epsilon(sigma * sens / math.sqrt(2), 1e-5), rel=1e-9)


# ---------------------------------------------------------------------------------------------------------
# accounting


def _analytic_delta(s: float, eps: float) -> float:  # Balle & Wang (2018), Theorem 8, sensitivity 1, std s
    return stats.norm.cdf(1 / (2 * s) - eps * s) - math.exp(eps) * stats.norm.cdf(-1 / (2 * s) - eps * s)


def _analytic_epsilon(s: float, delta: float) -> float:
    return optimize.brentq(lambda e: _analytic_delta(s, e) - delta, 0, 500, xtol=1e-12)


@pytest.mark.parametrize("family", FAMILIES)
def test_calibrated_sigma_gives_the_target_epsilon(family):
    T = 40
    mech = FTRLPlugin(noise=family, sampling="shuffle").configure_mechanism(setup=_setup(n=80, batch=8, steps=T))  # b = 10, k = 4
    for eps, delta in [(0.5, 1e-5), (3.0, 1e-6), (8.0, 1e-3)]:
        sigma = calibrate(mech, eps, delta, T)
        assert _analytic_delta(sigma, eps) == pytest.approx(delta, rel=1e-6)  # the whole run: one Gaussian mechanism
        assert epsilon_of(mech, sigma, delta, T) == pytest.approx(eps, rel=1e-8)
        assert epsilon_of(mech, sigma, delta, T) <= eps * (1 + 1e-12)
    sigma = calibrate(mech, 2.0, 1e-5, T)
    partial = [epsilon_of(mech, sigma, 1e-5, t) for t in range(1, T + 1)]
    assert partial == sorted(partial) and partial[0] < partial[-1]
    t = 15  # after t steps: the Gaussian mechanism on the first t releases, with sensitivity sens_t
    s_eff = sigma * mech.strategy.sensitivity / mech.strategy.sens_prefix[t - 1]
    assert partial[t - 1] == pytest.approx(_analytic_epsilon(s_eff, 1e-5), rel=1e-8)
    assert epsilon_of(mech, sigma, 1e-5, T + 1) == math.inf


def test_sigma_change_on_resume_is_refused():
    mech = FTRLPlugin(noise="blt").configure_mechanism(setup=_setup(steps=12))
    assert mech.resumable_with_changes is False  # one analysis over the stream: the ledger refuses a changed sigma
    other = FTRLPlugin(noise="blt").configure_mechanism(setup=_setup(steps=20))
    with pytest.raises(ConfigError, match="steps"):
        mech.load_state_dict(other.state_dict())


# ---------------------------------------------------------------------------------------------------------
# sampler


def test_sampler_participation_pattern_and_resume():
    n, batch, T = 23, 5, 11  # b = 4 batches per epoch, 3 examples left out
    mech = FTRLPlugin(noise="independent").configure_mechanism(setup=_setup(n=n, batch=batch, steps=T))
    gen = torch.Generator().manual_seed(0)
    sampler = mech.batch_sampler(n, 4, gen)
    assert len(sampler) == 4
    batches = []
    while len(batches) < T:
        batches.extend(list(sampler))
    batches = batches[:T]
    assert all(len(x) == batch and len(set(x)) == batch for x in batches)
    steps_of = {i: [t for t, x in enumerate(batches) if i in x] for i in range(n)}
    left_out = [i for i, s in steps_of.items() if not s]
    assert len(left_out) == 3 and set(left_out) == set(mech.permutation[20:].tolist())
    for steps in steps_of.values():
        if steps:
            assert steps == list(range(steps[0], T, 4)) and steps[0] < 4  # every b steps, from its slot on
    # same order every epoch, and a resumed sampler picks up at the step's slot
    resumed = mech.batch_sampler(n, 4, torch.Generator().manual_seed(99), start_step=6)
    first = list(resumed)
    assert first == batches[6:8]
    assert list(resumed) == batches[8:11] + [batches[3]]
    # an epoch abandoned half way cannot be continued
    broken = mech.batch_sampler(n, 4, gen)
    it = iter(broken)
    next(it)
    with pytest.raises(ConfigError, match="end of an epoch"):
        next(iter(broken))


# ---------------------------------------------------------------------------------------------------------
# refusals and state


def test_refusals():
    with pytest.raises(ConfigError, match="needs noise: banded"):
        FTRLPlugin(noise="blt", sampling="cyclic_poisson")
    with pytest.raises(ConfigError, match="at most floor"):
        FTRLPlugin(noise="banded", bands=9).validate_setup(setup=_setup(n=64, batch=8))
    with pytest.raises(ConfigError, match="divide"):
        FTRLPlugin(noise="blt", drop_remainder=False).validate_setup(setup=_setup(n=65, batch=8))
    FTRLPlugin(noise="blt").validate_setup(setup=_setup(n=65, batch=8))  # default: drop the remainder
    with pytest.raises(ConfigError, match="secure_noise"):
        FTRLPlugin(noise="nu_ftrl").validate_setup(setup=_setup(secure_noise=True))
    FTRLPlugin(noise="nu_ftrl", memory="keep").validate_setup(setup=_setup(secure_noise=True))
    plugin = FTRLPlugin(noise="blt")
    mech = plugin.configure_mechanism(setup=_setup())
    for obj in (plugin, mech):
        with pytest.raises(ConfigError, match="sidecar"):
            obj.load_secret_state_dict(None)


def test_state_split_public_secret():
    plugin = FTRLPlugin(noise="blt", nbuf=2)
    mech = plugin.configure_mechanism(setup=_setup(steps=12))
    mech.ensure_permutation(torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(0)
    for t in range(3):
        plugin.privatize(ctx=_ctx(t, gen), gradient_sum=GradientSum({"g": torch.ones(6)}, 8))
    public = {"plugin": plugin.state_dict(), "mechanism": mech.state_dict()}
    flat = repr(public)
    assert "tensor" not in flat.lower() and public["plugin"]["step"] == 3
    assert public["mechanism"]["params"]["omega"] == list(mech.strategy.params["omega"])
    secret = plugin.secret_state_dict()
    assert secret["stream"]["buffers"]["g"].shape == (mech.strategy.params["nbuf"], 6)
    assert torch.equal(mech.secret_state_dict()["permutation"], mech.permutation)
    # a fresh plugin restored from both continues the same stream
    clone = FTRLPlugin(noise="blt", nbuf=2)
    clone.configure_mechanism(setup=_setup(steps=12))
    clone.load_state_dict(public["plugin"])
    clone.mechanism.load_state_dict(public["mechanism"])
    clone.load_secret_state_dict(secret)
    g_a, g_b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    a = plugin.privatize(ctx=_ctx(3, g_a), gradient_sum=GradientSum({"g": torch.ones(6)}, 8))
    b = clone.privatize(ctx=_ctx(3, g_b), gradient_sum=GradientSum({"g": torch.ones(6)}, 8))
    assert torch.equal(a.values["g"], b.values["g"])


# ---------------------------------------------------------------------------------------------------------
# with denoise on top


def test_denoise_reads_ftrl_marginal_noise_std(monkeypatch):
    import dpl_plugins.denoise as denoise_module

    seen = []
    real = denoise_module.denoise_matrices

    def spy(matrices, stds, *args, **kwargs):
        seen.append(dict(stds))
        return real(matrices, stds, *args, **kwargs)

    monkeypatch.setattr(denoise_module, "denoise_matrices", spy)
    model = nn.Sequential(nn.Linear(12, 10), nn.Tanh(), nn.Linear(10, 2))
    trainable = dict(model.named_parameters())
    manager = create_plugin_manager({"ftrl": {"noise": "blt", "nbuf": 2}, "denoise": {}})
    setup = _setup(n=64, batch=8, steps=6, trainable=trainable, model=model)
    manager.hook.validate_setup(setup=setup)
    mech = manager.hook.configure_mechanism(setup=setup)
    assert isinstance(mech, FTRLMechanism)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 12), torch.randint(0, 2, (8,))
    for t in range(3):
        ctx = StepContext(model=model, trainable=trainable, max_grad_norm=1.0, noise_multiplier=0.8,
                          per_example_loss=lambda batch: F.cross_entropy(model(batch["x"]), batch["y"], reduction="none"),
                          expected_batch_size=8, step=t, noise_source=gen, log=lambda k, v: None)
        private_step(manager.hook, ctx, {"x": x, "y": y}, physical_batch_size=8, mechanism="ftrl")
        expected = 0.8 * 1.0 * mech.strategy.sensitivity * mech.strategy.marginal_std(t) / 8
        assert set(seen[-1]) == {"0.weight", "2.weight"}
        assert all(v == pytest.approx(expected, rel=1e-12) for v in seen[-1].values())
    assert seen[0]["0.weight"] != seen[2]["0.weight"]


# ---------------------------------------------------------------------------------------------------------
# end to end: `dpl fit` with the config fragment, and the exact resume


def test_dpl_fit_with_the_config_fragment(tmp_path, capsys):
    from helpers import save_tiny_bert, write_sentiment_tsv

    from dpl.cli import main

    model = save_tiny_bert(tmp_path / "model")
    write_sentiment_tsv(tmp_path / "data" / "train.tsv", rows=96)
    write_sentiment_tsv(tmp_path / "data" / "validation.tsv", rows=32, seed=1)
    root = tmp_path / "runs"
    main(["fit", "--model", "dpl.tasks.modules.DPClassificationModule", "--model.model", model,
          "--config", str(ROOT / "plugins" / "ftrl" / "ftrl.yaml"),
          "--model.privacy.target_epsilon", "4", "--model.privacy.batch_size", "16",
          "--model.privacy.physical_batch_size", "16",
          "--data", "dpl.tasks.data.ClassificationDataModule", "--data.tokenizer", model,
          "--data.data_dir", str(tmp_path / "data"), "--data.max_length", "16",
          "--trainer.max_epochs", "2", "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(root),
          "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
          "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(root)])
    out = capsys.readouterr().out
    assert "dpl: trained 12 private steps; privacy spent (epsilon=" in out  # 2 epochs x 96/16
    eps = float(out.split("epsilon=")[1].split(",")[0])
    assert 3.99 < eps <= 4.0  # exact Gaussian-mechanism calibration: no slack
    rows = list(csv.DictReader(open(next(root.rglob("metrics.csv")))))
    logged = [float(r["epsilon"]) for r in rows if r.get("epsilon")]
    assert logged == sorted(logged) and logged[-1] == pytest.approx(eps, abs=1e-3)
    stds = [float(r["ftrl/noise_std"]) for r in rows if r.get("ftrl/noise_std")]
    assert len(stds) == 12 and len(set(stds)) > 1


class _Recorder(L.Callback):
    def __init__(self) -> None:
        self.batches = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(batch["x"].clone())


def _fit(tmp, family, ckpt=None, stop_at=None, seed=3):
    module = VectorModule(privacy=PrivacyConfig(target_epsilon=3.0, batch_size=8, physical_batch_size=8, seed=seed),
                           plugins={"ftrl": {"noise": family, "nbuf": 2, "bands": 3}},
                           optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    recorder = _Recorder()
    callbacks = [recorder] + ([SaveAndStopAt(stop_at[0], stop_at[1])] if stop_at else [])
    trainer = L.Trainer(max_steps=10, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        default_root_dir=str(tmp), callbacks=callbacks)
    trainer.fit(module, datamodule=VectorDataModule(), ckpt_path=None if ckpt is None else str(ckpt))
    return module, recorder.batches


@pytest.mark.parametrize("family", ["blt", "banded", "nu_ftrl"])
def test_exact_resume_ten_steps_equal_five_plus_five(tmp_path, family):
    """10 steps == 5 + resume (.ckpt + .secret sidecar) + 5, bit for bit, for a seeded run (privacy.seed: the resume
    replays the sidecar's noise and sampler streams, not the new seed's); 8 steps per epoch: crosses an epoch."""
    full, full_batches = _fit(tmp_path / "a", family)
    path = tmp_path / "five.ckpt"
    first, first_batches = _fit(tmp_path / "b", family, stop_at=(5, path))
    assert first.engine.steps_done == 5 and path.exists() and Path(f"{path}.secret").exists()
    resumed, resumed_batches = _fit(tmp_path / "c", family, ckpt=path, seed=5)  # seeded: the files' streams replay
    assert full.engine.steps_done == resumed.engine.steps_done == 10
    for got, want in zip(first_batches[:5] + resumed_batches, full_batches):
        assert torch.equal(got, want)  # the same batches (same secret order, same slots)
    for (name, a), (_, b) in zip(full.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), name
    assert resumed.engine.epsilon(10) == full.engine.epsilon(10)
    plugin = dict(resumed.engine.plugin_manager.list_name_plugin())["ftrl"]
    reference = dict(full.engine.plugin_manager.list_name_plugin())["ftrl"]
    assert plugin.step == reference.step == 10
    for a, b in zip(_leaves(plugin.secret_state_dict()), _leaves(reference.secret_state_dict())):
        assert torch.equal(a, b)  # the noise stream's state too
    # the public checkpoint carries no stream state and no permutation
    public = torch.load(path, map_location="cpu", weights_only=False)
    assert "dpl_secret" not in public
    assert "buffers" not in repr(public["dpl"]["states"]) and "permutation" not in repr(public["dpl"]["states"])


def test_resume_without_the_sidecar_is_refused(tmp_path):
    path = tmp_path / "five.ckpt"
    _fit(tmp_path / "b", "blt", stop_at=(5, path))
    Path(f"{path}.secret").unlink()
    with pytest.raises(ConfigError, match="sidecar"):
        _fit(tmp_path / "c", "blt", ckpt=path, seed=None)


def _leaves(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _leaves(v)
    elif torch.is_tensor(obj):
        yield obj
