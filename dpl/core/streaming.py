"""Per-example norms computed during the backward pass, each layer's state freed as soon as its norm is known
(``privacy.clipping_memory: low`` and ``auto``; :class:`~dpl.core.per_example.PerExampleClipper` drives it).

In the forward pass, the output of every module that owns trainable parameters passes through an identity autograd
function (a *tap*) whose backward receives the output gradient g. The first backward runs to a scalar *sink* that
every tap feeds, so autograd computes the activation gradients the taps need and no weight gradient. When a layer's
input a and its g are both there, its per-example squared norms are added and (a, g) dropped. Under ``auto``, when
every layer's per-example gradients or book (what it holds beyond the non-private step: g, a where checkpointing drops
it, and where cheaper than the Gram path its per-example gradients), whichever is smaller, fit the byte budget
together (known once the forward pass has run), each layer keeps the smaller and the clipped sum needs no second pass (``fast``'s time); otherwise a layer whose per-example gradients fit
what is left of the budget keeps them and the others get their clipped sum from a second backward of
sum_i c_i * loss_i (Li et al., "Large language models can be strong differentially private learners", ICLR 2022:
ghost clipping).

Activation checkpointing (``torch.utils.checkpoint`` without reentrance, Hugging Face's default): a checkpointed
layer's input is not kept in the forward pass; the recomputation inside the backward pass hands it over (a forward
pre-hook that fires during a backward), before or after the layer's g arrives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dpl.core import clipping_policy as policy
from dpl.core.layer_gradients import LayerRecord, PreparedLayer, per_example_gradients, prepare, sq_norms
from dpl.core.units import Grouping


def in_backward() -> bool:
    """Whether autograd is running a backward pass now (a forward pass then is a checkpoint's recomputation)."""
    return torch._C._current_graph_task_id() != -1


def in_checkpoint() -> bool:
    """Whether this forward pass runs inside ``torch.utils.checkpoint`` (non-reentrant): its activations are dropped
    and recomputed during the backward pass."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return bool(hooks) and getattr(hooks[0], "__qualname__", "").startswith("_checkpoint_hook")


class _Tap(torch.autograd.Function):
    """Identity on ``output``; its backward hands the output gradient to ``callback`` and feeds ``sink``."""

    @staticmethod
    def forward(ctx, output: Tensor, sink: Tensor, callback: Callable[[Tensor], None]) -> Tensor:
        ctx.callback = callback
        ctx.sink_like = (sink.dtype, sink.device)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.callback(grad)
        dtype, device = ctx.sink_like
        return grad, torch.zeros((), dtype=dtype, device=device), None


@dataclass
class _Call:
    """One call of a module in the forward pass: its input (None until a recomputation hands it over) and g."""

    a: Tensor | None
    deferred: bool
    g: Tensor | None = None


@dataclass
class _Layer:
    calls: list[_Call] = field(default_factory=list)
    decided: str | None = None  # "kept" (per-example gradients held), "booked" (its book held: a float32 weighted
    # sum, as fast does) or "low" (summed by the second backward)
    book_bytes: int = 0  # its output gradients and checkpointed inputs (the sizes), noted in the forward pass
    steps: int = 0  # positions over its calls


def _book_part(x: Tensor, deferred: bool) -> int:
    """The bytes of a layer input a book holds beyond the non-private step: a checkpointed block's (which
    checkpointing would drop); otherwise autograd saves it for the backward pass anyway."""
    return x.numel() * x.element_size() if deferred else 0


class StreamingNorms:
    """The per-example squared norms of one micro-batch, accumulated layer by layer during the first backward.

    ``budget_bytes``: None (``low``: keep nothing) or the bytes of per-example gradients and books ``auto`` may hold.
    ``book``: keep the book of every layer not kept (bf16: no second pass at all).
    ``held_bytes`` / ``peak_held_bytes``: what the kept per-example gradients and books hold (the engine's retained
    state).
    """

    def __init__(self, device: torch.device, budget_bytes: int | None, book: bool = False) -> None:
        self.sink = torch.zeros((), device=device, requires_grad=True)
        self.budget_bytes = budget_bytes
        self.book = book  # keep (a, g) of the layers not kept, for a float32 weighted sum (no second pass)
        self.booked: list[tuple[LayerRecord, PreparedLayer]] = []
        self.layers: dict[int, tuple[LayerRecord, _Layer]] = {}
        self.kept: list[tuple[LayerRecord, dict[str, Tensor]]] = []
        self.held_bytes = 0
        self.peak_held_bytes = 0
        self.listening = False
        self.one_pass = False  # auto: every layer kept or booked, no second backward pass (plan_passes)
        self.sq_norms: Tensor | None = None
        self.grouping: Grouping | None = None
        self._grams: dict[tuple, Tensor] = {}
        self._gram_owner: list[Tensor] = []

    def tap(self, rec: LayerRecord, x: Tensor, output: Tensor) -> Tensor:
        """Forward hook: note the call (its input unless checkpointing drops it) and tap its output."""
        _, layer = self.layers.setdefault(id(rec), (rec, _Layer()))
        deferred = in_checkpoint()
        layer.book_bytes += _book_part(x, deferred) + output.numel() * output.element_size()
        layer.steps += output.shape[1] if output.dim() > 2 else 1
        call = _Call(None if deferred else x.detach(), deferred)
        layer.calls.append(call)
        return _Tap.apply(output, self.sink, lambda g: self._grad(rec, layer, call, g))

    def recomputed_input(self, rec: LayerRecord, x: Tensor) -> None:
        """Forward pre-hook during a recomputation: the input of the latest call still waiting for it (checkpointed
        blocks are recomputed last block first)."""
        if not self.listening or id(rec) not in self.layers:
            return
        _, layer = self.layers[id(rec)]
        waiting = [c for c in layer.calls if c.deferred and c.a is None]
        if waiting:
            waiting[-1].a = x.detach()
            self._maybe_account(rec, layer)

    def _grad(self, rec: LayerRecord, layer: _Layer, call: _Call, g: Tensor) -> None:
        if self.listening:
            call.g = g.detach()
            self._maybe_account(rec, layer)

    def _maybe_account(self, rec: LayerRecord, layer: _Layer) -> None:
        """Once every call of the layer has its input and g: add the layer's squared norms, drop (a, g)."""
        if any(c.a is None or c.g is None for c in layer.calls):
            return
        inputs, grads = [c.a for c in layer.calls], [c.g for c in layer.calls]
        book = sum(_book_part(c.a, c.deferred) + c.g.numel() * c.g.element_size() for c in layer.calls)
        for c in layer.calls:  # the retained graph's taps still reference the calls
            c.a = c.g = None
        layer.calls.clear()
        with torch.no_grad(), torch.autocast(device_type=self.sink.device.type, enabled=False):
            self.sq_norms += self._account(rec, layer, inputs, grads, book)

    def _account(self, rec: LayerRecord, layer: _Layer, inputs: list[Tensor], grads: list[Tensor],
                 book: int) -> Tensor:
        view = LayerRecord(rec.module, rec.kind, rec.full_names, inputs)
        if layer.decided is None:
            if self.one_pass:
                layer.decided = policy.one_pass_choice(*self._costs(rec, layer))
            else:
                layer.decided = "kept" if self._fits(rec) else "booked" if self.book else "low"
        if layer.decided == "kept":
            per_example = per_example_gradients(view, grads, self.grouping)
            self.kept.append((rec, per_example))
            self._hold(sum(t.numel() * t.element_size() for t in per_example.values()))
            return sum(t.reshape(t.shape[0], -1).pow(2).sum(1) for t in per_example.values())
        if layer.decided == "booked":
            prepared = prepare(view, grads, self._gram_cache(inputs), self.grouping)  # Q, K, V: one input Gram
            self.booked.append((rec, prepared))
            if not self.book:  # chosen within the budget (a bf16 step books every layer it does not keep)
                self._hold(self._book_of(rec, book, sum(g.shape[1] if g.dim() > 2 else 1 for g in grads)))
            return prepared.sq_norms
        return sq_norms(view, grads, self._gram_cache(inputs), self.grouping)

    def _hold(self, size: int) -> None:
        self.held_bytes += size
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)

    def _book_of(self, rec: LayerRecord, activation_bytes: int, steps: int) -> int:
        linear = rec.kind == "linear" and "weight" in rec.full_names
        d_out, d_in = rec.params["weight"].shape if linear else (0, 0)
        return policy.book_bytes(activation_bytes, self.sq_norms.numel(), steps, d_in, d_out, linear)

    def _costs(self, rec: LayerRecord, layer: _Layer) -> tuple[int | None, int | None]:
        """(bytes of the layer's per-example gradients, of its book); None where the layer cannot hold that."""
        kept = policy.kept_bytes(self.sq_norms.numel(), sum(p.numel() for p in rec.params.values()))
        return policy.layer_costs(rec.kind, kept, self._book_of(rec, layer.book_bytes, layer.steps))

    def plan_passes(self) -> None:
        """Before the first backward pass (the forward pass has noted every layer): one pass if every layer's
        per-example gradients or book, the smaller, fit the budget together (``auto`` in float32)."""
        self.one_pass = not self.book and policy.one_pass(
            [self._costs(rec, layer) for rec, layer in self.layers.values()], self.budget_bytes)

    def _fits(self, rec: LayerRecord) -> bool:
        need = policy.kept_bytes(self.sq_norms.numel(), sum(p.numel() for p in rec.params.values()))
        return policy.fits(rec.kind, self.held_bytes, need, self.budget_bytes)

    def _gram_cache(self, inputs: list[Tensor]) -> dict[tuple, Tensor]:
        """The Gram matrix of the latest input, shared by the layers that read it (Q, K, V); the input is held
        while its Gram is, so that no other tensor can take its address. Units: no sharing."""
        if self.grouping is not None:
            return {}
        key = tuple((t.data_ptr(), tuple(t.shape), t.stride()) for t in inputs)
        if key not in self._grams:
            self._grams.clear()
            self._gram_owner = list(inputs)
        return self._grams

    def flush(self) -> None:
        """After the first backward: a call whose g never came does not reach the loss (a zero gradient) and is
        dropped; the layer's other calls are then accounted. A g without its input is an error."""
        for rec, layer in self.layers.values():
            if not layer.calls:
                continue
            if any(c.g is not None and c.a is None for c in layer.calls):
                raise RuntimeError(f"no input recorded for {next(iter(rec.full_names.values()))}: its activation "
                                   "checkpoint was not recomputed (reentrant checkpointing is not supported)")
            layer.calls[:] = [c for c in layer.calls if c.g is not None]
            if layer.calls:
                self._maybe_account(rec, layer)

    def low_records(self) -> list[LayerRecord]:
        return [rec for rec, layer in self.layers.values() if layer.decided == "low"]

    def finish(self) -> None:
        """Drop every per-layer reference (the kept gradients are read before)."""
        self.listening = False
        self.layers.clear()
        self.kept.clear()
        self.booked.clear()
        self._grams.clear()
        self._gram_owner = []
        self.held_bytes = 0
