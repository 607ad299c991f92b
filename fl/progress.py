"""How far a run of rounds is: elapsed time and an estimate of what remains."""

from __future__ import annotations

import time


def duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``1h02m``."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


class Progress:
    """Elapsed time and an estimate of what remains, for ``total`` steps of which
    ``done_before`` were done before this process started (a resumed run).

    The estimate starts at the second step done here and uses the pace since the first
    ended: the first carries the run's start-up (sites joining, connections, the feature
    statistics' sum), which the later steps do not repeat."""

    def __init__(self, total: int, done_before: int = 0) -> None:
        self.total = total
        self.done_before = done_before
        self.started = time.monotonic()
        self._first: tuple[int, float] | None = None  # (step, time) of the first done here

    def __call__(self, done: int) -> str:
        now = time.monotonic()
        elapsed = now - self.started
        if done <= self.done_before or done >= self.total:
            return f"elapsed {duration(elapsed)}"
        if self._first is None:
            self._first = (done, now)
        first, at = self._first
        if done == first:
            return f"elapsed {duration(elapsed)}"
        left = (now - at) / (done - first) * (self.total - done)
        return f"elapsed {duration(elapsed)}, about {duration(left)} left"
