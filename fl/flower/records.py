"""The Flower records the adapter puts on the wire, in one place for both sides.

A secure-aggregation message is a ``RecordDict`` with one ``ConfigRecord`` under
:data:`RECORD`: ``setup`` (the round setup, with the first train message only),
``session`` (the round's 32-byte session id, every later message) and ``msg`` (secagg
wire bytes). Nothing else of a train reply leaves a node during a secure round.
"""

from __future__ import annotations

from typing import Any

RECORD = "secagg"
STATE = "secagg.round"
SETUP = "setup"
SESSION = "session"
PAYLOAD = "msg"
PROOF = "proof"
"""With input validation: the site's ``InputProof`` (secagg wire bytes) beside its masked
input's envelope, checked before the masked input (docs/protocol.md 10)."""
STAGE = "stage"


def secagg_record(message: Any) -> Any | None:
    """The adapter's ConfigRecord of a Flower message, or None."""
    if not message.has_content():
        return None
    return message.content.config_records.get(RECORD)


def payload_of(message: Any) -> bytes:
    """The secagg wire bytes of a reply (``ValueError`` if there are none)."""
    record = secagg_record(message)
    value = None if record is None else record.get(PAYLOAD)
    if not isinstance(value, bytes):
        raise ValueError("the reply carries no secure-aggregation message")
    return value


def stage_of(message: Any) -> str | None:
    """The secagg stage whose client message a server message asks for (``None``: not a
    secure-aggregation message): e.g. for a mod that logs or a test that injects dropouts."""
    from secagg.messages import decode, stage_opened_by

    record = secagg_record(message)
    if record is None:
        return None
    if SETUP in record:
        return "advertise_keys"
    payload = record.get(PAYLOAD)
    if not isinstance(payload, bytes):
        return None
    try:
        return stage_opened_by(type(decode(payload))).label
    except ValueError:  # a client message: it opens no stage
        return None
