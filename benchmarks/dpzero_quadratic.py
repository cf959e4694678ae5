"""The synthetic check of DPZero (Zhang et al., ICML 2024): DPZero vs DPGD-0th on quadratics of effective rank
1, sqrt(d) and d.

    OMP_NUM_THREADS=1 python benchmarks/dpzero_quadratic.py            # ~50 min on one core
    python benchmarks/dpzero_quadratic.py --report-only                # table + plot from the JSON
    python benchmarks/dpzero_quadratic.py --quick --results q.json --figure q.png   # a few seconds: d = 20 only

Per-example loss l_i(theta) = 1/2 (theta - xi_i)^T A (theta - xi_i), xi_i ~ N(0, I_d), N = 1000 examples,
A = diag(1, a, ..., a) with a = (r - 1) / (d - 1), so ||A|| = 1 and the effective rank tr(A) / ||A|| = r, for
r in {1, sqrt(d), d} and d in {20, 63, 200, 632, 2000}. theta_0 = mean(xi) + 1 (all ones), so the initial excess
loss is r / 2; we report the final excess loss divided by the initial one (1 = no progress).

Both methods run through the real plugin (``dpzero`` with ``estimator: dpzero`` or ``dpgd0``), the default
``gaussian`` privatize and dpl's update path, driven by dpl's training loop (``dpl.PrivateTraining``: its Poisson
sampler and its noise source, seeded per run by ``privacy.seed``), with Poisson batches of expected size B = 50
(q = 0.05), T = 200 steps, sigma calibrated by dpl's PRV accountant to epsilon = 2 at delta = 1e-4 (the same sigma
for both: both are the subsampled Gaussian with sensitivity C), plain SGD, mu = 1e-3 (central differences are exact
on a quadratic, so mu only matters through rounding). DPZero clips each example's scalar d_i to [-C, C] and adds one scalar of noise; DPGD-0th clips each example's
vector d_i z to norm C and adds N(0, sigma^2 C^2 I_d). Each (method, d, r) cell is tuned on seed 0 over
lr x C grids (the best final excess loss), then the best setting is rerun on seeds 1, 2, 3: the table and plot
show the mean (and min/max) over those three.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from dpl.errors import PrivacyWarning

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "dpzero_quadratic.json"
FIGURE = ROOT / "docs" / "figures" / "dpzero_quadratic.png"
DIMS = (20, 63, 200, 632, 2000)
RANKS = ("1", "sqrt(d)", "d")
LRS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)
CLIPS = (0.5, 2.0, 8.0, 32.0)
N, B, T, EPS, DELTA = 1000, 50, 200, 2.0, 1e-4


class Quadratic(nn.Module):
    def __init__(self, d: int, rank: float, gen: torch.Generator) -> None:
        super().__init__()
        a = (rank - 1.0) / (d - 1.0)
        diag = torch.full((d,), a, dtype=torch.float64)
        diag[0] = 1.0
        self.register_buffer("diag", diag)
        self.xi = torch.randn(N, d, generator=gen, dtype=torch.float64)
        self.center = self.xi.mean(0)
        self.theta = nn.Parameter(self.center + 1.0)

    def per_example_loss(self, batch):
        r = self.theta - self.xi[batch["index"]]
        return 0.5 * (r * r * self.diag).sum(1)

    @torch.no_grad()
    def excess(self) -> float:
        r = self.theta - self.center
        return float(0.5 * (r * r * self.diag).sum())


def rank_value(name: str, d: int) -> float:
    return {"1": 1.0, "sqrt(d)": math.sqrt(d), "d": float(d)}[name]


def run(method: str, d: int, rank: str, lr: float, clip: float, sigma: float, seed: int, steps: int = T) -> float:
    from dpl import PrivacyConfig, PrivateTraining

    gen = torch.Generator().manual_seed(1000 * seed + d)
    model = Quadratic(d, rank_value(rank, d), gen)
    initial = model.excess()
    privacy = PrivacyConfig(target_epsilon=None, noise_multiplier=sigma, target_delta=DELTA, max_grad_norm=clip,
                            batch_size=B, physical_batch_size=N, seed=777 + seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrivacyWarning)  # privacy.seed: a reproducible experiment
        training = PrivateTraining(model, model.per_example_loss, privacy, num_examples=N, steps=steps,
                                   collate=lambda rows: {"index": torch.as_tensor(rows, dtype=torch.long)},
                                   optimizer=torch.optim.SGD(model.parameters(), lr=lr),
                                   plugins={"dpzero": {"mu": 1e-3,
                                                       "estimator": "dpzero" if method == "dpzero" else "dpgd0"}})
    for _ in training.steps():
        value = model.excess()
        if not math.isfinite(value) or value > 1e6 * initial:
            return math.inf
    return model.excess() / initial


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--quick", action="store_true", help="smoke test: d = 20, one lr and C, 20 steps, one seed")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--figure", type=Path, default=FIGURE)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dims, lrs, clips, steps, seeds = (((20,), (1e-2,), (2.0,), 20, (1,)) if args.quick
                                      else (DIMS, LRS, CLIPS, T, (1, 2, 3)))
    if not args.report_only:
        from dpl.core import accounting

        sigma = accounting.calibrate_noise_multiplier(EPS, DELTA, B / N, steps, method="prv")
        results = {"settings": {"N": N, "B": B, "T": steps, "epsilon": EPS, "delta": DELTA, "sigma": sigma,
                                "lrs": lrs, "clips": clips, "dims": dims, "machine": platform.processor() or
                                platform.machine(), "threads": 1}, "cells": []}
        start = time.time()
        for method in ("dpzero", "dpgd0"):
            for rank in RANKS:
                for d in dims:
                    grid = {(lr, c): run(method, d, rank, lr, c, sigma, seed=0, steps=steps)
                            for lr in lrs for c in clips}
                    (lr, c), tuned = min(grid.items(), key=lambda kv: kv[1])
                    finals = [run(method, d, rank, lr, c, sigma, seed=s, steps=steps) for s in seeds]
                    cell = {"method": method, "rank": rank, "d": d, "lr": lr, "C": c, "tuning": tuned,
                            "finals": finals}
                    results["cells"].append(cell)
                    print(f"{method:7s} r={rank:8s} d={d:5d} lr={lr:g} C={c:g} excess ratio "
                          f"{sum(finals) / len(finals):.4f} ({time.time() - start:.0f}s)", flush=True)
        results["wall_s"] = time.time() - start
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(results, indent=1))
    report(json.loads(args.results.read_text()), args.figure)


def report(results: dict, figure: Path = FIGURE) -> None:
    cells, dims = results["cells"], results["settings"]["dims"]
    print(f"sigma = {results['settings']['sigma']:.4f}; wall {results.get('wall_s', 0):.0f} s")
    print("| method | effective rank | " + " | ".join(f"d = {d}" for d in dims) + " |")
    print("|---|---|" + "---|" * len(dims))
    for method in ("dpzero", "dpgd0"):
        for rank in RANKS:
            row = [c for c in cells if c["method"] == method and c["rank"] == rank]
            row.sort(key=lambda c: c["d"])
            print(f"| {'DPZero' if method == 'dpzero' else 'DPGD-0th'} | {rank} | "
                  + " | ".join(f"{sum(c['finals']) / len(c['finals']):.3f}" for c in row) + " |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6), sharey=True)
    for ax, rank in zip(axes, RANKS):
        for method, color in (("dpzero", "tab:blue"), ("dpgd0", "tab:red")):
            row = sorted((c for c in cells if c["method"] == method and c["rank"] == rank), key=lambda c: c["d"])
            ds = [c["d"] for c in row]
            mean = [sum(c["finals"]) / len(c["finals"]) for c in row]
            ax.plot(ds, mean, "o-", color=color, label="DPZero" if method == "dpzero" else "DPGD-0th")
            ax.fill_between(ds, [min(c["finals"]) for c in row], [max(c["finals"]) for c in row], color=color,
                            alpha=0.2)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"effective rank {rank}")
        ax.set_xlabel("dimension d")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("final / initial excess loss")
    axes[0].legend()
    s = results["settings"]
    fig.suptitle(f"Quadratics, eps = {s['epsilon']:g}, T = {s['T']}, q = {s['B'] / s['N']:g} "
                 f"(lr and C tuned per cell; mean and range of {len(cells[0]['finals'])} seeds)")
    fig.tight_layout()
    figure.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(figure, dpi=120)
    print(f"figure: {figure.relative_to(ROOT) if figure.is_relative_to(ROOT) else figure}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
