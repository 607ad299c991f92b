"""A minimal MQTT 3.1.1 client on a raw socket, for conformance and attack tests.

Written from the specification (OASIS MQTT 3.1.1), it sends exactly the bytes a test asks
for and reports exactly what comes back, so tests can stage what a real client library
would never send (a header that lies about its length, a packet left half-sent, a
subscriber that never reads). Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass

from transport.tasks import cancel_requests, raise_if_cancelled

CONNECT, CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP = 1, 2, 3, 4, 5, 6, 7
SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK, PINGREQ, PINGRESP, DISCONNECT = range(8, 15)


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def mqtt_str(value: str | bytes) -> bytes:
    raw = value.encode() if isinstance(value, str) else value
    return len(raw).to_bytes(2, "big") + raw


def packet(first: int, body: bytes) -> bytes:
    return bytes([first]) + varint(len(body)) + body


def connect_packet(client_id: str, username: str | None = None, password: str | None = None,
                   *, clean: bool = True, keepalive: int = 60,
                   will: tuple[str, bytes, int, bool] | None = None) -> bytes:
    flags = 0x02 if clean else 0
    payload = mqtt_str(client_id)
    if will is not None:
        topic, message, qos, retain = will
        flags |= 0x04 | (qos << 3) | (0x20 if retain else 0)
        payload += mqtt_str(topic) + mqtt_str(message)
    if username is not None:
        flags |= 0x80
        payload += mqtt_str(username)
    if password is not None:
        flags |= 0x40
        payload += mqtt_str(password)
    return packet(CONNECT << 4, mqtt_str("MQTT") + bytes([4, flags])
                  + keepalive.to_bytes(2, "big") + payload)


def publish_packet(topic: str, payload: bytes, *, qos: int = 0, retain: bool = False,
                   packet_id: int = 1, dup: bool = False) -> bytes:
    first = (PUBLISH << 4) | (int(dup) << 3) | (qos << 1) | int(retain)
    body = mqtt_str(topic) + (packet_id.to_bytes(2, "big") if qos else b"") + payload
    return packet(first, body)


def subscribe_packet(filters: list[tuple[str, int]], packet_id: int = 1) -> bytes:
    body = packet_id.to_bytes(2, "big") + b"".join(mqtt_str(f) + bytes([q]) for f, q in filters)
    return packet((SUBSCRIBE << 4) | 2, body)


def ack(kind: int, packet_id: int) -> bytes:
    return packet((kind << 4) | (2 if kind == PUBREL else 0), packet_id.to_bytes(2, "big"))


@dataclass
class Received:
    kind: int
    flags: int
    body: bytes

    @property
    def topic(self) -> str:
        n = int.from_bytes(self.body[:2], "big")
        return self.body[2:2 + n].decode()

    @property
    def qos(self) -> int:
        return (self.flags >> 1) & 3

    @property
    def retain(self) -> bool:
        return bool(self.flags & 1)

    @property
    def dup(self) -> bool:
        return bool(self.flags & 8)

    @property
    def packet_id(self) -> int:
        n = int.from_bytes(self.body[:2], "big")
        if self.kind == PUBLISH:
            return int.from_bytes(self.body[2 + n:4 + n], "big") if self.qos else 0
        return int.from_bytes(self.body[:2], "big")

    @property
    def payload(self) -> bytes:
        n = int.from_bytes(self.body[:2], "big")
        return self.body[2 + n + (2 if self.qos else 0):]


class RawClient:
    """One TCP connection speaking hand-made MQTT; ``recv_buffer`` shrinks SO_RCVBUF so a
    client that stops reading fills up quickly."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, port: int, host: str = "127.0.0.1", *,
                   recv_buffer: int | None = None) -> RawClient:
        sock = socket.socket()
        if recv_buffer is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, recv_buffer)
        sock.setblocking(False)
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, (host, port)), 5)
        # A small stream buffer too when the socket's is small: asyncio would otherwise
        # keep reading into memory and the client would not look stuck at all.
        limit = 1 << 24 if recv_buffer is None else recv_buffer
        reader, writer = await asyncio.open_connection(sock=sock, limit=limit)
        return cls(reader, writer)

    @classmethod
    async def login(cls, port: int, client_id: str, username: str | None = None,
                    password: str | None = None, **kwargs: object) -> RawClient:
        """Open, CONNECT and require CONNACK 0 (``kwargs`` go to ``connect_packet``)."""
        recv_buffer = kwargs.pop("recv_buffer", None)
        client = await cls.open(port, recv_buffer=recv_buffer)  # type: ignore[arg-type]
        client.send(connect_packet(client_id, username, password, **kwargs))  # type: ignore[arg-type]
        present, code = await client.connack()
        if code != 0:
            raise ConnectionRefusedError(f"CONNACK return code {code}")
        client.session_present = present
        return client

    session_present = False

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def read(self, timeout: float = 5.0) -> Received:
        async def one() -> Received:
            first = (await self.reader.readexactly(1))[0]
            length, shift = 0, 0
            while True:
                byte = (await self.reader.readexactly(1))[0]
                length |= (byte & 0x7F) << shift
                shift += 7
                if not byte & 0x80:
                    break
            body = await self.reader.readexactly(length) if length else b""
            return Received(first >> 4, first & 0x0F, body)

        # Python 3.11's wait_for returns a packet that arrives with a cancellation and drops
        # the cancellation: an attack loop cancelled at a ping then dripped on for ever
        # (tests/security/test_streaming_redteam.py, CI at 990e960)
        before = cancel_requests()
        received = await asyncio.wait_for(one(), timeout)
        raise_if_cancelled(before)
        return received

    async def read_kind(self, kind: int, timeout: float = 5.0) -> Received:
        """The next packet of ``kind``, skipping others (PINGRESPs, stray acks)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            got = await self.read(max(0.01, deadline - loop.time()))
            if got.kind == kind:
                return got

    async def connack(self, timeout: float = 5.0) -> tuple[bool, int]:
        got = await self.read(timeout)
        assert got.kind == CONNACK, f"expected CONNACK, got packet type {got.kind}"
        return bool(got.body[0] & 1), got.body[1]

    async def subscribe(self, filters: list[tuple[str, int]], packet_id: int = 1) -> list[int]:
        self.send(subscribe_packet(filters, packet_id))
        got = await self.read_kind(SUBACK)
        assert got.packet_id == packet_id
        return list(got.body[2:])

    async def publish(self, topic: str, payload: bytes, *, qos: int = 0, retain: bool = False,
                      packet_id: int = 1) -> None:
        """Publish; for QoS 1 wait for the PUBACK."""
        self.send(publish_packet(topic, payload, qos=qos, retain=retain, packet_id=packet_id))
        if qos == 1:
            got = await self.read_kind(PUBACK)
            assert got.packet_id == packet_id

    async def ping(self, timeout: float = 5.0) -> None:
        self.send(packet(PINGREQ << 4, b""))
        await self.read_kind(PINGRESP, timeout)

    async def closed(self, timeout: float = 5.0) -> bool:
        """True once the broker closed the connection (reading whatever is left)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            while loop.time() < deadline:
                chunk = await asyncio.wait_for(self.reader.read(1 << 16),
                                               max(0.01, deadline - loop.time()))
                if not chunk:
                    return True
        except (asyncio.TimeoutError, TimeoutError):
            return False
        except (ConnectionError, OSError):
            return True
        return False

    async def no_packet(self, wait: float = 0.3) -> bool:
        """True when nothing arrives for ``wait`` seconds."""
        try:
            await self.read(wait)
        except (asyncio.TimeoutError, TimeoutError):
            return True
        return False

    def disconnect(self) -> None:
        self.send(packet(DISCONNECT << 4, b""))
        self.writer.close()

    def drop(self) -> None:
        """Close the TCP connection without DISCONNECT (the will fires)."""
        self.writer.transport.abort()
