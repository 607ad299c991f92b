"""Replay across rounds (issue 9, finding 1) and rollback of a restored client, staged
through the public API: a recorded round (same config and roster, EMPTY context) replayed
into a new one by a network attacker or a malicious server, and a host that restores an
older snapshot."""

from __future__ import annotations

import numpy as np
import pytest
from adversary import (
    AttackSucceeded,
    RecordedRound,
    documented_limitation,
    rejected_without_change,
    threat,
)

from secagg import (
    Client,
    Config,
    ProtocolAbort,
    ProtocolError,
    RoundNonce,
    Server,
    SigningKey,
    Stage,
    StaleSnapshot,
    encode,
    round_stages,
)
from secagg.messages import UnmaskingShares, UnmaskRequest

pytestmark = pytest.mark.security

N, DIM, BITS = 6, 64, 32


def _two_rounds(security: str = "malicious") -> tuple[RecordedRound, RecordedRound]:
    config = Config(num_clients=N, dim=DIM, bits=BITS, security=security)
    signing = {i: SigningKey.generate() for i in range(1, N + 1)}  # long-term keys
    first = RecordedRound(config, signing, seed=1)
    first.run()
    return first, RecordedRound(config, signing, seed=2)


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
    rejected_without_change(new.server, 3, old.sent[(Stage.MASKED_INPUT, 3)])
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
    rejected_without_change(new.server, 2, old.sent[(Stage.UNMASKING, 2)])
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
    rejected_without_change(new.server, 4, old.sent[(Stage.SHARE_KEYS, 4)])


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
    rejected_without_change(new.server, 5, old.sent[(Stage.CONSISTENCY_CHECK, 5)])
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
    """A recorded advertisement is refused (the new server's round nonce is fresh), and
    nothing else of the old round verifies either: the client's recorded later messages
    are rejected, and the sum over everyone, the real client included, is exact."""
    old, new = _two_rounds()
    rejected_without_change(new.server, 3, old.sent[(Stage.ADVERTISE_KEYS, 3)])
    for stage in round_stages(new.config):
        new.stage(stage)
        if stage is Stage.SHARE_KEYS:
            with pytest.raises(ProtocolError):
                new.server.receive(3, old.sent[(Stage.SHARE_KEYS, 3)])
        new.close()
    result = new.server.result
    assert result is not None and result.included == frozenset(new.inputs)
    assert result.total.tolist() == new.expected()


@threat(attack="Replay of a recorded advertisement shuts the real client out",
        adversary="network attacker",
        controls="injects a client's advertisement from an earlier round, as that client, "
                 "before the client's own",
        protocol="every Server draws a fresh round nonce (Server.nonce) that the transport "
                 "relays and each advertisement's signature binds; a malicious-mode client "
                 "refuses to advertise before the nonce is bound, so no host can run a round "
                 "that a recorded advertisement verifies in: the replay is rejected and the "
                 "real client takes part", mode="malicious")
def test_replay_advertise_keys_is_rejected_and_the_real_client_takes_part() -> None:
    old, new = _two_rounds()
    rejected_without_change(new.server, 3, old.sent[(Stage.ADVERTISE_KEYS, 3)])
    new.run()
    result = new.server.result
    assert result is not None and result.included == frozenset(new.inputs)
    assert result.total.tolist() == new.expected()


@threat(attack="A host that forgets the round nonce",
        adversary="network attacker",
        controls="replays recorded advertisements into rounds whose host drives the state "
                 "machines without relaying Server.nonce",
        protocol="Server draws its nonce itself; a malicious-mode Client refuses to "
                 "advertise before it is bound, so the forgetful host gets an error instead of "
                 "a round a recording verifies in", mode="malicious")
def test_a_host_that_forgets_the_nonce_gets_an_error_not_a_replayable_round() -> None:
    """The fresh-round binding is not the host's duty: the server's nonce exists whether or
    not the host passes one, and a malicious-mode client that was not given it refuses to
    advertise (an unbound advertisement is what a recording could replay)."""
    config = Config(num_clients=N, dim=DIM, bits=BITS, security="malicious")
    signing = {i: SigningKey.generate() for i in range(1, N + 1)}
    verify = {i: k.public for i, k in signing.items()}
    servers = [Server(config, verify_keys=verify) for _ in range(2)]
    assert all(len(s.nonce) == 32 for s in servers) and servers[0].nonce != servers[1].nonce
    forgetful = Client(config, 1, np.zeros(DIM, dtype=np.uint64), signing_key=signing[1],
                       verify_keys=verify)
    with pytest.raises(ProtocolError, match="nonce"):
        forgetful.advertise()
    bound = forgetful.bind_nonce(servers[0].nonce)
    servers[0].receive(1, encode(bound))  # accepted once bound
    with pytest.raises(ProtocolError):
        servers[1].receive(1, encode(bound))  # and only in its own round


@threat(attack="A host that reuses a round nonce",
        adversary="network attacker",
        controls="records a client's signed advertisement in one round and replays it into "
                 "a later round whose host tries to run under the same nonce (its bytes, the "
                 "same RoundNonce, a copy or a pickle of it)",
        protocol="Server(nonce=) takes only a secagg.RoundNonce: 32 bytes drawn from "
                 "os.urandom when it is made, taken by one Server only, never made from "
                 "bytes, copied or pickled; so every round's nonce is fresh and the replayed "
                 "advertisement is rejected while the real client takes part",
        mode="malicious")
def test_a_host_cannot_reuse_a_nonce_so_a_replayed_signed_advert_never_verifies() -> None:
    import copy
    import pickle

    config = Config(num_clients=N, dim=DIM, bits=BITS, security="malicious")
    signing = {i: SigningKey.generate() for i in range(1, N + 1)}
    verify = {i: k.public for i, k in signing.items()}
    token = RoundNonce()
    first = Server(config, verify_keys=verify, nonce=token)
    old = Client(config, 3, np.zeros(DIM, dtype=np.uint64), signing_key=signing[3],
                 verify_keys=verify, nonce=token.value)
    recorded = encode(old.advertise())
    first.receive(3, recorded)  # it verifies in its own round
    # Every way a host could start the next round under the same nonce is refused.
    for reused in (token.value, token, copy.deepcopy(token), copy.copy(token)):
        with pytest.raises(ValueError, match="RoundNonce"):
            Server(config, verify_keys=verify, nonce=reused)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not pickled"):
        pickle.dumps(token)
    # What the host can build is a round under a fresh nonce: the recording is rejected and
    # the real client (bound to the new nonce) takes part.
    new = RecordedRound(config, signing, seed=2)
    assert new.server.nonce != token.value
    rejected_without_change(new.server, 3, recorded)
    new.run()
    result = new.server.result
    assert result is not None and result.included == frozenset(new.inputs)
    assert result.total.tolist() == new.expected()


# --- rollback of a restored client ---------------------------------------------------------


def _answered_round(security: str) -> tuple[RecordedRound, bytes, UnmaskRequest]:
    """Client 2 snapshotted before its unmasking request, then answered it honestly."""
    from secagg import decode

    config = Config(num_clients=N, dim=DIM, bits=BITS, security=security)
    signing = {i: SigningKey.generate() for i in range(1, N + 1)}
    rnd = RecordedRound(config, signing, seed=7)
    for stage in round_stages(config)[:-1]:
        rnd.stage(stage)
        rnd.close()
    before = rnd.clients[2].snapshot()
    request = decode(rnd.out[2])
    assert isinstance(request, UnmaskRequest)
    rnd.clients[2].handle(rnd.out[2])  # reveals the self-mask share of every survivor
    assert rnd.clients[2].revealed[1] == "self_mask"
    return rnd, before, request


def _restore(rnd: RecordedRound, data: bytes, min_stage: Stage | None) -> Client:
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
