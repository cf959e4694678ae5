"""Help texts of the ``dpl`` command: ``dpl --help``, ``dpl plugins`` and the dpl options that lead
``dpl fit --help`` (privacy, fine-tuning, plugins, model and data) before the Trainer's.

Nothing here imports torch or Lightning: ``dpl --help`` and ``dpl plugins`` answer at once. Texts come from the
docstrings of the settings they describe, so they cannot drift from them.
"""

from __future__ import annotations

import dataclasses
import shutil
import textwrap
import typing
from typing import Any

from dpl.core.plugin_manager import DEFAULT_PLUGINS, PluginInfo, first_sentence

#: Lightning's commands as ``dpl --help`` describes them
LIGHTNING_COMMANDS: dict[str, str] = {
    "fit": "train under differential privacy from a config: dpl fit --config CONFIG.yaml [--KEY VALUE ...] "
           "(its options: dpl fit --help)",
    "validate": "evaluate a run's checkpoint on the validation split (--ckpt_path; writes no run folder)",
    "test": "evaluate a run's checkpoint on the test split (--ckpt_path); keep it for the end of a study",
}

#: what ``dpl fit --help`` (``validate``, ``test``) says the command does
COMMAND_DESCRIPTIONS: dict[str, str] = {
    "fit": "Train a model under differential privacy. The model, data and privacy settings come from config files "
           "(--config, repeatable: later files and --KEY VALUE options override earlier ones); the run folder "
           "(config.yaml, metrics.csv, privacy.json, checkpoints/) is <trainer.default_root_dir>/lightning_logs/"
           "version_N.",
    "validate": "Evaluate a run's checkpoint (--ckpt_path) on the validation split of the config's data.",
    "test": "Evaluate a run's checkpoint (--ckpt_path) on the test split of the config's data.",
}

#: the data options most data classes share (each class's own: dpl fit --data.help CLASS)
DATA_ESSENTIALS = (
    ("data_dir", "DIR", "the folder of the data files, found by name (train, validation, test)"),
    ("tokenizer", "PATH", "the tokenizer: a local folder, hub id or pkg://<package>/<path> (usually the model's)"),
    ("max_length", "N", "longest tokenized input; longer ones are truncated"),
    ("eval_batch_size", "N", "batch size of the validation and test loaders"),
)


def width() -> int:
    """Text width: the terminal's (as argparse), between 60 and 120 columns."""
    return max(60, min(120, shutil.get_terminal_size().columns - 2))


def _wrap(text: str, indent: int, first: str = "", lead: int = 2) -> list[str]:
    """``first`` (after ``lead`` spaces, padded to ``indent``) then ``text`` wrapped with a hanging indent; nothing
    is cut."""
    named = f"{' ' * lead}{first}"
    lead = named.ljust(indent) if first else " " * indent
    if first and len(named) >= indent:  # a long name (no space left after it): the text starts on the next line
        return [lead.rstrip(), *textwrap.wrap(text, width(), initial_indent=" " * indent,
                                              subsequent_indent=" " * indent, break_on_hyphens=False, break_long_words=False)]
    return textwrap.wrap(text, width(), initial_indent=lead, subsequent_indent=" " * indent, break_on_hyphens=False,
                         break_long_words=False) or [lead.rstrip()]


def _section(title: str, rows: list[tuple[str, str]], indent: int = 28) -> list[str]:
    lines = textwrap.wrap(title, width(), subsequent_indent="  ", break_on_hyphens=False, break_long_words=False)
    for name, text in rows:
        lines += _wrap(text, indent, name)
    return lines


def top_level_help(description: str, commands: dict[str, tuple[str, str]]) -> str:
    """``dpl --help``: what dpl is, its commands (Lightning's and dpl's own) and an example."""
    names = [*LIGHTNING_COMMANDS, *commands]
    lines = [f"usage: dpl [-h] [-c CONFIG] {{{','.join(names)}}} ...", "", description, ""]
    lines += _section("training commands (Lightning; options as --KEY VALUE or in config files):",
                      list(LIGHTNING_COMMANDS.items()), indent=12)
    lines += [""] + _section("other commands (each has --help):",
                             [(name, text) for name, (text, _) in commands.items()], indent=12)
    lines += ["", *_section("options:", [
        ("-h, --help", "show this help and exit"),
        ("-c, --config CONFIG", "a config file for the command (usually given after it: dpl fit --config "
                                "CONFIG.yaml)"),
        ("--print_config", "print the resolved config and exit (after the command: dpl fit --config CONFIG.yaml "
                           "--print_config)")], indent=24)]
    lines += ["", "Example: dpl fit --config configs/quickstart.yaml  (docs: README.md, docs/configuration.md)"]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ dpl plugins


def plugins_listing(infos: list[PluginInfo]) -> str:
    """``dpl plugins``: per installed plugin its description, hooks, package and config fragments."""
    if not infos:
        return "no dpl plugins installed\n"
    indent = max(len(i.name) for i in infos) + 2
    lines = ["installed dpl plugins: what each does, its hooks (package), its config fragments", ""]
    for info in infos:
        lines += _wrap(info.description or "-", indent, info.name, lead=0)
        lines += _wrap(f"hooks: {', '.join(info.hooks) or '-'} ({info.package} {info.version})", indent)
        default = " (a default: always active, never named)" if info.name in DEFAULT_PLUGINS else ""
        lines += _wrap(f"config: {', '.join(info.fragments) or '-'}{default}", indent)
    lines += ["", *textwrap.wrap(
        "A run uses the defaults and the plugins named under model.plugins, with their options: add a plugin's "
        "config fragment after the task config (dpl fit --config configs/sst2/dpsgd.yaml --config "
        "plugins/denoise/denoise.yaml) or name it: --model.plugins '{denoise: {kappa: 1.02}}'.", width())]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ dpl fit --help


def _options_of(cls: type) -> list[tuple[str, str]]:
    """``(KEY, first sentence of its doc (type, default))`` for each field of dataclass ``cls``."""
    from dpl.cli_commands import docstring_args

    docs = docstring_args(cls)
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        shown = "" if dataclasses.is_dataclass(default) else f", default {_yaml(default)}"
        rows.append((f.name, f"{first_sentence(docs.get(f.name, ''))} ({_type_name(hints[f.name])}{shown})".lstrip()))
    return rows


def _yaml(value: Any) -> str:
    """``value`` as YAML writes it (``null``, ``true``, ``[]``)."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return str(value)


def _type_name(hint: Any) -> str:
    args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return " | ".join(str(a) for a in args)
    if args and type(None) in args and origin is not list:
        return " | ".join(_type_name(a) for a in args if a is not type(None)) + " | null"
    if origin is list:
        return f"list of {_type_name(args[0])}" if args else "list"
    return getattr(hint, "__name__", str(hint))


def fit_preface(command: str, plugins: list[PluginInfo], models: list[str], data: list[str]) -> str:
    """dpl's own options, leading ``dpl COMMAND --help``: privacy, fine-tuning and LoRA, plugins, model and data."""
    from dpl.core.privacy import PrivacyConfig
    from dpl.tasks.modules.finetuning import FinetuneOptions, LoraOptions

    lines = [f"usage: dpl {command} [-h] [--config CONFIG.yaml ...] [--KEY VALUE ...] [--ckpt_path CKPT]"
             + (" [--export FOLDER]" if command == "fit" else ""), ""]
    lines += textwrap.wrap(COMMAND_DESCRIPTIONS.get(command, ""), width()) + [""]
    lines += _section("privacy: --model.privacy.KEY VALUE (in a config: model.init_args.privacy; the full text: "
                      "dpl fit --model.privacy.help)", _options_of(PrivacyConfig), indent=30)
    lines += [""] + _section("fine-tuning: --model.finetuning.KEY VALUE (lora.KEY: peft's LoRA, with method lora)",
                             [*[row for row in _options_of(FinetuneOptions) if row[0] != "lora"],
                              *[(f"lora.{key}", text) for key, text in _options_of(LoraOptions)]], indent=30)
    named = [i for i in plugins if i.name not in DEFAULT_PLUGINS]
    rows = [(f"{i.name}", f"{i.description}; hooks: {', '.join(i.hooks)}; config: {', '.join(i.fragments) or '-'}")
            for i in named]
    lines += [""] + _section(
        "plugins (--model.plugins: dpl's private-training methods, not Lightning's --trainer.plugins; only the "
        "plugins named here run, beside the defaults " + " and ".join(DEFAULT_PLUGINS) + "; details: dpl plugins):",
        [("--model.plugins '{NAME: {OPTION: VALUE}}'", "e.g. --model.plugins '{denoise: {kappa: 1.02}}', or add "
                                                       "a plugin's config fragment: --config FRAGMENT.yaml"),
         *rows], indent=16)
    lines += [""] + _section("model and data (their options depend on the class: list them with --model.help "
                             "CLASS, --data.help CLASS):", [
        ("--model CLASS", ", ".join(models)),
        ("--model.model PATH", "the pretrained model: a local folder, hub id or pkg://<package>/<path>"),
        ("--model.optimizer CLASS", "the torch optimizer (default AdamW), e.g. --model.optimizer.lr 0.001"),
        ("--data CLASS", ", ".join(data)),
        *_data_rows(),
    ], indent=28)
    lines += ["", *textwrap.wrap("The run's own options (--config, --ckpt_path, --export, ...), the model and data "
                                 "groups and Lightning's Trainer options (--trainer.KEY VALUE) follow.", width()), ""]
    return "\n".join(lines) + "\n"


def _data_rows() -> list[tuple[str, str]]:
    return [(f"--data.{key} {kind}", text) for key, kind, text in DATA_ESSENTIALS]
