"""The callback every trial of ``dpl tune`` runs with (``--trainer.callbacks+=dpl.tune.probe.TrialProbe``): before
training it refuses a setup the tuning bound does not cover (including one whose sigma, sampling rate or steps are not
those planned for it); after a validation run it records the metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

from dpl.errors import ConfigError
from dpl.tune.plans import mismatch, tunable

#: the metrics of the last ``validate`` run in this process (``dpl.tune.trials.score`` reads them)
LAST_METRICS: dict[str, float] = {}
#: the plan of the trial about to run (set by ``dpl tune`` before each trial; ``None``: no check)
EXPECTED: dict[str, Any] | None = None
#: the tuning the trial belongs to (set by ``dpl tune``): its state, whose line in the data ledger the first trial to
#: train writes (:mod:`dpl.tune.ledger_line`)
TUNING: Any = None


class TrialProbe(Callback):
    """Refuses, before training, a trial the tuning bound does not cover; writes the tuning's line in the data ledger
    before the first trial's first private step (the trials write none of their own); records a validation run's
    metrics."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or not pl_module.engine.configured:
            return
        from dpl.lightning.report import PrivacyReport

        for callback in trainer.callbacks:
            if isinstance(callback, PrivacyReport):
                callback.ledger = False
        summary = pl_module.engine.summary()
        reason = tunable(summary, pl_module.privacy.seed is not None)
        if reason:
            raise ConfigError(f"dpl tune: {reason}")
        if EXPECTED is not None:
            differ = mismatch(EXPECTED, summary)
            if differ:
                raise ConfigError(f"dpl tune: the trial's accounting is not the one planned for it ({differ}): the "
                                  f"bound does not cover it")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        state = TUNING
        if state is None or state.ledger_line is not None or not trainer.is_global_zero:
            return
        from dpl.lightning.report import build_report
        from dpl.tune import ledger_line

        line = ledger_line.start_entry(build_report(pl_module), Path(state.folder).name, state.event(),
                                       state.epsilon(float(pl_module.engine.plan.delta)))
        state.ledger_line = ledger_line.write(state.ledger_root, line)
        state.save()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.state.fn == "validate" and trainer.is_global_zero:
            LAST_METRICS.clear()
            LAST_METRICS.update({k: float(v) for k, v in trainer.callback_metrics.items()})
