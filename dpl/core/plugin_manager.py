"""Discovering, listing and activating plugins.

Plugins are objects (usually classes instantiated with keyword arguments from the config) registered in the
entry-point group ``dpl``. Installed plugins are discovered and listable (``dpl plugins``) but only the ones
named in the config run; the defaults ``clip`` and ``gaussian`` are always active and yield to any named
plugin implementing the same hook. Built-ins register through the same entry points as third-party packages.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import inspect
import os
import re
import typing
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import pluggy

from dpl.core import hookspecs
from dpl.errors import ConfigError, PluginError

ENTRY_POINT_GROUP = "dpl"
DEFAULT_PLUGINS = ("clip", "gaussian")
_EXCLUSIVE_HOOKS = ("estimate_gradient", "privatize", "precondition", "configure_mechanism")


@dataclass(frozen=True)
class PluginInfo:
    """An installed plugin: its entry-point name, distribution, version, the hooks it implements, a one-line
    description and its config fragments (``*.yaml`` in the plugin's package folder)."""

    name: str
    package: str
    version: str
    hooks: tuple[str, ...]
    target: str
    description: str = ""
    fragments: tuple[str, ...] = ()


def installed_plugins() -> dict[str, metadata.EntryPoint]:
    """Entry points of the ``dpl`` group, by name."""
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def implemented_hooks(obj: Any) -> tuple[str, ...]:
    """Names of the dpl hooks that ``obj`` (a plugin class or instance) implements."""
    names = hookspecs.STEP_HOOKS + hookspecs.SETUP_HOOKS
    return tuple(n for n in names if callable(getattr(obj, n, None))
                 and hasattr(getattr(obj, n), f"{hookspecs.PROJECT}_impl"))


def _replaces(plugin: Any, hook: str) -> bool:
    """Whether ``plugin``'s implementation of ``hook`` answers it; a pluggy wrapper (``wrapper=True`` or
    ``hookwrapper=True``) only wraps whichever plugin answers, so it neither conflicts with nor replaces it."""
    opts = getattr(getattr(plugin, hook), f"{hookspecs.PROJECT}_impl", None) or {}
    return not (opts.get("wrapper") or opts.get("hookwrapper"))


def describe_plugins() -> list[PluginInfo]:
    """One :class:`PluginInfo` per installed plugin, sorted by name. A plugin class is read from its source where it
    can be (its module is not imported: ``dpl plugins`` stays fast); otherwise the entry point is loaded."""
    infos = []
    for name, ep in sorted(installed_plugins().items()):
        dist = ep.dist
        static = _read_plugin_source(ep.value)
        if static is not None:
            hooks, description, folder = static
        else:
            folder = None
            try:
                target = ep.load()
                hooks, description = implemented_hooks(target), describe(target)
            except Exception as exc:  # a broken third-party plugin must not break the listing
                hooks, description = (f"<failed to load: {exc}>",), ""
        fragments = tuple(_shown_path(p) for p in sorted(folder.glob("*.yaml"))) if folder is not None else ()
        infos.append(PluginInfo(name, dist.name if dist else "?", dist.version if dist else "?", hooks, ep.value,
                                description, fragments))
    return infos


def describe(plugin: Any) -> str:
    """A plugin's one-line description: its ``description`` attribute, else the first sentence of its docstring."""
    text = getattr(plugin, "description", None)
    if not isinstance(text, str) or not text.strip():
        text = first_sentence(inspect.getdoc(plugin) or "")
    return text.strip()


def first_sentence(text: str) -> str:
    """The first sentence of a docstring's first paragraph, without reStructuredText markup."""
    paragraph = " ".join(text.strip().split("\n\n", 1)[0].split())
    paragraph = re.sub(r":\w+:`~?([^`]+)`", r"\1", paragraph).replace("``", "")
    match = re.search(r"(?<!e\.g)(?<!i\.e)\.(\s|$)", paragraph)
    return paragraph[: match.start() + 1] if match else paragraph


def _read_plugin_source(value: str) -> tuple[tuple[str, ...], str, Path | None] | None:
    """Hooks, description and package folder of the plugin class ``module:Class`` read from its source file, or
    ``None`` when that is not enough (not a class defined there, or a class with base classes)."""
    module, _, attr = value.partition(":")
    attr = attr.strip()
    if not attr.isidentifier():
        return None
    try:
        spec = importlib.util.find_spec(module.strip())
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            return None
        tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    except (ImportError, ValueError, OSError, SyntaxError):
        return None
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == attr), None)
    if cls is None or any(not (isinstance(b, ast.Name) and b.id == "object") for b in cls.bases) or cls.keywords:
        return None
    marked = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
              and any("hookimpl" in ast.unparse(d) for d in n.decorator_list)}
    hooks = tuple(n for n in hookspecs.STEP_HOOKS + hookspecs.SETUP_HOOKS if n in marked)
    description = ""
    for node in cls.body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "description" for t in node.targets)
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            description = node.value.value.strip()
    description = description or first_sentence(ast.get_docstring(cls) or ast.get_docstring(tree) or "")
    folder = Path(spec.origin).parent if spec.submodule_search_locations else None
    return hooks, description, folder


def _shown_path(path: Path) -> str:
    """``path`` relative to the working directory when it lies below it (as the docs write it), else absolute."""
    path = path.resolve()
    return os.path.relpath(path) if path.is_relative_to(Path.cwd().resolve()) else str(path)


def load_plugin(name: str, options: dict[str, Any] | None = None) -> Any:
    """Instantiate the installed plugin ``name`` with ``options`` (keyword arguments)."""
    available = installed_plugins()
    if name not in available:
        known = ", ".join(sorted(available)) or "none"
        raise PluginError(f"unknown plugin {name!r}; installed plugins: {known}")
    try:
        target = available[name].load()
    except Exception as exc:
        raise PluginError(f"plugin {name!r} failed to load: {exc}") from exc
    options = options_as_dict(options)
    if inspect.isclass(target) or callable(target) and not implemented_hooks(target):
        try:
            return target(**options)
        except TypeError as exc:
            raise PluginError(f"bad options for plugin {name!r}: {exc}") from exc
    if options:
        raise PluginError(f"plugin {name!r} takes no options, got {sorted(options)}")
    return target


def normalize_plugin_config(plugins: dict[str, Any] | list[Any] | None) -> dict[str, dict[str, Any]]:
    """Accept ``{name: {options}}`` or ``[name, {name: {options}}, ...]``; return an ordered name->options dict."""
    if plugins is None:
        return {}
    if isinstance(plugins, dict):
        items = list(plugins.items())
    else:
        items = []
        for entry in plugins:
            if isinstance(entry, str):
                items.append((entry, {}))
            elif isinstance(entry, dict) and len(entry) == 1:
                items.extend(entry.items())
            else:
                raise PluginError(f"bad plugin entry {entry!r}: use a name or {{name: {{options}}}}")
    out: dict[str, dict[str, Any]] = {}
    for name, options in items:
        if name in out:
            raise PluginError(f"plugin {name!r} is named twice")
        try:
            out[name] = options_as_dict(options)
        except TypeError:
            raise PluginError(f"options of plugin {name!r} must be a mapping, got {options!r}") from None
    return out


def options_as_dict(options: Any) -> dict[str, Any]:
    """A plugin's options as keyword arguments: from a mapping, an options dataclass (:func:`plugin_options_type`)
    or a jsonargparse ``Namespace``; ``None`` means the defaults."""
    if options is None:
        return {}
    if dataclasses.is_dataclass(options) and not isinstance(options, type):
        return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    if hasattr(options, "as_dict") and callable(options.as_dict):  # jsonargparse Namespace
        return dict(options.as_dict())
    if isinstance(options, dict):
        return dict(options)
    raise TypeError(f"not plugin options: {options!r}")


def create_plugin_manager(plugins: dict[str, Any] | list[Any] | None = None) -> pluggy.PluginManager:
    """Build a fresh plugin manager for one run with the defaults plus the plugins named in ``plugins``.

    Named plugins are registered so that ``post_process`` runs them in the order they are named. Raises
    :class:`~dpl.errors.PluginError` for an unknown plugin or for two named plugins that both implement an
    exclusive hook (``estimate_gradient``, ``privatize``, ``precondition``, ``configure_mechanism``).
    """
    config = normalize_plugin_config(plugins)
    for name in DEFAULT_PLUGINS:
        if name in config:
            raise PluginError(f"{name!r} is a default plugin and always active; do not name it")
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    named = [(name, load_plugin(name, options)) for name, options in config.items()]
    for name, plugin in named:
        check_state_contract(name, plugin)
    owners: dict[str, str] = {}
    for name, plugin in named:
        for hook in implemented_hooks(plugin):
            if hook in _EXCLUSIVE_HOOKS and _replaces(plugin, hook):
                if hook in owners:
                    raise PluginError(f"plugins {owners[hook]!r} and {name!r} both implement {hook!r} "
                                      "and cannot be combined")
                owners[hook] = name
    for name in DEFAULT_PLUGINS:
        pm.register(load_plugin(name), name=name)
    # pluggy calls the most recently registered implementation first: register in reverse config order.
    for name, plugin in reversed(named):
        pm.register(plugin, name=name)
    try:
        pm.check_pending()  # a hook implementation whose name matches no hook (a typo such as post_proces)
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"plugin {pm.get_name(exc.plugin)!r}: {exc}") from None
    return pm


#: the state methods a plugin may have, in save / load pairs (see :mod:`dpl.core.hookspecs`)
STATE_METHODS = (("state_dict", "load_state_dict"), ("secret_state_dict", "load_secret_state_dict"))


def check_state_contract(name: str, plugin: Any) -> None:
    """Refuse a plugin with half of a state pair: what it saves must load back on resume, and what it loads must
    have been saved (:data:`STATE_METHODS`)."""
    for save, load in STATE_METHODS:
        has_save, has_load = callable(getattr(plugin, save, None)), callable(getattr(plugin, load, None))
        if has_save != has_load:
            present, missing = (save, load) if has_save else (load, save)
            raise PluginError(f"plugin {name!r} implements {present}() without {missing}(): its state would not "
                              "survive a resume")


def active_plugin_names(pm: pluggy.PluginManager) -> list[str]:
    """Names of the named (non-default) plugins, in config order."""
    return [n for n, _ in reversed(pm.list_name_plugin()) if n not in DEFAULT_PLUGINS]


def replaced_hooks(pm: pluggy.PluginManager) -> frozenset[str]:
    """Exclusive hooks implemented by a named plugin (so the default implementation is not used)."""
    named = set(active_plugin_names(pm))
    return frozenset(hook for name, plugin in pm.list_name_plugin() if name in named
                     for hook in implemented_hooks(plugin) if hook in _EXCLUSIVE_HOOKS and _replaces(plugin, hook))


# ---------------------------------------------------------------------------------------- typed options

#: name of each generated options dataclass -> the plugin it describes
OPTIONS_CLASSES: dict[str, str] = {}


@functools.cache
def options_dataclass(name: str, target: Any) -> type | None:
    """A dataclass whose fields are the keyword arguments of plugin class ``target`` (types and defaults from its
    constructor signature, help from its docstring), so that jsonargparse checks a plugin's options when the
    config is parsed. ``None`` when the constructor cannot be described (untyped or ``**kwargs``). Made once per
    plugin: jsonargparse finds it again by its import path."""
    if not inspect.isclass(target):
        return None
    try:
        params = list(inspect.signature(target.__init__).parameters.values())[1:]
        hints = typing.get_type_hints(target.__init__)
    except (TypeError, ValueError, NameError):
        return None
    fields = []
    for param in params:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) or param.name not in hints:
            return None
        if param.default is inspect.Parameter.empty:
            fields.append((param.name, hints[param.name]))
        else:
            fields.append((param.name, hints[param.name], dataclasses.field(default=param.default)))
    # Named after the entry point and kept in this module, so that jsonargparse can import it by its path.
    class_name = "".join(part.capitalize() for part in re.split(r"[^0-9A-Za-z]+", name) if part) + "Options"
    cls = dataclasses.make_dataclass(class_name, fields)
    cls.__doc__ = target.__doc__ or f"Options of the {name} plugin."
    cls.__module__ = __name__
    globals()[class_name] = cls
    OPTIONS_CLASSES[class_name] = name
    return cls


@functools.cache
def plugin_options_type() -> Any:
    """The type of a run's ``plugins`` setting: a ``TypedDict`` with one optional key per installed plugin (but the
    defaults), valued by that plugin's options dataclass (:func:`options_dataclass`), or a free mapping for a
    plugin whose options cannot be described. jsonargparse then refuses, when the config is parsed, an unknown
    plugin, an unknown option, a value of the wrong type or a choice outside a ``Literal``; the order of the keys
    (the ``post_process`` order) is kept, and ``--print_config`` shows each named plugin's options with defaults."""
    from typing_extensions import TypedDict

    fields: dict[str, Any] = {}
    for name, entry in sorted(installed_plugins().items()):
        if name in DEFAULT_PLUGINS:
            continue
        try:
            options = options_dataclass(name, entry.load())
        except Exception:  # noqa: BLE001 - a broken third-party plugin fails when it is named, not here
            options = None
        fields[name] = options | None if options is not None else dict[str, Any] | None
    return TypedDict("PluginOptions", fields, total=False)


# ---------------------------------------------------------------------------------------- contracts


@dataclass(frozen=True)
class Contract:
    """What a plugin declares about the step it takes part in (its ``contract`` attribute; default: nothing), so
    that the core refuses combinations without an analysis, whoever wrote the plugins - no plugin names another.

    Attributes:
        changes_noise: its ``post_process`` changes the noise left in the release in a data-dependent way, so the
            release's ``noise_std`` no longer describes it (denoise's shrinkage).
        needs_noise_std: it reads the release's ``noise_std`` as the std of the noise still in the values
            (AdamBC's bias correction).
        rank_one_release: its estimator releases a scalar along a public direction, not a gradient per parameter
            (DPZero).
        needs_gradient_matrices: it needs the release as a gradient per parameter (denoise's matrix shrinkage).
        full_tensors: it works on whole parameter tensors in place, so it cannot run on sharded parameters (FSDP).
        clips_units: its ``estimate_gradient`` bounds each privacy unit of the batch as one (the batch's
            ``dpl_units``: a user's rows under user-level sampling), so it may replace the default estimator there.
    """

    changes_noise: bool = False
    needs_noise_std: bool = False
    rank_one_release: bool = False
    needs_gradient_matrices: bool = False
    full_tensors: bool = False
    clips_units: bool = False


def contract_of(plugin: Any) -> Contract:
    contract = getattr(plugin, "contract", None)
    if contract is None:
        return Contract()
    if not isinstance(contract, Contract):
        raise PluginError(f"plugin {type(plugin).__name__}: contract must be a dpl.api.Contract, got {contract!r}")
    return contract


def check_contracts(pm: pluggy.PluginManager, sharded: bool = False, user_units: bool = False) -> None:
    """Refuse (one-line :class:`~dpl.errors.ConfigError`) the named plugins' combination when their contracts
    conflict: a plugin reading ``noise_std`` after one that changes the noise, a plugin needing gradient matrices
    with a rank-one estimator, a whole-tensor plugin on sharded parameters."""
    named = dict(pm.list_name_plugin())
    contracts = {name: contract_of(named[name]) for name in active_plugin_names(pm)}

    def having(flag: str) -> list[str]:
        return [n for n, c in contracts.items() if getattr(c, flag)]

    for reader in having("needs_noise_std"):
        changers = [n for n in having("changes_noise") if n != reader]
        if changers:
            raise ConfigError(f"{reader} reads the release's noise std, but {changers[0]} changes the noise left in "
                              "the gradient in a data-dependent way, so that std no longer describes it; drop one")
    for needer in having("needs_gradient_matrices"):
        rank_one = [n for n in having("rank_one_release") if n != needer]
        if rank_one:
            raise ConfigError(f"{needer} needs a noisy gradient per parameter, but {rank_one[0]} releases one scalar "
                              "along a public direction (a rank-one update): there is no gradient matrix to work on")
    if user_units:
        estimators = [n for n in active_plugin_names(pm)
                      if hasattr(named[n], "estimate_gradient") and not contracts[n].clips_units]
        if estimators:
            raise ConfigError(f"{estimators[0]} replaces estimate_gradient but does not clip per user "
                              "(privacy.unit: user with user_sampling: users needs each user's rows bounded as one "
                              "unit); use user_sampling: rows or drop it")
    whole = having("full_tensors")
    if sharded and whole:
        raise ConfigError(f"{whole[0]} works on whole parameter tensors in place; sharded parameters (FSDP) are not "
                          "supported: use strategy ddp")
