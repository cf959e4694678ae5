"""``dpl audit``: parse the settings, run the audit, print the report (exit code 1 on a violation)."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

from dpl.audit.config import AuditConfig
from dpl.audit.runner import run_audit
from dpl.errors import ConfigError, DPLError

RENAMED = {"epsilon": "target_epsilon", "delta": "target_delta", "rows_per_user": "max_rows_per_user"}
"""Names of privacy settings other than the privacy config's (``model.privacy``): refused, naming the right key."""


def check_privacy_names(argv: list[str]) -> None:
    """Refuse, in one line, a key of :data:`RENAMED` given on the command line or at the top of a ``--config`` file."""
    import os

    import yaml

    given = [arg[2:].split("=", 1)[0] for arg in argv if arg.startswith("--")]
    paths = [arg.split("=", 1)[1] for arg in argv if arg.startswith("--config=")]
    paths += [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--config"]
    for path in filter(os.path.isfile, paths):  # a missing or unreadable file: jsonargparse says so
        try:
            with open(path) as f:
                loaded = yaml.safe_load(f)
        except (OSError, yaml.YAMLError):
            continue
        given += list(loaded) if isinstance(loaded, dict) else []
    for key in given:
        if key in RENAMED:
            raise ConfigError(f"dpl audit: {key!r} is now {RENAMED[key]!r} (the privacy config's name)")


def build_parser() -> Any:
    from jsonargparse import ActionConfigFile, ArgumentParser

    parser = ArgumentParser(prog="dpl audit", exit_on_error=True, description=(
        "Empirical privacy audit in one run (Steinke, Nasr & Jagielski 2023): m gradient canaries, each included "
        "with probability 1/2, trained on by dpl's private step; the number of correct membership guesses gives "
        "a lower bound on epsilon at a stated confidence. A bound above the claimed epsilon is a violation; a "
        "bound below it proves nothing. See docs/audit.md."))
    parser.add_argument("--config", action=ActionConfigFile, help="YAML config (e.g. configs/audit/gaussian.yaml)")
    parser.add_class_arguments(AuditConfig, as_group=False)
    parser.add_argument("--output", type=str | None, default=None, help="write the report as JSON to this file")
    return parser


def audit_command(argv: list[str]) -> int:
    """``dpl audit [--config FILE] [--KEY VALUE ...]``: run an audit, print the report, optionally write JSON; exit code
    1 when the report says VIOLATION (so that a CI job fails), 2 on bad input."""
    import os

    try:
        check_privacy_names(argv)
        parser = build_parser()
        args = parser.parse_args(argv)
        cfg = AuditConfig(**{f.name: args[f.name] for f in dataclasses.fields(AuditConfig)})
        result = run_audit(cfg)
    except DPLError as exc:
        if os.environ.get("DPL_DEBUG"):
            raise
        print(f"dpl: error: {exc}", file=sys.stderr)
        return 2
    print(result.report(), flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result.to_dict(), f, indent=2)
            f.write("\n")
        print(f"  report written to {args.output}")
    return 1 if result.violation else 0
