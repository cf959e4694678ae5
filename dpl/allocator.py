"""Keep freed memory in the process: glibc's malloc tuned for a training loop.

A training step frees and allocates again the same large buffers every step (activations, the recorded layer
outputs, per-example products, gradients, noise). glibc serves each block above its mmap threshold with a fresh
``mmap`` and gives it back with ``munmap``, and trims the top of its heap when enough of it is free, so every step
pays page faults and the kernel's zeroing of those pages again. A private step allocates more than a
non-private one, so it pays more: on MiniLM LoRA (2 CPU cores) this alone was most of the private step's overhead
(``benchmarks/step_time.py``; docs/benchmarks.md).

:func:`keep_freed_memory` asks glibc (``mallopt``) to serve every block from its heap and never trim it: freed
memory is reused by the next step. The resident memory then stays at the run's peak instead of shrinking between
steps; the peak itself does not grow. Freed blocks keep their contents until reused, as any heap memory does;
nothing leaves the process. The ``dpl`` command calls it at start; ``DPL_MALLOC=system`` opts out.

What the process holds is then its resident memory, not its live tensors: :func:`resident_bytes`,
:func:`release_freed_memory` and :func:`reset_resident_peak` let ``physical_batch_size: auto`` measure it
(:mod:`dpl.core.micro_batch`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_MAX = -4
_NEVER = 2 ** 31 - 1  # the largest int mallopt takes: a free top of the heap below 2 GiB is never trimmed


def keep_freed_memory() -> bool:
    """Serve every allocation from glibc's heap and keep freed memory for reuse (see the module docstring).
    Returns whether the setting was applied: only on Linux with glibc, and not under ``DPL_MALLOC=system``."""
    if os.environ.get("DPL_MALLOC", "").strip().lower() == "system" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _NEVER))


# ------------------------------------------------------------------------- what the process holds (Linux)


def resident_bytes(field: str = "VmRSS") -> int | None:
    """The process's resident memory (``VmRSS``) or its peak since the last :func:`reset_resident_peak` (``VmHWM``),
    from ``/proc/self/status``; None where there is none."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def release_freed_memory() -> None:
    """Give the freed memory glibc keeps back to the system (``malloc_trim(0)``): the resident memory falls to what is
    allocated. A no-op without glibc."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_resident_peak() -> bool:
    """Restart the peak resident memory (``VmHWM``) from the current (Linux: ``5`` to ``/proc/self/clear_refs``).
    Returns whether it could."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return resident_bytes("VmHWM") is not None
    except OSError:
        return False
