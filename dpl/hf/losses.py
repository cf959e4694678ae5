"""One loss per example from a Hugging Face model's outputs and the batch's own labels (the label masks of the
trainer's collator: ``-100`` on every token that is not learned, as TRL's completion-only and assistant-only masks
and padding set them).

* causal LM (``task="causal_lm"``): the mean next-token cross-entropy over the example's labelled tokens, exactly
  :func:`dpl.tasks.modules.generation.completion_token_loss` (``dpl fit``'s generation loss); all-padding columns are
  dropped and the vocabulary-sized output layer runs only from the earliest labelled position, as ``dpl fit`` does;
* sequence classification (``"sequence_classification"``): cross-entropy of each example's label (mean squared error
  for a regression head, ``num_labels == 1``);
* token classification (``"token_classification"``): the mean cross-entropy over the example's labelled tokens.

``task="auto"`` picks one from the model (a model that generates text and is not an encoder-decoder: causal LM) and
from the shape of its logits.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpl.core.privacy_unit import UNITS_KEY
from dpl.errors import ConfigError

IGNORE_INDEX = -100
Task = Literal["auto", "causal_lm", "sequence_classification", "token_classification"]
TASKS = ("auto", "causal_lm", "sequence_classification", "token_classification")


def is_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` (or the model a peft wrapper holds) is a decoder-only language model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return False
    return type(base).__name__.endswith("ForCausalLM") or bool(getattr(base, "can_generate", lambda: False)())


def model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch without what the model must not see: the labels and the privacy unit of each row."""
    return {k: v for k, v in batch.items() if k not in ("labels", UNITS_KEY)}


def causal_lm_loss(model: nn.Module, batch: dict[str, Any]) -> Tensor:
    """Per-example mean cross-entropy of next-token prediction over the labelled tokens (right padding)."""
    from dpl.tasks.modules.generation import completion_token_loss

    labels = batch["labels"]
    inputs = model_inputs(batch)
    mask = inputs.get("attention_mask")
    if mask is not None and mask.numel():  # right padding: drop the columns that are padding in every row
        length = int(mask.sum(1).max())
        inputs = {k: v[:, :length] if torch.is_tensor(v) and v.dim() == 2 and v.shape[1] == mask.shape[1] else v
                  for k, v in inputs.items()}
        labels = labels[:, :length]
    length = labels.shape[1]
    scored = labels != IGNORE_INDEX
    start = max(0, int(scored.float().argmax(1)[scored.any(1)].min()) - 1) if scored.any() else 0
    logits = model(**inputs, use_cache=False, logits_to_keep=length - start).logits
    return completion_token_loss(logits, labels[:, start:])


def sequence_classification_loss(model: nn.Module, batch: dict[str, Any]) -> Tensor:
    logits = model(**model_inputs(batch)).logits
    labels = batch["labels"]
    if logits.shape[-1] == 1 or labels.is_floating_point():  # a regression head
        return F.mse_loss(logits.float().view(labels.shape[0], -1), labels.float().view(labels.shape[0], -1),
                          reduction="none").mean(1)
    return F.cross_entropy(logits.float(), labels, reduction="none")


def token_classification_loss(model: nn.Module, batch: dict[str, Any]) -> Tensor:
    logits = model(**model_inputs(batch)).logits
    labels = batch["labels"]
    token_loss = F.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none")
    return token_loss.sum(1) / (labels != IGNORE_INDEX).sum(1).clamp(min=1)


LOSSES = {"causal_lm": causal_lm_loss, "sequence_classification": sequence_classification_loss,
          "token_classification": token_classification_loss}


def resolve_task(task: str, model: nn.Module) -> str:
    """``task``, with ``auto`` resolved from the model (one-line ConfigError for an unknown task)."""
    if task not in TASKS:
        raise ConfigError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    if task != "auto":
        return task
    if is_causal_lm(model):
        return "causal_lm"
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = type(base).__name__
    if name.endswith("ForTokenClassification"):
        return "token_classification"
    if name.endswith("ForSequenceClassification"):
        return "sequence_classification"
    raise ConfigError(f"cannot tell the per-example loss of {name}: pass task= (causal_lm, sequence_classification, "
                      "token_classification) or override per_example_loss(model, batch)")


def per_example_loss(task: str, model: nn.Module, batch: dict[str, Any]) -> Tensor:
    """One loss per example of ``batch`` (shape ``(b,)``) for the resolved ``task``."""
    if "labels" not in batch:
        raise ConfigError("the training batch has no 'labels': the per-example loss needs the collator's labels")
    return LOSSES[task](model, batch)
