"""Carry a client's round across process restarts: ``Client.snapshot`` / ``Client.restore``.

A driver that rebuilds the client for every server message (e.g. a Flower ``ClientApp``,
which keeps state between messages as bytes in the node's context) saves
``client.snapshot(key)`` after each reply and rebuilds with ``Client.restore(data, ...)``
before handling the next message. A client restored from the latest snapshot gives the
replies the original would have given from that state (``tests/secagg/test_resume.py``).

**The host's duty (rollback).** The client's guard that it reveals one share per peer
(``revealed``) lives in the snapshot. A client restored from an *older* snapshot has
forgotten what it revealed since: a server that then sends it a different unmasking
request obtains the other share of a peer, i.e. that peer's input. So the host must

1. persist the snapshot taken after handling a message *before* the reply leaves, keep
   only the latest one, and never restore an older one;
2. record the stage this client reached in the session (``client.session_id``,
   ``client.stage``) where a failed or concurrent snapshot write cannot roll it back, and
   restore with ``min_stage=`` that stage: ``restore`` then refuses (``StaleSnapshot``)
   any snapshot from before it (``tests/security/test_protocol_replay.py::
   test_rollback_to_an_earlier_snapshot_is_refused_with_the_hosts_stage_record``);
3. handle one message per client at a time.

A host that breaks these rules gives up "one share per peer"
(``test_rollback_without_the_hosts_stage_record_reveals_both_shares``, a documented
limitation).

The snapshot holds the round's **secrets** (both X25519 private keys, the self-mask seed,
the input once given and until masked, the shares received): it is node-local and must never be sent
to the server or anyone else. It is authenticated with HMAC-SHA256 under ``key``: with the
default empty key the MAC detects corruption and truncation only; with a key the node
keeps outside the stored state it also detects tampering. ``restore`` refuses
(``StaleSnapshot``) bytes that fail the MAC, do not parse exactly, belong to another
session (config, roster, context) or another client id, whose keys and commitment do not
match the secrets they carry, or that are before ``min_stage``. A snapshot of an earlier
round with the same context has the same session id: give each round its own context (or
record the stage per session as above) so that it is refused at ``restore``.

Layout: magic ``"SAS2"``, the body's length (4 bytes, big-endian), the body (a msgpack
array), the input's bytes (only while the client has it and still has to mask it:
advertised or shared, after ``Client(..., input_vector)`` or ``provide_input``), then a
32-byte MAC over the body. The body holds the session id, client id, state code (0
advertised, 1 shared, 2 masked, 3 checked, 4 finished, 5 aborted), the advertisement's wire
bytes, the three 32-byte secrets, the SHA-256 of the input (which binds the input bytes to
the MAC; empty while no input was given), the key list's wire bytes, u's own two shares, F(u), the
received shares, the signed survivor list, ``revealed``, the reply cache, the abort reason
and stage, the server's round nonce.

**What a snapshot costs (a node's CPU per message).** A client built without its input
(``Client(config, client_id)``, given it by ``provide_input`` at the masked-input request,
as the Flower node does) is a few KB at every stage whatever ``dim``
(``tests/secagg/test_client_late_input.py``): the host never carries the input between
messages. Otherwise the MAC covers the body only (a few KB): the input is hashed once when
first saved, and checked against its digest only by the restore that precedes masking
(state shared), the one that uses it; a restore before that carries the bytes on unread (a
corrupted input still never reaches a mask). Once the client has masked, the snapshot keeps
neither the input nor the masked vector (at d = 10^7 and 32 bits that is 80 MB less in the
host's state after every message): the reply cache keeps the masked-input request's digest
only, and the same request again is refused with a ``ProtocolError`` (a re-sent masked
input cannot be re-derived without the input, and masking a second input under the same
masks would reveal the difference; the server has the first answer, or counts the client as
dropped at masked_input).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import weakref
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import msgpack  # type: ignore[import-untyped]
import numpy as np

from .client_state import PAIR, Aborted, Advertised, Checked, Finished, Masked, Secrets, Shared
from .config import Config
from .crypto import KeyPair, SigningKey, dtype_for_bits, load_public_key, self_mask_commitment
from .errors import ProtocolAbort, ProtocolError, StaleSnapshot
from .messages import AdvertiseKeys, KeyList, decode, decode_server_message, encode
from .shamir import SHARE_BYTES
from .stage import Stage
from .transcripts import advertisement_digest, key_set_digest

if TYPE_CHECKING:
    from .client import Client

MAGIC = b"SAS2"
_LENGTH = struct.Struct(">I")
_MAC_BYTES = 32
_STATES = ("advertised", "shared", "masked", "checked", "finished", "aborted")
_REVEALED = ("self_mask", "masking_key")
_STAGE_OF_STATE = (Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT,
                   Stage.CONSISTENCY_CHECK, Stage.UNMASKING, Stage.UNMASKING)


def _mac(key: bytes, body: bytes) -> bytes:
    mac = hmac.new(bytes(key), b"secagg/v2|snapshot|", "sha256")
    mac.update(body)
    return mac.digest()


_INPUT_DIGESTS: weakref.WeakKeyDictionary[Client, bytes] = weakref.WeakKeyDictionary()
"""SHA-256 of a client's input, once known (computed at its first snapshot, or read from
the authenticated body it was restored from): the input does not change until it is
masked, so later snapshots do not hash it again."""


def _input_digest(client: Client) -> bytes:
    """The input's SHA-256, or empty while the client has none yet (``provide_input``)."""
    vector = client._secrets.input
    if vector is None:
        return b""
    digest = _INPUT_DIGESTS.get(client)
    if digest is None:
        digest = hashlib.sha256(vector.data).digest()
        _INPUT_DIGESTS[client] = digest
    return digest


def snapshot(client: Client, key: bytes = b"") -> bytes:

    state = client._state
    code = {Shared: 1, Masked: 2, Checked: 3, Finished: 4, Aborted: 5}.get(
        type(state), 0)
    shared = state if isinstance(state, Shared) else None
    masked = state.masked if isinstance(state, Checked) else (
        state if isinstance(state, Masked) else None)
    if masked is not None:
        shared = masked.shared
    live = code < 4
    secrets = client._secrets
    # the input is kept while it is still to be masked (advertised or shared) and given
    unmasked = code < 2 and secrets.input is not None
    keylist = b""
    own = b""
    if shared is not None:
        keylist = encode(KeyList(client.session_id, client.client_id, shared.keys))
        own = bytes(shared.own_shares)
    body = msgpack.packb([
        MAGIC, client.session_id, client.client_id, code, encode(client._advertisement),
        bytes(secrets.encryption) if live else b"", bytes(secrets.masking) if live else b"",
        bytes(secrets.seed) if live else b"", _input_digest(client) if unmasked else b"",
        keylist, own,
        sorted(masked.peers) if masked is not None else [],
        bytes(masked.received) if masked is not None else b"",
        list(state.survivors) if isinstance(state, Checked) else [],
        [[p, _REVEALED.index(kind)] for p, kind in sorted(client.revealed.items())],
        client._snapshot_replies(),
        str(state.error) if isinstance(state, Aborted) else "",
        int(state.stage) if isinstance(state, Aborted) else 0,
        client.nonce,
    ], use_bin_type=True)
    vector = secrets.input.data.cast("B") if unmasked and secrets.input is not None else b""
    return b"".join((MAGIC, _LENGTH.pack(len(body)), body, vector, _mac(key, body)))


def _refuse(why: str) -> StaleSnapshot:
    return StaleSnapshot(f"snapshot refused: {why}")


def _ids(value: Any, what: str) -> list[int]:
    if type(value) is not list or any(type(v) is not int for v in value):
        raise _refuse(f"{what} is not a list of client ids")
    return list(value)


def _unseal(data: bytes | bytearray | memoryview, key: bytes) -> tuple[bytes, memoryview]:
    """The frame: the body and the input's bytes (unread), once the MAC over the body
    verifies under ``key``."""
    head = len(MAGIC) + _LENGTH.size
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) <= head + _MAC_BYTES:
        raise _refuse("not snapshot bytes (empty or truncated)")
    raw = memoryview(data).cast("B")
    if bytes(raw[:len(MAGIC)]) != MAGIC:
        raise _refuse("not a secagg client snapshot")
    (length,) = _LENGTH.unpack(raw[len(MAGIC):head])
    if length > len(raw) - head - _MAC_BYTES:
        raise _refuse("not snapshot bytes (empty or truncated)")
    body = bytes(raw[head:head + length])
    vector = raw[head + length:len(raw) - _MAC_BYTES]  # unread until it is checked
    tag = bytes(raw[len(raw) - _MAC_BYTES:])
    if not hmac.compare_digest(_mac(key, body), tag):
        raise _refuse("the MAC does not verify: corrupted, truncated or saved under another "
                      "key")
    return body, vector


def _fields(body: bytes) -> list[Any]:
    """The body's 19 fields (msgpack, bounded by the body's length)."""
    try:
        fields = msgpack.unpackb(body, raw=False, use_list=True, strict_map_key=False,
                                 max_bin_len=len(body), max_str_len=len(body),
                                 max_array_len=len(body), max_map_len=0, max_ext_len=0)
    except Exception as exc:  # msgpack raises several types on garbage
        raise _refuse(f"not a snapshot ({type(exc).__name__})") from None
    if type(fields) is not list or len(fields) != 19 or fields[0] != MAGIC:
        raise _refuse("not a secagg client snapshot")
    return fields


def _stage_reached(code: Any, abort_stage: Any, min_stage: Stage | None) -> None:
    """Refuse an unknown state, and one before ``min_stage`` (a rollback)."""
    if type(code) is not int or not 0 <= code < len(_STATES):
        raise _refuse("unknown state")
    reached = (Stage(abort_stage) if code == 5 and type(abort_stage) is int
               and abort_stage in set(Stage) else _STAGE_OF_STATE[code])
    if min_stage is not None and reached < min_stage:
        raise _refuse(f"it is at {reached.label}, before {min_stage.label}, which this client "
                      "already reached in this session: restoring it would roll the round "
                      "back (a second unmasking answer could reveal both shares of a peer)")


def _advertisement(advert_raw: Any, client_id: int, sid: bytes) -> AdvertiseKeys:
    try:
        advert = decode(advert_raw)
    except ProtocolError as exc:
        raise _refuse(f"the advertisement does not decode: {exc}") from None
    if not isinstance(advert, AdvertiseKeys) or advert.client_id != client_id \
            or advert.session_id != sid:
        raise _refuse("the advertisement is not this client's")
    return advert


def _secrets(data: bytes | bytearray | memoryview, vector: memoryview, config: Config,
             code: int, fields: tuple[Any, Any, Any, Any], advert: AdvertiseKeys,
             sid: bytes, client_id: int) -> Secrets:
    """The three secrets and the input (``fields``: encryption key, masking key, seed and
    the input's digest), checked against the advertisement and the digest; zeros once the
    round is over for this client (finished or aborted)."""
    enc, mask, seed, input_digest = fields
    live = code < 4
    # before masking the input is there once given (its digest in the body), absent before
    unmasked = code < 2 and input_digest != b""
    dtype = dtype_for_bits(config.bits)
    if len(vector) != (config.dim * dtype.itemsize if unmasked else 0):
        raise _refuse("the input has the wrong length for this config and state")
    if unmasked and (type(input_digest) is not bytes or len(input_digest) != 32):
        raise _refuse("the input's digest is malformed")
    if not unmasked and input_digest != b"":
        raise _refuse("a digest of an input this state does not keep")
    if code == 1 and unmasked and not hmac.compare_digest(hashlib.sha256(vector).digest(),
                                                          input_digest):
        # the restore before masking, the one that uses the input, checks it
        raise _refuse("the input does not match its digest: corrupted or tampered with")
    if not live:
        return Secrets(bytearray(32), bytearray(32), bytearray(32), None)
    if any(type(b) is not bytes or len(b) != 32 for b in (enc, mask, seed)):
        raise _refuse("the secrets are malformed")
    # the input of immutable snapshot bytes is read in place (the host's bytes: there is
    # nothing of the client's own to wipe), of a mutable buffer copied; not given yet, or
    # masked or later, it is None (the masked input is not re-derived,
    # secagg.masked_stream.SentMaskedInput)
    shared_input = unmasked and isinstance(data, bytes)
    secrets = Secrets(bytearray(enc), bytearray(mask), bytearray(seed),
                      np.frombuffer(vector if shared_input else bytearray(vector),
                                    dtype=dtype) if unmasked else None)
    if (KeyPair(secrets.key(secrets.encryption)).public != advert.encryption_key
            or KeyPair(secrets.key(secrets.masking)).public != advert.masking_key
            or self_mask_commitment(seed, sid, client_id) != advert.self_mask_commitment):
        raise _refuse("the secrets do not match the advertisement")
    return secrets


def _revealed(revealed: Any) -> dict[int, str]:
    """``Client.revealed``: which share of each peer the client has given away."""
    if type(revealed) is not list:
        raise _refuse("revealed is malformed")
    out = {}
    for item in revealed:
        if type(item) is not list or len(item) != 2 or item[1] not in (0, 1):
            raise _refuse("revealed is malformed")
        out[int(item[0])] = _REVEALED[item[1]]
    return out


def _replies(client: Client, answered: Any) -> None:
    """The reply cache (request digest -> the reply given), into ``client._answered``."""
    client._answered = {}
    if type(answered) is not list:
        raise _refuse("the reply cache is malformed")
    for item in answered:
        if type(item) is not list or len(item) != 2 or type(item[0]) is not bytes \
                or type(item[1]) is not bytes:
            raise _refuse("the reply cache is malformed")
        if not item[1]:  # the masked input: its request's digest only
            client._answered[item[0]] = client._sent_masked_input()
            continue
        try:
            reply = decode(item[1])
        except ProtocolError as exc:
            raise _refuse(f"a cached reply does not decode: {exc}") from None
        client._answered[item[0]] = reply  # type: ignore[assignment]


def _shared(client: Client, keylist: Any, own: Any, secrets: Secrets, sid: bytes) -> Shared:
    """State shared: the key list, u's own shares and the pairwise secrets with the peers
    of the key list (derived again from u's encryption key)."""
    try:
        key_list = decode_server_message(keylist, len(client.roster))
    except ProtocolError as exc:
        raise _refuse(f"the key list does not decode: {exc}") from None
    if not isinstance(key_list, KeyList) or own is None or type(own) is not bytes \
            or len(own) != 2 * SHARE_BYTES:
        raise _refuse("the key list or own shares are malformed")
    keys = dict(key_list.keys)
    peers_of_key_list = [p for p in sorted(keys) if p != client.client_id]
    encryption = KeyPair(secrets.key(secrets.encryption))
    pair_secrets = bytearray(32 * len(peers_of_key_list))
    loaded = {}
    for entry in keys.values():
        for public in (entry.encryption_key, entry.masking_key):
            loaded[public] = load_public_key(public)
    for i, peer in enumerate(peers_of_key_list):
        pair_secrets[32 * i:32 * i + 32] = encryption.exchange(loaded[keys[peer].encryption_key])
    own_shares = bytearray(own)
    client._wipeable += [pair_secrets, own_shares]
    return Shared(keys, key_set_digest(sid, keys),
                  {c: advertisement_digest(sid, c, e) for c, e in keys.items()}, loaded,
                  own_shares, pair_secrets,
                  {p: 32 * i for i, p in enumerate(peers_of_key_list)})


def _masked(client: Client, shared: Shared, peers: Any, received: Any) -> Masked:
    """State masked: F(u) and the shares u received from them."""
    order = sorted(_ids(peers, "F(u)"))
    if not set(order) <= set(shared.keys) - {client.client_id} or type(received) is not bytes \
            or len(received) != PAIR * len(order):
        raise _refuse("the received shares are malformed")
    shares = bytearray(received)
    client._wipeable.append(shares)
    return Masked(shared, frozenset(order), shares, {p: PAIR * i for i, p in enumerate(order)})


def restore(cls: type[Client], data: bytes | bytearray | memoryview, *, config: Config,
            client_id: int, context: bytes, roster: Iterable[int] | None,
            signing_key: SigningKey | None,
            verify_keys: Mapping[int, bytes] | None, key: bytes,
            min_stage: Stage | None = None) -> Client:
    """``Client.restore``: the client a snapshot holds, rebuilt step by step (the frame and
    its MAC, the fields, the session and the stage, the advertisement, the secrets, the
    guards, then the state), each step refusing (``StaleSnapshot``) what it cannot take."""
    body, vector = _unseal(data, key)
    (_, sid, cid, code, advert_raw, enc, mask, seed, input_digest, keylist, own, peers,
     received, survivors, revealed, answered, reason, abort_stage, nonce) = _fields(body)
    if type(nonce) is not bytes or len(nonce) not in (0, 32):
        raise _refuse("the round nonce is malformed")
    client = cls.__new__(cls)
    client._setup(config, client_id, roster, context, signing_key, verify_keys, nonce)
    if sid != client.session_id:
        raise _refuse("it belongs to another session (config, roster or context differ)")
    if cid != client_id:
        raise _refuse(f"it belongs to client {cid!r}, not {client_id}")
    _stage_reached(code, abort_stage, min_stage)
    advert = _advertisement(advert_raw, client_id, sid)
    secrets = _secrets(data, vector, config, code, (enc, mask, seed, input_digest), advert,
                       sid, client_id)
    client._secrets = secrets
    client._wipeable = [secrets.encryption, secrets.masking, secrets.seed]
    if secrets.input is not None and secrets.input.flags.writeable:
        client._wipeable.append(secrets.input)
    client._advertisement = advert
    client.revealed = _revealed(revealed)
    _replies(client, answered)
    if secrets.input is not None:
        _INPUT_DIGESTS[client] = input_digest
    if code == 0:
        client._state = Advertised()
    elif code == 5:
        if type(abort_stage) is not int or abort_stage not in set(Stage):
            raise _refuse("the abort stage is malformed")
        stage = Stage(abort_stage)
        client._state = Aborted(ProtocolAbort(str(reason), stage=stage, client_id=client_id),
                                stage)
    elif code == 4:
        client._state = Finished()
    else:
        shared = _shared(client, keylist, own, secrets, sid)
        if code == 1:
            client._state = shared
        else:
            masked = _masked(client, shared, peers, received)
            client._state = masked if code == 2 else Checked(
                masked, tuple(sorted(_ids(survivors, "survivors"))))
    return client
