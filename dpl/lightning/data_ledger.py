"""The data ledger: the privacy each run spent on its training data, one JSON line per ``dpl fit`` run that took a
private step, in ``privacy_ledger.jsonl`` of the runs' root folder (``trainer.default_root_dir``). A data set is
named by the content hash of its training data (:mod:`dpl.lightning.provenance`), so the runs on one data set can be
found and their epsilons composed (``dpl ledger``, :mod:`dpl.trained.spending`).

A run is recorded once: when it ends, or when it is interrupted or fails (before the command removes a run folder
without checkpoint). Each entry is one ``write`` of one line to the file opened in append mode, then fsynced, so
concurrent runs do not interleave and a crash loses at most the line being written (a torn last line is skipped when
reading). Entries hold public values only (those of the privacy report), never a secret.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

LEDGER_NAME = "privacy_ledger.jsonl"
STATUSES = ("finished", "interrupted", "failed")


def data_label(training_data: dict[str, Any] | None) -> str:
    """The training data in a few words: its training file names or its generator."""
    if not training_data:
        return "data not identified"
    if training_data.get("generator"):
        return f"generated data ({training_data['generator']})"
    names = [Path(f["path"]).name for f in training_data.get("files") or [] if f.get("split") == "train"]
    return ", ".join(names) or "data"


def entry_of(report: dict[str, Any], run_folder: str | None, steps_this_run: int) -> dict[str, Any]:
    """The ledger line of a run, from its final privacy report."""
    run, data = report["run"], report.get("training_data") or {}
    return {
        "run_id": run["id"], "started": run["started"], "ended": run["ended"], "status": run["status"],
        "data_id": data.get("id"), "data": data_label(data),
        "data_files": [f["hash"] for f in data.get("files") or [] if f.get("split") == "train"],
        "epsilon": report["epsilon"], "delta": report["delta"], "steps": report["steps_taken"],
        "steps_this_run": steps_this_run, "steps_planned": report["steps_planned"],
        "unit": report.get("unit") or "example", "adjacency": report["adjacency"], "mechanism": report["mechanism"],
        "sampling": report["sampling"], "accountant": report["accountant"],
        "noise_multiplier": report["noise_multiplier"], "sampling_rate": report["sampling_rate"],
        "events": report["events"], "scope": report.get("scope"), "continues": run.get("continues"),
        "base_model_id": (report.get("base_model") or {}).get("id"),
        "run_folder": str(Path(run_folder).absolute()) if run_folder else None, "dpl_version": report["dpl_version"],
    }


def append_entry(path: str | Path, entry: dict[str, Any]) -> None:
    """Append ``entry`` as one line to the ledger at ``path`` (created if need be): one write, flushed and fsynced."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(entry, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def record(report: dict[str, Any], root: str | Path, run_folder: str | None, steps_this_run: int) -> Path:
    """Record the run of ``report`` in the ledger of the runs' root folder ``root``; return the ledger's path."""
    path = Path(root) / LEDGER_NAME
    append_entry(path, entry_of(report, run_folder, steps_this_run))
    return path


def read_entries(path: str | Path) -> tuple[list[dict[str, Any]], int]:
    """The entries of a ledger, and the number of lines that are not an entry (a torn last line, say)."""
    entries, skipped = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                skipped += 1
                continue
            if isinstance(entry, dict) and "run_id" in entry and "epsilon" in entry:
                entries.append(entry)
            else:
                skipped += 1
    return entries, skipped


def epsilon_value(value: Any) -> float:
    """An epsilon as stored (a number, or ``"inf"`` / ``"nan"``: JSON has no such numbers) as a float."""
    return float(value)


def stop_line(report: dict[str, Any], status: str, ledger: Path) -> str:
    """The line printed when a run stops early: the steps taken, the epsilon they spent and where that is recorded."""
    data = report.get("training_data") or {}
    what = data_label(data) + (f" ({data['id']})" if data.get("id") else "")
    epsilon = epsilon_value(report["epsilon"])
    shown = f"{epsilon:.3f}" if math.isfinite(epsilon) else str(epsilon)
    steps = int(report["steps_taken"])
    return (f"dpl: {status} after {steps} private step{'s' if steps != 1 else ''}; epsilon = {shown} (delta = "
            f"{report['delta']:.3g}) spent on {what} (recorded in {ledger})")
