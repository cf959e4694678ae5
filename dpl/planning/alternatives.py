"""Alternatives to a run's batch size at the same epsilon and the same compute (B x steps), and the one to take.

Each alternative is planned by the caller's ``replan(batch_size, steps)``: a fresh
:class:`~dpl.core.engine.PrivateEngine` set up as ``dpl fit`` sets one up (the mechanism's own calibration), so every
mechanism's sigma is its own. Sander, Stock & Sablayrolles, "TAN without a burn: scaling laws of DP-SGD" (ICML 2023):
at a fixed number of steps utility is governed by the noise-batch ratio sigma / B; at fixed compute a larger batch
lowers it (sigma grows more slowly than B) at the price of fewer steps. :func:`recommend` keeps the run's batch size
when its noise is below the largest clipped signal (:data:`~dpl.core.regime.QUIET`), else takes the most steps whose
noise is, else says what it would take (a larger batch at more compute, fewer trainable parameters).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dpl.core.regime import QUIET, NoiseRegime, needed_dimension
from dpl.errors import ConfigError
from dpl.planning.memory import MemoryPlan

#: batch sizes tried: the run's times 2 ** k for these k (the steps scaled by 2 ** -k, kept when whole)
POWERS = range(-3, 7)


@dataclass(frozen=True)
class Row:
    """One planned setup: expected batch B, steps, epochs (B steps / N), sigma, epsilon (the mechanism's accountant at
    that sigma), the noise regime (``None`` when the release's dimension is a plugin's own) and the mechanism's
    ``noise_scale`` (ftrl: its sensitivity)."""

    @property
    def step_noise_multiplier(self) -> float:
        """One step's noise std per coordinate in units of C, times B."""
        return self.noise_multiplier * self.noise_scale


    batch_size: int
    steps: int
    epochs: float
    noise_multiplier: float
    epsilon: float
    regime: NoiseRegime | None
    current: bool = False
    noise_scale: float = 1.0  # the mechanism's: one step's noise multiplier is noise_multiplier x noise_scale


Replan = Callable[[int, int], Any]  # (batch size, steps) -> a set-up PrivateEngine


def steps_text(steps: int) -> str:
    """``1 step``, ``40 steps``."""
    return f"{steps:,} step{'' if steps == 1 else 's'}"


def planned_epsilon(engine: Any) -> float:
    """Epsilon after the engine's planned steps: the composition of the ledger's events (a one-off question: no
    background schedule)."""
    from dpl.core.accounting import events

    ledger = engine.ledger
    return float(events.epsilon(ledger.event(ledger.plan.steps), ledger.plan.delta, ledger.privacy.accountant))


def row_of(engine: Any, current: bool = False) -> Row:
    """The :class:`Row` of a set-up engine."""
    plan = engine.plan
    return Row(batch_size=plan.expected_batch_size, steps=plan.steps,
               epochs=plan.steps * plan.expected_batch_size / plan.population,
               noise_multiplier=float(engine.noise_multiplier), epsilon=planned_epsilon(engine),
               regime=engine.noise_regime(), current=current,
               noise_scale=float(engine.mechanism.noise_scale))


def same_compute(batch_size: int, steps: int, population: int) -> list[tuple[int, int]]:
    """``(B', T')`` with B' = B 2^k (k in :data:`POWERS`), B' T' = B T exactly, 1 <= B' <= population."""
    out, total = [], batch_size * steps
    for k in POWERS:
        if k < 0 and batch_size % (1 << -k):
            continue
        batch = batch_size << k if k >= 0 else batch_size >> -k
        if 1 <= batch <= population and total % batch == 0:
            out.append((batch, total // batch))
    return out


def alternatives(replan: Replan, current: Any) -> tuple[list[Row], list[str]]:
    """The rows at the same compute as ``current`` (a set-up engine), in batch-size order, and one line per
    alternative the mechanism refused."""
    plan = current.plan
    rows, refused = [], []
    for batch, steps in same_compute(plan.expected_batch_size, plan.steps, plan.population):
        if batch == plan.expected_batch_size:
            rows.append(row_of(current, current=True))
            continue
        try:
            rows.append(row_of(replan(batch, steps)))
        except ConfigError as exc:
            refused.append(f"B = {batch:,}, {steps_text(steps)}: {exc}")
    return rows, refused


def recommend(rows: list[Row], replan: Replan, population: int, lora: tuple[int, int, int] | None = None
              ) -> tuple[Row | None, str]:
    """The row to take and why, in one line. ``lora``: ``(rank, trainable parameters that are LoRA's, those that are
    not)`` when the model trains LoRA adapters (their count is proportional to the rank)."""
    current = next(r for r in rows if r.current)
    if current.regime is None:
        return None, ("not assessed: the run's gradient estimate is a plugin's own, so the noise's dimension is not "
                      "the trainable parameters' (sigma / B is the noise against a clipped signal <= C per released "
                      "coordinate)")
    r0 = current.regime.relative_noise
    if current.regime.quiet:
        return current, (f"keep B = {current.batch_size:,}: the noise on a step is below the largest clipped signal "
                         f"(sigma sqrt(d) / B = {r0:.2g} <= {QUIET:g})")
    quiet = [r for r in rows if r.regime is not None and r.regime.quiet]
    if quiet:
        best = max(quiet, key=lambda r: r.steps)
        return best, (f"raise B to {best.batch_size:,} ({steps_text(best.steps)} at the same compute): sigma sqrt(d) / B "
                      f"{r0:.3g} -> {best.regime.relative_noise:.2g}, below the largest clipped signal")
    ranked = [r for r in rows if r.regime is not None]
    feasible = [r for r in ranked if _lora_rank(r, lora) is not None]
    best = max(feasible, key=lambda r: r.steps) if feasible else min(ranked, key=lambda r: r.regime.relative_noise)
    ways = [_fewer_parameters(best, lora)]
    larger = _larger_batch(replan, current, population)
    if larger is not None:
        ways.append(f"raise B to {larger.batch_size:,} at {steps_text(larger.steps)} ({larger.batch_size // current.batch_size}x "
                    f"the compute: {larger.regime.relative_noise:.2g})")
    return best, (f"no batch size at this compute brings sigma sqrt(d) / B to {QUIET:g} (B = {best.batch_size:,}: "
                  f"{best.regime.relative_noise:.3g}): " + ", or ".join(ways) + ", or more data")


def _larger_batch(replan: Replan, current: Row, population: int) -> Row | None:
    """The smallest B 2^k (k >= 1, at most the population) whose noise is quiet at the run's steps."""
    batch = current.batch_size * 2
    while batch <= population:
        try:
            row = row_of(replan(batch, current.steps))
        except ConfigError:
            return None
        if row.regime is not None and row.regime.quiet:
            return row
        batch *= 2
    return None


def _lora_rank(row: Row, lora: tuple[int, int, int] | None) -> int | None:
    """The largest LoRA rank (at most the run's) whose noise is quiet at ``row``, or ``None`` (no LoRA, or not even
    rank 1)."""
    if lora is None:
        return None
    rank, in_lora, other = lora
    limit = needed_dimension(row.regime.noise_multiplier, row.regime.batch_size)
    fits = min(rank, int((limit - other) * rank // in_lora)) if limit > other else 0
    return fits if fits >= 1 else None


def _fewer_parameters(row: Row, lora: tuple[int, int, int] | None) -> str:
    """What cutting the trainable parameters takes at ``row``'s batch size."""
    regime = row.regime
    limit = needed_dimension(regime.noise_multiplier, regime.batch_size)
    where = f"at B = {row.batch_size:,} ({steps_text(row.steps)})"
    text = f"cut the trainable parameters to <= {limit:,} {where} (now {regime.dimension:,})"
    if lora is None:
        return text
    rank, in_lora, other = lora
    fits = _lora_rank(row, lora)
    if fits is not None:
        shrunk = NoiseRegime(regime.noise_multiplier, regime.batch_size, other + in_lora * fits // rank,
                             regime.max_grad_norm)
        return f"LoRA r {rank} -> {fits} {where}: {shrunk.relative_noise:.2g}"
    one = NoiseRegime(regime.noise_multiplier, regime.batch_size, other + in_lora // rank, regime.max_grad_norm)
    return text + (f"; LoRA r {rank} -> 1 leaves {one.relative_noise:.2g}" if rank > 1 else "")


@dataclass
class PlanReport:
    """What ``dpl plan`` prints (see :func:`format_report`)."""

    configs: list[str]
    rows_in_data: int
    population: int
    num_units: int
    unit: str
    data_text: str  # what the mechanism samples from, in the privacy unit's words (PrivacyUnit.data_text)
    sampled_noun: str  # what one draw is: users, rows or examples (PrivacyUnit.sampled_noun)
    user_sampling: str | None
    max_rows_per_user: int | None
    sampling_rate: float
    sampling: str
    steps_per_epoch: int
    target_epsilon: float
    delta: float
    mechanism: str
    accounting: str
    adjacency: str
    max_grad_norm: float
    current: Row
    trainable: int
    estimator: str | None  # the plugin whose gradient estimate replaces the default, if any
    lora: tuple[int, int, int] | None
    rows: list[Row] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    recommended: Row | None = None
    why: str = ""
    memory: MemoryPlan | None = None  # None: the gradient estimate is a plugin's own (no per-example clipping)
    clipping: str | None = None  # privacy.clipping per_layer: its groups, thresholds and (adaptive) privacy split
    task_kind: str | None = None  # the kind of task (dpl.core.regime's words for a hopeless regime)


def finish_report(report: PlanReport, engine: Any, replan: Any) -> PlanReport:
    """``report`` with the alternatives at the same compute (each planned by ``replan(B, steps)``) and the
    recommendation; none where the run adds no noise."""
    current = report.current
    if current.noise_multiplier == 0 or not math.isfinite(report.target_epsilon):
        report.rows = [current]
        report.why = "no alternatives: the run adds no noise (not private)"
        return report
    report.rows, report.refused = alternatives(replan, engine)
    report.recommended, report.why = recommend(report.rows, replan, engine.plan.population, report.lora)
    return report
