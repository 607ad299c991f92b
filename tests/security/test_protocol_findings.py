"""The findings of the independent review of ``secagg/`` (issue 9), each staged through the
public API: replay across rounds with an empty context, framing honest share holders,
SecAgg+ isolation, decoder amplification, secrets left after an abort."""

from __future__ import annotations

import os
import time
import tracemalloc
from collections.abc import Mapping

import numpy as np
import pytest
from adversary import (
    AttackSucceeded,
    Puppeteer,
    assert_input_hidden,
    documented_limitation,
    threat,
)

from secagg import (
    Client,
    Config,
    ProtocolAbort,
    ProtocolError,
    Server,
    SigningKey,
    Stage,
    StaleSnapshot,
    encode,
    round_stages,
)
from secagg.messages import (
    MAGIC,
    KeyList,
    SurvivorList,
    UnmaskingShares,
    UnmaskRequest,
)
from secagg.shamir import PRIME, lagrange_weights
from secagg.transcripts import client_message_transcript, key_set_digest

pytestmark = pytest.mark.security

N, DIM, BITS = 6, 64, 32


class Recorded:
    """One round between a real ``Server`` and real ``Client`` objects with an EMPTY
    context, every byte recorded; stages run one at a time so a test can inject."""

    def __init__(self, config: Config, signing: Mapping[int, SigningKey], seed: int,
                 nonce: bool = False) -> None:
        self.config = config
        rng = np.random.default_rng(seed)
        self.inputs = {i: rng.integers(0, config.modulus, DIM, dtype=np.uint64)
                       for i in range(1, config.num_clients + 1)}
        verify = {i: k.public for i, k in signing.items()} if config.malicious else None
        self.server = Server(config, verify_keys=verify,
                             nonce=os.urandom(32) if nonce else None)
        self.clients = {i: Client(config, i, v, signing_key=signing.get(i), verify_keys=verify,
                                  nonce=self.server.nonce) for i, v in self.inputs.items()}
        self.sent: dict[tuple[Stage, int], bytes] = {}
        self.got: dict[tuple[Stage, int], bytes] = {}
        self.out: dict[int, bytes] = {}
        self.rejected: dict[int, ProtocolError] = {}

    def stage(self, stage: Stage, skip: frozenset[int] | set[int] = frozenset()) -> None:
        for cid, client in self.clients.items():
            if cid in skip:
                continue
            if stage is Stage.ADVERTISE_KEYS:
                raw = encode(client.advertise())
            elif cid in self.out:
                self.got[(stage, cid)] = self.out[cid]
                try:
                    raw = encode(client.handle(self.out[cid]))
                except ProtocolAbort:
                    continue
            else:
                continue
            self.sent[(stage, cid)] = raw
            try:
                self.server.receive(cid, raw)
            except ProtocolError as exc:  # the server rejected it: the client sits out
                self.rejected[cid] = exc

    def close(self) -> None:
        self.out = {cid: encode(m) for cid, m in self.server.advance().items()}

    def run(self, skip: Mapping[Stage, set[int]] | None = None) -> None:
        for stage in round_stages(self.config):
            self.stage(stage, (skip or {}).get(stage, set()))
            self.close()

    def expected(self) -> list[int]:
        result = self.server.result
        assert result is not None
        return [int(x) % self.config.modulus
                for x in sum(self.inputs[i].astype(object) for i in result.included)]


def _two_rounds(security: str = "malicious", nonce: bool = False
                ) -> tuple[Recorded, Recorded]:
    config = Config(num_clients=N, dim=DIM, bits=BITS, security=security)
    signing = {i: SigningKey.generate() for i in range(1, N + 1)}  # long-term keys
    first = Recorded(config, signing, seed=1, nonce=nonce)
    first.run()
    return first, Recorded(config, signing, seed=2, nonce=nonce)


def _rejected_without_change(server: Server, cid: int, raw: bytes) -> None:
    before = (server.stage, server.received, dict(server.dropped), server._sum.tobytes())
    with pytest.raises(ProtocolError) as info:
        server.receive(cid, raw)
    assert not isinstance(info.value, ProtocolAbort)
    assert (server.stage, server.received, dict(server.dropped),
            server._sum.tobytes()) == before


REPLAY = dict(
    attack="Replay of a recorded round into a new round with the same roster and no context",
    adversary="network attacker",
    controls="every byte of an earlier round; injects it as the client (or the server "
             "forwards it) in a new round with the same config, roster and empty context",
    protocol="every signature after the advertisement binds the digest of the round's key "
             "list (fresh X25519 keys and commitments), the survivor signature the signer's "
             "fresh advertisement, every share ciphertext both parties' advertisements: "
             "nothing from another round verifies, whatever the context",
    mode="malicious")


@threat(**REPLAY)
def test_replay_masked_input_across_rounds_rejected() -> None:
    old, new = _two_rounds()
    for stage in (Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS):
        new.stage(stage)
        new.close()
    _rejected_without_change(new.server, 3, old.sent[(Stage.MASKED_INPUT, 3)])
    for stage in round_stages(new.config)[2:]:
        new.stage(stage)
        new.close()
    assert new.server.result is not None
    assert new.server.result.total.tolist() == new.expected()


@threat(**REPLAY)
def test_replay_unmasking_shares_across_rounds_rejected_and_nobody_blamed() -> None:
    old, new = _two_rounds()
    for stage in round_stages(new.config)[:-1]:
        new.stage(stage)
        new.close()
    _rejected_without_change(new.server, 2, old.sent[(Stage.UNMASKING, 2)])
    new.stage(Stage.UNMASKING)
    new.close()
    result = new.server.result
    assert result is not None and result.total.tolist() == new.expected()
    assert not result.corrupt_shares and not result.unattributable


@threat(**REPLAY)
def test_replay_share_keys_across_rounds_rejected() -> None:
    old, new = _two_rounds()
    new.stage(Stage.ADVERTISE_KEYS)
    new.close()
    _rejected_without_change(new.server, 4, old.sent[(Stage.SHARE_KEYS, 4)])


@threat(**{**REPLAY, "adversary": "malicious server",
           "controls": "forwards a client the share ciphertexts it got in an earlier round "
                       "with the same roster and empty context"})
def test_replay_share_ciphertexts_across_rounds_abort_the_client() -> None:
    old, new = _two_rounds()
    for stage in (Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS):
        new.stage(stage)
        new.close()
    with pytest.raises(ProtocolAbort, match="AEAD"):
        new.clients[1].handle(old.got[(Stage.MASKED_INPUT, 1)])
    assert (Stage.MASKED_INPUT, 1) not in new.sent


@threat(**REPLAY)
def test_replay_consistency_signatures_across_rounds_rejected() -> None:
    """At the server, a recorded ConsistencySignature is rejected; at a client, an unmasking
    request carrying the recorded round's signatures over the same survivor list makes it
    abort without revealing a share."""
    old, new = _two_rounds()
    for stage in round_stages(new.config)[:3]:
        new.stage(stage)
        new.close()
    _rejected_without_change(new.server, 5, old.sent[(Stage.CONSISTENCY_CHECK, 5)])
    new.stage(Stage.CONSISTENCY_CHECK)
    new.close()
    from secagg import decode

    old_request = decode(old.got[(Stage.UNMASKING, 1)])
    request = decode(new.out[1])
    assert isinstance(old_request, UnmaskRequest) and isinstance(request, UnmaskRequest)
    assert old_request.survivors == request.survivors  # same list, other round's signatures
    forged = UnmaskRequest(request.session_id, 1, request.survivors, request.dropped,
                           old_request.signatures)
    with pytest.raises(ProtocolAbort, match="signature over the survivor list"):
        new.clients[1].handle(encode(forged))
    assert new.clients[1].revealed == {}


@threat(**REPLAY)
def test_replay_advertise_keys_across_rounds_unlocks_nothing() -> None:
    """A recorded advertisement verifies (it is the round's first message and carries
    nothing fresh from anyone else), but nothing else of the old round does: the client's
    recorded later messages are rejected, honest peers never mask with its stale keys,
    and the sum over the others is exact."""
    old, new = _two_rounds()
    new.server.receive(3, old.sent[(Stage.ADVERTISE_KEYS, 3)])
    for stage in round_stages(new.config):
        new.stage(stage, {3} if stage is Stage.ADVERTISE_KEYS else set())
        if stage is Stage.SHARE_KEYS:
            with pytest.raises(ProtocolError):
                new.server.receive(3, old.sent[(Stage.SHARE_KEYS, 3)])
        new.close()
    result = new.server.result
    assert result is not None and 3 not in result.included
    assert result.total.tolist() == new.expected()


@threat(**REPLAY)
def test_replay_advertise_keys_with_a_round_nonce_rejected() -> None:
    """With the server's round nonce relayed to the clients (as ``simulate`` does), the
    advertisement is fresh too: a recorded one is rejected and the real client takes
    part."""
    old, new = _two_rounds(nonce=True)
    _rejected_without_change(new.server, 3, old.sent[(Stage.ADVERTISE_KEYS, 3)])
    new.run()
    result = new.server.result
    assert result is not None and result.included == frozenset(new.inputs)
    assert result.total.tolist() == new.expected()


@threat(attack="Replay of a recorded advertisement shuts the real client out",
        adversary="network attacker",
        controls="injects a client's advertisement from an earlier round, as that client, "
                 "before the client's own",
        protocol="without a round nonce nothing fresh exists before the first message: the "
                 "server keeps the first valid advertisement per client, so the real client is "
                 "excluded from this round (denial of service); relaying Server.nonce to the "
                 "clients (Client(nonce=...)) or sender authentication by the transport stops "
                 "it", mode="malicious",
        shows="limitation")
@documented_limitation("docs/protocol.md 9.2: without the server's round nonce an "
                       "advertisement carries nothing fresh; a replayed one that arrives first "
                       "excludes the real client from the round (nothing else of the old "
                       "round verifies)")
def test_replay_advertise_keys_shuts_the_real_client_out() -> None:
    old, new = _two_rounds()
    new.server.receive(3, old.sent[(Stage.ADVERTISE_KEYS, 3)])
    new.run()
    result = new.server.result
    assert result is not None
    if 3 not in result.included:
        raise AttackSucceeded("the replayed advertisement excluded client 3 from the round")


# --- framing honest share holders ----------------------------------------------------------


@threat(attack="Colluding share holders frame honest holders with offset shares",
        adversary="malicious client",
        controls="two holders send self-mask shares of one client shifted so that the "
                 "polynomial through the lowest ids still reconstructs the committed seed",
        protocol="a holder is named only when the shares decode uniquely (at most (m-t)/2 "
                 "off the verified polynomial); otherwise the secret is reported "
                 "unattributable and nobody is named", mode="both")
@pytest.mark.parametrize("security", ["semi-honest", "malicious"])
def test_colluding_holders_with_offset_shares_cannot_frame_honest_holders(
        security: str) -> None:
    config = Config(num_clients=7, threshold=5 if security == "malicious" else 4, dim=DIM,
                    bits=BITS, security=security)
    t = config.threshold or 0
    owner, colluders = 7, (1, 2)
    base = tuple(range(1, t + 1))  # the lowest ids, where the server starts
    weights = dict(zip(base, lagrange_weights(base), strict=True))
    # l_1 d_1 + l_2 d_2 = 0: the interpolation through ``base`` keeps the secret
    offsets = {1: 1, 2: (-weights[1] * pow(weights[2], -1, PRIME)) % PRIME}
    rnd = _round_with_shifted_shares(config, owner, offsets, seed_shares=True)
    _assert_nobody_honest_named(rnd, colluders, owner)


def _round_with_shifted_shares(config: Config, owner: int, offsets: Mapping[int, int], *,
                               seed_shares: bool, drop: frozenset[int] | set[int] = frozenset()
                               ) -> Recorded:
    """A round whose colluders (the keys of ``offsets``) add their offset to the share of
    ``owner``'s self-mask seed (or masking key) they send, signing it in malicious mode."""
    from secagg import decode

    signing = {i: SigningKey.generate() for i in range(1, config.num_clients + 1)}
    rnd = Recorded(config, signing, seed=5)
    for stage in round_stages(config)[:-1]:
        rnd.stage(stage, drop if stage is Stage.MASKED_INPUT else set())
        rnd.close()
    for cid in sorted(rnd.out):
        reply = rnd.clients[cid].handle(rnd.out[cid])
        assert isinstance(reply, UnmaskingShares)
        if cid in offsets:
            seeds, keys = dict(reply.self_mask_shares), dict(reply.masking_key_shares)
            shares = seeds if seed_shares else keys
            value = (int.from_bytes(shares[owner], "big") + offsets[cid]) % PRIME
            shares[owner] = value.to_bytes(33, "big")
            reply = UnmaskingShares(reply.session_id, cid, seeds, keys)
            if config.malicious:  # a corrupt client signs whatever it sends
                key_list = decode(rnd.got[(Stage.SHARE_KEYS, cid)])
                assert isinstance(key_list, KeyList)
                key_set = key_set_digest(reply.session_id, dict(key_list.keys))
                reply = UnmaskingShares(reply.session_id, cid, seeds, keys, signing[cid].sign(
                    client_message_transcript(reply, key_set)))
        rnd.server.receive(cid, encode(reply))
    rnd.close()
    return rnd


def _assert_nobody_honest_named(rnd: Recorded, colluders: tuple[int, ...], owner: int) -> None:
    result = rnd.server.result
    assert result is not None
    assert result.total.tolist() == rnd.expected()  # the true secret still verified
    honest = set(rnd.clients) - set(colluders)
    framed = honest & set(result.corrupt_shares)
    assert not framed, f"honest holders {sorted(framed)} were named"
    assert owner in result.unattributable


@threat(attack="Colluding share holders frame honest holders through X25519's ignored bits",
        adversary="malicious client",
        controls="two holders shift their shares of a dropped client's masking key by a "
                 "polynomial h with h(0) = 2^248 (a bit X25519 clamps away) that vanishes at "
                 "t-1 honest holders, so the shifted key maps to the advertised public key",
        protocol="masking keys are generated and accepted only in canonical clamped form, "
                 "where X25519 is one-to-one: the shifted value does not verify",
        mode="both")
@pytest.mark.parametrize("security", ["semi-honest", "malicious"])
def test_colluders_shifting_a_masking_key_by_x25519_ignored_bits_cannot_frame_honest_holders(
        security: str) -> None:
    n, t = (8, 5) if security == "semi-honest" else (10, 7)
    config = Config(num_clients=n, threshold=t, dim=DIM, bits=BITS, security=security)
    victim, colluders = n, (1, 2)
    holders = [c for c in range(1, n + 1) if c != victim]
    zeros = [h for h in holders if h not in colluders][:t - 1]

    def h(x: int) -> int:  # h(0) = 2^248, h(z) = 0 at t-1 honest holders
        num = den = 1
        for z in zeros:
            num, den = num * (x - z) % PRIME, den * (0 - z) % PRIME
        return (1 << 248) * num * pow(den, -1, PRIME) % PRIME

    rnd = _round_with_shifted_shares(config, victim, {c: h(c) for c in colluders},
                                     seed_shares=False, drop={victim})
    _assert_nobody_honest_named(rnd, colluders, victim)


# --- rollback of a restored client ---------------------------------------------------------


def _answered_round(security: str) -> tuple[Recorded, bytes, UnmaskRequest]:
    """Client 2 snapshotted before its unmasking request, then answered it honestly."""
    from secagg import decode

    config = Config(num_clients=N, dim=DIM, bits=BITS, security=security)
    signing = {i: SigningKey.generate() for i in range(1, N + 1)}
    rnd = Recorded(config, signing, seed=7)
    for stage in round_stages(config)[:-1]:
        rnd.stage(stage)
        rnd.close()
    before = rnd.clients[2].snapshot()
    request = decode(rnd.out[2])
    assert isinstance(request, UnmaskRequest)
    rnd.clients[2].handle(rnd.out[2])  # reveals the self-mask share of every survivor
    assert rnd.clients[2].revealed[1] == "self_mask"
    return rnd, before, request


def _restore(rnd: Recorded, data: bytes, min_stage: Stage | None) -> Client:
    cid = 2
    verify = dict(rnd.clients[cid]._verify_keys) or None  # the node's copy of the PKI
    return Client.restore(data, config=rnd.config, client_id=cid, min_stage=min_stage,
                          signing_key=rnd.clients[cid]._signing_key, verify_keys=verify)


ROLLBACK = dict(
    attack="Rollback: a client restored from an earlier snapshot is asked again",
    adversary="malicious server",
    controls="the host restores a snapshot taken before the client's unmasking answer "
             "(lost write, concurrent handling); the server then asks for the masking-key "
             "share of a peer whose self-mask share it already got",
    protocol="Client.restore(min_stage=) refuses a snapshot from before the stage the host "
             "recorded for the session (secagg/resume.py: the host's duty)", mode="both")


@threat(**ROLLBACK)
@pytest.mark.parametrize("security", ["semi-honest", "malicious"])
def test_rollback_to_an_earlier_snapshot_is_refused_with_the_hosts_stage_record(
        security: str) -> None:
    rnd, before, _ = _answered_round(security)
    recorded = rnd.clients[2].stage  # the host's record, kept outside the snapshot store
    assert recorded is Stage.UNMASKING
    with pytest.raises(StaleSnapshot, match="roll the round back"):
        _restore(rnd, before, min_stage=recorded)
    latest = _restore(rnd, rnd.clients[2].snapshot(), min_stage=recorded)
    assert latest.done and latest.revealed == rnd.clients[2].revealed


@threat(**{**ROLLBACK, "controls": ROLLBACK["controls"] + "; the host keeps no stage record",
           "protocol": "none: the one-share-per-peer guard lives in the snapshot, so a host "
                       "that restores an older one gives it up (its duty, secagg/resume.py)",
           "mode": "semi-honest"}, shows="limitation")
@documented_limitation("secagg/resume.py, docs/protocol.md 3.2: a host that restores an "
                       "older snapshot without min_stage lets the server ask again and "
                       "obtain both shares of a peer")
def test_rollback_without_the_hosts_stage_record_reveals_both_shares() -> None:
    rnd, before, request = _answered_round("semi-honest")
    restored = _restore(rnd, before, min_stage=None)
    survivors = tuple(c for c in request.survivors if c != 1)
    reply = restored.handle(encode(UnmaskRequest(request.session_id, 2, survivors, (1,))))
    assert isinstance(reply, UnmaskingShares)
    if 1 in reply.masking_key_shares:
        raise AttackSucceeded("the restored client revealed client 1's masking-key share "
                              "after it had revealed its self-mask share")


# --- SecAgg+ isolation ----------------------------------------------------------------------


ISOLATION = dict(
    attack="SecAgg+ isolation: a survivor cut off from its honest neighbours by dropouts",
    adversary="honest-but-curious server + colluding clients",
    controls="follows the protocol; the victim's graph neighbours are t-1 colluders and two "
             "honest clients that drop after share_keys (neighbors=5, 12 clients)",
    protocol="before revealing a dropped peer's masking-key share a client checks the public "
             "graph against the survivor list: every survivor keeps at least t surviving "
             "neighbours and the survivors stay connected, else it aborts",
    mode="semi-honest")


def _sparse(victim_neighbours: bool) -> tuple[Puppeteer, int, list[int], list[int]]:
    config = Config(num_clients=12, neighbors=5, dim=512, bits=16, unchecked_graph=True)
    p = Puppeteer(config)
    victim = 1
    ring: tuple[int, ...] = p.clients[victim].graph._ring  # type: ignore[attr-defined]
    if victim_neighbours:
        near = sorted(p.clients[victim].neighborhood - {victim})
        return p, victim, near[:2], near[2:]
    start = ring.index(victim)
    block = [ring[(start + i) % 12] for i in range(3)]
    cut = [ring[(start - 1) % 12], ring[(start - 2) % 12], ring[(start + 3) % 12],
           ring[(start + 4) % 12]]
    return p, victim, block, cut


def _run_with_dropouts(p: Puppeteer, dropouts: list[int], corrupt: list[int]) -> None:
    p.advertise()
    for cid in p.roster:
        p.deliver(cid, p.key_list(cid, p.clients[cid].neighborhood))
    for cid in p.roster:
        p.deliver(cid, p.ciphertexts(cid))
    for cid in corrupt:  # colluders hand the server everything they hold
        p.corrupt(cid)
    survivors = set(p.roster) - set(dropouts)
    for cid in dropouts:
        p.masked.pop(cid, None)
    for cid in sorted(survivors):
        mine = p.peers_of(cid) | {cid}
        p.deliver(cid, UnmaskRequest(p.session_id, cid, tuple(sorted(survivors)),
                                     tuple(sorted(mine - survivors))))


@threat(**ISOLATION)
def test_secagg_plus_colluding_neighbours_and_two_dropouts_cannot_isolate_a_victim() -> None:
    p, victim, colluders, honest = _sparse(victim_neighbours=True)
    _run_with_dropouts(p, honest, colluders)
    assert p.aborts, "no client refused to unmask"
    assert_input_hidden(p, victim)


@threat(**{**ISOLATION, "adversary": "honest-but-curious server",
           "attack": "SecAgg+ isolation: four dropouts cut a block of three clients off",
           "controls": "follows the protocol; four clients drop after share_keys, exactly "
                       "the ring neighbours around a block of three (neighbors=5, 12 clients)"})
def test_secagg_plus_four_dropouts_cannot_reveal_a_block_sum() -> None:
    p, _, block, cut = _sparse(victim_neighbours=False)
    _run_with_dropouts(p, cut, [])
    revealed = {owner for msg in p.unmasking for owner in msg.masking_key_shares}
    assert not revealed & set(cut), "a dropped client's masking key was revealed"
    assert set(p.aborts) >= set(block)


@threat(attack="SecAgg+ with a neighbourhood size not derived for the deployment",
        adversary="honest-but-curious server + colluding clients",
        controls="a configuration with neighbors=k and no stated dropout or corruption rates",
        protocol="Config refuses a sparse graph without dropout_rate and corrupt_rate (checked "
                 "against Bell et al.'s bounds) unless unchecked_graph=True states that the "
                 "caller gives up the guarantee that the honest survivors stay connected",
        mode="both")
def test_config_refuses_a_sparse_graph_not_derived_for_stated_rates() -> None:
    with pytest.raises(ValueError, match="dropout_rate"):
        Config(num_clients=12, neighbors=5)
    with pytest.raises(ValueError, match="unsafe"):
        Config(num_clients=12, neighbors=5, dropout_rate=0.2, corrupt_rate=0.1)
    assert Config(num_clients=12, neighbors=5, unchecked_graph=True).neighbors == 5


# --- decoder amplification ------------------------------------------------------------------


def _hostile(sid: bytes, size: int) -> dict[str, bytes]:
    head = b"\x95\xc4\x03" + MAGIC + b"\x05\xc4\x20" + sid + b"\x01"
    return {
        # a map header claiming 2^32 - 1 entries, then small integers
        "huge_map": head + b"\xdf\xff\xff\xff\xff" + b"\x01" * size,
        # arrays nested inside arrays: 1 byte per Python list for a naive unpacker
        "nested_arrays": b"\x9f" * size,
        # a map of many tiny entries (within a naive unpacker's limits)
        "many_entries": head + b"\xdf" + (size // 2).to_bytes(4, "big")
        + b"\x01\xc4\x00" * (size // 3),
        # a masked vector of another shape, as large as the round allows
        "other_shape_vector": b"\x99\xc4\x03" + MAGIC + b"\x03\xc4\x20" + sid + b"\x01\x20"
        + b"\xce" + (size // 4).to_bytes(4, "big") + b"\xc6" + size.to_bytes(4, "big")
        + bytes(size),
    }


@threat(attack="Decoder amplification: a large hostile message",
        adversary="any sender of bytes",
        controls="8 MiB of well-formed-looking msgpack (huge counts, nested containers, "
                 "oversized vectors) within the round's size limit",
        protocol="the decoder reads the canonical msgpack subset directly, checking every "
                 "header against the bytes left and the round's limits before allocating; "
                 "typed DecodeError, nothing changes", mode="both")
@pytest.mark.parametrize("kind", ["huge_map", "nested_arrays", "many_entries",
                                  "other_shape_vector"])
def test_large_hostile_message_costs_a_small_multiple_of_its_size(kind: str) -> None:
    size = 8 << 20
    config = Config(num_clients=5, dim=size // 4 + 1024, bits=32)
    server = Server(config)
    hostile = _hostile(server.session_id, size)[kind]
    assert len(hostile) <= server.max_message_bytes()
    before = (server.stage, server.received, server._sum.tobytes())
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(ProtocolError) as info:
            server.receive(1, hostile)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert not isinstance(info.value, ProtocolAbort)
    assert (server.stage, server.received, server._sum.tobytes()) == before
    assert peak < 3 * len(hostile), f"peak {peak} bytes for a {len(hostile)}-byte message"
    assert time.perf_counter() - started < 2.0
    client = Client(Config(num_clients=5, dim=4), 1, np.zeros(4, dtype=np.uint64))
    with pytest.raises(ProtocolError):
        client.handle(hostile)
    assert client.aborted is None


# --- secrets after abort -------------------------------------------------------------------


@threat(attack="Secrets left in memory after an abort or the end of the round",
        adversary="malicious server",
        controls="makes a client abort (or lets it finish), then inspects what the client "
                 "process still holds",
        protocol="private keys, seed, input, share-key secrets and shares live in bytearray / "
                 "numpy buffers that are overwritten with zeros on abort and on finishing "
                 "(transient copies inside cryptography's objects and immutable bytes are "
                 "not: docs/protocol.md 7.1)", mode="both")
@pytest.mark.parametrize("end", ["abort_before_masking", "abort", "finish"])
def test_client_secret_buffers_are_wiped_after_abort_and_finish(end: str) -> None:
    config = Config(num_clients=5, dim=DIM, bits=BITS)
    rnd = Recorded(config, {}, seed=9)
    stages = 2 if end == "abort_before_masking" else 3
    for stage in round_stages(config)[:stages]:
        rnd.stage(stage)
        rnd.close()
    client = rnd.clients[2]
    buffers = list(client._wipeable)
    # keys, seed, share-key secrets, own shares (+ the plaintext input before masking,
    # + the received shares after)
    assert len(buffers) >= 5
    assert (client._secrets.input in buffers) == (end == "abort_before_masking")
    assert all(np.any(np.frombuffer(b, np.uint8)) if isinstance(b, bytearray) else np.any(b)
               for b in buffers)
    if end.startswith("abort"):
        with pytest.raises(ProtocolAbort):
            client.handle(encode(SurvivorList(client.session_id, 2, (1, 2, 3))))
    else:
        reply = client.handle(rnd.out[2])
        assert isinstance(reply, UnmaskingShares)
    for buffer in buffers:
        raw = buffer.tobytes() if isinstance(buffer, np.ndarray) else bytes(buffer)
        assert raw == bytes(len(raw))
