"""Socket I/O of the embedded broker: a zero-copy reading protocol and a bounded outbox.

:class:`Stream` receives packets (large bodies straight into their own buffer) and applies
TCP back-pressure; :class:`Outbox` queues what one connection sends, so a consumer that
stops reading is dropped instead of making the broker hold every message for it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transport.broker import EmbeddedBroker

_STAGE_SIZE = 256 << 10  # staging buffer for small packets and headers
_DIRECT_READ = 64 << 10  # bodies larger than this are received in place
_WRITE_HIGH_WATER = 1 << 20
_WRITE_CHUNK = 1 << 20


class Stream(asyncio.BufferedProtocol):
    """Socket protocol whose large reads land directly in the packet's own buffer.

    Why not ``asyncio.StreamReader``: it receives in 256 KiB chunks, appends them to a
    buffer and copies the packet out again, i.e. three copies of every payload byte, and its
    small reads make senders that re-slice their output on every ``send`` (paho does) slow
    down quadratically. Here a body larger than ``_DIRECT_READ`` is read with ``recv_into``
    straight into one ``bytearray`` of the exact size; small packets go through a staging
    buffer whose fill level drives ``pause_reading`` (back-pressure to the sender).
    """

    def __init__(self, broker: EmbeddedBroker) -> None:
        self._broker = broker
        self._stage = bytearray(_STAGE_SIZE)
        self._start = 0
        self._end = 0
        self._body: bytearray | None = None
        self._filled = 0
        self._waiter: asyncio.Future[None] | None = None
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._eof = False
        self._read_paused = False
        self._write_paused = False
        self.transport: asyncio.Transport | None = None
        self.peer = "?"

    # -- asyncio callbacks ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.peer = str(transport.get_extra_info("peername"))
        transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER)
        self._broker._spawn_handler(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = True
        self._wake()
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_exception(ConnectionResetError("connection lost"))
        self._drain_waiters.clear()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return False

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._body is not None:
            return memoryview(self._body)[self._filled:]
        if self._end == len(self._stage) and self._start:
            pending = self._end - self._start
            self._stage[:pending] = self._stage[self._start:self._end]
            self._start, self._end = 0, pending
        return memoryview(self._stage)[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        body = self._body
        if body is not None:
            self._filled += nbytes
            if self._filled == len(body):
                self._body = None  # later bytes belong to the next packet
                self._wake()
            return
        self._end += nbytes
        if self._end - self._start == len(self._stage):
            self._pause_reading()
        self._wake()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._drain_waiters.clear()

    # -- reading -------------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _pause_reading(self) -> None:
        if not self._read_paused and self.transport is not None:
            self._read_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._read_paused and self.transport is not None and not self.transport.is_closing():
            self._read_paused = False
            self.transport.resume_reading()

    async def _wait(self) -> None:
        self._resume_reading()
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def readexactly(self, n: int) -> bytes | bytearray:
        """Exactly ``n`` bytes; ``IncompleteReadError`` when the peer closes first."""
        if n > _DIRECT_READ and self._end - self._start < n:
            return await self._read_direct(n)
        while self._end - self._start < n:
            if self._eof:
                partial = bytes(self._stage[self._start:self._end])
                raise asyncio.IncompleteReadError(partial, n)
            await self._wait()
        out = bytes(memoryview(self._stage)[self._start:self._start + n])
        self._start += n
        if self._start == self._end:
            self._start = self._end = 0
        return out

    async def _read_direct(self, n: int) -> bytearray:
        body = bytearray(n)
        have = self._end - self._start
        body[:have] = memoryview(self._stage)[self._start:self._end]
        self._start = self._end = 0
        self._filled = have
        self._body = body
        try:
            while self._filled < n:
                if self._eof:
                    raise asyncio.IncompleteReadError(bytes(body[:self._filled]), n)
                await self._wait()
        finally:
            self._body = None
        return body

    # -- writing -------------------------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    async def drain(self) -> None:
        """Wait until the transport's buffer is below its low-water mark."""
        if self._eof and (self.transport is None or self.transport.is_closing()):
            raise ConnectionResetError("connection lost")
        if not self._write_paused:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._drain_waiters.append(waiter)
        await waiter

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


# --------------------------------------------------------------------------- outbox


class Outbox:
    """Bounded outbound queue drained by one writer task per connection.

    Why not write straight to the transport: the transport buffer grows without limit, so a
    consumer that stops reading would make the broker hold every message for it. Here a
    publisher waits while the queue is over ``limit`` (back-pressure through TCP) and gives
    up after ``timeout`` seconds, at which point the consumer is dropped.
    """

    def __init__(self, stream: Stream, limit: int, timeout: float) -> None:
        self._stream = stream
        self._limit = limit
        self._timeout = timeout
        self._items: deque[tuple[bytes, bytes | memoryview, int]] = deque()
        self._queued = 0
        self._wakeup = asyncio.Event()
        self._space = asyncio.Event()
        self._space.set()
        self.closed = False

    @property
    def queued_bytes(self) -> int:
        return self._queued

    def put_nowait(self, packet: bytes) -> bool:
        """Queue a small control packet; False when even those overflow (peer not reading)."""
        if self.closed:
            return True
        if self._queued > 2 * self._limit:
            return False
        self._append(packet, b"")
        return True

    async def put(self, header: bytes, payload: bytes | memoryview) -> bool:
        """Queue a PUBLISH, waiting for room; False when the consumer stayed full too long."""
        size = len(header) + len(payload)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        while self._queued and self._queued + size > self._limit and not self.closed:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            self._space.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._space.wait(), remaining)
        if not self.closed:
            self._append(header, payload)
        return True

    def _append(self, header: bytes, payload: bytes | memoryview) -> None:
        size = len(header) + len(payload)
        self._items.append((header, payload, size))
        self._queued += size
        self._wakeup.set()

    def close(self, discard: bool = False) -> None:
        """Stop accepting; ``discard`` drops what is queued (the transport is gone)."""
        self.closed = True
        if discard:
            self._items.clear()
            self._queued = 0
        self._wakeup.set()
        self._space.set()

    async def run(self) -> None:
        """Write queued packets in order until closed; header and payload go out separately
        so the payload object is the same one for every subscriber."""
        writer = self._stream
        while True:
            if not self._items:
                if self.closed:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            header, payload, size = self._items.popleft()
            writer.write(header)
            # Slices, each written once the previous one drained: the transport would
            # otherwise copy a large payload into its own buffer, once per subscriber.
            view = memoryview(payload)
            for start in range(0, len(view), _WRITE_CHUNK):
                writer.write(view[start:start + _WRITE_CHUNK])
                await writer.drain()
            if not view:
                await writer.drain()
            self._queued -= size
            self._space.set()
