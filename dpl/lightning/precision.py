"""The trainer's precision under private training: float16 refused (per-example clipping does no loss scaling), and
a note where bfloat16 is emulated on this CPU."""

from __future__ import annotations

import logging
from typing import Any

import torch

from dpl.errors import ConfigError

log = logging.getLogger("dpl")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices natively (AVX512-BF16, AMX, Arm BF16), per oneDNN."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def check_precision(trainer: Any) -> None:
    """Refuse float16 in one line; say (log) when bf16 is emulated on a CPU without native bfloat16 arithmetic."""
    precision = str(getattr(trainer, "precision", "32"))
    if precision.startswith("16"):
        raise ConfigError(f"trainer.precision={precision} is not supported: float16 needs loss scaling, which "
                          "per-example clipping does not do; use bf16-mixed (or 32)")
    device = getattr(getattr(trainer, "strategy", None), "root_device", None)
    if precision.startswith("bf16") and getattr(device, "type", None) == "cpu" and not cpu_has_native_bf16():
        log.info("dpl: this CPU has no native bfloat16 arithmetic: trainer.precision=%s is emulated and slower "
                 "than float32 here (--trainer.precision 32-true)", precision)
