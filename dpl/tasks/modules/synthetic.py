"""``DPSyntheticModule``: a causal LM fine-tuned privately on the records of a data set, conditioned on their control
columns (:class:`~dpl.tasks.data.synthetic.SyntheticDataModule`), so that ``dpl synthesize`` can sample a synthetic
copy that carries the training's guarantee (post-processing). The training is the generation task's, unchanged: one
record is one example (or one user's records one unit), its loss the mean cross-entropy over its scored tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dpl.errors import ConfigError
from dpl.tasks.data.synthetic import SCHEMA_KEY
from dpl.tasks.modules.generation import DPGenerationModule, GenerationOptions


def checkpoint_schema(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    """The synthetic data schema saved with a checkpoint (the data module's state)."""
    for value in checkpoint.values():
        if isinstance(value, dict) and isinstance(value.get(SCHEMA_KEY), dict):
            return value[SCHEMA_KEY]
    return None


class DPSyntheticModule(DPGenerationModule):
    """DP fine-tuning of an ``AutoModelForCausalLM`` to generate the records of a data set (used with
    :class:`~dpl.tasks.data.SyntheticDataModule`); ``dpl synthesize`` samples from it. Options: those of
    :class:`~dpl.tasks.modules.DPGenerationModule`."""

    task = "synthetic"
    #: the data set's public schema (text column, control columns and their values, format), set after training
    schema: dict[str, Any] | None = None

    def restore_for_inference(self, checkpoint: dict[str, Any], tokenizer: Any) -> None:
        super().restore_for_inference(checkpoint, tokenizer)
        self.schema = checkpoint_schema(checkpoint)
        if self.schema is None:
            raise ConfigError("the checkpoint holds no synthetic data schema (was it trained with "
                              "dpl.tasks.data.SyntheticDataModule?)")

    def export_meta(self) -> dict[str, Any]:
        return {**super().export_meta(), "schema": self.schema}

    @classmethod
    def from_export(cls, folder: Path, meta: dict[str, Any], tokenizer: Any) -> "DPSyntheticModule":
        from transformers import AutoModelForCausalLM

        from dpl.tasks.exporting import load_exported

        module = cls(model=str(folder), generation=GenerationOptions(**meta.get("generation", {})))
        module.tokenizer = tokenizer
        module.model = load_exported(AutoModelForCausalLM, folder)
        module.schema = meta.get("schema")
        return module
