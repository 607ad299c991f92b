"""One client connection of the embedded broker: CONNECT handshake, packet loop, deadlines.

A :class:`Connection` reads packets from its :class:`~transport.broker.stream.Stream`,
checks each fixed header (type and size, before any body is read) against the limits,
decodes with ``transport.broker.packets``, asks the ACL, and hands PUBLISHes to the router.
It talks to the rest of the broker only through the small :class:`BrokerCore` interface.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable
from typing import Protocol, TypeVar

from .auth import Authenticator, LoginBusy, LoginThrottle
from .config import BrokerLimits, BrokerStats
from .packets import (
    CONNECT,
    DISCONNECT,
    PINGREQ,
    PINGRESP_PACKET,
    PUBACK,
    PUBCOMP,
    PUBLISH,
    PUBLISH_OVERHEAD,
    PUBREC,
    PUBREL,
    RC_ACCEPTED,
    RC_BAD_CLIENT_ID,
    RC_BAD_PROTOCOL,
    RC_NOT_AUTHORIZED,
    REQUIRED_FLAGS,
    SUBACK,
    SUBACK_FAILURE,
    SUBSCRIBE,
    UNSUBACK,
    UNSUBSCRIBE,
    V5_UNSUPPORTED_PROTOCOL,
    Buffer,
    Message,
    ProtocolViolation,
    ack_packet,
    encode_remaining_length,
    parse_connect,
    read_string,
    read_u16,
)
from .routing import PublishRate, Router
from .session import Recent, Session
from .stream import Outbox, Stream
from .topics import AclPolicy, match_levels, validate_topic_filter, validate_topic_name

T = TypeVar("T")
logger = logging.getLogger("transport.broker")

RC_SERVER_UNAVAILABLE = 0x03


class BrokerCore(Protocol):
    """What a connection needs from the broker (implemented by ``EmbeddedBroker``)."""

    limits: BrokerLimits
    stats: BrokerStats
    router: Router
    publish_rate: PublishRate
    acl: AclPolicy
    auth: Authenticator
    throttle: LoginThrottle
    allow_anonymous: bool

    def open_session(self, connection: Connection, clean: bool) -> tuple[Session, bool]:
        """Attach ``connection`` to its (username, client id) session; (session, present)."""

    def user_connections(self, username: str) -> int: ...

    def spawn_writer(self, connection: Connection) -> None: ...


class Connection:
    """One client connection: reads and dispatches packets, owns the outbox and the will."""

    def __init__(self, broker: BrokerCore, stream: Stream) -> None:
        self.broker = broker
        self.limits = broker.limits
        self.stream = stream
        self.peer = stream.peer
        self.client_id = ""
        self.username = ""
        self.idle_limit = float(self.limits.max_keepalive) * 1.5
        self.connected = False
        self.clean_disconnect = False
        self.closed = False
        self.busy = False
        self.will: Message | None = None
        self.session: Session | None = None
        self.outbox = Outbox(stream, self.limits.max_queued_bytes)
        self.opened_at = time.monotonic()
        self.packet_started: float | None = None
        self._qos2_pending: set[int] = set()
        self.writer_task: asyncio.Task[None] | None = None
        self.refusals = 0
        self.authenticating = False
        self.destinations = Recent()  # the sessions it delivered to lately

    def __repr__(self) -> str:
        return f"<client {self.client_id or '?'} user={self.username or '?'} peer={self.peer}>"

    # -- lifecycle ---------------------------------------------------------------------

    def abort(self) -> None:
        """Close at once, discarding queued output (takeover, slow consumer, deadline)."""
        if not self.closed:
            self.closed = True
            self.outbox.close(discard=True)
            self.stream.abort()

    def overdue(self, now: float) -> str | None:
        """Why this connection must be closed now, or None. Any received byte counts as
        activity; a packet that started arriving must finish within ``packet_timeout``."""
        if self.closed:
            return None
        if not self.connected:
            if now - self.opened_at > self.limits.connect_timeout:
                return f"no CONNECT within {self.limits.connect_timeout:g} s"
            return None
        started = self.packet_started
        if started is not None and now - started > self.limits.packet_timeout:
            return f"a packet stayed incomplete for more than {self.limits.packet_timeout:g} s"
        if not self.busy and now - self.stream.last_received > self.idle_limit:
            return f"nothing received for {self.idle_limit:g} s (1.5 x keepalive)"
        return None

    def _log_refusal(self, text: str, *args: object) -> None:
        """Log what was refused: the first few per connection, then every thousandth (a
        flood of refused requests must not become a flood of log lines)."""
        self.refusals += 1
        if self.refusals <= 10 or self.refusals % 1000 == 0:
            suffix = f" ({self.refusals} refusals on this connection)" if self.refusals > 10 else ""
            logger.warning("%r: " + text + suffix, self, *args)

    # -- reading -----------------------------------------------------------------------

    async def read_packet(self) -> tuple[int, int, list[bytes | bytearray]]:
        """Read one packet; its type and size are checked before any body is read."""
        first = (await self.stream.readexactly(1))[0]
        self.packet_started = time.monotonic()
        packet_type, flags = first >> 4, first & 0x0F
        if packet_type not in REQUIRED_FLAGS and packet_type != PUBLISH:
            raise ProtocolViolation(f"packet type {packet_type} is not valid from a client")
        if not self.connected and packet_type != CONNECT:
            raise ProtocolViolation("first packet was not CONNECT")
        if packet_type != PUBLISH and flags != REQUIRED_FLAGS[packet_type]:
            raise ProtocolViolation(f"bad fixed-header flags {flags:#x} for type {packet_type}")
        if not self.connected:
            limit = self.limits.max_connect_packet
        elif packet_type == PUBLISH:
            limit = self.limits.max_payload + PUBLISH_OVERHEAD
        else:
            limit = self.limits.max_control_packet
        length = 0
        for shift in (0, 7, 14, 21):
            byte = (await self.stream.readexactly(1))[0]
            length |= (byte & 0x7F) << shift
            if length > limit:
                raise ProtocolViolation(f"packet of {length}+ bytes exceeds the limit of "
                                        f"{limit}")
            if not byte & 0x80:
                break
        else:
            raise ProtocolViolation("remaining length is longer than 4 bytes")
        body = await self.stream.read_body(length)
        self.packet_started = None
        return packet_type, flags, body

    async def serve(self) -> None:
        """CONNECT handshake, then the packet loop until DISCONNECT or an error."""
        _, _, body = await self.read_packet()
        self.authenticating = True
        if not await self._on_connect(_join(body)):
            return
        handled = 0
        while True:
            packet_type, flags, body = await self.read_packet()
            if packet_type == PUBLISH:
                await self._on_publish(flags, body)
            elif packet_type == DISCONNECT:
                self.clean_disconnect = True
                return
            elif packet_type == CONNECT:
                raise ProtocolViolation("second CONNECT on one connection")
            else:
                self._on_control(packet_type, _join(body))
            handled += 1
            if handled % self.limits.packets_per_yield == 0:
                await asyncio.sleep(0)  # a client with a full buffer must not own the loop

    def _on_control(self, packet_type: int, body: bytes) -> None:
        session = self.session
        assert session is not None
        if packet_type == SUBSCRIBE:
            self._on_subscribe(body)
        elif packet_type == UNSUBSCRIBE:
            self._on_unsubscribe(body)
        elif packet_type == PINGREQ:
            self.outbox.put(PINGRESP_PACKET)
        elif packet_type == PUBREL:
            packet_id, _ = read_u16(body, 0)
            self._qos2_pending.discard(packet_id)
            self.outbox.put(ack_packet(PUBCOMP, packet_id))
        elif packet_type == PUBACK:
            packet_id, _ = read_u16(body, 0)
            if not session.acknowledged(packet_id):
                logger.debug("%r: PUBACK for packet id %d not in flight", self, packet_id)
        elif packet_type in (PUBREC, PUBCOMP):
            read_u16(body, 0)  # validated only: the broker never sends QoS 2

    # -- CONNECT -----------------------------------------------------------------------

    async def _refuse(self, code: int, reason: str) -> bool:
        logger.warning("%r refused at CONNECT: %s", self, reason)
        self.stream.write(bytes([0x20, 2, 0, code]))
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.stream.drain(), 5.0)
        return False

    async def _on_connect(self, body: bytes) -> bool:
        name, off = read_string(body, 0)
        if off + 4 > len(body):
            raise ProtocolViolation("CONNECT variable header truncated")
        level, flags = body[off], body[off + 1]
        if (name, level) not in (("MQTT", 4), ("MQIsdp", 3)):
            if name == "MQTT" and level == 5:
                logger.warning("%r refused: MQTT 5 is not supported; use MQTT 3.1.1", self)
                self.stream.write(bytes([0x20, 3, 0, V5_UNSUPPORTED_PROTOCOL, 0]))
                return False
            if name in ("MQTT", "MQIsdp"):
                return await self._refuse(RC_BAD_PROTOCOL, f"unsupported protocol level {level}")
            raise ProtocolViolation(f"unknown protocol name {name!r}")
        request = parse_connect(body, off + 2, flags)
        self.username = request.username or ""
        client_id = request.client_id
        if not client_id:
            if not request.clean_session:
                return await self._refuse(RC_BAD_CLIENT_ID, "empty client id needs clean session")
            client_id = "auto-" + secrets.token_hex(8)
        self.client_id = client_id
        try:
            if not await self._authenticate(request.username, request.password):
                return await self._refuse(RC_NOT_AUTHORIZED,
                                          f"bad credentials for user {request.username!r}")
        except LoginBusy as exc:
            return await self._refuse(RC_SERVER_UNAVAILABLE,
                                      f"user {request.username!r}: {exc}")
        if request.keepalive > self.limits.max_keepalive:
            return await self._refuse(RC_BAD_CLIENT_ID,
                                      f"keepalive {request.keepalive} s exceeds the broker's "
                                      f"maximum of {self.limits.max_keepalive} s")
        if self.broker.user_connections(self.username) >= self.limits.max_connections_per_user:
            self.broker.stats.connections_refused += 1
            return await self._refuse(RC_SERVER_UNAVAILABLE,
                                      f"user {self.username!r} already holds "
                                      f"{self.limits.max_connections_per_user} connections")
        keepalive = request.keepalive or self.limits.max_keepalive
        self.idle_limit = 1.5 * keepalive
        self.will = request.will
        self.connected = True
        session, present = self.broker.open_session(self, request.clean_session)
        self.session = session
        self.outbox.put(bytes([0x20, 2, int(present), RC_ACCEPTED]))
        resent = session.attach(self)
        self.broker.stats.redelivered += resent
        self.broker.spawn_writer(self)
        logger.debug("%r connected (keepalive %d s, session present %d)", self,
                     request.keepalive, present)
        return True

    async def _authenticate(self, username: str | None, password: bytes | None) -> bool:
        broker = self.broker
        if broker.allow_anonymous and username is None:
            return True
        # docs/deployment.md section 9: throttled per (address, username), unknown usernames
        # of an address sharing one key; checked in the throttle's fair CheckQueue; a
        # correct password is accepted once checked, a failure answered a fixed time
        # (auth.pad) after its check started, plus its delay
        known = username is not None and username in broker.auth
        self.authenticating = False  # waiting for a lane: evictable like any newcomer
        attempt = await self._while_open(
            broker.throttle.attempt(self.stream.peer_host, username if known else None))
        with attempt:
            if self.closed:
                return False
            ok, started = await self._while_open(attempt.check(
                lambda: broker.auth.verify(username, password), self._turn_to_check))
            if ok:
                attempt.succeeded()
                return True
            delay = attempt.failed(answer_after=started + broker.auth.pad)
        broker.stats.auth_failures += 1
        self.authenticating = False
        await self._while_open(asyncio.sleep(delay))
        return False

    def _turn_to_check(self) -> bool:
        """Whether to check this connection's password now that its turn has come: not if
        the peer is gone. From here on it is not evicted for a newcomer."""
        transport = self.stream.transport
        if self.closed or transport is None or transport.is_closing():
            return False
        self.authenticating = True
        return True

    async def _while_open(self, waiting: Awaitable[T]) -> T:
        """``waiting``'s result; cancelled (ConnectionAbortedError) if this connection is
        closed meanwhile (evicted, deadline, broker stopping), so no task outlives it."""
        task = asyncio.ensure_future(waiting)
        try:
            while not task.done():
                if self.closed:
                    raise ConnectionAbortedError("closed while waiting to log in")
                await asyncio.wait([task], timeout=0.1)
            return task.result()
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    # -- PUBLISH -----------------------------------------------------------------------

    async def _on_publish(self, flags: int, body: list[bytes | bytearray]) -> None:
        qos, retain = (flags >> 1) & 0x03, bool(flags & 0x01)
        if qos == 3:
            raise ProtocolViolation("PUBLISH with QoS 3")
        if not body:
            raise ProtocolViolation("PUBLISH without a topic")
        first = body[0]
        topic, off = read_string(first, 0)
        try:
            validate_topic_name(topic)
        except ValueError as exc:
            raise ProtocolViolation(f"bad PUBLISH topic: {exc}") from exc
        packet_id = 0
        if qos:
            packet_id, off = read_u16(first, off)
            if packet_id == 0:
                raise ProtocolViolation("PUBLISH QoS > 0 with packet id 0")
        chunks: list[Buffer] = [memoryview(first)[off:]] if off < len(first) else []
        chunks += body[1:]
        message = Message.build(topic, chunks, qos, False)
        if message.size > self.limits.max_payload:
            raise ProtocolViolation(f"payload of {message.size} bytes exceeds max_payload="
                                    f"{self.limits.max_payload}")
        stats = self.broker.stats
        stats.messages_in += 1
        stats.bytes_in += message.size
        pause = self.broker.publish_rate.take(self.username)
        if pause:
            # over its user's publish rate: nothing more is read from this connection
            # until it is back under (TCP back-pressure on this sender alone)
            stats.publishes_throttled += 1
            self.busy = True
            try:
                await asyncio.sleep(pause)
            finally:
                self.busy = False
        if not (qos == 2 and packet_id in self._qos2_pending):
            await self._route(message, retain)
        if qos == 1:
            self.outbox.put(ack_packet(PUBACK, packet_id))
        elif qos == 2:
            self._qos2_pending.add(packet_id)
            self.outbox.put(ack_packet(PUBREC, packet_id))

    async def _route(self, message: Message, retain: bool) -> None:
        broker = self.broker
        stats = broker.stats
        if not broker.acl.allowed(self.username, self.client_id, "publish", message.topic):
            stats.acl_denials += 1
            self._log_refusal("PUBLISH to %r denied by ACL; dropped", message.topic)
            return
        if retain:
            if not broker.acl.allowed(self.username, self.client_id, "retain", message.topic):
                stats.retain_denials += 1
                self._log_refusal("RETAIN on %r is not allowed for this user; delivered "
                                  "without retaining", message.topic)
            elif not broker.router.retained.set(message, self.username):
                stats.retain_denials += 1
                self._log_refusal("retained message on %r too large or the store is full; "
                                  "delivered without retaining", message.topic)
            stats.retained_messages = len(broker.router.retained)
        late = broker.router.fan_out(message, self)
        if late:
            self.busy = True  # waiting for a subscriber is the broker's doing, not the client's
            try:
                for session, qos in late:
                    await broker.router.deliver_late(session, message, qos)
            finally:
                self.busy = False

    # -- SUBSCRIBE / UNSUBSCRIBE ---------------------------------------------------------

    def _on_subscribe(self, body: bytes) -> None:
        packet_id, off = read_u16(body, 0)
        if off == len(body):
            raise ProtocolViolation("SUBSCRIBE without topic filters")
        codes = bytearray()
        granted: list[tuple[list[str], int]] = []
        while off < len(body):
            if len(codes) >= self.limits.max_subscriptions:
                raise ProtocolViolation(f"SUBSCRIBE with more than "
                                        f"{self.limits.max_subscriptions} filters")
            topic_filter, off = read_string(body, off)
            if off >= len(body):
                raise ProtocolViolation("SUBSCRIBE filter without requested QoS")
            requested = body[off]
            off += 1
            if requested & 0xFC or requested == 3:
                raise ProtocolViolation("SUBSCRIBE requested QoS byte is invalid")
            code = self._grant(topic_filter, min(requested, 1))
            codes.append(code)
            if code != SUBACK_FAILURE:
                granted.append((topic_filter.split("/"), code))
        self.outbox.put(bytes([SUBACK << 4]) + encode_remaining_length(2 + len(codes))
                        + packet_id.to_bytes(2, "big") + bytes(codes))
        self._deliver_retained(granted)

    def _grant(self, topic_filter: str, qos: int) -> int:
        session = self.session
        assert session is not None
        try:
            validate_topic_filter(topic_filter)
        except ValueError as exc:
            self._log_refusal("bad SUBSCRIBE filter refused: %s", exc)
            return SUBACK_FAILURE
        broker = self.broker
        if not broker.acl.allowed(self.username, self.client_id, "subscribe", topic_filter):
            broker.stats.acl_denials += 1
            self._log_refusal("SUBSCRIBE to %r denied by ACL", topic_filter)
            return SUBACK_FAILURE
        index = broker.router.index
        if topic_filter not in session.subscriptions and (
                len(session.subscriptions) >= self.limits.max_subscriptions
                or index.count >= self.limits.max_subscriptions_total):
            self._log_refusal("SUBSCRIBE to %r refused: subscription cap reached",
                              topic_filter)
            return SUBACK_FAILURE
        session.subscriptions[topic_filter] = qos
        index.add(topic_filter, session, qos)
        return qos

    def _deliver_retained(self, granted: list[tuple[list[str], int]]) -> None:
        router = self.broker.router
        if not granted or not len(router.retained):
            return
        session = self.session
        assert session is not None
        for topic, message in router.retained.items():
            topic_levels = topic.split("/")
            qos = max((q for levels, q in granted if match_levels(levels, topic_levels)),
                      default=-1)
            if qos >= 0:
                router.deliver(session, message, min(qos, message.qos), retain=True)

    def _on_unsubscribe(self, body: bytes) -> None:
        session = self.session
        assert session is not None
        packet_id, off = read_u16(body, 0)
        if off == len(body):
            raise ProtocolViolation("UNSUBSCRIBE without topic filters")
        while off < len(body):
            topic_filter, off = read_string(body, off)
            if session.subscriptions.pop(topic_filter, None) is not None:
                self.broker.router.index.remove(topic_filter, session)
        self.outbox.put(ack_packet(UNSUBACK, packet_id))


def _join(body: list[bytes | bytearray]) -> bytes:
    return b"".join(bytes(b) for b in body) if len(body) != 1 else bytes(body[0])
