"""The repository speaks of dpl itself: no tracked text file (code, tests, docs, configs, benchmarks; results data
excepted) tells how the project was made — work items, sessions, reviewers, agents, a GPU "lent", "superseded"
sections, what the project once was ("the former quickstart", "the old default"), commit hashes as history."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIPPED = ("benchmarks/results/",)  # measured data, written by the scripts
THIS = "tests/test_wording.py"

PHRASES = {
    "a work item": re.compile(r"\bissues?\b|\bwork items?\b", re.I),
    "a session": re.compile(r"\bsessions?\b", re.I),
    "a review": re.compile(r"\breview(?:er|ers|ed)\b|\b(?:code|peer) reviews?\b", re.I),
    "an agent": re.compile(r"\bagents?\b", re.I),
    "a machine lent": re.compile(r"\blent\b", re.I),
    "superseded work": re.compile(r"\bsuperseded\b", re.I),
    "an earlier state": re.compile(r"\bformer(?:ly)?\b|\bonce did\b|\bold default\b|\bfirst \w+ study\b", re.I),
    # 7 to 40 hex digits with a letter and a digit: a commit hash
    "a commit hash": re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b"),
}

# (path, phrase it may contain, why): legitimate uses only, kept short.
ALLOWED = [
    ("dpl/trained/spending.py", "superseded", "ledger runs that a continuation accounts for entirely"),
]


def tracked_text_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [p for p in listed.splitlines() if not p.startswith(SKIPPED) and p != THIS and (ROOT / p).is_file()]


def hits(path: str, text: str) -> list[str]:
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for name, pattern in PHRASES.items():
            for match in pattern.finditer(line):
                if not any(path == p and match.group(0).lower() == word for p, word, _ in ALLOWED):
                    found.append(f"{path}:{number}: {name}: {match.group(0)!r} in {line.strip()[:100]!r}")
    return found


def read_text(path: str) -> str | None:
    data = (ROOT / path).read_bytes()
    if b"\0" in data:
        return None  # binary
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def test_no_words_about_how_the_project_was_made():
    found = []
    for path in tracked_text_files():
        text = read_text(path)
        if text is not None:
            found += hits(path, text)
    assert found == [], "\n".join(found)


@pytest.mark.parametrize("line", ["Step time (issue: core pipeline)", "no GPU was lent to this work",
                                  "shared with other agents' jobs", "Earlier runs (superseded)",
                                  "before commit 2ac0681, which", "as the reviewer asked", "in this session",
                                  "the former quickstart: 2,000 rows", "what the DDP support once did",
                                  "the plugin's old default", "the first ftrl study (512 rows)"])
def test_the_phrases_are_caught(line):
    assert hits("docs/x.md", line)


@pytest.mark.parametrize("line", ["the reviews said the film was dull", "one generated review", "a transformer layer",
                                  "the first study table", "once per run", "the default is old-style",
                                  "from helpers import tiny_bert", "seed 20240611", "blake2b-256-keyed:9f2c"])
def test_ordinary_words_pass(line):
    assert hits("docs/x.md", line) == []


def test_an_allowed_use_passes_only_where_allowed():
    assert hits("dpl/trained/spending.py", "def superseded(entries):") == []
    assert hits("docs/x.md", "def superseded(entries):")
