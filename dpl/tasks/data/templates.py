"""Prompt and completion templates of generation data: ``str.format`` templates over a :class:`Record`'s fields."""

from __future__ import annotations

import re
import string
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpl.errors import DataError

_SHOW_FIELDS = 20


@dataclass
class Record:
    """One row of a data file: the ``fields`` the templates read, and where it comes from (for errors).

    ``group`` is the evaluation grouping key: records with the same key form one source (their completions are
    the references of one prompt). ``None`` groups by the rendered prompt.
    """

    fields: dict[str, Any]
    path: Path
    where: str  # "line 12", "entry 3", ...
    group: Hashable | None = None


def template_fields(template: str, arg: str) -> list[str]:
    """The field names a ``str.format`` template uses (the part before any ``.attr`` / ``[key]``).

    Raises :class:`DataError` for a malformed template or a positional field (``{}``, ``{0}``)."""
    if not isinstance(template, str):
        raise DataError(f"data.{arg} must be a string, got {type(template).__name__}")
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise DataError(f"data.{arg} {template!r} is not a valid str.format template ({exc}; write a literal "
                        f"brace as {{{{ or }}}})") from None
    names: list[str] = []
    for _, name, _, _ in parsed:
        if name is None:
            continue
        root = re.split(r"[.\[]", name, maxsplit=1)[0]
        if root == "" or root.isdigit():
            raise DataError(f"data.{arg} {template!r} has a positional field {{{name}}}: name the field, "
                            f"e.g. {{mr}}")
        if root not in names:
            names.append(root)
    return names


def show_fields(fields: Any) -> str:
    """The field names, for an error message (at most :data:`_SHOW_FIELDS`)."""
    names = list(fields)
    shown = ", ".join(str(n) for n in names[:_SHOW_FIELDS])
    return shown + (f", ... ({len(names)} fields)" if len(names) > _SHOW_FIELDS else "") if names else "none"


def render(template: str, arg: str, record: Record) -> str:
    """``template`` filled with ``record``'s fields; a missing field or a bad format is a :class:`DataError`
    naming the record."""
    try:
        return template.format_map(record.fields)
    except KeyError as exc:
        name = exc.args[0] if exc.args else "?"
        raise DataError(f"{record.path} {record.where}: data.{arg} {template!r} uses field {name!r}, which the "
                        f"data does not have (available fields: {show_fields(record.fields)})") from None
    except (ValueError, IndexError, AttributeError, TypeError) as exc:
        raise DataError(f"{record.path} {record.where}: cannot fill data.{arg} {template!r}: "
                        f"{type(exc).__name__}: {exc}") from None
