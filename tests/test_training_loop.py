"""The public training loop (dpl.training.PrivateTraining): it trains, reports the accountant's epsilon, draws its
batches from the mechanism's sampler, refuses to exceed the budget, and runs plugins (DPZero's streaming update,
adambc)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from dpl import PrivateTraining
from dpl.core.accounting import epsilon_for
from dpl.core.engine import PrivateEngine
from dpl.core.privacy import PrivacyConfig
from dpl.errors import BudgetExceeded, ConfigError, PrivacyWarning

N, D = 256, 4


def toy_data(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Linearly separable points: the label is the sign of the first coordinate (with a margin)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=gen)
    x[:, 0] = x[:, 0].sign() * (x[:, 0].abs() + 0.5)
    return [{"x": x[i], "y": (x[i, 0] > 0).long()} for i in range(N)]


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(D, 2)

    def per_example_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(self.linear(batch["x"]), batch["y"], reduction="none")


def mean_loss(model: Classifier, data: list[dict]) -> float:
    batch = torch.utils.data.default_collate(data)
    with torch.no_grad():
        return float(model.per_example_loss(batch).mean())


def privacy(**overrides) -> PrivacyConfig:
    settings = {"target_epsilon": 8.0, "batch_size": 32, "physical_batch_size": 16, "max_grad_norm": 1.0,
                "seed": 0, **overrides}
    return PrivacyConfig(**settings)


def loop(model: Classifier, data, steps: int = 40, **kwargs) -> PrivateTraining:
    kwargs.setdefault("optimizer", torch.optim.SGD(model.parameters(), lr=0.5))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrivacyWarning)  # privacy.seed: reproducible tests
        return PrivateTraining(model, model.per_example_loss, kwargs.pop("privacy", privacy()), data=data,
                               steps=steps, **kwargs)


def test_trains_a_separable_problem_and_reports_the_accountants_epsilon():
    data, model = toy_data(), Classifier()
    before = mean_loss(model, data)
    training = loop(model, data, privacy=privacy(target_epsilon=50.0))
    assert training.epsilon == 0.0
    spent = training.run()
    assert training.steps_done == 40
    assert mean_loss(model, data) < 0.5 * before
    engine = training.engine
    assert spent == training.epsilon == engine.epsilon()
    independent = epsilon_for(training.noise_multiplier, 32 / N, 40, engine.plan.delta)
    assert spent == pytest.approx(independent, rel=0.03)
    assert spent <= 50.0 * (1 + 1e-9)


def test_batches_come_from_the_mechanisms_sampler():
    drawn: list[list[int]] = []

    def collate(rows: list[int]) -> dict[str, torch.Tensor]:
        drawn.append(list(rows))
        examples = [data[i] for i in rows]
        return torch.utils.data.default_collate(examples) if examples else {"x": torch.zeros(0, D),
                                                                            "y": torch.zeros(0, dtype=torch.long)}

    data, model = toy_data(), Classifier()
    training = loop(model, None, steps=12, num_examples=N, collate=collate)
    training.run()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrivacyWarning)
        reference = PrivateEngine(privacy())
        reference.setup(Classifier(), num_rows=N, steps=12)
    assert drawn == list(reference.batches())
    assert len({len(rows) for rows in drawn}) > 1  # Poisson: the batch size varies


def test_ftrl_batches_are_its_shuffled_order():
    drawn: list[list[int]] = []
    data, model = toy_data(), Classifier()

    def collate(rows: list[int]) -> dict[str, torch.Tensor]:
        drawn.append(list(rows))
        return torch.utils.data.default_collate([data[i] for i in rows])

    training = loop(model, None, steps=16, num_examples=N, collate=collate,
                    plugins={"ftrl": {"noise": "independent"}})
    training.run()
    assert all(len(rows) == 32 for rows in drawn)  # fixed-size batches, not Poisson
    first, second = drawn[:8], drawn[8:]
    assert sorted(i for rows in first for i in rows) == list(range(N))  # one epoch: a permutation
    assert first == second  # the same secret order every epoch
    assert first[0] != list(range(32))


def test_refuses_a_step_beyond_the_budget():
    data, model = toy_data(), Classifier()
    training = loop(model, data, steps=5, privacy=privacy(target_epsilon=1.0))
    training.run()
    weight = model.linear.weight.detach().clone()
    with pytest.raises(BudgetExceeded, match="budget"):
        training.step()
    assert training.steps_done == 5
    assert torch.equal(model.linear.weight, weight)


def test_one_step_on_a_given_batch():
    data, model = toy_data(), Classifier()
    training = loop(model, data, privacy=privacy(target_epsilon=None, noise_multiplier=1.0))
    batch = torch.utils.data.default_collate(data[:8])
    weight = model.linear.weight.detach().clone()
    for _ in range(3):
        training.step(batch)
    assert training.steps_done == 3
    assert not torch.equal(model.linear.weight, weight)
    # the update's .grad is dropped after the optimizer's step: held until the next one, it would add a model-sized
    # buffer to that step's peak memory
    assert all(p.grad is None for p in model.parameters())


def test_dpzero_trains_with_its_streaming_update():
    data, model = toy_data(), Classifier()
    before = mean_loss(model, data)
    training = loop(model, data, steps=60, privacy=privacy(target_epsilon=50.0),
                    optimizer=torch.optim.SGD(model.parameters(), lr=0.2), plugins={"dpzero": {"mu": 1e-3}})
    training.run()
    assert all(p.grad is None for p in model.parameters())  # applied in place, no gradient buffer
    assert mean_loss(model, data) < before


def test_dpzero_refuses_an_optimizer_with_state():
    model = Classifier()
    with pytest.raises(ConfigError, match="dpzero"):
        loop(model, toy_data(), optimizer=torch.optim.Adam(model.parameters(), lr=0.1),
             plugins={"dpzero": {}})


def test_adambc_runs_through_the_loop():
    data, model = toy_data(), Classifier()
    before = mean_loss(model, data)
    training = loop(model, data, privacy=privacy(target_epsilon=50.0),
                    optimizer=lambda params: torch.optim.SGD(params, lr=0.05), plugins={"adambc": {}})
    training.run()
    plugin = dict(training.engine.plugin_manager.list_name_plugin())["adambc"]
    assert plugin.steps == 40
    assert mean_loss(model, data) < before
    with pytest.raises(ConfigError, match="adambc"):
        loop(Classifier(), data, optimizer=lambda params: torch.optim.AdamW(params), plugins={"adambc": {}})


@pytest.mark.parametrize("plugins", [None, {"adambc": {}}, {"ftrl": {"noise": "blt"}}, {"dpzero": {"mu": 1e-3}}],
                         ids=["dp-sgd", "adambc", "ftrl", "dpzero"])
def test_a_run_continued_from_its_states_is_the_run_uninterrupted(plugins):
    """10 steps, against 4 steps, the states saved, a new PrivateTraining continuing them for 6: the same parameters
    bit for bit (seeded), epsilon and plugin states; the public state holds no generator state."""
    data = toy_data()
    momentum = 0.9 if plugins is None or "ftrl" in plugins else 0.0  # adambc and dpzero need plain SGD

    def make(model, **kwargs):
        return loop(model, data, steps=10, plugins=plugins, privacy=privacy(target_epsilon=20.0),
                    optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=momentum), **kwargs)

    whole = Classifier()
    make(whole).run()
    first = make(Classifier())
    for _ in range(4):
        first.step()
    state, secret = first.state_dict(), first.secret_state_dict()
    assert "noise_rng" not in repr(state) and "sampler_rng" not in repr(state)
    assert secret["noise_rng"] is not None
    continued_model = Classifier()
    with torch.no_grad():
        continued_model.linear.weight.fill_(7.0)  # the saved parameters replace whatever the model holds
    continued = make(continued_model, state=state, secret=secret)
    assert continued.steps_done == 4
    continued.run()
    assert continued.steps_done == 10
    for name, p in whole.named_parameters():
        assert torch.equal(p, dict(continued_model.named_parameters())[name]), name
    assert continued.epsilon == pytest.approx(make(Classifier()).engine.final_epsilon(), rel=1e-12)


def test_a_continued_run_without_its_secret_draws_fresh_noise():
    data = toy_data()
    first = loop(Classifier(), data, steps=6)
    for _ in range(3):
        first.step()
    state = first.state_dict()
    runs = []
    for _ in range(2):
        model = Classifier()  # seeded, without the secret: fresh streams (the warning: tests/test_engine.py)
        training = loop(model, data, steps=6, state=state)
        assert training.steps_done == 3
        training.run()
        runs.append(model.linear.weight.detach().clone())
    assert not torch.equal(runs[0], runs[1])  # two continuations never share noise (OS entropy)
    with pytest.raises(ConfigError, match="other parameters"):
        loop(Classifier(), data, steps=6, state={**state, "trainable": {}})


def test_needs_the_data_or_its_size():
    model = Classifier()
    with pytest.raises(ConfigError, match="num_examples"):
        loop(model, None)


def test_benchmarks_drive_dpl_through_the_loop():
    """No benchmark builds the step's context or calls the step's hooks by hand: they train through
    dpl.PrivateTraining (or the dpl command), which draws the batches and the noise as the privacy analysis says."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "benchmarks"
    pattern = re.compile(r"\b(StepContext|private_step)\b")
    files = [p for p in root.rglob("*") if p.is_file()]
    assert any(p.name == "step_time.py" for p in files)
    offending = [str(p.relative_to(root)) for p in files
                 if pattern.search(p.read_bytes().decode("utf-8", errors="ignore"))]
    assert not offending, f"benchmarks building dpl's step by hand: {offending}"
