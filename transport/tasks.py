"""Stopping asyncio helper tasks without losing a cancellation of the caller.

``task.cancel(); with suppress(CancelledError): await task`` swallows the caller's own
cancellation when it arrives while the caller waits there, and the caller then carries on as
if nothing happened (a Ctrl-C that ``secagg simulate`` never acts on). ``stop_task`` waits
for the child with ``asyncio.wait``, which never raises the child's outcome, so the only
exception that can leave it is the caller's own ``CancelledError``.
"""

from __future__ import annotations

import asyncio
from typing import Any


def retrieve_outcome(future: asyncio.Future[Any]) -> None:
    """A done callback that marks the future's exception as seen (no "exception was never
    retrieved" at shutdown), for futures whose outcome only matters to someone else."""
    if not future.cancelled():
        future.exception()


async def stop_task(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and wait until it has ended, whatever its outcome; a cancellation of
    the calling task propagates (the child is then still cancelled, its outcome dropped)."""
    task.add_done_callback(retrieve_outcome)
    if task.done():
        return
    task.cancel()
    await asyncio.wait({task})



def cancel_requests() -> int:
    """How many cancellations of the current task are pending (0 outside a task)."""
    task = asyncio.current_task()
    return 0 if task is None else task.cancelling()


def raise_if_cancelled(before: int) -> None:
    """Raise ``CancelledError`` when the current task was asked to stop since it counted
    ``before`` (:func:`cancel_requests`) and the request got lost: on Python 3.11
    ``asyncio.wait_for`` (aiomqtt's wait for a CONNACK or SUBACK) returns the result and
    drops a cancellation that arrives as its future completes, and the task then carried on
    (``secagg simulate`` hung in ``stop_task`` on a server that had gone on to wait for its
    round: tests/transport/test_logical_deadlines.py, 1 run in 8 here). Only a request made
    during the call counts: a task already cancelling (a cleanup that still publishes) is
    left to finish."""
    if cancel_requests() > before:
        raise asyncio.CancelledError
