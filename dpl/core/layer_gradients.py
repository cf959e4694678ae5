"""The per-layer formulas of per-example clipping (:mod:`dpl.core.per_example`): from one layer's recorded inputs and
output gradients, each example's (or privacy unit's) squared gradient norm and the clipping-factor-weighted sum of
the gradients, without materialising them where a product identity avoids it.

``prepare(record, grads, grams, grouping)`` dispatches on the layer's kind: ``linear`` (ghost norm through the Gram
matrices of inputs and output gradients, or the per-example gradients when cheaper), ``embedding`` (token-identity
masks, ``index_add``), ``layer_norm`` and ``rms_norm`` (closed forms), ``generic`` (``torch.func``: exact
per-example gradients of the module's own parameters). :class:`~dpl.core.units.Grouping` turns examples into privacy
units.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap

from dpl.core import clipping_policy as policy
from dpl.core.clipping_policy import per_example_path
from dpl.core.units import Grouping


@dataclass
class LayerRecord:
    """One module that owns trainable parameters, and what its forward hooks recorded in the current pass."""

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


def _rms_eps(module: nn.Module, dtype: torch.dtype) -> float:
    for attr in ("variance_epsilon", "eps"):
        value = getattr(module, attr, None)
        if isinstance(value, (int, float)):
            return float(value)
    return float(torch.finfo(dtype).eps)  # nn.RMSNorm with eps=None


def rms_normed(module: nn.Module, x: Tensor) -> Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + _rms_eps(module, x.dtype))


@dataclass
class PreparedLayer:
    """One layer's squared norms per example (or unit), and how to sum its gradients weighted by clipping factors."""

    sq_norms: Tensor
    weighted_sum: callable  # (factors, keep) -> sums; keep: None or a bool mask of the examples to include
    sums: dict[str, Tensor] | None = None  # the clipped sums, where they were formed with the norms (clipped_in_chunks)


def _zero_rows(t: Tensor, keep: Tensor | None) -> Tensor:
    """``t`` with the examples (dim 0) not in ``keep`` set to exactly zero (NaN/inf included)."""
    if keep is None:
        return t
    return torch.where(keep.view(-1, *([1] * (t.dim() - 1))), t, torch.zeros((), dtype=t.dtype, device=t.device))


def _as_3d(t: Tensor) -> Tensor:
    """(B, d) -> (B, 1, d); (B, *, d) -> (B, T, d)."""
    return t.unsqueeze(1) if t.dim() == 2 else t.reshape(t.shape[0], -1, t.shape[-1])


def _cat_steps(tensors: list[Tensor]) -> Tensor:
    """Concatenate the recorded calls of one module along the sequence axis (no copy for a single call), in their
    own precision: a float32 copy of every layer's activations and output gradients, held until the clipping
    factors are known, would double or triple the step's memory under bf16. The products upcast a layer at a time."""
    parts = [_as_3d(t) for t in tensors]
    if len({t.dtype for t in parts}) > 1:
        parts = [t.float() for t in parts]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _per_unit(rec: LayerRecord, grads: list[Tensor], grouping: Grouping | None) -> tuple[LayerRecord, list[Tensor]]:
    """The layer's recorded inputs and output gradients per unit (each unit's rows' tokens concatenated, padded to the
    widest unit); unchanged per example."""
    if grouping is None:
        return rec, grads
    return (LayerRecord(rec.module, rec.kind, rec.full_names, [grouping.tokens(x) for x in rec.inputs]),
            [grouping.tokens(g) for g in grads])


def _dims(rec: LayerRecord, grads: list[Tensor]) -> tuple[int, int, int, int]:
    """A linear or embedding layer's rows, positions over all its recorded calls, input and output widths."""
    steps = sum(_as_3d(g).shape[1] for g in grads)
    return grads[0].shape[0], steps, _as_3d(rec.inputs[0]).shape[-1], _as_3d(grads[0]).shape[-1]


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
        a = a.float()
        grams[key] = torch.bmm(a, a.transpose(1, 2))
    return grams[key]


def _prepare_linear(rec: LayerRecord, grads: list[Tensor], grams: dict[tuple, Tensor]) -> PreparedLayer:
    a = _cat_steps(rec.inputs)
    g = _cat_steps(grads)
    batch, steps, d_in = a.shape
    d_out = g.shape[-1]
    has_weight = "weight" in rec.full_names
    has_bias = "bias" in rec.full_names
    sq = torch.zeros(batch, dtype=torch.float32, device=a.device)
    per_example_weight = None
    if has_weight:
        if not per_example_path(steps, d_in, d_out):
            if steps == 1:
                sq = sq + (a.squeeze(1).float().pow(2).sum(1) * g.squeeze(1).float().pow(2).sum(1))
            else:
                gf = g.float()
                sq = sq + _batched_dot(_input_gram(a, rec.inputs, grams), torch.bmm(gf, gf.transpose(1, 2)))
                del gf
        elif d_out <= d_in:  # the narrower operand first, made contiguous: (B, small, T) x (B, T, large) is the
            # faster orientation on CPU (LoRA's A and B matrices)
            per_example_weight = torch.bmm(g.transpose(1, 2).float().contiguous(), a.float())  # (B, d_out, d_in)
            sq = sq + per_example_weight.pow(2).sum((1, 2))
        else:
            per_example_weight = torch.bmm(a.transpose(1, 2).float().contiguous(), g.float())  # (B, d_in, d_out)
            sq = sq + per_example_weight.pow(2).sum((1, 2))
    bias_grad = g.float().sum(1) if has_bias else None
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
            else:
                out["weight"] = _linear_weight_sum(a, g, factors)
        if has_bias:
            out["bias"] = factors @ bias_grad
        return out

    return PreparedLayer(sq, weighted_sum)


def _linear_weight_sum(a: Tensor, g: Tensor, factors: Tensor) -> Tensor:
    """sum_i c_i g_i^T a_i in float32, the smaller of the two operands scaled by the clipping factors."""
    d_in, d_out = a.shape[-1], g.shape[-1]
    if d_out <= d_in:
        gw = g.float() * factors[:, None, None]
        return gw.reshape(-1, d_out).t() @ a.reshape(-1, d_in).float()
    aw = a.float() * factors[:, None, None]
    return g.reshape(-1, d_out).float().t() @ aw.reshape(-1, d_in)


def _direct_sums(rec: LayerRecord, grads: list[Tensor], factors: Tensor, keep: Tensor | None) -> dict[str, Tensor]:
    """The clipped sum of a linear or embedding layer from its inputs and output gradients, no per-example gradient
    formed (:func:`lean_prepare`)."""
    if rec.kind == "embedding":
        return _prepare_embedding(rec, grads, {}, norms=False).weighted_sum(factors, keep)
    a, g = _zero_rows(_cat_steps(rec.inputs), keep), _zero_rows(_cat_steps(grads), keep)
    out = {}
    if "weight" in rec.full_names:
        out["weight"] = _linear_weight_sum(a, g, factors)
    if "bias" in rec.full_names:
        out["bias"] = factors @ g.float().sum(1)
    return out


def lean_prepare(rec: LayerRecord, grads: list[Tensor], grams: dict[tuple, Tensor],
                 grouping: Grouping | None) -> PreparedLayer:
    """As :func:`prepare`, holding less: a linear or embedding layer's norms a chunk of examples at a time
    (:func:`sq_norms`) and its weighted sum from its inputs and output gradients (group-wise clipping, where the
    factors are known as soon as the layer's norms are)."""
    if (rec.kind not in _PREPARE or _small_per_example_gradients(rec, grads, grouping)
            or (grouping is None and not _chunked(rec, grads))):
        return prepare(rec, grads, grams, grouping)  # norms in one chunk: their by-products (a bias's sums) reused
    sq = sq_norms(rec, grads, grams, grouping)
    rec, grads = _per_unit(rec, grads, grouping)
    return PreparedLayer(sq, lambda factors, keep=None: _direct_sums(rec, grads, factors, keep))


def clipped_in_chunks(rec: LayerRecord, grads: list[Tensor], grouping: Grouping | None,
                      factors_of: Callable[[Tensor, int], tuple[Tensor, Tensor | None]]) -> PreparedLayer | None:
    """A linear layer clipped on its own (a group of one layer) whose norm takes the per-example path in chunks: each
    chunk's per-example gradients are formed once, their squared norms (bias included) turned into the chunk's
    clipping factors by ``factors_of(sq, first_row)`` (factors, and the rows kept or None for all), and summed
    weighted at once: one product of the layer's size, where norms then a weighted sum take two (an LM head, long
    sequences). The returned layer's ``sums`` are the clipped sums. None where the layer is not on that path."""
    if rec.kind != "linear" or "weight" not in rec.full_names or not _chunked_per_example(rec, grads, grouping):
        return None
    rec, grads = _per_unit(rec, grads, grouping)
    a, g = _cat_steps(rec.inputs), _cat_steps(grads)
    rows, steps, d_in = a.shape
    d_out = g.shape[-1]
    chunk = policy.norm_chunk(policy.norm_temporary("linear", steps, d_in, d_out))
    narrow_out = d_out <= d_in  # the narrower operand first, as in _prepare_linear
    weight = torch.zeros(d_out * d_in, dtype=torch.float32, device=a.device)
    bias = torch.zeros(d_out, dtype=torch.float32, device=a.device) if "bias" in rec.full_names else None
    norms = []
    for start in range(0, rows, chunk):
        ac, gc = a[start:start + chunk].float(), g[start:start + chunk].float()
        per_example = (torch.bmm(gc.transpose(1, 2).contiguous(), ac) if narrow_out else
                       torch.bmm(ac.transpose(1, 2).contiguous(), gc))
        sq = per_example.pow(2).sum((1, 2))
        bias_part = gc.sum(1) if bias is not None else None
        if bias_part is not None:
            sq = sq + bias_part.pow(2).sum(1)
        factors, keep = factors_of(sq, start)
        weight += factors @ _zero_rows(per_example, keep).reshape(per_example.shape[0], -1)
        if bias_part is not None:
            bias += factors @ _zero_rows(bias_part, keep)
        norms.append(sq)
        del per_example
    sums = {"weight": weight.view(d_out, d_in) if narrow_out else weight.view(d_in, d_out).t().contiguous()}
    if bias is not None:
        sums["bias"] = bias
    return PreparedLayer(torch.cat(norms), _formed_already, sums=sums)


def _formed_already(factors: Tensor, keep: Tensor | None = None) -> dict[str, Tensor]:
    """The weighted sum of a layer whose clipped sums were formed with its norms (read ``sums``)."""
    raise RuntimeError("this layer's clipped sums were formed with its norms: read PreparedLayer.sums")


def _chunked_per_example(rec: LayerRecord, grads: list[Tensor], grouping: Grouping | None) -> bool:
    """Whether :func:`lean_prepare` would take a linear layer's norms from per-example gradients formed a chunk at a
    time and its weighted sum from a second product (not formed once for the whole batch)."""
    _, steps, d_in, d_out = _dims(rec, grads)
    if grouping is not None:  # a unit's tokens are all its rows' (padded to the widest unit)
        steps = steps * int(grouping.index.shape[1])
    return per_example_path(steps, d_in, d_out) and not _small_per_example_gradients(rec, grads, grouping)


def _small_per_example_gradients(rec: LayerRecord, grads: list[Tensor], grouping: Grouping | None) -> bool:
    """Whether a linear layer's per-example weight gradients are its cheaper norm path and, for the whole batch, no
    larger than its recorded input and output gradient and one norm chunk: then they are formed once and reused for
    the weighted sum (LoRA's matrices, long sequences), instead of a second product of the layer's size. Per example
    only (units concatenate their rows' tokens: the chunked path)."""
    if rec.kind != "linear" or "weight" not in rec.full_names or grouping is not None:
        return False
    rows, steps, d_in, d_out = _dims(rec, grads)
    return per_example_path(steps, d_in, d_out) and rows * d_in * d_out <= policy.NORM_CHUNK


def _chunked(rec: LayerRecord, grads: list[Tensor]) -> bool:
    """Whether :func:`sq_norms` takes a linear or embedding layer's per-example norms in more than one chunk."""
    rows, steps, d_in, d_out = _dims(rec, grads)
    return policy.norm_chunk(policy.norm_temporary(rec.kind, steps, d_in, d_out)) < rows


def _prepare_embedding(rec: LayerRecord, grads: list[Tensor], grams: dict[tuple, Tensor],
                       norms: bool = True) -> PreparedLayer:
    module: nn.Embedding = rec.module
    ids = [x.reshape(x.shape[0], -1) for x in rec.inputs]
    ids = ids[0] if len(ids) == 1 else torch.cat(ids, dim=1)
    g = _cat_steps(grads).float()
    if module.padding_idx is not None:
        g = g * (ids != module.padding_idx).unsqueeze(-1)
    sq = None
    if norms:
        same = (ids.unsqueeze(2) == ids.unsqueeze(1)).float()
        sq = _batched_dot(same, torch.bmm(g, g.transpose(1, 2)))

    def weighted_sum(factors: Tensor, keep: Tensor | None = None) -> dict[str, Tensor]:
        weight = rec.params["weight"]
        out = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        out.index_add_(0, ids.reshape(-1), (_zero_rows(g, keep) * factors[:, None, None]).reshape(-1, g.shape[-1]))
        return {"weight": out}

    return PreparedLayer(sq, weighted_sum)


def _layer_norm_per_example(rec: LayerRecord, grads: list[Tensor]) -> dict[str, Tensor]:
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


def _per_example_prepared(per_example: dict[str, Tensor]) -> PreparedLayer:
    """Norms and weighted sums from materialised per-example gradients (small parameters only)."""
    sq = sum(t.reshape(t.shape[0], -1).pow(2).sum(1) for t in per_example.values())

    def weighted_sum(factors: Tensor, keep: Tensor | None = None) -> dict[str, Tensor]:
        return {n: torch.tensordot(factors, _zero_rows(t, keep), dims=1) for n, t in per_example.items()}

    return PreparedLayer(sq, weighted_sum)


def _rms_norm_per_example(rec: LayerRecord, grads: list[Tensor]) -> dict[str, Tensor]:
    """RMSNorm weight: per example, sum over positions of g * x / rms(x) (no parameter value needed)."""
    per_example = None
    for x, g in zip(rec.inputs, grads):
        t = g.float() * rms_normed(rec.module, x)
        t = t.reshape(t.shape[0], -1, t.shape[-1]).sum(1)
        per_example = t if per_example is None else per_example + t
    return {"weight": per_example}


def exact_per_example(module: nn.Module, params: dict[str, Tensor], inputs: list[Tensor],
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


def _generic(rec: LayerRecord, grads: list[Tensor]) -> dict[str, Tensor]:
    params = {n: p.detach() for n, p in rec.params.items()}
    return exact_per_example(rec.module, params, rec.inputs, grads)


#: kinds whose per-token contributions add up (a unit is one example made of all its rows' tokens)
_PREPARE = {"linear": _prepare_linear, "embedding": _prepare_embedding}
#: kinds computed as materialised per-example gradients (a unit's is the sum of its rows')
_PER_EXAMPLE = {"layer_norm": _layer_norm_per_example, "rms_norm": _rms_norm_per_example, "generic": _generic}


def sq_norms(rec: LayerRecord, grads: list[Tensor], grams: dict[tuple, Tensor],
             grouping: Grouping | None) -> Tensor:
    """The per-example (or per-unit) squared norms of one module's gradient alone, a chunk of examples at a time so
    that a Gram matrix (T x T) or a per-example weight gradient (d_out x d_in) of the whole batch never exists at
    once: at most about :data:`~dpl.core.clipping_policy.NORM_CHUNK` elements per chunk (one example at least)."""
    if rec.kind not in _PREPARE:
        return prepare(rec, grads, grams, grouping).sq_norms
    rec, grads = _per_unit(rec, grads, grouping)
    rows, steps, d_in, d_out = _dims(rec, grads)
    chunk = policy.norm_chunk(policy.norm_temporary(rec.kind, steps, d_in, d_out))
    if chunk >= rows:
        return _PREPARE[rec.kind](rec, grads, grams).sq_norms
    parts = []
    for start in range(0, rows, chunk):
        part = LayerRecord(rec.module, rec.kind, rec.full_names, [x[start:start + chunk] for x in rec.inputs])
        parts.append(_PREPARE[rec.kind](part, [g[start:start + chunk] for g in grads], {}).sq_norms)
    return torch.cat(parts)


def per_example_gradients(rec: LayerRecord, grads: list[Tensor], grouping: Grouping | None) -> dict[str, Tensor]:
    """The materialised float32 per-example (or per-unit) gradients of one module's parameters (not embeddings)."""
    if rec.kind in _PER_EXAMPLE:
        per_example = _PER_EXAMPLE[rec.kind](rec, grads)
        return per_example if grouping is None else {n: grouping.sum(t) for n, t in per_example.items()}
    if rec.kind != "linear":
        raise ValueError(f"no materialised per-example gradients for kind {rec.kind!r}")
    rec, grads = _per_unit(rec, grads, grouping)
    a, g = _cat_steps(rec.inputs).float(), _cat_steps(grads).float()
    out = {}
    if "weight" in rec.full_names:
        out["weight"] = torch.bmm(g.transpose(1, 2), a)  # (B, d_out, d_in)
    if "bias" in rec.full_names:
        out["bias"] = g.sum(1)
    return out


def prepare(rec: LayerRecord, grads: list[Tensor], grams: dict[tuple, Tensor],
            grouping: Grouping | None) -> PreparedLayer:
    """Norms and the weighted sum of one module's parameters, per example or (``grouping``) per unit."""
    if rec.kind in _PER_EXAMPLE:
        per_example = _PER_EXAMPLE[rec.kind](rec, grads)
        if grouping is not None:
            per_example = {n: grouping.sum(t) for n, t in per_example.items()}
        return _per_example_prepared(per_example)
    rec, grads = _per_unit(rec, grads, grouping)
    return _PREPARE[rec.kind](rec, grads, grams)

