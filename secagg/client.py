"""The client state machine (Bonawitz et al. 2017, Figure 4, rounds 0-4; SecAgg+ of
Bell et al. 2020 when the graph is sparse).

Sans-IO: ``advertise()`` returns the first message, ``handle(message)`` consumes one server
message (object or wire bytes) and returns the reply. The caller owns time and sockets.
``snapshot()`` / ``Client.restore`` carry a round across process restarts (secagg/resume.py).

The state is one record per stage (secagg/client_state.py: ``Shared``, ``Masked``, ...): each holds
exactly the data that stage has, so nothing is an ``Optional`` guarded by an assert.
``CLIENT_ACCEPTS`` (module-level data) says which server message each stage accepts.

Rejections and aborts (docs/protocol.md section 7):

* bytes that do not decode, or a message addressed to another client: ``ProtocolError``,
  nothing changes;
* the exact same server message again (QoS 1 redelivery): the same reply again;
* anything else that is wrong (another session or stage, too few peers, inconsistent
  lists, duplicated or small-order keys, bad signatures or AEAD tags, an unmasking request
  that names a peer as both survived and dropped, or this client as dropped, or that would
  isolate survivors of a sparse graph): ``ProtocolAbort``; the client wipes its secrets and
  answers nothing more.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import TypeVar

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from .client_state import (
    PAIR,
    Aborted,
    Advertised,
    Checked,
    Finished,
    Masked,
    Secrets,
    Shared,
    State,
    wipe,
)
from .config import Config
from .crypto import (
    CryptoError,
    KeyPair,
    SigningKey,
    clamp,
    load_public_key,
    open_sealed,
    pairwise_mask_key,
    seal,
    self_mask_commitment,
    self_mask_key,
    sha256,
    share_key,
    u32,
    verify_signature,
)
from .errors import ProtocolAbort, ProtocolError, ShamirError
from .graph import survivor_graph_problem
from .input_check import check_input
from .masked_stream import MaskedStream, SentMaskedInput
from .messages import (
    SCHEDULE,
    SHARE_PLAINTEXT_BYTES,
    AdvertiseKeys,
    Ciphertexts,
    ClientMessage,
    ConsistencySignature,
    InputProof,
    KeyEntry,
    KeyList,
    MaskedInput,
    ServerMessage,
    ShareKeys,
    SurvivorList,
    UnmaskingShares,
    UnmaskRequest,
    client_message_limit,
    decode_server_message,
    encode,
    peers_digest,
)
from .session import session_view
from .shamir import SHARE_BYTES, decode_share, split_many
from .stage import Stage
from .transcripts import (
    advertisement_digest,
    advertisement_transcript,
    client_message_transcript,
    key_set_digest,
    share_associated_data,
    survivors_transcript,
)

# Which server message each client stage accepts, by (stage of the last message the client
# sent, malicious mode). docs/protocol.md table 3.2b; anything else is an abort (P8).
CLIENT_ACCEPTS: Mapping[tuple[Stage, bool], type] = {
    (step.stage, malicious): answer
    for step in SCHEDULE.values() for malicious in (False, True)
    if (answer := step.answer_in(malicious)) is not None
}
"""(stage, malicious) -> the server message the client accepts there, read off
``secagg.messages.SCHEDULE``."""


def _reencode(message: object, stage: Stage, client_id: int | None = None) -> bytes:
    """Wire bytes of a message object, so objects get exactly the validation bytes get."""
    try:
        return encode(message)  # type: ignore[arg-type]
    except Exception as exc:  # a hand-built object with wrong field types
        raise ProtocolError(f"malformed {type(message).__name__} object: {exc}",
                            stage=stage, client_id=client_id) from None


_Signable = TypeVar("_Signable", ShareKeys, UnmaskingShares, InputProof)


class Client:
    """One site's side of a secure aggregation round.

    ``context`` must be the same bytes for every party of the round; it binds application
    data (e.g. the model's hash) into the session id. Freshness does not depend on it: every
    signature and ciphertext after the advertisement binds this round's fresh keys
    (secagg/transcripts.py). In ``malicious`` mode the client needs its Ed25519
    ``signing_key`` and the ``verify_keys`` (client id -> 32-byte Ed25519 public key) of its
    peers. ``nonce``: the server's ``Server.nonce`` for this round, relayed by the
    transport before the client advertises; the advertisement's signature binds it, so a
    recorded advertisement of another round is refused (docs/protocol.md 5.7, 9.2).

    ``input_vector``: the client's input (``check_input``), now or later: a host that
    computes it only when the masked-input request arrives builds the client without it and
    calls ``provide_input`` before answering that request (its snapshots then carry no
    input until it is given, ``secagg.resume``).
    """

    def __init__(self, config: Config, client_id: int, input_vector: object = None, *,
                 roster: Iterable[int] | None = None, context: bytes = b"",
                 signing_key: SigningKey | None = None,
                 verify_keys: Mapping[int, bytes] | None = None, nonce: bytes = b"") -> None:
        self._setup(config, client_id, roster, context, signing_key, verify_keys, nonce)
        encryption, masking = bytearray(32), bytearray(32)
        for buffer in (encryption, masking):
            buffer[:] = X25519PrivateKey.generate().private_bytes_raw()
            clamp(buffer)  # canonical form: the same key, one-to-one with its public key
        seed = bytearray(os.urandom(32))
        vector = None if input_vector is None else check_input(input_vector, config)
        self._secrets = Secrets(encryption, masking, seed, vector)
        self._wipeable: list[bytearray | np.ndarray] = [encryption, masking, seed]
        if vector is not None:
            self._wipeable.append(vector)
        self._advertisement = self._build_advertisement()
        self._state: State = Advertised()
        # digest of server message -> reply
        self._answered: dict[bytes, ClientMessage | MaskedStream] = {}
        self.revealed: dict[int, str] = {}  # peer -> "self_mask" | "masking_key"

    def _setup(self, config: Config, client_id: int, roster: Iterable[int] | None,
               context: bytes, signing_key: SigningKey | None,
               verify_keys: Mapping[int, bytes] | None, nonce: bytes) -> None:
        if not isinstance(nonce, bytes) or len(nonce) not in (0, 32):
            raise ValueError("nonce must be the server's 32-byte Server.nonce (or empty)")
        self.nonce = nonce
        self.config = config
        view = session_view(config, roster, context)  # shared by the session's clients
        self.roster = view.roster
        self._members = view.members
        if client_id not in self._members:
            raise ValueError(f"client_id={client_id} is not in the roster")
        self.client_id = client_id
        self.session_id = view.session_id
        self.graph = view.graph
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

    def _build_advertisement(self) -> AdvertiseKeys:
        secrets = self._secrets
        commitment = self_mask_commitment(bytes(secrets.seed), self.session_id, self.client_id)
        entry = KeyEntry(KeyPair(secrets.key(secrets.encryption)).public,
                         KeyPair(secrets.key(secrets.masking)).public, commitment)
        signature = b""
        if self._signing_key is not None and self.config.malicious:
            signature = self._signing_key.sign(
                advertisement_transcript(self.session_id, self.client_id, entry, self.nonce))
        return AdvertiseKeys(self.session_id, self.client_id, entry.encryption_key,
                             entry.masking_key, commitment, signature)

    # --- state ----------------------------------------------------------------------------

    @property
    def stage(self) -> Stage:
        """The stage of the last message this client sent (ADVERTISE_KEYS before any)."""
        return self._state.stage

    @property
    def done(self) -> bool:
        return isinstance(self._state, Finished)

    @property
    def aborted(self) -> ProtocolAbort | None:
        return self._state.error if isinstance(self._state, Aborted) else None

    @property
    def own_entry(self) -> KeyEntry:
        advert = self._advertisement
        return KeyEntry(advert.encryption_key, advert.masking_key,
                        advert.self_mask_commitment, advert.signature)

    def max_message_bytes(self) -> int:
        """An upper bound on a valid server message to this client (for transports)."""
        return client_message_limit(len(self.roster))

    def _abort(self, reason: str) -> ProtocolAbort:
        stage = self._state.stage
        error = ProtocolAbort(f"client {self.client_id} aborted in {stage.label}: "
                              f"{reason}", stage=stage, client_id=self.client_id)
        self._state = Aborted(error, stage)
        self._answered = {}
        self._erase()
        return error

    def _erase(self) -> None:
        """Overwrite with zeros every buffer that holds a secret of this round: the private
        keys, the seed, the input x (the masked input streams from it until the round
        ends; its chunks are public), the mask keys, the X25519 share-key secrets, its own
        shares and those it received. What was revealed stays in the cached replies
        only."""
        for buffer in self._wipeable:
            wipe(buffer)
        self._wipeable = []

    def _hold(self, buffer: bytearray) -> bytearray:
        self._wipeable.append(buffer)
        return buffer

    def _signed(self, message: _Signable, key_set: bytes) -> _Signable:
        """In malicious mode every client message is signed, bound to this round's key set,
        so neither the broker nor the server can alter or replay it (section 5.7)."""
        if not self.config.malicious or self._signing_key is None:
            return message
        signature = self._signing_key.sign(client_message_transcript(message, key_set))
        return replace(message, signature=signature)

    # --- stage advertise_keys -------------------------------------------------------------

    def advertise(self) -> AdvertiseKeys:
        """Round 0: the client's public keys (the same message every time it is asked).

        In ``malicious`` mode only once the server's round nonce is bound
        (``Client(nonce=server.nonce)`` or ``bind_nonce``): an advertisement signed without
        it could be replayed into a later round to shut this client out (docs/protocol.md
        9.2), so the client raises ``ProtocolError`` instead of sending one."""
        if self.config.malicious and not self.nonce:
            raise ProtocolError("malicious mode: bind the server's round nonce before "
                                "advertising (Client(..., nonce=server.nonce) or "
                                "client.bind_nonce(nonce)); the transport relays it",
                                stage=self.stage, client_id=self.client_id)
        return self._advertisement

    def bind_nonce(self, nonce: bytes) -> AdvertiseKeys:
        """Bind the server's round nonce (``Server.nonce``) that the transport relays before
        the client advertises, and return the advertisement signed over it, so that an
        advertisement recorded in another round is refused (docs/protocol.md 5.7, 9.2).

        For transports that build the client before the round's first server message
        arrives. Only before the client has answered any server message; the same nonce
        again is a no-op; another one raises ``ProtocolError`` and changes nothing.
        """
        if not isinstance(nonce, bytes) or len(nonce) != 32:
            raise ProtocolError("the round nonce must be 32 bytes", stage=self.stage,
                                client_id=self.client_id)
        if nonce == self.nonce:
            return self._advertisement
        if self.nonce or not isinstance(self._state, Advertised) or self.aborted is not None:
            raise ProtocolError("a round nonce can be bound only once, before the client "
                                "answers any server message", stage=self.stage,
                                client_id=self.client_id)
        self.nonce = nonce
        self._advertisement = self._build_advertisement()
        return self._advertisement

    @property
    def has_input(self) -> bool:
        """Whether this client holds its input (given at construction or by
        ``provide_input``) and has not masked it yet."""
        return self._secrets.input is not None and isinstance(self._state,
                                                              (Advertised, Shared))

    def provide_input(self, input_vector: object) -> None:
        """Give the client its input, once, any time before it answers the ``Ciphertexts``
        message (the masked-input request): a host that computes its input late (a Flower
        node trains at that request) builds ``Client(config, client_id)`` without one, and
        its snapshots carry no input until it is given. The input is checked as at
        construction (``ValueError`` naming what to change; ``ValidationUnavailable`` for a
        ``norm_bound`` without the group library) and nothing changes when it is refused. A
        second input, or one after masking, is refused with ``ProtocolError``: the client
        masks one input per round (two masked inputs under the same masks would reveal
        their difference)."""
        if self._secrets.input is not None or not isinstance(self._state,
                                                             (Advertised, Shared)):
            raise ProtocolError(f"client {self.client_id} already has its input "
                                f"(stage {self.stage.label}); a client masks one input per "
                                "round", stage=self.stage, client_id=self.client_id)
        vector = check_input(input_vector, self.config)
        self._secrets = replace(self._secrets, input=vector)
        self._wipeable.append(vector)

    # --- dispatch -------------------------------------------------------------------------

    def handle(self, message: ServerMessage | bytes | bytearray | memoryview) -> ClientMessage:
        """Consume one server message and return this client's reply (the masked input as
        one ``MaskedInput``: the one-chunk case of ``stream``)."""
        reply = self._answer(message)
        return reply.whole() if isinstance(reply, MaskedStream) else reply

    def stream(self, message: ServerMessage | bytes | bytearray | memoryview
               ) -> ClientMessage | MaskedStream:
        """Like ``handle``, but the answer to ``Ciphertexts`` is a ``MaskedStream``: the
        masked input produced chunk by chunk in a bounded window (docs/protocol.md 6.3),
        for transports that send model-sized vectors. The same message again returns the
        same stream."""
        return self._answer(message)

    def _answer(self, message: ServerMessage | bytes | bytearray | memoryview
                ) -> ClientMessage | MaskedStream:
        stage = self._state.stage
        if isinstance(message, (bytes, bytearray, memoryview)):
            raw = bytes(message)
        elif isinstance(message, (KeyList, Ciphertexts, SurvivorList, UnmaskRequest)):
            raw = _reencode(message, stage, self.client_id)
        else:
            raise ProtocolError(f"{type(message).__name__} is not a server message",
                                stage=stage, client_id=self.client_id)
        try:
            msg = decode_server_message(raw, len(self.roster))
        except ProtocolError as exc:
            raise ProtocolError(str(exc), stage=stage, client_id=self.client_id) from None
        if msg.recipient != self.client_id:
            raise ProtocolError(
                f"message for client {msg.recipient} delivered to client {self.client_id}",
                stage=stage, client_id=self.client_id)
        if isinstance(self._state, Aborted):
            raise ProtocolError(f"client {self.client_id} has aborted: {self._state.error}",
                                stage=stage, client_id=self.client_id)
        digest = sha256(raw)
        if digest in self._answered:
            return self._answered[digest]  # a redelivered message gets the same answer
        if isinstance(self._state, Finished):
            raise ProtocolError(f"client {self.client_id} has finished the round",
                                stage=stage, client_id=self.client_id)
        if msg.session_id != self.session_id:
            raise self._abort("the message belongs to another session")
        want = CLIENT_ACCEPTS.get((stage, self.config.malicious))
        if want is None or type(msg) is not want:
            raise self._abort(f"{type(msg).__name__} is not the next message after "
                              f"{stage.label}")
        try:
            reply: ClientMessage | MaskedStream = _HANDLERS[want](self, msg)
        except (CryptoError, ShamirError) as exc:
            raise self._abort(str(exc)) from None
        self._answered[digest] = reply
        if isinstance(self._state, Finished):
            self._erase()
        return reply

    # --- stage share_keys -----------------------------------------------------------------

    def _on_key_list(self, msg: KeyList) -> ShareKeys:
        t = self.config.threshold
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
            if self.config.malicious:
                try:
                    verify_signature(self._verify_keys.get(cid, b""), entry.signature,
                                     advertisement_transcript(self.session_id, cid, entry,
                                                              self.nonce))
                except CryptoError as exc:
                    raise self._abort(f"client {cid}'s key advertisement signature is "
                                      f"invalid: {exc}") from None
        sid, me = self.session_id, self.client_id
        adverts = {cid: advertisement_digest(sid, cid, e) for cid, e in keys.items()}
        holders = sorted(keys)
        secrets = self._secrets
        masking_shares, seed_shares = split_many(
            [bytes(secrets.masking), bytes(secrets.seed)], holders, t)
        encryption = KeyPair(secrets.key(secrets.encryption))
        peers = [p for p in holders if p != me]
        pair_secrets = self._hold(bytearray(32 * len(peers)))
        ciphertexts = {}
        for i, peer in enumerate(peers):
            peer_key = keys[peer].encryption_key
            secret = encryption.exchange(loaded[peer_key])
            pair_secrets[32 * i:32 * i + 32] = secret  # reused to open the replies
            key = share_key(secret, sid, me, peer, encryption.public, peer_key)
            plaintext = u32(me) + u32(peer) + masking_shares[peer] + seed_shares[peer]
            ciphertexts[peer] = seal(key, plaintext, share_associated_data(
                sid, me, peer, adverts[me], adverts[peer]))
        own = self._hold(bytearray(masking_shares[me] + seed_shares[me]))
        key_set = key_set_digest(sid, keys)
        self._state = Shared(keys, key_set, adverts, loaded, own, pair_secrets,
                              {p: 32 * i for i, p in enumerate(peers)})
        return self._signed(ShareKeys(sid, me, ciphertexts), key_set)

    # --- stage masked_input ---------------------------------------------------------------

    def _on_ciphertexts(self, msg: Ciphertexts) -> MaskedStream:
        state = self._state
        assert isinstance(state, Shared)  # guaranteed by CLIENT_ACCEPTS
        vector = self._secrets.input
        if vector is None:  # refused before anything changes: the request may come again
            raise ProtocolError(f"client {self.client_id} has no input to mask: give it with "
                                "client.provide_input(vector) before answering the "
                                "masked-input request", stage=state.stage,
                                client_id=self.client_id)
        t = self.config.threshold
        sid, me = self.session_id, self.client_id
        senders = set(msg.ciphertexts)
        if me in senders:
            raise self._abort("the server forwarded a ciphertext from this client to itself")
        unknown = sorted(senders - set(state.keys))
        if unknown:
            raise self._abort(f"ciphertexts from clients not in the key list: {unknown[:10]}")
        if len(senders) + 1 < t:
            raise self._abort(f"only {len(senders) + 1} clients shared keys; the threshold "
                              f"is {t}")
        own_public = self._advertisement.encryption_key
        order = sorted(senders)
        received = self._hold(bytearray(PAIR * len(order)))
        for i, sender in enumerate(order):
            peer_key = state.keys[sender].encryption_key
            offset = state.order[sender]
            key = share_key(bytes(state.secrets[offset:offset + 32]), sid, sender, me,
                            peer_key, own_public)
            try:
                plaintext = open_sealed(key, msg.ciphertexts[sender], share_associated_data(
                    sid, sender, me, state.adverts[sender], state.adverts[me]))
            except CryptoError:
                raise self._abort(f"the share ciphertext from client {sender} failed its "
                                  "AEAD check") from None
            if (len(plaintext) != SHARE_PLAINTEXT_BYTES or plaintext[:4] != u32(sender)
                    or plaintext[4:8] != u32(me)):
                raise self._abort(f"the shares from client {sender} name the wrong clients")
            decode_share(plaintext[8:8 + SHARE_BYTES])
            decode_share(plaintext[8 + SHARE_BYTES:])
            received[PAIR * i:PAIR * i + PAIR] = plaintext[8:]
        keys = self._mask_keys(state, order)
        proof = self._input_proof(keys, state.adverts[me], state.key_set)
        self._state = Masked(state, frozenset(senders), received,
                              {p: PAIR * i for i, p in enumerate(order)})
        signer = self._signing_key if self.config.malicious else None
        return MaskedStream(vector, keys, peers_digest(senders), state.key_set, proof,
                            session_id=sid, client_id=me, bits=self.config.bits,
                            signer=signer, over=self._weak_over())

    def _weak_over(self) -> Callable[[], ProtocolError | None]:
        """``_stream_over`` through a weak reference: the stream this client caches (in its
        reply cache) must not hold the client in a reference cycle, which would keep both,
        with the input and the masked vector, alive until Python's cycle collector runs."""
        method = weakref.WeakMethod(self._stream_over)

        def over() -> ProtocolError | None:
            bound = method()
            return None if bound is None else bound()

        return over

    def _stream_over(self) -> ProtocolError | None:
        """Why this client's masked input can no longer be streamed (its input is wiped once
        it aborted or finished), else None."""
        if self.aborted is None and not self.done:
            return None
        return ProtocolError(f"client {self.client_id} has "
                             f"{'aborted' if self.aborted else 'finished'}; its masked input "
                             "is gone", stage=self.stage, client_id=self.client_id)

    def _input_proof(self, keys: list[tuple[bytearray, bool]], advertisement: bytes,
                     key_set: bytes) -> InputProof | None:
        """With ``norm_bound``: the proof that the vector this client masks is within the
        bound, its commitment blinded by what its mask keys carry (docs/protocol.md 10)."""
        cfg = self.config
        vector = self._secrets.input
        if cfg.norm_bound is None or vector is None:  # _on_ciphertexts checked it is given
            return None
        from .validation import NormStatement, blinding, prove

        statement = NormStatement(self.session_id, self.client_id, cfg.dim, cfg.bits,
                                  cfg.norm_bound, advertisement, cfg.weight_index)
        blind = blinding((bytes(key), added) for key, added in keys)
        return self._signed(InputProof(self.session_id, self.client_id,
                                       prove(statement, vector, blind)), key_set)

    def _mask_keys(self, state: Shared, peers: list[int]) -> list[tuple[bytearray, bool]]:
        """The AES keys of y = x + PRG(b_u) + sum_{v > u} PRG(s_uv) - sum_{v < u} PRG(s_uv),
        each with its sign (True: added), held as secrets of this round."""
        cfg = self.config
        session, shape, me = self.session_id, cfg.shape_tag, self.client_id
        keys = [(self._hold(bytearray(self_mask_key(bytes(self._secrets.seed), session, me,
                                                    shape))), True)]
        masking = KeyPair(self._secrets.key(self._secrets.masking))
        own = self._advertisement.masking_key
        for peer in peers:
            peer_key = state.keys[peer].masking_key
            key = pairwise_mask_key(masking.exchange(state.loaded[peer_key]), session,
                                    me, peer, own, peer_key, shape)
            keys.append((self._hold(bytearray(key)), me < peer))
        return keys

    # --- stage consistency_check (malicious) ---------------------------------------------

    def _on_survivor_list(self, msg: SurvivorList) -> ConsistencySignature:
        state = self._state
        assert isinstance(state, Masked) and self._signing_key is not None
        t = self.config.threshold
        me = self.client_id
        survivors = set(msg.survivors)
        if me not in survivors:
            raise self._abort("the survivor list omits this client")
        mine = survivors & self.neighborhood
        strangers = sorted(mine - state.peers - {me})
        if strangers:
            raise self._abort(f"the survivor list names clients that never shared keys with "
                              f"this client: {strangers[:10]}")
        if len(mine) < t:
            raise self._abort(f"only {len(mine)} of this client's holders survived; the "
                              f"threshold is {t}")
        signature = self._signing_key.sign(survivors_transcript(
            self.session_id, me, msg.survivors, state.shared.adverts[me]))
        self._state = Checked(state, tuple(sorted(survivors)))
        return ConsistencySignature(self.session_id, me, signature)

    # --- stage unmasking ------------------------------------------------------------------

    def _on_unmask_request(self, msg: UnmaskRequest) -> UnmaskingShares:
        state = self._state
        checked = state if isinstance(state, Checked) else None
        masked = state.masked if isinstance(state, Checked) else state
        assert isinstance(masked, Masked)
        t = self.config.threshold
        me = self.client_id
        listed, dropped = set(msg.survivors), set(msg.dropped)
        peers = masked.peers | {me}
        survivors = listed & peers
        both = sorted(listed & dropped)
        if both:
            raise self._abort(f"the unmasking request names {both[:10]} as both survived and "
                              "dropped; answering would reveal both of their secrets")
        if me in dropped:
            raise self._abort("the unmasking request names this client as dropped")
        if me not in listed:
            raise self._abort("the unmasking request does not name this client as a survivor")
        strangers = sorted((listed | dropped) - self._members)
        if strangers:
            raise self._abort(f"the unmasking request names clients outside the roster: "
                              f"{strangers[:10]}")
        if survivors | dropped != peers:
            raise self._abort("the unmasking request is inconsistent with the clients that "
                              "shared keys with this client")
        if len(survivors) < t:
            raise self._abort(f"only {len(survivors)} of this client's holders survived; the "
                              f"threshold is {t}")
        if checked is not None:
            self._check_consistency(msg, checked, survivors, t)
        elif msg.signatures:
            raise self._abort("signatures in an unmasking request of a semi-honest round")
        if dropped and not self.graph.is_complete:
            problem = survivor_graph_problem(self.graph, listed, t)
            if problem is not None:
                raise self._abort(f"revealing the masking keys of dropped peers "
                                  f"{sorted(dropped)[:10]} would {problem}")
        for peer in survivors:
            if self.revealed.get(peer, "self_mask") != "self_mask":
                raise self._abort(f"client {peer}'s masking-key share was already revealed")
        for peer in dropped:
            if self.revealed.get(peer, "masking_key") != "masking_key":
                raise self._abort(f"client {peer}'s self-mask share was already revealed")
        seed_shares = {p: self._share_of(masked, p, seed=True) for p in survivors}
        key_shares = {p: self._share_of(masked, p, seed=False) for p in dropped}
        self.revealed.update({p: "self_mask" for p in survivors})
        self.revealed.update({p: "masking_key" for p in dropped})
        self._state = Finished()
        return self._signed(UnmaskingShares(self.session_id, me, seed_shares, key_shares),
                            masked.shared.key_set)

    def _share_of(self, masked: Masked, peer: int, *, seed: bool) -> bytes:
        if peer == self.client_id:
            pair, offset = masked.shared.own_shares, 0
        else:
            pair, offset = masked.received, masked.index[peer]
        start = offset + (SHARE_BYTES if seed else 0)
        return bytes(pair[start:start + SHARE_BYTES])

    def _check_consistency(self, msg: UnmaskRequest, checked: Checked, survivors: set[int],
                           t: int) -> None:
        if set(msg.survivors) != set(checked.survivors):
            raise self._abort("the unmasking request's survivors differ from the survivor "
                              "list this client signed")
        signers = set(msg.signatures)
        strangers = sorted(signers - survivors)
        if strangers:
            raise self._abort(f"consistency signatures from clients outside the survivors: "
                              f"{strangers[:10]}")
        adverts = checked.masked.shared.adverts
        for signer, signature in msg.signatures.items():
            try:
                verify_signature(self._verify_keys.get(signer, b""), signature,
                                 survivors_transcript(self.session_id, signer,
                                                      checked.survivors, adverts[signer]))
            except CryptoError:
                raise self._abort(f"client {signer}'s signature over the survivor list is "
                                  "invalid") from None
        if len(signers) < t:
            raise self._abort(f"only {len(signers)} consistency signatures; the threshold is "
                              f"{t}")

    # --- resuming (secagg/resume.py) -----------------------------------------------------

    def _snapshot_replies(self) -> list[list[bytes]]:
        """The reply cache for a snapshot: each reply's wire bytes, except the masked input,
        of which only the request's digest is kept (empty reply bytes; secagg.resume)."""
        return [[digest, b"" if isinstance(reply, (MaskedStream, MaskedInput))
                 else encode(reply)] for digest, reply in self._answered.items()]

    def _sent_masked_input(self) -> MaskedStream:
        """A restored reply-cache entry for a masked input sent before the snapshot."""
        return SentMaskedInput(self.config, self.client_id)

    def snapshot(self, key: bytes = b"") -> bytes:
        """This client's whole state as bytes, **secrets included**, authenticated with
        HMAC-SHA256 under ``key``: node-local, never to be sent to anyone. See
        ``secagg.resume``."""
        from .resume import snapshot

        return snapshot(self, key)

    @classmethod
    def restore(cls, data: bytes, *, config: Config, client_id: int, context: bytes = b"",
                roster: Iterable[int] | None = None, signing_key: SigningKey | None = None,
                verify_keys: Mapping[int, bytes] | None = None, key: bytes = b"",
                min_stage: Stage | None = None) -> Client:
        """The client ``snapshot()`` saved; raises ``StaleSnapshot`` for a snapshot of
        another session (config, roster, context) or client, under another ``key``, or
        corrupted or truncated bytes, and for one whose stage is before ``min_stage`` (the
        host's forward-only guard against rollback: pass the stage this client had reached
        in this session, recorded outside the snapshot; see ``secagg.resume``)."""
        from .resume import restore

        return restore(cls, data, config=config, client_id=client_id, context=context,
                       roster=roster, signing_key=signing_key, verify_keys=verify_keys,
                       key=key, min_stage=min_stage)


_HANDLERS: Mapping[type, Callable[[Client, object], ClientMessage | MaskedStream]] = {
    KeyList: Client._on_key_list,  # type: ignore[dict-item]
    Ciphertexts: Client._on_ciphertexts,  # type: ignore[dict-item]
    SurvivorList: Client._on_survivor_list,  # type: ignore[dict-item]
    UnmaskRequest: Client._on_unmask_request,  # type: ignore[dict-item]
}
