"""LightningModules: one private training loop (:class:`DPModule`) and the tasks built on it."""

from dpl.modules.base import DPModule
from dpl.modules.classification import DPClassificationModule, FinetuneOptions, LoraOptions
from dpl.modules.generation import DPGenerationModule, GenerationOptions

__all__ = ["DPModule", "DPClassificationModule", "DPGenerationModule", "FinetuneOptions", "GenerationOptions",
           "LoraOptions"]
