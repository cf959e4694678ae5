"""Declared plugin contracts: the core refuses conflicting combinations from the declarations (no plugin names
another), a misspelled hook fails when the plugin is loaded, the state contract holds for every installed plugin, and
the built-in plugins use nothing but the plugin API."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
from helpers import fake_entry_points

from dpl.api import Contract, hookimpl
from dpl.core.plugin_manager import (STATE_METHODS, check_contracts, create_plugin_manager, installed_plugins,
                                     load_plugin, options_dataclass)
from dpl.errors import ConfigError, PluginError

PLUGINS_DIR = Path(__file__).resolve().parents[1] / "plugins"


@pytest.mark.parametrize("plugins,message", [
    ({"denoise": {}, "dpzero": {}}, "releases one scalar"),
    ({"dpzero": {}, "denoise": {}}, "releases one scalar"),
    ({"denoise": {}, "adambc": {}}, "adambc reads the release's noise std, but denoise changes the noise"),
])
def test_conflicting_built_in_plugins_are_refused(plugins, message):
    with pytest.raises(ConfigError, match=message):
        check_contracts(create_plugin_manager(plugins))


@pytest.mark.parametrize("plugins", [{"denoise": {}, "adambc": {"bias_correction": False}},
                                     {"denoise": {}, "dpzero": {"estimator": "dpgd0"}}, {"adambc": {}, "ftrl": {}}])
def test_compatible_plugins_pass(plugins):
    check_contracts(create_plugin_manager(plugins))


def test_whole_tensor_plugins_are_refused_under_sharding():
    pm = create_plugin_manager({"dpzero": {}})
    check_contracts(pm)
    with pytest.raises(ConfigError, match="FSDP"):
        check_contracts(pm, sharded=True)


class _NoiseShaper:
    """A third-party post-processor that changes the noise, written without knowing adambc."""

    contract = Contract(changes_noise=True)

    @hookimpl
    def post_process(self, ctx, gradient):
        pass


def test_a_third_party_plugin_with_the_same_property_is_refused_too(monkeypatch):
    fake_entry_points(monkeypatch, {"shaper": _NoiseShaper})
    with pytest.raises(ConfigError, match="adambc reads the release's noise std, but shaper changes"):
        check_contracts(create_plugin_manager({"shaper": {}, "adambc": {}}))


class _Typo:
    @hookimpl
    def post_proces(self, ctx, gradient):  # misspelled hook
        pass


class _HalfState:
    @hookimpl
    def post_process(self, ctx, gradient):
        pass

    def secret_state_dict(self):
        return {}


def test_a_misspelled_hook_fails_loudly(monkeypatch):
    fake_entry_points(monkeypatch, {"typo": _Typo})
    with pytest.raises(PluginError, match="post_proces"):
        create_plugin_manager({"typo": {}})


def test_half_a_state_pair_is_refused(monkeypatch):
    fake_entry_points(monkeypatch, {"half": _HalfState})
    with pytest.raises(PluginError, match="secret_state_dict\\(\\) without load_secret_state_dict"):
        create_plugin_manager({"half": {}})


@pytest.mark.parametrize("name", sorted(installed_plugins()))
def test_every_installed_plugin_keeps_the_state_contract(name):
    """What a plugin saves loads back into a fresh instance, and its public state round-trips (third-party plugins
    installed in the environment are checked too)."""
    plugin = load_plugin(name)
    for save, load in STATE_METHODS:
        assert callable(getattr(plugin, save, None)) == callable(getattr(plugin, load, None)), (name, save)
    if callable(getattr(plugin, "state_dict", None)):
        load_plugin(name).load_state_dict(plugin.state_dict())
    if callable(getattr(plugin, "load_secret_state_dict", None)):
        try:  # a resume without the sidecar: continue from fresh entropy, or refuse in one line
            load_plugin(name).load_secret_state_dict(None)
        except ConfigError:
            pass


@pytest.mark.parametrize("name", sorted(installed_plugins()))
def test_every_attribute_of_a_fresh_plugin_can_be_read(name):
    """pluggy < 1.7 registers a plugin by reading every name in ``dir(plugin)``: a property that raises before
    the run is set up would make ``create_plugin_manager`` fail."""
    plugin = load_plugin(name)
    for attribute in dir(plugin):
        getattr(plugin, attribute)


@pytest.mark.parametrize("name", sorted(n for n in installed_plugins() if n not in ("clip", "gaussian")))
def test_every_installed_plugin_has_typed_options(name):
    target = installed_plugins()[name].load()
    if inspect.isclass(target):
        assert options_dataclass(name, target) is not None, f"{name}: annotate every constructor argument"


def _dpl_imports(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "dpl":
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules |= {a.name for a in node.names if a.name.split(".")[0] == "dpl"}
    return modules


@pytest.mark.parametrize("path", sorted(PLUGINS_DIR.rglob("*.py")), ids=lambda p: str(p.relative_to(PLUGINS_DIR)))
def test_built_in_plugins_use_only_the_plugin_api(path):
    assert _dpl_imports(path) <= {"dpl", "dpl.api"}, f"{path.name} imports {_dpl_imports(path) - {'dpl', 'dpl.api'}}"


def test_hooks_doc_and_hookspecs_name_every_setup_field_and_contract_flag():
    import dataclasses
    import re

    from dpl.core import hookspecs
    from dpl.core.step import RunSetup

    hooks = (Path(__file__).resolve().parents[1] / "docs" / "hooks.md").read_text()
    section = re.search(r"## `validate_setup`\n(.*?)\n## ", hooks, flags=re.S).group(1)
    for field in dataclasses.fields(RunSetup):
        assert f"`{field.name}`" in section, f"docs/hooks.md does not name RunSetup.{field.name}"
        assert f"``{field.name}``" in hookspecs.validate_setup.__doc__, f"hookspecs does not name RunSetup.{field.name}"
    for field in dataclasses.fields(Contract):
        assert f"`{field.name}`" in section, f"docs/hooks.md does not name Contract.{field.name}"
        assert f"``{field.name}``" in hookspecs.__doc__, f"hookspecs does not name Contract.{field.name}"
