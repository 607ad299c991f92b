"""The protocol messages as typed, immutable dataclasses, and their msgpack wire codec
(the canonical msgpack it is written in and read back from: ``secagg/wire.py``).

A message on the wire is a msgpack array ``[b"SA1", kind, session_id, party, *fields]``
where ``party`` is the sender (client messages) or the recipient (server messages).
``decode`` validates every type, length, id and range before building a message and raises
``DecodeError`` (a ``ProtocolError``) for anything else; it never returns a half-checked
object. Layouts are normative: docs/protocol.md section 6.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, cast

import numpy as np

from .crypto import KEY_BYTES, MAX_BITS, MIN_BITS, SIGNATURE_BYTES
from .shamir import SHARE_BYTES
from .stage import Stage
from .wire import Reader, array_header, bin_header, fail, pack_value

MAGIC = b"SA1"
SESSION_BYTES = 32
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
    masked: bytes | memoryview
    peers_digest: bytes = bytes(32)
    signature: bytes = b""
    stage = Stage.MASKED_INPUT

    def vector(self) -> np.ndarray:
        from .crypto import dtype_for_bits

        return np.frombuffer(self.masked, dtype=dtype_for_bits(self.bits), count=self.dim)


@dataclass(frozen=True)
class MaskedChunk:
    """Stage masked_input, streamed: elements [offset, offset + len) of the client's masked
    input y (docs/protocol.md section 6.3). A client sends its chunks in order, from offset 0
    to ``dim``; ``MaskedInput`` is the one-chunk case. In malicious mode only the last
    chunk carries a signature, over the SHA-256 of the whole stream (``bits``, ``dim``,
    ``peers_digest`` and every chunk's bytes in order: exactly the digest of the equivalent
    ``MaskedInput``, so one masked input has one signature however it was chunked)."""

    session_id: bytes
    client_id: int
    bits: int
    dim: int
    offset: int
    masked: bytes
    peers_digest: bytes = bytes(32)
    signature: bytes = b""
    stage = Stage.MASKED_INPUT

    @property
    def count(self) -> int:
        """Elements in this chunk."""
        from .crypto import dtype_for_bits

        return len(self.masked) // dtype_for_bits(self.bits).itemsize

    @property
    def last(self) -> bool:
        return self.offset + self.count == self.dim

    def vector(self) -> np.ndarray:
        from .crypto import dtype_for_bits

        return np.frombuffer(self.masked, dtype=dtype_for_bits(self.bits), count=self.count)


@dataclass(frozen=True)
class InputProof:
    """Stage masked_input, before the masked input, in a round with ``norm_bound``: the
    client's commitment to the vector it masks and the zero-knowledge proof that its L2
    norm is within the bound (docs/protocol.md section 10; layout
    ``secagg.validation.norm``), signed in malicious mode (docs/protocol.md 5.7), so that
    nobody but the client can get it refused and named."""

    session_id: bytes
    client_id: int
    proof: bytes
    signature: bytes = b""
    stage = Stage.MASKED_INPUT


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


ClientMessage = (AdvertiseKeys | ShareKeys | MaskedInput | MaskedChunk | ConsistencySignature
                 | UnmaskingShares | InputProof)
ServerMessage = KeyList | Ciphertexts | SurvivorList | UnmaskRequest
Message = ClientMessage | ServerMessage

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


class _Field:
    """One field after ``party``: how it is written (``pack``) and read back (``read``, with
    the limits of the call and the fields already read)."""

    __slots__ = ("attr", "what")

    def __init__(self, attr: str, what: str) -> None:
        self.attr, self.what = attr, what

    def pack(self, value: Any) -> bytes | memoryview:
        return pack_value(value)

    def read(self, r: Reader, limits: _Limits, got: list[Any]) -> Any:
        raise NotImplementedError


class _Bytes(_Field):
    """bin of exactly ``length`` bytes."""

    __slots__ = ("length",)

    def __init__(self, attr: str, what: str, length: int) -> None:
        super().__init__(attr, what)
        self.length = length

    def read(self, r: Reader, limits: _Limits, got: list[Any]) -> Any:
        return r.bin(self.what, self.length)


class _Signature(_Field):
    """bin of 0 or SIGNATURE_BYTES bytes (empty in semi-honest mode)."""

    def read(self, r: Reader, limits: _Limits, got: list[Any]) -> Any:
        return r.signature(self.what)


class _BlobMap(_Field):
    """map id -> bin of exactly ``length`` bytes, ids strictly ascending."""

    __slots__ = ("length",)

    def __init__(self, attr: str, what: str, length: int) -> None:
        super().__init__(attr, what)
        self.length = length

    def pack(self, value: Any) -> bytes:
        return pack_value(dict(value))

    def read(self, r: Reader, limits: _Limits, got: list[Any]) -> Any:
        return r.blob_map(self.length, self.what, limits.entries)


class _IdList(_Field):
    """array of ids, strictly ascending."""

    def pack(self, value: Any) -> bytes:
        return pack_value(list(value))

    def read(self, r: Reader, limits: _Limits, got: list[Any]) -> Any:
        return r.id_list(self.what, limits.entries)


class _KeyEntries(_Field):
    """map id -> [encryption key, masking key, commitment, signature]."""

    def pack(self, value: Any) -> bytes:
        return pack_value({cid: [e.encryption_key, e.masking_key, e.self_mask_commitment,
                            e.signature] for cid, e in value.items()})

    def read(self, r: Reader, limits: _Limits, got: list[Any]) -> Any:
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

    def read(self, r: Reader, limits: _Limits, got: list[Any]) -> Any:
        return r.bin(self.what)


class _Bits(_Field):
    def read(self, r: Reader, limits: _Limits, got: list[Any]) -> Any:
        bits = r.uint(self.what)
        if not MIN_BITS <= bits <= MAX_BITS:
            raise fail(f"{self.what} must be in {MIN_BITS}..{MAX_BITS}")
        return bits


class _Dim(_Field):
    def read(self, r: Reader, limits: _Limits, got: list[Any]) -> Any:
        dim = r.uint(self.what)
        if dim < 1:
            raise fail(f"{self.what} must be a positive integer")
        return dim


class _Vector(_Field):
    """bin of dim x width bytes (``bits`` and ``dim`` are the two fields before it), written
    and read without a copy: the masked vector is most of a round's bytes."""

    def pack(self, value: Any) -> bytes | memoryview:
        return memoryview(value)

    def read(self, r: Reader, limits: _Limits, got: list[Any]) -> Any:
        from .crypto import dtype_for_bits

        bits, dim = got[-2], got[-1]
        size = dim * dtype_for_bits(bits).itemsize
        if size > limits.vector_bytes:
            raise fail(f"a {self.what} of {size} bytes is more than the "
                        f"{limits.vector_bytes} this round allows")
        return r.view(self.what, size)


class _Offset(_Field):
    """The element offset of a chunk: below ``dim`` (the field before it)."""

    def read(self, r: Reader, limits: _Limits, got: list[Any]) -> Any:
        offset = r.uint(self.what)
        if offset >= got[-1]:
            raise fail(f"{self.what} {offset} is not below dim={got[-1]}")
        return offset


class _ChunkVector(_Field):
    """bin of a whole number of elements, at least one, ending at or before ``dim``
    (``bits``, ``dim`` and ``offset`` are the three fields before it); read without a copy."""

    def pack(self, value: Any) -> bytes | memoryview:
        return memoryview(value)

    def read(self, r: Reader, limits: _Limits, got: list[Any]) -> Any:
        from .crypto import dtype_for_bits

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


@dataclass(frozen=True)
class StageStep:
    """One stage of the round schedule: the message each client sends in it and the server
    message that closes it (semi-honest and malicious mode; ``None``: the round ends)."""

    stage: Stage
    client: type
    answer: type | None
    malicious_answer: type | None
    validation: type | None = None
    """The message a client sends before ``client`` in a round with ``norm_bound``."""

    def answer_in(self, malicious: bool) -> type | None:
        return self.malicious_answer if malicious else self.answer


SCHEDULE: Mapping[Stage, StageStep] = MappingProxyType({step.stage: step for step in (
    StageStep(Stage.ADVERTISE_KEYS, AdvertiseKeys, KeyList, KeyList),
    StageStep(Stage.SHARE_KEYS, ShareKeys, Ciphertexts, Ciphertexts),
    StageStep(Stage.MASKED_INPUT, MaskedInput, UnmaskRequest, SurvivorList, InputProof),
    StageStep(Stage.CONSISTENCY_CHECK, ConsistencySignature, None, UnmaskRequest),
    StageStep(Stage.UNMASKING, UnmaskingShares, None, None),
)})
"""The stage schedule as data (docs/protocol.md tables 3.2a/3.2b): the client's state
machine (``secagg.client.CLIENT_ACCEPTS``), ``stage_opened_by`` and the Flower records all
read it."""


def stage_opened_by(server_message: type) -> Stage:
    """The stage whose client message ``server_message`` asks for (a ``KeyList`` opens
    share_keys, ...): the stage after the one it closes in the schedule (each server
    message opens the same stage in both modes)."""
    from .stage import round_stages

    for malicious in (False, True):
        for here, after in itertools.pairwise(round_stages(malicious)):
            if SCHEDULE[here].answer_in(malicious) is server_message:
                return after
    raise ValueError(f"{server_message.__name__} opens no stage")


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


def kind_of(message: Message) -> MessageKind:
    """The wire kind of a message object."""
    return _SPEC_OF[type(message)].kind


def encode(message: Message) -> bytes:
    """The wire bytes of ``message`` (canonical msgpack, docs/protocol.md section 6.1); the
    masked vector is copied once, into the result."""
    spec = _SPEC_OF[type(message)]
    party = message.client_id if spec.client else message.recipient  # type: ignore[union-attr]
    parts: list[bytes | memoryview] = [
        array_header(spec.arity), _MAGIC_PACKED, pack_value(int(spec.kind)),
        pack_value(message.session_id), pack_value(party)]
    for fld in spec.fields:
        value = getattr(message, fld.attr)
        if isinstance(fld, (_Vector, _ChunkVector)):
            parts.append(bin_header(len(value)))
        parts.append(fld.pack(value))
    return b"".join(parts)


_MAGIC_PACKED = pack_value(MAGIC)


_KEY_ENTRY_BYTES = 1 + 3 * (2 + KEY_BYTES) + 2  # the smallest valid key-list entry
_KIND_VALUES = frozenset(int(k) for k in MessageKind)
_MAX_ARITY = max(spec.arity for spec in MESSAGE_KINDS.values())


@dataclass(frozen=True)
class _Limits:
    """The bounds of one ``decode`` call that fields read against."""

    entries: int
    vector_bytes: int


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
    limits = _Limits(max_entries, max_vector_bytes)
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


def split_masked_input(message: MaskedInput, elements: int) -> Iterator[MaskedChunk]:
    """``message`` as chunks of ``elements`` elements, in order, without copying: the last
    carries its signature, which covers the stream as it covers the whole message
    (``MaskedChunk``)."""
    if elements < 1:
        raise ValueError(f"chunks of {elements} elements: use a positive integer")
    view = memoryview(message.masked).cast("B")
    width = len(view) // message.dim
    for start in range(0, message.dim, elements):
        stop = min(message.dim, start + elements)
        yield MaskedChunk(message.session_id, message.client_id, message.bits, message.dim,
                          start, cast(bytes, view[start * width:stop * width]),
                          message.peers_digest,
                          message.signature if stop == message.dim else b"")


def peers_digest(peers: Iterable[int]) -> bytes:
    """SHA-256 naming the set of peers a client masked with (ids ascending)."""
    return hashlib.sha256(b"secagg/v1|peers|" + b"".join(
        struct.pack(">I", p) for p in sorted(peers))).digest()

