"""Expected prefix-sum error of amplified BandMF, amplified DP-SGD, BLT and independent noise at equal (epsilon, delta).

    python benchmarks/bandmf_error.py [--n 8192] [--batch 256] [--json benchmarks/results/bandmf_error.json]

For each epsilon in {1, 4, 16} and epochs in {3, 20} (T = epochs x floor(N / B) steps, delta = 0.1 / N, dpl's
default) every candidate strategy of ftrl's automatic choice is calibrated with its own accountant (amplified: PRV for
ceil(T / b) subsampled Gaussian steps at rate B / floor(N / b); shuffled: the exact Gaussian mechanism) and scored
by sigma x its strategy's expected error: the RMS over the steps of the per-coordinate noise std in the prefix
sums of the released gradients, in units of C / B (``dpl_plugins.ftrl.choice``). Amplified banded is tried for b
in 1, 2, 4, ..., floor(N / B) (``--max-bands``; the plugin's default ``max_bands`` is 16). This is the objective,
not a training result.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

from dpl.core.step import RunSetup
from dpl_plugins.ftrl import FTRLPlugin


def scores(n: int, batch: int, epochs: int, epsilon: float, max_bands: int) -> dict:
    steps = epochs * (n // batch)
    setup = RunSetup(model=nn.Linear(1, 1), trainable={"w": nn.Parameter(torch.zeros(1))}, plugin_names=["ftrl"],
                     population=n, expected_batch_size=batch, steps=steps, sampling_rate=batch / n,
                     accountant="prv", optimizer_name="SGD")
    start = time.perf_counter()
    mech = FTRLPlugin(max_bands=max_bands).configure_mechanism(setup=setup)
    fit = time.perf_counter() - start
    delta = 0.1 / n
    rows = {}
    for candidate in [mech.sampled_strategy, *mech.candidates]:
        sigma = mech.calibrate_strategy(candidate, epsilon, delta, steps)
        rows[candidate.label()] = {"sigma": sigma, "strategy_error": candidate.strategy.expected_error,
                                   "error": sigma * candidate.strategy.expected_error, "bands": candidate.bands}
    amplified = {k: v for k, v in rows.items() if k.startswith("amplified")}
    best = min(amplified, key=lambda k: amplified[k]["error"])
    chosen = min(rows, key=lambda k: rows[k]["error"])
    return {"epsilon": epsilon, "epochs": epochs, "steps": steps, "delta": delta, "fit_seconds": fit, "plans": rows,
            "best_amplified": best, "chosen": chosen}


def table(results: list[dict]) -> str:
    """The markdown table of plugins/ftrl/README.md (a test keeps the two equal)."""
    lines = ["| ε | epochs | T | amplified DP-SGD | amplified BandMF (best b) | BLT (shuffled, fitted buffers) | "
             "independent (shuffled) | chosen |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        p = r["plans"]
        best = p[r["best_amplified"]]
        blt_label = next(k for k in p if k.startswith("blt"))  # names the buffer count the fit kept
        blt = f"{p[blt_label]['error']:.2f} ({blt_label.split('(')[1].split(',')[0]})"
        lines.append(f"| {r['epsilon']:g} | {r['epochs']} | {r['steps']} | {p['amplified DP-SGD (b=1)']['error']:.2f} | "
                     f"{best['error']:.2f} (b = {best['bands']}) | {blt} | "
                     f"{p['independent (shuffled, no amplification)']['error']:.2f} | {r['chosen']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--max-bands", type=int, default=None, help="default: floor(N / B)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    max_bands = args.max_bands or args.n // args.batch
    results = [scores(args.n, args.batch, epochs, eps, max_bands) for eps in (1.0, 4.0, 16.0) for epochs in (3, 20)]
    print(f"N = {args.n}, B = {args.batch}, delta = 0.1/N; expected prefix-sum error in units of C/B (lower is better)")
    print(table(results))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"n": args.n, "batch": args.batch, "max_bands": max_bands, "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
