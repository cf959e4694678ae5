"""The synthetic heavy-tail study of Tang, Zhiyanov and Lécuyer (2025), scaled to CPU minutes: DP-GD, DP-GDM,
DP-Adam, DP-AdamBC.

Data (Kunstner et al.'s heavy-tailed construction, as in the paper's section 3): G groups of classes; group k
(k = 0 .. G-1) has 2^k classes with ``per_class * 2^(G-1-k)`` examples each, so every group holds the same number
of examples and class frequency falls like 1 / rank (Zipf). Inputs are uniform in [0, 1]^d, labels assigned as
above (random w.r.t. the inputs): the task is to fit the training set. Model: linear softmax (W in R^{c x d}).

Private full-batch gradient descent: per-example gradients (p_i - y_i) x_i^T (norm |p_i - y_i| |x_i|, exact),
clipped to C = 1, summed, plus N(0, sigma^2 C^2) with sigma = 10, divided by N. The noise is drawn with
dpl.core.noise.normal; DP-Adam and DP-AdamBC are the adambc plugin (bias_correction false / true) with plain SGD,
DP-GD and DP-GDM are torch.optim.SGD (momentum 0 / 0.9), exactly as the configs run them.

epsilon after T full-batch steps is that of one Gaussian mechanism with mu = sqrt(T) / sigma (exact, q = 1).

Learning rates on a half-power grid (10^(k/2)) per optimizer (and gamma' on a power grid for DP-AdamBC), picked
by the final training loss of seed 0; the picked settings are then run with 3 seeds (data and noise).

    OMP_NUM_THREADS=1 python benchmarks/adambc_synthetic.py            # ~10 min on one core
    python benchmarks/adambc_synthetic.py --plot-only                   # redraw from the JSON
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from dpl.core.gradients import PrivateGradient
from dpl.core.noise import normal
from dpl.core.step import ReleaseContext
from dpl_plugins.adambc import AdamBCPlugin

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "adambc_synthetic.json"
FIGURE = ROOT / "docs" / "figures" / "adambc_synthetic.png"
OPTIMIZERS = ("DP-GD", "DP-GDM", "DP-Adam", "DP-AdamBC")


def make_data(groups: int, per_class: int, dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    labels, group_of_class = [], []
    cls = 0
    for k in range(groups):
        for _ in range(2 ** k):
            labels += [cls] * (per_class * 2 ** (groups - 1 - k))
            group_of_class.append(k)
            cls += 1
    y = torch.tensor(labels)
    x = torch.rand(len(labels), dim, generator=gen)
    return x, y, torch.tensor(group_of_class), cls


def gaussian_epsilon(mu: float, delta: float) -> float:
    """epsilon of mu-GDP at delta (exact for the Gaussian mechanism): solve
    delta = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)."""
    def phi(t):
        return 0.5 * math.erfc(-t / math.sqrt(2))

    def delta_of(eps):
        return phi(-eps / mu + mu / 2) - math.exp(eps) * phi(-eps / mu - mu / 2)

    lo, hi = 0.0, 1.0
    while delta_of(hi) > delta:
        hi *= 2
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if delta_of(mid) > delta else (lo, mid)
    return hi


def evaluate(w, x, y, class_group, groups):
    with torch.no_grad():
        logits = x @ w.T
        loss = float(torch.nn.functional.cross_entropy(logits, y))
        correct = (logits.argmax(1) == y).float()
        g = class_group[y]
        acc = [float(correct[g == k].mean()) for k in range(groups)]
    return loss, acc


def train(opt_name: str, lr: float, gamma: float, args, seed: int, record: bool = False):
    x, y, class_group, c = make_data(args.groups, args.per_class, args.dim, seed)
    n = len(y)
    w = torch.nn.Parameter(torch.zeros(c, args.dim))
    noise_gen = torch.Generator().manual_seed(10_000 + seed)
    if opt_name == "DP-GD":
        opt, plugin = torch.optim.SGD([w], lr=lr), None
    elif opt_name == "DP-GDM":
        opt, plugin = torch.optim.SGD([w], lr=lr, momentum=0.9), None
    else:
        opt = torch.optim.SGD([w], lr=lr)
        plugin = AdamBCPlugin(beta1=0.9, beta2=0.999, gamma=gamma, bias_correction=opt_name == "DP-AdamBC")
    onehot = torch.nn.functional.one_hot(y, c).float()
    x_norm = x.norm(dim=1)
    std = args.sigma * args.clip
    ctx = ReleaseContext(trainable={"W": w}, max_grad_norm=args.clip, noise_multiplier=args.sigma,
                         expected_batch_size=n, step=0, public_seed=0, optimizer=opt, log=lambda k, v: None)
    curve = []
    for t in range(args.steps):
        with torch.no_grad():
            err = torch.softmax(x @ w.T, dim=1) - onehot                   # dloss_i / dlogits_i
            factor = (args.clip / (err.norm(dim=1) * x_norm)).clamp(max=1.0)  # per-example clipping
            total = (err * factor[:, None]).T @ x                              # clipped sum, c x d
            noisy = (total + std * normal(total.shape, noise_gen)) / n
        if plugin is None:
            direction = noisy
        else:
            release = PrivateGradient({"W": noisy}, noise_std=std / n, mechanism="gaussian",
                                      expected_batch_size=n, step=t)
            ctx.step = t
            direction = plugin.precondition(ctx=ctx, gradient=release)["W"]
        opt.zero_grad()
        w.grad = direction
        opt.step()
        if not torch.isfinite(w).all():
            return {"final_loss": math.inf, "diverged": True, "curve": curve}
        if record and ((t + 1) % args.record_every == 0 or t == 0):
            loss, acc = evaluate(w, x, y, class_group, args.groups)
            curve.append({"step": t + 1, "epsilon": gaussian_epsilon(math.sqrt(t + 1) / args.sigma, args.delta),
                          "loss": loss, "group_acc": acc})
    loss, acc = evaluate(w, x, y, class_group, args.groups)
    return {"final_loss": loss, "final_group_acc": acc, "diverged": False, "curve": curve}


def grids(args):
    half = [10 ** (k / 2) for k in range(-12, 7)]  # 1e-6 .. 1e3
    lo = {"DP-GD": 1.0, "DP-GDM": 0.1, "DP-Adam": 1e-3, "DP-AdamBC": 1e-4}
    hi = {"DP-GD": 1000, "DP-GDM": 100, "DP-Adam": 0.3, "DP-AdamBC": 0.1}
    gammas = {"DP-AdamBC": [1e-8, 1e-7, 1e-6]}
    return {o: ([lr for lr in half if lo[o] * 0.99 <= lr <= hi[o] * 1.01], gammas.get(o, [1e-8])) for o in OPTIMIZERS}


def run(args):
    results = {"settings": vars(args).copy(), "tuning": {}, "best": {}, "runs": {}}
    n = args.per_class * 2 ** (args.groups - 1) * args.groups
    results["settings"].update({"num_examples": n, "num_classes": 2 ** args.groups - 1,
                                "final_epsilon": gaussian_epsilon(math.sqrt(args.steps) / args.sigma, args.delta)})
    start = time.time()
    for opt_name, (lrs, gammas) in grids(args).items():
        if args.only and opt_name not in args.only:
            continue
        table = []
        for gamma in gammas:
            for lr in lrs:
                out = train(opt_name, lr, gamma, args, seed=0)
                table.append({"lr": lr, "gamma": gamma, "final_loss": out["final_loss"],
                              "final_group_acc": out.get("final_group_acc")})
                print(f"[{time.time() - start:6.0f}s] {opt_name:9s} lr={lr:.3g} gamma={gamma:.0e} "
                      f"loss={out['final_loss']:.4f} acc={['%.2f' % a for a in out.get('final_group_acc', [])]}",
                      flush=True)
        best = min(table, key=lambda r: r["final_loss"])
        results["tuning"][opt_name] = table
        results["best"][opt_name] = {"lr": best["lr"], "gamma": best["gamma"]}
        results["runs"][opt_name] = [train(opt_name, best["lr"], best["gamma"], args, seed=s, record=True)
                                     for s in range(args.seeds)]
        print(f"[{time.time() - start:6.0f}s] {opt_name}: best lr={best['lr']:.3g} gamma={best['gamma']:.0e}; "
              f"final group acc (mean of {args.seeds} seeds) "
              f"{[round(sum(r['final_group_acc'][k] for r in results['runs'][opt_name]) / args.seeds, 3) for k in range(args.groups)]}",
              flush=True)
    results["seconds"] = time.time() - start
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1))
    return results


def plot(results):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = results["settings"]["groups"]
    shown = [0, groups // 2, groups - 1]
    fig, axes = plt.subplots(1, 1 + len(shown), figsize=(4.2 * (1 + len(shown)), 3.6))
    colors = dict(zip(OPTIMIZERS, ["tab:blue", "tab:orange", "tab:green", "tab:red"]))
    for opt_name, runs in results["runs"].items():
        eps = [p["epsilon"] for p in runs[0]["curve"]]
        mean = lambda key: [sum(r["curve"][i][key] for r in runs) / len(runs) for i in range(len(eps))]  # noqa: E731
        best = results["best"][opt_name]
        label = f"{opt_name} (lr {best['lr']:.2g}" + (f", γ' {best['gamma']:.0e})" if opt_name == "DP-AdamBC" else ")")
        axes[0].plot(eps, mean("loss"), color=colors[opt_name], label=label)
        for ax, k in zip(axes[1:], shown):
            acc = [sum(r["curve"][i]["group_acc"][k] for r in runs) / len(runs) for i in range(len(eps))]
            ax.plot(eps, [100 * a for a in acc], color=colors[opt_name])
    s = results["settings"]
    axes[0].set_title("training loss")
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=7)
    for ax, k in zip(axes[1:], shown):
        size = s["per_class"] * 2 ** (groups - 1 - k)
        ax.set_title(f"group {k}: {2 ** k} classes x {size} examples", fontsize=9)
        ax.set_ylabel("training accuracy (%)")
    for ax in axes:
        ax.set_xlabel("ε (δ = %.0e)" % s["delta"])
        ax.grid(alpha=0.3)
    fig.suptitle(f"Linear softmax, {s['num_classes']} classes in {groups} Zipf groups, N = {s['num_examples']}, "
                 f"d = {s['dim']}, full batch, C = {s['clip']}, σ = {s['sigma']} (mean of {s['seeds']} seeds)",
                 fontsize=9)
    fig.tight_layout()
    FIGURE.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(FIGURE, dpi=110)
    print(f"wrote {FIGURE}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--per-class", type=int, default=64, dest="per_class")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--sigma", type=float, default=10.0)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--record-every", type=int, default=25, dest="record_every")
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--plot-only", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = json.loads(RESULTS.read_text()) if args.plot_only else run(args)
    plot(results)


if __name__ == "__main__":
    main()
