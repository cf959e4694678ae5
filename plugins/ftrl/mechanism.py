"""The ``ftrl`` mechanism: fixed-size batches from one secret shuffled order, and the accounting of the whole run
as one Gaussian mechanism on the sensitivity-normalised stream (no amplification by sampling)."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Sampler

from dpl.api import ConfigError, Segment
from dpl_plugins.ftrl.strategies import Strategy, strategy_from_params

log = logging.getLogger("dpl")


class ShuffledBatchSampler(Sampler[list[int]]):
    """Batches of exactly B examples from one secret permutation, the same order every epoch.

    The batch of global step t is slot t mod b of the permutation (b = steps per epoch = floor(N / B)): every
    example is in one slot, so it takes part in steps i, i + b, i + 2b, ... only. The last N - b B positions of
    the permutation (a secret, uniformly random subset of N mod B examples) are never used.

    Each ``__iter__`` yields the batches from the next step to the end of that step's epoch (a resumed run starts
    mid-epoch at ``start_step``). The batch of a step is tied to the step, not to how many batches the loader
    drew: if an iteration is abandoned before its epoch ends (``limit_train_batches``) and a new one starts,
    the sampler cannot know which batches were trained and refuses (a broken pattern would break the privacy
    analysis).
    """

    def __init__(self, mechanism: FTRLMechanism, generator: torch.Generator, start_step: int = 0) -> None:
        self.mechanism = mechanism
        self.generator = generator
        self.batch_size = mechanism.batch_size
        self.steps_per_epoch = mechanism.every
        self.position = int(start_step)
        self._open = False

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[list[int]]:
        if self._open:
            raise ConfigError("ftrl: the training loader stopped before the end of an epoch (limit_train_batches?); "
                              "ftrl's batches follow one fixed order and every epoch must run to its end")
        permutation = self.mechanism.ensure_permutation(self.generator)
        b, size = self.steps_per_epoch, self.batch_size
        end = (self.position // b + 1) * b
        self._open = True
        while self.position < end:
            slot = self.position % b
            self.position += 1
            if self.position == end:
                self._open = False  # the epoch's last batch is handed out: a consumer may stop right after it
            yield permutation[slot * size:(slot + 1) * size].tolist()


class FTRLMechanism:
    """One Gaussian mechanism with noise multiplier sigma on C X / sens (sens: the strategy's sensitivity for the
    b-periodic participation pattern, k = ceil(T / b) participations), released through C^-1.

    epsilon after t steps is exact for the Gaussian mechanism (Balle & Wang 2018, the analytic Gaussian
    mechanism): the first t releases have sensitivity sens_t <= sens_T, so their noise multiplier is
    sigma * sens_T / sens_t.
    """

    name = "ftrl"

    def __init__(self, strategy: Strategy, num_examples: int, batch_size: int) -> None:
        self.strategy = strategy
        self.num_examples = int(num_examples)
        self.batch_size = int(batch_size)
        self.every = strategy.every
        self.permutation: torch.Tensor | None = None

    @property
    def steps(self) -> int:
        return self.strategy.steps

    # --- sampling -------------------------------------------------------------------------------------
    def ensure_permutation(self, generator: torch.Generator) -> torch.Tensor:
        if self.permutation is None:
            self.permutation = torch.randperm(self.num_examples, generator=generator)
        return self.permutation

    def batch_sampler(self, num_examples: int, steps_per_epoch: int, generator: torch.Generator,
                      start_step: int = 0) -> Sampler:
        if num_examples != self.num_examples or steps_per_epoch != self.every:
            raise ConfigError(f"ftrl: the mechanism was set up for N={self.num_examples}, {self.every} steps per "
                              f"epoch, got N={num_examples}, {steps_per_epoch}")
        return ShuffledBatchSampler(self, generator, start_step)

    # --- accounting -----------------------------------------------------------------------------------
    def _check_steps(self, steps: int) -> None:
        if steps > self.steps:
            raise ConfigError(f"ftrl: its noise was fitted and accounted for {self.steps} steps, asked about {steps}")

    def calibrate(self, target_epsilon: float, delta: float, steps: int) -> float:
        from dpl.api import calibrate_gaussian_mechanism

        self._check_steps(steps)
        # epsilon(sigma, steps) = G(sigma * sens_T / sens_steps), G the exact Gaussian-mechanism epsilon
        return calibrate_gaussian_mechanism(target_epsilon, delta) * float(self.strategy.sens_prefix[steps - 1]) \
            / self.strategy.sensitivity

    def epsilon(self, noise_multiplier: float, delta: float, steps: int) -> float:
        from dpl.api import gaussian_mechanism_epsilon

        if steps <= 0:
            return 0.0
        if noise_multiplier == 0 or steps > self.steps:
            return math.inf  # beyond the plan there is no accounting (the budget guard stops there)
        ratio = self.strategy.sensitivity / float(self.strategy.sens_prefix[steps - 1])
        return gaussian_mechanism_epsilon(noise_multiplier * ratio, delta)

    def epsilon_of_segments(self, segments: Sequence[Segment], delta: float) -> float:
        sigmas = {float(s.noise_multiplier) for s in segments if s.steps > 0}
        if len(sigmas) <= 1:
            return self.epsilon(sigmas.pop() if sigmas else 1.0, delta, sum(int(s.steps) for s in segments))
        raise ConfigError("ftrl: sigma cannot change within a correlated-noise run (its accounting is one Gaussian "
                          "mechanism over the whole stream); resume with the same privacy settings")

    # --- state ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Public: the strategy (family, fitted coefficients) and the run's shape. No permutation."""
        return {"family": self.strategy.family, "steps": self.steps, "every": self.every,
                "num_examples": self.num_examples, "batch_size": self.batch_size,
                "params": _plain(self.strategy.params), "sensitivity": self.strategy.sensitivity}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        for key in ("family", "steps", "every", "num_examples", "batch_size"):
            if state.get(key) != mine[key]:
                raise ConfigError(f"ftrl: the checkpoint's noise was set up with {key}={state.get(key)}, this run has "
                                  f"{mine[key]}: the correlated stream cannot continue under another plan")
        if state["params"] != mine["params"]:  # a refit may differ in the last digits: keep the checkpoint's
            self.strategy = strategy_from_params(state["family"], state["steps"], state["every"], state["params"])

    def secret_state_dict(self) -> dict[str, Any]:
        """Secret: the permutation (whoever knows it knows every batch)."""
        return {"permutation": self.permutation}

    def load_secret_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is None:
            raise ConfigError("ftrl: resumed without the checkpoint's .secret sidecar: the secret batch order and the "
                              "correlated noise stream cannot continue privately; resume with it or start a new run")
        self.permutation = state["permutation"]


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if hasattr(obj, "item") and not isinstance(obj, str):
        return obj.item()
    return obj
