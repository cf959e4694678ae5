"""User-level DP (privacy.unit: user): the per-user clipped sums, the samplers, micro-batching and sharding that never
split a user, the mechanisms and their refusals."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from helpers import random_batch, reference_clipped_sum, tiny_bert, tiny_llama
from torch import nn

from dpl.core.engine import PrivateEngine
from dpl.core.per_example import PerExampleClipper
from dpl.core.privacy import PrivacyConfig
from dpl.core.sampling import PoissonBatchSampler
from dpl.core.step import UNITS_KEY, split_batch
from dpl.core.units import Users, UserRowsSampler, unit_sizes
from dpl.errors import ConfigError
from dpl.lightning.samplers import ShardedBatchSampler
from dpl.tasks.modules.classification import FinetuneOptions, LoraOptions, apply_finetuning

pytestmark = pytest.mark.filterwarnings("ignore::dpl.errors.PrivacyWarning")


def _loss_fn(model):
    def losses(batch):
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return F.cross_entropy(out.logits, batch["labels"], reduction="none")
    return losses


def _lora(model):
    return apply_finetuning(model, FinetuneOptions(method="lora", lora=LoraOptions(r=2, target_modules=None)),
                            "SEQ_CLS")


def _naive_user_sum(model, batch, units, max_norm):
    """Per user: the gradient of the mean of its rows' losses, by ordinary autograd, clipped to max_norm; summed."""
    return reference_clipped_sum(_loss_fn(model), model, batch, max_norm, units=units)


@pytest.mark.parametrize("build", [tiny_bert, tiny_llama, lambda: _lora(tiny_bert()), lambda: _lora(tiny_llama())],
                         ids=["bert-full", "llama-full", "bert-lora", "llama-lora"])
@pytest.mark.parametrize("max_norm", [0.05, math.inf])
def test_user_clipped_sums_equal_a_naive_per_user_loop(build, max_norm):
    """The unit's gradient (the mean of its rows') is clipped as one vector: embeddings, LayerNorm/RMSNorm,
    attention, heads, LoRA A/B. Per-row clipping (the planted bug) differs."""
    model = build().double()
    batch = random_batch(batch_size=7)
    units = torch.tensor([3, 3, 0, 5, 5, 5, 1])  # users of 2, 1, 3 and 1 rows, contiguous
    clipper = PerExampleClipper(model)
    with clipper.record(7):
        losses = _loss_fn(model)(batch) / unit_sizes(units).double()
    sums, norms = clipper.clipped_sum(losses, max_norm, units=units)
    expected, expected_norms = _naive_user_sum(model, batch, units, max_norm)
    assert norms.shape == (4,)
    torch.testing.assert_close(norms.double(), expected_norms, rtol=1e-5, atol=1e-7)
    for name in expected:
        torch.testing.assert_close(sums[name].double(), expected[name], rtol=1e-5, atol=1e-6, msg=name)
    if not math.isinf(max_norm):  # clipping each row on its own is not the same release
        with clipper.record(7):
            losses = _loss_fn(model)(batch) / unit_sizes(units).double()
        per_row, _ = clipper.clipped_sum(losses, max_norm)
        assert max(float((per_row[n].double() - expected[n]).abs().max()) for n in expected) > 1e-4


def test_every_user_contributes_at_most_the_clipping_bound():
    """Each user's share of the clipped sum (all its rows) has norm <= C, whatever its number of rows."""
    model = tiny_bert().double()
    batch = random_batch(batch_size=6)
    units = torch.tensor([0, 0, 0, 1, 2, 2])
    clipper = PerExampleClipper(model)
    for user in range(3):
        with clipper.record(6):
            losses = _loss_fn(model)(batch) / unit_sizes(units).double()
        only = (units == user).double()
        sums, _ = clipper.clipped_sum(losses * only, 0.01, units=units)
        assert math.sqrt(sum(float(t.double().pow(2).sum()) for t in sums.values())) <= 0.01 * (1 + 1e-6)


def test_users_from_keys_and_the_bound():
    users = Users.from_keys(["a", "b", "a", "c", "a", "b"], max_rows=2)
    assert users.rows == ((0, 2, 4), (1, 5), (3,))
    assert users.unit_of_row() == [0, 1, 0, 2, 0, 1]
    s = users.summary()
    assert (s["users"], s["rows"], s["rows_per_user_min"], s["rows_per_user_max"], s["rows_beyond_bound"]) == \
        (3, 6, 1, 3, 1)
    assert s["rows_per_user_median"] == 2
    assert users.sampled(True) == 3 and users.sampled(False) == 5
    gen = torch.Generator().manual_seed(0)
    picks = Counter(tuple(users.pick(0, gen)) for _ in range(3000))
    assert set(picks) == {(0, 2), (0, 4), (2, 4)}  # k of the user's own rows, in order
    assert all(abs(c / 3000 - 1 / 3) < 0.04 for c in picks.values())  # uniformly
    bounded = users.bounded_rows(gen)
    assert len(bounded) == 5 and sum(r in (0, 2, 4) for r in bounded) == 2


def test_user_sampling_includes_each_user_at_rate_q_and_at_most_k_rows():
    """Poisson over users: inclusion frequency q per user whatever its number of rows; a user's rows contiguous and
    at most k of them. 4,000 seeded steps: frequencies within 5 standard errors."""
    keys = [u for u in range(40) for _ in range(1 + u % 5)]  # users of 1 to 5 rows
    users = Users.from_keys(keys, max_rows=3)
    q, steps = 0.1, 4000
    gen = torch.Generator().manual_seed(1)
    sampler = UserRowsSampler(PoissonBatchSampler(40, q, steps, gen), users, gen)
    unit_of = users.unit_of_row()
    counts = Counter()
    for batch in sampler:
        seen = [unit_of[r] for r in batch]
        per_user = Counter(seen)
        assert all(n <= 3 for n in per_user.values())
        assert all(n == min(3, len(users.rows[u])) for u, n in per_user.items())
        runs = [u for i, u in enumerate(seen) if i == 0 or seen[i - 1] != u]
        assert len(runs) == len(per_user)  # contiguous
        counts.update(per_user.keys())
    se = math.sqrt(q * (1 - q) / steps)
    assert all(abs(counts[u] / steps - q) < 5 * se for u in range(40))


def test_micro_batches_and_ranks_never_split_a_user():
    batch = random_batch(batch_size=9)
    batch[UNITS_KEY] = torch.tensor([4, 4, 4, 1, 7, 7, 2, 2, 2])
    parts = list(split_batch(batch, 4))
    assert sum(len(p[UNITS_KEY]) for p in parts) == 9
    seen = [set(p[UNITS_KEY].tolist()) for p in parts]
    assert all(not (a & b) for i, a in enumerate(seen) for b in seen[i + 1:])  # a user in one micro-batch only
    for p in parts:  # rows of a unit contiguous and ordered longest unit first
        units = p[UNITS_KEY].tolist()
        assert len([u for i, u in enumerate(units) if i == 0 or units[i - 1] != u]) == len(set(units))
    assert all(len(p[UNITS_KEY]) <= 4 for p in parts)
    big = dict(batch, **{UNITS_KEY: torch.tensor([0] * 6 + [1] * 3)})
    assert sorted(len(p[UNITS_KEY]) for p in split_batch(big, 4)) == [3, 6]  # a unit larger than the micro-batch: alone
    keys = [u for u in range(30) for _ in range(1 + u % 3)]
    users = Users.from_keys(keys, 3)
    unit_of = users.unit_of_row()
    gen = torch.Generator().manual_seed(2)
    inner = UserRowsSampler(PoissonBatchSampler(30, 0.3, 5, gen), users, gen)
    shards = [ShardedBatchSampler(inner, r, 2, unit_of=unit_of) for r in range(2)]
    state = gen.get_state()
    per_rank = []
    for shard in shards:
        gen.set_state(state)
        per_rank.append(list(shard))
    for a, b in zip(*per_rank):
        assert not {unit_of[i] for i in a} & {unit_of[i] for i in b}


def _engine(privacy, n_rows=60):
    keys = [r // 3 for r in range(n_rows)]  # 20 users of 3 rows
    engine = PrivateEngine(privacy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    engine.setup(model, num_rows=n_rows, steps=6, users=Users.from_keys(keys, privacy.max_rows_per_user or 1))
    return engine, model


def test_user_level_sampling_accounts_as_dp_sgd_over_users():
    privacy = PrivacyConfig(target_epsilon=2.0, batch_size=5, unit="user", max_rows_per_user=2, seed=0)
    engine, model = _engine(privacy)
    plan = engine.plan
    assert (plan.population, plan.num_units, plan.num_rows) == (20, 20, 60)
    assert plan.delta == pytest.approx(0.1 / 20) and engine.sampling_rate == pytest.approx(5 / 20)
    assert engine.mechanism.unit == "user"
    from dpl.core.accounting import epsilon_for

    assert engine.final_epsilon() == pytest.approx(epsilon_for(engine.noise_multiplier, 5 / 20, 6, 0.1 / 20), rel=1e-6)
    # the rate of the rows would be the planted bug: a smaller epsilon than the truth
    assert epsilon_for(engine.noise_multiplier, 5 / 60, 6, 0.1 / 20) < engine.final_epsilon() * 0.8
    summary = engine.summary()
    assert summary["unit"] == "user" and summary["users"]["users"] == 20 and summary["num_units"] == 20
    batch = next(engine.batches())
    unit_of = engine.unit_of_row()
    assert all(Counter(unit_of[r] for r in batch)[u] <= 2 for u in set(unit_of[r] for r in batch))


def test_a_user_step_clips_each_user_once():
    """Through the engine and the default plugins: the release minus the noise is the sum over users of the clipped
    mean gradients (noise_multiplier 0, C small: each user's contribution has norm exactly C)."""
    privacy = PrivacyConfig(target_epsilon=None, noise_multiplier=0.0, max_grad_norm=1e-3, batch_size=5,
                            unit="user", max_rows_per_user=3, seed=0)
    engine, model = _engine(privacy)
    engine.start()
    x, y = torch.randn(9, 4), torch.tensor([0, 1, 0, 1, 1, 0, 0, 1, 1])
    units = torch.tensor([2, 2, 2, 5, 5, 9, 9, 9, 9])  # the last user has 4 rows here: a step takes what it is given

    def loss(batch):
        return F.cross_entropy(model(batch["x"]), batch["labels"], reduction="none")

    trainable = dict(model.named_parameters())
    direction = engine.step({"x": x, "labels": y, UNITS_KEY: units}, model=model, trainable=trainable,
                            per_example_loss=loss)
    total = torch.cat([direction[n].flatten() for n in trainable]) * 5  # times the expected batch (B users)
    expected = torch.zeros_like(total)
    for user in (2, 5, 9):
        rows = units == user
        grads = torch.autograd.grad(loss({"x": x[rows], "labels": y[rows]}).mean(), list(trainable.values()))
        g = torch.cat([t.flatten() for t in grads])
        expected += g * min(1.0, 1e-3 / (float(g.norm()) + 1e-6))
    torch.testing.assert_close(total, expected, rtol=1e-4, atol=1e-9)


def test_refusals_are_one_line():
    with pytest.raises(ConfigError, match="max_rows_per_user"):
        PrivacyConfig(unit="user").validate()
    engine = PrivateEngine(PrivacyConfig(unit="user", max_rows_per_user=2))
    with pytest.raises(ConfigError, match="user_column"):
        engine.setup(nn.Linear(2, 2), num_rows=10, steps=2)
    engine = PrivateEngine(PrivacyConfig(unit="user", max_rows_per_user=2, user_sampling="rows", batch_size=4),
                           plugins={"ftrl": {}})
    with pytest.raises(ConfigError, match="user_sampling: rows"):
        engine.setup(nn.Linear(2, 2), num_rows=40, steps=2, users=Users.from_keys(list(range(40)), 2))


@pytest.mark.parametrize("plugins", [{"adambc": {}}, {"denoise": {}}, {"ftrl": {}}, {"dpzero": {"mu": 0.05}}],
                         ids=["adambc", "denoise", "ftrl", "dpzero"])
def test_every_plugin_trains_with_user_level_sampling(plugins):
    """Each built-in plugin under privacy.unit: user (user-level sampling): its mechanism accounts per user, the
    batches hold whole users (at most k rows each), and the steps run."""
    from dpl.core.plugin_manager import installed_plugins
    from dpl.core.update import apply_direction

    name = next(iter(plugins))
    if name not in installed_plugins():
        pytest.skip(f"plugin {name} is not installed")
    privacy = PrivacyConfig(target_epsilon=4.0, batch_size=4, physical_batch_size=4, unit="user",
                            max_rows_per_user=2, seed=3)
    keys = [r // 3 for r in range(48)]  # 16 users of 3 rows
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    engine = PrivateEngine(privacy, plugins)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.setup(model, num_rows=48, steps=4, users=Users.from_keys(keys, 2),
                 optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.1))
    engine.start()
    assert engine.mechanism.unit == "user" and engine.plan.population == 16
    x, y = torch.randn(48, 4), torch.randint(0, 2, (48,))
    unit_of = torch.tensor(engine.unit_of_row())
    trainable = dict(model.named_parameters())
    before = [p.detach().clone() for p in model.parameters()]

    def loss(batch):
        return F.cross_entropy(model(batch["x"]), batch["labels"], reduction="none")

    for rows in engine.batches():
        idx = torch.tensor(rows, dtype=torch.long)
        assert all(n <= 2 for n in Counter(unit_of[idx].tolist()).values())
        direction = engine.step({"x": x[idx], "labels": y[idx], UNITS_KEY: unit_of[idx]}, model=model,
                                trainable=trainable, per_example_loss=loss, optimizer=optimizer)
        apply_direction(optimizer, trainable, direction)
    assert engine.steps_done == 4 and 0 < engine.epsilon() <= 4.0 * (1 + 1e-9)
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_an_estimator_that_does_not_clip_users_is_refused(monkeypatch):
    from helpers import fake_entry_points

    from dpl.api import GradientSum, hookimpl

    class RowClipper:
        @hookimpl
        def estimate_gradient(self, ctx, batch):
            return GradientSum({}, 0)

    fake_entry_points(monkeypatch, {"rowclip": RowClipper})
    engine = PrivateEngine(PrivacyConfig(unit="user", max_rows_per_user=2, batch_size=4), {"rowclip": {}})
    with pytest.raises(ConfigError, match="rowclip replaces estimate_gradient but does not clip per user"):
        engine.setup(nn.Linear(2, 2), num_rows=40, steps=2, users=Users.from_keys(list(range(40)), 2))


def test_example_level_sampling_bounds_users_once_and_accounts_per_user():
    """ELS: each user bounded to k rows for the whole run, rows sampled at q = B / bounded rows, clipped per row; the
    user-level epsilon from the mixture accountant, the per-row epsilon and the loose group-privacy conversion in the
    summary (the tight one below it)."""
    from dpl.core.accounting import els_epsilon, epsilon_for, group_privacy

    privacy = PrivacyConfig(target_epsilon=4.0, batch_size=6, unit="user", max_rows_per_user=2, user_sampling="rows",
                            seed=0)
    engine, model = _engine(privacy)  # 20 users of 3 rows: 40 bounded rows
    plan = engine.plan
    assert (plan.population, plan.num_units, plan.num_rows) == (40, 20, 60)
    assert engine.mechanism.unit == "user" and engine.unit_of_row() is None  # rows are clipped one by one
    sigma, q = engine.noise_multiplier, 6 / 40
    assert engine.final_epsilon() == pytest.approx(els_epsilon(sigma, q, 2, 6, 0.1 / 20), rel=1e-6)
    assert engine.final_epsilon() <= 4.0 * (1 + 1e-9)
    assert els_epsilon(sigma, q, 1, 6, 0.1 / 20) < engine.final_epsilon()  # k = 1 (the planted bug) says less
    used = set()
    for rows in engine.batches():
        used.update(rows)
    assert all(n <= 2 for n in Counter(r // 3 for r in used).values())  # the same k rows of a user all run long
    engine.start()
    engine.ledger.steps_done = 6  # as if trained: the report's figures
    summary = engine.summary()
    row = epsilon_for(sigma, q, 6, 0.1 / 20)
    assert summary["epsilon_per_row"] == pytest.approx(row, rel=1e-9)
    loose, loose_delta = group_privacy(row, 0.1 / 20, 2)
    assert summary["epsilon_group_privacy"] == pytest.approx(loose) and loose_delta > summary["delta"]
    assert summary["users"] == {"users": 20, "max_rows_per_user": 2, "sampling": "rows"}  # no per-user statistics


def _pld_epsilon(parts, delta, k=None):
    """dp-accounting's pessimistic PLD epsilon (grid 1e-3, add or remove one) of the parts ``(sigma, q, steps)``
    composed: Poisson-subsampled Gaussian steps (one row), or with ``k`` the mixture N(M, sigma^2), M ~ Binomial(k, q)
    (one user of k rows). An oracle written apart from dpl's accountants."""
    dp_accounting = pytest.importorskip("dp_accounting")
    from dp_accounting.pld import pld_privacy_accountant
    from scipy import stats

    acc = pld_privacy_accountant.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
                                               value_discretization_interval=1e-3)
    for sigma, q, steps in parts:
        if k is None:
            step = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
        else:
            step = dp_accounting.dp_event.MixtureOfGaussiansDpEvent(
                sigma, list(range(k + 1)), stats.binom.pmf(range(k + 1), k, q).tolist())
        acc.compose(dp_accounting.SelfComposedDpEvent(step, steps))
    return acc.get_epsilon(delta)


def test_resumed_example_level_sampling_reports_per_row_and_group_privacy_of_both_parts():
    """ELS for 6 steps at the calibrated sigma, resumed (force_resume) with sigma 3.0 for 6 more: the per-user, the
    per-row and the group-privacy figures are compositions of both parts, at or above dp-accounting's PLD of both
    parts and within 2% of it (dpl's PRV bound is the upper end of a 0.5% error interval; the PLD's pessimistic 1e-3
    grid is within 1e-4 of the truth here). The per-row figure from the current sigma alone (the planted bug:
    ``epsilon_for(3.0, q, 12)``) is far below."""
    from dpl.core.accounting import epsilon_for, group_privacy

    base = dict(batch_size=6, unit="user", max_rows_per_user=2, user_sampling="rows")
    first, _ = _engine(PrivacyConfig(target_epsilon=4.0, **base))
    first.ledger.steps_done = 6
    state = first.state_dict()
    sigma1, q, delta = first.noise_multiplier, 6 / 40, 0.1 / 20
    resumed = PrivateEngine(PrivacyConfig(noise_multiplier=3.0, force_resume=True, max_epsilon=9.0, **base))
    resumed.setup(nn.Linear(4, 2), num_rows=60, steps=12, users=Users.from_keys([r // 3 for r in range(60)], 2))
    resumed.load_state_dict(state)
    resumed.ledger.steps_done = 12  # as if trained
    summary = resumed.summary()
    assert summary["resumed_parts"] == 2
    parts = [(sigma1, q, 6), (3.0, q, 6)]
    row, user = _pld_epsilon(parts, delta), _pld_epsilon(parts, delta, k=2)
    assert row * (1 - 1e-4) <= summary["epsilon_per_row"] <= row * 1.02
    assert user * (1 - 1e-4) <= summary["epsilon"] <= user * 1.02
    group, group_delta = group_privacy(row, delta, 2)
    assert group * (1 - 1e-4) <= summary["epsilon_group_privacy"] <= group * 1.02
    assert summary["delta_group_privacy"] >= group_delta * (1 - 1e-4)
    assert epsilon_for(3.0, q, 12, delta) < 0.5 * row  # what the current sigma alone would say


def test_user_level_sampling_states_no_per_row_figure():
    """Under user-level sampling a row's removal changes its user's clipped mean by up to 2C, which the per-user
    add/remove analysis does not cover: the summary states no per-row epsilon."""
    engine, _ = _engine(PrivacyConfig(target_epsilon=2.0, batch_size=5, unit="user", max_rows_per_user=2))
    engine.ledger.steps_done = 6
    summary = engine.summary()
    assert "epsilon_per_row" not in summary and "epsilon_group_privacy" not in summary
