"""The private step: noise scale, the non-private limit, the privacy guards, micro-batching."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import random_batch, tiny_bert

from dpl.errors import PrivacyViolation
from dpl.core.gradients import GradientSum
from dpl.api import hookimpl
from dpl.core.plugin_manager import create_plugin_manager
from dpl.core.step import StepContext, private_step


def _ctx(model, noise_multiplier, max_grad_norm, batch_size, seed=0):
    def per_example_loss(batch):
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return F.cross_entropy(out.logits, batch["labels"], reduction="none")
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    return StepContext(model=model, trainable=trainable, per_example_loss=per_example_loss,
                       max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier,
                       expected_batch_size=batch_size, step=0,
                       noise_source=torch.Generator().manual_seed(seed), log=lambda *a: None)


def test_noise_std_matches_sigma_c_over_b():
    pm = create_plugin_manager()
    sigma, clip, batch = 1.7, 0.3, 8
    ctx = _ctx(tiny_bert(), sigma, clip, batch)
    zeros = GradientSum({"w": torch.zeros(200_000)}, 0)
    private = pm.hook.privatize(ctx=ctx, gradient_sum=zeros)
    expected = sigma * clip / batch
    assert private.noise_std == pytest.approx(expected)
    values = private.values["w"]
    # std of 200k N(0, s^2) draws: relative standard error ~ 1/sqrt(2n) = 0.16%
    assert values.std().item() == pytest.approx(expected, rel=0.01)
    assert abs(values.mean().item()) < 5 * expected / math.sqrt(values.numel())


def test_noise_is_independent_across_coordinates_and_steps():
    pm = create_plugin_manager()
    ctx = _ctx(tiny_bert(), 1.0, 1.0, 1)
    draws = torch.stack([pm.hook.privatize(ctx=ctx, gradient_sum=GradientSum({"w": torch.zeros(64)}, 0)).values["w"]
                         for _ in range(4000)])
    cov = torch.cov(draws.T)
    off_diagonal = cov - torch.diag(torch.diag(cov))
    assert off_diagonal.abs().max() < 0.1  # ~5 standard errors for n=4000
    torch.testing.assert_close(torch.diag(cov), torch.ones(64), atol=0.1, rtol=0)


def test_adaptive_thresholds_counts_carry_their_noise_independent_of_the_gradients():
    """Adaptive clipping thresholds: each step releases G centred counts with N(0, sigma_b^2) and the gradient with
    sigma_D C, sigma_b and sigma_D from clipping_policy.count_noise (the pair is the calibrated mechanism). Measured
    on zero sums: the released fractions' std is sigma_b / B, their mean 1/2, the gradient's std sigma_D C / B, and
    the count noise is uncorrelated with the gradient noise of the same step."""
    from dpl.core import clipping_policy
    from dpl.core.step import CLIPPING_COUNTS_KEY

    pm = create_plugin_manager()
    gaussian = dict(pm.list_name_plugin())["gaussian"]
    gaussian.count_share = share = 0.1
    sigma, clip, batch, groups, steps = 1.3, 0.5, 16, 8, 4000
    ctx = _ctx(tiny_bert(), sigma, clip, batch, seed=5)
    fractions, gradient = [], []
    for _ in range(steps):
        released = pm.hook.privatize(ctx=ctx, gradient_sum=GradientSum(
            {"w": torch.zeros(groups), CLIPPING_COUNTS_KEY: torch.zeros(groups)}, 0))
        fractions.append(released.info["clipping_fractions"])
        gradient.append(released.values["w"])
        assert CLIPPING_COUNTS_KEY not in released.values  # the counts leave only as fractions
    fractions, gradient = torch.tensor(fractions, dtype=torch.float64), torch.stack(gradient).double()
    sigma_d, count_std = clipping_policy.count_noise(sigma, groups, share)
    n = steps * groups  # 32,000 draws of each: a std's relative standard error is 1/sqrt(2n) = 0.4%, 2% is 5 of them
    assert (fractions - 0.5).std().item() == pytest.approx(count_std / batch, rel=0.02)
    assert abs((fractions - 0.5).mean().item()) < 5 * (count_std / batch) / math.sqrt(n)
    assert gradient.std().item() == pytest.approx(sigma_d * clip / batch, rel=0.02)
    assert released.noise_std == pytest.approx(sigma_d * clip / batch)
    # standardised, the counts' and the gradient's draws of each step have correlation ~ N(0, 1/steps) per pair:
    # every one of the 64 pairs within 5 standard errors
    a = ((fractions - 0.5) / (count_std / batch))
    b = gradient / (sigma_d * clip / batch)
    correlation = (a.T @ b) / steps
    assert correlation.abs().max().item() < 5 / math.sqrt(steps)


def test_sigma_zero_infinite_clip_is_plain_sgd():
    batch = random_batch(batch_size=6)
    dp_model, ref_model = tiny_bert(seed=3), tiny_bert(seed=3)
    pm = create_plugin_manager()
    ctx = _ctx(dp_model, 0.0, math.inf, 6)
    direction = private_step(pm.hook, ctx, batch, physical_batch_size=4)  # two micro-batches: 4 + 2
    dp_opt = torch.optim.SGD(dp_model.parameters(), lr=0.5)
    for name, p in dp_model.named_parameters():
        p.grad = direction[name]
    dp_opt.step()

    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.5)
    out = ref_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    F.cross_entropy(out.logits, batch["labels"]).backward()
    ref_opt.step()
    for (name, p), (_, q) in zip(dp_model.named_parameters(), ref_model.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_micro_batches_sum_to_the_logical_batch():
    batch = random_batch(batch_size=7)
    model = tiny_bert()
    pm = create_plugin_manager()
    whole = private_step(pm.hook, _ctx(model, 0.0, 0.5, 7), batch, physical_batch_size=7)
    split = private_step(pm.hook, _ctx(model, 0.0, 0.5, 7), batch, physical_batch_size=2)
    for name in whole:
        torch.testing.assert_close(whole[name], split[name], rtol=1e-5, atol=1e-7)


def test_empty_batch_releases_pure_noise():
    model = tiny_bert()
    batch = {k: v[:0] for k, v in random_batch().items()}
    pm = create_plugin_manager()
    direction = private_step(pm.hook, _ctx(model, 1.0, 1.0, 4), batch, physical_batch_size=2)
    assert set(direction) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert all(torch.isfinite(t).all() for t in direction.values())
    assert any(t.abs().sum() > 0 for t in direction.values())


class _Spy:
    """Counts privatize calls and tries to read the raw sum after privatize."""

    def __init__(self):
        self.privatize_calls = 0
        self.estimate_calls = 0
        self.seen_sum = None
        self.error = None

    @hookimpl(tryfirst=True, hookwrapper=True)
    def privatize(self, ctx, gradient_sum):
        self.privatize_calls += 1
        self.seen_sum = gradient_sum
        yield

    @hookimpl(hookwrapper=True)
    def estimate_gradient(self, ctx, batch):
        self.estimate_calls += 1
        yield

    @hookimpl
    def post_process(self, ctx, gradient):
        try:
            self.seen_sum.values  # noqa: B018
        except PrivacyViolation as exc:
            self.error = exc


def test_privatize_once_and_sum_wiped_before_post_process():
    spy = _Spy()
    pm = create_plugin_manager()
    pm.register(spy)
    private_step(pm.hook, _ctx(tiny_bert(), 1.0, 1.0, 6), random_batch(batch_size=6), physical_batch_size=2)
    assert spy.estimate_calls == 3
    assert spy.privatize_calls == 1
    assert isinstance(spy.error, PrivacyViolation)
    assert spy.seen_sum.wiped


class _AutocastSpy:
    """Records whether the hooks after the clipped sum run under autocast, and a matrix product's dtype there."""

    def __init__(self):
        self.seen = {}

    def _record(self, name):
        a = torch.ones(4, 4)
        self.seen[name] = (torch.is_autocast_enabled("cpu"), (a @ a).dtype)

    @hookimpl
    def post_process(self, ctx, gradient):
        self._record("post_process")

    @hookimpl
    def precondition(self, ctx, gradient):
        self._record("precondition")


def test_release_hooks_run_in_float32_under_mixed_precision():
    """Under bf16 autocast (as Lightning's bf16-mixed runs the step) the hooks from privatize on run without it."""
    spy = _AutocastSpy()
    pm = create_plugin_manager()
    pm.register(spy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        private_step(pm.hook, _ctx(tiny_bert(), 1.0, 1.0, 4), random_batch(batch_size=4), physical_batch_size=4)
        assert torch.is_autocast_enabled("cpu")  # restored afterwards
    assert spy.seen == {"post_process": (False, torch.float32), "precondition": (False, torch.float32)}
