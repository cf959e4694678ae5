"""clipping study: flat vs per-layer clipping (fixed and adaptive thresholds) at equal epsilon, which decides dpl's
default ``privacy.clipping``.

He, Li, Yu, Zhang, Kulkarni, Lee, Backurs, Yu & Bian, "Exploring the limits of differentially private deep learning
with group-wise clipping" (ICLR 2023): per-layer clipping with constant thresholds underperforms flat clipping, with
adaptive thresholds (Andrew, Thakkar, McMahan & Ramaswamy, "Differentially private learning with adaptive clipping",
NeurIPS 2021) it matches or beats it; Bu, Wang, Zha & Karypis ("On the efficacy of group-wise clipping", 2023) find
the gap shrinking with model size. Arms, at the same (epsilon, delta), sampler and accountant: ``flat`` (dpl's
default: each example's whole gradient clipped to C), ``per-layer fixed`` (configs/clipping/per-layer.yaml: each
layer clipped to C_g proportional to the square root of its parameters, sum_g C_g^2 = C^2) and ``per-layer
adaptive`` (configs/clipping/per-layer-adaptive.yaml: each C_g moved each step toward the median of its per-example
norms from a noisy count; the counts take 0.1 of 1/sigma^2, so the gradient's noise multiplier is sigma / sqrt(0.9)).
The arms' privacy settings are read from those configs. Every run trains the real model as dpl's task modules build
it through dpl's private engine (``finetune.py``'s machinery); seeds are paired (the same sampler, noise and dropout
seeds for every arm).

Row ``sst2`` (the default): MiniLM-L6 FULL fine-tuning (every one of its 22.6M parameters, embeddings included, and
a new linear head on mean pooling) on SST-2: every training row but 2,048 (65,301 rows, one random order, seed 0) to
train on, those 2,048 held-out training rows to tune on, the GLUE validation set (872 rows) to report on; max 64
tokens; Poisson B = 256 (micro-batches of 32, longest first), 36 steps, C = 1, delta = 1 / (10 N), SGD momentum 0.9;
epsilon in {1, 3, 8}. Each arm's lr is tuned per epsilon on the held-out rows (tuning seed; accuracy minus 0.001 x
loss) on {0.03, 0.1, 0.3}, widened once if the best is at an edge; then the report seeds (0, 1, 2): validation
accuracy and loss, mean +- sd and each seed, the paired difference to flat, and the wall time of each run.

What that size can show, and what it cannot: it is sized to run in at most 8 CPU-hours on one thread of this CPU
(``--time-steps 3`` measures each arm's step and estimates the row; docs/studies.md has the figures). 36 steps of
B = 256 see 9,216 examples, a seventh of an epoch (q = 0.004, each example used at most about once): the comparison
is of the first steps of full fine-tuning at three privacy levels, with each arm's lr tuned, on the real model and
all of SST-2's training rows (the small sampling rate keeps sigma low). It cannot show where the arms end after
epochs of training (the regime of He et al.'s tables), nor resolve differences smaller than the seeds' spread on
872 validation rows (a point or more). Adaptive thresholds start at the fixed split and move each step by a factor
exp(-0.2 (b - 0.5)) before the rescaling, within e^0.1 while the released fraction b is in [0, 1]: in 36 steps a
threshold travels at most about e^3.6 = 37 from where it started, so a verdict that per-layer adaptive matches flat
holds for short runs, and one that it does not may change with more steps.

Row ``e2e`` (only with ``--row e2e``): the denoise study's generation setting (``finetune.py denoise``):
SmolLM2-135M-Instruct + LoRA r = 32 on q/k/v/o, E2E (100 held-out mrs), Poisson B = 64 (micro-batches of 16, as
the denoise study's CPU runs: one micro-batch of 64 needs more than 16 GB), Adam lr 2e-4 (the paper's,
not tuned), epsilon 5.4 planned at 400 steps and stopped at step 50, scored there by greedy generation (BLEU, ROUGE-L,
METEOR, NIST, CIDEr); seeds 0, 1, 2. About 4,500-6,300 s a run on one thread (the denoise study's step-50 runs):
9 runs, about 11-16 CPU-hours, so run in two parts: ``--arms flat "per-layer adaptive"`` (6 runs, the comparison the
default depends on), then the rest (per-layer fixed) with ``--resume``. A fourth arm, ``per-layer adaptive (A+B)``,
tests a reading of the first three: adaptive thresholds with each adapter's A and B in one group
(``privacy.clipping_groups``, one pattern per adapted module: 120 groups where the default has 240), so that no
threshold follows an A matrix's near-zero gradients alone; a results file of the first three arms resumes under it
(``arms_added``), running only its 3 runs.

Results: ``<out>/clipping_<row>.json`` (other seeds: ``_seeds<first>`` / ``_tune<seed>`` in the name; ``--quick``:
``_quick``), written after every run with every tuning score and per-seed value, the seeds and the tuning seed in its
settings; ``--resume`` continues from the first run not saved (parts may run at once with ``--epsilons``, each save
keeping what the others saved), and with ``--checkpoint-dir`` from a run's state saved every 10 minutes
(``finetune.py``); progress on stderr; ``--table RESULTS`` prints the docs' tables without training.

    python benchmarks/studies/clipping.py --resume                     # row sst2: the full study (CPU, one thread)
    python benchmarks/studies/clipping.py --seeds 3 4 5 --tune-seed 7 --resume   # the same with other seeds
    python benchmarks/studies/clipping.py --row e2e --arms flat "per-layer adaptive" --resume \
        --checkpoint-dir ~/.cache/dpl-studies                          # row e2e (step 50): its first part
    python benchmarks/studies/clipping.py --row e2e --resume --checkpoint-dir ~/.cache/dpl-studies   # then the rest
    python benchmarks/studies/clipping.py --row e2e --arms "per-layer adaptive (A+B)" --resume \
        --checkpoint-dir ~/.cache/dpl-studies                          # row e2e: adapters' A and B grouped
    python benchmarks/studies/clipping.py --time-steps 3               # only time 3 steps of each arm
    python benchmarks/studies/clipping.py --quick                      # a few steps on tiny data (the test)
    python benchmarks/studies/clipping.py --table benchmarks/results/studies/clipping_sst2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

import finetune
from common import ROOT, choose, fmt, result_name, save, spread, study_parser


def config_privacy(name: str) -> dict[str, Any]:
    """The ``privacy`` settings of a shipped clipping config (configs/clipping/<name>)."""
    config = yaml.safe_load((ROOT / "configs" / "clipping" / name).read_text())
    return config["model"]["init_args"]["privacy"]


ARMS = [
    {"name": "flat", "plugins": None, "clipping": None},
    {"name": "per-layer fixed", "plugins": None, "clipping": config_privacy("per-layer.yaml")},
    {"name": "per-layer adaptive", "plugins": None, "clipping": config_privacy("per-layer-adaptive.yaml")},
]
SMOLLM2_LAYERS = 30  # SmolLM2-135M's decoder layers (a pattern matching no trainable parameter is refused)


def adapter_groups(layers: int, modules: list[str]) -> list[str]:
    """``privacy.clipping_groups`` with one group per adapted module: its LoRA A and B together (the default groups
    each apart), so that an adaptive threshold follows the adapter's norm, not A's alone (near zero while B is)."""
    return [f"*.layers.{i}.self_attn.{m}.*" for i in range(layers) for m in modules]


#: each row's arms (the e2e row adds per-layer adaptive with each adapter's A and B in one group)
ROW_ARMS = {"sst2": ARMS, "e2e": [*ARMS, {
    "name": "per-layer adaptive (A+B)", "plugins": None,
    "clipping": {**config_privacy("per-layer-adaptive.yaml"),
                 "clipping_groups": adapter_groups(SMOLLM2_LAYERS, finetune.DEFAULTS["denoise"]["lora"]
                                                   ["target_modules"])}}]}

#: full and --quick settings of each row (command-line options override them)
DEFAULTS = {
    "sst2": {"rows": 65_301, "tune_rows": 2048, "eval_rows": None, "max_length": 64, "batch_size": 256,
             "physical_batch_size": 32, "steps": 36, "epsilons": [1.0, 3.0, 8.0], "lr_grid": [0.03, 0.1, 0.3],
             "seeds": [0, 1, 2]},
    "e2e": {**finetune.DEFAULTS["denoise"], "physical_batch_size": 16, "scored_steps": [50], "seeds": [0, 1, 2]},
}
QUICK = {
    "sst2": {"rows": 32, "tune_rows": 16, "eval_rows": 16, "batch_size": 8, "physical_batch_size": 8, "steps": 2,
             "epsilons": [3.0], "lr_grid": [0.01, 0.1], "seeds": [0, 1]},
    "e2e": {**finetune.QUICK["denoise"], "physical_batch_size": 8, "scored_steps": [2], "metrics": ["bleu", "rouge_l"]},
}


#: what each row's size can and cannot show (printed with its plan; the module's docstring says more)
SCOPE = {
    "sst2": ("can show: the arms' accuracy after the first steps of full fine-tuning (a seventh of an epoch), each "
             "arm's lr tuned, at three epsilons, and their wall time; cannot show: where they end after epochs, "
             "differences under the seeds' spread, adaptive thresholds after more than 36 steps of adapting"),
    "e2e": ("can show: the arms' generation metrics at step 50 of LoRA fine-tuning at one lr (not tuned per arm) and "
            "their wall time; cannot show: later steps, or an arm that needs another lr"),
}


def arms_added(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether a results file's settings ``old`` resume as ``new``: the same but for arms added since (the runs of
    the arms it has keep their settings)."""
    rest = [{k: v for k, v in x.items() if k != "arms"} for x in (old, new)]
    return rest[0] == rest[1] and all(new["arms"].get(name, ...) == value for name, value in old["arms"].items())


def settings_of(args: Any) -> dict[str, Any]:
    """The row's settings: its defaults (``--quick``: the tiny ones), the command line's overrides, the seeds and the
    tuning seed."""
    s = {**DEFAULTS[args.row], **(QUICK[args.row] if args.quick else {})}
    for key in ("epsilons", "steps", "lr_grid", "rows", "batch_size", "physical_batch_size"):
        if getattr(args, key) is not None:
            s[key] = getattr(args, key)
    if args.seeds is not None:
        s["seeds"] = list(args.seeds)
    s.update(row=args.row, quick=args.quick, tune_seed=args.tune_seed, autocast=False,
             arms={a["name"]: a["clipping"] for a in ROW_ARMS[args.row]})
    if args.row == "e2e":
        s["meteor_backend"] = "python"
    return s


def setup_of(args: Any, s: dict[str, Any]) -> finetune.Setup:
    if args.row == "e2e":  # micro-batches of 16, as the denoise study's CPU runs (64 needs more than 16 GB)
        return finetune.denoise_setup(argparse.Namespace(**{**vars(args),
                                                            "physical_batch_size": s["physical_batch_size"]}), s)
    from dpl.tasks.modules.classification import FinetuneOptions

    return finetune.sst2_setup(args, {**s, "epochs": None}, FinetuneOptions(method="full"))


def size(s: dict[str, Any], arms: int) -> str:
    if s["row"] == "e2e":
        return finetune.denoise_size(s, arms)
    cells, grid, seeds = arms * len(s["epsilons"]), len(s["lr_grid"]), len(s["seeds"])
    low, high = cells * (grid + seeds), cells * (grid + 2 + seeds)
    return (f"{cells} cells ({arms} arms x {len(s['epsilons'])} epsilons) x ({grid} tuning runs, 2 more if the grid "
            f"widens, + {seeds} seeds) = {low}-{high} runs x {s['steps']} steps of B = {s['batch_size']} "
            f"({s['steps'] * s['batch_size']:,} examples of {s['rows']:,} rows: "
            f"{s['steps'] * s['batch_size'] / s['rows']:.2g} epochs), plus one evaluation per run "
            f"({s['tune_rows']:,} tuning or {s['eval_rows'] or 872} validation rows)")


# ----------------------------------------------------------------------------------------------------------
# Tables


def paired(cells: list[dict[str, Any]], cell: dict[str, Any], key: str,
           step: str | None = None) -> dict[str, Any] | None:
    """``cell``'s metric minus flat's, seed by seed, in the same epsilon (sst2) or at the same step (e2e)."""
    if cell["arm"] == ARMS[0]["name"]:
        return None
    if step is None:
        base = next((c for c in cells if c["arm"] == ARMS[0]["name"] and c["epsilon"] == cell["epsilon"]), None)
        if base is None:
            return None
        diffs = [a - b for a, b in zip(cell[f"per_seed_{key}"], base[f"per_seed_{key}"])
                 if a is not None and b is not None]
    else:
        flat = {c["seed"]: c for c in cells if c["arm"] == ARMS[0]["name"] and not c["diverged"]}
        diffs = [c["curve"][step][key] - flat[c["seed"]]["curve"][step][key] for c in cells
                 if c["arm"] == cell["arm"] and not c["diverged"] and c["seed"] in flat]
    return {**spread(diffs), "wins": sum(d > 0 for d in diffs)}


def versus_flat(d: dict[str, Any] | None, scale: float = 100.0, digits: int = 1) -> str:
    """``mean ± sd (wins/n)`` of paired differences to flat; ``-`` for flat itself."""
    return "-" if d is None or not d["n"] else f"{fmt(d, scale, digits)} ({d['wins']}/{d['n']})"


def sst2_table(results: dict[str, Any]) -> str:
    """Per epsilon and arm: sigma, the tuned lr, validation accuracy (mean +- sd, each seed, the paired difference to
    flat) and loss, and the wall time of a report run; then each arm's wall time over every epsilon."""
    s, order = results["settings"], list(results["settings"]["arms"])
    cells = sorted(results["cells"], key=lambda c: (c["epsilon"], order.index(c["arm"])))
    lines = [f"| ε | arm | mechanism | σ (gradient's) | lr (tuned) | val acc % (mean ± sd, {len(s['seeds'])} seeds) | "
             "val loss | acc % by seed | Δ acc vs flat (paired: mean ± sd, wins) | s per run |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        edge = " (edge)" if c["tuning"]["at_edge"] else ""
        seeds = ", ".join("diverged" if a is None else f"{100 * a:.1f}" for a in c["per_seed_acc"])
        lines.append(f"| {c['epsilon']:g} | {c['arm']} | {c['mechanism']} | {c['sigma']:.3f} "
                     f"({c['gradient_sigma']:.3f}) | {c['lr']:.3g}{edge} | "
                     f"{fmt(c['acc']) if c['acc'] else 'diverged'} | {fmt(c['loss'], 1.0, 3) if c['loss'] else '-'} | "
                     f"{seeds} | {versus_flat(paired(cells, c, 'acc'))} | {c['seconds_per_run']:.0f} |")
    lines += finetune.partial_rows(results, [{"name": name} for name in order])
    return "\n".join(lines) + "\n\n" + time_table(results, [r for r in results.get("runs", [])
                                                             if r["purpose"] == "report"])


def time_table(results: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    """Each arm's wall and CPU seconds per run (mean +- sd over its runs) on each machine, and its CPU time relative
    to flat's on the same machine (seconds compare only there; a run from before machines were recorded is its own
    group; CPU seconds, recorded since, are less moved by other jobs than wall seconds)."""
    lines = ["| machine | arm | runs | wall s per run (mean ± sd) | CPU s per run | × flat (CPU s) |",
             "|---|---|---|---|---|---|"]
    where = [r.get("machine", "not recorded") for r in runs]
    for place in dict.fromkeys(where):
        on = [r for r, w in zip(runs, where) if w == place]
        wall = {a: spread([r["seconds"] for r in on if r["arm"] == a]) for a in results["settings"]["arms"]}
        timed = [r for r in on if r.get("cpu_seconds") is not None]
        cpu = {a: spread([r["cpu_seconds"] for r in timed if r["arm"] == a]) for a in results["settings"]["arms"]}
        flat = cpu[ARMS[0]["name"]]
        for name, t in wall.items():
            if t["n"]:
                c = cpu[name]
                ratio = f"{c['mean'] / flat['mean']:.2f}" if c["n"] and flat["n"] else "-"
                lines.append(f"| {place} | {name} | {t['n']} | {fmt(t, 1.0, 0)} | "
                             f"{fmt(c, 1.0, 0) if c['n'] else '-'} | {ratio} |")
    return "\n".join(lines)


E2E_NAMES = {"bleu": "BLEU", "rouge_l": "ROUGE-L", "meteor": "METEOR", "nist": "NIST", "cider": "CIDEr"}


def e2e_table(results: dict[str, Any]) -> str:
    """Run by run, then per arm and scored step: each metric (mean +- sd over the seeds) and BLEU's paired difference
    to flat; then each arm's wall time per run."""
    s, order = results["settings"], list(results["settings"]["arms"])
    metrics = s["metrics"]
    scale = {m: (1.0, 2) if m in ("nist", "cider") else (100.0, 1) for m in metrics}
    cells = sorted((c for c in results["cells"] if not c["diverged"]), key=lambda c: (c["seed"], order.index(c["arm"])))
    lines = ["| seed | arm | step | " + " | ".join(E2E_NAMES.get(m, m) for m in metrics) + " | s per run |",
             "|---|---|---|" + "---|" * (len(metrics) + 1)]
    for step in map(str, s["scored_steps"]):
        lines += [f"| {c['seed']} | {c['arm']} | {step} | " + " | ".join(
            f"{c['curve'][step][m]:.{2 if m == 'nist' else 3}f}" for m in metrics) + f" | {c['seconds']:.0f} |"
            for c in cells]
    lines += ["", "| arm | seeds | step | " + " | ".join(E2E_NAMES.get(m, m) for m in metrics)
              + " | Δ BLEU vs flat (paired: mean ± sd, wins) |", "|---|---|---|" + "---|" * (len(metrics) + 1)]
    for step in map(str, s["scored_steps"]):
        for name in order:
            mine = [c for c in cells if c["arm"] == name]
            if mine:
                values = " | ".join(fmt(spread([c["curve"][step][m] for c in mine]), *scale[m]) for m in metrics)
                diff = versus_flat(paired(cells, mine[0], "bleu", step)) if "bleu" in metrics else "-"
                lines.append(f"| {name} | {len(mine)} | {step} | {values} | {diff} |")
    return "\n".join(lines) + "\n\n" + time_table(results, cells)


def tables(results: dict[str, Any]) -> str:
    """The row's tables (as in docs/studies.md)."""
    return e2e_table(results) if results["settings"]["row"] == "e2e" else sst2_table(results)


# ----------------------------------------------------------------------------------------------------------
# Timing: a few steps of each arm at the row's scale, and the CPU-hours of the whole row


def timing(args: Any, s: dict[str, Any], setup: finetune.Setup, arms: list[dict[str, Any]]) -> dict[str, Any]:
    """``--time-steps K``: K steps of each arm (after an untimed first), one evaluation on each scored split, and
    the row's CPU time estimated from them (every run at its full steps; sst2: the lr grid widened or not)."""
    extra = {"lr": s["lr_grid"][0], "epsilon": s["epsilons"][-1]} if s["row"] == "sst2" else {}
    measured = []
    for arm in arms:
        measured.append(finetune.time_steps(setup, arm, args.time_steps, **extra))
        t = measured[-1]
        print(f"{arm['name']}: CPU seconds per step " + ", ".join(f"{x:.2f}" for x in t["step_cpu_seconds"])
              + " (wall " + ", ".join(f"{x:.2f}" for x in t["step_seconds"])
              + f"); one evaluation {t['evaluation_cpu_seconds']:.1f} CPU s", file=sys.stderr, flush=True)
    tune_cpu = 0.0
    if setup.tune_on is not None:
        cpu = time.process_time()
        setup.tune_on()
        tune_cpu = time.process_time() - cpu
    step_of = {t["arm"]: statistics.median(t["step_cpu_seconds"]) for t in measured}
    evaluate = statistics.fmean(t["evaluation_cpu_seconds"] for t in measured)
    if s["row"] == "sst2":
        report = s["steps"] * sum(step_of.values()) + len(arms) * evaluate
        tuning = s["steps"] * sum(step_of.values()) + len(arms) * tune_cpu
        per_epsilon = [len(s["lr_grid"]) * tuning + len(s["seeds"]) * report,
                       (len(s["lr_grid"]) + 2) * tuning + len(s["seeds"]) * report]
        hours = [len(s["epsilons"]) * x / 3600 for x in per_epsilon]
    else:
        run = s["scored_steps"][-1] * sum(step_of.values()) + len(arms) * len(s["scored_steps"]) * evaluate
        hours = [len(s["seeds"]) * run / 3600] * 2
    print(f"estimated CPU time of the row ({size(s, len(arms))}): {hours[0]:.1f}-{hours[1]:.1f} CPU-hours",
          flush=True)
    return {"arms": measured, "tune_evaluation_cpu_seconds": tune_cpu, "median_step_cpu_seconds": step_of,
            "estimated_cpu_hours": hours}


# ----------------------------------------------------------------------------------------------------------
# Command line


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = study_parser(__doc__)
    parser.set_defaults(seeds=None)
    parser.add_argument("--row", choices=tuple(DEFAULTS), default="sst2",
                        help="sst2: MiniLM full fine-tuning (default); e2e: SmolLM2-135M LoRA at step 50")
    parser.add_argument("--arms", nargs="+", help="run only these arms (by name)")
    parser.add_argument("--epsilons", type=float, nargs="+", help="sst2: target epsilons (default 1 3 8)")
    parser.add_argument("--steps", type=int, help="sst2: steps of every run (default 36)")
    parser.add_argument("--lr-grid", type=float, nargs="+", help="sst2: lr grid (default 0.03 0.1 0.3)")
    parser.add_argument("--rows", type=int, help="training rows")
    parser.add_argument("--batch-size", type=int, help="expected batch size B")
    finetune.add_run_options(parser, kept="the runs",
                             timed="only time K private steps of each arm and one evaluation, and estimate the "
                                   "row's CPU-hours (results: clipping_<row>_timing.json)",
                             micro_batch="micro-batch of the per-example gradients")
    args = parser.parse_args(argv)
    if args.table:
        results = json.loads(args.table.read_text())
        print(tables(results))
        return results
    torch.set_num_threads(args.threads)
    args.device = "cpu"
    choose(args.arms, [a["name"] for a in ROW_ARMS[args.row]])
    arms = [a for a in ROW_ARMS[args.row] if not args.arms or a["name"] in args.arms]
    s = settings_of(args)
    # what a resumed file must share: all but the epsilons (sst2's cells are epsilons, so a part run with other
    # epsilons adds to the same file)
    settings = {k: v for k, v in s.items() if k != "epsilons"}
    name = result_name(f"clipping_{args.row}", argparse.Namespace(quick=args.quick, seeds=s["seeds"],
                                                                   tune_seed=s["tune_seed"]))
    plan = size(s, len(arms))
    print(f"{name} (CPU, float32, {args.threads} thread{'s' if args.threads > 1 else ''}): {plan}", flush=True)
    if not args.quick:
        print(f"this size {SCOPE[args.row]}", flush=True)
    setup = setup_of(args, s)
    setup.settings["checkpoint_dir"] = args.checkpoint_dir
    if args.time_steps:
        measured = {"settings": settings, "data": setup.data, "threads": args.threads, **timing(args, s, setup, arms)}
        save(f"{name}_timing", measured, args.out)
        return measured
    old = (finetune.resumed(args.out / f"{name}.json", settings, same=arms_added) if args.resume
           else {"cells": [], "runs": []})
    results = {"settings": settings, "size": plan, "data": setup.data, "threads": args.threads, "cells": old["cells"],
               "runs": old["runs"]}
    start = time.perf_counter()
    if args.row == "e2e":
        finetune.run_seeds(args, s, results, name, setup, arms, same=arms_added)
    else:
        finetune.run_tuned(args, s, results, name, setup, arms, same=arms_added)
    results["seconds"] = time.perf_counter() - start
    results = finetune.results_on_disk(args, name, results, same=arms_added)
    save(name, results, args.out)
    print(tables(results))
    return results


if __name__ == "__main__":
    main()
