"""The ``ftrl`` mechanisms: how batches are drawn and how privacy is accounted for a correlated-noise stream.

* ``shuffle`` (:class:`ShuffledBatchSampler`): fixed-size batches from one secret permutation, the same order every
  epoch; the whole run is one Gaussian mechanism on the sensitivity-normalised stream (no amplification).
  Adjacency: zero-out (an example's gradient replaced by zero), or replace-one at twice the sensitivity.
* ``cyclic_poisson`` (:class:`CyclicPoissonSampler`, amplified banded matrix factorization: Choquette-Choo,
  Ganesh, McKenna, McMahan, Rush, Thakurta, Xu, "(Amplified) Banded Matrix Factorization: A unified approach to
  private training", NeurIPS 2023): b partitions of one secret permutation, step t Poisson-samples partition
  t mod b; with a b-banded strategy the run is as private as ceil(T / b) Poisson-subsampled Gaussian steps with
  noise multiplier sigma (on the stream normalised by the strategy's column norm) and rate q = B / floor(N / b),
  accounted with dpl's PRV accountant. Adjacency: zero-out (the paper's; the partition is fixed by position, so
  adding or removing an example would move the others). b = 1 is DP-SGD with amplification.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Sampler

from dpl.api import ConfigError, events, poisson_mask
from dpl_plugins.ftrl.strategies import Strategy, strategy_from_params

log = logging.getLogger("dpl")

SAMPLINGS = ("shuffle", "cyclic_poisson")


@dataclass
class SampledStrategy:
    """A strategy and the sampling its sensitivity assumes (``cyclic_poisson``: the strategy is b-banded, b =
    ``bands``, fitted for one participation per column)."""

    strategy: Strategy
    sampling: str = "shuffle"

    @property
    def bands(self) -> int:
        return int(self.strategy.params.get("bands", 1)) if self.sampling == "cyclic_poisson" else 0

    def describe(self) -> str:
        st = self.strategy
        if self.sampling != "cyclic_poisson":
            return st.describe()
        c = ", ".join(f"{x:.4g}" for x in st.c[:self.bands])
        return (f"c=[{c}] for T={st.steps}, each participation one subsampled Gaussian step: column norm "
                f"{st.sensitivity:.4f}, expected prefix-sum error {st.expected_error:.4g} sigma*C "
                f"(before the sigma each strategy needs for the target)")

    def label(self) -> str:
        if self.sampling == "cyclic_poisson":
            return "amplified DP-SGD (b=1)" if self.bands == 1 else f"amplified banded (b={self.bands})"
        return {"blt": f"blt (nbuf={self.strategy.params.get('nbuf')}, shuffled)",
                "banded": f"banded (bands={self.strategy.params.get('bands')}, shuffled)",
                "independent": "independent (shuffled, no amplification)"}.get(self.strategy.family,
                                                                                 f"{self.strategy.family} (shuffled)")


# ----------------------------------------------------------------------------------------------------------
# samplers


class _StepSampler(Sampler[list[int]]):
    """Yields the batches from the next step to the end of that step's epoch; the batch of a step is tied to the
    step, not to how many batches the loader drew. If an iteration is abandoned before its epoch ends
    (``limit_train_batches``) and a new one starts, the sampler cannot know which batches were trained and
    refuses: a broken pattern would break the privacy analysis."""

    def __init__(self, mechanism: FTRLMechanism, generator: torch.Generator, start_step: int = 0) -> None:
        self.mechanism = mechanism
        self.generator = generator
        self.steps_per_epoch = mechanism.every_epoch
        self.position = int(start_step)
        self._open = False

    def __len__(self) -> int:
        return self.steps_per_epoch

    def _batch(self, step: int) -> list[int]:
        raise NotImplementedError

    def __iter__(self) -> Iterator[list[int]]:
        if self._open:
            raise ConfigError("ftrl: the training loader stopped before the end of an epoch (limit_train_batches?); "
                              "ftrl's batches follow one fixed pattern and every epoch must run to its end")
        end = (self.position // self.steps_per_epoch + 1) * self.steps_per_epoch
        self._open = True
        while self.position < end:
            step = self.position
            self.position += 1
            if self.position == end:
                self._open = False  # the epoch's last batch is handed out: a consumer may stop right after it
            yield self._batch(step)


class ShuffledBatchSampler(_StepSampler):
    """Batches of exactly B examples from one secret permutation, the same order every epoch.

    The batch of global step t is slot t mod b of the permutation (b = steps per epoch = floor(N / B)): every
    example is in one slot, so it takes part in steps i, i + b, i + 2b, ... only. The last N - b B positions of
    the permutation (a secret, uniformly random subset of N mod B examples) are never used."""

    def _batch(self, step: int) -> list[int]:
        permutation = self.mechanism.ensure_permutation(self.generator)
        slot, size = step % self.steps_per_epoch, self.mechanism.batch_size
        return permutation[slot * size:(slot + 1) * size].tolist()


class CyclicPoissonSampler(_StepSampler):
    """Cyclic Poisson sampling: the secret permutation cut into b partitions of m = floor(N / b) examples (the last
    N mod b positions, a secret random subset, never take part); at step t every example of partition t mod b
    joins independently with probability q = B / m (expected batch size B). With b = 1 there is no permutation
    and the draws are exactly those of :class:`dpl.core.sampling.PoissonBatchSampler`.

    The generator state before each step's draw is recorded (the last few, secret): a resumed run redraws the
    batches of the steps it resumes at, whatever the loader had prefetched."""

    def __init__(self, mechanism: FTRLMechanism, generator: torch.Generator, start_step: int = 0) -> None:
        super().__init__(mechanism, generator, start_step)
        recorded = mechanism.sampler_states.get(int(start_step))
        if recorded is not None:
            generator.set_state(recorded)

    def _batch(self, step: int) -> list[int]:
        mech = self.mechanism
        b, m = mech.bands, mech.num_examples // mech.bands
        members = mech.ensure_permutation(self.generator)[(step % b) * m:(step % b + 1) * m] if b > 1 else None
        mech.record_sampler_state(step, self.generator.get_state())
        mask = poisson_mask(m, mech.sample_rate, self.generator)
        return (mask.nonzero().flatten() if members is None else members[mask]).tolist()


# ----------------------------------------------------------------------------------------------------------
# the mechanism


class FTRLMechanism:
    """Sampling and accounting of ftrl's correlated noise for one :class:`SampledStrategy`,
    :attr:`sampled_strategy` (chosen among ``candidates`` by ``chooser`` at calibration, when there are several).

    ``shuffle``: one Gaussian mechanism with noise multiplier sigma on C X / sens (sens: the strategy's
    sensitivity for the b-periodic participation pattern, k = ceil(T / b) participations), released through
    C^-1; epsilon after t steps is exact for the Gaussian mechanism (Balle & Wang 2018, the analytic Gaussian
    mechanism): the first t releases have sensitivity sens_t <= sens_T, so their noise multiplier is
    sigma * sens_T / sens_t.

    ``cyclic_poisson``: ceil(t / b) compositions of the Poisson-subsampled Gaussian with noise multiplier sigma
    and rate q = B / floor(N / b) (PRV accountant, ``privacy.accountant``).

    ``adjacency``: the neighbouring relation the guarantee is for (``zero_out``; ``replace_one`` for ``shuffle``
    at twice the noise). ``noise_scale``: the factor of sigma * C_clip in the released noise.
    """

    name = "ftrl"
    adjacency = "zero_out"
    unit = "example"  # or "user" (set from the run: under user-level sampling the units it orders are users)

    def __init__(self, sampled_strategy: SampledStrategy, num_examples: int, batch_size: int, accountant: str = "prv",
                 candidates: list[SampledStrategy] | None = None, chooser: Any = None,
                 replay_batches: bool = False) -> None:
        self.sampled_strategy = sampled_strategy
        self.num_examples = int(num_examples)
        self.batch_size = int(batch_size)
        self.every_epoch = max(1, self.num_examples // self.batch_size)
        self.accountant = accountant
        self.candidates = candidates or []
        self.chooser = chooser
        self.permutation: torch.Tensor | None = None
        self.sampler_states: dict[int, torch.Tensor] = {}
        # record the sampler generator's state before each step's draw, so that a resume redraws the same batches:
        # only for a seeded run (privacy.seed), whose resume replays its streams; any other resume draws fresh batches
        self.replay_batches = replay_batches

    # --- the sampled strategy -------------------------------------------------------------------------
    @property
    def strategy(self) -> Strategy:
        return self.sampled_strategy.strategy

    @property
    def sampling(self) -> str:
        return self.sampled_strategy.sampling

    @property
    def steps(self) -> int:
        return self.strategy.steps

    @property
    def accounting(self) -> str:
        """How epsilon is computed: the PRV (or RDP) accountant of the subsampled Gaussian for amplified banded, the
        exact Gaussian mechanism for a shuffled order."""
        return self.accountant if self.sampling == "cyclic_poisson" else "exact Gaussian mechanism"

    @property
    def bands(self) -> int:
        return self.sampled_strategy.bands

    @property
    def adjacencies(self) -> tuple[str, ...]:
        return ("zero_out", "replace_one") if self.sampling == "shuffle" else ("zero_out",)

    @property
    def sample_rate(self) -> float:
        """Poisson rate within a partition (``cyclic_poisson``); the fraction of examples per step (``shuffle``)."""
        if self.sampling == "cyclic_poisson":
            return self.batch_size / (self.num_examples // self.bands)
        return self.batch_size / self.num_examples

    @property
    def noise_scale(self) -> float:
        """sens (shuffle: the multi-participation sensitivity; cyclic_poisson: the column norm), twice that under
        replace-one adjacency."""
        return self.strategy.sensitivity * (2.0 if self.adjacency == "replace_one" else 1.0)

    def rounds(self, steps: int) -> int:
        """Compositions of the subsampled Gaussian after ``steps`` steps (``cyclic_poisson``)."""
        return -(-int(steps) // self.bands)

    def settle(self, sampled: SampledStrategy) -> None:
        """Fix the sampled strategy (after a choice, or from a checkpoint); candidates are dropped. Used before any
        calibration (a fixed sigma: no epsilon to compare the candidates at), the first candidate is kept, with a
        log line."""
        if self.candidates and sampled is self.sampled_strategy:
            log.info("dpl: ftrl uses %s: privacy.noise_multiplier is set, so there is no target epsilon to compare "
                     "the candidates at (the default with a fixed sigma)", sampled.label())
        self.sampled_strategy, self.candidates = sampled, []

    # --- sampling -------------------------------------------------------------------------------------
    def ensure_permutation(self, generator: torch.Generator) -> torch.Tensor:
        if self.permutation is None:
            self.permutation = torch.randperm(self.num_examples, generator=generator)
        return self.permutation

    def record_sampler_state(self, step: int, state: torch.Tensor) -> None:
        if not self.replay_batches:
            return
        self.sampler_states[step] = state
        for old in [s for s in self.sampler_states if s < step - 4]:
            del self.sampler_states[old]

    def batch_sampler(self, num_examples: int, steps_per_epoch: int, generator: torch.Generator,
                      start_step: int = 0) -> Sampler:
        self.settle(self.sampled_strategy)
        if num_examples != self.num_examples or steps_per_epoch != self.every_epoch:
            raise ConfigError(f"ftrl: the mechanism was set up for N={self.num_examples}, {self.every_epoch} steps "
                              f"per epoch, got N={num_examples}, {steps_per_epoch}")
        if self.sampling == "cyclic_poisson":
            return CyclicPoissonSampler(self, generator, start_step)
        return ShuffledBatchSampler(self, generator, start_step)

    # --- accounting -----------------------------------------------------------------------------------
    resumable_with_changes = False  # one analysis over the whole stream: sigma cannot change within a run

    @property
    def scope(self) -> dict[str, Any]:
        return {"mechanism": self.name, "sampling": self.sampling, "unit": self.unit, "adjacency": self.adjacency,
                "strategy": self.strategy.family, "bands": self.bands}

    def event(self, noise_multiplier: float, steps: int) -> events.Event:
        self.settle(self.sampled_strategy)
        return self.strategy_event(self.sampled_strategy, noise_multiplier, steps)

    def strategy_event(self, sampled: SampledStrategy, noise_multiplier: float, steps: int) -> events.Event:
        """The event of the first ``steps`` steps of ``sampled`` (a candidate, or the one in use) at sigma.

        ``cyclic_poisson``: ceil(steps / b) Poisson-subsampled Gaussian steps at rate B / floor(N / b). ``shuffle``:
        one Gaussian mechanism on the sensitivity-normalised stream; the first t releases have sensitivity sens_t <=
        sens_T, so their noise multiplier is sigma * sens_T / sens_t. Beyond the fitted steps there is no analysis:
        non-private (the budget guard stops there)."""
        steps = int(steps)
        if steps <= 0:
            return events.Composed(())
        if noise_multiplier == 0 or steps > sampled.strategy.steps:
            return events.NonPrivate()
        if sampled.sampling == "cyclic_poisson":
            b = sampled.bands
            rate = self.batch_size / (self.num_examples // b)
            return events.SelfComposed(events.PoissonGaussian(float(noise_multiplier), rate), -(-steps // b))
        ratio = sampled.strategy.sensitivity / float(sampled.strategy.sens_prefix[steps - 1])
        return events.Gaussian(float(noise_multiplier) * ratio)

    def calibrate_strategy(self, sampled: SampledStrategy, target_epsilon: float, delta: float, steps: int) -> float:
        """sigma of ``sampled`` for (target_epsilon, delta) after ``steps`` steps (a candidate's, for the choice)."""
        if steps > sampled.strategy.steps:
            raise ConfigError(f"ftrl: its noise was fitted and accounted for {sampled.strategy.steps} steps, asked "
                              f"about {steps}")
        return events.calibrate(lambda sigma: self.strategy_event(sampled, sigma, steps), target_epsilon, delta,
                                self.accountant)

    def settle_choices(self, target_epsilon: float | None, delta: float, steps: int) -> None:
        """Choose the strategy among the candidates at (target_epsilon, delta) before sigma is calibrated; with a fixed
        sigma (``target_epsilon`` None) the first candidate is kept."""
        if self.candidates and self.chooser is not None and target_epsilon is not None:
            self.sampled_strategy = self.chooser(self, target_epsilon, delta, steps)
            self.candidates = []
        self.settle(self.sampled_strategy)

    # --- state ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Public: the sampled strategy (family, sampling, fitted coefficients), the run's shape and the adjacency. No
        permutation, no sampler state."""
        return {"family": self.strategy.family, "sampling": self.sampling, "steps": self.steps,
                "every": self.strategy.every, "num_examples": self.num_examples, "batch_size": self.batch_size,
                "params": _plain(self.strategy.params), "sensitivity": self.strategy.sensitivity,
                "adjacency": self.adjacency}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = {"sampling": "shuffle", "adjacency": "zero_out", **state}
        if state["sampling"] != self.sampling or state["family"] != self.strategy.family:
            candidates = {(p.sampling, p.strategy.family) for p in [self.sampled_strategy, *self.candidates]}
            if (state["sampling"], state["family"]) not in candidates:
                raise ConfigError(f"ftrl: the checkpoint's noise is {state['family']} with {state['sampling']} "
                                  f"sampling, this run's {self.strategy.family} with {self.sampling}: the correlated "
                                  "stream cannot continue under another strategy")
        mine = self.state_dict()
        for key in ("steps", "num_examples", "batch_size", "adjacency"):
            if state.get(key) != mine[key]:
                raise ConfigError(f"ftrl: the checkpoint's noise was set up with {key}={state.get(key)}, this run has "
                                  f"{mine[key]}: the correlated stream cannot continue under another strategy")
        if state["params"] != mine["params"] or state["family"] != mine["family"] or state["every"] != mine["every"]:
            # the checkpoint's strategy (a refit may differ in the last digits; an automatic choice is kept)
            strategy = strategy_from_params(state["family"], state["steps"], state["every"], state["params"])
            self.sampled_strategy = SampledStrategy(strategy, state["sampling"])
        self.settle(self.sampled_strategy)

    def secret_state_dict(self) -> dict[str, Any]:
        """Secret: the permutation (whoever knows it knows every partition / batch) and the sampler generator's
        states before the last steps' draws."""
        return {"permutation": self.permutation, "sampler_states": dict(self.sampler_states)}

    def load_secret_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is None:
            raise ConfigError("ftrl: resumed without the checkpoint's .secret sidecar: the secret batch order and the "
                              "correlated noise stream cannot continue privately; resume with it or start a new run")
        self.permutation = state["permutation"]
        self.sampler_states = dict(state.get("sampler_states") or {})


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if hasattr(obj, "item") and not isinstance(obj, str):
        return obj.item()
    return obj
