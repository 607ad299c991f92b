"""MQTT 3.1.1 wire format for the embedded broker: packet types, fixed-header rules,
remaining-length encoding, field decoders, the CONNECT payload and the PUBLISH header.

No I/O: ``transport.broker.connection`` reads the bytes and calls these. Every malformed
input raises :class:`ProtocolViolation`, which closes only the offending connection.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .errors import BrokerError
from .topics import validate_topic_name

Buffer = bytes | bytearray | memoryview

MQTT_MAX_REMAINING_LENGTH = 268_435_455
"""Largest remaining length the 4-byte MQTT varint can encode (256 MiB - 1)."""

# Packet types (high nibble of the first byte).
CONNECT, CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP = 1, 2, 3, 4, 5, 6, 7
SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK, PINGREQ, PINGRESP, DISCONNECT = (
    8, 9, 10, 11, 12, 13, 14,
)
# Fixed-header flags the spec mandates for each client->server packet type.
REQUIRED_FLAGS = {
    CONNECT: 0, PUBACK: 0, PUBREC: 0, PUBREL: 2, PUBCOMP: 0,
    SUBSCRIBE: 2, UNSUBSCRIBE: 2, PINGREQ: 0, DISCONNECT: 0,
}
# CONNACK return codes (3.1.1).
RC_ACCEPTED, RC_BAD_PROTOCOL, RC_BAD_CLIENT_ID, RC_NOT_AUTHORIZED = 0x00, 0x01, 0x02, 0x05
V5_UNSUPPORTED_PROTOCOL = 0x84
SUBACK_FAILURE = 0x80
# Largest non-payload part of a PUBLISH: topic (2 + 65535) + packet id (2).
PUBLISH_OVERHEAD = 2 + 65_535 + 2
PINGRESP_PACKET = bytes([PINGRESP << 4, 0])


class ProtocolViolation(BrokerError):
    """The peer broke the MQTT spec; its connection is closed, nothing else is affected."""


# --------------------------------------------------------------------------- codec


def encode_remaining_length(length: int) -> bytes:
    out = bytearray()
    while True:
        byte = length & 0x7F
        length >>= 7
        if length:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def read_u16(buf: bytes | bytearray, off: int) -> tuple[int, int]:
    if off + 2 > len(buf):
        raise ProtocolViolation("packet truncated inside a 2-byte integer")
    return (buf[off] << 8) | buf[off + 1], off + 2


def read_binary(buf: bytes | bytearray, off: int) -> tuple[bytes, int]:
    length, off = read_u16(buf, off)
    end = off + length
    if end > len(buf):
        raise ProtocolViolation("length-prefixed field runs past the end of the packet")
    return bytes(buf[off:end]), end


def read_string(buf: bytes | bytearray, off: int) -> tuple[str, int]:
    raw, off = read_binary(buf, off)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolViolation("string field is not valid UTF-8") from exc
    if "\x00" in text:
        raise ProtocolViolation("string field contains U+0000")
    return text, off


def ack_packet(packet_type: int, packet_id: int, flags: int = 0) -> bytes:
    return bytes([(packet_type << 4) | flags, 2, packet_id >> 8, packet_id & 0xFF])


@dataclass(frozen=True)
class Message:
    """A routed PUBLISH. The payload is a tuple of buffers (a large body arrives in pieces,
    never one allocation of a declared length) shared, never copied, by all subscribers."""

    topic: str
    topic_bytes: bytes
    chunks: tuple[Buffer, ...]
    size: int
    qos: int
    retain: bool

    @classmethod
    def build(cls, topic: str, payload: Buffer | Sequence[Buffer], qos: int,
              retain: bool) -> Message:
        chunks = ((payload,) if isinstance(payload, (bytes, bytearray, memoryview))
                  else tuple(payload))
        encoded = topic.encode()
        return cls(topic, len(encoded).to_bytes(2, "big") + encoded, chunks,
                   sum(len(c) for c in chunks), qos, retain)

    @property
    def payload(self) -> bytes:
        """The payload as one bytes object (a copy: for wills, tests and small messages)."""
        return b"".join(bytes(c) for c in self.chunks)

    def header(self, qos: int, retain: bool, packet_id: int = 0, dup: bool = False) -> bytes:
        """The PUBLISH fixed and variable header for sending this message at ``qos``."""
        first = (PUBLISH << 4) | (int(dup) << 3) | (qos << 1) | int(retain)
        remaining = len(self.topic_bytes) + self.size + (2 if qos else 0)
        head = bytes([first]) + encode_remaining_length(remaining) + self.topic_bytes
        return head + packet_id.to_bytes(2, "big") if qos else head


@dataclass(frozen=True)
class ConnectRequest:
    client_id: str
    clean_session: bool
    keepalive: int
    will: Message | None
    username: str | None
    password: bytes | None


def parse_connect(body: bytes, off: int, flags: int) -> ConnectRequest:
    """Decode the CONNECT fields after the protocol name and level (``off`` points at the
    keepalive, ``flags`` is the connect-flags byte); raise on anything the spec forbids."""
    if flags & 0x01:
        raise ProtocolViolation("CONNECT reserved flag is set")
    keepalive, off = read_u16(body, off)
    client_id, off = read_string(body, off)
    will: Message | None = None
    will_qos, will_retain = (flags >> 3) & 0x03, bool(flags & 0x20)
    if flags & 0x04:
        if will_qos == 3:
            raise ProtocolViolation("will QoS 3 is invalid")
        will_topic, off = read_string(body, off)
        will_payload, off = read_binary(body, off)
        try:
            validate_topic_name(will_topic)
        except ValueError as exc:
            raise ProtocolViolation(f"bad will topic: {exc}") from exc
        will = Message.build(will_topic, will_payload, will_qos, will_retain)
    elif will_qos or will_retain:
        raise ProtocolViolation("will QoS/retain set without the will flag")
    username: str | None = None
    password: bytes | None = None
    if flags & 0x80:
        username, off = read_string(body, off)
    if flags & 0x40:
        if username is None:
            raise ProtocolViolation("password flag set without username flag")
        password, off = read_binary(body, off)
    if off != len(body):
        raise ProtocolViolation("trailing bytes after the CONNECT payload")
    return ConnectRequest(client_id, bool(flags & 0x02), keepalive, will, username, password)
