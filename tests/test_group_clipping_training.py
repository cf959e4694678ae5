"""privacy.clipping: per_layer in a run (dpl.PrivateTraining, the config dpl fit reads): fixed thresholds keep flat
clipping's sigma and epsilon; adaptive thresholds release noisy counts with the gradient as one mechanism whose
epsilon dp-accounting confirms, move each step from the release only, and keep sum_g C_g^2 = C^2; bad values."""

from __future__ import annotations

import logging
import math
import warnings

import dp_accounting as dpa
import pytest
import torch
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant
from helpers import random_batch
from test_group_clipping import _build, _loss_fn

from dpl import PrivateTraining
from dpl.core import clipping_policy as policy
from dpl.core.privacy import PrivacyConfig
from dpl.errors import ConfigError, PrivacyWarning

de = dpa.dp_event
DELTA = 1e-5


def _rows(count: int = 48, length: int = 10) -> list[dict[str, torch.Tensor]]:
    batch = random_batch(batch_size=count, length=length, seed=3)
    return [{k: v[i] for k, v in batch.items()} for i in range(count)]


def _training(steps: int = 3, plugins=None, model=None, **privacy) -> PrivateTraining:
    model = model if model is not None else _build("llama-full", True, torch.float32)
    settings = dict(target_epsilon=2.0, batch_size=8, physical_batch_size=3, max_grad_norm=0.1, seed=0)
    config = PrivacyConfig(**{**settings, **privacy})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrivacyWarning)
        return PrivateTraining(model, _loss_fn(model), config, data=_rows(), steps=steps, plugins=plugins or {},
                               optimizer=lambda params: torch.optim.SGD(params, lr=0.1))


def _clip(training):
    return dict(training.engine.plugin_manager.list_name_plugin())["clip"]


@pytest.mark.parametrize("plugins", [{}, {"denoise": {}}, {"adambc": {}}, {"ftrl": {"noise": "independent"}}],
                         ids=["default", "denoise", "adambc", "ftrl"])
def test_fixed_thresholds_keep_flat_sigma_and_epsilon(plugins):
    flat, grouped = _training(plugins=plugins), _training(plugins=plugins, clipping="per_layer")
    assert grouped.engine.noise_multiplier == flat.engine.noise_multiplier
    assert grouped.engine.final_epsilon() == flat.engine.final_epsilon()
    clip = _clip(grouped)
    assert len(clip.groups) > 4 and math.isclose(sum(c * c for c in clip.thresholds), 0.01, rel_tol=1e-12)
    before = {n: p.detach().clone() for n, p in grouped.model.named_parameters()}
    grouped.run()
    assert any(not torch.equal(before[n], p) for n, p in grouped.model.named_parameters())
    assert all(torch.isfinite(p).all() for p in grouped.model.parameters())
    assert clip.thresholds == policy.group_thresholds(0.1, [sum(grouped.model.get_parameter(n).numel() for n in g)
                                                          for g in clip.groups])  # fixed: never moved


def test_adaptive_thresholds_move_from_the_release_and_keep_c(monkeypatch):
    training = _training(steps=4, clipping="per_layer", clipping_thresholds="adaptive", clipping_rate=0.5)
    clip, first = _clip(training), list(_clip(training).thresholds)
    released = []
    adapt = policy.adapted_thresholds

    def spy(thresholds, fractions, *args):
        released.append(list(fractions))
        return adapt(thresholds, fractions, *args)

    monkeypatch.setattr(policy, "adapted_thresholds", spy)
    training.run()
    assert len(released) == 4 and all(len(f) == len(first) for f in released)
    expected = first
    for fractions in released:  # the thresholds are functions of the released fractions alone
        expected = adapt(expected, fractions, 0.5, 0.5, 0.1)
    assert clip.thresholds == expected != first
    assert math.isclose(sum(c * c for c in clip.thresholds), 0.01, rel_tol=1e-9)
    assert clip.state_dict() == {"thresholds": expected}
    scope = training.engine.summary()["scope"]
    assert "per_layer adaptive over" in scope["clipping"] and "0.1 of 1/sigma^2" in scope["clipping"]


def test_adaptive_thresholds_on_lora_warn_where_an_a_matrix_is_apart_from_its_b(caplog):
    """Each LoRA matrix its own group: one warning line counting the A matrices alone (the study's LoRA row ran behind
    flat there); A and B of each adapted layer in one group, or fixed thresholds: no warning."""
    model = _build("llama-lora", False, torch.float32)
    adapted = sorted({n.split(".lora_A.")[0] for n, p in model.named_parameters() if ".lora_A." in n})
    with caplog.at_level(logging.WARNING, logger="dpl"):
        _training(model=model, clipping="per_layer", clipping_thresholds="adaptive")
    told = [r.getMessage() for r in caplog.records if "LoRA A matrices" in r.getMessage()]
    assert len(told) == 1 and told[0].startswith(f"dpl: privacy.clipping_thresholds adaptive with {len(adapted)} LoRA A")
    assert policy.lora_a_alone([["x.lora_A.default.weight"], ["x.lora_B.default.weight"], ["head.weight"]]) == 1
    caplog.clear()
    paired = [f"{name}.*" for name in adapted] + ["*"]
    with caplog.at_level(logging.WARNING, logger="dpl"):
        _training(model=_build("llama-lora", False, torch.float32), clipping="per_layer",
                  clipping_thresholds="adaptive", clipping_groups=paired)
        _training(model=_build("llama-lora", False, torch.float32), clipping="per_layer")
    assert not any("LoRA A matrices" in r.getMessage() for r in caplog.records)


def test_adaptive_epsilon_composes_both_parts_as_dp_accounting_does():
    """sigma is the pair's (gradient and counts, one Poisson-sampled Gaussian mechanism): dp-accounting's RDP of the
    two Gaussians composed inside the sampling equals that of one Gaussian of sigma_eff, and dpl's epsilon is within
    1% of dp-accounting's PLD of it (never below); flat clipping at the same target gets the same sigma."""
    adaptive = _training(steps=50, clipping="per_layer", clipping_thresholds="adaptive")
    flat = _training(steps=50)
    sigma, q, steps = adaptive.engine.noise_multiplier, adaptive.engine.sampling_rate, 50
    assert sigma == flat.engine.noise_multiplier
    groups = len(_clip(adaptive).groups)
    gradient_sigma, count_std = policy.count_noise(sigma, groups, 0.1)
    assert gradient_sigma > sigma and adaptive.engine.mechanism.noise_scale == pytest.approx(gradient_sigma / sigma)
    count_multiplier = count_std / (math.sqrt(groups) / 2)  # the counts' std over their L2 sensitivity sqrt(G)/2
    pair = de.PoissonSampledDpEvent(q, de.ComposedDpEvent([de.GaussianDpEvent(gradient_sigma),
                                                          de.GaussianDpEvent(count_multiplier)]))
    one = de.PoissonSampledDpEvent(q, de.GaussianDpEvent(sigma))
    rdp = []
    for event in (pair, one):
        accountant = rdp_privacy_accountant.RdpAccountant()
        accountant.compose(de.SelfComposedDpEvent(event, steps))
        rdp.append(accountant.get_epsilon(adaptive.engine.plan.delta))
    assert rdp[0] == pytest.approx(rdp[1], rel=1e-9)
    pld = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3)
    pld.compose(de.SelfComposedDpEvent(one, steps))
    oracle, ours = pld.get_epsilon(adaptive.engine.plan.delta), adaptive.engine.final_epsilon()
    assert oracle * (1 - 2e-3) <= ours <= oracle * 1.01, (ours, oracle)


def test_bad_values_in_one_line():
    cases = [(dict(clipping="groupwise"), "privacy.clipping must be flat or per_layer"),
             (dict(clipping_groups=["*"]), "privacy.clipping_groups needs privacy.clipping: per_layer"),
             (dict(clipping="per_layer", clipping_thresholds="moving"), "clipping_thresholds must be fixed or adaptive"),
             (dict(clipping="per_layer", clipping_quantile=1.0), "clipping_quantile must be in (0, 1)"),
             (dict(clipping="per_layer", clipping_count_share=0.0), "clipping_count_share must be in (0, 1)"),
             (dict(clipping="per_layer", clipping_groups=[]), "clipping_groups is empty")]
    for settings, message in cases:
        with pytest.raises(ConfigError) as info:
            PrivacyConfig(**settings).validate()
        assert message in str(info.value) and "\n" not in str(info.value)
    for settings, message in [(dict(clipping_split=[0.05, 0.05]), "clipping_split has 2 thresholds"),
                              (dict(clipping_groups=["*.layers.*", "*.nothing.*", "*"]), "an empty group"),
                              (dict(clipping_groups=["*.layers.0.*", "*.layers.1.*", "*"],
                                    clipping_split=[0.05, 0.05, 0.05]), "add up to 0.0075, not C^2 = 0.01")]:
        with pytest.raises(ConfigError) as info:
            _training(clipping="per_layer", **settings)
        assert message in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="adaptive releases its counts through dpl's default privatize"):
        _training(clipping="per_layer", clipping_thresholds="adaptive", plugins={"ftrl": {"noise": "independent"}})
    with pytest.raises(ConfigError, match="per_layer is dpl's default estimate_gradient"):
        _training(clipping="per_layer", plugins={"dpzero": {}})


def test_dpl_plan_shows_the_groups_and_the_split(tmp_path, capsys):
    from pathlib import Path

    from helpers import save_tiny_bert

    from dpl.cli import main

    root = Path(__file__).resolve().parents[1]
    bert = save_tiny_bert(tmp_path / "bert")
    common = ["--config", str(root / "configs/quickstart.yaml"), "--model.init_args.model", bert,
              "--data.init_args.tokenizer", bert, "--data.init_args.train_size", "400",
              "--data.init_args.validation_size", "20", "--trainer.precision", "32-true",
              "--model.init_args.privacy.batch_size", "16"]
    main(["plan", *common, "--config", str(root / "configs/clipping/per-layer-adaptive.yaml")])
    out = capsys.readouterr().out
    line = next(text for text in out.splitlines() if text.startswith("  clipping "))
    assert "per_layer adaptive over" in line and "the counts take 0.1 of 1/sigma^2" in line
    assert "per step sigma x 1.05" in out  # the gradient's noise: sigma / sqrt(1 - 0.1)
    main(["plan", *common, "--config", str(root / "configs/clipping/per-layer.yaml")])
    out = capsys.readouterr().out
    assert "  clipping per_layer fixed over" in out and "sigma and epsilon: flat clipping's" in out
