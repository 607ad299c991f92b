"""What the drivers need from a message bus: a ``Network`` that opens ``Link``s.

Two implementations: ``transport.mqtt.MqttNetwork`` (aiomqtt, any MQTT 3.1.1 broker) and
``transport.memory.MemoryNetwork`` (one asyncio loop, for tests and embedding). The drivers
in ``transport.drivers`` are written against this interface only, so the same round logic
runs over both::

    async with network.connect("site-7", will=Will(topic, payload)) as link:
        await link.subscribe("secagg/r1/client/site-7/#")
        await link.publish(topic, payload)
        event = await link.receive()          # Delivery, Reconnected, or raises LinkLost

A link reconnects by itself after a lost connection (re-subscribing to what it holds: what was
subscribed and not since unsubscribed; a party scopes a round's topics to the round, so the
list stays a handful long however many rounds run), and reports that with a
``Reconnected`` event so the driver can re-send what may have been lost: MQTT sessions are
clean, so anything in flight during an outage is gone.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

from .errors import TransportError


class LinkError(TransportError):
    """The bus failed in a way the driver cannot recover from."""


class LinkLost(LinkError):
    """The connection was lost and could not be re-established in time."""


@dataclass(frozen=True)
class Will:
    """A last-will message the broker publishes if the connection ends without DISCONNECT."""

    topic: str
    payload: bytes


@dataclass(frozen=True)
class Delivery:
    """One message received on a subscribed topic."""

    topic: str
    payload: bytes


@dataclass(frozen=True)
class Reconnected:
    """The link was re-established after an outage (messages may have been lost)."""

    attempt: int


Event = Delivery | Reconnected


class Link(Protocol):
    """One authenticated connection to the bus."""

    @property
    def name(self) -> str: ...

    async def subscribe(self, topic_filter: str) -> None:
        """Subscribe (QoS 1); kept across reconnections until ``unsubscribe``."""

    async def unsubscribe(self, topic_filter: str) -> None:
        """Drop a subscription: no longer delivered, nor renewed after a reconnection. Never
        raises for a lost link (the broker forgets a clean session's subscriptions)."""

    async def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> bool:
        """Publish at QoS 1. True when the broker acknowledged it; False when it could not be
        sent (link down): the caller relies on protocol-level confirmation either way,
        because a broker may acknowledge a publish its ACL then drops."""

    async def receive(self, timeout: float | None = None) -> Event | None:
        """The next event, or None after ``timeout`` seconds. Raises ``LinkLost``."""


class Network(Protocol):
    """Opens links; knows the broker address and each user's credentials."""

    def connect(self, username: str, *,
                will: Will | None = None) -> AbstractAsyncContextManager[Link]: ...
