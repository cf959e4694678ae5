"""A tuning's line in the data ledger: one line per ``dpl tune``, in the ledger of the root the user gave
(``trainer.default_root_dir`` of the ``dpl tune`` call), whatever happens to the trial folders.

The line carries the tuning's event (:func:`dpl.tune.plans.tuning_event`: the best of K ~ its distribution of one trial's event,
``RepeatAndSelect``; a fixed K: their composition) and the tuned release's epsilon. It is written when the first
trial starts training (before any private step: an interrupted or failed search is counted) and written again, with
the same run id, when the search ends (finished, failed, interrupted); ``dpl ledger`` reads the last line of each run
id. The trials themselves write no line: the tuning's covers them all. The line holds no count of trials, no steps
and no end time, and is not written per trial: each would reveal the secret number of trials K.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dpl.core.accounting import events
from dpl.lightning import data_ledger


def start_entry(trial_report: dict[str, Any], tuning_id: str, event: events.Event, epsilon: float) -> dict[str, Any]:
    """The tuning's line, from the privacy report of its first trial (its data, unit and adjacency)."""
    entry = data_ledger.entry_of(trial_report, run_folder=None, steps_this_run=0)
    entry.update(run_id=tuning_id, status="running", ended=None, epsilon=epsilon, steps=0, steps_this_run=0,
                 steps_planned=None, mechanism="tuning", sampling=f"best of K trials ({trial_report['sampling']})",
                 accountant="Papernot & Steinke (RDP)", noise_multiplier=None, sampling_rate=None,
                 events=events.history_to_json([(event, 0)]), continues=None)
    return entry


def write(root: str | Path, entry: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """Append ``entry`` with ``changes`` to the ledger of ``root``; return the line written."""
    line = {**entry, **changes}
    data_ledger.append_entry(Path(root) / data_ledger.LEDGER_NAME, line)
    return line
