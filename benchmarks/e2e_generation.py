"""DP fine-tuning of SmolLM2-135M-Instruct (LoRA) on E2E: BLEU, ROUGE-L, METEOR, NIST, CIDEr after 50 and 200 steps.

Trains on the ``mr``s of ``../shared/data/e2e/devset.csv`` that are not held out and evaluates by greedy
generation on the held-out ``mr``s (split by ``mr``: no input is seen in training), every 50 steps.
Arms: DP-SGD at epsilon = 5.4 for the planned steps (sigma from the accountant), and the non-private
reference (noise multiplier 0, clipping kept). Each arm runs in its own process so that peak memory (max RSS)
is per arm. Results are appended to ``benchmarks/results/e2e_generation.json``; finished arms are skipped.

    OMP_NUM_THREADS=2 python benchmarks/e2e_generation.py                 # both arms, one after the other
    OMP_NUM_THREADS=1 python benchmarks/e2e_generation.py --arms dp &      # or in parallel, one core each
    OMP_NUM_THREADS=1 python benchmarks/e2e_generation.py --arms nonprivate
    OMP_NUM_THREADS=2 python benchmarks/e2e_generation.py --timing 4   # step time only, side by side
    python benchmarks/e2e_generation.py --summary   # metrics recomputed from the predictions files, table printed
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "e2e_generation.json"
DATA = ROOT.parent / "shared" / "data" / "e2e" / "devset.csv"
METRICS = ["bleu", "rouge_l", "meteor", "nist", "cider"]


def run_arm(args: argparse.Namespace, arm: str) -> dict:
    import lightning as L
    import torch

    from dpl.tasks.data import E2EDataModule
    from dpl.tasks.modules import FinetuneOptions, LoraOptions
    from dpl.tasks.modules.generation import DPGenerationModule, GenerationOptions
    from dpl.core.privacy import PrivacyConfig

    torch.set_num_threads(args.threads)
    L.seed_everything(args.seed)
    data = E2EDataModule(train_file=str(args.data), holdout_mrs=args.holdout_mrs, holdout_seed=0,
                         max_length=args.max_length, eval_batch_size=args.eval_batch_size, chat_template="none")
    privacy = PrivacyConfig(target_epsilon=args.epsilon, batch_size=args.batch_size,
                            physical_batch_size=args.physical_batch_size, max_grad_norm=args.max_grad_norm,
                            noise_multiplier=0.0 if arm == "nonprivate" else None, seed=args.seed)
    lora = LoraOptions(r=args.lora_r, alpha=args.lora_r, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    module = DPGenerationModule(
        finetuning=FinetuneOptions(method="lora", lora=lora),
        generation=GenerationOptions(max_new_tokens=args.max_new_tokens, num_beams=1, metrics=METRICS),
        privacy=privacy,
        optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr))

    step_times: list[float] = []
    evaluations: list[dict] = []

    class Recorder(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step_times.append(time.perf_counter() - self.t0)
            if len(step_times) % 10 == 0:
                print(f"[{arm}] step {len(step_times)}: {step_times[-1]:.1f} s/step", file=sys.stderr, flush=True)

        def on_validation_end(self, trainer, pl_module):  # after the module has logged its metrics
            if trainer.sanity_checking:
                return
            scores = {m: float(trainer.callback_metrics[f"val_{m}"]) for m in METRICS
                      if f"val_{m}" in trainer.callback_metrics}
            row = {"step": pl_module.steps_done, "epsilon": pl_module.epsilon_after(pl_module.steps_done), **scores}
            evaluations.append(row)
            print(f"[{arm}] step {row['step']}: " + ", ".join(f"{k}={v:.4f}" for k, v in row.items() if k != "step"),
                  file=sys.stderr, flush=True)

    root = ROOT / "runs" / "bench-e2e" / arm
    trainer = L.Trainer(max_steps=args.steps, val_check_interval=args.eval_every, check_val_every_n_epoch=None,
                        num_sanity_val_steps=0, accelerator="cpu", logger=L.pytorch.loggers.CSVLogger(str(root)),
                        enable_checkpointing=False, enable_progress_bar=False, callbacks=[Recorder()],
                        default_root_dir=str(root), log_every_n_steps=10)
    start = time.perf_counter()
    trainer.fit(module, datamodule=data)
    wall = time.perf_counter() - start
    steady = step_times[2:] or step_times
    return {
        "arm": arm, "steps": module.steps_done, "sigma": module.noise_multiplier, "delta": module.delta,
        "epsilon": module.epsilon_after(module.steps_done) if arm == "dp" else None,
        "train_examples": data.num_train_examples, "eval_inputs": len(data.val_set),
        "batch_size": args.batch_size, "lr": args.lr, "lora_r": args.lora_r, "max_length": args.max_length,
        "evaluations": evaluations, "step_time_s_mean": sum(steady) / len(steady),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "wall_s": wall,
        "threads": args.threads, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "predictions": str(module.predictions_path("validation")),
    }


def timing(args: argparse.Namespace) -> None:
    """Step time side by side on one machine state: the private step (per-example clipping + noise, batch of
    ``--batch-size`` real E2E examples) vs a plain non-private forward/backward on the same batch, interleaved."""
    import statistics

    import torch

    from dpl.tasks.data import E2EDataModule
    from dpl.tasks.modules import FinetuneOptions, LoraOptions
    from dpl.tasks.modules.generation import DPGenerationModule
    from dpl.core.privacy import PrivacyConfig
    from dpl.core.step import StepContext, private_step

    torch.set_num_threads(args.threads)
    data = E2EDataModule(train_file=str(args.data), holdout_mrs=args.holdout_mrs, max_length=args.max_length,
                         chat_template="none")
    data.setup("fit")
    batch = data.collate([data.train_set[i] for i in range(args.batch_size)])
    lora = LoraOptions(r=args.lora_r, alpha=args.lora_r, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    module = DPGenerationModule(finetuning=FinetuneOptions(method="lora", lora=lora),
                                privacy=PrivacyConfig(batch_size=args.batch_size, noise_multiplier=0.5))
    model = module.ensure_model()
    ctx = StepContext(model=model, trainable=module.trainable, per_example_loss=module.per_example_loss,
                      max_grad_norm=1.0, noise_multiplier=0.5, expected_batch_size=args.batch_size, step=0,
                      noise_generator=torch.Generator().manual_seed(0), log=lambda *a: None)

    def nonprivate():
        model.zero_grad(set_to_none=True)
        module.per_example_loss(batch).mean().backward()

    def private():
        private_step(module.plugin_manager.hook, ctx, batch, args.physical_batch_size)

    times = {"non-private": [], "dpl (DP-SGD)": []}
    for _ in range(args.timing):
        for name, fn in (("non-private", nonprivate), ("dpl (DP-SGD)", private)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["non-private"][1:])
    print(f"SmolLM2-135M + LoRA r={args.lora_r}, batch {args.batch_size} E2E examples "
          f"({int(batch['attention_mask'].sum())} tokens), {args.threads} threads, {args.timing} repeats (first dropped)")
    for name, values in times.items():
        med = statistics.median(values[1:])
        print(f"| {name} | {med:.2f} s | {med / base:.2f}x |")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


def load_results() -> list[dict]:
    return json.loads(RESULTS.read_text()) if RESULTS.exists() else []


def scores_from_predictions(arm: str) -> list[dict]:
    """The five metrics recomputed from the predictions files a run wrote at each evaluation
    (``runs/bench-e2e/<arm>/.../predictions/validation_step<N>.jsonl``): works for an interrupted run too."""
    from dpl.tasks.metrics import compute_metrics

    versions = sorted((ROOT / "runs" / "bench-e2e" / arm).glob("lightning_logs/version_*"),
                      key=lambda p: int(p.name.split("_")[1]))
    if not versions:
        return []
    files = sorted(versions[-1].glob("predictions/validation_step*.jsonl"),  # the latest run of the arm
                   key=lambda p: int(p.stem.split("step")[1]))
    rows = []
    for path in files:
        outputs = [json.loads(line) for line in path.read_text().splitlines()]
        scores = compute_metrics([o["prediction"] for o in outputs], [o["references"] for o in outputs], METRICS)
        rows.append({"step": int(path.stem.split("step")[1]), "inputs": len(outputs), **scores,
                     "source": str(path.relative_to(ROOT))})
    return rows


def fill_from_predictions(results: list[dict], arms: list[str]) -> list[dict]:
    """Add (or complete) each arm's evaluations from its predictions files."""
    for arm in arms:
        rows = scores_from_predictions(arm)
        if not rows:
            continue
        result = next((r for r in results if r["arm"] == arm), None)
        if result is None:  # an interrupted run: only its evaluations are known
            result = {"arm": arm, "steps": rows[-1]["step"], "interrupted": True, "evaluations": []}
            results.append(result)
        known = {e["step"]: e for e in result["evaluations"]}
        for row in rows:
            known.setdefault(row["step"], {"step": row["step"]}).update(row)
        result["evaluations"] = [known[k] for k in sorted(known)]
    return results


def summary(results: list[dict]) -> str:
    lines = ["| arm | step | epsilon | BLEU | ROUGE-L | METEOR | NIST | CIDEr |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for e in r["evaluations"]:
            eps = "∞ (σ=0)" if r["arm"] == "nonprivate" else (f"{e['epsilon']:.2f}" if "epsilon" in e else "–")
            lines.append(f"| {r['arm']} | {e['step']} | {eps} | " + " | ".join(
                f"{e[m] * (100 if m in ('bleu', 'rouge_l', 'meteor') else 1):.2f}" if m in e else "–"
            for m in METRICS) + " |")
    lines.append("")
    lines.append("| arm | sigma | train examples | eval inputs | step time (s) | peak RSS (GiB) | wall (min) |")
    lines.append("|---|---|---|---|---|---|---|")
    for r in results:
        if r.get("interrupted"):
            lines.append(f"| {r['arm']} | interrupted after step {r['steps']} | | | | | |")
            continue
        lines.append(f"| {r['arm']} | {r['sigma']:.3f} | {r['train_examples']} | {r['eval_inputs']} | "
                     f"{r['step_time_s_mean']:.2f} | {r['peak_rss_gib']:.2f} | {r['wall_s'] / 60:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", nargs="+", default=["dp", "nonprivate"], choices=["dp", "nonprivate"])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--holdout-mrs", type=int, default=48, help="number of held-out mrs (evaluation inputs)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--epsilon", type=float, default=5.4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--physical-batch-size", type=int, default=16)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--lora-r", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=112)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--eval-batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--summary", action="store_true")
    parser.add_argument("--timing", type=int, metavar="REPEATS", help="only time the step (private vs non-private)")
    parser.add_argument("--worker", choices=["dp", "nonprivate"], help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:  # one arm in this process; the result goes to stdout as the last line
        print("RESULT " + json.dumps(run_arm(args, args.worker)), flush=True)
        return
    if args.timing:
        timing(args)
        return
    if args.summary:
        results = fill_from_predictions(load_results(), args.arms)
        RESULTS.write_text(json.dumps(results, indent=1))
        print(summary(results))
        return
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    for arm in args.arms:
        if any(r["arm"] == arm and r["steps"] == args.steps for r in load_results()):
            print(f"{arm}: already in {RESULTS}, skipped")
            continue
        cmd = [sys.executable, __file__, "--worker", arm, *sys.argv[1:]]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
        line = next(ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("RESULT "))
        with open(RESULTS.with_suffix(".lock"), "w") as lock:  # arms may run in parallel processes
            fcntl.flock(lock, fcntl.LOCK_EX)
            RESULTS.write_text(json.dumps([*load_results(), json.loads(line[len("RESULT "):])], indent=1))
        print(proc.stdout[-2000:])
    print(summary(load_results()))


if __name__ == "__main__":
    main()
