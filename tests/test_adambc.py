"""The adambc plugin: Adam without noise equals torch's Adam, the noise variance is removed from the second
moment (statistically), the per-step std is read from the release, other optimizers are refused, `dpl fit` runs
it, and a resumed run equals an uninterrupted one bit for bit."""

import functools
import math
from pathlib import Path

import pytest
import torch
from helpers import random_batch, tiny_bert, tiny_classification_workspace

from dpl.cli import main
from dpl.errors import ConfigError
from dpl.core.gradients import PrivateGradient
from dpl.api import hookimpl
from dpl.core.mechanism import PoissonGaussian
from dpl.core.plugin_manager import create_plugin_manager
from dpl.core.step import ReleaseContext, RunSetup, StepContext, private_step
from dpl_plugins.adambc import AdamBCPlugin

ROOT = Path(__file__).resolve().parents[1]


def _release_ctx(params, optimizer=None, logs=None, noise_multiplier=1.0, batch=1):
    logs = {} if logs is None else logs
    return ReleaseContext(trainable=params, max_grad_norm=1.0, noise_multiplier=noise_multiplier,
                          expected_batch_size=batch, step=0, public_seed=0, optimizer=optimizer,
                          log=logs.__setitem__)


def _setup(model, names=("adambc",), optimizer=torch.optim.SGD):
    return RunSetup(model=model, trainable=dict(model.named_parameters()), plugin_names=list(names),
                    population=100, expected_batch_size=4, steps=10, sampling_rate=0.04, accountant="prv",
                    optimizer_name=getattr(optimizer, "__name__", type(optimizer).__name__),
                    optimizer_factory=optimizer)


# ------------------------------------------------------------------------------------------ the update rule


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_without_noise_the_update_equals_torch_adam(weight_decay):
    """sigma = 0: adambc + SGD(lr) follows torch.optim.Adam(eps=0) (AdamW for decoupled weight decay)."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"w": (7, 5), "b": (5,)}
    init = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    ours = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
    lr = 0.01
    sgd = torch.optim.SGD(list(ours.values()), lr=lr)
    cls = torch.optim.AdamW if weight_decay else torch.optim.Adam
    adam = cls(list(ref.values()), lr=lr, betas=(0.9, 0.99), eps=0.0, weight_decay=weight_decay)
    plugin = AdamBCPlugin(beta1=0.9, beta2=0.99, weight_decay=weight_decay)
    for step in range(25):
        grads = {k: torch.randn(s, generator=gen) * (1 + step % 3) for k, s in shapes.items()}
        gradient = PrivateGradient({k: g.clone() for k, g in grads.items()}, noise_std=0.0, mechanism="gaussian",
                                   expected_batch_size=1, step=step)
        direction = plugin.precondition(ctx=_release_ctx(ours, sgd), gradient=gradient)
        sgd.zero_grad()
        for k, p in ours.items():
            p.grad = direction[k]
        sgd.step()
        adam.zero_grad()
        for k, p in ref.items():
            p.grad = grads[k]
        adam.step()
    for k in shapes:
        torch.testing.assert_close(ours[k].data, ref[k].data, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(ours["w"].data, init["w"], atol=1e-3)  # it moved


def _noisy_run(plugin, clean, stds, seed=0):
    """Feed ``plugin`` the fixed gradient ``clean`` plus N(0, stds[t]^2) noise at each step t."""
    gen = torch.Generator().manual_seed(seed)
    params = {"w": torch.nn.Parameter(torch.zeros_like(clean))}
    for t, std in enumerate(stds):
        noisy = clean + std * torch.randn(clean.shape, generator=gen)
        gradient = PrivateGradient({"w": noisy}, noise_std=std, mechanism="gaussian", expected_batch_size=1, step=t)
        plugin.precondition(ctx=_release_ctx(params), gradient=gradient)
    return plugin


def _group_means(estimate, values, per_value):
    return [float(estimate[i * per_value:(i + 1) * per_value].mean()) for i in range(len(values))]


def test_with_noise_the_corrected_second_moment_estimates_the_clean_one():
    """E[v^ - Phi] = g^2 for a fixed gradient g plus noise; plain DP-Adam's v^ is g^2 + Phi instead."""
    values, per_value, std = [0.0, 0.5, 1.0, 2.0], 20000, 3.0
    clean = torch.tensor(values).repeat_interleave(per_value)
    steps = [std] * 30
    bc = _noisy_run(AdamBCPlugin(beta2=0.9), clean, steps)
    plain = _noisy_run(AdamBCPlugin(beta2=0.9, bias_correction=False), clean, steps)
    # per coordinate, v^ = sum_s w_s (g + s z_s)^2 with the bias-corrected EMA weights w_s; Var (g + s z)^2 =
    # 2 s^4 + 4 g^2 s^2, so a group mean has variance sum_s w_s^2 (2 s^4 + 4 g^2 s^2) / per_value
    t = len(steps)
    weights = [(1 - 0.9) * 0.9 ** (t - 1 - s) / (1 - 0.9 ** t) for s in range(t)]
    assert sum(weights) == pytest.approx(1.0)
    for g, mean_bc, mean_plain in zip(values, _group_means(bc.corrected_second_moment("w"), values, per_value),
                                      _group_means(plain.corrected_second_moment("w"), values, per_value)):
        tol = 5 * math.sqrt(sum(w * w for w in weights) * (2 * std ** 4 + 4 * g * g * std * std) / per_value)
        assert mean_bc == pytest.approx(g * g, abs=tol)  # 5 standard errors
        assert mean_plain == pytest.approx(g * g + std * std, abs=tol)
        assert std * std > 20 * tol  # the test can tell the two apart


def test_phi_is_read_from_the_release_at_every_step_not_recomputed_from_sigma():
    """A mechanism whose std changes every step (as FTRL's does), while ctx says sigma = 1, B = 1: the plugin
    subtracts the moving average of the stds it was given, and E[v^ - Phi^] = g^2 still holds."""
    values, per_value = [0.0, 1.0], 20000
    clean = torch.tensor(values).repeat_interleave(per_value)
    stds = [0.5 + 2.5 * (t % 4) / 3 for t in range(24)]  # 0.5, 1.33, 2.17, 3.0, 0.5, ...
    plugin = _noisy_run(AdamBCPlugin(beta2=0.8), clean, stds)
    b2 = 0.8
    expected_phi = sum((1 - b2) * b2 ** (len(stds) - 1 - s) * std ** 2 for s, std in enumerate(stds))
    assert plugin.noise_var_avg["w"] == pytest.approx(expected_phi, rel=1e-12)
    estimate = plugin.corrected_second_moment("w")
    for g, mean in zip(values, _group_means(estimate, values, per_value)):
        assert mean == pytest.approx(g * g, abs=0.15)
    # the last step's std alone (or sigma C / B = 1 from ctx) would be wrong by far more than the tolerance
    wrong = (plugin.exp_avg_sq["w"] - (1 - b2 ** 24) * stds[-1] ** 2) / (1 - b2 ** 24)
    assert abs(float(wrong[:per_value].mean())) > 1.0


class _VaryingNoise:
    """A third-party mechanism whose noise std is 0.1 * (1 + step): it replaces privatize and accounting."""

    @hookimpl
    def configure_mechanism(self, setup):
        mech = PoissonGaussian(setup.sampling_rate)
        mech.name = "varying"
        return mech

    @hookimpl
    def privatize(self, ctx, gradient_sum):
        std = 0.1 * (1 + ctx.step)
        values = {k: (v + std * ctx.expected_batch_size * torch.randn(v.shape, generator=ctx.noise_source))
                  / ctx.expected_batch_size for k, v in gradient_sum.values.items()}
        return PrivateGradient(values, noise_std=std, mechanism="varying",
                               expected_batch_size=ctx.expected_batch_size, step=ctx.step)


def test_in_the_private_step_with_a_mechanism_whose_std_varies(monkeypatch):
    from helpers import fake_entry_points

    fake_entry_points(monkeypatch, {"varying": _VaryingNoise})
    pm = create_plugin_manager({"varying": {}, "adambc": {"beta2": 0.5}})
    model = tiny_bert()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.SGD(list(trainable.values()), lr=0.01)
    gen = torch.Generator().manual_seed(0)
    logs = {}
    for step in range(3):
        ctx = StepContext(model=model, trainable=trainable,
                          per_example_loss=lambda b: torch.nn.functional.cross_entropy(
                              model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits,
                              b["labels"], reduction="none"),
                          max_grad_norm=1.0, noise_multiplier=7.0, expected_batch_size=4, step=step,
                          noise_source=gen, log=logs.__setitem__, optimizer=opt)
        direction = private_step(pm.hook, ctx, random_batch(batch_size=4), physical_batch_size=4,
                                 mechanism="varying")
        assert set(direction) == set(trainable)
    plugin = pm.get_plugin("adambc")
    expected = sum(0.5 * 0.5 ** (2 - s) * (0.1 * (1 + s)) ** 2 for s in range(3))  # not (7 * 1 / 4)^2
    assert all(v == pytest.approx(expected, rel=1e-12) for v in plugin.noise_var_avg.values())
    assert 0.0 <= logs["adambc/fraction_floored"] <= 1.0


def test_per_key_std_dict():
    plugin = AdamBCPlugin(beta2=0.5)
    params = {"a": torch.nn.Parameter(torch.zeros(3)), "b": torch.nn.Parameter(torch.zeros(3))}
    gradient = PrivateGradient({"a": torch.ones(3), "b": torch.ones(3)}, noise_std={"a": 0.1, "b": 0.2},
                               mechanism="gaussian", expected_batch_size=1, step=0)
    plugin.precondition(ctx=_release_ctx(params), gradient=gradient)
    assert plugin.noise_var_avg == pytest.approx({"a": 0.5 * 0.01, "b": 0.5 * 0.04})


# ----------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("optimizer,match", [
    (torch.optim.Adam, "not Adam"),
    (torch.optim.AdamW, "not AdamW"),
    (functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9), "momentum=0.9"),
    (functools.partial(torch.optim.SGD, lr=0.1, weight_decay=0.01), "adambc's weight_decay instead"),
    (functools.partial(torch.optim.SGD, lr=0.1, nesterov=True, momentum=0.9), "nesterov=True"),
])
def test_other_optimizers_are_refused_with_one_line(optimizer, match):
    with pytest.raises(ConfigError, match=match) as err:
        AdamBCPlugin().validate_setup(setup=_setup(tiny_bert(), optimizer=optimizer))
    assert "\n" not in str(err.value)


def test_plain_sgd_is_accepted():
    AdamBCPlugin().validate_setup(setup=_setup(tiny_bert(), optimizer=torch.optim.SGD))
    AdamBCPlugin().validate_setup(setup=_setup(tiny_bert(), optimizer=functools.partial(torch.optim.SGD, lr=0.3)))


def test_refused_at_step_time_too():
    """Used as a library without validate_setup: the optimizer in the context is checked."""
    params = {"w": torch.nn.Parameter(torch.zeros(2))}
    gradient = PrivateGradient({"w": torch.ones(2)}, noise_std=0.0, mechanism="gaussian", expected_batch_size=1,
                               step=0)
    with pytest.raises(ConfigError, match="not Adam"):
        AdamBCPlugin().precondition(ctx=_release_ctx(params, torch.optim.Adam(list(params.values()))),
                                    gradient=gradient)


def test_bad_options():
    for kwargs in ({"beta1": 1.0}, {"beta2": -0.1}, {"gamma": 0.0}, {"weight_decay": -1.0}):
        with pytest.raises(ConfigError):
            AdamBCPlugin(**kwargs)


def test_state_dict_round_trip_and_beta_mismatch():
    plugin = _noisy_run(AdamBCPlugin(beta2=0.9), torch.ones(4), [1.0] * 3)
    state = plugin.state_dict()
    other = AdamBCPlugin(beta2=0.9)
    other.load_state_dict(state)
    assert other.steps == 3 and torch.equal(other.exp_avg_sq["w"], plugin.exp_avg_sq["w"])
    with pytest.raises(ConfigError, match="same betas"):
        AdamBCPlugin(beta2=0.99).load_state_dict(state)


# --------------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_classification_workspace(tmp_path_factory.mktemp("adambc"), rows=96, val_rows=32)


def _fit(tiny, root, *extra):
    tmp, model = tiny
    main(["fit", "--model", "dpl.tasks.modules.DPClassificationModule", "--model.model", model,
          "--config", str(ROOT / "plugins" / "adambc" / "adambc.yaml"),
          "--model.privacy.noise_multiplier", "0.8", "--model.privacy.batch_size", "16",
          "--model.privacy.physical_batch_size", "16", "--model.privacy.seed", "5",
          "--data", "dpl.tasks.data.ClassificationDataModule", "--data.tokenizer", model,
          "--data.data_dir", str(tmp / "data"), "--data.max_length", "16",
          "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(root), "--trainer.logger", "false",
          "--trainer.enable_progress_bar", "false", "--trainer.num_sanity_val_steps", "0",
          "--trainer.limit_val_batches", "0", "--seed_everything", "0", *extra])
    return sorted(Path(root).rglob("*.ckpt"))


def _final(paths):
    """The checkpoint written at the end of a run (``last.ckpt`` where the CLI saves one)."""
    last = [p for p in paths if p.name == "last.ckpt"]
    assert len(last) == 1 or len(paths) == 1, paths
    return last[0] if last else paths[0]


def test_fit_with_the_config_through_the_cli(tiny, capsys):
    tmp, _ = tiny
    ckpts = _fit(tiny, tmp / "fit", "--trainer.max_epochs", "1")  # 96 / 16 = 6 steps
    assert "dpl: trained 6 private steps" in capsys.readouterr().out
    state = torch.load(_final(ckpts), map_location="cpu", weights_only=False)
    adambc = state["dpl"]["states"]["adambc"]
    assert adambc["steps"] == 6 and adambc["exp_avg_sq"]  # the moments are in the (public) checkpoint
    assert adambc["noise_var_avg"]
    assert "dpl_secret" not in state


def test_adam_stacked_on_adambc_is_refused_by_the_cli(tiny, capsys):
    tmp, _ = tiny
    with pytest.raises(SystemExit) as exit_info:
        _fit(tiny, tmp / "refused", "--trainer.max_epochs", "1", "--model.optimizer", "torch.optim.AdamW")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dpl: error: adambc returns Adam's full update direction")


def test_resume_equals_an_uninterrupted_run_bit_for_bit(tiny):
    tmp, _ = tiny
    # epochs, not max_steps: see the report (dpl's manual steps do not advance trainer.global_step yet)
    full = _fit(tiny, tmp / "full", "--trainer.max_epochs", "2")  # 2 x 96 / 16 = 12 steps
    first = _fit(tiny, tmp / "first", "--trainer.max_epochs", "1")
    resumed = _fit(tiny, tmp / "resumed", "--trainer.max_epochs", "2", "--ckpt_path", str(_final(first)))
    a = torch.load(_final(full), map_location="cpu", weights_only=False)
    b = torch.load(_final(resumed), map_location="cpu", weights_only=False)
    assert a["dpl"]["steps_done"] == b["dpl"]["steps_done"] == 12
    for name, value in a["state_dict"].items():
        assert torch.equal(value, b["state_dict"][name]), name
    sa, sb = a["dpl"]["states"]["adambc"], b["dpl"]["states"]["adambc"]
    assert sa["steps"] == sb["steps"] == 12 and sa["noise_var_avg"] == sb["noise_var_avg"]
    for key in sa["exp_avg"]:
        assert torch.equal(sa["exp_avg"][key], sb["exp_avg"][key]), key
        assert torch.equal(sa["exp_avg_sq"][key], sb["exp_avg_sq"][key]), key
    # and the interrupted run really stopped half-way (the comparison means something)
    c = torch.load(_final(first), map_location="cpu", weights_only=False)
    assert c["dpl"]["states"]["adambc"]["steps"] == 6


def test_default_floor_is_the_noise_variance():
    """gamma' = max(gamma, gamma_relative * Phi^), gamma_relative 1 by default: where v^ - Phi^ is below Phi^ the step
    is m^ / sqrt(Phi^) (the methods study: a floor of 1e-8 fits the rarest classes 20 points worse)."""
    clean = torch.zeros(400)
    std = 0.1
    params = {"w": torch.nn.Parameter(torch.zeros(400))}
    plugins = {rel: AdamBCPlugin(beta2=0.9, gamma_relative=rel) for rel in (1.0, 0.0)}
    gen = torch.Generator().manual_seed(0)
    for t in range(5):
        noisy = clean + std * torch.randn(clean.shape, generator=gen)
        outs = {rel: p.precondition(ctx=_release_ctx(params), gradient=PrivateGradient(
            {"w": noisy.clone()}, noise_std=std, mechanism="gaussian", expected_batch_size=1, step=t))["w"]
            for rel, p in plugins.items()}
    plugin = plugins[1.0]
    phi = std ** 2  # constant std: Phi^ equals it exactly
    m_hat = plugin.exp_avg["w"] / (1 - 0.9 ** 5)
    expected = m_hat / plugin.corrected_second_moment("w").clamp(min=phi).sqrt()
    torch.testing.assert_close(outs[1.0], expected)
    assert float((plugin.corrected_second_moment("w") < phi).float().mean()) > 0.3  # the floor is in play
    fixed = m_hat / plugin.corrected_second_moment("w").clamp(min=1e-8).sqrt()
    torch.testing.assert_close(outs[0.0], fixed)  # gamma_relative 0: the fixed floor gamma alone
    assert float(outs[0.0].abs().max()) > 10 * float(outs[1.0].abs().max())
    with pytest.raises(ConfigError):
        AdamBCPlugin(gamma_relative=-1.0)
