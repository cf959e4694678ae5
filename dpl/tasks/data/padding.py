"""Batches of prompt -> completion examples as padded LongTensors: right-padded for training (the loss reads
``labels``), left-padded for generation (every prompt ends where generation starts)."""

from __future__ import annotations

from typing import Any

import torch

#: label value of positions that carry no loss (prompt tokens and padding)
IGNORE_INDEX = -100


def probe_ids(tokenizer: Any, size: int, length: int) -> list[list[int]]:
    """``size`` rows of ``length`` random ordinary token ids (no special token), from a fixed public generator: the
    public stand-in for the longest training examples on which ``physical_batch_size: auto`` probes the step."""
    high = int(getattr(tokenizer, "vocab_size", None) or len(tokenizer))
    special = sorted({i for i in (getattr(tokenizer, "all_special_ids", None) or []) if 0 <= i < high})
    plain = [i for i in range(high) if i not in set(special)]
    ids = torch.randint(0, high, (size, length), generator=torch.Generator().manual_seed(0))
    if special and plain:  # (a toy vocabulary may hold nothing but special tokens)
        ids[torch.isin(ids, torch.tensor(special))] = plain[0]
    return ids.tolist()


def training_batch(examples: list[dict[str, Any]], pad: int) -> dict[str, torch.Tensor]:
    """``input_ids`` (``pad``), ``attention_mask`` (1/0) and ``labels`` (``IGNORE_INDEX`` on padding), right-padded
    to the longest example, each ``[b, longest]``, in the given order; no examples: three ``[0, 0]`` tensors."""
    length = max((len(e["input_ids"]) for e in examples), default=0)
    ids, mask, labels = [], [], []
    for e in examples:
        n = len(e["input_ids"])
        fill = length - n
        ids.append([*e["input_ids"], *[pad] * fill])
        mask.append([1] * n + [0] * fill)
        labels.append([*e["labels"], *[IGNORE_INDEX] * fill])
    shape = (len(examples), length)
    return {"input_ids": torch.tensor(ids, dtype=torch.long).reshape(shape),
            "attention_mask": torch.tensor(mask, dtype=torch.long).reshape(shape),
            "labels": torch.tensor(labels, dtype=torch.long).reshape(shape)}


def generation_batch(examples: list[dict[str, Any]], pad: int) -> dict[str, Any]:
    """Left-padded ``input_ids`` and ``attention_mask`` ``[b, longest prompt]``, with each example's
    ``references`` (``list[list[str]]``) and ``prompts`` (``list[str]``), in the given order."""
    length = max(len(e["input_ids"]) for e in examples)
    ids, mask = [], []
    for e in examples:
        n = len(e["input_ids"])
        fill = length - n
        ids.append([*[pad] * fill, *e["input_ids"]])
        mask.append([0] * fill + [1] * n)
    return {"input_ids": torch.tensor(ids, dtype=torch.long),
            "attention_mask": torch.tensor(mask, dtype=torch.long),
            "references": [list(e["references"]) for e in examples],
            "prompts": [e["prompt"] for e in examples]}
