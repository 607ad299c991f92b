"""paho-mqtt copies every frame's payload several times on its way (issue 32); the links
take two of those copies out: a received PUBLISH is decoded with one copy of its payload
(``transport.mqtt._decode_publish_once``), and an outgoing packet is written without
copying what is left of it at every write (``transport.mqtt._Client``). The decoded
packet is exactly paho's."""

from __future__ import annotations

import asyncio
import inspect
import os
import tracemalloc
from typing import Any

import pytest
from paho.mqtt import _packet
from paho.mqtt.enums import MQTTProtocolVersion

import transport.mqtt  # noqa: F401  (installs the decoder)
from transport.mqtt import _Client

V311 = MQTTProtocolVersion.MQTTv311


def _paho_decoder() -> Any:
    return inspect.getclosurevars(_packet.decode_publish).nonlocals["original"]


def _publish(topic: bytes, payload: bytes, qos: int, mid: int = 7) -> tuple[int, bytearray]:
    header = 0x30 | (qos << 1) | 0x01  # retained, so every flag bit is exercised
    body = len(topic).to_bytes(2, "big") + topic + (mid.to_bytes(2, "big") if qos else b"")
    return header | (0x08 if qos else 0), bytearray(body + payload)


@pytest.mark.parametrize("qos", [0, 1])
@pytest.mark.parametrize("size", [0, 1, 300, 1 << 16])
def test_a_publish_decodes_as_paho_decodes_it(qos: int, size: int) -> None:
    header, packet = _publish(b"secagg/r/site-3/masked_input", os.urandom(size), qos)
    ours = _packet.decode_publish(header, packet, V311)
    assert ours == _paho_decoder()(header, packet, V311)
    assert type(ours.payload) is bytes


@pytest.mark.parametrize("packet", [b"", b"\x00", b"\x00\x00payload", b"\x00\x09short",
                                    b"\x00\x01t\x00"])
def test_a_malformed_publish_fails_as_paho_fails_it(packet: bytes) -> None:
    """Too short, an empty topic, a topic longer than the packet, a packet id cut off."""
    header = 0x32  # QoS 1: a packet id must follow the topic
    with pytest.raises(_packet.MalformedPacket):
        _paho_decoder()(header, bytearray(packet), V311)
    with pytest.raises(_packet.MalformedPacket):
        _packet.decode_publish(header, bytearray(packet), V311)


def test_a_received_megabyte_frame_is_copied_once() -> None:
    header, packet = _publish(b"t/x", os.urandom(1 << 20), 1)
    for decoder, most in ((_packet.decode_publish, 1.2), (_paho_decoder(), None)):
        tracemalloc.start()
        decoded = decoder(header, packet, V311)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        del decoded
        if most is not None:
            assert peak < most * (1 << 20)  # the payload, once
        else:
            assert peak > 2 * (1 << 20)  # paho's own: the rest of the packet, again and again


class _Socket:
    def __init__(self) -> None:
        self.sent = 0

    def send(self, data: Any) -> int:
        self.sent += len(data)
        return len(data)

    def close(self) -> None:
        pass


def test_an_outgoing_megabyte_packet_is_written_without_a_copy() -> None:
    async def make() -> _Client:  # aiomqtt binds its client to the running loop
        return _Client("127.0.0.1", 1, identifier="copies")

    paho = asyncio.run(make())._client
    for hook in ("open", "close", "register_write", "unregister_write"):  # no loop here
        setattr(paho, f"on_socket_{hook}", None)
    paho._sock = _Socket()  # type: ignore[assignment]
    packet = bytearray(1 << 20)
    tracemalloc.start()
    paho._packet_queue(0xC0, packet, 0, 0)  # any packet: a frame of 1 MiB; written now
    paho._packet_write()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert paho._sock.sent == 1 << 20  # type: ignore[attr-defined]
    paho._sock = None
    assert peak < 256 << 10  # paho alone copies the packet (1 MiB) to write it
