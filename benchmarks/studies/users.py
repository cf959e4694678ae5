"""users study: which privacy unit? ULS vs ELS vs row-level DP-SGD converted by group privacy, at user-level DP.

Charles et al., "Fine-tuning large language models with user-level differential privacy" (SaTML 2025) and Chua et
al., "Mind the privacy unit! User-level differential privacy for language model fine-tuning" (COLM 2024) claim that
(a) the per-user methods beat row-level DP-SGD converted to user level by group privacy, (b) the contribution bound
k has an interior best value (few rows: data dropped; many rows: noise per user), and (c) user-level sampling (ULS)
is ahead of example-level sampling (ELS) at small epsilon. Three arms at the same user-level (epsilon, delta),
delta = 1 / (10 users):

1. ULS (``user_sampling: users``): users Poisson-sampled, up to k rows per sampled user, the user's mean gradient
   clipped to C as one unit, accounted as DP-SGD over users;
2. ELS (``user_sampling: rows``): users bounded once to k rows, rows Poisson-sampled and clipped one by one, the
   user-level mixture-of-Gaussians accountant (``dpl.core.accounting.els_epsilon``);
3. group: the same bounding to k rows (``Users.bounded_rows``, seeded per run), then ordinary row-level DP-SGD at
   (eps_r, delta_r) = (epsilon / k, delta / (k e^((k-1) eps_r))), so that group privacy
   (``dpl.core.accounting.group_privacy``) gives exactly the user-level (epsilon, delta) (checked in the code).

Setting: SST-2, frozen MiniLM features (``common.sst2``: 8,192 training rows, 2,048 tuning rows, the 872 GLUE
validation rows reported), a linear head, SGD with momentum 0.9, C = 1, T = 200 steps for every arm. Two
assignments of training rows to users:

* ``zipf``: each row goes to user j in 1 .. 500 with probability proportional to 1 / j (seed 0): 500 users, median
  ~5 rows, the largest ~1,200 (with 8,192 rows a 1 / j law cannot give "a few" at the median and only hundreds at
  the top: the top user's share is 1 / H(500) = 15%); the exact summary is in the JSON;
* ``uniform``: every user exactly 8 rows (1,024 users; the rows are a random subset, so consecutive blocks of 8).

No natural unit: GLUE's SST-2 file carries no sentence or review id (the phrases of one treebank sentence could be
recovered only by phrase containment over all 67,349 rows), and the cached training rows are a random 12% of the
file, so most sentences would contribute one or two rows: nearly row-level, not worth a third assignment.

Batches: every arm samples at the same rate q = B / R_k, where B = 256 expected rows and R_k = sum over users of
min(rows, k) (the rows left after bounding). ELS and group sample rows at q (B = 256 rows per step); ULS samples users
at q, i.e. B_u = round(256 * users / R_k) expected users per step, which brings the same 256 expected rows (a
sampled user brings on average R_k / users rows). So at k = 1 all three arms sample the same rate with the same
accounting (Poisson Gaussian over users = rows): the same sigma (a sanity check in the table).

Tuning: each arm's lr on the grid {0.003, 0.01, 0.03, 0.1}, widened once at an edge (``common.tune``), scored by accuracy
on the tuning split with a tuning seed; then 3 paired seeds report validation accuracy (mean +- sd).
Grid: ``zipf``: user-level epsilon in {1, 4, 8} and k in {1, 2, 4, 8, 16}; ``uniform``: epsilon in {1, 8} and k in
{1, 8} only (the sanity check and all of every user's rows; every user has 8 rows, so k = 16 is k = 8): the shared
2-core machine ran at a load average of 10-15 and the full uniform grid did not fit the time.
The two assignments can run as two processes (``--assignments zipf`` / ``--assignments uniform``); ``--resume``
without ``--assignments`` then merges them into users.json (table and figure).

    python benchmarks/studies/users.py            # full study (benchmarks/results/studies/users.json, a figure)
    python benchmarks/studies/users.py --resume   # skip the cells already in users.json
    python benchmarks/studies/users.py --quick    # a few steps on tiny data (the test)
    python benchmarks/studies/users.py --assignments zipf --epsilons 8 --reverse-k   # a part, as a second process
"""

from __future__ import annotations

import json
import math
import time

import torch

from dpl.core.accounting import group_privacy
from dpl.core.units import Users

from common import (Split, choose, fmt, pyplot, result_name, save, save_figure, spread, sst2, study_parser,
                    train_private, tune)

ARMS = ("ULS", "ELS", "group")
EPSILONS = {"zipf": [1.0, 4.0, 8.0], "uniform": [1.0, 8.0]}
KS = {"zipf": [1, 2, 4, 8, 16], "uniform": [1, 8]}
LR_GRID = [0.003, 0.01, 0.03, 0.1]


def zipf_keys(n: int, users: int, seed: int = 0) -> list[int]:
    """Each of ``n`` rows goes to user j (1 .. users) with probability proportional to 1 / j; users are renumbered
    by first appearance (a user drawn for no row does not exist)."""
    weights = 1.0 / torch.arange(1, users + 1, dtype=torch.float64)
    return torch.multinomial(weights, n, replacement=True, generator=torch.Generator().manual_seed(seed)).tolist()


def uniform_keys(n: int, per_user: int) -> list[int]:
    return [i // per_user for i in range(n)]


def row_level(epsilon: float, delta: float, k: int) -> tuple[float, float]:
    """The row-level (eps_r, delta_r) whose group-privacy conversion to k rows is the user-level (epsilon, delta)."""
    eps_r = epsilon / k
    delta_r = delta / (k * math.exp((k - 1) * eps_r))
    eps_k, delta_k = group_privacy(eps_r, delta_r, k)
    assert math.isclose(eps_k, epsilon, rel_tol=1e-9) and math.isclose(delta_k, delta, rel_tol=1e-9)
    return eps_r, delta_r


def run_one(arm: str, train: Split, keys: list[int], k: int, epsilon: float, lr: float, seed: int, steps: int,
            rows_per_step: int, evaluate_on: dict, sigma: float | None = None) -> dict:
    """One private training of ``arm`` (``sigma``: reuse a calibrated noise multiplier)."""
    users = Users.from_keys(keys, k)
    delta = 1.0 / (10 * users.num_users)
    bounded = users.sampled(False)
    common = {"lr": lr, "optimizer": "sgd", "momentum": 0.9, "max_grad_norm": 1.0, "steps": steps, "seed": seed,
              "evaluate_on": evaluate_on, "noise_multiplier": sigma, "physical_batch_size": 4096}
    if arm == "group":
        rows = users.bounded_rows(torch.Generator().manual_seed(seed))
        eps_r, delta_r = row_level(epsilon, delta, k)
        r = train_private(Split(train.x[rows], train.y[rows]), 2, epsilon=eps_r, delta=delta_r,
                          batch_size=rows_per_step, **common)
        r["row_level"] = {"epsilon": eps_r, "delta": delta_r, "epsilon_spent": r["epsilon"]}
        r["epsilon_user"], r["delta_user"] = group_privacy(r["epsilon"], delta_r, k)
    else:
        batch = rows_per_step if arm == "ELS" else max(1, round(rows_per_step * users.num_users / bounded))
        r = train_private(train, 2, epsilon=epsilon, delta=delta, batch_size=batch, user_keys=keys,
                          max_rows_per_user=k, user_sampling="users" if arm == "ULS" else "rows", **common)
        r["epsilon_user"], r["delta_user"] = r["epsilon"], delta
    r["batch_size"] = rows_per_step if arm != "ULS" else batch
    r["sample_rate"] = r["batch_size"] / (users.num_users if arm == "ULS" else bounded)
    return r


def run_cell(arm: str, data, keys: list[int], k: int, epsilon: float, grid: list[float], seeds: list[int],
             tune_seed: int, steps: int, rows_per_step: int) -> dict:
    """Tune ``arm``'s lr on the tuning split, then the paired report seeds on the validation split."""
    sigma: dict[str, float] = {}
    first: dict = {}

    def once(lr: float, seed: int, split: dict) -> dict:
        r = run_one(arm, data.train, keys, k, epsilon, lr, seed, steps, rows_per_step, split, sigma.get("s"))
        sigma.setdefault("s", r["sigma"])  # calibrated once per cell (the same q, T, target for every run)
        if not first:
            first.update(r)
        return r

    def score(lr: float) -> float:
        r = once(lr, tune_seed, {"tune": data.tune})
        return -math.inf if r["diverged"] else r["final"]["tune"]["acc"]

    tuned = tune(score, grid, f"{arm} eps={epsilon:g} k={k} lr")
    runs = [once(tuned["best"], s, {"test": data.test}) for s in seeds]
    users = Users.from_keys(keys, k)
    return {"arm": arm, "epsilon": epsilon, "k": k, "lr": tuned["best"], "tuned": tuned, "sigma": first["sigma"],
            "epsilon_spent": first["epsilon_user"], "delta": first["delta_user"],
            "row_level": first.get("row_level"), "batch_size": first["batch_size"],
            "sample_rate": first["sample_rate"], "bounded_rows": users.sampled(False), "steps": steps,
            "seeds": seeds, "per_seed_acc": [None if r["diverged"] else r["final"]["test"]["acc"] for r in runs],
            "diverged": sum(r["diverged"] for r in runs), "seconds_per_run": sum(r["seconds"] for r in runs) / len(runs)}


def parser():
    """The command line; the study's defaults (EPSILONS, KS, LR_GRID) are the published table's settings."""
    parser = study_parser(__doc__)
    parser.add_argument("--resume", action="store_true",
                        help="keep the cells already in the results file (and in users_<assignment>.json)")
    parser.add_argument("--assignments", nargs="+", choices=["zipf", "uniform"], default=["zipf", "uniform"],
                        help="run only these assignments (results: users_<assignment>.json; a later --resume of "
                             "both merges them)")
    parser.add_argument("--epsilons", type=float, nargs="+", default=None,
                        help="run only these user-level epsilons (with --assignments: a part to merge by --resume)")
    parser.add_argument("--reverse-k", action="store_true",
                        help="the k values from the largest (a second process working toward the first)")
    return parser


def main() -> None:
    args = parser().parse_args()
    choose([f"{e:g}" for e in args.epsilons or []], sorted({f"{e:g}" for v in EPSILONS.values() for e in v}),
           "epsilon")
    start = time.perf_counter()
    if args.quick:
        data = sst2(train=1024, tune=512, quick=True)
        args.seeds = args.seeds[:2]
        epsilons, ks, steps, rows_per_step, grid = {"zipf": [4.0], "uniform": [4.0]}, {"zipf": [1, 4], "uniform": [1, 4]}, \
            8, 64, [0.1, 1.0]
        zipf_users, per_user = 100, 8
    else:
        data = sst2(train=8192, tune=2048)
        epsilons, ks, steps, rows_per_step = EPSILONS, KS, 200, 256
        grid, zipf_users, per_user = LR_GRID, 500, 8
    n = len(data.train)
    assignments = {"zipf": zipf_keys(n, zipf_users), "uniform": uniform_keys(n, per_user)}
    both = len(args.assignments) == 2
    name = result_name("users" + ("" if both else "_" + args.assignments[0]), args)
    path = args.out / f"{name}.json"
    results = {"settings": {"rows": n, "tune_rows": len(data.tune), "test_rows": len(data.test),
                            "steps": steps, "rows_per_step": rows_per_step, "clip": 1.0, "optimizer": "sgd",
                            "momentum": 0.9, "lr_grid": grid, "epsilons": epsilons, "ks": ks, "seeds": args.seeds,
                            "tune_seed": args.tune_seed, "quick": args.quick,
                            "assignments": {a: Users.from_keys(keys, 1).summary() | {"users_drawn": zipf_users}
                                            if a == "zipf" else Users.from_keys(keys, 1).summary() | {
                                                "rows_per_user": per_user} for a, keys in assignments.items()}},
               "cells": []}
    if args.resume:
        parts = [path] + ([args.out / f"{name.replace('users', f'users_{a}', 1)}.json" for a in assignments]
                          if both else [])
        for part in parts:
            if part.exists():
                old = json.loads(part.read_text())
                keys_done = {(c["assignment"], c["epsilon"], c["k"], c["arm"]) for c in results["cells"]}
                results["cells"] += [c for c in old["cells"] if c["assignment"] in args.assignments and (
                    c["assignment"], c["epsilon"], c["k"], c["arm"]) not in keys_done]
                results["seconds_before"] = results.get("seconds_before", 0.0) + old.get("seconds", 0.0)
    done = {(c["assignment"], c["epsilon"], c["k"], c["arm"]) for c in results["cells"]}
    for a, keys in assignments.items():
        if a not in args.assignments:
            continue
        print(f"{a}: {Users.from_keys(keys, 1).describe()}", flush=True)
        for epsilon in epsilons[a]:
            if args.epsilons and epsilon not in args.epsilons:
                continue
            for k in (reversed(ks[a]) if args.reverse_k else ks[a]):
                for arm in ARMS:
                    if (a, epsilon, k, arm) in done:
                        continue
                    cell = {"assignment": a, **run_cell(arm, data, keys, k, epsilon, grid, args.seeds,
                                                        args.tune_seed, steps, rows_per_step)}
                    results["cells"].append(cell)
                    save(name, results, args.out)
                    acc = spread([v for v in cell["per_seed_acc"] if v is not None])
                    print(f"[{time.perf_counter() - start:5.0f} s] {a} eps={epsilon:g} k={k} {arm}: lr "
                          f"{cell['lr']:.3g}, sigma {cell['sigma']:.3g}, acc {fmt(acc)} "
                          f"({cell['seconds_per_run']:.1f} s per run)", flush=True)
    results["seconds"] = time.perf_counter() - start
    save(name, results, args.out)
    print(table(results))
    if name == "users":
        plot(results)


def table(results: dict) -> str:
    s = results["settings"]
    out = []
    for a, ks in s["ks"].items():
        if not any(c["assignment"] == a for c in results["cells"]):
            continue
        u = s["assignments"][a]
        cells = {(c["epsilon"], c["k"], c["arm"]): c for c in results["cells"] if c["assignment"] == a}
        out += ["", f"{a}: {u['users']} users, rows per user min {u['rows_per_user_min']} / median "
                f"{u['rows_per_user_median']:g} / max {u['rows_per_user_max']}; validation accuracy %, mean ± sd of "
                f"{len(s['seeds'])} seeds (σ in brackets)", "",
                "| ε (user) | k | ULS | ELS | group privacy |", "|---|---|---|---|---|"]
        for epsilon in s["epsilons"][a]:
            for k in ks:
                row = []
                for arm in ARMS:
                    c = cells.get((epsilon, k, arm))
                    if c is None:
                        row.append("-")
                        continue
                    acc = spread([v for v in c["per_seed_acc"] if v is not None])
                    edge = "*" if c["tuned"]["at_edge"] else ""
                    row.append(f"{fmt(acc)} (σ {c['sigma']:.2f}){edge}")
                out.append(f"| {epsilon:g} | {k} | " + " | ".join(row) + " |")
    out.append("\n`*`: the tuned lr is still at an edge of the widened grid.")
    return "\n".join(out)


def plot(results: dict) -> None:
    plt = pyplot()
    s = results["settings"]
    rows = [a for a in s["ks"] if any(c["assignment"] == a for c in results["cells"])]
    cols = max(len(s["epsilons"][a]) for a in rows)
    fig, axes = plt.subplots(len(rows), cols, figsize=(4 * cols, 3.2 * len(rows)), squeeze=False)
    for i, a in enumerate(rows):
        for ax in axes[i][len(s["epsilons"][a]):]:
            ax.axis("off")
        for j, epsilon in enumerate(s["epsilons"][a]):
            ax = axes[i][j]
            for m, arm in enumerate(ARMS):
                cs = sorted((c for c in results["cells"] if c["assignment"] == a and c["epsilon"] == epsilon
                             and c["arm"] == arm), key=lambda c: c["k"])
                if not cs:
                    continue
                accs = [spread([v for v in c["per_seed_acc"] if v is not None]) for c in cs]
                ax.errorbar([c["k"] for c in cs], [100 * x["mean"] for x in accs], [100 * x["sd"] for x in accs],
                            marker="o", capsize=3, color=f"C{m}", label=arm)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{a} users, user-level ε = {epsilon:g}", fontsize=9)
            ax.set_xlabel("k (max rows per user)")
            ax.set_ylabel("validation accuracy %")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"SST-2, frozen MiniLM features, linear head, T = {s['steps']}, {s['rows_per_step']} expected rows "
                 f"per step, δ = 1/(10 users); mean ± sd of {len(s['seeds'])} seeds", fontsize=9)
    save_figure(fig, "studies_users")


if __name__ == "__main__":
    main()
