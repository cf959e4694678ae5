"""tuning study on the quickstart: a naive grid, private tuning or the planner, at equal total epsilon.

The task as ``dpl fit --config configs/quickstart.yaml`` trains it: MiniLM (all-MiniLM-L6-v2) + LoRA r 1 on
query/value + a new head, N = 50,000 generated rows, B = 512 (Poisson), 40 steps, AdamW, C = 1, delta = 0.1 / N;
every training run is one ``dpl fit`` of that config with sigma given (``privacy.noise_multiplier``) or the target
epsilon, the learning rate, ``privacy.seed`` and ``seed_everything`` set per run. The 1,000 generated validation
rows score the runs (the split ``dpl tune`` scores with, treated as public); 1,000 further generated rows, disjoint
from the training and validation rows, are the test set the table reports (``dpl predict`` on each run). Total
epsilon 8 (the quickstart's). The methods and their privacy are those of ``tuning.py`` (its docstring):

* **grid (honest)**: lr in GRID, the best by validation released, sigma such that the composition of the grid's
  runs spends 8;
* **tuned**: K ~ Poisson(mu = |GRID|) trials (Papernot & Steinke), lrs uniform from GRID, sigma such that the tuned
  release spends 8 (K = 0 releases nothing: the untrained zero head, which predicts the first label);
* **planner**: one run at the batch size and steps ``dpl plan`` recommends (:func:`dpl.planning.quick.quick_plan`;
  for the quickstart: keep B = 512 and 40 steps) with the config's lr, at the whole epsilon;
* **grid at one run's epsilon** (reference, NOT private at 8): the best of the grid, each run at one run's sigma
  for 8 (a run with the planner's settings is shared with the planner).

K and the trials' lrs come from a seeded generator (``dpl tune`` draws them from OS entropy). Results are written
after every seed; ``--resume`` keeps the seeds of a file with the same settings.

    python benchmarks/studies/tuning_quickstart.py --seeds 0 1 2 --resume
    python benchmarks/studies/tuning_quickstart.py --quick     # 1 step of 300 rows per run (the test)
"""

from __future__ import annotations

import csv
import functools
import json
import random
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import tuning
from common import save, study_parser

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "quickstart.yaml"
GRID = [0.005, 0.02, 0.08]
DEFAULT_LR = 0.02  # the config's
EPSILON = 8.0
SETTINGS = {"train_size": 50_000, "validation_size": 1_000, "test_size": 1_000, "batch_size": 512, "steps": 40,
            "grid": GRID, "epsilon": EPSILON}
QUICK = {"train_size": 300, "validation_size": 40, "test_size": 40, "batch_size": 32, "steps": 1,
         "grid": [0.02, 0.08], "epsilon": EPSILON}


def test_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """``test_size`` generated rows in neither the training nor the validation split: the generator drawn for a
    larger validation split (it draws the training rows first, then new sentences, each once, and shuffles each
    split afterwards), less the rows of the real validation split."""
    return _generated(s["train_size"], s["validation_size"], s["test_size"])


@functools.lru_cache(maxsize=2)
def _generated(train: int, validation: int, test: int) -> list[tuple[str, str]]:
    from dpl.tasks.data.quickstart_gen import SEED, generate

    used = {text for text, _ in generate(SEED, train, validation)["validation"]}
    rows = [r for r in generate(SEED, train, validation + test)["validation"] if r[0] not in used]
    if len(rows) != test:
        raise RuntimeError(f"the generator gave {len(rows)} new rows, not {test}")
    return rows


def _dpl(args: list[str]) -> None:
    """``dpl ARGS`` in this process (the imports are paid once)."""
    from dpl.cli import main

    try:
        main(args)
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise RuntimeError(f"dpl {args[0]} failed ({exc.code})") from exc


def fit(s: dict[str, Any], folder: Path, lr: float, seed: int, *, sigma: float | None = None,
        epsilon: float | None = None, batch: int | None = None, steps: int | None = None) -> dict[str, Any]:
    """One ``dpl fit`` of the quickstart config; its validation accuracy, epsilon and sigma, and the test accuracy
    of ``dpl predict`` (the checkpoints are deleted afterwards)."""
    batch, steps = batch or s["batch_size"], steps or s["steps"]
    per_epoch = max(1, s["train_size"] // batch)
    privacy = {"noise_multiplier": sigma} if sigma is not None else {"target_epsilon": epsilon}
    args = ["fit", "--config", str(CONFIG), "--trainer.default_root_dir", str(folder), "--seed_everything", str(seed),
            "--trainer.max_steps", str(steps), "--trainer.max_epochs", str(-(-steps // per_epoch)),
            "--trainer.limit_train_batches", str(min(steps, per_epoch)), "--trainer.enable_progress_bar", "false",
            "--model.init_args.optimizer.init_args.lr", str(lr), "--model.init_args.privacy.seed", str(seed),
            "--model.init_args.privacy.batch_size", str(batch),
            "--model.init_args.privacy.physical_batch_size", str(min(batch, 128)),
            "--data.init_args.train_size", str(s["train_size"]),
            "--data.init_args.validation_size", str(s["validation_size"])]
    for key, value in privacy.items():
        args += [f"--model.init_args.privacy.{key}", str(value)]
    _dpl(args)
    run = max((folder / "lightning_logs").glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    report = json.loads((run / "privacy.json").read_text())
    with open(run / "metrics.csv") as f:
        val = [float(r["val_acc"]) for r in csv.DictReader(f) if r.get("val_acc")]
    rows = test_rows(s)
    inputs, output = folder / "test.txt", folder / "predictions.jsonl"
    inputs.write_text("".join(text.replace("\n", " ") + "\n" for text, _ in rows))
    _dpl(["predict", str(run), str(inputs), "--output", str(output)])
    predicted = [json.loads(line)["label"] for line in output.read_text().splitlines()]
    test_acc = sum(p == label for p, (_, label) in zip(predicted, rows)) / len(rows)
    shutil.rmtree(run / "checkpoints", ignore_errors=True)  # 2 x 90 MB a run
    return {"lr": lr, "seed": seed, "final": {"tune": {"acc": val[-1]}, "test": {"acc": test_acc}},
            "diverged": False, "sigma": report["noise_multiplier"], "epsilon": report["epsilon"],
            "batch_size": batch, "steps": steps}


def run_seed(s: dict[str, Any], seed: int, sigmas: dict[str, float], plan: dict[str, Any], distribution: Any,
             folder: Path) -> dict[str, Any]:
    """The four methods at the total epsilon for one report seed."""
    target, grid = s["epsilon"], s["grid"]
    chance = sum(label == "negative" for _, label in test_rows(s)) / s["test_size"]

    def train(lr: float, run: int, **over: Any) -> dict[str, Any]:
        return fit(s, folder / f"seed{seed}_run{run}", lr, 1000 * seed + run, **over)

    def method(runs: list[dict[str, Any]], seconds: float, **extra: Any) -> dict[str, Any]:
        best = tuning.best_of(runs)
        acc = best["final"]["test"]["acc"] if best is not None else chance
        return {"test_acc": acc, "lr": best["lr"] if best is not None else None, "seconds": seconds,
                "diverged": 0, **extra}

    out: dict[str, Any] = {"epsilon": target, "seed": seed, "methods": {}}
    t0 = time.perf_counter()
    runs = [train(lr, i, sigma=sigmas["grid"]) for i, lr in enumerate(grid)]
    out["methods"][tuning.METHODS[0]] = method(runs, time.perf_counter() - t0, trials=len(grid),
                                               sigma=sigmas["grid"])
    t0 = time.perf_counter()
    keeps = plan["batch_size"] == s["batch_size"] and plan["steps"] == s["steps"]
    single = {lr: train(lr, 10 + i, epsilon=target) for i, lr in enumerate(grid)}
    out["methods"][tuning.METHODS[3]] = method(list(single.values()), time.perf_counter() - t0, trials=len(grid),
                                               sigma=single[grid[0]]["sigma"],
                                               per_lr_test={f"{lr:g}": r["final"]["test"]["acc"]
                                                            for lr, r in single.items()})
    rng = random.Random(f"tuning-quickstart/{target}/{seed}")
    k = distribution.sample(rng.random)
    lrs = [rng.choice(grid) for _ in range(k)]
    t0 = time.perf_counter()
    runs = [train(lr, 100 + i, sigma=sigmas["tuned"]) for i, lr in enumerate(lrs)]
    out["methods"]["tuned"] = method(runs, time.perf_counter() - t0, trials=k, trial_lrs=lrs, sigma=sigmas["tuned"])
    t0 = time.perf_counter()
    if keeps and DEFAULT_LR in single:  # the same settings as the reference's run at the config's lr
        run, shared = single[DEFAULT_LR], True
    else:
        run, shared = train(DEFAULT_LR, 200, epsilon=target, batch=plan["batch_size"], steps=plan["steps"]), False
    out["methods"]["planner"] = method([run], time.perf_counter() - t0, trials=1, sigma=run["sigma"],
                                       epsilon_spent=run["epsilon"], shared_with_reference=shared)
    return out


def recommended(s: dict[str, Any]) -> dict[str, Any]:
    """``dpl plan``'s recommendation for the quickstart at these settings."""
    from dpl.planning.quick import quick_plan

    report = quick_plan(["--config", str(CONFIG), "--model.init_args.privacy.batch_size", str(s["batch_size"]),
                         "--trainer.max_steps", str(s["steps"]), "--data.init_args.train_size", str(s["train_size"]),
                         "--data.init_args.validation_size", str(s["validation_size"])])
    if report is None:
        raise RuntimeError("dpl plan's quick path refused the quickstart config")
    best = report.recommended or report.current
    return {"batch_size": best.batch_size, "steps": best.steps, "why": report.why}


def main() -> None:
    parser = study_parser(__doc__)
    parser.add_argument("--resume", action="store_true", help="keep the seeds of the results file")
    parser.add_argument("--runs", type=Path, default=Path("runs/tuning_quickstart"), help="folder of the runs")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the training runs")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="privacy.seed is set")  # a seeded run is an experiment
    s = dict(QUICK if args.quick else SETTINGS)
    seeds = args.seeds[:1] if args.quick else args.seeds
    n, target, grid = s["train_size"], s["epsilon"], s["grid"]
    rate, steps, delta = s["batch_size"] / n, s["steps"], 0.1 / n
    from dpl.core.accounting import calibrate_noise_multiplier, tuning as accounting

    distribution = accounting.poisson(float(len(grid)))
    sigmas = {"grid": tuning.grid_sigma(target, delta, rate, steps, len(grid)),
              "tuned": tuning.tuned_sigma(target, delta, rate, steps, distribution)}
    single = calibrate_noise_multiplier(target, delta, rate, steps)
    plan = recommended(s)
    settings = {**s, "delta": delta, "sample_rate": rate, "lr_grid": grid, "default_lr": DEFAULT_LR,
                "distribution": distribution.describe(), "epsilons": [target], "quick": args.quick,
                "accountant": "prv (grid, planner); rdp (tuned)"}
    name = "tuning_quickstart" + ("_quick" if args.quick else "")
    path = args.out / f"{name}.json"
    old = json.loads(path.read_text()) if args.resume and path.is_file() else None
    if old is not None and {k: v for k, v in old["settings"].items() if k != "seeds"} != json.loads(json.dumps(settings)):
        print(f"{path}: other settings, not resumed", flush=True)
        old = None
    cells = [c for c in old["cells"] if c["seed"] in seeds] if old else []
    privacy = {
        tuning.METHODS[0]: {"sigma": sigmas["grid"],
                            "per_run_epsilon": tuning.one_run_epsilon(sigmas["grid"], delta, rate, steps),
                            "total_epsilon": tuning.one_run_epsilon(sigmas["grid"], delta, rate, len(grid) * steps)},
        "tuned": {"sigma": sigmas["tuned"],
                  "per_run_epsilon": tuning.one_run_epsilon(sigmas["tuned"], delta, rate, steps),
                  "total_epsilon": tuning.tuned_total(sigmas["tuned"], delta, rate, steps, distribution)},
        tuning.METHODS[3]: {"sigma": single, "per_run_epsilon": tuning.one_run_epsilon(single, delta, rate, steps),
                            "total_epsilon": tuning.one_run_epsilon(single, delta, rate, len(grid) * steps)},
    }
    print(f"{name}: grid sigma {sigmas['grid']:.3f}, tuned sigma {sigmas['tuned']:.3f}, one run's {single:.3f}; "
          f"planner: B = {plan['batch_size']}, {plan['steps']} steps ({plan['why']})", flush=True)
    start = time.perf_counter()
    results: dict[str, Any] = {"settings": settings, "cells": cells}
    for seed in seeds:
        if any(c["seed"] == seed for c in cells):
            continue
        cell = run_seed(s, seed, sigmas, plan, distribution, args.runs)
        cell.update(privacy=privacy, planner=plan)
        cells.append(cell)
        results["settings"]["seeds"] = sorted(c["seed"] for c in cells)
        save(name, results, args.out)
        print(f"[{time.perf_counter() - start:5.0f} s] seed {seed}: "
              + ", ".join(f"{m} {cell['methods'][m]['test_acc'] * 100:.1f}" for m in tuning.METHODS)
              + f" (K = {cell['methods']['tuned']['trials']})", flush=True)
    results["settings"]["seeds"] = sorted(c["seed"] for c in cells)
    results["summary"] = tuning.summary(results)
    results["paired"] = tuning.paired(results)
    results["single_run_by_lr"] = tuning.single_run_by_lr(results)
    save(name, results, args.out)
    print(tuning.table(results))


if __name__ == "__main__":
    main()
