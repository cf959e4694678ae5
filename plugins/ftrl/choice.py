"""ftrl's automatic choices: the candidate strategies of a run and the one with the least expected error.

The objective is the expected prefix-sum error of the run at its privacy target: sigma(strategy; epsilon, delta) x
``Strategy.expected_error`` (the RMS over the steps of the per-coordinate std of the noise in the prefix sums of
the released gradients, in units of C_clip / B). sigma comes from each candidate's own accounting -- the exact
Gaussian mechanism for the shuffled ones (independent of the strategy), the PRV accountant for ceil(T / b) subsampled
Gaussian steps at rate B / floor(N / b) for amplified banded -- so the comparison is at equal (epsilon, delta).
"""

from __future__ import annotations

import logging

from dpl_plugins.ftrl.mechanism import FTRLMechanism, SampledStrategy

log = logging.getLogger("dpl")


def band_range(steps_per_epoch: int, steps: int, max_bands: int) -> list[int]:
    """Band counts tried: powers of two up to the cap min(steps per epoch, T, max_bands), and the cap itself (first:
    the fallback when there is no target epsilon to compare at)."""
    cap = max(1, min(int(steps_per_epoch), int(steps), int(max_bands)))
    return [cap] + [b for b in (2 ** i for i in range(cap.bit_length())) if b < cap]


def choose(mechanism: FTRLMechanism, target_epsilon: float, delta: float, steps: int) -> SampledStrategy:
    """The candidate with the least expected error at (target_epsilon, delta); one log line with every candidate's
    error (amplified DP-SGD's among them)."""
    scored = []
    for candidate in [mechanism.sampled_strategy, *mechanism.candidates]:
        sigma = mechanism.calibrate_strategy(candidate, target_epsilon, delta, steps)
        scored.append((sigma * candidate.strategy.expected_error, sigma, candidate))
    best = min(scored, key=lambda s: s[0])
    shown = "; ".join(f"{p.label()}: {e:.4g} (sigma={s:.3f})" for e, s, p in sorted(scored, key=lambda s: s[0]))
    log.info("dpl: ftrl chose %s: least expected prefix-sum error at epsilon=%g, delta=%.3g over %d steps, in units "
             "of C/B: %s", best[2].label(), target_epsilon, delta, steps, shown)
    return best[2]
