"""Epsilon for the current step without waiting on the accountant.

A PRV evaluation costs 30-300 ms; a training step may take 50 ms. :class:`EpsilonSchedule` answers
``epsilon(steps)`` for a fixed mechanism from values a background thread computes ahead, in order, on a grid of
step counts (every count up to 1 / spacing, then ratio ``1 + spacing``) up to the largest count asked so far
(the plan's total, asked at setup), from the second question on (a one-off question starts no thread). A count
between grid points gets the value of the next grid point: an upper bound (epsilon grows with the steps), at most
~``spacing / 2`` above the exact value (epsilon grows about as the square root of the steps). A count with no
known value up to its grid point (the plan's total at setup, the first step) is computed exactly in the caller;
a step that outruns the thread waits for it.
"""

from __future__ import annotations

import atexit
import bisect
import math
import threading
import weakref
from collections.abc import Callable


_running: weakref.WeakSet[EpsilonSchedule] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """Let every schedule's thread finish its evaluation before the interpreter shuts down (a thread still inside
    native code at shutdown aborts the process)."""
    for schedule in list(_running):
        schedule.stop()


class EpsilonSchedule:
    """``schedule(steps)``: an upper bound on ``epsilon_of(steps)`` (exact on the grid), computed ahead.

    Args:
        epsilon_of: epsilon after a number of steps, increasing in it (e.g. a PRV evaluation).
        spacing: relative spacing of the grid of step counts (0.05: at most ~2.5% above the exact epsilon).
    """

    def __init__(self, epsilon_of: Callable[[int], float], spacing: float = 0.05) -> None:
        if not spacing > 0:
            raise ValueError(f"spacing must be > 0, got {spacing}")
        self.epsilon_of, self.spacing = epsilon_of, spacing
        self._values: dict[int, float] = {}
        self._known: list[int] = []  # the keys of _values, sorted
        self._next = 1  # the next grid point the thread computes
        self._horizon = 0  # the thread computes grid points up to this one
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._largest = 0  # the largest count asked so far

    def grid_point(self, steps: int) -> int:
        """The smallest grid step count >= ``steps``: every count up to 1 / spacing, then ceil(e^(k l) / spacing)
        with l = log(1 + spacing), k = 1, 2, ... (consecutive points at least 1 apart)."""
        if steps <= 1 / self.spacing:
            return steps
        rate = math.log1p(self.spacing)
        k = math.floor(math.log(steps * self.spacing) / rate)
        while math.ceil(math.exp(k * rate) / self.spacing) < steps:
            k += 1
        return math.ceil(math.exp(k * rate) / self.spacing)

    def exact(self, steps: int) -> float:
        """epsilon_of(steps), computed once (a race computes it twice: harmless)."""
        value = self._values.get(steps)
        if value is None:
            value = float(self.epsilon_of(steps))
            with self._changed:
                if steps not in self._values:
                    self._values[steps] = value
                    bisect.insort(self._known, steps)
                self._changed.notify_all()
        return value

    def _known_bound(self, steps: int) -> float | None:
        """The value at the smallest known count in [steps, its grid point], if any."""
        i = bisect.bisect_left(self._known, steps)
        if i < len(self._known) and self._known[i] <= self.grid_point(steps):
            return self._values[self._known[i]]
        return None

    def __call__(self, steps: int) -> float:
        """An upper bound on epsilon after ``steps`` steps (exact at grid points and at counts first asked beyond
        them), at most ~spacing / 2 above the exact value."""
        if steps <= 0:
            return 0.0
        value = self._known_bound(steps)
        if value is None and self.grid_point(steps) <= self._horizon:
            with self._changed:  # the thread will compute it: wait
                while (value := self._known_bound(steps)) is None and self._thread is not None:
                    self._changed.wait(1.0)
        if value is None:
            value = self.exact(steps)
        if self._largest:  # asked again: a training loop, worth computing ahead (a one-off question is not)
            self._ahead(self.grid_point(max(self._largest, steps + 1)))
        self._largest = max(self._largest, steps)
        return value

    def stop(self) -> None:
        """Stop computing ahead (after the evaluation under way)."""
        with self._changed:
            self._horizon, thread = 0, self._thread
        if thread is not None:
            thread.join()

    def _ahead(self, horizon: int) -> None:
        """Have the thread compute every grid point up to ``horizon``."""
        with self._changed:
            self._horizon = max(self._horizon, horizon)
            _running.add(self)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="dpl-epsilon", daemon=True)
                self._thread.start()

    def _work(self) -> None:
        point = None
        try:
            while True:
                with self._changed:
                    point = self._next
                    if point > self._horizon:
                        self._thread = None
                        self._changed.notify_all()
                        return
                    self._next = self.grid_point(point + 1)
                self.exact(point)
        except BaseException:  # the caller computes what it needs itself (and sees the error)
            with self._changed:
                self._next, self._thread = point, None
                self._changed.notify_all()
            raise
