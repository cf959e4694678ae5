"""The ``dpl`` command: Lightning's ``fit``, ``validate`` and ``test`` (:mod:`dpl.cli_training`) plus dpl's own
commands (:data:`COMMANDS`: ``dpl plugins``, ...), each loaded by its module's name when it runs.

This module imports neither torch nor Lightning: ``dpl --help`` and the light commands start in well under a
second, and the training commands load them when they run."""

from __future__ import annotations

import dataclasses
import importlib
import sys
import textwrap
import typing
from typing import Any

from dpl.allocator import keep_freed_memory
from dpl.cli_commands import COMMANDS, DESCRIPTION, SUBCOMMAND_EPILOG, docstring_args, epilog, task_classes
from dpl.cli_training import training_command
from dpl.messages import format_warning, format_warnings, quiet

__all__ = ["COMMANDS", "DESCRIPTION", "SUBCOMMAND_EPILOG", "epilog", "format_warning", "main", "task_classes"]

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


def main(args: list[str] | None = None) -> None:
    """Entry point of ``dpl``; ``args`` defaults to the command line."""
    argv = sys.argv[1:] if args is None else list(args)
    keep_freed_memory()  # glibc: reuse freed blocks step after step (dpl.allocator; DPL_MALLOC=system opts out)
    format_warnings()
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
            quiet()  # no loading bars or deprecation notices around the outputs
        _run_command(argv[0], argv[1:])
        return
    training_command(args)


def __getattr__(name: str) -> Any:
    """The Lightning part's names (:mod:`dpl.cli_lightning`: ``DPLightningCLI`` ...), imported when first used."""
    if name in ("DPLightningCLI", "DPLArgumentParser", "RunConfig", "default_loggers"):
        from dpl import cli_lightning

        return getattr(cli_lightning, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":  # python -m dpl.cli: run the module dpl.cli itself, not this __main__ copy
    from dpl.cli import main as _main

    _main()
