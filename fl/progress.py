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
    ``done_before`` were done before this process started (a resumed run)."""

    def __init__(self, total: int, done_before: int = 0) -> None:
        self.total = total
        self.done_before = done_before
        self.started = time.monotonic()

    def __call__(self, done: int) -> str:
        elapsed = time.monotonic() - self.started
        here = done - self.done_before
        if here <= 0 or done >= self.total:
            return f"elapsed {duration(elapsed)}"
        left = elapsed / here * (self.total - done)
        return f"elapsed {duration(elapsed)}, about {duration(left)} left"
