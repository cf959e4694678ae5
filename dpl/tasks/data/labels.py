"""Class labels of classification data: one canonical string per label value, and a stable label order."""

from __future__ import annotations

import numbers
import re
from typing import Any

_INT = re.compile(r"[+-]?\d+")
_SHOW_LABELS = 20


def label_key(value: Any, names: list[str] | None = None) -> str | None:
    """The canonical string of a label value (``None`` for a missing label).

    Integers (and integral floats) become their decimal string, strings are stripped, booleans become
    ``true``/``false``; with ``names`` (a ``ClassLabel`` feature) an integer is replaced by its name.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, numbers.Integral):
        if names is not None:
            return names[int(value)] if 0 <= int(value) < len(names) else None
        return str(int(value))
    if isinstance(value, float):
        if value != value:  # NaN
            return None
        return str(int(value)) if value.is_integer() else str(value)
    if isinstance(value, str):
        return value.strip() or None
    return str(value)


def sort_labels(keys: Any) -> list[str]:
    """Stable label order: numerically if every label is an integer, else lexicographically."""
    keys = set(keys)
    if keys and all(_INT.fullmatch(k) for k in keys):
        return sorted(keys, key=lambda k: (int(k), k))
    return sorted(keys)


def show_labels(labels: list[str]) -> str:
    shown = ", ".join(repr(x) for x in labels[:_SHOW_LABELS])
    return f"[{shown}, ... ({len(labels)} labels)]" if len(labels) > _SHOW_LABELS else f"[{shown}]"
