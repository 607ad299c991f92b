"""Mosquitto started with the generated config: auth, wildcards, ACL, large payloads.

Skipped when no mosquitto binary is installed (CI installs the Debian package).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiomqtt
import pytest

from transport.broker import TopicAcl
from transport.mosquitto import (
    MosquittoBroker,
    MosquittoStartError,
    hash_password,
    mosquitto_available,
    render_acl,
)

pytestmark = [
    pytest.mark.mosquitto,
    pytest.mark.skipif(not mosquitto_available(), reason="mosquitto binary not installed"),
]

USERS = {"server": "pw-server", "site-1": "pw-1", "site-2": "pw-2"}
ACL = {
    "server": TopicAcl(subscribe=("secagg/up/#",), publish=("secagg/down/#",)),
    "site-1": (["secagg/down/%u/#"], ["secagg/up/%u/#"]),
    "site-2": (["secagg/down/%u/#"], ["secagg/up/%u/#"]),
}


def run(coro_fn: Callable[[], Awaitable[None]], timeout: float = 30.0) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(timeout):
            await coro_fn()

    asyncio.run(bounded())


def client(broker: MosquittoBroker, user: str = "server") -> aiomqtt.Client:
    return aiomqtt.Client("127.0.0.1", broker.port, username=user, password=USERS[user])


async def next_message(c: aiomqtt.Client, timeout: float = 5.0) -> aiomqtt.Message:
    async with asyncio.timeout(timeout):
        async for message in c.messages:
            return message
    raise AssertionError("message iterator ended")


async def no_message(c: aiomqtt.Client, wait: float = 0.3) -> None:
    with pytest.raises(TimeoutError):
        await next_message(c, timeout=wait)


def test_render_acl_is_the_documented_text() -> None:
    text = render_acl({
        "server": TopicAcl(subscribe=("secagg/up/#",), publish=("secagg/down/#",)),
        "site-1": (["secagg/down/%u/#", "secagg/all"], ["secagg/up/%u/#", "secagg/all"]),
    })
    assert text == (
        "user server\n"
        "topic read secagg/up/#\n"
        "topic write secagg/down/#\n"
        "\n"
        "user site-1\n"
        "topic read secagg/down/site-1/#\n"
        "topic readwrite secagg/all\n"
        "topic write secagg/up/site-1/#\n"
    )
    with pytest.raises(ValueError, match="%c"):
        render_acl({"a": (["x/%c"], [])})
    with pytest.raises(ValueError, match="username"):
        render_acl({"bad name": ([], [])})


@pytest.mark.skipif(shutil.which("mosquitto_passwd") is None, reason="no mosquitto_passwd")
def test_hash_password_matches_mosquitto_passwd(tmp_path: Path) -> None:
    path = tmp_path / "pw"
    path.write_text("alice:s3cret\n")
    subprocess.run(["mosquitto_passwd", "-U", str(path)], check=True, timeout=10)
    line = path.read_text().strip()
    _, iterations, salt_b64, _ = line.split(":", 1)[1].split("$")[1:]
    import base64

    expected = line.split(":", 1)[1]
    assert hash_password("s3cret", salt=base64.b64decode(salt_b64),
                         iterations=int(iterations)) == expected


def test_auth_wildcards_and_large_payload() -> None:
    payload = os.urandom(8 << 20)

    async def body() -> None:
        async with MosquittoBroker(users=USERS, max_payload=len(payload)) as broker:
            assert broker.url == f"mqtt://127.0.0.1:{broker.port}"
            bad = aiomqtt.Client("127.0.0.1", broker.port, username="site-1", password="no")
            with pytest.raises(aiomqtt.MqttError):
                async with bad:
                    pass
            anonymous = aiomqtt.Client("127.0.0.1", broker.port)
            with pytest.raises(aiomqtt.MqttError):
                async with anonymous:
                    pass
            async with client(broker) as sub, client(broker, "site-1") as pub:
                await sub.subscribe("secagg/+/up", qos=1)
                await sub.subscribe("big/#", qos=1)
                await pub.publish("secagg/site-1/up", b"one", qos=1)
                await pub.publish("secagg/site-1/other", b"skip", qos=1)
                assert (await next_message(sub)).payload == b"one"
                await pub.publish("big/blob", payload, qos=1)
                assert (await next_message(sub, timeout=15)).payload == payload

    run(body)


def test_acl_confines_sites_with_sync_context_manager() -> None:
    with MosquittoBroker(users=USERS, acl=ACL) as broker:
        assert "topic write secagg/up/site-1/#" in (Path(broker.log_path or "").parent
                                                    / "acl").read_text()

        async def body() -> None:
            async with client(broker) as server, client(broker, "site-1") as site:
                await server.subscribe("secagg/up/#", qos=1)
                await site.subscribe("secagg/#", qos=1)  # Mosquitto grants it, delivers less
                await site.subscribe("secagg/down/site-1/#", qos=1)
                await site.publish("secagg/up/site-2/x", b"spoof", qos=1)
                await site.publish("secagg/up/site-1/x", b"mine", qos=1)
                assert (await next_message(server)).payload == b"mine"
                await no_message(server)
                await server.publish("secagg/down/site-2/k", b"for-2", qos=1)
                await server.publish("secagg/down/site-1/k", b"for-1", qos=1)
                assert (await next_message(site)).payload == b"for-1"
                await no_message(site)

        run(body)
    assert not broker.running


def test_start_failure_reports_log_tail() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        broker = MosquittoBroker(users=USERS, port=port, startup_timeout=5)
        with pytest.raises(MosquittoStartError, match="log tail"):
            broker.start()
        assert not broker.running
