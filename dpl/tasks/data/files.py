"""Finding and opening data files, shared by every data module: which file holds each split (``data_dir`` and
the explicit ``train_file`` / ``val_file`` / ``test_file``), text and CSV/TSV reading with one-line errors."""

from __future__ import annotations

import csv
import fnmatch
import json
from pathlib import Path
from typing import Any

from dpl.errors import ConfigError, DataError
from dpl.tasks.loading import resolve_path

#: the option that names each split's file explicitly
FILE_ARGS = {"train": "train_file", "validation": "val_file", "test": "test_file"}


def resolve_location(location: str) -> str:
    """A file or folder location (``pkg://`` etc., see :func:`~dpl.tasks.loading.resolve_path`) as a path."""
    try:
        return resolve_path(location)
    except ConfigError as exc:
        raise DataError(str(exc)) from None


def discover_files(data_dir: str | Path, patterns: dict[str, tuple[str, ...]]) -> dict[str, Path]:
    """The split files in ``data_dir``: for each split, the file whose name matches one of its glob
    ``patterns`` (lower case; names are compared case-insensitively). Raises :class:`DataError` for a missing
    folder or several candidates."""
    folder = Path(data_dir)
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "not found"
        raise DataError(f"data_dir {str(folder)!r} {what}")
    found: dict[str, Path] = {}
    files = sorted(p for p in folder.iterdir() if p.is_file())
    for split, globs in patterns.items():
        matches = [p for p in files if any(fnmatch.fnmatch(p.name.lower(), g) for g in globs)]
        if len(matches) > 1:
            raise DataError(f"data_dir {str(folder)!r} has several {split} files "
                            f"({', '.join(p.name for p in matches)}); keep one or name it with "
                            f"data.{FILE_ARGS[split]}")
        if matches:
            found[split] = matches[0]
    return found


def split_files(data_dir: str | None, explicit: dict[str, str | None],
                patterns: dict[str, tuple[str, ...]]) -> dict[str, Path]:
    """Split name -> file: what :func:`discover_files` finds in ``data_dir``, overridden by the ``explicit``
    files (split -> location or ``None``; a relative one is looked up in ``data_dir`` first, then in the working
    directory). A training file is required; the files are not checked to exist (see :func:`check_file`)."""
    if data_dir is None and explicit.get("train") is None:
        raise DataError("set data.data_dir (a folder with the data files) or data.train_file")
    folder = Path(resolve_location(data_dir)) if data_dir is not None else None
    files = discover_files(folder, patterns) if folder is not None else {}
    for split, value in explicit.items():
        if value is None:
            continue
        path = Path(resolve_location(value))
        if not path.is_absolute() and folder is not None and (folder / path).exists():
            path = folder / path
        files[split] = path
    if "train" not in files:
        assert folder is not None
        entries = sorted(p.name for p in folder.iterdir())
        names = ", ".join(entries[:10]) + (f", ... ({len(entries)} entries)" if len(entries) > 10 else "")
        wanted = list(patterns.get("train", ("train*",)))
        wanted_text = " or ".join([", ".join(wanted[:-1]), wanted[-1]] if len(wanted) > 1 else wanted)
        raise DataError(f"data_dir {str(folder)!r} has no training file ({wanted_text}; it holds: "
                        f"{names or 'nothing'}); or set data.train_file")
    return files


def check_file(split: str, path: Path) -> None:
    """Raise :class:`DataError` unless ``path`` is an existing file."""
    if not path.is_file():
        what = "is not a file" if path.exists() else "not found"
        raise DataError(f"{split} file {str(path)!r} {what}")


def read_text(path: Path) -> str:
    """The file as UTF-8 text (a byte-order mark is dropped)."""
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def json_lines(path: Path, text: str) -> list[tuple[int, dict[str, Any]]]:
    """The objects of a JSON-lines ``text`` (of file ``path``), each with its 1-based line; blank lines are
    skipped, and a line that is not a JSON object is a :class:`DataError` naming it."""
    items = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path} line {number}: invalid JSON ({exc.msg})") from None
        if not isinstance(item, dict):
            raise DataError(f"{path} line {number}: expected a JSON object, found {type(item).__name__}")
        items.append((number, item))
    return items


def read_delimited(path: Path, delimiter: str, required: list[str]) -> tuple[list[str], list[tuple[int, list[str]]]]:
    """A CSV/TSV file read with Python's csv module (standard double-quote quoting), checked: a header naming
    every ``required`` column, no duplicate column, the same number of fields on every row; blank lines are
    skipped.

    Returns the header and each data row with the (1-based, physical) line where it starts."""
    kind = "TSV" if delimiter == "\t" else "CSV"
    rows: list[tuple[int, list[str]]] = []
    reader = None
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f, delimiter=delimiter)
            header = None
            while header is None:
                row = next(reader, None)
                if row is None:
                    raise DataError(f"{path}: the file is empty (expected a header line naming the columns)")
                if row:
                    header = [c.strip() for c in row]
            _check_header(path, header, required, kind)
            width = len(header)
            while True:
                start = reader.line_num + 1
                row = next(reader, None)
                if row is None:
                    break
                if not row:  # blank line (the csv builder of ``datasets`` skips these too)
                    continue
                if len(row) != width:
                    hint = ""
                    if reader.line_num > start:
                        hint = (f" (the row runs to line {reader.line_num}: an unbalanced double quote? Quote a "
                                f"field that starts with \" and double the quotes inside it)")
                    raise DataError(f"{path} line {start}: expected {width} {kind} fields "
                                    f"({', '.join(header)}), found {len(row)}{hint}")
                rows.append((start, row))
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except csv.Error as exc:
        line = reader.line_num if reader is not None else 0
        raise DataError(f"{path} line {line}: {exc}") from None
    return header, rows


def _check_header(path: Path, header: list[str], required: list[str], kind: str) -> None:
    seen: set[str] = set()
    for name in header:
        if name in seen:
            raise DataError(f"{path}: column {name!r} appears twice in the header")
        seen.add(name)
    hint = ""
    if len(header) == 1 and kind == "TSV" and "," in header[0]:
        hint = "; the file looks comma-separated: name it .csv"
    elif len(header) == 1 and kind == "CSV" and "\t" in header[0]:
        hint = "; the file looks tab-separated: name it .tsv"
    check_columns(path, header, required, hint)


def check_columns(path: Path, columns: list[str], required: list[str], hint: str = "") -> None:
    """Raise :class:`DataError` naming the ``required`` columns that ``columns`` lacks."""
    missing = [name for name in required if name not in columns]
    if missing:
        raise DataError(f"{path}: missing column(s) {missing} (columns: {', '.join(columns) or 'none'}){hint}")


def user_keys_of(module: Any) -> list[str] | None:
    """The user (``str``) of each training row of a data module, in the order of its ``train_set`` (its training
    split's ``users``, cut like the rows by ``max_train_examples``; read by ``validate_data``, no tokenizing needed);
    ``None`` without a ``user_column``."""
    if module.user_column is None:
        return None
    if module._splits is None:
        module.validate_data()
    users = module._splits["train"].users
    assert users is not None
    keys = users[:module.max_train_examples] if module.max_train_examples is not None else list(users)
    assert module.train_set is None or len(keys) == len(module.train_set)
    return keys
