"""A finished run, loaded for inference (``dpl predict``, ``dpl export``): the task module with the checkpoint's
weights, the tokenizer, the label names and the data settings that shape the inputs.

A run is named by its log folder (``.../lightning_logs/version_N``, which holds ``config.yaml`` and
``checkpoints/last.ckpt``), by a checkpoint file (its run's ``config.yaml`` two folders up), or, for the
predictions, by an exported folder (:mod:`dpl.trained.export`). The checkpoint's ``.secret`` sidecar is never read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dpl.errors import ConfigError

EXPORT_META = "dpl.json"  # what an exported folder adds for dpl predict (task, label names, prompt template)


@dataclass
class LoadedRun:
    """What inference needs: the task module (:class:`~dpl.tasks.modules.base.DPTaskModule`, which knows how its task
    predicts and exports), the tokenizer, the data module's settings (``max_length``, ``text_column``,
    ``prompt_template`` ...) and the loaded checkpoint (``None`` for an exported folder)."""

    module: Any
    tokenizer: Any
    data: dict[str, Any] = field(default_factory=dict)
    checkpoint: dict[str, Any] | None = None
    source: Path | None = None

    @property
    def task(self) -> str:
        return self.module.task

    @property
    def label_names(self) -> list[str] | None:
        return getattr(self.module, "label_names", None)


def find_checkpoint(path: str | Path) -> Path:
    """The checkpoint a path names: a ``.ckpt`` file, or a run folder's ``checkpoints/last.ckpt``."""
    path = Path(path)
    if path.is_file():
        return path
    for candidate in (path / "checkpoints" / "last.ckpt", path / "last.ckpt"):
        if candidate.is_file():
            return candidate
    runs = sorted(path.glob("**/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime)
    if runs:
        return runs[-1]  # a default_root_dir: its newest run
    raise ConfigError(f"{path}: no checkpoint (give a run folder with checkpoints/last.ckpt, a .ckpt file or an "
                      f"exported folder)")


def _run_config(ckpt: Path) -> dict[str, Any]:
    for folder in (ckpt.parent.parent, ckpt.parent):
        if (folder / "config.yaml").is_file():
            return yaml.safe_load((folder / "config.yaml").read_text()) or {}
    raise ConfigError(f"{ckpt}: no config.yaml of its run (expected in {ckpt.parent.parent}); dpl fit saves it in "
                      f"the run's log folder")


def _instantiate(config: dict[str, Any], group: str) -> Any:
    from lightning.pytorch.cli import LightningArgumentParser

    from dpl.lightning.module import DPModule

    parser = LightningArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(DPModule, group, required=True)
    try:
        parsed = parser.parse_object({group: config[group]})
        return parser.instantiate_classes(parsed)[group]
    except Exception as exc:  # noqa: BLE001 - jsonargparse wraps everything
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"cannot rebuild the run's {group} from its config.yaml ({first})") from exc


def load_run(path: str | Path) -> LoadedRun:
    """Load a run (folder or ``.ckpt``) or an exported folder, in eval mode, on the CPU."""
    path = Path(path)
    if (path / EXPORT_META).is_file():
        return load_export(path)
    ckpt = find_checkpoint(path)
    from dpl.lightning.checkpoint import load_checkpoint_file  # torch: when a run is loaded, not at import

    checkpoint = load_checkpoint_file(ckpt)  # the public file only (never the .secret sidecar); first: a truncated
    config = _run_config(ckpt)  # file is said to be truncated wherever it lies
    module = _instantiate(config, "model")
    data = dict((config.get("data") or {}).get("init_args") or {})
    from dpl.tasks.loading import load_tokenizer

    tokenizer = load_tokenizer(data.get("tokenizer") or module.model_location)
    module.restore_for_inference(checkpoint, tokenizer)
    module.ensure_model()
    module.restore_frozen(checkpoint)
    module.load_state_dict(checkpoint["state_dict"])
    module.eval()
    return LoadedRun(module=module, tokenizer=tokenizer, data=data, checkpoint=checkpoint, source=ckpt)


def load_export(folder: str | Path) -> LoadedRun:
    """An exported folder (:func:`dpl.trained.export.export_run`), wrapped in its task module for predictions."""
    folder = Path(folder)
    meta = json.loads((folder / EXPORT_META).read_text())
    from dpl.tasks.loading import load_tokenizer
    from dpl.tasks.modules import task_class

    tokenizer = load_tokenizer(str(folder))
    module = task_class(meta["task"]).from_export(folder, meta, tokenizer)
    module.eval()
    return LoadedRun(module=module, tokenizer=tokenizer, data=dict(meta.get("data") or {}), source=folder)
