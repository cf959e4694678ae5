"""Examples longer than ``data.max_length`` tokens, cut to fit: a prompt loses its start (:func:`keep_prompt_end`:
a leading BOS, or a chat template's frame, kept), a conversation keeps its end (:func:`keep_end`: and a leading BOS);
:func:`truncate` cuts the examples of one split that do not fit and says how many in one warning."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TypeVar

__all__ = ["keep_end", "keep_prompt_end", "truncate"]

Example = TypeVar("Example")


def truncate(examples: list[Example], limit: int, length: Callable[[Example], int],
             cut: Callable[[Example], Example], split: str, what: str) -> list[Example]:
    """``examples`` with each one of more than ``limit`` tokens (``length``) replaced by ``cut(example)``; when any
    was, one warning ``"<split>: <count> of <total> <what>"`` (``what``: which examples, the limit and the cut)."""
    long = [length(example) > limit for example in examples]
    if any(long):
        warnings.warn(f"{split}: {sum(long)} of {len(examples)} {what}", stacklevel=2)
    return [cut(example) if over else example for example, over in zip(examples, long)]


def keep_end(ids: list[int], budget: int, bos: int | None, labels: list[int] | None = None
             ) -> tuple[list[int], list[int] | None]:
    """``ids`` (and ``labels``, cut alike) in at most ``budget`` (>= 1) tokens: a leading ``bos`` when there is room
    for it and one more token, then the last tokens."""
    if len(ids) <= budget:
        return ids, labels
    keep = 1 if bos is not None and ids[0] == bos and budget > 1 else 0
    start = len(ids) - budget + keep

    def cut(seq: list[int]) -> list[int]:
        return [*seq[:keep], *seq[start:]]

    return cut(ids), (cut(labels) if labels is not None else None)


def keep_prompt_end(ids: list[int], budget: int, bos: int | None, head: list[int], tail: list[int]) -> list[int]:
    """A prompt in ``budget`` (>= 1) tokens: its text loses tokens from its start. A chat template's frame (``head``
    and ``tail``: the tokens before and after the user's prompt) stays when there is room for it and one more token;
    otherwise the last tokens stay, after a leading ``bos`` when there is room for it."""
    if len(ids) <= budget:
        return ids
    keep = 1 if bos is not None and ids[0] == bos else 0
    if head and len(head) + len(tail) < budget and ids[:len(head)] == head and ids[len(ids) - len(tail):] == tail:
        keep = len(head)
    elif keep >= budget:
        keep = 0
    return [*ids[:keep], *ids[len(ids) - budget + keep:]]
