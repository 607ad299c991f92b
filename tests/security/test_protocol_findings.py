"""Findings of the independent review of ``secagg/`` (issue 9), each staged through the
public API: framing honest share holders, SecAgg+ isolation, decoder amplification,
secrets left after an abort (replay and rollback: test_protocol_replay.py)."""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Mapping

import numpy as np
import pytest
from adversary import (
    Puppeteer,
    RecordedRound,
    assert_input_hidden,
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
    t = config.threshold
    owner, colluders = 7, (1, 2)
    base = tuple(range(1, t + 1))  # the lowest ids, where the server starts
    weights = dict(zip(base, lagrange_weights(base), strict=True))
    # l_1 d_1 + l_2 d_2 = 0: the interpolation through ``base`` keeps the secret
    offsets = {1: 1, 2: (-weights[1] * pow(weights[2], -1, PRIME)) % PRIME}
    rnd = _round_with_shifted_shares(config, owner, offsets, seed_shares=True)
    _assert_nobody_honest_named(rnd, colluders, owner)


def _round_with_shifted_shares(config: Config, owner: int, offsets: Mapping[int, int], *,
                               seed_shares: bool, drop: frozenset[int] | set[int] = frozenset()
                               ) -> RecordedRound:
    """A round whose colluders (the keys of ``offsets``) add their offset to the share of
    ``owner``'s self-mask seed (or masking key) they send, signing it in malicious mode."""
    from secagg import decode

    signing = {i: SigningKey.generate() for i in range(1, config.num_clients + 1)}
    rnd = RecordedRound(config, signing, seed=5)
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


def _assert_nobody_honest_named(rnd: RecordedRound, colluders: tuple[int, ...], owner: int) -> None:
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
    before = (server.stage, server.received, server._uploads.sum.tobytes())
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(ProtocolError) as info:
            server.receive(1, hostile)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert not isinstance(info.value, ProtocolAbort)
    assert (server.stage, server.received, server._uploads.sum.tobytes()) == before
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
    rnd = RecordedRound(config, {}, seed=9)
    stages = 2 if end == "abort_before_masking" else 3
    for stage in round_stages(config)[:stages]:
        rnd.stage(stage)
        rnd.close()
    client = rnd.clients[2]
    buffers = list(client._wipeable)
    # keys, seed, share-key secrets, own shares, the plaintext input (kept until the round
    # ends: the masked input streams from it, docs/protocol.md 6.3; + the received shares
    # and the mask keys after masking)
    assert len(buffers) >= 5
    assert any(b is client._secrets.input for b in buffers)
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
