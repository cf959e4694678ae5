"""Linear-regression theory of Choquette-Choo et al. (ICLR 2024), no clipping: stationary error of Noisy-SGD
grows with the dimension d,
that of nu-Noisy-FTRL with the effective dimension d_eff = tr(H) / ||H||.

    OMP_NUM_THREADS=1 python benchmarks/ftrl_linear_regression.py [--out docs/figures/ftrl_linear_regression.png]

Model: f(theta) = 1/2 (theta - theta*)^T H (theta - theta*), H diagonal with eigenvalues
lambda_i = max(i^-alpha, lambda_min), ||H|| = 1; exact gradients plus privacy noise (the streaming setting of the
paper: every example is used once, so sens = 1 for Noisy-SGD and sens^2 = sum_t c_t^2 for nu-Noisy-FTRL, the same
sigma = 1 for both):

    theta_{t+1} = theta_t - eta (H (theta_t - theta*) + sens * w_t),   w = z (SGD)  or  w = beta * z (FTRL)

with beta the nu-DP-FTRL noising coefficients of the plugin (dpl_plugins.ftrl.strategies) and nu = eta lambda_min
(the paper's choice for this problem). Theory: in each eigendirection the error is a linear filter of z, so the
stationary E f = 1/2 sum_i lambda_i eta^2 sens^2 ||g_i * beta||^2 with g_i(k) = (1 - eta lambda_i)^k, computed
exactly (to a truncation at 60 000 terms, where every factor is below e^-30). Simulation: the recursion itself,
8 independent runs per point, E f averaged over the second half of 16 000 steps.
Sweep A: alpha = 2 (d_eff about 1.6-2.6), d = 8 .. 1024. Sweep B: d = 1024, alpha from 0 (d_eff = d) to 2.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
from scipy import signal

from dpl_plugins.ftrl.strategies import nu_noising_coefficients, nu_strategy_coefficients

ETA, LAMBDA_MIN = 0.5, 1e-3
NU = ETA * LAMBDA_MIN
L = 60_000


def spectrum(d: int, alpha: float) -> np.ndarray:
    return np.maximum(np.arange(1, d + 1, dtype=np.float64) ** -alpha, LAMBDA_MIN)


def d_eff(lam: np.ndarray) -> float:
    return float(lam.sum() / lam.max())


BETA = nu_noising_coefficients(L, NU)
SENS_FTRL = math.sqrt(float(np.sum(nu_strategy_coefficients(L, NU) ** 2)))


def theory(lam: np.ndarray, method: str) -> float:
    total = 0.0
    for value, count in zip(*np.unique(lam, return_counts=True)):
        a = 1 - ETA * value
        if method == "sgd":
            energy = 1 / (1 - a * a)
            sens = 1.0
        else:
            h = signal.lfilter([1.0], [1.0, -a], BETA)
            energy = float(np.dot(h, h))
            sens = SENS_FTRL
        total += count * 0.5 * value * ETA**2 * sens**2 * energy
    return total


def simulate(lam: np.ndarray, method: str, steps: int = 16_000, runs: int = 8, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    cols = len(lam) * runs
    z = rng.standard_normal((steps, cols))
    if method == "sgd":
        w, sens = z, 1.0
    else:
        w = np.empty_like(z)
        for c0 in range(0, cols, 128):  # chunks of columns: bounded FFT memory
            w[:, c0:c0 + 128] = signal.fftconvolve(z[:, c0:c0 + 128], BETA[:steps, None], axes=0)[:steps]
        sens = SENS_FTRL
    lam_cols = np.tile(lam, runs)
    x = np.zeros(cols)
    acc, n = 0.0, 0
    for t in range(steps):
        x = x - ETA * (lam_cols * x + sens * w[t])
        if t >= steps // 2:
            acc += 0.5 * float(np.dot(lam_cols, x * x)) / runs
            n += 1
    return acc / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/figures/ftrl_linear_regression.png")
    parser.add_argument("--json", default="benchmarks/results/ftrl_linear_regression.json")
    parser.add_argument("--simulate-max-d", type=int, default=256)
    args = parser.parse_args()
    start = time.perf_counter()
    rows = []
    for sweep, points in (("A", [(d, 2.0) for d in (8, 16, 32, 64, 128, 256, 512, 1024)]),
                          ("B", [(1024, a) for a in (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0)])):
        for d, alpha in points:
            lam = spectrum(d, alpha)
            row = {"sweep": sweep, "d": d, "alpha": alpha, "d_eff": d_eff(lam),
                   "theory_sgd": theory(lam, "sgd"), "theory_ftrl": theory(lam, "ftrl")}
            if d <= args.simulate_max_d:
                row["sim_sgd"], row["sim_ftrl"] = simulate(lam, "sgd"), simulate(lam, "ftrl")
            rows.append(row)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    print(f"nu = {NU}, sens_FTRL^2 = {SENS_FTRL**2:.3f}; {time.perf_counter() - start:.0f} s")
    with open(args.json, "w") as fh:
        json.dump({"eta": ETA, "lambda_min": LAMBDA_MIN, "nu": NU, "sens_ftrl": SENS_FTRL, "rows": rows}, fh, indent=1)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, sweep, key, label in ((axes[0], "A", "d", "dimension d (alpha = 2: d_eff 1.6-2.6)"),
                                  (axes[1], "B", "d_eff", "effective dimension d_eff (d = 1024)")):
        sel = [r for r in rows if r["sweep"] == sweep]
        xs = [r[key] for r in sel]
        for method, color, name in (("sgd", "C0", "Noisy-SGD"), ("ftrl", "C3", f"nu-Noisy-FTRL (nu={NU:g})")):
            ax.plot(xs, [r[f"theory_{method}"] for r in sel], "-", color=color, label=f"{name}: theory")
            sim = [(r[key], r[f"sim_{method}"]) for r in sel if f"sim_{method}" in r]
            if sim:
                ax.plot(*zip(*sim), "o", color=color, mfc="none", label=f"{name}: simulation")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("stationary E f(theta) (sigma = 1)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Linear regression, eta = {ETA}, lambda_i = max(i^-alpha, {LAMBDA_MIN:g})")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
