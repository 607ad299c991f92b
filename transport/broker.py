"""Embedded pure-Python asyncio MQTT broker: the zero-install default broker of ``secagg``.

Why it exists: ``secagg simulate`` and the tests must run with no broker installed, yet the
transport must speak real MQTT so the same driver works against Mosquitto in production.
The broker is not trusted by the protocol (shares are AEAD encrypted, inputs masked), but it
still authenticates clients and can confine each site to its own topics, so a leaked
site credential cannot be used to read or spoof another site's traffic.

What it implements (and what it deliberately does not):

* MQTT 3.1.1 (protocol level 4) and MQTT 3.1 (level 3, ``MQIsdp``). MQTT 5 (level 5) is
  refused with a v5-format CONNACK, reason code 0x84 "Unsupported Protocol Version", so a
  v5 client can fall back to 3.1.1; any other level gets the 3.1.1 code 0x01.
* Username/password authentication, on by default (``hmac.compare_digest``); failures get
  CONNACK 0x05 "not authorized" and the connection is closed.
* Optional per-user topic ACL (:class:`TopicAcl` mapping or a callable). A refused PUBLISH
  is acknowledged (so a QoS 1 client does not retransmit forever) but not routed, and is
  logged; a refused SUBSCRIBE gets SUBACK 0x80.
* QoS 0 and 1 in both directions. Inbound QoS 2 completes the PUBREC/PUBREL/PUBCOMP
  handshake (a retransmitted PUBLISH with a pending id is not routed twice); outbound
  delivery is capped at QoS 1: SUBSCRIBE requests for QoS 2 are granted QoS 1.
* Clean sessions only: ``clean session = 0`` is accepted but treated as clean (CONNACK
  session-present is always 0, nothing is queued for offline clients).
* Wildcard subscriptions, retained messages, PINGREQ, keepalive (1.5 x), last will on any
  close that is not a DISCONNECT (lost TCP connection, keepalive expiry, protocol error,
  slow-consumer drop, client-id takeover), duplicate client id closes the old connection.
* Bounded per-connection outbound queues: a publisher waits (TCP back-pressure) while a
  subscriber's queue is full, and the subscriber is dropped once it stays full for
  ``slow_consumer_timeout`` seconds, so one stuck consumer never blocks the broker forever.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import os
import secrets
import signal
import ssl
import sys
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = [
    "DEFAULT_MAX_PAYLOAD",
    "MQTT_MAX_REMAINING_LENGTH",
    "AclCallable",
    "AclEntry",
    "AclSpec",
    "BrokerConfigError",
    "BrokerError",
    "BrokerStartError",
    "BrokerStats",
    "BrokerThread",
    "EmbeddedBroker",
    "TopicAcl",
    "filter_covers",
    "main",
    "topic_matches",
    "validate_topic_filter",
    "validate_topic_name",
]

logger = logging.getLogger(__name__)

MQTT_MAX_REMAINING_LENGTH = 268_435_455
"""Largest remaining length the 4-byte MQTT varint can encode (256 MiB - 1)."""
DEFAULT_MAX_PAYLOAD = MQTT_MAX_REMAINING_LENGTH

# Packet types (high nibble of the first byte).
_CONNECT, _CONNACK, _PUBLISH, _PUBACK, _PUBREC, _PUBREL, _PUBCOMP = 1, 2, 3, 4, 5, 6, 7
_SUBSCRIBE, _SUBACK, _UNSUBSCRIBE, _UNSUBACK, _PINGREQ, _PINGRESP, _DISCONNECT = (
    8, 9, 10, 11, 12, 13, 14,
)
# Fixed-header flags the spec mandates for each client->server packet type.
_REQUIRED_FLAGS = {
    _CONNECT: 0, _PUBACK: 0, _PUBREC: 0, _PUBREL: 2, _PUBCOMP: 0,
    _SUBSCRIBE: 2, _UNSUBSCRIBE: 2, _PINGREQ: 0, _DISCONNECT: 0,
}
# CONNACK return codes (3.1.1).
_RC_ACCEPTED, _RC_BAD_PROTOCOL, _RC_BAD_CLIENT_ID, _RC_NOT_AUTHORIZED = 0x00, 0x01, 0x02, 0x05
_V5_UNSUPPORTED_PROTOCOL = 0x84
_SUBACK_FAILURE = 0x80
# Largest non-payload part of a PUBLISH: topic (2 + 65535) + packet id (2).
_PUBLISH_OVERHEAD = 2 + 65_535 + 2
_PINGRESP_PACKET = bytes([_PINGRESP << 4, 0])
_STAGE_SIZE = 256 << 10  # staging buffer for small packets and headers
_DIRECT_READ = 64 << 10  # bodies larger than this are received in place
_WRITE_HIGH_WATER = 1 << 20
_WRITE_CHUNK = 1 << 20

Action = Literal["publish", "subscribe"]
AclCallable = Callable[[str, Action, str], bool]
"""``(username, action, topic_or_filter) -> allowed``; called for every PUBLISH/SUBSCRIBE."""


class BrokerError(Exception):
    """Base class of the embedded broker's errors."""


class BrokerConfigError(BrokerError, ValueError):
    """The broker was configured in a way that cannot work; the message says what to change."""


class BrokerStartError(BrokerError, RuntimeError):
    """The broker could not bind or start (port in use, bad TLS context, ...)."""


class _ProtocolViolation(Exception):
    """The peer broke the MQTT spec; its connection is closed, nothing else is affected."""


# --------------------------------------------------------------------------- topics


def validate_topic_name(topic: str) -> None:
    """Raise ``ValueError`` unless ``topic`` is a valid PUBLISH topic (no wildcards)."""
    if not topic:
        raise ValueError("topic name must not be empty")
    if "+" in topic or "#" in topic:
        raise ValueError(f"topic name {topic!r} must not contain the wildcards + or #")
    if "\x00" in topic:
        raise ValueError("topic name must not contain U+0000")


def validate_topic_filter(topic_filter: str) -> None:
    """Raise ``ValueError`` unless ``topic_filter`` is a valid subscription filter.

    ``+`` must occupy a whole level and ``#`` must be the whole last level, as in the spec.
    """
    if not topic_filter:
        raise ValueError("topic filter must not be empty")
    if "\x00" in topic_filter:
        raise ValueError("topic filter must not contain U+0000")
    levels = topic_filter.split("/")
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != len(levels) - 1):
            raise ValueError(f"in {topic_filter!r}, '#' must be the whole last level")
        if "+" in level and level != "+":
            raise ValueError(f"in {topic_filter!r}, '+' must be a whole level")


def _match_levels(filter_levels: Sequence[str], topic_levels: Sequence[str]) -> bool:
    if topic_levels and topic_levels[0].startswith("$") and filter_levels[0] in ("+", "#"):
        # Spec 4.7.2: wildcards at the first level never match $-topics ($SYS, ...).
        return False
    n_topic = len(topic_levels)
    for i, level in enumerate(filter_levels):
        if level == "#":
            return True
        if i >= n_topic or (level != "+" and level != topic_levels[i]):
            return False
    return len(filter_levels) == n_topic


def topic_matches(topic_filter: str, topic: str) -> bool:
    """True when PUBLISH ``topic`` matches subscription ``topic_filter`` (``+``/``#`` rules)."""
    return _match_levels(topic_filter.split("/"), topic.split("/"))


def filter_covers(pattern: str, topic_filter: str) -> bool:
    """True when every topic matched by ``topic_filter`` is also matched by ``pattern``.

    Used for SUBSCRIBE ACLs: a site allowed to read ``secagg/+/site-1/#`` may subscribe to
    ``secagg/r7/site-1/#`` but not to ``secagg/#``.
    """
    p_levels = pattern.split("/")
    f_levels = topic_filter.split("/")
    for i, p in enumerate(p_levels):
        if p == "#":
            return True
        if i >= len(f_levels):
            return False
        f = f_levels[i]
        if f == "#":
            return False
        if p == "+":
            continue
        if f == "+" or f != p:
            return False
    # A longer filter reaches deeper levels than a wildcard-free pattern tail allows.
    return len(f_levels) == len(p_levels)


# --------------------------------------------------------------------------- ACL


@dataclass(frozen=True)
class TopicAcl:
    """Topic patterns one user may subscribe to (read) and publish to (write).

    Patterns use MQTT wildcards; ``%u`` is replaced by the username and ``%c`` by the client
    id (as in Mosquitto's ``pattern`` lines). A tuple ``(read_patterns, write_patterns)`` is
    accepted wherever a ``TopicAcl`` is, in that order (Mosquitto's read/write).
    """

    subscribe: tuple[str, ...] = ()
    publish: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("subscribe", "publish"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise BrokerConfigError(
                    f"TopicAcl.{name} must be a sequence of patterns, not the string "
                    f"{value!r}; wrap it in a list"
                )
            patterns = tuple(value)
            for pattern in patterns:
                try:
                    validate_topic_filter(pattern)
                except ValueError as exc:
                    raise BrokerConfigError(f"bad ACL pattern in TopicAcl.{name}: {exc}") from exc
            object.__setattr__(self, name, patterns)

    @classmethod
    def coerce(cls, value: TopicAcl | tuple[Sequence[str], Sequence[str]]) -> TopicAcl:
        """Accept a ``TopicAcl`` or a ``(read_patterns, write_patterns)`` tuple."""
        if isinstance(value, TopicAcl):
            return value
        if isinstance(value, tuple) and len(value) == 2:
            read, write = value
            return cls(subscribe=tuple(read), publish=tuple(write))
        raise BrokerConfigError(
            f"ACL entry {value!r} must be a TopicAcl or a (read_patterns, write_patterns) tuple"
        )

    def allows(self, action: Action, topic: str, username: str, client_id: str) -> bool:
        """Whether ``username``/``client_id`` may publish to or subscribe with ``topic``."""
        patterns = self.publish if action == "publish" else self.subscribe
        for raw in patterns:
            pattern = _substitute(raw, username, client_id)
            if pattern is None:
                continue
            if action == "publish":
                if topic_matches(pattern, topic):
                    return True
            elif filter_covers(pattern, topic):
                return True
        return False


def _substitute(pattern: str, username: str, client_id: str) -> str | None:
    """Expand ``%u``/``%c``; None when the value would inject a wildcard or a level."""
    for token, value in (("%u", username), ("%c", client_id)):
        if token in pattern:
            if not value or any(ch in value for ch in "+#/"):
                return None
            pattern = pattern.replace(token, value)
    return pattern


AclEntry = TopicAcl | tuple[Sequence[str], Sequence[str]]
AclSpec = AclCallable | Mapping[str, AclEntry]
"""A callable ``(username, action, topic) -> bool`` or a mapping username -> TopicAcl."""


class _AclPolicy:
    """Normalised ACL: None allows everything; unknown users of a mapping get nothing."""

    def __init__(self, spec: AclSpec | None) -> None:
        self._callable: AclCallable | None = None
        self._table: dict[str, TopicAcl] | None = None
        if spec is None:
            return
        if isinstance(spec, Mapping):
            self._table = {user: TopicAcl.coerce(entry) for user, entry in spec.items()}
        elif callable(spec):
            self._callable = spec
        else:
            raise BrokerConfigError(
                f"acl must be None, a mapping username -> TopicAcl or a callable, "
                f"not {type(spec).__name__}"
            )

    def allowed(self, username: str, client_id: str, action: Action, topic: str) -> bool:
        if self._callable is not None:
            try:
                return bool(self._callable(username, action, topic))
            except Exception:
                # A buggy ACL must fail closed, not crash the connection handler.
                logger.exception("ACL callable raised for %s %s %r; denying", username, action,
                                 topic)
                return False
        if self._table is None:
            return True
        entry = self._table.get(username)
        return entry is not None and entry.allows(action, topic, username, client_id)


# --------------------------------------------------------------------------- stats


@dataclass
class BrokerStats:
    """Counters for reports: payload bytes only (headers excluded), messages per direction."""

    connections_total: int = 0
    connections_current: int = 0
    messages_in: int = 0
    bytes_in: int = 0
    messages_out: int = 0
    bytes_out: int = 0
    retained_messages: int = 0
    auth_failures: int = 0
    acl_denials: int = 0
    protocol_errors: int = 0
    slow_consumers_dropped: int = 0
    wills_published: int = 0

    def as_dict(self) -> dict[str, int]:
        """JSON-friendly copy for benchmark and simulation reports."""
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- wire helpers


def _encode_remaining_length(length: int) -> bytes:
    out = bytearray()
    while True:
        byte = length & 0x7F
        length >>= 7
        if length:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _u16(buf: bytes, off: int) -> tuple[int, int]:
    if off + 2 > len(buf):
        raise _ProtocolViolation("packet truncated inside a 2-byte integer")
    return (buf[off] << 8) | buf[off + 1], off + 2


def _binary(buf: bytes, off: int) -> tuple[bytes, int]:
    length, off = _u16(buf, off)
    end = off + length
    if end > len(buf):
        raise _ProtocolViolation("length-prefixed field runs past the end of the packet")
    return buf[off:end], end


def _string(buf: bytes, off: int) -> tuple[str, int]:
    raw, off = _binary(buf, off)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _ProtocolViolation("string field is not valid UTF-8") from exc
    if "\x00" in text:
        raise _ProtocolViolation("string field contains U+0000")
    return text, off


def _ack_packet(packet_type: int, packet_id: int, flags: int = 0) -> bytes:
    return bytes([(packet_type << 4) | flags, 2, packet_id >> 8, packet_id & 0xFF])


@dataclass(frozen=True)
class _Message:
    """A routed PUBLISH; ``payload`` is shared (never copied) between all subscribers."""

    topic: str
    topic_bytes: bytes
    payload: bytes | memoryview
    qos: int
    retain: bool

    @classmethod
    def build(cls, topic: str, payload: bytes | memoryview, qos: int, retain: bool) -> _Message:
        return cls(topic, len(topic.encode()).to_bytes(2, "big") + topic.encode(), payload,
                   qos, retain)


@dataclass(frozen=True)
class _ConnectRequest:
    client_id: str
    clean_session: bool
    keepalive: int
    will: _Message | None
    username: str | None
    password: bytes | None


# --------------------------------------------------------------------------- stream


class _Stream(asyncio.BufferedProtocol):
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


class _Outbox:
    """Bounded outbound queue drained by one writer task per connection.

    Why not write straight to the transport: the transport buffer grows without limit, so a
    consumer that stops reading would make the broker hold every message for it. Here a
    publisher waits while the queue is over ``limit`` (back-pressure through TCP) and gives
    up after ``timeout`` seconds, at which point the consumer is dropped.
    """

    def __init__(self, stream: _Stream, limit: int, timeout: float) -> None:
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


# --------------------------------------------------------------------------- connection


class _Connection:
    """One client connection: reads and dispatches packets, owns the outbox and the will."""

    def __init__(self, broker: EmbeddedBroker, stream: _Stream) -> None:
        self.broker = broker
        self.stream = stream
        self.peer = stream.peer
        self.client_id = ""
        self.username = ""
        self.keepalive = 0
        self.connected = False
        self.registered = False
        self.clean_disconnect = False
        self.closed = False
        self.busy = False
        self.will: _Message | None = None
        self.subscriptions: dict[str, tuple[list[str], int]] = {}
        self.outbox = _Outbox(stream, broker.max_queued_bytes, broker.slow_consumer_timeout)
        self._next_packet_id = 0
        self._qos2_pending: set[int] = set()
        self.writer_task: asyncio.Task[None] | None = None
        self.watchdog_task: asyncio.Task[None] | None = None
        self._loop = asyncio.get_running_loop()
        self.last_activity = self._loop.time()

    def __repr__(self) -> str:
        return f"<client {self.client_id or '?'} user={self.username or '?'} peer={self.peer}>"

    # -- lifecycle ---------------------------------------------------------------------

    def abort(self) -> None:
        """Close at once, discarding queued output (takeover, slow consumer, shutdown)."""
        if not self.closed:
            self.closed = True
            self.outbox.close(discard=True)
            self.stream.abort()

    def start_watchdog(self) -> None:
        if self.watchdog_task is not None:
            self.watchdog_task.cancel()
        self.watchdog_task = self._loop.create_task(self._watchdog())

    async def _watchdog(self) -> None:
        """Close connections that never send CONNECT or miss their keepalive (1.5 x)."""
        while not self.closed:
            if self.connected:
                if self.keepalive == 0:
                    return
                limit = 1.5 * self.keepalive
            else:
                limit = self.broker.connect_timeout
            if self.busy:
                # Waiting for a slow subscriber is the broker's doing, not the client's.
                self.last_activity = self._loop.time()
            idle = self._loop.time() - self.last_activity
            if idle >= limit:
                logger.warning("%r: no packet for %.1f s (limit %.1f s); closing", self, idle,
                               limit)
                self.abort()
                return
            await asyncio.sleep(limit - idle)

    # -- reading -----------------------------------------------------------------------

    async def read_packet(self) -> tuple[int, int, bytes]:
        """Read one packet with bounded size; raise on malformed framing."""
        first = await self.stream.readexactly(1)
        self.last_activity = self._loop.time()
        packet_type, flags = first[0] >> 4, first[0] & 0x0F
        length = 0
        for shift in (0, 7, 14, 21):
            byte = (await self.stream.readexactly(1))[0]
            length |= (byte & 0x7F) << shift
            if not byte & 0x80:
                break
        else:
            raise _ProtocolViolation("remaining length is longer than 4 bytes")
        if packet_type == _PUBLISH:
            limit = min(self.broker.max_payload + _PUBLISH_OVERHEAD, MQTT_MAX_REMAINING_LENGTH)
        elif packet_type in _REQUIRED_FLAGS:
            limit = self.broker.max_control_packet
        else:
            raise _ProtocolViolation(f"packet type {packet_type} is not valid from a client")
        if length > limit:
            raise _ProtocolViolation(f"packet of {length} bytes exceeds the limit of {limit}")
        if packet_type != _PUBLISH and flags != _REQUIRED_FLAGS[packet_type]:
            raise _ProtocolViolation(f"bad fixed-header flags {flags:#x} for type {packet_type}")
        body = await self.stream.readexactly(length) if length else b""
        self.last_activity = self._loop.time()
        return packet_type, flags, body

    async def serve(self) -> None:
        """CONNECT handshake, then the packet loop until DISCONNECT or an error."""
        packet_type, _, body = await self.read_packet()
        if packet_type != _CONNECT:
            raise _ProtocolViolation("first packet was not CONNECT")
        if not await self._on_connect(body):
            return
        while True:
            packet_type, flags, body = await self.read_packet()
            if packet_type == _PUBLISH:
                await self._on_publish(flags, body)
            elif packet_type == _SUBSCRIBE:
                await self._on_subscribe(body)
            elif packet_type == _UNSUBSCRIBE:
                self._on_unsubscribe(body)
            elif packet_type == _PINGREQ:
                self._send(_PINGRESP_PACKET)
            elif packet_type == _PUBREL:
                packet_id, _ = _u16(body, 0)
                self._qos2_pending.discard(packet_id)
                self._send(_ack_packet(_PUBCOMP, packet_id))
            elif packet_type in (_PUBACK, _PUBREC, _PUBCOMP):
                _u16(body, 0)  # validated only: clean sessions keep no outbound state
            elif packet_type == _DISCONNECT:
                self.clean_disconnect = True
                return
            else:
                raise _ProtocolViolation("second CONNECT on one connection")

    def _send(self, packet: bytes) -> None:
        if not self.outbox.put_nowait(packet):
            self.broker._drop_slow(self)

    # -- CONNECT -----------------------------------------------------------------------

    async def _refuse(self, packet: bytes, reason: str) -> bool:
        logger.warning("%r refused at CONNECT: %s", self, reason)
        self.stream.write(packet)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.stream.drain(), 5.0)
        return False

    async def _on_connect(self, body: bytes) -> bool:
        name, off = _string(body, 0)
        if off + 4 > len(body):
            raise _ProtocolViolation("CONNECT variable header truncated")
        level, flags = body[off], body[off + 1]
        if (name, level) not in (("MQTT", 4), ("MQIsdp", 3)):
            if name == "MQTT" and level == 5:
                return await self._refuse(bytes([0x20, 3, 0, _V5_UNSUPPORTED_PROTOCOL, 0]),
                                          "MQTT 5 is not supported; use MQTT 3.1.1")
            if name in ("MQTT", "MQIsdp"):
                return await self._refuse(bytes([0x20, 2, 0, _RC_BAD_PROTOCOL]),
                                          f"unsupported protocol level {level}")
            raise _ProtocolViolation(f"unknown protocol name {name!r}")
        request = self._parse_connect(body, off + 2, flags)
        self.username = request.username or ""
        client_id = request.client_id
        if not client_id:
            if not request.clean_session:
                return await self._refuse(bytes([0x20, 2, 0, _RC_BAD_CLIENT_ID]),
                                          "empty client id needs clean session")
            client_id = "auto-" + secrets.token_hex(8)
        self.client_id = client_id
        if not self.broker._authenticate(request.username, request.password):
            self.broker.stats.auth_failures += 1
            return await self._refuse(bytes([0x20, 2, 0, _RC_NOT_AUTHORIZED]),
                                      f"bad credentials for user {request.username!r}")
        self.keepalive = request.keepalive
        self.will = request.will
        self.connected = True
        self.broker._register(self)
        self.outbox.put_nowait(bytes([0x20, 2, 0, _RC_ACCEPTED]))
        self.broker._spawn_writer(self)
        self.start_watchdog()  # the pre-CONNECT deadline no longer applies
        logger.debug("%r connected (keepalive %d s)", self, self.keepalive)
        return True

    def _parse_connect(self, body: bytes, off: int, flags: int) -> _ConnectRequest:
        if flags & 0x01:
            raise _ProtocolViolation("CONNECT reserved flag is set")
        keepalive, off = _u16(body, off)
        client_id, off = _string(body, off)
        will: _Message | None = None
        will_qos, will_retain = (flags >> 3) & 0x03, bool(flags & 0x20)
        if flags & 0x04:
            if will_qos == 3:
                raise _ProtocolViolation("will QoS 3 is invalid")
            will_topic, off = _string(body, off)
            will_payload, off = _binary(body, off)
            try:
                validate_topic_name(will_topic)
            except ValueError as exc:
                raise _ProtocolViolation(f"bad will topic: {exc}") from exc
            will = _Message.build(will_topic, will_payload, will_qos, will_retain)
        elif will_qos or will_retain:
            raise _ProtocolViolation("will QoS/retain set without the will flag")
        username: str | None = None
        password: bytes | None = None
        if flags & 0x80:
            username, off = _string(body, off)
        if flags & 0x40:
            if username is None:
                raise _ProtocolViolation("password flag set without username flag")
            password, off = _binary(body, off)
        if off != len(body):
            raise _ProtocolViolation("trailing bytes after the CONNECT payload")
        return _ConnectRequest(client_id, bool(flags & 0x02), keepalive, will, username, password)

    # -- PUBLISH -----------------------------------------------------------------------

    async def _on_publish(self, flags: int, body: bytes) -> None:
        qos, retain = (flags >> 1) & 0x03, bool(flags & 0x01)
        if qos == 3:
            raise _ProtocolViolation("PUBLISH with QoS 3")
        topic, off = _string(body, 0)
        try:
            validate_topic_name(topic)
        except ValueError as exc:
            raise _ProtocolViolation(f"bad PUBLISH topic: {exc}") from exc
        packet_id = 0
        if qos:
            packet_id, off = _u16(body, off)
            if packet_id == 0:
                raise _ProtocolViolation("PUBLISH QoS > 0 with packet id 0")
        payload = memoryview(body)[off:]
        if len(payload) > self.broker.max_payload:
            raise _ProtocolViolation(
                f"payload of {len(payload)} bytes exceeds max_payload={self.broker.max_payload}"
            )
        stats = self.broker.stats
        stats.messages_in += 1
        stats.bytes_in += len(payload)
        duplicate_qos2 = qos == 2 and packet_id in self._qos2_pending
        if not duplicate_qos2:
            if self.broker._acl.allowed(self.username, self.client_id, "publish", topic):
                self.busy = True
                try:
                    await self.broker._route(_Message.build(topic, payload, qos, retain))
                finally:
                    self.busy = False
            else:
                stats.acl_denials += 1
                logger.warning("%r: PUBLISH to %r denied by ACL; dropped", self, topic)
        if qos == 1:
            self._send(_ack_packet(_PUBACK, packet_id))
        elif qos == 2:
            self._qos2_pending.add(packet_id)
            self._send(_ack_packet(_PUBREC, packet_id))

    async def deliver(self, message: _Message, qos: int, retain: bool) -> None:
        """Queue ``message`` for this client; drops the client if it stays too slow."""
        if self.closed:
            return
        remaining = len(message.topic_bytes) + len(message.payload)
        first = (_PUBLISH << 4) | (qos << 1) | int(retain)
        if qos:
            self._next_packet_id = self._next_packet_id % 0xFFFF + 1
            remaining += 2
            header = (bytes([first]) + _encode_remaining_length(remaining) + message.topic_bytes
                      + self._next_packet_id.to_bytes(2, "big"))
        else:
            header = bytes([first]) + _encode_remaining_length(remaining) + message.topic_bytes
        if await self.outbox.put(header, message.payload):
            stats = self.broker.stats
            stats.messages_out += 1
            stats.bytes_out += len(message.payload)
        else:
            self.broker._drop_slow(self)

    def match_qos(self, topic_levels: Sequence[str]) -> int:
        """Highest granted QoS among this client's matching subscriptions, -1 if none."""
        best = -1
        for levels, qos in self.subscriptions.values():
            if qos > best and _match_levels(levels, topic_levels):
                best = qos
        return best

    # -- SUBSCRIBE / UNSUBSCRIBE ---------------------------------------------------------

    async def _on_subscribe(self, body: bytes) -> None:
        packet_id, off = _u16(body, 0)
        if off == len(body):
            raise _ProtocolViolation("SUBSCRIBE without topic filters")
        codes = bytearray()
        granted: list[tuple[list[str], int]] = []
        while off < len(body):
            topic_filter, off = _string(body, off)
            if off >= len(body):
                raise _ProtocolViolation("SUBSCRIBE filter without requested QoS")
            requested = body[off]
            off += 1
            if requested & 0xFC or requested == 3:
                raise _ProtocolViolation("SUBSCRIBE requested QoS byte is invalid")
            code = self._grant(topic_filter, min(requested, 1))
            codes.append(code)
            if code != _SUBACK_FAILURE:
                granted.append((self.subscriptions[topic_filter][0], code))
        suback = (bytes([_SUBACK << 4]) + _encode_remaining_length(2 + len(codes))
                  + packet_id.to_bytes(2, "big") + bytes(codes))
        self._send(suback)
        await self._deliver_retained(granted)

    def _grant(self, topic_filter: str, qos: int) -> int:
        try:
            validate_topic_filter(topic_filter)
        except ValueError as exc:
            logger.warning("%r: bad SUBSCRIBE filter refused: %s", self, exc)
            return _SUBACK_FAILURE
        if not self.broker._acl.allowed(self.username, self.client_id, "subscribe", topic_filter):
            self.broker.stats.acl_denials += 1
            logger.warning("%r: SUBSCRIBE to %r denied by ACL", self, topic_filter)
            return _SUBACK_FAILURE
        self.subscriptions[topic_filter] = (topic_filter.split("/"), qos)
        return qos

    async def _deliver_retained(self, granted: list[tuple[list[str], int]]) -> None:
        if not granted or not self.broker._retained:
            return
        for topic, message in list(self.broker._retained.items()):
            topic_levels = topic.split("/")
            qos = max((q for levels, q in granted if _match_levels(levels, topic_levels)),
                      default=-1)
            if qos >= 0:
                await self.deliver(message, min(qos, message.qos), retain=True)

    def _on_unsubscribe(self, body: bytes) -> None:
        packet_id, off = _u16(body, 0)
        if off == len(body):
            raise _ProtocolViolation("UNSUBSCRIBE without topic filters")
        while off < len(body):
            topic_filter, off = _string(body, off)
            self.subscriptions.pop(topic_filter, None)
        self._send(_ack_packet(_UNSUBACK, packet_id))


# --------------------------------------------------------------------------- broker


class EmbeddedBroker:
    """Pure-Python asyncio MQTT 3.1.1 broker; see the module docstring for what it supports.

    Use it as an async context manager (``async with EmbeddedBroker(users=...) as b``), with
    :meth:`start`/:meth:`stop`, in a background thread (:meth:`run_in_thread`) for
    synchronous callers, or as a process (``python -m transport.broker``).
    """

    def __init__(
        self,
        users: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        acl: AclSpec | None = None,
        *,
        ssl_context: ssl.SSLContext | None = None,
        allow_anonymous: bool = False,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        max_control_packet: int = 1 << 20,
        max_queued_bytes: int = 64 << 20,
        slow_consumer_timeout: float = 60.0,
        connect_timeout: float = 10.0,
    ) -> None:
        if not users and not allow_anonymous:
            raise BrokerConfigError(
                "EmbeddedBroker needs users={'name': 'password', ...}: authentication is on "
                "by default; pass allow_anonymous=True only for throwaway local tests"
            )
        if not 0 < max_payload <= MQTT_MAX_REMAINING_LENGTH:
            raise BrokerConfigError(
                f"max_payload must be in 1..{MQTT_MAX_REMAINING_LENGTH} (the MQTT maximum), "
                f"got {max_payload}"
            )
        if max_queued_bytes <= 0 or slow_consumer_timeout <= 0 or connect_timeout <= 0:
            raise BrokerConfigError(
                "max_queued_bytes, slow_consumer_timeout and connect_timeout must be positive"
            )
        self._users = {name: pw.encode() for name, pw in (users or {}).items()}
        self.host = host
        self._requested_port = port
        self._acl = _AclPolicy(acl)
        self.ssl_context = ssl_context
        self.allow_anonymous = allow_anonymous
        self.max_payload = max_payload
        self.max_control_packet = max_control_packet
        self.max_queued_bytes = max_queued_bytes
        self.slow_consumer_timeout = slow_consumer_timeout
        self.connect_timeout = connect_timeout
        self.stats = BrokerStats()
        self._server: asyncio.Server | None = None
        self._port: int | None = None
        self._clients: dict[str, _Connection] = {}
        self._retained: dict[str, _Message] = {}
        self._handlers: set[asyncio.Task[None]] = set()
        self._connections: set[_Connection] = set()
        self._stopping = False

    # -- public ------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The bound TCP port (the real one when constructed with ``port=0``)."""
        if self._port is None:
            raise BrokerError("broker is not started; use 'async with' or await start()")
        return self._port

    @property
    def url(self) -> str:
        """``mqtt://host:port`` (``mqtts://`` with TLS), for the transport's ``--broker``."""
        scheme = "mqtts" if self.ssl_context is not None else "mqtt"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._server is not None

    async def start(self) -> None:
        """Bind and start accepting connections."""
        if self._server is not None:
            raise BrokerError("broker already started")
        if self.host not in ("127.0.0.1", "::1", "localhost") and self.ssl_context is None:
            logger.warning("embedded broker listens on %s without TLS; passwords travel in "
                           "clear text", self.host)
        try:
            server = await asyncio.get_running_loop().create_server(
                lambda: _Stream(self), self.host, self._requested_port, ssl=self.ssl_context,
            )
        except OSError as exc:
            raise BrokerStartError(
                f"cannot listen on {self.host}:{self._requested_port}: {exc}; pick another "
                "port or port=0 for a free one"
            ) from exc
        self._stopping = False
        self._server = server
        # With a host name resolving to several addresses each socket may get its own port.
        self._port = int(server.sockets[0].getsockname()[1])
        logger.info("embedded MQTT broker listening on %s", self.url)

    async def stop(self) -> None:
        """Stop accepting, close every connection (no wills: the broker is going away)."""
        server, self._server = self._server, None
        if server is None:
            return
        self._stopping = True
        server.close()
        for connection in list(self._connections):
            connection.abort()
        handlers = list(self._handlers)
        if handlers:
            await asyncio.wait(handlers, timeout=5.0)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(server.wait_closed(), 5.0)
        self._clients.clear()
        logger.info("embedded MQTT broker on port %s stopped", self._port)

    async def serve_forever(self) -> None:
        """Run until cancelled (used by the process entry point)."""
        if self._server is None:
            await self.start()
        try:
            await asyncio.Event().wait()
        finally:
            await self.stop()

    async def __aenter__(self) -> EmbeddedBroker:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def run_in_thread(self, start_timeout: float = 10.0) -> BrokerThread:
        """Start the broker on its own event loop in a daemon thread, for synchronous code."""
        return BrokerThread(self, start_timeout)

    # -- internals ---------------------------------------------------------------------

    def _authenticate(self, username: str | None, password: bytes | None) -> bool:
        if self.allow_anonymous and username is None:
            return True
        expected = self._users.get(username or "")
        # Compare even for unknown users so timing does not reveal which names exist.
        ok = hmac.compare_digest(expected or b"\x00" * 16, password or b"")
        return ok and expected is not None and username is not None

    def _register(self, connection: _Connection) -> None:
        old = self._clients.get(connection.client_id)
        if old is not None and old is not connection:
            logger.info("client id %r reconnected; closing its previous connection",
                        connection.client_id)
            old.abort()
        self._clients[connection.client_id] = connection
        connection.registered = True

    def _spawn_writer(self, connection: _Connection) -> None:
        task = asyncio.get_running_loop().create_task(self._run_writer(connection))
        connection.writer_task = task

    async def _run_writer(self, connection: _Connection) -> None:
        try:
            await connection.outbox.run()
        except (ConnectionError, OSError, RuntimeError) as exc:
            logger.debug("%r: write failed: %s", connection, exc)
            connection.abort()

    def _drop_slow(self, connection: _Connection) -> None:
        if connection.closed:
            return
        self.stats.slow_consumers_dropped += 1
        logger.warning("%r: dropped as a slow consumer (%d bytes queued for more than %.0f s)",
                       connection, connection.outbox.queued_bytes, self.slow_consumer_timeout)
        connection.abort()

    async def _route(self, message: _Message) -> None:
        if message.retain:
            if len(message.payload):
                self._retained[message.topic] = dataclasses.replace(message, retain=False)
            else:
                self._retained.pop(message.topic, None)
            self.stats.retained_messages = len(self._retained)
        topic_levels = message.topic.split("/")
        for connection in list(self._clients.values()):
            qos = connection.match_qos(topic_levels)
            if qos >= 0:
                await connection.deliver(message, min(qos, message.qos), retain=False)

    async def _publish_will(self, connection: _Connection) -> None:
        will = connection.will
        if will is None or self._stopping:
            return
        if not self._acl.allowed(connection.username, connection.client_id, "publish",
                                 will.topic):
            self.stats.acl_denials += 1
            logger.warning("%r: will to %r denied by ACL; dropped", connection, will.topic)
            return
        self.stats.wills_published += 1
        logger.debug("%r: publishing will to %r", connection, will.topic)
        await self._route(will)

    def _spawn_handler(self, stream: _Stream) -> None:
        task = asyncio.get_running_loop().create_task(self._handle(stream))
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)

    async def _handle(self, stream: _Stream) -> None:
        """Per-connection task: whatever the peer sends, only this connection is affected."""
        connection = _Connection(self, stream)
        self._connections.add(connection)
        self.stats.connections_total += 1
        self.stats.connections_current += 1
        connection.start_watchdog()
        try:
            if self._stopping:
                return
            await connection.serve()
        except asyncio.IncompleteReadError as exc:
            if exc.partial or exc.expected != 1:
                logger.debug("%r: connection lost inside a packet", connection)
            else:
                logger.debug("%r: connection closed by peer", connection)
        except _ProtocolViolation as exc:
            self.stats.protocol_errors += 1
            logger.warning("%r: protocol violation, closing: %s", connection, exc)
        except (ConnectionError, OSError, ssl.SSLError) as exc:
            logger.debug("%r: connection error: %s", connection, exc)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("%r: unexpected error; connection closed", connection)
        finally:
            if connection.watchdog_task is not None:
                connection.watchdog_task.cancel()
            await self._cleanup(connection)

    async def _cleanup(self, connection: _Connection) -> None:
        was_closed = connection.closed
        connection.closed = True
        connection.outbox.close()
        self._connections.discard(connection)
        self.stats.connections_current -= 1
        if connection.registered and self._clients.get(connection.client_id) is connection:
            del self._clients[connection.client_id]
        writer_task = connection.writer_task
        if connection.connected and not connection.clean_disconnect:
            try:
                await self._publish_will(connection)
            except Exception:
                logger.exception("%r: publishing the will failed", connection)
        if writer_task is not None and not was_closed and connection.clean_disconnect:
            # Let queued acks reach a client that said goodbye, but never wait long.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(writer_task), 1.0)
        if writer_task is not None:
            writer_task.cancel()
        if was_closed:
            connection.stream.abort()
        else:
            connection.stream.close()
        logger.debug("%r: closed", connection)


# --------------------------------------------------------------------------- thread runner


class BrokerThread:
    """An :class:`EmbeddedBroker` running on its own event loop in a daemon thread.

    Why: the CLI and synchronous tests need a broker while their own code blocks; a thread is
    cheaper than a process and the handle stops it deterministically.
    """

    def __init__(self, broker: EmbeddedBroker, start_timeout: float = 10.0) -> None:
        self.broker = broker
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="secagg-mqtt-broker",
                                        daemon=True)
        self._thread.start()
        if not self._ready.wait(start_timeout):
            raise BrokerStartError(f"embedded broker did not start within {start_timeout} s")
        if self._error is not None:
            message = f"embedded broker failed to start: {self._error}"
            raise BrokerStartError(message) from self._error

    def _main(self) -> None:
        async def runner() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop_event = asyncio.Event()
            try:
                await self.broker.start()
            except BaseException as exc:
                self._error = exc
                self._ready.set()
                return
            self._ready.set()
            try:
                await self._stop_event.wait()
            finally:
                await self.broker.stop()

        asyncio.run(runner())

    @property
    def port(self) -> int:
        return self.broker.port

    @property
    def url(self) -> str:
        return self.broker.url

    @property
    def stats(self) -> BrokerStats:
        """A snapshot of the broker's counters (copied: the broker thread keeps counting)."""
        return dataclasses.replace(self.broker.stats)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the broker and join its thread; safe to call twice."""
        loop, event = self._loop, self._stop_event
        if loop is not None and event is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # loop already closed
                loop.call_soon_threadsafe(event.set)
        self._thread.join(timeout)

    def __enter__(self) -> BrokerThread:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


# --------------------------------------------------------------------------- process entry


def _load_json_object(path: str, what: str) -> dict[str, object]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BrokerConfigError(f"cannot read {what} file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise BrokerConfigError(f"{what} file {path} must hold a JSON object")
    return data


def load_users_file(path: str) -> dict[str, str]:
    """Read ``{"username": "password", ...}`` (JSON)."""
    data = _load_json_object(path, "users")
    if not all(isinstance(v, str) for v in data.values()):
        raise BrokerConfigError(f"users file {path}: every password must be a JSON string")
    return {str(k): str(v) for k, v in data.items()}


def load_acl_file(path: str) -> dict[str, TopicAcl]:
    """Read ``{"username": {"subscribe": [...], "publish": [...]}, ...}`` (JSON)."""
    data = _load_json_object(path, "ACL")
    table: dict[str, TopicAcl] = {}
    for user, entry in data.items():
        if not isinstance(entry, dict):
            raise BrokerConfigError(f"ACL file {path}: entry for {user!r} must be an object")
        table[user] = TopicAcl(subscribe=tuple(entry.get("subscribe", ())),
                               publish=tuple(entry.get("publish", ())))
    return table


def _write_port_file(path: str, port: int) -> None:
    # Write-then-rename so a polling reader never sees a half-written number.
    tmp = f"{path}.tmp{os.getpid()}"
    Path(tmp).write_text(f"{port}\n", encoding="utf-8")
    os.replace(tmp, path)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m transport.broker",
        description="Embedded MQTT 3.1.1 broker for secagg (authentication always on).",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--users-file", required=True,
                        help='JSON object {"username": "password", ...}')
    parser.add_argument("--acl-file", help='JSON {"user": {"subscribe": [...], "publish": [...]}}')
    parser.add_argument("--port-file", help="write the bound port here once listening")
    parser.add_argument("--max-payload", type=int, default=DEFAULT_MAX_PAYLOAD)
    parser.add_argument("--certfile", help="PEM certificate: enables TLS (mqtts)")
    parser.add_argument("--keyfile", help="PEM private key for --certfile")
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


async def _serve_process(args: argparse.Namespace) -> None:
    context: ssl.SSLContext | None = None
    if args.certfile:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(args.certfile, args.keyfile)
    broker = EmbeddedBroker(
        users=load_users_file(args.users_file), host=args.host, port=args.port,
        acl=load_acl_file(args.acl_file) if args.acl_file else None, ssl_context=context,
        max_payload=args.max_payload,
    )
    await broker.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(signum, stop.set)
    try:
        if args.port_file:
            _write_port_file(args.port_file, broker.port)
        await stop.wait()
    finally:
        await broker.stop()
        logger.info("final stats: %s", json.dumps(broker.stats.as_dict()))


def main(argv: Sequence[str] | None = None) -> int:
    """Process entry point: ``python -m transport.broker --users-file F --port-file P``."""
    args = _parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(_serve_process(args))
    except BrokerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
