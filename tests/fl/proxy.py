"""A TCP proxy between one party and the broker, for link faults across processes.

It runs its own event loop in a thread of the test process, listens on a loopback port and
forwards every connection to the broker, counting the bytes each way. ``rate`` throttles
what the party receives (bytes per second, broker -> party, as a slow hospital link),
``up_rate`` what it sends;
``reset()`` cuts every open connection (a network partition the party reconnects after).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time


class LinkProxy:
    """``with LinkProxy(broker_port, rate=2e6) as proxy``: connect the party to
    ``proxy.port``; ``proxy.down`` is what it received, ``proxy.up`` what it sent."""

    def __init__(self, broker_port: int, *, rate: float | None = None,
                 up_rate: float | None = None, host: str = "127.0.0.1") -> None:
        self.broker = (host, broker_port)
        self.rate = rate
        self.up_rate = up_rate
        self.down = 0
        self.up = 0
        self.connections = 0
        sock = socket.socket()
        sock.bind((host, 0))
        self.port = sock.getsockname()[1]
        self._sock = sock
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.base_events.Server | None = None

    def __enter__(self) -> LinkProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def reset(self) -> None:
        """Cut every open connection (the party sees a reset and reconnects)."""
        asyncio.run_coroutine_threadsafe(self._close_all(), self._loop).result(10)

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._accept, sock=self._sock)

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._close_all()

    async def _close_all(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.broker)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer, "up"),
                             self._pipe(up_reader, writer, "down"), return_exceptions=True)
        for w in (writer, up_writer):
            self._writers.discard(w)
            w.transport.abort()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    direction: str) -> None:
        started, sent = time.monotonic(), 0
        try:
            while True:
                data = await reader.read(16384)
                if not data:
                    break
                rate = self.rate if direction == "down" else self.up_rate
                if rate:
                    sent += len(data)
                    ahead = sent / rate - (time.monotonic() - started)
                    if ahead > 0:
                        await asyncio.sleep(ahead)
                writer.write(data)
                await writer.drain()
                if direction == "down":
                    self.down += len(data)
                else:
                    self.up += len(data)
        finally:
            with contextlib.suppress(Exception):
                writer.transport.abort()
