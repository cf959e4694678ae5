"""Every relative link in README.md, docs/ and the plugins' pages points to a file that exists, and every
``#anchor`` into a Markdown file to one of its headings (GitHub's slugs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "plugins").glob("*/README.md"))]


def slugs(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped (hyphens kept), spaces to hyphens."""
    found = set()
    for line in page.read_text().splitlines():
        heading = re.match(r"#{1,6}\s+(.*)", line)
        if heading:
            found.add(re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-"))
    return found


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # not inside code blocks
    return [m.group(1) for m in re.finditer(r"\]\(([^)\s]+)\)", text)
            if not m.group(1).startswith(("http://", "https://", "mailto:"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for link in links(page):
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link} (no such file)")
        elif anchor and target.suffix == ".md" and anchor not in slugs(target):
            broken.append(f"{link} (no such heading)")
    assert broken == []


def test_the_checks_catch_a_moved_page(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n## Cost per step: fused streams\n\n[x](b.md) [y](#cost-per-step-fused-streams)"
                                   " [z](#nowhere)\n")
    assert links(tmp_path / "a.md") == ["b.md", "#cost-per-step-fused-streams", "#nowhere"]
    assert "cost-per-step-fused-streams" in slugs(tmp_path / "a.md") and "nowhere" not in slugs(tmp_path / "a.md")


def test_the_tests_map_names_every_test_file():
    """tests/README.md maps each test file to the code it checks: a new test file gets its row."""
    table = (ROOT / "tests" / "README.md").read_text()
    missing = [p.name for p in sorted((ROOT / "tests").glob("test_*.py")) if f"`{p.name}`" not in table]
    assert missing == []
