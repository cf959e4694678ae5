"""The denoise plugin inside the private step: reads the noise std from the metadata, refuses DPZero; its opt-in
non-private diagnostics (Improvement = cos(D(g~), g) - cos(g~, g)) against an independent computation."""

import math
import warnings

import numpy as np
import pytest
import torch
from helpers import random_batch, tiny_bert, tiny_classification_workspace

from dpl.errors import ConfigError, PrivacyWarning
from dpl.core.gradients import GradientSum, PrivateGradient
from dpl.api import hookimpl
from dpl.core.plugin_manager import create_plugin_manager, replaced_hooks
from dpl.core.step import RunSetup, StepContext, private_step
from dpl_plugins.denoise import NONPRIVATE_PREFIX, DenoisePlugin
from dpl_plugins.denoise.shrinkage import ShrinkageOptions, denoise_matrices, optimal_shrinkage
from dpl_plugins.gaussian import GaussianPlugin


def _ctx(model, logs):
    return StepContext(model=model, trainable={n: p for n, p in model.named_parameters()},
                       per_example_loss=None, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4, step=0,
                       noise_source=torch.Generator().manual_seed(0), log=lambda k, v: logs.__setitem__(k, v))


def _setup(model, names):
    return RunSetup(model=model, trainable=dict(model.named_parameters()), plugin_names=names, population=100,
                    expected_batch_size=4, steps=10, sampling_rate=0.04, accountant="prv", optimizer_name="SGD")


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


def test_refuses_an_empty_selection():
    model = tiny_bert()
    with pytest.raises(ConfigError, match="no trainable 2-D parameter"):
        DenoisePlugin(parameters="lora").validate_setup(setup=_setup(model, ["denoise"]))
    DenoisePlugin().validate_setup(setup=_setup(model, ["denoise"]))


def test_bad_options():
    with pytest.raises(ConfigError):
        DenoisePlugin(kappa=0)
    with pytest.raises(ConfigError):
        DenoisePlugin(rank=0)
    assert DenoisePlugin().svd == "auto"


def test_runs_in_the_private_step_after_privatize():
    model = tiny_bert()
    logs = {}
    pm = create_plugin_manager({"denoise": {"kappa": 1.02}})
    ctx = StepContext(model=model, trainable={n: p for n, p in model.named_parameters() if p.requires_grad},
                      per_example_loss=lambda b: torch.nn.functional.cross_entropy(
                          model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits, b["labels"],
                          reduction="none"),
                      max_grad_norm=1.0, noise_multiplier=0.5, expected_batch_size=4, step=0,
                      noise_source=torch.Generator().manual_seed(0), log=lambda k, v: logs.__setitem__(k, v))
    direction = private_step(pm.hook, ctx, random_batch(batch_size=4), physical_batch_size=4)
    assert set(direction) == set(ctx.trainable)
    assert "denoise/fraction_denoised" in logs


# ------------------------------------------------------------------------------------------ non-private diagnostics


def _loss_fn(model):
    return lambda b: torch.nn.functional.cross_entropy(
        model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits, b["labels"], reduction="none")


def _step_ctx(model, logs, noise_multiplier, seed=0, batch_size=8):
    return StepContext(model=model, trainable={n: p for n, p in model.named_parameters() if p.requires_grad},
                       per_example_loss=_loss_fn(model), max_grad_norm=1.0, noise_multiplier=noise_multiplier,
                       expected_batch_size=batch_size, step=3, noise_source=torch.Generator().manual_seed(seed),
                       log=lambda k, v: logs.__setitem__(k, v))


def _cos(a, b):
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_diagnostics_are_off_by_default_and_log_nothing_nonprivate():
    assert DenoisePlugin().nonprivate_diagnostics is False
    model = tiny_bert()
    logs = {}
    pm = create_plugin_manager({"denoise": {}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "non-private" warning either
        DenoisePlugin().validate_setup(setup=_setup(model, ["denoise"]))
    private_step(pm.hook, _step_ctx(model, logs, 0.05), random_batch(batch_size=8), physical_batch_size=8)
    assert "denoise/fraction_denoised" in logs
    assert not [k for k in logs if "nonprivate" in k]


def test_diagnostics_warn_at_setup():
    with pytest.warns(PrivacyWarning, match="non-private diagnostics enabled: logged values read the clean gradient "
                                         "and are not covered by the privacy guarantee"):
        DenoisePlugin(nonprivate_diagnostics=True).validate_setup(setup=_setup(tiny_bert(), ["denoise"]))


@pytest.mark.parametrize("noise_multiplier", [0.02, 0.5])
def test_improvement_equals_an_independent_computation(noise_multiplier):
    """The logged Improvement against numpy cosines of: the clean clipped sum (from the clip estimator), the noisy
    gradient (the same Gaussian draw, reproduced from the seed), and D = the full-SVD denoiser on it."""
    model = tiny_bert()
    batch = random_batch(batch_size=8)
    logs = {}
    pm = create_plugin_manager({"denoise": {"nonprivate_diagnostics": True}})
    private_step(pm.hook, _step_ctx(model, logs, noise_multiplier), batch, physical_batch_size=8)

    # independently: clean clipped sum, the same noise, the reference (full SVD) denoiser
    ref_pm = create_plugin_manager(None)
    ctx = _step_ctx(model, {}, noise_multiplier)
    total = ref_pm.hook.estimate_gradient(ctx=ctx, batch=batch)
    clean = {k: v.clone() for k, v in total.values.items()}
    private = GaussianPlugin().privatize(ctx=ctx, gradient_sum=total)
    noisy = {k: v.clone() for k, v in private.values.items()}
    matrices = {k: v for k, v in noisy.items() if v.dim() == 2}
    denoised, stats = denoise_matrices(matrices, private.std_of("x"), ShrinkageOptions(method="full"))
    assert 0 < stats.num_denoised  # the test means something
    full = {**noisy, **denoised}

    def flat(d):
        return np.concatenate([d[k].double().flatten().numpy() for k in clean])

    g, y, d = flat(clean), flat(noisy), flat(full)
    expected = _cos(d, g) - _cos(y, g)
    assert logs[NONPRIVATE_PREFIX + "denoise_improvement"] == pytest.approx(expected, abs=1e-5)
    assert logs[NONPRIVATE_PREFIX + "denoise_cosine_noisy"] == pytest.approx(_cos(y, g), abs=1e-6)
    assert logs[NONPRIVATE_PREFIX + "denoise_cosine_denoised"] == pytest.approx(_cos(d, g), abs=1e-5)
    per_layer = {k[len(NONPRIVATE_PREFIX + "denoise_improvement/"):]: v for k, v in logs.items()
                 if k.startswith(NONPRIVATE_PREFIX + "denoise_improvement/")}
    assert set(per_layer) == set(matrices)  # one per denoise-eligible matrix, none for biases / LayerNorm
    for key, value in per_layer.items():
        a, b, c = clean[key].double().flatten().numpy(), noisy[key].double().flatten().numpy(), \
            full[key].double().flatten().numpy()
        assert value == pytest.approx(_cos(c, a) - _cos(b, a), abs=1e-5), key
    if noise_multiplier < 0.1:
        assert logs[NONPRIVATE_PREFIX + "denoise_improvement"] > 0  # weak noise: denoising helps


def test_diagnostics_keep_nothing_and_change_nothing():
    """Same direction bit for bit with the diagnostics on and off; nothing is kept in the plugin or ctx.scratch;
    the clipped sum is still wiped after privatize."""
    batch = random_batch(batch_size=8)
    directions, plugins, ctxs = [], [], []
    for on in (False, True):
        model = tiny_bert()
        logs = {}
        pm = create_plugin_manager({"denoise": {"nonprivate_diagnostics": on}})
        ctx = _step_ctx(model, logs, 0.05)
        directions.append(private_step(pm.hook, ctx, batch, physical_batch_size=8))
        plugins.append(pm.get_plugin("denoise"))
        ctxs.append(ctx)
        assert any(k.startswith(NONPRIVATE_PREFIX) for k in logs) == on
    assert directions[0].keys() == directions[1].keys()
    for key in directions[0]:
        assert torch.equal(directions[0][key], directions[1][key]), key
    assert ctxs[1].scratch == {}
    assert not [v for v in vars(plugins[1]).values() if torch.is_tensor(v) or isinstance(v, dict)]
    assert vars(plugins[0]).keys() == vars(plugins[1]).keys()


def test_wrapper_copies_the_clean_sum_before_privatize_may_overwrite_it():
    """The default privatize writes the release into the clipped sum: the diagnostics copy the clean sum first, and
    without diagnostics the wrapper does not read the sum at all."""
    seen = {}

    class Spy(DenoisePlugin):
        def _log_nonprivate(self, ctx, clean, private):
            seen["clean"] = {k: v.clone() for k, v in clean.items()}
            super()._log_nonprivate(ctx, clean, private)

    plugin = Spy(nonprivate_diagnostics=True)
    values = {"w": torch.randn(20, 10), "b": torch.randn(10)}
    total = GradientSum({k: v.clone() for k, v in values.items()}, 3)
    private = PrivateGradient({k: v + 0.1 * torch.randn_like(v) for k, v in values.items()}, noise_std=0.1,
                              mechanism="test", expected_batch_size=3, step=0)
    logs = {}
    ctx = StepContext(model=None, trainable={}, per_example_loss=None, max_grad_norm=1.0, noise_multiplier=1.0,
                      expected_batch_size=3, step=0, noise_source=torch.Generator(), log=logs.__setitem__)
    gen = plugin.privatize(ctx=ctx, gradient_sum=total)  # the wrapper, driven by hand as pluggy does
    next(gen)
    for key, value in total.values.items():  # the inner privatize writes its release into the sum
        value.copy_(private.values[key])
    with pytest.raises(StopIteration) as stop:
        gen.send(private)
    assert stop.value.value is private  # passed through unchanged
    assert all(torch.equal(seen["clean"][k], values[k]) for k in values)  # the clean sum, not the release
    assert NONPRIVATE_PREFIX + "denoise_improvement" in logs
    assert not any(isinstance(v, (torch.Tensor, dict)) for v in vars(plugin).values())  # nothing kept

    quiet = DenoisePlugin()  # diagnostics off: the sum is never read (a wiped one does not raise)
    total.wipe()
    gen = quiet.privatize(ctx=ctx, gradient_sum=total)
    next(gen)
    with pytest.raises(StopIteration) as stop:
        gen.send(private)
    assert stop.value.value is private


class _OtherNoise:
    """A third-party mechanism that replaces privatize (as FTRL does)."""

    @hookimpl
    def privatize(self, ctx, gradient_sum):
        return GaussianPlugin().privatize(ctx=ctx, gradient_sum=gradient_sum)


def test_wrapper_is_not_a_conflicting_privatize(monkeypatch):
    from helpers import fake_entry_points

    fake_entry_points(monkeypatch, {"other_noise": _OtherNoise})
    pm = create_plugin_manager({"denoise": {"nonprivate_diagnostics": True}})
    assert "privatize" not in replaced_hooks(pm)  # the default Gaussian mechanism still answers
    pm = create_plugin_manager({"other_noise": {}, "denoise": {"nonprivate_diagnostics": True}})
    assert replaced_hooks(pm) == frozenset({"privatize"})
    model = tiny_bert()
    logs = {}
    private_step(pm.hook, _step_ctx(model, logs, 0.05), random_batch(batch_size=8), physical_batch_size=8)
    assert NONPRIVATE_PREFIX + "denoise_improvement" in logs


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    return tiny_classification_workspace(tmp_path_factory.mktemp("denoise_e2e"), rows=96, val_rows=32)


def _train(tiny_run, diagnostics):
    import lightning as L

    from dpl.tasks.data import ClassificationDataModule
    from dpl.tasks.modules import DPClassificationModule
    from dpl.core.privacy import PrivacyConfig

    tmp, model = tiny_run
    torch.manual_seed(0)
    data = ClassificationDataModule(tokenizer=model, data_dir=str(tmp / "data"), max_length=16)
    module = DPClassificationModule(model=model, privacy=PrivacyConfig(noise_multiplier=0.05, batch_size=16,
                                                                       physical_batch_size=16, seed=11),
                                    plugins={"denoise": {"nonprivate_diagnostics": diagnostics}})
    trainer = L.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        enable_checkpointing=False, default_root_dir=str(tmp / "runs"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, datamodule=data)
    warned = any("non-private diagnostics enabled" in str(w.message) for w in caught)
    return module, trainer, warned


def test_training_is_bit_identical_with_diagnostics_on_and_off(tiny_run):
    off, trainer_off, warned_off = _train(tiny_run, False)
    on, trainer_on, warned_on = _train(tiny_run, True)
    assert (warned_off, warned_on) == (False, True)
    assert off.engine.steps_done == on.engine.steps_done == 4
    params_off, params_on = dict(off.model.named_parameters()), dict(on.model.named_parameters())
    assert params_off.keys() == params_on.keys()
    for name, value in params_off.items():
        assert torch.equal(value, params_on[name]), name
    logged_on = [k for k in trainer_on.callback_metrics if k.startswith(NONPRIVATE_PREFIX)]
    assert NONPRIVATE_PREFIX + "denoise_improvement" in logged_on
    assert not [k for k in trainer_off.callback_metrics if "nonprivate" in k]
    assert float(trainer_off.callback_metrics["denoise/fraction_denoised"]) > 0  # denoising changes the update
