"""METEOR: the official METEOR 1.5 jar (``java``), or METEOR 1.0 in pure Python (:mod:`dpl.tasks.metrics.meteor10`)
as a fallback; see :mod:`dpl.tasks.metrics.text` for what each computes."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from dpl.tasks.metrics.meteor10 import meteor_python

MeteorBackend = Literal["auto", "java", "python"]
METEOR_BACKENDS = ("auto", "java", "python")
_JAVA_HEAP = "-Xmx2G"


class MeteorFallbackWarning(RuntimeWarning):
    """METEOR was computed with the pure-Python METEOR 1.0 fallback instead of the METEOR 1.5 jar."""


def meteor(hyps: list[list[str]], refs: list[list[list[str]]], backend: MeteorBackend) -> float:
    """Corpus METEOR with ``backend`` (``auto``: the jar when it runs, else the Python fallback with a warning)."""
    if backend == "python":
        return meteor_python(hyps, refs)
    if backend == "java":
        return meteor_java(hyps, refs)
    if meteor_java_available():
        try:
            return meteor_java(hyps, refs)
        except RuntimeError as err:
            reason = f"the METEOR 1.5 jar failed ({err})"
    else:
        reason = "java or pycocoevalcap's METEOR 1.5 jar is not available"
    warnings.warn(
        f"{reason}; computing METEOR 1.0 in Python instead (exact + stem matching, no synonyms "
        "or paraphrases): scores are lower than, and not comparable with, the official METEOR 1.5",
        MeteorFallbackWarning,
        stacklevel=3,
    )
    return meteor_python(hyps, refs)


def meteor_jar() -> Path | None:
    spec = importlib.util.find_spec("pycocoevalcap")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        jar = Path(location) / "meteor" / "meteor-1.5.jar"
        if jar.is_file():
            return jar
    return None


def meteor_java_available() -> bool:
    """Whether ``meteor_backend="auto"`` will use the official METEOR 1.5 jar (java + pycocoevalcap)."""
    return shutil.which("java") is not None and meteor_jar() is not None


def meteor_java(hyps: list[list[str]], refs: list[list[list[str]]], modules: Sequence[str] | None = None) -> float:
    """Corpus METEOR from the METEOR 1.5 jar in -stdio mode, the way pycocoevalcap / E2E call it.

    ``modules`` (tests only) replaces the default matchers, e.g. ``("exact", "stem", "synonym")``
    skips loading the paraphrase table (~15 s).
    """
    java, jar = shutil.which("java"), meteor_jar()
    if java is None or jar is None:
        raise RuntimeError("METEOR 1.5 needs a `java` executable and pycocoevalcap's meteor-1.5.jar")

    def clean(words: list[str]) -> str:  # "|||" separates fields in the jar's protocol
        return " ".join(words).replace("|||", " ")

    score_lines = [
        "SCORE ||| " + " ||| ".join(clean(r) for r in input_refs) + " ||| " + clean(hyp)
        for hyp, input_refs in zip(hyps, refs)
    ]
    cmd = [java, _JAVA_HEAP, "-Dfile.encoding=UTF-8", "-jar", str(jar), "-", "-", "-stdio", "-l", "en", "-norm"]
    if modules is not None:
        cmd += ["-m", " ".join(modules)]
    with tempfile.TemporaryFile() as stderr:
        try:
            proc = subprocess.Popen(
                cmd,
                cwd=jar.parent,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                encoding="utf-8",
            )
        except OSError as err:
            raise RuntimeError(f"cannot start java: {err}") from err
        try:
            stats = _exchange(proc, score_lines)  # one statistics line per SCORE line
            outputs = _exchange(proc, ["EVAL ||| " + " ||| ".join(stats)], n_out=len(stats) + 1)
            proc.stdin.close()
            proc.wait(timeout=60)
            return float(outputs[-1])  # segment scores, then the corpus score
        except (RuntimeError, ValueError, OSError, subprocess.TimeoutExpired) as err:
            proc.kill()
            proc.wait()
            stderr.seek(0)
            tail = stderr.read().decode("utf-8", "replace").strip().splitlines()[-3:]
            raise RuntimeError(f"METEOR jar: {err}; stderr: {' / '.join(tail)}") from err


def _exchange(proc: subprocess.Popen, lines: list[str], n_out: int | None = None) -> list[str]:
    """Write ``lines`` from a thread (no pipe deadlock) while reading ``n_out`` answer lines."""

    def write() -> None:
        try:
            for line in lines:
                proc.stdin.write(line + "\n")
            proc.stdin.flush()
        except OSError:  # the process died; the reader reports it
            pass

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    answers = []
    for _ in range(len(lines) if n_out is None else n_out):
        answer = proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"the process ended early (exit code {proc.poll()})")
        answers.append(answer.strip())
    writer.join()
    return answers
