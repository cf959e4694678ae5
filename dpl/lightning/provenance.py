"""What a run is and what it was trained from, for the privacy report and the data ledger: a random public run id
with its dates (:func:`new_run`), the base model's weights and the training data, each named with a content hash, or,
for generated data, its generator and settings (:func:`run_sources`).

Hashes are BLAKE2b with a 256-bit digest over a file's bytes. The base model's are plain (``b2sum -l 256 FILE``
prints the same), written ``blake2b-256:<hex>``. The training data's are keyed (``blake2b-256-keyed:<hex>``) with a
secret key of this machine (:func:`data_key`): a plain hash of the training file would let whoever holds a candidate
copy of it check it against a published report - and learn whether one row was in it, which is exactly what DP
protects. With the key, the hashes identify the data set in this machine's ledgers and say nothing to anyone
else. They are cached by (path, size, modification time, key): a run hashes each file once, however often it writes its
report.
"""

from __future__ import annotations

import functools
import hashlib
import os
import uuid
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

HASH = "blake2b-256"
DATA_HASH = "blake2b-256-keyed"
#: where the key of the data hashes lives (``DPL_DATA_KEY``, 64 hex digits, overrides it)
DATA_KEY_FILE = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "dpl" / "data.key"
#: the files of a model folder that hold weights (what :func:`describe_model` hashes)
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth")
_CHUNK = 1 << 20


def data_key() -> bytes:
    """The secret key of the data hashes: ``DPL_DATA_KEY`` (hex), else :data:`DATA_KEY_FILE`, made on first use
    (32 random bytes, owner-only). Keep it to compare ledgers across machines; never publish it."""
    if os.environ.get("DPL_DATA_KEY"):
        return bytes.fromhex(os.environ["DPL_DATA_KEY"])[:64]
    try:
        return bytes.fromhex(DATA_KEY_FILE.read_text().strip())
    except FileNotFoundError:
        DATA_KEY_FILE.parent.mkdir(parents=True, exist_ok=True)
        key = os.urandom(32)
        fd = os.open(DATA_KEY_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key.hex() + "\n")
        return key


def _digest(key: bytes | None = None) -> Any:
    return hashlib.blake2b(digest_size=32, key=key or b"")


@functools.lru_cache(maxsize=512)
def _file_digest(path: str, size: int, mtime_ns: int, key: bytes | None) -> str:
    digest = _digest(key)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_hash(path: str | Path, keyed: bool = False) -> str:
    """BLAKE2b-256 (hex) of the file's bytes; ``keyed``: with :func:`data_key` (training data)."""
    stat = os.stat(path)
    return _file_digest(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns, data_key() if keyed else None)


def text_hash(lines: Iterable[str], keyed: bool = False) -> str:
    """BLAKE2b-256 (hex) of ``lines``, each UTF-8 and ended by a newline; ``keyed``: with :func:`data_key`."""
    digest = _digest(data_key() if keyed else None)
    for line in lines:
        digest.update(line.encode("utf-8") + b"\n")
    return digest.hexdigest()


def combined_id(hashes: list[str], keyed: bool = False) -> str:
    """The id of a set of files: the hash of the one file, or of the sorted hashes of several (one per line)."""
    return f"{DATA_HASH if keyed else HASH}:{hashes[0] if len(hashes) == 1 else text_hash(sorted(hashes), keyed)}"


def public_location(location: str) -> str:
    """``location`` as a report may publish it: a hub id, a ``pkg://`` location or a relative path as given; a local
    absolute path (or one under ``~``) by its last part only, so that no local folder (home, virtual environment) is
    named."""
    if location.startswith(("/", "~")) or Path(location).is_absolute() or "\\" in location:
        return Path(location).expanduser().name
    return location


def public_names(paths: Iterable[str | Path]) -> dict[str, str]:
    """Each path -> its name relative to the deepest folder that holds them all (one file: its base name)."""
    resolved = {str(p): Path(p).resolve() for p in paths}
    if not resolved:
        return {}
    common = Path(os.path.commonpath([str(p.parent) for p in resolved.values()]))
    return {given: str(path.relative_to(common)) for given, path in resolved.items()}


def file_entry(path: str | Path, split: str | None = None, keyed: bool = False,
               name: str | None = None) -> dict[str, Any]:
    """``{split, path, bytes, hash}`` of one file (``path``: ``name``, else as given; ``keyed``: :func:`file_hash`)."""
    entry = {"split": split} if split is not None else {}
    return {**entry, "path": str(path) if name is None else name, "bytes": os.stat(path).st_size,
            "hash": file_hash(path, keyed)}


def describe_files(files: Mapping[str, Iterable[str | Path]]) -> dict[str, Any]:
    """The data read from ``files`` (split -> its files; ``train`` required): every file, named relative to the
    folder that holds them all (:func:`public_names`), with its size and keyed hash, and the data set's ``id``
    (:func:`combined_id` of the training files)."""
    files = {split: list(dict.fromkeys(paths)) for split, paths in files.items()}
    names = public_names([path for paths in files.values() for path in paths])
    entries = [file_entry(path, split, keyed=True, name=names[str(path)]) for split, paths in files.items()
               for path in paths]
    train = [e["hash"] for e in entries if e["split"] == "train"]
    return {"id": combined_id(train, keyed=True), "files": entries,
            "hashed": f"the bytes of each file ({DATA_HASH}: keyed with this machine's secret data key, so that the "
                      f"hash confirms nothing to whoever holds a candidate copy of the data); id: the training "
                      f"file's hash (several training files: the hash of their sorted hashes)"}


def describe_generated(generator: str, settings: Mapping[str, Any], rows: Iterable[str],
                       rows_text: str) -> dict[str, Any]:
    """Generated training data: its ``generator`` and ``settings``, and an ``id`` that hashes the generated training
    ``rows`` (one line each, described by ``rows_text``), so that changed generator code gives another id."""
    return {"id": f"{DATA_HASH}:{text_hash(rows, keyed=True)}", "generator": generator, "settings": dict(settings), "files": [],
            "hashed": f"the generated training rows ({rows_text}; one line each, UTF-8; {DATA_HASH})"}


def describe_model(location: str | None, path: str | Path | None = None) -> dict[str, Any]:
    """The base model as configured (``location``, as :func:`public_location` publishes it) and, where it is a local
    file or folder (``path``: ``location`` resolved), the hash of its weight files (:data:`WEIGHT_SUFFIXES`; a
    ``.gguf`` or other single file: that file), each named by its base name."""
    if location is None:
        return {"location": None, "id": None, "files": [], "hashed": "nothing: the model states no location"}
    path = Path(location if path is None else path)
    shown = public_location(location)
    if path.is_file():
        weights = [path]
    elif path.is_dir():
        weights = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    else:
        return {"location": shown, "id": None, "files": [],
                "hashed": "nothing: not a local file or folder (a hub id: its weights were not hashed)"}
    if not weights:
        return {"location": shown, "id": None, "files": [],
                "hashed": f"nothing: no weight file ({', '.join('*' + s for s in WEIGHT_SUFFIXES)}) in the folder"}
    files = [file_entry(p, name=p.name) for p in weights]
    return {"location": shown, "id": combined_id([f["hash"] for f in files]),
            "files": files, "hashed": f"the bytes of each weight file ({HASH}; b2sum -l 256 FILE prints the same); id: the file's hash (several files: "
                                      f"the hash of their sorted hashes)"}


def utc_now() -> str:
    """The current time, UTC, ISO 8601 to the second (``2025-01-31T12:00:00Z``)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def new_run() -> dict[str, Any]:
    """The identity of a new run: a random public id (uuid4, derived from nothing secret) and its start date."""
    return {"id": str(uuid.uuid4()), "started": utc_now(), "ended": None, "status": "running", "continues": None}


def run_sources(module: Any) -> dict[str, Any]:
    """What ``module`` trains from: the base model, the training data and what one privacy unit of it is (the data
    module says; ``None`` where it does not). Hashing the files is the cost: compute this once per run."""
    datamodule = module.datamodule
    return {"base_model": module.base_model(),
            "training_data": datamodule.training_data() if datamodule is not None else None,
            "unit_description": datamodule.unit_description(module.engine.unit) if datamodule is not None else None}
