"""Trust in the guarantee: secrets stay out of checkpoints, non-finite examples, entropy, safe and exact resume, the
budget guard, layers that mix examples, planned steps, soft guards, precision, delta."""

from __future__ import annotations

import logging
import math
import os
import stat
import warnings
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import SaveAndStopAt, VectorDataModule, VectorModule  # the SIGKILL test uses test_trust.Vector* paths
from torch import nn

from dpl.lightning.checkpoint import SECRET_KEY, secret_path
from dpl.errors import ConfigError, PluginError, PrivacyWarning
from dpl.core.gradients import GradientSum, PrivateGradient
from dpl.api import hookimpl
from dpl.lightning.module import DPModule
from dpl.core.noise import KeyedNormal, SecureNormal, normal, replay_source
from dpl.core.per_example import PerExampleClipper
from dpl.core.plugin_manager import create_plugin_manager
from dpl.core.privacy import PrivacyConfig
from dpl.core.sampling import derive_key, secure_generator
from dpl.core.step import StepContext, private_step

# ---------------------------------------------------------------------------------------------------------
# a tiny float-feature task (fast, and lets a test put NaN / BatchNorm in the model)


def _trainer(tmp_path, max_steps, callbacks=(), **kwargs):
    return L.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                     default_root_dir=str(tmp_path), callbacks=list(callbacks), **kwargs)


def _vector_module(**privacy):
    defaults = dict(noise_multiplier=1.0, batch_size=8, physical_batch_size=8, seed=3)
    defaults.update(privacy)
    return VectorModule(privacy=PrivacyConfig(**defaults), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))


def _params(module):
    return {n: p.detach().clone() for n, p in module.model.named_parameters()}


# ---------------------------------------------------------------------------------------------------------
# 1. checkpoints carry no secret


def _all_leaves(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _all_leaves(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _all_leaves(v)
    else:
        yield obj


def test_checkpoint_alone_does_not_reveal_noise_or_batches(tmp_path):
    module, data = _vector_module(seed=None), VectorDataModule()
    path = tmp_path / "run.ckpt"
    _trainer(tmp_path, 4).fit(module, datamodule=data)
    _trainer_for_save = module.trainer
    _trainer_for_save.save_checkpoint(path)
    secret = module.engine.secret_state_dict()
    noise_state, sampler_state = secret["noise_rng"], secret["sampler_rng"]
    next_noise = normal((50,), replay_source(module.engine.noise_source, noise_state))
    next_batch = torch.rand(64, generator=torch.Generator().set_state(sampler_state))

    checkpoint = torch.load(path, weights_only=False)
    assert SECRET_KEY not in checkpoint
    leaves = list(_all_leaves(checkpoint))
    for leaf in leaves:  # no generator state (or anything equal to one) in the checkpoint
        if torch.is_tensor(leaf) and leaf.dtype == torch.uint8:
            assert not torch.equal(leaf, noise_state) and not torch.equal(leaf, sampler_state)
    assert noise_state[:32].numpy().tobytes() not in path.read_bytes()  # the noise key, anywhere in the file
    # An attacker tries every tensor that looks like a generator state and every integer as a seed.
    noise_candidates, batch_candidates = [], []
    for leaf in leaves:
        if torch.is_tensor(leaf) and leaf.dtype == torch.uint8 and leaf.numel() == noise_state.numel():
            noise_candidates.append(replay_source(module.engine.noise_source, leaf))
        if torch.is_tensor(leaf) and leaf.dtype == torch.uint8 and leaf.numel() == sampler_state.numel():
            batch_candidates.append(torch.Generator().set_state(leaf))
        if isinstance(leaf, int) and not isinstance(leaf, bool) and leaf >= 0:
            noise_candidates.append(KeyedNormal(derive_key(leaf, "noise")))
            batch_candidates.append(torch.Generator().manual_seed(leaf))
    for source in noise_candidates:
        assert not torch.equal(normal((50,), source), next_noise)
    for g in batch_candidates:
        assert not torch.equal(torch.rand(64, generator=g), next_batch)

    # The secret sidecar is owner-only and does hold what resuming needs.
    sidecar = secret_path(path)
    assert stat.S_IMODE(os.stat(sidecar).st_mode) == 0o600
    secret = torch.load(sidecar, weights_only=True)["entries"][-1]  # the newest entry: this checkpoint's
    torch.testing.assert_close(secret["noise_rng"], noise_state)


def test_weights_only_checkpoint_has_no_sidecar_and_no_secret(tmp_path):
    module, data = _vector_module(), VectorDataModule()
    trainer = _trainer(tmp_path, 2)
    trainer.fit(module, datamodule=data)
    path = tmp_path / "weights.ckpt"
    trainer.save_checkpoint(path, weights_only=True)
    assert not secret_path(path).exists()
    assert SECRET_KEY not in torch.load(path, weights_only=False)


def test_checkpoint_io_without_sidecar_support_gets_no_secret(tmp_path):
    """A trainer whose checkpoint IO is not dpl's (someone replaced it) must not receive the secrets."""
    from lightning.fabric.plugins import TorchCheckpointIO

    module, data = _vector_module(), VectorDataModule()
    trainer = _trainer(tmp_path, 1)
    trainer.fit(module, datamodule=data)
    trainer.strategy.checkpoint_io = TorchCheckpointIO()
    checkpoint = {"optimizer_states": []}
    module.on_save_checkpoint(checkpoint)
    assert SECRET_KEY not in checkpoint


def test_corrupt_truncated_and_mismatched_checkpoints_fail_with_one_line(tmp_path):
    module, data = _vector_module(), VectorDataModule()
    trainer = _trainer(tmp_path, 2)
    trainer.fit(module, datamodule=data)
    good = tmp_path / "good.ckpt"
    trainer.save_checkpoint(good)
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint at all")
    other = tmp_path / "other.ckpt"
    trainer.save_checkpoint(other)
    mismatched = tmp_path / "mismatched.ckpt"
    mismatched.write_bytes(good.read_bytes())
    secret_path(mismatched).write_bytes(secret_path(other).read_bytes())
    os.chmod(secret_path(mismatched), 0o600)
    for path, message in [(truncated, "corrupt or truncated"), (garbage, "corrupt or truncated"),
                          (tmp_path / "missing.ckpt", "does not exist"), (mismatched, "does not belong")]:
        resumed = _vector_module()
        with pytest.raises(ConfigError, match=message) as info:
            _trainer(tmp_path, 4).fit(resumed, datamodule=VectorDataModule(), ckpt_path=str(path))
        assert "\n" not in str(info.value)


def test_sidecar_readable_by_others_is_refused(tmp_path):
    module, data = _vector_module(), VectorDataModule()
    trainer = _trainer(tmp_path, 2)
    trainer.fit(module, datamodule=data)
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    os.chmod(secret_path(path), 0o644)
    with pytest.raises(ConfigError, match="readable by others"):
        _trainer(tmp_path, 4).fit(_vector_module(), datamodule=VectorDataModule(), ckpt_path=str(path))


def test_kill_between_the_sidecar_and_checkpoint_writes_still_resumes(tmp_path, monkeypatch):
    """The sidecar lands first; a run killed before the new .ckpt lands resumes from the previous .ckpt."""
    import dpl.lightning.checkpoint as ck

    trainer = _trainer(tmp_path, 2)
    trainer.fit(_vector_module(), datamodule=VectorDataModule())
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    first_id = torch.load(path, weights_only=False)["dpl"]["secret_id"]
    write = ck._write_atomic

    def killed_before_the_checkpoint(data, target, mode):
        if Path(target) == path:
            raise RuntimeError("killed")
        write(data, target, mode)

    monkeypatch.setattr(ck, "_write_atomic", killed_before_the_checkpoint)
    with pytest.raises(RuntimeError, match="killed"):
        trainer.save_checkpoint(path)
    monkeypatch.setattr(ck, "_write_atomic", write)
    checkpoint = ck.load_checkpoint_file(path)
    assert checkpoint["dpl"]["secret_id"] == first_id  # the previous checkpoint, beside the newer sidecar
    ck.attach_secret(checkpoint, path)
    assert checkpoint[ck.SECRET_KEY]["secret_id"] == first_id
    _trainer(tmp_path, 4).fit(_vector_module(), datamodule=VectorDataModule(), ckpt_path=str(path))


def test_sidecar_of_the_single_entry_format_still_loads(tmp_path):
    import dpl.lightning.checkpoint as ck

    path = tmp_path / "old.ckpt"
    ck._write_atomic(ck._serialize({"secret_id": "abc", "noise": torch.ones(2)}), ck.secret_path(path), 0o600)
    checkpoint = {"dpl": {"secret_id": "abc"}, "state_dict": {}}
    ck.attach_secret(checkpoint, path)
    assert checkpoint[ck.SECRET_KEY]["secret_id"] == "abc"
    with pytest.raises(ConfigError, match="does not belong"):
        ck.attach_secret({"dpl": {"secret_id": "other"}, "state_dict": {}}, path)


def test_resume_without_sidecar_uses_fresh_entropy(tmp_path):
    module, data = _vector_module(seed=None), VectorDataModule()
    trainer = _trainer(tmp_path, 2)
    trainer.fit(module, datamodule=data)
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    next_noise = normal((20,), module.engine.noise_source)
    secret_path(path).unlink()
    resumed = _vector_module(seed=None)
    _trainer(tmp_path, 4).fit(resumed, datamodule=VectorDataModule(), ckpt_path=str(path))
    assert resumed.engine.steps_done == 4
    assert not torch.equal(normal((20,), resumed.engine.noise_source), next_noise)


def test_a_linked_last_checkpoint_resumes_with_the_sidecar_of_the_file_it_links_to(tmp_path, caplog):
    """``save_last: link`` (what dpl fit sets without a monitor): last.ckpt is a link to the newest checkpoint, with
    no sidecar of its own; loading it reads the newest checkpoint's sidecar, and the run resumes with its secrets."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from dpl.lightning.checkpoint import SidecarCheckpointIO

    module = _vector_module(seed=None)
    saving = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_last="link")
    _trainer(tmp_path, 4, callbacks=[saving]).fit(module, datamodule=VectorDataModule())
    last = tmp_path / "ckpt" / "last.ckpt"
    assert last.is_symlink() and not secret_path(last).exists()
    assert sorted(p.name for p in last.parent.iterdir()) == ["epoch=0-step=4.ckpt", "epoch=0-step=4.ckpt.secret",
                                                             "last.ckpt"]
    loaded = SidecarCheckpointIO().load_checkpoint(last)
    assert loaded[SECRET_KEY]["secret_id"] == loaded["dpl"]["secret_id"]  # the newest checkpoint's own secrets
    resumed = _vector_module(seed=None)
    with caplog.at_level(logging.INFO, logger="dpl"):
        _trainer(tmp_path / "r", 6).fit(resumed, datamodule=VectorDataModule(), ckpt_path=str(last))
    assert resumed.engine.steps_done == 6
    assert not [r for r in caplog.records if "without the checkpoint's .secret sidecar" in r.getMessage()]
    last.resolve().unlink()  # killed between removing the older checkpoint and linking to the newer: one line
    with pytest.raises(ConfigError, match=r"last.ckpt links to epoch=0-step=4.ckpt, which does not exist: resume"):
        _trainer(tmp_path / "r", 6).fit(_vector_module(seed=None), datamodule=VectorDataModule(), ckpt_path=str(last))


# ---------------------------------------------------------------------------------------------------------
# 2. a non-finite example contributes exactly zero


@pytest.mark.parametrize("bad_value", [float("nan"), 1e30, float("inf")])
def test_non_finite_example_contributes_zero(bad_value):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(5, 6)
    y = torch.tensor([0, 1, 0, 1, 1])
    clipper = PerExampleClipper(model)

    def clipped(inputs, labels):
        with clipper.record(inputs.shape[0]):
            losses = F.cross_entropy(model(inputs), labels, reduction="none")
        return clipper.clipped_sum(losses, 1.0)[0]

    bad = x.clone()
    bad[2, 3] = bad_value
    with_bad = clipped(bad, y)
    keep = torch.tensor([0, 1, 3, 4])
    without = clipped(x[keep], y[keep])
    for name in without:
        assert torch.isfinite(with_bad[name]).all(), name
        torch.testing.assert_close(with_bad[name], without[name], atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# 3. entropy


def test_secure_generator_fills_the_whole_state_from_os_entropy():
    gen = secure_generator()
    words = gen.get_state()[24:24 + 624 * 8].view(torch.int64)
    # manual_seed(s) makes words[1:] a function of words[0] = s (32 bits): not so here.
    reseeded = torch.Generator().manual_seed(int(words[0]))
    assert not torch.equal(reseeded.get_state()[24:24 + 624 * 8].view(torch.int64)[1:], words[1:])
    other = secure_generator().get_state()[24:24 + 624 * 8].view(torch.int64)
    assert (words != other).float().mean() > 0.99  # 624 independent 32-bit words
    assert int(words.max()) < 2 ** 32 and int(words.min()) >= 0
    a, b = secure_generator(), secure_generator()
    assert not torch.equal(torch.randn(16, generator=a), torch.randn(16, generator=b))


def test_secure_noise_is_standard_normal_and_not_a_torch_generator():
    source = SecureNormal()
    draws = normal((400_000,), source)
    assert draws.dtype == torch.float32
    assert abs(draws.mean().item()) < 5 / math.sqrt(4e5)
    assert draws.std().item() == pytest.approx(1.0, rel=0.01)
    # tails as a Gaussian's: P(|z| > 3) = 0.0027
    assert (draws.abs() > 3).float().mean().item() == pytest.approx(0.0027, rel=0.15)
    with pytest.raises(TypeError):
        torch.randn(3, generator=source)


def test_secure_noise_trains_and_has_no_secret_state(tmp_path):
    module = _vector_module(seed=None, secure_noise=True)
    trainer = _trainer(tmp_path, 2)
    trainer.fit(module, datamodule=VectorDataModule())
    path = tmp_path / "secure.ckpt"
    trainer.save_checkpoint(path)
    assert torch.load(secret_path(path), weights_only=True)["entries"][-1]["noise_rng"] is None
    with pytest.raises(ConfigError, match="cannot be seeded"):
        PrivacyConfig(secure_noise=True, seed=1).validate()


# ---------------------------------------------------------------------------------------------------------
# 4./5. resume and the budget guard


def test_resume_is_bit_exact_with_a_seed(tmp_path):
    full = _vector_module(target_epsilon=3.0, noise_multiplier=None)
    _trainer(tmp_path / "a", 10).fit(full, datamodule=VectorDataModule())  # 8 steps per epoch: crosses an epoch
    path = tmp_path / "five.ckpt"
    first = _vector_module(target_epsilon=3.0, noise_multiplier=None)
    _trainer(tmp_path / "b", 10, callbacks=[SaveAndStopAt(5, path)]).fit(first, datamodule=VectorDataModule())
    assert first.engine.steps_done == 5
    resumed = _vector_module(target_epsilon=3.0, noise_multiplier=None)
    _trainer(tmp_path / "c", 10).fit(resumed, datamodule=VectorDataModule(), ckpt_path=str(path))
    assert resumed.engine.steps_done == full.engine.steps_done == 10
    for name, value in _params(full).items():
        assert torch.equal(value, _params(resumed)[name]), name
    assert resumed.engine.epsilon(10) == full.engine.epsilon(10)
    assert torch.equal(normal((8,), resumed.engine.noise_source),
                       normal((8,), full.engine.noise_source))


def test_resume_with_changed_plan_is_refused_then_composed_when_forced(tmp_path):
    first = _vector_module(target_epsilon=2.0, noise_multiplier=None, seed=None)
    trainer = _trainer(tmp_path, 5)
    trainer.fit(first, datamodule=VectorDataModule())
    path = tmp_path / "five.ckpt"
    trainer.save_checkpoint(path)
    eps5 = first.engine.epsilon(5)
    assert eps5 <= 2.0

    refused = _vector_module(target_epsilon=2.0, noise_multiplier=None, seed=None)
    with pytest.raises(ConfigError, match="force_resume") as info:
        _trainer(tmp_path, 10).fit(refused, datamodule=VectorDataModule(), ckpt_path=str(path))
    assert "sigma" in str(info.value) and "\n" not in str(info.value)

    forced = _vector_module(target_epsilon=2.0, noise_multiplier=None, seed=None, force_resume=True)
    _trainer(tmp_path, 10).fit(forced, datamodule=VectorDataModule(), ckpt_path=str(path))
    assert forced.engine.steps_done == 10
    total = forced.engine.epsilon(10)
    assert eps5 < total <= 2.0 * (1 + 1e-9)  # composed over both parts, within the target, never reset
    assert forced.engine.noise_multiplier > first.engine.noise_multiplier  # the second part had less budget left
    # an independent composition of the two segments gives the same number
    from dpl.core.accounting import prv
    from dpl.core.accounting.common import _canonical

    both = prv._epsilon(_canonical(((first.engine.noise_multiplier, 8 / 64, 5), (forced.engine.noise_multiplier, 8 / 64, 5))), forced.engine.plan.delta,
                        "prv", None)
    assert total == pytest.approx(both, rel=1e-9)


def test_resume_with_changed_clip_or_delta_is_refused(tmp_path):
    first = _vector_module()
    trainer = _trainer(tmp_path, 3)
    trainer.fit(first, datamodule=VectorDataModule())
    path = tmp_path / "three.ckpt"
    trainer.save_checkpoint(path)
    for change, word in [({"max_grad_norm": 2.0}, "C 1 -> 2"), ({"target_delta": 1e-4}, "delta"),
                         ({"batch_size": 16}, "q = ")]:
        with pytest.raises(ConfigError, match=word):
            _trainer(tmp_path, 6).fit(_vector_module(**change), datamodule=VectorDataModule(), ckpt_path=str(path))


def test_plan_exceeding_the_budget_is_refused():
    module = _vector_module(noise_multiplier=0.8, max_epsilon=1.0)
    trainer = SimpleNamespace(world_size=1, max_steps=50, max_epochs=None, limit_train_batches=1.0, precision="32")
    module.ensure_model()
    with pytest.raises(ConfigError, match="max_epsilon"):
        module.prepare_privacy(64, trainer)


def test_resume_that_would_end_above_the_budget_is_refused(tmp_path):
    """Part one at sigma 0.6; a forced resume at sigma 1.5 fits the budget on its own, not composed with part one:
    refused before training, in one line naming both figures (the run never ends above max_epsilon)."""
    first = _vector_module(noise_multiplier=0.6, seed=None)
    trainer = _trainer(tmp_path, 4)
    trainer.fit(first, datamodule=VectorDataModule())
    path = tmp_path / "four.ckpt"
    trainer.save_checkpoint(path)
    from dpl.core.accounting import events

    def pg(sigma: float, steps: int) -> events.Event:
        return events.SelfComposed(events.PoissonGaussian(sigma, 8 / 64), steps)

    budget = events.epsilon(events.Composed((pg(0.6, 4), pg(1.5, 2))), first.engine.plan.delta) * 1.001
    assert events.epsilon(pg(1.5, 12), first.engine.plan.delta) < budget  # a fresh plan of 12 steps at 1.5 passes the setup check
    resumed = _vector_module(noise_multiplier=1.5, seed=None, force_resume=True, max_epsilon=budget)
    with pytest.raises(ConfigError, match="resuming would end at epsilon") as info:
        _trainer(tmp_path, 12).fit(resumed, datamodule=VectorDataModule(), ckpt_path=str(path))
    message = str(info.value)
    assert f"max_epsilon = {budget:g}" in message and "already spent in 4 steps" in message and "\n" not in message
    # the same resume planned to stop within the budget trains
    within = _vector_module(noise_multiplier=1.5, seed=None, force_resume=True, max_epsilon=budget)
    _trainer(tmp_path, 6).fit(within, datamodule=VectorDataModule(), ckpt_path=str(path))
    assert within.engine.steps_done == 6 and within.engine.epsilon(6) <= budget


def _stopped_at_four(tmp_path, **privacy):
    """A run planned for 8 steps at target epsilon 3, interrupted after 4 (its checkpoint)."""
    path = tmp_path / "four.ckpt"
    first = _vector_module(noise_multiplier=None, target_epsilon=3.0, seed=None, **privacy)
    _trainer(tmp_path / "first", 8, callbacks=[SaveAndStopAt(4, path)]).fit(first, datamodule=VectorDataModule())
    assert first.engine.steps_done == 4
    return first, path


def test_resume_with_a_lower_target_or_budget_is_refused(tmp_path):
    """The resume must never train on with the checkpoint's sigma past a smaller target or max_epsilon."""
    first, path = _stopped_at_four(tmp_path)
    spent = first.engine.epsilon(4)
    assert 1.0 < spent < 3.0
    for privacy, words in [({"target_epsilon": 1.0, "max_epsilon": 1.0}, "target epsilon 3.0 -> 1"),
                           ({"target_epsilon": 1.0, "force_resume": True}, f"already spent epsilon = {spent:.3f}"),
                           ({"max_epsilon": spent + 0.01}, f"max_epsilon = {spent + 0.01:g}")]:
        resumed = _vector_module(**{"noise_multiplier": None, "target_epsilon": 3.0, "seed": None, **privacy})
        with pytest.raises(ConfigError, match=words) as info:
            _trainer(tmp_path / "r", 8).fit(resumed, datamodule=VectorDataModule(), ckpt_path=str(path))
        assert "\n" not in str(info.value)


def test_resume_with_a_higher_target_recalibrates_the_remaining_steps(tmp_path):
    """A new target is a change of the privacy settings: refused without force_resume; with it sigma is calibrated
    for the steps left, epsilon composed over both parts ends at the new target, and the sigma that trains is the one
    reported."""
    first, path = _stopped_at_four(tmp_path)
    refused = _vector_module(noise_multiplier=None, target_epsilon=6.0, seed=None)
    with pytest.raises(ConfigError, match="force_resume"):
        _trainer(tmp_path / "r", 8).fit(refused, datamodule=VectorDataModule(), ckpt_path=str(path))
    forced = _vector_module(noise_multiplier=None, target_epsilon=6.0, seed=None, force_resume=True)
    _trainer(tmp_path / "f", 8).fit(forced, datamodule=VectorDataModule(), ckpt_path=str(path))
    assert forced.engine.steps_done == 8 and forced.engine.noise_multiplier < first.engine.noise_multiplier
    from dpl.core.accounting import prv
    from dpl.core.accounting.common import _canonical

    both = prv._epsilon(_canonical(((first.engine.noise_multiplier, 8 / 64, 4), (forced.engine.noise_multiplier, 8 / 64, 4))), forced.engine.plan.delta,
                        "prv", None)
    assert both == pytest.approx(forced.engine.epsilon(8), rel=1e-9)
    assert 3.0 < forced.engine.epsilon(8) <= 6.0 * (1 + 1e-9)
    summary = forced.engine.summary()
    assert summary["noise_multiplier"] == forced.engine.noise_multiplier and summary["resumed_from"] == path.name  # no path: nothing absolute in a report
    assert summary["resumed_noise"] == "fresh"


def test_resume_with_nothing_left_to_train_says_so(tmp_path):
    first, path = _stopped_at_four(tmp_path)
    resumed = _vector_module(noise_multiplier=None, target_epsilon=3.0, seed=None)
    with pytest.raises(ConfigError, match="nothing left to train: the checkpoint took 4 steps and this run plans 4"):
        _trainer(tmp_path / "r", 4).fit(resumed, datamodule=VectorDataModule(), ckpt_path=str(path))


# ---------------------------------------------------------------------------------------------------------
# 6.-10. setup refusals and warnings


def test_batch_norm_is_refused(tmp_path):
    module = VectorModule(batch_norm=True, privacy=PrivacyConfig(noise_multiplier=1.0, batch_size=8))
    with pytest.raises(ConfigError, match="normalizes over the batch"):
        _trainer(tmp_path, 2).fit(module, datamodule=VectorDataModule())


def _fake_trainer(**kw):
    base = dict(world_size=1, max_steps=-1, max_epochs=None, limit_train_batches=1.0, precision="32-true")
    base.update(kw)
    return SimpleNamespace(**base)


def test_planned_steps_are_the_steps_that_run(caplog):
    assert DPModule.planned_total_steps(_fake_trainer(max_steps=200, max_epochs=1), 50) == 50
    assert "training stops after 50 steps" in caplog.text
    assert DPModule.planned_total_steps(_fake_trainer(max_steps=30, max_epochs=2), 50) == 30
    assert DPModule.planned_total_steps(_fake_trainer(max_epochs=3, limit_train_batches=10), 50) == 30
    assert DPModule.planned_total_steps(_fake_trainer(max_epochs=2, limit_train_batches=0.5), 50) == 50
    with pytest.raises(ConfigError):
        DPModule.planned_total_steps(_fake_trainer(), 50)


@pytest.mark.parametrize("precision", ["16-mixed", "16-true", "16"])
def test_float16_is_refused(precision):
    module = _vector_module()
    module.ensure_model()
    with pytest.raises(ConfigError, match="bf16"):
        module.prepare_privacy(64, _fake_trainer(max_steps=4, precision=precision))


def test_bf16_is_accepted():
    module = _vector_module()
    module.ensure_model()
    module.prepare_privacy(64, _fake_trainer(max_steps=4, precision="bf16-mixed"))


@pytest.mark.parametrize("native", [True, False])
def test_emulated_bf16_on_cpu_is_reported(native, monkeypatch, caplog):
    import dpl.lightning.precision as base

    monkeypatch.setattr(base, "cpu_has_native_bf16", lambda: native)
    module = _vector_module()
    module.ensure_model()
    cpu = SimpleNamespace(root_device=torch.device("cpu"))
    with caplog.at_level(logging.INFO, logger="dpl"):
        module.prepare_privacy(64, _fake_trainer(max_steps=4, precision="bf16-mixed", strategy=cpu))
    assert ("bfloat16 arithmetic" in caplog.text) is not native


def test_large_delta_warns_and_default_delta_does_not():
    module = _vector_module(target_delta=1e-2, seed=None)
    module.ensure_model()
    with pytest.warns(PrivacyWarning, match="N \\* delta"):
        module.prepare_privacy(64, _fake_trainer(max_steps=4))
    module = _vector_module(seed=None)
    module.ensure_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyWarning)
        module.prepare_privacy(64, _fake_trainer(max_steps=4))
    assert module.engine.plan.delta * 64 == pytest.approx(0.1)


def _linear_ctx(expected_batch_size: int) -> StepContext:
    """A step context over a 3 -> 2 linear model (inputs ``x``, labels ``y``)."""
    model = nn.Linear(3, 2)
    return StepContext(model=model, trainable=dict(model.named_parameters()),
                       per_example_loss=lambda b: F.cross_entropy(model(b["x"]), b["y"], reduction="none"),
                       max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=expected_batch_size, step=0,
                       noise_source=torch.Generator().manual_seed(0), log=lambda *a: None)


class _LeakyPostProcess:
    """Tries to reach the noise source and the data from post_process."""

    seen: dict = {}

    @hookimpl
    def post_process(self, ctx, gradient):
        _LeakyPostProcess.seen = {"noise_source": hasattr(ctx, "noise_source"),
                                  "per_example_loss": hasattr(ctx, "per_example_loss"),
                                  "model": hasattr(ctx, "model")}


def test_post_processing_hooks_get_no_generator_and_no_data():
    pm = create_plugin_manager()
    pm.register(_LeakyPostProcess(), name="leaky")
    ctx = _linear_ctx(expected_batch_size=2)
    private_step(pm.hook, ctx, {"x": torch.randn(2, 3), "y": torch.tensor([0, 1])}, 2, mechanism="gaussian")
    assert _LeakyPostProcess.seen == {"noise_source": False, "per_example_loss": False, "model": False}


class _RoguePrivatize:
    @hookimpl
    def privatize(self, ctx, gradient_sum):
        return PrivateGradient({k: v.clone() for k, v in gradient_sum.values.items()}, noise_std=0.0,
                               mechanism="rogue", expected_batch_size=1.0, step=ctx.step)


def test_privatize_without_its_mechanism_is_refused(tmp_path):
    pm = create_plugin_manager()
    pm.register(_RoguePrivatize(), name="rogue")
    ctx = _linear_ctx(expected_batch_size=2)
    with pytest.raises(PluginError, match="configure_mechanism"):
        private_step(pm.hook, ctx, {"x": torch.randn(2, 3), "y": torch.tensor([0, 1])}, 2, mechanism="gaussian")
    module = _vector_module()
    module.engine.plugin_manager.register(_RoguePrivatize(), name="rogue")
    from dpl.core import plugin_manager

    original = plugin_manager.replaced_hooks
    module.ensure_model()
    try:
        import dpl.lightning.module as base

        base.replaced_hooks = lambda pm: frozenset({"privatize"})
        with pytest.raises(ConfigError, match="without configure_mechanism"):
            module.prepare_privacy(64, _fake_trainer(max_steps=4))
    finally:
        base.replaced_hooks = original


def test_partial_sums_are_wiped_after_privatize():
    kept = []

    class Keep:
        @hookimpl(wrapper=True)
        def estimate_gradient(self, ctx, batch):
            result = yield
            kept.append(result)
            return result

    pm = create_plugin_manager()
    pm.register(Keep(), name="keep")
    ctx = _linear_ctx(expected_batch_size=4)
    private_step(pm.hook, ctx, {"x": torch.randn(5, 3), "y": torch.tensor([0, 1, 0, 1, 1])}, 2)
    assert len(kept) == 3 and all(isinstance(k, GradientSum) and k.wiped for k in kept)


# ---------------------------------------------------------------------------------------------------------
# a run killed with SIGKILL resumes from its last checkpoint


def test_sigkill_mid_training_then_resume_from_last_checkpoint(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    ckpt_dir = tmp_path / "ckpt"
    args = ["--model", "test_trust.VectorModule", "--model.privacy.noise_multiplier", "1.0",
            "--model.privacy.batch_size", "8", "--data", "test_trust.VectorDataModule",
            "--trainer.max_steps", "150", "--trainer.accelerator", "cpu", "--trainer.logger", "false",
            "--trainer.enable_progress_bar", "false", "--trainer.limit_val_batches", "0",
            "--trainer.default_root_dir", str(tmp_path),
            "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
            "--trainer.callbacks.dirpath", str(ckpt_dir), "--trainer.callbacks.every_n_train_steps", "1",
            "--trainer.callbacks.save_last", "true"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", "import sys; from dpl.cli import main; main(sys.argv[1:])", "fit", *args]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    last = ckpt_dir / "last.ckpt"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if last.exists() and torch.load(last, weights_only=False)["dpl"]["steps_done"] >= 3:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # A write cut by the kill can leave a temporary file; it is never the checkpoint, and a secret one is
    # owner-only from its creation.
    for leftover in ckpt_dir.glob(".*.secret.*.tmp"):
        assert stat.S_IMODE(os.stat(leftover).st_mode) == 0o600
    steps_before = torch.load(last, weights_only=False)["dpl"]["steps_done"]
    assert 3 <= steps_before < 150
    resumed = subprocess.run([*command, "--ckpt_path", str(last)], env=env, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    from dpl.core.accounting import epsilon_for

    expected = epsilon_for(1.0, 8 / 64, 150, 0.1 / 64)
    assert f"trained 150 private steps ({150 - steps_before} after resuming at step {steps_before}); privacy spent " \
           f"(epsilon={expected:.3f}" in resumed.stdout


class _UserVectors(VectorDataModule):
    """64 rows of 16 users (4 rows each)."""

    def train_user_keys(self):
        return [i // 4 for i in range(self.n)]


def test_a_resume_from_example_level_to_user_level_sampling_is_refused_even_forced(tmp_path):
    """3 steps under ELS (user_sampling: rows, k = 4), then a resume under user-level sampling with force_resume: the
    checkpoint's mixture-of-Gaussians steps cannot be composed as user-sampled ones (that under-reports): one line
    naming both, before any step."""
    users = dict(unit="user", max_rows_per_user=4, seed=None, batch_size=8, physical_batch_size=8)
    first = _vector_module(user_sampling="rows", **users)
    trainer = _trainer(tmp_path, 3)
    trainer.fit(first, datamodule=_UserVectors())
    path = tmp_path / "three.ckpt"
    trainer.save_checkpoint(path)
    resumed = _vector_module(user_sampling="users", force_resume=True, **{**users, "batch_size": 4})
    with pytest.raises(ConfigError, match="cannot change how the privacy is accounted") as info:
        _trainer(tmp_path, 6).fit(resumed, datamodule=_UserVectors(), ckpt_path=str(path))
    assert "rows, at most 4 per user" in str(info.value) and "poisson (users)" in str(info.value)
    assert "\n" not in str(info.value) and resumed.engine.steps_done == 0
