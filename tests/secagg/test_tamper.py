"""Every field of every message, tampered, in a real round (docs/architecture.md sections 3 and 8).

A tampered message must end in exactly one of:

* the client raises ``ProtocolAbort``: it is aborted, answers nothing more and never
  reveals a share afterwards; the round finishes without it (or aborts cleanly);
* the recipient raises a ``ProtocolError`` that is not an abort (undecodable or
  misaddressed bytes): its state is unchanged and the honest message still works;
* the server raises ``ProtocolError``: its state is unchanged and the round still completes
  with the exact sum once the honest message is delivered.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from harness import (
    SMALL_ORDER_POINTS,
    Round,
    client_state,
    flip,
    flip_last,
    pack,
    pack_with_pairs,
    replace,
    server_state,
    unpack,
)

from secagg import Config, ProtocolAbort, ProtocolError, SigningKey, Stage, encode
from secagg import decode as _decode
from secagg.crypto import (
    Masker,
    pairwise_mask_key,
    self_mask_key,
)
from secagg.messages import (
    AdvertiseKeys,
    Ciphertexts,
    ConsistencySignature,
    KeyEntry,
    KeyList,
    MaskedInput,
    ShareKeys,
    SurvivorList,
    UnmaskingShares,
    UnmaskRequest,
)
from secagg.shamir import PRIME, SHARE_BYTES
from secagg.transcripts import survivors_transcript as _survivors_transcript
from secagg.transcripts import transcript

MODES = ["semi-honest", "malicious"]


def survivors_transcript(rnd: Round, session: bytes, signer: int, survivors: Any) -> bytes:
    """The survivor transcript ``signer`` signs in ``rnd`` (bound to its advertisement)."""
    return _survivors_transcript(session, signer, survivors,
                                 rnd.server._advert_digests[signer])


def decode(data: bytes) -> Any:
    """``secagg.decode``, typed loosely so tests can reach each kind's fields."""
    return _decode(data)


N = 7  # semi-honest t = 4, malicious t = 5: one or two aborts leave enough survivors
VICTIM = 2  # the client whose message is tampered with


def make_round(security: str = "semi-honest", *, n: int = N, dim: int = 5, bits: int = 16,
               context: bytes = b"tamper", **kw: Any) -> Round:
    return Round(Config(num_clients=n, dim=dim, bits=bits, security=security, **kw),
                 context=context)


# --- outcome checks -------------------------------------------------------------------------


def assert_server_rejects(rnd: Round, cid: int, bad: bytes | Any, *,
                          include: bool = True) -> None:
    """``bad`` from ``cid`` is rejected without abort or state change; the honest pending
    message is then accepted and the round completes with the exact sum."""
    before = server_state(rnd.server)
    with pytest.raises(ProtocolError) as info:
        rnd.server.receive(cid, bad)
    assert not isinstance(info.value, ProtocolAbort), info.value
    assert server_state(rnd.server) == before
    rnd.step()
    assert cid not in rnd.server_rejects
    result = rnd.assert_correct()
    if include:
        assert cid in result.included


def assert_client_refuses(rnd: Round, cid: int, bad: bytes | Any) -> None:
    """``bad`` is an undecodable or misaddressed message: ``ProtocolError`` (not an abort),
    nothing changes, and the honest message still works, to the end of the round."""
    client = rnd.clients[cid]
    before = client_state(client)
    with pytest.raises(ProtocolError) as info:
        client.handle(bad)
    assert not isinstance(info.value, ProtocolAbort), info.value
    assert client_state(client) == before
    assert client.aborted is None
    rnd.step()
    assert cid not in rnd.client_aborts and cid not in rnd.client_errors
    result = rnd.assert_correct()
    assert cid in result.included
    assert not rnd.client_aborts


def assert_never_reveals(rnd: Round, cid: int) -> None:
    """An aborted client answers no message with shares, not even a well-formed request."""
    client = rnd.clients[cid]
    assert client.aborted is not None
    assert client.revealed == {}
    request = UnmaskRequest(client.session_id, cid, tuple(rnd.roster), ())
    with pytest.raises(ProtocolError):
        client.handle(request)
    assert client.revealed == {}
    assert not any(kind is UnmaskingShares and sender == cid for kind, sender, _ in rnd.sent)


def assert_client_aborts(rnd: Round, cid: int, bad: bytes | Any, *,
                         round_completes: bool = True) -> None:
    """``bad`` makes ``cid`` abort; the aborted client refuses the honest message, never
    reveals a share, and the round finishes without its secrets (or aborts cleanly)."""
    client = rnd.clients[cid]
    honest = rnd.pending.get(cid)
    with pytest.raises(ProtocolAbort) as info:
        client.handle(bad)
    assert client.aborted is info.value
    stage = client.stage
    if honest is not None:
        with pytest.raises(ProtocolError) as again:
            client.handle(honest)
        assert client.stage is stage
        del again
    if round_completes:
        result = rnd.assert_correct()
        assert rnd.clients[cid].aborted is info.value
        if stage < Stage.MASKED_INPUT:
            assert cid not in result.included
    else:
        with pytest.raises(ProtocolAbort):
            rnd.finish()
    assert_never_reveals(rnd, cid)


def other_session_round(rnd: Round) -> Round:
    """A round of the same configuration and roster under another context."""
    return Round(rnd.config, context=rnd.context + b"/other", inputs=rnd.inputs)


# =============================================================================================
# client -> server: AdvertiseKeys
# =============================================================================================


def _advert_field(data: bytes, index: int, value: Any) -> bytes:
    obj = unpack(data)
    obj[index] = value
    return pack(obj)


UNDECODABLE_ADVERTS: dict[str, Callable[[bytes], bytes]] = {
    "truncated": lambda d: d[:-1],
    "not_msgpack": lambda d: b"\xc1" + d,
    "empty": lambda d: b"",
    "wrong_magic": lambda d: _advert_field(d, 0, b"SA2"),
    "unknown_kind": lambda d: _advert_field(d, 1, 99),
    "kind_of_other_message": lambda d: _advert_field(d, 1, 4),
    "extra_field": lambda d: pack([*unpack(d), b""]),
    "missing_field": lambda d: pack(unpack(d)[:-1]),
    "session_id_short": lambda d: _advert_field(d, 2, unpack(d)[2][:31]),
    "session_id_str": lambda d: _advert_field(d, 2, "x" * 32),
    "client_id_zero": lambda d: _advert_field(d, 3, 0),
    "client_id_negative": lambda d: _advert_field(d, 3, -VICTIM),
    "client_id_too_big": lambda d: _advert_field(d, 3, 1 << 32),
    "client_id_bool": lambda d: _advert_field(d, 3, True),
    "client_id_str": lambda d: _advert_field(d, 3, str(VICTIM)),
    "encryption_key_31_bytes": lambda d: _advert_field(d, 4, unpack(d)[4][:31]),
    "encryption_key_33_bytes": lambda d: _advert_field(d, 4, unpack(d)[4] + b"\x00"),
    "encryption_key_str": lambda d: _advert_field(d, 4, "k" * 32),
    "masking_key_list": lambda d: _advert_field(d, 5, list(unpack(d)[5])),
    "commitment_wrong_length": lambda d: _advert_field(d, 6, b"\x00" * 31),
    "signature_63_bytes": lambda d: _advert_field(d, 7, b"\x00" * 63),
    "signature_none": lambda d: _advert_field(d, 7, None),
}



def rejected_when_signed(rnd: Round, security: str, cid: int = VICTIM) -> bool:
    """In malicious mode every client message is signed: the server refuses an altered one
    without a state change (and the round then treats the client as silent)."""
    if security != "malicious":
        return False
    before = server_state(rnd.server)
    with pytest.raises(ProtocolError) as info:
        rnd.server.receive(cid, rnd.pending[cid])
    assert not isinstance(info.value, ProtocolAbort)
    assert server_state(rnd.server) == before
    return True

@pytest.mark.parametrize("security", MODES)
@pytest.mark.parametrize("how", sorted(UNDECODABLE_ADVERTS))
def test_undecodable_advertisement_rejected_without_state_change(security: str,
                                                                 how: str) -> None:
    rnd = make_round(security)
    bad = UNDECODABLE_ADVERTS[how](rnd.pending[VICTIM])
    assert_server_rejects(rnd, VICTIM, bad)


@pytest.mark.parametrize("security", MODES)
def test_advertisement_from_other_session_rejected(security: str) -> None:
    rnd = make_round(security)
    other = other_session_round(rnd)
    assert_server_rejects(rnd, VICTIM, other.pending[VICTIM])
    rnd2 = make_round(security)
    forged = replace(rnd2.decoded(VICTIM), session_id=other.server.session_id)
    assert_server_rejects(rnd2, VICTIM, encode(forged))


@pytest.mark.parametrize("security", MODES)
def test_advertisement_claiming_another_client_id_rejected(security: str) -> None:
    rnd = make_round(security)
    # client 3's own advertisement, delivered by the transport as coming from the victim
    assert_server_rejects(rnd, VICTIM, rnd.pending[3])
    rnd = make_round(security)
    relabelled = replace(rnd.decoded(VICTIM), client_id=3)
    assert_server_rejects(rnd, VICTIM, encode(relabelled))


def test_sender_outside_roster_rejected() -> None:
    rnd = make_round()
    before = server_state(rnd.server)
    with pytest.raises(ProtocolError) as info:
        rnd.server.receive(N + 1, rnd.pending[VICTIM])
    assert not isinstance(info.value, ProtocolAbort)
    assert server_state(rnd.server) == before
    rnd.assert_correct()


@pytest.mark.parametrize("security", MODES)
@pytest.mark.parametrize("which", ["encryption_key", "masking_key"])
@pytest.mark.parametrize("point", range(len(SMALL_ORDER_POINTS)))
def test_small_order_public_key_in_advertisement_rejected(security: str, which: str,
                                                          point: int) -> None:
    rnd = make_round(security)
    bad = replace(rnd.decoded(VICTIM), **{which: SMALL_ORDER_POINTS[point]})
    assert_server_rejects(rnd, VICTIM, encode(bad))


@pytest.mark.parametrize("security", MODES)
@pytest.mark.parametrize("theirs", ["encryption_key", "masking_key"])
@pytest.mark.parametrize("mine", ["encryption_key", "masking_key"])
def test_duplicated_public_key_of_another_client_rejected(security: str, theirs: str,
                                                          mine: str) -> None:
    """Google's fcp accepts a key that another client already advertised."""
    rnd = make_round(security)
    rnd.server.receive(1, rnd.pending[1])
    copied = getattr(rnd.decoded(1), theirs)
    bad = replace(rnd.decoded(VICTIM), **{mine: copied})
    assert_server_rejects(rnd, VICTIM, encode(bad))


@pytest.mark.parametrize("security", MODES)
def test_advertisement_reusing_one_key_for_both_purposes_rejected(security: str) -> None:
    rnd = make_round(security)
    advert = rnd.decoded(VICTIM)
    bad = replace(advert, masking_key=advert.encryption_key)
    assert_server_rejects(rnd, VICTIM, encode(bad))


def test_advertisement_signature_from_wrong_key_rejected() -> None:
    rnd = make_round("malicious")
    advert = rnd.decoded(VICTIM)
    entry = KeyEntry(advert.encryption_key, advert.masking_key, advert.self_mask_commitment)
    from secagg.client import advertisement_transcript

    message = advertisement_transcript(rnd.server.session_id, VICTIM, entry)
    for key in (rnd.signing[3], SigningKey.generate()):
        bad = replace(advert, signature=key.sign(message))
        before = server_state(rnd.server)
        with pytest.raises(ProtocolError) as info:
            rnd.server.receive(VICTIM, encode(bad))
        assert not isinstance(info.value, ProtocolAbort)
        assert server_state(rnd.server) == before
    assert_server_rejects(rnd, VICTIM, encode(replace(advert, signature=b"")))


@pytest.mark.parametrize("field", ["encryption_key", "masking_key", "self_mask_commitment",
                                   "signature"])
def test_signed_advertisement_altered_in_transit_rejected(field: str) -> None:
    rnd = make_round("malicious")
    advert = rnd.decoded(VICTIM)
    value = getattr(advert, field)
    if field.endswith("_key"):
        value = other_session_round(rnd).decoded(VICTIM).encryption_key  # a valid point
    else:
        value = flip_last(value)
    assert_server_rejects(rnd, VICTIM, encode(replace(advert, **{field: value})))


def test_advertisement_signature_replayed_from_another_session_rejected() -> None:
    rnd = make_round("malicious")
    other = Round(rnd.config, context=b"elsewhere", signing=rnd.signing)
    theirs = other.decoded(VICTIM)  # signed by the victim's real key, for another session
    forged = replace(theirs, session_id=rnd.server.session_id)
    assert_server_rejects(rnd, VICTIM, encode(forged))


@pytest.mark.parametrize("field", ["encryption_key", "self_mask_commitment"])
def test_unsigned_advertisement_altered_in_transit_makes_its_owner_abort(field: str) -> None:
    """Semi-honest: the server cannot tell, but the owner sees its key list entry changed."""
    rnd = make_round("semi-honest")
    advert = rnd.decoded(VICTIM)
    value = (other_session_round(rnd).decoded(VICTIM).encryption_key
             if field == "encryption_key" else flip_last(advert.self_mask_commitment))
    rnd.pending[VICTIM] = encode(replace(advert, **{field: value}))
    rnd.run_until(KeyList)
    assert_client_aborts(rnd, VICTIM, rnd.pending[VICTIM])


@pytest.mark.parametrize("security", MODES)
def test_advertisement_redelivered_is_accepted_once(security: str) -> None:
    rnd = make_round(security)
    rnd.server.receive(VICTIM, rnd.pending[VICTIM])
    before = server_state(rnd.server)
    rnd.server.receive(VICTIM, rnd.pending[VICTIM])  # QoS 1 duplicate: ignored
    assert server_state(rnd.server) == before
    rnd.assert_correct()


@pytest.mark.parametrize("security", MODES)
def test_second_different_advertisement_rejected(security: str) -> None:
    rnd = make_round(security)
    rnd.server.receive(VICTIM, rnd.pending[VICTIM])
    other = other_session_round(rnd).decoded(VICTIM)
    fresh = replace(rnd.decoded(VICTIM), encryption_key=other.encryption_key)
    before = server_state(rnd.server)
    with pytest.raises(ProtocolError) as info:
        rnd.server.receive(VICTIM, encode(fresh))
    assert not isinstance(info.value, ProtocolAbort)
    assert server_state(rnd.server) == before
    rnd.assert_correct()


@pytest.mark.parametrize("security", MODES)
def test_replayed_advertisement_in_later_stages_changes_nothing(security: str) -> None:
    rnd = make_round(security)
    advert = rnd.pending[VICTIM]
    rnd.run_until(ShareKeys)
    before = server_state(rnd.server)
    rnd.server.receive(VICTIM, advert)  # one stage late: a QoS 1 redelivery, ignored
    assert server_state(rnd.server) == before
    rnd.run_until(MaskedInput)
    assert_server_rejects(rnd, VICTIM, advert)  # two stages late: rejected


@pytest.mark.parametrize("security", MODES)
def test_server_message_sent_to_server_rejected(security: str) -> None:
    rnd = make_round(security)
    rnd.run_until(ShareKeys)
    key_list = next(data for kind, cid, data in rnd.sent if kind is KeyList and cid == VICTIM)
    assert_server_rejects(rnd, VICTIM, key_list)


# =============================================================================================
# client -> server: ShareKeys
# =============================================================================================


@pytest.mark.parametrize("security", MODES)
@pytest.mark.parametrize("how", ["ciphertext_short", "ciphertext_long", "ciphertext_str",
                                 "key_str", "key_zero", "map_as_list", "truncated"])
def test_undecodable_share_keys_rejected(security: str, how: str) -> None:
    rnd = make_round(security)
    data = rnd.run_until(ShareKeys)[VICTIM]
    obj = unpack(data)
    cts: dict[Any, Any] = obj[4]
    first = min(cts)
    if how == "ciphertext_short":
        cts[first] = cts[first][:-1]
    elif how == "ciphertext_long":
        cts[first] = cts[first] + b"\x00"
    elif how == "ciphertext_str":
        cts[first] = "x" * len(cts[first])
    elif how == "key_str":
        cts[str(first)] = cts.pop(first)
    elif how == "key_zero":
        cts[0] = cts.pop(first)
    elif how == "map_as_list":
        obj[4] = list(cts.values())
    bad = data[:-1] if how == "truncated" else pack(obj)
    assert_server_rejects(rnd, VICTIM, bad)


@pytest.mark.parametrize("security", MODES)
def test_share_keys_from_other_session_or_sender_rejected(security: str) -> None:
    rnd = make_round(security)
    msg = decode(rnd.run_until(ShareKeys)[VICTIM])
    other = other_session_round(rnd)
    assert_server_rejects(rnd, VICTIM, encode(replace(msg, session_id=other.server.session_id)))
    rnd = make_round(security)
    rnd.run_until(ShareKeys)
    assert_server_rejects(rnd, VICTIM, rnd.pending[3])  # client 3's message, "from" 2


@pytest.mark.parametrize("security", MODES)
@pytest.mark.parametrize("how", ["drop_entry", "add_self", "add_outsider", "empty"])
def test_share_keys_not_addressing_exactly_its_key_list_rejected(security: str,
                                                                 how: str) -> None:
    rnd = make_round(security)
    msg = decode(rnd.run_until(ShareKeys)[VICTIM])
    cts = dict(msg.ciphertexts)
    any_ct = next(iter(cts.values()))
    if how == "drop_entry":
        del cts[min(cts)]
    elif how == "add_self":
        cts[VICTIM] = any_ct
    elif how == "add_outsider":
        cts[N + 5] = any_ct
    else:
        cts = {}
    assert_server_rejects(rnd, VICTIM, encode(replace(msg, ciphertexts=cts)))


@pytest.mark.parametrize("security", MODES)
def test_share_keys_repeating_a_recipient_on_the_wire_rejected(security: str) -> None:
    rnd = make_round(security)
    obj = unpack(rnd.run_until(ShareKeys)[VICTIM])
    pairs = sorted(obj[4].items())
    pairs[0] = (pairs[1][0], pairs[0][1])  # two entries for one recipient, one missing
    assert_server_rejects(rnd, VICTIM, pack_with_pairs(obj[:4], pairs))


@pytest.mark.parametrize("security", MODES)
def test_share_ciphertext_bitflip_makes_recipient_abort(security: str) -> None:
    """The server cannot check a ciphertext; the AEAD tag makes the recipient abort."""
    rnd = make_round(security)
    msg = decode(rnd.run_until(ShareKeys)[VICTIM])
    cts = dict(msg.ciphertexts)
    cts[5] = flip(cts[5], 10)
    rnd.pending[VICTIM] = encode(replace(msg, ciphertexts=cts))
    if rejected_when_signed(rnd, security):
        return
    rnd.run_until(Ciphertexts)
    assert_client_aborts(rnd, 5, rnd.pending[5])


@pytest.mark.parametrize("security", MODES)
def test_share_ciphertexts_swapped_between_pairs_make_recipients_abort(security: str) -> None:
    rnd = make_round(security)
    msg = decode(rnd.run_until(ShareKeys)[VICTIM])
    cts = dict(msg.ciphertexts)
    cts[4], cts[5] = cts[5], cts[4]
    rnd.pending[VICTIM] = encode(replace(msg, ciphertexts=cts))
    if rejected_when_signed(rnd, security):
        return
    rnd.run_until(Ciphertexts)
    with pytest.raises(ProtocolAbort):
        rnd.clients[4].handle(rnd.pending[4])
    assert_client_aborts(rnd, 5, rnd.pending[5])
    assert_never_reveals(rnd, 4)


@pytest.mark.parametrize("security", MODES)
def test_share_ciphertext_replayed_from_another_session_aborts_recipient(security: str) -> None:
    rnd = make_round(security)
    other = other_session_round(rnd)
    theirs = decode(other.run_until(ShareKeys)[VICTIM])
    msg = decode(rnd.run_until(ShareKeys)[VICTIM])
    cts = dict(msg.ciphertexts)
    cts[5] = theirs.ciphertexts[5]
    rnd.pending[VICTIM] = encode(replace(msg, ciphertexts=cts))
    if rejected_when_signed(rnd, security):
        return
    rnd.run_until(Ciphertexts)
    assert_client_aborts(rnd, 5, rnd.pending[5])


# =============================================================================================
# client -> server: MaskedInput
# =============================================================================================


@pytest.mark.parametrize("security", MODES)
@pytest.mark.parametrize("how", ["bits", "dim", "dim_and_length", "bits_and_length",
                                 "length", "bits_out_of_range", "dim_zero", "masked_str"])
def test_masked_input_of_wrong_shape_rejected(security: str, how: str) -> None:
    rnd = make_round(security)
    data = rnd.run_until(MaskedInput)[VICTIM]
    obj = unpack(data)  # [magic, kind, session, id, bits, dim, masked]
    if how == "bits":
        obj[4] = 15  # same width, other modulus
    elif how == "dim":
        obj[5] += 1
    elif how == "dim_and_length":
        obj[5] += 1
        obj[6] += b"\x00\x00"
    elif how == "bits_and_length":
        obj[4] = 32
        obj[6] += obj[6]
    elif how == "length":
        obj[6] = obj[6][:-1]
    elif how == "bits_out_of_range":
        obj[4] = 65
    elif how == "dim_zero":
        obj[5], obj[6] = 0, b""
    else:
        obj[6] = obj[6].hex()
    assert_server_rejects(rnd, VICTIM, pack(obj))


def test_masked_input_with_values_beyond_the_modulus_rejected() -> None:
    rnd = make_round(bits=12)
    msg = decode(rnd.run_until(MaskedInput)[VICTIM])
    vec = np.frombuffer(msg.masked, dtype="<u2").copy()
    vec[0] |= 1 << 12
    assert_server_rejects(rnd, VICTIM, encode(replace(msg, masked=vec.tobytes())))


@pytest.mark.parametrize("security", MODES)
def test_masked_input_from_other_session_or_sender_rejected(security: str) -> None:
    rnd = make_round(security)
    msg = decode(rnd.run_until(MaskedInput)[VICTIM])
    assert_server_rejects(rnd, VICTIM, encode(replace(msg, session_id=bytes(32))))
    rnd = make_round(security)
    rnd.run_until(MaskedInput)
    assert_server_rejects(rnd, VICTIM, rnd.pending[3])


@pytest.mark.parametrize("security", MODES)
def test_masked_input_redelivery_is_added_once(security: str) -> None:
    rnd = make_round(security)
    rnd.run_until(MaskedInput)
    rnd.server.receive(VICTIM, rnd.pending[VICTIM])
    before = server_state(rnd.server)
    for _ in range(3):
        rnd.server.receive(VICTIM, rnd.pending[VICTIM])
    assert server_state(rnd.server) == before
    msg = decode(rnd.pending[VICTIM])
    other = replace(msg, masked=flip(msg.masked, 0))
    with pytest.raises(ProtocolError) as info:  # a second, different one in the same stage
        rnd.server.receive(VICTIM, encode(other))
    assert not isinstance(info.value, ProtocolAbort)
    assert server_state(rnd.server) == before
    rnd.assert_correct()


@pytest.mark.parametrize("security", MODES)
def test_masked_input_bitflip_only_shifts_that_clients_contribution(security: str) -> None:
    """Semi-honest: client messages carry no signature, so the server cannot detect an
    altered masked vector; the masks still cancel and the error is confined to that
    coordinate, exactly as if the client had sent another input (semi-honest mode trusts
    the transport for integrity). Malicious: the signature makes the server refuse it."""
    rnd = make_round(security)
    msg = decode(rnd.run_until(MaskedInput)[VICTIM])
    bad = replace(msg, masked=flip(msg.masked, 2, 0x10))  # element 1, bit 12
    rnd.pending[VICTIM] = encode(bad)
    if rejected_when_signed(rnd, security):
        return
    result = rnd.finish()
    expected = rnd.expected(result.included)
    delta = (int(bad.vector()[1]) - int(msg.vector()[1])) % rnd.config.modulus
    expected[1] = (expected[1] + delta) % rnd.config.modulus
    assert delta != 0
    assert result.total.tolist() == expected


def test_masks_bound_to_session_and_shape() -> None:
    """Pairwise and self masks depend on the session id and the (dim, bits) shape, so a
    masked vector is useless in another session or for another shape (as in fcp)."""
    pk_u, pk_v, secret = b"\x09" * 32, b"\x0a" * 32, b"\x42" * 32
    sessions = [b"\x01" * 32, b"\x02" * 32]
    shapes = [Config(num_clients=3, dim=d, bits=b).shape_tag
              for d, b in [(8, 32), (9, 32), (8, 31), (16, 16)]]
    keys = {(s, sh): pairwise_mask_key(secret, s, 1, 2, pk_u, pk_v, sh)
            for s in sessions for sh in shapes}
    assert len(set(keys.values())) == len(keys)
    # symmetric in the pair, bound to the ids and the public keys
    k = keys[(sessions[0], shapes[0])]
    assert pairwise_mask_key(secret, sessions[0], 2, 1, pk_v, pk_u, shapes[0]) == k
    assert pairwise_mask_key(secret, sessions[0], 1, 3, pk_u, pk_v, shapes[0]) != k
    assert pairwise_mask_key(secret, sessions[0], 1, 2, pk_v, pk_u, shapes[0]) != k
    selfs = {self_mask_key(secret, s, 1, sh) for s in sessions for sh in shapes}
    assert len(selfs) == len(sessions) * len(shapes)
    assert self_mask_key(secret, sessions[0], 2, shapes[0]) not in selfs
    # the 8-element mask is not a prefix of the 9-element one
    a = Masker(8, 32).keystream(keys[(sessions[0], shapes[0])]).copy()
    b = Masker(9, 32).keystream(keys[(sessions[0], shapes[1])])[:8].copy()
    assert not np.array_equal(a, b)
    # end to end: a masked input replayed into another session does not unmask there
    rnd = make_round(dim=6)
    other = other_session_round(rnd)
    theirs = decode(other.run_until(MaskedInput)[VICTIM])
    msg = decode(rnd.run_until(MaskedInput)[VICTIM])
    rnd.pending[VICTIM] = encode(replace(msg, masked=theirs.masked))
    result = rnd.finish()
    assert result.total.tolist() != rnd.expected(result.included)


# =============================================================================================
# client -> server: ConsistencySignature (malicious)
# =============================================================================================


def _at_consistency() -> tuple[Round, ConsistencySignature]:
    rnd = make_round("malicious")
    msg = decode(rnd.run_until(ConsistencySignature)[VICTIM])
    assert isinstance(msg, ConsistencySignature)
    return rnd, msg


def test_consistency_signature_bitflip_rejected() -> None:
    rnd, msg = _at_consistency()
    assert_server_rejects(rnd, VICTIM, encode(replace(msg, signature=flip(msg.signature, 5))))


@pytest.mark.parametrize("how", ["short", "empty", "str"])
def test_undecodable_consistency_signature_rejected(how: str) -> None:
    rnd, msg = _at_consistency()
    obj = unpack(encode(msg))
    obj[4] = {"short": obj[4][:63], "empty": b"", "str": "s" * 64}[how]
    assert_server_rejects(rnd, VICTIM, pack(obj))


def test_consistency_signature_from_wrong_key_rejected() -> None:
    rnd, msg = _at_consistency()
    survivors = sorted(rnd.server._survivors)
    forged = rnd.signing[3].sign(survivors_transcript(rnd, rnd.server.session_id, VICTIM,
                                                      survivors))
    assert_server_rejects(rnd, VICTIM, encode(replace(msg, signature=forged)))


def test_consistency_signature_of_another_signer_rejected() -> None:
    rnd, _ = _at_consistency()
    assert_server_rejects(rnd, VICTIM, encode(replace(decode(rnd.pending[3]),
                                                      client_id=VICTIM)))


def test_consistency_signature_over_another_survivor_list_rejected() -> None:
    rnd, msg = _at_consistency()
    survivors = sorted(rnd.server._survivors)[1:]
    forged = rnd.signing[VICTIM].sign(survivors_transcript(rnd, rnd.server.session_id, VICTIM,
                                                           survivors))
    assert_server_rejects(rnd, VICTIM, encode(replace(msg, signature=forged)))


def test_consistency_signature_replayed_from_another_session_or_stage_rejected() -> None:
    rnd, msg = _at_consistency()
    survivors = sorted(rnd.server._survivors)
    other_session = rnd.signing[VICTIM].sign(survivors_transcript(rnd, b"\x07" * 32, VICTIM,
                                                                  survivors))
    payload = b"".join(c.to_bytes(4, "big") for c in survivors)
    other_stage = rnd.signing[VICTIM].sign(transcript(
        b"survivors", rnd.server.session_id, Stage.ADVERTISE_KEYS, VICTIM,
        hashlib.sha256(payload).digest(), rnd.server._advert_digests[VICTIM]))
    for signature in (other_session, other_stage):
        before = server_state(rnd.server)
        with pytest.raises(ProtocolError) as info:
            rnd.server.receive(VICTIM, encode(replace(msg, signature=signature)))
        assert not isinstance(info.value, ProtocolAbort)
        assert server_state(rnd.server) == before
    advert = next(d for kind, cid, d in rnd.sent if kind is AdvertiseKeys and cid == VICTIM)
    assert_server_rejects(rnd, VICTIM, advert)  # a whole message from an earlier stage


# =============================================================================================
# client -> server: UnmaskingShares
# =============================================================================================

DROPPED = 7  # sends no masked input, so masking-key shares are requested


def _at_unmasking(security: str = "semi-honest") -> tuple[Round, UnmaskingShares]:
    rnd = make_round(security)
    rnd.run_until(MaskedInput)
    rnd.step(stop={DROPPED})
    msg = decode(rnd.run_until(UnmaskingShares)[VICTIM])
    assert isinstance(msg, UnmaskingShares)
    assert set(msg.masking_key_shares) == {DROPPED}
    return rnd, msg


@pytest.mark.parametrize("security", MODES)
@pytest.mark.parametrize("how", ["add_self_mask_share", "drop_self_mask_share",
                                 "drop_masking_key_share", "reveal_both_shares",
                                 "swap_kinds", "add_unknown_owner"])
def test_unmasking_shares_not_answering_exactly_the_request_rejected(security: str,
                                                                     how: str) -> None:
    rnd, msg = _at_unmasking(security)
    seeds, keys = dict(msg.self_mask_shares), dict(msg.masking_key_shares)
    share = next(iter(seeds.values()))
    if how == "add_self_mask_share":
        seeds[DROPPED] = share
    elif how == "drop_self_mask_share":
        del seeds[1]
    elif how == "drop_masking_key_share":
        keys = {}
    elif how == "reveal_both_shares":
        keys[1] = share
    elif how == "swap_kinds":
        seeds[DROPPED], keys[1] = keys.pop(DROPPED), seeds.pop(1)
    else:
        seeds[N + 3] = share
    bad = replace(msg, self_mask_shares=seeds, masking_key_shares=keys)
    assert_server_rejects(rnd, VICTIM, encode(bad))


@pytest.mark.parametrize("how", ["share_short", "share_long", "share_not_field_element",
                                 "key_str", "repeated_owner"])
def test_malformed_unmasking_share_rejected(how: str) -> None:
    rnd, msg = _at_unmasking()
    obj = unpack(encode(msg))  # [magic, kind, session, id, seeds, keys]
    seeds: dict[Any, Any] = obj[4]
    if how == "share_short":
        seeds[1] = seeds[1][1:]
    elif how == "share_long":
        seeds[1] = b"\x00" + seeds[1]
    elif how == "share_not_field_element":
        seeds[1] = PRIME.to_bytes(SHARE_BYTES, "big")
    elif how == "key_str":
        seeds["1"] = seeds.pop(1)
    if how == "repeated_owner":
        pairs = sorted(seeds.items())
        pairs[0] = (pairs[1][0], pairs[0][1])
        bad = pack_with_pairs(obj[:4], pairs, (obj[5],))
    else:
        bad = pack(obj)
    assert_server_rejects(rnd, VICTIM, bad)


@pytest.mark.parametrize("security", MODES)
def test_unmasking_shares_from_other_session_or_sender_rejected(security: str) -> None:
    rnd, msg = _at_unmasking(security)
    assert_server_rejects(rnd, VICTIM, encode(replace(msg, session_id=b"\x00" * 32)))
    rnd, msg = _at_unmasking(security)
    assert_server_rejects(rnd, VICTIM, rnd.pending[3])  # transport says VICTIM, message 3


@pytest.mark.parametrize("security", MODES)
def test_unmasking_shares_of_another_holder_relabelled_are_blamed(security: str) -> None:
    """Client 3's shares relabelled as the victim's answer the same request, so the server
    cannot reject them; they are evaluated at the wrong point, and verified reconstruction
    keeps the sum exact and names the victim's slot as corrupt."""
    rnd, msg = _at_unmasking(security)
    rnd.pending[VICTIM] = encode(replace(decode(rnd.pending[3]), client_id=VICTIM))
    if rejected_when_signed(rnd, security):
        return
    result = rnd.assert_correct()
    assert set(result.corrupt_shares) == {VICTIM}
    assert result.corrupt_shares[VICTIM] == frozenset(msg.self_mask_shares) | {DROPPED}


@pytest.mark.parametrize("kind", ["self_mask", "masking_key"])
def test_corrupted_unmasking_share_is_detected_and_blamed(kind: str) -> None:
    """A wrong share that is a field element is accepted, but reconstruction is verified
    (commitment / public key), so the sum is still exact and the holder is named."""
    rnd, msg = _at_unmasking()
    seeds, keys = dict(msg.self_mask_shares), dict(msg.masking_key_shares)
    owner = 1 if kind == "self_mask" else DROPPED
    target = seeds if kind == "self_mask" else keys
    value = (int.from_bytes(target[owner], "big") + 1) % PRIME
    target[owner] = value.to_bytes(SHARE_BYTES, "big")
    rnd.pending[VICTIM] = encode(replace(msg, self_mask_shares=seeds, masking_key_shares=keys))
    result = rnd.assert_correct()
    assert dict(result.corrupt_shares) == {VICTIM: frozenset({owner})}


def test_corrupted_share_with_exactly_threshold_holders_aborts_cleanly() -> None:
    rnd, msg = _at_unmasking()
    t = rnd.config.threshold
    assert t is not None
    answering = sorted(rnd.pending)[:t]
    seeds = dict(msg.self_mask_shares)
    seeds[1] = ((int.from_bytes(seeds[1], "big") + 1) % PRIME).to_bytes(SHARE_BYTES, "big")
    rnd.pending[VICTIM] = encode(replace(msg, self_mask_shares=seeds))
    assert VICTIM in answering
    with pytest.raises(ProtocolAbort):
        rnd.step({cid: rnd.pending[cid] for cid in answering})


# =============================================================================================
# server -> client: KeyList
# =============================================================================================


def _key_list(rnd: Round, cid: int = VICTIM) -> KeyList:
    msg: KeyList = decode(rnd.run_until(KeyList)[cid])
    assert isinstance(msg, KeyList)
    return msg


def _with_entry(msg: KeyList, cid: int, **changes: Any) -> KeyList:
    keys = dict(msg.keys)
    keys[cid] = replace(keys[cid], **changes)
    out: KeyList = replace(msg, keys=keys)
    return out


@pytest.mark.parametrize("security", MODES)
def test_key_list_for_another_client_refused_without_state_change(security: str) -> None:
    rnd = make_round(security)
    _key_list(rnd)
    assert_client_refuses(rnd, VICTIM, rnd.pending[3])


@pytest.mark.parametrize("security", MODES)
@pytest.mark.parametrize("how", ["truncated", "key_31_bytes", "entry_of_three", "id_str",
                                 "entry_as_map", "client_message_kind", "garbage"])
def test_undecodable_key_list_refused_without_state_change(security: str, how: str) -> None:
    rnd = make_round(security)
    data = rnd.run_until(KeyList)[VICTIM]
    obj = unpack(data)
    keys: dict[Any, Any] = obj[4]
    if how == "key_31_bytes":
        keys[1][0] = keys[1][0][:31]
    elif how == "entry_of_three":
        keys[1] = keys[1][:3]
    elif how == "id_str":
        keys["1"] = keys.pop(1)
    elif how == "entry_as_map":
        keys[1] = dict(enumerate(keys[1]))
    bad = {"truncated": data[:-3], "garbage": b"\x93\x01\x02",
           "client_message_kind": next(d for k, c, d in rnd.sent
                                   if k is AdvertiseKeys and c == VICTIM)
           }.get(how, pack(obj))
    assert_client_refuses(rnd, VICTIM, bad)


@pytest.mark.parametrize("security", MODES)
def test_server_chosen_session_id_rejected(security: str) -> None:
    """The session id is derived by every client, never taken from the server (fcp trusts a
    server-sent one): a server that runs another session, or rewrites the id, is refused."""
    rnd = make_round(security)
    msg = _key_list(rnd)
    rogue = Round(rnd.config, context=b"server-chosen", signing=rnd.signing)
    theirs = rogue.run_until(KeyList)[VICTIM]
    assert decode(theirs).session_id != rnd.clients[VICTIM].session_id
    assert_client_aborts(rnd, VICTIM, theirs)
    rnd = make_round(security)
    msg = _key_list(rnd)
    for session in (bytes(32), rogue.server.session_id):
        client = Round(rnd.config, context=rnd.context, inputs=rnd.inputs,
                       signing=rnd.signing).clients[VICTIM]
        with pytest.raises(ProtocolAbort):
            client.handle(encode(replace(msg, session_id=session)))
    assert_client_aborts(rnd, VICTIM, encode(replace(msg, session_id=rogue.server.session_id)))


@pytest.mark.parametrize("security", MODES)
@pytest.mark.parametrize("field", ["encryption_key", "masking_key", "self_mask_commitment"])
def test_key_list_altering_the_clients_own_entry_aborts(security: str, field: str) -> None:
    rnd = make_round(security)
    msg = _key_list(rnd)
    value = flip_last(getattr(msg.keys[VICTIM], field))
    assert_client_aborts(rnd, VICTIM, encode(_with_entry(msg, VICTIM, **{field: value})))


@pytest.mark.parametrize("security", MODES)
def test_key_list_omitting_the_client_itself_aborts(security: str) -> None:
    rnd = make_round(security)
    msg = _key_list(rnd)
    keys = {c: e for c, e in msg.keys.items() if c != VICTIM}
    assert_client_aborts(rnd, VICTIM, encode(replace(msg, keys=keys)))


@pytest.mark.parametrize("security", MODES)
@pytest.mark.parametrize("which", ["encryption_key", "masking_key"])
@pytest.mark.parametrize("point", range(len(SMALL_ORDER_POINTS)))
def test_key_list_with_small_order_peer_key_aborts(security: str, which: str,
                                                   point: int) -> None:
    rnd = make_round(security)
    msg = _key_list(rnd)
    bad = _with_entry(msg, 3, **{which: SMALL_ORDER_POINTS[point]})
    assert_client_aborts(rnd, VICTIM, encode(bad))


@pytest.mark.parametrize("security", MODES)
@pytest.mark.parametrize("how", ["peer_copies_peer", "peer_copies_mine", "enc_equals_mask",
                                 "mask_copies_other_enc"])
def test_key_list_with_duplicated_public_key_aborts(security: str, how: str) -> None:
    """fcp accepts a duplicated key; a client here refuses a key list that repeats one."""
    rnd = make_round(security)
    msg = _key_list(rnd)
    keys = msg.keys
    change = {
        "peer_copies_peer": {"encryption_key": keys[4].encryption_key},
        "peer_copies_mine": {"masking_key": keys[VICTIM].masking_key},
        "enc_equals_mask": {"masking_key": keys[3].encryption_key},
        "mask_copies_other_enc": {"masking_key": keys[5].encryption_key},
    }[how]
    assert_client_aborts(rnd, VICTIM, encode(_with_entry(msg, 3, **change)))


@pytest.mark.parametrize("security", MODES)
def test_key_list_below_threshold_aborts(security: str) -> None:
    rnd = make_round(security)
    msg = _key_list(rnd)
    t = rnd.config.threshold
    assert t is not None
    keep = [VICTIM, *[c for c in msg.keys if c != VICTIM][: t - 2]]
    assert_client_aborts(rnd, VICTIM, encode(replace(msg, keys={c: msg.keys[c] for c in keep})))


@pytest.mark.parametrize("security", MODES)
def test_key_list_naming_client_outside_neighbourhood_aborts(security: str) -> None:
    rnd = make_round(security)
    msg = _key_list(rnd)
    keys = dict(msg.keys)
    keys[N + 1] = replace(keys[3], encryption_key=keys[3].masking_key,
                          masking_key=keys[3].encryption_key)
    del keys[3]  # n entries: a list longer than the roster is a DecodeError (6.2)
    assert_client_aborts(rnd, VICTIM, encode(replace(msg, keys=keys)))
    # SecAgg+: a roster member that is not a graph neighbour
    rnd = make_round(security, n=9, neighbors=5 if security == "semi-honest" else 7,
                     unchecked_graph=True)
    client = rnd.clients[VICTIM]
    outsider = min(set(rnd.roster) - client.neighborhood)
    full = decode(rnd.run_until(KeyList)[outsider]).keys[outsider]
    msg = _key_list(rnd)
    keys = dict(msg.keys)
    keys[outsider] = full
    assert_client_aborts(rnd, VICTIM, encode(replace(msg, keys=keys)))


@pytest.mark.parametrize("security", MODES)
def test_key_list_missing_a_peer_excludes_the_client_cleanly(security: str) -> None:
    """A shorter (but still >= t) key list is plausible; the client's shares then do not
    match the server's record, so the server rejects them and the round finishes without
    the client."""
    rnd = make_round(security)
    msg = _key_list(rnd)
    keys = {c: e for c, e in msg.keys.items() if c != 3}
    rnd.pending[VICTIM] = encode(replace(msg, keys=keys))
    rnd.run_until(Ciphertexts)
    assert VICTIM in rnd.server_rejects
    result = rnd.assert_correct()
    assert VICTIM not in result.included


def test_key_list_with_swapped_peer_entries_aborts() -> None:
    rnd = make_round("malicious")
    msg = _key_list(rnd)
    keys = dict(msg.keys)
    keys[3], keys[4] = keys[4], keys[3]
    assert_client_aborts(rnd, VICTIM, encode(replace(msg, keys=keys)))


@pytest.mark.parametrize("field", ["encryption_key", "masking_key", "self_mask_commitment",
                                   "signature"])
def test_key_list_with_forged_peer_advertisement_aborts(field: str) -> None:
    rnd = make_round("malicious")
    msg = _key_list(rnd)
    entry = msg.keys[3]
    if field.endswith("_key"):
        value: bytes = other_session_round(rnd).decoded(3).encryption_key
    else:
        value = flip_last(getattr(entry, field))
    assert_client_aborts(rnd, VICTIM, encode(_with_entry(msg, 3, **{field: value})))


@pytest.mark.parametrize("how", ["wrong_key", "empty", "other_peers_signature"])
def test_key_list_with_signature_from_wrong_key_aborts(how: str) -> None:
    rnd = make_round("malicious")
    msg = _key_list(rnd)
    entry = msg.keys[3]
    from secagg.client import advertisement_transcript

    message = advertisement_transcript(rnd.server.session_id, 3,
                                       replace(entry, signature=b""))
    signature = {"wrong_key": rnd.signing[4].sign(message), "empty": b"",
                 "other_peers_signature": msg.keys[4].signature}[how]
    assert_client_aborts(rnd, VICTIM, encode(_with_entry(msg, 3, signature=signature)))


def test_key_entry_replayed_from_another_session_aborts() -> None:
    rnd = make_round("malicious")
    other = Round(rnd.config, context=b"yesterday", signing=rnd.signing)
    old = decode(other.run_until(KeyList)[VICTIM]).keys[3]  # validly signed, other session
    msg = _key_list(rnd)
    keys = dict(msg.keys)
    keys[3] = old
    assert_client_aborts(rnd, VICTIM, encode(replace(msg, keys=keys)))


@pytest.mark.parametrize("security", MODES)
def test_key_list_redelivery_gets_the_same_answer(security: str) -> None:
    rnd = make_round(security)
    data = rnd.run_until(KeyList)[VICTIM]
    first = encode(rnd.clients[VICTIM].handle(data))
    before = client_state(rnd.clients[VICTIM])
    assert encode(rnd.clients[VICTIM].handle(data)) == first
    assert client_state(rnd.clients[VICTIM]) == before
    rnd.pending[VICTIM] = data
    rnd.assert_correct()


@pytest.mark.parametrize("security", MODES)
def test_late_redelivery_of_previous_stage_message_does_not_abort(security: str) -> None:
    rnd = make_round(security)
    key_list = rnd.run_until(KeyList)[VICTIM]
    share_keys = encode(rnd.clients[VICTIM].handle(key_list))
    rnd.run_until(Ciphertexts)
    rnd.step()  # the client answered Ciphertexts
    client = rnd.clients[VICTIM]
    try:
        again = client.handle(key_list)
    except ProtocolAbort:
        pytest.fail("a late duplicate of the KeyList aborted the client")
    except ProtocolError:
        again = None
    assert client.aborted is None
    assert again is None or encode(again) == share_keys
    rnd.assert_correct()


@pytest.mark.parametrize("security", MODES)
def test_out_of_stage_server_message_aborts(security: str) -> None:
    rnd = make_round(security)
    rnd.run_until(KeyList)
    ahead = make_round(security)
    ciphertexts = ahead.run_until(Ciphertexts)[VICTIM]  # a Ciphertexts of another session
    forged = encode(replace(decode(ciphertexts), session_id=rnd.clients[VICTIM].session_id))
    assert_client_aborts(rnd, VICTIM, forged)


# =============================================================================================
# server -> client: Ciphertexts
# =============================================================================================


def _ciphertexts(rnd: Round, cid: int = VICTIM) -> Ciphertexts:
    msg = decode(rnd.run_until(Ciphertexts)[cid])
    assert isinstance(msg, Ciphertexts)
    return msg


def _with_cts(msg: Ciphertexts, cts: dict[int, bytes]) -> bytes:
    return encode(replace(msg, ciphertexts=cts))


@pytest.mark.parametrize("security", MODES)
def test_ciphertexts_for_another_client_refused_without_state_change(security: str) -> None:
    rnd = make_round(security)
    _ciphertexts(rnd)
    assert_client_refuses(rnd, VICTIM, rnd.pending[4])


@pytest.mark.parametrize("security", MODES)
@pytest.mark.parametrize("how", ["short", "long", "str", "id_zero", "truncated"])
def test_undecodable_ciphertexts_refused_without_state_change(security: str, how: str) -> None:
    rnd = make_round(security)
    data = rnd.run_until(Ciphertexts)[VICTIM]
    obj = unpack(data)
    cts: dict[Any, Any] = obj[4]
    if how == "short":
        cts[1] = cts[1][:-1]
    elif how == "long":
        cts[1] = cts[1] + b"\x00"
    elif how == "str":
        cts[1] = "c" * len(cts[1])
    elif how == "id_zero":
        cts[0] = cts.pop(1)
    bad = data[:len(data) // 2] if how == "truncated" else pack(obj)
    assert_client_refuses(rnd, VICTIM, bad)


@pytest.mark.parametrize("security", MODES)
def test_ciphertexts_of_another_session_abort(security: str) -> None:
    rnd = make_round(security)
    msg = _ciphertexts(rnd)
    assert_client_aborts(rnd, VICTIM, encode(replace(msg, session_id=b"\x01" * 32)))


@pytest.mark.parametrize("security", MODES)
@pytest.mark.parametrize("index", [0, 20, 40, 60, 89])
def test_ciphertext_bitflip_aborts(security: str, index: int) -> None:
    rnd = make_round(security)
    msg = _ciphertexts(rnd)
    cts = dict(msg.ciphertexts)
    cts[3] = flip(cts[3], index)
    assert_client_aborts(rnd, VICTIM, _with_cts(msg, cts))


@pytest.mark.parametrize("security", MODES)
def test_ciphertext_from_another_pair_aborts(security: str) -> None:
    rnd = make_round(security)
    msg = _ciphertexts(rnd)
    elsewhere = decode(rnd.pending[4]).ciphertexts[3]  # 3 -> 4, not 3 -> VICTIM
    cts = dict(msg.ciphertexts)
    cts[3] = elsewhere
    assert_client_aborts(rnd, VICTIM, _with_cts(msg, cts))


@pytest.mark.parametrize("security", MODES)
def test_ciphertexts_with_swapped_senders_abort(security: str) -> None:
    rnd = make_round(security)
    msg = _ciphertexts(rnd)
    cts = dict(msg.ciphertexts)
    cts[3], cts[4] = cts[4], cts[3]
    assert_client_aborts(rnd, VICTIM, _with_cts(msg, cts))


@pytest.mark.parametrize("security", MODES)
def test_ciphertext_replayed_from_another_session_aborts(security: str) -> None:
    rnd = make_round(security)
    other = other_session_round(rnd)
    old = _ciphertexts(other).ciphertexts[3]
    msg = _ciphertexts(rnd)
    cts = dict(msg.ciphertexts)
    cts[3] = old
    assert_client_aborts(rnd, VICTIM, _with_cts(msg, cts))


@pytest.mark.parametrize("security", MODES)
def test_ciphertext_claimed_from_the_client_itself_aborts(security: str) -> None:
    rnd = make_round(security)
    msg = _ciphertexts(rnd)
    cts = dict(msg.ciphertexts)
    cts[VICTIM] = cts[3]
    assert_client_aborts(rnd, VICTIM, _with_cts(msg, cts))


@pytest.mark.parametrize("security", MODES)
def test_ciphertext_from_client_outside_key_list_aborts(security: str) -> None:
    rnd = make_round(security)
    msg = _ciphertexts(rnd)
    cts = dict(msg.ciphertexts)
    cts[N + 2] = cts[3]
    assert_client_aborts(rnd, VICTIM, _with_cts(msg, cts))


@pytest.mark.parametrize("security", MODES)
def test_ciphertexts_below_threshold_abort(security: str) -> None:
    rnd = make_round(security)
    msg = _ciphertexts(rnd)
    t = rnd.config.threshold
    assert t is not None
    cts = dict(sorted(msg.ciphertexts.items())[: t - 2])
    assert_client_aborts(rnd, VICTIM, _with_cts(msg, cts))


@pytest.mark.parametrize("kind", [KeyList, Ciphertexts, UnmaskRequest, ShareKeys])
def test_map_repeating_a_client_id_is_undecodable(kind: type) -> None:
    rnd = make_round("malicious")
    data = rnd.run_until(kind)[VICTIM]
    obj = unpack(data)
    index = 6 if kind is UnmaskRequest else 4
    pairs = sorted(obj[index].items())
    pairs[0] = (pairs[1][0], pairs[0][1])
    with pytest.raises(ProtocolError):
        decode(pack_with_pairs(obj[:index], pairs, tuple(obj[index + 1:])))


@pytest.mark.parametrize("security", MODES)
def test_ciphertexts_entry_collapsed_by_repeated_key_refused(security: str) -> None:
    """Regression: a one-byte change of a map key used to delete an entry silently (the
    decoder kept the last value), which ended in a wrong sum."""
    rnd = make_round(security)
    obj = unpack(rnd.run_until(Ciphertexts)[VICTIM])
    pairs = sorted(obj[4].items())
    pairs[0] = (pairs[1][0], pairs[1][1])  # sender 1 vanishes; sender 3 is intact
    assert_client_refuses(rnd, VICTIM, pack_with_pairs(obj[:4], pairs))


@pytest.mark.parametrize("security", MODES)
def test_ciphertexts_entry_removed_never_yields_wrong_sum(security: str) -> None:
    rnd = make_round(security)
    msg = _ciphertexts(rnd)
    cts = dict(msg.ciphertexts)
    del cts[1]
    rnd.pending[VICTIM] = _with_cts(msg, cts)
    try:
        result = rnd.finish()
    except ProtocolAbort:
        return
    assert result.total.tolist() == rnd.expected(result.included)


# =============================================================================================
# server -> client: SurvivorList (malicious)
# =============================================================================================


def _survivor_list(rnd: Round, cid: int = VICTIM) -> SurvivorList:
    msg = decode(rnd.run_until(SurvivorList)[cid])
    assert isinstance(msg, SurvivorList)
    return msg


def test_survivor_list_for_another_client_refused_without_state_change() -> None:
    rnd = make_round("malicious")
    _survivor_list(rnd)
    assert_client_refuses(rnd, VICTIM, rnd.pending[3])


@pytest.mark.parametrize("how", ["unsorted", "repeated", "id_str", "as_map"])
def test_undecodable_survivor_list_refused_without_state_change(how: str) -> None:
    rnd = make_round("malicious")
    obj = unpack(rnd.run_until(SurvivorList)[VICTIM])
    ids: list[Any] = obj[4]
    obj[4] = {"unsorted": ids[::-1], "repeated": [ids[0], *ids],
              "id_str": [str(i) for i in ids], "as_map": dict.fromkeys(ids, b"")}[how]
    assert_client_refuses(rnd, VICTIM, pack(obj))


def test_survivor_list_of_another_session_aborts() -> None:
    rnd = make_round("malicious")
    msg = _survivor_list(rnd)
    assert_client_aborts(rnd, VICTIM, encode(replace(msg, session_id=b"\x05" * 32)))


def test_survivor_list_omitting_the_client_aborts() -> None:
    rnd = make_round("malicious")
    msg = _survivor_list(rnd)
    survivors = tuple(c for c in msg.survivors if c != VICTIM)
    assert_client_aborts(rnd, VICTIM, encode(replace(msg, survivors=survivors)))


def test_survivor_list_naming_client_that_never_shared_keys_aborts() -> None:
    rnd = make_round("malicious")
    rnd.run_until(ShareKeys)
    rnd.step(stop={DROPPED})  # DROPPED sends no shares
    msg = _survivor_list(rnd)
    assert DROPPED not in msg.survivors
    survivors = tuple(sorted({*msg.survivors, DROPPED}))
    assert_client_aborts(rnd, VICTIM, encode(replace(msg, survivors=survivors)))


def test_survivor_list_below_threshold_aborts() -> None:
    rnd = make_round("malicious")
    msg = _survivor_list(rnd)
    t = rnd.config.threshold
    assert t is not None
    survivors = tuple(sorted({VICTIM, *[c for c in msg.survivors if c != VICTIM][: t - 2]}))
    assert_client_aborts(rnd, VICTIM, encode(replace(msg, survivors=survivors)),
                         round_completes=True)


def test_survivor_list_in_semi_honest_round_aborts() -> None:
    rnd = make_round("semi-honest")
    rnd.run_until(UnmaskRequest)
    forged = SurvivorList(rnd.clients[VICTIM].session_id, VICTIM, tuple(rnd.roster))
    assert_client_aborts(rnd, VICTIM, encode(forged))


# =============================================================================================
# server -> client: UnmaskRequest
# =============================================================================================


def _unmask_request(security: str, *, drop: bool = True) -> tuple[Round, UnmaskRequest]:
    rnd = make_round(security)
    if drop:
        rnd.run_until(MaskedInput)
        rnd.step(stop={DROPPED})
    msg = decode(rnd.run_until(UnmaskRequest)[VICTIM])
    assert isinstance(msg, UnmaskRequest)
    if drop:
        assert msg.dropped == (DROPPED,)
    return rnd, msg


@pytest.mark.parametrize("security", MODES)
@pytest.mark.parametrize("who", ["dropped_peer_also_survived", "survivor_also_dropped"])
def test_unmask_request_naming_peer_in_both_lists_aborts(security: str, who: str) -> None:
    """Flower's SecAgg+ never checks that the lists are disjoint, so a server learns both
    shares of a peer and unmasks its input exactly."""
    rnd, msg = _unmask_request(security)
    if who == "dropped_peer_also_survived":
        bad = replace(msg, survivors=tuple(sorted({*msg.survivors, DROPPED})))
    else:
        bad = replace(msg, dropped=tuple(sorted({*msg.dropped, 3})))
    assert_client_aborts(rnd, VICTIM, encode(bad))


@pytest.mark.parametrize("security", MODES)
@pytest.mark.parametrize("also_survivor", [True, False])
def test_unmask_request_naming_the_client_itself_as_dropped_aborts(security: str,
                                                                   also_survivor: bool) -> None:
    rnd, msg = _unmask_request(security)
    survivors = msg.survivors if also_survivor else tuple(c for c in msg.survivors
                                                          if c != VICTIM)
    bad = replace(msg, survivors=survivors, dropped=tuple(sorted({*msg.dropped, VICTIM})))
    assert_client_aborts(rnd, VICTIM, encode(bad))


@pytest.mark.parametrize("security", MODES)
@pytest.mark.parametrize("how", ["omit_self", "omit_survivor", "omit_dropped",
                                 "unknown_survivor", "unknown_dropped", "empty"])
def test_unmask_request_inconsistent_with_shared_keys_aborts(security: str, how: str) -> None:
    rnd, msg = _unmask_request(security)
    survivors, dropped = set(msg.survivors), set(msg.dropped)
    if how == "omit_self":
        survivors.discard(VICTIM)
    elif how == "omit_survivor":
        survivors.discard(3)
    elif how == "omit_dropped":
        dropped.clear()
    elif how == "unknown_survivor":
        survivors.add(N + 4)
    elif how == "unknown_dropped":
        dropped.add(N + 4)
    else:
        survivors, dropped = set(), set()
    bad = replace(msg, survivors=tuple(sorted(survivors)), dropped=tuple(sorted(dropped)))
    assert_client_aborts(rnd, VICTIM, encode(bad))


def test_unmask_request_below_threshold_aborts() -> None:
    rnd, msg = _unmask_request("semi-honest")
    t = rnd.config.threshold
    assert t is not None
    peers = sorted({*msg.survivors, *msg.dropped} - {VICTIM})
    survivors = {VICTIM, *peers[: t - 2]}
    dropped = set(peers) - survivors
    bad = replace(msg, survivors=tuple(sorted(survivors)), dropped=tuple(sorted(dropped)))
    assert_client_aborts(rnd, VICTIM, encode(bad))


def test_unmask_request_with_signatures_in_semi_honest_round_aborts() -> None:
    rnd, msg = _unmask_request("semi-honest")
    bad = replace(msg, signatures={3: b"\x00" * 64})
    assert_client_aborts(rnd, VICTIM, encode(bad))


def test_unmask_request_moving_a_signed_survivor_to_dropped_aborts() -> None:
    """Malicious: the partition must match the survivor list the client signed."""
    rnd, msg = _unmask_request("malicious")
    survivors = tuple(c for c in msg.survivors if c != 3)
    signatures = {c: s for c, s in msg.signatures.items() if c != 3}
    bad = replace(msg, survivors=survivors, dropped=tuple(sorted({*msg.dropped, 3})),
                  signatures=signatures)
    assert_client_aborts(rnd, VICTIM, encode(bad))


@pytest.mark.parametrize("how", ["bitflip", "wrong_key", "other_signer", "below_threshold",
                                 "signer_not_survivor", "other_session", "none",
                                 "over_other_list"])
def test_unmask_request_with_bad_consistency_signatures_aborts(how: str) -> None:
    rnd, msg = _unmask_request("malicious")
    sigs = dict(msg.signatures)
    session = rnd.clients[VICTIM].session_id
    survivors = sorted(rnd.server._survivors)
    t = rnd.config.threshold
    assert t is not None and len(sigs) == len(msg.survivors)
    if how == "bitflip":
        sigs[3] = flip(sigs[3], 7)
    elif how == "wrong_key":
        sigs[3] = rnd.signing[4].sign(survivors_transcript(rnd, session, 3, survivors))
    elif how == "other_signer":
        sigs[3] = sigs[4]
    elif how == "below_threshold":
        sigs = dict(sorted(sigs.items())[: t - 1])
    elif how == "signer_not_survivor":
        sigs[DROPPED] = rnd.signing[DROPPED].sign(survivors_transcript(rnd, session, DROPPED,
                                                                       survivors))
    elif how == "other_session":
        sigs[3] = rnd.signing[3].sign(survivors_transcript(rnd, b"\x02" * 32, 3, survivors))
    elif how == "none":
        sigs = {}
    else:
        sigs[3] = rnd.signing[3].sign(survivors_transcript(rnd, session, 3, survivors[1:]))
    assert_client_aborts(rnd, VICTIM, encode(replace(msg, signatures=sigs)))


def test_repeated_signer_on_the_wire_does_not_count_twice() -> None:
    rnd, msg = _unmask_request("malicious")
    t = rnd.config.threshold
    assert t is not None
    obj = unpack(encode(msg))
    pairs = sorted(obj[6].items())[: t - 1]
    pairs.append(pairs[0])  # t entries on the wire, t - 1 signers
    assert_client_refuses(rnd, VICTIM, pack_with_pairs(obj[:6], pairs))


@pytest.mark.parametrize("security", MODES)
def test_unmask_request_for_another_client_refused_without_state_change(security: str) -> None:
    rnd, _ = _unmask_request(security)
    assert_client_refuses(rnd, VICTIM, rnd.pending[3])


@pytest.mark.parametrize("security", MODES)
@pytest.mark.parametrize("how", ["unsorted", "repeated", "id_zero", "signature_short"])
def test_undecodable_unmask_request_refused_without_state_change(security: str,
                                                                 how: str) -> None:
    rnd, msg = _unmask_request(security)
    obj = unpack(encode(msg))  # [magic, kind, session, id, survivors, dropped, signatures]
    if how == "unsorted":
        obj[4] = obj[4][::-1]
    elif how == "repeated":
        obj[4] = [obj[4][0], *obj[4]]
    elif how == "id_zero":
        obj[5] = [0]
    else:
        obj[6] = {3: b"\x00" * 63}
    assert_client_refuses(rnd, VICTIM, pack(obj))


@pytest.mark.parametrize("security", MODES)
def test_unmask_request_of_another_session_aborts(security: str) -> None:
    rnd, msg = _unmask_request(security)
    assert_client_aborts(rnd, VICTIM, encode(replace(msg, session_id=b"\x03" * 32)))


@pytest.mark.parametrize("security", MODES)
def test_answered_client_reveals_nothing_more(security: str) -> None:
    """Redelivery gets the identical answer; any other request after it is refused, so no
    sequence of requests obtains both shares of one peer."""
    rnd, msg = _unmask_request(security)
    client = rnd.clients[VICTIM]
    first = encode(client.handle(rnd.pending[VICTIM]))
    revealed = dict(client.revealed)
    assert revealed[DROPPED] == "masking_key" and revealed[3] == "self_mask"
    assert encode(client.handle(rnd.pending[VICTIM])) == first
    flipped = replace(msg, survivors=tuple(sorted({*msg.survivors, DROPPED} - {3})),
                      dropped=(3,))
    with pytest.raises(ProtocolError):
        client.handle(encode(flipped))
    assert client.revealed == revealed
    rnd.assert_correct()


# =============================================================================================
# state machines as a whole
# =============================================================================================


@pytest.mark.parametrize("security", MODES)
def test_client_message_delivered_to_client_refused(security: str) -> None:
    rnd = make_round(security)
    rnd.run_until(Ciphertexts)
    share_keys = next(d for k, c, d in rnd.sent if k is ShareKeys and c == VICTIM)
    assert_client_refuses(rnd, VICTIM, share_keys)


def test_aborted_server_does_nothing_more() -> None:
    rnd = make_round()
    t = rnd.config.threshold
    assert t is not None
    late = sorted(rnd.pending)[t - 1:]
    for cid in sorted(rnd.pending)[: t - 1]:
        rnd.server.receive(cid, rnd.pending[cid])
    with pytest.raises(ProtocolAbort):
        rnd.server.advance()
    for cid in late:
        with pytest.raises(ProtocolError):
            rnd.server.receive(cid, rnd.pending[cid])
    with pytest.raises(ProtocolError):
        rnd.server.advance()


def test_malformed_message_object_rejected_by_server_without_state_change() -> None:
    rnd = make_round(bits=32)
    msg = decode(rnd.run_until(MaskedInput)[VICTIM])
    bad = replace(msg, masked="x" * len(msg.masked))
    before = server_state(rnd.server)
    with pytest.raises(ProtocolError):
        rnd.server.receive(VICTIM, bad)
    assert server_state(rnd.server) == before


@pytest.mark.parametrize("kind", [KeyList, UnmaskRequest])
def test_malformed_message_object_rejected_by_client(kind: type) -> None:
    rnd = make_round()
    msg = decode(rnd.run_until(kind)[VICTIM])
    bad = (replace(msg, keys={c: [1, 2] for c in msg.keys}) if kind is KeyList
           else replace(msg, survivors=None))
    with pytest.raises(ProtocolError):
        rnd.clients[VICTIM].handle(bad)
