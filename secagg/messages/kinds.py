"""The wire table (docs/protocol.md section 6): each message kind (``MessageKind``) with its
class, the side that sends it and its fields after ``party`` (``KindSpec``), and how each
kind of field is written and read back within a decode call's limits (a ``_Field``).
``encode`` and ``decode`` (``secagg/messages/codec.py``) both read this one table.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ..crypto import KEY_BYTES, MAX_BITS, MIN_BITS, SIGNATURE_BYTES, dtype_for_bits
from ..shamir import SHARE_BYTES
from ..wire import Reader, bin_header, fail, pack_value
from .classes import (
    AdvertiseKeys,
    Ciphertexts,
    ConsistencySignature,
    InputProof,
    KeyEntry,
    KeyList,
    MaskedChunk,
    MaskedInput,
    Message,
    ShareKeys,
    SurvivorList,
    UnmaskingShares,
    UnmaskRequest,
)

SHARE_PLAINTEXT_BYTES = 4 + 4 + 2 * SHARE_BYTES
CIPHERTEXT_BYTES = SHARE_PLAINTEXT_BYTES + 16
_KEY_ENTRY_BYTES = 1 + 3 * (2 + KEY_BYTES) + 2  # the smallest valid key-list entry


class MessageKind(enum.IntEnum):
    """The ``kind`` element of the envelope (docs/protocol.md section 6.1): 1-7 are client
    messages, 11-14 server messages. ``MESSAGE_KINDS`` maps each kind to its class, side and
    fields; ``encode`` and ``decode`` both read that one table."""

    ADVERTISE_KEYS = 1
    SHARE_KEYS = 2
    MASKED_INPUT = 3
    CONSISTENCY_SIGNATURE = 4
    UNMASKING_SHARES = 5
    MASKED_CHUNK = 6
    INPUT_PROOF = 7
    KEY_LIST = 11
    CIPHERTEXTS = 12
    SURVIVOR_LIST = 13
    UNMASK_REQUEST = 14


@dataclass(frozen=True)
class Limits:
    """The bounds of one ``decode`` call that fields read against."""

    entries: int
    vector_bytes: int


class _Field:
    """One field after ``party``: how it is written (``pack``) and read back (``read``, with
    the limits of the call and the fields already read)."""

    __slots__ = ("attr", "what")

    def __init__(self, attr: str, what: str) -> None:
        self.attr, self.what = attr, what

    def pack(self, value: Any) -> list[bytes | memoryview]:
        """The parts ``value`` is written as, in order."""
        return [pack_value(value)]

    def read(self, r: Reader, limits: Limits, got: list[Any]) -> Any:
        raise NotImplementedError


class _Bytes(_Field):
    """bin of exactly ``length`` bytes."""

    __slots__ = ("length",)

    def __init__(self, attr: str, what: str, length: int) -> None:
        super().__init__(attr, what)
        self.length = length

    def read(self, r: Reader, limits: Limits, got: list[Any]) -> Any:
        return r.bin(self.what, self.length)


class _Signature(_Field):
    """bin of 0 or SIGNATURE_BYTES bytes (empty in semi-honest mode)."""

    def read(self, r: Reader, limits: Limits, got: list[Any]) -> Any:
        return r.signature(self.what)


class _BlobMap(_Field):
    """map id -> bin of exactly ``length`` bytes, ids strictly ascending."""

    __slots__ = ("length",)

    def __init__(self, attr: str, what: str, length: int) -> None:
        super().__init__(attr, what)
        self.length = length

    def pack(self, value: Any) -> list[bytes | memoryview]:
        return [pack_value(dict(value))]

    def read(self, r: Reader, limits: Limits, got: list[Any]) -> Any:
        return r.blob_map(self.length, self.what, limits.entries)


class _IdList(_Field):
    """array of ids, strictly ascending."""

    def pack(self, value: Any) -> list[bytes | memoryview]:
        return [pack_value(list(value))]

    def read(self, r: Reader, limits: Limits, got: list[Any]) -> Any:
        return r.id_list(self.what, limits.entries)


class _KeyEntries(_Field):
    """map id -> [encryption key, masking key, commitment, signature]."""

    def pack(self, value: Any) -> list[bytes | memoryview]:
        return [pack_value({cid: [e.encryption_key, e.masking_key, e.self_mask_commitment,
                             e.signature] for cid, e in value.items()})]

    def read(self, r: Reader, limits: Limits, got: list[Any]) -> Any:
        count = r.map(self.what, limits.entries, _KEY_ENTRY_BYTES)
        keys = {}
        last = 0
        for _ in range(count):
            cid = r.client_id(f"{self.what} id")
            if cid <= last:
                raise fail(f"{self.what} repeats a key or is not sorted by id (canonical form)")
            last = cid
            if r.array("a key entry", 4, 2) != 4:
                raise fail("a key entry is [encryption key, masking key, commitment, sig]")
            keys[cid] = KeyEntry(r.bin("encryption key", KEY_BYTES),
                                 r.bin("masking key", KEY_BYTES),
                                 r.bin("self-mask commitment", 32), r.signature("signature"))
        return keys


class _Blob(_Field):
    """bin of any length (bounded by the message's own ``max_bytes``): its owner checks
    the exact length (an input proof's depends on the round)."""

    def read(self, r: Reader, limits: Limits, got: list[Any]) -> Any:
        return r.bin(self.what)


class _Bits(_Field):
    def read(self, r: Reader, limits: Limits, got: list[Any]) -> Any:
        bits = r.uint(self.what)
        if not MIN_BITS <= bits <= MAX_BITS:
            raise fail(f"{self.what} must be in {MIN_BITS}..{MAX_BITS}")
        return bits


class _Dim(_Field):
    def read(self, r: Reader, limits: Limits, got: list[Any]) -> Any:
        dim = r.uint(self.what)
        if dim < 1:
            raise fail(f"{self.what} must be a positive integer")
        return dim


class _View(_Field):
    """bin written and read without a copy: the masked vector is most of a round's bytes."""

    def pack(self, value: Any) -> list[bytes | memoryview]:
        return [bin_header(len(value)), memoryview(value)]


class _Vector(_View):
    """bin of dim x width bytes (``bits`` and ``dim`` are the two fields before it)."""

    def read(self, r: Reader, limits: Limits, got: list[Any]) -> Any:
        bits, dim = got[-2], got[-1]
        size = dim * dtype_for_bits(bits).itemsize
        if size > limits.vector_bytes:
            raise fail(f"a {self.what} of {size} bytes is more than the "
                        f"{limits.vector_bytes} this round allows")
        return r.view(self.what, size)


class _Offset(_Field):
    """The element offset of a chunk: below ``dim`` (the field before it)."""

    def read(self, r: Reader, limits: Limits, got: list[Any]) -> Any:
        offset = r.uint(self.what)
        if offset >= got[-1]:
            raise fail(f"{self.what} {offset} is not below dim={got[-1]}")
        return offset


class _ChunkVector(_View):
    """bin of a whole number of elements, at least one, ending at or before ``dim``
    (``bits``, ``dim`` and ``offset`` are the three fields before it)."""

    def read(self, r: Reader, limits: Limits, got: list[Any]) -> Any:
        bits, dim, offset = got[-3], got[-2], got[-1]
        width = dtype_for_bits(bits).itemsize
        room = min((dim - offset) * width, limits.vector_bytes)
        return r.view(self.what, None, limit=room, multiple=width)


@dataclass(frozen=True)
class KindSpec:
    """One row of the wire table: the kind, its message class, which side sends it, and
    its fields after ``party`` in wire order (the class's own field order after the
    session id and the party)."""

    kind: MessageKind
    message: type
    client: bool
    fields: tuple[_Field, ...]

    @property
    def arity(self) -> int:
        """The envelope's array length: magic, kind, session, party and the fields."""
        return 4 + len(self.fields)


_KEY = KEY_BYTES
MESSAGE_KINDS: Mapping[MessageKind, KindSpec] = MappingProxyType({spec.kind: spec for spec in (
    KindSpec(MessageKind.ADVERTISE_KEYS, AdvertiseKeys, True, (
        _Bytes("encryption_key", "encryption key", _KEY),
        _Bytes("masking_key", "masking key", _KEY),
        _Bytes("self_mask_commitment", "self-mask commitment", 32),
        _Signature("signature", "signature"))),
    KindSpec(MessageKind.SHARE_KEYS, ShareKeys, True, (
        _BlobMap("ciphertexts", "ciphertexts", CIPHERTEXT_BYTES),
        _Signature("signature", "signature"))),
    KindSpec(MessageKind.MASKED_INPUT, MaskedInput, True, (
        _Bits("bits", "bits"), _Dim("dim", "dim"), _Vector("masked", "masked vector"),
        _Bytes("peers_digest", "peers digest", 32), _Signature("signature", "signature"))),
    KindSpec(MessageKind.MASKED_CHUNK, MaskedChunk, True, (
        _Bits("bits", "bits"), _Dim("dim", "dim"), _Offset("offset", "chunk offset"),
        _ChunkVector("masked", "masked chunk"), _Bytes("peers_digest", "peers digest", 32),
        _Signature("signature", "signature"))),
    KindSpec(MessageKind.INPUT_PROOF, InputProof, True, (
        _Blob("proof", "input proof"), _Signature("signature", "signature"))),
    KindSpec(MessageKind.CONSISTENCY_SIGNATURE, ConsistencySignature, True, (
        _Bytes("signature", "signature", SIGNATURE_BYTES),)),
    KindSpec(MessageKind.UNMASKING_SHARES, UnmaskingShares, True, (
        _BlobMap("self_mask_shares", "self-mask shares", SHARE_BYTES),
        _BlobMap("masking_key_shares", "masking-key shares", SHARE_BYTES),
        _Signature("signature", "signature"))),
    KindSpec(MessageKind.KEY_LIST, KeyList, False, (_KeyEntries("keys", "key list"),)),
    KindSpec(MessageKind.CIPHERTEXTS, Ciphertexts, False, (
        _BlobMap("ciphertexts", "ciphertexts", CIPHERTEXT_BYTES),)),
    KindSpec(MessageKind.SURVIVOR_LIST, SurvivorList, False, (
        _IdList("survivors", "survivors"),)),
    KindSpec(MessageKind.UNMASK_REQUEST, UnmaskRequest, False, (
        _IdList("survivors", "survivors"), _IdList("dropped", "dropped"),
        _BlobMap("signatures", "signatures", SIGNATURE_BYTES))),
)})
_SPEC_OF: dict[type, KindSpec] = {spec.message: spec for spec in MESSAGE_KINDS.values()}
CLIENT_KINDS = frozenset(k for k, spec in MESSAGE_KINDS.items() if spec.client)
SERVER_KINDS = frozenset(k for k, spec in MESSAGE_KINDS.items() if not spec.client)


def spec_of(message: Message) -> KindSpec:
    """The row of the wire table for a message object."""
    return _SPEC_OF[type(message)]


def kind_of(message: Message) -> MessageKind:
    """The wire kind of a message object."""
    return spec_of(message).kind
