"""Routing of the embedded broker: an indexed subscription tree, the retained store, fan-out.

:class:`SubscriptionIndex` is a tree on topic levels (``+`` and ``#`` are children like any
other level), so matching a topic costs its depth times the wildcards on the way, not one
comparison per subscription in the broker. :class:`RetainedStore` keeps retained messages
with an owner each and caps them per user and overall. :class:`Router` delivers a message to
every matching session with room at once; a publisher waits only for a subscriber over its
queue limit that is the only one it delivers to (so waiting holds no one else), and only
until that subscriber's drain deadline. :class:`PublishRate` bounds each user's PUBLISH
rate (``BrokerLimits.max_publish_rate``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from typing import Protocol

from .config import BrokerLimits, BrokerStats
from .packets import Message
from .session import Recent, Session

logger = logging.getLogger("transport.broker")


class _Node:
    __slots__ = ("children", "sessions")

    def __init__(self) -> None:
        self.children: dict[str, _Node] = {}
        self.sessions: dict[Session, int] = {}


class SubscriptionIndex:
    """Topic filter tree: ``match(topic)`` -> {session: highest granted QoS}."""

    def __init__(self) -> None:
        self._root = _Node()
        self.count = 0

    def add(self, topic_filter: str, session: Session, qos: int) -> None:
        node = self._root
        for level in topic_filter.split("/"):
            node = node.children.setdefault(level, _Node())
        if session not in node.sessions:
            self.count += 1
        node.sessions[session] = qos

    def remove(self, topic_filter: str, session: Session) -> None:
        path = [self._root]
        levels = topic_filter.split("/")
        for level in levels:
            child = path[-1].children.get(level)
            if child is None:
                return
            path.append(child)
        if path[-1].sessions.pop(session, None) is not None:
            self.count -= 1
        for depth in range(len(levels), 0, -1):  # prune empty branches
            node = path[depth]
            if node.sessions or node.children:
                break
            del path[depth - 1].children[levels[depth - 1]]

    def match(self, topic: str) -> dict[Session, int]:
        levels = topic.split("/")
        out: dict[Session, int] = {}
        dollar = levels[0].startswith("$")

        def take(node: _Node) -> None:
            for session, qos in node.sessions.items():
                if out.get(session, -1) < qos:
                    out[session] = qos

        def walk(node: _Node, depth: int) -> None:
            # Spec 4.7.2: wildcards at the first level never match $-topics ($SYS, ...).
            wild = not (dollar and depth == 0)
            hash_node = node.children.get("#") if wild else None
            if hash_node is not None:
                take(hash_node)  # '#' also matches the parent level itself
            if depth == len(levels):
                take(node)
                return
            child = node.children.get(levels[depth])
            if child is not None:
                walk(child, depth + 1)
            plus = node.children.get("+") if wild else None
            if plus is not None:
                walk(plus, depth + 1)

        walk(self._root, 0)
        return out


class RetainedStore:
    """Retained messages, each owned by the user who set it, capped per user and overall.

    A user at its cap (``max_retained_per_user`` messages or ``max_retained_bytes_per_user``
    bytes) makes room by losing its own oldest retained messages: a long-running aggregator
    keeps its latest control messages, a flooding site only ever holds its cap.
    """

    def __init__(self, limits: BrokerLimits) -> None:
        self._limits = limits
        self._messages: dict[str, tuple[Message, str]] = {}
        self._owned: dict[str, dict[str, None]] = {}  # owner -> its topics, oldest first
        self._bytes: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._messages)

    def items(self) -> list[tuple[str, Message]]:
        return [(topic, message) for topic, (message, _) in self._messages.items()]

    def set(self, message: Message, owner: str) -> bool:
        """Keep (or, with an empty payload, clear) the retained message of its topic; False
        when it cannot be kept (larger than a user's whole allowance, or the store is full
        of other users' messages)."""
        limits = self._limits
        if message.size > limits.max_retained_bytes_per_user:
            return False
        self._remove(message.topic)
        if not message.size:
            return True
        owned = self._owned.setdefault(owner, {})
        while owned and (len(owned) >= limits.max_retained_per_user
                         or self._bytes[owner] + message.size
                         > limits.max_retained_bytes_per_user):
            self._remove(next(iter(owned)))
            owned = self._owned.setdefault(owner, {})
        if len(self._messages) >= limits.max_retained_total:
            if not owned:
                del self._owned[owner]
            return False
        self._messages[message.topic] = (message, owner)
        owned[message.topic] = None
        self._bytes[owner] = self._bytes.get(owner, 0) + message.size
        return True

    def _remove(self, topic: str) -> None:
        entry = self._messages.pop(topic, None)
        if entry is None:
            return
        message, owner = entry
        owned = self._owned[owner]
        del owned[topic]
        self._bytes[owner] -= message.size
        if not owned:
            del self._owned[owner], self._bytes[owner]


THROTTLE_QUANTUM = 0.01
"""A throttled connection sleeps once its debt reaches this many seconds (then in one sleep
for all of it), not after every packet."""


class PublishRate:
    """Token buckets of PUBLISH packets, one per user (shared by its connections): ``rate``
    per second, ``burst`` at once; users in ``unthrottled`` are not limited."""

    def __init__(self, rate: float, burst: int, unthrottled: Collection[str] = ()) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.unthrottled = frozenset(unthrottled)
        self._buckets: dict[str, tuple[float, float]] = {}  # user -> (tokens, when)

    def take(self, user: str) -> float:
        """Take one packet's token; the seconds the caller must pause before reading more
        (0 while the user is within its budget or its debt is under ``THROTTLE_QUANTUM``)."""
        if user in self.unthrottled:
            return 0.0
        now = time.monotonic()
        tokens, at = self._buckets.get(user, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate) - 1.0
        self._buckets[user] = (tokens, now)
        debt = -tokens / self.rate
        return debt if debt >= THROTTLE_QUANTUM else 0.0


class Publisher(Protocol):
    """What the router keeps per publishing connection: the sessions it delivered to."""

    destinations: Recent


class Router:
    """Fans a message out to the matching sessions; drops subscribers that stop draining."""

    def __init__(self, limits: BrokerLimits, stats: BrokerStats,
                 drop_slow: Callable[[Session], None],
                 penalized: Callable[[str], bool]) -> None:
        self.limits = limits
        self.stats = stats
        self.index = SubscriptionIndex()
        self.retained = RetainedStore(limits)
        self._drop_slow = drop_slow
        self._penalized = penalized

    def deliver(self, session: Session, message: Message, qos: int, retain: bool) -> None:
        if session.deliver(message, qos, retain):
            self.stats.messages_out += 1
            self.stats.bytes_out += message.size
        else:
            self.stats.messages_dropped += 1
        if session.connection is not None and session.over():
            if session.over(2.0):
                self._drop_slow(session)
            elif session.over_since is None:
                session.over_since = time.monotonic()  # its drain deadline starts

    def fan_out(self, message: Message, publisher: Publisher | None = None
                ) -> list[tuple[Session, int]]:
        """Queue ``message`` now for every matching session, except those over their limit
        that ``publisher`` may wait for (:meth:`_may_wait`): returned with the QoS to use,
        to deliver to with :meth:`deliver_late`. Without ``publisher`` (wills) every
        session gets it now."""
        late = []
        matched = self.index.match(message.topic)
        if publisher is not None and matched:
            self._record(publisher, matched)
        for session, granted in matched.items():
            qos = min(granted, message.qos)
            if publisher is not None and session.connection is not None and session.over():
                if self._penalized(session.username):
                    self._drop_slow(session)  # dropped as slow recently: no more waiting
                elif self._may_wait(publisher, session):
                    late.append((session, qos))
                    continue
            self.deliver(session, message, qos, retain=False)
        return late

    def _record(self, publisher: Publisher, matched: dict[Session, int]) -> None:
        now = time.monotonic()
        window = self.limits.slow_consumer_timeout
        for session in matched:
            publisher.destinations.note(session, now, window)
            session.sources.note(publisher, now, window)

    def _may_wait(self, publisher: Publisher, session: Session) -> bool:
        """Whether ``publisher`` may wait for ``session`` (over its limit): only when that
        holds no one else and spares the subscriber's memory. The publisher delivered to
        no other session for ``slow_consumer_timeout`` seconds (a site streaming to the
        server; not the server, which answers every site), and the session has other
        publishers too (the server's inbox, fed by every site; not a site's inbox, which
        only the server feeds: there the copy is queued and the drain deadline decides)."""
        since = time.monotonic() - self.limits.slow_consumer_timeout
        return (not publisher.destinations.other_since(session, since)
                and session.sources.other_since(publisher, since))

    def check_drain(self, session: Session, now: float) -> None:
        """Disconnect ``session`` when it stayed over its queue limit for
        ``slow_consumer_timeout`` seconds (the broker's watchdog calls this)."""
        if session.connection is None or not session.over():
            session.over_since = None
            return
        if session.over_since is None:
            session.over_since = now
        elif now - session.over_since >= self.limits.slow_consumer_timeout:
            self._drop_slow(session)

    async def deliver_late(self, session: Session, message: Message, qos: int) -> None:
        """Wait while ``session`` is over its limit, at most until its drain deadline
        (``slow_consumer_timeout`` after it went over), then queue ``message``; a session
        still over it then is disconnected (a persistent one still queues it)."""
        timeout = self.limits.slow_consumer_timeout
        while session.connection is not None and session.over():
            if session.over_since is None:
                session.over_since = time.monotonic()
            remaining = session.over_since + timeout - time.monotonic()
            if remaining <= 0:
                self._drop_slow(session)
                break
            await session.wait_room(remaining)
        self.deliver(session, message, qos, retain=False)
        session.notify_room()  # the next waiting publisher, if there is still room
