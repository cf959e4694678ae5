"""Empirical privacy audit in one training run (``dpl audit``).

The audit of Steinke, Nasr & Jagielski, "Privacy auditing with one (1) training run" (NeurIPS 2023), with
white-box gradient canaries, run through dpl's real private step:

1. **Canaries.** ``m`` canaries, each a training example whose per-example gradient is a chosen direction
   ``u_i`` of norm ``canary_norm * C`` (>= C, so clipping is what bounds it): a *Dirac* canary (one weight
   entry) or a random rank-one direction of a small linear model ``W`` (``rows x cols``). Each canary is
   included in the training set independently with probability 1/2 (``S_i = +1``) or left out (``S_i = -1``).
2. **Training.** The included canaries and ``examples`` ordinary examples (random directions, the other
   gradients in each batch) are trained on for ``steps`` steps by :func:`dpl.core.step.private_step` with a plugin
   manager from :func:`dpl.core.plugin_manager.create_plugin_manager`: the mechanism's own batch sampler (Poisson for
   the default), its own clipping, noise and post-processing, and :func:`dpl.core.update.apply_direction` with SGD.
   Sigma is calibrated by the mechanism for the claimed (epsilon, delta).
3. **Scores.** The auditor sees every intermediate model (white box). For canary i and step t,
   ``y_it = <theta_t - theta_{t+1}, u_i> * B / (lr * C)`` (1 when the canary was in the batch, plus noise).
   The score is the log-likelihood ratio of the Poisson-subsampled Gaussian with the *claimed* sigma and q,
   ``sum_t log(1 - q + q exp((2 y_it - 1) / (2 sigma^2)))`` (``score: lr``), ``sum_t y_it`` (``score: sum``) or
   ``sum_t sign(y_it)`` (``score: sign``).
4. **Guesses and bound.** Guess "in" for the ``k+`` highest scores and "out" for the ``k-`` lowest; with ``r``
   guesses of which ``v`` are right, Theorem 5.2 / Corollary 5.4 of the paper bound
   ``P[v correct] <= f(v) + 2 m delta max_i (f(v - i) - f(v)) / i``, ``f(v) = P[Binomial(r, e^eps/(1+e^eps)) >= v]``,
   for any (eps, delta)-DP mechanism. The reported lower bound is the largest eps that this p-value rejects at
   the stated confidence. Several (k+, k-) candidates are tried with a Bonferroni correction (the significance
   is split evenly), so taking the best of them is still valid.

A bound above the claimed epsilon is a **violation**: with probability at least ``confidence`` the
implementation is not (claimed eps, delta)-DP. A bound below it shows nothing more than that this attack did
not find a leak: an audit never proves a guarantee. ``inject`` plants a known bug (noise x0.1, clipping off,
or an auditor who knows the noise generator's state, as dpl's old checkpoints leaked it) to check that the
audit catches it. See ``docs/audit.md``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from scipy import special, stats
from torch import Tensor, nn

from dpl.errors import ConfigError, DPLError
from dpl.core.gradients import GradientSum
from dpl.core.hookspecs import hookimpl
from dpl.core.plugin_manager import active_plugin_names, create_plugin_manager, implemented_hooks, replaced_hooks
from dpl.core.sampling import derive_seed, secure_generator
from dpl.core.step import RunSetup, StepContext, private_step
from dpl.core.update import apply_direction

INJECTIONS = ("none", "weak_noise", "no_clip", "noise_leak")
# Fractions of m guessed "in" (k+) and "out" (k-) tried by default (Bonferroni over all of them).
DEFAULT_GUESS_FRACTIONS: tuple[tuple[float, float], ...] = (
    (0.01, 0.0), (0.02, 0.0), (0.05, 0.0), (0.1, 0.0), (0.2, 0.0), (0.3, 0.0), (0.45, 0.0), (0.05, 0.05))


# ----------------------------------------------------------------------------------------------------------
# The bound (Steinke, Nasr & Jagielski 2023, Theorem 5.2 / Corollary 5.4)


def p_value(m: int, r: int, v: int, epsilon: float, delta: float = 0.0) -> float:
    """Probability bound of ``v`` or more correct guesses out of ``r`` (``m`` canaries) for an
    (epsilon, delta)-DP mechanism: ``f(v) + 2 m delta max_{i >= 1} (f(v - i) - f(v)) / i`` with
    ``f(v) = P[Binomial(r, e^eps / (1 + e^eps)) >= v]`` (the maximum is attained at some i <= v)."""
    m, r, v = int(m), int(r), int(v)
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got m={m}, r={r}, v={v}")
    if not (epsilon >= 0 and 0 <= delta <= 1):
        raise ValueError(f"need epsilon >= 0 and delta in [0, 1], got {epsilon}, {delta}")
    if v == 0:
        return 1.0
    q = float(special.expit(epsilon))
    beta = float(stats.binom.sf(v - 1, r, q))  # f(v) = P[W >= v]
    if delta == 0:
        return min(beta, 1.0)
    shifts = np.arange(1, v + 1)
    tails = stats.binom.sf(v - shifts - 1, r, q)  # f(v - i) = P[W >= v - i]
    alpha = float(np.max((tails - beta) / shifts))
    return min(beta + 2.0 * m * delta * alpha, 1.0)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float = 0.0, confidence: float = 0.95,
                        iterations: int = 60) -> float:
    """The largest epsilon rejected by ``v`` correct guesses out of ``r``: an (epsilon, delta)-DP mechanism with
    epsilon below it yields that many correct guesses with probability at most ``1 - confidence`` (the paper's
    test, Lemma 4.7 / Appendix D). Bisection on ``p_value`` (increasing in epsilon); returns the low end of the
    final bracket (conservative)."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    significance = 1.0 - confidence
    if p_value(m, r, v, 0.0, delta) > significance:
        return 0.0
    lo, hi = 0.0, 1.0
    while p_value(m, r, v, hi, delta) <= significance:
        lo, hi = hi, hi * 2
        if hi > 1e3:
            return lo
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        if p_value(m, r, v, mid, delta) <= significance:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class Guess:
    """One (k+, k-) candidate: ``r = k+ + k-`` guesses, ``v`` of them right, and the bound it gives alone at
    the Bonferroni-corrected confidence."""

    k_plus: int
    k_minus: int
    correct: int
    bound: float

    @property
    def guesses(self) -> int:
        return self.k_plus + self.k_minus


def guesses_for(m: int, fractions: Sequence[tuple[float, float]] | None = None,
                explicit: Sequence[Sequence[int]] | None = None) -> list[tuple[int, int]]:
    """The (k+, k-) candidates: ``explicit`` pairs, or ``fractions`` of m (default DEFAULT_GUESS_FRACTIONS)."""
    if explicit:
        pairs = [(int(p[0]), int(p[1])) for p in explicit]
    else:
        pairs = [(max(1, round(fp * m)) if fp > 0 else 0, max(1, round(fm * m)) if fm > 0 else 0)
                 for fp, fm in (fractions or DEFAULT_GUESS_FRACTIONS)]
    out = []
    for kp, km in pairs:
        if kp < 0 or km < 0 or kp + km == 0 or kp + km > m:
            raise ConfigError(f"bad guess counts (k+={kp}, k-={km}) for {m} canaries: need k+, k- >= 0 and "
                              f"1 <= k+ + k- <= m")
        if (kp, km) not in out:
            out.append((kp, km))
    return out


def score_guesses(scores: np.ndarray, included: np.ndarray, candidates: Sequence[tuple[int, int]], delta: float,
                  confidence: float) -> tuple[list[Guess], Guess]:
    """Guess "in" for the k+ highest scores and "out" for the k- lowest, for each candidate; the bound of each
    at confidence ``1 - (1 - confidence) / len(candidates)`` (Bonferroni); returns all and the best."""
    scores = np.asarray(scores, dtype=np.float64)
    included = np.asarray(included, dtype=bool)
    m = len(scores)
    # Ties are broken at random (a fixed permutation), so equal scores carry no information about membership.
    tie_break = np.random.default_rng(0).permutation(m)
    order = np.lexsort((tie_break, scores))[::-1]  # highest first
    per_test = 1.0 - (1.0 - confidence) / len(candidates)
    results = []
    for kp, km in candidates:
        if kp + km > m:
            raise ConfigError(f"k+ + k- = {kp + km} > m = {m}")
        top, bottom = order[:kp], order[m - km:] if km else order[:0]
        correct = int(included[top].sum() + (~included[bottom]).sum())
        results.append(Guess(kp, km, correct, epsilon_lower_bound(m, kp + km, correct, delta, per_test)))
    best = max(results, key=lambda g: (g.bound, g.correct))
    return results, best


def perfect_guess_ceiling(m: int, candidates: Sequence[tuple[int, int]], delta: float, confidence: float) -> float:
    """The largest bound these settings can give at all (every guess right): the audit's resolution."""
    per_test = 1.0 - (1.0 - confidence) / len(candidates)
    return max(epsilon_lower_bound(m, kp + km, kp + km, delta, per_test) for kp, km in candidates)


# ----------------------------------------------------------------------------------------------------------
# Injected bugs (for testing the auditor): pluggy wrappers around whatever plugin answers the hook


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


class NoClip:
    """Bug: ``estimate_gradient`` runs with C = inf (no clipping) while the noise is calibrated for C."""

    @hookimpl(wrapper=True)
    def estimate_gradient(self, ctx: StepContext, batch: dict[str, Any]):
        claimed = ctx.max_grad_norm
        ctx.max_grad_norm = math.inf
        try:
            return (yield)
        finally:
            ctx.max_grad_norm = claimed


# ----------------------------------------------------------------------------------------------------------
# Configuration and result


@dataclass
class AuditConfig:
    """Settings of ``dpl audit`` (also the keys of its YAML config).

    Args:
        plugins: plugins to activate, as ``model.plugins`` in a training config (``{name: {options}}``); the
            defaults (clip, gaussian) are always active.
        epsilon: claimed epsilon: sigma is calibrated by the mechanism for it (PRV accounting by default).
        delta: claimed delta (also the delta of the audit's bound).
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
        inject: plant a bug to check the audit: ``weak_noise`` (noise x weak_noise_factor), ``no_clip``, or
            ``noise_leak`` (the auditor knows the noise generator's state and subtracts the noise).
        weak_noise_factor: the noise factor of ``weak_noise``.
    """

    plugins: dict[str, dict[str, Any] | None] | None = None
    epsilon: float = 4.0
    delta: float = 1e-5
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
    inject: Literal["none", "weak_noise", "no_clip", "noise_leak"] = "none"
    weak_noise_factor: float = 0.1

    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        need(self.epsilon > 0 and math.isfinite(self.epsilon), f"epsilon must be > 0, got {self.epsilon}")
        need(0 < self.delta < 1, f"delta must be in (0, 1), got {self.delta}")
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
        rows, cols = self.shape()
        need(rows >= 1 and cols >= 1, f"rows and cols must be >= 1, got {rows} x {cols}")
        if self.canary_type == "dirac":
            need(rows * cols >= self.canaries, f"dirac canaries need rows * cols >= canaries ({rows} x {cols} < "
                                               f"{self.canaries})")

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
            f"  mechanism       {self.mechanism}" + (f" + plugins {', '.join(self.plugins)}" if self.plugins else ""),
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


# ----------------------------------------------------------------------------------------------------------
# The canary game


class _CanaryData:
    """Canary directions, the inclusion vector and the training set (rows of inputs x and output weights y;
    example j's gradient is y_j x_j^T, norm |y_j| |x_j|)."""

    def __init__(self, cfg: AuditConfig, gen: torch.Generator) -> None:
        rows, cols = cfg.shape()
        m, C = cfg.canaries, cfg.max_grad_norm
        self.rows, self.cols, self.m = rows, cols, m
        if cfg.canary_type == "dirac":
            cells = torch.randperm(rows * cols, generator=gen)[:m]
            self.cell_rows, self.cell_cols = cells // cols, cells % cols
            cy = torch.zeros(m, rows).index_put_((torch.arange(m), self.cell_rows), torch.tensor(1.0))
            cx = torch.zeros(m, cols).index_put_((torch.arange(m), self.cell_cols), torch.tensor(1.0))
        else:
            self.cell_rows = self.cell_cols = None
            cy = _unit_rows(torch.randn(m, rows, generator=gen))
            cx = _unit_rows(torch.randn(m, cols, generator=gen))
        self.cy, self.cx = cy, cx  # unit vectors: u_i = cy_i cx_i^T
        self.included = torch.rand(m, generator=gen) < 0.5
        n = cfg.examples
        ey = _unit_rows(torch.randn(n, rows, generator=gen))
        ex = _unit_rows(torch.randn(n, cols, generator=gen)) * (cfg.example_norm * C)
        inc = self.included.nonzero().flatten()
        self.x = torch.cat([cx[inc] * (cfg.canary_norm * C), ex])
        self.y = torch.cat([cy[inc], ey])

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def batch(self, indices: Sequence[int]) -> dict[str, Tensor]:
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        return {"x": self.x[idx], "y": self.y[idx]}

    def project(self, matrix: Tensor) -> Tensor:
        """<matrix, u_i> for every canary (float64)."""
        matrix = matrix.detach().double()
        if self.cell_rows is not None:
            return matrix[self.cell_rows, self.cell_cols]
        return ((self.cy.double() @ matrix) * self.cx.double()).sum(dim=1)


def _unit_rows(t: Tensor) -> Tensor:
    return t / t.norm(dim=1, keepdim=True).clamp(min=1e-12)


class _LinearCanaryModel(nn.Module):
    """``loss_j = y_j . (W x_j)``: its gradient in W is ``y_j x_j^T`` whatever W is."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.layer = nn.Linear(cols, rows, bias=False)
        nn.init.zeros_(self.layer.weight)

    def per_example_loss(self, batch: dict[str, Tensor]) -> Tensor:
        return (self.layer(batch["x"]) * batch["y"]).sum(dim=-1)


def _forever(sampler: Any) -> Iterator[list[int]]:
    while True:
        empty = True
        for indices in sampler:
            empty = False
            yield list(indices)
        if empty:
            raise ConfigError("the mechanism's batch sampler yields no batch")


def _check_leak_supported(pm: Any) -> None:
    named = dict(pm.list_name_plugin())
    for name in active_plugin_names(pm):
        hooks = set(implemented_hooks(named[name])) & {"privatize", "post_process", "precondition"}
        if hooks:
            raise ConfigError(f"inject: noise_leak replays the default gaussian noise and needs the update to be "
                              f"the release itself; plugin {name!r} implements {', '.join(sorted(hooks))}")


def run_audit(cfg: AuditConfig, progress: Any = None) -> AuditResult:
    """Run the canary game through dpl's private step and bound epsilon from below (see the module doc)."""
    cfg.validate()
    start = time.perf_counter()
    seed = cfg.seed
    data_gen = secure_generator(derive_seed(seed, "audit/canaries"))
    data = _CanaryData(cfg, data_gen)
    model = _LinearCanaryModel(data.rows, data.cols)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}

    pm = create_plugin_manager(cfg.plugins)
    plugin_names = active_plugin_names(pm)
    if cfg.inject == "weak_noise":
        pm.register(WeakNoise(cfg.weak_noise_factor), name="audit-inject-weak-noise")
    elif cfg.inject == "no_clip":
        pm.register(NoClip(), name="audit-inject-no-clip")
    elif cfg.inject == "noise_leak":
        _check_leak_supported(pm)
    hook = pm.hook
    B, C, T, m = cfg.batch_size, cfg.max_grad_norm, cfg.steps, cfg.canaries
    q = B / (cfg.examples + m / 2)  # fixed before the inclusion is drawn: it must not depend on it
    N = len(data)

    def optimizer_factory(params):
        return torch.optim.SGD(params, lr=cfg.lr)

    replaced = replaced_hooks(pm)
    if "privatize" in replaced and "configure_mechanism" not in replaced:
        raise ConfigError("a plugin replaces privatize without configure_mechanism: the default accounting would "
                          "not match its noise")
    setup = RunSetup(model=model, trainable=trainable, plugin_names=plugin_names, num_examples=N,
                     expected_batch_size=B, steps=T, sampling_rate=q, accountant=cfg.accountant,
                     optimizer_name="SGD", task="audit", replaced_hooks=replaced, seed=seed,
                     optimizer_factory=optimizer_factory)
    hook.validate_setup(setup=setup)
    mechanism = hook.configure_mechanism(setup=setup)
    if mechanism is None:
        raise ConfigError("no plugin configured a privacy mechanism")
    if cfg.noise_multiplier is not None:
        sigma = float(cfg.noise_multiplier)
    else:
        sigma = float(mechanism.calibrate(cfg.epsilon, cfg.delta, T))
    claimed = float(mechanism.epsilon(sigma, cfg.delta, T)) if sigma > 0 else math.inf

    optimizer = optimizer_factory(list(trainable.values()))
    noise_gen = secure_generator(derive_seed(seed, "audit/noise"))
    sampler = mechanism.batch_sampler(N, max(1, N // B), secure_generator(derive_seed(seed, "audit/sampler")))
    public_gen = secure_generator(derive_seed(seed, "audit/public"))
    weight = model.layer.weight
    weight_name = next(n for n, p in trainable.items() if p is weight)
    unit = B / (cfg.lr * C)  # y_it = <theta_t - theta_{t+1}, u_i> * unit
    scores = torch.zeros(m, dtype=torch.float64)
    log_1mq, log_q = math.log1p(-min(q, 1.0 - 1e-12)), math.log(q)
    batches = _forever(sampler)
    for t in range(T):
        batch = data.batch(next(batches))
        ctx = StepContext(model=model, trainable=trainable, per_example_loss=model.per_example_loss,
                          max_grad_norm=C, noise_multiplier=sigma, expected_batch_size=B, step=t,
                          noise_generator=noise_gen, log=lambda name, value: None,
                          public_seed=int(torch.randint(0, 2 ** 62, (1,), generator=public_gen)), optimizer=optimizer)
        leaked_state = noise_gen.get_state() if cfg.inject == "noise_leak" else None
        before = weight.detach().clone()
        direction = private_step(hook, ctx, batch, cfg.physical_batch_size, mechanism=mechanism.name)
        apply_direction(optimizer, trainable, direction)
        del direction
        observed = data.project(before - weight.detach()) * unit
        if leaked_state is not None:  # the auditor replays the noise from the leaked generator state
            replay = torch.Generator()
            replay.set_state(leaked_state)
            zeros = GradientSum({n: torch.zeros(p.shape, dtype=torch.float32) for n, p in trainable.items()}, 0)
            noise = hook.privatize(ctx=dataclasses.replace(ctx, noise_generator=replay), gradient_sum=zeros)
            observed -= data.project(noise.values[weight_name]) * (B / C)
        if cfg.score == "lr" and sigma > 0:
            scores += torch.logaddexp(torch.full_like(observed, log_1mq),
                                      log_q + (2 * observed - 1) / (2 * sigma ** 2))
        elif cfg.score == "sign":
            scores += torch.sign(observed)
        else:
            scores += observed
        if progress is not None:
            progress(t + 1, T)

    included = data.included.numpy()
    candidates = guesses_for(m, explicit=cfg.guesses)
    guesses, best = score_guesses(scores.numpy(), included, candidates, cfg.delta, cfg.confidence)
    ceiling = perfect_guess_ceiling(m, candidates, cfg.delta, cfg.confidence)
    return AuditResult(config=cfg, mechanism=mechanism.name, plugins=plugin_names, noise_multiplier=sigma,
                       sampling_rate=q, claimed_epsilon=claimed, delta=cfg.delta, confidence=cfg.confidence,
                       canaries=m, included=int(included.sum()), guesses=guesses, best=best,
                       lower_bound=best.bound, ceiling=ceiling, seconds=time.perf_counter() - start,
                       scores=scores.numpy(), membership=included)


# ----------------------------------------------------------------------------------------------------------
# The command


def build_parser() -> Any:
    from jsonargparse import ActionConfigFile, ArgumentParser

    parser = ArgumentParser(prog="dpl audit", exit_on_error=True, description=(
        "Empirical privacy audit in one run (Steinke, Nasr & Jagielski 2023): m gradient canaries, each included "
        "with probability 1/2, trained on by dpl's private step; the number of correct membership guesses gives "
        "a lower bound on epsilon at a stated confidence. A bound above the claimed epsilon is a violation; a "
        "bound below it proves nothing. See docs/audit.md."))
    parser.add_argument("--config", action=ActionConfigFile, help="YAML config (e.g. configs/audit/gaussian.yaml)")
    parser.add_class_arguments(AuditConfig, as_group=False)
    parser.add_argument("--output", type=str | None, default=None, help="write the report as JSON to this file")
    return parser


def audit_command(argv: list[str]) -> int:
    """``dpl audit [--config FILE] [--KEY VALUE ...]``: run an audit, print the report, optionally write JSON."""
    import os

    parser = build_parser()
    args = parser.parse_args(argv)
    values = {f.name: args[f.name] for f in dataclasses.fields(AuditConfig)}
    try:
        cfg = AuditConfig(**values)
        result = run_audit(cfg)
    except DPLError as exc:
        if os.environ.get("DPL_DEBUG"):
            raise
        print(f"dpl: error: {exc}", file=sys.stderr)
        return 2
    print(result.report(), flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result.to_dict(), f, indent=2)
            f.write("\n")
        print(f"  report written to {args.output}")
    return 1 if result.violation else 0  # a CI job fails on a VIOLATION
