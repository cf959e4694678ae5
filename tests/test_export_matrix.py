"""Every task x fine-tuning mode after training, on tiny models: fit 2 steps -> dpl predict -> export merged and as
an adapter -> reload with plain transformers / peft -> the same outputs as dpl predict. The classifiers start from
an encoder without a classification head (as real sentence encoders ship), so their head is new and random: what a
run must carry for its head to load anywhere else. Exports a mode cannot make are one line and leave nothing."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from helpers import save_tiny_bert, save_tiny_llama_lm, write_sentiment_tsv

from dpl.cli import main
from dpl.trained.predict import predict
from dpl.trained.runs import load_run

TEXTS = ["the movie was very good", "the plot was awful", "a story"]
PROMPTS = [{"prompt": "name : aromi , food : italian"}, {"prompt": "name : cotto"}]
LORA = ["--model.finetuning.method", "lora"]
PARTIAL = ["--model.finetuning.freeze", '["*embeddings*"]']


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("matrix")
    bert = Path(save_tiny_bert(tmp / "bert"))
    from transformers import BertModel

    from transformers import BertForMaskedLM

    BertModel.from_pretrained(bert).save_pretrained(tmp / "encoder")  # the encoder alone: no classifier weights
    torch.manual_seed(0)
    BertForMaskedLM(BertModel.from_pretrained(bert).config).save_pretrained(tmp / "mlm")  # a masked LM with its head
    for folder in ("encoder", "mlm"):
        for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (bert / name).is_file():
                (tmp / folder / name).write_bytes((bert / name).read_bytes())
    write_sentiment_tsv(tmp / "cls" / "train.tsv", rows=96)
    write_sentiment_tsv(tmp / "cls" / "validation.tsv", rows=8, seed=1)
    llama = save_tiny_llama_lm(tmp / "llama", tie=True)
    rows = [json.dumps({"prompt": f"name : {['aromi', 'cotto'][i % 2]} , food : italian",
                        "completion": " the restaurant serves italian food ."}) for i in range(48)]
    (tmp / "gen").mkdir()
    (tmp / "gen" / "train.jsonl").write_text("\n".join(rows) + "\n")
    (tmp / "gen" / "validation.jsonl").write_text("\n".join(rows[:2]) + "\n")
    return tmp


def _fit(tmp: Path, root: Path, args: list[str]) -> Path:
    main(["fit", *args, "--model.privacy.target_epsilon", "8", "--model.privacy.batch_size", "16",
          "--trainer.max_steps", "2", "--trainer.limit_val_batches", "1", "--trainer.num_sanity_val_steps", "0",
          "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(root)])
    return sorted(root.glob("lightning_logs/version_*"))[-1]


def _classification(tmp: Path, *extra: str, task: str = "DPClassificationModule",
                    data: str = "ClassificationDataModule") -> list[str]:
    model = str(tmp / "encoder")
    return ["--model", f"dpl.tasks.modules.{task}", "--model.model", model, "--model.optimizer.init_args.lr", "0.05",
            "--data", f"dpl.tasks.data.{data}", "--data.tokenizer", model, "--data.data_dir", str(tmp / "cls"),
            "--data.max_length", "16", *extra]


def _generation(tmp: Path, *extra: str) -> list[str]:
    model = str(tmp / "llama")
    return ["--model", "dpl.tasks.modules.DPGenerationModule", "--model.model", model,
            "--model.generation.max_new_tokens", "4", "--data", "dpl.tasks.data.JSONLDataModule",
            "--data.tokenizer", model, "--data.data_dir", str(tmp / "gen"), *extra]


def _export(run_dir: Path, folder: Path, *flags: str) -> tuple[int, str]:
    import contextlib
    import io

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            main(["export", str(run_dir), str(folder), *flags])
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    return code, err.getvalue()


def _refused(run_dir: Path, folder: Path, *flags: str, says: str) -> None:
    code, err = _export(run_dir, folder, *flags)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("dpl: error:") and says in lines[0], err
    assert not folder.exists() and not list(folder.parent.glob(f".{folder.name}.*"))  # nothing left behind


def _probabilities(rows: list[dict]) -> torch.Tensor:
    return torch.tensor([list(r["probabilities"].values()) for r in rows])


def _reloaded_probabilities(folder: Path, tokenizer, adapter: bool) -> torch.Tensor:
    """Softmax of the export's logits, loaded by plain transformers (merged) or peft (adapter)."""
    from transformers import AutoModelForSequenceClassification

    if adapter:
        from peft import AutoPeftModelForSequenceClassification

        model = AutoPeftModelForSequenceClassification.from_pretrained(folder)
    else:
        model = AutoModelForSequenceClassification.from_pretrained(
            folder, trust_remote_code=(folder / "modeling_dpl.py").is_file())
    batch = tokenizer(TEXTS, truncation=True, max_length=16, padding=True, return_tensors="pt")
    with torch.no_grad():
        return torch.softmax(model.eval()(**batch).logits.float(), dim=-1)


CLASSIFICATION = {  # mode -> (extra fit options, whether an adapter export exists)
    "full": ([], False), "partial": (PARTIAL, False), "lora": (LORA, True),
    "mean full": (["--model.pooling", "mean"], False), "mean lora": (["--model.pooling", "mean", *LORA], False),
}


@pytest.mark.parametrize("mode", list(CLASSIFICATION))
def test_classification_predicts_and_exports(workspace, tmp_path, capsys, mode):
    extra, has_adapter = CLASSIFICATION[mode]
    run_dir = _fit(workspace, tmp_path / "runs", _classification(workspace, *extra))
    capsys.readouterr()
    run = load_run(run_dir)
    rows = predict(run, [{"sentence": t} for t in TEXTS])
    assert all(r["label"] in ("negative", "positive") for r in rows)
    expected = _probabilities(rows)
    assert not torch.equal(expected[0], expected[1])  # the outputs depend on the input

    merged = tmp_path / "merged"
    assert _export(run_dir, merged)[0] == 0
    torch.testing.assert_close(_reloaded_probabilities(merged, run.tokenizer, False), expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(_probabilities(predict(load_run(merged), [{"sentence": t} for t in TEXTS])), expected,
                               atol=1e-5, rtol=1e-4)
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in merged.iterdir()}  # shareable, weights included
    assert modes == {p.name: (0o755 if p.is_dir() else 0o644) & ~umask for p in merged.iterdir()}
    assert "from_pretrained" in (merged / "README.md").read_text()

    adapter = tmp_path / "adapter"
    if not has_adapter:
        _refused(run_dir, adapter, "--adapter", says="--adapter")
        return
    assert _export(run_dir, adapter, "--adapter")[0] == 0
    # the base named in adapter_config.json loads as is (the new head and the labels, as trained)
    base = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert Path(base) == (adapter / "base").resolve() and (Path(base) / "config.json").is_file()
    torch.testing.assert_close(_reloaded_probabilities(adapter, run.tokenizer, True), expected, atol=1e-5, rtol=1e-4)
    moved = tmp_path / "moved"
    adapter.rename(moved)  # a moved adapter folder still finds its base with dpl predict
    torch.testing.assert_close(_probabilities(predict(load_run(moved), [{"sentence": t} for t in TEXTS])), expected,
                               atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("mode", ["full", "lora", "mlm_head"])
def test_prompt_classification_predicts_and_exports(workspace, tmp_path, capsys, mode):
    from transformers import AutoModelForSequenceClassification

    from dpl.tasks.data.prompt import render_ids

    extra = {"full": [], "lora": LORA, "mlm_head": ["--model.decoder", "mlm_head"]}[mode]
    model = workspace / ("mlm" if mode == "mlm_head" else "encoder")
    args = _classification(workspace, "--model.label_words", "[bad, good]", "--data.template",
                           "{sentence} it was [MASK] .", *extra, task="DPPromptClassificationModule",
                           data="PromptClassificationDataModule")
    args[args.index("--model.model") + 1] = args[args.index("--data.tokenizer") + 1] = str(model)
    run_dir = _fit(workspace, tmp_path / "runs", args)
    capsys.readouterr()
    run = load_run(run_dir)
    rows = predict(run, [{"sentence": t} for t in TEXTS])
    assert all(r["label"] in ("negative", "positive") for r in rows)
    expected = _probabilities(rows)

    merged = tmp_path / "merged"
    assert _export(run_dir, merged)[0] == 0
    hf = AutoModelForSequenceClassification.from_pretrained(merged, trust_remote_code=True).eval()
    ids = [{"input_ids": render_ids(run.tokenizer, "{sentence} it was [MASK] .", t, 16)} for t in TEXTS]
    with torch.no_grad():
        got = torch.softmax(hf(**run.tokenizer.pad(ids, return_tensors="pt")).logits.float(), dim=-1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(_probabilities(predict(load_run(merged), [{"sentence": t} for t in TEXTS])), expected,
                               atol=1e-5, rtol=1e-4)
    _refused(run_dir, tmp_path / "adapter", "--adapter", says="merged only")


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_generation_predicts_and_exports(workspace, tmp_path, capsys, mode):
    from transformers import AutoModelForCausalLM

    extra = [*LORA, "--model.finetuning.lora.target_modules", "[q_proj, v_proj]"] if mode == "lora" else []
    run_dir = _fit(workspace, tmp_path / "runs", _generation(workspace, *extra))
    capsys.readouterr()
    run = load_run(run_dir)
    rows = predict(run, PROMPTS)
    ids = run.tokenizer([PROMPTS[0]["prompt"]], return_tensors="pt")
    with torch.no_grad():
        want = run.module.model(**ids).logits

    merged = tmp_path / "merged"
    assert _export(run_dir, merged)[0] == 0
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(merged).eval()(**ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert predict(load_run(merged), PROMPTS) == rows
    snippet = re.search(r"```python\n(.*?)```", (merged / "README.md").read_text(), flags=re.S).group(1)
    assert "data.prompt_template '{prompt}'" in snippet and "data.max_length" in snippet
    scope: dict = {}
    exec(snippet.replace("path/to/this/folder", str(merged)).replace('"..."', repr(PROMPTS[0]["prompt"])), scope)
    assert torch.equal(scope["ids"], ids["input_ids"])  # the README's inputs are those the model was trained on

    adapter = tmp_path / "adapter"
    if mode != "lora":
        _refused(run_dir, adapter, "--adapter", says="LoRA")
        return
    assert _export(run_dir, adapter, "--adapter")[0] == 0
    from peft import AutoPeftModelForCausalLM

    with torch.no_grad():
        got = AutoPeftModelForCausalLM.from_pretrained(adapter).eval()(**ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert predict(load_run(adapter), PROMPTS) == rows
    assert re.search(r"PeftModel\.from_pretrained", (adapter / "README.md").read_text())


def test_export_into_a_non_empty_folder_is_one_line(workspace, tmp_path, capsys):
    run_dir = _fit(workspace, tmp_path / "runs", _generation(workspace))
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    code, err = _export(run_dir, tmp_path / "taken")
    assert code == 2 and "not empty" in err and len(err.strip().splitlines()) == 1
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["file"]


@pytest.mark.slow
def test_e2e_run_on_the_gguf_base_exports_merged_and_as_adapter(tmp_path, capsys):
    """SmolLM2-135M-Instruct read from its GGUF file (dequantized to float32 on load): the merged export is an
    ordinary safetensors model, and the adapter's base is saved beside it; both reload with plain transformers /
    peft and give the run's logits."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    root = Path(__file__).resolve().parents[1]
    configs = [str(root / "configs" / c) for c in ("e2e/dpsgd.yaml", "smoke.yaml", "e2e/smoke.yaml")]
    main(["fit", *[a for c in configs for a in ("--config", c)],
          "--data.train_file", str(root.parent / "shared" / "data" / "e2e" / "devset.csv"),
          "--model.privacy.batch_size", "4", "--model.privacy.physical_batch_size", "4", "--trainer.max_steps", "1",
          "--trainer.limit_val_batches", "0", "--trainer.enable_checkpointing", "true",
          "--trainer.precision", "32-true", "--trainer.default_root_dir", str(tmp_path / "runs")])
    capsys.readouterr()
    run_dir = sorted((tmp_path / "runs").glob("lightning_logs/version_*"))[-1]
    run = load_run(run_dir)
    ids = run.tokenizer(["Table: name[The Eagle], food[French]\nSentence:"], return_tensors="pt")
    with torch.no_grad():
        want = run.module.model(**ids).logits
    for flags, auto in (([], AutoModelForCausalLM), (["--adapter"], AutoPeftModelForCausalLM)):
        folder = tmp_path / ("adapter" if flags else "merged")
        assert _export(run_dir, folder, *flags)[0] == 0
        config = json.loads(((folder / "base") if flags else folder).joinpath("config.json").read_text())
        assert "quantization_config" not in config  # an ordinary model, not a GGUF reference
        with torch.no_grad():
            got = auto.from_pretrained(folder).eval()(**ids).logits
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
