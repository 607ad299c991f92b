"""Routing of the embedded broker: an indexed subscription tree, the retained store, fan-out.

:class:`SubscriptionIndex` is a tree on topic levels (``+`` and ``#`` are children like any
other level), so matching a topic costs its depth times the wildcards on the way, not one
comparison per subscription in the broker. :class:`RetainedStore` keeps retained messages
with an owner each and caps them per user and overall. :class:`Router` delivers a message to
every matching session with room at once; only the publisher waits, and only for a
subscriber that is over its queue limit and still draining, before queueing its copy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from .config import BrokerLimits, BrokerStats
from .packets import Message
from .session import Session

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
        if session.connection is not None and session.over(2.0):
            self._drop_slow(session)

    def fan_out(self, message: Message, *, wait: bool = True) -> list[tuple[Session, int]]:
        """Queue ``message`` now for every matching session that has room; returns those
        over their limit, with the QoS to use (the publisher delivers to them with
        :meth:`deliver_late`). With ``wait=False`` (wills) every session gets it now."""
        late = []
        for session, granted in self.index.match(message.topic).items():
            qos = min(granted, message.qos)
            if wait and session.connection is not None and session.over():
                if self._penalized(session.username):
                    self._drop_slow(session)  # dropped as slow recently: no more waiting
                    self.deliver(session, message, qos, retain=False)
                else:
                    late.append((session, qos))
            else:
                self.deliver(session, message, qos, retain=False)
        return late

    async def deliver_late(self, session: Session, message: Message, qos: int) -> None:
        """Wait while ``session`` is over its limit and keeps making progress, then queue
        ``message``; drop the session's connection once it made no progress for
        ``slow_consumer_timeout`` seconds (a persistent session still queues it)."""
        timeout = self.limits.slow_consumer_timeout
        while session.connection is not None and session.over():
            remaining = session.progress_at + timeout - time.monotonic()
            if remaining <= 0:
                self._drop_slow(session)
                break
            await session.wait_room(remaining)
        self.deliver(session, message, qos, retain=False)
        session.notify_room()  # the next waiting publisher, if there is still room
