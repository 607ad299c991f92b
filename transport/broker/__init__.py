"""Embedded pure-Python asyncio MQTT 3.1.1 broker: the zero-install default broker of secagg.

Why it exists: ``secagg simulate`` and the tests must run with no broker installed, yet the
transport must speak real MQTT so the same driver works against Mosquitto in production.
The broker is not trusted by the protocol (shares are AEAD encrypted, inputs masked), but it
authenticates clients and confines each to its topics, so a site credential can neither
speak for, listen to, nor disrupt another party. What it guarantees, and its limits, are in
docs/deployment.md section 9.

One idea per module, dependencies pointing one way (no cycle)::

    errors <- topics (names, filters, ACL) <- packets (wire format) <- config (limits, stats)
    auth (password hashes, login throttle)      stream (socket I/O, outbox)
    session (one (user, client id): subscriptions, QoS 1 window, queue)
    routing (subscription index, retained store, fan-out) <- connection (packet loop)
    <- broker (EmbeddedBroker, BrokerThread) <- cli (``python -m transport.broker``)

Importing this package does not import ``cli``.
"""

from __future__ import annotations

from .auth import hash_password
from .broker import BrokerThread, EmbeddedBroker
from .config import DEFAULT_MAX_PAYLOAD, BrokerLimits, BrokerStats
from .errors import BrokerConfigError, BrokerError, BrokerStartError
from .packets import MQTT_MAX_REMAINING_LENGTH
from .topics import (
    AclCallable,
    AclEntry,
    AclSpec,
    Action,
    TopicAcl,
    filter_covers,
    topic_matches,
    validate_topic_filter,
    validate_topic_name,
)

__all__ = [
    "DEFAULT_MAX_PAYLOAD",
    "MQTT_MAX_REMAINING_LENGTH",
    "AclCallable",
    "AclEntry",
    "AclSpec",
    "Action",
    "BrokerConfigError",
    "BrokerError",
    "BrokerLimits",
    "BrokerStartError",
    "BrokerStats",
    "BrokerThread",
    "EmbeddedBroker",
    "TopicAcl",
    "filter_covers",
    "hash_password",
    "topic_matches",
    "validate_topic_filter",
    "validate_topic_name",
]
