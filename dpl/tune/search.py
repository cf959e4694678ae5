"""The search space of ``dpl tune``: ``--search KEY=V1,V2,...`` options, each a ``dpl fit`` option and its values; a
configuration takes one value of every key, each drawn uniformly (so configurations are uniform over the product).

Two kinds of options may be searched: those that leave a trial's privacy accounting unchanged
(:data:`NEUTRAL_PREFIXES`, :data:`NEUTRAL_KEYS`), and the batch size and training length (:data:`PLANNED_KEYS`), which
change sigma, the sampling rate or the steps: the tuning bound then holds the RDP curve of every configuration, planned
before any trial (:mod:`dpl.tune.plans`). Options that change the mechanism, the privacy unit, the accountant or the
target epsilon stay out.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass

from dpl.errors import ConfigError

#: short names for common options
ALIASES: dict[str, str] = {
    "lr": "model.optimizer.init_args.lr",
    "weight_decay": "model.optimizer.init_args.weight_decay",
    "max_grad_norm": "model.privacy.max_grad_norm",
    "batch_size": "model.privacy.batch_size",
    "steps": "trainer.max_steps",
    "epochs": "trainer.max_epochs",
}
#: option families that do not change the accounting: the optimizer and its schedule, the fine-tuning method, decoding,
#: and plugins that post-process the private gradient or only change what is privatized
NEUTRAL_PREFIXES: tuple[str, ...] = ("model.optimizer.", "model.lr_scheduler.", "model.finetuning.",
                                     "model.generation.", "model.plugins.denoise.", "model.plugins.adambc.",
                                     "model.plugins.dpzero.")
#: single options that do not change the accounting (C scales the clipping and the noise together)
NEUTRAL_KEYS: tuple[str, ...] = ("model.privacy.max_grad_norm", "model.privacy.physical_batch_size", "model.pooling",
                                 "seed_everything")
#: options that change a trial's accounting (sigma, sampling rate, steps) but not its mechanism: each
#: accounting-distinct configuration is planned, and the bound takes the largest of their RDP curves
PLANNED_KEYS: tuple[str, ...] = ("model.privacy.batch_size", "trainer.max_steps", "trainer.max_epochs")


def canonical(key: str) -> str:
    """The option without ``--`` and ``init_args`` (``model.init_args.optimizer.init_args.lr`` ->
    ``model.optimizer.lr``), the form the neutral lists use."""
    return ".".join(part for part in key.lstrip("-").split(".") if part != "init_args")


def is_neutral(key: str) -> bool:
    """Whether searching ``key`` leaves every trial's accounting unchanged."""
    name = canonical(key)
    prefixes = tuple(canonical(p.rstrip(".")) + "." for p in NEUTRAL_PREFIXES)
    return name in {canonical(k) for k in NEUTRAL_KEYS} or name.startswith(prefixes)


def is_planned(key: str) -> bool:
    """Whether ``key`` changes a trial's accounting in a way the planned bound covers (:data:`PLANNED_KEYS`)."""
    return canonical(key) in {canonical(k) for k in PLANNED_KEYS}


@dataclass(frozen=True)
class SearchSpace:
    """``options``: the ``dpl fit`` option (without ``--``) and its values, in the order given."""

    options: dict[str, tuple[str, ...]]

    @property
    def size(self) -> int:
        """The number of configurations."""
        total = 1
        for values in self.options.values():
            total *= len(values)
        return total

    def draw(self, randbelow: Callable[[int], int] = secrets.randbelow) -> dict[str, str]:
        """One configuration, uniform over the product (OS entropy by default)."""
        return {key: values[randbelow(len(values))] for key, values in self.options.items()}

    def describe(self) -> dict[str, list[str]]:
        return {key: list(values) for key, values in self.options.items()}

    def accounting_configurations(self) -> list[dict[str, str]]:
        """Every combination of the values of the :data:`PLANNED_KEYS` searched (``[{}]`` when none is): the
        configurations whose accounting can differ, in a fixed order."""
        out: list[dict[str, str]] = [{}]
        for key, values in self.options.items():
            if is_planned(key):
                out = [{**config, key: value} for config in out for value in values]
        return out


def accounting_part(config: dict[str, str]) -> dict[str, str]:
    """The values of ``config``'s :data:`PLANNED_KEYS` (what its accounting depends on)."""
    return {key: value for key, value in config.items() if is_planned(key)}


def config_args(config: dict[str, str]) -> list[str]:
    """``dpl fit`` arguments that set a configuration."""
    return [arg for key, value in config.items() for arg in (f"--{key}", value)]


def short(config: dict[str, str]) -> str:
    """``lr=0.01, max_grad_norm=1`` (aliases where they exist)."""
    names = {canonical(full): alias for alias, full in ALIASES.items()}
    return ", ".join(f"{names.get(canonical(key), key)}={value}" for key, value in config.items())


def parse_search(specs: list[str]) -> SearchSpace:
    """The search space of ``--search KEY=V1,V2`` options (one-line ``ConfigError`` for bad input)."""
    if not specs:
        raise ConfigError("dpl tune needs a search space: --search KEY=V1,V2 (e.g. --search lr=0.005,0.01,0.02)")
    options: dict[str, tuple[str, ...]] = {}
    for spec in specs:
        key, sep, text = spec.partition("=")
        key = key.strip().lstrip("-")
        if not sep or not key:
            raise ConfigError(f"--search {spec!r}: expected KEY=V1,V2 (e.g. lr=0.005,0.01)")
        key = ALIASES.get(key, key)
        values = tuple(v.strip() for v in text.split(","))
        if not text.strip() or any(not v for v in values):
            raise ConfigError(f"--search {spec!r}: empty value (give KEY=V1,V2,...)")
        if len(set(values)) != len(values):
            raise ConfigError(f"--search {spec!r}: a value is listed twice (the draw is uniform over the values)")
        if any(canonical(key) == canonical(k) for k in options):
            raise ConfigError(f"--search: {key} is given twice; list all its values in one --search")
        if not is_neutral(key) and not is_planned(key):
            raise ConfigError(f"--search {key}: may change a trial's privacy accounting beyond what the tuning bound "
                              f"plans (the batch size and the number of steps or epochs): search those, or the "
                              f"optimizer, scheduler, fine-tuning, clipping norm or post-processing options "
                              f"({', '.join(sorted(ALIASES))}, model.optimizer.*, model.finetuning.*, ...)")
        options[key] = values
    return SearchSpace(options)
