"""The embedded broker's limits and counters: every bound it enforces, in one place.

Each limit is there because a client with one valid login (or none: raw bytes on a socket)
could otherwise make the broker spend memory, CPU or other clients' time without bound;
docs/deployment.md lists what each guarantees. ``BrokerLimits()`` are the defaults the CLI
and ``secagg simulate`` use.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import BrokerConfigError
from .packets import MQTT_MAX_REMAINING_LENGTH

DEFAULT_MAX_PAYLOAD = 256 << 10
"""Largest PUBLISH payload by default: the transport's frames (``transport.framing``) are at
most 256 KiB, so nothing the package sends is larger; raise it for other uses."""


@dataclass(frozen=True)
class BrokerLimits:
    """Bounds on what any one client, user or the whole broker may hold.

    Sizes are bytes, times seconds. ``max_queued_bytes`` is one subscriber's outbound queue.
    A publisher waits (TCP back-pressure) for a subscriber over it only while that
    subscriber is the only one it delivered to for ``slow_consumer_timeout`` seconds and
    other publishers feed that subscriber too (sites streaming to the server); otherwise
    (the server answering every site, whose inboxes only it feeds) it never waits: the slow
    subscriber's copy is queued over its limit. A
    subscriber that does not drain below its limit within ``slow_consumer_timeout`` seconds
    of going over it (progress or not), or whose queue passes twice the limit, is
    disconnected. For ``slow_consumer_penalty`` seconds after that, over the limit that
    user's subscriptions are disconnected at once (reconnecting to stall publishers again
    does not work).

    ``max_publish_rate`` PUBLISH packets per second per user, in bursts of up to
    ``max_publish_burst``, bound what one login can make the broker and its subscribers
    process: over it, the broker stops reading that user's connections until it is back
    under (TCP back-pressure on the flooder alone; ``EmbeddedBroker(unthrottled=)`` exempts
    the aggregator, which publishes for every site; ``python -m transport.broker`` exempts
    user ``server`` unless ``--unthrottled`` names others).
    """

    max_payload: int = DEFAULT_MAX_PAYLOAD
    max_connect_packet: int = 16 << 10
    max_control_packet: int = 64 << 10
    connect_timeout: float = 10.0
    packet_timeout: float = 30.0
    max_keepalive: int = 300
    max_queued_bytes: int = 16 << 20
    slow_consumer_timeout: float = 10.0
    slow_consumer_penalty: float = 300.0
    max_inflight: int = 64
    max_publish_rate: float = 1000.0
    max_publish_burst: int = 2000
    max_session_queue: int = 1000
    max_connections: int = 4096
    max_connections_per_user: int = 64
    max_pending_logins: int = 1024
    max_pending_logins_per_address: int = 256
    max_subscriptions: int = 64
    max_subscriptions_total: int = 100_000
    max_retained_per_user: int = 16
    max_retained_bytes_per_user: int = 4 << 20
    max_retained_total: int = 10_000
    max_sessions_per_user: int = 16
    login_failure_delay: float = 0.25
    login_failure_max_delay: float = 5.0
    packets_per_yield: int = 16

    def __post_init__(self) -> None:
        for spec in dataclasses.fields(self):
            value = getattr(self, spec.name)
            if not value > 0:
                raise BrokerConfigError(f"BrokerLimits.{spec.name} must be positive, got "
                                        f"{value!r}")
        if self.max_payload > MQTT_MAX_REMAINING_LENGTH:
            raise BrokerConfigError(
                f"max_payload must be in 1..{MQTT_MAX_REMAINING_LENGTH} (the MQTT maximum), "
                f"got {self.max_payload}")
        if self.max_keepalive > 0xFFFF:
            raise BrokerConfigError("max_keepalive must be at most 65535 s (the MQTT field)")

    def for_parties(self, parties: int, *, one_address: bool = True) -> BrokerLimits:
        """These limits for a broker that ``parties`` known users (a round's sites and its
        server) log in to, all at once and possibly from one address (``secagg simulate``
        runs them all on loopback): room for each of them to wait for its login, to stay
        connected, and for one subscriber (the server) to hold a message from each of them
        in its session queue. The caps only grow, never below the defaults; every
        per-connection and per-user bound (payload, queued bytes, subscriptions, retained,
        login throttling) is unchanged. ``one_address=False`` (a broker listening off
        loopback, where the parties come from their own addresses) keeps the per-address
        place: one address gains nothing."""
        if not isinstance(parties, int) or isinstance(parties, bool) or not (
                0 <= parties <= MAX_PARTIES):
            raise BrokerConfigError(f"parties must be an integer from 0 to {MAX_PARTIES}, "
                                    f"got {parties!r}")
        room = parties + 64  # the parties, plus reconnections overlapping their old sockets
        per_address = self.max_pending_logins_per_address
        return self.replace(
            max_pending_logins_per_address=max(per_address, room) if one_address
            else per_address,
            max_pending_logins=max(self.max_pending_logins, room),
            max_connections=max(self.max_connections, 2 * room),
            max_session_queue=max(self.max_session_queue, 2 * room))

    def replace(self, **changes: object) -> BrokerLimits:
        """A copy with ``changes``; unknown names are a configuration error."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise BrokerConfigError(f"unknown broker limits {unknown}; known: {sorted(names)}")
        # the names are checked above; each value's type is the field's to check
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


MAX_PARTIES = 1 << 16
"""The most parties ``BrokerLimits.for_parties`` sizes a broker for (a round's roster is
at most this many sites in practice; beyond it the places would only serve an attacker)."""


@dataclass
class BrokerStats:
    """Counters for reports: payload bytes only (headers excluded), messages per direction."""

    connections_total: int = 0
    connections_current: int = 0
    connections_refused: int = 0
    messages_in: int = 0
    bytes_in: int = 0
    messages_out: int = 0
    bytes_out: int = 0
    messages_dropped: int = 0
    retained_messages: int = 0
    retain_denials: int = 0
    auth_failures: int = 0
    acl_denials: int = 0
    protocol_errors: int = 0
    slow_consumers_dropped: int = 0
    publishes_throttled: int = 0
    wills_published: int = 0
    redelivered: int = 0

    def as_dict(self) -> dict[str, int]:
        """JSON-friendly copy for benchmark and simulation reports."""
        return dataclasses.asdict(self)
