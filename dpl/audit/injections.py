"""Deliberately broken mechanisms, planted to check that the audit catches them: pluggy wrappers around whichever
plugin answers the hook (``dpl audit --inject ...``). Never registered outside an audit."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dpl.core.gradients import GradientSum
from dpl.api import hookimpl
from dpl.core.plugin_manager import Contract
from dpl.core.step import UNITS_KEY, StepContext

INJECTIONS = ("none", "weak_noise", "no_clip", "noise_leak", "per_row_clip", "unsplit_thresholds")


class WeakNoise:
    """Bug: ``privatize`` adds noise with ``factor * sigma`` while the accounting claims sigma."""

    def __init__(self, factor: float = 0.1) -> None:
        self.factor = float(factor)

    @hookimpl(wrapper=True)
    def privatize(self, ctx: StepContext, gradient_sum: GradientSum):
        claimed = ctx.noise_multiplier
        ctx.noise_multiplier = claimed * self.factor
        try:
            return (yield)
        finally:
            ctx.noise_multiplier = claimed


@contextmanager
def _thresholds(clip: Any, value: float) -> Iterator[None]:
    """Every group threshold C_g of ``privacy.clipping: per_layer`` set to ``value`` for one hook call, then restored
    (adaptive thresholds move from the restored ones). Nothing under flat clipping."""
    saved = list(clip.thresholds)
    clip.thresholds = [value] * len(saved)
    try:
        yield
    finally:
        clip.thresholds = saved


class NoClip:
    """Bug: ``estimate_gradient`` runs with C = inf (no clipping; per_layer: every C_g = inf) while the noise is
    calibrated for C."""

    def __init__(self, clip: Any) -> None:
        self.clip = clip  # the default estimator (its per_layer thresholds)

    @hookimpl(wrapper=True)
    def estimate_gradient(self, ctx: StepContext, batch: dict[str, Any]):
        claimed = ctx.max_grad_norm
        ctx.max_grad_norm = math.inf
        try:
            with _thresholds(self.clip, math.inf):
                return (yield)
        finally:
            ctx.max_grad_norm = claimed


class UnsplitThresholds:
    """Bug (``privacy.clipping: per_layer``): every group clipped to C instead of its share C_g (sum_g C_g^2 = C^2), so
    an example whose gradient spans G groups adds up to sqrt(G) C while the noise is calibrated for C."""

    def __init__(self, clip: Any) -> None:
        self.clip = clip

    @hookimpl(wrapper=True)
    def estimate_gradient(self, ctx: StepContext, batch: dict[str, Any]):
        with _thresholds(self.clip, ctx.max_grad_norm):
            return (yield)


class PerRowClip:
    """Bug (``unit: user``): ``estimate_gradient`` never sees the batch's users, so it clips every row on its own and a
    user of k rows adds up to k C, while the accounting assumes C per user. It claims to clip per user (a plugin
    whose contract lies: what the audit is for)."""

    contract = Contract(clips_units=True)

    @hookimpl(wrapper=True)
    def estimate_gradient(self, ctx: StepContext, batch: dict[str, Any]):
        batch.pop(UNITS_KEY, None)
        return (yield)
