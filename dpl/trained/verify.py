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


#: how deep below a folder its reports are looked for (runs/<name>/lightning_logs/version_N/privacy.json)
DEPTH = 4


def report_files(location: str) -> list[Path]:
    """The privacy reports of ``location``: a ``privacy.json``, a run or exported folder holding one, or a folder
    with runs below it (up to :data:`DEPTH` levels)."""
    path = Path(location)
    if path.is_file():
        return [path]
    if (path / REPORT).is_file():
        return [path / REPORT]
    found = sorted(p for depth in range(1, DEPTH + 1) for p in path.glob("/".join(["*"] * depth) + f"/{REPORT}"))
    if not found:
        raise ConfigError(f"{location!r}: no {REPORT} there or below (give a run folder, a runs folder, an exported "
                          f"folder or a {REPORT})")
    return found


def read_report(path: Path) -> dict[str, Any]:
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
    """``dpl verify-data FILE RUN``: exit 0 when FILE matches a data file of a report of RUN, 1 when not."""
    parser = argparse.ArgumentParser(prog="dpl verify-data", description=(
        "Whether a data file is one a run trained (or validated) on, checked against the keyed hashes of its privacy "
        "report (this machine's data key, or DPL_DATA_KEY). Exit 0: it matches; 1: it does not; 2: unreadable."))
    parser.add_argument("file", help="the data file to check")
    parser.add_argument("run", help="a run folder (lightning_logs/version_N), a folder of runs, an exported folder "
                                    "or a privacy.json")
    args = parser.parse_args(argv)
    try:
        reports = report_files(args.run)
        single = len(reports) == 1
        matches = []
        for path in reports:
            report = read_report(path)
            keyed = str((report.get("training_data") or {}).get("id") or "").startswith("blake2b-256-keyed:")
            if single or keyed:  # in a folder of runs, runs on generated data are passed over
                matches += [(path.parent, entry) for entry in matching_entries(args.file, report)]
    except DPLError as exc:
        print(f"dpl: error: {exc}", file=sys.stderr)
        return 2
    if not matches:
        print(f"dpl verify-data: {args.file} does not match the data of {args.run} (another file, or hashed with "
              f"another machine's key: set DPL_DATA_KEY to the key of the machine that trained)")
        return 1
    if single:
        names = ", ".join(f"{e.get('split', 'data')} file {e.get('path')}" for _, e in matches)
        print(f"dpl verify-data: {args.file} matches the {names} of {args.run}")
    else:
        runs = "; ".join(f"{e.get('split', 'data')} file {e.get('path')} of {folder}" for folder, e in matches)
        print(f"dpl verify-data: {args.file} matches {len(matches)} data file(s) of the runs in {args.run}: {runs}")
    return 0
