"""The denoise plugin inside the private step: reads the noise std from the metadata, refuses DPZero."""

import math

import pytest
import torch
from helpers import random_batch, tiny_bert

from dpl.errors import ConfigError
from dpl.gradients import PrivateGradient
from dpl.plugin_manager import create_plugin_manager
from dpl.step import RunSetup, StepContext, private_step
from dpl_plugins.denoise import DenoisePlugin
from dpl_plugins.denoise.shrinkage import optimal_shrinkage


def _ctx(model, logs):
    return StepContext(model=model, trainable={n: p for n, p in model.named_parameters()},
                       per_example_loss=None, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4, step=0,
                       noise_generator=torch.Generator().manual_seed(0), log=lambda k, v: logs.__setitem__(k, v))


def _setup(model, names):
    return RunSetup(model=model, trainable=dict(model.named_parameters()), plugin_names=names, num_examples=100,
                    expected_batch_size=4, steps=10, sampling_rate=0.04, accountant="prv", optimizer_name="SGD",
                    task="classification")


def test_uses_the_noise_std_of_each_tensor_from_the_metadata():
    gen = torch.Generator().manual_seed(0)
    signal = 3.0 * torch.outer(torch.randn(60, generator=gen), torch.randn(40, generator=gen)) / math.sqrt(60 * 40)
    noisy = signal + 0.05 * torch.randn(60, 40, generator=gen)
    gradient = PrivateGradient({"a": noisy.clone(), "b": noisy.clone(), "bias": torch.ones(3)},
                               noise_std={"a": 0.05, "b": 10.0, "bias": 0.05}, mechanism="test",
                               expected_batch_size=4, step=0)
    logs = {}
    DenoisePlugin().post_process(ctx=_ctx(tiny_bert(), logs), gradient=gradient)
    expected, _ = optimal_shrinkage(noisy, 0.05)
    torch.testing.assert_close(gradient.values["a"], expected)  # denoised with its own std
    assert not torch.equal(gradient.values["a"], noisy)
    assert torch.equal(gradient.values["b"], noisy)  # huge std: below the bulk edge, left alone
    assert torch.equal(gradient.values["bias"], torch.ones(3))  # not a matrix
    assert logs["denoise/fraction_denoised"] == 0.5
    assert logs["denoise/spikes"] >= 1


def test_refuses_rank_one_estimators_and_empty_selection():
    model = tiny_bert()
    with pytest.raises(ConfigError, match="dpzero"):
        DenoisePlugin().validate_setup(setup=_setup(model, ["denoise", "dpzero"]))
    with pytest.raises(ConfigError, match="no trainable 2-D parameter"):
        DenoisePlugin(parameters="lora").validate_setup(setup=_setup(model, ["denoise"]))
    DenoisePlugin().validate_setup(setup=_setup(model, ["denoise"]))


def test_bad_options():
    with pytest.raises(ConfigError):
        DenoisePlugin(kappa=0)
    with pytest.raises(ConfigError):
        DenoisePlugin(svd="qr")
    with pytest.raises(ConfigError):
        DenoisePlugin(parameters="some")


def test_runs_in_the_private_step_after_privatize():
    model = tiny_bert()
    logs = {}
    pm = create_plugin_manager({"denoise": {"kappa": 1.02}})
    ctx = StepContext(model=model, trainable={n: p for n, p in model.named_parameters() if p.requires_grad},
                      per_example_loss=lambda b: torch.nn.functional.cross_entropy(
                          model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits, b["labels"],
                          reduction="none"),
                      max_grad_norm=1.0, noise_multiplier=0.5, expected_batch_size=4, step=0,
                      noise_generator=torch.Generator().manual_seed(0), log=lambda k, v: logs.__setitem__(k, v))
    direction = private_step(pm.hook, ctx, random_batch(batch_size=4), physical_batch_size=4)
    assert set(direction) == set(ctx.trainable)
    assert "denoise/fraction_denoised" in logs
