"""dpl: differentially private fine-tuning of language models on Lightning.

A plugin uses :mod:`dpl.api` only (``from dpl.api import hookimpl`` marks its hook implementations).
``from dpl import PrivateTraining, PrivacyConfig`` trains privately without Lightning (:mod:`dpl.training`); both are
imported on first use, so that ``import dpl`` stays free of torch.
"""

from typing import Any

from dpl.version import __version__

__all__ = ["PrivacyConfig", "PrivateTraining", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "PrivateTraining":
        from dpl.training import PrivateTraining

        return PrivateTraining
    if name == "PrivacyConfig":
        from dpl.core.privacy import PrivacyConfig

        return PrivacyConfig
    raise AttributeError(f"module 'dpl' has no attribute {name!r}")
