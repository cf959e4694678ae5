"""Canary exposure (Carlini et al., "The Secret Sharer: evaluating and testing unintended memorization in neural
networks", USENIX Security 2019): how strongly the trained model prefers each canary's secret to random ones.

A canary (:func:`dpl.synthetic.leakage.canary_texts`) holds a secret, a number of at least 4 digits. Its training
row (its control values) is scored with the real secret and with ``candidates`` other random numbers of as many
digits, each as training scores a record: the run's data module tokenizes it, the loss is the summed cross-entropy
of its text tokens and EOS. The real secret's rank r among the ``candidates + 1`` (ties count against it) gives the
exposure ``log2(candidates + 1) - log2(r)`` bits: at most ``log2(candidates + 1)`` (rank 1); a model that learnt
nothing of the canary ranks it uniformly: :func:`by_chance` bits expected (1.40 of 100 candidates; toward
``log2(e) = 1.44`` with more).

Exposure reads the model, not the synthetic data: it bounds what sampling could reproduce, and detects memorization
long before a sampled record repeats a secret. Its inputs are the trained model and the canaries (test records the
evaluator inserted), so the figure is post-processing of the run's guarantee.
"""

from __future__ import annotations

import json
import math
import random
import tempfile
from pathlib import Path
from typing import Any

import torch

from dpl.errors import ConfigError
from dpl.synthetic.leakage import secret_of


def alternatives(secret: str, count: int, seed: int) -> list[str]:
    """``count`` distinct random numbers of ``secret``'s number of digits, none equal to it."""
    space = 10 ** len(secret)
    if count >= space:
        raise ConfigError(f"{count} alternatives asked for a {len(secret)}-digit secret: at most {space - 1}")
    rng, found = random.Random(f"{seed}:{secret}"), {secret}
    out = []
    while len(out) < count:
        value = f"{rng.randrange(space):0{len(secret)}d}"
        if value not in found:
            found.add(value)
            out.append(value)
    return out


def by_chance(candidates: int) -> float:
    """The exposure expected of a rank drawn uniformly among ``candidates + 1`` (a model that learnt nothing)."""
    n = candidates + 1
    return math.log2(n) - sum(math.log2(r) for r in range(1, n + 1)) / n


def rank_and_exposure(loss: float, others: list[float]) -> tuple[int, float]:
    """The rank of ``loss`` among ``others`` (1: below all; a tie counts against it) and its exposure in bits."""
    rank = 1 + sum(1 for other in others if other <= loss)
    return rank, math.log2(len(others) + 1) - math.log2(rank)


def record_losses(ckpt: Path, module: Any, rows: list[dict[str, Any]], batch_size: int = 32) -> list[float]:
    """The summed training loss of each row under ``module`` (the loaded run of ``ckpt``), tokenized by the run's
    own data module as training tokenizes it."""
    from dpl.synthetic.command import run_data_module
    from dpl.synthetic.sampling import Progress
    from dpl.tasks.data.padding import IGNORE_INDEX

    with tempfile.TemporaryDirectory(prefix="dpl-exposure-") as folder:
        Path(folder, "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
        data = run_data_module(ckpt, data_dir=folder, train_file=None, val_file=None, test_file=None, dataset=None,
                               max_train_examples=None)
        data.setup("fit")
        examples = list(data.train_set)
    losses: list[float] = []
    progress = Progress(len(examples), "exposure")
    with torch.inference_mode():
        for start in range(0, len(examples), batch_size):
            batch = data.collate(examples[start:start + batch_size])
            scored = (batch["labels"][:, 1:] != IGNORE_INDEX).sum(1)
            losses += (module.per_example_loss(batch).double() * scored).tolist()
            progress.update(len(scored))
    progress.close()
    return losses


def canary_exposure(run_path: str, canary_rows: list[dict[str, Any]], text_column: str, candidates: int = 99,
                    seed: int = 0) -> dict[str, Any]:
    """Each canary's rank and exposure under the run's model; ``canary_rows``: their training rows (the text in
    ``text_column``, the control values beside it)."""
    from dpl.trained.runs import find_checkpoint, load_run

    if candidates < 1:
        raise ConfigError(f"--exposure_candidates must be positive, got {candidates}")
    ckpt = find_checkpoint(run_path)
    if ckpt.suffix != ".ckpt":
        raise ConfigError(f"{run_path}: exposure needs a run folder or checkpoint (its config.yaml), not an export")
    run = load_run(ckpt)
    if (getattr(run.module, "schema", None) or {}).get("format") != "table":
        raise ConfigError(f"{run_path}: exposure is measured for table runs of DPSyntheticModule")
    rows, spans = [], []
    for row in canary_rows:
        text = str(row[text_column])
        secret = secret_of(text)
        if secret is None:
            raise ConfigError(f"the canary {text[:60]!r} holds no secret (a number of at least 4 digits)")
        others = alternatives(secret, candidates, seed)
        spans.append((text, secret, len(rows)))
        rows += [{**row, text_column: text}] + [{**row, text_column: text.replace(secret, o, 1)} for o in others]
    losses = record_losses(ckpt, run.module, rows)
    each = []
    for text, secret, first in spans:
        rank, bits = rank_and_exposure(losses[first], losses[first + 1:first + 1 + candidates])
        each.append({"canary": text, "rank": rank, "exposure": bits})
    values = [e["exposure"] for e in each]
    return {"candidates": candidates, "run": str(ckpt), "mean": sum(values) / len(values), "max": max(values),
            "most": math.log2(candidates + 1), "by_chance": by_chance(candidates), "each": each}
