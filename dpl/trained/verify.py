"""``dpl verify-data FILE RUN``: whether a data file is one a run trained (or validated) on, checked against the keyed
hashes of its privacy report. The hashes are keyed with this machine's secret data key
(:func:`dpl.lightning.provenance.data_key`; ``DPL_DATA_KEY`` gives another machine's), so only their owner can check
a file: to anyone else they confirm nothing."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dpl.errors import ConfigError, DPLError

REPORT = "privacy.json"


def read_report(location: str) -> dict[str, Any]:
    """The privacy report of ``location``: a run or exported folder holding ``privacy.json``, or the file itself."""
    path = Path(location)
    if path.is_dir():
        path = path / REPORT
    if not path.is_file():
        raise ConfigError(f"{location!r}: no {REPORT} there (give a run folder, an exported folder or a {REPORT})")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a readable privacy report ({exc})") from None


def matching_entries(file: str, report: dict[str, Any]) -> list[dict[str, Any]]:
    """The training-data entries of ``report`` whose keyed hash is that of ``file`` (hashed with this machine's
    key)."""
    from dpl.lightning.provenance import file_hash

    path = Path(file)
    if not path.is_file():
        raise ConfigError(f"{file!r} not found" if not path.exists() else f"{file!r} is not a file")
    data = report.get("training_data") or {}
    if not str(data.get("id") or "").startswith("blake2b-256-keyed:"):
        raise ConfigError("the report states no keyed hash of its training data (generated data, or none stated)")
    digest = file_hash(path, keyed=True)
    return [entry for entry in data.get("files") or [] if entry.get("hash") == digest]


def verify_command(argv: list[str]) -> int:
    """``dpl verify-data FILE RUN``: exit 0 when FILE matches a data file of RUN's report, 1 when not."""
    parser = argparse.ArgumentParser(prog="dpl verify-data", description=__doc__.split("\n\n")[0])
    parser.add_argument("file", help="the data file to check")
    parser.add_argument("run", help="a run folder (lightning_logs/version_N), an exported folder or a privacy.json")
    args = parser.parse_args(argv)
    try:
        found = matching_entries(args.file, read_report(args.run))
    except DPLError as exc:
        print(f"dpl: error: {exc}", file=sys.stderr)
        return 2
    if not found:
        print(f"dpl verify-data: {args.file} does not match the data of {args.run} (another file, or hashed with "
              f"another machine's key: set DPL_DATA_KEY to the key of the machine that trained)")
        return 1
    names = ", ".join(f"{e.get('split', 'data')} file {e.get('path')}" for e in found)
    print(f"dpl verify-data: {args.file} matches the {names} of {args.run}")
    return 0
