"""Every primitive the protocol uses, from ``cryptography``; nothing is re-implemented.

* X25519 key agreement, with public keys checked against the small-order points.
* HKDF-SHA256 key derivation; every label binds the session id, the stage and the ids.
* AES-256-GCM for the share ciphertexts, with associated data binding session, stage,
  sender and recipient.
* AES-128-CTR keystream as the mask PRG (``Masker``), written into preallocated buffers.
* Ed25519 signatures over transcripts the code builds itself (``secagg.transcripts``),
  never over a re-encoding of a received message.

Labels and layouts are normative: docs/protocol.md section 5.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from functools import lru_cache

import numpy as np
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .errors import CryptoError as CryptoError  # re-exported
from .stage import Stage

MIN_BITS, MAX_BITS = 8, 64
"""The modulus of a secure sum is ``2**bits`` with ``MIN_BITS <= bits <= MAX_BITS`` (every
layer checks a bit width against these two)."""

PROTOCOL = b"secagg/v1"
KEY_BYTES = 32
SIGNATURE_BYTES = 64
_FIELD_P = (1 << 255) - 19
# u-coordinates (mod p, bit 255 cleared) of the points of order 1, 2, 4 and 8 on
# Curve25519 and its twist; an exchange with any of them yields a predictable secret.
_SMALL_ORDER_U = frozenset({
    0,
    1,
    _FIELD_P - 1,
    0x00B8495F16056286FDB1329CEB8D09DA6AC49FF1FAE35616AEB8413B7C7AEBE0,
    0x57119FD0DD4E22D8868E1C58C45C44045BEF839C55B1D0B1248C50A3BC959C5F,
})


def sha256(*parts: bytes) -> bytes:
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h.digest()


_U32 = struct.Struct(">I")


def u32(value: int) -> bytes:
    return _U32.pack(value)


def constant_time_equal(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)


# --- X25519 ------------------------------------------------------------------------------


def clamp(private_key: bytearray) -> None:
    """Put a raw X25519 private key in its canonical clamped form, in place (RFC 7748:
    clear bits 0-2 and 255, set bit 254). X25519 ignores those bits, so the key is the same;
    among clamped keys the map to public keys is one-to-one, which the server's check of a
    reconstructed masking key relies on (docs/protocol.md section 8)."""
    private_key[0] &= 248
    private_key[31] &= 127
    private_key[31] |= 64


def is_clamped(private_key: bytes) -> bool:
    """True when a raw X25519 private key is in canonical clamped form."""
    return len(private_key) == 32 and private_key[0] & 7 == 0 and \
        private_key[31] & 0xC0 == 0x40


def is_small_order(public_key: bytes) -> bool:
    """True when ``public_key`` is a small-order (or non-canonical small-order) point."""
    u = int.from_bytes(public_key, "little") & ((1 << 255) - 1)
    return u % _FIELD_P in _SMALL_ORDER_U


def check_public_key(public_key: bytes) -> None:
    """Accept only canonical encodings of points that are not of small order.

    X25519 ignores bit 255 and reduces u mod p, so the same point has several encodings;
    accepting only the canonical one makes "duplicated key" checks on bytes sound."""
    if not isinstance(public_key, bytes) or len(public_key) != KEY_BYTES:
        raise CryptoError(f"an X25519 public key is {KEY_BYTES} bytes")
    if public_key[31] & 0x80 or int.from_bytes(public_key, "little") >= _FIELD_P:
        raise CryptoError("X25519 public key is not canonically encoded (bit 255 set or "
                          "u >= 2^255 - 19)")
    if is_small_order(public_key):
        raise CryptoError("X25519 public key is a small-order point")


class KeyPair:
    """An ephemeral X25519 key pair (fresh for every round)."""

    __slots__ = ("_private", "public")

    def __init__(self, private: X25519PrivateKey | None = None) -> None:
        self._private = private if private is not None else X25519PrivateKey.generate()
        self.public: bytes = self._private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    @classmethod
    def from_private_bytes(cls, data: bytes) -> KeyPair:
        return cls(X25519PrivateKey.from_private_bytes(data))

    def private_bytes(self) -> bytes:
        return self._private.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
            serialization.NoEncryption())

    def exchange(self, peer_public: bytes | X25519PublicKey) -> bytes:
        """X25519 with a peer key given as bytes (checked here) or as a key object from
        ``load_public_key`` (checked when loaded: the server reuses one per survivor)."""
        peer = peer_public if isinstance(peer_public, X25519PublicKey) else \
            load_public_key(peer_public)
        try:
            return self._private.exchange(peer)
        except ValueError as exc:  # all-zero shared secret
            raise CryptoError(f"X25519 exchange failed: {exc}") from exc


def load_public_key(public_key: bytes) -> X25519PublicKey:
    """A checked X25519 public key object (canonical, not of small order)."""
    check_public_key(public_key)
    return X25519PublicKey.from_public_bytes(public_key)


def hkdf(secret: bytes, salt: bytes, info: bytes, length: int = 32) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt, info=info).derive(secret)


@lru_cache(maxsize=256)
def _label_prefix(tag: bytes, session_id: bytes, stage: int) -> bytes:
    return b"|".join([PROTOCOL, tag, session_id, bytes([stage]), b""])


def pair_label(tag: bytes, session_id: bytes, stage: Stage, first: int, second: int,
               *extra: bytes) -> bytes:
    """The HKDF info / AEAD associated data: protocol, purpose, session, stage, both ids,
    joined with b"|" (docs/protocol.md section 5)."""
    head = _label_prefix(tag, session_id, int(stage)) + _U32.pack(first) + b"|"
    return b"|".join([head + _U32.pack(second), *extra])


# --- share encryption (stage share_keys) --------------------------------------------------


def share_key(shared_secret: bytes, session_id: bytes, sender: int, recipient: int,
              sender_pk: bytes, recipient_pk: bytes) -> bytes:
    """A one-time AES-256-GCM key for the sender -> recipient share ciphertext."""
    info = pair_label(b"share-key", session_id, Stage.SHARE_KEYS, sender, recipient,
                      sender_pk, recipient_pk)
    return hkdf(shared_secret, session_id, info)


_ZERO_NONCE = b"\x00" * 12  # each key encrypts exactly one message


def seal(key: bytes, plaintext: bytes, associated: bytes) -> bytes:
    return AESGCM(key).encrypt(_ZERO_NONCE, plaintext, associated)


def open_sealed(key: bytes, ciphertext: bytes, associated: bytes) -> bytes:
    try:
        return AESGCM(key).decrypt(_ZERO_NONCE, ciphertext, associated)
    except InvalidTag:
        raise CryptoError("AEAD tag check failed") from None


# --- masks (stage masked_input) -------------------------------------------------------------


# Masks are AES-128-CTR keystream: X25519 gives about 128-bit security, so a 256-bit mask
# key buys nothing, and AES-128 expands 20-30% faster (the server expands one mask per
# (dropped, survivor) pair). docs/protocol.md section 5.4.
MASK_KEY_BYTES = 16


def pairwise_mask_key(shared_secret: bytes, session_id: bytes, u: int, v: int,
                      pk_u: bytes, pk_v: bytes, shape_tag: bytes) -> bytes:
    """The AES-128-CTR key of the pairwise mask of u and v (symmetric in u, v)."""
    if u > v:
        u, v, pk_u, pk_v = v, u, pk_v, pk_u
    info = pair_label(b"pairwise-mask", session_id, Stage.MASKED_INPUT, u, v, pk_u, pk_v,
                      shape_tag)
    return hkdf(shared_secret, session_id, info, MASK_KEY_BYTES)


def self_mask_key(seed: bytes, session_id: bytes, u: int, shape_tag: bytes) -> bytes:
    """The AES-128-CTR key of u's self mask, from its 32-byte seed b_u."""
    info = pair_label(b"self-mask", session_id, Stage.MASKED_INPUT, u, u, shape_tag)
    return hkdf(seed, session_id, info, MASK_KEY_BYTES)


def self_mask_commitment(seed: bytes, session_id: bytes, u: int) -> bytes:
    """A hiding, binding commitment to the self-mask seed, so the server can verify the
    seed it reconstructs (Bonawitz et al. verify nothing here)."""
    return sha256(pair_label(b"self-mask-commit", session_id, Stage.ADVERTISE_KEYS, u, u),
                  seed)


def dtype_for_bits(bits: int) -> np.dtype[np.unsignedinteger]:
    """The smallest unsigned dtype holding ``bits`` bits; arithmetic in it wraps mod 2^w,
    and 2^bits divides 2^w, so reducing at the end gives the sum mod 2^bits."""
    for width in (8, 16, 32, 64):
        if bits <= width:
            return np.dtype(f"<u{width // 8}")
    raise ValueError(f"bits={bits} must be at most {MAX_BITS}")


_ZERO_COUNTER = modes.CTR(b"\x00" * 16)  # each mask key is used for exactly one stream


@lru_cache(maxsize=4)
def _zeros(nbytes: int) -> bytes:
    """The all-zero plaintext the keystream is encrypted from (immutable: shared)."""
    return bytes(nbytes)


class Masker:
    """Expands mask keys with AES-128-CTR into one preallocated buffer and adds or subtracts
    the keystream in place, so a mask costs one keystream pass plus one vector add.

    ``dim`` is the window: the most elements one call expands. ``start`` seeks: the
    keystream of elements [start, start + count) of a vector is the CTR stream from the
    counter block ``start * itemsize // 16`` (CTR can seek), so a masked input is produced
    and unmasked window by window with the same bytes a whole pass gives (docs/protocol.md
    section 5.4)."""

    def __init__(self, dim: int, bits: int) -> None:
        self.dim = dim
        self.dtype = dtype_for_bits(bits)
        nbytes = dim * self.dtype.itemsize
        self._zeros = _zeros(nbytes + 16)
        self._buffer = bytearray(nbytes + 16 + 15)
        self._array = np.frombuffer(self._buffer, dtype=np.uint8)

    def keystream(self, key: bytes, start: int = 0, count: int | None = None) -> np.ndarray:
        """The mask for ``key`` at elements [start, start + count) (default: the whole
        window); a view valid until the next call."""
        count = self.dim if count is None else count
        if not 0 <= count <= self.dim:
            raise ValueError(f"a window of {count} elements is more than this masker's "
                             f"{self.dim}")
        itemsize = self.dtype.itemsize
        block, skip = divmod(start * itemsize, 16)
        nbytes = count * itemsize
        counter = modes.CTR(block.to_bytes(16, "big")) if block else _ZERO_COUNTER
        encryptor = Cipher(algorithms.AES(key), counter).encryptor()
        encryptor.update_into(memoryview(self._zeros)[:skip + nbytes], self._buffer)
        return self._array[skip:skip + nbytes].view(self.dtype)

    def add(self, accumulator: np.ndarray, key: bytes, start: int = 0) -> None:
        np.add(accumulator, self.keystream(key, start, accumulator.shape[0]), out=accumulator)

    def subtract(self, accumulator: np.ndarray, key: bytes, start: int = 0) -> None:
        np.subtract(accumulator, self.keystream(key, start, accumulator.shape[0]),
                    out=accumulator)


# --- signatures -----------------------------------------------------------------------------


class SigningKey:
    """A client's long-term Ed25519 identity key (malicious mode)."""

    __slots__ = ("_key", "public")

    def __init__(self, key: Ed25519PrivateKey | None = None) -> None:
        self._key = key if key is not None else Ed25519PrivateKey.generate()
        self.public: bytes = self._key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    @classmethod
    def generate(cls) -> SigningKey:
        return cls()

    @classmethod
    def from_private_bytes(cls, data: bytes) -> SigningKey:
        """The key from its 32-byte raw Ed25519 seed (e.g. loaded from a site's key file)."""
        return cls(Ed25519PrivateKey.from_private_bytes(data))

    def private_bytes(self) -> bytes:
        """The 32-byte raw seed; handle it like a password."""
        return self._key.private_bytes(serialization.Encoding.Raw,
                                       serialization.PrivateFormat.Raw,
                                       serialization.NoEncryption())

    def sign(self, message: bytes) -> bytes:
        return self._key.sign(message)


def verify_signature(verify_key: bytes, signature: bytes, message: bytes) -> None:
    """Raise ``CryptoError`` unless ``signature`` is a valid Ed25519 signature of ``message``
    under ``verify_key`` (a missing or malformed key or signature is invalid too)."""
    if len(verify_key) != KEY_BYTES:
        raise CryptoError(f"no valid verification key ({KEY_BYTES} bytes) for the signer")
    if len(signature) != SIGNATURE_BYTES:
        raise CryptoError(f"a signature is {SIGNATURE_BYTES} bytes, got {len(signature)}")
    try:
        Ed25519PublicKey.from_public_bytes(verify_key).verify(signature, message)
    except (InvalidSignature, ValueError):
        raise CryptoError("the Ed25519 signature does not verify") from None
