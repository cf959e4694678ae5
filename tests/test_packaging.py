"""The built wheel holds every module and data file of dpl and its built-in plugins.

The test suite runs against an editable install, which imports from the checkout and so cannot see a
subpackage missing from pyproject's package list; a wheel (``pip install .``, a release) would lack it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# source folder -> the import name it is installed under (pyproject's package-dir)
INSTALLED_AS = {"dpl": "dpl", "plugins": "dpl_plugins"}


def shipped_sources() -> set[str]:
    """Every file under dpl/ and plugins/ as its path inside the wheel; the plugins' READMEs stay in the repo."""
    files = set()
    for folder, name in INSTALLED_AS.items():
        for path in (ROOT / folder).rglob("*"):
            if not path.is_file() or "__pycache__" in path.parts or path.suffix == ".pyc":
                continue
            if folder == "plugins" and path.name == "README.md":
                continue
            files.add(f"{name}/{path.relative_to(ROOT / folder).as_posix()}")
    return files


def setuptools_here() -> bool:
    """Whether this environment's setuptools can build dpl (else pip fetches one into an isolated build)."""
    try:
        import setuptools
    except ImportError:
        return False
    return int(setuptools.__version__.split(".")[0]) >= 68


def test_wheel_ships_every_module_and_data_file(tmp_path: Path) -> None:
    source = tmp_path / "source"  # a copy: building in place would leave build/ in the checkout
    for folder in INSTALLED_AS:
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    isolation = ["--no-build-isolation"] if setuptools_here() else []
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", str(tmp_path),
                    str(source)], check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = tmp_path.glob("dpl-*.whl")
    in_wheel = {n for n in zipfile.ZipFile(wheel).namelist() if ".dist-info/" not in n}
    assert shipped_sources() - in_wheel == set(), "missing from the wheel (pyproject's packages / package-data)"
    assert in_wheel - shipped_sources() == set(), "in the wheel but not in the checkout"


def test_shipped_sources_sees_subpackages() -> None:
    files = shipped_sources()
    assert "dpl/core/accounting/prv.py" in files and "dpl_plugins/ftrl/ftrl.yaml" in files
    assert not any(f.endswith("README.md") for f in files if f.startswith("dpl_plugins/"))
