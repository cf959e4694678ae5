"""Where the private step's time goes, phase by phase (MiniLM full fine-tuning or LoRA).

    python benchmarks/step_breakdown.py [--repeats 4] [--method full|lora] [--freeze-embeddings]

Phases, on 32 sequences x 64 tokens: the recorded forward pass, ``autograd.grad`` at the layer outputs, the
per-example norms, the clipped weighted sums (norms and sums also per module kind), and drawing Gaussian noise for
every trainable coordinate (one draw per tensor, drawn together, as the default mechanism does); next to the ordinary
forward+backward of the same batch. Prints one line per repeat (the first includes warm-up), then the medians of
the others.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from step_time import load, make_batch

import dpl.core.per_example as pe
from dpl.core.layer_gradients import prepare
from dpl.core.noise import noise_source, normals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--method", choices=("full", "lora"), default="full")
    parser.add_argument("--freeze-embeddings", action="store_true")
    args = parser.parse_args()
    from dpl.allocator import keep_freed_memory

    keep_freed_memory()  # as the dpl command does (DPL_MALLOC=system: glibc's default)
    model, batch = load(args.method, freeze_embeddings=args.freeze_embeddings), make_batch(32, 64)
    clipper = pe.PerExampleClipper(model)
    source = noise_source(None)  # the default noise source
    shapes = [p.shape for p in model.parameters() if p.requires_grad]
    numel = sum(shape.numel() for shape in shapes)

    def losses():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return F.cross_entropy(out.logits, batch["labels"], reduction="none")

    timings = []
    for _ in range(args.repeats):
        t = {}
        timings.append(t)
        start = time.perf_counter()
        losses().sum().backward()
        t["non-private fwd+bwd"] = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        with clipper.record(32):
            loss = losses()
        t["forward"] = time.perf_counter() - start
        start = time.perf_counter()
        active = [r for r in clipper.records if r.outputs]
        grads = iter(torch.autograd.grad(loss.sum(), [o for r in active for o in r.outputs]))
        t["grad at outputs"] = time.perf_counter() - start
        start = time.perf_counter()
        grams: dict = {}
        by_kind: dict[str, float] = {}
        prepared = []
        for r in active:
            begin = time.perf_counter()
            prepared.append((r.kind, prepare(r, [next(grads) for _ in r.outputs], grams, None)))
            by_kind[f"norms {r.kind}"] = by_kind.get(f"norms {r.kind}", 0.0) + time.perf_counter() - begin
        t["norms"] = time.perf_counter() - start
        start = time.perf_counter()
        for kind, state in prepared:
            begin = time.perf_counter()
            state.weighted_sum(torch.ones(32), None)
            by_kind[f"sums {kind}"] = by_kind.get(f"sums {kind}", 0.0) + time.perf_counter() - begin
        t["clipped sums"] = time.perf_counter() - start
        t.update(by_kind)
        start = time.perf_counter()
        normals(shapes, source)  # one draw per trainable tensor, drawn together, as the default privatize does
        t[f"noise ({numel / 1e6:.1f}M)"] = time.perf_counter() - start
        print("  ".join(f"{k} {v:.3f}s" for k, v in t.items()))
    if len(timings) > 1:
        print("median  " + "  ".join(f"{k} {statistics.median(t[k] for t in timings[1:]):.3f}s" for k in timings[0]))


if __name__ == "__main__":
    main()
