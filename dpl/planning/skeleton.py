"""A task module's model without its weights: built from the pretrained model's config on the meta device.

:func:`build_without_weights` runs the module's own ``build_model`` (its head, LoRA, frozen parameters, tied
embeddings) on the meta device, with ``from_pretrained`` of transformers replaced by construction from the config
(under ``accelerate.init_empty_weights`` where accelerate is installed): parameters take no memory and no weights
are read, so the trainable parameters can be counted in a fraction of a second. The loading report names
the modules the checkpoint lacks (from its safetensors header), as a real load would, because a module may build
differently without them (the prompt module's decoder).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import nn


def build_without_weights(module: Any, datamodule: Any = None) -> nn.Module:
    """``module.ensure_model(datamodule)`` with every transformers model built from its config and every tensor
    created on the meta device (the model stays on ``module.model``; the module is for planning only)."""
    import torch

    with without_weights(), torch.device("meta"):
        return module.ensure_model(datamodule)


@contextlib.contextmanager
def without_weights() -> Iterator[None]:
    """Within: ``PreTrainedModel.from_pretrained`` builds the model from its config with empty (meta) parameters."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.__dict__["from_pretrained"]
    PreTrainedModel.from_pretrained = classmethod(_from_config_on_meta)
    try:
        yield
    finally:
        PreTrainedModel.from_pretrained = original


def _empty_weights() -> Any:
    try:
        from accelerate import init_empty_weights
    except ImportError:  # buffers on meta too: enough to count parameters
        import torch

        return torch.device("meta")
    return init_empty_weights()


def _from_config_on_meta(cls: type, location: Any, *args: Any, config: Any = None, output_loading_info: bool = False,
                         **kwargs: Any) -> Any:
    """Stands in for ``from_pretrained``: the Auto classes pass the resolved ``config``; a direct call reads it."""
    if config is None or isinstance(config, (str, Path)):
        source = location if config is None else config
        names = ("gguf_file", "subfolder", "revision", "trust_remote_code", "cache_dir", "local_files_only")
        config = cls.config_class.from_pretrained(source, **{k: kwargs[k] for k in names if k in kwargs})
    with _empty_weights():
        model = cls._from_config(config) if hasattr(cls, "_from_config") else cls(config)
    if getattr(config, "tie_word_embeddings", False) and hasattr(model, "tie_weights"):
        model.tie_weights()
    model.eval()  # as from_pretrained returns it
    if not output_loading_info:
        return model
    missing = missing_modules(model, location, kwargs.get("subfolder") or "")
    return model, {"missing_keys": missing, "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}


def checkpoint_keys(location: Any, subfolder: str = "") -> set[str] | None:
    """The tensor names of a local safetensors checkpoint (its header only), or ``None`` where there is none."""
    folder = Path(str(location)) / subfolder
    if not folder.is_dir():
        return None
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text()).get("weight_map", {}))
    single = folder / "model.safetensors"
    if not single.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return set(f.keys())


def missing_modules(model: nn.Module, location: Any, subfolder: str = "") -> list[str]:
    """The parameters of ``model`` whose module (the name without its last part) has no tensor in the checkpoint,
    with the model's ``base_model_prefix`` added or removed as loading does; ``[]`` when the checkpoint cannot be
    read without loading it (GGUF, ``.bin``)."""
    keys = checkpoint_keys(location, subfolder)
    if not keys:
        return []
    prefix = getattr(model, "base_model_prefix", "") or ""
    names = [n for n, _ in model.named_parameters()]
    stored = {k.rsplit(".", 1)[0] for k in keys}
    if prefix:
        model_has = any(n.startswith(prefix + ".") for n in names)
        stored_has = any(k.startswith(prefix + ".") for k in stored)
        if model_has and not stored_has:
            stored = {f"{prefix}.{k}" for k in stored}
        elif stored_has and not model_has:
            stored = {k[len(prefix) + 1:] for k in stored if k.startswith(prefix + ".")}
    return [n for n in names if n.rsplit(".", 1)[0] not in stored]
