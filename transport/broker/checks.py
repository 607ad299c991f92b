"""The embedded broker's password checks: a few threads, shared fairly among peer addresses.

A password check (scrypt) costs tens of milliseconds of CPU; whoever can open TCP
connections can ask for one. :class:`CheckQueue` runs the checks off the event loop in
``workers`` threads, at most ``per_address`` at a time for one peer address, and serves the
checks that wait round robin: across addresses, and within one address across throttle keys
(docs/deployment.md section 9). So one address gets at most ``per_address`` threads of
hashing however many connections it opens, and a check from any other address, or under
another key from the same address, waits for at most a turn of each address (key) that is
waiting too, not for the whole backlog.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")


@dataclass
class _Address:
    running: int = 0
    waiting: OrderedDict[bytes, deque[asyncio.Future[None]]] = field(
        default_factory=OrderedDict)  # per throttle key, in turn order


class CheckQueue:
    """Runs password checks in ``workers`` threads, fairly across addresses and keys."""

    def __init__(self, *, workers: int = 2, per_address: int = 1) -> None:
        self.workers = workers
        self.per_address = per_address
        self.performed = 0
        """Checks run so far (not those whose peer had left when their turn came)."""
        self.peak_per_address = 0
        """The most checks one address ever had running at once."""
        self._running = 0
        self._executor: ThreadPoolExecutor | None = None
        self._addresses: OrderedDict[str, _Address] = OrderedDict()  # busy ones, turn order

    def __len__(self) -> int:
        """Addresses with a check running or waiting (bounded by the pending logins)."""
        return len(self._addresses)

    async def run(self, address: str, key: bytes, check: Callable[[], T],
                  wanted: Callable[[], bool] = lambda: True) -> tuple[T, float]:
        """``check()``'s result once run in a thread, and the loop time it started. When its
        turn comes and ``wanted()`` is false (the peer is gone), it is not run:
        ConnectionAbortedError."""
        loop = asyncio.get_running_loop()
        entry = self._addresses.setdefault(address, _Address())
        if self._running < self.workers and entry.running < self.per_address \
                and not entry.waiting:
            self._start(entry)
        else:
            turn: asyncio.Future[None] = loop.create_future()
            entry.waiting.setdefault(key, deque()).append(turn)
            try:
                await turn
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled():  # granted as we were cancelled
                    self._release(address, entry)
                else:
                    self._forget(address, entry, key, turn)
                raise
        if not wanted():
            self._release(address, entry)
            raise ConnectionAbortedError("the peer left before its password was checked")
        self.performed += 1
        started = loop.time()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.workers,
                                                thread_name_prefix="broker-password-check")
        try:
            future = self._executor.submit(check)
        except BaseException:
            self._release(address, entry)
            raise
        # the thread's slot is free when the check has ended, even if nobody awaits it now
        future.add_done_callback(lambda _: _call_soon(loop, self._release, address, entry))
        return await asyncio.wrap_future(future, loop=loop), started

    def _start(self, entry: _Address) -> None:
        self._running += 1
        entry.running += 1
        self.peak_per_address = max(self.peak_per_address, entry.running)

    def _release(self, address: str, entry: _Address) -> None:
        self._running -= 1
        entry.running -= 1
        self._drop_if_idle(address, entry)
        self._dispatch()

    def _forget(self, address: str, entry: _Address, key: bytes,
                turn: asyncio.Future[None]) -> None:
        queue = entry.waiting.get(key)
        if queue is not None:
            with contextlib.suppress(ValueError):
                queue.remove(turn)
            if not queue:
                del entry.waiting[key]
        self._drop_if_idle(address, entry)

    def _drop_if_idle(self, address: str, entry: _Address) -> None:
        if entry.running == 0 and not entry.waiting and self._addresses.get(address) is entry:
            del self._addresses[address]

    def _dispatch(self) -> None:
        """Give free threads to waiting checks: the next address in turn with room, and its
        next key in turn."""
        while self._running < self.workers:
            chosen = next(((address, entry) for address, entry in self._addresses.items()
                           if entry.waiting and entry.running < self.per_address), None)
            if chosen is None:
                return
            address, entry = chosen
            self._addresses.move_to_end(address)
            key, queue = next(iter(entry.waiting.items()))
            turn = queue.popleft()
            if queue:
                entry.waiting.move_to_end(key)
            else:
                del entry.waiting[key]
            if turn.done():  # cancelled; its task removes nothing more
                self._drop_if_idle(address, entry)
                continue
            self._start(entry)
            turn.set_result(None)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[..., object],
               *args: object) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is closed: nothing waits any more
        loop.call_soon_threadsafe(callback, *args)

