"""``Client.snapshot`` / ``Client.restore``: a client rebuilt from bytes at every stage
(as a Flower ClientApp is, per message) finishes the round with the same sum; a snapshot of
another session, client or key, or corrupted bytes, is refused with ``StaleSnapshot``."""

from __future__ import annotations

import numpy as np
import pytest

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

KEY = b"node-local snapshot key"
MODES = ["semi-honest", "malicious"]


def _parties(security: str, n: int = 5, context: bytes = b"resume"
             ) -> tuple[Config, Server, dict[int, Client], dict[int, np.ndarray], dict]:
    config = Config(num_clients=n, dim=16, bits=32, security=security)
    rng = np.random.default_rng(3)
    inputs = {i: rng.integers(0, 2**32, 16, dtype=np.uint64) for i in range(1, n + 1)}
    signing = {i: SigningKey.generate() for i in inputs} if config.malicious else {}
    verify = {i: k.public for i, k in signing.items()} if config.malicious else None
    extra = {i: {"signing_key": signing.get(i), "verify_keys": verify} for i in inputs}
    server = Server(config, context=context, verify_keys=verify)
    clients = {i: Client(config, i, v, context=context, nonce=server.nonce, **extra[i])
               for i, v in inputs.items()}
    return config, server, clients, inputs, extra


def _restore(client: Client, config: Config, extra: dict, context: bytes = b"resume"
             ) -> Client:
    return Client.restore(client.snapshot(KEY), config=config, client_id=client.client_id,
                          context=context, key=KEY, **extra[client.client_id])


@pytest.mark.parametrize("security", MODES)
def test_client_restored_before_every_message_gives_the_same_sum(security: str) -> None:
    config, server, clients, inputs, extra = _parties(security)
    for cid, client in clients.items():
        server.receive(cid, encode(client.advertise()))
    out = server.advance()
    for _ in round_stages(config)[1:]:
        for cid, msg in out.items():
            original = clients[cid]
            restored = _restore(original, config, extra)  # a fresh process per message
            assert restored.stage is original.stage
            assert restored.snapshot(KEY) == original.snapshot(KEY)
            raw = encode(msg)
            reply = restored.handle(raw)
            if original.stage >= Stage.SHARE_KEYS:  # deterministic from here on
                assert encode(original.handle(raw)) == encode(reply)
            clients[cid] = restored
            server.receive(cid, encode(reply))
        out = server.advance()
    result = server.result
    assert result is not None and result.included == frozenset(inputs)
    expected = sum(v.astype(object) for v in inputs.values())
    assert result.total.tolist() == [int(x) % 2**32 for x in expected]
    # a finished client restored from its snapshot still answers a redelivery the same way
    for client in clients.values():
        again = _restore(client, config, extra)
        assert again.done and again.snapshot(KEY) == client.snapshot(KEY)


@pytest.mark.parametrize("security", MODES)
def test_restored_client_answers_a_redelivery_byte_identically(security: str) -> None:
    config, server, clients, _, extra = _parties(security)
    for cid, client in clients.items():
        server.receive(cid, encode(client.advertise()))
    key_lists = server.advance()
    first = encode(clients[1].handle(encode(key_lists[1])))  # random shares: cached reply
    restored = _restore(clients[1], config, extra)
    assert encode(restored.handle(encode(key_lists[1]))) == first


@pytest.mark.parametrize("how", ["context", "client", "config", "key", "truncated", "flipped",
                                 "empty", "appended", "roster"])
def test_snapshot_of_another_session_client_or_corrupted_is_refused(how: str) -> None:
    config, server, clients, _, _ = _parties("semi-honest")
    for cid, client in clients.items():
        server.receive(cid, encode(client.advertise()))
    out = server.advance()
    clients[2].handle(encode(out[2]))
    data = clients[2].snapshot(KEY)
    kwargs = {"config": config, "client_id": 2, "context": b"resume", "key": KEY}
    if how == "context":
        kwargs["context"] = b"resume/round-2"
    elif how == "client":
        kwargs["client_id"] = 3
    elif how == "config":
        kwargs["config"] = Config(num_clients=5, dim=16, bits=31)
    elif how == "key":
        kwargs["key"] = b"another node's key"
    elif how == "truncated":
        data = data[:-40]
    elif how == "flipped":
        data = data[:50] + bytes([data[50] ^ 1]) + data[51:]
    elif how == "empty":
        data = b""
    elif how == "appended":
        data = data + b"\x00"
    else:
        kwargs["roster"] = [1, 2, 3, 4, 6]
    with pytest.raises(StaleSnapshot) as info:
        Client.restore(data, **kwargs)  # type: ignore[arg-type]
    assert isinstance(info.value, ProtocolError)


def test_aborted_client_restores_aborted_and_answers_nothing() -> None:
    config, server, clients, _, extra = _parties("semi-honest")
    for cid, client in clients.items():
        server.receive(cid, encode(client.advertise()))
    out = server.advance()
    bad = out[1]
    with pytest.raises(ProtocolAbort):  # the key list of client 2 delivered to client 1
        clients[1].handle(encode(type(bad)(bad.session_id, 1, {})))
    restored = _restore(clients[1], config, extra)
    assert restored.aborted is not None and restored.aborted.stage is Stage.ADVERTISE_KEYS
    with pytest.raises(ProtocolError):
        restored.handle(encode(out[1]))


def test_snapshot_from_an_earlier_round_with_the_same_context_cannot_answer_this_round() -> None:
    """Same context, so the session id and the snapshot's binding match; the restored
    client still aborts on the new round's messages, which bind the new keys."""
    config, server, clients, _, extra = _parties("malicious")
    for cid, client in clients.items():
        server.receive(cid, encode(client.advertise()))
    server.advance()
    old = clients[1].snapshot(KEY)
    config, server2, clients2, _, extra2 = _parties("malicious")
    extra2[1] = extra[1] | {"verify_keys": extra2[1]["verify_keys"]}
    for cid, client in clients2.items():
        server2.receive(cid, encode(client.advertise()))
    out = server2.advance()
    stale = Client.restore(old, config=config, client_id=1, context=b"resume", key=KEY,
                           **extra2[1])
    with pytest.raises(ProtocolAbort, match="own keys"):
        stale.handle(encode(out[1]))


def test_garbage_is_refused_with_a_typed_error() -> None:
    config = Config(num_clients=5, dim=16)
    with pytest.raises(StaleSnapshot):
        Client.restore(b"\x00" * 100, config=config, client_id=1, context=b"resume")


def test_bind_nonce_signs_the_advertisement_over_the_relayed_nonce_once() -> None:
    """Client.bind_nonce (for transports that build the client before the round start
    arrives): the advertisement then verifies only against that server nonce; a second,
    different nonce, or one after the client answered a message, is refused and changes
    nothing."""
    import os

    from secagg.messages import AdvertiseKeys

    config = Config(num_clients=4, dim=8, security="malicious")
    keys = {c: SigningKey.generate() for c in range(1, 5)}
    verify = {c: k.public for c, k in keys.items()}
    round_nonce = RoundNonce()
    nonce, other = round_nonce.value, os.urandom(32)
    client = Client(config, 1, np.zeros(8, dtype=np.uint64), signing_key=keys[1],
                    verify_keys=verify)
    with pytest.raises(ProtocolError, match="nonce"):
        client.advertise()  # malicious mode: nothing is sent before the nonce is bound
    bound = client.bind_nonce(nonce)
    assert isinstance(bound, AdvertiseKeys) and bound.signature
    assert client.bind_nonce(nonce) == bound  # the same nonce again: no-op
    with pytest.raises(ProtocolError):
        client.bind_nonce(other)
    with pytest.raises(ProtocolError):
        client.bind_nonce(b"short")
    assert client.advertise() == bound and client.nonce == nonce
    server = Server(config, verify_keys=verify, nonce=round_nonce)
    server.receive(1, encode(bound))
    stale = Server(config, verify_keys=verify)  # another round: its own nonce
    with pytest.raises(ProtocolError):
        stale.receive(1, encode(bound))


def _through_masking(dim: int) -> tuple[Config, Server, dict[int, Client], dict]:
    config = Config(num_clients=3, dim=dim, bits=32)
    rng = np.random.default_rng(5)
    server = Server(config, context=b"resume")
    clients = {i: Client(config, i, rng.integers(0, 2**32, dim, dtype=np.uint64),
                         context=b"resume", nonce=server.nonce) for i in (1, 2, 3)}
    return config, server, clients, {i: {} for i in clients}


def test_the_snapshot_keeps_the_input_until_masking_and_neither_vector_after() -> None:
    """What the host stores per message (secagg.resume, "What a snapshot costs"): the input
    once while it is still to be masked, then neither it nor the masked vector."""
    dim = 100_000
    config, server, clients, extra = _through_masking(dim)
    for cid, client in clients.items():
        server.receive(cid, encode(client.advertise()))
    vector = 4 * dim
    sizes = [len(clients[1].snapshot(KEY))]  # advertised
    for _ in range(2):  # share_keys, then masked_input
        out = server.advance()
        for cid, client in clients.items():
            server.receive(cid, encode(client.handle(encode(out[cid]))))
        sizes.append(len(clients[1].snapshot(KEY)))
    assert vector < sizes[0] < vector + 2048 and vector < sizes[1] < vector + 4096
    assert sizes[2] < 8192  # masked: 400 KB of input and 400 KB of masked vector gone
    restored = _restore(clients[1], config, extra)
    out = server.advance()
    for cid in clients:
        client = restored if cid == 1 else clients[cid]
        server.receive(cid, encode(client.handle(encode(out[cid]))))
    server.advance()
    assert server.result is not None and server.result.included == {1, 2, 3}


@pytest.mark.parametrize("state", ["advertised", "shared"])
def test_a_corrupted_input_never_reaches_a_mask(state: str) -> None:
    """The MAC covers the input's digest, which the restore before masking checks: a
    flipped input byte is refused there (and carried, unread, by an earlier restore)."""
    config, server, clients, _ = _through_masking(1000)
    for cid, client in clients.items():
        server.receive(cid, encode(client.advertise()))
    key_lists = server.advance()
    if state == "shared":
        clients[1].handle(encode(key_lists[1]))
    data = bytearray(clients[1].snapshot(KEY))
    data[-32 - 100] ^= 1  # an input byte (the MAC is the last 32)
    kwargs = {"config": config, "client_id": 1, "context": b"resume", "key": KEY}
    if state == "advertised":
        client = Client.restore(bytes(data), **kwargs)  # type: ignore[arg-type]
        client.handle(encode(key_lists[1]))
        data = bytearray(client.snapshot(KEY))
    with pytest.raises(StaleSnapshot, match="does not match its digest"):
        Client.restore(bytes(data), **kwargs)  # type: ignore[arg-type]
