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
* anything else (RMSNorm, ...): exact per-example gradients of that module's own parameters with
  ``torch.func`` (vmap of a vjp through ``functional_call``), given the recorded input and output gradient.
  The module's forward must take a single tensor.

Inputs whose batch dimension is 1 while the batch has more examples (BERT's position ids) are expanded to
the batch first, so that each example's gradient stays separate. A parameter shared by two modules (tied
embeddings) is refused: its per-example gradient would need cross terms.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap

from dpl.errors import ConfigError


@dataclass
class _Record:
    module: nn.Module
    kind: str  # "linear" | "embedding" | "layer_norm" | "generic"
    full_names: dict[str, str]  # local name -> name in the model (trainable parameters only)
    inputs: list[Tensor] = field(default_factory=list)
    outputs: list[Tensor] = field(default_factory=list)

    @property
    def params(self) -> dict[str, nn.Parameter]:
        """Local name -> the module's current parameter object (read on use: FSDP replaces parameters with
        sharded ones after the clipper is built; shapes are the full ones either way)."""
        return {local: getattr(self.module, local) for local in self.full_names}


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


def _rms_eps(module: nn.Module, dtype: torch.dtype) -> float:
    for attr in ("variance_epsilon", "eps"):
        value = getattr(module, attr, None)
        if isinstance(value, (int, float)):
            return float(value)
    return float(torch.finfo(dtype).eps)  # nn.RMSNorm with eps=None


def _rms_normed(module: nn.Module, x: Tensor) -> Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + _rms_eps(module, x.dtype))


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
    gen = torch.Generator(device=weight.device).manual_seed(0)
    x = torch.randn(2, 3, weight.numel(), generator=gen, device=weight.device, dtype=weight.dtype)
    g = torch.randn(2, 3, weight.numel(), generator=gen, device=weight.device, dtype=weight.dtype)
    try:
        exact = _generic_per_example(module, {"weight": weight.detach()}, [x], [g])["weight"]
    except Exception:  # noqa: BLE001 - a forward that does not fit the check: use the exact path
        return False
    closed = (g.float() * _rms_normed(module, x)).sum(1)
    return bool(torch.allclose(closed, exact, rtol=1e-4, atol=1e-5))


class PerExampleClipper:
    """Computes the clipped sum of per-example gradients of ``model``'s trainable parameters.

    Usage::

        clipper = PerExampleClipper(model)
        with clipper.record(batch_size):
            losses = per_example_loss(model, batch)  # shape (batch_size,)
        sums, norms = clipper.clipped_sum(losses, max_norm)

    ``sums`` maps each trainable parameter's name to the float32 sum of the clipped per-example gradients;
    ``norms`` holds the per-example gradient norms before clipping (private: never release them).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.records: list[_Record] = []
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
            self.records.append(_Record(module, _kind(module), full_names))
        self._batch_size = 0
        self._recording = False
        self._handles = []
        for rec in self.records:
            self._handles.append(rec.module.register_forward_pre_hook(self._make_pre_hook(rec)))
            self._handles.append(rec.module.register_forward_hook(self._make_hook(rec)))
        self.parameter_names: list[str] = [n for rec in self.records for n in rec.full_names.values()]

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

    def _make_pre_hook(self, rec: _Record):
        def pre_hook(module, args):
            if not self._recording or not args or not torch.is_tensor(args[0]):
                return None
            x = args[0]
            if x.dim() > 0 and x.shape[0] == 1 and self._batch_size > 1:
                return (x.expand(self._batch_size, *x.shape[1:]), *args[1:])
            return None
        return pre_hook

    def _make_hook(self, rec: _Record):
        def hook(module, args, output):
            if not self._recording:
                return None
            if len(args) != 1 or not torch.is_tensor(args[0]) or not torch.is_tensor(output):
                raise ConfigError(f"cannot compute per-example gradients for {type(module).__name__}: its forward "
                                  "must take one tensor and return one tensor; freeze its parameters")
            if output.shape[0] != self._batch_size:
                raise ConfigError(f"{type(module).__name__} output has leading dimension {output.shape[0]}, "
                                  f"expected the batch size {self._batch_size}")
            rec.inputs.append(args[0].detach())
            rec.outputs.append(output)
            return None
        return hook

    @contextmanager
    def record(self, batch_size: int) -> Iterator[None]:
        """Record layer inputs and outputs during a forward pass over ``batch_size`` examples."""
        self._clear()
        self._batch_size = batch_size
        self._recording = True
        try:
            yield
        finally:
            self._recording = False

    def _clear(self) -> None:
        for rec in self.records:
            rec.inputs.clear()
            rec.outputs.clear()

    def zero_sums(self) -> dict[str, Tensor]:
        return {full: torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                for rec in self.records for local, p in rec.params.items()
                for full in [rec.full_names[local]]}

    def clipped_sum(self, losses: Tensor, max_norm: float, exclude: Tensor | None = None,
                    units: Tensor | None = None) -> tuple[dict[str, Tensor], Tensor]:
        """Clip each example's gradient of ``losses[i]`` to ``max_norm`` and sum over the batch; examples flagged
        in ``exclude`` (bool per example: FSDP's fillers) contribute exactly zero.

        ``units`` (the privacy unit of every example, the examples of a unit contiguous): the gradient of each unit
        (the sum of its examples' gradients of ``losses``) is clipped as one, and ``norms`` are per unit. Linear and
        embedding layers treat a unit as one example whose tokens are all its rows' tokens (the ghost-norm and
        direct paths as for one example); the others sum their per-example gradients by unit."""
        if losses.dim() != 1 or losses.shape[0] != self._batch_size:
            raise ValueError(f"expected per-example losses of shape ({self._batch_size},), got {tuple(losses.shape)}")
        # Under mixed precision (bf16-mixed) autocast would run the norms' and sums' products in bfloat16, with
        # separate roundings for the norm and for the summed gradient: an example could then add more than
        # max_norm. Both are computed in float32 from the recorded activations and output gradients.
        with torch.autocast(device_type=losses.device.type, enabled=False):
            return self._clipped_sum(losses, max_norm, exclude, units)

    def _clipped_sum(self, losses: Tensor, max_norm: float, exclude: Tensor | None,
                     units: Tensor | None = None) -> tuple[dict[str, Tensor], Tensor]:
        active = [rec for rec in self.records if rec.outputs]
        outputs = [out for rec in active for out in rec.outputs]
        grads = torch.autograd.grad(losses.sum(), outputs, allow_unused=True) if outputs else []
        it = iter(grads)
        grads_per_rec = [[g if g is not None else torch.zeros_like(o) for g, o in zip(
            [next(it) for _ in rec.outputs], rec.outputs)] for rec in active]
        grouping = None if units is None else _Grouping(units.to(losses.device))
        count = self._batch_size if grouping is None else grouping.count
        sq_norms = torch.zeros(count, dtype=torch.float32, device=losses.device)
        prepared = []
        grams: dict[tuple, Tensor] = {}  # Gram matrices of layer inputs shared by several layers (Q, K, V)
        for rec, gs in zip(active, grads_per_rec):
            state = _prepare(rec, gs, grams, grouping)
            sq_norms += state.sq_norms
            prepared.append((rec, state))
        if grouping is not None and exclude is not None:
            exclude = grouping.all_rows(exclude.to(device=losses.device, dtype=torch.bool))
        norms = sq_norms.sqrt()
        if math.isinf(max_norm):
            factors = torch.ones_like(norms)
        else:
            factors = (max_norm / (norms + 1e-6)).clamp(max=1.0)
        # An example whose gradient is not finite (NaN/inf input, overflow) contributes exactly zero: otherwise
        # one record would turn the whole release into NaN (0 * inf = NaN), an event of unbounded privacy loss.
        finite = torch.isfinite(norms)
        if exclude is not None:
            finite = finite & ~exclude.to(device=finite.device, dtype=torch.bool)
        keep = None if bool(finite.all()) else finite
        if keep is not None:
            factors = torch.where(keep, factors, torch.zeros_like(factors))
        sums = {}
        for rec, state in prepared:
            for local, tensor in state.weighted_sum(factors, keep).items():
                sums[rec.full_names[local]] = tensor
        self._clear()
        if len(sums) < len(self.parameter_names):  # modules unused in this forward pass contribute zeros
            for rec in self.records:
                for local, p in rec.params.items():
                    if rec.full_names[local] not in sums:
                        sums[rec.full_names[local]] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        return sums, norms


@dataclass
class _Prepared:
    sq_norms: Tensor
    weighted_sum: callable  # (factors, keep) -> sums; keep: None or a bool mask of the examples to include


def _zero_rows(t: Tensor, keep: Tensor | None) -> Tensor:
    """``t`` with the examples (dim 0) not in ``keep`` set to exactly zero (NaN/inf included)."""
    if keep is None:
        return t
    return torch.where(keep.view(-1, *([1] * (t.dim() - 1))), t, torch.zeros((), dtype=t.dtype, device=t.device))


def _as_3d(t: Tensor) -> Tensor:
    """(B, d) -> (B, 1, d); (B, *, d) -> (B, T, d)."""
    return t.unsqueeze(1) if t.dim() == 2 else t.reshape(t.shape[0], -1, t.shape[-1])


def _cat_steps(tensors: list[Tensor]) -> Tensor:
    """Concatenate the recorded calls of one module along the sequence axis (no copy for a single call)."""
    parts = [_as_3d(t).float() for t in tensors]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _batched_dot(x: Tensor, y: Tensor) -> Tensor:
    """Per-example <x_b, y_b> over all other dimensions, a few examples at a time (temporaries of at most
    ``_DOT_CHUNK`` elements). An elementwise product and sum: torch's CPU ``bmm`` of (B, 1, n) by (B, n, 1) runs far
    below its speed for the (B, T, T) Gram matrices of ghost norms."""
    b = x.shape[0]
    x, y = x.reshape(b, -1), y.reshape(b, -1)
    rows = max(1, _DOT_CHUNK // max(1, x.shape[1]))
    if rows >= b:
        return (x * y).sum(1)
    return torch.cat([(x[i:i + rows] * y[i:i + rows]).sum(1) for i in range(0, b, rows)])


_DOT_CHUNK = 1 << 21  # elements of one temporary of _batched_dot (8 MiB in float32)


def _input_gram(a: Tensor, source: list[Tensor], grams: dict[tuple, Tensor]) -> Tensor:
    """a a^T per example, computed once per distinct input tensor."""
    key = tuple((t.data_ptr(), tuple(t.shape), t.stride()) for t in source)
    if key not in grams:
        grams[key] = torch.bmm(a, a.transpose(1, 2))
    return grams[key]


def _prepare_linear(rec: _Record, grads: list[Tensor], grams: dict[tuple, Tensor]) -> _Prepared:
    a = _cat_steps(rec.inputs)
    g = _cat_steps(grads)
    batch, steps, d_in = a.shape
    d_out = g.shape[-1]
    has_weight = "weight" in rec.full_names
    has_bias = "bias" in rec.full_names
    sq = torch.zeros(batch, dtype=torch.float32, device=a.device)
    per_example_weight = None
    if has_weight:
        if steps * steps * (d_in + d_out) < d_in * d_out * steps or steps == 1:
            if steps == 1:
                sq = sq + (a.squeeze(1).pow(2).sum(1) * g.squeeze(1).pow(2).sum(1))
            else:
                sq = sq + _batched_dot(_input_gram(a, rec.inputs, grams), torch.bmm(g, g.transpose(1, 2)))
        elif d_out <= d_in:  # the narrower operand first, made contiguous: (B, small, T) x (B, T, large) is the
            # faster orientation on CPU (LoRA's A and B matrices)
            per_example_weight = torch.bmm(g.transpose(1, 2).contiguous(), a)  # (B, d_out, d_in)
            sq = sq + per_example_weight.pow(2).sum((1, 2))
        else:
            per_example_weight = torch.bmm(a.transpose(1, 2).contiguous(), g)  # (B, d_in, d_out): transposed
            sq = sq + per_example_weight.pow(2).sum((1, 2))
    bias_grad = g.sum(1) if has_bias else None
    if has_bias:
        sq = sq + bias_grad.pow(2).sum(1)

    def weighted_sum(factors: Tensor, keep: Tensor | None = None) -> dict[str, Tensor]:
        nonlocal a, g, per_example_weight, bias_grad
        if keep is not None:
            a, g = _zero_rows(a, keep), _zero_rows(g, keep)
            per_example_weight = None if per_example_weight is None else _zero_rows(per_example_weight, keep)
            bias_grad = None if bias_grad is None else _zero_rows(bias_grad, keep)
        out = {}
        if has_weight:
            if per_example_weight is not None:  # one (1, B) x (B, d_out * d_in) product
                summed = (factors @ per_example_weight.reshape(batch, -1)).view(per_example_weight.shape[1:])
                out["weight"] = summed if d_out <= d_in else summed.t().contiguous()
            elif d_out <= d_in:  # scale the smaller of the two operands by the clipping factors
                gw = g * factors[:, None, None]
                out["weight"] = gw.reshape(-1, d_out).t() @ a.reshape(-1, d_in)
            else:
                aw = a * factors[:, None, None]
                out["weight"] = g.reshape(-1, d_out).t() @ aw.reshape(-1, d_in)
        if has_bias:
            out["bias"] = factors @ bias_grad
        return out

    return _Prepared(sq, weighted_sum)


def _prepare_embedding(rec: _Record, grads: list[Tensor], grams: dict[tuple, Tensor]) -> _Prepared:
    module: nn.Embedding = rec.module
    ids = [x.reshape(x.shape[0], -1) for x in rec.inputs]
    ids = ids[0] if len(ids) == 1 else torch.cat(ids, dim=1)
    g = _cat_steps(grads)
    if module.padding_idx is not None:
        g = g * (ids != module.padding_idx).unsqueeze(-1)
    same = (ids.unsqueeze(2) == ids.unsqueeze(1)).float()
    sq = _batched_dot(same, torch.bmm(g, g.transpose(1, 2)))

    def weighted_sum(factors: Tensor, keep: Tensor | None = None) -> dict[str, Tensor]:
        weight = rec.params["weight"]
        out = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        out.index_add_(0, ids.reshape(-1), (_zero_rows(g, keep) * factors[:, None, None]).reshape(-1, g.shape[-1]))
        return {"weight": out}

    return _Prepared(sq, weighted_sum)


def _layer_norm_per_example(rec: _Record, grads: list[Tensor]) -> dict[str, Tensor]:
    module: nn.LayerNorm = rec.module
    per_example: dict[str, Tensor] = {}
    for x, g in zip(rec.inputs, grads):
        x, g = x.float(), g.float()
        batch_dims = tuple(range(1, x.dim() - len(module.normalized_shape)))
        parts = {}
        if "weight" in rec.full_names:
            # with a unit weight and a zero bias: the same x_hat, and torch's affine kernel is faster on the CPU
            ones = torch.ones(module.normalized_shape, dtype=x.dtype, device=x.device)
            normed = torch.nn.functional.layer_norm(x, module.normalized_shape, ones, torch.zeros_like(ones),
                                                    eps=module.eps)
            parts["weight"] = (g * normed).sum(batch_dims) if batch_dims else g * normed
        if "bias" in rec.full_names:
            parts["bias"] = g.sum(batch_dims) if batch_dims else g
        for name, t in parts.items():
            per_example[name] = per_example[name] + t if name in per_example else t
    return per_example


def _per_example_prepared(per_example: dict[str, Tensor]) -> _Prepared:
    """Norms and weighted sums from materialised per-example gradients (small parameters only)."""
    sq = sum(t.reshape(t.shape[0], -1).pow(2).sum(1) for t in per_example.values())

    def weighted_sum(factors: Tensor, keep: Tensor | None = None) -> dict[str, Tensor]:
        return {n: torch.tensordot(factors, _zero_rows(t, keep), dims=1) for n, t in per_example.items()}

    return _Prepared(sq, weighted_sum)


def _rms_norm_per_example(rec: _Record, grads: list[Tensor]) -> dict[str, Tensor]:
    """RMSNorm weight: per example, sum over positions of g * x / rms(x) (no parameter value needed)."""
    per_example = None
    for x, g in zip(rec.inputs, grads):
        t = g.float() * _rms_normed(rec.module, x)
        t = t.reshape(t.shape[0], -1, t.shape[-1]).sum(1)
        per_example = t if per_example is None else per_example + t
    return {"weight": per_example}


def _generic_per_example(module: nn.Module, params: dict[str, Tensor], inputs: list[Tensor],
                         grads: list[Tensor]) -> dict[str, Tensor]:
    """Exact per-example gradients of ``module``'s ``params`` (vmap of a vjp), summed over its recorded calls."""

    def one_example(x: Tensor, g: Tensor) -> dict[str, Tensor]:
        def f(p):
            return functional_call(module, p, (x.unsqueeze(0),)).squeeze(0)
        _, pullback = vjp(f, params)
        return pullback(g)[0]

    per_example: dict[str, Tensor] = {}
    for x, g in zip(inputs, grads):
        result = vmap(one_example)(x, g.to(x.dtype) if x.is_floating_point() else g)
        for name, t in result.items():
            t = t.float()
            per_example[name] = per_example[name] + t if name in per_example else t
    return per_example


def _generic(rec: _Record, grads: list[Tensor]) -> dict[str, Tensor]:
    params = {n: p.detach() for n, p in rec.params.items()}
    return _generic_per_example(rec.module, params, rec.inputs, grads)


#: kinds whose per-token contributions add up (a unit is one example made of all its rows' tokens)
_PREPARE = {"linear": _prepare_linear, "embedding": _prepare_embedding}
#: kinds computed as materialised per-example gradients (a unit's is the sum of its rows')
_PER_EXAMPLE = {"layer_norm": _layer_norm_per_example, "rms_norm": _rms_norm_per_example, "generic": _generic}


def _prepare(rec: _Record, grads: list[Tensor], grams: dict[tuple, Tensor], grouping: _Grouping | None) -> _Prepared:
    """Norms and the weighted sum of one module's parameters, per example or (``grouping``) per unit."""
    if rec.kind in _PER_EXAMPLE:
        per_example = _PER_EXAMPLE[rec.kind](rec, grads)
        if grouping is not None:
            per_example = {n: grouping.sum(t) for n, t in per_example.items()}
        return _per_example_prepared(per_example)
    if grouping is not None:
        rec = _Record(rec.module, rec.kind, rec.full_names, [grouping.tokens(x) for x in rec.inputs])
        grads = [grouping.tokens(g) for g in grads]
    return _PREPARE[rec.kind](rec, grads, grams)


class _Grouping:
    """The units of a batch (``units``: unit id per example, a unit's examples contiguous): per-unit sums of
    per-example tensors, and per-unit token sequences made of all the unit's examples' tokens."""

    def __init__(self, units: Tensor) -> None:
        _, self.inverse, counts = torch.unique_consecutive(units, return_inverse=True, return_counts=True)
        self.count, self.rows = int(counts.numel()), int(units.numel())
        if self.count != int(torch.unique(units).numel()):
            raise ValueError("the rows of a privacy unit must be contiguous in the batch")
        widest = int(counts.max()) if self.count else 0
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(widest, device=units.device)
        index = starts[:, None] + slot[None, :]  # (units, widest): rows of each unit, then padding (= rows)
        self.index = torch.where(slot[None, :] < counts[:, None], index, torch.full_like(index, self.rows))
        self._tokens: dict[tuple, Tensor] = {}

    def sum(self, t: Tensor) -> Tensor:
        """(examples, ...) -> (units, ...): the sum over each unit's examples."""
        out = torch.zeros((self.count, *t.shape[1:]), dtype=t.dtype, device=t.device)
        return out.index_add_(0, self.inverse.to(t.device), t)

    def all_rows(self, flags: Tensor) -> Tensor:
        """Per unit: whether every example of it is flagged."""
        return self.sum((~flags).to(torch.int64)) == 0

    def tokens(self, t: Tensor) -> Tensor:
        """(examples, [positions,] ...) -> (units, widest * positions, ...): each unit's examples concatenated
        along the positions, padded with zeros (which add nothing to a gradient); computed once per tensor."""
        key = (t.data_ptr(), tuple(t.shape), t.stride())
        if key not in self._tokens:
            x = t.unsqueeze(1) if t.dim() == 2 and t.is_floating_point() else t  # (B, d) -> (B, 1, d)
            padded = torch.cat([x, x.new_zeros((1, *x.shape[1:]))])
            grouped = padded[self.index.to(t.device)]  # (units, widest, positions, ...)
            self._tokens[key] = grouped.reshape(self.count, -1, *x.shape[2:])
        return self._tokens[key]
