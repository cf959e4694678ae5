"""LightningModules: one private training loop (:class:`DPModule`) and the tasks built on it."""

from dpl.modules.base import DPModule
from dpl.modules.classification import DPClassificationModule, FinetuneOptions, LoraOptions
from dpl.modules.generation import DPGenerationModule, GenerationOptions
from dpl.modules.prompt import DPPromptClassificationModule

__all__ = ["DPModule", "DPClassificationModule", "DPGenerationModule", "DPPromptClassificationModule",
           "FinetuneOptions", "GenerationOptions", "LoraOptions"]
