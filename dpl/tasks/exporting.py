"""Writing and reading exported models, for the task modules' ``export_model`` / ``from_export``.

Merged weights: LoRA merged into the base, saved with ``save_pretrained`` (a base read from a GGUF file was
dequantized to float32 when it loaded: it is saved as an ordinary safetensors model). Adapters: peft's adapter files
and, in ``adapter_config.json``, a base that ``from_pretrained`` loads as is - the configured base model's folder, or,
where that folder does not load as is (a GGUF file; a classifier whose head and labels the base does not have), the
base as trained saved once beside the adapter in ``base/`` (:data:`BASE_FOLDER`).
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path
from typing import Any

from dpl.errors import ConfigError
from dpl.tasks.gguf import serializable
from dpl.tasks.loading import resolve_path

BASE_FOLDER = "base"


def is_peft(model: Any) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def merged(model: Any) -> Any:
    """``model`` with its LoRA adapters merged into the weights (``model`` itself when it has none)."""
    return model.merge_and_unload() if is_peft(model) else model


def label_config(config: Any, names: list[str]) -> None:
    """Write the label names into a transformers config (``id2label``, ``label2id``, ``num_labels``)."""
    config.id2label = dict(enumerate(names))
    config.label2id = {name: i for i, name in enumerate(names)}


def save_merged(model: Any, folder: Path) -> None:
    """Merged weights of ``model`` into ``folder`` (loads with the plain ``AutoModelFor...`` class)."""
    model = merged(model)
    with serializable(model):
        model.save_pretrained(folder)


def loads_as_is(location: str) -> bool:
    """Whether ``from_pretrained(resolve_path(location))`` reads the model (a folder with ``config.json`` or a
    hub id), unlike a ``.gguf`` file."""
    path = Path(resolve_path(location))
    if path.suffix == ".gguf":
        return False
    return (path / "config.json").is_file() or not path.exists()


def save_adapter(model: Any, folder: Path, base_location: str, own_base: bool) -> str:
    """The PEFT adapter of ``model`` into ``folder``, naming a base ``from_pretrained`` loads: ``base_location``
    resolved, or (``own_base``) the base as trained, saved into ``folder/base``. Returns the base's path."""
    with warnings.catch_warnings():  # peft looks for a config.json beside a GGUF file
        warnings.filterwarnings("ignore", message="Could not find a config file")
        model.save_pretrained(folder)
    if own_base:
        base = copy.deepcopy(model).unload()  # the weights without the adapter, the config as trained
        with serializable(base):
            base.save_pretrained(folder / BASE_FOLDER)
        base_path = str((folder / BASE_FOLDER).resolve())
    else:
        base_path = resolve_path(base_location)
    config_file = folder / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["base_model_name_or_path"] = base_path
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    (folder / "README.md").unlink(missing_ok=True)  # peft's empty model-card template: dpl writes its own
    return base_path


def relocate_base(folder: Path) -> None:
    """Point a moved adapter folder's ``adapter_config.json`` at its own ``base/`` (after the export's rename)."""
    config_file = folder / "adapter_config.json"
    if config_file.is_file() and (folder / BASE_FOLDER).is_dir():
        config = json.loads(config_file.read_text())
        config["base_model_name_or_path"] = str((folder / BASE_FOLDER).resolve())
        config_file.write_text(json.dumps(config, indent=2) + "\n")


def load_exported(auto_class: Any, folder: Path, **kwargs: Any) -> Any:
    """A model that :func:`save_merged` or :func:`save_adapter` wrote (a moved adapter folder still finds its
    ``base/``), in eval mode."""
    if not (folder / "adapter_config.json").is_file():
        return auto_class.from_pretrained(str(folder), **kwargs).eval()
    from peft import PeftModel

    base = folder / BASE_FOLDER
    if not base.is_dir():
        base = Path(json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"])
    try:
        model = auto_class.from_pretrained(str(base), **kwargs)
    except OSError as exc:
        raise ConfigError(f"{folder}: cannot load its base model {base} ({str(exc).splitlines()[0]})") from exc
    return PeftModel.from_pretrained(model, str(folder)).eval()
