"""Exceptions dpl raises for bad input and for privacy-contract violations."""


class DPLError(Exception):
    """Base class of dpl's errors."""


class ConfigError(DPLError, ValueError):
    """A configuration dpl refuses, with a one-line reason (raised before training starts)."""


class DataError(ConfigError):
    """Bad input data (missing file or column, malformed row, unknown label, empty split), in one line."""


class PluginError(ConfigError):
    """An unknown plugin, a plugin that fails to load, or plugins that cannot be combined."""


class PrivacyViolation(DPLError, RuntimeError):
    """Code tried to read data that the privacy contract forbids at that point (a bug, never user error)."""


class BudgetExceeded(DPLError, RuntimeError):
    """A step refused because it would spend more epsilon than the privacy budget (``privacy.max_epsilon``)."""


class PrivacyWarning(Warning):
    """A setting that weakens the privacy guarantee or its interpretation (a seed, a large delta, non-private
    diagnostics). Deliberately not a ``UserWarning``, so that filters aimed at ordinary warnings keep it."""


def dpl_error_in(exc: BaseException | None) -> DPLError | None:
    """The DPLError that caused ``exc`` (jsonargparse wraps errors raised while instantiating classes)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, DPLError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None
