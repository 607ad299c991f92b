"""One client connection of the embedded broker: CONNECT handshake, packet loop, keepalive.

A :class:`Connection` reads packets from its :class:`~transport.broker_stream.Stream`,
checks them against ``transport.mqtt_packets`` and the ACL, and hands PUBLISHes to the
broker (``transport.broker``), which routes them, keeps retained messages and publishes
wills.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING

from transport.broker_stream import Outbox, Stream
from transport.mqtt_packets import (
    CONNECT,
    DISCONNECT,
    MQTT_MAX_REMAINING_LENGTH,
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
    Message,
    ProtocolViolation,
    ack_packet,
    encode_remaining_length,
    parse_connect,
    read_string,
    read_u16,
)
from transport.mqtt_topics import match_levels, validate_topic_filter, validate_topic_name

if TYPE_CHECKING:
    from transport.broker import EmbeddedBroker

# One logger for the whole embedded broker, whichever module it lives in.
logger = logging.getLogger("transport.broker")


class Connection:
    """One client connection: reads and dispatches packets, owns the outbox and the will."""

    def __init__(self, broker: EmbeddedBroker, stream: Stream) -> None:
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
        self.will: Message | None = None
        self.subscriptions: dict[str, tuple[list[str], int]] = {}
        self.outbox = Outbox(stream, broker.max_queued_bytes, broker.slow_consumer_timeout)
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
            raise ProtocolViolation("remaining length is longer than 4 bytes")
        if packet_type == PUBLISH:
            limit = min(self.broker.max_payload + PUBLISH_OVERHEAD, MQTT_MAX_REMAINING_LENGTH)
        elif packet_type in REQUIRED_FLAGS:
            limit = self.broker.max_control_packet
        else:
            raise ProtocolViolation(f"packet type {packet_type} is not valid from a client")
        if length > limit:
            raise ProtocolViolation(f"packet of {length} bytes exceeds the limit of {limit}")
        if packet_type != PUBLISH and flags != REQUIRED_FLAGS[packet_type]:
            raise ProtocolViolation(f"bad fixed-header flags {flags:#x} for type {packet_type}")
        body = await self.stream.readexactly(length) if length else b""
        self.last_activity = self._loop.time()
        return packet_type, flags, body

    async def serve(self) -> None:
        """CONNECT handshake, then the packet loop until DISCONNECT or an error."""
        packet_type, _, body = await self.read_packet()
        if packet_type != CONNECT:
            raise ProtocolViolation("first packet was not CONNECT")
        if not await self._on_connect(body):
            return
        while True:
            packet_type, flags, body = await self.read_packet()
            if packet_type == PUBLISH:
                await self._on_publish(flags, body)
            elif packet_type == SUBSCRIBE:
                await self._on_subscribe(body)
            elif packet_type == UNSUBSCRIBE:
                self._on_unsubscribe(body)
            elif packet_type == PINGREQ:
                self._send(PINGRESP_PACKET)
            elif packet_type == PUBREL:
                packet_id, _ = read_u16(body, 0)
                self._qos2_pending.discard(packet_id)
                self._send(ack_packet(PUBCOMP, packet_id))
            elif packet_type in (PUBACK, PUBREC, PUBCOMP):
                read_u16(body, 0)  # validated only: clean sessions keep no outbound state
            elif packet_type == DISCONNECT:
                self.clean_disconnect = True
                return
            else:
                raise ProtocolViolation("second CONNECT on one connection")

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
        name, off = read_string(body, 0)
        if off + 4 > len(body):
            raise ProtocolViolation("CONNECT variable header truncated")
        level, flags = body[off], body[off + 1]
        if (name, level) not in (("MQTT", 4), ("MQIsdp", 3)):
            if name == "MQTT" and level == 5:
                return await self._refuse(bytes([0x20, 3, 0, V5_UNSUPPORTED_PROTOCOL, 0]),
                                          "MQTT 5 is not supported; use MQTT 3.1.1")
            if name in ("MQTT", "MQIsdp"):
                return await self._refuse(bytes([0x20, 2, 0, RC_BAD_PROTOCOL]),
                                          f"unsupported protocol level {level}")
            raise ProtocolViolation(f"unknown protocol name {name!r}")
        request = parse_connect(body, off + 2, flags)
        self.username = request.username or ""
        client_id = request.client_id
        if not client_id:
            if not request.clean_session:
                return await self._refuse(bytes([0x20, 2, 0, RC_BAD_CLIENT_ID]),
                                          "empty client id needs clean session")
            client_id = "auto-" + secrets.token_hex(8)
        self.client_id = client_id
        if not self.broker._authenticate(request.username, request.password):
            self.broker.stats.auth_failures += 1
            return await self._refuse(bytes([0x20, 2, 0, RC_NOT_AUTHORIZED]),
                                      f"bad credentials for user {request.username!r}")
        self.keepalive = request.keepalive
        self.will = request.will
        self.connected = True
        self.broker._register(self)
        self.outbox.put_nowait(bytes([0x20, 2, 0, RC_ACCEPTED]))
        self.broker._spawn_writer(self)
        self.start_watchdog()  # the pre-CONNECT deadline no longer applies
        logger.debug("%r connected (keepalive %d s)", self, self.keepalive)
        return True

    # -- PUBLISH -----------------------------------------------------------------------

    async def _on_publish(self, flags: int, body: bytes) -> None:
        qos, retain = (flags >> 1) & 0x03, bool(flags & 0x01)
        if qos == 3:
            raise ProtocolViolation("PUBLISH with QoS 3")
        topic, off = read_string(body, 0)
        try:
            validate_topic_name(topic)
        except ValueError as exc:
            raise ProtocolViolation(f"bad PUBLISH topic: {exc}") from exc
        packet_id = 0
        if qos:
            packet_id, off = read_u16(body, off)
            if packet_id == 0:
                raise ProtocolViolation("PUBLISH QoS > 0 with packet id 0")
        payload = memoryview(body)[off:]
        if len(payload) > self.broker.max_payload:
            raise ProtocolViolation(
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
                    await self.broker._route(Message.build(topic, payload, qos, retain))
                finally:
                    self.busy = False
            else:
                stats.acl_denials += 1
                logger.warning("%r: PUBLISH to %r denied by ACL; dropped", self, topic)
        if qos == 1:
            self._send(ack_packet(PUBACK, packet_id))
        elif qos == 2:
            self._qos2_pending.add(packet_id)
            self._send(ack_packet(PUBREC, packet_id))

    async def deliver(self, message: Message, qos: int, retain: bool) -> None:
        """Queue ``message`` for this client; drops the client if it stays too slow."""
        if self.closed:
            return
        remaining = len(message.topic_bytes) + len(message.payload)
        first = (PUBLISH << 4) | (qos << 1) | int(retain)
        if qos:
            self._next_packet_id = self._next_packet_id % 0xFFFF + 1
            remaining += 2
            header = (bytes([first]) + encode_remaining_length(remaining) + message.topic_bytes
                      + self._next_packet_id.to_bytes(2, "big"))
        else:
            header = bytes([first]) + encode_remaining_length(remaining) + message.topic_bytes
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
            if qos > best and match_levels(levels, topic_levels):
                best = qos
        return best

    # -- SUBSCRIBE / UNSUBSCRIBE ---------------------------------------------------------

    async def _on_subscribe(self, body: bytes) -> None:
        packet_id, off = read_u16(body, 0)
        if off == len(body):
            raise ProtocolViolation("SUBSCRIBE without topic filters")
        codes = bytearray()
        granted: list[tuple[list[str], int]] = []
        while off < len(body):
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
                granted.append((self.subscriptions[topic_filter][0], code))
        suback = (bytes([SUBACK << 4]) + encode_remaining_length(2 + len(codes))
                  + packet_id.to_bytes(2, "big") + bytes(codes))
        self._send(suback)
        await self._deliver_retained(granted)

    def _grant(self, topic_filter: str, qos: int) -> int:
        try:
            validate_topic_filter(topic_filter)
        except ValueError as exc:
            logger.warning("%r: bad SUBSCRIBE filter refused: %s", self, exc)
            return SUBACK_FAILURE
        if not self.broker._acl.allowed(self.username, self.client_id, "subscribe", topic_filter):
            self.broker.stats.acl_denials += 1
            logger.warning("%r: SUBSCRIBE to %r denied by ACL", self, topic_filter)
            return SUBACK_FAILURE
        self.subscriptions[topic_filter] = (topic_filter.split("/"), qos)
        return qos

    async def _deliver_retained(self, granted: list[tuple[list[str], int]]) -> None:
        if not granted or not self.broker._retained:
            return
        for topic, message in list(self.broker._retained.items()):
            topic_levels = topic.split("/")
            qos = max((q for levels, q in granted if match_levels(levels, topic_levels)),
                      default=-1)
            if qos >= 0:
                await self.deliver(message, min(qos, message.qos), retain=True)

    def _on_unsubscribe(self, body: bytes) -> None:
        packet_id, off = read_u16(body, 0)
        if off == len(body):
            raise ProtocolViolation("UNSUBSCRIBE without topic filters")
        while off < len(body):
            topic_filter, off = read_string(body, off)
            self.subscriptions.pop(topic_filter, None)
        self._send(ack_packet(UNSUBACK, packet_id))
