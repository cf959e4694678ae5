"""Data modules. Each provides datasets and a collate function; the training loader's batch sampler comes
from the DP module (Poisson by default), because the privacy analysis owns how batches are drawn."""

from dpl.data.base import DPDataModule

__all__ = ["DPDataModule"]
