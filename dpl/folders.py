"""Output folders: whether a folder can be written before anything is written into it."""

from __future__ import annotations

import os
from pathlib import Path

from dpl.errors import ConfigError


def check_writable(path: Path | str, what: str) -> None:
    """Raise :class:`~dpl.errors.ConfigError` (one line) unless the folder ``path`` exists as a writable folder or
    can be created: no ancestor of it may be a file, and the deepest existing one must be writable."""
    path = Path(path).absolute()
    existing = path
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        under = "is a file" if existing == path else f"lies under a file ({existing})"
        raise ConfigError(f"{what} {str(path)!r} {under}: name a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {str(path)!r} is not writable ({existing} does not allow writing here)")
