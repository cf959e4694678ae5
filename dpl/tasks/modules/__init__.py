"""LightningModules: one private training loop (:class:`DPModule`) and the tasks built on it."""

from dpl.lightning.module import DPModule
from dpl.tasks.modules.classification import DPClassificationModule, FinetuneOptions, LoraOptions
from dpl.tasks.modules.generation import DPGenerationModule, GenerationOptions
from dpl.tasks.modules.prompt import DPPromptClassificationModule

__all__ = ["DPModule", "DPClassificationModule", "DPGenerationModule", "DPPromptClassificationModule",
           "FinetuneOptions", "GenerationOptions", "LoraOptions"]
