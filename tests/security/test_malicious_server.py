"""A scripted malicious server drives real, honest clients (issue #6).

Each test is one attack. It must end with the honest clients aborting or the attack
failing, and then runs the attacker's best recovery (``adversary.recover_input``) on every
byte the clients sent and asserts that the victim's input does not come out (and that
what the attacker holds is statistically uniform). Attacks that are known to succeed in a
mode (stated non-guarantees of docs/protocol.md section 9.2) are strict xfails that must
fail with ``AttackSucceeded``.

Setting: n = 7 clients, complete graph; semi-honest t = 4, malicious t = 5; dim = 512,
bits = 16 (large enough for the uniformity check of the residual).
"""

from __future__ import annotations

import pytest
from adversary import (
    Puppeteer,
    any_unmasking_from,
    assert_input_hidden,
    documented_limitation,
    recover_input,
    threat,
)

from secagg import Config, ProtocolError
from secagg.crypto import CryptoError, KeyPair
from secagg.messages import KeyEntry, KeyList

pytestmark = pytest.mark.security

N = 7
DIM = 512
BITS = 16
VICTIM = 1
SEMI_HONEST_ACTIVE = (
    "documented non-guarantee (docs/protocol.md 9.2): semi-honest mode has no signatures, "
    "so an active server can show each client a different view; use security='malicious' "
    "against a malicious server")


def config(security: str, **kw: object) -> Config:
    return Config(num_clients=N, dim=DIM, bits=BITS, security=security, **kw)  # type: ignore[arg-type]


def modes_with_semi_honest_known(reason: str = SEMI_HONEST_ACTIVE) -> list[object]:
    return [pytest.param("semi-honest", marks=documented_limitation(reason)), "malicious"]


def signed_survivor_lists(p: Puppeteer, lists: dict[int, set[int]]) -> None:
    """Malicious mode: send each client its survivor list and collect the signatures."""
    if p.config.malicious:
        for cid, survivors in lists.items():
            if cid not in p.aborts:
                p.deliver(cid, p.survivor_list(cid, survivors))


# ============================================================================================
# both shares of one client
# ============================================================================================


@threat(attack="Ask for both shares of one client (Flower SecAgg+ attack)",
        adversary="malicious server",
        controls="the unmasking request of every holder: names the victim as survived and "
                 "dropped at once",
        protocol="R1: a client refuses a request whose survivor and dropped lists "
                 "intersect and aborts; it reveals at most one share per peer, ever")
@pytest.mark.parametrize("security", ["semi-honest", "malicious"])
def test_request_for_both_shares_of_the_victim_makes_every_holder_abort(security: str) -> None:
    p = Puppeteer(config(security))
    p.honest_until_masked_input()
    everyone = set(p.roster)
    signed_survivor_lists(p, dict.fromkeys(p.roster, everyone))
    for holder in p.roster:
        if holder != VICTIM:
            p.deliver(holder, p.unmask_request(holder, everyone, {VICTIM}))
    assert set(p.aborts) == everyone - {VICTIM}
    assert not p.unmasking
    assert all(p.clients[h].revealed == {} for h in p.roster)
    assert_input_hidden(p, VICTIM)


@threat(attack="Ask for both shares of one client (Flower SecAgg+ attack)",
        adversary="malicious server",
        controls="two follow-up requests to each holder: first 'victim survived', then "
                 "'victim dropped'",
        protocol="a client answers one unmasking request only (done), redeliveries get the "
                 "same bytes back (P4, P6)")
@pytest.mark.parametrize("security", ["semi-honest", "malicious"])
def test_second_request_with_the_other_share_is_refused(security: str) -> None:
    p = Puppeteer(config(security))
    p.honest_until_masked_input()
    everyone = set(p.roster)
    signed_survivor_lists(p, dict.fromkeys(p.roster, everyone))
    for holder in p.roster:
        p.deliver(holder, p.unmask_request(holder, everyone))
    answered = len(p.unmasking)
    for holder in p.roster:
        if holder != VICTIM:
            p.deliver(holder, p.unmask_request(holder, everyone - {VICTIM}, {VICTIM}))
    assert len(p.unmasking) == answered == N
    assert set(p.refusals) == everyone - {VICTIM}
    assert not any(msg.masking_key_shares for msg in p.unmasking)
    assert_input_hidden(p, VICTIM)


# ============================================================================================
# two groups, two survivor lists
# ============================================================================================


@threat(attack="Tell two groups of clients different survivor lists",
        adversary="malicious server",
        controls="group A is told the victim dropped (to get masking-key shares), group B "
                 "and the victim that it survived (to get self-mask-seed shares)",
        protocol="t > n/2: two disjoint groups of t holders do not exist; malicious mode: "
                 "a client unmasks only with t signatures over the list it signed itself "
                 "(M1-M4), and t > 2n/3 signers cannot sign two lists")
@pytest.mark.parametrize("security", ["semi-honest", "malicious"])
@pytest.mark.parametrize("group_a", [(2, 3, 4), (2, 3)])
def test_victim_survived_for_one_group_and_dropped_for_the_other(security: str,
                                                                 group_a: tuple[int, ...]
                                                                 ) -> None:
    p = Puppeteer(config(security))
    p.honest_until_masked_input()
    everyone = set(p.roster)
    a = set(group_a)
    lists = {cid: (everyone - {VICTIM} if cid in a else everyone) for cid in p.roster}
    signed_survivor_lists(p, lists)
    for holder in p.roster:
        survivors = lists[holder]
        # the server's best: every signature it holds, whichever list it is over
        p.deliver(holder, p.unmask_request(holder, survivors, everyone - survivors,
                                           signatures=None))
    seed_holders = {m.client_id for m in p.unmasking if VICTIM in m.self_mask_shares}
    key_holders = {m.client_id for m in p.unmasking if VICTIM in m.masking_key_shares}
    assert not (len(seed_holders) >= p.t and len(key_holders) >= p.t)
    if security == "malicious":
        assert len(p.unmasking) == 0 or not key_holders
    assert_input_hidden(p, VICTIM)


# ============================================================================================
# isolate the victim
# ============================================================================================


@threat(attack="Isolate one victim by declaring every other client dropped",
        adversary="malicious server",
        controls="the survivor/dropped lists: everyone but the victim (and the recipient) "
                 "is declared dropped",
        protocol="R4/S3/M4: a client aborts when fewer than t of its holders survived")
@pytest.mark.parametrize("security", ["semi-honest", "malicious"])
def test_everyone_but_the_victim_declared_dropped(security: str) -> None:
    p = Puppeteer(config(security))
    p.honest_until_masked_input()
    everyone = set(p.roster)
    lists = {cid: {cid, VICTIM} for cid in p.roster}
    signed_survivor_lists(p, lists)
    for holder in p.alive():
        p.deliver(holder, p.unmask_request(holder, lists[holder], everyone - lists[holder]))
    assert set(p.aborts) == everyone
    assert not p.unmasking
    assert_input_hidden(p, VICTIM)


@threat(attack="Isolate one victim by declaring every other client dropped",
        adversary="malicious server",
        controls="which ciphertexts reach the victim (only t-1 peers), and per-holder "
                 "views: the victim's peers are 'dropped' for the other holders but "
                 "'survived' for the victim",
        protocol="malicious mode: each holder unmasks only after t signatures over the same "
                 "survivor list, so the victim's peers cannot be both in and out; "
                 "semi-honest mode has no defence (9.2)")
@pytest.mark.parametrize("security", modes_with_semi_honest_known(
    "documented non-guarantee (docs/protocol.md 4.4, 9.2): semi-honest mode is secure "
    "against an honest-but-curious server only; an active server never asks one holder for "
    "both shares of one client but takes b_v from one group and s_w of each of the "
    "victim's t-1 peers from another; malicious mode's signed survivor list stops it"))
def test_victims_peers_declared_dropped_to_everyone_else(security: str) -> None:
    """The server forwards the victim only t-1 ciphertexts (peers P), so the victim masks
    with P only; the holders outside P are told P dropped (they reveal s_w for w in P)
    while the victim and the others are told the victim survived (b_v)."""
    cfg = config(security)
    p = Puppeteer(cfg)
    t = p.t
    everyone = set(p.roster)
    p.advertise()
    for cid in p.roster:
        p.deliver(cid, p.key_list(cid))
    peers = set(sorted(everyone - {VICTIM})[: t - 1])
    for cid in p.roster:
        p.deliver(cid, p.ciphertexts(cid, peers if cid == VICTIM else None))
    others = everyone - peers - {VICTIM}
    # who tells whom what: the victim sees everyone alive; each other holder sees the
    # victim alive and as many of P dropped as its t survivors allow
    views: dict[int, tuple[set[int], set[int]]] = {
        VICTIM: (peers | {VICTIM}, set())}
    for holder in sorted(everyone - {VICTIM}):
        mine = p.peers_of(holder) | {holder}
        keep = {holder, VICTIM} | (others & mine)
        candidates = sorted(mine - keep - peers)
        for extra in [*candidates, *sorted(peers - {holder})]:
            if len(keep) >= t:
                break
            keep.add(extra)
        views[holder] = (keep & mine, mine - keep)
    signed_survivor_lists(p, {cid: views[cid][0] for cid in p.roster})
    for holder in p.alive():
        survivors, dropped = views[holder]
        p.deliver(holder, p.unmask_request(holder, survivors, dropped))
    recovery = recover_input(p, VICTIM)
    assert_input_hidden(p, VICTIM, recovery)
    assert security == "malicious"


# ============================================================================================
# public keys: substitution, duplication, omission, low-order and malformed points
# ============================================================================================


@threat(attack="Substitute public keys (man in the middle)",
        adversary="malicious server",
        controls="the key list sent to the victim: every peer's keys replaced by keys the "
                 "server generated",
        protocol="malicious mode: K6, each entry's Ed25519 signature over (sid, C, S, "
                 "commitment) must verify under the peer's long-term key; semi-honest mode "
                 "authenticates nobody (9.2)")
@pytest.mark.parametrize("security", modes_with_semi_honest_known())
def test_every_peer_key_replaced_by_the_servers(security: str) -> None:
    p = Puppeteer(config(security))
    p.advertise()
    fake = {w: p.plant_fake(VICTIM, w) for w in p.roster if w != VICTIM}
    p.deliver(VICTIM, p.key_list(VICTIM, replace=fake))
    for cid in p.roster:
        if cid != VICTIM:
            p.deliver(cid, p.key_list(cid))
    if VICTIM not in p.aborts:
        # the victim's ciphertexts go to the server's fake peers, which 'answer' with
        # ciphertexts sealed under the server's keys
        p.deliver(VICTIM, p.forged_ciphertexts(VICTIM))
    assert_input_hidden(p, VICTIM)
    assert VICTIM in p.aborts and VICTIM not in p.masked


@threat(attack="Duplicate public keys",
        adversary="malicious server",
        controls="the key list: a peer's entry carries the victim's own key, or another "
                 "peer's key, or one key for both purposes",
        protocol="K4: no 32-byte key may occur twice in a key list; the client aborts")
@pytest.mark.parametrize("security", ["semi-honest", "malicious"])
@pytest.mark.parametrize("how", ["victims_masking_key", "victims_encryption_key",
                                 "other_peers_key", "same_key_twice_in_one_entry"])
def test_duplicated_public_key_makes_the_victim_abort(security: str, how: str) -> None:
    p = Puppeteer(config(security))
    p.advertise()
    own, peer, other = p.entry(VICTIM), p.entry(2), p.entry(3)
    bad = {
        "victims_masking_key": KeyEntry(peer.encryption_key, own.masking_key,
                                        peer.self_mask_commitment, peer.signature),
        "victims_encryption_key": KeyEntry(own.encryption_key, peer.masking_key,
                                           peer.self_mask_commitment, peer.signature),
        "other_peers_key": KeyEntry(peer.encryption_key, other.masking_key,
                                    peer.self_mask_commitment, peer.signature),
        "same_key_twice_in_one_entry": KeyEntry(peer.masking_key, peer.masking_key,
                                                peer.self_mask_commitment, peer.signature),
    }[how]
    p.deliver(VICTIM, p.key_list(VICTIM, replace={2: bad}))
    assert VICTIM in p.aborts
    assert VICTIM not in p.share_keys
    assert_input_hidden(p, VICTIM)


@threat(attack="Duplicate public keys",
        adversary="malicious client",
        controls="its own advertisement: another client's public key with bit 255 set "
                 "(the same X25519 point, different bytes)",
        protocol="only canonical key encodings are accepted (bit 255 clear, u < p), so "
                 "byte comparison is point comparison")
@pytest.mark.parametrize("security", ["semi-honest", "malicious"])
def test_key_alias_with_bit_255_set_is_refused_as_duplicate(security: str) -> None:
    from adversary import AttackSucceeded

    from secagg import Server
    from secagg.messages import AdvertiseKeys

    p = Puppeteer(config(security))
    server = Server(p.config, roster=p.roster, context=p.context, verify_keys=p.verify_keys,
                    nonce=p.round_nonce)
    p.advertise()
    server.receive(VICTIM, p.adverts[VICTIM])
    copier = 2
    alias = p.adverts[VICTIM].masking_key[:31] + bytes([p.adverts[VICTIM].masking_key[31] | 0x80])
    # X25519 itself ignores bit 255: the alias is the same point as S_victim ...
    from cryptography.hazmat.primitives.asymmetric.x25519 import (
        X25519PrivateKey,
        X25519PublicKey,
    )
    probe = X25519PrivateKey.generate()
    assert probe.exchange(X25519PublicKey.from_public_bytes(alias)) == probe.exchange(
        X25519PublicKey.from_public_bytes(p.adverts[VICTIM].masking_key))
    # ... which the protocol refuses as a non-canonical encoding
    with pytest.raises(CryptoError, match="canonical"):
        KeyPair().exchange(alias)
    mine = p.adverts[copier]
    entry = KeyEntry(mine.encryption_key, alias, mine.self_mask_commitment)
    signature = b""
    if security == "malicious":
        from secagg.client import advertisement_transcript

        signature = p.signing[copier].sign(advertisement_transcript(p.session_id, copier,
                                                                    entry, p.nonce))
    forged = AdvertiseKeys(p.session_id, copier, mine.encryption_key, alias,
                           mine.self_mask_commitment, signature)
    try:
        server.receive(copier, forged)
    except ProtocolError:
        return
    raise AttackSucceeded("the server accepted client 2 advertising client 1's masking key "
                          "(bit 255 alias) as its own")


@threat(attack="Omit public keys",
        adversary="malicious server",
        controls="the key list: peers left out, down to exactly t entries or below",
        protocol="K3: at least t entries, else abort; with t or more the victim shares "
                 "t-of-#KL, so omission only shrinks the holder set")
@pytest.mark.parametrize("security", ["semi-honest", "malicious"])
@pytest.mark.parametrize("below", [False, True])
def test_key_list_with_omitted_peers(security: str, below: bool) -> None:
    p = Puppeteer(config(security))
    t = p.t
    kept = set(p.roster[: t - 1 if below else t])
    p.honest_until_masked_input()  # the others run honestly
    q = Puppeteer(p.config, inputs=p.inputs, seed=1)
    q.advertise()
    q.deliver(VICTIM, q.key_list(VICTIM, kept))
    for cid in q.roster:
        if cid != VICTIM:
            q.deliver(cid, q.key_list(cid))
    for cid in q.alive():
        q.deliver(cid, q.ciphertexts(cid, kept if cid == VICTIM else None))
    if below:
        assert VICTIM in q.aborts and VICTIM not in q.masked
    else:
        assert VICTIM in q.masked
        assert set(q.share_keys[VICTIM].ciphertexts) == kept - {VICTIM}
        everyone = set(q.roster)
        signed_survivor_lists(q, dict.fromkeys(q.roster, everyone))
        for cid in q.alive():
            mine = q.peers_of(cid) | {cid}
            q.deliver(cid, q.unmask_request(cid, mine))
    assert_input_hidden(q, VICTIM)


SMALL_ORDER = (
    bytes(32),
    b"\x01" + bytes(31),
    bytes.fromhex("e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800"),
    bytes.fromhex("5f9c95bca3508c24b1d0b1559c83ef5b04445cc4581c8e86d8224eddd09f1157"),
    bytes.fromhex("ecffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f"),
    bytes.fromhex("edffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f"),
    bytes.fromhex("eeffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f"),
    bytes.fromhex("e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b880"),
    bytes.fromhex("0100000000000000000000000000000000000000000000000000000000000080"),
)


@threat(attack="Low-order or malformed public points",
        adversary="malicious server",
        controls="a peer's key in the victim's key list: a small-order point (order 1, 2, "
                 "4, 8, incl. non-canonical encodings) or a key of the wrong length",
        protocol="5.6: small-order keys are rejected before any exchange (abort); a wrong "
                 "length does not decode (ProtocolError, no state change)")
@pytest.mark.parametrize("security", ["semi-honest", "malicious"])
@pytest.mark.parametrize("which", ["encryption", "masking"])
@pytest.mark.parametrize("point", range(len(SMALL_ORDER)))
def test_small_order_peer_key_makes_the_victim_abort(security: str, which: str,
                                                     point: int) -> None:
    p = Puppeteer(config(security))
    p.advertise()
    peer = p.entry(2)
    key = SMALL_ORDER[point]
    bad = (KeyEntry(key, peer.masking_key, peer.self_mask_commitment, peer.signature)
           if which == "encryption" else
           KeyEntry(peer.encryption_key, key, peer.self_mask_commitment, peer.signature))
    p.deliver(VICTIM, p.key_list(VICTIM, replace={2: bad}))
    assert VICTIM in p.aborts and VICTIM not in p.share_keys
    assert_input_hidden(p, VICTIM)


@threat(attack="Low-order or malformed public points",
        adversary="malicious server",
        controls="a peer's key of 31 or 33 bytes",
        protocol="the decoder rejects it (DecodeError): no state change, the honest key "
                 "list still works")
@pytest.mark.parametrize("security", ["semi-honest", "malicious"])
@pytest.mark.parametrize("length", [31, 33])
def test_malformed_peer_key_is_refused_without_state_change(security: str, length: int) -> None:
    import msgpack

    from secagg import encode

    p = Puppeteer(config(security))
    p.honest_until_masked_input([c for c in p.roster if c != VICTIM])
    p.advertise([VICTIM])
    honest = p.key_list(VICTIM)
    obj = msgpack.unpackb(encode(honest), raw=False, strict_map_key=False)
    obj[4][2][1] = (obj[4][2][1] * 2)[:length]
    before = p.clients[VICTIM].stage
    p.deliver(VICTIM, msgpack.packb(obj, use_bin_type=True))
    assert VICTIM in p.refusals and VICTIM not in p.aborts
    assert p.clients[VICTIM].stage is before and p.clients[VICTIM].aborted is None
    assert p.deliver(VICTIM, honest) is not None
    assert_input_hidden(p, VICTIM)


# ============================================================================================
# replay and the session id
# ============================================================================================


@threat(attack="Replay messages from another session or stage",
        adversary="malicious server",
        controls="delivers the victim messages of a parallel session (same roster, another "
                 "context)",
        protocol="P7: another sid aborts; labels, AEAD data and transcripts bind sid and "
                 "stage")
@pytest.mark.parametrize("security", ["semi-honest", "malicious"])
@pytest.mark.parametrize("what", ["key_list", "ciphertexts", "unmask_request"])
def test_message_of_another_session_makes_the_victim_abort(security: str, what: str) -> None:
    p = Puppeteer(config(security))
    other = Puppeteer(p.config, context=p.context + b"|parallel", inputs=p.inputs)
    other.honest_until_masked_input()
    everyone = set(p.roster)
    signed_survivor_lists(other, dict.fromkeys(other.roster, everyone))
    if what == "key_list":
        p.advertise()
        p.deliver(VICTIM, next(raw for cid, raw in other.delivered if cid == VICTIM))
    elif what == "ciphertexts":
        p.advertise()
        p.deliver(VICTIM, p.key_list(VICTIM))
        p.deliver(VICTIM, [raw for cid, raw in other.delivered if cid == VICTIM][1])
    else:
        p.honest_until_masked_input()
        signed_survivor_lists(p, dict.fromkeys(p.roster, everyone))
        p.deliver(VICTIM, other.unmask_request(VICTIM, everyone))
    assert VICTIM in p.aborts, p.refusals
    assert not any_unmasking_from(p, VICTIM)
    if VICTIM in p.masked:  # the attacker then asks the others honestly
        for cid in p.alive():
            p.deliver(cid, p.unmask_request(cid, everyone - {VICTIM}, {VICTIM}))
    assert_input_hidden(p, VICTIM)


@threat(attack="Replay messages from another session or stage",
        adversary="malicious server",
        controls="re-sends the victim an older message of this session at a later stage",
        protocol="idempotency on wire bytes: the victim answers with the byte-identical "
                 "reply it sent before (nothing new), any other out-of-stage message aborts "
                 "(P8)")
@pytest.mark.parametrize("security", ["semi-honest", "malicious"])
@pytest.mark.parametrize("which", [0, 1])
def test_older_message_replayed_later_yields_nothing_new(security: str, which: int) -> None:
    p = Puppeteer(config(security))
    p.honest_until_masked_input()
    everyone = set(p.roster)
    signed_survivor_lists(p, dict.fromkeys(p.roster, everyone))
    mine = [raw for cid, raw in p.delivered if cid == VICTIM]
    replies = [raw for cid, raw in p.received if cid == VICTIM][1:]
    before = len(p.received)
    p.deliver(VICTIM, mine[which])
    assert VICTIM not in p.aborts
    assert p.received[before:] == [(VICTIM, replies[which])]
    stale = KeyList(p.session_id, VICTIM, {})  # a *different* stale message aborts
    p.deliver(VICTIM, stale)
    assert VICTIM in p.aborts
    for cid in p.alive():
        p.deliver(cid, p.unmask_request(cid, everyone - {VICTIM}, {VICTIM}))
    assert_input_hidden(p, VICTIM)


@threat(attack="A session id the server chose",
        adversary="malicious server",
        controls="the session: it runs the round under a context of its choosing, or puts a "
                 "session id of its choosing into the messages",
        protocol="section 2: every party derives sid = H(config, roster, context) itself; "
                 "no sid is ever adopted from the wire; a message with another sid aborts "
                 "(P7)")
@pytest.mark.parametrize("security", ["semi-honest", "malicious"])
@pytest.mark.parametrize("how", ["server_context", "zero_sid", "sid_of_victims_choice"])
def test_server_chosen_session_id_is_refused(security: str, how: str) -> None:
    p = Puppeteer(config(security))
    p.advertise()
    if how == "server_context":
        rogue = Puppeteer(p.config, context=b"server-picked-context")
        rogue.advertise()
        sid = rogue.session_id
    elif how == "zero_sid":
        sid = bytes(32)
    else:
        sid = bytes(reversed(p.session_id))
    for cid in p.roster:
        p.deliver(cid, p.key_list(cid, session_id=sid))
    assert set(p.aborts) == set(p.roster)
    assert not p.share_keys
    assert_input_hidden(p, VICTIM)


# ============================================================================================
# a threshold or graph below the safe minimum
# ============================================================================================


@threat(attack="A threshold or neighbour graph below the safe minimum",
        adversary="malicious server",
        controls="the configuration it proposes: t at or below n/2 (2n/3 malicious), a "
                 "neighbourhood too small for the declared dropout/corruption rates",
        protocol="Config raises ValueError naming a safe value (4.4, 4.5)")
@pytest.mark.parametrize(("n", "t", "security", "k", "rates"), [
    (7, 3, "semi-honest", None, None),
    (7, 4, "malicious", None, None),
    (100, 50, "semi-honest", None, None),
    (100, 66, "malicious", None, None),
    (50, 4, "semi-honest", 7, (0.1, 0.1)),
    (50, 6, "malicious", 9, (0.0, 0.1)),
    (50, 5, "semi-honest", 5, (0.1, 0.1)),
])
def test_config_refuses_an_unsafe_threshold(n: int, t: int, security: str, k: int | None,
                                            rates: tuple[float, float] | None) -> None:
    kw: dict[str, object] = {}
    if rates is not None:
        kw = {"dropout_rate": rates[0], "corrupt_rate": rates[1]}
    with pytest.raises(ValueError, match=r"threshold|neighbors"):
        Config(num_clients=n, threshold=t, security=security, neighbors=k, **kw)  # type: ignore[arg-type]


@threat(attack="A threshold or neighbour graph below the safe minimum",
        adversary="malicious server",
        controls="behaves as if t were one lower: a key list, ciphertexts, survivor list, "
                 "unmasking request or signature set with t-1 members",
        protocol="the client enforces its own t at every stage (K3, C3, S3, R4, M4) and "
                 "aborts; its polynomials always have degree t-1")
@pytest.mark.parametrize("security", ["semi-honest", "malicious"])
@pytest.mark.parametrize("stage", ["key_list", "ciphertexts", "survivor_list",
                                   "unmask_request", "signatures"])
def test_client_enforces_its_threshold_against_a_lower_one(security: str, stage: str) -> None:
    if security == "semi-honest" and stage in ("survivor_list", "signatures"):
        pytest.skip("no survivor list or signatures in semi-honest mode")
    p = Puppeteer(config(security))
    t = p.t
    few = set(p.roster[: t - 1])
    p.advertise()
    if stage == "key_list":
        p.deliver(VICTIM, p.key_list(VICTIM, few))
    else:
        for cid in p.roster:
            p.deliver(cid, p.key_list(cid))
        if stage == "ciphertexts":
            p.deliver(VICTIM, p.ciphertexts(VICTIM, few - {VICTIM} - {max(few)}))
        else:
            for cid in p.roster:
                p.deliver(cid, p.ciphertexts(cid))
            everyone = set(p.roster)
            if stage == "survivor_list":
                p.deliver(VICTIM, p.survivor_list(VICTIM, few))
            else:
                signed_survivor_lists(p, dict.fromkeys(p.roster, everyone))
                if stage == "unmask_request":
                    p.deliver(VICTIM, p.unmask_request(VICTIM, few, everyone - few))
                else:
                    sigs = {s: p.signatures[s] for s in sorted(p.signatures)[: t - 1]}
                    p.deliver(VICTIM, p.unmask_request(VICTIM, everyone, signatures=sigs))
    assert VICTIM in p.aborts
    assert not any_unmasking_from(p, VICTIM)
    assert_input_hidden(p, VICTIM)
    # shares are t-of-#holders: t-1 of them (all the other holders' views) interpolate to
    # something that fails the commitment check
    if stage not in ("key_list",) and VICTIM in p.share_keys:
        assert len(p.share_keys[VICTIM].ciphertexts) == N - 1


# ============================================================================================
# different models for different clients
# ============================================================================================


@threat(attack="Send different models to different clients",
        adversary="malicious server",
        controls="which model (hence which model hash in the context) each client trains "
                 "on: a crafted model for the victim only",
        protocol="the caller binds the model hash into the context, so the victim derives "
                 "another sid: every message of the honest session aborts it, and its "
                 "ciphertexts do not open under the others' sid")
@pytest.mark.parametrize("security", ["semi-honest", "malicious"])
@pytest.mark.parametrize("victim_sid", ["others", "victims"])
def test_victim_on_another_model_cannot_join_the_round(security: str, victim_sid: str) -> None:
    contexts = {VICTIM: b"round-3|model=sha256:trap"}
    p = Puppeteer(config(security), context=b"round-3|model=sha256:honest",
                  contexts=contexts)
    victims = Puppeteer(p.config, context=contexts[VICTIM])
    assert p.clients[VICTIM].session_id == victims.session_id != p.session_id
    p.advertise()
    sid = p.session_id if victim_sid == "others" else victims.session_id
    for cid in p.roster:
        p.deliver(cid, p.key_list(cid, session_id=sid if cid == VICTIM else None))
    if VICTIM not in p.aborts:
        # semi-honest: the victim accepted a key list under its own sid; its peers'
        # ciphertexts (under the honest sid) cannot open for it, nor its for them
        for cid in p.alive():
            msg = p.ciphertexts(cid)
            if cid == VICTIM:
                msg = type(msg)(sid, cid, msg.ciphertexts)
            p.deliver(cid, msg)
    assert VICTIM in p.aborts
    assert VICTIM not in p.masked
    assert_input_hidden(p, VICTIM)


@threat(attack="Grinding the context (SecAgg+ graph)",
        adversary="coordinator choosing the context",
        controls="the context bytes (hence sid and the SecAgg+ relabelling), chosen after "
                 "the roster is fixed",
        protocol="nothing in the protocol (9.2): the context SHOULD contain randomness the "
                 "coordinator cannot choose (committed client randomness or a public "
                 "beacon)", mode="SecAgg+")
@documented_limitation(
    "documented non-guarantee (docs/protocol.md 9.2): whoever picks the context can grind "
    "it until t Sybils surround the victim in the SecAgg+ graph")
def test_context_grinding_puts_sybils_around_the_victim() -> None:
    from adversary import AttackSucceeded

    from secagg.session import derive_session_id, session_graph

    cfg = Config(num_clients=20, neighbors=5, unchecked_graph=True)
    roster = tuple(range(1, 21))
    t = cfg.threshold
    assert t is not None
    sybils = set(range(21 - t, 21))
    for attempt in range(20_000):
        context = b"round-9|nonce=%d" % attempt
        graph = session_graph(cfg, roster, derive_session_id(cfg, roster, context))
        if sybils <= graph.closed_neighborhood(VICTIM):
            raise AttackSucceeded(f"context {context!r} (attempt {attempt + 1}) gives the "
                                  f"victim {t} Sybil holders")
