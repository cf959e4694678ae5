"""The settings of ``dpl audit`` (:class:`AuditConfig`, also the keys of its YAML config) and what it found
(:class:`AuditResult`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from dpl.audit.bound import Guess
from dpl.audit.injections import INJECTIONS
from dpl.core.privacy_unit import names_users
from dpl.errors import ConfigError


@dataclass
class AuditConfig:
    """Settings of ``dpl audit`` (also the keys of its YAML config).

    Args:
        plugins: plugins to activate, as ``model.plugins`` in a training config (``{name: {options}}``); the
            defaults (clip, gaussian) are always active.
        target_epsilon: claimed epsilon: sigma is calibrated by the mechanism for it (PRV accounting by default).
        target_delta: claimed delta (also the delta of the audit's bound).
        noise_multiplier: audit this sigma instead of calibrating one (the claimed epsilon is then computed).
        steps: training steps (logical batches).
        canaries: m, the number of canaries (each included with probability 1/2).
        examples: ordinary (non-canary) training examples.
        batch_size: expected logical batch size B; the sampling rate is q = B / (examples + canaries / 2),
            fixed before the canaries are drawn.
        max_grad_norm: clipping norm C.
        canary_norm: the canaries' gradient norm in units of C (>= 1: clipping bounds them).
        example_norm: the ordinary examples' gradient norm in units of C.
        canary_type: ``dirac`` (one weight entry each; needs rows * cols >= m) or ``random`` (random rank-one
            unit directions, nearly orthogonal when rows * cols >> 1).
        rows: rows of the audited weight matrix (None: the smallest square that holds the canaries).
        cols: columns of the weight matrix (None: as rows).
        lr: SGD learning rate (the model is linear, so it only scales the updates).
        score: ``lr`` (log-likelihood ratio of the subsampled Gaussian at the claimed sigma and q), ``sum`` (of the
            per-step projections) or ``sign`` (sum of their signs: scale-free, for preconditioned updates such
            as adambc's, whose per-coordinate scale varies wildly).
        guesses: explicit ``[[k_plus, k_minus], ...]`` candidates (None: fractions of m, see
            DEFAULT_GUESS_FRACTIONS). The best one is reported, with a Bonferroni correction over all.
        confidence: confidence of the lower bound (e.g. 0.95).
        seed: seed of the canaries, the inclusion, the sampler and the noise (None: OS entropy).
        accountant: ``prv`` or ``rdp``.
        physical_batch_size: micro-batch size of the private step.
        inject: plant a bug to check the audit: ``weak_noise`` (noise x weak_noise_factor), ``no_clip``,
            ``noise_leak`` (the auditor knows the noise generator's state and subtracts the noise) or
            ``per_row_clip`` (``unit: user``: each row clipped on its own, so a user adds up to k C) or
            ``unsplit_thresholds`` (``clipping: per_layer``: each layer clipped to C instead of C_g, so a canary that
            spans G layers adds up to sqrt(G) C).
        unit: ``example`` or ``user``: audit user-level DP (user-level sampling): every canary and every ordinary
            example is a user of ``max_rows_per_user`` rows (a canary's rows are copies of it: the worst case), users
            are Poisson-sampled at q = B / (examples + canaries / 2), and the bound is on the user-level epsilon.
        max_rows_per_user: k, the rows of each user with ``unit: user``.
        weak_noise_factor: the noise factor of ``weak_noise``.
        clipping: ``flat`` or ``per_layer`` (``privacy.clipping``: each of the ``layers`` clipped to its own C_g).
        clipping_thresholds: ``fixed`` or ``adaptive`` (``privacy.clipping_thresholds``, ``per_layer`` only).
        layers: the weight matrix's rows split into this many linear layers (per_layer's groups); use
            ``canary_type: random``, whose canaries span every layer (a Dirac canary lies in one, clipped to its C_g).
    """

    plugins: dict[str, dict[str, Any] | None] | None = None
    target_epsilon: float = 4.0
    target_delta: float = 1e-5
    noise_multiplier: float | None = None
    steps: int = 100
    canaries: int = 1000
    examples: int = 1000
    batch_size: int = 100
    max_grad_norm: float = 1.0
    canary_norm: float = 10.0
    example_norm: float = 2.0
    canary_type: Literal["dirac", "random"] = "dirac"
    rows: int | None = None
    cols: int | None = None
    lr: float = 1.0
    score: Literal["lr", "sum", "sign"] = "lr"
    guesses: list[list[int]] | None = None
    confidence: float = 0.95
    seed: int | None = None
    accountant: Literal["prv", "rdp"] = "prv"
    physical_batch_size: int = 4096
    inject: Literal["none", "weak_noise", "no_clip", "noise_leak", "per_row_clip", "unsplit_thresholds"] = "none"
    weak_noise_factor: float = 0.1
    unit: Literal["example", "user"] = "example"
    max_rows_per_user: int = 1
    clipping: Literal["flat", "per_layer"] = "flat"
    clipping_thresholds: Literal["fixed", "adaptive"] = "fixed"
    layers: int = 1

    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        need(self.target_epsilon > 0 and math.isfinite(self.target_epsilon),
             f"target_epsilon must be > 0, got {self.target_epsilon}")
        need(0 < self.target_delta < 1, f"target_delta must be in (0, 1), got {self.target_delta}")
        need(self.steps >= 1, f"steps must be >= 1, got {self.steps}")
        need(self.canaries >= 2, f"canaries must be >= 2, got {self.canaries}")
        need(self.examples >= 0, f"examples must be >= 0, got {self.examples}")
        need(self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}")
        need(self.batch_size <= self.examples + self.canaries // 2,
             f"batch_size ({self.batch_size}) exceeds the expected data set size "
             f"({self.examples} examples + {self.canaries // 2} canaries)")
        need(self.max_grad_norm > 0 and math.isfinite(self.max_grad_norm), "max_grad_norm must be finite and > 0")
        need(self.canary_norm >= 1, f"canary_norm must be >= 1 (in units of C), got {self.canary_norm}")
        need(self.example_norm > 0, f"example_norm must be > 0, got {self.example_norm}")
        need(0 < self.confidence < 1, f"confidence must be in (0, 1), got {self.confidence}")
        need(self.lr > 0, f"lr must be > 0, got {self.lr}")
        need(self.noise_multiplier is None or self.noise_multiplier >= 0, "noise_multiplier must be >= 0")
        need(self.inject in INJECTIONS, f"inject must be one of {', '.join(INJECTIONS)}, got {self.inject!r}")
        need(self.weak_noise_factor >= 0, "weak_noise_factor must be >= 0")
        need(self.max_rows_per_user >= 1, f"max_rows_per_user must be >= 1, got {self.max_rows_per_user}")
        need(self.inject != "per_row_clip" or names_users(self.unit), "inject: per_row_clip needs unit: user")
        need(self.inject != "unsplit_thresholds" or (self.clipping == "per_layer" and self.layers >= 2),
             "inject: unsplit_thresholds needs clipping: per_layer and layers >= 2")
        need(self.clipping == "per_layer" or self.clipping_thresholds == "fixed",
             "clipping_thresholds: adaptive needs clipping: per_layer")
        rows, cols = self.shape()
        need(rows >= 1 and cols >= 1, f"rows and cols must be >= 1, got {rows} x {cols}")
        need(1 <= self.layers <= rows, f"layers must be in [1, rows = {rows}], got {self.layers}")
        if self.canary_type == "dirac":
            need(rows * cols >= self.canaries, f"dirac canaries need rows * cols >= canaries ({rows} x {cols} < "
                                               f"{self.canaries})")

    @property
    def rows_per_user(self) -> int:
        """The rows each canary and ordinary example's user has: k with ``unit: user``, else 1."""
        return self.max_rows_per_user if names_users(self.unit) else 1

    def shape(self) -> tuple[int, int]:
        """(rows, cols) of the weight matrix: a missing side equals the other; both missing: the smallest square
        with at least 16 m entries (the ordinary examples' gradients are spread over all entries, so each canary's
        entry sees little of them)."""
        rows, cols = self.rows, self.cols
        if rows is None and cols is None:
            rows = cols = math.ceil(math.sqrt(16 * self.canaries))
        return int(rows if rows is not None else cols), int(cols if cols is not None else rows)


@dataclass
class AuditResult:
    """What an audit found (``to_dict`` is the JSON report)."""

    config: AuditConfig
    mechanism: str
    plugins: list[str]
    noise_multiplier: float
    sampling_rate: float
    claimed_epsilon: float
    delta: float
    confidence: float
    canaries: int
    included: int
    guesses: list[Guess]
    best: Guess
    lower_bound: float
    ceiling: float
    seconds: float
    scores: np.ndarray = field(repr=False, default=None)
    membership: np.ndarray = field(repr=False, default=None)

    @property
    def violation(self) -> bool:
        return self.lower_bound > self.claimed_epsilon

    @property
    def verdict(self) -> str:
        if self.violation:
            return (f"VIOLATION: the audit shows epsilon >= {self.lower_bound:.3f} > claimed {self.claimed_epsilon:.3f} "
                    f"(at {self.confidence:.0%} confidence): the implementation does not meet its claim")
        text = (f"no violation found: epsilon >= {self.lower_bound:.3f} <= claimed {self.claimed_epsilon:.3f}. "
                "This is consistent with the claim but does not prove it")
        if self.ceiling <= self.claimed_epsilon:
            text += (f"; note: with {self.canaries} canaries even perfect guesses could only show epsilon >= "
                     f"{self.ceiling:.3f}, so this audit could not have caught a violation (use more canaries)")
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": dataclasses.asdict(self.config),
            "mechanism": self.mechanism, "plugins": self.plugins, "inject": self.config.inject,
            "noise_multiplier": self.noise_multiplier, "sampling_rate": self.sampling_rate,
            "steps": self.config.steps, "claimed_epsilon": self.claimed_epsilon, "delta": self.delta,
            "confidence": self.confidence, "canaries": self.canaries, "included": self.included,
            "guesses": [dict(dataclasses.asdict(g), guesses=g.guesses) for g in self.guesses],
            "best": dict(dataclasses.asdict(self.best), guesses=self.best.guesses),
            "lower_bound": self.lower_bound, "ceiling": self.ceiling, "violation": self.violation,
            "verdict": self.verdict, "seconds": self.seconds,
        }

    def report(self) -> str:
        cfg = self.config
        lines = [
            "dpl audit: one-run privacy audit (Steinke, Nasr & Jagielski 2023), white-box gradient canaries",
            f"  mechanism       {self.mechanism}" + (f" + plugins {', '.join(self.plugins)}" if self.plugins else "")
            + (f"; per_layer clipping, {cfg.clipping_thresholds} thresholds, {cfg.layers} layers"
               if cfg.clipping == "per_layer" else ""),
            f"  injected bug    {cfg.inject}" + (f" (noise x{cfg.weak_noise_factor:g})" if cfg.inject == "weak_noise"
                                                  else ""),
            f"  claim           epsilon = {self.claimed_epsilon:.3f}, delta = {self.delta:.3g} "
            f"(sigma = {self.noise_multiplier:.4f}, q = {self.sampling_rate:.4g}, {cfg.steps} steps, C = "
            f"{cfg.max_grad_norm:g})",
            f"  canaries        m = {self.canaries} ({cfg.canary_type}, norm {cfg.canary_norm:g} C), "
            f"{self.included} included; {cfg.examples} ordinary examples; score = {cfg.score}",
            f"  guesses         best of {len(self.guesses)} (k+, k-) candidates, Bonferroni-corrected: "
            f"k+ = {self.best.k_plus}, k- = {self.best.k_minus}: {self.best.correct} / {self.best.guesses} correct",
            f"  lower bound     epsilon >= {self.lower_bound:.3f} at {self.confidence:.0%} confidence "
            f"(perfect guesses could show at most {self.ceiling:.3f})",
            f"  verdict         {self.verdict}",
        ]
        return "\n".join(lines)
