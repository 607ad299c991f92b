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
from typing import Any

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
    as little-endian unsigned integers of the smallest width holding ``bits``.
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
        body = [message.client_id, message.bits, message.dim, message.masked,
                message.peers_digest, message.signature]
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


def _fail(what: str) -> DecodeError:
    return DecodeError(f"malformed message: {what}")


def _client_id(value: object, what: str) -> int:
    if type(value) is not int or not 1 <= value <= MAX_CLIENT_ID:
        raise _fail(f"{what} must be a client id in 1..{MAX_CLIENT_ID}")
    return value


def _blob(value: object, length: int | None, what: str) -> bytes:
    if type(value) is not bytes:
        raise _fail(f"{what} must be bytes")
    if length is not None and len(value) != length:
        raise _fail(f"{what} must be {length} bytes, got {len(value)}")
    return value


def _signature(value: object, what: str) -> bytes:
    sig = _blob(value, None, what)
    if len(sig) not in (0, SIGNATURE_BYTES):
        raise _fail(f"{what} must be empty or {SIGNATURE_BYTES} bytes")
    return sig


def _blob_map(value: object, length: int, what: str, limit: int) -> dict[int, bytes]:
    if type(value) is not dict:
        raise _fail(f"{what} must be a map of client id to bytes")
    if len(value) > limit:
        raise _fail(f"{what} has {len(value)} entries, more than {limit}")
    # one flat loop: this runs for every entry of every share list (n^2 per round)
    for key, blob in value.items():
        if type(key) is not int or not 1 <= key <= MAX_CLIENT_ID:
            raise _fail(f"{what} key must be a client id in 1..{MAX_CLIENT_ID}")
        if type(blob) is not bytes or len(blob) != length:
            raise _fail(f"{what} value must be {length} bytes")
    return value


def _id_list(value: object, what: str, limit: int) -> tuple[int, ...]:
    if type(value) is not list:
        raise _fail(f"{what} must be a list of client ids")
    if len(value) > limit:
        raise _fail(f"{what} has {len(value)} entries, more than {limit}")
    ids = tuple(_client_id(v, what) for v in value)
    if len(set(ids)) != len(ids):
        raise _fail(f"{what} repeats a client id")
    if list(ids) != sorted(ids):
        raise _fail(f"{what} must be sorted")
    return ids


_ARITY = {1: 8, 2: 6, 3: 9, 4: 5, 5: 7, 11: 5, 12: 5, 13: 5, 14: 7}


def decode(data: bytes, *, max_bytes: int = 1 << 31, max_entries: int = 1 << 20) -> Message:
    """Parse and validate wire bytes; raises ``DecodeError`` on anything malformed."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise _fail("expected bytes")
    if len(data) > max_bytes:
        raise _fail(f"{len(data)} bytes is more than the {max_bytes} this round allows")
    raw = bytes(data)
    try:
        obj = msgpack.unpackb(raw, raw=False, use_list=True, strict_map_key=False,
                              object_pairs_hook=_unique_map)
    except DecodeError:
        raise
    except Exception as exc:  # msgpack raises many types on garbage; all mean "malformed"
        raise _fail(f"not msgpack ({type(exc).__name__})") from None
    message = _build(obj, max_entries)
    # One message, one encoding: duplicate detection by digest and signatures over what
    # the code builds itself both rely on it.
    if encode(message) != raw:
        raise _fail("not in canonical form (maps sorted by id, minimal integers)")
    return message


def _unique_map(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise _fail("a map repeats a key")
    return out


def _build(obj: Any, max_entries: int) -> Message:
    if type(obj) is not list or len(obj) < 4:
        raise _fail("expected an array [magic, kind, session, party, ...]")
    if obj[0] != MAGIC:
        raise _fail("wrong magic (not a secagg v1 message)")
    kind = obj[1]
    if type(kind) is not int or kind not in _ARITY:
        raise _fail(f"unknown message kind {kind!r}")
    if len(obj) != _ARITY[kind]:
        raise _fail(f"kind {kind} has {_ARITY[kind]} fields, got {len(obj)}")
    session = _blob(obj[2], SESSION_BYTES, "session id")
    party = _client_id(obj[3], "client id")
    f = obj[4:]
    if kind == 1:
        return AdvertiseKeys(session, party, _blob(f[0], KEY_BYTES, "encryption key"),
                             _blob(f[1], KEY_BYTES, "masking key"),
                             _blob(f[2], 32, "self-mask commitment"),
                             _signature(f[3], "signature"))
    if kind == 2:
        return ShareKeys(session, party,
                         _blob_map(f[0], CIPHERTEXT_BYTES, "ciphertexts", max_entries),
                         _signature(f[1], "signature"))
    if kind == 3:
        bits, dim, masked, digest, signature = f
        if type(bits) is not int or not 8 <= bits <= 64:
            raise _fail("bits must be in 8..64")
        if type(dim) is not int or dim < 1:
            raise _fail("dim must be a positive integer")
        from .crypto import dtype_for_bits

        blob = _blob(masked, dim * dtype_for_bits(bits).itemsize, "masked vector")
        return MaskedInput(session, party, bits, dim, blob, _blob(digest, 32, "peers digest"),
                           _signature(signature, "signature"))
    if kind == 4:
        return ConsistencySignature(session, party, _blob(f[0], SIGNATURE_BYTES, "signature"))
    if kind == 5:
        return UnmaskingShares(
            session, party, _blob_map(f[0], SHARE_BYTES, "self-mask shares", max_entries),
            _blob_map(f[1], SHARE_BYTES, "masking-key shares", max_entries),
            _signature(f[2], "signature"))
    if kind == 11:
        if type(f[0]) is not dict or len(f[0]) > max_entries:
            raise _fail("key list must be a map of client id to key entry")
        keys = {}
        for cid, entry in f[0].items():
            if type(entry) is not list or len(entry) != 4:
                raise _fail("a key entry is [encryption key, masking key, commitment, sig]")
            keys[_client_id(cid, "key list id")] = KeyEntry(
                _blob(entry[0], KEY_BYTES, "encryption key"),
                _blob(entry[1], KEY_BYTES, "masking key"),
                _blob(entry[2], 32, "self-mask commitment"),
                _signature(entry[3], "signature"))
        return KeyList(session, party, keys)
    if kind == 12:
        return Ciphertexts(session, party,
                           _blob_map(f[0], CIPHERTEXT_BYTES, "ciphertexts", max_entries))
    if kind == 13:
        return SurvivorList(session, party, _id_list(f[0], "survivors", max_entries))
    return UnmaskRequest(session, party, _id_list(f[0], "survivors", max_entries),
                         _id_list(f[1], "dropped", max_entries),
                         _blob_map(f[2], SIGNATURE_BYTES, "signatures", max_entries))


def peers_digest(peers: Iterable[int]) -> bytes:
    """SHA-256 naming the set of peers a client masked with (ids ascending)."""
    return hashlib.sha256(b"secagg/v1|peers|" + b"".join(
        struct.pack(">I", p) for p in sorted(peers))).digest()


def signed_payload(message: ShareKeys | MaskedInput | UnmaskingShares) -> bytes:
    """The bytes a client signs (malicious mode) for its share_keys, masked_input and
    unmasking messages: built from the fields, never a re-encoding (section 5.7)."""
    if isinstance(message, ShareKeys):
        return b"".join(struct.pack(">I", r) + ct for r, ct in message.ciphertexts.items())
    if isinstance(message, MaskedInput):
        return (struct.pack(">BQ", message.bits, message.dim) + message.peers_digest
                + message.masked)
    seeds = b"".join(struct.pack(">I", o) + s for o, s in message.self_mask_shares.items())
    keys = b"".join(struct.pack(">I", o) + s for o, s in message.masking_key_shares.items())
    return b"s" + struct.pack(">I", len(message.self_mask_shares)) + seeds + b"k" + keys


SIGNED_TAGS = {ShareKeys: b"share-keys", MaskedInput: b"masked-input",
               UnmaskingShares: b"unmasking"}


def sender_of(message: ClientMessage) -> int:
    return message.client_id


def recipient_of(message: ServerMessage) -> int:
    return message.recipient
