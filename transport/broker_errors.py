"""The embedded MQTT broker's errors, kept apart so every broker module can raise them.

They live outside ``broker.py`` so that ``python -m transport.broker`` (which runs that file
as ``__main__``) still catches the same classes the other broker modules raise.
"""

from __future__ import annotations


class BrokerError(Exception):
    """Base class of the embedded broker's errors."""


class BrokerConfigError(BrokerError, ValueError):
    """The broker was configured in a way that cannot work; the message says what to change."""


class BrokerStartError(BrokerError, RuntimeError):
    """The broker could not bind or start (port in use, bad TLS context, ...)."""

