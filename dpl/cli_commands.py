"""The ``dpl`` command's table and texts: its description, dpl's own commands (:data:`COMMANDS`), the task classes it
ships and the end of ``dpl fit --help``. Shared by :mod:`dpl.cli` (dispatch), :mod:`dpl.cli_help`,
:mod:`dpl.cli_errors` and :mod:`dpl.cli_lightning`; imports neither torch nor Lightning."""

from __future__ import annotations

import inspect
import re
from typing import Any

DESCRIPTION = ("dpl: differentially private fine-tuning of language models. DP-SGD (Poisson sampling, per-example\n"
               "clipping, calibrated noise, PRV accounting) on Lightning; private-training methods plug in as hooks.")

#: dpl's commands besides Lightning's (fit, validate, test): name -> (one-line help, "module:function").
#: The function gets the remaining arguments (list of str) and returns an exit code (or None for 0).
COMMANDS: dict[str, tuple[str, str]] = {
    "predict": ("labels and probabilities, or completions, for new inputs from a run or an exported folder",
                "dpl.trained.predict:predict_command"),
    "export": ("a Hugging Face model folder (LoRA merged, or a PEFT adapter) with tokenizer, labels and privacy "
               "report", "dpl.trained.export:export_command"),
    "report": ("plots of a run: loss/accuracy and epsilon over steps (PNG; needs matplotlib)",
               "dpl.trained.plots:report_command"),
    "ledger": ("the privacy spent on a data set: its runs recorded in the privacy ledger and their composed epsilon",
               "dpl.trained.spending:ledger_command"),
    "verify-data": ("whether a data file is one a run trained on, checked against the keyed hashes of its "
                    "privacy report (exit 0: it matches)", "dpl.trained.verify:verify_command"),
    "plugins": ("list the installed dpl plugins: what each does, its hooks and its config fragments",
                "dpl.cli:plugins_command"),
    "audit": ("empirical privacy audit in one run: canaries, membership guesses, a lower bound on epsilon "
              "(docs/audit.md)", "dpl.audit.command:audit_command"),
    "plan": ("sigma, the noise against the clipped signal and the batch sizes at the same epsilon and compute, from "
             "a fit config, without training (docs/planning.md)", "dpl.planning.command:plan_command"),
    "tune": ("private hyperparameter tuning: the best of a secret, random number of private trainings, with the "
             "epsilon of the whole search (docs/privacy.md)", "dpl.tune.command:tune_command"),
    "synthesize": ("a synthetic copy of a run's training data, sampled from its private model, with its privacy "
                   "report (docs/synthetic.md)", "dpl.synthetic.command:synthesize_command"),
    "evaluate-synthetic": ("what synthetic data is worth: train-on-synthetic accuracy, MAUVE, distributions and "
                           "leakage against the real data (docs/synthetic.md)",
                           "dpl.synthetic.evaluation:evaluate_command"),
}

def task_classes() -> tuple[list[str], list[str]]:
    """The names of the model and data classes dpl ships: those that ``dpl.tasks.modules`` / ``dpl.tasks.data``
    export and that subclass :class:`DPModule` / :class:`DPDataModule`. Importing them here also lets
    ``--model.help NAME`` and ``class_path: NAME`` find them by their short name."""
    import dpl.tasks.data
    import dpl.tasks.modules
    from dpl.lightning.data import DPDataModule
    from dpl.lightning.module import DPModule

    def names(package: Any, base: type) -> list[str]:
        classes = [getattr(package, name) for name in package.__all__]
        return [c.__name__ for c in classes if inspect.isclass(c) and issubclass(c, base) and c is not base]

    return names(dpl.tasks.modules, DPModule), names(dpl.tasks.data, DPDataModule)


def epilog() -> str:
    """The end of ``dpl fit --help``'s parent help: dpl's other commands and an example."""
    width = max(len(name) for name in COMMANDS)
    lines = [f"  {name.ljust(width)}  {text}" for name, (text, _) in COMMANDS.items()]
    return ("other commands:\n" + "\n".join(lines) + "\n\nExample: dpl fit --config configs/quickstart.yaml  "
            "(docs: README.md, docs/configuration.md)")


#: the end of ``dpl fit/validate/test --help`` (``{models}``, ``{data}``: the task classes dpl ships)
SUBCOMMAND_EPILOG = (
    "Model and data options depend on the class chosen by the config (model.class_path, data.class_path). "
    "See them with --model.help CLASS ({models}) and --data.help CLASS ({data}), e.g. "
    "dpl fit --model.help DPClassificationModule; or print a config with every option resolved: "
    "dpl fit --config configs/quickstart.yaml --print_config")


def docstring_args(cls: type) -> dict[str, str]:
    """``name -> text`` of the ``Args:`` section of ``cls``'s docstring (continuation lines joined)."""
    found: dict[str, str] = {}
    name = None
    for line in (inspect.getdoc(cls) or "").split("Args:", 1)[-1].splitlines():
        match = re.match(r"^    (\w+): (.*)", line)
        if match:
            name, found[match.group(1)] = match.group(1), match.group(2).strip()
        elif name and line.startswith("        "):
            found[name] += " " + line.strip()
    return found
