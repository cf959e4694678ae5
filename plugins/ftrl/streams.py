"""Streaming the correlated noise: one call per step turns the fresh i.i.d. draw z_t into w_t = (C^-1 Z)_t.

Every stream works on dicts of tensors (one per gradient key) and keeps only what its family needs:

* ``BandedStream`` (bands m): C w = z solved forward, w_t = (z_t - sum_{j=1}^{m-1} c_j w_{t-j}) / c_0; keeps the
  m - 1 last outputs in a ring: (m - 1) x d floats.
* ``BLTStream`` (nbuf buffers): with C = I + sum_j omega_j Toeplitz(0, 1, theta_j, theta_j^2, ...),
  w_t = z_t - sum_j omega_j buf_j, then buf_j <- theta_j buf_j + w_t (buf_j = sum_{s<t} theta_j^{t-1-s} w_s):
  nbuf x d floats.

Banded and BLT are *fused*: the weighted sum over the stacked buffers is one ``addmm_`` and the buffer update
follows it chunk by chunk (``CHUNK`` columns on CPU), so each buffer is read from memory once and written once per
step instead of once per elementwise operation.
* ``DenseKeepStream`` (nu_ftrl, ``memory: keep``): keeps every z_s, w_t = sum_s beta_{t-s} z_s: T x d floats.
* ``DenseRegenerateStream`` (nu_ftrl, ``memory: regenerate``): keeps the noise generator's state before each
  step's draw (a few KB per step, independent of d) and re-draws z_s to form the same sum: O(d) memory,
  O(t d) work at step t. Needs a replayable noise source (not ``privacy.secure_noise``).

All their state is secret (derived from the noise): ``secret_state()`` / ``load_secret_state()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dpl.api import replay_source

Draw = Callable[[Any], dict[str, Tensor]]  # draw(source) -> {key: z}


def _to_cpu(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}  # a snapshot, not a view


CHUNK = 1 << 16  # columns per pass on CPU: a chunk of the stacked buffers stays in cache between its read and write
# (with 2^15, two threads split too little work in each operation)


def _fused(out: Tensor, stacked: Tensor, row: Tensor, after: Callable[[Tensor, Tensor], None]) -> None:
    """out += row @ stacked (stacked: (m, *out.shape)), then ``after(out_chunk, stacked_chunk)``, one chunk of
    columns at a time on CPU (each chunk of the m stacked buffers is read from memory once, updated in cache), the
    whole tensor at once elsewhere."""
    flat_out, flat = out.view(1, -1), stacked.view(stacked.shape[0], -1)
    width = CHUNK if out.device.type == "cpu" else flat_out.shape[1]
    for start in range(0, flat_out.shape[1], width):
        o, b = flat_out[:, start:start + width], flat[:, start:start + width]
        o.addmm_(row, b)
        after(o, b)


class _Coefficients:
    """A coefficient vector as a tensor of the noise's dtype and device (cached)."""

    def __init__(self, values: list[float], shape: tuple[int, ...]) -> None:
        self.values, self.shape = values, shape
        self._cache: dict[tuple[Any, Any], Tensor] = {}

    def on(self, like: Tensor) -> Tensor:
        key = (like.dtype, like.device)
        if key not in self._cache:
            self._cache[key] = torch.tensor(self.values, dtype=like.dtype, device=like.device).view(self.shape)
        return self._cache[key]


class BandedStream:
    """Per key: ``push(key, z)`` turns z into w_t in place and stores it in the key's ring of the bands - 1 last
    outputs (one fused pass over the stacked ring); ``end_step()`` after all keys. Memory: (bands - 1) x d."""

    in_place = True  # w is copied into the ring: the caller may reuse its memory

    def __init__(self, c_band: np.ndarray) -> None:
        self.c = [float(x) for x in c_band]
        self.rings: dict[str, Tensor] = {}  # key -> (bands - 1, *shape); w_s in slot s mod (bands - 1)
        self.t = 0  # index of the step being pushed

    def _row(self, like: Tensor) -> Tensor:
        m = len(self.c) - 1
        row = torch.zeros((1, m), dtype=like.dtype, device=like.device)
        for j in range(1, m + 1):
            row[0, (self.t - j) % m] = -self.c[j]  # slots not yet written hold zeros
        return row

    def push(self, key: str, z: Tensor) -> Tensor:
        m = len(self.c) - 1
        if m > 0:
            ring = self.rings.get(key)
            if ring is None:
                ring = self.rings[key] = torch.zeros((m, *z.shape), dtype=z.dtype, device=z.device)
            elif ring.device != z.device:
                ring = self.rings[key] = ring.to(z.device)
            slot = self.t % m  # the oldest output, w_{t - m}: read by this step's sum, then overwritten by w_t
            _fused(z, ring, self._row(z), lambda o, b: b[slot].copy_(o[0]))
        if self.c[0] != 1.0:
            z.div_(self.c[0])
            if m > 0:
                self.rings[key][self.t % m].div_(self.c[0])
        return z

    def end_step(self) -> None:
        self.t += 1

    def memory_floats(self) -> int:
        return sum(t.numel() for t in self.rings.values())

    def secret_state(self) -> dict[str, Any]:
        return {"rings": _to_cpu(self.rings), "t": self.t}

    def load_secret_state(self, state: dict[str, Any]) -> None:
        self.rings, self.t = dict(state["rings"]), int(state["t"])


class BLTStream:
    """Per key: ``push(key, z)`` turns z into w_t in place and updates the key's nbuf buffers, in one fused pass
    over the stacked buffers: w_t = z_t - omega . buf, then buf <- theta * buf + w_t. Memory: nbuf x d."""

    in_place = True  # w is not kept: the caller may reuse its memory

    def __init__(self, omega: list[float], theta: list[float]) -> None:
        self.omega = [float(x) for x in omega]
        self.theta = [float(x) for x in theta]
        self._neg_omega = _Coefficients([-x for x in self.omega], (1, len(self.omega)))
        self._theta = _Coefficients(self.theta, (len(self.theta), 1))
        self.buffers: dict[str, Tensor] = {}  # key -> (nbuf, *shape)

    def push(self, key: str, z: Tensor) -> Tensor:
        buf = self.buffers.get(key)
        if buf is None:
            buf = self.buffers[key] = torch.zeros((len(self.omega), *z.shape), dtype=z.dtype, device=z.device)
        elif buf.device != z.device:
            buf = self.buffers[key] = buf.to(z.device)
        theta = self._theta.on(z)
        _fused(z, buf, self._neg_omega.on(z), lambda o, b: torch.addcmul(o, b, theta, out=b))  # theta b + w
        return z

    def end_step(self) -> None:
        pass

    def memory_floats(self) -> int:
        return sum(t.numel() for t in self.buffers.values())

    def secret_state(self) -> dict[str, Any]:
        return {"buffers": _to_cpu(self.buffers)}

    def load_secret_state(self, state: dict[str, Any]) -> None:
        self.buffers = dict(state["buffers"] or {})


class DenseKeepStream:
    """Per key: ``push(key, z)`` keeps z and returns a new w_t = sum_s beta_{t-s} z_s. Memory: T x d."""

    in_place = True  # w is a fresh tensor

    def __init__(self, beta: np.ndarray) -> None:
        self.beta = [float(x) for x in beta]
        self.past: list[dict[str, Tensor]] = []
        self._current: dict[str, Tensor] = {}

    def push(self, key: str, z: Tensor) -> Tensor:
        self._current[key] = z
        t = len(self.past)
        out = z.clone()  # beta_0 = 1
        for s in range(t):
            prev = self.past[s][key]
            if prev.device != out.device:
                prev = self.past[s][key] = prev.to(out.device)
            out.add_(prev, alpha=self.beta[t - s])
        return out

    def end_step(self) -> None:
        self.past.append(self._current)
        self._current = {}

    def memory_floats(self) -> int:
        return sum(t.numel() for p in self.past for t in p.values())

    def secret_state(self) -> dict[str, Any]:
        return {"past": [_to_cpu(p) for p in self.past]}

    def load_secret_state(self, state: dict[str, Any]) -> None:
        self.past = [dict(p) for p in state["past"]]


class DenseRegenerateStream:
    """``push`` needs the generator state from before z_t was drawn (``record``) and a ``draw`` function that
    re-draws one step's z from a generator in the same order as the original draw."""

    def __init__(self, beta: np.ndarray) -> None:
        self.beta = [float(x) for x in beta]
        self.states: list[Tensor] = []

    def record(self, source: Any) -> None:
        self.source = source
        self.states.append(source.get_state())

    def push(self, z: dict[str, Tensor], draw: Draw) -> dict[str, Tensor]:
        t = len(self.states) - 1
        w = {k: v.clone() for k, v in z.items()}
        for s in range(t):
            past = draw(replay_source(self.source, self.states[s]))
            for key, out in w.items():
                out.add_(past[key], alpha=self.beta[t - s])
        return w

    def memory_floats(self) -> int:
        return 0

    def secret_state(self) -> dict[str, Any]:
        return {"states": [s.clone() for s in self.states]}

    def load_secret_state(self, state: dict[str, Any]) -> None:
        self.states = list(state["states"])
