"""E2E NLG data: CSV files with a meaning representation (``mr``) and a reference sentence (``ref``) per row."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

from dpl.core.privacy_unit import EXAMPLE, PrivacyUnit
from dpl.errors import DataError
from dpl.tasks.data.files import read_delimited
from dpl.tasks.data.generation import GenerationDataModule
from dpl.tasks.data.templates import Record

log = logging.getLogger(__name__)


def read_csv_records(path: Path, required: tuple[str, ...], nonempty: dict[str, str]) -> list[Record]:
    """Rows of a CSV file (header line first) as records with one field per column; ``required`` columns must
    exist; ``nonempty`` maps a column to what it holds, for the error when a row leaves it empty."""
    header, rows = read_delimited(path, ",", list(required))
    records: list[Record] = []
    for line, row in rows:
        fields = dict(zip(header, row))
        for column, what in nonempty.items():
            if not fields[column].strip():
                raise DataError(f"{path} line {line}: empty {what} in column {column!r}")
        records.append(Record(fields=fields, path=path, where=f"line {line}"))
    if not records:
        raise DataError(f"{path}: no data rows after the header")
    return records


def holdout_split(records: list[Record], key: str, holdout: int | float, seed: int,
                  path: Path) -> tuple[list[Record], list[Record]]:
    """Split ``records`` by the value of field ``key``: a random ``holdout`` (fraction in (0, 1), or a count)
    of the distinct values goes, with all their records, to the second list. Deterministic given ``seed``."""
    values = list(dict.fromkeys(r.fields[key] for r in records))
    n = len(values)
    if isinstance(holdout, bool) or not isinstance(holdout, (int, float)):
        raise DataError(f"data.holdout_mrs must be a fraction in (0, 1) or a count, got {holdout!r}")
    if isinstance(holdout, float) and 0 < holdout < 1:
        count = min(max(1, round(holdout * n)), n - 1)
    elif holdout >= 1 and float(holdout).is_integer():
        count = int(holdout)
    else:
        raise DataError(f"data.holdout_mrs must be a fraction in (0, 1) or a whole count >= 1, got {holdout!r}")
    if n < 2:
        raise DataError(f"data.holdout_mrs: {path} has {n} distinct {key} value(s); holding some out needs at "
                        f"least 2")
    if count >= n:
        raise DataError(f"data.holdout_mrs={holdout!r} holds out {count} of the {n} distinct {key} values of "
                        f"{path}: at least one must stay for training")
    held = set(random.Random(seed).sample(values, count))
    train = [r for r in records if r.fields[key] not in held]
    rest = [r for r in records if r.fields[key] in held]
    return train, rest


class E2EDataModule(GenerationDataModule):
    """E2E NLG data: CSV files with columns ``mr`` (meaning representation) and ``ref`` (a reference sentence);
    several rows share an ``mr``, and evaluation groups them (one source per ``mr``, all its refs as references).

    Args:
        data_dir: folder with the CSV files: training ``train*.csv`` (``trainset.csv``), validation ``dev*.csv``
            (``devset.csv``), ``validation.csv`` or ``val.csv``, test ``test*.csv`` (``testset_w_refs.csv``).
        holdout_mrs: hold out part of the *training file* as the validation split, by ``mr``: a fraction in
            (0, 1) or a count of distinct mrs; every row of a held-out mr goes to validation, none to training.
            Cannot be combined with ``val_file`` (a validation file found in ``data_dir`` is ignored).
        holdout_seed: seed of the random choice of held-out mrs (same seed and file: same split).
        user_column: column (generation readers: record field) naming the user who owns each row, for
            privacy.unit: user; rows of one user form one privacy unit. ``mr``: one unit per meaning
            representation (all its references).
        prompt_template, completion_template: see :class:`~dpl.tasks.data.generation.GenerationDataModule`.
            Fields: ``mr``, ``ref`` and any other column.
        **kwargs: the other options of :class:`~dpl.tasks.data.generation.GenerationDataModule` (``train_file``,
            ``val_file``, ``test_file``, ``tokenizer``, ``max_length``, ...).
    """

    FILE_PATTERNS = {"train": ("train*.csv",), "validation": ("dev*.csv", "validation.csv", "val.csv"),
                     "test": ("test*.csv",)}
    DATA_SOURCE = ("get the E2E NLG data (trainset.csv, devset.csv, testset_w_refs.csv) from "
                   "https://github.com/tuetschek/e2e-dataset and pass their folder as data.data_dir "
                   "(configs/e2e/dpsgd.yaml shows how); offline: dpl fit --config configs/e2e/quickstart.yaml "
                   "(generated tables)")

    def __init__(self, data_dir: str | None = None, holdout_mrs: int | float | None = None,
                 holdout_seed: int = 0, prompt_template: str = "Table: {mr}\nSentence:",
                 completion_template: str = " {ref}", **kwargs: Any) -> None:
        super().__init__(data_dir=data_dir, prompt_template=prompt_template, completion_template=completion_template,
                         **kwargs)
        if holdout_mrs is not None and self.val_file is not None:
            raise DataError("set either data.holdout_mrs (validation = held-out mrs of the training file) or "
                            "data.val_file, not both")
        if holdout_mrs is not None and (isinstance(holdout_mrs, bool) or holdout_mrs <= 0):
            raise DataError(f"data.holdout_mrs must be a fraction in (0, 1) or a count, got {holdout_mrs!r}")
        self.holdout_mrs = holdout_mrs
        self.holdout_seed = holdout_seed

    def data_files(self) -> dict[str, Path]:
        files = super().data_files()
        if self.holdout_mrs is not None and "validation" in files:
            log.info("holdout_mrs is set: validating on held-out mrs of %s, not on %s", files["train"],
                     files["validation"])
            del files["validation"]
        return files

    def unit_description(self, unit: PrivacyUnit = EXAMPLE) -> str:
        name = self.train_name()
        if unit.per_user and self.user_column == "mr":
            return f"one meaning representation: all the rows of {name} with the same mr (all its reference sentences)"
        if unit.per_user:
            return super().unit_description(unit)
        return (f"one row of {name} (one reference sentence); several rows share one meaning representation: use "
                f"privacy.unit: user with data.user_column: mr to protect a whole mr")

    def read_file(self, split: str, path: Path) -> list[Record]:
        nonempty = {"mr": "meaning representation", "ref": "reference"}
        if split == "train" and self.user_column is not None:
            nonempty.setdefault(self.user_column, "user")
        return read_csv_records(path, tuple(nonempty), nonempty)

    def read_splits(self) -> dict[str, list[Record]]:
        files = self.data_files()
        splits = {split: self.read_file(split, path) for split, path in files.items()}
        if self.holdout_mrs is not None:
            splits["train"], splits["validation"] = holdout_split(splits["train"], "mr", self.holdout_mrs,
                                                                  self.holdout_seed, files["train"])
        return splits
