"""The wire codec (docs/protocol.md section 6.1): a message on the wire is a msgpack array
``[b"SA1", kind, session_id, party, *fields]`` where ``party`` is the sender (client
messages) or the recipient (server messages); its fields are the kind's row of the wire
table (``secagg/messages/kinds.py``), in the canonical msgpack of ``secagg/wire.py``.

``decode`` validates every type, length, id and range before building a message and raises
``DecodeError`` (a ``ProtocolError``) for anything else; it never returns a half-checked
object. Layouts are normative: docs/protocol.md section 6.
"""

from __future__ import annotations

from typing import Any

from ..wire import Reader, array_header, fail, pack_value
from .classes import Ciphertexts, KeyList, Message, ServerMessage, SurvivorList, UnmaskRequest
from .kinds import MESSAGE_KINDS, SERVER_KINDS, Limits, MessageKind, spec_of

MAGIC = b"SA1"
SESSION_BYTES = 32
_MAGIC_PACKED = pack_value(MAGIC)
_KIND_VALUES = frozenset(int(k) for k in MessageKind)
_MAX_ARITY = max(spec.arity for spec in MESSAGE_KINDS.values())


def encode(message: Message) -> bytes:
    """The wire bytes of ``message`` (canonical msgpack, docs/protocol.md section 6.1); the
    masked vector is copied once, into the result."""
    spec = spec_of(message)
    party = message.client_id if spec.client else message.recipient  # type: ignore[union-attr]
    parts: list[bytes | memoryview] = [
        array_header(spec.arity), _MAGIC_PACKED, pack_value(int(spec.kind)),
        pack_value(message.session_id), pack_value(party)]
    for fld in spec.fields:
        parts += fld.pack(getattr(message, fld.attr))
    return b"".join(parts)


def client_message_limit(num_clients: int) -> int:
    """The largest valid server message to a client of a round of ``num_clients`` clients:
    the bound ``Client.max_message_bytes`` returns and its decoder enforces."""
    return 4096 + num_clients * (4 * 32 + 64 + 160) + 64 * num_clients


def decode(data: bytes | bytearray | memoryview, *, max_bytes: int = 1 << 31,
           max_entries: int = 1 << 20, max_vector_bytes: int = 1 << 34,
           kinds: frozenset[int] | None = None) -> Message:
    """Parse and validate wire bytes; raises ``DecodeError`` on anything malformed.

    ``max_entries`` bounds every map and list, ``max_vector_bytes`` the masked vector,
    ``kinds`` the message kinds accepted (e.g. ``SERVER_KINDS`` at a client); all are
    checked before the part they bound is read."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise fail("expected bytes")
    if len(data) > max_bytes:
        raise fail(f"{len(data)} bytes is more than the {max_bytes} this round allows")
    reader = Reader(bytes(data))
    count = reader.array("the envelope [magic, kind, session, party, ...]", _MAX_ARITY)
    if count < 4:
        raise fail("expected an array [magic, kind, session, party, ...]")
    if reader.bin("magic", limit=len(MAGIC)) != MAGIC:
        raise fail("wrong magic (not a secagg v1 message)")
    value = reader.uint("kind")
    if value not in _KIND_VALUES:
        raise fail(f"unknown message kind {value!r}")
    spec = MESSAGE_KINDS[MessageKind(value)]
    if kinds is not None and spec.kind not in kinds:
        side = "client" if spec.client else "server"
        raise fail(f"a {side} message (kind {value}) is not accepted here")
    if count != spec.arity:
        raise fail(f"kind {value} has {spec.arity} fields, got {count}")
    session = reader.bin("session id", SESSION_BYTES)
    party = reader.client_id("client id")
    limits = Limits(max_entries, max_vector_bytes)
    values: list[Any] = []
    for fld in spec.fields:
        values.append(fld.read(reader, limits, values))
    message: Message = spec.message(session, party, *values)
    if reader.pos != len(reader.data):
        raise fail("trailing bytes after the message")
    return message


def decode_server_message(data: bytes | bytearray | memoryview, num_clients: int
                          ) -> ServerMessage:
    """A server message to a client of a round of ``num_clients`` clients, decoded with
    that round's limits (size, entries)."""
    message = decode(data, max_bytes=client_message_limit(num_clients),
                     max_entries=num_clients, max_vector_bytes=0, kinds=SERVER_KINDS)
    assert isinstance(message, (KeyList, Ciphertexts, SurvivorList, UnmaskRequest))
    return message
