"""Group-wise clipping inside the one backward pass (``privacy.clipping: per_layer``).

Each group g of trainable parameters (a layer, or the layers whose names match one of ``privacy.clipping_groups``)
clips each example's (or privacy unit's) gradient on its own, to C_g with sum_g C_g^2 = C^2 (He et al., "Exploring
the limits of differentially private deep learning with group-wise clipping", ICLR 2023): the concatenation has norm
at most C, so the release, sigma and the accountant are flat clipping's at the same C. No norm of another group is
needed, so each layer's clipped sum is formed the moment its output gradient arrives in the backward pass (the taps
of :class:`~dpl.core.streaming.StreamingNorms`, activation checkpointing included) and its state dropped: no book,
no second backward pass. A group of several layers holds its layers' states until its last layer has arrived.

With adaptive thresholds the step also counts, per group, the units whose norm is within C_g, centred (sum_i (b_i -
1/2): a private value that only ``privatize`` reads (it releases it with noise: :func:`noisy_fractions`).
Norms and sums are float32 whatever the model's precision.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dpl.core.layer_gradients import LayerRecord, PreparedLayer, clipped_in_chunks, lean_prepare
from dpl.core.noise import NoiseSource, normal
from dpl.core.streaming import StreamingNorms, _Layer
from dpl.core.units import Grouping


class GroupClipping(StreamingNorms):
    """The clipped sums of one micro-batch, group by group, during its one backward pass.

    ``group_of``: the group index of each record (by ``id``); ``thresholds``: C_g per group (float32, on the device);
    ``exclude``: per unit, whether it contributes nothing (FSDP's fillers). After the backward pass: ``sums`` (per
    parameter name), ``sq_norms`` (each unit's squared norm over all groups, before clipping) and ``counts`` (per
    group, sum over the units kept of 1[norm <= C_g] - 1/2).
    """

    def __init__(self, device: torch.device, group_of: dict[int, int]) -> None:
        super().__init__(device, budget_bytes=None)
        self.group_of = group_of
        self.thresholds = torch.zeros(0)
        self.exclude: Tensor | None = None
        self.sums: dict[str, Tensor] = {}
        self.counts = torch.zeros(0)
        self._left: dict[int, int] = {}
        self._layers: dict[int, int] = {}  # each group's layers in this pass
        self._pending: dict[int, list[tuple[LayerRecord, PreparedLayer]]] = {}
        self._group_sq: dict[int, Tensor] = {}

    def start(self, rows: int, thresholds: Tensor, grouping: Grouping | None, exclude: Tensor | None) -> None:
        """Before the backward pass (the forward pass has tapped every layer that runs): the thresholds, and how
        many layers each group waits for."""
        self.thresholds = thresholds.to(device=self.sink.device, dtype=torch.float32)
        self.counts = torch.zeros(thresholds.numel(), dtype=torch.float32, device=self.sink.device)
        self.grouping = grouping
        self.sq_norms = torch.zeros(rows, dtype=torch.float32, device=self.sink.device)
        self.exclude = exclude
        self._left.clear()
        for rec, _ in self.layers.values():
            group = self.group_of[id(rec)]
            self._left[group] = self._left.get(group, 0) + 1
        self._layers = dict(self._left)
        self.listening = True

    def _account(self, rec: LayerRecord, layer: _Layer, inputs: list[Tensor], grads: list[Tensor],
                 book: int = 0) -> Tensor:
        view = LayerRecord(rec.module, rec.kind, rec.full_names, inputs)
        group = self.group_of[id(rec)]
        prepared = None
        if self._layers[group] == 1:  # clipped on its own: its factors are known chunk by chunk
            prepared = clipped_in_chunks(view, grads, self.grouping,
                                         lambda sq, start: self._factors(group, sq.sqrt(), start))
        if prepared is None:
            prepared = lean_prepare(view, grads, self._gram_cache(inputs), self.grouping)
        self._pending.setdefault(group, []).append((rec, prepared))
        sq = self._group_sq.get(group)
        self._group_sq[group] = prepared.sq_norms if sq is None else sq + prepared.sq_norms
        self._left[group] -= 1
        if self._left[group] == 0:
            self._clip(group)
        return prepared.sq_norms

    def _clip(self, group: int) -> None:
        """The group's clipping factors min(1, C_g / ||g_i^(g)||), its layers' weighted sums and its count (a group
        none of whose layers got a gradient: norms 0)."""
        norms = self._group_sq.pop(group, torch.zeros_like(self.sq_norms)).sqrt()
        factors, mask = self._factors(group, norms, 0)
        for rec, prepared in self._pending.pop(group, []):
            sums = prepared.sums if prepared.sums is not None else prepared.weighted_sum(factors, mask)
            for local, tensor in sums.items():
                self.sums[rec.full_names[local]] = tensor
        keep = torch.ones_like(norms, dtype=torch.bool) if mask is None else mask
        within = (norms <= self.thresholds[group]) & keep
        self.counts[group] = within.sum().float() - 0.5 * keep.sum().float()
        self._left[group] = -1  # clipped

    def _factors(self, group: int, norms: Tensor, start: int) -> tuple[Tensor, Tensor | None]:
        """The clipping factors min(1, C_g / ||g_i^(g)||) of the units from ``start`` on whose group norms are
        ``norms``, 0 for a unit not kept (a norm not finite, an excluded filler); and the units kept (None: all)."""
        keep = torch.isfinite(norms)
        if self.exclude is not None:
            keep = keep & ~self.exclude[start:start + norms.numel()]
        factors = torch.where(keep, (self.thresholds[group] / (norms + 1e-6)).clamp(max=1.0), torch.zeros_like(norms))
        return factors, None if bool(keep.all()) else keep

    def flush(self) -> None:
        """After the backward pass: the layers whose output gradient never came (unused) are dropped, and every group
        not clipped yet is clipped with what arrived."""
        super().flush()
        for group in range(self.thresholds.numel()):
            if self._left.get(group, 0) >= 0:
                self._clip(group)

    def finish(self) -> None:
        super().finish()
        self._pending.clear()
        self._group_sq.clear()


def noisy_fractions(counts: Tensor, count_std: float, expected_batch: float, source: NoiseSource) -> list[float]:
    """The released fraction of units within each group's threshold: (sum_i (b_i - 1/2) + N(0, count_std^2)) / B +
    1/2, the noise from the run's secret ``source`` (``privatize`` only; the counts are wiped after)."""
    noisy = counts.double()
    if count_std > 0:
        noisy = noisy + count_std * normal(tuple(counts.shape), source, counts.device, torch.float64)
    fractions = (noisy / expected_batch + 0.5).tolist()
    counts.zero_()
    return fractions
