"""What the ``dpl`` command shows of the messages around a run: dpl's warnings as one line (:func:`format_warning`),
the messages that do not matter to a dpl user silenced (:func:`quiet`: Lightning's tips and seed line, library
deprecations, loading bars in logs; the ones about privacy stay), and Lightning's setup lines held until the run
starts (:data:`BANNERS`). Imports neither torch nor Lightning."""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

from dpl.errors import PrivacyWarning


def _no_tips(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("\U0001f4a1 Tip:")  # Lightning's advertisements for its cloud


def _no_seed_line(record: logging.LogRecord) -> bool:
    return "Seed set to" not in str(record.msg)


def _rank_zero_info(record: logging.LogRecord) -> bool:
    """dpl's informational lines once per run, not once per process (warnings stay on every rank)."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    return record.levelno > logging.INFO or getattr(rank_zero_only, "rank", 0) == 0


def quiet() -> None:
    """Silence the messages that do not matter to a dpl user (the ones about privacy stay)."""
    for pattern in (r".*`tensorboardX` has been removed as a dependency", r".*`is_gradient_checkpointing` is deprecated",
                    r".*LeafSpec.*deprecated",
                    r".*smaller than the logging interval",  # dpl logs epsilon at the last step whatever the interval
                    # dpl's epoch metrics are reduced over the ranks already (torchmetrics states, gathered outputs)
                    r".*sync_dist=True\)` when logging on epoch level in distributed setting",
                    r".*Total length of `list` across ranks is zero"):  # no validation split: dpl says so itself
        warnings.filterwarnings("ignore", message=pattern)
    logging.getLogger("dpl").addFilter(_rank_zero_info)  # the same function object: added once

    for name in ("lightning.pytorch.utilities.rank_zero", "lightning_fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_no_tips)  # the same function object: added once
    for name in ("lightning.fabric.utilities.seed", "lightning_fabric.utilities.seed"):
        logging.getLogger(name).addFilter(_no_seed_line)  # seed_everything's "Seed set to N": the config says so
    if not (sys.stderr.isatty() and sys.stdout.isatty()):  # no carriage-return bars in logs
        try:
            import datasets
            import transformers

            datasets.disable_progress_bars()
            transformers.utils.logging.disable_progress_bar()
        except Exception:  # noqa: BLE001 - optional
            pass


_PACKAGE = Path(__file__).resolve().parent


def format_warnings() -> None:
    """Show dpl's warnings as one line (:func:`format_warning`), other warnings as the current format does."""
    if warnings.formatwarning is not format_warning:
        format_warning.others = warnings.formatwarning  # type: ignore[attr-defined]
        warnings.formatwarning = format_warning


def format_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                   line: str | None = None) -> str:
    """dpl's warnings (a :class:`~dpl.errors.PrivacyWarning`, or one raised in dpl's code) as one line,
    ``dpl: warning: ...``, without the source location; other warnings as before."""
    try:
        ours = issubclass(category, PrivacyWarning) or Path(filename).resolve().is_relative_to(_PACKAGE)
    except (OSError, ValueError, TypeError):
        ours = False
    if ours:
        return f"dpl: warning: {message}\n"
    return format_warning.others(message, category, filename, lineno, line)  # type: ignore[attr-defined]


format_warning.others = warnings.formatwarning  # type: ignore[attr-defined]


#: the loggers of Lightning's informational lines (GPU/TPU/HPU available, mixed precision, restoring states)
LIGHTNING_INFO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
                          "lightning_fabric.utilities.rank_zero", "pytorch_lightning.utilities.rank_zero")


class HeldBanners(logging.Filter):
    """Holds Lightning's informational lines while the run is set up: they are shown once the run starts
    (:class:`~dpl.cli_lightning.ShowBanners`) and dropped when setup fails, so that a refused run prints its
    ``dpl: error:`` line alone. Warnings pass at once."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.holding = False

    def filter(self, record: logging.LogRecord) -> bool:
        if self.holding and record.levelno <= logging.INFO:
            self.records.append(record)
            return False
        return True

    def hold(self) -> None:
        self.holding = True
        for name in LIGHTNING_INFO_LOGGERS:
            logging.getLogger(name).addFilter(self)

    def _stop(self) -> list[logging.LogRecord]:
        self.holding = False
        for name in LIGHTNING_INFO_LOGGERS:
            logging.getLogger(name).removeFilter(self)
        records, self.records = self.records, []
        return records

    def release(self) -> None:
        """Show the held lines (in order) and stop holding."""
        for record in self._stop():
            logging.getLogger(record.name).handle(record)

    def drop(self) -> None:
        """Forget the held lines and stop holding."""
        self._stop()


BANNERS = HeldBanners()
