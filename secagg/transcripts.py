"""What is signed and what a share ciphertext authenticates (docs/protocol.md sections 5.3
and 5.7), in one place used by both the client and the server.

Freshness (docs/architecture.md section 9): the session id names the configuration, roster
and context, which may repeat from round to round. What never repeats are the clients'
fresh X25519 keys and self-mask commitments. So every signature after the advertisement and
the associated data of every share ciphertext also bind them:

* a client's ``share-keys``, ``masked-input`` and ``unmasking`` signatures bind the digest
  of the whole key list it received (``key_set_digest``: every advertisement of its
  neighbourhood, its own included);
* its ``survivors`` signature binds the digest of its own advertisement
  (``advertisement_digest``), which every neighbour that checks it holds;
* the associated data of the share ciphertext u -> v binds the advertisements of u and v.

A message recorded in another round therefore never verifies in this one, whatever the
caller passes as ``context``. An advertisement itself is the first message of a round:
it is fresh only when the server hands out a round nonce before it (``Server.nonce``,
passed to ``Client(nonce=...)``), which its signature then binds; without one, what a
replayed advertisement can and cannot do is in docs/protocol.md section 9.2.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Mapping
from functools import lru_cache

from .crypto import PROTOCOL, pair_label, sha256, u32
from .messages import InputProof, KeyEntry, MaskedInput, ShareKeys, UnmaskingShares
from .stage import Stage

_NO_BINDING = b""
SIGNED_TAGS: dict[type, bytes] = {ShareKeys: b"share-keys", MaskedInput: b"masked-input",
                                  UnmaskingShares: b"unmasking", InputProof: b"input-proof"}


def transcript(tag: bytes, session_id: bytes, stage: Stage, signer: int, payload_digest: bytes,
               binding: bytes = _NO_BINDING) -> bytes:
    """What is signed: domain tag, fixed header, the round binding (32 bytes, or nothing for
    the advertisement), SHA-256 of the payload."""
    parts = [PROTOCOL, b"sig", tag, session_id, bytes([stage.value]), u32(signer)]
    if binding:
        parts.append(binding)
    parts.append(payload_digest)
    return b"|".join(parts)


def advertisement_payload(entry: KeyEntry) -> bytes:
    return entry.encryption_key + entry.masking_key + entry.self_mask_commitment


def advertisement_transcript(session_id: bytes, client_id: int, entry: KeyEntry,
                             nonce: bytes = b"") -> bytes:
    """The advertisement signature; bound to the server's round ``nonce`` when the round
    uses one (a replayed advertisement of another round then fails, docs/protocol.md 5.7)."""
    return transcript(b"advertise", session_id, Stage.ADVERTISE_KEYS, client_id,
                      sha256(advertisement_payload(entry)), nonce)


@lru_cache(maxsize=4096)
def _advertisement_digest(session_id: bytes, client_id: int, payload: bytes) -> bytes:
    return sha256(PROTOCOL, b"|advert|", session_id, u32(client_id), payload)


def advertisement_digest(session_id: bytes, client_id: int, entry: KeyEntry) -> bytes:
    """32 bytes naming client ``client_id``'s fresh keys and commitment in this session."""
    return _advertisement_digest(session_id, client_id, advertisement_payload(entry))


def key_set_digest(session_id: bytes, keys: Mapping[int, KeyEntry]) -> bytes:
    """32 bytes naming a key list: every (id, advertisement) in it, ids ascending."""
    h = hashlib.sha256(PROTOCOL + b"|key-set|" + session_id)
    for cid in sorted(keys):
        h.update(u32(cid))
        h.update(advertisement_digest(session_id, cid, keys[cid]))
    return h.digest()


def survivors_transcript(session_id: bytes, signer: int, survivors: Iterable[int],
                         signer_advertisement: bytes) -> bytes:
    """The consistency-check signature: over the whole survivor list, bound to the signer's
    own advertisement digest."""
    key = survivors if isinstance(survivors, (tuple, frozenset)) else tuple(survivors)
    return transcript(b"survivors", session_id, Stage.CONSISTENCY_CHECK, signer,
                      _survivors_digest(key), signer_advertisement)


@lru_cache(maxsize=8)
def _survivors_digest(survivors: tuple[int, ...] | frozenset[int]) -> bytes:
    """SHA-256 of the sorted survivor list, once per list: the server checks n signatures
    over one list and a client k, so it is not sorted and hashed (O(n)) for each."""
    return sha256(b"".join(u32(c) for c in sorted(survivors)))


def payload_digest(message: ShareKeys | MaskedInput | UnmaskingShares | InputProof) -> bytes:
    """SHA-256 of the bytes a client signs for its share_keys, masked_input and unmasking
    messages, built from the fields (never a re-encoding) and hashed in one pass without
    joining the masked vector to anything (section 5.7)."""
    h = hashlib.sha256()
    if isinstance(message, ShareKeys):
        for recipient, ciphertext in message.ciphertexts.items():
            h.update(struct.pack(">I", recipient))
            h.update(ciphertext)
    elif isinstance(message, MaskedInput):
        h = masked_input_hash(message.bits, message.dim, message.peers_digest)
        h.update(message.masked)
    elif isinstance(message, InputProof):
        h.update(message.proof)
    else:
        h.update(b"s" + struct.pack(">I", len(message.self_mask_shares)))
        for owner, share in message.self_mask_shares.items():
            h.update(struct.pack(">I", owner))
            h.update(share)
        h.update(b"k")
        for owner, share in message.masking_key_shares.items():
            h.update(struct.pack(">I", owner))
            h.update(share)
    return h.digest()


def masked_input_hash(bits: int, dim: int, peers_digest: bytes) -> hashlib._Hash:
    """The running SHA-256 of a masked input before its vector: a streamed input updates
    it with every chunk in order, so the digest of the stream is the digest of the whole
    ``MaskedInput`` (one signature, whatever the chunking; docs/protocol.md 5.7)."""
    h = hashlib.sha256()
    h.update(struct.pack(">BQ", bits, dim))
    h.update(peers_digest)
    return h


def client_message_transcript(message: ShareKeys | MaskedInput | UnmaskingShares
                              | InputProof, key_set: bytes, digest: bytes | None = None) -> bytes:
    """The transcript a client signs for ``message``; ``key_set`` is the digest of the key
    list it received (``key_set_digest``)."""
    return transcript(SIGNED_TAGS[type(message)], message.session_id, message.stage,
                      message.client_id, digest or payload_digest(message), key_set)


def share_associated_data(session_id: bytes, sender: int, recipient: int,
                          sender_advertisement: bytes, recipient_advertisement: bytes) -> bytes:
    """AES-GCM associated data of the share ciphertext sender -> recipient."""
    return pair_label(b"share-ciphertext", session_id, Stage.SHARE_KEYS, sender, recipient,
                      sender_advertisement, recipient_advertisement)
