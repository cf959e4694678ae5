"""Per-example clipped gradient sums in one forward and one backward pass ("book-keeping" ghost clipping).

For every module that directly owns trainable parameters, a forward hook records the module's input and its
output tensor. After the forward pass, ``torch.autograd.grad`` computes the gradients of the summed
per-example losses with respect to those outputs only - autograd skips the weight-gradient products, which
dpl then forms once, already weighted by each example's clipping factor:

* ``nn.Linear`` (also peft's LoRA A/B, classifier heads): per-example gradient norms by the ghost-norm
  identity ``||g_i^T a_i||^2 = <a_i a_i^T, g_i g_i^T>`` (cost B T^2 (d_in+d_out)) or by materialising
  the per-example gradients when that is cheaper (B T d_in d_out); the clipped sum is one matmul.
* ``nn.Embedding``: ghost norm through token-identity masks; clipped sum by ``index_add``. ``padding_idx``
  rows get no gradient, as in PyTorch.
* ``nn.LayerNorm``: per-example gradients in closed form (sum over positions of g * x_hat, and of g).
* RMSNorm (``nn.RMSNorm``, Llama's ``LlamaRMSNorm`` and other ``*RMSNorm`` classes with one ``weight``): closed form
  (sum over positions of g * x / rms(x)), used only after a numerical check against the exact path at setup.
* anything else: exact per-example gradients of its own parameters with ``torch.func`` (vmap of a vjp through
  ``functional_call``) from the recorded input and output gradient; its forward must take a single tensor.

Inputs whose batch dimension is 1 while the batch has more examples (BERT's position ids) are expanded to
the batch first, so that each example's gradient stays separate. A parameter shared by two modules (tied
embeddings) is refused: its per-example gradient would need cross terms.

This module records and clips; the formulas of each layer kind are in :mod:`dpl.core.layer_gradients`.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from dpl.core import clipping_policy as policy
from dpl.core.group_clipping import GroupClipping
from dpl.core.layer_gradients import LayerRecord, _zero_rows, exact_per_example, prepare, rms_normed
from dpl.core.streaming import StreamingNorms, in_backward
from dpl.core.units import Grouping
from dpl.errors import ConfigError

log = logging.getLogger("dpl")


def _kind(module: nn.Module) -> str:
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Embedding):
        if module.max_norm is not None or module.sparse:
            raise ConfigError(f"nn.Embedding with max_norm or sparse gradients is not supported ({module})")
        return "embedding"
    if type(module) is nn.LayerNorm:
        return "layer_norm"
    if _rms_norm_closed_form_holds(module):
        return "rms_norm"
    return "generic"


def _rms_norm_closed_form_holds(module: nn.Module) -> bool:
    """Whether ``module`` is an RMSNorm (``nn.RMSNorm``, or a class named ``*RMSNorm`` such as Llama's) whose only
    trainable parameter is a last-dimension ``weight`` with per-example gradient sum_t g * x / rms(x). Checked
    numerically against the exact ``torch.func`` gradient on a random input, so a variant that differs (another
    formula, other parameters) falls back to the exact path instead of getting a wrong norm."""
    if not (isinstance(module, nn.RMSNorm) or type(module).__name__.endswith("RMSNorm")):
        return False
    trainable = {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}
    weight = trainable.get("weight")
    if set(trainable) != {"weight"} or weight.dim() != 1 or not weight.is_floating_point():
        return False
    if weight.device.type == "meta":  # a model without its weights (dpl plan's): check a copy on the CPU
        module = copy.deepcopy(module).to_empty(device="cpu")
        with torch.no_grad():
            module.weight.copy_(torch.randn(module.weight.shape, generator=torch.Generator().manual_seed(1)))
        weight = module.weight
    gen = torch.Generator(device=weight.device).manual_seed(0)
    x = torch.randn(2, 3, weight.numel(), generator=gen, device=weight.device, dtype=weight.dtype)
    g = torch.randn(2, 3, weight.numel(), generator=gen, device=weight.device, dtype=weight.dtype)
    try:
        exact = exact_per_example(module, {"weight": weight.detach()}, [x], [g])["weight"]
    except Exception:  # noqa: BLE001 - a forward that does not fit the check: use the exact path
        return False
    closed = (g.float() * rms_normed(module, x)).sum(1)
    return bool(torch.allclose(closed, exact, rtol=1e-4, atol=1e-5))


def model_is_per_example(model: nn.Module) -> None:
    """Refuse layers whose output for one example depends on the other examples of the batch."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            raise ConfigError(f"layer {name or type(module).__name__} ({type(module).__name__}) normalizes over "
                              "the batch, so one example changes the others' gradients and clipping no longer "
                              "bounds its influence; use LayerNorm/GroupNorm (or replace it before training)")
        if getattr(module, "expert_capacity", None) is not None or "Top1Router" in type(module).__name__:
            raise ConfigError(f"layer {name} ({type(module).__name__}) routes tokens with a capacity shared by "
                              "the batch (token dropping): one example changes the others' outputs")


class PerExampleClipper:
    """Computes the clipped sum of per-example gradients of ``model``'s trainable parameters.

    Usage::

        clipper = PerExampleClipper(model)
        with clipper.record(batch_size):
            losses = per_example_loss(model, batch)  # shape (batch_size,)
        sums, norms = clipper.clipped_sum(losses, max_norm)

    ``sums`` maps each trainable parameter's name to the float32 sum of the clipped per-example gradients;
    ``norms`` holds the per-example gradient norms before clipping (private: never release them).

    ``memory`` (``privacy.clipping_memory``) chooses what the step holds:

    * ``fast``: one backward pass; every layer's input and output gradient is held until all norms are known
      (book-keeping: Bu et al., "Differentially private optimization on large model at small cost", ICML 2023).
    * ``low``: norms during the first backward pass, each layer's state freed at once
      (:mod:`dpl.core.streaming`); the clipped sum by a second backward pass of sum_i c_i * loss_i. It holds what
      the non-private step holds plus one layer's state, and works with activation checkpointing.
    * ``auto``: as ``low``, except that layers whose per-example gradients fit what is left of ``budget_mib``
      (default: :func:`~dpl.core.clipping_policy.default_budget_bytes`) keep them; when every layer does,
      there is no second pass. Under bf16 (autocast or 16-bit parameters) the other layers keep ``fast``'s state
      instead of a second pass, whose bf16 products would round each clipped gradient apart from its norm; ``low``
      is refused there.
    """

    def __init__(self, model: nn.Module, memory: str = "fast", budget_mib: float | None = None) -> None:
        policy.check_choice("clipping_memory", memory, policy.CLIPPING_MEMORY)
        self.model = model
        self.memory = memory
        self.budget_mib = budget_mib
        self.budget: int | None = None  # auto's budget in bytes: fixed at the first step, or set by the probe
        self.stream: StreamingNorms | None = None
        self.peak_held_bytes = 0  # ``auto``: the most bytes of per-example gradients and books held in the last step
        self.one_pass = self.second_pass_told = False  # ``auto``: the last step held them all; a second pass logged
        self.records: list[LayerRecord] = []
        owners: dict[int, str] = {}
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        for mod_name, module in model.named_modules(remove_duplicate=False):
            params = {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}
            if not params:
                continue
            for local, p in params.items():
                full = f"{mod_name}.{local}" if mod_name else local
                if id(p) in owners:
                    raise ConfigError(f"trainable parameter {full!r} is shared with {owners[id(p)]!r} (tied "
                                      "weights): untie them or freeze one; per-example clipping of shared "
                                      "parameters is not supported")
                owners[id(p)] = full
            full_names = {n: names[id(p)] for n, p in params.items()}
            self.records.append(LayerRecord(module, _kind(module), full_names))
        self._batch_size, self._recording = 0, False
        self._armed = False  # from the forward pass to the end of clipped_sum (checkpoints recompute in between)
        self._handles = []
        for rec in self.records:
            self._handles.append(rec.module.register_forward_pre_hook(self._make_pre_hook(rec)))
            self._handles.append(rec.module.register_forward_hook(self._make_hook(rec)))
        self.parameter_names: list[str] = [n for rec in self.records for n in rec.full_names.values()]
        self.group_of: dict[int, int] | None = None  # per_layer: each record's group (set_groups)

    def set_groups(self, groups: list[list[str]]) -> None:
        """Clip group-wise (``privacy.clipping: per_layer``): ``groups`` partition :attr:`parameter_names`
        (:func:`~dpl.core.clipping_policy.clipping_groups`); a layer's parameters lie in one group."""
        index = {name: g for g, names in enumerate(groups) for name in names}
        self.group_of = {}
        for rec in self.records:
            owners = {index[name] for name in rec.full_names.values()}
            if len(owners) != 1:
                raise ConfigError(f"the parameters of {type(rec.module).__name__} {sorted(rec.full_names.values())} "
                                  "lie in several clipping groups; a layer is clipped as one")
            self.group_of[id(rec)] = owners.pop()

    def modules_needing_parameter_values(self) -> list[str]:
        """Modules whose per-example gradients need the parameter values (``torch.func`` path): they cannot run on
        sharded parameters (FSDP). Linear, Embedding, LayerNorm and RMSNorm need only activations."""
        return [f"{type(rec.module).__name__} ({next(iter(rec.full_names.values()))})" for rec in self.records
                if rec.kind == "generic"]

    def remove(self) -> None:
        """Remove the hooks from the model."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _make_pre_hook(self, rec: LayerRecord):
        def pre_hook(module, args):
            if not self._armed or not args or not torch.is_tensor(args[0]):
                return None
            x, expanded = args[0], None
            if x.dim() > 0 and x.shape[0] == 1 and self._batch_size > 1:
                x = x.expand(self._batch_size, *x.shape[1:])
                expanded = (x, *args[1:])
            if self.stream is not None and in_backward():
                self.stream.recomputed_input(rec, x)
            return expanded
        return pre_hook

    def _make_hook(self, rec: LayerRecord):
        def hook(module, args, output):
            if not self._recording or in_backward():  # a checkpoint's recomputation: the first pass recorded it
                return None
            if len(args) != 1 or not torch.is_tensor(args[0]) or not torch.is_tensor(output):
                raise ConfigError(f"cannot compute per-example gradients for {type(module).__name__}: its forward "
                                  "must take one tensor and return one tensor; freeze its parameters")
            if output.shape[0] != self._batch_size:
                raise ConfigError(f"{type(module).__name__} output has leading dimension {output.shape[0]}, "
                                  f"expected the batch size {self._batch_size}")
            if self.stream is not None:
                return self.stream.tap(rec, args[0], output) if output.requires_grad else None
            rec.inputs.append(args[0].detach())
            rec.outputs.append(output)
            return None
        return hook

    @contextmanager
    def record(self, batch_size: int) -> Iterator[None]:
        """Record layer inputs and outputs during a forward pass over ``batch_size`` examples."""
        self._clear()
        self._batch_size = batch_size
        if self.group_of is not None:
            self.stream = GroupClipping(self._device(), self.group_of)
        elif self.memory != "fast":
            device = self._device()
            book = _low_precision(self.records, device)
            if book and self.memory == "low":
                raise ConfigError("privacy.clipping_memory low needs float32 parameters without autocast (its second "
                                  "backward pass would round each clipped gradient apart from its norm); use auto or "
                                  "fast under bf16")
            self.stream = StreamingNorms(device, self._budget_bytes(device), book=book)
        self._recording = self._armed = True
        try:
            yield
        finally:
            self._recording = False

    def _device(self) -> torch.device:
        return next((p.device for rec in self.records for p in rec.params.values()), torch.device("cpu"))

    def _budget_bytes(self, device: torch.device) -> int | None:
        """``auto``'s budget (:attr:`budget`, unless set: fixed at the first step and logged once): the configured
        MiB, or a share of what the device has free then (:func:`~dpl.core.clipping_policy.default_budget_bytes`)."""
        if self.memory == "low":
            return None
        if self.budget is None:
            free = int(torch.cuda.mem_get_info(device)[0]) if device.type == "cuda" else None
            self.budget = (policy.default_budget_bytes(free) if self.budget_mib is None
                           else int(self.budget_mib * policy.MIB))
            log.info(policy.auto_notes(self.budget, self.budget_mib is not None, device.type))
        return self.budget

    def _clear(self) -> None:
        self._armed = False
        if self.stream is not None:
            self.stream.finish()
            self.stream = None
        for rec in self.records:
            rec.inputs.clear()
            rec.outputs.clear()

    def zero_sums(self) -> dict[str, Tensor]:
        return {full: torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                for rec in self.records for local, p in rec.params.items()
                for full in [rec.full_names[local]]}

    def clipped_sum(self, losses: Tensor, max_norm: float, exclude: Tensor | None = None,
                    units: Tensor | None = None,
                    reforward: Callable[[Tensor], Tensor] | None = None) -> tuple[dict[str, Tensor], Tensor]:
        """Clip each example's gradient of ``losses[i]`` to ``max_norm`` and sum over the batch; examples flagged
        in ``exclude`` (bool per example: FSDP's fillers) contribute exactly zero.

        ``units`` (the privacy unit of every example, the examples of a unit contiguous): the gradient of each unit
        (the sum of its examples' gradients of ``losses``) is clipped as one, and ``norms`` are per unit. Linear and
        embedding layers treat a unit as one example whose tokens are all its rows' tokens (the ghost-norm and
        direct paths as for one example); the others sum their per-example gradients by unit.

        ``reforward(rows)`` (``low``/``auto``): the per-example losses of a forward pass that replays the first one
        (the same random draws, e.g. dropout masks, on the same shapes) with each row not flagged in ``rows`` replaced
        by a flagged one, for the second backward pass when some example's gradient is not finite (its zero weight
        would still turn the retained graph's sum into NaN)."""
        if losses.dim() != 1 or losses.shape[0] != self._batch_size:
            raise ValueError(f"expected per-example losses of shape ({self._batch_size},), got {tuple(losses.shape)}")
        # Under mixed precision (bf16-mixed) autocast would run the norms' and sums' products in bfloat16, with
        # separate roundings for the norm and for the summed gradient: an example could then add more than
        # max_norm. Both are computed in float32 from the recorded activations and output gradients.
        if isinstance(self.stream, GroupClipping):
            raise RuntimeError("the clipper clips group-wise: call group_clipped_sum")
        try:
            if self.stream is not None:
                return self._streamed_sum(losses, max_norm, exclude, units, reforward)
            with torch.autocast(device_type=losses.device.type, enabled=False):
                return self._clipped_sum(losses, max_norm, exclude, units)
        finally:
            self._clear()

    def group_clipped_sum(self, losses: Tensor, thresholds: Tensor, exclude: Tensor | None = None,
                          units: Tensor | None = None) -> tuple[dict[str, Tensor], Tensor, Tensor]:
        """Group-wise clipping (:mod:`dpl.core.group_clipping`) in the one backward pass of ``losses``: each group's
        gradient of each example (or unit, as :meth:`clipped_sum`) clipped to its threshold, summed. Returns the
        sums, the norms before clipping and, per group, the centred count of units within its threshold (private:
        only ``privatize`` may read the sums and the counts)."""
        if losses.dim() != 1 or losses.shape[0] != self._batch_size:
            raise ValueError(f"expected per-example losses of shape ({self._batch_size},), got {tuple(losses.shape)}")
        stream = self.stream
        try:
            grouping = None if units is None else Grouping(units.to(losses.device), cache=False)
            rows = self._batch_size if grouping is None else grouping.count
            if exclude is not None:
                exclude = exclude.to(device=losses.device, dtype=torch.bool)
                exclude = exclude if grouping is None else grouping.all_rows(exclude)
            stream.start(rows, thresholds, grouping, exclude)
            torch.autograd.grad(losses.sum(), stream.sink, allow_unused=True)
            stream.flush()
            return self._complete(stream.sums), stream.sq_norms.sqrt(), stream.counts
        finally:
            self._clear()

    def _clipped_sum(self, losses: Tensor, max_norm: float, exclude: Tensor | None,
                     units: Tensor | None = None) -> tuple[dict[str, Tensor], Tensor]:
        active = [rec for rec in self.records if rec.outputs]
        outputs = [out for rec in active for out in rec.outputs]
        grads = torch.autograd.grad(losses.sum(), outputs, allow_unused=True) if outputs else []
        it = iter(grads)
        grads_per_rec = [[g if g is not None else torch.zeros_like(o) for g, o in zip(
            [next(it) for _ in rec.outputs], rec.outputs)] for rec in active]
        grouping = None if units is None else Grouping(units.to(losses.device))
        count = self._batch_size if grouping is None else grouping.count
        sq_norms = torch.zeros(count, dtype=torch.float32, device=losses.device)
        prepared = []
        grams: dict[tuple, Tensor] = {}  # Gram matrices of layer inputs shared by several layers (Q, K, V)
        for rec, gs in zip(active, grads_per_rec):
            state = prepare(rec, gs, grams, grouping)
            sq_norms += state.sq_norms
            prepared.append((rec, state))
        if grouping is not None and exclude is not None:
            exclude = grouping.all_rows(exclude.to(device=losses.device, dtype=torch.bool))
        norms = sq_norms.sqrt()
        factors, keep = _clipping_factors(norms, max_norm, exclude)
        sums = {}
        for rec, state in prepared:
            for local, tensor in state.weighted_sum(factors, keep).items():
                sums[rec.full_names[local]] = tensor
        return self._complete(sums), norms

    def _complete(self, sums: dict[str, Tensor]) -> dict[str, Tensor]:
        """Zeros for the parameters of modules unused in this forward pass; the parameters in the model's order
        (the order the noise is drawn in)."""
        if len(sums) < len(self.parameter_names):
            for rec in self.records:
                for local, p in rec.params.items():
                    if rec.full_names[local] not in sums:
                        sums[rec.full_names[local]] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        return {name: sums[name] for name in self.parameter_names}

    def _streamed_sum(self, losses: Tensor, max_norm: float, exclude: Tensor | None, units: Tensor | None,
                      reforward: Callable[[Tensor], Tensor] | None) -> tuple[dict[str, Tensor], Tensor]:
        """``low``/``auto``: norms in a first backward pass (:class:`StreamingNorms`), then the kept per-example
        gradients weighted, and a second backward pass of sum_i c_i * loss_i for the other layers."""
        stream = self.stream
        grouping = None if units is None else Grouping(units.to(losses.device), cache=False)
        stream.grouping = grouping
        count = self._batch_size if grouping is None else grouping.count
        stream.sq_norms = torch.zeros(count, dtype=torch.float32, device=losses.device)
        stream.plan_passes()
        stream.listening = True
        try:
            torch.autograd.grad(losses.sum(), stream.sink, retain_graph=True, allow_unused=True)
        except RuntimeError as exc:
            if "checkpoint" in str(exc) and "reentrant" in str(exc).lower():
                raise ConfigError("clipping_memory low/auto needs non-reentrant activation checkpointing "
                                  "(use_reentrant=False, Hugging Face's default)") from exc
            raise
        stream.flush()
        stream.listening = False
        self.peak_held_bytes, self.one_pass = stream.peak_held_bytes, stream.one_pass
        norms = stream.sq_norms.sqrt()
        if grouping is not None and exclude is not None:
            exclude = grouping.all_rows(exclude.to(device=losses.device, dtype=torch.bool))
        factors, keep = _clipping_factors(norms, max_norm, exclude)
        sums: dict[str, Tensor] = {}
        with torch.autocast(device_type=losses.device.type, enabled=False):
            for rec, per_example in stream.kept:
                for local, t in per_example.items():
                    sums[rec.full_names[local]] = torch.tensordot(factors, _zero_rows(t, keep), dims=1)
            for rec, prepared in stream.booked:
                for local, t in prepared.weighted_sum(factors, keep).items():
                    sums[rec.full_names[local]] = t
        low = [(rec.full_names[local], p) for rec in stream.low_records() for local, p in rec.params.items()]
        if low and self.memory == "auto" and not self.second_pass_told:
            self.second_pass_told = True
            log.info(policy.second_pass_note(len(stream.low_records()), len(stream.layers)))
        stream.finish()
        if low:
            weights = factors if grouping is None else factors[grouping.inverse.to(factors.device)]
            if keep is not None and not bool(torch.isfinite(losses.detach()).all() and torch.isfinite(norms).all()):
                losses = self._finite_losses(losses, keep if grouping is None else keep[grouping.inverse], reforward)
            if losses is not None:
                grads = torch.autograd.grad((losses * weights.to(losses.dtype).detach()).sum(), [p for _, p in low],
                                            allow_unused=True)
                for (name, p), g in zip(low, grads):
                    sums[name] = torch.zeros(p.shape, dtype=torch.float32, device=p.device) if g is None else g.float()
        return self._complete(sums), norms

    def _finite_losses(self, losses: Tensor, rows: Tensor,
                       reforward: Callable[[Tensor], Tensor] | None) -> Tensor | None:
        """The losses of a forward pass that replays the first one with the rows not flagged in ``rows`` replaced by
        kept ones (a zero weight on a non-finite gradient would still make the retained graph's sum NaN). The clip
        factors were measured on the first pass: every kept row's loss must be the first pass's, bit for bit (the
        same dropout masks), or the step stops rather than release gradients whose norms were never measured."""
        if reforward is None:
            raise RuntimeError("an example's gradient is not finite: clipped_sum needs reforward under "
                               "clipping_memory low/auto")
        if not bool(rows.any()):
            return None
        again = reforward(rows)
        kept = rows.to(losses.device)
        if again.shape != losses.shape or not torch.equal(again.detach()[kept], losses.detach()[kept]):
            raise RuntimeError("clipping_memory low/auto: the forward pass run again without the non-finite examples "
                               "differs from the first (randomness the replay does not cover, or a non-deterministic "
                               "kernel); use privacy.clipping_memory fast")
        if not bool(torch.isfinite(again.detach()).all()):
            raise RuntimeError("clipping_memory low/auto: a kept example's loss is not finite at a non-finite example's "
                               "place in the batch; use privacy.clipping_memory fast")
        return again


def _low_precision(records: list[LayerRecord], device: torch.device) -> bool:
    """Whether the step runs in less than float32 (autocast to a 16-bit type, or 16-bit trainable parameters): a second
    backward pass would then form the clipped sum in those products, rounded apart from the norms."""
    if torch.is_autocast_enabled(device.type) and torch.get_autocast_dtype(device.type) not in (torch.float32,
                                                                                                 torch.float64):
        return True
    return any(p.dtype not in (torch.float32, torch.float64) for rec in records for p in rec.params.values())


def _clipping_factors(norms: Tensor, max_norm: float, exclude: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """c_i = min(1, C / (||g_i|| + 1e-6)), and the examples to keep (None: all). An example whose gradient is not
    finite (NaN/inf input, overflow) or that is excluded contributes exactly zero: otherwise one record would turn
    the whole release into NaN (0 * inf = NaN), an event of unbounded privacy loss."""
    if math.isinf(max_norm):
        factors = torch.ones_like(norms)
    else:
        factors = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    finite = torch.isfinite(norms)
    if exclude is not None:
        finite = finite & ~exclude.to(device=finite.device, dtype=torch.bool)
    keep = None if bool(finite.all()) else finite
    if keep is not None:
        factors = torch.where(keep, factors, torch.zeros_like(factors))
    return factors, keep
