"""dpl inside Hugging Face trainers: ``from dpl.hf import PrivateTrainer, PrivateSFTTrainer``
(docs/from-trainer.md). ``PrivateSFTTrainer`` needs TRL (``pip install 'dpl[hf]'``)."""

from __future__ import annotations

from typing import Any

__all__ = ["PrivateTrainer", "PrivateTrainerMixin", "PrivateSFTTrainer"]


def __getattr__(name: str) -> Any:
    if name in ("PrivateTrainer", "PrivateTrainerMixin"):
        from dpl.hf import trainer

        return getattr(trainer, name)
    if name == "PrivateSFTTrainer":
        try:
            from dpl.hf.sft import PrivateSFTTrainer
        except ImportError as exc:
            if "trl" not in str(exc):
                raise
            from dpl.errors import ConfigError

            raise ConfigError("PrivateSFTTrainer needs TRL: pip install 'dpl[hf]' (or pip install trl)") from None
        return PrivateSFTTrainer
    raise AttributeError(f"module 'dpl.hf' has no attribute {name!r}")
