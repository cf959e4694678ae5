"""On a CUDA GPU (skipped without one; ``pytest -m gpu``): a 3-step private fit of the tiny classifier in bf16-mixed
and in 32-true that reports its epsilon, then predict and export of that run, whose export reloads with transformers
and gives the run's logits. ``dpl audit`` takes no device (its game runs on the CPU), so it has no GPU test."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from helpers import tiny_classification_workspace

from dpl.cli import main
from dpl.trained.predict import predict
from dpl.trained.runs import load_run

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)")]

TEXTS = ["the movie was very good", "the plot was awful", "a story"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_classification_workspace(tmp_path_factory.mktemp("gpu"), rows=96, val_rows=16)


def cuda_fit(tmp: Path, model: str, precision: str, capsys) -> tuple[Path, float]:
    """3 private steps on one GPU; the run folder and the epsilon of the summary line."""
    root = tmp / f"runs_{precision}"
    main(["fit", "--model", "dpl.tasks.modules.DPClassificationModule", "--model.model", model,
          "--model.privacy.target_epsilon", "4", "--model.privacy.batch_size", "16",
          "--data", "dpl.tasks.data.ClassificationDataModule", "--data.tokenizer", model,
          "--data.data_dir", str(tmp / "data"), "--data.max_length", "16",
          "--trainer.accelerator", "gpu", "--trainer.devices", "1", "--trainer.precision", precision,
          "--trainer.max_steps", "3", "--trainer.default_root_dir", str(root),
          "--trainer.enable_progress_bar", "false"])
    out = capsys.readouterr().out
    assert "dpl: trained 3 private steps; privacy spent (epsilon=" in out, out[-2000:]
    epsilon = float(re.search(r"epsilon=([0-9.]+)", out.split("dpl: trained")[-1]).group(1))
    return sorted(root.glob("lightning_logs/version_*"))[-1], epsilon


def exit_code(args: list[str]) -> int:
    try:
        main(args)
    except SystemExit as exc:
        return exc.code or 0
    return 0


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_cuda_fit_reports_epsilon(tiny, precision, capsys):
    run_dir, epsilon = cuda_fit(*tiny, precision, capsys)
    assert 0 < epsilon <= 4.0
    assert (run_dir / "privacy.json").is_file() and (run_dir / "checkpoints" / "last.ckpt").is_file()


def test_cuda_run_predicts_and_exports(tiny, tmp_path, capsys):
    run_dir, _ = cuda_fit(*tiny, "32-true", capsys)
    run = load_run(run_dir)
    rows = predict(run, [{"sentence": t} for t in TEXTS])
    assert all(r["label"] in ("negative", "positive") for r in rows)
    assert all(abs(sum(r["probabilities"].values()) - 1) < 1e-5 for r in rows)
    assert exit_code(["export", str(run_dir), str(tmp_path / "export")]) == 0
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "export").eval()
    batch = AutoTokenizer.from_pretrained(tmp_path / "export")(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        probabilities = hf(**batch).logits.softmax(-1)
    labels = [hf.config.id2label[int(i)] for i in probabilities.argmax(-1)]
    assert labels == [r["label"] for r in rows]
