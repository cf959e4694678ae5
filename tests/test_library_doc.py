"""The Python in docs/library.md runs as written (its fenced ``python`` blocks, in order, as one script in a fresh
interpreter) and prints what the page says it prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "library.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_library_page_runs(tmp_path):
    blocks = python_blocks(PAGE.read_text())
    assert blocks, "docs/library.md has no python block"
    script = tmp_path / "library_example.py"
    script.write_text("\n".join(blocks))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    found = re.search(r"epsilon = ([\d.]+) \(delta = ([\de.+-]+)\), accuracy = ([\d.]+)", out.stdout)
    assert found, out.stdout
    epsilon, accuracy = float(found.group(1)), float(found.group(3))
    assert 2.5 < epsilon <= 3.0  # calibrated to the target, never above it
    assert accuracy > 0.9  # the page's example learns its toy task
    assert "continued at step 20" in out.stdout  # the run continued from its saved states
    assert re.search(r"steps taken: 50, spent: ([\d.]+)", out.stdout), out.stdout
