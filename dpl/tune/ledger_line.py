"""A tuning's line in the data ledger: one line per ``dpl tune``, in the ledger of the root the user gave
(``trainer.default_root_dir`` of the ``dpl tune`` call), whatever happens to the trial folders.

The line carries the tuning's event (:func:`tuning_event`: the best of K ~ its distribution of one trial's event,
``RepeatAndSelect``; a fixed K: their composition) and the tuned release's epsilon. It is written when the first
trial starts training (before any private step: an interrupted or failed search is counted) and written again, with
the same run id, when the search ends (finished, failed, interrupted); ``dpl ledger`` reads the last line of each run
id. The trials themselves write no line: the tuning's covers them all. The line holds no count of trials, no steps
and no end time, and is not written per trial: each would reveal the secret number of trials K.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from dpl.core.accounting import events
from dpl.core.accounting.tuning import TrialDistribution
from dpl.lightning import data_ledger


def trial_event(plan: dict[str, Any]) -> events.Event:
    """One trial of ``plan``: its steps of the Poisson-subsampled Gaussian (the only mechanism a trial may have)."""
    return events.SelfComposed(events.PoissonGaussian(float(plan["noise_multiplier"]), float(plan["sampling_rate"])),
                               int(plan["steps"]))


def tuning_event(plans: list[dict[str, Any]], dist: TrialDistribution) -> events.Event:
    """The event of the whole search: one trial is any of the plans' configurations (drawn without looking at the
    data), released as the best of K trials."""
    trials = [trial_event(plan) for plan in plans]
    trial = trials[0] if len(trials) == 1 else events.AnyOf(tuple(trials))
    if dist.kind == "fixed":
        return events.SelfComposed(trial, int(dist.trials))
    if dist.kind == "poisson":
        return events.RepeatAndSelect(trial, float(dist.mu), math.inf)
    return events.RepeatAndSelect(trial, float(dist.mean), float(dist.eta))


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
