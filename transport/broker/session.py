"""One MQTT session of the embedded broker: subscriptions, QoS 1 in flight, queued messages.

A session is keyed by (username, client id), so only the same user can resume or take it
over. It outlives its connection when the client asked for ``clean session = 0`` (MQTT 3.1.1
section 3.1.2.4): QoS 1 messages that arrive meanwhile are queued (bounded) and, with those
sent but not acknowledged, delivered again on reconnection, the unacknowledged ones with the
DUP flag (section 4.4). Outbound QoS 1 uses a window of ``max_inflight`` distinct packet ids.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from typing import Protocol

from .packets import Message
from .stream import Outbox

SessionKey = tuple[str, str]


class Attachment(Protocol):
    """The connection a session is attached to, as sessions and the router see it."""

    @property
    def outbox(self) -> Outbox: ...

    @property
    def closed(self) -> bool: ...

    def abort(self) -> None:
        """Close at once (a slow consumer, a takeover)."""


class Recent:
    """Keys last seen within ``window`` seconds of the latest (older ones are forgotten in
    amortised constant time per ``note``)."""

    __slots__ = ("_limit", "at")

    def __init__(self) -> None:
        self.at: dict[object, float] = {}
        self._limit = 16

    def note(self, key: object, now: float, window: float) -> None:
        self.at[key] = now
        if len(self.at) > self._limit:
            for old in [k for k, at in self.at.items() if now - at > window]:
                del self.at[old]
            self._limit = max(16, 2 * len(self.at))

    def other_since(self, key: object, since: float) -> bool:
        """Whether a key other than ``key`` was seen at or after ``since``."""
        return any(at >= since for other, at in self.at.items() if other is not key)


class Session:
    """Subscriptions and outbound QoS 1 state of one (username, client id)."""

    def __init__(self, username: str, client_id: str, *, persistent: bool, max_inflight: int,
                 max_queued_bytes: int, max_queue: int) -> None:
        self.username = username
        self.client_id = client_id
        self.persistent = persistent
        self.max_inflight = max_inflight
        self.max_queued_bytes = max_queued_bytes
        self.max_queue = max_queue
        self.subscriptions: dict[str, int] = {}  # filter -> granted QoS
        self.connection: Attachment | None = None
        self._inflight: OrderedDict[int, tuple[Message, bool]] = OrderedDict()
        self._pending: deque[tuple[Message, int, bool]] = deque()
        self._pending_bytes = 0
        self._next_id = 0
        self._room_waiters: deque[asyncio.Future[None]] = deque()
        self.acked_at = time.monotonic()
        self.detached_at = time.monotonic()
        self.dropped = 0
        self.over_since: float | None = None
        self.sources = Recent()  # the connections that delivered to it lately
        """When its queue went over ``max_queued_bytes`` (None while under it): it must be
        back under within ``slow_consumer_timeout`` seconds (``Router.check_drain``)."""

    @property
    def key(self) -> SessionKey:
        return (self.username, self.client_id)

    def __repr__(self) -> str:
        return f"<session {self.client_id} user={self.username}>"

    # -- attachment ----------------------------------------------------------------------

    def attach(self, connection: Attachment) -> int:
        """Bind to a new connection; re-send what was in flight (DUP) and what was queued.
        Returns how many messages were delivered again."""
        self.connection = connection
        connection.outbox.on_room = self.notify_room
        resent = 0
        for packet_id, (message, retain) in self._inflight.items():
            connection.outbox.put(message.header(1, retain, packet_id, dup=True),
                                  message.chunks, message.size)
            resent += 1
        self._fill()
        return resent

    def detach(self) -> None:
        self.connection = None
        self.over_since = None
        self.detached_at = time.monotonic()
        if not self.persistent:
            self._inflight.clear()
            self._pending.clear()
            self._pending_bytes = 0
        for waiter in self._room_waiters:  # nothing to wait for any more
            if not waiter.done():
                waiter.set_result(None)
        self._room_waiters.clear()

    # -- delivery ------------------------------------------------------------------------

    def deliver(self, message: Message, qos: int, retain: bool) -> bool:
        """Queue ``message`` at ``qos``; False when it was dropped (offline QoS 0, or the
        session's queue is full)."""
        connection = self.connection
        if qos == 0:
            if connection is None:
                return False
            connection.outbox.put(message.header(0, retain), message.chunks, message.size)
            return True
        if connection is not None and not self._pending and \
                len(self._inflight) < self.max_inflight:
            self._send(connection, message, retain)
            return True
        if len(self._pending) >= self.max_queue or \
                self._pending_bytes + message.size > self.max_queued_bytes:
            self.dropped += 1
            return False
        self._pending.append((message, qos, retain))
        self._pending_bytes += message.size
        return True

    def _send(self, connection: Attachment, message: Message, retain: bool) -> None:
        packet_id = self._next_id
        for _ in range(0x10000):
            packet_id = packet_id % 0xFFFF + 1
            if packet_id not in self._inflight:
                break
        self._next_id = packet_id
        self._inflight[packet_id] = (message, retain)
        connection.outbox.put(message.header(1, retain, packet_id), message.chunks,
                              message.size)

    def _fill(self) -> None:
        connection = self.connection
        while (connection is not None and self._pending
               and len(self._inflight) < self.max_inflight):
            message, _, retain = self._pending.popleft()
            self._pending_bytes -= message.size
            self._send(connection, message, retain)

    def acknowledged(self, packet_id: int) -> bool:
        """A PUBACK: frees its slot in the window; False for an id not in flight."""
        if self._inflight.pop(packet_id, None) is None:
            return False
        self.acked_at = time.monotonic()
        self._fill()
        self.notify_room()
        return True

    # -- back-pressure -------------------------------------------------------------------

    @property
    def queued_bytes(self) -> int:
        outbox = self.connection.outbox.queued_bytes if self.connection is not None else 0
        return outbox + self._pending_bytes

    def over(self, factor: float = 1.0) -> bool:
        return self.queued_bytes > factor * self.max_queued_bytes

    @property
    def progress_at(self) -> float:
        outbox = self.connection.outbox.progress_at if self.connection is not None else 0.0
        return max(outbox, self.acked_at)

    def notify_room(self) -> None:
        """Wake the first publisher waiting for room, if there is room (it passes the baton
        on after queueing its message: waking every waiter would make them all re-check)."""
        if not self.over():
            self.over_since = None
        waiters = self._room_waiters
        while waiters:
            if waiters[0].done():
                waiters.popleft()
                continue
            if self.over():
                return
            waiters.popleft().set_result(None)
            return

    async def wait_room(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) until this session may have room again."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._room_waiters.append(waiter)
        try:
            await asyncio.wait([waiter], timeout=timeout)
        finally:
            if not waiter.done():
                waiter.cancel()
