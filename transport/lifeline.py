"""Child processes that end with the process that started them, even when it is SIGKILLed.

A process killed with SIGKILL runs no cleanup, so a child it started (the embedded broker,
a ``secagg simulate`` worker) would run on, orphaned, and a temporary folder holding the
broker's users and ACL files would stay. Each such child watches its parent instead: once
the parent is gone the kernel re-parents the child, ``os.getppid()`` changes, and the
child's ``on_orphaned`` runs (the broker removes its folder and stops; a worker exits). A
thread polls, which works on every POSIX system (Linux's ``PR_SET_PDEATHSIG`` would fire
when the starting *thread* ends, which a broker started from an executor thread must not).
A process whose parent is not the one that started it (a worker forked by multiprocessing's
fork server) watches its starter's pid instead (``watch_process``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

POLL_INTERVAL = 0.2
"""Seconds between two looks at the parent: an orphan ends within about this long."""


def watch_parent(parent_pid: int, on_orphaned: Callable[[], None], *,
                 interval: float = POLL_INTERVAL) -> threading.Thread:
    """Run ``on_orphaned()`` (on a daemon thread) once this process's parent is no longer
    ``parent_pid``: it died, or it had died before this call."""
    if parent_pid <= 0:
        raise ValueError(f"parent_pid must be a process id, got {parent_pid}")

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval)
        on_orphaned()

    thread = threading.Thread(target=watch, name="watch-parent", daemon=True)
    thread.start()
    return thread


def process_alive(pid: int) -> bool:
    """True while process ``pid`` runs (a zombie, dead but not yet reaped, is gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc: os.kill said it exists


def watch_process(pid: int, on_gone: Callable[[], None], *,
                  interval: float = POLL_INTERVAL) -> threading.Thread:
    """Run ``on_gone()`` (on a daemon thread) once process ``pid`` no longer runs: for a
    process whose parent is not the one it must end with."""
    if pid <= 0:
        raise ValueError(f"pid must be a process id, got {pid}")

    def watch() -> None:
        while process_alive(pid):
            time.sleep(interval)
        on_gone()

    thread = threading.Thread(target=watch, name="watch-process", daemon=True)
    thread.start()
    return thread
