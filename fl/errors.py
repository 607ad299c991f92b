"""The root of every error the ``fl`` layer raises: ``except FLError`` catches them all.
Subclasses keep ``ValueError``/``RuntimeError`` mix-ins where callers relied on them; the
privacy layer's refusals stay ``dp.PrivacyError`` (a roster refusal is both)."""

from __future__ import annotations


class FLError(Exception):
    """A federated-learning failure: bad data or options, a checkpoint, an encoding that
    would overflow, a round that failed, a Flower setup or reply refused."""


class NothingReleased(FLError, RuntimeError):
    """A run ended without any round releasing anything (every round aborted or was not
    run): an untrained model is not a result. The message names the rule the sites refused
    on and the fix, when they said one."""
