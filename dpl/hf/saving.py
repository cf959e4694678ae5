"""A trainer's checkpoints and saved models with dpl's privacy state, its report and its ledger line.

* ``<checkpoint>/dpl_engine.pt``: the engine's public state (sigma, the plan, the steps and their accounting events,
  the public seed generator, the plugins' public state) and a random ``secret_id``;
* ``<output_dir>/_dpl_secrets/<checkpoint name>.secret`` (folder 0700, file 0600): the secret state (the noise and
  sampler generators, the plugins' secrets), outside the checkpoint folder, so that a checkpoint folder can be shared
  or pushed as it is (the trainer's hub upload also skips folders named ``_*``); written before ``dpl_engine.pt``,
  both atomically; a sidecar whose checkpoint folder was rotated away is removed;
* ``privacy.json`` / ``privacy.md`` (:mod:`dpl.lightning.report`) beside every saved model and checkpoint, and the
  run's line in ``<output_dir>/privacy_ledger.jsonl`` (:mod:`dpl.lightning.data_ledger`; the last line of a run is
  the one ``dpl ledger`` reads).

Resuming (:func:`load_engine`) follows dpl's rules: the ledger compares the plan with the checkpoint's (changed
privacy settings refused unless ``privacy.force_resume``), the budget is checked, and the noise and sampler continue
from fresh OS entropy unless ``privacy.seed`` replays them (:meth:`~dpl.core.engine.PrivateEngine.load_secret_state_dict`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import torch

from dpl.errors import ConfigError
from dpl.lightning.checkpoint import _serialize, _write_atomic, new_secret_id, public_mode

ENGINE_FILE = "dpl_engine.pt"
SECRETS_DIR = "_dpl_secrets"


def secret_file(checkpoint: str | os.PathLike) -> Path:
    """Where the secret state of ``checkpoint`` (a checkpoint folder) lives: beside it, never in it."""
    checkpoint = Path(checkpoint)
    return checkpoint.parent / SECRETS_DIR / f"{checkpoint.name}.secret"


def save_engine(engine: Any, checkpoint: str | os.PathLike) -> None:
    """Write the engine's public state into ``checkpoint`` and its secret state into :func:`secret_file`."""
    checkpoint = Path(checkpoint)
    secret_id = new_secret_id()
    sidecar = secret_file(checkpoint)
    sidecar.parent.mkdir(mode=0o700, exist_ok=True)
    os.chmod(sidecar.parent, 0o700)
    _write_atomic(_serialize({**engine.secret_state_dict(), "secret_id": secret_id}), sidecar,
                  stat.S_IRUSR | stat.S_IWUSR)
    _write_atomic(_serialize({**engine.state_dict(), "secret_id": secret_id}), checkpoint / ENGINE_FILE, public_mode())
    for stale in sidecar.parent.glob("*.secret"):  # checkpoints the trainer rotated away
        if not (checkpoint.parent / stale.name[:-len(".secret")]).is_dir():
            stale.unlink(missing_ok=True)


def load_engine(engine: Any, checkpoint: str | os.PathLike, global_step: int | None = None) -> None:
    """Resume ``engine`` (set up, not started) from ``checkpoint``: its public state, then its secret state if the
    sidecar is there and belongs to it (one-line ConfigError for a missing engine state, a sidecar of another
    checkpoint or readable by others)."""
    checkpoint = Path(checkpoint)
    path = checkpoint / ENGINE_FILE
    if not path.is_file():
        raise ConfigError(f"{checkpoint} holds no dpl privacy state ({ENGINE_FILE}): it was not written by a dpl "
                          "trainer, so its privacy spent is unknown")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # truncated or corrupt
        raise ConfigError(f"{path} is corrupt or truncated ({type(exc).__name__})") from None
    if global_step is not None and int(state.get("steps_done", global_step)) != int(global_step):
        raise ConfigError(f"{path} records {state.get('steps_done')} private steps, the trainer state {global_step}: "
                          "the checkpoint folder was assembled from different saves")
    engine.resumed_from = str(checkpoint)
    engine.load_state_dict(state)
    engine.load_secret_state_dict(_read_secret(checkpoint, state.get("secret_id")))


def _read_secret(checkpoint: Path, secret_id: str | None) -> dict[str, Any] | None:
    sidecar = secret_file(checkpoint)
    if not sidecar.is_file():
        return None
    mode = sidecar.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{sidecar} is readable by others (mode {oct(mode & 0o777)}): it holds the run's noise "
                          "secrets; chmod 600 it")
    try:
        secret = torch.load(sidecar, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ConfigError(f"secret sidecar {sidecar} is corrupt or truncated ({type(exc).__name__})") from None
    if secret_id is None or not isinstance(secret, dict) or secret.get("secret_id") != secret_id:
        raise ConfigError(f"secret sidecar {sidecar} does not belong to checkpoint {checkpoint}")
    return secret


class ReportView:
    """What :func:`dpl.lightning.report.build_report` reads of a run, for a trainer's engine."""

    def __init__(self, engine: Any, task: str) -> None:
        self.engine = engine
        self.task = "generation" if task == "causal_lm" else task

    def privacy_summary(self, deltas: tuple[float, ...] = ()) -> dict[str, Any]:
        return self.engine.summary(deltas)


class RunRecord:
    """The run's privacy report and ledger line, rewritten at every save (same run id: the ledger keeps the last)."""

    def __init__(self, engine: Any, task: str, sources: dict[str, Any], root: str | os.PathLike) -> None:
        from dpl.lightning.provenance import new_run

        self.view = ReportView(engine, task)
        self.engine = engine
        self.sources = sources
        self.root = Path(root)
        self.run = new_run()
        self.start_steps = 0

    def started(self) -> None:
        """Training starts (after a resume: at the checkpoint's step, continuing the run whose report it holds)."""
        import json

        from dpl.lightning.report import REPORT_JSON

        self.start_steps = self.engine.steps_done
        if self.engine.resumed_from:
            try:
                earlier = json.loads((Path(self.engine.resumed_from) / REPORT_JSON).read_text())
            except (OSError, ValueError):
                earlier = {}
            run_id = (earlier.get("run") or {}).get("id")
            if run_id:
                self.run["continues"] = {"run_id": run_id, "steps": self.start_steps}

    def write(self, folder: str | os.PathLike, status: str | None = None) -> dict[str, Any]:
        """Write ``privacy.json`` / ``privacy.md`` into ``folder`` and the run's ledger line (once a step was taken)."""
        from dpl.lightning import data_ledger
        from dpl.lightning.provenance import utc_now
        from dpl.lightning.report import build_report, write_report

        if status is not None:
            self.run.update(status=status, ended=utc_now())
        report = build_report(self.view, self.run, self.sources)
        Path(folder).mkdir(parents=True, exist_ok=True)
        write_report(report, folder)
        steps = self.engine.steps_done - self.start_steps
        if steps >= 1:
            data_ledger.record(report, self.root, run_folder=str(self.root), steps_this_run=steps)
        return report
