"""The embedded MQTT broker against real aiomqtt/paho clients and hostile raw sockets.

pytest-asyncio is not a dependency: each test is a sync function running ``asyncio.run``,
and every wait is bounded with ``asyncio.timeout`` so a broker bug fails instead of hanging.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import textwrap
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiomqtt
import pytest
from mqtt_raw import mqtt_str as _str
from mqtt_raw import varint as _varint
from paho.mqtt.enums import MQTTProtocolVersion

from transport.broker import (
    BrokerConfigError,
    EmbeddedBroker,
    TopicAcl,
    filter_covers,
    topic_matches,
    validate_topic_filter,
)

USERS = {"server": "pw-server", "site-1": "pw-1", "site-2": "pw-2"}


def run(coro_fn: Callable[[], Awaitable[None]], timeout: float = 20.0) -> None:
    """Run one async test body with an overall deadline."""

    async def bounded() -> None:
        async with asyncio.timeout(timeout):
            await coro_fn()

    asyncio.run(bounded())


def client(broker: EmbeddedBroker, user: str = "server", **kwargs: Any) -> aiomqtt.Client:
    return aiomqtt.Client("127.0.0.1", broker.port, username=user, password=USERS[user],
                          **kwargs)


async def next_message(c: aiomqtt.Client, timeout: float = 5.0) -> aiomqtt.Message:
    async with asyncio.timeout(timeout):
        async for message in c.messages:
            return message
    raise AssertionError("message iterator ended")


async def no_message(c: aiomqtt.Client, wait: float = 0.3) -> None:
    with pytest.raises(TimeoutError):
        await next_message(c, timeout=wait)


# --------------------------------------------------------------------------- raw MQTT


def connect_packet(client_id: str, user: str | None = "server", password: str | None = None,
                   *, keepalive: int = 60, will: tuple[str, bytes] | None = None,
                   level: int = 4) -> bytes:
    flags = 0x02
    payload = _str(client_id)
    if will is not None:
        flags |= 0x04 | (1 << 3)
        payload += _str(will[0]) + _str(will[1])
    if user is not None:
        flags |= 0x80
        payload += _str(user)
        flags |= 0x40
        payload += _str(password if password is not None else USERS[user])
    body = _str("MQTT") + bytes([level, flags]) + keepalive.to_bytes(2, "big") + payload
    return b"\x10" + _varint(len(body)) + body


def publish_packet(topic: str, payload: bytes) -> bytes:
    body = _str(topic) + payload
    return b"\x30" + _varint(len(body)) + body


async def raw_open(broker: EmbeddedBroker) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", broker.port)


async def raw_connect(broker: EmbeddedBroker, client_id: str, **kwargs: Any
                      ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await raw_open(broker)
    writer.write(connect_packet(client_id, **kwargs))
    assert await reader.readexactly(4) == b"\x20\x02\x00\x00"
    return reader, writer


async def expect_closed(reader: asyncio.StreamReader, timeout: float = 5.0) -> bytes:
    """Read until EOF; returns what the broker sent before closing."""
    async with asyncio.timeout(timeout):
        return await reader.read()


async def assert_broker_healthy(broker: EmbeddedBroker) -> None:
    async with client(broker) as sub, client(broker, "site-1") as pub:
        await sub.subscribe("health/#", qos=1)
        await pub.publish("health/check", b"ok", qos=1)
        assert (await next_message(sub)).payload == b"ok"


# --------------------------------------------------------------------------- topic rules


@pytest.mark.parametrize(("topic_filter", "topic", "expected"), [
    ("a/b", "a/b", True),
    ("a/+", "a/b", True),
    ("a/+", "a/b/c", False),
    ("a/#", "a", True),
    ("a/#", "a/b/c", True),
    ("#", "a/b", True),
    ("+/+", "a/b", True),
    ("+", "/a", False),
    ("+/a", "/a", True),
    ("#", "$SYS/x", False),
    ("+/x", "$SYS/x", False),
    ("$SYS/#", "$SYS/x", True),
    ("a/b", "a/c", False),
])
def test_topic_matches(topic_filter: str, topic: str, expected: bool) -> None:
    assert topic_matches(topic_filter, topic) is expected


@pytest.mark.parametrize(("pattern", "topic_filter", "expected"), [
    ("secagg/+/site-1/#", "secagg/r7/site-1/#", True),
    ("secagg/+/site-1/#", "secagg/r7/site-1", True),
    ("secagg/+/site-1/#", "secagg/#", False),
    ("secagg/+/site-1/#", "secagg/+/+/#", False),
    ("a/+", "a/+", True),
    ("a/+", "a/#", False),
    ("a/b", "a/+", False),
    ("#", "anything/#", True),
    ("a", "a/#", False),
])
def test_filter_covers(pattern: str, topic_filter: str, expected: bool) -> None:
    assert filter_covers(pattern, topic_filter) is expected


@pytest.mark.parametrize("bad", ["", "a/#/b", "a#", "a/b+", "x\x00"])
def test_invalid_filters_rejected(bad: str) -> None:
    with pytest.raises(ValueError):
        validate_topic_filter(bad)


def test_authentication_is_required_by_default() -> None:
    with pytest.raises(BrokerConfigError, match="users="):
        EmbeddedBroker()
    with pytest.raises(BrokerConfigError, match="ACL pattern"):
        TopicAcl(publish=("a/#/b",))


# --------------------------------------------------------------------------- auth


def test_auth_success_and_failure() -> None:
    async def body() -> None:
        async with EmbeddedBroker(users=USERS) as broker:
            assert broker.url == f"mqtt://127.0.0.1:{broker.port}"
            async with client(broker, "site-1"):
                pass
            for user, password in [("site-1", "wrong"), ("nobody", "pw-1"), ("site-1", "")]:
                bad = aiomqtt.Client("127.0.0.1", broker.port, username=user, password=password)
                with pytest.raises(aiomqtt.MqttError):
                    async with bad:
                        pass
            # No username at all gets CONNACK 0x05 "not authorized" and a closed socket.
            reader, writer = await raw_open(broker)
            writer.write(connect_packet("anon", user=None))
            assert await expect_closed(reader) == b"\x20\x02\x00\x05"
            writer.close()
            assert broker.stats.auth_failures == 4

    run(body)


def test_mqtt5_is_refused_with_v5_connack() -> None:
    async def body() -> None:
        async with EmbeddedBroker(users=USERS) as broker:
            reader, writer = await raw_open(broker)
            writer.write(connect_packet("v5", level=5))
            assert await expect_closed(reader) == b"\x20\x03\x00\x84\x00"
            writer.close()
            v5 = client(broker, protocol=MQTTProtocolVersion.MQTTv5)
            with pytest.raises(aiomqtt.MqttError):
                async with v5:
                    pass
            await assert_broker_healthy(broker)

    run(body)


# --------------------------------------------------------------------------- pub/sub


def test_wildcards_qos_and_stats() -> None:
    async def body() -> None:
        async with EmbeddedBroker(users=USERS) as broker:
            async with client(broker) as plus, client(broker) as hash_, \
                    client(broker, "site-1") as pub:
                await plus.subscribe("secagg/+/up", qos=1)
                await hash_.subscribe("secagg/#", qos=0)
                await pub.publish("secagg/site-1/up", b"one", qos=1)
                await pub.publish("secagg/site-1/deep/down", b"two", qos=1)
                got = await next_message(plus)
                assert (str(got.topic), got.payload, got.qos) == ("secagg/site-1/up", b"one", 1)
                await no_message(plus)
                first, second = await next_message(hash_), await next_message(hash_)
                assert [first.payload, second.payload] == [b"one", b"two"]
                assert first.qos == 0  # min(granted 0, published 1)
            stats = broker.stats
            assert (stats.messages_in, stats.bytes_in) == (2, 6)
            assert (stats.messages_out, stats.bytes_out) == (3, 9)

    run(body)


def test_overlapping_subscriptions_deliver_once_and_unsubscribe() -> None:
    async def body() -> None:
        broker = EmbeddedBroker(users=USERS)
        async with broker, client(broker) as sub, client(broker, "site-1") as pub:
            await sub.subscribe("a/#", qos=0)
            await sub.subscribe("a/+", qos=1)
            await pub.publish("a/b", b"x", qos=1)
            message = await next_message(sub)
            assert message.qos == 1
            await no_message(sub)
            await sub.unsubscribe("a/#")
            await sub.unsubscribe("a/+")
            await pub.publish("a/b", b"y", qos=1)
            await no_message(sub)

    run(body)


def test_qos2_is_downgraded_to_qos1() -> None:
    async def body() -> None:
        broker = EmbeddedBroker(users=USERS)
        async with broker, client(broker) as sub, client(broker, "site-1") as pub:
            granted = await sub.subscribe("q/#", qos=2)
            assert [int(getattr(g, "value", g)) for g in granted] == [1]
            await pub.publish("q/2", b"exactly-once?", qos=2)  # full PUBREC/PUBCOMP flow
            message = await next_message(sub)
            assert (message.payload, message.qos) == (b"exactly-once?", 1)
            await no_message(sub)

    run(body)


def test_retained_store_deliver_and_clear() -> None:
    async def body() -> None:
        async with EmbeddedBroker(users=USERS) as broker:
            async with client(broker, "site-1") as pub:
                await pub.publish("cfg/round", b"7", qos=1, retain=True)
                async with client(broker) as late:
                    await late.subscribe("cfg/#", qos=1)
                    message = await next_message(late)
                    assert (message.payload, message.retain) == (b"7", True)
                    await pub.publish("cfg/round", b"8", qos=1, retain=True)
                    live = await next_message(late)
                    assert (live.payload, live.retain) == (b"8", False)
                    await pub.publish("cfg/round", b"", qos=1, retain=True)  # clears
                    assert (await next_message(late)).payload == b""
                async with client(broker) as later:
                    await later.subscribe("cfg/#", qos=1)
                    await no_message(later)
            assert broker.stats.retained_messages == 0

    run(body)


def test_large_payload_8mib_round_trip() -> None:
    payload = os.urandom(8 << 20)

    async def body() -> None:
        broker = EmbeddedBroker(users=USERS, max_payload=16 << 20)
        async with broker, client(broker) as sub, client(broker, "site-1") as pub:
            await sub.subscribe("big", qos=1)
            await pub.publish("big", payload, qos=1)
            message = await next_message(sub, timeout=15)
            assert message.payload == payload

    run(body, timeout=30)


def test_thirty_concurrent_clients_publish_1mib_each() -> None:
    payloads = {i: os.urandom(1 << 20) for i in range(30)}

    async def publish(broker: EmbeddedBroker, i: int) -> None:
        async with client(broker, "site-1", identifier=f"site-{i}") as pub:
            await pub.publish(f"bulk/{i}", payloads[i], qos=1)

    async def body() -> None:
        async with EmbeddedBroker(users=USERS, max_payload=2 << 20) as broker:
            async with client(broker, max_queued_incoming_messages=0) as sub:
                await sub.subscribe("bulk/#", qos=1)
                await asyncio.gather(*(publish(broker, i) for i in range(30)))
                seen = {}
                for _ in range(30):
                    message = await next_message(sub, timeout=15)
                    seen[int(str(message.topic).split("/")[1])] = message.payload
                assert seen == payloads
            assert broker.stats.bytes_in == 30 << 20

    run(body, timeout=45)


# --------------------------------------------------------------------------- last will


def test_last_will_on_sigkill_of_client_process() -> None:
    script = textwrap.dedent("""
        import sys, time, threading
        import paho.mqtt.client as mqtt
        ready = threading.Event()
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="victim")
        c.username_pw_set("site-1", "pw-1")
        c.will_set("secagg/will/victim", b"gone", qos=1)
        c.on_connect = lambda *a: ready.set()
        c.connect("127.0.0.1", int(sys.argv[1]), keepalive=60)
        c.loop_start()
        ready.wait(10)
        print("ready", flush=True)
        time.sleep(60)
    """)

    async def body() -> None:
        async with EmbeddedBroker(users=USERS) as broker, client(broker) as sub:
            await sub.subscribe("secagg/will/#", qos=1)
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", script, str(broker.port), stdout=subprocess.PIPE)
            try:
                assert proc.stdout is not None
                assert (await proc.stdout.readline()).strip() == b"ready"
                os.kill(proc.pid, signal.SIGKILL)
                message = await next_message(sub)
                assert (str(message.topic), message.payload) == ("secagg/will/victim", b"gone")
                assert broker.stats.wills_published == 1
            finally:
                if proc.returncode is None:
                    proc.kill()
                await proc.wait()

    run(body)


def test_last_will_on_socket_drop_and_keepalive_expiry_not_on_disconnect() -> None:
    async def body() -> None:
        async with EmbeddedBroker(users=USERS) as broker, client(broker) as sub:
            await sub.subscribe("will/#", qos=1)
            # TCP connection just lost (no DISCONNECT).
            _, writer = await raw_connect(broker, "dropper", will=("will/dropper", b"lost"))
            writer.transport.abort()
            assert (await next_message(sub)).payload == b"lost"
            # Silent client: keepalive 1 s, so the will fires after 1.5 s.
            reader, writer = await raw_connect(broker, "silent", keepalive=1,
                                               will=("will/silent", b"timeout"))
            started = time.monotonic()
            # the will came 1.5 s in (2.3 s for the whole test at load average 7): the wait
            # only bounds a failure
            assert (await next_message(sub, timeout=12)).payload == b"timeout"
            assert time.monotonic() - started >= 1.2
            await expect_closed(reader)
            writer.close()
            # A clean DISCONNECT discards the will.
            reader, writer = await raw_connect(broker, "polite", will=("will/polite", b"no"))
            writer.write(b"\xe0\x00")
            await expect_closed(reader)
            writer.close()
            await no_message(sub)

    run(body)


def test_duplicate_client_id_closes_old_connection() -> None:
    async def body() -> None:
        async with EmbeddedBroker(users=USERS) as broker, client(broker) as sub:
            await sub.subscribe("will/#", qos=1)
            reader, writer = await raw_connect(broker, "twin", will=("will/twin", b"old"))
            async with client(broker, identifier="twin") as twin:
                await expect_closed(reader)
                assert (await next_message(sub)).payload == b"old"
                await twin.publish("will/alive", b"new", qos=1)
                assert (await next_message(sub)).payload == b"new"
            writer.close()

    run(body)


# --------------------------------------------------------------------------- ACL


def test_acl_mapping_confines_a_site_to_its_topics() -> None:
    acl = {
        "server": TopicAcl(subscribe=("secagg/up/#",), publish=("secagg/down/#",)),
        "site-1": (["secagg/down/%u/#"], ["secagg/up/%u/#"]),  # (read, write)
    }

    async def body() -> None:
        async with EmbeddedBroker(users=USERS, acl=acl) as broker:
            async with client(broker) as server, client(broker, "site-1") as site:
                await server.subscribe("secagg/up/#", qos=1)
                refused = await site.subscribe("secagg/#", qos=1)
                assert [int(getattr(g, "value", g)) for g in refused] == [0x80]
                ok = await site.subscribe("secagg/down/site-1/#", qos=1)
                assert [int(getattr(g, "value", g)) for g in ok] == [1]
                # Spoofing another site's topic is acknowledged but never routed.
                await site.publish("secagg/up/site-2/x", b"spoof", qos=1)
                await site.publish("secagg/up/site-1/x", b"mine", qos=1)
                assert (await next_message(server)).payload == b"mine"
                await no_message(server)
                await server.publish("secagg/down/site-1/k", b"for-1", qos=1)
                assert (await next_message(site)).payload == b"for-1"
            # Users missing from the mapping get nothing.
            async with client(broker, "site-2") as other:
                refused = await other.subscribe("secagg/down/site-2/#", qos=1)
                assert [int(getattr(g, "value", g)) for g in refused] == [0x80]
            assert broker.stats.acl_denials == 3

    run(body)


def test_acl_callable_and_denied_will() -> None:
    def acl(username: str, action: str, topic: str) -> bool:
        return username == "server" or (action == "publish" and topic == "ok")

    async def body() -> None:
        async with EmbeddedBroker(users=USERS, acl=acl) as broker, client(broker) as sub:
            await sub.subscribe("#", qos=1)
            _, writer = await raw_connect(broker, "w", user="site-1",
                                          will=("forbidden/will", b"x"))
            writer.transport.abort()
            async with client(broker, "site-1") as site:
                await site.publish("ok", b"1", qos=1)
            assert (await next_message(sub)).payload == b"1"
            await no_message(sub)

    run(body)


# --------------------------------------------------------------------------- hostile input


HOSTILE = {
    "garbage": os.urandom(64) + b"\xff" * 16,
    "bad_remaining_length": b"\x10\xff\xff\xff\xff\x7f",
    "truncated_connect": connect_packet("t")[:-5],
    "publish_before_connect": publish_packet("a", b"x"),
    "reserved_type": b"\x00\x00",
    "bad_protocol_name": b"\x10\x0c" + _str("HTTP") + b"\x04\x02\x00\x3c\x00\x00",
    "http_request": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_bytes_close_only_that_connection(name: str) -> None:
    async def body() -> None:
        async with EmbeddedBroker(users=USERS, connect_timeout=1.0) as broker, \
                client(broker) as bystander:
            await bystander.subscribe("health/#", qos=1)
            reader, writer = await raw_open(broker)
            writer.write(HOSTILE[name])
            if name == "truncated_connect":
                writer.write_eof()
            await expect_closed(reader)
            writer.close()
            await assert_broker_healthy(broker)
            # The subscriber that was connected all along still receives.
            assert (await next_message(bystander)).payload == b"ok"

    run(body)


def test_malformed_packets_after_connect() -> None:
    cases = [
        b"\x82\x02\x00\x01",                             # SUBSCRIBE without filters
        b"\x80\x08\x00\x01" + _str("a/b") + b"\x01",     # SUBSCRIBE with wrong flags
        b"\x82\x08\x00\x01" + _str("a/b") + b"\x05",     # reserved QoS bits
        b"\x36\x05" + _str("a/b"),                       # PUBLISH QoS 3
        publish_packet("a/+", b"wildcard in topic"),
        b"\x30\x05\x00\x03\xff\xfe\xfd",                 # topic is not UTF-8
        b"\x32\x05" + _str("a/b"),                       # QoS 1 without packet id
        connect_packet("again"),                         # second CONNECT
    ]

    async def body() -> None:
        async with EmbeddedBroker(users=USERS) as broker:
            for i, packet in enumerate(cases):
                reader, writer = await raw_connect(broker, f"bad-{i}")
                writer.write(packet)
                await expect_closed(reader)
                writer.close()
            assert broker.stats.protocol_errors == len(cases)
            await assert_broker_healthy(broker)

    run(body)


def test_invalid_subscribe_filter_gets_failure_code() -> None:
    async def body() -> None:
        async with EmbeddedBroker(users=USERS) as broker:
            reader, writer = await raw_connect(broker, "filters")
            body_ = b"\x00\x07" + _str("a/#/b") + b"\x01" + _str("ok/+") + b"\x01"
            writer.write(b"\x82" + _varint(len(body_)) + body_)
            assert await reader.readexactly(6) == b"\x90\x04\x00\x07\x80\x01"
            writer.write(b"\xc0\x00")  # PINGREQ
            assert await reader.readexactly(2) == b"\xd0\x00"
            writer.close()

    run(body)


def test_client_that_never_sends_connect_is_closed() -> None:
    async def body() -> None:
        async with EmbeddedBroker(users=USERS, connect_timeout=0.5) as broker:
            reader, writer = await raw_open(broker)
            started = time.monotonic()
            assert await expect_closed(reader, 8.0) == b""
            # closed ~0.5 s in at load average 7; the upper bound stays below the default
            # 10 s connect_timeout, so it still shows the configured one applies
            assert 0.4 < time.monotonic() - started < 8
            writer.close()

    run(body)


def test_oversize_publish_is_refused_before_reading_it() -> None:
    async def body() -> None:
        broker = EmbeddedBroker(users=USERS, max_payload=1 << 20)
        async with broker, client(broker) as sub:
            await sub.subscribe("big/#", qos=1)
            reader, writer = await raw_connect(broker, "oversize")
            # Announce 64 MiB but send only the header: the broker must not wait for it.
            writer.write(b"\x30" + _varint(64 << 20) + _str("big/x"))
            await expect_closed(reader)
            writer.close()
            # Just over the limit with the whole body sent is refused as well.
            reader, writer = await raw_connect(broker, "oversize-2")
            writer.write(publish_packet("big/y", bytes((1 << 20) + 1)))
            await expect_closed(reader)
            writer.close()
            async with client(broker, "site-1") as pub:
                await pub.publish("big/ok", bytes(1 << 20), qos=1)
            assert len((await next_message(sub)).payload) == 1 << 20
            await no_message(sub)

    run(body)


def test_slow_consumer_is_dropped_and_others_keep_receiving() -> None:
    async def body() -> None:
        broker = EmbeddedBroker(users=USERS, max_queued_bytes=1 << 20,
                                slow_consumer_timeout=0.5, max_payload=2 << 20)
        async with broker, client(broker) as fast:
            await fast.subscribe("flood/#", qos=0)
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", broker.port))
            reader, writer = await asyncio.open_connection(sock=sock)
            writer.write(connect_packet("stuck", will=("flood/stuck-will", b"dropped")))
            assert await reader.readexactly(4) == b"\x20\x02\x00\x00"
            sub = b"\x00\x01" + _str("flood/#") + b"\x00"
            writer.write(b"\x82" + _varint(len(sub)) + sub)
            assert await reader.readexactly(5) == b"\x90\x03\x00\x01\x00"
            # From here on the raw client never reads again.
            async with client(broker, "site-1") as pub:
                for i in range(40):
                    await pub.publish(f"flood/{i}", bytes(1 << 20), qos=1)
            received = [str((await next_message(fast, 10)).topic) for _ in range(41)]
            assert "flood/stuck-will" in received
            assert broker.stats.slow_consumers_dropped == 1
            writer.transport.abort()

    run(body, timeout=40)


# --------------------------------------------------------------------------- runners


def test_run_in_thread_for_synchronous_callers() -> None:
    handle = EmbeddedBroker(users=USERS).run_in_thread()
    try:
        assert handle.url == f"mqtt://127.0.0.1:{handle.port}"

        async def body() -> None:
            async with aiomqtt.Client("127.0.0.1", handle.port, username="server",
                                      password=USERS["server"]) as c:
                await c.subscribe("t", qos=1)
                await c.publish("t", b"threaded", qos=1)
                assert (await next_message(c)).payload == b"threaded"

        run(body)
        assert handle.stats.messages_in == 1
    finally:
        handle.stop()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", handle.port), timeout=1).close()


def test_process_entry_point_writes_port_file(tmp_path: Path) -> None:
    users_file = tmp_path / "users.json"
    users_file.write_text(json.dumps(USERS))
    acl_file = tmp_path / "acl.json"
    acl_file.write_text(json.dumps({"server": {"subscribe": ["#"], "publish": ["#"]}}))
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "transport.broker", "--port", "0", "--users-file",
         str(users_file), "--acl-file", str(acl_file), "--port-file", str(port_file),
         "--log-level", "WARNING"],
        # the installed package, from anywhere: no source tree on PYTHONPATH
        cwd=tmp_path, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    try:
        deadline = time.monotonic() + 10
        while not port_file.exists():
            assert proc.poll() is None, "broker process exited early"
            assert time.monotonic() < deadline, "no port file after 10 s"
            time.sleep(0.05)
        port = int(port_file.read_text())

        async def body() -> None:
            async with aiomqtt.Client("127.0.0.1", port, username="server",
                                      password=USERS["server"]) as c:
                await c.subscribe("p", qos=1)
                await c.publish("p", b"proc", qos=1)
                assert (await next_message(c)).payload == b"proc"

        run(body)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def test_tls(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.create_default_context(cafile=str(cert))
    payload = os.urandom(2 << 20)

    async def body() -> None:
        async with EmbeddedBroker(users=USERS, ssl_context=server_ctx,
                                  max_payload=4 << 20) as broker:
            assert broker.url.startswith("mqtts://")
            async with aiomqtt.Client("localhost", broker.port, username="server",
                                      password=USERS["server"], tls_context=client_ctx) as c:
                await c.subscribe("tls", qos=1)
                await c.publish("tls", payload, qos=1)
                got = await next_message(c)
                assert hashlib.sha256(got.payload).digest() == hashlib.sha256(payload).digest()

    run(body)
