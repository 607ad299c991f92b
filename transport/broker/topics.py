"""MQTT topic names and filters, wildcard matching, and the embedded broker's topic ACL.

Pure functions and immutable values, no I/O: the broker asks :class:`AclPolicy` whether a
user may publish, retain or subscribe; ``transport.mosquitto`` reuses :class:`TopicAcl` and
:func:`validate_topic_filter` to write Mosquitto's ACL file.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from .errors import BrokerConfigError

SERVER_USER = "server"
"""The aggregation server's user name (``transport.topics`` lays out its topics; the
broker's command line exempts it from the publish rate limit by default). Defined here so
that the broker's process imports no more than the broker."""

# One logger for the whole embedded broker, whichever module it lives in.
logger = logging.getLogger("transport.broker")

Action = Literal["publish", "subscribe", "retain"]
AclCallable = Callable[[str, Action, str], bool]
"""``(username, action, topic_or_filter) -> allowed``; called for every PUBLISH/SUBSCRIBE,
and with ``"retain"`` for a PUBLISH that asks the broker to retain it."""


# --------------------------------------------------------------------------- topics


def validate_topic_name(topic: str) -> None:
    """Raise ``ValueError`` unless ``topic`` is a valid PUBLISH topic (no wildcards)."""
    if not topic:
        raise ValueError("topic name must not be empty")
    if "+" in topic or "#" in topic:
        raise ValueError(f"topic name {topic!r} must not contain the wildcards + or #")
    if "\x00" in topic:
        raise ValueError("topic name must not contain U+0000")


def validate_topic_filter(topic_filter: str) -> None:
    """Raise ``ValueError`` unless ``topic_filter`` is a valid subscription filter.

    ``+`` must occupy a whole level and ``#`` must be the whole last level, as in the spec.
    """
    if not topic_filter:
        raise ValueError("topic filter must not be empty")
    if "\x00" in topic_filter:
        raise ValueError("topic filter must not contain U+0000")
    levels = topic_filter.split("/")
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != len(levels) - 1):
            raise ValueError(f"in {topic_filter!r}, '#' must be the whole last level")
        if "+" in level and level != "+":
            raise ValueError(f"in {topic_filter!r}, '+' must be a whole level")


def match_levels(filter_levels: Sequence[str], topic_levels: Sequence[str]) -> bool:
    if topic_levels and topic_levels[0].startswith("$") and filter_levels[0] in ("+", "#"):
        # Spec 4.7.2: wildcards at the first level never match $-topics ($SYS, ...).
        return False
    n_topic = len(topic_levels)
    for i, level in enumerate(filter_levels):
        if level == "#":
            return True
        if i >= n_topic or (level != "+" and level != topic_levels[i]):
            return False
    return len(filter_levels) == n_topic


def topic_matches(topic_filter: str, topic: str) -> bool:
    """True when PUBLISH ``topic`` matches subscription ``topic_filter`` (``+``/``#`` rules)."""
    return match_levels(topic_filter.split("/"), topic.split("/"))


def filter_covers(pattern: str, topic_filter: str) -> bool:
    """True when every topic matched by ``topic_filter`` is also matched by ``pattern``.

    Used for SUBSCRIBE ACLs: a site allowed to read ``secagg/+/site-1/#`` may subscribe to
    ``secagg/r7/site-1/#`` but not to ``secagg/#``.
    """
    p_levels = pattern.split("/")
    f_levels = topic_filter.split("/")
    for i, p in enumerate(p_levels):
        if p == "#":
            return True
        if i >= len(f_levels):
            return False
        f = f_levels[i]
        if f == "#":
            return False
        if p == "+":
            continue
        if f == "+" or f != p:
            return False
    # A longer filter reaches deeper levels than a wildcard-free pattern tail allows.
    return len(f_levels) == len(p_levels)


# --------------------------------------------------------------------------- ACL


@dataclass(frozen=True)
class TopicAcl:
    """Topic patterns one user may subscribe to (read) and publish to (write).

    ``retain`` lists the topics where this user may ask the broker to keep a retained message
    (nowhere by default: a retained message outlives its sender, so only the topics the
    layout needs allow it). Patterns use MQTT wildcards; ``%u`` is replaced by the username
    and ``%c`` by the client id (as in Mosquitto's ``pattern`` lines), the latter only when
    the client id is bound to the username (it is the username or starts with
    ``<username>-``). A tuple ``(read_patterns, write_patterns)`` is accepted wherever a
    ``TopicAcl`` is, in that order (Mosquitto's read/write).
    """

    subscribe: tuple[str, ...] = ()
    publish: tuple[str, ...] = ()
    retain: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("subscribe", "publish", "retain"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise BrokerConfigError(
                    f"TopicAcl.{name} must be a sequence of patterns, not the string "
                    f"{value!r}; wrap it in a list"
                )
            patterns = tuple(value)
            for pattern in patterns:
                try:
                    validate_topic_filter(pattern)
                except ValueError as exc:
                    raise BrokerConfigError(f"bad ACL pattern in TopicAcl.{name}: {exc}") from exc
            object.__setattr__(self, name, patterns)

    def to_json(self) -> dict[str, list[str]]:
        """The entry as the broker's ``--acl-file`` holds it (JSON-ready)."""
        return {"subscribe": list(self.subscribe), "publish": list(self.publish),
                "retain": list(self.retain)}

    @classmethod
    def coerce(cls, value: TopicAcl | tuple[Sequence[str], Sequence[str]]) -> TopicAcl:
        """Accept a ``TopicAcl`` or a ``(read_patterns, write_patterns)`` tuple."""
        if isinstance(value, TopicAcl):
            return value
        if isinstance(value, tuple) and len(value) == 2:
            read, write = value
            return cls(subscribe=tuple(read), publish=tuple(write))
        raise BrokerConfigError(
            f"ACL entry {value!r} must be a TopicAcl or a (read_patterns, write_patterns) tuple"
        )

    def allows(self, action: Action, topic: str, username: str, client_id: str) -> bool:
        """Whether ``username``/``client_id`` may publish to, retain on or subscribe with
        ``topic`` (retaining also needs the right to publish)."""
        if action == "retain":
            return (self.allows("publish", topic, username, client_id)
                    and any(p is not None and topic_matches(p, topic)
                            for p in (_substitute(r, username, client_id)
                                      for r in self.retain)))
        patterns = self.publish if action == "publish" else self.subscribe
        for raw in patterns:
            pattern = _substitute(raw, username, client_id)
            if pattern is None:
                continue
            if action == "publish":
                if topic_matches(pattern, topic):
                    return True
            elif filter_covers(pattern, topic):
                return True
        return False


def client_id_bound(username: str, client_id: str) -> bool:
    """Whether ``client_id`` belongs to ``username``: it is the username or
    ``<username>-<suffix>`` (what the drivers use), so no other user can claim it."""
    return bool(username) and (client_id == username or client_id.startswith(username + "-"))


def _substitute(pattern: str, username: str, client_id: str) -> str | None:
    """Expand ``%u``/``%c``; None when the value would inject a wildcard or a level, or
    when ``%c`` names a client id that is not bound to the username."""
    if "%c" in pattern and not client_id_bound(username, client_id):
        return None
    for token, value in (("%u", username), ("%c", client_id)):
        if token in pattern:
            if not value or any(ch in value for ch in "+#/"):
                return None
            pattern = pattern.replace(token, value)
    return pattern


AclEntry = TopicAcl | tuple[Sequence[str], Sequence[str]]
AclSpec = AclCallable | Mapping[str, AclEntry]
"""A callable ``(username, action, topic) -> bool`` or a mapping username -> TopicAcl."""


class AclPolicy:
    """Normalised ACL: None allows everything; unknown users of a mapping get nothing."""

    def __init__(self, spec: AclSpec | None) -> None:
        self._callable: AclCallable | None = None
        self._table: dict[str, TopicAcl] | None = None
        if spec is None:
            return
        if isinstance(spec, Mapping):
            self._table = {user: TopicAcl.coerce(entry) for user, entry in spec.items()}
        elif callable(spec):
            self._callable = spec
        else:
            raise BrokerConfigError(
                f"acl must be None, a mapping username -> TopicAcl or a callable, "
                f"not {type(spec).__name__}"
            )

    def allowed(self, username: str, client_id: str, action: Action, topic: str) -> bool:
        if self._callable is not None:
            try:
                return bool(self._callable(username, action, topic))
            except Exception:
                # A buggy ACL must fail closed, not crash the connection handler.
                logger.exception("ACL callable raised for %s %s %r; denying", username, action,
                                 topic)
                return False
        if self._table is None:
            return True
        entry = self._table.get(username)
        return entry is not None and entry.allows(action, topic, username, client_id)
