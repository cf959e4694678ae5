"""adambc study: DP-GD, DP-GDM, DP-Adam and DP-AdamBC under heavy-tail class imbalance (training fit per group).

"On the performance of differentially private optimization with heavy-tail class imbalance" (DP-AdamBC) claims
that DP-AdamBC fits the rarest classes where DP-GD, DP-GDM and DP-Adam (no bias correction) do not. The claim is
about *training* fit, so the table reports training accuracy per frequency group (and, for Banking77, validation
accuracy per group too).

1. Synthetic (the paper's design, scaled to CPU minutes): G = 7 frequency groups; group k (0 .. 6) has 2^floor(k/3)
   classes of 8 * 2^(6 - k) examples each (head 512, tail 8: 64x; 13 classes), inputs uniform in [0, 1]^d with
   d = 1,280 > N = 1,152, labels as above (the task is to fit the training set), a linear softmax head, C = 1,
   sigma = 10, full batch (q = 1), T = 600 steps (epsilon ~ 12.6 at delta = 1e-5).
2. Banking77: frozen MiniLM features; the training split is Zipf-subsampled (classes in a random order, the k-th keeps
   max(5, ceil(n_k / k)) rows; seed 0), a linear head, full batch, epsilon = 8, T = 300; groups by training count.

Every arm runs through dpl's private step (``common.train_private``): DP-GD / DP-GDM are plain SGD (momentum 0 /
0.9), DP-Adam and DP-AdamBC the adambc plugin (``bias_correction`` false / true) with plain SGD. Each arm's lr (and
DP-AdamBC's gamma' as a multiple of the noise variance Phi = (sigma C / B)^2) is tuned on the final training loss
of a tuning seed (its own data draw and noise), widened once at a grid edge; then the report seeds (paired).

    python benchmarks/studies/adambc.py            # full study
    python benchmarks/studies/adambc.py --quick    # a few steps on tiny data (the test)
"""

from __future__ import annotations

import json
import math
import time

import torch

from dpl.core.mechanism import PoissonGaussian, calibrate

from common import (Split, banking77_features, choose, fmt, pyplot, result_name, save, save_figure, spread, study_parser, train_private,
                    tune)

ARMS = [
    {"name": "DP-GD", "plugins": None, "momentum": 0.0, "lr_grid": [0.1, 0.3, 1.0]},
    {"name": "DP-GDM", "plugins": None, "momentum": 0.9, "lr_grid": [0.01, 0.03, 0.1]},
    {"name": "DP-Adam", "plugins": {"adambc": {"bias_correction": False}}, "lr_grid": [1e-3, 3e-3, 1e-2]},
    {"name": "DP-AdamBC", "plugins": {"adambc": {"bias_correction": True}}, "lr_grid": [1e-3, 3e-3, 1e-2],
     "gamma_factors": [0.01, 0.1, 1.0]},
    # a fixed gamma' = 1e-8, far below Phi (run only when named with --arms)
    {"name": "DP-AdamBC (γ′ 1e-8)",
     "plugins": {"adambc": {"bias_correction": True, "gamma": 1e-8, "gamma_relative": 0.0}},
     "lr_grid": [1e-3, 3e-3, 1e-2], "extra": True},
]


def synthetic(groups: int, tail: int, dim: int, seed: int) -> tuple[Split, torch.Tensor]:
    """The heavy-tailed training set and ``group_of_class``."""
    labels, group_of_class = [], []
    for k in range(groups):
        for _ in range(2 ** (k // 3)):
            labels += [len(group_of_class)] * (tail * 2 ** (groups - 1 - k))
            group_of_class.append(k)
    gen = torch.Generator().manual_seed(seed)
    y = torch.tensor(labels)
    perm = torch.randperm(len(y), generator=gen)
    return Split(torch.rand(len(y), dim, generator=gen), y[perm]), torch.tensor(group_of_class)


def banking77_zipf(floor: int = 5, seed: int = 0, quick: bool = False) -> tuple[Split, Split, torch.Tensor, list[int]]:
    """Zipf-subsampled Banking77 features (train), the dev set, ``group_of_class`` by training count and the group
    edges (a class with count >= edges[k] and < edges[k - 1] is in group k)."""
    f = banking77_features(quick)
    x, y = f["train_x"], f["train_y"]
    classes = len(f["names"])
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(classes, generator=gen).tolist()
    keep = []
    for k, c in enumerate(order, start=1):
        rows = (y == c).nonzero().flatten()
        rows = rows[torch.randperm(len(rows), generator=gen)]
        keep.append(rows[:max(floor, math.ceil(len(rows) / k))])
    idx = torch.cat(keep)
    idx = idx[torch.randperm(len(idx), generator=gen)]
    counts = torch.bincount(y[idx], minlength=classes)
    edges = [64, 32, 16, 8, floor]
    group = torch.tensor([next(k for k, e in enumerate(edges) if int(n) >= e) for n in counts])
    return Split(x[idx], y[idx]), Split(f["test_x"], f["test_y"]), group, edges


def run_arm(arm: dict, train: Split, classes: int, common: dict, seeds: list[int], tune_seed: int,
            make_train=None, groups=None, evaluate_extra=None) -> dict:
    """Tune an arm's lr (and gamma' for DP-AdamBC) on the final training loss of ``tune_seed``, then run ``seeds``.
    ``make_train(seed)`` gives a fresh training set per seed (synthetic), else ``train`` is used for all."""
    phi = (common["noise_multiplier"] * common.get("max_grad_norm", 1.0) / len(train)) ** 2 \
        if common.get("noise_multiplier") else None

    def settings(lr: float, factor: float | None) -> dict:
        plugins = arm["plugins"]
        if factor is not None:
            plugins = {"adambc": {**plugins["adambc"], "gamma": factor * phi, "gamma_relative": 0.0}}
        return {**common, "plugins": plugins, "momentum": arm.get("momentum", 0.0), "lr": lr}

    def loss_of(lr: float, factor: float | None) -> float:
        data = make_train(tune_seed) if make_train else train
        r = train_private(data, classes, **{**settings(lr, factor), "eval_steps": ()}, seed=tune_seed,
                          evaluate_on={"train": data})
        return -math.inf if r["diverged"] else -r["final"]["train"]["loss"]

    inner: dict[float, dict] = {}
    if "gamma_factors" in arm:
        def by_factor(factor: float) -> float:
            inner[factor] = tune(lambda lr: loss_of(lr, factor), arm["lr_grid"],
                                 f"{arm['name']} gamma'={factor:g}Phi lr")
            return max(inner[factor]["scores"].values())
        outer = tune(by_factor, arm["gamma_factors"], f"{arm['name']} gamma'/Phi")
        factor = outer["best"]
        tuned = {"gamma_factor": outer, "lr": inner[factor], "gamma": factor * phi}
    else:
        factor = None
        tuned = {"lr": tune(lambda lr: loss_of(lr, None), arm["lr_grid"], f"{arm['name']} lr")}
    lr = tuned["lr"]["best"]
    runs = []
    for s in seeds:
        data = make_train(s) if make_train else train
        splits = {"train": data, **(evaluate_extra or {})}
        runs.append(train_private(data, classes, **settings(lr, factor), seed=s, evaluate_on=splits, groups=groups))
    return {"arm": arm["name"], "tuned": tuned, "lr": lr, "sigma": runs[0]["sigma"], "epsilon": runs[0]["epsilon"],
            "runs": [{"seed": s, "diverged": r["diverged"], "final": r["final"], "curve": r["curve"],
                      "logged": r["logged"]} for s, r in zip(seeds, runs)]}


def group_summary(result: dict, split: str, groups: int) -> list[dict]:
    ok = [r for r in result["runs"] if not r["diverged"]]
    return [spread([r["final"][split]["group_acc"][k] for r in ok]) if ok else None for k in range(groups)]


def parser():
    """The command line; its defaults are the published tables' settings."""
    p = study_parser(__doc__)
    p.add_argument("--part", choices=["synthetic", "banking77", "both"], default="both",
                   help="run one part only (the two parts are independent: run them as two processes)")
    p.add_argument("--arms", nargs="+", default=None, help="run only these arms (results: adambc_..._extra)")
    p.add_argument("--report-only", action="store_true", help="tables and figure from the saved parts")
    return p


def main() -> None:
    args = parser().parse_args()
    args.arms = choose(args.arms, [a["name"] for a in ARMS])
    if args.report_only:
        report(args.out)
        return
    start = time.perf_counter()
    if args.quick:
        G, tail, dim, steps, b_steps = 6, 1, 64, 20, 10
        args.seeds = args.seeds[:2]
        arms = [dict(a, lr_grid=a["lr_grid"][1:], **({"gamma_factors": [0.1, 1.0]} if "gamma_factors" in a else {}))
                for a in ARMS]
    else:
        G, tail, dim, steps, b_steps = 7, 8, 1280, 600, 300
        arms = ARMS
    arms = [a for a in arms if (a["name"] in args.arms if args.arms else not a.get("extra"))]
    results = {"settings": {"groups": G, "tail": tail, "dim": dim, "steps": steps, "sigma": 10.0, "clip": 1.0,
                            "seeds": args.seeds, "tune_seed": args.tune_seed, "quick": args.quick,
                            "arms": [a["name"] for a in arms],
                            "lr_grids": {a["name"]: a["lr_grid"] for a in arms}},
               "synthetic": [], "banking77": []}
    # 1. synthetic
    probe, group_of_class = synthetic(G, tail, dim, 0)
    n, classes = len(probe), len(group_of_class)
    results["settings"].update({"num_examples": n, "classes": classes,
                                "group_sizes": [int((group_of_class[probe.y] == k).sum()) for k in range(G)],
                                "group_classes": [int((group_of_class == k).sum()) for k in range(G)]})
    common = {"noise_multiplier": 10.0, "max_grad_norm": 1.0, "batch_size": n, "steps": steps, "delta": 1e-5,
              "optimizer": "sgd", "eval_steps": list(range(steps // 15, steps + 1, steps // 15))}
    name = result_name("adambc" + ("" if args.part == "both" else f"_{args.part}") + ("_extra" if args.arms else ""),
                       args)
    for arm in (arms if args.part != "banking77" else []):
        res = run_arm(arm, probe, classes, common, args.seeds, args.tune_seed,
                      make_train=lambda s: synthetic(G, tail, dim, s)[0], groups=group_of_class)
        results["synthetic"].append(res)
        save(name, results, args.out)  # so far
        accs = group_summary(res, "train", G)
        print(f"[{time.perf_counter() - start:5.0f} s] synthetic {arm['name']}: lr {res['lr']:.3g}, train acc per "
              f"group {[round(a['mean'] * 100, 1) if a else None for a in accs]}", flush=True)
    # 2. Banking77 (Zipf-subsampled), frozen features
    train, dev, group, edges = banking77_zipf(quick=args.quick)
    classes = int(group.numel())
    results["settings"]["banking77"] = {
        "train_rows": len(train), "dev_rows": len(dev), "epsilon": 8.0, "steps": b_steps, "group_edges": edges,
        "group_classes": [int((group == k).sum()) for k in range(len(edges))],
        "group_rows": [int((group[train.y] == k).sum()) for k in range(len(edges))]}
    # sigma for epsilon = 8 after b_steps full-batch steps: the default mechanism's calibration, once for all arms
    # (DP-AdamBC's gamma' grid is a multiple of Phi = (sigma C / B)^2).
    sigma = calibrate(PoissonGaussian(1.0), 8.0, 1e-5, b_steps)
    common = {"noise_multiplier": sigma, "delta": 1e-5, "batch_size": len(train), "steps": b_steps,
              "optimizer": "sgd"}
    for arm in (arms if args.part != "synthetic" else []):
        res = run_arm(arm, train, classes, common, args.seeds, args.tune_seed, groups=group,
                      evaluate_extra={"dev": dev})
        results["banking77"].append(res)
        save(name, results, args.out)  # so far
        print(f"[{time.perf_counter() - start:5.0f} s] banking77 {arm['name']}: lr {res['lr']:.3g}, train acc per "
              f"group {[round(a['mean'] * 100, 1) if a else None for a in group_summary(res, 'train', len(edges))]}",
              flush=True)
    results["seconds"] = time.perf_counter() - start
    save(name, results, args.out)
    print(tables(results))
    if name in ("adambc", "adambc_synthetic"):
        plot(results)


def report(folder) -> None:
    """Merge the saved parts (``--part synthetic`` / ``banking77``, and ``--arms`` extras) into one table and plot."""
    from pathlib import Path

    parts = {n: json.loads((Path(folder) / f"adambc_{n}.json").read_text())
             for n in ("synthetic", "banking77", "banking77_extra") if (Path(folder) / f"adambc_{n}.json").exists()}
    merged = parts.get("synthetic") or parts["banking77"]
    merged = {**merged, "banking77": [r for n in ("banking77", "banking77_extra") for r in parts.get(n, {}).get(
        "banking77", [])]}
    if "banking77" in parts:
        merged["settings"] = {**merged["settings"], "banking77": parts["banking77"]["settings"]["banking77"]}
    print(tables(merged))
    if merged["synthetic"]:
        plot(merged)


def tables(results: dict) -> str:
    s = results["settings"]
    out = []
    G = s["groups"]
    head = " | ".join(f"g{k} ({s['group_classes'][k]}×{s['group_sizes'][k] // max(1, s['group_classes'][k])})"
                      for k in range(G))
    out += [f"Synthetic, training accuracy % per group (classes × examples per class), mean ± sd of "
            f"{len(s['seeds'])} seeds", "", f"| arm | lr | σ | ε | {head} |", "|---|---|---|---|" + "---|" * G]
    for res in results["synthetic"]:
        gam = f", γ′ {res['tuned']['gamma']:.2g}" if "gamma" in res["tuned"] else ""
        accs = " | ".join(fmt(a) if a else "-" for a in group_summary(res, "train", G))
        out.append(f"| {res['arm']} | {res['lr']:.3g}{gam} | {res['sigma']:.3g} | {res['epsilon']:.1f} | {accs} |")
    b = s["banking77"]
    ng = len(b["group_edges"])
    head = " | ".join(f"≥{e} rows ({b['group_classes'][k]} cl.)" for k, e in enumerate(b["group_edges"]))
    for split in ("train", "dev"):
        out += ["", f"Banking77 Zipf ({b['train_rows']} rows), {split} accuracy % per group", "",
                f"| arm | lr | σ | {head} | all |", "|---|---|---|" + "---|" * (ng + 1)]
        for res in results["banking77"]:
            ok = [r for r in res["runs"] if not r["diverged"]]
            gam = f", γ′ {res['tuned']['gamma']:.2g}" if "gamma" in res["tuned"] else ""
            accs = " | ".join(fmt(a) if a else "-" for a in group_summary(res, split, ng))
            allacc = fmt(spread([r["final"][split]["acc"] for r in ok])) if ok else "-"
            out.append(f"| {res['arm']} | {res['lr']:.3g}{gam} | {res['sigma']:.3g} | {accs} | {allacc} |")
    return "\n".join(out)


def plot(results: dict) -> None:
    plt = pyplot()
    s = results["settings"]
    G = s["groups"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for i, res in enumerate(results["synthetic"]):
        ok = [r for r in res["runs"] if not r["diverged"]]
        if not ok:
            continue
        steps = [p["step"] for p in ok[0]["curve"]]
        loss = [sum(r["curve"][j]["train"]["loss"] for r in ok) / len(ok) for j in range(len(steps))]
        axes[0].plot(steps, loss, color=f"C{i}", label=res["arm"])
        for ax, k in ((axes[1], G - 1), (axes[2], G - 2)):
            acc = [100 * sum(r["curve"][j]["train"]["group_acc"][k] for r in ok) / len(ok) for j in range(len(steps))]
            ax.plot(steps, acc, color=f"C{i}", label=res["arm"])
    axes[0].set_title("synthetic: training loss")
    axes[0].set_yscale("log")
    for ax, k in ((axes[1], G - 1), (axes[2], G - 2)):
        per = s["group_sizes"][k] // s["group_classes"][k]
        ax.set_title(f"group {k}: {s['group_classes'][k]} classes × {per} examples (training acc %)", fontsize=9)
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Heavy-tailed linear softmax: {s['classes']} classes in {G} groups, N = {s['num_examples']}, "
                 f"d = {s['dim']}, full batch, C = 1, σ = 10; mean of {len(s['seeds'])} seeds", fontsize=9)
    save_figure(fig, "studies_adambc")


if __name__ == "__main__":
    main()
