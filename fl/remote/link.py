"""A party's one connection to the broker, shared by the federation and the secagg rounds.

A broker that binds client identifiers to usernames (Mosquitto with
``use_username_as_clientid``, docs/deployment.md) closes an older connection of the same
user, so a coordinator or site holds exactly one ``transport`` link (opened by a
``transport.link.Network``, with the party's federation-level last will). :class:`PartyLink`
reads it and routes each event: deliveries under the current secagg round's topics go to
that round's :class:`RoundView` (the ``transport.link.Link`` its ``transport.drivers``
driver runs on), everything else to the federation's queue; reconnections and a lost link
go to both.

The party's one last will is federation-level; the role that hears it forwards it into
the open round (:meth:`PartyLink.to_round`), so the secagg driver stops waiting for a dead
party as it would on its own will.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from transport import Delivery, Event, Link, LinkLost, Network, Reconnected, Topics, Will

Item = Event | LinkLost


class _Inbox:
    """An event queue whose ``receive`` has ``transport.link.Link``'s contract."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Item] = asyncio.Queue()

    def put(self, item: Item) -> None:
        self._queue.put_nowait(item)

    async def receive(self, timeout: float | None = None) -> Event | None:
        try:
            item = await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            return None
        if isinstance(item, LinkLost):
            self._queue.put_nowait(item)  # every later receive fails the same way
            raise item
        return item


class RoundView(_Inbox):
    """The ``transport.link.Link`` of one secagg round on a party's shared connection."""

    def __init__(self, link: Link, topics: Topics) -> None:
        super().__init__()
        self._link = link
        self.topics = topics
        self.prefix = topics.base + "/"
        self.filters: list[str] = []
        self.ended = False  # PartyLink.end_round: its driver was told the round is over

    @property
    def name(self) -> str:
        return self._link.name

    async def subscribe(self, topic_filter: str) -> None:
        """Subscribe for this round only: :meth:`PartyLink.round` drops it at the end."""
        if topic_filter not in self.filters:
            self.filters.append(topic_filter)
        await self._link.subscribe(topic_filter)

    async def unsubscribe(self, topic_filter: str) -> None:
        if topic_filter in self.filters:
            self.filters.remove(topic_filter)
        await self._link.unsubscribe(topic_filter)

    async def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> bool:
        return await self._link.publish(topic, payload, retain=retain)


class PartyLink(_Inbox):
    """The federation's side of a party's connection (see the module docstring)."""

    def __init__(self, link: Link) -> None:
        super().__init__()
        self.link = link
        self._round: RoundView | None = None
        self.lost: LinkLost | None = None
        self.round_heard_at = 0.0
        """``loop.time()`` of the last delivery on the open round's topics (what the round's
        server sends: the party hears from it there while the round runs)."""

    @property
    def name(self) -> str:
        return self.link.name

    async def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> bool:
        return await self.link.publish(topic, payload, retain=retain)

    async def subscribe(self, topic_filter: str) -> None:
        await self.link.subscribe(topic_filter)

    async def unsubscribe(self, topic_filter: str) -> None:
        await self.link.unsubscribe(topic_filter)

    @contextlib.asynccontextmanager
    async def round(self, topics: Topics) -> AsyncIterator[RoundView]:
        """Route ``topics``' deliveries to a fresh view while the block runs; what the view
        subscribed is unsubscribed when it ends, so a party holds the same few subscriptions
        at round 1,000 as at round 1 (a broker caps them per session: the embedded broker
        at 64, which a federation reached at round 32 when rounds kept theirs)."""
        view = RoundView(self.link, topics)
        if self.lost is not None:
            view.put(self.lost)
        self._round = view
        try:
            yield view
        finally:
            if self._round is view:
                self._round = None
            # Bounded by the link: it stops waiting once the connection is down, and a
            # reconnection renews only what is still held.
            for topic_filter in list(view.filters):
                await view.unsubscribe(topic_filter)

    def end_round(self, reason: str) -> None:
        """The federation says the open round is over for this party (its coordinator moved
        on, or went silent past the party's idle limit): the round's view fails with
        ``LinkLost(reason)``, so its driver stops now instead of waiting for a round end
        that a restarted broker may have lost. No round open: nothing."""
        view = self._round
        if view is not None and not view.ended:
            view.ended = True
            view.put(LinkLost(reason))

    def to_round(self, delivery: Delivery) -> None:
        """Hand the open round a delivery (a forwarded last will); no round: dropped."""
        if self._round is not None:
            self._round.put(delivery)

    async def pump(self) -> None:
        try:
            while True:
                event = await self.link.receive()
                current = self._round
                if isinstance(event, Reconnected):
                    self.put(event)
                    if current is not None:
                        current.put(event)
                elif isinstance(event, Delivery):
                    if current is not None and event.topic.startswith(current.prefix):
                        self.round_heard_at = asyncio.get_running_loop().time()
                        current.put(event)
                    else:
                        self.put(event)
        except LinkLost as exc:
            self.lost = exc
            self.put(exc)
            if self._round is not None:
                self._round.put(exc)


@contextlib.asynccontextmanager
async def connect_party(network: Network, username: str, will: Will) -> AsyncIterator[PartyLink]:
    """Connect as ``username`` with ``will`` and route the link's events while open."""
    async with network.connect(username, will=will) as link:
        party = PartyLink(link)
        pump = asyncio.create_task(party.pump(), name=f"party-pump-{username}")
        try:
            yield party
        finally:
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pump
