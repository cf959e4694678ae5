"""GGUF bases read once. transformers reads a ``.gguf`` file by parsing all of its metadata (the whole vocabulary, for
the config, the tokenizer and the model alike) and dequantizing every tensor, on every load. What it yields, a float32
model and a tokenizer, is saved once in dpl's cache and read from there afterwards (SmolLM2-135M: 57 s against 6.5 s,
``benchmarks/gguf_load.py``), the first time as every time after: a cold cache and a warm one give the same
model, the same tokenizer, and leave the random state as they found it.

The cache: ``$DPL_CACHE`` (``off``: no cache, every load reads the file), else ``$XDG_CACHE_HOME/dpl``, else
``~/.cache/dpl``; ``gguf/<key>/model`` and ``gguf/<key>/tokenizer``, the key a digest of the file's content and the
transformers and gguf versions that read it. Each part is written whole into a temporary folder and renamed into
place, so a reader never sees half of one and two writers keep the first. It holds public pretrained weights, nothing
of a run. A cache that cannot be written or read is one warning, and the file is read as before.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

from dpl.errors import ConfigError

CACHE_ENV = "DPL_CACHE"
log = logging.getLogger("dpl")


def cache_root() -> Path | None:
    """dpl's cache folder (``$DPL_CACHE``, ``$XDG_CACHE_HOME/dpl`` or ``~/.cache/dpl``); None when ``DPL_CACHE=off``."""
    value = os.environ.get(CACHE_ENV, "").strip()
    if value.lower() == "off":
        return None
    if value:
        return Path(value).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dpl"


@functools.lru_cache(maxsize=16)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    """The cache key of a GGUF file: its content and the versions of the readers (``size`` and ``mtime_ns`` only key
    this memo, so that the model and the tokenizer of one load hash the file once)."""
    digest = hashlib.sha256(f"transformers {version('transformers')} gguf {version('gguf')}\n".encode())
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()[:32]


def cache_folder(gguf_file: str, part: str) -> Path | None:
    """Where ``part`` (``model`` or ``tokenizer``) of ``gguf_file`` is cached; None when the cache is off."""
    root = cache_root()
    if root is None:
        return None
    stat = os.stat(gguf_file)
    return root / "gguf" / _digest(os.path.realpath(gguf_file), stat.st_size, stat.st_mtime_ns) / part


@contextlib.contextmanager
def serializable(model: Any) -> Iterator[None]:
    """``model`` as transformers saves it: a model read from a GGUF file is marked as GGUF-quantized (which
    ``save_pretrained`` refuses) though its weights were dequantized when it loaded; the marks are lifted while
    saving. Weights still in GGUF blocks (GGUF kernels on a GPU) are refused in one line."""
    quantizer = getattr(model, "hf_quantizer", None)
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
    if quantizer is None or str(getattr(method, "value", method)) != "gguf":
        yield
        return
    if any("gguf" in type(m).__name__.lower() for m in model.modules()):
        raise ConfigError("the base model's weights are still in GGUF blocks and cannot be saved merged: export "
                          "the adapter (dpl export RUN FOLDER --adapter)")
    config = model.config
    mark = config.__dict__.pop("quantization_config", None)
    model.hf_quantizer = None
    try:
        yield
    finally:
        model.hf_quantizer = quantizer
        if mark is not None:
            config.quantization_config = mark


def _save(obj: Any, folder: Path) -> None:
    """A model (its GGUF marks lifted while saving) or a tokenizer, with ``save_pretrained``."""
    with serializable(obj):
        obj.save_pretrained(folder)


def _write(folder: Path, save: Callable[[Path], None]) -> None:
    """``save`` into a temporary folder beside ``folder``, renamed into place whole (a folder already there, written
    by another process meanwhile, is kept); a failure is one warning and no folder."""
    scratch = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
        save(scratch)
        scratch.chmod(0o755)  # mkdtemp's is 0o700: a shared cache is read by others
        os.rename(scratch, folder)
        scratch = None
    except OSError as exc:
        if not folder.is_dir():
            warnings.warn(f"dpl could not cache the dequantized GGUF base in {folder} ({exc}); it is read from the "
                          f"file on every load (DPL_CACHE names another folder, or off)", stacklevel=3)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def read_once(gguf_file: str, part: str, read_file: Callable[[], Any], read_folder: Callable[[str], Any]) -> Any:
    """``part`` (``model`` or ``tokenizer``) of ``gguf_file``: ``read_folder(cache)`` of the cached copy, written
    first from ``read_file()`` where the cache lacks it; ``read_file()`` itself when the cache is off or fails."""
    import torch

    folder = cache_folder(gguf_file, part)
    if folder is None:
        return read_file()
    if not folder.is_dir():
        with torch.random.fork_rng(devices=[]):  # reading the file draws nothing that a warm cache would not
            obj = read_file()
            real = part != "model" or not any(p.is_meta for p in obj.parameters())  # dpl plan's skeleton: no weights
            if not real:
                return obj
            _write(folder, functools.partial(_save, obj))
        if not folder.is_dir():
            return obj  # the cache could not be written (one warning): the file's read, as without a cache
        del obj
        log.info("dpl: %s: the dequantized %s is cached in %s (read from there from now on; DPL_CACHE=off: no cache)",
                 Path(gguf_file).name, part, folder)
    try:
        return read_folder(str(folder))
    except (OSError, ValueError) as exc:
        warnings.warn(f"dpl could not read the cached GGUF {part} in {folder} ({str(exc).splitlines()[0]}); "
                      f"reading {gguf_file} instead (delete the folder to rebuild it)", stacklevel=2)
        return read_file()
