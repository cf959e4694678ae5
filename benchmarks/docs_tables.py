"""Rewrite the docs' generated tables from the committed results, or check that they are up to date.

    python benchmarks/docs_tables.py            # rewrite every generated block of docs/*.md in place
    python benchmarks/docs_tables.py --check    # list the blocks that differ and exit 1 (the tests run this)

A generated block is the output of one command of this repository, between two markers in a docs page:

    <!-- generated: python benchmarks/studies/clipping.py --table benchmarks/results/studies/clipping_e2e.json -->
    | ... the tables the command prints ... |
    <!-- end generated -->

The command runs from the repository's root with this interpreter; it must only print (``--table`` modes read
results files and train nothing). Prose around a block is written by hand and is not touched.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- generated: (?P<command>[^\n]*?) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S)


@dataclass(frozen=True)
class Block:
    """One generated block: the page, the command, what the page holds and what the command prints now."""

    page: Path
    command: str
    shown: str
    printed: str

    @property
    def current(self) -> bool:
        return self.shown == self.printed


def printed(command: str) -> str:
    """What ``command`` (``python ...``, run from the repository's root) prints, without surrounding blank lines."""
    words = shlex.split(command)
    if words[0] != "python":
        raise SystemExit(f"docs_tables: a generated block's command must start with 'python': {command}")
    done = subprocess.run([sys.executable, *words[1:]], cwd=ROOT, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise SystemExit(f"docs_tables: '{command}' failed: {done.stderr.strip().splitlines()[-1:]}")
    return done.stdout.strip("\n")


def blocks(pages: list[Path]) -> list[Block]:
    """Every generated block of ``pages``, with what its command prints now."""
    return [Block(page, m["command"], m["body"], printed(m["command"]) + "\n")
            for page in pages for m in BLOCK.finditer(page.read_text())]


def rewrite(page: Path) -> bool:
    """Put each block's output in ``page``; True if the page changed."""
    text = page.read_text()
    new = BLOCK.sub(lambda m: m[1] + printed(m["command"]) + "\n" + m[4], text)
    if new != text:
        page.write_text(new)
    return new != text


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.resolve().is_relative_to(ROOT) else str(page)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block is out of date")
    parser.add_argument("pages", nargs="*", type=Path, help="docs pages (default: docs/*.md)")
    args = parser.parse_args(argv)
    pages = args.pages or sorted((ROOT / "docs").glob("*.md"))
    if args.check:
        stale = [b for b in blocks(pages) if not b.current]
        for b in stale:
            print(f"{_name(b.page)}: out of date: {b.command}")
        return 1 if stale else 0
    for page in pages:
        if rewrite(page):
            print(f"rewrote {_name(page)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
