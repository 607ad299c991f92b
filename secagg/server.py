"""The server state machine (Bonawitz et al. 2017, Figure 4, server side; SecAgg+ of
Bell et al. 2020 for sparse graphs).

Sans-IO: ``receive(client_id, message)`` takes one client message (object or wire bytes)
for the current stage; ``advance()`` closes the stage (the caller decides when: every
expected message arrived, or its deadline passed) and returns the messages to send, by
recipient. After the unmasking stage ``advance()`` returns nothing and ``result`` holds the
aggregate.

A rejected message raises ``ProtocolError`` and changes nothing. The exact same message
twice is accepted once (QoS 1 redelivery); a different second message from one client in
one stage is rejected. ``ProtocolAbort`` means the round cannot finish.

This module is the state machine; beside it: the upload slots and each masked-input
chunk's checks (``secagg/uploads.py``), the unmasking stage's recovery of the secrets and
removal of the masks (``secagg/recovery.py``), the log of refusals
(``secagg/rejections.py``) and the round nonce (``secagg/nonce.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace

import numpy as np

from .config import Config
from .crypto import (
    CryptoError,
    check_public_key,
    dtype_for_bits,
    sha256,
    verify_signature,
)
from .errors import InputMismatch, InputRefused, ProtocolAbort, ProtocolError
from .messages import (
    CLIENT_KINDS,
    AdvertiseKeys,
    Ciphertexts,
    ClientMessage,
    ConsistencySignature,
    InputProof,
    KeyEntry,
    KeyList,
    MaskedChunk,
    MaskedInput,
    ServerMessage,
    ShareKeys,
    SurvivorList,
    UnmaskingShares,
    UnmaskRequest,
    decode,
    encode,
    peers_digest,
)
from .nonce import RoundNonce
from .recovery import recover, unmask
from .rejections import RejectionLog
from .session import derive_session_id, normalize_roster, session_graph
from .shamir import (
    PRIME,
)
from .stage import Stage
from .transcripts import (
    SIGNED_TAGS,
    advertisement_digest,
    advertisement_transcript,
    client_message_transcript,
    key_set_digest,
    payload_digest,
    survivors_transcript,
    transcript,
)
from .unmasking import MaskKeys
from .uploads import DEFAULT_UPLOAD_BUDGET, Uploads


@dataclass(frozen=True)
class AggregateResult:
    """The output of a round.

    ``total``: the sum of the included inputs mod 2**bits, in the natural width
    (``secagg.crypto.dtype_for_bits``: uint32 for bits <= 32, uint64 above).
    ``included``: ids whose masked input is in the sum.
    ``dropped``: id -> the first stage in which the client sent nothing.
    ``corrupt_shares``: holder id -> ids of clients whose secret it sent a wrong share of,
    named only when attributable (docs/protocol.md section 8, step 5).
    ``unattributable``: ids of clients whose secret was reconstructed and verified although
    its shares were inconsistent beyond what can be attributed to anyone.
    ``refused``: id -> why, for clients whose input-validation proof failed (``norm_bound``,
    docs/protocol.md section 10): left out of the sum, named; an honest client never is.
    """

    total: np.ndarray
    included: frozenset[int]
    dropped: Mapping[int, Stage] = field(default_factory=dict)
    corrupt_shares: Mapping[int, frozenset[int]] = field(default_factory=dict)
    unattributable: frozenset[int] = frozenset()
    refused: Mapping[int, str] = field(default_factory=dict)


class Server:
    """The aggregator's side of one round. See the module docstring for the interface."""

    def __init__(self, config: Config, *, roster: Iterable[int] | None = None,
                 context: bytes = b"", verify_keys: Mapping[int, bytes] | None = None,
                 executor: Executor | None = None, workers: int = 2,
                 nonce: RoundNonce | None = None,
                 upload_budget: int = DEFAULT_UPLOAD_BUDGET
                 ) -> None:
        if nonce is not None and not isinstance(nonce, RoundNonce):
            raise ValueError("Server(nonce=) takes a RoundNonce (secagg.RoundNonce(), whose "
                             ".value the host relays), or None to draw one here; never bytes:"
                             " given bytes could be a nonce used before")
        # relayed to every client before it advertises (Client(nonce=...) or
        # client.bind_nonce): binds each advertisement to this round (docs/protocol.md 5.7).
        # Always fresh and single-use: drawn here or by RoundNonce(), which gives it to one
        # Server only; a malicious-mode client refuses to advertise without it
        self.nonce: bytes = (nonce or RoundNonce()).take()
        self.config = config
        self._executor = executor
        self._workers = max(1, workers)
        self.roster = normalize_roster(config, roster)
        self._members = frozenset(self.roster)
        self.session_id = derive_session_id(config, self.roster, context)
        self.graph = session_graph(config, self.roster, self.session_id)
        if config.malicious and verify_keys is None:
            raise ValueError("security='malicious' needs verify_keys (client id -> Ed25519 "
                             "public key)")
        self._verify_keys = dict(verify_keys or {})
        self._threshold: int = config.threshold
        self._vector_bytes = config.dim * dtype_for_bits(config.bits).itemsize
        # the masked inputs: the upload slots, the pending streams and the sum
        self._uploads = Uploads(config.dim, config.bits, upload_budget)
        self.upload_slots = self._uploads.slots
        """How many senders may stream a masked input at once (``grant_uploads``)."""
        self._stage = Stage.ADVERTISE_KEYS
        self._expected: set[int] = set(self.roster)
        self._inbox: dict[int, ClientMessage] = {}
        # _expected minus _inbox, kept as messages arrive: what a transport asks after
        # every message (``pending_count``, ``is_pending``) costs O(1), not O(n)
        self._pending: set[int] = set(self.roster)
        # sha256 of each accepted message (this stage, previous stage): a redelivery is the
        # same bytes, hashed only when the sender already has an accepted message. A digest,
        # not the bytes: n whole masked inputs must not stay behind (docs/protocol.md 6.3)
        self._accepted_digest: dict[int, bytes] = {}
        self._previous_digest: dict[int, bytes] = {}
        self.dropped: dict[int, Stage] = {}
        # why each client's messages were refused: one entry per client, bounded by the
        # roster whatever a client floods (RejectionLog)
        self.rejected = RejectionLog(self.roster)
        self._adverts: dict[int, AdvertiseKeys] = {}
        self._key_owner: dict[bytes, int] = {}
        self._key_lists: dict[int, frozenset[int]] = {}
        self._key_sets: dict[int, bytes] = {}  # key_set_digest of each client's key list
        self._advert_digests: dict[int, bytes] = {}
        self._share_keys: dict[int, ShareKeys] = {}
        self._forwarded: dict[int, frozenset[int]] = {}
        self._survivors: frozenset[int] = frozenset()
        self._requests: dict[int, tuple[frozenset[int], frozenset[int]]] = {}
        self._signatures: dict[int, bytes] = {}
        self.result: AggregateResult | None = None
        self.aborted: ProtocolAbort | None = None
        # input validation (docs/protocol.md 10): each verified client's input commitment,
        # the digest of its proof message, and who was refused and why
        self._commitments: dict[int, object] = {}
        self._proof_digests: dict[int, bytes] = {}
        self.refused: dict[int, str] = {}
        if config.norm_bound is not None:
            from .validation import available
            from .validation.group import ValidationUnavailable

            if not available():
                raise ValidationUnavailable("norm_bound needs the group library: pip install "
                                            "'secagg[validation]' (py-arkworks-bls12381)")

    # --- state ----------------------------------------------------------------------------

    @property
    def stage(self) -> Stage:
        """The stage whose client messages the server is collecting."""
        return self._stage

    @property
    def finished(self) -> bool:
        return self.result is not None

    @property
    def pending(self) -> frozenset[int]:
        """Clients whose message for the current stage has not arrived yet (a copy, O(n):
        per message, ask ``pending_count`` or ``is_pending``)."""
        return frozenset(self._pending)

    @property
    def pending_count(self) -> int:
        """``len(pending)`` in O(1)."""
        return len(self._pending)

    def is_pending(self, client_id: int) -> bool:
        """``client_id in pending`` in O(1)."""
        return client_id in self._pending

    @property
    def received(self) -> frozenset[int]:
        return frozenset(self._inbox)

    def max_message_bytes(self) -> int:
        """An upper bound on a valid client message this round (for transports)."""
        proof = 0
        if self.config.norm_bound is not None:
            from .validation import proof_size

            proof = proof_size(self.config.dim, self.config.weight_index is not None)
        return 1024 + max(self._vector_bytes, proof) + len(self.roster) * 128

    # --- receiving ------------------------------------------------------------------------

    def _reject(self, client_id: int, reason: str) -> ProtocolError:
        self.rejected.append((client_id, reason))
        return ProtocolError(f"message from client {client_id} rejected in "
                             f"{self._stage.label}: {reason}", stage=self._stage,
                             client_id=client_id)

    def receive(self, client_id: int,
                message: ClientMessage | bytes | bytearray | memoryview, *,
                digest: bytes | None = None) -> bool:
        """Accept one message from ``client_id`` (the transport-authenticated sender).

        Returns ``True`` for a new message, ``False`` for a redelivery of one already
        accepted (this stage's or the previous stage's); raises ``ProtocolError`` when the
        message is rejected. The bytes are decoded once; besides what a signature covers
        (malicious mode), the server keeps each accepted message's sha256 to recognise its
        redelivery (never the bytes: a whole masked input is d-sized). ``digest``: that
        sha256 of ``message``'s bytes when the caller has it already (a transport's
        reassembly checked it against them), so a 4 MiB chunk is not hashed again."""
        if digest is not None and (not isinstance(digest, bytes) or len(digest) != 32):
            raise ValueError("digest must be the 32-byte sha256 of the message's bytes")
        if self.aborted is not None:
            raise self._reject(client_id, f"the round was aborted: {self.aborted}")
        if isinstance(message, (bytes, bytearray, memoryview)):
            raw = bytes(message)
        elif isinstance(message, (AdvertiseKeys, ShareKeys, MaskedInput, MaskedChunk,
                                  ConsistencySignature, UnmaskingShares, InputProof)):
            try:  # objects get exactly the validation wire bytes get
                raw = encode(message)
            except Exception as exc:  # a hand-built object with wrong field types
                raise self._reject(client_id, f"malformed {type(message).__name__} object: "
                                              f"{exc}") from None
        else:
            raise self._reject(client_id, f"{type(message).__name__} is not a client message")
        try:
            msg = decode(raw, max_bytes=self.max_message_bytes(),
                         max_entries=len(self.roster), max_vector_bytes=self._vector_bytes,
                         kinds=CLIENT_KINDS)
        except ProtocolError as exc:
            raise self._reject(client_id, str(exc)) from None
        assert isinstance(msg, (AdvertiseKeys, ShareKeys, MaskedInput, MaskedChunk,
                                ConsistencySignature, UnmaskingShares, InputProof))
        if client_id not in self._members:
            raise self._reject(client_id, "the sender is not in the roster")
        if msg.client_id != client_id:
            raise self._reject(client_id, f"the message claims to come from client "
                                          f"{msg.client_id}")
        if msg.session_id != self.session_id:
            raise self._reject(client_id, "the message belongs to another session")
        if isinstance(msg, InputProof):
            return self._take_proof(client_id, msg, raw)
        accepted = self._accepted_digest.get(client_id)
        previous = self._previous_digest.get(client_id)
        known = digest
        digest = (known or sha256(raw)) if accepted is not None or previous is not None else b""
        if accepted == digest and client_id in self._inbox:
            return False  # redelivery of an accepted message
        if previous == digest:
            return False  # late redelivery of last stage's message (also after the result)
        if self.result is not None:
            raise self._reject(client_id, "the round has finished")
        if msg.stage != self._stage:
            raise self._reject(client_id, f"a {msg.stage.label} message is out of stage")
        if client_id not in self._expected:
            raise self._reject(client_id, "the client is not part of this stage (it dropped "
                                          "or was not sent the previous message)")
        upload = self._uploads.get(client_id)
        if upload is not None and upload.last_raw == raw:
            return False  # redelivery of the latest chunk of a stream
        if client_id in self._inbox:
            raise self._reject(client_id, "a second, different message in one stage")
        if isinstance(msg, (MaskedInput, MaskedChunk)):
            return self._take_masked(client_id, msg, raw, digest or known)
        self._validate(client_id, msg)
        self._inbox[client_id] = msg
        self._pending.discard(client_id)
        self._accepted_digest[client_id] = digest or known or sha256(raw)
        if isinstance(msg, AdvertiseKeys):
            self._advert_digests[client_id] = advertisement_digest(
                self.session_id, client_id, _entry(msg))
            self._key_owner[msg.encryption_key] = client_id
            self._key_owner[msg.masking_key] = client_id
        return True

    def _validate(self, cid: int, msg: ClientMessage) -> None:
        cfg = self.config
        if isinstance(msg, AdvertiseKeys):
            try:
                check_public_key(msg.encryption_key)
                check_public_key(msg.masking_key)
            except CryptoError as exc:
                raise self._reject(cid, str(exc)) from None
            if msg.encryption_key == msg.masking_key:
                raise self._reject(cid, "the encryption and masking keys are the same")
            for key in (msg.encryption_key, msg.masking_key):
                if key in self._key_owner:
                    raise self._reject(cid, "duplicates a public key of client "
                                            f"{self._key_owner[key]}")
            if cfg.malicious:
                try:
                    verify_signature(self._verify_keys.get(cid, b""), msg.signature,
                                     advertisement_transcript(self.session_id, cid,
                                                              _entry(msg), self.nonce))
                except CryptoError as exc:
                    raise self._reject(cid, f"the advertisement signature is invalid: "
                                            f"{exc}") from None
        elif isinstance(msg, ShareKeys):
            if set(msg.ciphertexts) != self._key_lists[cid] - {cid}:
                raise self._reject(cid, "ciphertexts must address exactly the other clients "
                                        "of its key list")
            self._check_signature(cid, msg)
        elif isinstance(msg, ConsistencySignature):
            try:
                verify_signature(self._verify_keys.get(cid, b""), msg.signature,
                                 survivors_transcript(self.session_id, cid, self._survivors,
                                                      self._advert_digests[cid]))
            except CryptoError as exc:
                raise self._reject(cid, f"the survivor-list signature is invalid: "
                                        f"{exc}") from None
        else:
            assert isinstance(msg, UnmaskingShares)
            survivors, dropped = self._requests[cid]
            if set(msg.self_mask_shares) != survivors or set(msg.masking_key_shares) != dropped:
                raise self._reject(cid, "shares must answer exactly the unmasking request")
            for share in (*msg.self_mask_shares.values(), *msg.masking_key_shares.values()):
                if int.from_bytes(share, "big") >= PRIME:
                    raise self._reject(cid, "a share is not a field element")
            self._check_signature(cid, msg)

    # --- streamed masked inputs (docs/protocol.md 6.3) ------------------------------------

    @property
    def uploading(self) -> frozenset[int]:
        """Senders granted an upload slot whose masked input has not completed (a copy:
        per message, ask ``is_uploading``)."""
        return self._uploads.ids()

    def is_uploading(self, client_id: int) -> bool:
        """``client_id in uploading`` in O(1)."""
        return client_id in self._uploads

    def grant_uploads(self, client_ids: Iterable[int] | None = None, *,
                      exclude: Container[int] = (),
                      chunk_elements: int | None = None) -> list[int]:
        """Stage masked_input: give free upload slots to clients still expected (of
        ``client_ids``, default all; none in ``exclude``, e.g. clients known to be gone,
        which later calls consider again; lowest id first) and return them. Only a granted
        client may stream chunks; a whole ``MaskedInput`` needs no grant (it completes in
        one message). The transport tells each granted client, which waits for its grant
        instead of being dropped: a slow server slows its senders (docs/deployment.md,
        flow control). With ``chunk_elements`` the grant is for chunks of that many
        elements: any other chunk but the last (which may be shorter) is refused, so a
        sender cannot make the server's per-chunk work and state per element.

        Without ``client_ids`` a call costs O((granted + excluded ids met) log n), not
        O(n): a transport may call it after every message."""
        if chunk_elements is not None and chunk_elements < 1:
            raise ValueError("chunk_elements must be a positive number of elements")
        if self._stage is not Stage.MASKED_INPUT or self.result is not None \
                or self.aborted is not None:
            return []
        return self._uploads.grant(self._pending, client_ids, exclude, chunk_elements)

    def cancel_upload(self, client_id: int, reason: str) -> bool:
        """Take back ``client_id``'s upload slot (e.g. it sent nothing for too long): its
        pending chunks are discarded, it is dropped from this round at masked_input with
        ``reason`` (in ``rejected``), and the slot is free for ``grant_uploads``. Returns
        False when it held no slot."""
        if not self._uploads.cancel(client_id):
            return False
        self._expected.discard(client_id)
        self._pending.discard(client_id)
        self.dropped.setdefault(client_id, Stage.MASKED_INPUT)
        self.rejected.append((client_id, reason))
        return True

    def _take_proof(self, cid: int, msg: InputProof, raw: bytes) -> bool:
        """Stage masked_input, before the masked input: verify the client's input proof
        (docs/protocol.md 10.3). A failed proof refuses the client: named in ``refused``,
        dropped at masked_input, its masked input never counts."""
        from .validation import InvalidProof, NormStatement, verify

        cfg = self.config
        if cfg.norm_bound is None:
            raise self._reject(cid, "an input proof in a round without norm_bound")
        digest = sha256(raw)
        if self._proof_digests.get(cid) == digest:
            return False  # redelivery
        if self.result is not None:
            raise self._reject(cid, "the round has finished")
        if self._stage is not Stage.MASKED_INPUT:
            raise self._reject(cid, "a masked_input message is out of stage")
        if cid not in self._expected:
            raise self._reject(cid, "the client is not part of this stage (it dropped, was "
                                    "refused or was not sent the previous message)")
        if cid in self._proof_digests:
            raise self._reject(cid, "a second, different input proof")
        upload = self._uploads.get(cid)
        if cid in self._inbox or (upload is not None and upload.next):
            raise self._reject(cid, "the input proof must come before the masked input")
        self._check_signature(cid, msg)  # a forged proof must not get the client named
        statement = NormStatement(self.session_id, cid, cfg.dim, cfg.bits, cfg.norm_bound,
                                  self._advert_digests[cid], cfg.weight_index)
        try:
            self._commitments[cid] = verify(statement, msg.proof)
        except InvalidProof as exc:
            what = (f"norm_bound={cfg.norm_bound}" if cfg.weight_index is None else
                    f"norm_bound={cfg.norm_bound}, weight_index={cfg.weight_index}")
            reason = f"input proof refused ({what}): {exc}"
            self.refused[cid] = reason
            self._expected.discard(cid)
            self._pending.discard(cid)
            self._uploads.cancel(cid)
            self.dropped.setdefault(cid, Stage.MASKED_INPUT)
            self.rejected.append((cid, reason))
            raise InputRefused(f"client {cid} refused in masked_input: {reason}",
                               stage=self._stage, client_id=cid) from None
        self._proof_digests[cid] = digest
        return True

    def _take_masked(self, cid: int, msg: MaskedInput | MaskedChunk, raw: bytes,
                     digest: bytes | None) -> bool:
        """One chunk of a masked input, to its upload (:meth:`Uploads.take` checks it and
        adds the input to the sum when it is complete); the completed input goes into the
        inbox. ``digest``: sha256(raw), if known."""
        cfg = self.config
        if cfg.norm_bound is not None and cid not in self._commitments:
            raise self._reject(cid, f"no verified input proof before the masked input "
                                    f"(the round has norm_bound={cfg.norm_bound}: "
                                    f"docs/protocol.md 10)")

        def verify(stream: bytes, signature: bytes) -> None:
            verify_signature(self._verify_keys.get(cid, b""), signature,
                             transcript(SIGNED_TAGS[MaskedInput], self.session_id,
                                        Stage.MASKED_INPUT, cid, stream, self._key_sets[cid]))

        try:
            new, done = self._uploads.take(cid, msg, raw,
                                           peers=peers_digest(self._forwarded[cid]),
                                           verify=verify if cfg.malicious else None)
        except ValueError as exc:
            raise self._reject(cid, str(exc)) from None
        if done is not None:
            last, last_raw = done
            # kept without its vector (in the sum now), so n whole inputs never stay behind
            self._inbox[cid] = replace(last, masked=b"")
            self._pending.discard(cid)
            known = digest if last_raw is raw else None
            self._accepted_digest[cid] = known or sha256(last_raw)
        return new

    def _check_signature(self, cid: int, msg: ShareKeys | UnmaskingShares | InputProof
                         ) -> None:
        if self.config.malicious:
            try:
                verify_signature(self._verify_keys.get(cid, b""), msg.signature,
                                 client_message_transcript(msg, self._key_sets[cid],
                                                           payload_digest(msg)))
            except CryptoError as exc:
                raise self._reject(cid, f"the {msg.stage.label} signature is invalid (another "
                                        f"round's, or altered): {exc}") from None
        elif msg.signature:
            raise self._reject(cid, "a signature in a semi-honest round")

    # --- advancing ------------------------------------------------------------------------

    def _abort(self, reason: str) -> ProtocolAbort:
        error = ProtocolAbort(f"server aborted the round in {self._stage.label}: {reason}",
                              stage=self._stage)
        self.aborted = error  # sticky: nothing is received or sent after an abort
        return error

    def _close(self) -> set[int]:
        responders = set(self._inbox)
        for cid, upload in self._uploads.close():
            self.rejected.append((cid, f"its masked input stopped at element {upload.next} "
                                       f"of {self.config.dim}; an incomplete input never "
                                       f"counts (docs/protocol.md 6.3)"))
        for cid in self._expected - responders:
            self.dropped.setdefault(cid, self._stage)
        return responders

    def _open(self, stage: Stage, recipients: Iterable[int]) -> None:
        self._previous_digest = self._accepted_digest
        self._accepted_digest = {}
        self._inbox = {}
        self._stage = stage
        self._expected = set(recipients)
        self._pending = set(self._expected)
        self._uploads.new_stage()

    def advance(self) -> dict[int, ServerMessage]:
        """Close the current stage; return the next messages by recipient."""
        if self.result is not None:
            raise ProtocolError("the round has finished")
        if self.aborted is not None:
            raise ProtocolAbort(f"the round was aborted: {self.aborted}", stage=self._stage)
        t = self._threshold
        responders = self._close()
        if len(responders) < t:
            raise self._abort(f"only {len(responders)} clients responded; the threshold "
                              f"is {t}")
        out = SERVER_HANDLERS[self._stage](self, responders)
        if self.result is None and len(out) < t:
            raise self._abort(f"only {len(out)} clients can continue; the threshold is {t}")
        return out

    def _skip(self, cid: int, stage: Stage) -> None:
        self.dropped.setdefault(cid, stage)

    def _after_advertise(self, u1: set[int]) -> dict[int, ServerMessage]:
        t = self._threshold
        self._adverts = {cid: msg for cid, msg in self._inbox.items()
                         if isinstance(msg, AdvertiseKeys)}
        entries = {cid: _entry(advert) for cid, advert in self._adverts.items()}
        out: dict[int, ServerMessage] = {}
        digests: dict[frozenset[int], bytes] = {}  # one key list for all: complete graph
        for cid in sorted(u1):
            holders = frozenset(self.graph.closed_neighborhood(cid) & u1)
            if len(holders) < t:
                self._skip(cid, Stage.SHARE_KEYS)  # it would abort: too few holders
                continue
            self._key_lists[cid] = holders
            keys = {h: entries[h] for h in holders}
            if holders not in digests:
                digests[holders] = key_set_digest(self.session_id, keys)
            self._key_sets[cid] = digests[holders]
            out[cid] = KeyList(self.session_id, cid, keys)
        self._open(Stage.SHARE_KEYS, out)
        return out

    def _after_share_keys(self, u2: set[int]) -> dict[int, ServerMessage]:
        t = self._threshold
        self._share_keys = {cid: msg for cid, msg in self._inbox.items()
                            if isinstance(msg, ShareKeys)}
        inbound: dict[int, dict[int, bytes]] = {cid: {} for cid in u2}
        for sender, msg in self._share_keys.items():
            for recipient, ciphertext in msg.ciphertexts.items():
                if recipient in inbound:
                    inbound[recipient][sender] = ciphertext
        out: dict[int, ServerMessage] = {}
        for cid in sorted(u2):
            if len(inbound[cid]) + 1 < t:
                self._skip(cid, Stage.MASKED_INPUT)
                continue
            self._forwarded[cid] = frozenset(inbound[cid])
            out[cid] = Ciphertexts(self.session_id, cid, inbound[cid])
        self._open(Stage.MASKED_INPUT, out)
        return out

    def _unmask_sets(self, cid: int) -> tuple[frozenset[int], frozenset[int]]:
        peers = self._forwarded[cid] | {cid}
        return frozenset(peers & self._survivors), frozenset(peers - self._survivors)

    def _after_masked_input(self, u3: set[int]) -> dict[int, ServerMessage]:
        self._survivors = frozenset(u3)
        everyone = tuple(sorted(u3))  # the whole U3: clients check the survivor graph
        out: dict[int, ServerMessage] = {}
        if self.config.malicious:
            ordered = tuple(sorted(u3))
            out = {cid: SurvivorList(self.session_id, cid, ordered) for cid in ordered}
            self._open(Stage.CONSISTENCY_CHECK, out)
            return out
        for cid in sorted(u3):
            survivors, dropped = self._unmask_sets(cid)
            if len(survivors) < self._threshold:
                self._skip(cid, Stage.UNMASKING)
                continue
            self._requests[cid] = (survivors, dropped)
            out[cid] = UnmaskRequest(self.session_id, cid, everyone, tuple(sorted(dropped)))
        self._open(Stage.UNMASKING, out)
        return out

    def _after_consistency(self, u4: set[int]) -> dict[int, ServerMessage]:
        t = self._threshold
        everyone = tuple(sorted(self._survivors))
        signatures = {cid: msg.signature for cid, msg in self._inbox.items()
                      if isinstance(msg, ConsistencySignature)}
        out: dict[int, ServerMessage] = {}
        for cid in sorted(u4):
            survivors, dropped = self._unmask_sets(cid)
            mine = {s: signatures[s] for s in survivors if s in signatures}
            if len(survivors) < t or len(mine) < t:
                self._skip(cid, Stage.UNMASKING)
                continue
            self._requests[cid] = (survivors, dropped)
            out[cid] = UnmaskRequest(self.session_id, cid, everyone, tuple(sorted(dropped)),
                                     mine)
        self._open(Stage.UNMASKING, out)
        return out

    # --- unmasking ------------------------------------------------------------------------

    def _after_unmasking(self, u5: set[int]) -> dict[int, ServerMessage]:
        survivors = self._survivors
        replies = [(cid, msg) for cid, msg in self._inbox.items()
                   if isinstance(msg, UnmaskingShares)]
        recovered = recover(replies, survivors, self._forwarded, self._adverts,
                            self.session_id, self._threshold, self._abort)
        total = self._uploads.sum  # the round is over: unmask in place, no d-sized copy
        if self._uploads.empty:  # no input at all (cannot pass the threshold checks)
            total.fill(0)
        keys = unmask(total, recovered, survivors, self._forwarded, self._adverts,
                      self.session_id, self.config, self._executor, self._workers)
        if self.config.norm_bound is not None:
            self._check_commitments(total, survivors, keys)
        self.result = AggregateResult(
            total=total, included=frozenset(survivors), dropped=dict(self.dropped),
            corrupt_shares={h: frozenset(o) for h, o in recovered.corrupt.items()},
            unattributable=frozenset(recovered.unattributable), refused=dict(self.refused))
        self._open(Stage.UNMASKING, ())
        return {}

    def _check_commitments(self, total: np.ndarray, survivors: frozenset[int],
                           keys: list[MaskKeys]) -> None:
        """docs/protocol.md 10.4: the survivors' commitments must open to the unmasked sum
        with the blinding the removed masks (their ``keys``) carried; otherwise someone
        masked another vector than it proved, and nothing is released."""
        from .validation import blinding, check_sum

        if not check_sum([self._commitments[u] for u in sorted(survivors)], total,
                         self.config.bits, blinding(k for batch in keys for k in batch)):
            error = InputMismatch(
                "server aborted the round in unmasking: the included clients' input "
                "commitments do not open to the unmasked sum, so at least one of "
                f"{sorted(survivors)} masked another vector than the one it proved; the "
                "sum is not released (docs/protocol.md 10.4)", stage=self._stage)
            self.aborted = error
            raise error


def _entry(msg: AdvertiseKeys) -> KeyEntry:
    return KeyEntry(msg.encryption_key, msg.masking_key, msg.self_mask_commitment,
                    msg.signature)


# Which handler closes each collecting stage (docs/protocol.md table 3.3b).
SERVER_HANDLERS: Mapping[Stage, Callable[[Server, set[int]], dict[int, ServerMessage]]] = {
    Stage.ADVERTISE_KEYS: Server._after_advertise,
    Stage.SHARE_KEYS: Server._after_share_keys,
    Stage.MASKED_INPUT: Server._after_masked_input,
    Stage.CONSISTENCY_CHECK: Server._after_consistency,
    Stage.UNMASKING: Server._after_unmasking,
}
