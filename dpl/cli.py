"""The ``dpl`` command: Lightning's ``fit``, ``validate`` and ``test`` (:mod:`dpl.cli_lightning`) plus dpl's own
commands (:data:`COMMANDS`: ``dpl plugins``, ...).

This module imports neither torch nor Lightning: ``dpl --help`` and the light commands start in well under a
second, and the training commands load them when they run."""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import sys
import textwrap
import typing
import warnings
from pathlib import Path
from typing import Any

from dpl.allocator import keep_freed_memory
from dpl.cli_commands import COMMANDS, DESCRIPTION, SUBCOMMAND_EPILOG, docstring_args, epilog, task_classes
from dpl.errors import DPLError, PrivacyWarning

__all__ = ["COMMANDS", "DESCRIPTION", "SUBCOMMAND_EPILOG", "epilog", "main", "task_classes"]

def privacy_help() -> str:
    """The privacy options (``--model.privacy.KEY``): type, default and meaning."""
    from dpl.core.privacy import PrivacyConfig

    docs = docstring_args(PrivacyConfig)
    hints = typing.get_type_hints(PrivacyConfig)
    lines = ["privacy options of every dpl model (--model.privacy.KEY VALUE, or model.init_args.privacy in a config):"]
    for f in dataclasses.fields(PrivacyConfig):
        kind = str(hints[f.name]).replace("typing.", "").replace("<class '", "").replace("'>", "")
        lines.append(f"  --model.privacy.{f.name} ({kind}, default {f.default!r})")
        lines.append(textwrap.fill(docs.get(f.name, ""), 100, initial_indent=" " * 6, subsequent_indent=" " * 6))
    return "\n".join(lines)


def print_plugins() -> None:
    """``dpl plugins``' listing: each installed plugin's description, hooks, package and config fragments."""
    from dpl.cli_help import plugins_listing
    from dpl.core.plugin_manager import describe_plugins

    print(plugins_listing(describe_plugins()), end="")


def plugins_command(argv: list[str]) -> int:
    """``dpl plugins``: list the installed plugins."""
    if argv:
        if argv[0] in ("-h", "--help"):
            print(f"usage: dpl plugins\n\n{COMMANDS['plugins'][0]}")
            return 0
        print(f"dpl: error: dpl plugins takes no arguments (got {' '.join(argv)})", file=sys.stderr)
        return 2
    print_plugins()
    return 0


def _run_command(name: str, argv: list[str]) -> None:
    module, _, function = COMMANDS[name][1].partition(":")
    code = getattr(importlib.import_module(module), function)(argv)
    if code:
        raise SystemExit(code)


def _no_tips(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("\U0001f4a1 Tip:")  # Lightning's advertisements for its cloud


def _no_seed_line(record: logging.LogRecord) -> bool:
    return "Seed set to" not in str(record.msg)


def _rank_zero_info(record: logging.LogRecord) -> bool:
    """dpl's informational lines once per run, not once per process (warnings stay on every rank)."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    return record.levelno > logging.INFO or getattr(rank_zero_only, "rank", 0) == 0


def _quiet() -> None:
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


def _format_warnings() -> None:
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


def main(args: list[str] | None = None) -> None:
    """Entry point of ``dpl``; ``args`` defaults to the command line."""
    argv = sys.argv[1:] if args is None else list(args)
    keep_freed_memory()  # glibc: reuse freed blocks step after step (dpl.allocator; DPL_MALLOC=system opts out)
    _format_warnings()
    if not argv:
        print(f"dpl: error: expected a command: fit, validate, test, {', '.join(COMMANDS)} (see dpl --help)",
              file=sys.stderr)
        raise SystemExit(2)
    if argv[0] in ("-h", "--help"):
        from dpl.cli_help import top_level_help

        print(top_level_help(DESCRIPTION, COMMANDS), end="")
        raise SystemExit(0)
    if any(a in ("--model.privacy.help", "--model.init_args.privacy.help") for a in argv):
        print(privacy_help())
        return
    if argv[:1] and argv[0] in COMMANDS:
        if argv[0] in ("predict", "export") and not {"-h", "--help"} & set(argv):
            _quiet()  # no loading bars or deprecation notices around the outputs
        _run_command(argv[0], argv[1:])
        return
    if argv[0] in ("fit", "validate", "test") and not os.environ.get("DPL_DEBUG"):
        from dpl.cli_precheck import precheck

        mistake = precheck(argv[1:])  # dpl's own keys, before the seconds of importing torch and Lightning
        if mistake:
            print(f"dpl: error: {mistake}", file=sys.stderr)
            raise SystemExit(2)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Lightning first: it gives its loggers their own handler when the root logger has none yet
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from dpl import cli_lightning

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    _quiet()
    _format_warnings()  # again: Lightning installs its own format when imported
    try:
        cli_lightning.run(args)
    except SIGTERMException:
        print("dpl: stopped by SIGTERM after the current step; checkpoints already written are complete (a run "
              "without one was removed)", file=sys.stderr)
        raise SystemExit(143) from None
    except Exception as exc:
        error = _dpl_error_in(exc)
        if error is None or os.environ.get("DPL_DEBUG"):
            raise
        print(f"dpl: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def _dpl_error_in(exc: BaseException | None) -> DPLError | None:
    """The DPLError that caused ``exc`` (jsonargparse wraps errors raised while instantiating classes)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, DPLError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def __getattr__(name: str) -> Any:
    """The Lightning part's names (:mod:`dpl.cli_lightning`: ``DPLightningCLI`` ...), imported when first used."""
    if name in ("DPLightningCLI", "DPLArgumentParser", "RunConfig", "default_loggers"):
        from dpl import cli_lightning

        return getattr(cli_lightning, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":  # python -m dpl.cli: run the module dpl.cli_lightning shares state with, not this copy
    from dpl.cli import main as _main

    _main()
