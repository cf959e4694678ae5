"""What per-example clipping holds above the non-private step, predicted from the layers' shapes alone.

``dpl plan``'s memory block: for one micro-batch of b examples of T tokens, the bytes each
``privacy.clipping_memory`` mode keeps while the norms are computed (docs/scaling.md, "Memory of one process"):

* ``fast``: every layer's output gradient g (b T d_out, in the step's dtype) until all norms are known, plus the
  float32 per-example gradients of the layers whose norms need them (norm layers, ``generic`` layers, and linear
  layers where they are cheaper than the Gram matrices: T^2 (d_in + d_out) >= d_in d_out T); the Gram path's two
  (b, T, T) matrices are transient.
* ``low``: nothing across layers; one layer's norm temporaries at a time (at most about :data:`NORM_CHUNK` float32
  elements), and a second backward pass. Refused under bf16.
* ``auto``: if every layer's float32 per-example gradients (4 b numel bytes) or book (its input a, its g and, on the
  per-example path, its per-example gradients), whichever is smaller, fit the budget together, each layer holds the
  smaller and there is no second pass; otherwise, in the order of the backward pass, each layer but the embeddings
  keeps its per-example gradients while they fit what is left of the budget, the others as ``low`` (under bf16 every
  layer not kept keeps its book, as ``fast``, outside the budget).

Layer inputs are not counted, but in ``auto``'s books: they are autograd's saved activations, which the non-private
step holds too (a book holds them beyond a checkpointed block's recomputation, so its budget counts them). Pure
Python (no torch): both :mod:`~dpl.planning.command` and the torch-free :mod:`~dpl.planning.quick` use it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from dpl.core import clipping_policy as policy
from dpl.core.clipping_policy import MIB, NORM_CHUNK

KINDS = ("linear", "embedding", "layer_norm", "rms_norm", "generic")


@dataclass(frozen=True)
class LayerShape:
    """One layer the clipper records: its kind, input and output widths and trainable parameters (``matrix``: a
    linear layer's weight is trainable, not only its bias)."""

    kind: str
    d_in: int
    d_out: int
    numel: int
    matrix: bool = True


def shape_of(record: Any) -> LayerShape:
    """The :class:`LayerShape` of a :class:`~dpl.core.layer_gradients.LayerRecord` (read from its module's
    attributes and parameter shapes: works without weights)."""
    module, params = record.module, record.params
    numel = sum(p.numel() for p in params.values())
    if record.kind == "linear":
        return LayerShape("linear", module.in_features, module.out_features, numel, "weight" in params)
    if record.kind == "embedding":
        return LayerShape("embedding", module.num_embeddings, module.embedding_dim, numel)
    first = next(iter(params.values()))
    width = int(first.shape[-1]) if first.dim() else 1
    return LayerShape(record.kind, width, width, numel)


def per_example_path(layer: LayerShape, tokens: int) -> bool:
    """Whether a linear layer's weight norm materialises per-example gradients (else Gram matrices; T = 1: neither)
    - the choice of ``dpl.core.layer_gradients._prepare_linear``."""
    return layer.kind == "linear" and layer.matrix and policy.per_example_path(tokens, layer.d_in, layer.d_out)


def grad_bytes(kind: str, precision: str) -> int:
    """Bytes of one element of a layer's output gradient g under the trainer's precision: bf16-mixed autocasts linear
    layers only (the others' outputs stay float32); bf16-true keeps everything in bfloat16."""
    if precision.startswith("64"):
        return 8
    if precision == "bf16-true" or (precision.startswith("bf16") and kind == "linear"):
        return 2
    return 4


def kept_bytes(layer: LayerShape, batch: int) -> int:
    """The float32 per-example gradients of the layer's trainable parameters."""
    return policy.kept_bytes(batch, layer.numel)


def input_bytes(layer: LayerShape, batch: int, tokens: int, precision: str = "32-true") -> int:
    """A layer's input (an embedding's int64 token ids): what a book holds beyond the non-private step only where
    activation checkpointing would have dropped it."""
    return (8 if layer.kind == "embedding" else grad_bytes(layer.kind, precision) * layer.d_in) * batch * tokens


def fast_bytes(layer: LayerShape, batch: int, tokens: int, precision: str, checkpointing: bool = False) -> int:
    """What ``fast`` holds of one layer until all norms are known: g and the per-example state (and, under activation
    checkpointing, the input its book keeps past the block's recomputation)."""
    if checkpointing:
        return input_bytes(layer, batch, tokens, precision) + fast_bytes(layer, batch, tokens, precision)
    if layer.kind == "embedding":  # g in float32 (the token-identity norm and sum read it)
        return max(4, grad_bytes("embedding", precision)) * batch * tokens * layer.d_out
    held = grad_bytes(layer.kind, precision) * batch * tokens * layer.d_out
    if layer.kind != "linear" or per_example_path(layer, tokens):
        return held + kept_bytes(layer, batch)
    bias = layer.numel - (layer.d_in * layer.d_out if layer.matrix else 0)
    return held + 4 * batch * bias


def gram_bytes(layer: LayerShape, batch: int, tokens: int) -> int:
    """``fast``'s transient (b, T, T) float32 pair of a layer that takes the Gram path (embeddings, linear)."""
    if layer.kind == "embedding" or (layer.kind == "linear" and layer.matrix and tokens > 1
                                     and not per_example_path(layer, tokens)):
        return 2 * 4 * batch * tokens * tokens
    return 0


def low_bytes(layer: LayerShape, batch: int, tokens: int) -> int:
    """``low``'s transient norm temporaries of one layer: a chunk of examples at a time for linear and embedding
    layers (``dpl.core.layer_gradients.sq_norms``), the per-example gradients of the others."""
    if layer.kind not in ("linear", "embedding"):
        return kept_bytes(layer, batch)
    per_row = policy.norm_temporary(layer.kind, tokens, layer.d_in, layer.d_out)
    return 4 * min(batch, policy.norm_chunk(per_row)) * per_row


def book_bytes(layer: LayerShape, batch: int, tokens: int, checkpointing: bool = False) -> int:
    """What ``auto``'s book of a float32 layer holds beyond the non-private step (``dpl.core.streaming``): its g, its
    per-example gradients on the per-example path and, under activation checkpointing, its input."""
    size = 4 * batch * tokens * layer.d_out + (input_bytes(layer, batch, tokens) if checkpointing else 0)
    return policy.book_bytes(size, batch, tokens, layer.d_in, layer.d_out, layer.kind == "linear" and layer.matrix)


def _costs(layers: list[LayerShape], batch: int, tokens: int,
           checkpointing: bool = False) -> list[tuple[int | None, int | None]]:
    """Per layer: (bytes of its per-example gradients, of its book); None where it cannot hold that."""
    return [policy.layer_costs(layer.kind, kept_bytes(layer, batch), book_bytes(layer, batch, tokens, checkpointing))
            for layer in layers]


def one_pass(layers: list[LayerShape], batch: int, budget_bytes: int, tokens: int | None, bf16: bool,
             checkpointing: bool = False) -> bool:
    """Whether float32 ``auto`` holds every layer's per-example gradients or book, the smaller, and skips the second
    backward pass: they fit the budget together (``dpl.core.streaming.StreamingNorms.plan_passes``)."""
    return not (bf16 or tokens is None) and policy.one_pass(_costs(layers, batch, tokens, checkpointing),
                                                            budget_bytes)


def keeps_in_any_order(layers: list[LayerShape], batch: int, budget_bytes: int, tokens: int | None = None,
                       bf16: bool = False) -> bool:
    """Whether :func:`auto_choices` holds the same whatever the layers' order: in one pass, or when every per-example
    gradient fits together, none fits alone, or all are of one size (without activation checkpointing)."""
    if one_pass(layers, batch, budget_bytes, tokens, bf16):
        return True
    sizes = [kept_bytes(layer, batch) for layer in layers if layer.kind != "embedding"]
    return not sizes or sum(sizes) <= budget_bytes or min(sizes) > budget_bytes or len(set(sizes)) == 1


def auto_choices(layers: list[LayerShape], batch: int, budget_bytes: int, tokens: int | None = None,
                 bf16: bool = False, checkpointing: bool = False) -> list[str]:
    """``auto``'s choice for each layer (in the order of the backward pass), as ``dpl.core.streaming.StreamingNorms``
    makes it: in one pass (:func:`one_pass`) ``kept`` or ``booked``, whichever holds less (an embedding: booked);
    otherwise ``kept`` while its per-example gradients fit what is left of the budget (never an embedding's), the
    others ``low`` (under bf16 ``booked``, as ``fast``, outside the budget)."""
    if one_pass(layers, batch, budget_bytes, tokens, bf16, checkpointing):
        return [policy.one_pass_choice(kept, book) for kept, book in _costs(layers, batch, tokens, checkpointing)]
    held, choices = 0, []
    for layer in layers:
        need = kept_bytes(layer, batch)
        if policy.fits(layer.kind, held, need, budget_bytes):
            held += need
            choices.append("kept")
        else:
            choices.append("booked" if bf16 else "low")
    return choices


def auto_keeps(layers: list[LayerShape], batch: int, budget_bytes: int) -> list[bool]:
    """Which layers keep their per-example gradients (:func:`auto_choices` without books)."""
    return [choice == "kept" for choice in auto_choices(layers, batch, budget_bytes)]


@dataclass(frozen=True)
class KindMemory:
    """One layer kind's share: layers, trainable parameters, ``fast``'s bytes, and the layers ``auto`` keeps, their
    bytes and all ``auto`` holds of the kind (the kept bytes, plus under bf16 the others' ``fast`` state). ``None``:
    needs T."""

    kind: str
    layers: int
    params: int
    fast: int | None
    kept_layers: int
    kept: int
    auto: int | None
    booked_layers: int = 0  # layers auto keeps the book of (float32: within the budget; bf16: every other layer)


@dataclass(frozen=True)
class MemoryPlan:
    """The memory block of ``dpl plan``: the setting it was predicted for, per kind, and the totals of each mode
    (bytes held above the non-private step; ``*_transient``: the largest temporary of one layer)."""

    micro_batch: int | None  # privacy.physical_batch_size; None: auto (predicted for one example)
    batch_size: int  # privacy.batch_size, the expected batch (a micro-batch never holds more than the sampled one)
    batch_memory_mib: float | None  # privacy.physical_batch_memory as configured
    tokens: int | None  # T: data.max_length (None: the data module has none)
    mode: str
    budget_mib: float | None  # privacy.clipping_memory_budget as configured (None: the default)
    budget_bytes: int  # what auto is predicted with (the default: a quarter of this machine's available RAM)
    precision: str
    kinds: list[KindMemory]
    fast: int | None
    fast_transient: int | None
    low_transient: int | None
    auto: int | None
    checkpointing: bool = False  # finetuning.gradient_checkpointing: books (fast's and auto's) hold the inputs too

    @property
    def bf16(self) -> bool:
        return self.precision.startswith("bf16")


@functools.lru_cache(maxsize=1)
def _default_budget() -> int:
    """``auto``'s default budget on this machine's CPU, read once per process (one plan, one figure)."""
    return policy.default_budget_bytes()


def planned_budget(budget_mib: float | None) -> int:
    """The budget ``auto`` is predicted with: the configured MiB, or the CPU default of the machine that plans."""
    return int(budget_mib * MIB) if budget_mib is not None else _default_budget()


def plan_memory(layers: list[LayerShape], *, physical_batch_size: int | str, tokens: int | None, mode: str,
                budget_mib: float | None, precision: str, batch_memory_mib: float | None = None,
                batch_size: int = 0, checkpointing: bool = False) -> MemoryPlan:
    """The :class:`MemoryPlan` of ``layers`` (in the order of the backward pass: last layer first; ``checkpointing``:
    activation checkpointing drops the layers' inputs, which books then hold)."""
    auto_batch = physical_batch_size == "auto"
    batch = 1 if auto_batch else int(physical_batch_size)
    budget = planned_budget(budget_mib)
    bf16 = precision.startswith("bf16")
    choices = auto_choices(layers, batch, budget, tokens, bf16, checkpointing)

    def fast(layer: LayerShape) -> int | None:
        return None if tokens is None else fast_bytes(layer, batch, tokens, precision, checkpointing)

    kinds = []
    for kind in KINDS:
        mine = [(layer, choice) for layer, choice in zip(layers, choices) if layer.kind == kind]
        if not mine:
            continue
        fasts = [fast(layer) for layer, _ in mine]
        kept = sum(kept_bytes(layer, batch) for layer, choice in mine if choice == "kept")
        booked = [(f if bf16 else book_bytes(layer, batch, tokens, checkpointing)) for f, (layer, choice) in zip(fasts, mine)
                  if choice == "booked"]
        kinds.append(KindMemory(
            kind=kind, layers=len(mine), params=sum(layer.numel for layer, _ in mine),
            fast=None if tokens is None else sum(fasts), kept_layers=sum(c == "kept" for _, c in mine), kept=kept,
            auto=None if None in booked else kept + sum(booked),
            booked_layers=sum(c == "booked" for _, c in mine)))
    known = tokens is not None
    return MemoryPlan(
        micro_batch=None if auto_batch else batch, batch_size=batch_size, batch_memory_mib=batch_memory_mib,
        tokens=tokens, mode=mode, budget_mib=budget_mib, budget_bytes=budget, precision=precision, kinds=kinds,
        fast=sum(k.fast for k in kinds) if known else None,
        fast_transient=max((gram_bytes(layer, batch, tokens) for layer in layers), default=0) if known else None,
        low_transient=max((low_bytes(layer, batch, tokens) for layer in layers), default=0) if known else None,
        auto=None if any(k.auto is None for k in kinds) else sum(k.auto for k in kinds), checkpointing=checkpointing)


# ------------------------------------------------------------------------------------------------- printing


def mib(size: int | None) -> str:
    """``39 KiB``, ``4.88 MiB``, ``1,024 MiB``; ``needs T`` for a size that depends on the unknown length."""
    if size is None:
        return "needs T"
    if 0 < size < MIB:
        return f"{size / 1024:.3g} KiB"
    value = size / MIB
    return f"{value:,.0f} MiB" if value >= 100 else f"{value:.3g} MiB"


def memory_lines(m: MemoryPlan) -> list[str]:
    """The block as printed under ``memory``."""
    length = f"T = {m.tokens:,} tokens (data.max_length)" if m.tokens is not None else \
        "T unknown: the data module sets no max_length, which the prediction needs"
    if m.micro_batch is None:
        within = f"{m.batch_memory_mib:g} MiB" if m.batch_memory_mib is not None else \
            "default: 90% of the free CUDA memory, half the available RAM on a CPU"
        lines = ["micro-batch auto: chosen at the start of dpl fit by probing the private step on a public batch at "
                 f"data.max_length tokens within privacy.physical_batch_memory ({within}), auto's clipping state "
                 "within the same budget",
                 f"predicted per example (b = 1), {length}"]
    else:
        larger = m.micro_batch > m.batch_size > 0
        note = f"; an upper bound: a sampled batch, B = {m.batch_size:,} expected, mostly fits in one" if larger else ""
        lines = [f"micro-batch b = {m.micro_batch:,} (privacy.physical_batch_size{note}), {length}"]
    budget = policy.describe_budget(m.budget_bytes, m.budget_mib is not None, "cpu")
    if m.budget_mib is None:
        budget = budget[:-1] + " here; on CUDA of the free memory at the first step)"
    dtype = {"bf16-mixed": "g of linear layers in bfloat16 (bf16-mixed)", "bf16-true": "g in bfloat16 (bf16-true)"}
    lines.append(f"clipping_memory {m.mode}, auto's budget {budget}; per-example gradients in float32, "
                 + dtype.get(m.precision, "g in float64" if m.precision.startswith("64") else "g in float32"))
    booked = any(k.auto != k.kept for k in m.kinds)  # auto holds books too
    header = ("kind", "layers", "parameters", "fast", "auto keeps", *(("auto",) if booked else ()))
    rows = [header] + [(k.kind, f"{k.layers:,}", f"{k.params:,}", mib(k.fast), f"{k.kept_layers:,} ({mib(k.kept)})",
                        *((mib(k.auto),) if booked else ())) for k in m.kinds]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines += ["  " + "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(row, widths))) for row in rows]
    lines.append(f"predicted per-example clipping state above the non-private step ({m.mode}): {_mode(m, m.mode)}")
    lines.append("  " + "; ".join(f"{mode} {_mode(m, mode)}" for mode in policy.CLIPPING_MEMORY if mode != m.mode))
    lines.append("  (counted: g, per-example state and the layer inputs books hold past a checkpointed block's "
                 "recomputation)" if m.checkpointing else
                 "  (counted: g and per-example state; layer inputs are autograd's saved activations)")
    if m.auto is not None and m.fast is not None and m.auto > m.fast:
        lines.append("  (auto holds more than fast here: the per-example gradients it keeps within its budget are "
                     "larger than the g fast holds for those layers; a smaller clipping_memory_budget keeps fewer)")
    return lines


def _mode(m: MemoryPlan, mode: str) -> str:
    if mode == "fast":
        gram = f" (+ {mib(m.fast_transient)} of Gram matrices at a time)" if m.fast_transient else ""
        return mib(m.fast) + gram
    if mode == "low":
        return "refused under bf16" if m.bf16 else \
            f"0 MiB (+ {mib(m.low_transient)} of norm temporaries at a time; a second backward pass)"
    kept = sum(k.kept_layers for k in m.kinds)
    booked = sum(k.booked_layers for k in m.kinds)
    rest = sum(k.layers for k in m.kinds) - kept - booked
    if not rest and not booked:
        return f"{mib(m.auto)} (every layer kept: one backward pass, fast's time)"
    kept_text = f"{kept:,} layer{'' if kept == 1 else 's'} kept"
    if m.bf16:
        return f"{mib(m.auto)} ({kept_text}, {booked:,} with fast's state)"
    books = f", {booked:,} booked" if booked else ""
    if not rest:
        return f"{mib(m.auto)} ({kept_text}{books}: one backward pass, fast's time)"
    return f"{mib(m.auto)} ({kept_text}{books}; {rest:,} as low: a second backward pass)"
