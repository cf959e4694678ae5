"""tuning study: which to pick, a naive grid, private tuning (``dpl tune``) or the planner, at equal total epsilon.

Setting: SST-2, frozen MiniLM features (384-d), a linear head, N = 8,192 training rows, 2,048 held-out training rows
score the trials (the "validation" split, treated as public, as ``dpl tune`` does), the GLUE validation set (872
rows) is what the table reports. DP-SGD, SGD momentum 0.9, B = 256 (Poisson, q = B/N), 3 epochs (96 steps),
C = 1, delta = 1/(10 N), add/remove adjacency. The search space is a learning-rate grid. Every method spends the
same *total* epsilon, for the release of one model:

* **grid (honest)**: every lr of the grid trained, the best by validation score released; each run's sigma is
  calibrated so that the composition of all the grid's runs (dpl's PRV accountant over G x T steps) is the target.
* **tuned**: Papernot & Steinke, "Hyperparameter tuning with Rényi differential privacy" (ICLR 2022), as ``dpl tune``
  runs it: K ~ Poisson(mu) trials (Theorem 6; K = 0 releases nothing: the untrained, zero head), each an lr drawn
  uniformly from the grid, the best by validation score released; one trial's sigma is solved so that the tuned
  release's epsilon (dpl's :func:`~dpl.core.accounting.tuning.tuned_epsilon`) is the target.
* **planner**: one run, no tuning, at the batch size and steps ``dpl plan``'s functions recommend for this setup
  (:func:`~dpl.planning.alternatives.recommend`), a default lr, the whole target epsilon.
* **grid at one run's epsilon** (reference, NOT private at the stated epsilon): the best of the grid, each run
  calibrated to the target as if it were the only one; its true cost is the composition of all of them.

K and the trials' lrs are drawn from a seeded generator (a reproducible experiment; ``dpl tune`` draws them from OS
entropy). Every training run has its own seed (independent noise and sampling), paired across methods by report
seed.

    python benchmarks/studies/tuning.py            # full study
    python benchmarks/studies/tuning.py --quick    # tiny data, a few steps (the test)
"""

from __future__ import annotations

import math
import random
import statistics
import time
import warnings
from typing import Any

import torch

from common import Head, evaluate, fmt, save, spread, sst2, study_parser, train_private

GRID = [0.01, 0.03, 0.1, 0.3, 1.0, 3.0]
DEFAULT_LR = 0.1  # SGD (momentum 0.9) on a linear head: the planner's run is not tuned
MOMENTUM = 0.9
METHODS = ("grid (honest)", "tuned", "planner", "grid at one run's ε (not private at ε)")


# ------------------------------------------------------------------------------------------------ privacy solving


def grid_sigma(target: float, delta: float, sample_rate: float, steps: int, runs: int) -> float:
    """The sigma of every run of a grid of ``runs`` runs (``steps`` steps each) whose composition (dpl's PRV
    accountant) spends ``target``: one calibration over ``runs x steps`` steps (within 1% below the target)."""
    from dpl.core.accounting import calibrate_noise_multiplier

    return calibrate_noise_multiplier(target, delta, sample_rate, runs * steps)


def tuned_sigma(target: float, delta: float, sample_rate: float, steps: int, distribution: Any) -> float:
    """One trial's sigma such that the best of K ~ ``distribution`` trials (Papernot & Steinke, by dpl's
    :func:`~dpl.core.accounting.tuning.tuned_epsilon` on the trial's RDP curve) spends ``target`` (within 1% below),
    by dpl's sigma search (:func:`~dpl.core.accounting.smallest_noise_multiplier`)."""
    from dpl.core.accounting import smallest_noise_multiplier

    return smallest_noise_multiplier(lambda s: tuned_total(s, delta, sample_rate, steps, distribution), target)


def tuned_total(sigma: float, delta: float, sample_rate: float, steps: int, distribution: Any) -> float:
    """Epsilon of the tuned release at one trial's ``sigma``."""
    from dpl.core.accounting import tuning

    curve = tuning.subsampled_gaussian_rdp([(sigma, sample_rate, steps)])
    return tuning.tuned_epsilon(distribution, tuning.ORDERS, curve, delta)


def one_run_epsilon(sigma: float, delta: float, sample_rate: float, steps: int) -> float:
    """Epsilon of one run at ``sigma`` (dpl's PRV accountant)."""
    from dpl.core.accounting import epsilon_for

    return epsilon_for(sigma, sample_rate, steps, delta)


def planner(data: Any, target: float, delta: float, batch_size: int, steps: int) -> dict[str, Any]:
    """What ``dpl plan``'s functions recommend for a head on ``data`` trained at (``batch_size``, ``steps``) to
    ``target``: the alternatives at the same epsilon and compute, and the row to take (its batch size and steps)."""
    from dpl.core.engine import PrivateEngine
    from dpl.core.privacy import PrivacyConfig
    from dpl.planning.alternatives import alternatives, recommend

    n = len(data.train)
    model = Head(data.train.x.shape[1], data.classes)
    trainable = dict(model.named_parameters())

    def replan(batch: int, planned_steps: int) -> Any:
        privacy = PrivacyConfig(target_epsilon=target, target_delta=delta, max_grad_norm=1.0, batch_size=batch)
        engine = PrivateEngine(privacy, None)
        engine.setup(model, trainable=trainable, num_rows=n, steps=planned_steps,
                     optimizer_factory=lambda p: torch.optim.SGD(p, lr=DEFAULT_LR, momentum=MOMENTUM))
        return engine

    rows, refused = alternatives(replan, replan(batch_size, steps))
    best, why = recommend(rows, replan, n)
    best = best if best is not None else next(r for r in rows if r.current)
    return {"batch_size": best.batch_size, "steps": best.steps, "why": why, "refused": refused,
            "rows": [{"batch_size": r.batch_size, "steps": r.steps, "sigma": r.noise_multiplier,
                      "relative_noise": r.regime.relative_noise if r.regime else None} for r in rows]}


# ------------------------------------------------------------------------------------------------ the methods


def best_of(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The run with the best validation ("tune" split) accuracy, or None if every run diverged."""
    ok = [r for r in runs if not r["diverged"]]
    return max(ok, key=lambda r: r["final"]["tune"]["acc"]) if ok else None


def main() -> None:
    parser = study_parser(__doc__)
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 4.0], help="total epsilons")
    parser.add_argument("--trials-mean", type=float, default=None, help="mu of K ~ Poisson (default: the grid size)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.set_defaults(seeds=list(range(10)))  # K is random: more seeds than the other studies
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="privacy.seed is set")  # a seeded run is an experiment
    start = time.perf_counter()
    grid, batch = GRID, 256
    if args.quick:
        data, batch, grid, args.epsilons = sst2(512, 256, quick=True), 64, [0.1, 1.0], [4.0]
        args.seeds = args.seeds[:1]
    else:
        data = sst2(8192, 2048)
    n = len(data.train)
    steps, rate, delta = args.epochs * (n // batch), batch / n, 1.0 / (10 * n)
    mu = args.trials_mean or float(len(grid))
    from dpl.core.accounting import calibrate_noise_multiplier, tuning as accounting

    distribution = accounting.poisson(mu)
    name = "tuning_quick" if args.quick else "tuning"
    results: dict[str, Any] = {
        "settings": {"train": n, "tune": len(data.tune), "test": len(data.test), "batch_size": batch, "steps": steps,
                     "sample_rate": rate, "delta": delta, "momentum": MOMENTUM, "lr_grid": grid,
                     "default_lr": DEFAULT_LR, "distribution": distribution.describe(), "epsilons": args.epsilons,
                     "seeds": args.seeds, "quick": args.quick, "accountant": "prv (grid, planner); rdp (tuned)"},
        "cells": []}
    for target in args.epsilons:
        sigmas = {"grid": grid_sigma(target, delta, rate, steps, len(grid)),
                  "tuned": tuned_sigma(target, delta, rate, steps, distribution)}
        plan = planner(data, target, delta, batch, steps)
        single = calibrate_noise_multiplier(target, delta, rate, steps)
        privacy = {
            METHODS[0]: {"sigma": sigmas["grid"],
                         "per_run_epsilon": one_run_epsilon(sigmas["grid"], delta, rate, steps),
                         "total_epsilon": one_run_epsilon(sigmas["grid"], delta, rate, len(grid) * steps)},
            "tuned": {"sigma": sigmas["tuned"], "per_run_epsilon": one_run_epsilon(sigmas["tuned"], delta, rate, steps),
                      "total_epsilon": tuned_total(sigmas["tuned"], delta, rate, steps, distribution)},
            METHODS[3]: {"sigma": single, "per_run_epsilon": one_run_epsilon(single, delta, rate, steps),
                         "total_epsilon": one_run_epsilon(single, delta, rate, len(grid) * steps)},
        }
        print(f"[{time.perf_counter() - start:5.0f} s] eps={target:g}: grid sigma {sigmas['grid']:.3f} (one run "
              f"eps {privacy['grid (honest)']['per_run_epsilon']:.3f}), tuned sigma {sigmas['tuned']:.3f} (one trial "
              f"eps {privacy['tuned']['per_run_epsilon']:.3f}); planner: B={plan['batch_size']} T={plan['steps']}: "
              f"{plan['why']}", flush=True)
        for seed in args.seeds:
            cell = run_cell(data, target, seed, grid, batch, steps, sigmas, plan, distribution)
            cell["privacy"] = privacy
            cell["planner"] = plan
            results["cells"].append(cell)
            save(name, results, args.out)
            print(f"[{time.perf_counter() - start:5.0f} s] eps={target:g} seed {seed}: "
                  + ", ".join(f"{m} {cell['methods'][m]['test_acc'] * 100:.1f}" for m in METHODS)
                  + f" (K = {cell['methods']['tuned']['trials']})", flush=True)
    results["summary"] = summary(results)
    results["paired"] = paired(results)
    results["single_run_by_lr"] = single_run_by_lr(results)
    results["seconds"] = time.perf_counter() - start
    save(name, results, args.out)
    print(table(results))


def run_cell(data: Any, target: float, seed: int, grid: list[float], batch: int, steps: int,
             sigmas: dict[str, float], plan: dict[str, Any], distribution: Any) -> dict[str, Any]:
    """The four methods at total epsilon ``target`` for one report seed."""
    common = {"batch_size": batch, "steps": steps, "optimizer": "sgd", "momentum": MOMENTUM,
              "evaluate_on": {"tune": data.tune, "test": data.test}}

    def train(lr: float, run: int, **over: Any) -> dict[str, Any]:
        return train_private(data.train, data.classes, **{**common, **over}, lr=lr, seed=1000 * seed + run)

    def method(runs: list[dict[str, Any]], seconds: float, **extra: Any) -> dict[str, Any]:
        best = best_of(runs)
        acc = best["final"]["test"]["acc"] if best is not None else chance(data)
        return {"test_acc": acc, "lr": best["lr"] if best is not None else None, "seconds": seconds,
                "diverged": sum(r["diverged"] for r in runs), **extra}

    out: dict[str, Any] = {"epsilon": target, "seed": seed, "methods": {}}
    for label, sigma in (("grid (honest)", sigmas["grid"]), (METHODS[3], None)):
        t0 = time.perf_counter()
        over = {"noise_multiplier": sigma} if sigma is not None else {"epsilon": target}
        runs = [{**train(lr, i, **over), "lr": lr} for i, lr in enumerate(grid)]
        out["methods"][label] = method(runs, time.perf_counter() - t0, trials=len(grid), sigma=runs[0]["sigma"],
                                       per_lr_test={f"{r['lr']:g}": r["final"].get("test", {}).get("acc")
                                                    for r in runs})
    rng = random.Random(f"tuning/{target}/{seed}")  # seeded: a reproducible experiment (dpl tune: OS entropy)
    k = distribution.sample(rng.random)
    lrs = [rng.choice(grid) for _ in range(k)]
    t0 = time.perf_counter()
    runs = [{**train(lr, 100 + i, noise_multiplier=sigmas["tuned"]), "lr": lr} for i, lr in enumerate(lrs)]
    out["methods"]["tuned"] = method(runs, time.perf_counter() - t0, trials=k, trial_lrs=lrs, sigma=sigmas["tuned"])
    t0 = time.perf_counter()
    run = {**train(DEFAULT_LR, 200, epsilon=target, batch_size=plan["batch_size"], steps=plan["steps"]),
           "lr": DEFAULT_LR}
    out["methods"]["planner"] = method([run], time.perf_counter() - t0, trials=1, sigma=run["sigma"],
                                       epsilon_spent=run["epsilon"])
    return out


def chance(data: Any) -> float:
    """Test accuracy of releasing nothing: the untrained head (zero weights: it predicts class 0)."""
    return evaluate(Head(data.test.x.shape[1], data.classes), data.test)["acc"]


def summary(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (total epsilon, method): test accuracy over seeds, trials drawn, one run's epsilon, seconds."""
    out = []
    for target in results["settings"]["epsilons"]:
        cells = [c for c in results["cells"] if c["epsilon"] == target]
        for m in METHODS:
            rows = [c["methods"][m] for c in cells]
            privacy = cells[0]["privacy"].get(m) if cells else None
            out.append({"epsilon": target, "method": m, "acc": spread([r["test_acc"] for r in rows]),
                        "trials": [r["trials"] for r in rows], "lrs": [r["lr"] for r in rows],
                        "sigma": statistics.fmean(r["sigma"] for r in rows) if rows else math.nan,
                        "per_run_epsilon": privacy["per_run_epsilon"] if privacy else
                        (statistics.fmean(r.get("epsilon_spent", target) for r in rows) if rows else math.nan),
                        "total_epsilon": privacy["total_epsilon"] if privacy else target,
                        "seconds": statistics.fmean(r["seconds"] for r in rows) if rows else math.nan})
    return out


def paired(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per total epsilon and method: its test accuracy minus the honest grid's, seed by seed (wins / seeds)."""
    out = []
    for target in results["settings"]["epsilons"]:
        cells = [c for c in results["cells"] if c["epsilon"] == target]
        for m in METHODS[1:]:
            diffs = [c["methods"][m]["test_acc"] - c["methods"][METHODS[0]]["test_acc"] for c in cells]
            out.append({"epsilon": target, "method": m, "diffs": diffs, "wins": sum(d > 0 for d in diffs),
                        "losses": sum(d < 0 for d in diffs), "mean": statistics.fmean(diffs) if diffs else math.nan})
    return out


def single_run_by_lr(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per total epsilon and lr of the grid: the test accuracy of one run at the whole epsilon (the reference's
    runs: what the planner's single run would give with that lr as its default, when it keeps the batch size)."""
    out = []
    for target in results["settings"]["epsilons"]:
        cells = [c for c in results["cells"] if c["epsilon"] == target]
        for lr in results["settings"]["lr_grid"]:
            accs = [c["methods"][METHODS[3]]["per_lr_test"][f"{lr:g}"] for c in cells]
            out.append({"epsilon": target, "lr": lr, "acc": spread([a for a in accs if a is not None])})
    return out


def table(results: dict[str, Any]) -> str:
    s = results["settings"]
    lines = [f"| total ε | method | test acc % (mean ± sd, {len(s['seeds'])} seeds) | trials: mean (min-max) | σ | "
             "one run's ε | lr released (seeds) | s per seed |", "|---|---|---|---|---|---|---|---|"]
    for r in results["summary"]:
        total = f"{r['epsilon']:g}" if r["method"] != METHODS[3] else \
            f"{r['epsilon']:g} claimed, {r['total_epsilon']:.3g} true"
        lrs = ", ".join(f"{'nothing' if v is None else f'{v:g}'} x{r['lrs'].count(v)}"
                        for v in sorted(set(r["lrs"]), key=lambda v: -1 if v is None else v))
        k = r["trials"]
        trials = f"{k[0]}" if len(set(k)) == 1 else f"{statistics.fmean(k):.1f} ({min(k)}-{max(k)})"
        lines.append(f"| {total} | {r['method']} | {fmt(r['acc'])} | {trials} | "
                     f"{r['sigma']:.3f} | {r['per_run_epsilon']:.3f} | {lrs} | {r['seconds']:.0f} |")
    lines += ["", "| total ε | method | minus the honest grid, points (mean) | wins / losses |", "|---|---|---|---|"]
    lines += [f"| {p['epsilon']:g} | {p['method']} | {100 * p['mean']:+.1f} | {p['wins']} / {p['losses']} |"
              for p in results["paired"]]
    eps = s["epsilons"]
    lines += ["", "| lr | " + " | ".join(f"one run at ε = {e:g}" for e in eps) + " |", "|---|" + "---|" * len(eps)]
    for lr in s["lr_grid"]:
        lines.append(f"| {lr:g} | " + " | ".join(fmt(r["acc"]) for e in eps for r in results["single_run_by_lr"]
                                                 if r["epsilon"] == e and r["lr"] == lr) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
