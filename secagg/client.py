"""The client state machine (Bonawitz et al. 2017, Figure 4, rounds 0-4; SecAgg+ of
Bell et al. 2020 when the graph is sparse).

Sans-IO: ``advertise()`` returns the first message, ``handle(message)`` consumes one server
message (object or wire bytes) and returns the reply. The caller owns time and sockets.

Rejections and aborts (docs/protocol.md section 7):

* bytes that do not decode, or a message addressed to another client: ``ProtocolError``,
  nothing changes;
* the exact same server message again (QoS 1 redelivery): the same reply again;
* anything else that is wrong (another session or stage, too few peers, inconsistent
  lists, duplicated or small-order keys, bad signatures or AEAD tags, an unmasking request
  that names a peer as both survived and dropped, or this client as dropped):
  ``ProtocolAbort``; the client erases its secrets and answers nothing more.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TypeVar

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

from .config import Config
from .crypto import (
    CryptoError,
    KeyPair,
    Masker,
    SigningKey,
    dtype_for_bits,
    load_public_key,
    open_sealed,
    pair_label,
    pairwise_mask_key,
    seal,
    self_mask_commitment,
    self_mask_key,
    sha256,
    share_key,
    transcript,
    u32,
    verify_signature,
)
from .errors import ProtocolAbort, ProtocolError
from .messages import (
    SHARE_PLAINTEXT_BYTES,
    SIGNED_TAGS,
    AdvertiseKeys,
    Ciphertexts,
    ClientMessage,
    ConsistencySignature,
    KeyEntry,
    KeyList,
    MaskedInput,
    ServerMessage,
    ShareKeys,
    SurvivorList,
    UnmaskingShares,
    UnmaskRequest,
    decode,
    encode,
    peers_digest,
    signed_payload,
)
from .session import derive_session_id, normalize_roster, session_graph
from .shamir import SHARE_BYTES, ShamirError, decode_share, split_many
from .stage import Stage


def advertisement_transcript(session_id: bytes, client_id: int, entry: KeyEntry) -> bytes:
    payload = entry.encryption_key + entry.masking_key + entry.self_mask_commitment
    return transcript(b"advertise", session_id, Stage.ADVERTISE_KEYS, client_id, payload)


def survivors_transcript(session_id: bytes, signer: int, survivors: Iterable[int]) -> bytes:
    payload = b"".join(u32(c) for c in sorted(survivors))
    return transcript(b"survivors", session_id, Stage.CONSISTENCY_CHECK, signer, payload)


_Signable = TypeVar("_Signable", ShareKeys, MaskedInput, UnmaskingShares)


def client_message_transcript(message: ShareKeys | MaskedInput | UnmaskingShares) -> bytes:
    return transcript(SIGNED_TAGS[type(message)], message.session_id, message.stage,
                      message.client_id, signed_payload(message))


def share_associated_data(session_id: bytes, sender: int, recipient: int) -> bytes:
    return pair_label(b"share-ciphertext", session_id, Stage.SHARE_KEYS, sender, recipient)


def check_input(vector: object, config: Config, who: str = "input") -> np.ndarray:
    """A validated copy of a client's input as the protocol's working dtype."""
    arr = np.asarray(vector)
    if arr.ndim != 1 or arr.shape[0] != config.dim:
        raise ValueError(f"{who} has shape {arr.shape}; it must be a vector of length "
                         f"dim={config.dim}")
    if arr.dtype.kind not in "ui":
        raise ValueError(f"{who} has dtype {arr.dtype}; use unsigned integers "
                         f"(uint64) with values below 2**bits")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= config.modulus):
        raise ValueError(f"{who} has values outside [0, 2**{config.bits}); reduce them "
                         f"mod 2**bits or raise bits")
    return arr.astype(dtype_for_bits(config.bits), copy=True)


def _reencode(message: object, stage: Stage, client_id: int | None = None) -> bytes:
    """Wire bytes of a message object, so objects get exactly the validation bytes get."""
    try:
        return encode(message)  # type: ignore[arg-type]
    except Exception as exc:  # a hand-built object with wrong field types
        raise ProtocolError(f"malformed {type(message).__name__} object: {exc}",
                            stage=stage, client_id=client_id) from None


@dataclass
class _Received:
    masking_key_share: bytes
    self_mask_share: bytes


class Client:
    """One site's side of a secure aggregation round.

    ``context`` must be the same bytes for every party of the round and should name the
    round (e.g. federation, round number, model hash); the session id is derived from it.
    In ``malicious`` mode the client needs its Ed25519 ``signing_key`` and the
    ``verify_keys`` (client id -> 32-byte Ed25519 public key) of its peers.
    """

    def __init__(self, config: Config, client_id: int, input_vector: object, *,
                 roster: Iterable[int] | None = None, context: bytes = b"",
                 signing_key: SigningKey | None = None,
                 verify_keys: Mapping[int, bytes] | None = None) -> None:
        self.config = config
        self.roster = normalize_roster(config, roster)
        if client_id not in self.roster:
            raise ValueError(f"client_id={client_id} is not in the roster")
        self.client_id = client_id
        self.session_id = derive_session_id(config, self.roster, context)
        self.graph = session_graph(config, self.roster, self.session_id)
        self.neighborhood = self.graph.closed_neighborhood(client_id)
        if config.malicious:
            if signing_key is None or verify_keys is None:
                raise ValueError("security='malicious' needs signing_key and verify_keys "
                                 "(the peers' Ed25519 public keys)")
            missing = sorted(self.neighborhood - set(verify_keys))
            if missing:
                raise ValueError(f"verify_keys lacks the neighbours {missing[:10]}")
        self._signing_key = signing_key
        self._verify_keys = dict(verify_keys or {})
        self._input: np.ndarray | None = check_input(input_vector, config)
        self._encryption: KeyPair | None = KeyPair()
        self._masking: KeyPair | None = KeyPair()
        self._seed = os.urandom(32)
        self._stage = Stage.ADVERTISE_KEYS
        self._done = False
        self._aborted: ProtocolAbort | None = None
        self._advertisement: AdvertiseKeys | None = None
        self._answered: dict[bytes, ClientMessage] = {}  # digest of server message -> reply
        self._keys: dict[int, KeyEntry] = {}
        self._shared_secrets: dict[int, bytes] = {}
        self._loaded: dict[bytes, X25519PublicKey] = {}
        self._own_shares: _Received | None = None
        self._received: dict[int, _Received] = {}
        self._survivor_list: tuple[int, ...] | None = None
        self.revealed: dict[int, str] = {}  # peer -> "self_mask" | "masking_key"
        self.advertise()

    # --- state ----------------------------------------------------------------------------

    @property
    def stage(self) -> Stage:
        """The stage of the last message this client sent (ADVERTISE_KEYS before any)."""
        return self._stage

    @property
    def done(self) -> bool:
        return self._done

    @property
    def aborted(self) -> ProtocolAbort | None:
        return self._aborted

    @property
    def own_entry(self) -> KeyEntry:
        advert = self.advertise()
        return KeyEntry(advert.encryption_key, advert.masking_key,
                        advert.self_mask_commitment, advert.signature)

    def _abort(self, reason: str) -> ProtocolAbort:
        error = ProtocolAbort(f"client {self.client_id} aborted in {self._stage.label}: "
                              f"{reason}", stage=self._stage, client_id=self.client_id)
        self._aborted = error
        self._answered = {}
        self._erase()
        return error

    def _keys_of(self, pair: KeyPair | None) -> KeyPair:
        if pair is None:
            raise ProtocolError(f"client {self.client_id} has erased its keys",
                                stage=self._stage, client_id=self.client_id)
        return pair

    def _erase(self) -> None:
        """Forget every secret an attacker could still ask for (after an abort, or once
        the round is done: what was revealed stays in the cached replies only)."""
        self._seed = b""
        self._input = None
        self._received = {}
        self._shared_secrets = {}
        self._loaded = {}
        self._own_shares = None
        self._encryption = None
        self._masking = None

    def _signed(self, message: _Signable) -> _Signable:
        """In malicious mode every client message is signed, so neither the broker nor the
        server can alter it unnoticed (docs/architecture.md section 5)."""
        if not self.config.malicious or self._signing_key is None:
            return message
        signature = self._signing_key.sign(client_message_transcript(message))
        return replace(message, signature=signature)

    # --- stage advertise_keys -------------------------------------------------------------

    def advertise(self) -> AdvertiseKeys:
        """Round 0: the client's public keys (the same message every time it is asked)."""
        if self._advertisement is None:
            commitment = self_mask_commitment(self._seed, self.session_id, self.client_id)
            entry = KeyEntry(self._keys_of(self._encryption).public,
                             self._keys_of(self._masking).public, commitment)
            signature = b""
            if self._signing_key is not None and self.config.malicious:
                signature = self._signing_key.sign(
                    advertisement_transcript(self.session_id, self.client_id, entry))
            self._advertisement = AdvertiseKeys(
                self.session_id, self.client_id, entry.encryption_key, entry.masking_key,
                commitment, signature)
        return self._advertisement

    # --- dispatch -------------------------------------------------------------------------

    def handle(self, message: ServerMessage | bytes | bytearray | memoryview) -> ClientMessage:
        """Consume one server message and return this client's reply."""
        if isinstance(message, (bytes, bytearray, memoryview)):
            raw = bytes(message)
            decoded = decode(raw, max_bytes=self.max_message_bytes())
            if isinstance(decoded, (AdvertiseKeys, ShareKeys, MaskedInput,
                                    ConsistencySignature, UnmaskingShares)):
                raise ProtocolError("a client message was delivered to a client",
                                    stage=self._stage, client_id=self.client_id)
            msg: ServerMessage = decoded
        else:
            if not isinstance(message, (KeyList, Ciphertexts, SurvivorList, UnmaskRequest)):
                raise ProtocolError(f"{type(message).__name__} is not a server message",
                                    stage=self._stage, client_id=self.client_id)
            raw = _reencode(message, self._stage, self.client_id)
            checked = decode(raw, max_bytes=self.max_message_bytes())
            assert isinstance(checked, (KeyList, Ciphertexts, SurvivorList, UnmaskRequest))
            msg = checked
        if msg.recipient != self.client_id:
            raise ProtocolError(
                f"message for client {msg.recipient} delivered to client {self.client_id}",
                stage=self._stage, client_id=self.client_id)
        if self._aborted is not None:
            raise ProtocolError(f"client {self.client_id} has aborted: {self._aborted}",
                                stage=self._stage, client_id=self.client_id)
        digest = sha256(raw)
        if digest in self._answered:
            return self._answered[digest]  # a redelivered message gets the same answer
        if self._done:
            raise ProtocolError(f"client {self.client_id} has finished the round",
                                stage=self._stage, client_id=self.client_id)
        if msg.session_id != self.session_id:
            raise self._abort("the message belongs to another session")
        reply = self._dispatch(msg)
        self._answered[digest] = reply
        if self._done:
            self._erase()
        return reply

    def max_message_bytes(self) -> int:
        """An upper bound on a valid server message to this client (for transports)."""
        n = len(self.roster)
        return 4096 + n * (4 * 32 + 64 + 160) + 64 * n

    def _dispatch(self, msg: ServerMessage) -> ClientMessage:
        expected: dict[Stage, type] = {
            Stage.ADVERTISE_KEYS: KeyList,
            Stage.SHARE_KEYS: Ciphertexts,
            Stage.MASKED_INPUT: SurvivorList if self.config.malicious else UnmaskRequest,
            Stage.CONSISTENCY_CHECK: UnmaskRequest,
        }
        want = expected.get(self._stage)
        if want is None or not isinstance(msg, want):
            raise self._abort(f"{type(msg).__name__} is not the next message after "
                              f"{self._stage.label}")
        try:
            if isinstance(msg, KeyList):
                return self._on_key_list(msg)
            if isinstance(msg, Ciphertexts):
                return self._on_ciphertexts(msg)
            if isinstance(msg, SurvivorList):
                return self._on_survivor_list(msg)
            assert isinstance(msg, UnmaskRequest)
            return self._on_unmask_request(msg)
        except (CryptoError, ShamirError) as exc:
            raise self._abort(str(exc)) from None

    # --- stage share_keys -----------------------------------------------------------------

    def _on_key_list(self, msg: KeyList) -> ShareKeys:
        t = self.config.threshold
        assert t is not None
        keys = dict(msg.keys)
        outside = sorted(set(keys) - self.neighborhood)
        if outside:
            raise self._abort(f"the key list names clients outside this client's "
                              f"neighbourhood: {outside[:10]}")
        if keys.get(self.client_id) != self.own_entry:
            raise self._abort("the key list does not carry this client's own keys unchanged")
        if len(keys) < t:
            raise self._abort(f"only {len(keys)} clients advertised keys; the threshold "
                              f"is {t}")
        seen: set[bytes] = set()
        loaded: dict[bytes, X25519PublicKey] = {}  # checked once, used for both exchanges
        for cid, entry in keys.items():
            for key in (entry.encryption_key, entry.masking_key):
                try:
                    loaded[key] = load_public_key(key)
                except CryptoError as exc:
                    raise self._abort(f"client {cid}'s public key is invalid: {exc}") from None
                if key in seen:
                    raise self._abort(f"client {cid} advertises a public key that another "
                                      "entry already uses")
                seen.add(key)
            if len(entry.self_mask_commitment) != 32:
                raise self._abort(f"client {cid}'s commitment is malformed")
            if self.config.malicious and not verify_signature(
                    self._verify_keys.get(cid, b""), entry.signature,
                    advertisement_transcript(self.session_id, cid, entry)):
                raise self._abort(f"client {cid}'s key advertisement signature is invalid")
        holders = sorted(keys)
        masking_shares, seed_shares = split_many(
            [self._keys_of(self._masking).private_bytes(), self._seed], holders, t)
        ciphertexts = {}
        secrets: dict[int, bytes] = {}
        for peer in holders:
            if peer == self.client_id:
                continue
            peer_key = keys[peer].encryption_key
            secret = secrets[peer] = self._keys_of(self._encryption).exchange(loaded[peer_key])
            key = share_key(secret, self.session_id, self.client_id, peer,
                            self._keys_of(self._encryption).public, peer_key)
            plaintext = (u32(self.client_id) + u32(peer) + masking_shares[peer]
                         + seed_shares[peer])
            ciphertexts[peer] = seal(key, plaintext,
                                     share_associated_data(self.session_id, self.client_id,
                                                           peer))
        self._keys = keys
        self._loaded = loaded
        self._shared_secrets = secrets  # X25519 is symmetric: reused to open the replies
        self._own_shares = _Received(masking_shares[self.client_id],
                                     seed_shares[self.client_id])
        self._stage = Stage.SHARE_KEYS
        return self._signed(ShareKeys(self.session_id, self.client_id, ciphertexts))

    # --- stage masked_input ---------------------------------------------------------------

    def _on_ciphertexts(self, msg: Ciphertexts) -> MaskedInput:
        t = self.config.threshold
        assert t is not None and self._input is not None
        senders = set(msg.ciphertexts)
        if self.client_id in senders:
            raise self._abort("the server forwarded a ciphertext from this client to itself")
        unknown = sorted(senders - set(self._keys))
        if unknown:
            raise self._abort(f"ciphertexts from clients not in the key list: {unknown[:10]}")
        if len(senders) + 1 < t:
            raise self._abort(f"only {len(senders) + 1} clients shared keys; the threshold "
                              f"is {t}")
        received: dict[int, _Received] = {}
        for sender in sorted(senders):
            peer_key = self._keys[sender].encryption_key
            key = share_key(self._shared_secrets[sender], self.session_id, sender,
                            self.client_id, peer_key, self._keys_of(self._encryption).public)
            try:
                plaintext = open_sealed(key, msg.ciphertexts[sender],
                                        share_associated_data(self.session_id, sender,
                                                              self.client_id))
            except CryptoError:
                raise self._abort(f"the share ciphertext from client {sender} failed its "
                                  "AEAD check") from None
            if (len(plaintext) != SHARE_PLAINTEXT_BYTES or plaintext[:4] != u32(sender)
                    or plaintext[4:8] != u32(self.client_id)):
                raise self._abort(f"the shares from client {sender} name the wrong clients")
            masking_share = plaintext[8:8 + SHARE_BYTES]
            seed_share = plaintext[8 + SHARE_BYTES:]
            decode_share(masking_share)
            decode_share(seed_share)
            received[sender] = _Received(masking_share, seed_share)
        masked = self._mask_input(sorted(senders))
        self._input = None  # masked in place: the plaintext input is gone from memory
        self._received = received
        self._stage = Stage.MASKED_INPUT
        return self._signed(MaskedInput(self.session_id, self.client_id, self.config.bits,
                                        self.config.dim, masked, peers_digest(senders)))

    def _mask_input(self, peers: list[int]) -> bytes:
        """y = x + PRG(b_u) + sum_{v > u} PRG(s_uv) - sum_{v < u} PRG(s_uv)."""
        assert self._input is not None
        cfg = self.config
        masker = Masker(cfg.dim, cfg.bits)
        y = self._input  # this client's private copy (check_input), masked in place
        masker.add(y, self_mask_key(self._seed, self.session_id, self.client_id,
                                    cfg.shape_tag))
        masking = self._keys_of(self._masking)
        own, session, shape = masking.public, self.session_id, cfg.shape_tag
        for peer in peers:
            peer_key = self._keys[peer].masking_key
            key = pairwise_mask_key(masking.exchange(self._loaded[peer_key]), session,
                                    self.client_id, peer, own, peer_key, shape)
            if self.client_id < peer:
                masker.add(y, key)
            else:
                masker.subtract(y, key)
        width = 8 * y.dtype.itemsize
        if cfg.bits < width:
            np.bitwise_and(y, y.dtype.type((1 << cfg.bits) - 1), out=y)
        return y.tobytes()

    # --- stage consistency_check (malicious) ---------------------------------------------

    def _peers_and_self(self) -> set[int]:
        return set(self._received) | {self.client_id}

    def _on_survivor_list(self, msg: SurvivorList) -> ConsistencySignature:
        t = self.config.threshold
        assert t is not None and self._signing_key is not None
        survivors = set(msg.survivors)
        if self.client_id not in survivors:
            raise self._abort("the survivor list omits this client")
        mine = survivors & self.neighborhood
        strangers = sorted(mine - self._peers_and_self())
        if strangers:
            raise self._abort(f"the survivor list names clients that never shared keys with "
                              f"this client: {strangers[:10]}")
        if len(mine) < t:
            raise self._abort(f"only {len(mine)} of this client's holders survived; the "
                              f"threshold is {t}")
        signature = self._signing_key.sign(
            survivors_transcript(self.session_id, self.client_id, msg.survivors))
        self._survivor_list = tuple(sorted(survivors))
        self._stage = Stage.CONSISTENCY_CHECK
        return ConsistencySignature(self.session_id, self.client_id, signature)

    # --- stage unmasking ------------------------------------------------------------------

    def _on_unmask_request(self, msg: UnmaskRequest) -> UnmaskingShares:
        t = self.config.threshold
        assert t is not None and self._own_shares is not None
        survivors, dropped = set(msg.survivors), set(msg.dropped)
        both = sorted(survivors & dropped)
        if both:
            raise self._abort(f"the unmasking request names {both[:10]} as both survived and "
                              "dropped; answering would reveal both of their secrets")
        if self.client_id in dropped:
            raise self._abort("the unmasking request names this client as dropped")
        if self.client_id not in survivors:
            raise self._abort("the unmasking request does not name this client as a survivor")
        peers = self._peers_and_self()
        if survivors | dropped != peers:
            raise self._abort("the unmasking request is inconsistent with the clients that "
                              "shared keys with this client")
        if len(survivors) < t:
            raise self._abort(f"only {len(survivors)} of this client's holders survived; the "
                              f"threshold is {t}")
        if self.config.malicious:
            self._check_consistency(msg, survivors, peers, t)
        elif msg.signatures:
            raise self._abort("signatures in an unmasking request of a semi-honest round")
        for peer in survivors:
            if self.revealed.get(peer, "self_mask") != "self_mask":
                raise self._abort(f"client {peer}'s masking-key share was already revealed")
        for peer in dropped:
            if self.revealed.get(peer, "masking_key") != "masking_key":
                raise self._abort(f"client {peer}'s self-mask share was already revealed")
        shares = dict(self._received)
        shares[self.client_id] = self._own_shares
        seed_shares = {p: shares[p].self_mask_share for p in survivors}
        key_shares = {p: shares[p].masking_key_share for p in dropped}
        self.revealed.update({p: "self_mask" for p in survivors})
        self.revealed.update({p: "masking_key" for p in dropped})
        self._stage = Stage.UNMASKING
        self._done = True
        return self._signed(UnmaskingShares(self.session_id, self.client_id, seed_shares,
                                            key_shares))

    def _check_consistency(self, msg: UnmaskRequest, survivors: set[int], peers: set[int],
                           t: int) -> None:
        assert self._survivor_list is not None
        if survivors != set(self._survivor_list) & peers:
            raise self._abort("the unmasking request's survivors differ from the survivor "
                              "list this client signed")
        signers = set(msg.signatures)
        strangers = sorted(signers - survivors)
        if strangers:
            raise self._abort(f"consistency signatures from clients outside the survivors: "
                              f"{strangers[:10]}")
        for signer, signature in msg.signatures.items():
            if not verify_signature(self._verify_keys.get(signer, b""), signature,
                                    survivors_transcript(self.session_id, signer,
                                                         self._survivor_list)):
                raise self._abort(f"client {signer}'s signature over the survivor list is "
                                  "invalid")
        if len(signers) < t:
            raise self._abort(f"only {len(signers)} consistency signatures; the threshold is "
                              f"{t}")
