"""Hugging Face data sets as the data of any data module (``data.dataset``): a data set's name on the Hub, loaded
with ``datasets.load_dataset`` (offline, ``HF_DATASETS_OFFLINE=1``: from the local cache), a folder written by
``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (``load_from_disk``), or, in Python, a ``datasets.Dataset``
(its one split is ``train``) or ``DatasetDict``. :class:`DatasetSource` picks the splits (``train_split``,
``val_split``, ``test_split``) and describes the rows read for the privacy report: each split's keyed content hash
(:func:`table_hash`), as files are hashed for file data."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from dpl.errors import DataError

log = logging.getLogger(__name__)

#: the option that names each split of a data set
SPLIT_ARGS = {"train": "train_split", "validation": "val_split", "test": "test_split"}
#: the splits of a data set that serve as validation when ``val_split`` is not given, in order of preference
VALIDATION_NAMES = ("validation", "valid", "dev", "val")
_ROWS = 4096  # rows converted at a time for hashing


def table_hash(table: Any) -> tuple[str, int]:
    """The keyed BLAKE2b-256 (hex, :func:`~dpl.lightning.provenance.data_key`) of an Arrow table's rows and column
    types: a line naming each column and its type, then each row as a JSON line (keys sorted), whatever the table's
    chunks, buffers and metadata; and the bytes hashed."""
    from dpl.lightning.provenance import data_key

    digest = hashlib.blake2b(digest_size=32, key=data_key())
    size = 0
    lines: list[str] = [json.dumps([[f.name, str(f.type)] for f in table.schema])]
    for start in range(0, table.num_rows, _ROWS):
        lines += [json.dumps(row, sort_keys=True, ensure_ascii=False, default=repr)
                  for row in table.slice(start, _ROWS).to_pylist()]
        for line in lines:
            data = line.encode("utf-8") + b"\n"
            digest.update(data)
            size += len(data)
        lines = []
    for line in lines:  # a table without rows: its columns
        data = line.encode("utf-8") + b"\n"
        digest.update(data)
        size += len(data)
    return digest.hexdigest(), size


def _cached_names() -> list[str]:
    """The data sets in the local Hugging Face caches (``datasets`` and hub), as names to load."""
    try:
        import datasets.config as config
    except ImportError:  # pragma: no cover - datasets is a dependency
        return []
    names = set()
    root = Path(config.HF_DATASETS_CACHE)
    if root.is_dir():
        names |= {p.name.replace("___", "/") for p in root.iterdir() if p.is_dir() and not p.name.startswith("_")
                  and p.name not in ("downloads", "parquet", "json", "csv", "text", "arrow")}
    hub = Path(os.environ.get("HF_HUB_CACHE") or Path(config.HF_CACHE_HOME) / "hub")
    if hub.is_dir():
        names |= {p.name[len("datasets--"):].replace("--", "/") for p in hub.iterdir()
                  if p.name.startswith("datasets--")}
    return sorted(names)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class DatasetSource:
    """The splits of one data set (``dataset``: a name, a ``save_to_disk`` folder, a ``Dataset`` or
    ``DatasetDict``), chosen by ``splits`` (``train`` / ``validation`` / ``test`` -> the data set's split name;
    ``None`` for validation: its ``validation`` (``valid``, ``dev``, ``val``) split if it has one; ``None`` for test:
    none). Loaded on first use; every error is one :class:`DataError` line naming what exists."""

    def __init__(self, dataset: Any, config: str | None = None, splits: dict[str, str | None] | None = None,
                 cache_dir: str | None = None) -> None:
        self.dataset = dataset
        self.config = config
        self.splits = {"train": "train", "validation": None, "test": None, **(splits or {})}
        self.cache_dir = cache_dir
        self._loaded: dict[str, Any] | None = None
        if isinstance(dataset, str):
            from dpl.lightning.provenance import public_location

            self.label = public_location(dataset.rstrip("/")) + (f" ({config})" if config else "")
        else:
            self.label = type(dataset).__name__
        if not isinstance(dataset, str) and config is not None:
            raise DataError("data.dataset_config names a configuration of a data set on the Hub; a "
                            f"{type(dataset).__name__} object has none")

    def path(self, split: str) -> Path:
        """What names ``split`` in messages and reports: ``<label>:<the data set's split name>``."""
        return Path(f"{self.label}:{self.load()[split][0]}")

    def load(self) -> dict[str, tuple[str, Any]]:
        """``train`` / ``validation`` / ``test`` (those configured) -> (the data set's split name, its ``Dataset``
        with any index mapping applied)."""
        if self._loaded is None:
            available = self._open()
            chosen: dict[str, tuple[str, Any]] = {}
            for split, name in self.splits.items():
                if name is None and split == "validation":
                    name = next((n for n in VALIDATION_NAMES if n in available), None)
                if name is None:
                    continue
                if name not in available:
                    raise DataError(f"data set {self.label!r} has no split {name!r} (data.{SPLIT_ARGS[split]}; its "
                                    f"splits: {', '.join(available)})")
                data = available[name]
                if getattr(data, "_indices", None) is not None:  # a select / shuffle / filter view
                    data = data.flatten_indices(keep_in_memory=True)
                chosen[split] = (name, data)
            if len(chosen["train"][1]) == 0:
                raise DataError(f"the training split {chosen['train'][0]!r} of data set {self.label!r} has no rows")
            self._loaded = chosen
        return self._loaded

    def _open(self) -> dict[str, Any]:
        import datasets

        data = self.dataset
        if isinstance(data, str):
            folder = Path(data).expanduser()
            if (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file():
                try:
                    data = datasets.load_from_disk(str(folder))
                except Exception as exc:  # noqa: BLE001 - one line instead of the library's traceback
                    raise DataError(f"cannot read data set folder {data!r}: {_first_line(exc)}") from exc
            else:
                data = self._load_by_name(data)
        if isinstance(data, datasets.Dataset):
            return {"train": data}
        if isinstance(data, datasets.DatasetDict):
            return dict(data)
        raise DataError(f"data.dataset must be a data set's name, a save_to_disk folder, a datasets.Dataset or a "
                        f"DatasetDict, got {type(data).__name__} (an iterable data set has no length to sample from)")

    def _load_by_name(self, name: str) -> Any:
        import datasets

        try:
            return datasets.load_dataset(name, self.config, cache_dir=self.cache_dir)
        except (ConnectionError, FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as exc:
            offline = os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1"
            cached = _cached_names()
            where = "in the local cache (offline)" if offline else "on the Hub, as a folder or in the local cache"
            raise DataError(f"data set {name!r}{f' ({self.config})' if self.config else ''} not found {where}; "
                            f"cached data sets: {', '.join(cached) or 'none'}") from exc
        except ValueError as exc:  # an unknown configuration names the known ones
            raise DataError(f"data set {name!r}: {_first_line(exc)}") from exc

    def describe(self) -> dict[str, Any]:
        """The rows read, for the privacy report: per split its name, rows, bytes (of the hashed stream) and keyed
        hash (:func:`table_hash`); the data set's ``id`` is the training split's hash."""
        from dpl.lightning.provenance import DATA_HASH, combined_id

        entries = []
        for split, (name, data) in self.load().items():
            digest, size = table_hash(data.data.table if hasattr(data.data, "table") else data.data)
            entries.append({"split": split, "path": f"{self.label}:{name}", "rows": len(data), "bytes": size,
                            "hash": digest})
        train = [e["hash"] for e in entries if e["split"] == "train"]
        return {"id": combined_id(train, keyed=True), "files": entries,
                "hashed": f"each split's column types and rows as JSON lines ({DATA_HASH}: keyed with this machine's "
                          f"secret data key, so that the hash confirms nothing to whoever holds a candidate copy of the "
                          f"data); id: the training split's hash"}


def dataset_source(dataset: Any, config: str | None, splits: dict[str, str | None], cache_dir: str | None,
                   files: dict[str, Any]) -> DatasetSource | None:
    """The :class:`DatasetSource` of a data module's options (``None`` without ``dataset``); the file options
    (``files``: option -> value) are not used beside it (a log line says so), and split or configuration options
    without a data set are a one-line :class:`DataError`."""
    if dataset is None:
        stray = [f"data.{SPLIT_ARGS[s]}" for s in ("validation", "test") if splits.get(s) is not None]
        stray += ["data.dataset_config"] if config is not None else []
        if splits.get("train") not in (None, "train"):
            stray.insert(0, "data.train_split")
        if stray:
            raise DataError(f"{', '.join(stray)} choose{'s' if len(stray) == 1 else ''} splits of data.dataset, "
                            f"which is not set")
        return None
    unused = [f"data.{option}" for option, value in files.items() if value is not None]
    if unused:
        log.info("data.dataset is set: %s not used", ", ".join(unused))
    return DatasetSource(dataset, config, splits, cache_dir)
