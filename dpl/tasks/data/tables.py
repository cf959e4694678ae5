"""Reading one classification split: a TSV/CSV/JSON(L)/Parquet file, checked, into an in-memory
``datasets.Dataset`` (:func:`load_split`), with the line (or row) of each record for errors."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpl.errors import DataError
from dpl.tasks.data.files import check_columns, check_file, json_lines, read_delimited, read_text

#: file extension -> format name (``tsv`` is read by the csv builder with a tab delimiter)
FORMATS: dict[str, str] = {".tsv": "tsv", ".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def file_format(path: Path) -> str:
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise DataError(f"{path}: unsupported file type {path.suffix!r} (use one of {', '.join(FORMATS)})")
    return fmt


def scan_json(path: Path) -> list[int]:
    """Check that a .json/.jsonl file parses: a JSON array of objects, or JSON lines (one object per line).

    Returns the line number of each row (JSON lines) or zeros (a JSON array: rows are numbered instead)."""
    text = read_text(path)
    if not text.strip():
        raise DataError(f"{path}: the file is empty")
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path} line {exc.lineno}: invalid JSON ({exc.msg})") from None
        for i, item in enumerate(data):
            if not isinstance(item, dict):
                raise DataError(f"{path} row {i + 1}: expected a JSON object, found {type(item).__name__}")
        return [0] * len(data)
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = None  # several objects: JSON lines
        if isinstance(data, dict) and data and all(isinstance(v, list) for v in data.values()):
            raise DataError(f"{path}: a JSON object of columns is not supported; write a JSON array of objects "
                            f"or JSON lines (one object per line)")
    return [number for number, _ in json_lines(path, text)]


@dataclass
class SplitData:
    """One split as read and checked (before tokenizing)."""

    name: str
    path: Path
    dataset: Any  # datasets.Dataset with the raw columns
    lines: list[int] | None = None  # line number of each row (CSV/TSV/JSON lines), else rows are numbered
    label_names: list[str] | None = None  # set when the label column is a ClassLabel
    keys: list[str | None] = field(default_factory=list)  # canonical label of each row
    users: list[str] | None = None  # the user of each row (training split with a user column)

    def where(self, index: int) -> str:
        if self.lines is not None and index < len(self.lines):
            return f"line {self.lines[index]}"
        return f"row {index + 1}"


def load_split(name: str, path: Path, columns: list[str], cache_dir: str | None = None) -> SplitData:
    """Read one file into an in-memory ``datasets.Dataset`` after checking it; ``columns`` must all be present.

    Nothing is written to disk: private rows never land in the shared ``datasets`` cache (``cache_dir`` is
    accepted for compatibility and unused)."""
    import datasets

    check_file(name, path)
    fmt = file_format(path)
    lines = None
    try:
        if fmt in ("tsv", "csv"):
            delimiter = "\t" if fmt == "tsv" else ","
            header, rows = read_delimited(path, delimiter, columns)
            lines = [line for line, _ in rows]
            _check_not_empty(name, path, len(lines))
            features = datasets.Features({c: datasets.Value("string") for c in header})
            # keep_default_na=False: a text "NA" or "None" stays a string; all columns are read as strings
            # so labels compare exactly as written. Read into memory: no copy of private rows in a cache.
            import pandas as pd

            frame = pd.read_csv(path, sep=delimiter, dtype=str, keep_default_na=False, encoding="utf-8-sig",
                                skip_blank_lines=True)
            dataset = datasets.Dataset.from_pandas(frame, features=features, preserve_index=False)
        elif fmt == "json":
            lines = scan_json(path)
            _check_not_empty(name, path, len(lines))
            if not any(lines):
                lines = None
            rows = _json_rows(path)
            keys = list(dict.fromkeys(k for row in rows for k in row))
            dataset = datasets.Dataset.from_dict({k: [row.get(k) for row in rows] for k in keys})
        else:
            import pyarrow.parquet as pq

            _check_not_empty(name, path, pq.read_metadata(path).num_rows)
            dataset = datasets.Dataset(pq.read_table(path))
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - datasets/pyarrow errors are many and cryptic: one line instead
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"cannot read {name} file {str(path)!r}: {message}") from exc
    if lines is not None and len(lines) != len(dataset):
        lines = None  # parsers disagree on the row count: fall back to row numbers
    if fmt not in ("tsv", "csv"):
        check_columns(path, dataset.column_names, columns)
    _check_not_empty(name, path, len(dataset))
    return SplitData(name=name, path=path, dataset=dataset, lines=lines)


def _json_rows(path: Path) -> list[dict[str, Any]]:
    """The objects of a JSON array or JSON-lines file (already checked by :func:`scan_json`)."""
    text = path.read_text(encoding="utf-8-sig")
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        return json.loads(text)
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = None
        if isinstance(data, dict):
            return [data]
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _check_not_empty(name: str, path: Path, rows: int) -> None:
    if rows == 0:
        raise DataError(f"{name} file {str(path)!r} has no rows")


def column_values(dataset: Any, name: str) -> list[Any]:
    """A whole column as a Python list (one Arrow conversion, not one query per row)."""
    return dataset.data.column(name).to_pylist()
