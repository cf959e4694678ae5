"""examples/sft_chat.py, run as docs/from-trainer.md shows it, on a tiny chat model: it trains privately through
SFTTrainer, logs epsilon to MLflow (file store), and its saved folder reloads in plain transformers + peft with the
trained model's outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("mlflow")

ROOT = Path(__file__).resolve().parents[1]


def test_the_example_trains_logs_epsilon_to_mlflow_and_reloads(tmp_path):
    from helpers import tiny_llama_lm
    from peft import PeftModel
    from test_data_chat import make_chat_tokenizer
    from transformers import AutoModelForCausalLM

    model = tmp_path / "tiny"
    tokenizer = make_chat_tokenizer()
    tokenizer.save_pretrained(model)
    tiny_llama_lm(vocab_size=len(tokenizer), tie=True).save_pretrained(model)
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "sft_chat.py"), "--model", str(model), "--steps",
                          "3", "--output", str(out), "--mlflow"], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "dpl: trained 3 private steps through SFTTrainer; epsilon = " in run.stdout
    report = json.loads((out / "privacy.json").read_text())
    assert report["steps_taken"] == 3 and report["run"]["status"] == "finished" and 0 < report["epsilon"] <= 8.0
    logged = list((out / "mlruns").rglob("metrics/epsilon"))
    assert logged, "epsilon did not reach MLflow"
    values = [float(line.split()[1]) for line in logged[0].read_text().splitlines()]
    assert values[-1] == pytest.approx(report["epsilon"], rel=1e-6)

    base = AutoModelForCausalLM.from_pretrained(model)
    reloaded = PeftModel.from_pretrained(base, out).eval()
    ids = torch.tensor([tokenizer("<|im_start|> user what is red <|im_end|>")["input_ids"]])
    fresh = AutoModelForCausalLM.from_pretrained(model).eval()
    with torch.no_grad():
        assert not torch.equal(reloaded(input_ids=ids).logits, fresh(input_ids=ids).logits)  # the adapters trained
        assert torch.equal(reloaded.merge_and_unload()(input_ids=ids).logits.argmax(-1),
                           PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), out).eval()
                           (input_ids=ids).logits.argmax(-1))
