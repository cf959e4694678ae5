"""What the accountants share: error settings, argument checks, the canonical form of a step history."""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

logger = logging.getLogger("dpl.core.accounting")

METHODS = ("prv", "rdp")
#: RDP orders of the "rdp" method: opacus' RDPAccountant defaults.
RDP_ORDERS: tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))
#: Relative PRV error: eps_error = REL_EPS_ERROR * (an upper bound on epsilon), at least MIN_EPS_ERROR.
REL_EPS_ERROR = 0.005
MIN_EPS_ERROR = 1e-3
#: delta_error = DELTA_ERROR_FRACTION * delta (prv-accountant's own choice).
DELTA_ERROR_FRACTION = 1e-3
#: Largest PRV grid; beyond it the mesh is coarsened (and eps_error grows accordingly).
MAX_GRID_POINTS = 2**21



class Segment(NamedTuple):
    """Consecutive steps run with one noise multiplier and sampling rate. A run has one segment; a run resumed with
    changed settings (``privacy.force_resume``) has one per part, composed by the accountant."""

    noise_multiplier: float
    sample_rate: float
    steps: int


_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        logger.warning(msg)

def _real(x: Any, name: str) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or math.isnan(float(x)):
        raise ValueError(f"{name} must be a real number, got {x!r}")
    return float(x)


def _check_sigma(x: Any, name: str = "noise_multiplier") -> float:
    x = _real(x, name)
    if not (0 <= x < math.inf):
        raise ValueError(f"{name} must be a finite number >= 0, got {x}")
    return x


def _check_rate(x: Any) -> float:
    x = _real(x, "sample_rate")
    if not 0 < x <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], got {x}")
    return x


def _check_steps(x: Any, name: str = "steps") -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        if isinstance(x, float) and x.is_integer():
            x = int(x)
        else:
            raise ValueError(f"{name} must be an integer >= 0, got {x!r}")
    if x < 0:
        raise ValueError(f"{name} must be >= 0, got {x}")
    return int(x)


def _check_delta(x: Any) -> float:
    x = _real(x, "delta")
    if not 0 < x < 1:
        raise ValueError(f"delta must be in (0, 1), got {x}")
    return x


def _check_epsilon(x: Any, name: str = "target_epsilon") -> float:
    x = _real(x, name)
    if not 0 < x < math.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {x}")
    return x


def _check_method(method: Any) -> str:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return method


def _check_eps_error(x: Any) -> float | None:
    if x is None:
        return None
    x = _real(x, "eps_error")
    if not 0 < x < math.inf:
        raise ValueError(f"eps_error must be a finite number > 0 or None, got {x}")
    return x


def _canonical(segments: Iterable[Sequence]) -> tuple[Segment, ...]:
    """Merge segments with the same (sigma, q) (composition is commutative); drop empty ones; sort."""
    merged: dict[tuple[float, float], int] = {}
    for s, q, n in segments:
        if n > 0:
            merged[(float(s), float(q))] = merged.get((float(s), float(q)), 0) + int(n)
    return tuple(sorted((s, q, n) for (s, q), n in merged.items()))
