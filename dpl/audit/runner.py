"""Empirical privacy audit in one training run (``dpl audit``).

The audit of Steinke, Nasr & Jagielski, "Privacy auditing with one (1) training run" (NeurIPS 2023), with
white-box gradient canaries, run through dpl's private engine (:class:`~dpl.core.engine.PrivateEngine`, the one
``dpl fit`` drives):

1. **Canaries.** ``m`` canaries, each a training example whose per-example gradient is a chosen direction
   ``u_i`` of norm ``canary_norm * C`` (>= C, so clipping is what bounds it): a *Dirac* canary (one weight
   entry) or a random rank-one direction of a small linear model ``W`` (``rows x cols``). Each canary is
   included in the training set independently with probability 1/2 (``S_i = +1``) or left out (``S_i = -1``).
2. **Training.** The included canaries and ``examples`` ordinary examples (random directions, the other
   gradients in each batch) are trained on for ``steps`` steps by the engine, with a plugin manager from
   :func:`dpl.core.plugin_manager.create_plugin_manager`: the mechanism's own batch sampler (Poisson for
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

import math
import time
from typing import Any

import torch

from dpl.audit.bound import guesses_for, perfect_guess_ceiling, score_guesses
from dpl.audit.canaries import CanaryData, LinearCanaryModel
from dpl.audit.config import AuditConfig, AuditResult
from dpl.audit.injections import NoClip, PerRowClip, UnsplitThresholds, WeakNoise
from dpl.core.engine import PrivateEngine
from dpl.core.gradients import GradientSum
from dpl.core.noise import replay_source
from dpl.core.plugin_manager import active_plugin_names, create_plugin_manager, implemented_hooks
from dpl.core.privacy import PrivacyConfig
from dpl.core.sampling import derive_seed, secure_generator
from dpl.core.step import CLIPPING_COUNTS_KEY, StepContext
from dpl.core.update import apply_direction
from dpl.errors import ConfigError


def _check_leak_supported(pm: Any) -> None:
    named = dict(pm.list_name_plugin())
    for name in active_plugin_names(pm):
        hooks = set(implemented_hooks(named[name])) & {"privatize", "post_process", "precondition"}
        if hooks:
            raise ConfigError(f"inject: noise_leak replays the default gaussian noise and needs the update to be "
                              f"the release itself; plugin {name!r} implements {', '.join(sorted(hooks))}")


def run_audit(cfg: AuditConfig, progress: Any = None) -> AuditResult:
    """Run the canary game through dpl's private engine and bound epsilon from below (see the module doc)."""
    cfg.validate()
    start = time.perf_counter()
    data = CanaryData(cfg, secure_generator(derive_seed(cfg.seed, "audit/canaries")))
    model = LinearCanaryModel(data.rows, data.cols, cfg.layers)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}

    pm = create_plugin_manager(cfg.plugins)
    plugin_names = active_plugin_names(pm)
    if cfg.inject == "weak_noise":
        pm.register(WeakNoise(cfg.weak_noise_factor), name="audit-inject-weak-noise")
    elif cfg.inject == "no_clip":
        pm.register(NoClip(pm.get_plugin("clip")), name="audit-inject-no-clip")
    elif cfg.inject == "unsplit_thresholds":
        pm.register(UnsplitThresholds(pm.get_plugin("clip")), name="audit-inject-unsplit-thresholds")
    elif cfg.inject == "noise_leak":
        _check_leak_supported(pm)
    elif cfg.inject == "per_row_clip":
        pm.register(PerRowClip(), name="audit-inject-per-row-clip")
    B, C, T, m = cfg.batch_size, cfg.max_grad_norm, cfg.steps, cfg.canaries
    q = B / (cfg.examples + m / 2)  # fixed before the inclusion is drawn: it must not depend on it

    def optimizer_factory(params):
        return torch.optim.SGD(params, lr=cfg.lr)

    privacy = PrivacyConfig(target_epsilon=cfg.target_epsilon, target_delta=cfg.target_delta,
                            noise_multiplier=cfg.noise_multiplier, max_grad_norm=C, batch_size=B, physical_batch_size=cfg.physical_batch_size,
                            accountant=cfg.accountant, seed=cfg.seed, unit=cfg.unit,
                            max_rows_per_user=cfg.max_rows_per_user, clipping=cfg.clipping,
                            clipping_thresholds=cfg.clipping_thresholds)
    engine = PrivateEngine(privacy, cfg.plugins, plugin_manager=pm, seed_namespace="audit/")
    engine.setup(model, trainable=trainable, num_rows=len(data), steps=T, sampling_rate=q,
                 optimizer_factory=optimizer_factory, users=data.user_keys)
    engine.start("cpu")
    sigma = float(engine.noise_multiplier)
    claimed = engine.final_epsilon()

    optimizer = optimizer_factory(list(trainable.values()))
    weight_names = [n for n, p in trainable.items() if any(p is part.weight for part in model.parts)]
    counts = len(pm.get_plugin("clip").thresholds) if privacy.adaptive_clipping else 0
    unit = B / (cfg.lr * C)  # y_it = <theta_t - theta_{t+1}, u_i> * unit
    scores = torch.zeros(m, dtype=torch.float64)
    log_1mq, log_q = math.log1p(-min(q, 1.0 - 1e-12)), math.log(q)
    batches = engine.batches()
    for t in range(T):
        rows = next(batches)
        batch = engine.tag(data.batch(rows), rows)
        leaked_state = engine.secret_state_dict()["noise_rng"] if cfg.inject == "noise_leak" else None
        before = model.weight().detach().clone()
        direction = engine.step(batch, model=model, trainable=trainable, per_example_loss=model.per_example_loss,
                                optimizer=optimizer)
        apply_direction(optimizer, trainable, direction)
        del direction
        observed = data.project(before - model.weight().detach()) * unit
        if leaked_state is not None:  # the auditor replays the noise from the leaked generator state
            replayed = _replayed_noise(pm, engine.noise_source, leaked_state, trainable, sigma, C, B, t, counts)
            observed -= data.project(torch.cat([replayed[name] for name in weight_names])) * (B / C)
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
    guesses, best = score_guesses(scores.numpy(), included, candidates, cfg.target_delta, cfg.confidence)
    ceiling = perfect_guess_ceiling(m, candidates, cfg.target_delta, cfg.confidence)
    return AuditResult(config=cfg, mechanism=engine.mechanism.name, plugins=plugin_names, noise_multiplier=sigma,
                       sampling_rate=q, claimed_epsilon=claimed, delta=cfg.target_delta, confidence=cfg.confidence,
                       canaries=m, included=int(included.sum()), guesses=guesses, best=best,
                       lower_bound=best.bound, ceiling=ceiling, seconds=time.perf_counter() - start,
                       scores=scores.numpy(), membership=included)


def _replayed_noise(pm: Any, source: Any, state: torch.Tensor, trainable: dict[str, torch.Tensor], sigma: float,
                    C: float, B: int, step: int, counts: int = 0) -> dict[str, torch.Tensor]:
    """The noise of a step's release, replayed from the noise generator's leaked state (``privatize`` on zeros;
    ``counts``: the groups of adaptive clipping thresholds, whose counts' noise is drawn first)."""
    values = {n: torch.zeros(p.shape, dtype=torch.float32) for n, p in trainable.items()}
    if counts:
        values[CLIPPING_COUNTS_KEY] = torch.zeros(counts)
    zeros = GradientSum(values, 0)
    ctx = StepContext(model=None, trainable=trainable, per_example_loss=None, max_grad_norm=C, noise_multiplier=sigma,
                      expected_batch_size=B, step=step, noise_source=replay_source(source, state),
                      log=lambda name, value: None)
    return pm.hook.privatize(ctx=ctx, gradient_sum=zeros).values
