"""Experiment trackers (MLflow, Weights & Biases, or any Lightning logger): the run's privacy in every logger.

ε (``epsilon``, at the steps taken) and the validation metrics (``val_*``) reach every configured logger as metrics
(:class:`~dpl.lightning.module.DPModule` and the task modules log them). :class:`TrackerLogging` adds, when training
starts, the run's fixed privacy values as hyperparameters (``privacy/delta``, ``privacy/sigma``, ``privacy/unit``,
...: public values of the plan, nothing secret), and, once the fit has ended and the final ``privacy.json`` /
``privacy.md`` are written, attaches those two files as artifacts to the loggers that store files (MLflow:
``log_artifact`` under ``privacy/``; Weights & Biases: ``save``). :func:`with_run_folder` keeps dpl's run folder
(``metrics.csv``, checkpoints, the report) when a config names its own loggers. :func:`log_release` logs a run
that no fit logged (``dpl tune``'s tuned model: its trials log to no tracker) as one run of its own.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

log = logging.getLogger("dpl")

#: the summary keys logged as hyperparameters (``privacy/<name>``; ``noise_multiplier`` as ``privacy/sigma``)
PRIVACY_PARAMS = ("unit", "adjacency", "delta", "noise_multiplier", "max_grad_norm", "batch_size", "sampling_rate",
                  "sampling", "steps_planned", "target_epsilon", "accountant", "mechanism", "num_examples",
                  "num_units")


def privacy_params(summary: dict[str, Any]) -> dict[str, Any]:
    """The hyperparameters of a run's privacy from :meth:`~dpl.core.engine.PrivateEngine.summary`: plain public
    values (no seed, no generator state, nothing per example)."""
    names = {"noise_multiplier": "sigma"}
    return {f"privacy/{names.get(key, key)}": summary[key] for key in PRIVACY_PARAMS if summary.get(key) is not None}


def attach_files(logger: Any, paths: list[Path]) -> bool:
    """Attach ``paths`` to ``logger``'s run where it stores files (MLflow, Weights & Biases); ``False`` for a logger
    that does not."""
    from lightning.pytorch.loggers import MLFlowLogger, WandbLogger

    if isinstance(logger, MLFlowLogger):
        for path in paths:
            logger.experiment.log_artifact(logger.run_id, str(path), artifact_path="privacy")
        return True
    if isinstance(logger, WandbLogger):
        for path in paths:
            logger.experiment.save(str(path), base_path=str(path.parent), policy="now")
        return True
    return False


class TrackerLogging(Callback):
    """The run's privacy values as hyperparameters of every logger at the start of training, and the final privacy
    report attached to the loggers that store files once the fit has ended (rank 0 only)."""

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        engine = getattr(pl_module, "engine", None)
        if engine is None or not engine.configured or not trainer.is_global_zero:
            return
        params = privacy_params(engine.summary())
        for logger in trainer.loggers:
            logger.log_hyperparams(params)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        from dpl.lightning.report import REPORT_JSON, REPORT_MD

        folder = trainer.log_dir
        engine = getattr(pl_module, "engine", None)
        if not trainer.is_global_zero or not folder or engine is None or not engine.configured:
            return
        paths = [Path(folder) / name for name in (REPORT_JSON, REPORT_MD) if (Path(folder) / name).is_file()]
        for logger in trainer.loggers if paths else []:
            if attach_files(logger, paths):
                log.info("dpl: privacy report attached to %s", type(logger).__name__)


def log_release(loggers: list[Any], report: dict[str, Any], folder: Path) -> None:
    """Log one released run to each of ``loggers`` and end it: the privacy hyperparameters of ``report`` (a
    ``privacy.json``), its ``epsilon`` (under ``dpl tune``: the whole search's) and, for a tuned model, the tuning's
    public description and the released model's score (as its report states them), and ``folder``'s privacy.json /
    privacy.md as files. Nothing of the trials that were not released."""
    from dpl.lightning.report import REPORT_JSON, REPORT_MD

    params, metrics = privacy_params(report), {"epsilon": float(report["epsilon"])}
    tuning = report.get("tuning")
    if tuning:
        params.update({"tuning/method": tuning["method"], "tuning/theorem": tuning["theorem"],
                       "tuning/distribution": tuning["distribution"]["distribution"], "tuning/metric": tuning["metric"],
                       "tuning/epsilon_one_trial": tuning["epsilon_one_trial"]})
        metrics[tuning["metric"]] = float(tuning["score"])
    paths = [folder / name for name in (REPORT_JSON, REPORT_MD) if (folder / name).is_file()]
    for logger in loggers:
        logger.log_hyperparams(params)
        logger.log_metrics(metrics, step=int(report.get("steps_taken") or 0))
        attach_files(logger, paths)
        logger.finalize("success")


def with_run_folder(loggers: Any, root: str | None) -> Any:
    """``loggers`` (a config's ``trainer.logger``) with a CSV or TensorBoard logger first (the config's own, moved to
    the front, or dpl's CSV logger under ``root``): Lightning's run folder is the first logger's, so the run folder
    (``<root>/lightning_logs/version_N``: ``metrics.csv``, checkpoints, the privacy report) stays where dpl's commands
    look for it when a config adds a tracker."""
    import os

    from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger

    given = list(loggers) if isinstance(loggers, (list, tuple)) else [loggers]
    if not given or not all(isinstance(x, Logger) for x in given):
        return loggers
    folder = next((x for x in given if isinstance(x, (CSVLogger, TensorBoardLogger))), None)
    if folder is None:
        return [CSVLogger(save_dir=root or os.getcwd()), *given]
    if given[0] is folder:
        return loggers
    return [folder, *(x for x in given if x is not folder)]


def allow_file_store(loggers: Any) -> None:
    """MLflow 3 opens a local file store (a ``file:`` tracking URI, as ``configs/trackers/mlflow.yaml`` names) only
    with ``MLFLOW_ALLOW_FILE_STORE=true``: a config whose ``trainer.logger`` (as parsed, before the loggers are made)
    names one asks for it, so it is set here (one log line) unless the variable is set already; set to anything else,
    the run is refused in one line."""
    import os

    from dpl.errors import ConfigError

    given = list(loggers) if isinstance(loggers, (list, tuple)) else [loggers]
    for logger in given:
        if not str(_field(logger, "class_path") or "").endswith("MLFlowLogger"):
            continue
        init = _field(logger, "init_args")
        uri = str(_field(init, "tracking_uri") or "")
        if not (uri.startswith("file:") or (not uri and _field(init, "save_dir"))):
            continue
        value = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
        if value is None:
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
            log.info("dpl: MLflow logs to a local file store (%s): MLFLOW_ALLOW_FILE_STORE=true for this run",
                     uri or _field(init, "save_dir"))
        elif value.strip().lower() not in ("true", "1"):
            raise ConfigError(f"the MLflow logger writes to a local file store, which MLflow 3 opens only with "
                              f"MLFLOW_ALLOW_FILE_STORE=true (it is {value!r}); set it, or give "
                              "trainer.logger.init_args.tracking_uri a server or sqlite: URI")


def _field(value: Any, name: str) -> Any:
    """``value.name`` or ``value[name]`` of a parsed config node (``None`` if absent)."""
    if value is None:
        return None
    getter = getattr(value, "get", None)
    return getter(name) if callable(getter) else getattr(value, name, None)
