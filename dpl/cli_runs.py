"""Run folders of ``dpl fit`` / ``validate`` / ``test``: the folders a run is about to create, and their removal when
the run fails before it wrote a checkpoint (no empty or half-written run folder is left behind)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any


def run_folder(trainer: Any) -> Path | None:
    """The trainer's run folder (its logger's log folder, else ``default_root_dir``), absolute; None if it has none."""
    try:
        location = trainer.log_dir or trainer.default_root_dir
    except Exception:  # noqa: BLE001 - a logger without a log folder
        location = trainer.default_root_dir
    return Path(location).absolute() if location else None


def missing_folders(path: Path | None) -> list[Path]:
    """``path`` and its ancestors that do not exist yet, deepest first: the folders a run there creates."""
    missing = []
    while path is not None and not path.exists() and path.parent != path:
        missing.append(path)
        path = path.parent
    return missing


def remove_partial_run(created: list[Path]) -> None:
    """After a failed run: remove the run folder it created (``created[0]``: config.yaml, logs) unless it holds a
    checkpoint, then the parent folders it created (the rest of ``created``) while they are empty."""
    if not created or not created[0].exists() or any(created[0].rglob("*.ckpt")):
        return
    shutil.rmtree(created[0], ignore_errors=True)
    for folder in created[1:]:
        try:
            folder.rmdir()
        except OSError:
            break
