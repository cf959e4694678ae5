"""The ``ftrl`` plugin: correlated-noise DP training (nu-DP-FTRL, banded, BLT; amplified banded matrix
factorization; ``independent`` = DP-SGD without amplification). It replaces ``privatize`` and
``configure_mechanism``.

Release at step t (0-based), for a run of T steps:

    g~_t = (sum_i clip(g_i) + sigma * C_clip * sens * w_t) / B,      w_t = (C^-1 Z)_t,  Z i.i.d. N(0, I)

with C the lower-triangular Toeplitz *strategy* of the chosen family (``strategies.py``; the beta of
Choquette-Choo et al. (ICLR 2024) are the coefficients of C^-1, the *noising* matrix), sigma the noise multiplier and ``sens`` the strategy's
sensitivity for the mechanism's sampler (``mechanism.py``): ``shuffle`` (one secret order, the same every epoch;
sens for k = ceil(T / b) participations b = floor(N / B) steps apart; one Gaussian mechanism, no amplification) or
``cyclic_poisson`` (amplified banded: b partitions, Poisson sampling within partition t mod b; sens = the column
norm; ceil(T / b) subsampled Gaussian steps). Under replace-one adjacency the noise is doubled.

``PrivateGradient.noise_std`` is the per-step marginal std of one coordinate of the noise in g~_t:
sigma * C_clip * sens * sqrt(sum_{s<=t} beta_s^2) / B. It changes with t; post-processing (denoise, adambc)
reads it from the release.

State: public (``state_dict``, in the .ckpt): the step index and the family's parameters. Secret
(``secret_state_dict``, only in the owner-only ``.secret`` sidecar): the stream's buffers / past noise /
generator states; the mechanism keeps the secret permutation and sampler states. Without the sidecar a resume is
refused.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch

from dpl.api import (ConfigError, GradientSum, PluginError, PrivateGradient, RunSetup, SecureNormal, StepContext,
                     hookimpl, noisy_mean_, noisy_means_, normals_like)
from dpl_plugins.ftrl.choice import band_range, choose
from dpl_plugins.ftrl.mechanism import CyclicPoissonSampler, FTRLMechanism, SampledStrategy, ShuffledBatchSampler
from dpl_plugins.ftrl.strategies import Strategy, make_strategy
from dpl_plugins.ftrl.streams import BandedStream, BLTStream, DenseKeepStream, DenseRegenerateStream

__all__ = ["CyclicPoissonSampler", "FTRLMechanism", "FTRLPlugin", "ShuffledBatchSampler"]

log = logging.getLogger("dpl")


class FTRLPlugin:
    """Correlated Gaussian noise across steps (``privatize``) and its mechanism (``configure_mechanism``).

    Args:
        noise: ``blt``, ``banded``, ``nu_ftrl`` or ``independent``. Default (unset): chosen at calibration among
            BLT (shuffled), independent (shuffled) and amplified banded (b in ``band_range``, b = 1 being amplified
            DP-SGD) by the least expected prefix-sum error at the run's (epsilon, delta); with
            ``privacy.noise_multiplier`` instead of a target epsilon: amplified banded with the largest b tried.
        sampling: ``shuffle`` (fixed-size batches from one secret order, no amplification) or ``cyclic_poisson``
            (amplified banded: ``banded`` only). Default: ``cyclic_poisson`` for ``banded`` and for an unset
            ``noise``, ``shuffle`` otherwise (with ``shuffle`` and no ``noise``: BLT or independent, the least error).
        nu: nu of ``nu_ftrl`` (and the start / truncation of ``banded``, the start of ``blt``); default 1 / T.
        bands: number of bands of ``banded`` (memory: bands - 1 vectors of the model's size). Default: the value in
            1, 2, 4, ..., min(steps per epoch, T, ``max_bands``) with the least expected error (for
            ``cyclic_poisson`` at the run's (epsilon, delta); with a fixed sigma the largest).
        max_bands: the largest band count the automatic choice tries (memory: max_bands - 1 model-size vectors).
        banded_coefficients: ``optimized`` (fitted at setup for this run length and participation pattern) or
            ``truncated`` (the first ``bands`` nu-DP-FTRL coefficients, renormalized to unit column norm).
        nbuf: the most buffers ``blt`` may use (memory: one vector of the model's size each); the fit keeps the
            fewest whose expected error is within 1% of the best.
        memory: ``nu_ftrl`` only: ``regenerate`` (default: re-draw past noise from per-step generator states;
            O(d) memory, O(t d) work at step t) or ``keep`` (store all past noise: T x d floats).
        drop_remainder: ``shuffle``: when B does not divide N, leave out N mod B examples (a secret random subset:
            the end of the secret permutation). ``false``: refuse such a batch size instead.
    """

    description = "correlated noise across steps: amplified banded MF, BLT, banded, nu-DP-FTRL"

    def __init__(self, noise: Literal["blt", "banded", "nu_ftrl", "independent"] | None = None,
                 sampling: Literal["shuffle", "cyclic_poisson"] | None = None, nu: float | None = None,
                 bands: int | None = None, max_bands: int = 16,
                 banded_coefficients: Literal["optimized", "truncated"] = "optimized", nbuf: int = 4,
                 memory: Literal["regenerate", "keep"] = "regenerate", drop_remainder: bool = True) -> None:
        if nu is not None and not 0 <= float(nu) < 1:
            raise ConfigError(f"ftrl: nu must be in [0, 1), got {nu}")
        if (bands is not None and int(bands) < 1) or int(nbuf) < 1 or int(max_bands) < 1:
            raise ConfigError("ftrl: bands, max_bands and nbuf must be >= 1")
        if sampling == "cyclic_poisson" and noise not in (None, "banded"):
            raise ConfigError(f"ftrl: sampling: cyclic_poisson (amplified banded) needs noise: banded, not {noise}: "
                              "its privacy analysis needs a banded strategy")
        self.noise = noise
        self.sampling = sampling or ("cyclic_poisson" if noise in (None, "banded") else "shuffle")
        self.nu = None if nu is None else float(nu)
        self.bands = None if bands is None else int(bands)
        self.max_bands = int(max_bands)
        self.banded_coefficients = banded_coefficients
        self.nbuf = int(nbuf)
        self.memory = memory
        self.drop_remainder = bool(drop_remainder)
        self.mechanism: FTRLMechanism | None = None
        self.stream: Any = None
        self.step = 0  # index of the next release

    # --- setup ----------------------------------------------------------------------------------------
    @hookimpl
    def validate_setup(self, setup: RunSetup) -> None:
        if self.noise == "nu_ftrl" and self.memory == "regenerate" and setup.secure_noise:
            raise ConfigError("ftrl: memory: regenerate replays past noise from generator states, which "
                              "privacy.secure_noise (OS CSPRNG) cannot do; use memory: keep or another noise family")
        if setup.unit.bounds_rows:
            raise ConfigError("ftrl: privacy.user_sampling: rows has no correlated-noise accounting (the user-level "
                              "accountant is the independent Gaussian's); use user_sampling: users, where every "
                              "participation is a user's")
        n, batch = setup.population, setup.expected_batch_size
        if self.sampling == "shuffle" and n % batch and not self.drop_remainder:
            raise ConfigError(f"ftrl: batch size {batch} does not divide the {n} training examples into equal "
                              "batches; set drop_remainder: true or a batch size that divides N")
        every = max(1, n // batch)
        if self.sampling == "cyclic_poisson" and self.bands is not None and self.bands > every:
            raise ConfigError(f"ftrl: bands={self.bands} with cyclic_poisson sampling needs partitions of at least "
                              f"B={batch} examples: at most floor(N / B) = {every} bands")

    def _strategy(self, family: str, steps: int, every: int, bands: int | None = None) -> Strategy:
        return make_strategy(family, steps, every, nu=self.nu, bands=bands or 1,
                             banded_coefficients=self.banded_coefficients, nbuf=self.nbuf)

    @hookimpl
    def configure_mechanism(self, setup: RunSetup) -> FTRLMechanism:
        n, batch, steps = setup.population, setup.expected_batch_size, setup.steps
        every = max(1, n // batch)
        bands = [self.bands] if self.bands is not None else band_range(every, steps, self.max_bands)
        if self.sampling == "cyclic_poisson":
            candidates = [SampledStrategy(self._strategy("banded", steps, steps, b), "cyclic_poisson")
                          for b in bands]
            if self.noise is None:
                candidates += [SampledStrategy(self._strategy(f, steps, every)) for f in ("blt", "independent")]
        elif self.noise in ("banded", None):  # shuffled: the same sigma for every strategy: the least error is best
            shuffled = [SampledStrategy(self._strategy("banded", steps, every, b)) for b in bands] if self.noise else \
                [SampledStrategy(self._strategy(f, steps, every)) for f in ("blt", "independent")]
            candidates = [min(shuffled, key=lambda p: p.strategy.expected_error)]
        else:
            candidates = [SampledStrategy(self._strategy(self.noise, steps, every))]
        if self.sampling == "shuffle" and n % batch:
            log.info("dpl: ftrl: %d examples, batch size %d: %d batches per epoch, the last %d examples of the secret "
                     "order (a random subset) are left out", n, batch, every, n % batch)
        for candidate in candidates:
            log.info("dpl: ftrl candidate: %s; %s; fitted in %.2f s", candidate.label(), candidate.describe(),
                     candidate.strategy.fit_seconds)
        if self.noise == "nu_ftrl" and self.memory == "keep":
            log.info("dpl: ftrl nu_ftrl memory: keep stores every step's noise: %d x d floats", steps)
        self.mechanism = FTRLMechanism(candidates[0], n, batch, accountant=setup.accountant,
                                       candidates=candidates[1:], chooser=choose, replay_batches=setup.seed is not None)
        self.mechanism.unit = setup.unit.kind  # user-level sampling: the examples it orders and samples are users
        self.stream = None
        return self.mechanism

    @property
    def strategy(self) -> Strategy | None:
        """The sampled strategy; None before ``configure_mechanism`` (a property that raised would break
        plugin registration under pluggy < 1.7, which reads every attribute of a plugin)."""
        return None if self.mechanism is None else self.mechanism.strategy

    def _new_stream(self) -> Any:
        strategy = self.strategy
        if strategy is None:
            raise PluginError("ftrl: configure_mechanism has not run")
        if strategy.family == "banded":
            return BandedStream(strategy.c[:int(strategy.params["bands"])])
        if strategy.family == "blt":
            return BLTStream(strategy.params["omega"], strategy.params["theta"])
        if strategy.family == "nu_ftrl":
            return DenseKeepStream(strategy.beta) if self.memory == "keep" else DenseRegenerateStream(strategy.beta)
        return None

    # --- the step -------------------------------------------------------------------------------------
    @hookimpl
    def privatize(self, ctx: StepContext, gradient_sum: GradientSum) -> PrivateGradient:
        mechanism = self.mechanism
        if mechanism is None:
            raise PluginError("ftrl: configure_mechanism has not run")
        mechanism.settle(mechanism.sampled_strategy)
        strategy = mechanism.strategy
        if ctx.step != self.step:
            raise PluginError(f"ftrl: step {ctx.step} but the noise stream is at step {self.step}")
        if ctx.step >= strategy.steps:
            raise ConfigError(f"ftrl: step {ctx.step} is beyond the {strategy.steps} steps the noise was fitted for")
        sigma, clip, batch = ctx.noise_multiplier, ctx.max_grad_norm, float(ctx.expected_batch_size)
        sens = mechanism.noise_scale
        scale = (sigma * sens) * clip if sigma > 0 else 0.0
        totals = gradient_sum.values
        values: dict[str, torch.Tensor] = {}
        if scale == 0:
            values = {k: v / batch for k, v in totals.items()}
            noise_std = 0.0
        elif len(strategy.c) == 1 or not strategy.c[1:].any():
            # C = I (independent; banded with b = 1): exactly the default Gaussian step with noise multiplier
            # sigma * sens (with amplification when the sampling is cyclic_poisson with b = 1: DP-SGD itself)
            values = noisy_means_(totals, scale, batch, ctx.noise_source)  # into the sum, as the default does
            noise_std = scale / batch
        else:
            if self.stream is None:
                self.stream = self._new_stream()
            if isinstance(self.stream, DenseRegenerateStream):
                if isinstance(ctx.noise_source, SecureNormal):
                    raise ConfigError("ftrl: memory: regenerate needs a replayable noise source (not secure_noise)")

                def draw(source: Any) -> dict[str, torch.Tensor]:
                    return normals_like(totals, source)

                self.stream.record(ctx.noise_source)
                w = self.stream.push(draw(ctx.noise_source), draw)
                for key, total in totals.items():
                    values[key] = noisy_mean_(w.pop(key), scale, total, batch)
            else:
                # z drawn for all keys together (the same values as key by key), then key by key: turn z into w_t,
                # release; each z becomes its release (in place) or is dropped once released
                noise = normals_like(totals, ctx.noise_source)
                for key, total in totals.items():
                    z = noise.pop(key)
                    w = self.stream.push(key, z)
                    if self.stream.in_place:
                        values[key] = noisy_mean_(w, scale, total, batch)
                    else:
                        values[key] = torch.add(total, w, alpha=scale).div_(batch)
                    del z, w
                self.stream.end_step()
            noise_std = scale * strategy.marginal_std(ctx.step) / batch
        self.step += 1
        ctx.log("ftrl/noise_std", noise_std)
        return PrivateGradient(values, noise_std=noise_std, mechanism=mechanism.name, expected_batch_size=batch,
                               step=ctx.step, info={"ftrl_family": strategy.family, "ftrl_sampling": mechanism.sampling,
                                                    "ftrl_sensitivity": sens, "adjacency": mechanism.adjacency})

    # --- state ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Public: the step index and the family's (fitted) parameters."""
        params = self.mechanism.state_dict()["params"] if self.mechanism is not None else None
        return {"step": self.step, "noise": self.noise, "params": params}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("noise") != self.noise:
            raise ConfigError(f"ftrl: the checkpoint used noise {state.get('noise')!r}, this run {self.noise!r}: "
                              "the correlated stream cannot change family")
        self.step = int(state["step"])

    def secret_state_dict(self) -> dict[str, Any]:
        """Secret: the stream's buffers / past noise / generator states (derived from the noise)."""
        return {"stream": None if self.stream is None else self.stream.secret_state()}

    def load_secret_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is None:
            raise ConfigError("ftrl: resumed without the checkpoint's .secret sidecar: the correlated noise stream "
                              "cannot continue privately; resume with the sidecar or start a new run")
        self.stream = None
        if state.get("stream") is not None:
            self.stream = self._new_stream()
            self.stream.load_secret_state(state["stream"])
