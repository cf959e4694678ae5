"""dpl's own keys checked before Lightning is imported: a mistyped privacy option (on the command line or in a config
file) or an option of no group is one ``dpl: error:`` line within a second, instead of after the seconds that
importing torch and Lightning take. Only what is certainly wrong is answered here; anything else goes on to the full
parser (:mod:`dpl.cli_lightning`), which says the same in the same words."""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any

#: the option roots of ``dpl fit`` / ``validate`` / ``test`` (argparse also takes a prefix of one)
ROOTS = ("config", "print_config", "seed_everything", "trainer", "model", "data", "optimizer", "lr_scheduler",
         "ckpt_path", "export", "help")

#: the ways a privacy option is written on the command line
PRIVACY_PREFIXES = ("--model.privacy.", "--model.init_args.privacy.")


def privacy_fields() -> list[str]:
    from dpl.core.privacy import PrivacyConfig

    return [f.name for f in dataclasses.fields(PrivacyConfig)]


def _closest(word: str, choices: list[str]) -> str | None:
    match = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return match[0] if match else None


def option_error(option: str, fields: list[str]) -> str | None:
    """The error line for one command-line option (``--KEY`` or ``--KEY=VALUE``), or ``None`` when it may be valid."""
    name = option.split("=", 1)[0]
    for prefix in PRIVACY_PREFIXES:
        if name.startswith(prefix):
            key = name[len(prefix):]
            if "." in key or key in fields or key == "help":
                return None
            match = _closest(key, fields)
            return f"unknown option {name}; did you mean {prefix}{match}?" if match else None
    root = name[2:].split(".", 1)[0]
    if not root or any(r.startswith(root) for r in ROOTS):
        return None
    if _closest(root, list(ROOTS)) is not None:
        return None  # perhaps a misspelled group: the full parser names the closest option
    return f"unknown option {name}; see dpl fit --help"


def config_error(path: Path, fields: list[str]) -> str | None:
    """The error line for a privacy key of a config file that no privacy option has a name close to."""
    import yaml

    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    model = config.get("model") if isinstance(config, dict) else None
    if not isinstance(model, dict):
        return None
    for where, section in (("model.init_args.privacy", (model.get("init_args") or {})), ("model.privacy", model)):
        privacy = section.get("privacy") if isinstance(section, dict) else None
        if not isinstance(privacy, dict):
            continue
        for key in privacy:
            if key not in fields:
                match = _closest(str(key), fields)
                if match:
                    return f"unknown option {where}.{key} in {path}; did you mean {where}.{match}?"
    return None


def precheck(argv: list[str]) -> str | None:
    """The first certain mistake in ``dpl fit/validate/test`` arguments ``argv`` (after the command), or ``None``."""
    if any(a in ("-h", "--help") or a.endswith(".help") for a in argv):
        return None
    fields = privacy_fields()
    configs: list[Any] = []
    for i, arg in enumerate(argv):
        if arg in ("--config", "-c") and i + 1 < len(argv):
            configs.append(argv[i + 1])
        elif arg.startswith("--config="):
            configs.append(arg.split("=", 1)[1])
        elif arg.startswith("--"):
            error = option_error(arg, fields)
            if error:
                return error
    for config in configs:
        path = Path(config)
        if path.suffix in (".yaml", ".yml", ".json") and path.is_file():
            error = config_error(path, fields)
            if error:
                return error
    return None
