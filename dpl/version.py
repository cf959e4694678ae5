"""dpl's version (the package's, as in pyproject.toml)."""

__version__ = "0.1.0"
