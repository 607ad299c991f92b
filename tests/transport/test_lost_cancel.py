"""A cancellation that the MQTT library drops while a link connects still stops the task.

On Python 3.11 ``asyncio.wait_for`` (aiomqtt's wait for the CONNACK) returns its result and
drops a cancellation that arrives as its future completes. ``secagg simulate``'s server
task, cancelled while it connected, then went on to wait for its round and ``stop_task``
waited for ever (CI: tests/transport/test_logical_deadlines.py hung 600 s; about 1 run in 8
of its wall-clock half). Here the connect attempt drops the cancel deterministically, as
that ``wait_for`` does, and returns a connection: ``MqttLink.open`` must end cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from transport.mqtt import BrokerSettings, MqttLink


class _Connected:
    """A stand-in for a connected aiomqtt client (only what closing it reads)."""

    _connected = None
    _client = None


def test_a_cancel_dropped_inside_the_connect_still_cancels_the_link(monkeypatch: Any) -> None:
    async def dropping(self: MqttLink, deadline: float, last: list[Exception]) -> Any:
        # what 3.11's wait_for does when its future completes with the cancel:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(30)  # the CONNACK wait
        return _Connected()

    monkeypatch.setattr(MqttLink, "_try_connect", dropping)

    async def scenario() -> asyncio.Task[None]:
        link = MqttLink(BrokerSettings(connect_timeout=60.0), "server", None)
        task = asyncio.create_task(link.open())
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.wait({task}, timeout=5)
        return task

    task = asyncio.run(scenario())
    assert task.done() and task.cancelled(), "the link went on as if it had not been cancelled"
