"""The two gradient objects that travel through the private step.

:class:`GradientSum` is the clipped sum of a logical batch: sensitive. Only ``privatize`` may read it, and
dpl wipes it right after (``wipe()``), so any later read raises :class:`~dpl.errors.PrivacyViolation`.
:class:`PrivateGradient` is the released, noised gradient with its metadata; every later hook reads only it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from dpl.errors import PrivacyViolation


class GradientSum:
    """Sum over the examples of a logical batch of per-example contributions of norm <= C.

    ``values`` maps a key (a parameter name for backprop estimators; any key an estimator chooses, e.g. one
    scalar for DPZero) to a tensor. ``count`` is the number of examples summed: private, never logged.
    """

    def __init__(self, values: dict[str, Tensor], count: int) -> None:
        self._values: dict[str, Tensor] | None = values
        self._count = count

    @property
    def values(self) -> dict[str, Tensor]:
        if self._values is None:
            raise PrivacyViolation("the clipped gradient sum was read after privatize; only privatize may read it")
        return self._values

    @property
    def count(self) -> int:
        self.values  # noqa: B018 - same guard
        return self._count

    def add_(self, other: GradientSum) -> GradientSum:
        """Add another micro-batch's sum in place (keys must match)."""
        mine, theirs = self.values, other.values
        if mine.keys() != theirs.keys():
            raise ValueError("cannot add gradient sums over different parameters")
        for key, tensor in theirs.items():
            mine[key].add_(tensor)
        self._count += other.count
        return self

    def set_count(self, count: int) -> None:
        """Replace the example count (multi-process training: the all-reduced global count)."""
        self.values  # noqa: B018 - same guard
        self._count = int(count)

    def wipe(self) -> None:
        """Drop the tensors; any later access raises."""
        self._values = None

    @property
    def wiped(self) -> bool:
        return self._values is None


@dataclass
class PrivateGradient:
    """A DP release: the noised gradient of one logical batch, divided by the expected batch size.

    Attributes:
        values: tensors per key (same keys as the :class:`GradientSum` it came from).
        noise_std: per-coordinate standard deviation of the noise in ``values`` at this step (a float for all
            keys, or a dict per key). Post-processing reads it (denoise's threshold, AdamBC's correction).
        mechanism: name of the mechanism that produced it ("gaussian", "ftrl", ...).
        expected_batch_size: the divisor B.
        step: index of the logical step (0-based).
        info: free-form public metadata from the mechanism (e.g. FTRL's sensitivity).
    """

    values: dict[str, Tensor]
    noise_std: float | dict[str, float]
    mechanism: str
    expected_batch_size: float
    step: int
    info: dict[str, Any] = field(default_factory=dict)

    def std_of(self, key: str) -> float:
        """Noise std of the tensor under ``key``."""
        return self.noise_std[key] if isinstance(self.noise_std, dict) else float(self.noise_std)

