"""Plugin discovery, activation, the third-party path (the writing-plugins tutorial) and refusals."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import fake_entry_points, save_tiny_bert, write_sentiment_tsv

from dpl.core import hookspecs
from dpl.errors import PluginError
from dpl.api import hookimpl
from dpl.core.plugin_manager import (active_plugin_names, create_plugin_manager, describe_plugins, installed_plugins,
                                normalize_plugin_config)

ROOT = Path(__file__).resolve().parents[1]


def test_builtins_are_registered_through_entry_points():
    names = installed_plugins()
    assert {"clip", "gaussian"} <= set(names)
    assert names["clip"].value.startswith("dpl_plugins.")
    info = {i.name: i for i in describe_plugins()}
    assert "estimate_gradient" in info["clip"].hooks
    assert "privatize" in info["gaussian"].hooks


def test_every_hookspec_is_documented():
    doc = (ROOT / "docs" / "hooks.md").read_text()
    for name in hookspecs.STEP_HOOKS + hookspecs.SETUP_HOOKS:
        spec = getattr(hookspecs, name)
        assert spec.__doc__, name
        if name in hookspecs.STEP_HOOKS:
            assert "Privacy contract" in spec.__doc__, name
        assert re.search(rf"^## `{name}`", doc, re.M), f"docs/hooks.md has no section for {name}"


def test_unknown_plugin_is_refused():
    with pytest.raises(PluginError, match="unknown plugin 'nope'"):
        create_plugin_manager({"nope": {}})


def test_bad_plugin_config_is_refused():
    with pytest.raises(PluginError):
        normalize_plugin_config([{"a": {}, "b": {}}])
    with pytest.raises(PluginError, match="default plugin"):
        create_plugin_manager({"gaussian": {}})


class _Noise1:
    @hookimpl
    def privatize(self, ctx, gradient_sum):
        return None


class _Noise2(_Noise1):
    pass


class _Post:
    def __init__(self, tag, seen):
        self.tag, self.seen = tag, seen

    @hookimpl
    def post_process(self, ctx, gradient):
        self.seen.append(self.tag)


def test_two_plugins_replacing_privatize_cannot_be_combined(monkeypatch):
    fake_entry_points(monkeypatch, {"noise1": _Noise1, "noise2": _Noise2})
    with pytest.raises(PluginError, match="both implement 'privatize'"):
        create_plugin_manager({"noise1": {}, "noise2": {}})


def test_post_process_runs_in_config_order_and_only_named_plugins_run(monkeypatch):
    seen = []
    fake_entry_points(monkeypatch, {"a": lambda: _Post("a", seen), "b": lambda: _Post("b", seen),
                                     "c": lambda: _Post("c", seen)})
    pm = create_plugin_manager({"b": {}, "a": {}})
    assert active_plugin_names(pm) == ["b", "a"]
    pm.hook.post_process(ctx=None, gradient=None)
    assert seen == ["b", "a"]


def _tutorial_files() -> dict[str, str]:
    text = (ROOT / "docs" / "writing-plugins.md").read_text()
    return {m.group(1): m.group(2) for m in re.finditer(r"```\w+ file=(\S+)\n(.*?)```", text, re.S)}


def test_third_party_plugin_from_the_tutorial(tmp_path):
    files = _tutorial_files()
    assert {"pyproject.toml", "dpl_gradnorm/__init__.py", "gradnorm.yaml"} <= set(files)
    package = tmp_path / "dpl-gradnorm"
    for name, content in files.items():
        target = (tmp_path if name.endswith(".yaml") else package) / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(package)], check=True)
    env = {**__import__("os").environ, "PYTHONPATH": str(site)}
    listing = subprocess.run([sys.executable, "-m", "dpl.cli", "plugins"], env=env, capture_output=True, text=True,
                             check=True).stdout
    # the first sentence of the class docstring, the hooks with the package, no config fragment in the package
    assert ("gradnorm Logs <prefix>grad_norm, the L2 norm of the privatized gradient, every step. hooks: post_process "
            "(dpl-gradnorm 0.1.0) config: -") in " ".join(listing.split()), listing

    model = save_tiny_bert(tmp_path / "model")
    train = write_sentiment_tsv(tmp_path / "data" / "train.tsv", rows=64)
    write_sentiment_tsv(tmp_path / "data" / "validation.tsv", rows=16, seed=1)
    config = tmp_path / "run.yaml"
    config.write_text(TINY_RUN.format(model=model, data=Path(train).parent, root=tmp_path / "runs"))
    result = subprocess.run([sys.executable, "-m", "dpl.cli", "fit", "--config", str(config), "--config",
                             str(tmp_path / "gradnorm.yaml")], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = next((tmp_path / "runs").rglob("metrics.csv")).read_text()
    assert "private_grad_norm" in metrics.splitlines()[0]


TINY_RUN = """
seed_everything: 0
trainer:
  accelerator: cpu
  max_steps: 4
  default_root_dir: {root}
  logger: {{class_path: lightning.pytorch.loggers.CSVLogger, init_args: {{save_dir: {root}}}}}
  log_every_n_steps: 1
  enable_progress_bar: false
  enable_checkpointing: false
model:
  class_path: dpl.tasks.modules.DPClassificationModule
  init_args:
    model: {model}
    privacy: {{target_epsilon: 5.0, batch_size: 16, physical_batch_size: 8, seed: 0}}
data:
  class_path: dpl.tasks.data.ClassificationDataModule
  init_args: {{tokenizer: {model}, data_dir: {data}, max_length: 16}}
"""
