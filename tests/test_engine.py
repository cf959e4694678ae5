"""The private engine without Lightning: life cycle, accounting, state split, exact resume, and the privacy boundary
between the private hooks and the release hooks."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from helpers import VectorData
from torch import nn

import pytest
from dpl.api import ConfigError, GradientSum, PrivateGradient, hookimpl
from dpl.core.engine import PrivateEngine
from dpl.core.mechanism import epsilon_of
from dpl.core.plugin_manager import create_plugin_manager, installed_plugins, implemented_hooks
from dpl.core.privacy import PrivacyConfig
from dpl.core.step import StepContext, private_step
from dpl.core.update import apply_direction
from dpl.errors import PrivacyWarning

N, B, STEPS = 64, 16, 6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def _engine(model: nn.Module, plugins=None, seed: int | None = 3, **privacy) -> PrivateEngine:
    cfg = PrivacyConfig(**{"target_epsilon": 4.0, "batch_size": B, "physical_batch_size": 8, "seed": seed, **privacy})
    engine = PrivateEngine(cfg, plugins)
    engine.setup(model, num_rows=N, steps=STEPS, optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.1))
    return engine


def _train(engine: PrivateEngine, model: nn.Module, steps: int, optimizer=None) -> torch.optim.Optimizer:
    data = VectorData(N)
    trainable = dict(model.named_parameters())
    optimizer = optimizer or torch.optim.SGD(trainable.values(), lr=0.1)

    def loss(batch):
        return F.cross_entropy(model(batch["x"]), batch["labels"], reduction="none")

    batches = engine.batches()
    for _ in range(steps):
        idx = next(batches)
        batch = {"x": data.x[idx], "labels": data.y[idx]}
        direction = engine.step(batch, model=model, trainable=trainable, per_example_loss=loss, optimizer=optimizer)
        apply_direction(optimizer, trainable, direction)
    return optimizer


def test_engine_trains_and_accounts_without_lightning():
    model = _model()
    engine = _engine(model)
    engine.start()
    before = [p.detach().clone() for p in model.parameters()]
    _train(engine, model, STEPS)
    assert engine.steps_done == STEPS
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert engine.epsilon() == pytest.approx(epsilon_of(engine.mechanism, engine.noise_multiplier, engine.plan.delta, STEPS))
    assert engine.epsilon() <= 4.0 * (1 + 1e-6)
    summary = engine.summary(deltas=(1e-2,))  # the run's delta is 0.1 / 64
    assert summary["steps_taken"] == STEPS and summary["epsilon"] == engine.epsilon()
    assert summary["epsilon_at_delta"][1e-2] < summary["epsilon"]  # a larger delta, a smaller epsilon


def test_lifecycle_is_enforced():
    model = _model()
    engine = _engine(model)
    with pytest.raises(RuntimeError, match="not started"):
        engine.step({}, model=model, trainable={}, per_example_loss=None)
    with pytest.raises(RuntimeError, match="once"):
        engine.setup(model, num_rows=N, steps=STEPS)


def test_public_state_holds_no_secret_and_a_resume_is_exact():
    model = _model()
    engine = _engine(model)
    engine.start()
    optimizer = _train(engine, model, 3)
    public, secret = engine.state_dict(), engine.secret_state_dict()
    assert secret["noise_rng"] is not None and secret["sampler_rng"] is not None
    flat = repr(public)
    assert "noise_rng" not in flat and "sampler_rng" not in flat
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt_state = optimizer.state_dict()
    _train(engine, model, 3, optimizer)  # the uninterrupted run
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}

    resumed_model = _model()
    resumed_model.load_state_dict(params)
    resumed = _engine(resumed_model, seed=5)  # another seed: a seeded resume replays the sidecar's generators
    resumed.load_state_dict(public)
    resumed.load_secret_state_dict(secret)
    resumed.start()
    optimizer = torch.optim.SGD(resumed_model.parameters(), lr=0.1)
    optimizer.load_state_dict(opt_state)
    _train(resumed, resumed_model, 3, optimizer)
    for name, p in resumed_model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=0, atol=0)
    assert resumed.epsilon() == engine.epsilon()


def _linear_engine(seed, model):
    cfg = PrivacyConfig(target_epsilon=None, noise_multiplier=1.3, max_grad_norm=0.5, batch_size=4,
                        physical_batch_size=4, seed=seed)
    engine = PrivateEngine(cfg)
    engine.setup(model, num_rows=40, steps=5)
    return engine


def _clipped(model: nn.Module, x: torch.Tensor, clip: float) -> torch.Tensor:
    """One example's gradient of the sum of the outputs, clipped to ``clip`` (flattened, by hand)."""
    model.zero_grad()
    model(x[None]).sum().backward()
    g = torch.cat([p.grad.flatten() for p in model.parameters()])
    return g * min(1.0, clip / g.norm().item())


@pytest.mark.parametrize("seed", [None, 11])
def test_two_continuations_of_one_checkpoint_draw_fresh_noise(seed):
    """The branching attack: resume one checkpoint twice, with one row of the batch edited in the second branch, and
    subtract the two releases. Replayed noise cancels and leaves (clip(old) - clip(new)) / B exactly; without
    privacy.seed each continuation draws fresh noise, and the difference minus that is N(0, 2 (sigma C / B)^2) in
    every coordinate (4,040 coordinates: the std is checked to 8%, seven standard errors)."""
    torch.manual_seed(0)
    model = nn.Linear(100, 40)
    engine = _linear_engine(seed, model)
    engine.start()
    trainable = dict(model.named_parameters())
    x = torch.randn(4, 100)

    def loss(batch):
        return model(batch["x"]).sum(-1)

    engine.step({"x": x}, model=model, trainable=trainable, per_example_loss=loss)  # the checkpoint is at step 1
    public, secret = engine.state_dict(), engine.secret_state_dict()
    edited = x.clone()
    edited[2] = torch.randn(100) * 3
    releases = []
    for batch in (x, edited):
        branch = _linear_engine(seed, model)
        branch.load_state_dict(public)
        branch.load_secret_state_dict(secret)
        branch.start()
        direction = branch.step({"x": batch}, model=model, trainable=trainable, per_example_loss=loss)
        releases.append(torch.cat([direction[n].flatten() for n in trainable]).double())
        assert branch.summary()["epsilon"] == engine.epsilon(2)
    known = (_clipped(model, x[2], 0.5) - _clipped(model, edited[2], 0.5)).double() / 4
    residual = (releases[0] - releases[1] - known) / (1.3 * 0.5 / 4)
    if seed is not None:  # the reproducible-experiment case: both branches replay the sidecar's noise exactly
        assert residual.abs().max() < 1e-4
        return
    assert residual.numel() == 4040
    assert abs(residual.mean().item()) < 7 * (2 / 4040) ** 0.5
    assert residual.std().item() == pytest.approx(2 ** 0.5, rel=0.08)


def test_a_seeded_resume_without_its_sidecar_never_draws_the_first_steps_noise_again():
    """privacy.seed, resumed without the .secret sidecar: generators made again from the seed would start over, and
    the step after the resume would carry step 0's noise (the difference of the two releases: the clipped sums',
    noise-free). They are re-keyed from OS entropy: on the same batch, the releases of step 0 and of two
    continuations all differ in every coordinate, and so do the batches drawn."""
    torch.manual_seed(0)
    model = nn.Linear(10, 4)
    trainable = dict(model.named_parameters())
    batch = {"x": torch.randn(4, 10)}

    def release(engine):
        direction = engine.step(batch, model=model, trainable=trainable, per_example_loss=lambda b: model(b["x"]).sum(-1))
        return torch.cat([direction[n].flatten() for n in trainable])

    engine = _linear_engine(11, model)
    engine.start()
    first_batches = [list(b) for _, b in zip(range(5), engine.batch_sampler())]
    releases = [release(engine)]
    public = engine.state_dict()
    for _ in range(2):
        branch = _linear_engine(11, model)
        branch.load_state_dict(public)
        with warnings.catch_warnings():  # "the resumed run is not bit-exact": said, and what is checked below
            warnings.simplefilter("ignore", PrivacyWarning)
            branch.load_secret_state_dict(None)
            branch.start()
        assert not torch.equal(branch.noise_source.get_state()[:32], engine.noise_source.get_state()[:32])  # re-keyed
        assert [list(b) for _, b in zip(range(5), branch.batch_sampler())] != first_batches
        releases.append(release(branch))
    for a, b in ((0, 1), (0, 2), (1, 2)):
        assert (releases[a] != releases[b]).all(), (a, b)


def test_max_epsilon_is_checked_before_every_step():
    """A driver that runs past the plan: the step that would end above max_epsilon is refused by the accountant."""
    model = _model()
    engine = _engine(model, seed=1)
    engine.start()
    max_epsilon = engine.privacy.effective_max_epsilon
    assert engine.final_epsilon() <= max_epsilon
    _train(engine, model, STEPS)
    assert engine.epsilon() <= max_epsilon and engine.would_exceed_max_epsilon()  # step STEPS + 1 would exceed


def test_poisson_batch_sizes_have_the_binomial_mean_and_variance():
    """The default sampler draws Poisson batches: sizes Binomial(N, q), mean Nq and variance Nq(1 - q). A fixed-size
    sampler (variance 0) or another rate fails. Seeded, so the test is deterministic: 4,000 batches, the mean within
    5 standard errors (0.53), the variance within 10% (its standard error is 2.2%)."""
    cfg = PrivacyConfig(target_epsilon=None, noise_multiplier=1.0, batch_size=20, seed=123)
    engine = PrivateEngine(cfg)
    engine.setup(_model(), num_rows=400, steps=4000)
    sizes = torch.tensor([len(b) for b in engine.batches()], dtype=torch.float64)
    assert len(sizes) == 4000
    q = 20 / 400
    assert abs(sizes.mean().item() - 400 * q) < 5 * (400 * q * (1 - q) / 4000) ** 0.5
    assert sizes.var().item() == pytest.approx(400 * q * (1 - q), rel=0.10)


def test_a_sidecar_with_an_old_noise_generator_state_is_refused_in_one_line():
    """A sidecar from a dpl whose noise came from torch's float32 generator (an MT19937 state) cannot continue."""
    engine = _engine(_model())
    engine.start()
    secret = engine.secret_state_dict()
    secret["noise_rng"] = torch.Generator().get_state()
    resumed = _engine(_model())
    resumed.load_secret_state_dict(secret)
    with pytest.raises(ConfigError, match="older dpl"):
        resumed.start()


class _StashInScratch:
    """A private hook that puts a value computed from the examples into the private hooks' scratch."""

    @hookimpl(wrapper=True)
    def estimate_gradient(self, ctx: StepContext, batch):
        total = yield
        ctx.scratch["clipped"] = {k: v.clone() for k, v in total.values.items()}
        return total


class _ReadScratch:
    def __init__(self):
        self.seen = None

    @hookimpl
    def post_process(self, ctx, gradient):
        self.seen = dict(ctx.scratch)


def _step_with(plugins: list, batch_seed: int) -> dict:
    model = _model()
    pm = create_plugin_manager()
    for i, plugin in enumerate(plugins):
        pm.register(plugin, name=f"test{i}")
    data = VectorData(N, seed=batch_seed)
    trainable = dict(model.named_parameters())
    ctx = StepContext(model=model, trainable=trainable,
                      per_example_loss=lambda b: F.cross_entropy(model(b["x"]), b["labels"], reduction="none"),
                      max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=B, step=0,
                      noise_source=torch.Generator().manual_seed(0), log=lambda *a: None)
    return private_step(pm.hook, ctx, {"x": data.x[:B], "labels": data.y[:B]}, 8)


def test_release_hooks_do_not_see_the_private_hooks_scratch():
    reader = _ReadScratch()
    _step_with([_StashInScratch(), reader], batch_seed=0)
    assert reader.seen == {}  # before the fix the release context shared the private scratch (clean clipped sums)


class _FixedRelease:
    """Replaces privatize with a release that does not depend on the clipped sum (same keys and shapes)."""

    @hookimpl
    def privatize(self, ctx, gradient_sum):
        gen = torch.Generator().manual_seed(11)
        values = {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in gradient_sum.values.items()}
        return PrivateGradient(values, noise_std=0.05, mechanism="gaussian", expected_batch_size=B, step=ctx.step)


def _release_plugins() -> list[str]:
    names = []
    for name, ep in sorted(installed_plugins().items()):
        hooks = set(implemented_hooks(ep.load()))
        if hooks & {"post_process", "precondition"} and not hooks & {"estimate_gradient"}:
            names.append(name)
    return names


@pytest.mark.parametrize("name", _release_plugins())
def test_release_hooks_depend_on_the_release_only(name):
    """Every installed post_process / precondition plugin: the same release after different clipped sums gives the
    same update direction (a plugin reading the clipped sum, per-example values or the private scratch fails)."""
    from dpl.core.plugin_manager import load_plugin

    directions = []
    for batch_seed in (0, 1):
        directions.append(_step_with([_StashInScratch(), load_plugin(name), _FixedRelease()], batch_seed))
    for key in directions[0]:
        torch.testing.assert_close(directions[0][key], directions[1][key], rtol=0, atol=0)


class _LeakyPrecondition:
    """A planted bug: precondition reads the clean clipped sum that a private hook left in the scratch."""

    @hookimpl
    def precondition(self, ctx, gradient):
        clean = ctx.scratch.get("clipped")
        return {k: v + (clean[k] if clean else 0) for k, v in gradient.values.items()}


def test_the_release_only_check_catches_a_plugin_reading_the_clipped_sum(monkeypatch):
    """The check above fails on a precondition that reads the clipped sum when the scratch is shared."""
    monkeypatch.setattr(StepContext, "release_context", _shared_scratch_release_context)
    a = _step_with([_StashInScratch(), _LeakyPrecondition(), _FixedRelease()], 0)
    b = _step_with([_StashInScratch(), _LeakyPrecondition(), _FixedRelease()], 1)
    assert any(not torch.equal(a[k], b[k]) for k in a)


def _shared_scratch_release_context(self):
    from dpl.core.step import ReleaseContext

    return ReleaseContext(trainable=self.trainable, max_grad_norm=self.max_grad_norm,
                          noise_multiplier=self.noise_multiplier, expected_batch_size=self.expected_batch_size,
                          step=self.step, public_seed=self.public_seed, optimizer=self.optimizer, log=self.log,
                          scratch=self.scratch)


def test_gradient_sum_is_wiped_before_the_release_hooks():
    seen = {}

    class Keep:
        @hookimpl(wrapper=True)
        def privatize(self, ctx, gradient_sum: GradientSum):
            seen["sum"] = gradient_sum
            return (yield)

    _step_with([Keep()], 0)
    assert seen["sum"].wiped


def test_a_forced_resume_names_the_sigma_that_trains(caplog):
    """A resume that changes the plan recalibrates sigma for what is left of the budget after the checkpoint's part:
    the warning names that sigma (the one trained), not the sigma a fresh plan of the new length would have."""
    import logging

    from dpl.core.privacy import PrivacyConfig

    first = PrivateEngine(PrivacyConfig(target_epsilon=2.0, batch_size=8))
    first.setup(nn.Linear(2, 2), num_rows=64, steps=8)
    first.ledger.steps_done = 4
    state = first.state_dict()
    fresh = PrivateEngine(PrivacyConfig(target_epsilon=2.0, batch_size=8))
    fresh.setup(nn.Linear(2, 2), num_rows=64, steps=12)  # sigma of a fresh 12-step plan
    resumed = PrivateEngine(PrivacyConfig(target_epsilon=2.0, batch_size=8, force_resume=True))
    resumed.setup(nn.Linear(2, 2), num_rows=64, steps=12)
    with caplog.at_level(logging.WARNING, logger="dpl"):
        resumed.load_state_dict(state)
    trained = resumed.noise_multiplier
    assert f"{trained:.4f}" != f"{fresh.noise_multiplier:.4f}"  # the two sigmas differ at the printed precision
    assert f"sigma {first.noise_multiplier:.4f} -> {trained:.4f} (plan 8 -> 12 steps)" in caplog.text
    assert f"-> {fresh.noise_multiplier:.4f}" not in caplog.text
    assert resumed.summary()["resumed_parts"] == 2
