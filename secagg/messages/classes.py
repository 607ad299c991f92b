"""The protocol messages as typed, immutable dataclasses (docs/protocol.md section 6):
client -> server, server -> client, and what a client derives from them (a masked input
as chunks, the digest of the peers it masked with). How they are written:
``secagg/messages/kinds.py`` and ``codec.py``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, cast

import numpy as np

from ..crypto import dtype_for_bits
from ..stage import Stage


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
        return len(self.masked) // dtype_for_bits(self.bits).itemsize

    @property
    def last(self) -> bool:
        return self.offset + self.count == self.dim

    def vector(self) -> np.ndarray:
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
