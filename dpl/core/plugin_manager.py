"""Discovering, listing and activating plugins.

Plugins are objects (usually classes instantiated with keyword arguments from the config) registered in the
entry-point group ``dpl``. Installed plugins are discovered and listable (``dpl plugins``) but only the ones
named in the config run; the defaults ``clip`` and ``gaussian`` are always active and yield to any named
plugin implementing the same hook. Built-ins register through the same entry points as third-party packages.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import pluggy

from dpl.core import hookspecs
from dpl.errors import PluginError

ENTRY_POINT_GROUP = "dpl"
DEFAULT_PLUGINS = ("clip", "gaussian")
_EXCLUSIVE_HOOKS = ("estimate_gradient", "privatize", "precondition", "configure_mechanism")


@dataclass(frozen=True)
class PluginInfo:
    """An installed plugin: its entry-point name, distribution, version and the hooks it implements."""

    name: str
    package: str
    version: str
    hooks: tuple[str, ...]
    target: str


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
    """One :class:`PluginInfo` per installed plugin, sorted by name (loads each entry point)."""
    infos = []
    for name, ep in sorted(installed_plugins().items()):
        dist = ep.dist
        try:
            hooks = implemented_hooks(ep.load())
        except Exception as exc:  # a broken third-party plugin must not break the listing
            hooks = (f"<failed to load: {exc}>",)
        infos.append(PluginInfo(name, dist.name if dist else "?", dist.version if dist else "?", hooks, ep.value))
    return infos


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
    options = dict(options or {})
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
        if options is not None and not isinstance(options, dict):
            raise PluginError(f"options of plugin {name!r} must be a mapping, got {options!r}")
        out[name] = dict(options or {})
    return out


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
    return pm


def active_plugin_names(pm: pluggy.PluginManager) -> list[str]:
    """Names of the named (non-default) plugins, in config order."""
    return [n for n, _ in reversed(pm.list_name_plugin()) if n not in DEFAULT_PLUGINS]


def replaced_hooks(pm: pluggy.PluginManager) -> frozenset[str]:
    """Exclusive hooks implemented by a named plugin (so the default implementation is not used)."""
    named = set(active_plugin_names(pm))
    return frozenset(hook for name, plugin in pm.list_name_plugin() if name in named
                     for hook in implemented_hooks(plugin) if hook in _EXCLUSIVE_HOOKS and _replaces(plugin, hook))
