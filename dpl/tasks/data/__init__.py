"""Data modules. Each provides datasets and a collate function; the training loader's batch sampler comes
from the DP module (Poisson by default), because the privacy analysis owns how batches are drawn."""

from dpl.lightning.data import DPDataModule
from dpl.tasks.data.classification import ClassificationDataModule, DataError
from dpl.tasks.data.generation import DARTDataModule, E2EDataModule, GenerationDataModule, JSONLDataModule, Record

__all__ = ["DPDataModule", "ClassificationDataModule", "DataError", "GenerationDataModule", "E2EDataModule",
           "DARTDataModule", "JSONLDataModule", "Record"]
