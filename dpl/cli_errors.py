"""jsonargparse's error messages as one ``dpl: error:`` line: the rules that read its message text (a mistyped
option named with the closest valid one, a wrong type with what was expected and given, a bad plugin option).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import re
import typing
from typing import Any

def summarize_parse_error(message: str, argv: list[str], parser: Any = None) -> str:
    """One line for a jsonargparse error: a mistyped option is named with the closest valid one."""
    text = str(message)
    text = text.replace('Parser key "config": ', "--config: ")
    plugin_error = _plugin_option_error(text)
    if plugin_error is not None:
        return plugin_error
    unknown = re.search(r"unrecognized arguments:\s*(\S+)", text, re.IGNORECASE)
    if unknown:
        bad = unknown.group(1).split("=")[0]
        options = list(getattr(parser, "_option_string_actions", {}) or {})
        return _unknown_option(bad, None, options)
    leaf = re.search(r"(?:Option|Key) '([^']+)' is not accepted", text)
    group = re.search(r'Parser key "([^"]+)"', text)
    if leaf and group:
        nested = re.findall(r"NestedArg\(key='([^']+)'", text)
        key = nested[-1] if nested else leaf.group(1)
        classes = re.findall(r"Problem with given class_path '([\w.]+)'", text)
        candidates = _init_keys(classes[0]) if classes else []
        typed = _typed_option(group.group(1), key, argv)
        return _unknown_option(typed, (group.group(1), key, candidates), [])
    if re.search(r'expected "subcommand"', text):
        from dpl.cli_commands import COMMANDS

        return f"expected a command: fit, validate, test, {', '.join(COMMANDS)} (see dpl --help)"
    if "arguments are required" in text and (".model" in text or ".data" in text):
        return f"{text.strip()} (give a config: dpl fit --config configs/quickstart.yaml)"
    keys = re.findall(r'Parser key "([^"]+)"', text)
    expected = [t for t in re.findall(r"Expected a <class '([^']+)'>", text) if t != "NoneType"]
    given = [g for g in re.findall(r"Given value: (.*)", text) if not g.startswith("NestedArg(")]
    if expected and keys and keys != ["config"]:
        got = f", got {given[0]!r}" if given else ""
        return f"{'.'.join(keys)}: expected {' or '.join(dict.fromkeys(expected))}{got}"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    noise = ("Does not validate against", "Subtypes:", "Errors:", "Given value", "- Expected a <class 'NoneType'>",
             "Problem with given class_path")
    meaningful = [ln.lstrip("- ") for ln in lines if not ln.startswith(noise) and not ln.startswith("Parser key")]
    where = ".".join(keys)
    if meaningful:
        detail = meaningful[-1] if keys else meaningful[0]
        return (f"{where}: {detail}" if where else detail) + _debug_hint(len(lines) > 1)
    return (lines[0] if lines else "invalid arguments") + _debug_hint(len(lines) > 1)


def _plugin_option_error(text: str) -> str | None:
    """One line for a bad ``model.plugins`` entry: an unknown plugin, an unknown option, a wrong type or choice."""
    from dpl.core.plugin_manager import OPTIONS_CLASSES, installed_plugins

    unknown = re.search(r'Parser key "plugins":(?:.|\n)*?Unexpected keys: \{([^}]*)\}', text)
    if unknown:
        names = sorted(n for n in installed_plugins() if n not in ("clip", "gaussian"))
        bad = [k.strip().strip("'\"") for k in unknown.group(1).split(",")][0]
        match = difflib.get_close_matches(bad, names, n=1, cutoff=0.6)
        hint = f"; did you mean {match[0]}?" if match else ""
        return f"unknown plugin {bad!r} in model.plugins{hint} (installed: {', '.join(names) or 'none'})"
    options = re.search(r"Problem with given class_path '[\w.]*\.(\w+Options)':\s*\n?\s*(.*(?:\n.*)?)", text)
    if not options or options.group(1) not in OPTIONS_CLASSES:
        return None
    plugin, detail = OPTIONS_CLASSES[options.group(1)], options.group(2)
    from dpl.core import plugin_manager

    fields = [f.name for f in dataclasses.fields(getattr(plugin_manager, options.group(1)))]
    leaf = re.search(r"Option '([^']+)' is not accepted", detail)
    if leaf:
        match = difflib.get_close_matches(leaf.group(1), fields, n=1, cutoff=0.6)
        hint = f"; did you mean {match[0]}?" if match else f" (options of {plugin}: {', '.join(fields)})"
        return f"unknown option model.plugins.{plugin}.{leaf.group(1)}{hint}"
    wrong = re.search(r'Parser key "([^"]+)":\s*\n?\s*Expected a (.+?)\. Got value: (.*)', detail)
    if not wrong:
        return f"model.plugins.{plugin}: {detail.strip().splitlines()[0]}"
    key, expected, got = wrong.groups()
    choices = re.fullmatch(r"typing\.Literal\[(.*)\]", expected)
    if choices:
        allowed = [c.strip().strip("'\"") for c in choices.group(1).split(",")]
        match = difflib.get_close_matches(got.strip(), allowed, n=1, cutoff=0.5)
        hint = f"; did you mean {match[0]!r}?" if match else ""
        return (f"model.plugins.{plugin}.{key}: expected one of {', '.join(map(repr, allowed))}, got "
                f"{got.strip()!r}{hint}")
    kind = re.sub(r"<class '([^']+)'>", r"\1", expected)
    return f"model.plugins.{plugin}.{key}: expected {kind}, got {got.strip()!r}"


def _debug_hint(more: bool) -> str:
    return " (DPL_DEBUG=1 shows the full message)" if more else ""


def _typed_option(group: str, key: str, argv: list[str]) -> str:
    """The option as the user wrote it (``--model.privacy.x`` or ``--model.init_args.privacy.x``)."""
    for token in argv:
        name = token.split("=")[0]
        if name.startswith(f"--{group}.") and name.replace(".init_args.", ".").endswith("." + key):
            return name
    return f"{group}.{key}"  # from a config file


def _unknown_option(typed: str, nested: tuple[str, str, list[str]] | None, options: list[str]) -> str:
    if nested is None:
        match = difflib.get_close_matches(typed, [o for o in options if o.startswith("--")], n=1, cutoff=0.6)
        hint = f"; did you mean {match[0]}?" if match else "; see dpl fit --help"
        return f"unknown option {typed}{hint}"
    group, key, candidates = nested
    match = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    if match:
        prefix = typed[: len(typed) - len(key)] if typed.endswith(key) else f"{group}."
        hint = f"; did you mean {prefix}{match[0]}?"
    else:
        hint = f"; see --{group}.help CLASS"
    return f"unknown option {typed}{hint}"


def _init_keys(class_path: str, depth: int = 0) -> list[str]:
    """Dotted names of a class's init arguments, recursing into dpl's own classes (e.g. ``privacy.batch_size``)."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return []
    return _class_keys(cls, depth)


def _class_keys(cls: type, depth: int) -> list[str]:
    try:
        params = inspect.signature(cls.__init__).parameters
        hints = typing.get_type_hints(cls.__init__)
    except (TypeError, ValueError, NameError):
        return []
    keys = []
    for pname, param in params.items():
        if pname == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        keys.append(pname)
        hint = hints.get(pname)
        options = typing.get_args(hint) or (hint,)
        for option in options:
            if (depth < 2 and inspect.isclass(option) and option.__module__.startswith("dpl")
                    and option is not cls):
                keys += [f"{pname}.{k}" for k in _class_keys(option, depth + 1)]
    return keys
