"""DP synthetic data study: what a synthetic copy of SST-2 and Banking77 is worth at epsilon 1, 4, 8 and inf.

Every cell is the three documented commands (docs/synthetic.md), in this process:

1. ``dpl fit --config configs/synthetic/<data>.yaml`` (SmolLM2-135M-Instruct + LoRA r 8, the label as control
   prefix) on the real training file with 10 canary records inserted (``dpl.synthetic.leakage.canary_texts``, labelled
   with the first label), at the target epsilon (inf: ``privacy.noise_multiplier 0``, no guarantee), ``seed_everything``
   per seed;
2. ``dpl synthesize`` of ``rows`` records, uniform labels (``--non_private_ok`` for inf);
3. ``dpl evaluate-synthetic`` against the real validation split with ``--train`` (the training file with its
   canaries) and ``--canaries``: TSTR accuracy beside the same classifier on as many real training rows, MAUVE of the
   synthetic and of as many real training texts against the validation texts, exact and near duplicates, canaries.

Results (per cell and seed, and the mean and spread over seeds) go to ``benchmarks/results/studies/synthetic.json``
after every cell; ``--resume`` keeps the cells of a file with the same settings.

    python benchmarks/studies/synthetic.py --seeds 0 1 2 --resume
    python benchmarks/studies/synthetic.py --quick     # SST-2 at 8 and Banking77 at inf: 2 steps on 200 rows (the test)
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import DATA, RESULTS, read_tsv, save, study_parser

ROOT = Path(__file__).resolve().parents[2]
DATASETS = {"sst2": {"config": "configs/synthetic/sst2.yaml", "text": "sentence", "validation": "validation.tsv"},
            "banking77": {"config": "configs/synthetic/banking77.yaml", "text": "text", "validation": "dev.tsv"}}
EPSILONS = [1.0, 4.0, 8.0, math.inf]
SETTINGS = {"cells": [(d, e) for d in DATASETS for e in EPSILONS], "train_rows": None, "validation_rows": None,
            "steps": 200, "batch_size": 256, "rows": {"sst2": 2000, "banking77": 3080}, "max_new_tokens": 48,
            "canaries": 10}
QUICK = {"cells": [("sst2", 8.0), ("banking77", math.inf)], "train_rows": 200, "validation_rows": 60,
         "steps": 2, "batch_size": 16, "rows": {"sst2": 20, "banking77": 20}, "max_new_tokens": 12, "canaries": 2}


def dpl(*args: str) -> str:
    """``dpl ARGS`` in this process; its stdout (a failure raises with the end of its stderr)."""
    from dpl.cli import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main(list(args))
    except SystemExit as exc:
        code = exc.code or 0
    if code:
        raise RuntimeError(f"dpl {' '.join(args[:3])} ... exited {code}: {err.getvalue()[-2000:]}")
    return out.getvalue()


def write_tsv(path: Path, columns: list[str], rows: list[tuple[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, delimiter="\t", lineterminator="\n")
        writer.writerow(columns)
        writer.writerows(rows)


def prepare(name: str, s: dict[str, Any], seed: int, folder: Path) -> dict[str, Path]:
    """The cell's files: the training rows with the canaries inserted, the validation rows, the canaries."""
    from dpl.synthetic.leakage import canary_texts

    spec = DATASETS[name]
    texts, labels = read_tsv(DATA / name / "train.tsv", spec["text"], "label")
    rows = list(zip(texts, labels))
    if s["train_rows"] is not None:
        rows = random.Random(seed).sample(rows, s["train_rows"])
    canaries = canary_texts(s["canaries"], seed=1000 + seed)
    first = sorted(set(labels))[0]
    rows = rows + [(c, first) for c in canaries]
    random.Random(seed).shuffle(rows)
    texts, labels = read_tsv(DATA / name / spec["validation"], spec["text"], "label")
    validation = list(zip(texts, labels))[:s["validation_rows"]]
    paths = {"train": folder / "data" / "train.tsv", "validation": folder / "validation.tsv",
             "canaries": folder / "canaries.txt"}
    write_tsv(paths["train"], [spec["text"], "label"], rows)
    write_tsv(paths["validation"], [spec["text"], "label"], validation)
    paths["canaries"].write_text("\n".join(canaries) + "\n")
    return paths


def cell(name: str, epsilon: float, seed: int, s: dict[str, Any], folder: Path) -> dict[str, Any]:
    """One fit -> synthesize -> evaluate; its figures."""
    start = time.perf_counter()
    paths = prepare(name, s, seed, folder)
    privacy = (["--model.init_args.privacy.noise_multiplier", "0"] if math.isinf(epsilon)
               else ["--model.init_args.privacy.target_epsilon", str(epsilon)])
    out = dpl("fit", "--config", str(ROOT / DATASETS[name]["config"]), "--data.init_args.data_dir",
              str(paths["train"].parent), "--trainer.default_root_dir", str(folder / "runs"),
              "--trainer.max_steps", str(s["steps"]), "--model.init_args.privacy.batch_size", str(s["batch_size"]),
              "--seed_everything", str(seed), *privacy)
    checkpoint = out.strip().splitlines()[-1].rsplit("checkpoint ", 1)[-1]
    synthetic = folder / "synthetic"
    dpl("synthesize", checkpoint, "--rows", str(s["rows"][name]), "--out", str(synthetic), "--seed", str(seed),
        "--max_new_tokens", str(s["max_new_tokens"]), *(["--non_private_ok"] if math.isinf(epsilon) else []))
    dpl("evaluate-synthetic", str(synthetic), str(paths["validation"]), "--train", str(paths["train"]),
        "--canaries", str(paths["canaries"]), "--seed", str(seed))
    page = json.loads((synthetic / "evaluation" / "evaluation.json").read_text())
    report = json.loads((synthetic / "privacy.json").read_text())
    down, leak = page["downstream"], page["leakage"]["synthetic"]
    return {"data": name, "epsilon": epsilon, "seed": seed, "epsilon_spent": float(report["training"]["epsilon"]),
            "sigma": report["training"]["noise_multiplier"], "tstr_accuracy": down["tstr_accuracy"],
            "real_accuracy": down["real_accuracy"], "majority_accuracy": down["majority_accuracy"],
            "mauve": page["mauve"].get("mauve"), "mauve_real": (page.get("mauve_real") or {}).get("mauve"),
            "exact_duplicates": leak["exact_fraction"], "near_duplicates": leak["near_fraction"],
            "longest_match_max": leak["longest_match_max"],
            "validation_exact_duplicates": page["leakage"]["validation"]["exact_fraction"],
            "canaries_reproduced": page["canaries"]["reproduced"],
            "canary_secrets_reproduced": page["canaries"]["secrets_reproduced"],
            "seconds": time.perf_counter() - start}


def summary(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean and spread (population std) over seeds per data set and epsilon."""
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for c in cells:
        groups.setdefault((c["data"], c["epsilon"]), []).append(c)
    keys = ("tstr_accuracy", "real_accuracy", "mauve", "mauve_real", "exact_duplicates", "near_duplicates",
            "canaries_reproduced")
    out = []
    for (name, epsilon), group in groups.items():
        row: dict[str, Any] = {"data": name, "epsilon": epsilon, "seeds": len(group)}
        for key in keys:
            values = [g[key] for g in group if g[key] is not None]
            row[key] = statistics.fmean(values) if values else None
            row[f"{key}_spread"] = statistics.pstdev(values) if len(values) > 1 else 0.0 if values else None
        out.append(row)
    return out


def main() -> None:
    parser = study_parser(__doc__)
    parser.add_argument("--resume", action="store_true", help="keep the cells of a results file with the same "
                                                               "settings")
    args = parser.parse_args()
    s = QUICK if args.quick else SETTINGS
    seeds = [args.seeds[0]] if args.quick else args.seeds
    name = "synthetic_quick" if args.quick else "synthetic"
    path = Path(args.out) / f"{name}.json"
    settings = {**s, "cells": [[d, str(e)] for d, e in s["cells"]], "seeds": seeds}
    done: list[dict[str, Any]] = []
    if args.resume and path.is_file():
        old = json.loads(path.read_text())
        if old.get("settings") == settings:
            done = old["cells"]
    for data, epsilon in s["cells"]:
        for seed in seeds:
            if any(c["data"] == data and c["epsilon"] == epsilon and c["seed"] == seed for c in done):
                continue
            folder = Path(tempfile.mkdtemp(prefix=f"synthetic-{data}-"))
            try:
                result = cell(data, epsilon, seed, s, folder)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            done.append(result)
            print(f"[synthetic] {data} eps={epsilon} seed={seed}: TSTR {result['tstr_accuracy']:.3f} "
                  f"(real {result['real_accuracy']:.3f}), MAUVE {result['mauve']}, {result['seconds']:.0f} s",
                  file=sys.stderr, flush=True)
            save(name, {"settings": settings, "cells": done, "summary": summary(done)}, args.out)


if __name__ == "__main__":
    RESULTS.mkdir(parents=True, exist_ok=True)
    main()
