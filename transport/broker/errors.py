"""The embedded broker's errors, importable by every broker module without a cycle."""

from __future__ import annotations

from ..errors import TransportError


class BrokerError(TransportError):
    """Base class of the embedded broker's errors."""


class BrokerConfigError(BrokerError, ValueError):
    """The broker was configured in a way that cannot work; the message says what to change."""


class BrokerStartError(BrokerError, RuntimeError):
    """The broker could not bind or start (port in use, bad TLS context, ...)."""
