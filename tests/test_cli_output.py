"""What the dpl command prints and writes: one-line errors without Lightning's banners, help that leads with dpl's
options and cuts no sentence, fast help and light commands, one-line warnings, steps counted from 1 in metrics.csv
and the plots, public modes on exported files, and a plugin listing with descriptions and config fragments."""

from __future__ import annotations

import csv
import os
import stat
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from helpers import tiny_classification_workspace

from dpl import cli
from dpl.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _dpl(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``dpl ARGS`` as a user runs it: a new process, stdout and stderr together."""
    return subprocess.run([sys.executable, "-m", "dpl.cli", *args], cwd=cwd, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env={**os.environ, "COLUMNS": "100"})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished 5-step run (epsilon logged by Lightning every 2 steps, validation after step 5): its config, run
    folder and output."""
    tmp, model = tiny_classification_workspace(tmp_path_factory.mktemp("cli_output"), rows=64, val_rows=8)
    config = tmp / "run.yaml"
    config.write_text(f"""
seed_everything: 0
trainer: {{accelerator: cpu, max_steps: 5, log_every_n_steps: 2, val_check_interval: 5,
          check_val_every_n_epoch: null, default_root_dir: {tmp / "runs"}}}
model:
  class_path: dpl.tasks.modules.DPClassificationModule
  init_args: {{model: {model}, privacy: {{target_epsilon: 3.0, target_delta: 0.05, batch_size: 8,
                                          physical_batch_size: 8}}}}
data:
  class_path: dpl.tasks.data.ClassificationDataModule
  init_args: {{tokenizer: {model}, data_dir: {tmp / "data"}, max_length: 16}}
""")
    result = _dpl("fit", "--config", str(config))
    assert result.returncode == 0, result.stdout[-3000:]
    return config, tmp / "runs" / "lightning_logs" / "version_0", result.stdout


def test_a_refused_run_prints_its_error_line_alone():
    result = _dpl("fit", "--config", "configs/quickstart.yaml", "--model.privacy.target_epsilon", "-1")
    assert result.returncode == 2
    assert result.stdout.splitlines() == ["dpl: error: privacy.target_epsilon must be > 0, got -1.0"], result.stdout


def test_a_resume_with_nothing_left_is_one_line_and_leaves_no_run_folder(run):
    config, folder, _ = run
    result = _dpl("fit", "--config", str(config), "--ckpt_path", str(folder / "checkpoints" / "last.ckpt"))
    assert result.returncode == 2
    lines = [line for line in result.stdout.splitlines() if not line.startswith("dpl: warning:")]  # the large delta
    assert len(lines) == 1 and lines[0].startswith("dpl: error: nothing left to train"), result.stdout
    assert sorted(p.name for p in folder.parent.iterdir()) == ["version_0"]


def test_lightning_lines_come_once_the_run_starts_and_warnings_are_one_line(run):
    _, _, out = run
    lines = out.splitlines()
    assert not any(line.startswith("Seed set to") for line in lines), out
    assert sum(line.startswith("GPU available") for line in lines) == 1, out
    # target_delta 0.05 for N = 64: dpl's own warning, one line without a source path
    warning = [line for line in lines if "N * delta" in line]
    assert len(warning) == 1 and warning[0].startswith("dpl: warning: delta = 0.05 gives N * delta = 3.20"), out
    assert ".py:" not in out


def test_format_warning_shortens_dpl_warnings_only():
    from dpl.errors import PrivacyWarning

    assert cli.format_warning("careful", PrivacyWarning, "/elsewhere/x.py", 3) == "dpl: warning: careful\n"
    assert cli.format_warning("careful", UserWarning, cli.__file__, 3) == "dpl: warning: careful\n"
    other = cli.format_warning("careful", UserWarning, "/elsewhere/x.py", 3)
    assert "/elsewhere/x.py:3" in other and "UserWarning" in other


@pytest.mark.parametrize("population", [11, 22, 150, 300, 1000, 50000])
def test_the_default_delta_does_not_warn(population):
    from dpl.core.ledger import make_plan
    from dpl.core.privacy import PrivacyConfig
    from dpl.errors import PrivacyWarning

    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyWarning)
        plan = make_plan(PrivacyConfig(batch_size=1), population=population, steps=10)
    assert plan.delta * population == pytest.approx(0.1)
    with pytest.warns(PrivacyWarning, match="N \\* delta"):
        make_plan(PrivacyConfig(batch_size=1, target_delta=0.2 / population), population=population, steps=10)


def test_metrics_count_private_steps_from_one(run):
    _, folder, _ = run
    with open(folder / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    epsilon = [int(r["step"]) for r in rows if r.get("epsilon")]
    assert epsilon == [1, 2, 4, 5]  # the first step, Lightning's rows every 2 steps, the last step
    assert [int(r["step"]) for r in rows if r.get("val_acc")] == [5]  # validation after step 5
    from dpl.trained.plots import read_metrics

    assert [step for step, _ in read_metrics(folder / "metrics.csv")["epsilon"]] == [1, 2, 4, 5]


def test_plots_have_whole_steps_from_zero():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dpl.trained.plots import steps_axis

    fig, ax = plt.subplots()
    ax.plot([40], [0.8], marker="o")  # one validation point
    steps_axis(ax, 40)
    fig.canvas.draw()
    ticks = [t for t in ax.get_xticks() if 0 <= t <= 42]
    plt.close(fig)
    assert ticks[0] == 0 and all(float(t).is_integer() for t in ticks) and len(ticks) >= 3, ticks


def test_export_is_public_and_the_secret_stays_owner_only(run, tmp_path):
    _, folder, _ = run
    old = os.umask(0o022)
    try:
        main(["export", str(folder), str(tmp_path / "export")])
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "export").iterdir() if p.is_file()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes
    secret = Path(f"{(folder / 'checkpoints' / 'last.ckpt').resolve()}.secret")  # the newest checkpoint's
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE((folder / "checkpoints" / "last.ckpt").stat().st_mode) == 0o644


def test_top_level_help_says_every_command_in_full(capsys):
    from dpl.cli_help import LIGHTNING_COMMANDS

    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for name, text in [*LIGHTNING_COMMANDS.items(), *((n, t) for n, (t, _) in cli.COMMANDS.items())]:
        assert f"{name} {text}" in out, name
    assert "make sure you never run on your" not in out


def test_help_and_light_commands_import_neither_torch_nor_lightning():
    code = ("import contextlib, io, sys\nfrom dpl.cli import main\n"
            "for args in (['--help'], ['plugins'], ['predict', '--help'], ['export', '--help']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()):\n"
            "        try:\n            main(args)\n        except SystemExit:\n            pass\n"
            "print(sorted(m for m in ('torch', 'lightning', 'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]", result.stdout


def test_fit_help_leads_with_dpl_options(capsys):
    import dataclasses

    from dpl.core.privacy import PrivacyConfig

    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    out = capsys.readouterr().out
    trainer = out.index("Lightning Trainer options")
    order = [out.index(title) for title in ("\nprivacy:", "\nfine-tuning:", "\nplugins", "\nmodel and data")]
    assert order == sorted(order) and order[-1] < trainer
    preface = " ".join(out[:trainer].split())
    for f in dataclasses.fields(PrivacyConfig):
        assert f" {f.name} " in preface, f.name
    assert "epsilon to reach at the end of training" in preface  # from the dataclass docstring
    for key in ("method", "freeze", "lora.r", "lora.alpha", "lora.dropout", "lora.target_modules"):
        assert f" {key} " in preface, key
    assert "denoise" in preface and "plugins/denoise/denoise.yaml" in preface and "--model.plugins" in preface
    assert out.index("--trainer.accelerator") > trainer
    note = " ".join(out[out.index("--trainer.plugins PLUGINS"):].split())[:300]
    assert "not dpl's" in note and "plugins go under --model.plugins" in note
    assert len(out.splitlines()[0]) < 120 and out.startswith("usage: dpl fit")


def test_plugins_listing_has_descriptions_and_config_fragments(capsys, monkeypatch):
    from dpl.core.plugin_manager import describe_plugins

    info = {i.name: i for i in describe_plugins()}
    assert all(i.description for i in info.values())
    assert [Path(f).name for f in info["ftrl"].fragments] == ["bandmf.yaml", "ftrl.yaml"]
    assert info["clip"].fragments == () and info["denoise"].hooks == ("privatize", "post_process", "validate_setup")
    monkeypatch.chdir(ROOT)  # fragments are shown relative to the working directory
    main(["plugins"])
    out = " ".join(capsys.readouterr().out.split())
    assert f"denoise {info['denoise'].description} hooks: privatize, post_process, validate_setup" in out
    assert "config: plugins/denoise/denoise.yaml" in out and "config: - (a default" in out


@pytest.mark.parametrize("native, keep, expected", [(False, False, "32-true"), (False, True, "bf16-mixed"),
                                                     (True, False, "bf16-mixed")])
def test_bf16_on_a_cpu_without_native_bfloat16_trains_in_float32(monkeypatch, caplog, native, keep, expected):
    import logging

    import dpl.lightning.precision as module
    from dpl.cli_lightning import native_precision

    monkeypatch.setattr(module, "cpu_has_native_bf16", lambda: native)
    if keep:
        monkeypatch.setenv("DPL_KEEP_PRECISION", "1")
    else:
        monkeypatch.delenv("DPL_KEEP_PRECISION", raising=False)
    with caplog.at_level(logging.INFO, logger="dpl"):
        config = native_precision({"precision": "bf16-mixed", "accelerator": "cpu"})
    assert config["precision"] == expected
    assert ("training in float32" in caplog.text) == (expected == "32-true")
    assert native_precision({"precision": "32-true", "accelerator": "cpu"})["precision"] == "32-true"
