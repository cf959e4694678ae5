"""dpl.allocator: the dpl command keeps freed memory for reuse (glibc), and DPL_MALLOC=system opts out."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

from dpl import cli

PROBE = """
import ctypes, sys, torch
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                              "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
from dpl.allocator import keep_freed_memory
applied = keep_freed_memory()
before = libc.mallinfo2().hblkhd
x = torch.empty(16 << 20)  # 64 MiB
x.fill_(1.0)
mapped = libc.mallinfo2().hblkhd - before
del x
print(applied, mapped >> 20, libc.mallinfo2().fordblks >> 20)
"""


def _probe(**env: str) -> tuple[bool, int, int]:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True,
                         env={**os.environ, **env}).stdout.split()
    return out[0] == "True", int(out[1]), int(out[2])


def _glibc_with_mallinfo2() -> bool:
    try:
        ctypes.CDLL("libc.so.6").mallinfo2  # noqa: B018 - glibc >= 2.33
    except (OSError, AttributeError):
        return False
    return sys.platform.startswith("linux")


@pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="needs glibc >= 2.33 (mallinfo2)")
def test_freed_blocks_stay_in_the_heap_for_reuse():
    applied, mapped, free_kept = _probe(DPL_MALLOC="")
    assert applied
    assert mapped == 0  # 64 MiB served from the heap, not by its own mmap
    assert free_kept >= 64  # and kept after being freed, for the next step to reuse
    applied, mapped, free_kept = _probe(DPL_MALLOC="system")  # glibc's default: its own mmap, unmapped when freed
    assert not applied
    assert mapped >= 64 and free_kept < 64


def test_the_dpl_command_applies_it(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(cli, "keep_freed_memory", lambda: calls.append(1) or True)
    cli.main(["plugins"])
    assert calls == [1]
    assert "dpzero" in capsys.readouterr().out
