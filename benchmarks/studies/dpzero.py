"""dpzero study: a dimension sweep at a fixed effective rank - MeZO, DPZero (epsilon 2, 6), DPGD-0th, DP-SGD.

Zhang, Li, Thekumparampil, Oh & He, "DPZero: private fine-tuning of language models without backpropagation"
(ICML 2024) claim that DPZero's error depends on the problem's effective rank, not on its dimension d (one scalar of
noise per step), so it stays within a few points of the non-private MeZO (Malladi et al., "Fine-tuning language
models with just forward passes", NeurIPS 2023) and flat in d, while DPGD-0th (the same zeroth-order estimate,
clipped and noised as a d-dimensional vector) degrades with d.

Setting: SST-2, frozen MiniLM features (centred, unit norm), a fixed random ReLU expansion of width D in {256, 2,048,
16,384} scaled by sqrt(2 / D) (its kernel, so the problem, barely changes with D; the features are computed
once per width), a linear head on it (d = 2 D + 2 parameters, zero init). N = 4,096 rows, Poisson batches of B = 64,
T = 1,000 steps, C = 1, delta = 1 / (10 N), mu = 1e-3, plain SGD (DPZero's update needs it). MeZO is the dpzero plugin
with noise 0 and C = inf (plugins/dpzero/mezo.yaml); DPGD-0th is its ``estimator: dpgd0``. Each arm's lr is tuned per
width on 1,024 held-out training rows (tuning seed), widened once at a grid edge; the zeroth-order arms' grid is in
units of 1 / d. A best lr still at the edge of the widened grid is warned about and marked "(edge)" in the table:
the best lr d grows with d, and ``--zo-grid`` widens the grid. Report seeds are paired; accuracy on the GLUE validation set.

    python benchmarks/studies/dpzero.py            # full study
    python benchmarks/studies/dpzero.py --quick    # a few steps on tiny data (the test)
"""

from __future__ import annotations

import json
import math
import time

import torch

from common import (Split, choose, fmt, pyplot, result_name, save, save_figure, spread, sst2, study_parser,
                    train_private, tune)

ZEROTH = {"dpzero": {"mu": 1e-3}}
ARMS = [  # lr_grid in units of 1 / d for the zeroth-order arms ("per_d": true)
    {"name": "MeZO", "plugins": ZEROTH, "noise_multiplier": 0.0, "max_grad_norm": math.inf, "per_d": True},
    {"name": "DPZero ε=2", "plugins": ZEROTH, "epsilon": 2.0, "per_d": True},
    {"name": "DPZero ε=6", "plugins": ZEROTH, "epsilon": 6.0, "per_d": True},
    {"name": "DPGD-0th ε=6", "plugins": {"dpzero": {"mu": 1e-3, "estimator": "dpgd0"}}, "epsilon": 6.0,
     "per_d": True},
    {"name": "DP-SGD ε=6", "plugins": None, "epsilon": 6.0, "per_d": False},
]
# The direction's distribution (run with ``--arms`` only; ``--tag directions``): DPZero at epsilon 6 with a Gaussian and
# with a Rademacher z, the same lr grid and seeds; reported in a table of their own.
DIRECTION_ARMS = [
    {"name": f"DPZero ε=6, {label} z", "plugins": {"dpzero": {"mu": 1e-3, "direction": direction}}, "epsilon": 6.0,
     "per_d": True} for label, direction in (("Gaussian", "gaussian"), ("Rademacher", "rademacher"))]
ZO_GRID = [10.0, 30.0, 100.0]       # x 1 / d
FO_GRID = [0.3, 1.0, 3.0]
WIDTHS = [256, 2048, 16384]


def random_features(x: torch.Tensor, width: int, mean: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """sqrt(2 / D) relu(W u + b), u = the centred feature scaled to unit norm; W, b fixed (public) for this width."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(x.shape[1], width, generator=gen)
    b = torch.randn(width, generator=gen) * 0.1
    u = x - mean
    u = u / u.norm(dim=1, keepdim=True)
    return torch.relu(u @ w + b) * math.sqrt(2.0 / width)


def parser():
    """The command line; its defaults are the published table's settings."""
    p = study_parser(__doc__)
    p.add_argument("--widths", type=int, nargs="+", default=WIDTHS)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--zo-grid", type=float, nargs="+", default=ZO_GRID, help="lr grid of the zeroth-order arms "
                   "(units of 1 / d)")
    p.add_argument("--arms", nargs="+", default=None, help="run only these arms")
    p.add_argument("--tag", default="", help="suffix of the results' name (dpzero_<tag>.json)")
    p.add_argument("--report-only", action="store_true", help="the tables and figure of dpzero.json and "
                   "dpzero_directions.json")
    return p


def main() -> None:
    args = parser().parse_args()
    args.arms = choose(args.arms, [a["name"] for a in ARMS + DIRECTION_ARMS])
    if args.report_only:
        report(args.out)
        return
    start = time.perf_counter()
    if args.quick:
        data, args.widths, args.steps, batch = sst2(512, 128, quick=True), [64, 256], 20, 32
        args.seeds = args.seeds[:2]
        zo_grid, fo_grid = ZO_GRID[:2], FO_GRID[:2]
    else:
        data, batch, zo_grid, fo_grid = sst2(4096, 1024), 64, args.zo_grid, FO_GRID
    name = result_name("dpzero" + (f"_{args.tag}" if args.tag else ""), args)
    mean = data.train.x.mean(0)
    results = {"settings": {"train": len(data.train), "tune": len(data.tune), "batch_size": batch,
                            "steps": args.steps, "widths": args.widths, "mu": 1e-3, "clip": 1.0,
                            "seeds": args.seeds, "tune_seed": args.tune_seed, "quick": args.quick,
                            "zo_grid": zo_grid, "fo_grid": fo_grid,
                            "arms": [a["name"] for a in ARMS + DIRECTION_ARMS
                                     if (a["name"] in args.arms if args.arms else a in ARMS)]}, "cells": []}
    for width in args.widths:
        train, held, test = (Split(random_features(s.x, width, mean), s.y) for s in (data.train, data.tune, data.test))
        d = 2 * width + 2
        for arm in ARMS + DIRECTION_ARMS:
            if (args.arms and arm["name"] not in args.arms) or (not args.arms and arm in DIRECTION_ARMS):
                continue
            settings = {k: v for k, v in arm.items() if k not in ("name", "per_d")}
            settings.update(batch_size=batch, steps=args.steps, optimizer="sgd")
            settings.setdefault("max_grad_norm", 1.0)
            unit = 1.0 / d if arm["per_d"] else 1.0

            def score(lr: float) -> float:
                r = train_private(train, 2, **settings, lr=lr * unit, seed=args.tune_seed, evaluate_on={"tune": held})
                return -1.0 if r["diverged"] else r["final"]["tune"]["acc"] - 1e-3 * r["final"]["tune"]["loss"]

            tuned = tune(score, zo_grid if arm["per_d"] else fo_grid, f"{arm['name']} D={width} lr")
            runs = [train_private(train, 2, **settings, lr=tuned["best"] * unit, seed=s, evaluate_on={"test": test})
                    for s in args.seeds]
            ok = [r for r in runs if not r["diverged"]]
            cell = {"arm": arm["name"], "width": width, "d": d, "lr": tuned["best"] * unit, "tuning": tuned,
                    "sigma": runs[0]["sigma"], "epsilon": runs[0]["epsilon"],
                    "acc": spread([r["final"]["test"]["acc"] for r in ok]) if ok else None,
                    "per_seed_acc": [r["final"]["test"]["acc"] if not r["diverged"] else None for r in runs],
                    "seconds_per_run": sum(r["seconds"] for r in runs) / len(runs)}
            results["cells"].append(cell)
            save(name, results, args.out)  # so far
            print(f"[{time.perf_counter() - start:5.0f} s] D={width} {arm['name']}: lr {cell['lr']:.3g}"
                  f"{' (AT EDGE)' if tuned['at_edge'] else ''} acc {fmt(cell['acc']) if ok else 'diverged'}",
                  flush=True)
    results["seconds"] = time.perf_counter() - start
    save(name, results, args.out)
    print(table(results))
    if name == "dpzero":
        plot(results)


def report(folder) -> None:
    """The tables of ``dpzero.json`` and ``dpzero_directions.json`` (where present), and the figure of the first."""
    from pathlib import Path

    for stem in ("dpzero", "dpzero_directions"):
        path = Path(folder) / f"{stem}.json"
        if path.exists():
            results = json.loads(path.read_text())
            print(table(results))
            if stem == "dpzero":
                plot(results)


def table(results: dict) -> str:
    widths = results["settings"]["widths"]
    names = list(dict.fromkeys(c["arm"] for c in results["cells"]))
    cell = {(c["arm"], c["width"]): c for c in results["cells"]}
    lines = ["| arm | " + " | ".join(f"D = {w} (d = {2 * w + 2})" for w in widths) + " |",
             "|---|" + "---|" * len(widths)]
    for name in names:
        row = []
        for w in widths:
            c = cell.get((name, w))
            edge = " (edge)" if c and c["tuning"]["at_edge"] else ""
            row.append((fmt(c["acc"]) if c["acc"] else "diverged") + edge if c else "-")
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(results: dict) -> None:
    plt = pyplot()
    names = list(dict.fromkeys(c["arm"] for c in results["cells"]))
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for i, name in enumerate(names):
        sel = [c for c in results["cells"] if c["arm"] == name and c["acc"]]
        ax.errorbar([c["d"] for c in sel], [100 * c["acc"]["mean"] for c in sel],
                    [100 * c["acc"]["sd"] for c in sel], marker="o", capsize=3, color=f"C{i}", label=name)
        edge = [c for c in sel if c["tuning"]["at_edge"]]
        ax.scatter([c["d"] for c in edge], [100 * c["acc"]["mean"] for c in edge], s=140, facecolors="none",
                   edgecolors="k", label="lr at the grid's edge" if i == len(names) - 1 else None, zorder=3)
    s = results["settings"]
    ax.set_xscale("log")
    ax.set_xlabel("trainable parameters d (random-feature width D, d = 2D + 2)")
    ax.set_ylabel("validation accuracy (%)")
    ax.set_title(f"SST-2, frozen MiniLM -> random ReLU features -> linear head\nN={s['train']}, B={s['batch_size']}, "
                 f"T={s['steps']}; lr tuned per arm and width; mean ± sd of {len(s['seeds'])} seeds", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, "studies_dpzero")


if __name__ == "__main__":
    main()
