"""The trainer's training batches, drawn by dpl: the engine's sampler over row indices, the trainer's own collator on
the sampled rows, each batch tagged with its privacy units; and what the training set is, for the privacy report.

* :class:`EngineBatches`: a batch sampler that answers the engine's sampler (Poisson for DP-SGD), continuing at the
  engine's step on every pass, with one pass's length (the steps of one epoch), so that the trainer counts its steps
  as dpl plans them;
* :class:`RowCollate`: the sampled rows collated by the trainer's collator and tagged by the privacy unit; an empty
  Poisson batch (possible; the step still adds its noise) collated as zero rows;
* :func:`user_keys`, :func:`describe_rows`: the user of every row (``user_column``) and the training data's keyed
  hash.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler

from dpl.errors import ConfigError


class RowIndices(Dataset):
    """The indices ``0 .. n-1``: the loader hands the sampled row indices to :class:`RowCollate`."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return int(i)


class EngineBatches(Sampler[list[int]]):
    """The engine's batches: each pass asks the engine for its sampler at the step it has reached."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def __len__(self) -> int:
        return self.engine.plan.steps_per_epoch

    def __iter__(self) -> Iterator[list[int]]:
        for rows in self.engine.batch_sampler():
            yield list(rows)


class RowCollate:
    """``rows -> batch``: ``collate([dataset[i] for i in rows])`` tagged with the rows' privacy units (under
    user-level sampling); an empty batch is the first row collated and cut to zero rows (no row's value is in it)."""

    def __init__(self, dataset: Any, collate: Callable[[list[Any]], Any], engine: Any) -> None:
        self.dataset, self.collate, self.engine = dataset, collate, engine

    def __call__(self, rows: list[int]) -> dict[str, Any]:
        if not rows:
            batch = dict(self.collate([self.dataset[0]]))
            return {k: v[:0] if torch.is_tensor(v) else v for k, v in batch.items()}
        batch = self.collate([self.dataset[i] for i in rows])
        if not hasattr(batch, "items"):
            raise ConfigError(f"the data collator must return a dict of tensors, got {type(batch).__name__}")
        return self.engine.tag(dict(batch), rows)


def user_keys(dataset: Any, column: str | None) -> list[Any] | None:
    """The user of every training row, from ``column`` (``None``: no user column)."""
    if column is None:
        return None
    names = getattr(dataset, "column_names", None)
    if names is not None:
        if column not in names:
            raise ConfigError(f"user_column {column!r} is not a column of the training set (columns: "
                              f"{', '.join(names)})")
        return list(dataset[column])
    try:
        return [dataset[i][column] for i in range(len(dataset))]
    except (KeyError, TypeError):
        raise ConfigError(f"user_column {column!r}: the training rows have no such field") from None


def describe_rows(dataset: Any, name: str = "train_dataset") -> dict[str, Any]:
    """The training data for the privacy report and the data ledger: the keyed hash of its rows (each row as one JSON
    line; dpl's keyed hash, :mod:`dpl.lightning.provenance`), the number of rows and their bytes."""
    from dpl.lightning.provenance import DATA_HASH, text_hash

    lines = [json.dumps(_plain(dataset[i]), sort_keys=True, default=str) for i in range(len(dataset))]
    digest = text_hash(lines, keyed=True)
    size = sum(len(line.encode()) + 1 for line in lines)
    return {"id": f"{DATA_HASH}:{digest}",
            "files": [{"split": "train", "path": f"{name} ({len(lines)} rows)", "bytes": size, "hash": digest}],
            "hashed": f"the training rows, each as one JSON line with sorted keys ({DATA_HASH}: keyed with this "
                      "machine's secret data key, so that the hash confirms nothing to whoever holds a candidate copy "
                      "of the data)"}


def _plain(row: Any) -> Any:
    if torch.is_tensor(row):
        return row.tolist()
    if isinstance(row, dict):
        return {str(k): _plain(v) for k, v in row.items()}
    if isinstance(row, (list, tuple)):
        return [_plain(v) for v in row]
    return row.tolist() if hasattr(row, "tolist") else row
