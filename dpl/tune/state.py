"""The secret sidecar of a tuning folder, ``tuning.secret`` (mode 0600, JSON): what makes a tuning resumable without
drawing K again.

It holds the number of trials K and every drawn configuration (whoever knows K learns what the guarantee hides), the
finished trials with their scores and reports, the trial running now, the current best, and the plans the bound is
computed from. It is written atomically
after every change, never exported and never shared; ``dpl tune --resume FOLDER`` reads it back.
"""

from __future__ import annotations

import json
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dpl.errors import ConfigError
from dpl.lightning.checkpoint import _write_atomic

STATE_FILE = "tuning.secret"
VERSION = 1


@dataclass
class TuningState:
    """A tuning in progress. ``fit_args``: the ``dpl fit`` arguments every trial shares; ``search``: option ->
    values; ``distribution``: the :class:`~dpl.core.accounting.tuning.TrialDistribution` fields; ``trials``: K;
    ``configurations``: the K drawn configurations; ``finished``: ``{"index", "folder", "score", "report"}`` per
    finished trial (``report``: its privacy.json); ``running``: ``{"index", "folder"}`` of the trial under way;
    ``best``: the index of the best finished trial; ``released``: whether the tuned model's report is written;
    ``plans``: the plan of every accounting-distinct configuration (:mod:`dpl.tune.plans`), made before any trial;
    ``total_epsilon``: ``--total-epsilon``, and ``target_epsilon`` the per-trial target solved for it; ``ledger_root``
    and ``ledger_line``: the tuning's line in the data ledger (:mod:`dpl.tune.ledger_line`)."""

    folder: str
    fit_args: list[str]
    search: dict[str, list[str]]
    method: str
    distribution: dict[str, Any]
    metric: str | None
    mode: str
    trials: int
    configurations: list[dict[str, str]]
    finished: list[dict[str, Any]] = field(default_factory=list)
    running: dict[str, Any] | None = None
    best: int | None = None
    released: bool = False
    plans: list[dict[str, Any]] = field(default_factory=list)
    total_epsilon: float | None = None
    target_epsilon: float | None = None
    ledger_root: str | None = None  # where the tuning's line goes (the dpl tune call's trainer.default_root_dir)
    ledger_line: dict[str, Any] | None = None  # the last line written (None: no trial has started training)
    version: int = VERSION

    @property
    def path(self) -> Path:
        return Path(self.folder) / STATE_FILE

    def save(self) -> None:
        """Write the sidecar atomically, owner-only from creation."""
        _write_atomic((json.dumps(asdict(self), indent=1) + "\n").encode(), self.path, stat.S_IRUSR | stat.S_IWUSR)

    def event(self) -> Any:
        """The event of the whole search (:func:`dpl.tune.plans.tuning_event`)."""
        from dpl.core.accounting.tuning import TrialDistribution
        from dpl.tune.plans import tuning_event

        return tuning_event(self.plans, TrialDistribution(**self.distribution))

    def epsilon(self, delta: float) -> float:
        """The tuned release's epsilon at ``delta`` (as its report states it)."""
        from dpl.core.accounting.tuning import TrialDistribution
        from dpl.tune.plans import tuned_epsilon

        return tuned_epsilon(self.plans, TrialDistribution(**self.distribution), delta)

    def result(self, index: int) -> dict[str, Any] | None:
        return next((t for t in self.finished if t["index"] == index), None)

    @classmethod
    def load(cls, folder: str | Path) -> TuningState:
        """The state of the tuning folder ``folder`` (one-line ``ConfigError`` if missing, shared or unreadable)."""
        path = Path(folder) / STATE_FILE
        if not path.is_file():
            raise ConfigError(f"{folder} is not a tuning folder (no {STATE_FILE}; dpl tune prints its folder)")
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(f"{path} is readable by others (mode {oct(mode & 0o777)}): it holds the secret number "
                              f"of trials; chmod 600 it")
        try:
            data = json.loads(path.read_text())
            if data.get("version") != VERSION:
                raise ValueError(f"version {data.get('version')}")
            data["folder"] = str(Path(folder))
            return cls(**data)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{path} is not a readable tuning state ({exc})") from None
