"""dpl: differentially private fine-tuning of language models on Lightning.

``from dpl import hookimpl`` marks a plugin's hook implementations; :mod:`dpl.api` lists everything else a plugin
may use.
"""

from dpl.core.hookspecs import hookimpl

__version__ = "0.1.0"
__all__ = ["hookimpl", "__version__"]
