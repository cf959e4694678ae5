"""Streaming the correlated noise: one call per step turns the fresh i.i.d. draw z_t into w_t = (C^-1 Z)_t.

Every stream works on dicts of tensors (one per gradient key) and keeps only what its family needs:

* ``BandedStream`` (bands m): C w = z solved forward, w_t = (z_t - sum_{j=1}^{m-1} c_j w_{t-j}) / c_0; keeps the
  m - 1 last outputs: (m - 1) x d floats.
* ``BLTStream`` (nbuf buffers): with C = I + sum_j omega_j Toeplitz(0, 1, theta_j, theta_j^2, ...),
  w_t = z_t - sum_j omega_j buf_j, then buf_j <- theta_j buf_j + w_t (buf_j = sum_{s<t} theta_j^{t-1-s} w_s):
  nbuf x d floats.
* ``DenseKeepStream`` (nu_ftrl, ``memory: keep``): keeps every z_s, w_t = sum_s beta_{t-s} z_s: T x d floats.
* ``DenseRegenerateStream`` (nu_ftrl, ``memory: regenerate``): keeps the noise generator's state before each
  step's draw (a few KB per step, independent of d) and re-draws z_s to form the same sum: O(d) memory,
  O(t d) work at step t. Needs a replayable ``torch.Generator`` (not ``privacy.secure_noise``).

All their state is secret (derived from the noise): ``secret_state()`` / ``load_secret_state()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

Draw = Callable[[Any], dict[str, Tensor]]  # draw(source) -> {key: z}


def _to_cpu(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}  # a snapshot, not a view


class BandedStream:
    """Per key: ``push(key, z)`` (z is consumed: it becomes w_t and joins the history); ``end_step()`` after all
    keys. Memory: the bands - 1 last outputs."""

    in_place = False  # w is kept in the history: the caller must not modify it

    def __init__(self, c_band: np.ndarray) -> None:
        self.c = [float(x) for x in c_band]
        self.history: list[dict[str, Tensor]] = []  # newest first, at most len(c) - 1
        self._current: dict[str, Tensor] = {}

    def push(self, key: str, z: Tensor) -> Tensor:
        out = z
        for j, past in enumerate(self.history, start=1):
            prev = past[key]
            if prev.device != out.device:
                prev = past[key] = prev.to(out.device)
            out.sub_(prev, alpha=self.c[j])
        if self.c[0] != 1.0:
            out.div_(self.c[0])
        if len(self.c) > 1:
            self._current[key] = out
        return out

    def end_step(self) -> None:
        if len(self.c) > 1:
            self.history.insert(0, self._current)
            del self.history[len(self.c) - 1:]
        self._current = {}

    def memory_floats(self) -> int:
        return sum(t.numel() for h in self.history for t in h.values())

    def secret_state(self) -> dict[str, Any]:
        return {"history": [_to_cpu(h) for h in self.history]}

    def load_secret_state(self, state: dict[str, Any]) -> None:
        self.history = [dict(h) for h in state["history"]]


class BLTStream:
    """Per key: ``push(key, z)`` turns z into w_t in place and updates the key's nbuf buffers. Memory: nbuf x d."""

    in_place = True  # w is not kept: the caller may reuse its memory

    def __init__(self, omega: list[float], theta: list[float]) -> None:
        self.omega = [float(x) for x in omega]
        self.theta = [float(x) for x in theta]
        self.buffers: dict[str, Tensor] = {}  # key -> (nbuf, *shape)

    def push(self, key: str, z: Tensor) -> Tensor:
        buf = self.buffers.get(key)
        if buf is None:
            buf = self.buffers[key] = torch.zeros((len(self.omega), *z.shape), dtype=z.dtype, device=z.device)
        elif buf.device != z.device:
            buf = self.buffers[key] = buf.to(z.device)
        out = z
        for j, om in enumerate(self.omega):
            out.sub_(buf[j], alpha=om)
        for j, th in enumerate(self.theta):
            buf[j].mul_(th).add_(out)
        return out

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

    def record(self, generator: torch.Generator) -> None:
        self.states.append(generator.get_state())

    def push(self, z: dict[str, Tensor], draw: Draw, device: torch.device | str) -> dict[str, Tensor]:
        t = len(self.states) - 1
        w = {k: v.clone() for k, v in z.items()}
        replay = torch.Generator(device=device)
        for s in range(t):
            replay.set_state(self.states[s])
            past = draw(replay)
            for key, out in w.items():
                out.add_(past[key], alpha=self.beta[t - s])
        return w

    def memory_floats(self) -> int:
        return 0

    def secret_state(self) -> dict[str, Any]:
        return {"states": [s.clone() for s in self.states]}

    def load_secret_state(self, state: dict[str, Any]) -> None:
        self.states = list(state["states"])
