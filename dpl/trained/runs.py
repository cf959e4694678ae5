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
    """What inference needs. ``data`` holds the data module's settings (``max_length``, ``text_column``,
    ``prompt_template`` ...), ``checkpoint`` the loaded checkpoint (``None`` for an exported folder)."""

    module: Any
    tokenizer: Any
    task: str
    label_names: list[str] | None = None
    data: dict[str, Any] = field(default_factory=dict)
    checkpoint: dict[str, Any] | None = None
    source: Path | None = None


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


def _label_names(checkpoint: dict[str, Any]) -> list[str] | None:
    for value in checkpoint.values():  # the data module's state: {"label_map": {name: id}}
        if isinstance(value, dict) and isinstance(value.get("label_map"), dict):
            mapping = value["label_map"]
            return [name for name, _ in sorted(mapping.items(), key=lambda kv: kv[1])]
    return None


def load_run(path: str | Path) -> LoadedRun:
    """Load a run (folder or ``.ckpt``) or an exported folder, in eval mode, on the CPU."""
    path = Path(path)
    if (path / EXPORT_META).is_file():
        return load_export(path)
    ckpt = find_checkpoint(path)
    config = _run_config(ckpt)
    from dpl.lightning.checkpoint import load_checkpoint_file  # torch: when a run is loaded, not at import

    checkpoint = load_checkpoint_file(ckpt)  # the public file only: never the .secret sidecar
    module = _instantiate(config, "model")
    data = dict((config.get("data") or {}).get("init_args") or {})
    from dpl.tasks.loading import load_tokenizer

    tokenizer = load_tokenizer(data.get("tokenizer") or module.model_location)
    labels = None
    if module.task == "classification":
        labels = _label_names(checkpoint)
        if labels is None:
            raise ConfigError(f"{ckpt}: the checkpoint has no label map (written by an older dpl?)")
        module.label_names = labels
        module.num_labels = len(labels)
        module.head_origin = "weights from the checkpoint"
    else:
        module.tokenizer = tokenizer
    module.ensure_model()
    module.restore_frozen(checkpoint)
    module.load_state_dict(checkpoint["state_dict"])
    module.eval()
    return LoadedRun(module=module, tokenizer=tokenizer, task=module.task, label_names=labels, data=data,
                     checkpoint=checkpoint, source=ckpt)


def load_export(folder: str | Path) -> LoadedRun:
    """An exported folder (:func:`dpl.trained.export.export_run`), wrapped in its task module for predictions."""
    folder = Path(folder)
    meta = json.loads((folder / EXPORT_META).read_text())
    from dpl.tasks.loading import load_tokenizer

    tokenizer = load_tokenizer(str(folder))
    task = meta["task"]
    if task == "classification":
        from transformers import AutoModelForSequenceClassification

        from dpl.tasks.modules import DPClassificationModule

        module = DPClassificationModule(model=str(folder), num_labels=len(meta["label_names"]))
        module.label_names = list(meta["label_names"])
        module.model = _from_pretrained(AutoModelForSequenceClassification, folder)
    else:
        from transformers import AutoModelForCausalLM

        from dpl.tasks.modules import DPGenerationModule, GenerationOptions

        module = DPGenerationModule(model=str(folder), generation=GenerationOptions(**meta.get("generation", {})))
        module.tokenizer = tokenizer
        module.model = _from_pretrained(AutoModelForCausalLM, folder)
    module.eval()
    return LoadedRun(module=module, tokenizer=tokenizer, task=task, label_names=meta.get("label_names"),
                     data=dict(meta.get("data") or {}), source=folder)


def _from_pretrained(auto_class: Any, folder: Path) -> Any:
    """Load an exported model (a PEFT adapter folder through peft; dpl's mean-pooling head as its remote code)."""
    if (folder / "adapter_config.json").is_file():
        from peft import AutoPeftModelForCausalLM, AutoPeftModelForSequenceClassification

        peft_class = AutoPeftModelForCausalLM if "CausalLM" in auto_class.__name__ else \
            AutoPeftModelForSequenceClassification
        return peft_class.from_pretrained(str(folder))
    return auto_class.from_pretrained(str(folder), trust_remote_code=(folder / "modeling_dpl.py").is_file())
