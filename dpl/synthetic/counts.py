"""How many synthetic records of each label: the private data's label frequencies are private, so they are either
not used (uniform, or proportions the user gives) or released through a DP histogram.

The DP histogram (:func:`dp_histogram`): every privacy unit contributes a vector of L2 norm at most 1 to the counts
(an example: 1 on its label; a user: its rows' label fractions, a vector that sums to 1), so the counts have
sensitivity 1 under add/remove (and zero-out) adjacency and sqrt(2) under replace-one; Gaussian noise of std
sigma * sensitivity on every count is the Gaussian mechanism ``Gaussian(sigma)``, an event that the run's ledger
composes with the training's. The noise comes from a fresh OS-keyed ChaCha20 source (:class:`~dpl.core.noise.
SecureNormal`), never from the sampling seed.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from dpl.errors import ConfigError

#: the ways of choosing the label counts
METHODS = ("uniform", "given", "dp_histogram")


@dataclass
class LabelCounts:
    """The label proportions used and how they were chosen; ``histogram``: the DP release (noisy counts, sigma,
    epsilon, delta, the event), ``None`` unless ``method`` is ``dp_histogram``."""

    method: str
    proportions: dict[str, float]
    histogram: dict[str, Any] | None = None
    counts: dict[str, int] = field(default_factory=dict)


def allocate(rows: int, proportions: dict[str, float]) -> dict[str, int]:
    """``rows`` split by ``proportions`` (largest remainders; ties in the given order): the counts sum to ``rows``."""
    total = sum(proportions.values())
    exact = {label: rows * p / total for label, p in proportions.items()}
    counts = {label: math.floor(x) for label, x in exact.items()}
    left = rows - sum(counts.values())
    order = sorted(exact, key=lambda label: -(exact[label] - counts[label]))
    for label in order[:left]:
        counts[label] += 1
    return counts


def uniform(labels: list[str]) -> LabelCounts:
    return LabelCounts("uniform", {label: 1.0 / len(labels) for label in labels})


def given(text: str, labels: list[str]) -> LabelCounts:
    """Proportions written ``LABEL=WEIGHT,LABEL=WEIGHT`` (weights >= 0, normalised; labels left out get 0); an
    unknown label, a bad weight or all weights zero is a one-line :class:`ConfigError`."""
    weights: dict[str, float] = {}
    for part in text.split(","):
        label, sep, value = part.strip().rpartition("=")
        if not sep or not label:
            raise ConfigError(f"--proportions {text!r}: write LABEL=WEIGHT,LABEL=WEIGHT")
        if label not in labels:
            raise ConfigError(f"--proportions: unknown label {label!r} (the run's labels: {', '.join(labels)})")
        try:
            weight = float(value)
        except ValueError:
            raise ConfigError(f"--proportions: the weight of {label!r} is not a number: {value!r}") from None
        if not weight >= 0 or math.isinf(weight):
            raise ConfigError(f"--proportions: the weight of {label!r} must be finite and >= 0, got {value}")
        weights[label] = weight
    if sum(weights.values()) <= 0:
        raise ConfigError("--proportions: the weights sum to 0")
    return LabelCounts("given", {label: weights.get(label, 0.0) / sum(weights.values()) for label in labels})


def unit_vectors(values: list[str], users: list[str] | None) -> list[dict[str, float]]:
    """Each privacy unit's contribution to the counts: an example's label with weight 1, or a user's label
    fractions (private)."""
    if users is None:
        return [{value: 1.0} for value in values]
    rows: dict[str, Counter] = defaultdict(Counter)
    for value, user in zip(values, users):
        rows[user][value] += 1
    return [{label: n / sum(counter.values()) for label, n in counter.items()} for counter in rows.values()]


def dp_histogram(values: list[str], users: list[str] | None, labels: list[str], epsilon: float, delta: float,
                 adjacency: str, source: Any = None) -> LabelCounts:
    """The label proportions from a DP histogram of the training labels at (``epsilon``, ``delta``): the noisy
    counts clipped at 0 and normalised (all clipped: uniform). ``source``: the Gaussian source (default: a fresh
    :class:`~dpl.core.noise.SecureNormal`)."""
    import torch

    from dpl.core.accounting.gaussian import calibrate_gaussian_mechanism
    from dpl.core.noise import SecureNormal

    if not epsilon > 0 or math.isinf(epsilon):
        raise ConfigError(f"--label_epsilon must be a positive number, got {epsilon}")
    sigma = calibrate_gaussian_mechanism(epsilon, delta)
    sensitivity = math.sqrt(2.0) if adjacency == "replace_one" else 1.0
    sums = Counter()
    for vector in unit_vectors(values, users):
        for label, weight in vector.items():
            sums[label] += weight
    source = SecureNormal() if source is None else source
    noise = source.standard_normal(len(labels), dtype=torch.float64).tolist()
    noisy = {label: float(sums.get(label, 0.0)) + sigma * sensitivity * z for label, z in zip(labels, noise)}
    del sums  # the exact counts are private: only the noisy ones leave this function
    positive = {label: max(0.0, count) for label, count in noisy.items()}
    total = sum(positive.values())
    proportions = ({label: c / total for label, c in positive.items()} if total > 0
                   else {label: 1.0 / len(labels) for label in labels})
    from dpl.core.accounting.events import Gaussian, to_dict

    histogram = {"noisy_counts": noisy, "noise_multiplier": sigma, "sensitivity": sensitivity,
                 "noise_std": sigma * sensitivity, "epsilon": epsilon, "delta": delta,
                 "unit": "user" if users is not None else "example",
                 "event": {"event": to_dict(Gaussian(sigma)), "steps": 1}}
    return LabelCounts("dp_histogram", proportions, histogram)
