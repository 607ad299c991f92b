"""Transport-level control messages: round start/end/abort, receipts, offline notices.

These are not protocol messages (``secagg.messages`` are); they carry no secrets and are
msgpack maps validated field by field. Anything malformed raises ``ControlError``, which the
drivers log and drop.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

from secagg import Config

from . import fields
from .errors import TransportError

MAX_CONTROL_BYTES = 16 << 20


class ControlError(TransportError, ValueError):
    """A control payload that does not decode to a valid control message."""


@dataclass(frozen=True)
class RoundStart:
    """Published (retained) on the control topic when a round opens. Constant size: the
    session id binds the roster and context, which the sites already hold."""

    session_id: bytes
    config: Mapping[str, Any]
    clients: int
    deadlines: Mapping[str, float] = field(default_factory=dict)
    nonce: bytes = b""  # the server's round nonce (Server.nonce), bound by the advertisement


@dataclass(frozen=True)
class RoundEnd:
    session_id: bytes
    included: tuple[int, ...]
    dropped: Mapping[int, str]


@dataclass(frozen=True)
class RoundAbort:
    session_id: bytes
    reason: str


@dataclass(frozen=True)
class Receipt:
    """The server's confirmation (or rejection) of one client message, by its sha256."""

    digest: bytes
    ok: bool
    reason: str = ""


UPLOAD_RECEIPT = bytes(32)
"""The digest of a ``Receipt`` about a client's streamed masked input as a whole (its
upload slot taken back), not about one message."""


@dataclass(frozen=True)
class Grant:
    """The server's upload slot for one client's streamed masked input (flow control,
    docs/deployment.md): stream it now, in chunks of ``chunk_elements`` elements, with at
    most ``window`` chunks unconfirmed (each chunk's ``Receipt`` frees one)."""

    session_id: bytes
    chunk_elements: int
    window: int


@dataclass(frozen=True)
class Offline:
    """A site's last will (``final=False``: the broker may publish it merely because it is
    shutting down) or its own notice that it leaves the round (``final=True``)."""

    reason: str = ""
    final: bool = True


@dataclass(frozen=True)
class ClientAbort:
    """A site's notice that its state machine aborted (so the server stops waiting)."""

    reason: str


Control = RoundStart | RoundEnd | RoundAbort | Receipt | Grant | Offline | ClientAbort


def config_fields(config: Config) -> dict[str, Any]:
    return {"num_clients": config.num_clients, "threshold": config.threshold,
            "dim": config.dim, "bits": config.bits, "neighbors": config.neighbors,
            "security": config.security}


def encode_control(message: Control) -> bytes:
    body: dict[str, Any]
    if isinstance(message, RoundStart):
        body = {"t": "start", "session": message.session_id, "config": dict(message.config),
                "clients": message.clients, "deadlines": dict(message.deadlines)}
        if message.nonce:
            body["nonce"] = message.nonce
    elif isinstance(message, RoundEnd):
        body = {"t": "end", "session": message.session_id, "included": list(message.included),
                "dropped": {int(k): str(v) for k, v in message.dropped.items()}}
    elif isinstance(message, RoundAbort):
        body = {"t": "abort", "session": message.session_id, "reason": message.reason}
    elif isinstance(message, Receipt):
        body = {"t": "receipt", "digest": message.digest, "ok": message.ok,
                "reason": message.reason}
    elif isinstance(message, Grant):
        body = {"t": "grant", "session": message.session_id,
                "chunk": message.chunk_elements, "window": message.window}
    elif isinstance(message, Offline):
        body = {"t": "offline", "reason": message.reason, "final": message.final}
    else:
        body = {"t": "client-abort", "reason": message.reason}
    return fields.pack_map(body)


class _FieldErrors(TypedDict):
    error: type[ValueError]
    what: str


_FIELD: _FieldErrors = {"error": ControlError, "what": "control field"}


def _mapping(body: Mapping[Any, Any], key: str) -> dict[Any, Any]:
    value = body.get(key)
    if not isinstance(value, dict):
        raise ControlError(f"control field {key!r} must be a map")
    return value


def decode_control(data: bytes) -> Control:
    body = fields.unpack_map(data, MAX_CONTROL_BYTES, error=ControlError,
                             max_entries=1 << 21, max_array_len=1 << 21,
                             what="control payload")
    kind = body.get("t")
    if kind == "start":
        config = _mapping(body, "config")
        deadlines = body.get("deadlines", {})
        if not isinstance(deadlines, dict) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) for k, v in deadlines.items()):
            raise ControlError("control field 'deadlines' must map stage -> seconds")
        nonce = body.get("nonce", b"")
        if not isinstance(nonce, bytes) or len(nonce) not in (0, 32):
            raise ControlError("control field 'nonce' must be 32 bytes")
        return RoundStart(fields.raw(body, "session", **_FIELD), config,
                          fields.integer(body, "clients", **_FIELD), deadlines, nonce)
    if kind == "end":
        dropped = body.get("dropped", {})
        if not isinstance(dropped, dict) or not all(
                isinstance(k, int) and isinstance(v, str) for k, v in dropped.items()):
            raise ControlError("control field 'dropped' must map client id -> stage")
        return RoundEnd(fields.raw(body, "session", **_FIELD),
                        fields.site_ids(body, "included", **_FIELD), dropped)
    if kind == "abort":
        return RoundAbort(fields.raw(body, "session", **_FIELD),
                          fields.text(body, "reason", limit=1 << 16, **_FIELD))
    if kind == "receipt":
        digest = fields.raw(body, "digest", (32,), **_FIELD)
        ok = body.get("ok")
        if not isinstance(ok, bool):
            raise ControlError("control field 'ok' must be true or false")
        return Receipt(digest, ok, str(body.get("reason", "")))
    if kind == "grant":
        chunk = fields.integer(body, "chunk", 1, 1 << 40, error=ControlError,
                               what="control field")
        window = fields.integer(body, "window", 1, 1024, error=ControlError,
                                what="control field")
        return Grant(fields.raw(body, "session", error=ControlError, what="control field"),
                     chunk, window)
    if kind == "offline":
        return Offline(str(body.get("reason", "")), body.get("final") is not False)
    if kind == "client-abort":
        return ClientAbort(fields.text(body, "reason", limit=1 << 16, **_FIELD))
    raise ControlError(f"unknown control message type {kind!r}")
