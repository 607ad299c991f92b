"""``MqttLink`` after a lost connection: every attempt fails or succeeds fast, the link gives
up within its timeout, and once it gave up nothing waits on it."""

from __future__ import annotations

import asyncio
import secrets
import socket
import struct
import threading
import time

import pytest

from transport.broker import EmbeddedBroker, TopicAcl
from transport.link import LinkLost
from transport.mqtt import BrokerSettings, MqttNetwork

pytestmark = pytest.mark.timeout(60)

USER = "probe"
ACL = {USER: TopicAcl(subscribe=("secagg/#",), publish=("secagg/#",))}


class Resetter:
    """Accepts TCP connections on loopback and resets each before any CONNACK (what a
    restarting broker does to the first connections that reach it)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.recv(1024)  # the CONNECT
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()  # linger 0: a reset

    def close(self) -> None:
        self.sock.close()


def test_a_connection_reset_before_connack_fails_the_attempt_at_once() -> None:
    """aiomqtt alone waits its whole timeout (here 30 s) for a CONNACK after a reset; the
    link retries instead, several times within a 3 s connect timeout."""
    server = Resetter()
    settings = BrokerSettings(port=server.port, passwords={USER: "x"}, connect_timeout=3.0,
                              publish_timeout=30.0)

    async def scenario() -> None:
        async with MqttNetwork(settings).connect(USER):
            pass

    started = time.monotonic()
    try:
        with pytest.raises(LinkLost, match="closed the connection before accepting it"):
            asyncio.run(scenario())
    finally:
        server.close()
    assert time.monotonic() - started < 4.0
    assert server.accepted >= 3


def test_a_link_that_gave_up_answers_at_once() -> None:
    """The broker goes away for good: ``receive`` raises ``LinkLost`` within the reconnect
    timeout (plus one attempt's bound), and a publish after that returns False at once
    instead of waiting the reconnect timeout again."""
    users = {USER: secrets.token_hex(8)}

    async def scenario() -> tuple[float, float, bool]:
        broker = EmbeddedBroker(users=users, acl=ACL)
        await broker.start()
        settings = BrokerSettings(port=broker.port, passwords=users, connect_timeout=5.0,
                                  reconnect_timeout=2.0, publish_timeout=30.0)
        async with MqttNetwork(settings).connect(USER) as link:
            await link.subscribe("secagg/x/#")
            await broker.stop()
            started = time.monotonic()
            with pytest.raises(LinkLost, match="cannot reach the MQTT broker"):
                while True:
                    await link.receive(10.0)
            gave_up = time.monotonic() - started
            started = time.monotonic()
            sent = await link.publish("secagg/x/y", b"late")
            return gave_up, time.monotonic() - started, sent

    gave_up, publish_took, sent = asyncio.run(scenario())
    assert gave_up < 2.0 + 1.5
    assert publish_took < 0.5 and sent is False


def test_a_partition_after_connecting_is_not_called_a_certificate_problem() -> None:
    """A link that was connected loses its path to the broker (a proxy between them now
    closes every connection before the broker answers): the error names the network or a
    restarting broker, not a client certificate or mqtt:// instead of mqtts:// (issue 30:
    a partition was reported as a TLS problem), since these settings were accepted before."""
    from tests.fl.proxy import LinkProxy

    users = {USER: secrets.token_hex(8)}
    dead = socket.create_server(("127.0.0.1", 0))
    dead_port = dead.getsockname()[1]
    dead.close()

    async def scenario() -> str:
        broker = EmbeddedBroker(users=users, acl=ACL)
        await broker.start()
        try:
            with LinkProxy(broker.port) as proxy:
                settings = BrokerSettings(port=proxy.port, passwords=users,
                                          connect_timeout=5.0, reconnect_timeout=2.0)
                async with MqttNetwork(settings).connect(USER) as link:
                    await link.subscribe("secagg/x/#")
                    proxy.broker = ("127.0.0.1", dead_port)  # the path to the broker is cut
                    proxy.reset()
                    with pytest.raises(LinkLost) as lost:
                        while True:
                            await link.receive(10.0)
                    return str(lost.value)
        finally:
            await broker.stop()

    text = asyncio.run(scenario())
    assert "network" in text and "certificate" not in text, text


def test_an_idle_link_pings_every_keepalive_without_waking_every_second(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A link's housekeeping (paho's ``loop_misc``: the keepalive ping) runs every quarter
    keepalive, not every second (a worker holding 5,000 sites woke 5,000 times a second),
    and an idle link still outlives 1.5 x keepalive, after which the broker would close a
    silent connection: a message then still arrives without a reconnection."""
    import paho.mqtt.client as paho

    users = {USER: secrets.token_hex(8)}
    calls = [0]
    loop_misc = paho.Client.loop_misc

    def counting(self: paho.Client) -> paho.MQTTErrorCode:
        calls[0] += 1
        return loop_misc(self)

    monkeypatch.setattr(paho.Client, "loop_misc", counting)

    async def scenario() -> object:
        async with EmbeddedBroker(users=users, acl=ACL) as broker:
            settings = BrokerSettings(port=broker.port, passwords=users, keepalive=8,
                                      connect_timeout=5.0, publish_timeout=10.0)
            async with MqttNetwork(settings).connect(USER) as link:
                await link.subscribe("secagg/x/#")
                await asyncio.sleep(13.0)  # past 1.5 x keepalive (12 s) with no traffic
                assert await link.publish("secagg/x/y", b"still here")
                return await link.receive(10.0)

    event = asyncio.run(scenario())
    assert getattr(event, "payload", None) == b"still here", event  # not a Reconnected
    assert calls[0] <= 8  # every 2 s (a quarter keepalive) over 13 s; every 1 s: 13
