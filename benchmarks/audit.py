"""One-run privacy audit (dpl audit) of every installed mechanism/plugin at epsilon in {1, 4, 8}, honest and with
planted bugs: table (markdown) + JSON + PNG.

    OMP_NUM_THREADS=1 python benchmarks/audit.py [--quick] [--out benchmarks/results/audit.json]
        [--figure docs/figures/audit_bounds.png] [--from-json]

Settings (the same for every run; scaled to ~10-15 minutes of one CPU core): m = 50,000 Dirac gradient
canaries in a 448 x 448 linear layer, 1,000 ordinary examples, q = 0.075 (expected batch 1,950), 100 steps,
delta = 1e-6, 95 % confidence, guesses k+ in {5 %, 20 %, 45 %} of m (k- = 0), Bonferroni over the three.
With these settings a perfect attack could show at most epsilon >= 8.35 (the "ceiling").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from dpl.audit import AuditConfig, run_audit
from dpl.core.plugin_manager import installed_plugins

EPSILONS = (1.0, 4.0, 8.0)
# (label, plugins, score): the mechanisms audited, when installed.
MECHANISMS = [
    ("gaussian (DP-SGD)", None, "lr"),
    ("denoise", {"denoise": {}}, "lr"),
    ("adambc", {"adambc": {}}, "sign"),
    ("dpzero", {"dpzero": {}}, "sum"),
    ("ftrl", {"ftrl": {}}, "sum"),
]
BUGS = ("none", "weak_noise", "no_clip", "noise_leak")


def settings(quick: bool) -> dict:
    if quick:  # a smoke test of the script (~1 minute), not the documented numbers
        m = 4000
        return dict(canaries=m, examples=200, batch_size=160, steps=60, rows=128, cols=128, target_delta=1e-6,
                    guesses=[[m // 20, 0], [m // 5, 0], [9 * m // 20, 0]], confidence=0.95, seed=0)
    m = 50000
    return dict(canaries=m, examples=1000, batch_size=1950, steps=100, rows=448, cols=448, target_delta=1e-6,
                guesses=[[m // 20, 0], [m // 5, 0], [9 * m // 20, 0]], confidence=0.95, seed=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/audit.json")
    parser.add_argument("--figure", default="docs/figures/audit_bounds.png")
    parser.add_argument("--from-json", action="store_true", help="only redraw the table and figure from --out")
    args = parser.parse_args()
    if args.from_json:
        saved = json.loads(Path(args.out).read_text())
        print_table(saved["runs"])
        plot(saved["runs"], saved["meta"], args.figure)
        return
    base = settings(args.quick)
    available = set(installed_plugins())
    runs = []
    start_all = time.perf_counter()
    for label, plugins, score in MECHANISMS:
        if plugins is not None and not set(plugins) <= available:
            print(f"# {label}: not installed, skipped", flush=True)
            continue
        for bug in BUGS:
            if bug == "noise_leak" and plugins is not None:
                continue  # the leak attack replays the default gaussian noise (refused with other release paths)
            for eps in EPSILONS:
                cfg = AuditConfig(target_epsilon=eps, plugins=plugins, score=score, inject=bug, **base)
                result = run_audit(cfg)
                row = {**{k: v for k, v in result.to_dict().items() if k not in ("config", "guesses")},
                       "label": label, "score": score, "inject": bug, "target_epsilon": eps}
                runs.append(row)
                print(f"{label:18s} {bug:10s} eps={eps:g}: claimed {result.claimed_epsilon:.3f}, bound "
                      f"{result.lower_bound:.3f} ({result.best.correct}/{result.best.guesses} correct), "
                      f"{'VIOLATION' if result.violation else 'ok'}, {result.seconds:.1f}s", flush=True)
    total = time.perf_counter() - start_all
    meta = {"settings": base, "seconds": total, "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores "
            f"visible, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}", "quick": args.quick,
            "ceiling": runs[0]["ceiling"] if runs else None}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "runs": runs}, indent=1) + "\n")
    print(f"\n# {len(runs)} audits in {total / 60:.1f} min; ceiling (perfect guesses) {meta['ceiling']:.3f}\n")
    print_table(runs)
    plot(runs, meta, args.figure)


def print_table(runs: list[dict]) -> None:
    labels = {"none": "honest", "weak_noise": "noise ×0.1", "no_clip": "clipping off", "noise_leak": "noise leaked"}
    print("| mechanism (score) | bug | " + " | ".join(f"ε={e:g}: claimed / bound" for e in EPSILONS) + " |")
    print("|---|---|" + "---|" * len(EPSILONS))
    seen = []
    for r in runs:
        key = (r["label"], r["inject"])
        if key in seen:
            continue
        seen.append(key)
        cells = []
        for eps in EPSILONS:
            match = [x for x in runs if (x["label"], x["inject"]) == key and x["target_epsilon"] == eps]
            if match:
                x = match[0]
                flag = " **violation**" if x["violation"] else ""
                cells.append(f"{x['claimed_epsilon']:.2f} / {x['lower_bound']:.2f}{flag}")
            else:
                cells.append("—")
        score = next(x["score"] for x in runs if x["label"] == key[0])
        print(f"| {key[0]} ({score}) | {labels[key[1]]} | " + " | ".join(cells) + " |")


def plot(runs: list[dict], meta: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mechanisms = list(dict.fromkeys(r["label"] for r in runs))
    fig, axes = plt.subplots(1, len(mechanisms), figsize=(3.6 * len(mechanisms), 3.6), sharey=True, squeeze=False)
    styles = {"none": ("honest", "o", "C0"), "weak_noise": ("noise ×0.1", "s", "C3"),
              "no_clip": ("clipping off", "^", "C1"), "noise_leak": ("noise leaked", "D", "C4")}
    for ax, mech in zip(axes[0], mechanisms):
        claimed = sorted({(r["target_epsilon"], r["claimed_epsilon"]) for r in runs if r["label"] == mech})
        ax.plot([c[0] for c in claimed], [c[1] for c in claimed], "k--", lw=1, label="claimed ε")
        ax.axhline(meta["ceiling"], color="grey", lw=0.8, ls=":", label="ceiling (perfect guesses)")
        for bug, (label, marker, color) in styles.items():
            pts = sorted((r["target_epsilon"], r["lower_bound"]) for r in runs
                         if r["label"] == mech and r["inject"] == bug)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color, label=label)
        ax.set_title(mech)
        ax.set_xlabel("claimed ε (target)")
        ax.set_xticks(list(EPSILONS))
    axes[0][0].set_ylabel("audited lower bound on ε (95 %)")
    handles, labels = axes[0][0].get_legend_handles_labels()  # the first panel (gaussian) has every series
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    s = meta["settings"]
    fig.suptitle(f"One-run audit: m = {s['canaries']} canaries, {s['steps']} steps, δ = {s.get('target_delta', s.get('delta')):g}", fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"\nfigure: {path}")


if __name__ == "__main__":
    main()
