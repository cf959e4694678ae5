"""One trial of ``dpl tune``: a full private ``dpl fit`` in its own folder and a ``dpl validate`` of its last
checkpoint, both through :func:`dpl.cli_training.training_command` (the command line's own code path), in this
process.

A trial logs to no tracker the config names (MLflow, W&B, ...): only to dpl's run folder inside the trial's folder,
deleted with the trial when it loses. A tracker run per trial would reveal the secret number of trials K and the
losing trials' scores; the tuning logs its one released run there instead (:func:`trackers`)."""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import math
import sys
import warnings
from pathlib import Path
from typing import Any

import yaml

from dpl.errors import ConfigError
from dpl.tune import probe
from dpl.tune.search import config_args

PROBE = "dpl.tune.probe.TrialProbe"
#: the loggers that write into dpl's run folder, not to a tracker
RUN_FOLDER_LOGGERS = ("CSVLogger", "TensorBoardLogger")
#: the default metric: the first of these the validation logs
DEFAULT_METRICS = ("val_acc", "val_bleu")


class TrialFailed(Exception):
    """A ``dpl`` command of a trial exited with ``code`` (it has printed why)."""

    def __init__(self, code: int) -> None:
        super().__init__(f"exit {code}")
        self.code = code


def run_cli(args: list[str]) -> None:
    """``dpl ARGS`` in this process; :class:`TrialFailed` if it exits non-zero."""
    from dpl.cli_training import training_command

    warnings.filterwarnings("ignore", message=r"LightningCLI's args parameter is intended")  # dpl tune's own argv
    try:
        training_command(args)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise TrialFailed(exc.code if isinstance(exc.code, int) else 1) from None
    finally:
        gc.collect()


def check_args(args: list[str]) -> str:
    """Parse ``dpl ARGS --print_config`` without running anything: the resolved config (YAML), or a one-line
    ``ConfigError`` with dpl's own message."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            run_cli([*args, "--print_config"])
    except TrialFailed:
        lines = [line for line in err.getvalue().splitlines() if line.startswith("dpl: error:")]
        raise ConfigError(lines[-1][len("dpl: error:"):].strip() if lines else
                          (err.getvalue().strip().splitlines() or ["invalid arguments"])[-1]) from None
    finally:
        _unbind(out, err)
    return out.getvalue()


def _unbind(*buffers: io.StringIO) -> None:
    """Point log handlers created while the output was captured (``dpl``'s own, on its first run in this process)
    back at the real streams."""
    for logger in [logging.getLogger(), *(logging.getLogger(n) for n in list(logging.root.manager.loggerDict))]:
        for handler in getattr(logger, "handlers", []):
            if isinstance(handler, logging.StreamHandler) and any(handler.stream is b for b in buffers):
                handler.setStream(sys.stdout if handler.stream is buffers[0] else sys.stderr)


def fit(fit_args: list[str], config: dict[str, str], folder: Path, extra: list[str]) -> Path:
    """Train one trial under ``folder``; return its run folder (``.../lightning_logs/version_N``)."""
    run_cli(["fit", *fit_args, *config_args(config), *extra, "--trainer.default_root_dir", str(folder),
             "--trainer.logger", "true", f"--trainer.callbacks+={PROBE}"])
    return run_folder(folder)


def trackers(fit_args: list[str]) -> list[Any]:
    """The loggers the trials' config names beside dpl's run folder (CSV and TensorBoard): the user's trackers, built
    from the config (nothing is logged yet)."""
    from lightning.pytorch.cli import instantiate_class

    resolved = yaml.safe_load(check_args(["fit", *fit_args])) or {}
    given = (resolved.get("trainer") or {}).get("logger")
    specs = given if isinstance(given, list) else [given]
    return [instantiate_class((), spec) for spec in specs if isinstance(spec, dict) and "class_path" in spec
            and spec["class_path"].rsplit(".", 1)[-1] not in RUN_FOLDER_LOGGERS]


def run_folder(folder: Path) -> Path:
    """The run folder a trial wrote under ``folder``: the one with privacy.json and checkpoints/last.ckpt."""
    runs = sorted(p.parent for p in folder.glob("**/privacy.json")
                  if (p.parent / "checkpoints" / "last.ckpt").is_file())
    if len(runs) != 1:
        raise ConfigError(f"{folder}: expected one run with privacy.json and checkpoints/last.ckpt, found {len(runs)} "
                          f"(a trial needs trainer.enable_checkpointing)")
    return runs[0]


def score(run: Path, metric: str | None) -> tuple[str, float]:
    """Validate ``run``'s last checkpoint on the validation split; return ``(metric, value)`` (NaN for a diverged
    model). ``metric`` ``None``: the first of :data:`DEFAULT_METRICS` logged."""
    probe.LAST_METRICS.clear()
    run_cli(["validate", "--config", str(run / "config.yaml"), "--ckpt_path", str(run / "checkpoints" / "last.ckpt")])
    metrics = dict(probe.LAST_METRICS)
    if not metrics:
        raise ConfigError("the trial's validation logged no metric: dpl tune scores trials on the validation split, "
                          "and this data has none")
    name = metric or next((m for m in DEFAULT_METRICS if m in metrics), None)
    if name is None or name not in metrics:
        raise ConfigError(f"{'--metric ' + metric if metric else 'no val_acc or val_bleu'}: the validation logs "
                          f"{', '.join(sorted(metrics))}; choose one with --metric NAME")
    value = metrics[name]
    return name, value if math.isfinite(value) else math.nan
