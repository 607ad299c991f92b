"""The protocol messages as typed, immutable dataclasses, and their msgpack wire codec.

A message on the wire is a msgpack array ``[b"SA1", kind, session_id, party, *fields]``
where ``party`` is the sender (client messages) or the recipient (server messages).
``decode`` validates every type, length, id and range before building a message and raises
``DecodeError`` (a ``ProtocolError``) for anything else; it never returns a half-checked
object. Layouts are normative: docs/protocol.md section 6.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, cast

import msgpack  # type: ignore[import-untyped]
import numpy as np

from .crypto import KEY_BYTES, SIGNATURE_BYTES
from .errors import DecodeError
from .shamir import SHARE_BYTES
from .stage import Stage

MAGIC = b"SA1"
SESSION_BYTES = 32
MAX_CLIENT_ID = (1 << 32) - 1
SHARE_PLAINTEXT_BYTES = 4 + 4 + 2 * SHARE_BYTES
CIPHERTEXT_BYTES = SHARE_PLAINTEXT_BYTES + 16


def _frozen(mapping: Mapping[int, Any]) -> Mapping[int, Any]:
    return MappingProxyType(dict(sorted(mapping.items())))


# --- client -> server ---------------------------------------------------------------------


@dataclass(frozen=True)
class AdvertiseKeys:
    """Stage advertise_keys: the client's two fresh X25519 public keys, a commitment to its
    self-mask seed, and (malicious mode) its Ed25519 signature over them."""

    session_id: bytes
    client_id: int
    encryption_key: bytes
    masking_key: bytes
    self_mask_commitment: bytes
    signature: bytes = b""
    stage = Stage.ADVERTISE_KEYS


@dataclass(frozen=True)
class ShareKeys:
    """Stage share_keys: one AES-GCM ciphertext of the client's shares per holder."""

    session_id: bytes
    client_id: int
    ciphertexts: Mapping[int, bytes]
    signature: bytes = b""
    stage = Stage.SHARE_KEYS

    def __post_init__(self) -> None:
        object.__setattr__(self, "ciphertexts", _frozen(self.ciphertexts))


@dataclass(frozen=True)
class MaskedInput:
    """Stage masked_input: y = x + PRG(b_u) + sum of signed pairwise masks, mod 2^bits,
    as little-endian unsigned integers of the smallest width holding ``bits`` (decoded:
    a read-only view into the received wire bytes, not a copy).
    ``peers_digest`` names the peers the client masked with, so the server notices when
    the set it forwarded was altered on the way (docs/protocol.md section 5)."""

    session_id: bytes
    client_id: int
    bits: int
    dim: int
    masked: bytes
    peers_digest: bytes = bytes(32)
    signature: bytes = b""
    stage = Stage.MASKED_INPUT

    def vector(self) -> np.ndarray:
        from .crypto import dtype_for_bits

        return np.frombuffer(self.masked, dtype=dtype_for_bits(self.bits), count=self.dim)


@dataclass(frozen=True)
class ConsistencySignature:
    """Stage consistency_check (malicious): the client's signature over the survivor list."""

    session_id: bytes
    client_id: int
    signature: bytes
    stage = Stage.CONSISTENCY_CHECK


@dataclass(frozen=True)
class UnmaskingShares:
    """Stage unmasking: self-mask-seed shares of survivors, masking-key shares of dropouts."""

    session_id: bytes
    client_id: int
    self_mask_shares: Mapping[int, bytes]
    masking_key_shares: Mapping[int, bytes]
    signature: bytes = b""
    stage = Stage.UNMASKING

    def __post_init__(self) -> None:
        object.__setattr__(self, "self_mask_shares", _frozen(self.self_mask_shares))
        object.__setattr__(self, "masking_key_shares", _frozen(self.masking_key_shares))


# --- server -> client ---------------------------------------------------------------------


@dataclass(frozen=True)
class KeyEntry:
    encryption_key: bytes
    masking_key: bytes
    self_mask_commitment: bytes
    signature: bytes = b""


@dataclass(frozen=True)
class KeyList:
    """Answer to advertise_keys: the advertisements of the recipient's neighbourhood."""

    session_id: bytes
    recipient: int
    keys: Mapping[int, KeyEntry]
    stage = Stage.ADVERTISE_KEYS

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", _frozen(self.keys))


@dataclass(frozen=True)
class Ciphertexts:
    """Answer to share_keys: the ciphertexts addressed to the recipient, by sender."""

    session_id: bytes
    recipient: int
    ciphertexts: Mapping[int, bytes]
    stage = Stage.SHARE_KEYS

    def __post_init__(self) -> None:
        object.__setattr__(self, "ciphertexts", _frozen(self.ciphertexts))


@dataclass(frozen=True)
class SurvivorList:
    """Answer to masked_input in malicious mode: every client whose masked input arrived."""

    session_id: bytes
    recipient: int
    survivors: tuple[int, ...]
    stage = Stage.MASKED_INPUT


@dataclass(frozen=True)
class UnmaskRequest:
    """Opens stage unmasking: which of the recipient's peers survived and which dropped,
    plus (malicious) the neighbours' signatures over the survivor list."""

    session_id: bytes
    recipient: int
    survivors: tuple[int, ...]
    dropped: tuple[int, ...]
    signatures: Mapping[int, bytes] = field(default_factory=dict)
    stage = Stage.UNMASKING

    def __post_init__(self) -> None:
        object.__setattr__(self, "signatures", _frozen(self.signatures))


ClientMessage = (AdvertiseKeys | ShareKeys | MaskedInput | ConsistencySignature
                 | UnmaskingShares)
ServerMessage = KeyList | Ciphertexts | SurvivorList | UnmaskRequest
Message = ClientMessage | ServerMessage

_KINDS: dict[type, int] = {
    AdvertiseKeys: 1, ShareKeys: 2, MaskedInput: 3, ConsistencySignature: 4,
    UnmaskingShares: 5, KeyList: 11, Ciphertexts: 12, SurvivorList: 13, UnmaskRequest: 14,
}
CLIENT_KINDS = frozenset({1, 2, 3, 4, 5})
SERVER_KINDS = frozenset({11, 12, 13, 14})


def _id_map(mapping: Mapping[int, bytes]) -> dict[int, bytes]:
    return dict(mapping)


def _encode_masked(message: MaskedInput) -> bytes:
    """``MaskedInput`` with the vector copied once (msgpack's packb would copy it twice)."""
    packer = msgpack.Packer(use_bin_type=True)
    head = (packer.pack_array_header(9) + packer.pack(MAGIC) + packer.pack(3)
            + packer.pack(message.session_id) + packer.pack(message.client_id)
            + packer.pack(message.bits) + packer.pack(message.dim)
            + _bin_header(len(message.masked)))
    tail = packer.pack(message.peers_digest) + packer.pack(message.signature)
    return b"".join((head, message.masked, tail))


def encode(message: Message) -> bytes:
    """The wire bytes of ``message``."""
    kind = _KINDS[type(message)]
    head: list[Any] = [MAGIC, kind, message.session_id]
    body: list[Any]
    if isinstance(message, AdvertiseKeys):
        body = [message.client_id, message.encryption_key, message.masking_key,
                message.self_mask_commitment, message.signature]
    elif isinstance(message, ShareKeys):
        body = [message.client_id, _id_map(message.ciphertexts), message.signature]
    elif isinstance(message, MaskedInput):
        return _encode_masked(message)
    elif isinstance(message, ConsistencySignature):
        body = [message.client_id, message.signature]
    elif isinstance(message, UnmaskingShares):
        body = [message.client_id, _id_map(message.self_mask_shares),
                _id_map(message.masking_key_shares), message.signature]
    elif isinstance(message, KeyList):
        body = [message.recipient, {
            cid: [e.encryption_key, e.masking_key, e.self_mask_commitment, e.signature]
            for cid, e in message.keys.items()}]
    elif isinstance(message, Ciphertexts):
        body = [message.recipient, _id_map(message.ciphertexts)]
    elif isinstance(message, SurvivorList):
        body = [message.recipient, list(message.survivors)]
    else:
        body = [message.recipient, list(message.survivors), list(message.dropped),
                _id_map(message.signatures)]
    packed: bytes = msgpack.packb(head + body, use_bin_type=True)
    return packed


# --- decoding ------------------------------------------------------------------------------
#
# The decoder reads the msgpack subset of section 6 directly from the bytes: every header is
# checked (type, minimal form, count against the bytes left and the limit for the kind)
# before anything is allocated, so a hostile message costs at most a small multiple of its
# size and time linear in it. It accepts only the canonical encoding, so one message has
# one byte string (no re-encoding to compare).


def _fail(what: str) -> DecodeError:
    return DecodeError(f"malformed message: {what}")


_UINT = {0xCC: (1, 1 << 7), 0xCD: (2, 1 << 8), 0xCE: (4, 1 << 16), 0xCF: (8, 1 << 32)}
_BIN = {0xC4: (1, 0), 0xC5: (2, 1 << 8), 0xC6: (4, 1 << 16)}
_ARRAY = {0xDC: (2, 16), 0xDD: (4, 1 << 16)}
_MAP = {0xDE: (2, 16), 0xDF: (4, 1 << 16)}


class _Reader:
    """A cursor over one message's bytes that accepts only canonical msgpack."""

    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def _take(self, size: int, what: str) -> int:
        start = self.pos
        if start + size > len(self.data):
            raise _fail(f"truncated at {what}")
        self.pos = start + size
        return start

    def _length(self, table: dict[int, tuple[int, int]], lead: int, what: str) -> int:
        size, smallest = table[lead]
        start = self._take(size, what)
        value = int.from_bytes(self.data[start:start + size], "big")
        if value < smallest:
            raise _fail(f"{what} is not in canonical form (a wider length than needed)")
        return value

    def uint(self, what: str) -> int:
        lead = self.data[self._take(1, what)]
        if lead < 0x80:
            return lead
        if lead not in _UINT:
            raise _fail(f"{what} must be a non-negative integer")
        return self._length(_UINT, lead, what)

    def view(self, what: str, length: int) -> bytes:
        """A bin of exactly ``length`` bytes as a read-only view into the message (no copy:
        the masked vector is most of a round's bytes)."""
        lead = self.data[self._take(1, what)]
        if lead not in _BIN:
            raise _fail(f"{what} must be bytes")
        size = self._length(_BIN, lead, what)
        if size != length:
            raise _fail(f"{what} must be {length} bytes, got {size}")
        start = self._take(size, what)
        return cast(bytes, memoryview(self.data)[start:start + size])

    def bin(self, what: str, length: int | None = None, *, limit: int = 1 << 62) -> bytes:
        lead = self.data[self._take(1, what)]
        if lead not in _BIN:
            raise _fail(f"{what} must be bytes")
        size = self._length(_BIN, lead, what)
        if length is not None and size != length:
            raise _fail(f"{what} must be {length} bytes, got {size}")
        if size > limit:
            raise _fail(f"{what} has {size} bytes, more than {limit}")
        start = self._take(size, what)
        return self.data[start:start + size]

    def _count(self, table: dict[int, tuple[int, int]], low: int, high: int, what: str,
               kind: str, limit: int, entry_bytes: int) -> int:
        lead = self.data[self._take(1, what)]
        if low <= lead < high:
            count = lead - low
        elif lead in table:
            count = self._length(table, lead, what)
        else:
            raise _fail(f"{what} must be {kind}")
        if count > limit:
            raise _fail(f"{what} has {count} entries, more than {limit}")
        if count * entry_bytes > len(self.data) - self.pos:
            raise _fail(f"{what} claims {count} entries but the message is too short")
        return count

    def array(self, what: str, limit: int, entry_bytes: int = 1) -> int:
        return self._count(_ARRAY, 0x90, 0xA0, what, "an array", limit, entry_bytes)

    def map(self, what: str, limit: int, entry_bytes: int = 2) -> int:
        return self._count(_MAP, 0x80, 0x90, what, "a map of client id to value", limit,
                           entry_bytes)

    def client_id(self, what: str) -> int:
        value = self.uint(what)
        if not 1 <= value <= MAX_CLIENT_ID:
            raise _fail(f"{what} must be a client id in 1..{MAX_CLIENT_ID}")
        return value

    def signature(self, what: str) -> bytes:
        sig = self.bin(what, limit=SIGNATURE_BYTES)
        if len(sig) not in (0, SIGNATURE_BYTES):
            raise _fail(f"{what} must be empty or {SIGNATURE_BYTES} bytes")
        return sig

    def blob_map(self, length: int, what: str, limit: int) -> dict[int, bytes]:
        """A map id -> bin of exactly ``length`` bytes, ids strictly ascending."""
        count = self.map(what, limit, 2 + length)
        out: dict[int, bytes] = {}
        header = _bin_header(length)
        span = len(header) + length
        data, pos, last = self.data, self.pos, 0
        # one tight loop: this runs for every entry of every share list (n^2 per round)
        for _ in range(count):
            lead = data[pos] if pos < len(data) else -1
            if 0 < lead < 0x80:
                key, pos = lead, pos + 1
            elif lead in (0xCC, 0xCD, 0xCE):
                self.pos = pos
                key = self.client_id(f"{what} key")
                pos = self.pos
            else:
                raise _fail(f"{what} key must be a client id in 1..{MAX_CLIENT_ID}")
            if key <= last:
                raise _fail(f"{what} repeats a key or is not sorted by id (canonical form)")
            last = key
            if data[pos:pos + len(header)] != header or pos + span > len(data):
                raise _fail(f"{what} value must be {length} bytes")
            out[key] = data[pos + len(header):pos + span]
            pos += span
        self.pos = pos
        return out

    def id_list(self, what: str, limit: int) -> tuple[int, ...]:
        count = self.array(what, limit)
        ids = []
        last = 0
        for _ in range(count):
            value = self.client_id(what)
            if value <= last:
                raise _fail(f"{what} must be sorted and must not repeat a client id")
            last = value
            ids.append(value)
        return tuple(ids)


def _bin_header(length: int) -> bytes:
    """The canonical msgpack header of a bin of ``length`` bytes."""
    if length < 1 << 8:
        return bytes([0xC4, length])
    if length < 1 << 16:
        return b"\xc5" + length.to_bytes(2, "big")
    return b"\xc6" + length.to_bytes(4, "big")


_ARITY = {1: 8, 2: 6, 3: 9, 4: 5, 5: 7, 11: 5, 12: 5, 13: 5, 14: 7}
_KEY_ENTRY_BYTES = 1 + 3 * (2 + KEY_BYTES) + 2  # the smallest valid key-list entry


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
        raise _fail("expected bytes")
    if len(data) > max_bytes:
        raise _fail(f"{len(data)} bytes is more than the {max_bytes} this round allows")
    reader = _Reader(bytes(data))
    count = reader.array("the envelope [magic, kind, session, party, ...]", 9)
    if count < 4:
        raise _fail("expected an array [magic, kind, session, party, ...]")
    if reader.bin("magic", limit=len(MAGIC)) != MAGIC:
        raise _fail("wrong magic (not a secagg v1 message)")
    kind = reader.uint("kind")
    if kind not in _ARITY:
        raise _fail(f"unknown message kind {kind!r}")
    if kinds is not None and kind not in kinds:
        side = "server" if kind in SERVER_KINDS else "client"
        raise _fail(f"a {side} message (kind {kind}) is not accepted here")
    if count != _ARITY[kind]:
        raise _fail(f"kind {kind} has {_ARITY[kind]} fields, got {count}")
    session = reader.bin("session id", SESSION_BYTES)
    party = reader.client_id("client id")
    message = _build(reader, kind, session, party, max_entries, max_vector_bytes)
    if reader.pos != len(reader.data):
        raise _fail("trailing bytes after the message")
    return message


def decode_server_message(data: bytes | bytearray | memoryview, num_clients: int
                          ) -> ServerMessage:
    """A server message to a client of a round of ``num_clients`` clients, decoded with
    that round's limits (size, entries)."""
    message = decode(data, max_bytes=client_message_limit(num_clients),
                     max_entries=num_clients, max_vector_bytes=0, kinds=SERVER_KINDS)
    assert isinstance(message, (KeyList, Ciphertexts, SurvivorList, UnmaskRequest))
    return message


def _build(r: _Reader, kind: int, session: bytes, party: int, max_entries: int,
           max_vector: int) -> Message:
    if kind == 1:
        return AdvertiseKeys(session, party, r.bin("encryption key", KEY_BYTES),
                             r.bin("masking key", KEY_BYTES), r.bin("self-mask commitment", 32),
                             r.signature("signature"))
    if kind == 2:
        return ShareKeys(session, party, r.blob_map(CIPHERTEXT_BYTES, "ciphertexts",
                                                    max_entries), r.signature("signature"))
    if kind == 3:
        bits = r.uint("bits")
        if not 8 <= bits <= 64:
            raise _fail("bits must be in 8..64")
        dim = r.uint("dim")
        if dim < 1:
            raise _fail("dim must be a positive integer")
        from .crypto import dtype_for_bits

        size = dim * dtype_for_bits(bits).itemsize
        if size > max_vector:
            raise _fail(f"a masked vector of {size} bytes is more than the {max_vector} this "
                        "round allows")
        blob = r.view("masked vector", size)
        return MaskedInput(session, party, bits, dim, blob, r.bin("peers digest", 32),
                           r.signature("signature"))
    if kind == 4:
        return ConsistencySignature(session, party, r.bin("signature", SIGNATURE_BYTES))
    if kind == 5:
        return UnmaskingShares(
            session, party, r.blob_map(SHARE_BYTES, "self-mask shares", max_entries),
            r.blob_map(SHARE_BYTES, "masking-key shares", max_entries),
            r.signature("signature"))
    if kind == 11:
        count = r.map("key list", max_entries, _KEY_ENTRY_BYTES)
        keys = {}
        last = 0
        for _ in range(count):
            cid = r.client_id("key list id")
            if cid <= last:
                raise _fail("key list repeats a key or is not sorted by id (canonical form)")
            last = cid
            if r.array("a key entry", 4, 2) != 4:
                raise _fail("a key entry is [encryption key, masking key, commitment, sig]")
            keys[cid] = KeyEntry(r.bin("encryption key", KEY_BYTES),
                                 r.bin("masking key", KEY_BYTES),
                                 r.bin("self-mask commitment", 32), r.signature("signature"))
        return KeyList(session, party, keys)
    if kind == 12:
        return Ciphertexts(session, party,
                           r.blob_map(CIPHERTEXT_BYTES, "ciphertexts", max_entries))
    if kind == 13:
        return SurvivorList(session, party, r.id_list("survivors", max_entries))
    return UnmaskRequest(session, party, r.id_list("survivors", max_entries),
                         r.id_list("dropped", max_entries),
                         r.blob_map(SIGNATURE_BYTES, "signatures", max_entries))


def peers_digest(peers: Iterable[int]) -> bytes:
    """SHA-256 naming the set of peers a client masked with (ids ascending)."""
    return hashlib.sha256(b"secagg/v1|peers|" + b"".join(
        struct.pack(">I", p) for p in sorted(peers))).digest()


def sender_of(message: ClientMessage) -> int:
    return message.client_id


def recipient_of(message: ServerMessage) -> int:
    return message.recipient
