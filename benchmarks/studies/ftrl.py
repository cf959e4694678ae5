"""ftrl study: correlated noise (banded, BLT, nu-DP-FTRL) vs amplified DP-SGD vs ``independent`` on frozen features.

Choquette-Choo, Dvijotham, Pillutla, Ganesh, Steinke & Thakurta, "Correlated noise provably beats independent noise
for differentially private learning" (ICLR 2024) claim that correlated noise beats independent noise, and with many
epochs and moderate-to-large epsilon also amplified DP-SGD.

Setting: SST-2, frozen MiniLM features (mean pooled, 384-d), a linear head (770 parameters), N = 8,192 training rows,
B = 256 (32 steps per epoch), C = 1, delta = 1 / (10 N), SGD with momentum 0.9; epsilon in {1, 4, 16} x epochs in
{3, 20}. Each arm's lr is tuned per (epsilon, epochs) cell on 2,048 held-out training rows (tuning seed), widened
once if the best is at the grid's edge; then the picked lr runs with the report seeds (paired: same seeds for every
arm) and is scored on the GLUE validation set (872 rows).

    python benchmarks/studies/ftrl.py            # full study
    python benchmarks/studies/ftrl.py --quick    # a few steps on tiny data (the test)
"""

from __future__ import annotations

import time

from common import (arm_settings, choose, fmt, pyplot, result_name, save, save_figure, spread, sst2, study_parser,
                    train_private, tune)

EPSILONS, EPOCHS, LR_GRID = [1.0, 4.0, 16.0], [3, 20], [0.03, 0.1, 0.3, 1.0, 3.0]


def arms(steps_per_epoch: int) -> list[dict]:
    """The arms (one line each). ``banded`` (one shuffled order) gets bands = steps per epoch; ``extra`` arms run
    only when named with ``--arms``: shuffled banded with 4 bands, and amplified banded matrix factorization (cyclic
    Poisson sampling, bands chosen by the plugin)."""
    return [
        {"name": "DP-SGD (amplified)", "plugins": None},
        {"name": "independent", "plugins": {"ftrl": {"noise": "independent"}}},
        {"name": "banded", "plugins": {"ftrl": {"noise": "banded", "sampling": "shuffle", "bands": steps_per_epoch}}},
        {"name": "BLT", "plugins": {"ftrl": {"noise": "blt"}}},
        {"name": "nu-FTRL", "plugins": {"ftrl": {"noise": "nu_ftrl", "memory": "keep"}}},
        {"name": "banded (4 bands)", "plugins": {"ftrl": {"noise": "banded", "sampling": "shuffle", "bands": 4}},
         "extra": True},
        {"name": "amplified BandMF", "plugins": {"ftrl": {"noise": "banded", "sampling": "cyclic_poisson"}},
         "extra": True},
    ]


def parser():
    """The command line; its defaults are the published table's settings."""
    p = study_parser(__doc__)
    p.add_argument("--epsilons", type=float, nargs="+", default=EPSILONS)
    p.add_argument("--epochs", type=int, nargs="+", default=EPOCHS)
    p.add_argument("--arms", nargs="+", default=None, help="run only these arms (results: ftrl_<arms>.json)")
    return p


def main() -> None:
    args = parser().parse_args()
    args.arms = choose(args.arms, [a["name"] for a in arms(1)])
    name = result_name("ftrl" + ("_" + "_".join(a.split()[0].lower() + "".join(c for c in a if c.isdigit())
                                                for a in args.arms) if args.arms else ""), args)
    start = time.perf_counter()
    if args.quick:
        data, batch, args.epsilons, args.epochs, grid = sst2(512, 256, quick=True), 64, [4.0], [2], [0.3, 1.0]
        args.seeds = args.seeds[:2]
    else:
        data, batch, grid = sst2(8192, 2048), 256, LR_GRID
    b = len(data.train) // batch
    common = {"momentum": 0.9, "optimizer": "sgd", "batch_size": batch}
    results = {"settings": {"train": len(data.train), "tune": len(data.tune), "test": len(data.test),
                            "batch_size": batch, "steps_per_epoch": b, "momentum": 0.9, "lr_grid": grid,
                            "epsilons": args.epsilons, "epochs": args.epochs,
                            "arms": [a["name"] for a in arms(b) if (a["name"] in args.arms if args.arms
                                                                    else not a.get("extra"))],
                            "seeds": args.seeds, "tune_seed": args.tune_seed, "quick": args.quick}, "cells": []}
    for epochs in args.epochs:
        for eps in args.epsilons:
            for arm in arms(b):
                if (arm["name"] not in args.arms) if args.arms else arm.get("extra"):
                    continue
                settings = arm_settings(arm, **common, epsilon=eps, epochs=epochs)

                def score(lr: float) -> float:
                    r = train_private(data.train, data.classes, **{**settings, "lr": lr}, seed=args.tune_seed,
                                      evaluate_on={"tune": data.tune})
                    return -1.0 if r["diverged"] else r["final"]["tune"]["acc"] - 1e-3 * r["final"]["tune"]["loss"]

                tuned = tune(score, grid, f"{arm['name']} eps={eps:g} epochs={epochs}")
                runs = [train_private(data.train, data.classes, **{**settings, "lr": tuned["best"]}, seed=s,
                                      evaluate_on={"test": data.test}) for s in args.seeds]
                ok = [r for r in runs if not r["diverged"]]
                cell = {"arm": arm["name"], "plugins": arm["plugins"], "epsilon": eps, "epochs": epochs,
                        "steps": runs[0]["steps"], "sigma": runs[0]["sigma"], "epsilon_spent": runs[0]["epsilon"],
                        "tuning": tuned, "lr": tuned["best"],
                        "acc": spread([r["final"]["test"]["acc"] for r in ok]) if ok else None,
                        "loss": spread([r["final"]["test"]["loss"] for r in ok]) if ok else None,
                        "per_seed_acc": [r["final"]["test"]["acc"] if not r["diverged"] else None for r in runs],
                        "diverged": len(runs) - len(ok)}
                results["cells"].append(cell)
                save(name, results, args.out)  # so far
                print(f"[{time.perf_counter() - start:5.0f} s] eps={eps:g} epochs={epochs} {arm['name']}: lr "
                      f"{tuned['best']:.3g}{' (AT EDGE)' if tuned['at_edge'] else ''} acc "
                      f"{fmt(cell['acc']) if ok else 'diverged'}", flush=True)
    results["seconds"] = time.perf_counter() - start
    save(name, results, args.out)
    print(table(results))
    if not args.quick and not args.arms:
        plot(results)


def table(results: dict) -> str:
    s = results["settings"]
    lines = [f"| epochs | ε | arm | σ | lr (tuned) | val acc % (mean ± sd, {len(s['seeds'])} seeds) | val loss |",
             "|---|---|---|---|---|---|---|"]
    for c in results["cells"]:
        edge = " (edge)" if c["tuning"]["at_edge"] else ""
        acc = fmt(c["acc"]) if c["acc"] else "diverged"
        loss = fmt(c["loss"], 1.0, 3) if c["loss"] else "-"
        lines.append(f"| {c['epochs']} | {c['epsilon']:g} | {c['arm']} | {c['sigma']:.3f} | {c['lr']:.3g}{edge} | "
                     f"{acc} | {loss} |")
    return "\n".join(lines)


def plot(results: dict) -> None:
    plt = pyplot()
    cells = results["cells"]
    names = list(dict.fromkeys(c["arm"] for c in cells))
    epochs = sorted({c["epochs"] for c in cells})
    fig, axes = plt.subplots(2, len(epochs), figsize=(5.2 * len(epochs), 7), squeeze=False)
    for j, ep in enumerate(epochs):
        for i, name in enumerate(names):
            sel = sorted((c for c in cells if c["arm"] == name and c["epochs"] == ep and c["acc"]),
                         key=lambda c: c["epsilon"])
            x = [c["epsilon"] for c in sel]
            for row, key, scale in ((0, "acc", 100), (1, "loss", 1)):
                axes[row][j].errorbar(x, [c[key]["mean"] * scale for c in sel], [c[key]["sd"] * scale for c in sel],
                                      marker="o", capsize=3, color=f"C{i}", label=name, alpha=0.85)
        axes[0][j].set_title(f"{ep} epochs ({ep * results['settings']['steps_per_epoch']} steps)", fontsize=10)
        axes[0][j].set_ylabel("validation accuracy (%)")
        axes[1][j].set_ylabel("validation loss")
        for row in (0, 1):
            axes[row][j].set_xscale("log")
            axes[row][j].set_xlabel("ε")
            axes[row][j].grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    s = results["settings"]
    fig.suptitle(f"SST-2, frozen MiniLM features + linear head, N={s['train']}, B={s['batch_size']}, SGD momentum "
                 f"0.9, lr tuned per arm and cell; mean ± sd of {len(s['seeds'])} seeds", fontsize=9)
    save_figure(fig, "studies_ftrl")


if __name__ == "__main__":
    main()
