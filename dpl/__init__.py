"""dpl: differentially private fine-tuning of language models on Lightning.

``from dpl import hookimpl`` marks a plugin's hook implementations; :mod:`dpl.api` lists everything else a plugin
may use. ``from dpl import PrivateTraining, PrivacyConfig`` trains privately without Lightning (:mod:`dpl.training`); both
are imported on first use, so that ``import dpl`` stays free of torch.
"""

from typing import Any

from dpl.core.hookspecs import hookimpl
from dpl.version import __version__
__all__ = ["PrivacyConfig", "PrivateTraining", "hookimpl", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "PrivateTraining":
        from dpl.training import PrivateTraining

        return PrivateTraining
    if name == "PrivacyConfig":
        from dpl.core.privacy import PrivacyConfig

        return PrivacyConfig
    raise AttributeError(f"module 'dpl' has no attribute {name!r}")
