"""Tokenisation shared by the text metrics: lowercased mteval-v13a (sacrebleu ``13a``) tokens, and the same
tokens without the standalone punctuation that the MS-COCO caption code drops (for ROUGE-L, METEOR, CIDEr)."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

# Standalone tokens that the MS-COCO PTBTokenizer wrapper drops ("-LRB-" etc. are its brackets).
_COCO_PUNCTUATION = frozenset(
    ["''", "'", "``", "`", '"', "(", ")", "{", "}", ".", "?", "!", ",", ":", "-", "--", "...", ";"]
)


def tokenize(text: str) -> list[str]:
    """Lowercase ``text`` and split it into mteval-v13a (sacrebleu ``13a``) tokens."""
    return _tokenizer_13a()(text.lower()).split()


@functools.cache
def _tokenizer_13a():
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

    return Tokenizer13a()


def drop_punctuation(tokens: list[str]) -> list[str]:
    """``tokens`` without standalone punctuation tokens (MS-COCO convention)."""
    return [t for t in tokens if t not in _COCO_PUNCTUATION]


def ngrams(tokens: Sequence[str], n: int) -> Iterable[tuple[str, ...]]:
    """The ``n``-grams of ``tokens``, in order."""
    return (tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))
