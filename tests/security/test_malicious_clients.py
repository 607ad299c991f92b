"""Malicious clients, an untrusted broker and a network attacker, against the real server.

Rounds run through ``tests/secagg/harness.Round`` (real ``Server`` and ``Client`` state
machines, every message through the wire codec); the attacker rewrites the bytes of the
clients it controls, or of any message in transit.
"""

from __future__ import annotations

import numpy as np
import pytest
from adversary import (
    AttackSucceeded,
    Puppeteer,
    assert_input_hidden,
    documented_limitation,
    field_element,
    threat,
)
from harness import Round, server_state

from secagg import Config, ProtocolAbort, ProtocolError, SigningKey, encode
from secagg.client import advertisement_transcript
from secagg.crypto import KeyPair, Masker, self_mask_commitment, self_mask_key
from secagg.messages import (
    AdvertiseKeys,
    KeyEntry,
    MaskedInput,
    UnmaskingShares,
    UnmaskRequest,
    decode,
)

pytestmark = pytest.mark.security

VICTIM = 1


def _corrupt_seed_shares(rnd: Round, holders: set[int], owner: int) -> None:
    """The pending UnmaskingShares of ``holders`` carry a wrong share of ``owner``'s seed."""
    for holder in holders:
        msg = decode(rnd.pending[holder])
        assert isinstance(msg, UnmaskingShares)
        shares = dict(msg.self_mask_shares)
        shares[owner] = field_element(int.from_bytes(shares[owner], "big") + 12345 + holder)
        rnd.pending[holder] = encode(UnmaskingShares(msg.session_id, holder, shares,
                                                     msg.masking_key_shares))


@threat(attack="Corrupted Shamir shares",
        adversary="malicious client",
        controls="the unmasking shares it sends: wrong shares of a survivor's seed, from up "
                 "to (m - t)/2 holders",
        protocol="section 8: Reed-Solomon (Gao) decoding corrects them, the seed is checked "
                 "against its commitment, the culprits are named in "
                 "AggregateResult.corrupt_shares, the round completes with the exact sum")
@pytest.mark.parametrize("corrupt", [{1, 2}, {1, 10}, {2}])
def test_corrupted_shares_are_corrected_and_blamed(corrupt: set[int]) -> None:
    rnd = Round(Config(num_clients=10, dim=16, bits=32), context=b"corrupt-shares")
    rnd.run_until(UnmaskingShares)
    owner = 5
    _corrupt_seed_shares(rnd, corrupt, owner)
    result = rnd.assert_correct()
    assert result.included == frozenset(rnd.roster)
    assert dict(result.corrupt_shares) == {h: frozenset({owner}) for h in corrupt}


@threat(attack="Corrupted Shamir shares",
        adversary="malicious client",
        controls="a wrong share from a holder whose id is above the t smallest",
        protocol="section 8: a random combination of all secrets' shares is checked for "
                 "consistency; off-polynomial holders are found (Gao, or share by share) "
                 "and blamed")
def test_corrupted_share_of_a_high_id_holder_is_blamed() -> None:
    rnd = Round(Config(num_clients=10, dim=16, bits=32), context=b"corrupt-high")
    rnd.run_until(UnmaskingShares)
    _corrupt_seed_shares(rnd, {10}, 5)
    result = rnd.assert_correct()
    if 10 not in result.corrupt_shares:
        raise AttackSucceeded("holder 10 sent a wrong share and was not named")


@threat(attack="Corrupted Shamir shares",
        adversary="malicious client",
        controls="more wrong shares than Reed-Solomon decoding corrects (3 of 10, t = 6)",
        protocol="bounded subset search against the commitment; otherwise a clean "
                 "ProtocolAbort: never a wrong sum, never an honest holder blamed")
@pytest.mark.parametrize("corrupt", [{1, 2, 3}, {2, 6, 9}, {1, 2, 3, 4}])
def test_too_many_corrupted_shares_never_give_a_wrong_sum(corrupt: set[int]) -> None:
    rnd = Round(Config(num_clients=10, dim=16, bits=32), context=b"corrupt-many")
    rnd.run_until(UnmaskingShares)
    _corrupt_seed_shares(rnd, corrupt, 5)
    try:
        result = rnd.assert_correct()
    except ProtocolAbort:
        assert rnd.server.result is None
        return
    assert set(result.corrupt_shares) <= corrupt


@threat(attack="Wrong-length or out-of-range masked inputs",
        adversary="malicious client",
        controls="its masked input: truncated, extended, other bits/dim, values >= 2^bits",
        protocol="V11: rejected with ProtocolError, server state unchanged; the client's "
                 "valid message is still accepted and the sum is exact")
@pytest.mark.parametrize("how", ["short", "long", "other_bits", "other_dim", "out_of_range"])
def test_malformed_masked_input_is_rejected(how: str) -> None:
    cfg = Config(num_clients=5, dim=8, bits=12)
    rnd = Round(cfg, context=b"masked-input")
    rnd.run_until(MaskedInput)
    msg = decode(rnd.pending[VICTIM])
    assert isinstance(msg, MaskedInput)
    vec = msg.vector().copy()
    bad = {
        "short": MaskedInput(msg.session_id, VICTIM, 12, 7, vec[:7].tobytes()),
        "long": MaskedInput(msg.session_id, VICTIM, 12, 9, np.append(vec, 1).tobytes()),
        "other_bits": MaskedInput(msg.session_id, VICTIM, 16, 8, vec.tobytes()),
        "other_dim": MaskedInput(msg.session_id, VICTIM, 12, 4, vec.astype("<u4").tobytes()),
        "out_of_range": MaskedInput(msg.session_id, VICTIM, 12, 8,
                                    np.where(np.arange(8) == 3, 1 << 12, vec)
                                    .astype(vec.dtype).tobytes()),
    }[how]
    before = server_state(rnd.server)
    with pytest.raises(ProtocolError) as info:
        rnd.server.receive(VICTIM, encode(bad))
    assert not isinstance(info.value, ProtocolAbort)
    assert server_state(rnd.server) == before
    result = rnd.assert_correct()
    assert VICTIM in result.included


@threat(attack="Impersonating another client",
        adversary="malicious client",
        controls="messages claiming another client's id, over its own transport identity",
        protocol="V5: the claimed id must equal the transport-authenticated sender")
@pytest.mark.parametrize("security", ["semi-honest", "malicious"])
def test_message_claiming_another_id_is_rejected(security: str) -> None:
    rnd = Round(Config(num_clients=5, dim=8, bits=16, security=security), context=b"imp")
    victim_advert = rnd.pending[VICTIM]
    with pytest.raises(ProtocolError):
        rnd.server.receive(2, victim_advert)
    assert VICTIM not in rnd.server.received
    rnd.assert_correct()


@threat(attack="Impersonating another client",
        adversary="malicious client",
        controls="the transport identity too (e.g. through a compromised broker): it "
                 "advertises its own keys under the victim's id, before the victim does",
        protocol="malicious mode: the advertisement must carry the victim's Ed25519 "
                 "signature; semi-honest mode relies on transport authentication (9.2)")
@pytest.mark.parametrize("security", [
    pytest.param("semi-honest", marks=documented_limitation(
        "documented non-guarantee (docs/protocol.md 9.2): semi-honest mode does not "
        "authenticate clients; it relies on the transport")),
    "malicious"])
def test_spoofed_advertisement_under_the_victims_id(security: str) -> None:
    cfg = Config(num_clients=5, dim=8, bits=16, security=security)
    rnd = Round(cfg, context=b"spoof")
    mallory = SigningKey.generate()
    enc, mask, seed = KeyPair(), KeyPair(), b"\x05" * 32
    sid = rnd.server.session_id
    entry = KeyEntry(enc.public, mask.public, self_mask_commitment(seed, sid, VICTIM))
    signature = (mallory.sign(advertisement_transcript(sid, VICTIM, entry))
                 if cfg.malicious else b"")
    forged = AdvertiseKeys(sid, VICTIM, enc.public, mask.public,
                           entry.self_mask_commitment, signature)
    try:
        rnd.server.receive(VICTIM, encode(forged))
    except ProtocolError:
        rnd.assert_correct()
        return
    raise AttackSucceeded("the server accepted keys for client 1 that client 1 never made")


@threat(attack="Flooding the server with duplicates",
        adversary="malicious client",
        controls="sends its valid masked input 2000 times, and 2000 junk or conflicting "
                 "messages",
        protocol="V7: identical bytes are accepted once (the sum counts it once); V10 and "
                 "decoding reject the rest without state change; the round completes")
def test_flood_of_duplicates_and_junk_changes_nothing() -> None:
    rnd = Round(Config(num_clients=5, dim=8, bits=16), context=b"flood")
    rnd.run_until(MaskedInput)
    good = rnd.pending[VICTIM]
    rnd.server.receive(VICTIM, good)
    after_first = server_state(rnd.server)
    for _ in range(2000):
        rnd.server.receive(VICTIM, good)
    assert server_state(rnd.server) == after_first
    msg = decode(good)
    assert isinstance(msg, MaskedInput)
    other = MaskedInput(msg.session_id, VICTIM, 16, 8, bytes(16))
    rejected = 0
    for i in range(2000):
        junk = encode(other) if i % 2 else good[: i % len(good)]
        try:
            rnd.server.receive(VICTIM, junk)
        except ProtocolError as exc:
            assert not isinstance(exc, ProtocolAbort)
            rejected += 1
    assert rejected == 2000
    assert server_state(rnd.server) == after_first
    result = rnd.assert_correct()
    assert VICTIM in result.included


# ============================================================================================
# broker and network
# ============================================================================================


@threat(attack="Passive broker reads every message",
        adversary="untrusted broker",
        controls="a copy of every byte every client sends (an honest round)",
        protocol="shares are AES-GCM encrypted end to end; masked inputs are masked; the "
                 "broker can do no better than the server")
@pytest.mark.parametrize("security", ["semi-honest", "malicious"])
def test_passive_broker_cannot_recover_an_input(security: str) -> None:
    p = Puppeteer(Config(num_clients=7, dim=512, bits=16, security=security))
    p.honest_until_masked_input()
    everyone = set(p.roster)
    if p.config.malicious:
        for cid in p.roster:
            p.deliver(cid, p.survivor_list(cid, everyone))
    for cid in p.roster:
        p.deliver(cid, p.unmask_request(cid, everyone))
    assert len(p.unmasking) == 7
    assert_input_hidden(p, VICTIM)


@threat(attack="Passive broker reads every message",
        adversary="untrusted broker",
        controls="the same copy of the traffic, used to compute the sum",
        protocol="unmasking shares travel to the server in clear (only transport TLS "
                 "protects them), so the broker learns what the server learns: the sum")
@documented_limitation(
    "finding (design): UnmaskingShares are not encrypted to the server, so a passive broker "
    "computes the aggregate the server computes; docs/architecture.md section 5 lists only shares "
    "and masked inputs as protected; use TLS to the broker or encrypt shares to the server")
def test_passive_broker_learns_only_the_sum() -> None:
    p = Puppeteer(Config(num_clients=7, dim=64, bits=16))
    p.honest_until_masked_input()
    everyone = set(p.roster)
    for cid in p.roster:
        p.deliver(cid, p.unmask_request(cid, everyone))
    from adversary import reconstruct_checked

    masker = Masker(64, 16)
    total = np.zeros(64, dtype=np.uint16)
    for cid, masked in p.masked.items():
        np.add(total, masked.vector(), out=total)
        shares = {m.client_id: int.from_bytes(m.self_mask_shares[cid], "big")
                  for m in p.unmasking}
        seed = reconstruct_checked(shares, p.t, lambda s, c=cid: self_mask_commitment(
            s, p.session_id, c) == p.adverts[c].self_mask_commitment)
        assert seed is not None
        masker.subtract(total, self_mask_key(seed, p.session_id, cid, p.config.shape_tag))
    expected = sum(p.inputs[c].astype(object) for c in p.roster) % p.config.modulus
    if np.array_equal(total.astype(np.uint64), np.asarray(expected, dtype=np.uint64)):
        raise AttackSucceeded("the broker computed the aggregate from the wire alone")


@threat(attack="Network attacker alters messages in transit",
        adversary="network attacker",
        controls="any byte between a client and the server: it adds a value of its choice "
                 "to one client's masked input (keeping every other field)",
        protocol="malicious mode: every client message is signed over its own transcript, "
                 "the altered input is rejected and the sum stays exact over the others; "
                 "semi-honest mode trusts the transport for integrity (5.7)")
@pytest.mark.parametrize("security", [
    pytest.param("semi-honest", marks=documented_limitation(
        "documented (docs/protocol.md 5.7): in semi-honest mode client messages carry no "
        "signature and the transport is trusted for integrity; an untrusted broker shifts "
        "the sum undetected")),
    "malicious"])
def test_masked_input_altered_in_transit_is_detected(security: str) -> None:
    import dataclasses

    cfg = Config(num_clients=5, dim=8, bits=16, security=security)
    rnd = Round(cfg, context=b"mitm-input")
    rnd.run_until(MaskedInput)
    msg = decode(rnd.pending[VICTIM])
    assert isinstance(msg, MaskedInput)
    shifted = (msg.vector() + np.uint16(1000)).astype(msg.vector().dtype)
    rnd.pending[VICTIM] = encode(dataclasses.replace(msg, masked=shifted.tobytes()))
    result = rnd.finish()
    if result.total.tolist() != rnd.expected(result.included):
        raise AttackSucceeded("the sum was shifted in transit and nobody noticed")
    assert VICTIM not in result.included and VICTIM in rnd.server_rejects


@threat(attack="Network attacker alters messages in transit",
        adversary="network attacker",
        controls="one bit of a share ciphertext, or of an unmasking request",
        protocol="AES-GCM tag with associated data (sid, stage, ids) fails: the recipient "
                 "aborts; a changed request fails the client's checks")
@pytest.mark.parametrize("security", ["semi-honest", "malicious"])
def test_share_ciphertext_altered_in_transit_aborts_its_recipient(security: str) -> None:
    p = Puppeteer(Config(num_clients=7, dim=512, bits=16, security=security))
    p.advertise()
    for cid in p.roster:
        p.deliver(cid, p.key_list(cid))
    msg = p.ciphertexts(VICTIM)
    cts = dict(msg.ciphertexts)
    cts[2] = cts[2][:-1] + bytes([cts[2][-1] ^ 1])
    p.deliver(VICTIM, type(msg)(msg.session_id, VICTIM, cts))
    assert VICTIM in p.aborts and VICTIM not in p.masked
    request = UnmaskRequest(p.session_id, VICTIM, tuple(p.roster), ())
    with pytest.raises(ProtocolError):
        p.clients[VICTIM].handle(encode(request))
    assert_input_hidden(p, VICTIM)
