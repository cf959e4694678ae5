"""``privacy.physical_batch_size: auto``: the largest micro-batch whose private step fits a memory budget.

The private step is probed before training on a *public* batch: random token ids at the configured longest length
(``data.max_length``), never a training example, so the micro-batch chosen (and logged) depends on the model, the
length, the settings and the device, not on the data. A real batch is never longer than the probe's, so its step
holds no more. The probe runs ``estimate_gradient`` alone (no noise, no ledger step, no optimizer step), under forks
of torch's global generators (dropout draws the same masks afterwards), and the sampler and per-step public
generators are not touched: the sampled batches, the noise and the accounting are those of a run with a fixed
micro-batch; only how each logical batch is cut into forward/backward passes changes.

Memory is measured as what the process holds above what it held before each probe: on CUDA the caching allocator's
peak (``torch.cuda.max_memory_reserved``, after its cache is emptied; an out-of-memory error counts as too large); on
Linux the peak resident memory (``VmHWM``, restarted with the freed memory glibc keeps given back first:
:mod:`dpl.allocator`), which counts what live tensor bytes miss (the kernels' own buffers, and the heap's freed blocks
that :func:`~dpl.allocator.keep_freed_memory` keeps for the next step); elsewhere :class:`LiveBytes`, which counts
the storages torch allocates while the step runs. The step's memory is about affine in the micro-batch b: after one
unmeasured step (the first step's one-time allocations), b = 1 and b = 2 are probed, and each next size is read off
the line through the last two that fit (at most 8 times the last, so that a measurement the line misreads cannot send
a probe far past the budget), probed, and lowered while it does not fit. Each probe is one log line (its size, peak
and time).

``clipping_memory: auto`` (flat clipping) is chosen within the same budget: each probe runs the step with the
clipping that will train, offered all the budget the step leaves (one backward pass wherever its state fits); at
the micro-batch chosen, auto's budget is fixed to the state that probe held, so that no batch (a shorter one may
take one pass where the longest did not) holds more. Where one example does not fit with that state, auto keeps
none (``low``'s memory). The choice is one log line of public figures.
"""

from __future__ import annotations

import logging
import math
import os
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dpl.allocator import release_freed_memory, reset_resident_peak, resident_bytes
from dpl.core.clipping_policy import available_ram_bytes
from dpl.errors import ConfigError

log = logging.getLogger("dpl")

MIB = 1 << 20
#: share of the free device memory (CUDA) or of the available RAM (CPU) that the default budget takes
CUDA_SHARE, CPU_SHARE = 0.9, 0.5


@dataclass(frozen=True)
class MicroBatch:
    """The micro-batch ``physical_batch_size: auto`` chose, and the public figures it was chosen from (bytes)."""

    size: int
    peak_bytes: int  # the probed private step's peak at ``size``, above what was held before it
    budget_bytes: int  # what the step may use (``privacy.physical_batch_memory``)
    reserve_bytes: int  # kept free for the clipped sum, the noisy release and two optimizer states
    tokens: int | None  # the probe's sequence length
    measure: str = "live tensor bytes"  # what was measured (:func:`measure_peak`)
    clipping_bytes: int | None = None  # ``clipping_memory: auto``: the state it keeps at most (its budget from now)
    one_pass: bool = False  # ``clipping_memory: auto``: whether that state makes the step one backward pass

    def describe(self) -> str:
        at = f" at {self.tokens:,} tokens" if self.tokens else ""
        clipping = "" if self.clipping_bytes is None else (
            f", clipping_memory auto keeping {mib(self.clipping_bytes)} of per-example state ("
            + ("one backward pass" if self.one_pass else "a second backward pass for the layers it does not keep")
            + ")")
        return (f"physical_batch_size auto: {self.size}{clipping}, within a {mib(self.budget_bytes)} budget (the "
                f"private step probed{at} on a public batch: peak {mib(self.peak_bytes)} of {self.measure}, "
                f"{mib(self.reserve_bytes)} kept for the clipped sum, the noise and the optimizer)")


def mib(size: float) -> str:
    """``size`` bytes in MiB, to a tenth below 10 MiB."""
    return f"{size / MIB:,.1f} MiB" if size < 10 * MIB else f"{size / MIB:,.0f} MiB"


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages torch allocates while the mode is on, live now (``live``) and at most (``peak``).

    A storage counts from the op that creates it until it is freed; an op's output that shares an input's storage
    (a view, an in-place op) adds nothing, and tensors that existed before are not counted. Works on any device,
    ``meta`` included."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._sizes: dict[int, int] = {}

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in inputs or key in self._sizes:
                continue
            self._sizes[key] = size = storage.nbytes()
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key)
        return out


def measure_peak(run: Callable[[], Any], device: torch.device) -> tuple[int, str]:
    """The peak bytes the process holds while ``run()`` runs above what it held before, and what was measured: on
    CUDA the caching allocator's reserved memory, on Linux the resident memory (the freed memory glibc keeps given
    back first), elsewhere :class:`LiveBytes`."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        start = torch.cuda.memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_reserved(device) - start), "CUDA memory reserved"
    if device.type == "cpu":
        release_freed_memory()
        start = resident_bytes()
        if start is not None and reset_resident_peak():
            run()
            return max(0, resident_bytes("VmHWM") - start), "resident memory"
    with LiveBytes() as tracker:
        run()
    return tracker.peak, "live tensor bytes"


def default_budget_bytes(device: torch.device) -> int:
    """What the step may use by default: 90% of the free CUDA memory (torch's cached blocks included), else half
    of the available RAM (``MemAvailable``)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(CUDA_SHARE * (free + cached))
    available = available_ram_bytes()
    if available is not None:
        return int(CPU_SHARE * available)
    return int(CPU_SHARE * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def choose_micro_batch(probe: Callable[[int], tuple[int, bool] | None], *, upper: int, budget_bytes: int,
                       reserve_bytes: int, device: torch.device, tokens: int | None = None) -> MicroBatch:
    """The largest micro-batch b <= ``upper`` whose probed step (``probe(b)``, which returns the clipping state it
    held and whether in one pass, or None) peaks at most at ``budget_bytes`` - ``reserve_bytes``; one log line per
    probe. Refused in one line where one example does not fit."""
    room = budget_bytes - reserve_bytes
    peaks: dict[int, float] = {}
    states: dict[int, tuple[int, bool] | None] = {}
    measured = ["live tensor bytes"]
    at = f" of {tokens:,} tokens" if tokens else ""

    def peak(b: int) -> float:
        if b not in peaks:
            start = time.perf_counter()
            try:
                peaks[b], measured[0] = measure_peak(lambda: states.__setitem__(b, probe(b)), device)
            except (RuntimeError, torch.OutOfMemoryError) as exc:
                if not _is_oom(exc):
                    raise
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                peaks[b] = math.inf
            shown = "out of memory" if math.isinf(peaks[b]) else f"peak {mib(peaks[b])} of {measured[0]}"
            log.info("dpl: physical_batch_size auto: probed %d example%s%s: %s, %s the %s room (%.1f s)", b,
                     "" if b == 1 else "s", at, shown, "within" if peaks[b] <= room else "over", mib(room),
                     time.perf_counter() - start)
        return peaks[b]

    if peak(1) > room:
        shown = "more than the device has" if math.isinf(peak(1)) else mib(peak(1))
        raise ConfigError(f"physical_batch_size auto: the private step of one example{at} needs {shown}, more than "
                          f"the {mib(room)} left of privacy.physical_batch_memory ({mib(budget_bytes)}) after the "
                          "sum, noise and optimizer state: lower data.max_length, use privacy.clipping_memory: low, "
                          "gradient checkpointing or LoRA, or raise the budget")
    size = 1
    if upper >= 2 and peak(2) <= room:
        lower, size = 1, 2
        while size < upper and len(peaks) < 12:  # the next size read off the line through the last two that fit
            slope = max((peak(size) - peak(lower)) / (size - lower), peak(size) / (2 * size), 1.0)
            over = min((b for b, value in peaks.items() if value > room), default=upper + 1)
            guess = min(upper, over - 1, 8 * size, size + int((room - peak(size)) // slope))  # at most 8x the last
            while guess > size and peak(guess) > room and len(peaks) < 12:  # lowered while it does not fit
                shrunk = int(guess * room / peak(guess)) if math.isfinite(peak(guess)) else (size + guess) // 2
                guess = max(size, min(guess - 1, shrunk))
            if guess <= size or peak(guess) > room:
                break
            lower, size = size, guess
    state = states.get(size)
    return MicroBatch(size=size, peak_bytes=int(peak(size)), budget_bytes=budget_bytes, reserve_bytes=reserve_bytes,
                      tokens=tokens, measure=measured[0], clipping_bytes=None if state is None else state[0],
                      one_pass=state is not None and state[1])


def auto_clipper(plugin_manager: Any, model: torch.nn.Module) -> Any:
    """The clipper of the default estimator under flat ``clipping_memory: auto`` (whose budget the probe sets), or
    None (another estimator, mode or ``clipping: per_layer``)."""
    from dpl.core.plugin_manager import replaced_hooks

    clip = dict(plugin_manager.list_name_plugin()).get("clip")
    if clip is None or "estimate_gradient" in replaced_hooks(plugin_manager) or not hasattr(clip, "auto_clipper"):
        return None
    return clip.auto_clipper(model)


def probe_micro_batch(plugin_manager: Any, ctx: Any, probe_batch: Callable[[int], dict[str, Any]], *,
                      upper: int, per_unit: bool, memory_mib: float | None, tokens: int | None = None,
                      context: Callable[[], Any] | None = None) -> MicroBatch:
    """The micro-batch of ``physical_batch_size: auto``: the plugins' ``estimate_gradient(ctx=ctx,
    batch=probe_batch(b))`` probed (:func:`choose_micro_batch`) within ``memory_mib`` (default:
    :func:`default_budget_bytes`), each probe wrapped in ``context`` (the trainer's autocast); ``per_unit``: every
    probe example its own unit (the step's per-user path). Under ``clipping_memory: auto`` its state is chosen within
    the same budget (the module docstring). ``ctx`` holds no noise source; torch's global generators are restored
    after, the trainable gradients cleared."""
    from contextlib import nullcontext

    from dpl.core.privacy_unit import UNITS_KEY

    trainable = ctx.trainable
    device = next(iter(trainable.values())).device
    budget = int(memory_mib * MIB) if memory_mib is not None else default_budget_bytes(device)
    # kept free for what the step holds besides the passes: the running clipped sum, the noisy release and two
    # optimizer states, float32 per trainable coordinate each
    reserve = 4 * 4 * sum(t.numel() for t in trainable.values())

    def probe(size: int) -> tuple[int, bool] | None:
        batch = probe_batch(size)
        if per_unit:
            batch = {**batch, UNITS_KEY: torch.arange(size, device=device)}
        ctx.scratch.clear()
        with context() if context is not None else nullcontext():
            part = plugin_manager.hook.estimate_gradient(ctx=ctx, batch=batch)
        if part is not None:
            part.wipe()
        ctx.scratch.clear()
        return None if clipper is None else (clipper.peak_held_bytes, clipper.one_pass)

    def choose() -> MicroBatch:
        probe(1)  # once unmeasured: the first step's one-time allocations (kernels' caches) are held before any step
        return choose_micro_batch(probe, upper=upper, budget_bytes=budget, reserve_bytes=reserve, device=device,
                                  tokens=tokens)

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        clipper = auto_clipper(plugin_manager, ctx.model)
        if clipper is None:
            choice = choose()
        else:  # the state may take all the step leaves of the budget (at most clipping_memory_budget, if set)
            configured = clipper.budget_mib
            clipper.budget = max(0, budget - reserve if configured is None else min(int(configured * MIB),
                                                                                    budget - reserve))
            try:
                choice = choose()
            except ConfigError:
                if clipper.budget == 0:
                    raise
                log.info("dpl: physical_batch_size auto: one example does not fit with auto's clipping state; "
                         "probing again with none kept (low's memory)")
                clipper.budget = 0
                choice = choose()
            clipper.budget = choice.clipping_bytes  # no batch holds more state than the probe at its size did
    for p in trainable.values():
        p.grad = None
    return choice
