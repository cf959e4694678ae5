"""Data modules. Each provides datasets and a collate function; the training loader's batch sampler comes
from the DP module (Poisson by default), because the privacy analysis owns how batches are drawn.

Classification: :class:`ClassificationDataModule` (files found and read by :mod:`~dpl.tasks.data.files` and
:mod:`~dpl.tasks.data.tables`, labels by :mod:`~dpl.tasks.data.labels`), the masked-LM prompt variant
(:mod:`~dpl.tasks.data.prompt`) and the quickstart data (:mod:`~dpl.tasks.data.quickstart`). Generation:
:class:`GenerationDataModule` and its readers :class:`E2EDataModule`, :class:`DARTDataModule`,
:class:`JSONLDataModule` (one module each; records rendered by :mod:`~dpl.tasks.data.templates`, conversations by
:mod:`~dpl.tasks.data.conversations`, too-long examples cut by :mod:`~dpl.tasks.data.truncation`), and the
generation quickstart's generated tables (:class:`QuickstartE2EDataModule`); records to learn to generate, for synthetic data
(:class:`SyntheticDataModule`)."""

from dpl.errors import DataError
from dpl.lightning.data import DPDataModule
from dpl.tasks.data.classification import ClassificationDataModule
from dpl.tasks.data.dart import DARTDataModule
from dpl.tasks.data.e2e import E2EDataModule
from dpl.tasks.data.generation import GenerationDataModule
from dpl.tasks.data.jsonl import JSONLDataModule
from dpl.tasks.data.prompt import PromptClassificationDataModule
from dpl.tasks.data.quickstart import QuickstartDataModule
from dpl.tasks.data.quickstart_tables import QuickstartE2EDataModule
from dpl.tasks.data.synthetic import SyntheticDataModule
from dpl.tasks.data.templates import Record

__all__ = ["DPDataModule", "ClassificationDataModule", "PromptClassificationDataModule", "QuickstartDataModule",
           "DataError", "GenerationDataModule", "E2EDataModule", "QuickstartE2EDataModule", "DARTDataModule",
           "JSONLDataModule", "SyntheticDataModule", "Record"]
