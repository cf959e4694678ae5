"""Bad input fails before training with one clear line (exit code 2) and writes no run directory."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import tiny_classification_workspace

from dpl.cli import main
from dpl.errors import ConfigError
from dpl.core.privacy import PrivacyConfig

CONFIG = """
trainer:
  accelerator: cpu
  max_steps: 2
  default_root_dir: {root}
  enable_progress_bar: false
model:
  class_path: dpl.tasks.modules.DPClassificationModule
  init_args:
    model: {model}
    privacy: {{target_epsilon: 3.0, batch_size: 8, physical_batch_size: 8}}
data:
  class_path: dpl.tasks.data.ClassificationDataModule
  init_args: {{tokenizer: {model}, data_dir: {data}, max_length: 16}}
"""


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return tiny_classification_workspace(tmp_path_factory.mktemp("bad"), rows=32, val_rows=8)


def _run(workspace, *overrides, files=None, capsys=None):
    tmp, model = workspace
    data = tmp / "data"
    if files:
        data = tmp / f"data_{abs(hash(tuple(files.items())))}"
        data.mkdir(exist_ok=True)
        for name, text in files.items():
            (data / name).write_text(text)
    root = tmp / f"runs_{abs(hash(overrides))}_{data.name}"
    config = tmp / "config.yaml"
    config.write_text(CONFIG.format(root=root, model=model, data=data))
    args = ["fit", "--config", str(config), *overrides]
    if capsys is None:  # a real process, as a user runs it
        result = subprocess.run([sys.executable, "-m", "dpl.cli", *args], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parents[1])
        return result, root
    with pytest.raises(SystemExit) as exit_info:  # in-process: the same code path, without interpreter start-up
        main(args)
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, exit_info.value.code, captured.out, captured.err), root


def _assert_one_line_error(result, root, pattern):
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("dpl: error:")]
    assert len(errors) == 1, result.stderr[-2000:]
    assert pattern in errors[0], errors[0]
    assert "Traceback" not in result.stderr
    assert not root.exists(), "a run directory was written although the run failed"


GOOD_TRAIN = "sentence\tlabel\n" + "the movie was good\tpositive\nthe film was bad\tnegative\n" * 8


@pytest.mark.parametrize("overrides,pattern", [
    (("--model.init_args.privacy.target_epsilon", "0"), "target_epsilon must be > 0"),
    (("--model.init_args.privacy.target_epsilon", "-1"), "target_epsilon must be > 0"),
    (("--model.init_args.privacy.target_delta", "0"), "target_delta must be in (0, 1)"),
    (("--model.init_args.privacy.target_delta", "1"), "target_delta must be in (0, 1)"),
    (("--model.init_args.privacy.max_grad_norm", "0"), "max_grad_norm (C) must be > 0"),
    (("--model.init_args.privacy.batch_size", "1000"), "larger than the training set"),
    (("--model.init_args.plugins", "{nope: {}}"), "unknown plugin 'nope'"),
    (("--model.init_args.plugins", "{denoize: {}}"), "unknown plugin 'denoize' in model.plugins; did you mean denoise?"),
    (("--model.init_args.plugins", "{denoise: {kapa: 1.0}}"),
     "unknown option model.plugins.denoise.kapa; did you mean kappa?"),
    (("--model.init_args.plugins", "{denoise: {svd: ful}}"),
     "model.plugins.denoise.svd: expected one of 'auto', 'full', 'randomized', got 'ful'; did you mean 'full'?"),
    (("--model.init_args.plugins", "{adambc: {gamma: abc}}"), "model.plugins.adambc.gamma: expected float, got 'abc'"),
    (("--data.init_args.data_dir", "/nonexistent/dir"), "not found"),
    (("--data.init_args.text_column", "text"), "missing column(s) ['text']"),
    (("--data.init_args.max_length", "129"), "data.max_length = 129 is longer than the 128 positions the model"),
])
def test_bad_input_fails_with_one_line(workspace, overrides, pattern, capsys):
    result, root = _run(workspace, *overrides, capsys=capsys)
    _assert_one_line_error(result, root, pattern)


@pytest.mark.parametrize("files,pattern", [
    ({"train.tsv": GOOD_TRAIN, "validation.tsv": "sentence\tlabel\nok\tneutral\n"}, "'neutral' is not in the label set"),
    ({"train.tsv": GOOD_TRAIN + "broken row\tpositive\textra\n", "validation.tsv": GOOD_TRAIN}, "line 18"),
])
def test_bad_data_files(workspace, files, pattern, capsys):
    result, root = _run(workspace, files=files, capsys=capsys)
    _assert_one_line_error(result, root, pattern)


def test_print_config_shows_every_named_plugin_option_with_its_default(workspace, capsys):
    tmp, model = workspace
    config = tmp / "config.yaml"
    config.write_text(CONFIG.format(root=tmp / "unused", model=model, data=tmp / "data"))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--model.init_args.plugins", "{adambc: {gamma: 0.001}, denoise: {}}",
              "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    plugins = printed[printed.index("  plugins:"):]
    for line in ("adambc:", "gamma: 0.001", "beta2: 0.999", "bias_correction: true", "denoise:", "kappa: 1.02",
                 "svd: auto", "nonprivate_diagnostics: false"):
        assert f"      {line}" in plugins or f"        {line}" in plugins, (line, plugins[:800])
    assert plugins.index("adambc:") < plugins.index("denoise:")  # the post_process order is kept


def test_bad_input_in_a_real_process(workspace):
    result, root = _run(workspace, "--model.init_args.privacy.max_grad_norm", "-1")
    _assert_one_line_error(result, root, "max_grad_norm (C) must be > 0")


@pytest.mark.parametrize("kwargs", [dict(target_epsilon=None, noise_multiplier=None),
                                    dict(target_epsilon=None, noise_multiplier=-1.0),
                                    dict(max_grad_norm=float("inf"), target_epsilon=None, noise_multiplier=1.0),
                                    dict(physical_batch_size=0)])
def test_privacy_config_rejects_bad_values_directly(kwargs):
    with pytest.raises(ConfigError):
        PrivacyConfig(**kwargs).validate()


def test_position_limit_of_learned_and_rotary_positions():
    """BERT reads max_position_embeddings tokens, RoBERTa two fewer (positions start after padding_idx), GPT-2
    n_positions; a rotary model has no learned table (no limit)."""
    from transformers import (BertConfig, BertModel, GPT2Config, GPT2Model, LlamaConfig, LlamaModel, RobertaConfig,
                              RobertaModel)

    from dpl.tasks.modules.base import position_limit

    small = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32,
             "vocab_size": 40}
    assert position_limit(BertModel(BertConfig(max_position_embeddings=40, **small))) == 40
    assert position_limit(RobertaModel(RobertaConfig(max_position_embeddings=42, pad_token_id=1, **small))) == 40
    assert position_limit(GPT2Model(GPT2Config(n_positions=40, n_embd=16, n_layer=1, n_head=2, vocab_size=40))) == 40
    assert position_limit(LlamaModel(LlamaConfig(num_key_value_heads=1, **small))) is None


def test_a_resume_past_the_budget_or_with_nothing_left_is_one_line(workspace, capsys):
    """A checkpoint at step 2 of a 4-step run at target epsilon 3, resumed with a lower target and max_epsilon, with
    a lower max_epsilon alone, and with no step left: each is refused in one line, and no run directory is left."""
    tmp, model = workspace
    root = tmp / "runs_resume"
    config = tmp / "resume.yaml"
    config.write_text(CONFIG.format(root=root, model=model, data=tmp / "data"))
    main(["fit", "--config", str(config), "--trainer.max_steps", "4", "--trainer.callbacks+=ModelCheckpoint",
          "--trainer.callbacks.every_n_train_steps=1", "--trainer.callbacks.save_top_k=-1"])
    ckpt = str(next(root.rglob("*step=2.ckpt")))
    for overrides, pattern in [
        (("--model.init_args.privacy.target_epsilon", "1.0", "--model.init_args.privacy.max_epsilon", "1.0"),
         "resuming would change the privacy settings (target epsilon 3.0 -> 1"),
        (("--model.init_args.privacy.max_epsilon", "2.0"), "> privacy.max_epsilon = 2 (sigma = "),
        (("--trainer.max_steps", "2"), "nothing left to train: the checkpoint took 2 steps and this run plans 2")]:
        resumed, resumed_root = _run(workspace, "--trainer.max_steps", "4", "--ckpt_path", ckpt, *overrides,
                                     capsys=capsys)
        _assert_one_line_error(resumed, resumed_root, pattern)


@pytest.fixture(scope="module")
def user_mistakes(workspace):
    """A regular file (``a_file``) to name folders under, and a model folder with no model in it."""
    tmp, _ = workspace
    (tmp / "a_file").write_text("not a folder\n")
    (tmp / "empty_model").mkdir(exist_ok=True)
    return tmp


@pytest.mark.parametrize("overrides,pattern", [
    (("--trainer.default_root_dir", "{tmp}/a_file/runs"), "lies under a file"),
    (("--trainer.default_root_dir", "{tmp}/a_file"), "lies under a file"),
    (("--export", "{tmp}/a_file/exported"), "--export '{tmp}/a_file/exported' lies under a file"),
    (("--model.init_args.model", "{tmp}/empty_model"), "holds no model (no config.json"),
    (("--model.init_args.model", "{tmp}/no_such_model"), "model '{tmp}/no_such_model' not found"),
    (("--data.init_args.tokenizer", "{tmp}/no_such_model"), "tokenizer '{tmp}/no_such_model' not found"),
    (("--trainer.accumulate_grad_batches", "4"), "privacy.physical_batch_size"),
], ids=["root-under-file", "root-is-file", "export-under-file", "empty-model-folder", "missing-model",
        "missing-tokenizer", "accumulate"])
def test_a_users_mistake_is_one_line(workspace, user_mistakes, overrides, pattern, capsys):
    tmp = user_mistakes
    result, root = _run(workspace, *(o.format(tmp=tmp) for o in overrides), capsys=capsys)
    _assert_one_line_error(result, root, pattern.format(tmp=tmp))
    assert (tmp / "a_file").read_text() == "not a folder\n"


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes into any folder")
def test_a_read_only_run_folder_is_one_line(workspace, tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        result, root = _run(workspace, "--trainer.default_root_dir", str(locked / "runs"), capsys=capsys)
        _assert_one_line_error(result, root, "is not writable")
    finally:
        locked.chmod(0o700)


def test_export_to_a_folder_under_a_file_is_one_line(workspace, user_mistakes, capsys):
    tmp, model = workspace
    root = tmp / "runs_export"
    config = tmp / "export.yaml"
    config.write_text(CONFIG.format(root=root, model=model, data=tmp / "data"))
    main(["fit", "--config", str(config)])
    capsys.readouterr()
    checkpoint = str(next(root.rglob("last.ckpt")))
    with pytest.raises(SystemExit) as exit_info:
        main(["export", checkpoint, str(tmp / "a_file" / "exported")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("dpl: error:") == 1 and "Traceback" not in err
    assert "lies under a file" in err and (tmp / "a_file").is_file()


def test_a_relative_data_folder_is_found_beside_the_config(workspace, tmp_path, monkeypatch, capsys):
    import shutil

    tmp, model = workspace
    folder = tmp_path / "project"
    shutil.copytree(tmp / "data", folder / "my_data")
    root = tmp_path / "runs"
    (folder / "config.yaml").write_text(CONFIG.format(root=root, model=model, data="my_data"))
    monkeypatch.chdir(tmp_path)  # my_data is not in the working folder: it is beside the config
    main(["fit", "--config", str(folder / "config.yaml")])
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("dpl: trained 2 private steps")
    saved = next(root.rglob("config.yaml")).read_text()
    assert f"data_dir: {folder / 'my_data'}" in saved
