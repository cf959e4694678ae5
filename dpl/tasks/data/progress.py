"""Progress of tokenizing a large split, where no progress bar shows it (output to a file: ``datasets``' bars are
off; the generation modules have none): a line on dpl's logger every :data:`INTERVAL` seconds, e.g.
``dpl: tokenizing train: 400,000 of 2,000,000 rows (10 s)``, and one when a split that took that long is done."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

log = logging.getLogger(__name__)

#: seconds between two progress lines
INTERVAL = 10.0
#: rows tokenized in one call of the tokenizer, between which progress is counted
CHUNK = 10_000

T = TypeVar("T")


class RowProgress:
    """Counts the rows of ``total`` done; logs a line once ``interval`` seconds (default :data:`INTERVAL`) passed since
    the start or the last line."""

    def __init__(self, what: str, total: int, interval: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.what, self.total, self.clock = what, total, clock
        self.interval = INTERVAL if interval is None else interval
        self.done = 0
        self.start = self.last = clock()

    def advance(self, rows: int) -> None:
        self.done += rows
        now = self.clock()
        if now - self.last >= self.interval and self.done < self.total:
            self.last = now
            log.info("dpl: %s: %s of %s rows (%.0f s)", self.what, f"{self.done:,}", f"{self.total:,}",
                     now - self.start)

    def finish(self) -> None:
        """The closing line, where a progress line was due at least once."""
        elapsed = self.clock() - self.start
        if elapsed >= self.interval:
            log.info("dpl: %s: %s rows in %.0f s", self.what, f"{self.total:,}", elapsed)


def in_chunks(encode: Callable[[Sequence[Any]], list[T]], items: Sequence[Any], what: str) -> list[T]:
    """``encode(items)``, called on :data:`CHUNK` items at a time (the same result for an ``encode`` that treats each
    item alone, as a tokenizer without padding does), with progress lines."""
    if len(items) <= CHUNK:
        return encode(items)
    progress, out = RowProgress(what, len(items)), []
    for start in range(0, len(items), CHUNK):
        chunk = items[start:start + CHUNK]
        out += encode(chunk)
        progress.advance(len(chunk))
    progress.finish()
    return out
