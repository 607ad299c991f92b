"""An in-memory message bus with MQTT semantics, on one asyncio loop.

The same interface as ``transport.mqtt.MqttNetwork`` (see ``transport.link``): topic
wildcards, retained messages, last wills, an optional per-user ACL, and a simulated broker
restart. For tests and for embedding the protocol in a single process::

    network = MemoryNetwork(acl=topics.acl_table(roster))
    result = await run_round(network, config, inputs, drop={3: Stage.SHARE_KEYS})

Fault injection: ``network.tap`` sees every publish and may rewrite, drop or duplicate it
(return a list of payloads); ``kill(username)`` ends a connection abruptly (its will is
published); ``restart()`` drops every connection and every retained message, as a broker
restart without persistence does, and the links reconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager

from .broker.topics import AclEntry, Action, TopicAcl, topic_matches
from .link import Delivery, Event, LinkLost, Reconnected, Will

logger = logging.getLogger(__name__)

Tap = Callable[[str, str, bytes], list[bytes]]
"""``(username, topic, payload) -> payloads to route instead`` (``[]`` drops it)."""


class MemoryLink:
    """A connection to a ``MemoryNetwork``; see ``transport.link.Link``."""

    def __init__(self, network: MemoryNetwork, username: str, will: Will | None) -> None:
        self._network = network
        self._name = username
        self._will = will
        self._filters: list[str] = []
        self._queue: asyncio.Queue[Event | BaseException] = asyncio.Queue()
        self.connected = True
        self._reconnects = 0

    @property
    def name(self) -> str:
        return self._name

    async def subscribe(self, topic_filter: str) -> None:
        if not self._network.allowed(self._name, "subscribe", topic_filter):
            logger.warning("memory bus: %s may not subscribe to %s", self._name, topic_filter)
            return
        if topic_filter not in self._filters:
            self._filters.append(topic_filter)
        for topic, payload in list(self._network.retained.items()):
            if topic_matches(topic_filter, topic):
                self._queue.put_nowait(Delivery(topic, payload))

    async def unsubscribe(self, topic_filter: str) -> None:
        if topic_filter in self._filters:
            self._filters.remove(topic_filter)

    @property
    def subscriptions(self) -> tuple[str, ...]:
        """The filters this link holds (renewed after a restart)."""
        return tuple(self._filters)

    async def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> bool:
        if not self.connected:
            await self._network.wait_up()
            if not self.connected:
                return False
        await asyncio.sleep(0)  # a publish is a suspension point, as on a real socket
        self._network.route(self._name, topic, bytes(payload), retain)
        return True

    async def receive(self, timeout: float | None = None) -> Event | None:
        try:  # as MqttLink: a queued event is returned even with timeout 0
            async with asyncio.timeout(timeout):
                item = await self._queue.get()
        except TimeoutError:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def matches(self, topic: str) -> bool:
        return any(topic_matches(f, topic) for f in self._filters)

    def deliver(self, event: Event | BaseException) -> None:
        self._queue.put_nowait(event)

    def drop(self, *, publish_will: bool) -> None:
        """End the connection; the network may bring it back (``restart``)."""
        self.connected = False
        if publish_will and self._will is not None:
            will, self._will = self._will, None
            self._network.route(self._name, will.topic, will.payload, False)

    def reconnect(self) -> None:
        self.connected = True
        self._reconnects += 1
        for topic, payload in list(self._network.retained.items()):
            if self.matches(topic):
                self._queue.put_nowait(Delivery(topic, payload))
        self._queue.put_nowait(Reconnected(self._reconnects))


class MemoryNetwork:
    """An in-process bus; ``connect(username, will=...)`` opens a ``MemoryLink``."""

    def __init__(self, acl: Mapping[str, AclEntry] | None = None) -> None:
        self._acl = ({user: TopicAcl.coerce(entry) for user, entry in acl.items()}
                     if acl is not None else None)
        self._links: dict[str, MemoryLink] = {}
        self.retained: dict[str, bytes] = {}
        self.tap: Tap | None = None
        self.published: list[tuple[str, str, int]] = []  # (username, topic, bytes)
        self._up = asyncio.Event()
        self._up.set()

    def allowed(self, username: str, action: str, topic: str) -> bool:
        if self._acl is None:
            return True
        entry = self._acl.get(username)
        kind: Action = ("publish" if action == "publish" else
                        "retain" if action == "retain" else "subscribe")
        return entry is not None and entry.allows(kind, topic, username, username)

    @asynccontextmanager
    async def connect(self, username: str, *,
                      will: Will | None = None) -> AsyncIterator[MemoryLink]:
        await self._up.wait()
        old = self._links.get(username)
        if old is not None:
            old.drop(publish_will=True)  # a second connection takes over, as in MQTT
        link = MemoryLink(self, username, will)
        self._links[username] = link
        try:
            yield link
        finally:
            link.drop(publish_will=False)
            if self._links.get(username) is link:
                del self._links[username]

    def route(self, username: str, topic: str, payload: bytes, retain: bool) -> None:
        if not self.allowed(username, "retain" if retain else "publish", topic):
            logger.warning("memory bus: %s may not %s to %s; dropped", username,
                           "publish retained" if retain else "publish", topic)
            return
        payloads = [payload] if self.tap is None else self.tap(username, topic, payload)
        for data in payloads:
            self.published.append((username, topic, len(data)))
            if retain:
                if data:
                    self.retained[topic] = data
                else:
                    self.retained.pop(topic, None)
            for link in list(self._links.values()):
                if link.connected and link.matches(topic):
                    link.deliver(Delivery(topic, data))

    def inject(self, topic: str, payload: bytes) -> None:
        """Deliver ``payload`` on ``topic`` as if a (privileged) party had published it."""
        for link in list(self._links.values()):
            if link.connected and link.matches(topic):
                link.deliver(Delivery(topic, payload))

    def kill(self, username: str) -> None:
        """End ``username``'s connection abruptly: the network publishes its will, and the
        link reports ``LinkLost`` to its owner."""
        link = self._links.pop(username, None)
        if link is None:
            return
        link.drop(publish_will=True)
        link.deliver(LinkLost(f"{username}: connection killed"))

    async def wait_up(self) -> None:
        await self._up.wait()

    async def restart(self, downtime: float = 0.1, *, persistent: bool = False) -> None:
        """Drop every connection and retained message (``persistent``: a broker that keeps
        its retained messages across the restart, as Mosquitto with ``persistence true``),
        then let the links reconnect (each is re-delivered what is retained)."""
        self._up.clear()
        for link in self._links.values():
            link.drop(publish_will=False)
        if not persistent:
            self.retained.clear()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(downtime)
        self._up.set()
        for link in list(self._links.values()):
            link.reconnect()
