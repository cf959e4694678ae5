"""Which parameters of a pretrained model train: full fine-tuning or LoRA adapters (peft), frozen parameters, and
Hugging Face activation checkpointing (:class:`FinetuneOptions`, :func:`apply_finetuning`); every task module's
``finetuning`` option."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

from dpl.errors import ConfigError

__all__ = ["FinetuneOptions", "LoraOptions", "apply_finetuning", "enable_checkpointing", "freeze_parameters"]


@dataclass
class LoraOptions:
    """LoRA settings (peft).

    Args:
        r: rank of the adapters (trainable parameters, hence noise, grow with it).
        alpha: scaling numerator: the adapter's update is scaled by alpha / r.
        dropout: dropout on the adapters' input.
        target_modules: names of the modules that get adapters (e.g. ``[query, value]``); null: peft's default for
            the architecture.
    """

    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] | None = None


@dataclass
class FinetuneOptions:
    """Which parameters train.

    Args:
        method: ``full`` (every parameter but the frozen ones) or ``lora`` (LoRA adapters + the head).
        lora: LoRA settings, used with ``method: lora``.
        freeze: glob patterns of parameter names to freeze (e.g. ``"*embeddings*"``).
        gradient_checkpointing: Hugging Face activation checkpointing (non-reentrant): each layer's activations are
            recomputed in the backward pass instead of kept. Saves memory with ``privacy.clipping_memory`` low or
            auto (docs/scaling.md), at about one more forward pass.
    """

    method: Literal["full", "lora"] = "full"
    lora: LoraOptions = field(default_factory=LoraOptions)
    freeze: list[str] = field(default_factory=list)
    gradient_checkpointing: bool = False


def apply_finetuning(model: nn.Module, options: FinetuneOptions, task_type: str) -> nn.Module:
    """Freeze parameters and wrap with LoRA as ``options`` says; return the model to train."""
    if options.gradient_checkpointing:
        enable_checkpointing(model)
    if options.method == "lora":
        from peft import LoraConfig, get_peft_model

        lora = options.lora
        config = LoraConfig(task_type=task_type, r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                            target_modules=lora.target_modules)
        try:
            model = get_peft_model(model, config)
        except ValueError as exc:
            raise ConfigError(f"LoRA: {exc}") from exc
    elif options.method != "full":
        raise ConfigError(f"finetuning.method must be 'full' or 'lora', got {options.method!r}")
    freeze_parameters(model, options.freeze)
    return model


def enable_checkpointing(model: nn.Module) -> None:
    """Hugging Face activation checkpointing without reentrance (what per-example clipping supports)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(f"finetuning.gradient_checkpointing: {type(model).__name__} does not support activation "
                          "checkpointing")
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def freeze_parameters(model: nn.Module, patterns: list[str]) -> None:
    """Freeze the parameters whose names match one of the glob ``patterns`` (each must match one)."""
    for pattern in patterns:
        matched = [p for n, p in model.named_parameters() if fnmatch.fnmatch(n, pattern)]
        if not matched:
            raise ConfigError(f"finetuning.freeze pattern {pattern!r} matches no parameter")
        for p in matched:
            p.requires_grad_(False)
