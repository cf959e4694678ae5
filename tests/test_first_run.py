"""What a new user meets first: help, one-line errors, progress output, last.ckpt, no noise, nothing left behind."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import WORDS, save_tiny_bert, write_sentiment_tsv

from dpl.cli import main
from dpl.lightning.progress import PlainProgress, _epoch_description, default_progress_bar


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("first_run")
    model = save_tiny_bert(tmp / "model")
    headless = tmp / "headless"  # a pretrained encoder without a classification head (the usual case)
    shutil.copytree(model, headless)
    from transformers import BertModel

    BertModel.from_pretrained(model).save_pretrained(headless)
    write_sentiment_tsv(tmp / "data" / "train.tsv", rows=64)
    write_sentiment_tsv(tmp / "data" / "validation.tsv", rows=16, seed=1)
    return tmp, model, str(headless)


def _args(tiny, root, *extra, model=None):
    tmp, default_model, _ = tiny
    model = model or default_model
    return ["fit", "--model", "dpl.tasks.modules.DPClassificationModule", "--model.model", model,
            "--model.privacy.target_epsilon", "4", "--model.privacy.batch_size", "16",
            "--model.privacy.physical_batch_size", "16", "--data", "dpl.tasks.data.ClassificationDataModule",
            "--data.tokenizer", default_model, "--data.data_dir", str(tmp / "data"), "--data.max_length", "16",
            "--trainer.max_steps", "3", "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(root),
            *extra]


def _fails(args, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("dpl: error:")]
    assert len(errors) == 1, err
    assert "Traceback" not in err and "usage:" not in err, err
    return errors[0]


@pytest.mark.parametrize("option,suggestion", [
    ("--model.privacy.target_epsilonn", "--model.privacy.target_epsilon"),
    ("--model.init_args.privacy.max_grad_nrom", "--model.init_args.privacy.max_grad_norm"),
    ("--data.max_lenght", "--data.max_length"),
    ("--trainer.max_stepz", "--trainer.max_steps"),
])
def test_mistyped_option_is_one_line_with_the_closest_option(tiny, tmp_path, capsys, option, suggestion):
    line = _fails(_args(tiny, tmp_path / "runs", option, "3"), capsys)
    assert f"unknown option {option}; did you mean {suggestion}?" in line
    assert not (tmp_path / "runs").exists()


def test_wrong_type_is_one_line(tiny, tmp_path, capsys):
    line = _fails(_args(tiny, tmp_path / "runs", "--model.privacy.target_epsilon", "abc"), capsys)
    assert "model.privacy.target_epsilon: expected float, got 'abc'" in line


def test_help_shows_dpl_and_its_commands(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.count("differentially private") >= 1 and "Lightning Trainer command line tool" not in out
    assert "plugins" in out and "fit" in out
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    out = capsys.readouterr().out
    assert "--model.help" in out and "max_grad_norm" in out and "--model.privacy.help" in out


def test_privacy_help_lists_every_privacy_option(capsys):
    import dataclasses

    from dpl.core.privacy import PrivacyConfig

    main(["fit", "--model.privacy.help"])
    out = capsys.readouterr().out
    for f in dataclasses.fields(PrivacyConfig):
        assert f"--model.privacy.{f.name} (" in out
    assert "calibrated" in out  # the meaning, from the docstring


def test_help_lists_every_task_class_and_finds_it_by_name(capsys):
    import importlib
    import inspect
    import pkgutil

    import dpl.tasks
    from dpl.cli import task_classes
    from dpl.lightning.data import DPDataModule
    from dpl.lightning.module import DPModule
    from dpl.tasks.data.file_module import FileDataModule

    shipped: dict[type, set[str]] = {DPModule: set(), DPDataModule: set()}
    for info in pkgutil.walk_packages(dpl.tasks.__path__, "dpl.tasks."):
        for _, cls in inspect.getmembers(importlib.import_module(info.name), inspect.isclass):
            for base, names in shipped.items():
                # DPTaskModule and FileDataModule are base classes (they leave their subclasses' job undone)
                abstract = issubclass(cls, base) and (
                    (base is DPModule and cls.build_model is DPModule.build_model)
                    or (issubclass(cls, FileDataModule) and cls.checked_train_count is FileDataModule.checked_train_count))
                if issubclass(cls, base) and cls is not base and cls.__module__ == info.name and not abstract:
                    names.add(cls.__name__)
    models, data = task_classes()
    assert set(models) == shipped[DPModule] and set(data) == shipped[DPDataModule]
    assert "DPPromptClassificationModule" in models and "PromptClassificationDataModule" in data
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    epilog = " ".join(capsys.readouterr().out.split())
    assert all(name in epilog for name in models + data)
    for group, names in (("model", models), ("data", data)):
        for name in names:  # a short name is enough
            with pytest.raises(SystemExit) as info:
                main(["fit", f"--{group}.help", name])
            assert info.value.code == 0, capsys.readouterr().err


@pytest.mark.parametrize("content,pattern", [(None, "not found"), (b"", "not a readable checkpoint"),
                                             (b"PK\x03\x04 truncated", "not a readable checkpoint"),
                                             ("link", "links to gone.ckpt, which does not exist: resume from")])
def test_bad_ckpt_path_is_one_line(tiny, tmp_path, capsys, content, pattern):
    path = tmp_path / "last.ckpt"
    if content == "link":  # last.ckpt linking to a checkpoint removed before the link moved on
        path.symlink_to("gone.ckpt")
    elif content is not None:
        path.write_bytes(content)
    line = _fails(_args(tiny, tmp_path / "runs", "--ckpt_path", str(path)), capsys)
    assert pattern in line
    assert not (tmp_path / "runs").exists()


def test_failure_after_the_trainer_started_leaves_no_run_folder(tiny, tmp_path, capsys):
    import json

    root = tmp_path / "runs"
    args = _args(tiny, root, "--trainer.val_check_interval", "1", "--trainer.callbacks+=EarlyStopping",
                 "--trainer.callbacks.monitor", "no_such_metric", "--trainer.logger", "CSVLogger",
                 "--trainer.logger.save_dir", str(root))
    with pytest.raises(RuntimeError, match="no_such_metric"):
        main(args)
    # the run folder is removed; the privacy its steps spent stays recorded in the ledger, and is said
    assert sorted(p.name for p in root.rglob("*")) == ["privacy_ledger.jsonl"], list(root.rglob("*"))
    [entry] = [json.loads(line) for line in (root / "privacy_ledger.jsonl").read_text().splitlines()]
    assert entry["status"] == "failed" and entry["steps"] >= 1 and not Path(entry["run_folder"]).exists()
    steps = f"{entry['steps']} private step{'s' if entry['steps'] != 1 else ''}"
    assert f"dpl: failed after {steps}; epsilon = {entry['epsilon']:.3f}" in capsys.readouterr().err


def test_run_output_last_ckpt_and_no_noise(tiny, tmp_path, capsys, caplog):
    _, _, headless = tiny
    root = tmp_path / "runs"
    with caplog.at_level("INFO"):
        main(_args(tiny, root, "--trainer.val_check_interval", "3", "--trainer.check_val_every_n_epoch", "null",
                   model=headless))
    out, err = capsys.readouterr()
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines[-1].startswith("dpl: trained 3 private steps"), out  # the summary is the last thing shown
    assert any(line.startswith("dpl: step 1/3") for line in lines), out  # plain progress lines, not a bar
    assert any(line.startswith("dpl: step 3/3") and "epsilon" in line and "examples/s" in line for line in lines)
    assert "\x1b[" not in out + err and "\r" not in out
    everything = out + err + caplog.text
    for noise in ("tensorboardX", "Tip:", "LOAD REPORT", "MISSING", "is_gradient_checkpointing", "LeafSpec",
                  "v_num"):
        assert noise not in everything, noise
    assert caplog.text.count("new classification head classifier.bias, classifier.weight") == 1
    assert len(list(root.rglob("checkpoints/last.ckpt"))) == 1


def test_epoch_description_without_max_epochs():
    assert _epoch_description(SimpleNamespace(max_epochs=-1), 1) == "Epoch 1"
    assert _epoch_description(SimpleNamespace(max_epochs=None), 0) == "Epoch 0"
    assert _epoch_description(SimpleNamespace(max_epochs=3), 1) == "Epoch 1/2"


def test_plain_progress_off_terminal():
    class Pipe:
        def isatty(self):
            return False

    assert isinstance(default_progress_bar(Pipe()), PlainProgress)


def test_classification_data_stays_out_of_the_datasets_cache(tmp_path, monkeypatch):
    import datasets

    from dpl.tasks.data import ClassificationDataModule

    cache = tmp_path / "hf-datasets"
    cache.mkdir()
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    model = save_tiny_bert(tmp_path / "model")
    data = tmp_path / "data"
    write_sentiment_tsv(data / "train.tsv", rows=32)
    write_sentiment_tsv(data / "validation.tsv", rows=8, seed=1)
    (data / "test.jsonl").write_text("".join(f'{{"sentence": "the {w} secret-row-{i}", "label": "positive"}}\n'
                                             for i, w in enumerate(WORDS)))
    module = ClassificationDataModule(tokenizer=model, data_dir=str(data), max_length=16)
    module.setup(None)
    for split in (module.train_set, module.val_set, module.test_set):
        assert len(split) > 0 and split.cache_files == []
    assert not any(cache.rglob("*")), list(cache.rglob("*"))
    assert not any(Path(p).is_file() and b"secret-row" in Path(p).read_bytes()
                   for p in tmp_path.rglob("*") if Path(p).parent != data and Path(p).is_file())


def test_validate_a_run_writes_nothing_and_says_where_the_head_comes_from(tiny, tmp_path, capsys, caplog):
    _, _, headless = tiny
    root = tmp_path / "runs"
    main(_args(tiny, root, model=headless))
    capsys.readouterr()
    ckpt = next(root.rglob("checkpoints/last.ckpt"))
    before = sorted(p for p in root.rglob("*"))
    import warnings

    with caplog.at_level("INFO"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main(["validate", *_args(tiny, root, "--ckpt_path", str(ckpt), model=headless)[1:]])
    out, err = capsys.readouterr()
    shown = err + " ".join(str(w.message) for w in caught)
    assert "val_acc" in out and "dirpath has changed" not in shown and "callbacks used to create" not in shown
    assert sorted(p for p in root.rglob("*")) == before  # no version_1, no config.yaml, no checkpoint
    assert "new classification head classifier.bias, classifier.weight (not in" in caplog.text
    assert "weights from the checkpoint" in caplog.text and "trained under DP" not in caplog.text


def test_plain_progress_while_validating():
    import io

    stream = io.StringIO()
    bar = PlainProgress(interval=0.0, stream=stream)
    trainer = SimpleNamespace(sanity_checking=False, num_val_batches=[3])
    bar.on_validation_start(trainer, None)
    bar.on_validation_batch_end(trainer, None, None, None, 0)
    assert stream.getvalue().startswith("dpl: validating: batch 1/3 after ")


def test_plain_progress_says_when_a_validation_of_fit_starts(monkeypatch):
    import io

    from dpl.lightning import progress

    monkeypatch.setattr(progress, "_step", lambda trainer, module: 40)
    stream = io.StringIO()
    bar = PlainProgress(interval=60.0, stream=stream)
    fit = SimpleNamespace(sanity_checking=False, num_val_batches=[16], state=SimpleNamespace(fn="fit"))
    bar.on_validation_start(fit, None)
    assert stream.getvalue() == "dpl: validating after step 40: 16 batches\n"
    for quiet in (SimpleNamespace(sanity_checking=True, num_val_batches=[2], state=SimpleNamespace(fn="fit")),
                  SimpleNamespace(sanity_checking=False, num_val_batches=[2], state=SimpleNamespace(fn="validate"))):
        bar.on_validation_start(quiet, None)
    assert stream.getvalue().count("\n") == 1  # not for the sanity check, nor for dpl validate


def test_dpl_info_lines_once_per_run(caplog, monkeypatch):
    import logging

    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    from dpl.messages import _rank_zero_info

    record = logging.LogRecord("dpl", logging.INFO, __file__, 1, "dpl: N=10", None, None)
    warning = logging.LogRecord("dpl", logging.WARNING, __file__, 1, "dpl: careful", None, None)
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    assert not _rank_zero_info(record) and _rank_zero_info(warning)
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    assert _rank_zero_info(record)


def test_no_gguf_bar_off_a_terminal(monkeypatch):
    import io
    import sys

    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from dpl.tasks.loading import _no_gguf_bar_in_logs

    original = gguf_utils.tqdm
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with _no_gguf_bar_in_logs():
        assert gguf_utils.tqdm([1]).disable
    assert gguf_utils.tqdm is original
