"""Off a terminal (a log file, CI), `dpl fit` prints a one-line model summary instead of Lightning's box-drawn table."""

from __future__ import annotations

import pytest
from helpers import tiny_classification_workspace

from dpl.cli import main
from dpl.lightning.progress import PlainModelSummary, default_model_summary

TABLE_MARKS = ("┃", "┏", "│", "Total params", "Trainable params", "Skipping setting a default")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_classification_workspace(tmp_path_factory.mktemp("summary"), rows=32, val_rows=8)


def _fit(tiny, root, *extra):
    tmp, model = tiny
    main(["fit", "--model", "dpl.tasks.modules.DPClassificationModule", "--model.model", model,
          "--model.privacy.target_epsilon", "4", "--model.privacy.batch_size", "8",
          "--model.privacy.physical_batch_size", "8", "--data", "dpl.tasks.data.ClassificationDataModule",
          "--data.tokenizer", model, "--data.data_dir", str(tmp / "data"), "--data.max_length", "16",
          "--trainer.max_steps", "1", "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(root),
          "--trainer.enable_checkpointing", "false", "--trainer.logger", "false", *extra])


def test_redirected_output_has_one_plain_summary_line(tiny, tmp_path, capsys, caplog):
    with caplog.at_level("INFO"):
        _fit(tiny, tmp_path / "runs")
    out, err = capsys.readouterr()
    everything = out + err + caplog.text
    for mark in TABLE_MARKS:
        assert mark not in everything, mark
    lines = [line for line in out.splitlines() if line.startswith("dpl: model ")]
    assert len(lines) == 1, out
    assert "parameters" in lines[0] and "trainable" in lines[0], lines[0]


def test_no_summary_when_disabled(tiny, tmp_path, capsys):
    _fit(tiny, tmp_path / "runs", "--trainer.enable_model_summary", "false")
    assert "dpl: model " not in capsys.readouterr().out


def test_summary_kind_follows_the_stream():
    class Stream:
        def __init__(self, tty):
            self.tty = tty

        def isatty(self):
            return self.tty

    assert default_model_summary(Stream(True)) is None  # a terminal: Lightning's own table
    assert isinstance(default_model_summary(Stream(False)), PlainModelSummary)
