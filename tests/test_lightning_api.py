"""dpl's Lightning adapter and its command use Lightning's public API only: no private attribute of a Lightning object
is read or written (``trainer._accelerator_connector``, ``module._trainer``, ``super()._x``), no private Lightning
name is imported, and no class overrides or touches a private member it inherits from Lightning.

The exceptions are listed in :data:`ALLOWED`, each with its reason: where Lightning offers no public way to do
what dpl needs."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the adapter, the task modules built on it and the ``dpl fit`` / ``validate`` / ``test`` command
SCANNED = sorted([*(ROOT / "dpl" / "lightning").glob("*.py"), *(ROOT / "dpl" / "tasks" / "modules").glob("*.py"),
                  ROOT / "dpl" / "cli_lightning.py"])
_FSDP = ("DPFSDPStrategy runs FSDP over every rank (Lightning's ModelParallelStrategy sizes its mesh for tensor "
         "parallelism) and forks its ranks in tests and notebooks: neither is public in Lightning")
_ARGPARSE = ("argparse's own action lists (jsonargparse's parser is an argparse parser, with no public listing): "
             "the help's groups are retitled and reordered, and --trainer.plugins' help is prefixed")
#: (file, private name) -> why no public API does it
ALLOWED = {
    **{("dpl/lightning/fsdp.py", name): _FSDP for name in (
        "_configure_launcher", "_launcher", "_data_parallel_size", "_tensor_parallel_size",
        "_MultiProcessingLauncher", "_collect_rank_zero_results")},
    ("dpl/cli_lightning.py", "_parse_ckpt_path"): (
        "LightningCLI reads --ckpt_path's hyperparameters there, in its constructor before any public hook: dpl "
        "checks the path first and makes a checkpoint torch cannot read a one-line error"),
    ("dpl/cli_lightning.py", "_run_subcommand"): (
        "the one LightningCLI call that runs before_<command>, the command and after_<command>: a failure anywhere "
        "in them removes the run folder the run created"),
    ("dpl/cli_lightning.py", "_actions"): _ARGPARSE,
    ("dpl/cli_lightning.py", "_group_actions"): _ARGPARSE,
}
PRIVATE = re.compile(r"^_[A-Za-z]\w*$")


def _is_private(name: str) -> bool:
    return bool(PRIVATE.match(name)) and not name.endswith("__")


def _lightning_source(cls: type) -> str:
    """The source of every Lightning class ``cls`` inherits from."""
    parts = []
    for base in cls.__mro__:
        if base.__module__.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_fabric"):
            try:
                parts.append(inspect.getsource(base))
            except (OSError, TypeError):
                pass
    return "\n".join(parts)


def _inherited_from_lightning(name: str, source: str) -> bool:
    return bool(re.search(rf"(self\.{name}\b|def {name}\b|^\s*{name}\s*[:=])", source, re.M))


def private_uses(path: Path, root: Path = ROOT) -> list[tuple[str, int, str]]:
    """``(name, line, what)`` for each private Lightning member ``path`` (a module under ``root``) touches."""
    tree = ast.parse(path.read_text())
    module = importlib.import_module(".".join(path.relative_to(root).with_suffix("").parts))
    found: list[tuple[str, int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("lightning", "pytorch_lightning",
                                                                                     "lightning_fabric"):
            found += [(a.name, node.lineno, f"imports {node.module}.{a.name}") for a in node.names
                      if _is_private(a.name) or any(_is_private(p) for p in node.module.split("."))]
        elif isinstance(node, ast.Attribute) and _is_private(node.attr):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue  # judged per class below
            root = base
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in ("torch", "os", "sys"):
                continue  # not a Lightning object
            found.append((node.attr, node.lineno, f"reads {ast.unparse(node)}"))
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        cls = getattr(module, node.name, None)
        source = _lightning_source(cls) if isinstance(cls, type) else ""
        if not source:
            continue
        for inner in ast.walk(node):
            name = None
            if isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name) and inner.value.id == "self":
                name, what = inner.attr, f"self.{inner.attr} of {node.name}"
            elif isinstance(inner, ast.FunctionDef):
                name, what = inner.name, f"overrides {node.name}.{inner.name}"
            if name and _is_private(name) and _inherited_from_lightning(name, source):
                found.append((name, inner.lineno, what))
    return found


def test_no_private_lightning_members():
    bad = []
    for path in SCANNED:
        rel = path.relative_to(ROOT).as_posix()
        bad += [f"{rel}:{line}: {what}" for name, line, what in private_uses(path) if (rel, name) not in ALLOWED]
    assert not bad, "private Lightning API used:\n" + "\n".join(bad)


def test_the_check_finds_private_uses(tmp_path, monkeypatch):
    """The check itself: it flags the trainer's accelerator connector written, ``module._trainer`` read and a
    private Lightning method overridden."""
    package = tmp_path / "probe_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "probe.py").write_text(
        "import lightning as L\n"
        "from lightning.pytorch.strategies import DDPStrategy\n"
        "def keep(trainer):\n"
        "    trainer._accelerator_connector.use_distributed_sampler = False\n"
        "class M(L.LightningModule):\n"
        "    def hook(self):\n"
        "        return self._trainer\n"
        "class S(DDPStrategy):\n"
        "    def _configure_launcher(self):\n"
        "        pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    names = {name for name, _, _ in private_uses(package / "probe.py", root=tmp_path)}
    assert {"_accelerator_connector", "_trainer", "_configure_launcher"} <= names
