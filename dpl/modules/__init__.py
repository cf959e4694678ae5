"""LightningModules: one private training loop (:class:`DPModule`) and the tasks built on it."""

from dpl.modules.base import DPModule
from dpl.modules.classification import DPClassificationModule, FinetuneOptions, LoraOptions

__all__ = ["DPModule", "DPClassificationModule", "FinetuneOptions", "LoraOptions"]
