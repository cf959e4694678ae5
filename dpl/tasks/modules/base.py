"""``DPTaskModule``: what every task module adds to :class:`~dpl.lightning.module.DPModule` - checkpoints that hold
only the trained parameters, a one-line refusal of a checkpoint of another architecture, and the task's life after
training (rebuilt from a run or an export, exported, predicting), with a registry of tasks by name (:data:`TASKS`).

A LoRA or partial fine-tuning checkpoint holds the trainable parameters only (LoRA of rank 1 on MiniLM: a few
hundred KB instead of 95 MB) plus a fingerprint of the frozen ones (:data:`BASE_KEY`): the frozen weights come from
the pretrained model named by the config, and loading checks that they are the same, bit for bit. Frozen tensors
that do not come from the pretrained model (peft's frozen copy of a new, randomly initialised head) are kept in
the checkpoint instead: nothing rebuilds them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch

from dpl.errors import ConfigError
from dpl.lightning.module import DPModule

BASE_KEY = "dpl_frozen_base"

#: task name -> task module class; a subclass of :class:`DPTaskModule` that sets ``task`` registers itself
TASKS: dict[str, type["DPTaskModule"]] = {}


def _is_sharded(tensor: Any) -> bool:
    return type(tensor).__name__ == "DTensor"


def fingerprint(tensors: dict[str, torch.Tensor]) -> str:
    """A hash of names, dtypes, shapes and values of ``tensors``."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _shapes(state: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in state.items() if torch.is_tensor(v)}


def position_limit(model: torch.nn.Module) -> int | None:
    """The most tokens ``model`` can read when it has a learned table of absolute positions (BERT's
    ``position_embeddings``, GPT-2's ``wpe``); ``None`` without one (rotary or relative positions)."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in ("position_embeddings", "wpe"):
            first = module.padding_idx  # RoBERTa numbers positions from padding_idx + 1
            return module.num_embeddings - (0 if first is None else first + 1)
    return None


def _examples(names: list[str]) -> str:
    return ", ".join(names[:2]) + (f" ... ({len(names)} in all)" if len(names) > 2 else "")


class DPTaskModule(DPModule):
    """A :class:`DPModule` whose checkpoints hold only what trains (see the module docstring), and which owns its
    life after training: ``dpl predict`` and ``dpl export`` (:mod:`dpl.trained`) call only the methods of the section
    "after training" below, so a new task touches its own module only."""

    #: the task's registered name (:data:`TASKS`), written into exports (``dpl.json``)
    task: ClassVar[str] = ""
    #: the transformers class that loads this task's exports (``AutoModelForCausalLM`` ...), for their README
    auto_class: ClassVar[str] = ""
    _frozen_fingerprint: str | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("task"):
            TASKS[cls.task] = cls

    def setup(self, stage: str) -> None:
        super().setup(stage)
        self.check_input_length(getattr(self.datamodule, "max_length", None))

    def check_input_length(self, max_length: int | None) -> None:
        """Refuse ``data.max_length`` longer than the model's learned position table: the first batch holding so
        long an input would otherwise fail in the middle of training (the batches are sampled at random)."""
        limit = position_limit(self.ensure_model())
        if isinstance(max_length, int) and limit is not None and max_length > limit:
            raise ConfigError(f"data.max_length = {max_length} is longer than the {limit} positions the model "
                              f"{getattr(self, 'model_location', '')} can read: set --data.init_args.max_length "
                              f"{limit} (or less)")

    def base_model(self) -> dict[str, Any] | None:
        """The configured pretrained model (``model_location``) with the hash of its weight files."""
        from dpl.lightning.provenance import describe_model
        from dpl.tasks.loading import resolve_path

        location = getattr(self, "model_location", None)
        if location is None:
            return None
        try:
            path = resolve_path(location)
        except ConfigError:
            path = location
        return describe_model(location, path)

    def _sharded(self) -> bool:
        """Whether FSDP shards this module's parameters (its checkpoints are then kept whole)."""
        return any(_is_sharded(p) for p in self.ensure_model().parameters())

    def _frozen_state(self) -> dict[str, torch.Tensor]:
        """This module's state-dict entries that do not train and come from the pretrained model (frozen
        parameters and buffers; not the frozen copies of new heads, :meth:`_new_frozen`)."""
        kept = self._new_frozen()
        trainable = {f"model.{name}" for name in self.trainable}
        return {k: v for k, v in self.state_dict().items() if k not in trainable and not k.startswith(kept)}

    def _new_frozen(self) -> tuple[str, ...]:
        """Prefixes of frozen state that no pretrained model holds: peft keeps the original of every module it
        trains as a whole (``modules_to_save``: a new classification head) frozen beside the trained copy."""
        return tuple(f"model.{name}.original_module." for name, module in self.ensure_model().named_modules()
                     if type(module).__name__ == "ModulesToSaveWrapper")

    def frozen_fingerprint(self) -> str:
        """Fingerprint of the frozen weights (computed once: they never change)."""
        if self._frozen_fingerprint is None:
            self._frozen_fingerprint = fingerprint(self._frozen_state())
        return self._frozen_fingerprint

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        state = checkpoint.get("state_dict") or {}
        if self._sharded() or any(_is_sharded(v) for v in state.values()):
            return  # FSDP: the full state as Lightning wrote it
        frozen = self._frozen_state()
        if not frozen or len(frozen) == len(state):
            return
        for key in frozen:
            state.pop(key, None)
        checkpoint[BASE_KEY] = {"fingerprint": self.frozen_fingerprint(), "tensors": len(frozen),
                                "model": getattr(self, "model_location", None)}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.restore_frozen(checkpoint)
        super().on_load_checkpoint(checkpoint)

    def restore_frozen(self, checkpoint: dict[str, Any]) -> None:
        """Check that ``checkpoint`` fits this module's architecture (one-line ``ConfigError`` otherwise) and put the
        frozen weights back into a trainable-only checkpoint, after checking they are those it was trained on."""
        self.ensure_model()
        state = checkpoint.get("state_dict")
        if state is None or self._sharded() or any(_is_sharded(v) for v in state.values()):
            return
        base = checkpoint.get(BASE_KEY)
        frozen = self._frozen_state() if base is not None else {}
        expected = {k: v for k, v in _shapes(self.state_dict()).items() if k not in frozen}
        given = _shapes(state)
        missing = sorted(set(expected) - set(given))
        unexpected = sorted(set(given) - set(expected))
        reshaped = sorted(f"{k} {list(given[k])} vs {list(expected[k])}" for k in set(given) & set(expected)
                          if given[k] != expected[k])
        if missing or unexpected or reshaped:
            parts = [f"{len(missing)} trained tensors missing ({_examples(missing)})" if missing else "",
                     f"{len(unexpected)} unknown ({_examples(unexpected)})" if unexpected else "",
                     f"{len(reshaped)} of another shape ({_examples(reshaped)})" if reshaped else ""]
            raise ConfigError("the checkpoint was written for another model architecture: "
                              + "; ".join(p for p in parts if p)
                              + "; use the model and finetuning settings of the run that wrote it")
        if base is not None:
            if base.get("fingerprint") != self.frozen_fingerprint():
                raise ConfigError(f"the checkpoint holds only the trained parameters, and the frozen weights they "
                                  f"were trained on ({base.get('model')}) differ from this model's "
                                  f"({getattr(self, 'model_location', '?')}): load the same pretrained model")
            state.update(frozen)

    # --- after training: rebuilt from a run or an export, exported, predicting ------------------------------
    def restore_for_inference(self, checkpoint: dict[str, Any], tokenizer: Any) -> None:
        """Before a run's weights are loaded for inference: set what training took from the data module (label
        names, the tokenizer) from the ``checkpoint`` and the run's ``tokenizer``."""

    def input_field(self, data: dict[str, Any]) -> str:
        """The field that one line of plain-text input fills (``data``: the run's data settings)."""
        return "text"

    def inference_batches(self, rows: list[dict[str, Any]], tokenizer: Any, data: dict[str, Any],
                          batch_size: int) -> Iterator[tuple[dict[str, Any], list[dict[str, Any]]]]:
        """The model inputs of ``rows`` in batches of ``batch_size``, each with what its rows' outputs show
        besides the predictions (e.g. the rendered prompt); ``data``: the run's data settings."""
        raise NotImplementedError

    def predict_step(self, batch: dict[str, Any], batch_idx: int = 0) -> list[dict[str, Any]]:
        """One row per example of ``batch`` (``dpl predict``)."""
        raise NotImplementedError

    def export_meta(self) -> dict[str, Any]:
        """What an export records (``dpl.json``) for :meth:`from_export` besides the task and the data settings."""
        return {}

    def card_usage(self, data: dict[str, Any], tokenizer: Any) -> list[str]:
        """Markdown lines that the export's README adds to its loading snippet (``data``: the run's data settings)."""
        return []

    def export_model(self, folder: Path, adapter: bool) -> None:
        """Write the trained model into the new, empty ``folder``: merged weights that a plain ``AutoModelFor...``
        loads, or (``adapter``) a PEFT adapter that ``AutoPeftModelFor...`` loads. One-line ``ConfigError``,
        before anything is written, for what this task and fine-tuning mode cannot export."""
        raise ConfigError(f"{type(self).__name__} cannot be exported; use dpl predict on the run itself")

    @classmethod
    def from_export(cls, folder: Path, meta: dict[str, Any], tokenizer: Any) -> "DPTaskModule":
        """This task's module around the model that :meth:`export_model` wrote into ``folder``."""
        raise ConfigError(f"{cls.__name__} cannot load exports")


def row_field(row: dict[str, Any], name: str, where: int) -> str:
    """Field ``name`` of input row number ``where`` (one-line ``ConfigError`` when it is missing)."""
    if name not in row:
        raise ConfigError(f"input row {where}: no field {name!r} (fields: {', '.join(map(str, row)) or 'none'})")
    return str(row[name])


def checkpoint_label_names(checkpoint: dict[str, Any]) -> list[str] | None:
    """Class id -> label name, from the data module's state in a checkpoint (``{"label_map": {name: id}}``)."""
    for value in checkpoint.values():
        if isinstance(value, dict) and isinstance(value.get("label_map"), dict):
            mapping = value["label_map"]
            return [name for name, _ in sorted(mapping.items(), key=lambda kv: kv[1])]
    return None
