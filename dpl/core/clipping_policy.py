"""The clipping policy: every rule that decides how per-example clipping spends memory and time, in one place and
without torch, so that the clipper (:mod:`dpl.core.layer_gradients`, :mod:`dpl.core.streaming`,
:mod:`dpl.core.per_example`) and ``dpl plan``'s prediction (:mod:`dpl.planning.memory`) apply the same rules.

* the names: ``privacy.clipping_memory`` (:data:`CLIPPING_MEMORY`), ``privacy.clipping`` (:data:`CLIPPING`) and
  ``privacy.clipping_thresholds`` (:data:`THRESHOLDS`);
* a linear layer's norm path (:func:`per_example_path`) and the size of a norm temporary (:func:`norm_temporary`,
  :data:`NORM_CHUNK`);
* what a layer holds when it keeps its per-example gradients (:func:`kept_bytes`) or its book (:func:`book_bytes`),
  the one-pass decision (:func:`one_pass`) and ``auto``'s choice per layer (:func:`one_pass_choice`, :func:`fits`);
* ``auto``'s default budget (:func:`default_budget_bytes`): a share of what the device has free;
* group-wise clipping (``privacy.clipping: per_layer``): the groups (:func:`clipping_groups`), their thresholds
  (:func:`group_thresholds`, :func:`adapted_thresholds`) and the noise of adaptive thresholds (:func:`count_noise`).
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable
from pathlib import Path

from dpl.errors import ConfigError

#: ``privacy.clipping_memory``: how flat clipping trades memory for time
CLIPPING_MEMORY = ("fast", "low", "auto")
#: ``privacy.clipping``: one bound C on each example's whole gradient, or one bound C_g per group of parameters
CLIPPING = ("flat", "per_layer")
#: ``privacy.clipping_thresholds``: the split of C over the groups (``per_layer``)
THRESHOLDS = ("fixed", "adaptive")
#: elements of the largest temporary of a chunked norm (64 MiB in float32)
NORM_CHUNK = 1 << 24
#: share of the free memory ``auto``'s budget takes when ``privacy.clipping_memory_budget`` is unset (CUDA: of the
#: free device memory; CPU: of ``MemAvailable``)
AUTO_BUDGET_SHARE = 0.25
#: layer kinds whose state is an input and an output gradient (a book); the others' is their per-example gradients
BOOKED_KINDS = ("linear", "embedding")
MIB = 1 << 20


def check_choice(setting: str, value: object, choices: tuple[str, ...]) -> None:
    """Refuse in one line a ``privacy.<setting>`` that is not one of ``choices``."""
    if value not in choices:
        raise ConfigError(f"privacy.{setting} must be {', '.join(choices[:-1])} or {choices[-1]}, got {value!r}")


def per_example_path(steps: int, d_in: int, d_out: int) -> bool:
    """Whether a linear layer's weight norm is cheaper through its per-example gradients (B d_in d_out) than through
    the Gram matrices of its inputs and output gradients (B T^2 (d_in + d_out)); one position: neither."""
    return steps > 1 and steps * (d_in + d_out) >= d_in * d_out


def norm_temporary(kind: str, steps: int, d_in: int, d_out: int) -> int:
    """Float32 elements per example of a linear or embedding layer's norm temporaries: its two T x T Gram matrices
    (embeddings, and linear layers where ``steps (d_in + d_out) < d_in d_out``) or its per-example weight gradient,
    plus its input and output gradient."""
    ghost = kind == "embedding" or steps * (d_in + d_out) < d_in * d_out
    return (2 * steps * steps if ghost else d_in * d_out) + steps * (d_in + d_out)


def norm_chunk(per_row: int) -> int:
    """Examples per chunk of a chunked norm: at most about :data:`NORM_CHUNK` elements (one example at least)."""
    return max(1, NORM_CHUNK // max(1, per_row))


def kept_bytes(rows: int, numel: int) -> int:
    """The float32 per-example gradients of a layer with ``numel`` trainable parameters."""
    return 4 * rows * numel


def book_bytes(activation_bytes: int, rows: int, steps: int, d_in: int, d_out: int, linear_weight: bool) -> int:
    """What a layer's book holds beyond the non-private step: its output gradients and the inputs checkpointing would
    have dropped (``activation_bytes``; autograd saves the others anyway), and a linear layer's
    float32 per-example weight gradients where they are cheaper than the Gram path."""
    extra = 4 * rows * d_in * d_out if linear_weight and per_example_path(steps, d_in, d_out) else 0
    return activation_bytes + extra


def layer_costs(kind: str, kept: int, book: int) -> tuple[int | None, int | None]:
    """(bytes of a layer's per-example gradients, of its book); None where the layer cannot hold that (an
    embedding's per-example gradients, the book of a layer that is not linear or an embedding)."""
    return (None if kind == "embedding" else kept), (book if kind in BOOKED_KINDS else None)


def one_pass(costs: Iterable[tuple[int | None, int | None]], budget_bytes: int | None) -> bool:
    """Whether every layer's per-example gradients or book, the smaller, fit the budget together: then ``auto``
    holds them all and needs no second backward pass."""
    if budget_bytes is None:
        return False
    return sum(min(c for c in pair if c is not None) for pair in costs) <= budget_bytes


def one_pass_choice(kept: int | None, book: int | None) -> str:
    """In one pass, what a layer holds: ``kept`` (its per-example gradients) or ``booked``, whichever is smaller."""
    return "kept" if kept is not None and (book is None or kept <= book) else "booked"


def fits(kind: str, held: int, need: int, budget_bytes: int | None) -> bool:
    """Without one pass: whether a layer keeps its per-example gradients (``need`` bytes) with ``held`` bytes
    already kept (never an embedding's)."""
    return budget_bytes is not None and kind != "embedding" and held + need <= budget_bytes


def available_ram_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def default_budget_bytes(free_device_bytes: int | None = None) -> int:
    """``auto``'s budget when ``privacy.clipping_memory_budget`` is unset: :data:`AUTO_BUDGET_SHARE` of the free CUDA
    memory (``free_device_bytes``), or on a CPU (None) of the available RAM."""
    free = free_device_bytes if free_device_bytes is not None else available_ram_bytes()
    return int(AUTO_BUDGET_SHARE * (free if free is not None else 0))


def describe_budget(budget_bytes: int, configured: bool, device: str) -> str:
    """The budget as a log line or ``dpl plan`` shows it: its size and where it comes from (public figures)."""
    source = ("privacy.clipping_memory_budget" if configured else
              f"default: a quarter of the {'free CUDA memory' if device == 'cuda' else 'available RAM'}")
    return f"{budget_bytes / MIB:,.0f} MiB ({source})"


def auto_notes(budget_bytes: int, configured: bool, device: str) -> str:
    """The one line ``auto`` logs at its first step: its budget and what it does with it."""
    return (f"dpl: clipping_memory auto: budget {describe_budget(budget_bytes, configured, device)}; each layer keeps "
            "its per-example gradients or book within it, and with all of them kept one backward pass (fast's time)")


def second_pass_note(low: int, layers: int) -> str:
    """The one line ``auto`` logs the first time some layers take the second backward pass (public counts)."""
    return (f"dpl: clipping_memory auto: {low} of {layers} layers do not fit its budget and take a second backward pass "
            "every step; privacy.clipping: per_layer clips every layer in the one pass at the non-private step's memory "
            "(docs/methods.md: which clipping when)")


# ------------------------------------------------------------------------------- group-wise clipping (per_layer)


def clipping_groups(names: list[str], patterns: list[str] | None = None) -> list[list[str]]:
    """The groups of ``privacy.clipping: per_layer``, in the order of ``names`` (the trainable parameters): each
    layer (the module owning a parameter: its weight and bias together), or with ``patterns`` (``fnmatch`` patterns
    of ``privacy.clipping_groups``) one group per pattern, a parameter in the first pattern it matches. Refused in
    one line: a parameter no pattern matches, a pattern that matches none (an empty group), and a layer whose
    parameters fall in two groups (a layer's norms are computed together)."""
    if patterns is None:
        layers: dict[str, list[str]] = {}
        for name in names:
            layers.setdefault(name.rpartition(".")[0], []).append(name)
        return list(layers.values())
    groups: list[list[str]] = [[] for _ in patterns]
    for name in names:
        index = next((i for i, pattern in enumerate(patterns) if fnmatch.fnmatchcase(name, pattern)), None)
        if index is None:
            raise ConfigError(f"privacy.clipping_groups: trainable parameter {name!r} matches no pattern (end the "
                              "list with '*' for the rest)")
        groups[index].append(name)
    for pattern, group in zip(patterns, groups):
        if not group:
            raise ConfigError(f"privacy.clipping_groups: pattern {pattern!r} matches no trainable parameter not "
                              "matched before (an empty group)")
    owner: dict[str, int] = {}
    for index, group in enumerate(groups):
        for name in group:
            layer = name.rpartition(".")[0]
            if owner.setdefault(layer, index) != index:
                raise ConfigError(f"privacy.clipping_groups: the parameters of layer {layer!r} fall in patterns "
                                  f"{patterns[owner[layer]]!r} and {patterns[index]!r}; a layer is clipped as one")
    return groups


def lora_a_alone(groups: list[list[str]]) -> int:
    """How many groups hold a LoRA A matrix without its B (peft's ``.lora_A.`` / ``.lora_B.`` names): adaptive
    thresholds follow such an A's near-zero gradients down while B is near zero (docs/methods.md)."""
    return sum(any(".lora_A." in n for n in g) and not any(".lora_B." in n for n in g) for g in groups)


def group_thresholds(max_norm: float, sizes: list[int], split: list[float] | None = None) -> list[float]:
    """Each group's threshold C_g with sum_g C_g^2 = C^2: proportional to the square root of its parameters
    (``sizes``), or the stated ``split`` (``privacy.clipping_split``), refused in one line unless its squares add up
    to C^2 (to 1e-6 relative)."""
    if split is None:
        total = sum(sizes)
        return [max_norm * math.sqrt(size / total) for size in sizes]
    if len(split) != len(sizes):
        raise ConfigError(f"privacy.clipping_split has {len(split)} thresholds for {len(sizes)} groups")
    if not all(c > 0 for c in split):
        raise ConfigError(f"privacy.clipping_split: every threshold must be > 0, got {split}")
    squares = sum(c * c for c in split)
    if not math.isclose(squares, max_norm * max_norm, rel_tol=1e-6):
        raise ConfigError(f"privacy.clipping_split: the squares of the thresholds add up to {squares:.6g}, not "
                          f"C^2 = {max_norm * max_norm:.6g} (privacy.max_grad_norm {max_norm:g})")
    return [float(c) for c in split]


def adapted_thresholds(thresholds: list[float], fractions: list[float], quantile: float, rate: float,
                       max_norm: float) -> list[float]:
    """One step of adaptive thresholds (Andrew et al., "Differentially private learning with adaptive clipping",
    NeurIPS 2021): each C_g moves geometrically toward the ``quantile`` of its per-example norms, C_g exp(-rate (b_g -
    quantile)) with b_g the released (noisy) fraction of norms within C_g; then all are scaled so that sum_g C_g^2 =
    C^2 again (the release's sensitivity and noise stay those of C)."""
    moved = [c * math.exp(-rate * (b - quantile)) for c, b in zip(thresholds, fractions)]
    scale = max_norm / math.sqrt(sum(c * c for c in moved))
    return [c * scale for c in moved]


def count_noise(noise_multiplier: float, groups: int, count_share: float) -> tuple[float, float]:
    """(the gradient's noise multiplier sigma_D, the counts' noise std sigma_b) of adaptive thresholds, when the run's
    calibrated multiplier sigma is the pair's (the gradient sum and the G centred counts sum_i (b_i - 1/2), L2
    sensitivity sqrt(G)/2, released together: one Gaussian mechanism with 1/sigma^2 = 1/sigma_D^2 + G / (4
    sigma_b^2)); ``count_share`` is the counts' part of 1/sigma^2."""
    if noise_multiplier == 0:
        return 0.0, 0.0
    return (noise_multiplier / math.sqrt(1 - count_share),
            math.sqrt(groups) * noise_multiplier / (2 * math.sqrt(count_share)))
