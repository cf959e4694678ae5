"""LightningModules: one private training loop (:class:`DPModule`) and the tasks built on it."""

from dpl.errors import ConfigError
from dpl.lightning.module import DPModule
from dpl.tasks.modules.base import TASKS, DPTaskModule
from dpl.tasks.modules.classification import DPClassificationModule
from dpl.tasks.modules.finetuning import FinetuneOptions, LoraOptions
from dpl.tasks.modules.generation import DPGenerationModule, GenerationOptions
from dpl.tasks.modules.prompt import DPPromptClassificationModule
from dpl.tasks.modules.synthetic import DPSyntheticModule

__all__ = ["DPModule", "DPClassificationModule", "DPGenerationModule", "DPPromptClassificationModule",
           "DPSyntheticModule",
           "FinetuneOptions", "GenerationOptions", "LoraOptions"]


def task_class(name: str) -> type[DPTaskModule]:
    """The task module class registered as ``name`` (the built-in tasks are, by being imported here; one-line
    ``ConfigError`` for an unknown one)."""
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r} (known: {', '.join(sorted(TASKS))}); is the package that "
                          f"defines it installed?")
    return TASKS[name]
