"""The root of every error the transport layer raises: ``except TransportError`` catches
them all. Subclasses keep ``ValueError``/``RuntimeError`` mix-ins where callers relied on them.
"""

from __future__ import annotations


class TransportError(Exception):
    """A transport failure: the round could not be run over the bus (broker unreachable,
    lost for too long), or one of the subclasses (a malformed frame or field, the broker's
    configuration, Mosquitto, a lost link)."""
