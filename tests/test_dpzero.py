"""The dpzero plugin: public direction regenerated exactly, parameters restored, no .grad, unbiased on a quadratic,
contributions bounded by C, noise independent of the direction seed, noise std, MeZO equals a hand-written MeZO
step, the streaming SGD update, refusals, and `dpl fit` end to end."""

import copy
import csv
import logging
import math
import types
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import random_batch, save_tiny_llama_lm, tiny_bert, tiny_classification_workspace
from torch import nn

from dpl.errors import ConfigError, PluginError
from dpl.core.gradients import GradientSum
from dpl.core.noise import normal
from dpl.core.plugin_manager import create_plugin_manager
from dpl.core.step import RunSetup, StepContext, private_step
from dpl.core.update import StreamingDirection, apply_direction, apply_streaming, streaming_refusal
from dpl_plugins.dpzero import KEY, DPZeroPlugin
from dpl_plugins.dpzero.directions import DirectionSampler
from dpl_plugins.dpzero.lookups import RowPerturbation, lookup_tables
from dpl_plugins.gaussian import GaussianPlugin

ROOT = Path(__file__).resolve().parents[1]


class Quadratic(nn.Module):
    """l_i(theta) = 1/2 (theta - x_i)^T A (theta - x_i) in float64: central differences are exact on it."""

    def __init__(self, dim: int = 5, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        m = torch.randn(dim, dim, generator=gen, dtype=torch.float64)
        self.register_buffer("A", m @ m.T / dim + torch.eye(dim, dtype=torch.float64))
        self.theta = nn.Parameter(torch.randn(dim, generator=gen, dtype=torch.float64))
        self.bias = nn.Parameter(torch.randn(2, generator=gen, dtype=torch.float64))  # a second tensor of z

    def per_example_loss(self, batch):
        r = self.theta - batch["x"]
        return 0.5 * ((r @ self.A) * r).sum(1) + 3.0 * self.bias.sum() * batch["w"]

    def gradient(self, batch):
        """Gradient of the summed loss, per parameter."""
        r = self.theta - batch["x"]
        return {"theta": (r @ self.A).sum(0), "bias": 3.0 * batch["w"].sum() * torch.ones(2, dtype=torch.float64)}


def _xbatch(n=6, dim=5, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, dim, generator=gen, dtype=torch.float64),
            "w": torch.randn(n, generator=gen, dtype=torch.float64)}


def _ctx(model, loss, *, seed=123, C=1.0, sigma=0.0, B=4, noise_seed=0, optimizer=None, logs=None):
    logs = {} if logs is None else logs
    return StepContext(model=model, trainable={n: p for n, p in model.named_parameters() if p.requires_grad},
                       per_example_loss=loss, max_grad_norm=C, noise_multiplier=sigma, expected_batch_size=B, step=0,
                       noise_source=torch.Generator().manual_seed(noise_seed),
                       log=lambda k, v: logs.__setitem__(k, v), public_seed=seed, optimizer=optimizer)


def _bert_loss(model):
    def loss(batch):
        return F.cross_entropy(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                               batch["labels"], reduction="none")
    return loss


def _setup(model, names, optimizer_factory=None, replaced=frozenset({"estimate_gradient", "precondition"})):
    return RunSetup(model=model, trainable={n: p for n, p in model.named_parameters() if p.requires_grad},
                    plugin_names=names, population=100, expected_batch_size=4, steps=10, sampling_rate=0.04,
                    accountant="prv", optimizer_name="SGD", replaced_hooks=replaced,
                    optimizer_factory=optimizer_factory)


# --- the public direction -------------------------------------------------------------------------------------

def test_regenerated_z_equals_the_perturbation():
    model = Quadratic()
    theta0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    seen = []

    def loss(batch):  # record the parameters each forward pass sees
        seen.append({n: p.detach().clone() for n, p in model.named_parameters()})
        return model.per_example_loss(batch)

    plugin = DPZeroPlugin(mu=1e-3)
    ctx = _ctx(model, loss, seed=987)
    torch.manual_seed(0)
    plugin.estimate_gradient(ctx=ctx, batch=_xbatch())
    torch.manual_seed(1)  # the global RNG plays no part in z
    sampler = DirectionSampler(987)
    for name, p in model.named_parameters():
        z = sampler.z(name, p)
        torch.testing.assert_close((seen[0][name] - theta0[name]) / 1e-3, z, rtol=0, atol=1e-9)
        torch.testing.assert_close((seen[1][name] - theta0[name]) / -1e-3, z, rtol=0, atol=1e-9)
    # precondition regenerates the same z (times the released scalar)
    direction = plugin.precondition(ctx=ctx.release_context(), gradient=_private(2.5))
    for name, p in model.named_parameters():
        torch.testing.assert_close(direction[name], 2.5 * sampler.z(name, p), rtol=0, atol=0)
    # exact regeneration, any order; a different seed gives a different direction
    zero = {"theta": nn.Parameter(torch.zeros(5, dtype=torch.float64))}
    DirectionSampler(987).perturb_(zero, 1.0)
    assert torch.equal(zero["theta"].detach(), DirectionSampler(987).z("theta", zero["theta"]))
    assert not torch.equal(DirectionSampler(988).z("theta", zero["theta"]), zero["theta"].detach())


def test_large_tensors_are_drawn_in_chunks_consistently(monkeypatch):
    from dpl_plugins.dpzero import directions

    monkeypatch.setattr(directions, "CHUNK", 4)  # a 5 x 3 matrix: chunks of 4, 4, 4, 3
    param = nn.Parameter(torch.zeros(5, 3))
    sampler = DirectionSampler(11)
    chunks = list(sampler.chunks("w", param))
    assert [offset for offset, _ in chunks] == [0, 4, 8, 12]
    z = sampler.z("w", param)
    assert torch.equal(z.reshape(-1), torch.cat([c for _, c in chunks]))
    sampler.perturb_({"w": param}, 1.0)
    assert torch.equal(param.detach(), z)
    # the streaming update applies the same pieces: theta <- theta - lr * g * z
    plugin = DPZeroPlugin()
    model = nn.Module()
    model.w = param
    ctx = _ctx(model, None, seed=11)
    direction = plugin.precondition(ctx=ctx.release_context(), gradient=_private(2.0))
    optimizer = torch.optim.SGD([param], lr=0.5)
    apply_direction(optimizer, {"w": param}, direction)
    torch.testing.assert_close(param.detach(), z - 0.5 * 2.0 * z)
    assert param.grad is None


def _private(value):
    from dpl.core.gradients import PrivateGradient
    return PrivateGradient({KEY: torch.tensor([value], dtype=torch.float64)}, noise_std=0.0, mechanism="gaussian",
                           expected_batch_size=4, step=0)


@pytest.mark.parametrize("direction", ["gaussian", "rademacher"])
def test_parameters_restored_and_no_grad_ever_allocated(direction):
    model = tiny_bert()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = _bert_loss(model)
    outputs = []

    def recording(batch):
        out = loss(batch)
        outputs.append(out.requires_grad)
        return out

    pm = create_plugin_manager({"dpzero": {"mu": 1e-3, "direction": direction}})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    ctx = _ctx(model, recording, C=5.0, sigma=1.0, B=8, optimizer=optimizer)
    plugin = dict(pm.list_name_plugin())["dpzero"]
    batch = random_batch(8)
    plugin.estimate_gradient(ctx=ctx, batch=batch)
    # left at theta - mu z after the second forward: the update moves them back in its own pass; the embedding
    # tables only in the rows the batch looked up (words in the batch, its 7 positions, token type 0)
    tables = {"bert.embeddings.word_embeddings.weight": batch["input_ids"].unique(),
              "bert.embeddings.position_embeddings.weight": torch.arange(7),
              "bert.embeddings.token_type_embeddings.weight": torch.tensor([0])}
    assert set(lookup_tables(model, ctx.trainable)) == set(tables)
    sampler = DirectionSampler(ctx.public_seed, distribution=direction)
    for n, p in model.named_parameters():
        expected = before[n] - 1e-3 * sampler.z(n, p)
        if n in tables:
            looked_up = torch.zeros(p.shape[0], dtype=torch.bool)
            looked_up[tables[n]] = True
            expected[~looked_up] = before[n][~looked_up]  # exactly: never moved
            assert torch.equal(p.detach()[~looked_up], before[n][~looked_up])
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-6)
    assert model.training  # eval mode for the two forwards only
    update = plugin.precondition(ctx=ctx.release_context(), gradient=_private(0.0))
    assert update.displaced == {n: -1e-3 for n, _ in model.named_parameters() if n not in tables}
    for n in tables:  # the looked-up rows are back at theta exactly before the update
        assert torch.equal(ctx.trainable[n].detach(), before[n])
    apply_direction(optimizer, ctx.trainable, update)  # lr = 0: back to theta
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[n], rtol=0, atol=1e-6)

    ctx = _ctx(model, recording, C=5.0, sigma=1.0, B=8, optimizer=optimizer, seed=124)
    direction = private_step(pm.hook, ctx, random_batch(8), physical_batch_size=3)  # 3 micro-batches
    assert isinstance(direction, StreamingDirection)
    apply_direction(optimizer, ctx.trainable, direction)  # lr = 0: the parameters stay where they were
    assert outputs and not any(outputs)  # no autograd graph was built
    assert all(p.grad is None for p in model.parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[n], rtol=0, atol=1e-6)


def test_parameters_restored_when_the_forward_fails():
    model = Quadratic()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    calls = []

    def failing(batch):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return model.per_example_loss(batch)

    with pytest.raises(RuntimeError, match="boom"):
        DPZeroPlugin().estimate_gradient(ctx=_ctx(model, failing), batch=_xbatch())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[n], rtol=0, atol=1e-12)


# --- the estimate ---------------------------------------------------------------------------------------------

def _estimate_and_update(plugin, model, seed, batch, *, lr=0.0):
    """estimate_gradient, then the update (lr 0 by default: only the pass that moves the parameters back)."""
    total = plugin.estimate_gradient(ctx=_ctx(model, model.per_example_loss, seed=seed, C=math.inf), batch=batch)
    release = _ctx(model, None, seed=seed).release_context()
    direction = plugin.precondition(ctx=release, gradient=_private(float(total.values[KEY])))
    apply_direction(torch.optim.SGD(model.parameters(), lr=lr), dict(model.named_parameters()), direction)
    return total, direction


@pytest.mark.parametrize("distribution", ["gaussian", "rademacher"])
def test_quadratic_estimate_is_the_directional_derivative_and_unbiased(distribution):
    model = Quadratic()
    batch = _xbatch(n=4)
    plugin = DPZeroPlugin(mu=1e-2, direction=distribution)
    grad = model.gradient(batch)
    # per step: the central difference of a quadratic is exactly the directional derivative grad . z
    for seed in range(5):
        total, _ = _estimate_and_update(plugin, model, seed, batch)
        sampler = DirectionSampler(seed, distribution=distribution)
        directional = sum(float(grad[n] @ sampler.z(n, p)) for n, p in model.named_parameters())
        assert float(total.values[KEY]) == pytest.approx(directional, rel=1e-7, abs=1e-9)
    # in expectation over z: E[(grad . z) z] = grad
    seeds = 3000
    mean = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for seed in range(seeds):
        _, direction = _estimate_and_update(plugin, model, seed, batch)
        for n in mean:
            mean[n] += direction[n] / seeds
    for n in mean:
        scale = float(torch.cat([g.flatten() for g in grad.values()]).norm())
        assert float((mean[n] - grad[n]).norm()) < 4 * scale * math.sqrt(len(grad) * 7 / seeds)
    # and it is wrong if the direction were not the one used to perturb
    wrong, _ = _estimate_and_update(plugin, model, 1, batch)
    other = sum(float(grad[n] @ DirectionSampler(2, distribution=distribution).z(n, p))
                for n, p in model.named_parameters())
    assert float(wrong.values[KEY]) != pytest.approx(other, rel=1e-3)


def test_rademacher_direction_is_signs_regenerated_exactly():
    gen = torch.Generator().manual_seed(0)
    params = {"a": nn.Parameter(torch.randn(1000, 13, generator=gen)), "b": nn.Parameter(torch.randn(5, generator=gen))}
    sampler = DirectionSampler(77, distribution="rademacher")
    z = {n: sampler.z(n, p) for n, p in params.items()}
    for n, p in params.items():
        assert z[n].shape == p.shape and z[n].dtype == p.dtype
        assert set(z[n].unique().tolist()) <= {-1.0, 1.0}
        assert torch.equal(DirectionSampler(77, distribution="rademacher").z(n, p), z[n])  # public seed -> same z
    assert not torch.equal(DirectionSampler(78, distribution="rademacher").z("a", params["a"]), z["a"])
    # fair, independent signs: 13000 of them; mean within 5 standard errors, neighbours uncorrelated
    flat = z["a"].flatten()
    assert abs(float(flat.mean())) < 5 / math.sqrt(flat.numel())
    assert abs(float((flat[1:] * flat[:-1]).mean())) < 5 / math.sqrt(flat.numel())
    assert abs(float((flat[8:] * flat[:-8]).mean())) < 5 / math.sqrt(flat.numel())  # across the bytes of a word
    assert sampler.squared_norm(params) == 13005.0
    # perturbing adds exactly +-scale
    before = params["a"].detach().clone()
    sampler.perturb_(params, 0.5)
    assert torch.equal(params["a"].detach(), before + 0.5 * z["a"])


def test_rademacher_chunks_tile_the_same_signs(monkeypatch):
    from dpl_plugins.dpzero import directions

    param = nn.Parameter(torch.zeros(59, 17))  # 1,003 elements: not a multiple of 8
    whole = DirectionSampler(5, distribution="rademacher").z("w", param)
    monkeypatch.setattr(directions, "SIGN_CHUNK", 16)  # 63 chunks of 16 and one of 11
    sampler = DirectionSampler(5, distribution="rademacher")
    chunks = list(sampler.chunks("w", param))
    assert [start for start, _ in chunks] == list(range(0, 1003, 16))
    assert torch.equal(torch.cat([c for _, c in chunks]).view(59, 17), whole)
    sampler.perturb_({"w": param}, 2.0)
    assert torch.equal(param.detach(), 2.0 * whole)


def test_a_step_whose_update_was_never_applied_is_refused():
    model = Quadratic()
    plugin = DPZeroPlugin()
    plugin.estimate_gradient(ctx=_ctx(model, model.per_example_loss, seed=1), batch=_xbatch())
    with pytest.raises(PluginError, match="still displaced"):
        plugin.estimate_gradient(ctx=_ctx(model, model.per_example_loss, seed=2), batch=_xbatch())


@pytest.mark.parametrize("distribution", ["gaussian", "rademacher"])
def test_a_kept_direction_is_drawn_once_and_stored_compactly(distribution, monkeypatch):
    from dpl_plugins.dpzero import directions

    monkeypatch.setattr(directions, "CHUNK", 64)
    monkeypatch.setattr(directions, "SIGN_CHUNK", 64)
    param = nn.Parameter(torch.randn(37, 11, generator=torch.Generator().manual_seed(3)))  # 407: chunks of 64 + 23
    fresh = DirectionSampler(9, distribution=distribution).z("w", param)
    kept = DirectionSampler(9, keep=True, distribution=distribution)
    draws = []
    draw = kept._draw
    kept._draw = lambda name, p: draws.append(name) or draw(name, p)
    before = param.detach().clone()
    kept.perturb_({"w": param}, 0.5)
    kept.perturb_({"w": param}, -0.5)
    z = kept.z("w", param)
    assert draws == ["w"]  # expanded once, reused by every later pass
    stored = kept._kept["w"]
    assert [c.numel() for c in stored] == [64] * 6 + [23]
    if distribution == "rademacher":  # int8 signs, exactly the regenerated ones
        assert all(c.dtype == torch.int8 for c in stored)
        assert torch.equal(z, fresh)
    else:  # bfloat16: the rounded z is the direction
        assert all(c.dtype == torch.bfloat16 for c in stored)
        assert torch.equal(z, fresh.bfloat16().float())
    torch.testing.assert_close(param.detach(), before, rtol=0, atol=1e-6)
    z.zero_()  # chunks are fresh copies: the store is untouched
    assert torch.equal(kept.z("w", param), fresh if distribution == "rademacher" else fresh.bfloat16().float())


def test_each_contribution_bounded_by_C():
    model = Quadratic()
    batch = _xbatch(n=8)
    batch["x"] *= 30.0  # large per-example differences
    plugin = DPZeroPlugin(mu=1e-3)
    C = 0.5
    singles = []
    for i in range(8):
        one = {k: v[i:i + 1] for k, v in batch.items()}
        value = float(plugin.estimate_gradient(ctx=_ctx(model, model.per_example_loss, C=C), batch=one).values[KEY])
        assert abs(value) <= C + 1e-12
        singles.append(value)
    assert sum(abs(s) == pytest.approx(C) for s in singles) >= 4  # clipping was active
    total = plugin.estimate_gradient(ctx=_ctx(model, model.per_example_loss, C=C), batch=batch)
    assert float(total.values[KEY]) == pytest.approx(sum(singles), abs=1e-9)
    assert total.count == 8
    unclipped = plugin.estimate_gradient(ctx=_ctx(model, model.per_example_loss, C=math.inf), batch=batch)
    assert abs(float(unclipped.values[KEY])) > 8 * C  # without clipping the bound does not hold: the test can fail


def test_micro_batches_and_ranks_sum_to_the_full_batch():
    """DDP by design: every rank uses the same public seed; the scalar sums add up (the core all-reduces them)."""
    model = Quadratic()
    batch = _xbatch(n=6)
    plugin = DPZeroPlugin()
    full = plugin.estimate_gradient(ctx=_ctx(model, model.per_example_loss, C=2.0), batch=batch)
    rank0 = plugin.estimate_gradient(ctx=_ctx(model, model.per_example_loss, C=2.0), batch={k: v[:4] for k, v in batch.items()})
    rank1 = plugin.estimate_gradient(ctx=_ctx(model, model.per_example_loss, C=2.0), batch={k: v[4:] for k, v in batch.items()})
    rank0.add_(rank1)
    assert float(rank0.values[KEY]) == pytest.approx(float(full.values[KEY]), rel=1e-9)
    assert rank0.count == 6
    empty = plugin.estimate_gradient(ctx=_ctx(model, model.per_example_loss), batch={k: v[:0] for k, v in batch.items()})
    assert float(empty.values[KEY]) == 0.0 and empty.count == 0


# --- noise ----------------------------------------------------------------------------------------------------

def _released(model, public_seed, noise_seed, sigma=2.0, C=1.0, B=4):
    pm = create_plugin_manager({"dpzero": {}})
    ctx = _ctx(model, model.per_example_loss, seed=public_seed, sigma=sigma, C=C, B=B, noise_seed=noise_seed)
    batch = _xbatch(n=4)
    clean = float(DPZeroPlugin().estimate_gradient(ctx=_ctx(model, model.per_example_loss, seed=public_seed, C=C),
                                                   batch=batch).values[KEY])
    state = ctx.noise_source.get_state()
    direction = private_step(pm.hook, ctx, batch, physical_batch_size=4, mechanism="gaussian")
    g = float(direction["theta"][0] / DirectionSampler(public_seed).z("theta", model.theta)[0])
    noise = g * B - clean
    return noise, state, ctx.noise_source


def test_noise_does_not_depend_on_the_direction_seed_and_never_comes_from_it():
    model = Quadratic()
    noise_a, state, gen = _released(model, public_seed=1, noise_seed=42)
    noise_b, _, _ = _released(model, public_seed=2, noise_seed=42)
    assert noise_a == pytest.approx(noise_b, rel=1e-6)  # other direction, same noise draw
    # the noise is the first draw of the run's noise generator, times sigma C
    expected = float(normal((1,), torch.Generator().manual_seed(42), dtype=torch.float64)) * 2.0
    assert noise_a == pytest.approx(expected, rel=1e-6)
    # exactly one scalar was drawn from it: estimate_gradient and precondition never touch the noise generator
    replay = torch.Generator().manual_seed(42)
    normal((1,), replay, dtype=torch.float64)
    assert torch.equal(replay.get_state(), gen.get_state())
    # and a generator seeded with the public seed would have given another draw
    for public_seed in (1, 2):
        leaked = float(normal((1,), torch.Generator().manual_seed(public_seed), dtype=torch.float64)) * 2.0
        assert noise_a != pytest.approx(leaked, rel=1e-3)
    noise_c, _, _ = _released(model, public_seed=1, noise_seed=43)
    assert noise_c != pytest.approx(noise_a, rel=1e-3)  # other noise seed: other noise


def test_noise_std_is_sigma_C_over_B():
    model = Quadratic()
    sigma, C, B, n = 1.5, 0.7, 4, 4000
    plugin = DPZeroPlugin()
    gaussian = GaussianPlugin()
    gen = torch.Generator().manual_seed(5)
    batch = _xbatch(n=4)
    ctx = _ctx(model, model.per_example_loss, seed=3, C=C, sigma=sigma, B=B)
    ctx.noise_source = gen
    clean = float(plugin.estimate_gradient(ctx=ctx, batch=batch).values[KEY]) / B
    released = []
    for _ in range(n):
        total = GradientSum({KEY: torch.tensor([clean * B], dtype=torch.float64)}, 4)
        private = gaussian.privatize(ctx=ctx, gradient_sum=total)
        released.append(float(private.values[KEY]) - clean)
    released = torch.tensor(released, dtype=torch.float64)
    expected = sigma * C / B
    assert private.noise_std == pytest.approx(expected)
    # std of a sample of n normals: relative standard error 1/sqrt(2n) = 1.1%; 5 standard errors
    assert float(released.std()) == pytest.approx(expected, rel=5 / math.sqrt(2 * n))
    assert abs(float(released.mean())) < 5 * expected / math.sqrt(n)


# --- MeZO and the update --------------------------------------------------------------------------------------

@pytest.mark.parametrize("keep, distribution", [(False, "gaussian"), (True, "gaussian"), (False, "rademacher"),
                                                (True, "rademacher")])
def test_mezo_mode_equals_a_hand_written_mezo_step(keep, distribution, monkeypatch):
    draws = []
    draw = DirectionSampler._draw
    monkeypatch.setattr(DirectionSampler, "_draw", lambda self, name, p: draws.append(name) or draw(self, name, p))
    model = tiny_bert()
    for module in model.modules():  # dropout active in train mode: the plugin's two forwards run in eval mode
        if isinstance(module, nn.Dropout):
            module.p = 0.3
    reference = copy.deepcopy(model)
    batch = random_batch(8)
    lr, mu, seed = 0.05, 1e-3, 4242
    # dpl: privacy noise off and no clipping (MeZO), fixed batch of the expected size
    pm = create_plugin_manager({"dpzero": {"mu": mu, "keep_direction": keep, "direction": distribution}})
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    ctx = _ctx(model, _bert_loss(model), seed=seed, C=math.inf, sigma=0.0, B=8, optimizer=optimizer)
    apply_direction(optimizer, ctx.trainable, private_step(pm.hook, ctx, batch, physical_batch_size=3))
    names = [n for n, _ in model.named_parameters()]
    # 3 micro-batches: perturb, perturb back each, then the update (which also moves them back from theta - mu z);
    # kept: one draw per tensor; rademacher: signs drawn as bits once per tensor, expanded at each pass, and the
    # looked-up rows of the embedding tables read from the bits directly (only the update expands them); gaussian:
    # a table's z is drawn for the rows a micro-batch reads first (its second forward reuses them), and by the update
    tables = set(lookup_tables(model, dict(model.named_parameters())))
    assert len(tables) == 3
    counts = Counter(draws)
    assert set(counts) == set(names)
    for n in names:
        if keep or (n in tables and distribution == "rademacher"):
            assert counts[n] == 1, n
        elif n in tables:
            assert 2 <= counts[n] <= 4, (n, counts[n])
        else:
            assert counts[n] == 7, n
    # by hand (MeZO's Algorithm 1, mean loss, z from the same public seed; kept: rounded to bfloat16)
    z = {n: DirectionSampler(seed, keep, distribution).z(n, p) for n, p in reference.named_parameters()}
    if keep and distribution == "gaussian":
        assert all(torch.equal(v, v.bfloat16().float()) for v in z.values())
    reference.eval()
    with torch.no_grad():
        def mean_loss(scale):
            probe = copy.deepcopy(reference)
            for n, p in probe.named_parameters():
                p.add_(scale * z[n])
            return float(_bert_loss(probe)(batch).double().mean())
        g = (mean_loss(mu) - mean_loss(-mu)) / (2 * mu)
        for n, p in reference.named_parameters():
            p.sub_(lr * g * z[n])
    assert g != 0.0
    for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=1e-5, msg=n)


def test_streaming_update_equals_sgd_through_grad():
    gen = torch.Generator().manual_seed(0)
    a = [nn.Parameter(torch.randn(3, 4, generator=gen)), nn.Parameter(torch.randn(5, generator=gen))]
    b = [nn.Parameter(p.detach().clone()) for p in a]
    dirs = [torch.randn(3, 4, generator=gen), torch.randn(5, generator=gen)]
    groups_a = [{"params": [a[0]], "lr": 0.1, "weight_decay": 0.01}, {"params": [a[1]], "lr": 0.3}]
    groups_b = [{"params": [b[0]], "lr": 0.1, "weight_decay": 0.01}, {"params": [b[1]], "lr": 0.3}]
    opt_a, opt_b = torch.optim.SGD(groups_a, lr=1.0), torch.optim.SGD(groups_b, lr=1.0)
    names = ["w", "b"]
    produced = []

    def produce(name):
        produced.append(name)
        return dirs[names.index(name)].clone()

    apply_direction(opt_a, dict(zip(names, a)), StreamingDirection(names, produce))
    apply_direction(opt_b, dict(zip(names, b)), dict(zip(names, dirs)))
    for p, q in zip(a, b):
        torch.testing.assert_close(p.detach(), q.detach())
        assert p.grad is None
    assert produced == names  # one tensor at a time, each produced once
    # LR schedulers see the step (no "scheduler.step() before optimizer.step()" warning path)
    sched = torch.optim.lr_scheduler.StepLR(opt_a, step_size=1, gamma=0.5)
    apply_direction(opt_a, dict(zip(names, a)), StreamingDirection(names, produce))
    sched.step()
    assert opt_a.param_groups[1]["lr"] == pytest.approx(0.15)


def test_optimizers_with_gradient_buffers_are_refused():
    p = [nn.Parameter(torch.zeros(2))]
    assert streaming_refusal(torch.optim.SGD(p, lr=0.1)) is None
    assert streaming_refusal(torch.optim.SGD(p, lr=0.1, weight_decay=0.1)) is None
    assert "momentum" in streaming_refusal(torch.optim.SGD(p, lr=0.1, momentum=0.9))
    assert "AdamW" in streaming_refusal(torch.optim.AdamW(p, lr=0.1))
    with pytest.raises(ConfigError):
        apply_streaming(torch.optim.Adam(p), {"x": p[0]}, StreamingDirection(["x"], lambda n: torch.ones(2)))
    model = tiny_bert()
    plugin = DPZeroPlugin()
    with pytest.raises(ConfigError, match="AdamW"):
        plugin.validate_setup(setup=_setup(model, ["dpzero"], optimizer_factory=torch.optim.AdamW))
    with pytest.raises(ConfigError, match="momentum"):
        plugin.validate_setup(setup=_setup(model, ["dpzero"], optimizer_factory=lambda ps: torch.optim.SGD(
            ps, lr=0.1, momentum=0.9)))
    plugin.validate_setup(setup=_setup(model, ["dpzero"], optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.1)))
    # the dense DPGD-0th baseline goes through .grad: any optimizer
    DPZeroPlugin(estimator="dpgd0").validate_setup(setup=_setup(model, ["dpzero"],
                                                                optimizer_factory=torch.optim.AdamW))


def test_privatize_replacements_are_refused():
    model = tiny_bert()
    with pytest.raises(ConfigError, match="privatize"):
        DPZeroPlugin().validate_setup(setup=_setup(model, ["dpzero", "x"],
                                                   replaced=frozenset({"estimate_gradient", "privatize"})))
    with pytest.raises(ConfigError):
        DPZeroPlugin(mu=0)


def test_dpgd0_clips_the_whole_vector():
    model = Quadratic()
    batch = _xbatch(n=5)
    batch["x"] *= 30.0
    C = 0.5
    total = DPZeroPlugin(estimator="dpgd0").estimate_gradient(ctx=_ctx(model, model.per_example_loss, C=C),
                                                               batch=batch)
    assert set(total.values) == {"theta", "bias"}
    norm = math.sqrt(sum(float(v.pow(2).sum()) for v in total.values.values()))
    assert norm <= 5 * C + 1e-9
    for i in range(5):
        one = {k: v[i:i + 1] for k, v in batch.items()}
        single = DPZeroPlugin(estimator="dpgd0").estimate_gradient(ctx=_ctx(model, model.per_example_loss, C=C),
                                                                    batch=one)
        assert math.sqrt(sum(float(v.pow(2).sum()) for v in single.values.values())) <= C * (1 + 1e-7)


def test_generation_module_with_lora(tmp_path):
    from dpl.tasks.modules import FinetuneOptions, LoraOptions
    from dpl.tasks.modules.generation import DPGenerationModule

    folder = save_tiny_llama_lm(tmp_path / "lm", tie=True)
    module = DPGenerationModule(model=folder, finetuning=FinetuneOptions(
        method="lora", lora=LoraOptions(r=2, alpha=4, target_modules=["q_proj", "v_proj"])))
    model = module.ensure_model()
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 9, 2, 0], [5, 10, 11, 12, 13, 14, 2]]),
             "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]]),
             "labels": torch.tensor([[-100, -100, -100, 8, 9, 2, -100], [-100, -100, 11, 12, 13, 14, 2]])}
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora" in n for n in trainable)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    pm = create_plugin_manager({"dpzero": {"mu": 1e-2}})
    optimizer = torch.optim.SGD(trainable.values(), lr=1.0)
    ctx = StepContext(model=model, trainable=trainable, per_example_loss=module.per_example_loss, max_grad_norm=10.0,
                      noise_multiplier=0.0, expected_batch_size=2, step=0, noise_source=torch.Generator(),
                      log=lambda k, v: None, public_seed=7, optimizer=optimizer)
    before = {n: p.detach().clone() for n, p in trainable.items()}
    apply_direction(optimizer, trainable, private_step(pm.hook, ctx, batch, physical_batch_size=2))
    assert any(not torch.equal(before[n], p.detach()) for n, p in trainable.items())  # LoRA moved
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(frozen[n], p.detach())  # the base model never moved (not even by rounding)
    assert all(p.grad is None for p in model.parameters())


# --- end to end -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_classification_workspace(tmp_path_factory.mktemp("dpzero_e2e"), rows=96, val_rows=32)


@pytest.mark.parametrize("fragment", ["dpzero.yaml", "mezo.yaml"])
def test_dpl_fit_with_the_config(tiny, fragment, capsys):
    from dpl.cli import main

    tmp, model = tiny
    root = tmp / f"runs_{fragment}"
    main(["fit", "--config", str(ROOT / "configs" / "quickstart.yaml"),
          "--config", str(ROOT / "plugins" / "dpzero" / fragment),
          "--model.model", model, "--model.finetuning.method", "full",
          "--model.privacy.batch_size", "16", "--model.privacy.physical_batch_size", "8",
          "--data", "dpl.tasks.data.ClassificationDataModule", "--data.tokenizer", model,
          "--data.data_dir", str(tmp / "data"), "--data.max_length", "16",
          "--trainer.max_epochs", "1", "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(root),
          "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
          "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(root)])
    out = capsys.readouterr().out
    assert "dpl: trained 6 private steps" in out
    eps = out.split("epsilon=")[1].split(",")[0]
    assert (eps == "inf") == (fragment == "mezo.yaml")
    rows = list(csv.DictReader(open(next(root.rglob("metrics.csv")))))
    assert any(r.get("dpzero/projected_grad") for r in rows)
    assert any(r.get("val_acc") for r in rows)


# --- embedding tables perturbed row by row ------------------------------------------------------------------------

def _one_step(model, batch, *, sparse, keep=False, distribution="rademacher", g=None, physical=3, plugin=None,
              seed=31):
    """One dpzero step (MeZO: no noise, no clipping) with lr 0.05; ``g``: the released scalar to apply instead of
    the estimate (as every DDP rank applies the same release). Returns the estimate."""
    if plugin is None:
        plugin = DPZeroPlugin(mu=1e-3, keep_direction=keep, direction=distribution, sparse_embeddings=sparse)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    ctx = _ctx(model, _bert_loss(model), seed=seed, C=math.inf, optimizer=optimizer)
    total = None
    for start in range(0, batch["labels"].numel(), physical):
        part = plugin.estimate_gradient(ctx=ctx, batch={k: v[start:start + physical] for k, v in batch.items()})
        total = part.values[KEY] if total is None else total + part.values[KEY]
    estimate = float(total) / batch["labels"].numel()
    update = plugin.precondition(ctx=ctx.release_context(), gradient=_private(estimate if g is None else g))
    apply_direction(optimizer, ctx.trainable, update)
    return estimate


@pytest.mark.parametrize("keep, distribution", [(False, "gaussian"), (True, "gaussian"), (False, "rademacher"),
                                                (True, "rademacher")])
def test_row_wise_tables_give_the_same_step_as_dense_passes(keep, distribution):
    batch = random_batch(8)
    dense, sparse = tiny_bert(), tiny_bert()
    before = {n: p.detach().clone() for n, p in dense.named_parameters()}
    g_dense = _one_step(dense, batch, sparse=False, keep=keep, distribution=distribution)
    g_sparse = _one_step(sparse, batch, sparse=True, keep=keep, distribution=distribution)
    assert g_dense != 0.0
    assert g_sparse == pytest.approx(g_dense, rel=1e-4)  # the same losses, up to float rounding of theta +- mu z
    for (n, p), (_, q) in zip(dense.named_parameters(), sparse.named_parameters()):
        assert not torch.equal(p.detach(), before[n]), n  # every row moved, looked up or not
        torch.testing.assert_close(q.detach(), p.detach(), rtol=1e-4, atol=1e-6, msg=n)


def test_row_wise_tables_end_bit_identical_whatever_rows_a_rank_looked_up():
    # two DDP ranks: different batches, the same released scalar: the embedding tables must agree bit for bit (the
    # rows are written back from a copy, never moved back arithmetically)
    first, second = tiny_bert(), tiny_bert()
    _one_step(first, random_batch(8, seed=1), sparse=True, g=0.7)
    _one_step(second, random_batch(6, length=5, seed=2), sparse=True, g=0.7)
    for (n, p), (_, q) in zip(first.named_parameters(), second.named_parameters()):
        if "embeddings" in n and "LayerNorm" not in n:
            assert torch.equal(p.detach(), q.detach()), n


def test_tied_subclassed_or_renormalized_tables_are_perturbed_densely():
    class Doubled(nn.Embedding):  # a forward of its own: may read the weight some other way
        def forward(self, ids):
            return 2 * super().forward(ids)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.plain = nn.Embedding(10, 4)
            self.tied = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.tied.weight  # an output layer tied to the input embeddings reads every row
            self.doubled = Doubled(10, 4)
            self.renormed = nn.Embedding(10, 4, max_norm=1.0)
            self.frozen = nn.Embedding(10, 4).requires_grad_(False)

    model = Model()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert set(lookup_tables(model, trainable)) == {"plain.weight"}


class ReadsATable(nn.Module):
    """Looks one table up and reads another's whole weight directly (as DeBERTa-v2 reads its relative positions)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.looked_up, self.read = nn.Embedding(50, 8), nn.Embedding(12, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, input_ids, attention_mask):
        hidden = self.looked_up(input_ids).mean(1) + torch.tanh(self.read.weight).mean(0)
        return types.SimpleNamespace(logits=self.head(hidden))


class LooksATableUpItself(ReadsATable):
    """Looks the second table up with ``F.embedding`` on its weight, outside the module's forward."""

    def forward(self, input_ids, attention_mask):
        hidden = self.looked_up(input_ids).mean(1) + F.embedding(input_ids % 12, self.read.weight).mean(1)
        return types.SimpleNamespace(logits=self.head(hidden))


@pytest.mark.parametrize("model", [ReadsATable, LooksATableUpItself])
def test_a_table_the_model_reads_directly_is_perturbed_densely(model, caplog):
    batch = random_batch(8)
    dense, sparse = model(), model()
    assert set(lookup_tables(sparse, dict(sparse.named_parameters()))) == {"looked_up.weight", "read.weight"}
    plugin = DPZeroPlugin(mu=1e-3, direction="rademacher")
    with caplog.at_level(logging.INFO, logger="dpl"):
        g_sparse = _one_step(sparse, batch, sparse=True, plugin=plugin)
    g_dense = _one_step(dense, batch, sparse=False)
    assert "read.weight" in caplog.text and "looked_up.weight" not in caplog.text
    # the first forward ran again with read.weight perturbed (float32 losses: ~2e-5 of rounding in g)
    assert g_sparse == pytest.approx(g_dense, rel=1e-4, abs=1e-4)
    assert plugin._verified == {"looked_up.weight"}
    # later steps: one table row-wise, the other densely: still the step of dense passes
    assert _one_step(sparse, batch, sparse=True, plugin=plugin, seed=32) == pytest.approx(
        _one_step(dense, batch, sparse=False, seed=32), rel=1e-4, abs=1e-4)
    for (n, p), (_, q) in zip(dense.named_parameters(), sparse.named_parameters()):
        torch.testing.assert_close(q.detach(), p.detach(), rtol=1e-4, atol=1e-6, msg=n)


def test_deberta_relative_positions_are_seen_read_directly():
    # DeBERTa-v2's relative position table is a plain, untied nn.Embedding whose weight the encoder indexes itself
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    torch.manual_seed(0)
    model = DebertaV2ForSequenceClassification(DebertaV2Config(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        relative_attention=True, position_buckets=8, max_relative_positions=16, pos_att_type=["p2c", "c2p"]))
    tables = lookup_tables(model, dict(model.named_parameters()))
    assert "deberta.encoder.rel_embeddings.weight" in tables
    batch = random_batch(4)

    def read_directly(model, tables):
        rows = RowPerturbation(tables, DirectionSampler(1))  # target 0: the rows are written back unchanged
        with torch.no_grad(), rows.hooked(), rows.watching() as uses:
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        rows.restore()
        return uses.read_directly

    assert read_directly(model, tables) == {"deberta.encoder.rel_embeddings.weight"}
    bert = tiny_bert()
    # BERT only looks its tables up, each in its own module's forward (metadata reads do not count)
    assert read_directly(bert, lookup_tables(bert, dict(bert.named_parameters()))) == set()


def test_a_lookup_by_keyword_moves_its_rows():
    table = nn.Embedding(12, 8)
    theta = table.weight.detach().clone()
    sampler = DirectionSampler(3, distribution="rademacher")
    rows = RowPerturbation({"weight": table}, sampler)
    rows.target = 0.5
    with torch.no_grad(), rows.hooked():
        out = table(input=torch.tensor([[4, 1], [4, 9]]))
    z = sampler.z("weight", table.weight)
    looked_up = torch.tensor([1, 4, 9])
    assert torch.equal(out[0, 0], theta[4] + 0.5 * z[4])
    assert torch.equal(table.weight.detach()[looked_up], theta[looked_up] + 0.5 * z[looked_up])
    others = torch.ones(12, dtype=torch.bool)
    others[looked_up] = False
    assert torch.equal(table.weight.detach()[others], theta[others])
    rows.restore()
    assert torch.equal(table.weight.detach(), theta) and not rows.displaced


def test_an_error_in_a_forward_restores_the_looked_up_rows():
    model = tiny_bert()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = _bert_loss(model)
    calls = []

    def failing(batch):
        calls.append(1)
        if len(calls) == 2:  # the second forward, at theta - mu z
            raise RuntimeError("boom")
        return loss(batch)

    plugin = DPZeroPlugin(direction="rademacher")
    with pytest.raises(RuntimeError, match="boom"):
        plugin.estimate_gradient(ctx=_ctx(model, failing), batch=random_batch(8))
    for n, p in model.named_parameters():
        if "embeddings" in n and "LayerNorm" not in n:
            assert torch.equal(p.detach(), before[n]), n  # rows written back exactly
        else:
            torch.testing.assert_close(p.detach(), before[n], rtol=0, atol=1e-6, msg=n)
    # and the next step starts clean
    plugin.estimate_gradient(ctx=_ctx(model, loss, seed=5), batch=random_batch(8))


@pytest.mark.parametrize("keep, distribution", [(False, "gaussian"), (True, "gaussian"), (False, "rademacher"),
                                                (True, "rademacher")])
@pytest.mark.parametrize("width", [16, 13])  # whole bytes per row, and rows that straddle bytes
def test_rows_of_z_are_the_rows_of_the_whole_z(keep, distribution, width, monkeypatch):
    from dpl_plugins.dpzero import directions

    monkeypatch.setattr(directions, "CHUNK", 64)  # rows cut across chunks
    monkeypatch.setattr(directions, "SIGN_CHUNK", 64)
    param = torch.zeros(40, width)
    whole = DirectionSampler(8, keep, distribution).z("table", param)
    rows = torch.tensor([0, 3, 4, 17, 39])
    assert torch.equal(DirectionSampler(8, keep, distribution).rows("table", param, rows), whole[rows])
