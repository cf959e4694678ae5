"""``dpl ledger DATA_OR_ROOT``: the privacy spent on a data set, run after run, and its composition.

Every ``dpl fit`` run that took a private step is recorded in the data ledger of its runs' root folder
(:mod:`dpl.lightning.data_ledger`), under the content hash of its training data. This command reads the ledgers,
groups the runs by data set (and by privacy unit and adjacency: guarantees about different neighbouring relations do
not compose into one) and composes their epsilons:

* always by sequential composition: the epsilons add up and so do the deltas, whatever the mechanisms and however
  each run's settings were chosen (basic composition holds fully adaptively);
* where every run records the events of its steps (:mod:`dpl.core.accounting.events`: DP-SGD and DPZero's
  Poisson-subsampled Gaussian steps, user-level sampling, ELS's mixtures of Gaussians, ftrl's Gaussian or amplified
  banded steps, a tuning's selection), also by composing those events at the same total delta: the PRV accountant over
  every step of every run, tighter; a tuning's release (whose bound is its own, Papernot & Steinke's) is added to the
  rest by sequential composition, and the method says so. That bound is the composition of mechanisms whose settings
  are fixed in advance: it holds when no run's settings (sigma, q, steps) were chosen after seeing an earlier run's
  results. The composed epsilon is the smaller bound, shown with that condition; the sum is always shown beside it.

A run continued from another's checkpoint accounts for the steps before it: the run it continues is left out of the
composition when the continuation covers all its steps, and counted as well (conservatively) when it took steps
after that checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from dpl.errors import ConfigError
from dpl.lightning.data_ledger import LEDGER_NAME, epsilon_value, read_entries

#: how many folder levels below a runs root ``dpl ledger`` looks for ledgers (``runs/`` -> ``runs/<config>/``)
SEARCH_DEPTH = 3
SUM = ("sequential composition (the runs' epsilons add up and so do their deltas; valid for any mechanisms, however "
       "the runs' settings were chosen)")
PRV = ("the runs' events composed (PRV accountant over every step of every run; valid when no run's settings were "
       "chosen after seeing an earlier run's results)")
PRV_AND_TUNING = ("the runs' events composed (PRV accountant over every step; each tuning's release, bounded by its own "
                  "theorem, added by sequential composition; valid when no run's settings were chosen after seeing an "
                  "earlier run's results)")


def find_ledgers(folder: Path, depth: int = SEARCH_DEPTH) -> list[Path]:
    """The ledgers in ``folder`` and up to ``depth - 1`` folder levels below it."""
    found: list[Path] = []
    for level in range(depth):
        found += sorted(folder.glob("/".join(["*"] * level + [LEDGER_NAME])))
    return found


def is_ledger(path: Path) -> bool:
    """Whether the file ``path`` is a data ledger (by name, or a JSON-lines file of ledger entries)."""
    if path.name == LEDGER_NAME:
        return True
    if path.suffix != ".jsonl":
        return False
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                try:
                    first = json.loads(line)
                except json.JSONDecodeError:
                    return False
                return isinstance(first, dict) and {"run_id", "data_id", "epsilon"} <= set(first)
    return False


def data_hashes(path: Path) -> set[str]:
    """The content hashes of a data file, or of every file in a data folder."""
    from dpl.lightning.provenance import file_hash

    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    return {file_hash(p, keyed=True) for p in files}


def select(target: str, ledgers: list[str] | None = None) -> tuple[list[Path], list[dict[str, Any]], int, str]:
    """The ledgers read, the entries selected, the unreadable lines, and what was selected (in words), for ``target``:
    a ledger file or a runs root folder (every data set in its ledgers), or a data file or folder (the runs whose
    training file is among its files, in the ``ledgers`` given or those found under the working folder)."""
    path = Path(target)
    if not path.exists():
        raise ConfigError(f"{target} not found (give a ledger file, a runs root folder or a data file or folder)")
    wanted: set[str] | None = None
    if path.is_file() and is_ledger(path):
        files = [path]
    elif path.is_dir() and find_ledgers(path):
        files = find_ledgers(path)
    else:
        wanted = data_hashes(path)
        files = _given_ledgers(ledgers) if ledgers else find_ledgers(Path.cwd())
        if not files:
            raise ConfigError(f"no privacy ledger ({LEDGER_NAME}) found in {Path.cwd()} or the {SEARCH_DEPTH - 1} "
                              f"folder levels below it: give the runs' root folder (trainer.default_root_dir) with "
                              f"--ledger")
    latest: dict[str, dict[str, Any]] = {}  # a run written again (a tuning, when it ends): its last line
    skipped = 0
    for file in files:
        found, bad = read_entries(file)
        skipped += bad
        for entry in found:
            if wanted is None or wanted & set(entry.get("data_files") or []):
                latest.pop(entry["run_id"], None)
                latest[entry["run_id"]] = entry
    entries = list(latest.values())
    what = f"the runs on {target}" if wanted is not None else "every data set"
    return files, entries, skipped, what


def _given_ledgers(ledgers: list[str]) -> list[Path]:
    files: list[Path] = []
    for given in ledgers:
        path = Path(given)
        if path.is_file():
            files.append(path)
        elif path.is_dir() and find_ledgers(path):
            files += find_ledgers(path)
        else:
            raise ConfigError(f"--ledger {given}: no privacy ledger there")
    return files


def superseded(entries: list[dict[str, Any]]) -> dict[str, str]:
    """``run id -> id of the run that continues it`` for the runs whose steps a continuation accounts for entirely
    (it resumed from their checkpoint after their last step)."""
    by_id = {e["run_id"]: e for e in entries}
    covered = {}
    for entry in entries:
        continued = entry.get("continues") or {}
        earlier = by_id.get(continued.get("run_id"))
        if earlier is not None and earlier.get("data_id") == entry.get("data_id") \
                and int(continued.get("steps", 0)) >= int(earlier["steps"]):
            covered[earlier["run_id"]] = entry["run_id"]
    return covered


def _composable(entry: dict[str, Any]) -> str | None:
    """Why this run's events cannot be composed (``None``: they can)."""
    if not entry.get("events"):
        return f"run {entry['run_id']} records no events of its steps"
    return None


def compose(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The composition of ``entries`` (runs on one data set, one unit and adjacency): by summing, and by composing
    their events where every run records them (:func:`_composable`); ``epsilon`` / ``delta`` / ``method``: the
    smaller."""
    from dpl.core.accounting import events

    eps_sum = sum(epsilon_value(e["epsilon"]) for e in entries)
    delta_sum = sum(float(e["delta"]) for e in entries)
    result: dict[str, Any] = {"runs": len(entries), "epsilon_sum": eps_sum, "delta": delta_sum, "epsilon": eps_sum,
                              "method": SUM, "epsilon_prv": None, "prv_not_used": None}
    reasons = [r for r in map(_composable, entries) if r is not None]
    if reasons:
        result["prv_not_used"] = reasons[0]
    elif len(entries) > 1 and delta_sum < 1:
        history = [pair for entry in entries for pair in events.history_from_json(entry["events"])]
        composed = events.history_event(history)
        eps = events.epsilon(composed, delta_sum)
        result["epsilon_prv"] = eps
        result["events_method"] = PRV if events.composition_method(composed) == events.TIGHT else PRV_AND_TUNING
        if eps < eps_sum:
            result["epsilon"], result["method"] = eps, result["events_method"]
    return result


def data_sets(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The entries grouped by data set, privacy unit and adjacency, each group with its runs (those a continuation
    accounts for marked ``continued_by``) and their composition (``None`` for data that names no content hash)."""
    covered = superseded(entries)
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for entry in entries:
        key = (entry.get("data_id"), entry.get("unit", "example"), entry.get("adjacency"))
        groups.setdefault(key, []).append({**entry, "continued_by": covered.get(entry["run_id"])})
    found = []
    for (data_id, unit, adjacency), runs in groups.items():
        runs.sort(key=lambda e: str(e.get("started")))
        counted = [r for r in runs if r["continued_by"] is None]
        left_out = [{"run_id": e["run_id"], "why": _left_out_because(unit, adjacency, e)} for e in entries
                    if data_id is not None and e.get("data_id") == data_id
                    and (e.get("unit", "example"), e.get("adjacency")) != (unit, adjacency)]
        found.append({"data_id": data_id, "data": runs[0].get("data"), "unit": unit, "adjacency": adjacency,
                      "runs": runs, "composed": compose(counted) if data_id is not None else None,
                      "left_out": left_out})
    return found


#: why a total of ``unit``-level runs leaves out the runs of another unit on the same data
OTHER_UNIT = {"user": "example-level: each protects one row, which gives a user of several rows no bounded protection",
              "example": "user-level: a guarantee about all the rows of one user, another neighbouring relation"}


def _left_out_because(unit: str, adjacency: str | None, other: dict[str, Any]) -> str:
    """Why a total of ``unit``-level runs with ``adjacency`` does not count ``other``, a run on the same data."""
    if other.get("unit", "example") != unit:
        return OTHER_UNIT.get(unit, f"{other.get('unit')}-level: another neighbouring relation")
    return f"{other.get('adjacency')} adjacency: a guarantee about another neighbouring relation"


def _jsonable(value: Any) -> Any:
    """JSON-safe: inf and NaN as strings, as in the ledger."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def _kept(run: dict[str, Any]) -> bool:
    """Whether the run's folder still holds that run (a removed run's folder name may be taken by a later run)."""
    try:
        report = json.loads((Path(run["run_folder"]) / "privacy.json").read_text())
    except (OSError, ValueError):
        return False
    return (report.get("run") or {}).get("id") == run["run_id"]


def _fmt_eps(value: Any) -> str:
    number = epsilon_value(value)
    return f"{number:.3f}" if math.isfinite(number) else str(number)


def show(group: dict[str, Any]) -> list[str]:
    """The lines that show one data set's runs and their composition."""
    ident = group["data_id"] or "not identified: the data module states no training data"
    lines = [f"data set {group['data']} ({ident}); {group['unit']}-level, {group['adjacency']} adjacency",
             f"  {'status':<12} {'started (UTC)':<21} {'steps':>6} {'epsilon':>9} {'delta':>9}  run id / run folder"]
    for run in group["runs"]:
        folder = run.get("run_folder")
        note = f"; continued by {run['continued_by']}, which accounts for its steps" if run["continued_by"] else ""
        tuning = run.get("mechanism") == "tuning"  # its steps and trials would reveal the secret number of trials
        steps = "-" if tuning else run["steps"]
        where = ("dpl tune: the best of K trials (K secret; no steps or folders shown)" if tuning else
                 f"{folder}{'' if folder is None or _kept(run) else ' (removed)'}")
        lines.append(f"  {run['status']:<12} {str(run.get('started')):<21} {steps:>6} "
                     f"{_fmt_eps(run['epsilon']):>9} {float(run['delta']):>9.3g}  {run['run_id']} {where}{note}")
    composed = group["composed"]
    if composed is None:
        lines.append("  not composed: runs on unidentified data may be on different data sets")
        return lines
    runs = f"{composed['runs']} run{'s' if composed['runs'] != 1 else ''}"
    lines.append(f"  {SUM}: epsilon = {_fmt_eps(composed['epsilon_sum'])}, delta = {composed['delta']:.3g}")
    if composed["epsilon_prv"] is not None:
        lines.append(f"  {composed['events_method']}: epsilon = {_fmt_eps(composed['epsilon_prv'])} at delta = {composed['delta']:.3g}")
    elif composed["prv_not_used"] and composed["runs"] > 1:
        lines.append(f"  no tighter composition: {composed['prv_not_used']}")
    condition = ""
    if composed["method"] in (PRV, PRV_AND_TUNING):
        condition = (f" (composed events; if a run's settings were chosen after seeing an earlier run's results: the sum, "
                     f"{_fmt_eps(composed['epsilon_sum'])})")
    lines.append(f"  composed over {runs}: epsilon = {_fmt_eps(composed['epsilon'])}, delta = "
                 f"{composed['delta']:.3g}{condition}")
    whys: dict[str, list[str]] = {}
    for run in group.get("left_out") or []:
        whys.setdefault(run["why"], []).append(run["run_id"])
    for why, ids in whys.items():
        lines.append(f"  left out: {len(ids)} run{'s' if len(ids) != 1 else ''} on the same data, {why} "
                     f"({', '.join(ids)})")
    return lines


def ledger_command(argv: list[str]) -> int:
    """``dpl ledger DATA_OR_ROOT [--ledger FILE_OR_FOLDER ...] [--json]``."""
    parser = argparse.ArgumentParser(prog="dpl ledger", description=__doc__.split("\n\n")[0])
    parser.add_argument("target", metavar="DATA_OR_ROOT",
                        help="a ledger file (privacy_ledger.jsonl), a runs root folder (trainer.default_root_dir), or "
                             "a data file or folder, whose runs are found by its content hash")
    parser.add_argument("--ledger", action="append", default=None, metavar="FILE_OR_FOLDER",
                        help="where to look up a data file or folder (repeatable; default: the ledgers in the working "
                             "folder and two levels below)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = parser.parse_args(argv)
    try:
        files, entries, skipped, what = select(args.target, args.ledger)
    except (ConfigError, OSError) as exc:
        print(f"dpl: error: {exc}", file=sys.stderr)
        return 2
    groups = data_sets(entries)
    if args.json:
        print(json.dumps(_jsonable({"ledgers": [str(f) for f in files], "unreadable_lines": skipped,
                                    "data_sets": groups}), indent=2))
        return 0
    shown = ", ".join(str(f) for f in files)
    if not entries:
        print(f"dpl ledger: no run recorded for {what} in {shown}")
        return 0
    print(f"dpl ledger: {len(entries)} run{'s' if len(entries) != 1 else ''} ({what}) in {shown}"
          + (f"; {skipped} unreadable line(s) skipped" if skipped else ""))
    for group in groups:
        print()
        print("\n".join(show(group)))
    return 0
