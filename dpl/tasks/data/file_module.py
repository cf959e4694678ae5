"""The base of the data modules that read their splits from files and check them before tokenizing
(classification, generation), or from a Hugging Face data set (``data.dataset``, :mod:`~dpl.tasks.data.sources`): N
and the training data's provenance come from the checked files or rows, before setup."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dpl.lightning.data import DPDataModule
from dpl.tasks.data.sources import DatasetSource


class FileDataModule(DPDataModule):
    """A :class:`DPDataModule` whose ``validate_data()`` reads and checks every split's files without tokenizing;
    a subclass says how many training examples were read (:meth:`checked_train_count`) and from which files
    (:meth:`split_paths`), and sets ``max_train_examples`` (``None``: all)."""

    max_train_examples: int | None = None
    #: the data set the splits come from instead of files (``data.dataset``), or ``None``
    source: DatasetSource | None = None

    def checked_train_count(self) -> int:
        """The training examples that ``validate_data()`` read and checked (before ``max_train_examples``)."""
        raise NotImplementedError

    def split_paths(self) -> dict[str, list[Path]]:
        """Split name -> the files it was read from (after ``validate_data()``)."""
        raise NotImplementedError

    def count_train_examples(self) -> int:
        """N without tokenizing: the checked training examples, cut by ``max_train_examples`` as ``setup`` cuts
        them."""
        if self.train_set is not None:
            return len(self.train_set)
        count = self.checked_train_count()
        return count if self.max_train_examples is None else min(count, self.max_train_examples)

    def training_data(self) -> dict[str, Any] | None:
        """Every split's files (or, from ``data.dataset``, rows) with their sizes and content hashes; the data set's
        id is the training file's (split's)."""
        from dpl.lightning.provenance import describe_files

        if self.source is not None:
            return self.source.describe()
        return describe_files(self.split_paths())
