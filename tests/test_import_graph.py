"""dpl's modules import each other without a loop (docs/architecture.md: imports only go downwards): every
``import`` / ``from ... import`` of a dpl module, at module level or inside a function, read with ``ast``, and the
modules the ``dpl`` command loads by name (``importlib.import_module`` on its command table)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def modules() -> dict[str, Path]:
    """Module name -> file, for every module and package of ``dpl/``."""
    found = {}
    for path in (ROOT / "dpl").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the dpl modules it imports (a name imported from a package counts as the submodule it names)."""
    known = modules()

    def owner(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, *([base] if base else [])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            else:
                continue
            for target in targets:
                module = owner(target) if target.split(".")[0] == "dpl" else None
                if module is not None and module != name:
                    graph[name].add(module)
    for name, loaded in loaded_by_name().items():
        graph[name] |= {owner(target) for target in loaded} - {name, None}
    return graph


#: the modules that call ``importlib.import_module``, and what they load with it: ``dpl.cli`` the command table's
#: modules (:func:`loaded_by_name`); ``dpl.cli_errors`` the class paths a user's config names (no import of dpl's own)
LOADERS = {"dpl.cli", "dpl.cli_errors"}


def loaded_by_name() -> dict[str, set[str]]:
    """Module -> the dpl modules it imports through ``importlib``: ``dpl.cli`` runs each command of its table
    (``"module:function"``) by the module's name."""
    from dpl.cli_commands import COMMANDS

    return {"dpl.cli": {target.partition(":")[0] for _, target in COMMANDS.values()}}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import loops: strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_dpl_has_no_import_loop():
    graph = import_graph()
    assert not [loop for loop in cycles(graph)], {
        " <-> ".join(loop): {m: sorted(graph[m] & set(loop)) for m in loop} for loop in cycles(graph)}


def test_the_loop_finder_finds_a_loop():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_function_level_imports_count():
    graph = import_graph()
    assert "dpl.cli_lightning" in graph["dpl.cli_training"]  # imported inside training_command(), when it runs


def test_the_commands_loaded_by_name_count():
    graph = import_graph()
    assert {"dpl.planning.command", "dpl.tune.command", "dpl.audit.command", "dpl.trained.predict"} <= graph["dpl.cli"]
    assert cycles({**graph, "dpl.tune.trials": graph["dpl.tune.trials"] | {"dpl.cli"}})  # a trial through dpl.cli
    calls = {name for name, path in modules().items() if "import_module(" in path.read_text()}
    assert calls == LOADERS  # a new import by name is followed here (loaded_by_name) or said to load no dpl module


def test_nothing_below_the_command_imports_it():
    importers = sorted(name for name, imported in import_graph().items() if "dpl.cli" in imported)
    assert importers == [], importers


#: the largest a module may grow (lines): past it, a module holds more than one job
ROOM = 450
ROOMS = {"dpl/lightning/module.py": 300,  # the Lightning adapter: hooks over the engine, nothing of its own
         "dpl/core/engine.py": 462}  # the engine, over the room and shrinking: never larger than now


def test_every_module_is_within_its_room():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for folder in ("dpl", "plugins") for p in (ROOT / folder).rglob("*.py")}
    over = {name: n for name, n in sizes.items() if n > ROOMS.get(name, ROOM)}
    assert not over, over
