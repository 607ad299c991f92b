"""Socket I/O of the embedded broker: a low-copy reading protocol and a bounded outbox.

:class:`Stream` receives packets (large bodies straight into buffers of their own, allocated
piece by piece as the bytes arrive, never at once for a declared length) and records when
bytes last arrived; :class:`Outbox` queues what one connection sends and tells the router
when it is over its limit and whether it is still draining.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from .packets import Buffer

_STAGE_SIZE = 128 << 10  # staging buffer for small packets and headers
_DIRECT_READ = 64 << 10  # bodies larger than this are received in place
PIECE_SIZE = 1 << 20  # a large body arrives in buffers of at most this size
_WRITE_HIGH_WATER = 1 << 20


class Stream(asyncio.BufferedProtocol):
    """Socket protocol whose large reads land directly in the packet's own buffers.

    Why not ``asyncio.StreamReader``: it receives in 256 KiB chunks, appends them to a
    buffer and copies the packet out again, i.e. three copies of every payload byte. Here a
    body larger than ``_DIRECT_READ`` is read with ``recv_into`` straight into pieces of at
    most ``PIECE_SIZE`` bytes, each allocated only when the previous one is full, so a
    header that declares 256 MiB and sends nothing costs one piece, not 256 MiB. Small
    packets go through a staging buffer whose fill level drives ``pause_reading``.
    """

    def __init__(self, on_connect: Callable[[Stream], None]) -> None:
        self._on_connect = on_connect
        self._stage = bytearray()  # allocated when the connection is first read
        self._start = 0
        self._end = 0
        self._pieces: list[bytearray] | None = None
        self._piece: bytearray | None = None
        self._piece_filled = 0
        self._body_left = 0
        self._waiter: asyncio.Future[None] | None = None
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._eof = False
        self._read_paused = False
        self._write_paused = False
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.peer_host = "?"
        self.last_received = time.monotonic()
        """When bytes last arrived (any bytes count as activity)."""

    # -- asyncio callbacks ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = str(peer)
        self.peer_host = str(peer[0]) if isinstance(peer, tuple) and peer else self.peer
        transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER)
        # Nothing is read (or buffered) until the broker serves this connection: one that
        # waits for a login slot costs its socket, not a staging buffer.
        self._pause_reading()
        self._on_connect(self)

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
        if self._pieces is not None and self._body_left:
            if self._piece is None:
                self._piece = bytearray(min(self._body_left, PIECE_SIZE))
                self._piece_filled = 0
            return memoryview(self._piece)[self._piece_filled:]
        if self._end == len(self._stage) and self._start:
            pending = self._end - self._start
            self._stage[:pending] = self._stage[self._start:self._end]
            self._start, self._end = 0, pending
        return memoryview(self._stage)[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        self.last_received = time.monotonic()
        if self._piece is not None:
            self._take_piece_bytes(nbytes)
            return
        self._end += nbytes
        if self._end - self._start == len(self._stage):
            self._pause_reading()
        self._wake()

    def _take_piece_bytes(self, nbytes: int) -> None:
        assert self._pieces is not None and self._piece is not None
        self._piece_filled += nbytes
        self._body_left -= nbytes
        if self._piece_filled == len(self._piece):
            self._pieces.append(self._piece)
            self._piece = None
            if self._body_left == 0:
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
        if not self._stage:
            self._stage = bytearray(_STAGE_SIZE)
        self._resume_reading()
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    @property
    def buffered(self) -> int:
        """Bytes received and not yet consumed (a whole next packet may be among them)."""
        return self._end - self._start

    async def readexactly(self, n: int) -> bytes:
        """Exactly ``n`` bytes (at most the staging size); ``IncompleteReadError`` when the
        peer closes first."""
        if n > _DIRECT_READ:
            raise ValueError("readexactly is for small reads; use read_body")
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

    async def read_body(self, n: int) -> list[bytes | bytearray]:
        """A body of ``n`` bytes as buffers: one ``bytes`` for a small body, else pieces of
        at most ``PIECE_SIZE`` bytes each allocated only once its predecessor is full."""
        if n <= _DIRECT_READ:
            return [await self.readexactly(n)] if n else []
        have = min(self._end - self._start, n)
        self._pieces = []
        self._body_left = n
        self._piece = None
        try:
            if have:
                # What already sits in the staging buffer starts the first piece.
                first = self.get_buffer(have)
                first[:have] = memoryview(self._stage)[self._start:self._start + have]
                self._start += have
                if self._start == self._end:
                    self._start = self._end = 0
                self._take_piece_bytes(have)
            while self._body_left:
                if self._eof:
                    raise asyncio.IncompleteReadError(b"", n)
                await self._wait()
            pieces: list[bytes | bytearray] = list(self._pieces)
            return pieces
        finally:
            self._pieces = None
            self._piece = None
            self._body_left = 0

    # -- writing -------------------------------------------------------------------------

    def write(self, data: Buffer) -> None:
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
    """Outbound queue of one connection, drained by its writer task.

    Never blocks the caller: the router appends, and asks :meth:`over` (a publisher waits
    for a subscriber that is over ``limit`` while it keeps draining, woken by
    ``on_room``). ``progress_at`` is when the writer last got bytes out.
    """

    def __init__(self, stream: Stream, limit: int) -> None:
        self._stream = stream
        self.limit = limit
        self._items: deque[tuple[bytes, tuple[Buffer, ...], int]] = deque()
        self._queued = 0
        self._wakeup = asyncio.Event()
        self.closed = False
        self.progress_at = time.monotonic()
        self.on_room: Callable[[], None] | None = None
        """Called whenever a packet went out and the queue is at or under its limit."""

    @property
    def queued_bytes(self) -> int:
        return self._queued

    def over(self) -> bool:
        return self._queued > self.limit

    def put(self, header: bytes, chunks: tuple[Buffer, ...] = (), size: int = 0) -> None:
        """Queue one packet (``header`` then ``chunks`` of ``size`` bytes in total)."""
        if self.closed:
            return
        total = len(header) + size
        if not self._items:
            self.progress_at = time.monotonic()  # an idle writer has nothing to be late with
        self._items.append((header, chunks, total))
        self._queued += total
        self._wakeup.set()

    def close(self, discard: bool = False) -> None:
        """Stop accepting; ``discard`` drops what is queued (the transport is gone)."""
        self.closed = True
        if discard:
            self._items.clear()
            self._queued = 0
        self._wakeup.set()

    async def run(self) -> None:
        """Write queued packets in order until closed; payload buffers are the ones every
        subscriber shares, written as they are (never copied into one per subscriber)."""
        writer = self._stream
        while True:
            if not self._items:
                if self.closed:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            header, chunks, size = self._items.popleft()
            writer.write(header)
            for chunk in chunks:
                # Each piece written once the previous one drained: the transport would
                # otherwise copy a large payload into its own buffer, once per subscriber.
                writer.write(chunk)
                await writer.drain()
                self.progress_at = time.monotonic()
            if not chunks:
                await writer.drain()
            self.progress_at = time.monotonic()
            self._queued -= size
            if self._queued <= self.limit and self.on_room is not None:
                self.on_room()
