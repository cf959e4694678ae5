"""The stateful accountant: epsilon spent by a history of Poisson-subsampled Gaussian steps."""

from __future__ import annotations

from typing import Any

from dpl.core.accounting.common import _canonical, _check_delta, _check_method, _check_rate, _check_sigma, \
    _check_steps, logger
from dpl.core.accounting.prv import _epsilon


class PoissonGaussianAccountant:
    """Epsilon spent by a sequence of Poisson-subsampled Gaussian steps (sigma and q may change).

    ``history`` holds ``(noise_multiplier, sample_rate, num_steps)`` segments. ``epsilon(delta)`` is cached:
    repeated calls with an unchanged history are free. ``method="prv"`` falls back to RDP (one logged
    warning per accountant) where PRV fails or returns inf/nan.
    """

    def __init__(self, method: str = "prv") -> None:
        self.method = _check_method(method)
        self.history: list[tuple[float, float, int]] = []
        self._cache: dict[tuple, float] = {}
        self._last: tuple[tuple, float] | None = None  # ((method, history, delta), epsilon) of the last call
        self._warned = False

    def step(self, noise_multiplier: float, sample_rate: float, n: int = 1) -> None:
        """Record ``n`` steps with this noise multiplier and sample rate."""
        sigma, q, n = _check_sigma(noise_multiplier), _check_rate(sample_rate), _check_steps(n, "n")
        if n == 0:
            return
        if self.history and self.history[-1][:2] == (sigma, q):
            self.history[-1] = (sigma, q, self.history[-1][2] + n)
        else:
            self.history.append((sigma, q, n))

    @property
    def steps(self) -> int:
        """Total number of steps recorded."""
        return sum(n for _, _, n in self.history)

    def _fallback(self, msg: str) -> None:
        if not self._warned:
            self._warned = True
            logger.warning(msg)

    def epsilon(self, delta: float) -> float:
        """Epsilon spent so far at ``delta`` (PRV upper bound, or RDP)."""
        fast_key = (self.method, tuple(self.history), delta)
        if self._last is not None and self._last[0] == fast_key:
            return self._last[1]
        delta = _check_delta(delta)
        key = (self.method, _canonical(self.history), delta)
        if key not in self._cache:
            if len(self._cache) > 64:
                self._cache.clear()
            self._cache[key] = _epsilon(key[1], delta, self.method, None, on_fallback=self._fallback)
        self._last = (fast_key, self._cache[key])
        return self._last[1]

    def state_dict(self) -> dict[str, Any]:
        """Plain python types: ``{"method": str, "history": [[sigma, q, n], ...]}``."""
        return {"method": self.method, "history": [[float(s), float(q), int(n)] for s, q, n in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (replaces the current history)."""
        method = _check_method(state["method"])
        history = [(_check_sigma(s), _check_rate(q), _check_steps(n, "n")) for s, q, n in state["history"]]
        self.method, self.history, self._cache, self._last = method, history, {}, None

    def __len__(self) -> int:
        return len(self.history)

    def __repr__(self) -> str:
        return f"PoissonGaussianAccountant(method={self.method!r}, steps={self.steps}, segments={len(self.history)})"
