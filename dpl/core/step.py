"""The private step: the four hooks, in order, once per logical batch."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pluggy
import torch
from torch import Tensor, nn

from dpl.errors import PluginError
from dpl.core.gradients import GradientSum, PrivateGradient
from dpl.core.noise import NoiseSource
from dpl.core.privacy import PrivacyConfig
from dpl.core.privacy_unit import UNITS_KEY, PrivacyUnit

#: key of the per-group centred counts of adaptive clipping thresholds in the clipped sum (only privatize reads them)
CLIPPING_COUNTS_KEY = "dpl_clipping_counts"
#: batch key of the filler flags (bool per example) in FSDP training batches; fillers are weighted zero
PADDING_KEY = "dpl_padding"
#: batch key of the privacy unit of every row (int64 per row) under user-level sampling: the rows of one unit are
#: contiguous, never split across micro-batches or ranks, and clipped together as one unit


@dataclass
class RunSetup:
    """What plugins see at setup (``validate_setup``, ``configure_mechanism``)."""

    model: nn.Module
    trainable: dict[str, nn.Parameter]
    plugin_names: list[str]
    population: int  # what the mechanism samples: rows, or users (user-level sampling), or ELS's bounded rows
    expected_batch_size: int
    steps: int
    sampling_rate: float
    accountant: str
    optimizer_name: str
    replaced_hooks: frozenset[str] = frozenset()  # exclusive hooks a named plugin implements (replacing a default)
    seed: int | None = None  # privacy.seed (reproducible experiments only) or None: OS entropy
    world_size: int = 1
    optimizer_factory: Any = None  # the configured optimizer callable (plugins may refuse some optimizers)
    secure_noise: bool = False  # noise from the OS CSPRNG (dpl.core.noise.SecureNormal): it cannot be replayed
    sharded: bool = False  # parameters sharded over the ranks (FSDP, dpl.lightning.fsdp): hooks see full-size tensors
    unit: PrivacyUnit = field(default_factory=PrivacyUnit)  # the privacy unit: its flags (samples_users: batches
    # carry UNITS_KEY; bounds_rows: ELS), k (max_rows) and the users
    clipping_memory: str = "auto"  # privacy.clipping_memory: "fast", "low" or "auto" (the default estimator)
    clipping_memory_budget: float | None = None  # privacy.clipping_memory_budget (MiB)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)  # the run's privacy settings (privacy.clipping...)


@dataclass
class StepContext:
    """What ``estimate_gradient`` and ``privatize`` see. ``per_example_loss(batch) -> Tensor[b]`` runs the
    model's forward pass; ``noise_source`` is secret (identical on every DDP rank); ``public_seed`` is a
    public per-step seed (identical on every rank) for public randomness such as DPZero's direction."""

    model: nn.Module
    trainable: dict[str, nn.Parameter]
    per_example_loss: Callable[[dict[str, Any]], Tensor]
    max_grad_norm: float
    noise_multiplier: float
    expected_batch_size: int
    step: int
    noise_source: NoiseSource
    log: Callable[[str, float], None]
    scratch: dict[str, Any] = field(default_factory=dict)  # per-step values shared by estimate_gradient / privatize
    public_seed: int = 0
    optimizer: torch.optim.Optimizer | None = None

    def release_context(self) -> ReleaseContext:
        """The context of the hooks after ``privatize``: no noise source, no forward pass on data, and a scratch
        of its own (the private hooks' scratch may hold values computed from the examples)."""
        return ReleaseContext(trainable=self.trainable, max_grad_norm=self.max_grad_norm,
                              noise_multiplier=self.noise_multiplier, expected_batch_size=self.expected_batch_size,
                              step=self.step, public_seed=self.public_seed, optimizer=self.optimizer, log=self.log)


@dataclass
class ReleaseContext:
    """What ``post_process`` and ``precondition`` see: public values only. No noise source (a later hook
    could subtract the noise) and no ``per_example_loss`` (no access to the private examples)."""

    trainable: dict[str, nn.Parameter]
    max_grad_norm: float
    noise_multiplier: float
    expected_batch_size: int
    step: int
    public_seed: int
    optimizer: torch.optim.Optimizer | None
    log: Callable[[str, float], None]
    scratch: dict[str, Any] = field(default_factory=dict)  # per-step values shared by post_process / precondition


def batch_size_of(batch: dict[str, Any]) -> int:
    for value in batch.values():
        if torch.is_tensor(value):
            return int(value.shape[0])
    raise ValueError("batch has no tensor to read its size from")


def longest_first(batch: dict[str, Any]) -> dict[str, Any]:
    """``batch`` with its examples ordered by decreasing number of real tokens (``attention_mask``; stable), every
    per-example tensor and list permuted alike. Cut into micro-batches, similar lengths then share one, and the
    modules drop the columns that are padding in a whole micro-batch. The order changes no clipped sum. With
    privacy units (:data:`UNITS_KEY`) whole units move: ordered by their longest row, each unit's rows kept together
    in their order."""
    mask = batch.get("attention_mask")
    total = batch_size_of(batch)
    if not torch.is_tensor(mask) or mask.dim() != 2 or mask.shape[0] != total or total < 2:
        return batch
    lengths = mask.sum(1)
    units = batch.get(UNITS_KEY)
    if torch.is_tensor(units):
        _, inverse = torch.unique_consecutive(units.to(lengths.device), return_inverse=True)
        longest = torch.zeros(int(inverse.max()) + 1, dtype=lengths.dtype, device=lengths.device)
        longest = longest.scatter_reduce(0, inverse, lengths, reduce="amax")
        # sort by (unit's longest row desc, unit position, row position): one stable sort on a combined key
        key = -longest[inverse] * (total + 1) ** 2 + inverse * (total + 1) + torch.arange(total, device=lengths.device)
        order = torch.sort(key, stable=True).indices
    else:
        order = torch.sort(lengths, descending=True, stable=True).indices
    if bool((order == torch.arange(total, device=order.device)).all()):
        return batch
    listed = order.tolist()
    return {k: v[order.to(v.device)] if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == total
            else [v[i] for i in listed] if isinstance(v, list) and len(v) == total else v
            for k, v in batch.items()}


def split_batch(batch: dict[str, Any], size: int) -> Iterator[dict[str, Any]]:
    """Physical micro-batches of at most ``size`` examples (one empty batch if ``batch`` is empty); a batch cut into
    several is ordered longest first (:func:`longest_first`). A privacy unit (:data:`UNITS_KEY`) is never cut: a
    micro-batch ends at a unit's boundary, and a unit of more than ``size`` rows forms a micro-batch of its own."""
    total = batch_size_of(batch)
    if total == 0:
        yield batch
        return
    if total > size:
        batch = longest_first(batch)
    for start, end in _cuts(batch.get(UNITS_KEY), total, size):
        yield {k: v[start:end] if torch.is_tensor(v) or isinstance(v, list) else v for k, v in batch.items()}


def _cuts(units: Tensor | None, total: int, size: int) -> Iterator[tuple[int, int]]:
    """(start, end) of each micro-batch: every ``size`` rows, or at unit boundaries with units."""
    if not torch.is_tensor(units):
        for start in range(0, total, size):
            yield start, min(total, start + size)
        return
    _, counts = torch.unique_consecutive(units, return_counts=True)
    start = end = 0
    for count in counts.tolist():
        if end > start and end + count - start > size:
            yield start, end
            start = end
        end += count
    yield start, end


def private_step(hook: pluggy.HookRelay, ctx: StepContext, batch: dict[str, Any], physical_batch_size: int,
                 reduce_sum: Callable[[GradientSum], None] | None = None,
                 mechanism: str | None = None) -> dict[str, Tensor]:
    """Run estimate_gradient (per micro-batch, summed), privatize, post_process and precondition.

    ``reduce_sum`` (multi-process training) sums the clipped sum over all ranks in place before ``privatize``.
    ``mechanism`` is the name of the configured mechanism; the release must say it came from it.
    Returns the update direction per trainable parameter. Every reference to the clipped sum is dropped once
    privatize returns (``wipe``), and the later hooks get a :class:`ReleaseContext`.
    """
    total: GradientSum | None = None
    for micro in split_batch(batch, physical_batch_size):
        part = hook.estimate_gradient(ctx=ctx, batch=micro)
        if part is None:
            raise PluginError("no plugin answered estimate_gradient")
        if total is None:
            total = part
        else:
            total.add_(part)
            part.wipe()
        del part
    with full_precision():  # the clipped sum, the noise and what is computed from the release stay float32
        if reduce_sum is not None:
            reduce_sum(total)
        private: PrivateGradient | None = hook.privatize(ctx=ctx, gradient_sum=total)
        total.wipe()
        del total
        if private is None:
            raise PluginError("no plugin answered privatize")
        if mechanism is not None and private.mechanism != mechanism:
            raise PluginError(f"privatize released noise of mechanism {private.mechanism!r} but the run accounts "
                              f"for {mechanism!r}: a plugin replacing privatize must also implement "
                              "configure_mechanism")
        release = ctx.release_context()
        hook.post_process(ctx=release, gradient=private)
        direction = hook.precondition(ctx=release, gradient=private)
    return private.values if direction is None else direction


@contextmanager
def full_precision() -> Iterator[None]:
    """Autocast off on CPU and CUDA. Mixed precision (Lightning's ``bf16-mixed``) runs the whole step under
    autocast, which would run the out-of-place matrix products of ``privatize``, ``post_process`` and
    ``precondition`` (denoise's randomized sketches, a plugin's ``a @ b``) in bfloat16; the forward passes of
    ``estimate_gradient`` keep it."""
    with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
        yield
