"""The ``dpl`` command's Lightning part: :class:`DPLightningCLI` (``dpl fit``, ``validate``, ``test``) and its parser;
a failed run's folder is removed (:mod:`dpl.cli_runs`), Lightning's setup lines are held until the run starts
(:data:`dpl.messages.BANNERS`). :mod:`dpl.cli_training` imports it only for those commands, so that ``dpl --help``
and dpl's own light commands start without torch and Lightning."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import textwrap
import typing
import warnings
import zipfile
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ModelSummary
from lightning.pytorch.callbacks.progress import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback

from dpl import cli_commands as commands
from dpl.cli_errors import summarize_parse_error
from dpl.cli_runs import missing_folders, remove_partial_run, run_folder
from dpl.errors import ConfigError
from dpl.folders import check_writable
from dpl.lightning import checkpoint as ckpt_io
from dpl.lightning.data import DPDataModule
from dpl.lightning.module import DPModule
from dpl.lightning.report import PrivacyReport
from dpl.messages import BANNERS


def _parser_kwargs(argv: list[str]) -> dict[str, Any]:
    import argparse

    from jsonargparse import DefaultHelpFormatter

    from dpl.cli_help import COMMAND_DESCRIPTIONS

    class Formatter(DefaultHelpFormatter, argparse.RawDescriptionHelpFormatter):
        pass

    models, data = commands.task_classes()
    epilog = textwrap.fill(commands.SUBCOMMAND_EPILOG.format(models=", ".join(models), data=", ".join(data)), 79)
    kwargs: dict[str, Any] = {"prog": "dpl", "description": commands.DESCRIPTION, "epilog": commands.epilog(),
                              "formatter_class": Formatter, "argv": argv}
    for command in ("fit", "validate", "test"):
        kwargs[command] = {"epilog": epilog, "description": COMMAND_DESCRIPTIONS[command], "dpl_command": command,
                           "argv": argv}
    return kwargs


#: the data options that name files or folders (looked up beside the config files when not in the working folder)
DATA_PATH_KEYS = ("data_dir", "train_file", "val_file", "test_file")


def config_files(argv: list[str]) -> list[str]:
    """The config files given on the command line (``--config FILE``, ``-c FILE``, ``--config=FILE``), in order."""
    found = []
    for i, arg in enumerate(argv):
        if arg in ("--config", "-c") and i + 1 < len(argv):
            found.append(argv[i + 1])
        elif arg.startswith("--config="):
            found.append(arg.split("=", 1)[1])
    return [f for f in found if Path(f).is_file()]


#: Lightning's DDP strategy class, which the ``dpl`` command runs as dpl's ``DPDDPStrategy`` (same options)
LIGHTNING_DDP_CLASSES = ("lightning.pytorch.strategies.DDPStrategy", "lightning.pytorch.strategies.ddp.DDPStrategy")

#: the title of the Trainer's options in ``dpl fit --help``, which lists them after dpl's own
TRAINER_OPTIONS = "Lightning Trainer options (--trainer.KEY VALUE)"

#: the titles of the other groups of options in ``dpl fit --help``, by an option they hold
GROUP_TITLES = {"model": "model: the task class (--model CLASS; its options: --model.help CLASS)",
                "data": "data: the data class (--data CLASS; its options: --data.help CLASS)",
                "ckpt_path": "checkpoint: resume (fit) or evaluate (validate, test) a run's checkpoint"}

#: what ``dpl fit --help`` says about ``--trainer.plugins`` before Lightning's own text
TRAINER_PLUGINS_NOTE = ("Lightning's Trainer plugins (precision, cluster environment, checkpoint IO), not dpl's: "
                        "dpl's private-training plugins go under --model.plugins (dpl plugins lists them).")


class DPLArgumentParser(LightningArgumentParser):
    """Lightning's parser, whose errors are one ``dpl: error:`` line (a mistyped option names the closest valid
    one) instead of the usage text and the nested union errors. ``DPL_DEBUG=1`` shows the original. The parser of
    a command (``dpl_command``) leads its help with dpl's own options and lists the Trainer's last; ``argv`` is the
    command line it parses (an unknown option is named as it was typed there)."""

    def __init__(self, *args: Any, dpl_command: str | None = None, argv: list[str] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dpl_command = dpl_command
        self.argv = list(argv or [])

    def error(self, message: str, ex: Exception | None = None) -> typing.NoReturn:
        if not self.exit_on_error or os.environ.get("DPL_DEBUG"):
            super().error(message, ex)
        print(f"dpl: error: {summarize_parse_error(message, self.argv, self)}", file=sys.stderr)
        self.exit(2)

    def format_help(self) -> str:
        if self.dpl_command is None:
            return super().format_help()
        import argparse

        from dpl.cli_help import fit_preface
        from dpl.core.plugin_manager import describe_plugins

        trainer = [g for g in self._action_groups
                   if any(a.dest == "trainer" or a.dest.startswith("trainer.") for a in g._group_actions)]
        for group in self._action_groups:
            dests = {a.dest for a in group._group_actions}
            for dest, title in GROUP_TITLES.items():
                if dest in dests:
                    group.title = title
        for group in trainer:
            group.title = TRAINER_OPTIONS
        self._action_groups = [g for g in self._action_groups if g not in trainer] + trainer
        usage, description = self.usage, self.description
        self.usage, self.description = argparse.SUPPRESS, None  # the preface has a short usage and says what it does
        try:
            text = super().format_help()
        finally:
            self.usage, self.description = usage, description
        models, data = commands.task_classes()
        return fit_preface(self.dpl_command, describe_plugins(), models, data) + text


class RunConfig(SaveConfigCallback):
    """Saves the run's ``config.yaml`` with ``export: null``: ``--export`` is what to do once this run ends, not part
    of the run (rerunning from the file must not export over that folder)."""

    def __init__(self, parser: LightningArgumentParser, config: Any, *args: Any, **kwargs: Any) -> None:
        if "export" in config:
            config = config.clone()
            config.export = None
        super().__init__(parser, config, *args, **kwargs)


class ShowBanners(Callback):
    """Shows the held Lightning lines when the run starts (fit, validate or test)."""

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        BANNERS.release()

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        BANNERS.release()

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        BANNERS.release()


def run(args: list[str] | None) -> None:
    """Parse ``args`` and run the command (``fit``, ``validate``, ``test``) with :class:`DPLightningCLI`; Lightning's
    setup lines are held until the run starts (``DPL_DEBUG=1`` shows them at once)."""
    if not os.environ.get("DPL_DEBUG"):
        BANNERS.hold()
    try:
        DPLightningCLI(DPModule, DPDataModule, subclass_mode_model=True, subclass_mode_data=True,
                       save_config_callback=RunConfig, save_config_kwargs={"overwrite": True}, args=args,
                       auto_configure_optimizers=False)
    except BaseException:
        BANNERS.drop()
        raise
    BANNERS.release()


def _last_checkpoint_kind(callback: ModelCheckpoint, trainer: Any) -> bool | str:
    """``save_last`` of a checkpoint callback the config left unset: ``"link"`` (``last.ckpt`` a symbolic link to the
    newest checkpoint, one file on disk) where no monitor picks the checkpoints it keeps, so the newest saved is the
    last, and the folder is local; else ``True`` (``last.ckpt`` a file of its own)."""
    folder = str(callback.dirpath or trainer.default_root_dir)
    return "link" if callback.monitor is None and callback.save_top_k != 0 and "://" not in folder else True


class DPLightningCLI(LightningCLI):
    """LightningCLI that validates the privacy setup before the trainer writes anything, saves ``last.ckpt``,
    shows plain progress lines and a one-line model summary when stdout is not a terminal, and removes a run
    directory it created when the run fails before any checkpoint was written."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        argv = kwargs.get("args")
        import dpl.lightning.fsdp  # noqa: F401  (registers --trainer.strategy dpl_fsdp)
        from dpl.lightning.ddp import use_for_lightning_names

        use_for_lightning_names()  # --trainer.strategy ddp (and auto on several devices): dpl's DPDDPStrategy
        self._argv = list(argv) if isinstance(argv, list) else sys.argv[1:]
        kwargs.setdefault("parser_class", DPLArgumentParser)
        kwargs.setdefault("parser_kwargs", _parser_kwargs(list(argv) if isinstance(argv, list) else sys.argv[1:]))
        super().__init__(*args, **kwargs)

    def before_instantiate_classes(self) -> None:
        """dpl's strategies for Lightning's DDP (a ``DDPStrategy`` class path too), and no ``DistributedSampler``:
        dpl's mechanism draws and shards the training batches, and its data modules shard the evaluation sets."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        self._data_paths_beside_configs(config)
        trainer = config.get("trainer")
        if trainer is None:
            return
        if trainer.get("logger") not in (None, True, False):
            from dpl.lightning.trackers import allow_file_store

            allow_file_store(trainer.get("logger"))  # MLflow 3's switch for the local file store a config names
        accumulate = trainer.get("accumulate_grad_batches")
        if accumulate not in (None, 1):
            raise ConfigError(f"trainer.accumulate_grad_batches ({accumulate}) is not used by dpl: a private step "
                              f"already accumulates its whole logical batch (privacy.batch_size) in micro-batches of "
                              f"privacy.physical_batch_size; lower that to use less memory")
        trainer.use_distributed_sampler = False
        strategy = trainer.get("strategy")
        if getattr(strategy, "class_path", None) in LIGHTNING_DDP_CLASSES:
            strategy.class_path = "dpl.lightning.ddp.DPDDPStrategy"

    def _data_paths_beside_configs(self, config: Any) -> None:
        """A relative data path (``data.data_dir``, ``train_file``, ``val_file``, ``test_file``) that does not exist
        in the working folder is looked up beside the config files, the last given first; with a ``data_dir``, the
        files are the data module's to find in it (a config's example files never stand in for one's own)."""
        init = (config.get("data") or {}).get("init_args") if hasattr(config.get("data") or {}, "get") else None
        if init is None:
            return
        folders = [Path(c).parent for c in reversed(config_files(self._argv))]
        for key in DATA_PATH_KEYS:
            value = init.get(key) if hasattr(init, "get") else None
            if key != "data_dir" and init.get("data_dir"):  # a file of one's own folder: the data module looks there
                continue
            if not isinstance(value, str) or "://" in value or Path(value).is_absolute() or Path(value).exists():
                continue
            beside = next((folder / value for folder in folders if (folder / value).exists()), None)
            if beside is not None:
                init[key] = str(beside)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """Lightning's fit, validate and test (``dpl predict`` is dpl's own command)."""
        return {k: v for k, v in LightningCLI.subcommands().items() if k != "predict"}

    def trainer_config(self, **kwargs: Any) -> dict[str, Any]:
        """The Trainer's arguments as configured for this command, updated with ``kwargs``."""
        section = self.config_init[self.subcommand] if self.subcommand else self.config_init
        return {**section.get("trainer", {}), **kwargs}

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        """Lightning's Trainer with dpl's defaults where the config leaves them open: dpl's progress bar and model
        summary, the CSV (and TensorBoard) loggers, the privacy report, checkpoints that keep ``last.ckpt``;
        ``validate`` and ``test`` evaluate a run without a new run folder or checkpoint."""
        config = self.trainer_config(**kwargs)
        given = config.get("callbacks") or []
        given = given if isinstance(given, list) else [given]
        callbacks: list[Any] = []
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in given):
            from dpl.lightning.progress import default_progress_bar

            callbacks.append(default_progress_bar())
        if config.get("enable_model_summary") is not False and not any(isinstance(c, ModelSummary) for c in given):
            from dpl.lightning.progress import default_model_summary

            summary = default_model_summary()  # off a terminal: one plain line, not the box-drawn table
            if summary is not None:  # Lightning then adds no table of its own (and says nothing about it)
                callbacks.append(summary)
                config["enable_model_summary"] = False
        if self.subcommand in ("validate", "test"):  # evaluate a run: no new run folder, no checkpoint callback
            self.save_config_callback = None
            config["enable_checkpointing"] = False
            warnings.filterwarnings("ignore", message=r".*callbacks used to create the checkpoint need to be")
            if config.get("logger") in (None, True):
                config["logger"] = False
        elif config.get("logger") in (None, True):
            config["logger"] = default_loggers(config.get("default_root_dir"))
        elif config.get("logger") is not False:  # a tracker: the run folder stays (metrics.csv, checkpoints, report)
            from dpl.lightning.trackers import with_run_folder

            config["logger"] = with_run_folder(config["logger"], config.get("default_root_dir"))
        if not any(isinstance(c, PrivacyReport) for c in given):
            callbacks.append(PrivacyReport())  # privacy.json / privacy.md in the run folder
        config["callbacks"] = [*given, ShowBanners(), *callbacks]
        trainer = super().instantiate_trainer(**native_precision(config))
        for callback in trainer.checkpoint_callbacks:  # `dpl ... --ckpt_path .../checkpoints/last.ckpt` resumes
            if isinstance(callback, ModelCheckpoint) and callback.save_last is None:
                callback.save_last = _last_checkpoint_kind(callback, trainer)
        return trainer

    def before_fit(self) -> None:
        # Load and check the data, build the model, check plugins and calibrate sigma before fit starts, so a
        # bad input fails with one line and leaves no half-written run behind.
        self._check_ckpt_path()
        self.datamodule.prepare_data()
        self.datamodule.setup("fit")
        self.model.ensure_model(self.datamodule)
        self.model.prepare_privacy(self.datamodule.num_train_examples, self.trainer)
        self._check_val_check_interval()
        self.model.print_fit_summary = False  # printed by after_fit, below the finished progress bar

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--export", type=typing.Optional[str], default=None,
                            help="fit: after training, export the last checkpoint to this folder (as dpl export)")
        for action in parser._actions:
            if action.dest == "trainer.plugins":  # not to be confused with dpl's model.plugins
                action.help = f"{TRAINER_PLUGINS_NOTE} {action.help or ''}".strip()

    def after_fit(self) -> None:
        folder = self.config[self.subcommand].get("export")
        if folder and self.trainer.is_global_zero:
            self._export(folder)
        summary = self.model.fit_summary
        if summary and self.trainer.is_global_zero:
            print(summary + self._where(), flush=True)

    def _where(self) -> str:
        """``; run folder DIR, checkpoint FILE``: where the run and its last checkpoint are (relative to the working
        folder when inside it)."""
        folder = run_folder(self.trainer)
        last = getattr(self.trainer.checkpoint_callback, "last_model_path", "") or ""
        parts = [f"run folder {shown_path(folder)}"] if folder is not None and folder.is_dir() else []
        parts.append(f"checkpoint {shown_path(Path(last))}" if last and Path(last).is_file() else
                     "no checkpoint (trainer.enable_checkpointing false)")
        return "; " + ", ".join(parts)

    def _export(self, folder: str) -> None:
        from dpl.trained.export import export_run
        from dpl.trained.runs import load_run

        last = getattr(self.trainer.checkpoint_callback, "last_model_path", "") or ""
        if not last or not Path(last).is_file():
            raise ConfigError("--export needs a checkpoint, and this run wrote none (trainer.enable_checkpointing)")
        print(f"dpl: exported to {export_run(load_run(last), folder)}", flush=True)

    def before_validate(self) -> None:
        self._check_ckpt_path()
        self._say_where_weights_come_from()

    def before_test(self) -> None:
        self._check_ckpt_path()
        self._say_where_weights_come_from()

    def _say_where_weights_come_from(self) -> None:
        if hasattr(self.model, "head_origin"):  # a new classification head: from the checkpoint, or untrained
            given = self.config_init[self.subcommand].get("ckpt_path") is not None
            self.model.head_origin = ("weights from the checkpoint" if given else
                                      "initialised randomly and not trained (no --ckpt_path given)")

    def _parse_ckpt_path(self) -> None:
        # Lightning reads the checkpoint here (before any hook), for hyperparameters: check it first, and make a
        # checkpoint torch cannot read a one-line error.
        if not self.config.get("subcommand"):
            return
        value = self.config[self.config.subcommand].get("ckpt_path")
        self._check_ckpt_path(value)
        try:
            super()._parse_ckpt_path()
        except (RuntimeError, EOFError, OSError, ValueError, KeyError, AttributeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"checkpoint {str(value)!r} is not a readable checkpoint ({first})") from exc

    def _check_ckpt_path(self, value: Any = ...) -> None:
        if value is ...:
            value = self.config_init[self.subcommand].get("ckpt_path")
        if value is None or value in ("last", "best", "hpc", "registry") or "://" in str(value):
            return
        path = Path(value)
        if not path.exists():
            raise ConfigError(ckpt_io.broken_link(path) or f"checkpoint {str(value)!r} not found (a run saves "
                              f"checkpoints/last.ckpt in its log folder)")
        if not path.is_file():
            raise ConfigError(f"checkpoint {str(value)!r} is not a file")
        with open(path, "rb") as f:
            head = f.read(2)
        if not (zipfile.is_zipfile(path) or head[:1] == b"\x80"):  # torch.save: a zip archive (or legacy pickle)
            raise ConfigError(f"checkpoint {str(value)!r} is not a readable checkpoint (empty, truncated or not "
                              f"written by dpl)")

    def _check_val_check_interval(self) -> None:
        trainer, model = self.trainer, self.model
        interval = getattr(trainer, "val_check_interval", None)
        plan = model.engine.plan
        steps = plan.steps_per_epoch if plan is not None else 0
        if (isinstance(interval, int) and not isinstance(interval, bool) and steps
                and trainer.check_val_every_n_epoch is not None and interval > steps):
            raise ConfigError(f"trainer.val_check_interval ({interval}) is more than one epoch ({steps} steps: "
                              f"N={plan.population} // B={model.privacy.batch_size}); set "
                              f"trainer.check_val_every_n_epoch null to validate every {interval} steps across "
                              f"epochs, or lower val_check_interval")

    def _run_subcommand(self, subcommand: str) -> None:
        folder = run_folder(self.trainer)
        if subcommand == "fit" and folder is not None:
            check_writable(folder, "the run folder (trainer.default_root_dir)")
        export = self.config[subcommand].get("export") if subcommand == "fit" else None
        if export:
            check_writable(export, "--export")
        created = missing_folders(folder)
        try:
            super()._run_subcommand(subcommand)
        except (Exception, SystemExit, KeyboardInterrupt):  # SystemExit: Lightning's stop on SIGTERM or Ctrl+C
            remove_partial_run(created)
            raise


def shown_path(path: Path) -> str:
    """``path`` relative to the working folder when it lies inside it, else absolute."""
    path = Path(path).absolute()
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def tensorboard_installed() -> bool:
    """Whether the ``tensorboard`` package is installed (what Lightning's TensorBoardLogger writes with)."""
    return importlib.util.find_spec("tensorboard") is not None


def default_loggers(root: str | None) -> list[Any]:
    """``metrics.csv`` always (CSVLogger), and TensorBoard event files in the same run folder where tensorboard is
    installed (``pip install tensorboard``; then ``tensorboard --logdir <default_root_dir>``)."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    csv = CSVLogger(save_dir=root or os.getcwd())
    if not tensorboard_installed():
        return [csv]
    return [csv, TensorBoardLogger(save_dir=csv.save_dir, name=csv.name, version=csv.version,
                                   default_hp_metric=False)]


def native_precision(config: dict[str, Any]) -> dict[str, Any]:
    """The Trainer's settings, with ``bf16-mixed`` replaced by ``32-true`` on a CPU without native bfloat16
    arithmetic: emulated there, it is several times slower than float32 (and no more private), so a config written
    for CPUs with AVX512-BF16 or AMX (the quickstart's) does not crawl on others. One line says so;
    ``DPL_KEEP_PRECISION=1`` keeps the configured precision."""
    precision, accelerator = str(config.get("precision")), str(config.get("accelerator") or "auto")
    if not precision.startswith("bf16") or os.environ.get("DPL_KEEP_PRECISION") or accelerator not in ("cpu", "auto"):
        return config
    import torch

    from dpl.lightning.precision import cpu_has_native_bf16

    if accelerator == "auto" and (torch.cuda.is_available() or torch.backends.mps.is_available()):
        return config
    if cpu_has_native_bf16():
        return config
    logging.getLogger("dpl").info("dpl: this CPU has no native bfloat16 arithmetic: training in float32 "
                                  "(trainer.precision 32-true; %s would be emulated, several times slower; "
                                  "DPL_KEEP_PRECISION=1 keeps it)", precision)
    return {**config, "precision": "32-true"}
