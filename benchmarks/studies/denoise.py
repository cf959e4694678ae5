"""denoise study: dose-response of RMT gradient denoising over the batch size, on frozen features with an MLP head.

"Sample-efficient differentially private fine-tuning via gradient matrix denoising" (arXiv 2510.01137) claims that
optimal shrinkage of each noisy gradient matrix makes DP fine-tuning reach a given accuracy in fewer steps. It can
only act on a matrix whose signal spikes above the noise bulk edge s (sqrt(m) + sqrt(n)), s = sigma C / B: the
dose is the batch size B.

Setting: SST-2, frozen MiniLM features (384-d), an MLP head 384 -> 256 -> 2 (ReLU; matrices 256 x 384 and 2 x 256),
N = 8,192 rows, B in {64, 256, 1024} (Poisson), epsilon = 4 planned at T = 200 steps, delta = 1 / (10 N), C = 1,
Adam (as in the paper). Arms: DP-SGD and DP-SGD + denoise (defaults: kappa 1.02, norm correction). Each arm's lr is
tuned per B on 2,048 held-out training rows (tuning seed), on the mean held-out accuracy over the scored steps
{25, 50, 100, 200}, widened once at a grid edge; then the report seeds (paired: same sampler and noise
generators). Logged: the fraction of matrices denoised per step (the plugin's ``denoise/fraction_denoised``).

    python benchmarks/studies/denoise.py            # full study
    python benchmarks/studies/denoise.py --quick    # a few steps on tiny data (the test)
"""

from __future__ import annotations

import statistics
import time

from common import fmt, pyplot, result_name, save, save_figure, spread, sst2, study_parser, train_private, tune

ARMS = [
    {"name": "DP-SGD", "plugins": None},
    {"name": "DP-SGD + denoise", "plugins": {"denoise": {}}},
]
GRID = [1e-3, 3e-3, 1e-2]
BATCH_SIZES = [64, 256, 1024]


def parser():
    """The command line; its defaults are the published table's settings."""
    p = study_parser(__doc__)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=BATCH_SIZES)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--hidden", type=int, default=256)
    return p


def main() -> None:
    args = parser().parse_args()
    name = result_name("denoise", args)
    start = time.perf_counter()
    if args.quick:
        data, args.batch_sizes, args.steps, grid = sst2(1024, 256, quick=True), [64, 256], 8, GRID[1:]
        args.seeds, scored = args.seeds[:2], [4, 8]
    else:
        data, grid = sst2(8192, 2048), GRID
        scored = [s for s in (25, 50, 100, 200, 400) if s <= args.steps]
    results = {"settings": {"train": len(data.train), "tune": len(data.tune), "hidden": args.hidden,
                            "steps": args.steps, "scored_steps": scored, "epsilon": 4.0, "optimizer": "adam",
                            "batch_sizes": args.batch_sizes, "lr_grid": grid, "seeds": args.seeds, "tune_seed": args.tune_seed,
                            "quick": args.quick}, "cells": []}
    for batch in args.batch_sizes:
        for arm in ARMS:
            settings = {"plugins": arm["plugins"], "epsilon": 4.0, "batch_size": batch, "steps": args.steps,
                        "optimizer": "adam", "hidden": args.hidden, "eval_steps": scored}

            def score(lr: float) -> float:
                r = train_private(data.train, 2, **settings, lr=lr, seed=args.tune_seed,
                                  evaluate_on={"tune": data.tune})
                return -1.0 if r["diverged"] else statistics.fmean(p["tune"]["acc"] for p in r["curve"])

            tuned = tune(score, grid, f"{arm['name']} B={batch} lr")
            runs = [train_private(data.train, 2, **settings, lr=tuned["best"], seed=s, evaluate_on={"test": data.test})
                    for s in args.seeds]
            cell = {"arm": arm["name"], "batch_size": batch, "lr": tuned["best"], "tuning": tuned,
                    "sigma": runs[0]["sigma"], "epsilon": runs[0]["epsilon"],
                    "fraction_denoised": [r["logged"].get("denoise/fraction_denoised") for r in runs],
                    "max_edge_ratio": [r["logged"].get("denoise/max_edge_ratio") for r in runs],
                    "curves": [{p["step"]: p["test"]["acc"] for p in r["curve"]} if not r["diverged"] else None
                               for r in runs],
                    "seconds_per_run": statistics.fmean(r["seconds"] for r in runs)}
            results["cells"].append(cell)
            save(name, results, args.out)  # so far
            final = [c[scored[-1]] for c in cell["curves"] if c]
            print(f"[{time.perf_counter() - start:5.0f} s] B={batch} {arm['name']}: lr {tuned['best']:.3g}"
                  f"{' (AT EDGE)' if tuned['at_edge'] else ''} acc@{scored[-1]} {fmt(spread(final)) if final else '-'}"
                  f" denoised {cell['fraction_denoised']}", flush=True)
    results["paired"] = paired(results)
    results["seconds"] = time.perf_counter() - start
    save(name, results, args.out)
    print(table(results))
    if name == "denoise":
        plot(results)


def paired(results: dict) -> list[dict]:
    """Per B and scored step: denoise minus DP-SGD accuracy, seed by seed (wins / comparisons)."""
    out = []
    for batch in results["settings"]["batch_sizes"]:
        base, den = (next(c for c in results["cells"] if c["batch_size"] == batch and c["arm"] == name)
                     for name in (ARMS[0]["name"], ARMS[1]["name"]))
        for step in results["settings"]["scored_steps"]:
            diffs = [d[step] - b[step] for b, d in zip(base["curves"], den["curves"]) if b and d]
            out.append({"batch_size": batch, "step": step, "diffs": diffs, "wins": sum(x > 0 for x in diffs),
                        "ties": sum(x == 0 for x in diffs), "n": len(diffs)})
    return out


def table(results: dict) -> str:
    s = results["settings"]
    steps = s["scored_steps"]
    lines = ["| B | arm | σ | lr | fraction of matrices denoised | "
             + " | ".join(f"acc % @ {t}" for t in steps) + " |",
             "|---|---|---|---|---|" + "---|" * len(steps)]
    for c in results["cells"]:
        ok = [cv for cv in c["curves"] if cv]
        accs = " | ".join(fmt(spread([cv[t] for cv in ok])) if ok else "-" for t in steps)
        frac = [f for f in c["fraction_denoised"] if f is not None]
        fr = f"{statistics.fmean(frac):.2f}" if frac else "-"
        lines.append(f"| {c['batch_size']} | {c['arm']} | {c['sigma']:.3f} | {c['lr']:.3g}"
                     f"{' (edge)' if c['tuning']['at_edge'] else ''} | {fr} | {accs} |")
    lines += ["", "| B | " + " | ".join(f"denoise wins @ {t}" for t in steps) + " |", "|---|" + "---|" * len(steps)]
    for batch in s["batch_sizes"]:
        row = [p for p in results["paired"] if p["batch_size"] == batch]
        lines.append(f"| {batch} | " + " | ".join(f"{p['wins']}/{p['n']} ({100 * statistics.fmean(p['diffs']):+.1f})"
                                                  if p["n"] else "-" for p in row) + " |")
    return "\n".join(lines)


def plot(results: dict) -> None:
    plt = pyplot()
    s = results["settings"]
    fig, axes = plt.subplots(1, len(s["batch_sizes"]), figsize=(4.6 * len(s["batch_sizes"]), 3.8), squeeze=False)
    for ax, batch in zip(axes[0], s["batch_sizes"]):
        for i, c in enumerate(c for c in results["cells"] if c["batch_size"] == batch):
            ok = [cv for cv in c["curves"] if cv]
            steps = s["scored_steps"]
            acc = [spread([cv[t] for cv in ok]) for t in steps]
            frac = [f for f in c["fraction_denoised"] if f is not None]
            label = c["arm"] + (f" ({100 * statistics.fmean(frac):.0f}% denoised)" if frac else "")
            ax.errorbar(steps, [100 * a["mean"] for a in acc], [100 * a["sd"] for a in acc], marker="o", capsize=3,
                        color=f"C{i}", label=label)
        ax.set_title(f"B = {batch}", fontsize=10)
        ax.set_xscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("validation accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"SST-2, frozen MiniLM + MLP head (hidden {s['hidden']}), ε = 4 planned at {s['steps']} steps, Adam, "
                 f"lr tuned per arm and B; mean ± sd of {len(s['seeds'])} seeds", fontsize=9)
    save_figure(fig, "studies_denoise")


if __name__ == "__main__":
    main()
