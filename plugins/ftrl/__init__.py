"""The ``ftrl`` plugin: correlated-noise DP training (nu-DP-FTRL, banded, BLT; ``independent`` = DP-SGD without
amplification). It replaces ``privatize`` and ``configure_mechanism``.

Release at step t (0-based), for a run of T steps with b = floor(N / B) steps per epoch:

    g~_t = (sum_i clip(g_i) + sigma * C_clip * sens * w_t) / B,      w_t = (C^-1 Z)_t,  Z i.i.d. N(0, I)

with C the lower-triangular Toeplitz *strategy* of the chosen family (``strategies.py``; the beta of Choquette-Choo
et al. (ICLR 2024) are the coefficients of C^-1, the *noising* matrix), ``sens`` its sensitivity for the
participation pattern of the mechanism's sampler (one secret shuffled order, the same every epoch: every example
participates at most k = ceil(T / b) times, exactly b steps apart), and sigma the noise multiplier of the whole run,
seen as one Gaussian mechanism (``mechanism.py``: calibrated with the exact analytic-Gaussian conversion, no
amplification).

``PrivateGradient.noise_std`` is the per-step marginal std of one coordinate of the noise in g~_t:
sigma * C_clip * sens * sqrt(sum_{s<=t} beta_s^2) / B. It changes with t; post-processing (denoise, adambc)
reads it from the release.

State: public (``state_dict``, in the .ckpt): the step index and the family's parameters. Secret
(``secret_state_dict``, only in the owner-only ``.secret`` sidecar): the stream's buffers / past noise /
generator states; the mechanism keeps the secret permutation. Without the sidecar a resume is refused.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch

from dpl.errors import ConfigError, PluginError
from dpl.core.gradients import GradientSum, PrivateGradient
from dpl.core.hookspecs import hookimpl
from dpl.core.noise import normal
from dpl.core.step import RunSetup, StepContext
from dpl_plugins.ftrl.mechanism import FTRLMechanism, ShuffledBatchSampler
from dpl_plugins.ftrl.strategies import FAMILIES, Strategy, make_strategy
from dpl_plugins.ftrl.streams import BandedStream, BLTStream, DenseKeepStream, DenseRegenerateStream

__all__ = ["FTRLMechanism", "FTRLPlugin", "ShuffledBatchSampler"]

log = logging.getLogger("dpl")

MEMORY = ("regenerate", "keep")
BANDED_COEFFICIENTS = ("optimized", "truncated")


class FTRLPlugin:
    """Correlated Gaussian noise across steps (``privatize``) and its mechanism (``configure_mechanism``).

    Args:
        noise: ``blt`` (default), ``banded``, ``nu_ftrl`` or ``independent``.
        nu: nu of ``nu_ftrl`` (and the start / truncation of ``banded``, the start of ``blt``); default 1 / T.
        bands: number of bands of ``banded`` (memory: bands - 1 vectors of the model's size).
        banded_coefficients: ``optimized`` (fitted at setup for this run length and participation pattern) or
            ``truncated`` (the first ``bands`` nu-DP-FTRL coefficients, renormalized to unit column norm).
        nbuf: buffers of ``blt`` (memory: nbuf vectors of the model's size).
        memory: ``nu_ftrl`` only: ``regenerate`` (default: re-draw past noise from per-step generator states;
            O(d) memory, O(t d) work at step t) or ``keep`` (store all past noise: T x d floats).
        sampling: ``shuffle`` (the only one: fixed-size batches from one secret order). ``poisson`` is refused:
            there is no amplification analysis here for correlated noise.
        drop_remainder: when B does not divide N, leave out N mod B examples (a secret random subset: the end of
            the secret permutation). ``false``: refuse such a batch size instead.
    """

    def __init__(self, noise: Literal["blt", "banded", "nu_ftrl", "independent"] = "blt", nu: float | None = None,
                 bands: int = 4, banded_coefficients: Literal["optimized", "truncated"] = "optimized", nbuf: int = 4,
                 memory: Literal["regenerate", "keep"] = "regenerate", sampling: Literal["shuffle"] = "shuffle",
                 drop_remainder: bool = True) -> None:
        if noise not in FAMILIES:
            raise ConfigError(f"ftrl: noise must be one of {', '.join(FAMILIES)}, got {noise!r}")
        if sampling != "shuffle":
            raise ConfigError(f"ftrl: sampling {sampling!r} is not supported: correlated noise is accounted without "
                              "amplification, for fixed-size batches from one shuffled order (sampling: shuffle)")
        if nu is not None and not 0 <= float(nu) < 1:
            raise ConfigError(f"ftrl: nu must be in [0, 1), got {nu}")
        if int(bands) < 1 or int(nbuf) < 1:
            raise ConfigError("ftrl: bands and nbuf must be >= 1")
        if banded_coefficients not in BANDED_COEFFICIENTS:
            raise ConfigError(f"ftrl: banded_coefficients must be optimized or truncated, got {banded_coefficients!r}")
        if memory not in MEMORY:
            raise ConfigError(f"ftrl: memory must be regenerate or keep, got {memory!r}")
        self.noise = noise
        self.nu = None if nu is None else float(nu)
        self.bands = int(bands)
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
        n, batch = setup.num_examples, setup.expected_batch_size
        if n % batch and not self.drop_remainder:
            raise ConfigError(f"ftrl: batch size {batch} does not divide the {n} training examples into equal "
                              "batches; set drop_remainder: true or a batch size that divides N")

    @hookimpl
    def configure_mechanism(self, setup: RunSetup) -> FTRLMechanism:
        n, batch = setup.num_examples, setup.expected_batch_size
        every = max(1, n // batch)
        if n % batch:
            log.info("dpl: ftrl: %d examples, batch size %d: %d batches per epoch, the last %d examples of the secret "
                     "order (a random subset) are left out", n, batch, every, n % batch)
        strategy = make_strategy(self.noise, setup.steps, every, nu=self.nu, bands=self.bands,
                                 banded_coefficients=self.banded_coefficients, nbuf=self.nbuf)
        log.info("dpl: ftrl noise: %s; fitted in %.2f s", strategy.describe(), strategy.fit_seconds)
        if self.noise == "nu_ftrl" and self.memory == "keep":
            log.info("dpl: ftrl nu_ftrl memory: keep stores every step's noise: %d x d floats", setup.steps)
        self.mechanism = FTRLMechanism(strategy, n, batch)
        self.stream = None
        return self.mechanism

    @property
    def strategy(self) -> Strategy:
        if self.mechanism is None:
            raise PluginError("ftrl: configure_mechanism has not run")
        return self.mechanism.strategy

    def _new_stream(self) -> Any:
        strategy = self.strategy
        if self.noise == "banded":
            return BandedStream(strategy.c[:self.bands])
        if self.noise == "blt":
            return BLTStream(strategy.params["omega"], strategy.params["theta"])
        if self.noise == "nu_ftrl":
            return DenseKeepStream(strategy.beta) if self.memory == "keep" else DenseRegenerateStream(strategy.beta)
        return None

    # --- the step -------------------------------------------------------------------------------------
    @hookimpl
    def privatize(self, ctx: StepContext, gradient_sum: GradientSum) -> PrivateGradient:
        strategy = self.strategy
        if ctx.step != self.step:
            raise PluginError(f"ftrl: step {ctx.step} but the noise stream is at step {self.step}")
        if ctx.step >= strategy.steps:
            raise ConfigError(f"ftrl: step {ctx.step} is beyond the {strategy.steps} steps the noise was fitted for")
        sigma, clip, batch = ctx.noise_multiplier, ctx.max_grad_norm, float(ctx.expected_batch_size)
        sens = strategy.sensitivity
        scale = (sigma * sens) * clip if sigma > 0 else 0.0
        totals = gradient_sum.values
        values: dict[str, torch.Tensor] = {}
        if scale == 0:
            values = {k: v / batch for k, v in totals.items()}
            noise_std = 0.0
        elif self.noise == "independent":
            # Exactly the default Gaussian step with noise multiplier sigma * sens (DP-SGD without amplification).
            for key, total in totals.items():
                noise = normal(total.shape, ctx.noise_generator, device=total.device, dtype=total.dtype)
                values[key] = noise.mul_(scale).add_(total).div_(batch)
            noise_std = scale / batch
        else:
            if self.stream is None:
                self.stream = self._new_stream()

            if isinstance(self.stream, DenseRegenerateStream):
                if not isinstance(ctx.noise_generator, torch.Generator):
                    raise ConfigError("ftrl: memory: regenerate needs a replayable torch.Generator noise source")

                def draw(source: Any) -> dict[str, torch.Tensor]:
                    return {k: normal(v.shape, source, device=v.device, dtype=v.dtype) for k, v in totals.items()}

                self.stream.record(ctx.noise_generator)
                w = self.stream.push(draw(ctx.noise_generator), draw, ctx.noise_generator.device)
                for key, total in totals.items():
                    values[key] = w.pop(key).mul_(scale).add_(total).div_(batch)
            else:
                # key by key: draw z, turn it into w_t, release; at most one extra tensor of one key at a time
                for key, total in totals.items():
                    z = normal(total.shape, ctx.noise_generator, device=total.device, dtype=total.dtype)
                    w = self.stream.push(key, z)
                    if self.stream.in_place:
                        values[key] = w.mul_(scale).add_(total).div_(batch)
                    else:
                        values[key] = torch.add(total, w, alpha=scale).div_(batch)
                    del z, w
                self.stream.end_step()
            noise_std = scale * strategy.marginal_std(ctx.step) / batch
        self.step += 1
        ctx.log("ftrl/noise_std", noise_std)
        return PrivateGradient(values, noise_std=noise_std, mechanism=FTRLMechanism.name, expected_batch_size=batch,
                               step=ctx.step, info={"ftrl_family": self.noise, "ftrl_sensitivity": sens})

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
