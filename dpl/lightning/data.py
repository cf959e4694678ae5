"""Base class for dpl data modules."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import lightning as L
from torch.utils.data import DataLoader, Dataset, Sampler

from dpl.core.privacy_unit import EXAMPLE, PrivacyUnit
from dpl.errors import ConfigError, DataError


class DPDataModule(L.LightningDataModule):
    """A LightningDataModule whose training loader yields *logical* batches drawn by the privacy mechanism.

    Subclasses implement :meth:`setup` (set ``self.train_set`` and ``self.val_set``, optionally
    ``self.test_set``) and :meth:`collate` (list of examples -> dict of tensors). The training batch sampler
    comes from the :class:`~dpl.lightning.module.DPModule`, which sets :attr:`train_batch_sampler` at setup, so
    Poisson sampling (or the mechanism's own scheme) is used without the data module knowing about privacy. An empty logical batch is
    possible under Poisson sampling: ``collate([])`` must return a dict whose tensors have batch size 0.
    """

    train_set: Dataset | None = None
    val_set: Dataset | None = None
    test_set: Dataset | None = None
    #: ``num_examples -> batch sampler`` of the training set, set by the DP module at setup
    train_batch_sampler: Callable[[int], Sampler] | None = None
    #: the run's privacy unit (set by the DP module at setup): training batches are tagged by it
    #: (:meth:`dpl.core.privacy_unit.PrivacyUnit.tag`: under user-level sampling, each row's user)
    train_unit: Any = None

    def __init__(self, eval_batch_size: int = 64, num_workers: int = 0) -> None:
        super().__init__()
        self.eval_batch_size = eval_batch_size
        self.num_workers = num_workers

    def collate(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        raise NotImplementedError

    #: the longest training example's length in tokens, where the data module bounds it (``max_length``)
    max_length: int | None = None

    def probe_batch(self, size: int) -> dict[str, Any]:
        """A training batch of ``size`` *public* examples as long as a training example may be (random token ids at
        ``max_length``; no training data), on which ``privacy.physical_batch_size: auto`` probes the private step
        (:mod:`dpl.core.micro_batch`). A data module that cannot build one refuses ``auto``."""
        raise ConfigError(f"privacy.physical_batch_size auto: {type(self).__name__} builds no probe batch "
                          "(probe_batch): set privacy.physical_batch_size to a number")

    @staticmethod
    def splits_for(stage: str | None, available: Collection[str]) -> list[str]:
        """The configured splits (``train``, ``validation``, ``test``) a Lightning ``stage`` needs; testing falls
        back to the validation split when there is no test split. Raises ``DataError`` for ``validate`` without
        a validation split."""
        needed = {"fit": ["train", "validation"], "validate": ["validation"], "test": ["test"],
                  "predict": ["test"]}.get(stage or "", ["train", "validation", "test"])
        if stage == "validate" and "validation" not in available:
            raise DataError("no validation split: add a validation file to data_dir (or set data.val_file)")
        if "test" in needed and "test" not in available:
            needed = [*needed, "validation"]
        return [name for name in needed if name in available]

    def training_data(self) -> dict[str, Any] | None:
        """Where the training set comes from, for the privacy report and the data ledger: its files with sizes and
        content hashes (:func:`~dpl.lightning.provenance.describe_files`) or its generator and settings
        (:func:`~dpl.lightning.provenance.describe_generated`); ``None``: not stated (after ``setup("fit")``)."""
        return None

    def unit_description(self, unit: PrivacyUnit = EXAMPLE) -> str:
        """What one privacy unit of this data is, in words: the data module says what its rows are, the run's
        ``unit`` (:class:`~dpl.core.privacy_unit.PrivacyUnit`) words the rest (one example, or all a user's rows)."""
        return unit.describe("training rows", repr(getattr(self, "user_column", None)), "one item of the training set")

    def train_user_keys(self) -> list[str] | None:
        """The user owning each row of ``train_set``, in its index order (after ``setup("fit")``), for user-level
        privacy; ``None`` when the rows carry no user (every row is its own unit)."""
        return None

    @property
    def num_train_examples(self) -> int:
        assert self.train_set is not None, "call setup('fit') first"
        return len(self.train_set)

    def count_train_examples(self) -> int:
        """N, the :attr:`num_train_examples` that ``setup("fit")`` gives, for planning (``dpl plan``); afterwards
        :meth:`train_user_keys` answers too. This default sets the data up; subclasses that can count the rows
        without tokenizing (or generating) them override it."""
        if self.train_set is None:
            self.prepare_data()
            self.setup("fit")
        return self.num_train_examples

    def train_dataloader(self) -> DataLoader:
        if self.train_batch_sampler is None:
            raise ConfigError(f"{type(self).__name__} trains only under a dpl.lightning.module.DPModule, which draws "
                              "the training batches")
        batch_sampler = self.train_batch_sampler(len(self.train_set))
        if getattr(batch_sampler, "pads", False):  # FSDP: shards padded with zero-weight fillers
            from dpl.lightning.samplers import PaddedCollate, PaddedDataset

            return DataLoader(PaddedDataset(self.train_set), batch_sampler=batch_sampler,
                              collate_fn=PaddedCollate(self.collate), num_workers=self.num_workers)
        if self.train_unit is not None and self.train_unit.samples_users:  # every batch tagged with its units
            return DataLoader(RowTagged(self.train_set), batch_sampler=batch_sampler,
                              collate_fn=UnitCollate(self.collate, self.train_unit), num_workers=self.num_workers)
        return DataLoader(self.train_set, batch_sampler=batch_sampler, collate_fn=self.collate,
                          num_workers=self.num_workers)

    def _eval_loader(self, dataset: Dataset | None) -> DataLoader:
        if dataset is None:
            raise ValueError(f"{type(self).__name__} has no such split configured")
        from dpl.lightning.strategy import dp_strategy

        # several ranks: each evaluates its shard (FSDP: the same number of batches on every rank)
        batches = dp_strategy(self.trainer).eval_batch_sampler(len(dataset), self.eval_batch_size)
        if batches is not None:
            return DataLoader(dataset, batch_sampler=batches, collate_fn=self.collate, num_workers=self.num_workers)
        return DataLoader(dataset, batch_size=self.eval_batch_size, shuffle=False, collate_fn=self.collate,
                          num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader(self.val_set)

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader(self.test_set if self.test_set is not None else self.val_set)


class RowTagged(Dataset):
    """``dataset`` with the row index of each example: items are ``(example, row)``."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        return self.dataset[i], int(i)


class UnitCollate:
    """Collates ``(example, row)`` items with ``collate``; the privacy unit tags the batch with its rows' units."""

    def __init__(self, collate: Callable[[list[Any]], dict[str, Any]], unit: Any) -> None:
        self.collate, self.unit = collate, unit

    def __call__(self, items: list[tuple[Any, int]]) -> dict[str, Any]:
        return self.unit.tag(self.collate([example for example, _ in items]), [row for _, row in items])
