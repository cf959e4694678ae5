"""The README's two commands: `bash scripts/setup.sh quickstart` and `bash scripts/setup.sh test`. CI (`.ci/run`) runs
the second, the first runs the README's quickstart command; the script answers bad input in one line, exit 2."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "setup.sh"


def _readme_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def _commands(block: str) -> list[str]:
    return [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]


def test_readme_two_commands_are_the_scripts():
    """The first bash block of the README is exactly the two set-up commands."""
    assert _commands(_readme_blocks()[0]) == ["bash scripts/setup.sh quickstart", "bash scripts/setup.sh test"]


def test_ci_runs_the_readme_test_command():
    """`.ci/run` is one command: the README's test command (the `Run the tests` block)."""
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci == ['cd "$(dirname "$0")/.." && exec bash scripts/setup.sh test']
    readme = (ROOT / "README.md").read_text()
    tests_block = re.search(r"## Run the tests\n+```bash\n(.*?)```", readme, flags=re.S).group(1)
    assert _commands(tests_block) == ["bash scripts/setup.sh test"]


def test_script_runs_the_documented_commands():
    """The script's quickstart is the README's quickstart command (which tests/test_documented_commands.py runs), and
    its test mode is the suite's command."""
    script = SCRIPT.read_text()
    quickstart = re.search(r"## Quickstart\n+```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S).group(1)
    assert _commands(quickstart) == ["dpl fit --config configs/quickstart.yaml"]
    assert 'exec "$venv/bin/dpl" fit --config configs/quickstart.yaml "$@"' in script
    assert 'exec "$venv/bin/python" -m pytest -q -n "$workers" --dist loadfile "$@"' in script


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})}, cwd=ROOT)


def test_old_python_is_one_line(tmp_path):
    fake = tmp_path / "python3.8"
    fake.write_text('#!/bin/sh\ncase "$2" in *version_info\\ \\<*) exit 1;; esac\necho 3.8.10\n')
    fake.chmod(0o755)
    done = _run("test", env={"PYTHON": str(fake), "DPL_VENV": str(tmp_path / "venv")})
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"dpl setup: dpl needs Python 3.10 or newer; '{fake}' is 3.8.10 (set PYTHON to a newer one)"]
    assert not (tmp_path / "venv").exists()


@pytest.mark.parametrize("args, env, says", [
    (["nonsense"], {}, "usage: bash scripts/setup.sh quickstart|test|env"),
    (["test"], {"DPL_TORCH": "rocm"}, "DPL_TORCH must be auto, cpu, cuda or keep (got 'rocm')"),
    (["test"], {"PYTHON": "no-such-python"}, "no 'no-such-python' on PATH"),
])
def test_bad_input_is_one_line(tmp_path, args, env, says):
    done = _run(*args, env={"DPL_VENV": str(tmp_path / "venv"), **env})
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0]
    assert not (tmp_path / "venv").exists()


def test_failed_install_is_one_line(tmp_path):
    """A package pip cannot fetch: one line naming it and the log, the details in the log."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    done = _run("env", env={"DPL_VENV": str(venv), "PYTHON": sys.executable})
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last == f"dpl setup: pip could not install pip (details: {venv}/setup.log)"
    assert "No module named pip" in (venv / "setup.log").read_text()


def test_second_setup_installs_nothing():
    """Where this suite runs in the environment the script made (CI), a second set-up is a no-op."""
    venv = Path(sys.prefix)
    if not (venv / ".dpl-setup-test").is_file() or venv.resolve() != (ROOT / ".venv").resolve():
        pytest.skip("the suite does not run in the .venv that scripts/setup.sh made")
    done = _run("env")
    assert done.returncode == 0, done.stderr
    assert "environment up to date" in done.stderr and "installing" not in done.stderr
