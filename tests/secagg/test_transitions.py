"""Every message kind in every stage, to the client and to the server (as Google's fcp
tests every state against every message): the answer is the transition the tables allow
(``secagg.client.CLIENT_ACCEPTS``, ``secagg.server.SERVER_HANDLERS``) or a typed rejection
that changes nothing (a client that gets a server message out of order aborts, as table
3.2b says, and reveals nothing)."""

from __future__ import annotations

import numpy as np
import pytest
from harness import server_state

from secagg import (
    Client,
    Config,
    ProtocolAbort,
    ProtocolError,
    Server,
    SigningKey,
    Stage,
    decode,
    encode,
    round_stages,
)
from secagg.client import CLIENT_ACCEPTS
from secagg.messages import CLIENT_KINDS, Ciphertexts, ConsistencySignature
from secagg.server import SERVER_HANDLERS

MODES = ["semi-honest", "malicious"]
ME = 1


def _round(security: str) -> tuple[Config, dict, list[tuple[Stage, bytes]],
                                   dict[int, list[bytes]], dict]:
    """One honest round; returns client 1's snapshot before every server message it got,
    every message of client 1 (sent) and to client 1 (received), and the server's view."""
    config = Config(num_clients=4, dim=8, bits=16, security=security)
    signing = {i: SigningKey.generate() for i in range(1, 5)}
    verify = {i: k.public for i, k in signing.items()} if config.malicious else None
    extra = {"signing_key": signing[ME] if config.malicious else None, "verify_keys": verify}
    server = Server(config, context=b"transitions", verify_keys=verify)
    rng = np.random.default_rng(0)
    clients = {i: Client(config, i, rng.integers(0, 2**16, 8, dtype=np.uint64),
                         context=b"transitions",
                         signing_key=signing[i] if config.malicious else None,
                         verify_keys=verify, nonce=server.nonce) for i in range(1, 5)}
    snapshots: list[tuple[Stage, bytes]] = []
    mine: dict[int, list[bytes]] = {}  # kind -> wire bytes, to and from client 1
    server_views: dict[Stage, dict[int, bytes]] = {}
    for cid, client in clients.items():
        raw = encode(client.advertise())
        server.receive(cid, raw)
        server_views.setdefault(Stage.ADVERTISE_KEYS, {})[cid] = raw
    mine.setdefault(1, []).append(encode(clients[ME].advertise()))
    out = server.advance()
    for stage in round_stages(config)[1:]:
        for cid, msg in out.items():
            raw_in = encode(msg)
            if cid == ME:
                snapshots.append((clients[ME].stage, clients[ME].snapshot()))
                mine.setdefault(_kind(raw_in), []).append(raw_in)
            raw = encode(clients[cid].handle(raw_in))
            if cid == ME:
                mine.setdefault(_kind(raw), []).append(raw)
            server.receive(cid, raw)
            server_views.setdefault(stage, {})[cid] = raw
        out = server.advance()
    snapshots.append((clients[ME].stage, clients[ME].snapshot()))
    if not config.malicious:  # a well-formed kind 4 the round never had
        mine[4] = [encode(ConsistencySignature(server.session_id, ME, b"\x01" * 64))]
    return config, extra, snapshots, mine, server_views


def _kind(raw: bytes) -> int:
    return raw[6]  # array header, magic (bin 3: 5 bytes), then the kind


@pytest.mark.parametrize("security", MODES)
def test_every_message_kind_in_every_client_stage(security: str) -> None:
    config, extra, snapshots, mine, _ = _round(security)
    assert set(mine) >= {1, 2, 3, 4, 5, 11, 12, 14} | ({13} if config.malicious else set())
    for stage, data in snapshots:
        for kind, messages in sorted(mine.items()):
            for raw in messages:
                client = Client.restore(data, config=config, client_id=ME,
                                        context=b"transitions", **extra)
                before = client.snapshot()
                answered = any(raw_digest == _digest(raw) for raw_digest in client._answered)
                accepted = CLIENT_ACCEPTS.get((stage, config.malicious))
                if kind in CLIENT_KINDS:
                    with pytest.raises(ProtocolError) as info:
                        client.handle(raw)
                    assert not isinstance(info.value, ProtocolAbort)
                    assert client.snapshot() == before, (stage, kind)
                elif answered and type(decode(raw)) is Ciphertexts:
                    # the masked input's request again after a restore: the snapshot kept
                    # its digest only (secagg.resume), so it is refused, nothing changes
                    with pytest.raises(ProtocolError, match="sent its masked input") as info:
                        client.handle(raw)
                    assert not isinstance(info.value, ProtocolAbort)
                    assert client.snapshot() == before
                elif answered:  # a redelivery: the same reply, nothing changes
                    client.handle(raw)
                    assert client.snapshot() == before
                elif client.done:
                    with pytest.raises(ProtocolError) as info:
                        client.handle(raw)
                    assert not isinstance(info.value, ProtocolAbort)
                    assert client.snapshot() == before
                elif accepted is not None and type(decode(raw)) is accepted:
                    client.handle(raw)  # the one transition the table allows
                    assert client.stage > stage
                else:
                    revealed = dict(client.revealed)
                    with pytest.raises(ProtocolAbort):
                        client.handle(raw)
                    assert client.aborted is not None and client.revealed == revealed
                    with pytest.raises(ProtocolError):
                        client.handle(raw)


def _digest(raw: bytes) -> bytes:
    import hashlib

    return hashlib.sha256(raw).digest()


@pytest.mark.parametrize("security", MODES)
def test_every_message_kind_in_every_server_stage(security: str) -> None:
    """In each stage of a live round, every message of every stage from every client that
    the server is not waiting for, and every server kind, is rejected (or ignored as a
    redelivery) without changing the server."""
    assert set(SERVER_HANDLERS) == set(Stage)
    config, _, _, mine, _ = _round(security)
    server_kinds = [raw for kind, msgs in mine.items() if kind not in CLIENT_KINDS
                    for raw in msgs]
    signing = {i: SigningKey.generate() for i in range(1, 5)}
    verify = {i: k.public for i, k in signing.items()} if config.malicious else None
    live = Server(config, context=b"live", verify_keys=verify)
    rng = np.random.default_rng(1)
    clients = {i: Client(config, i, rng.integers(0, 2**16, 8, dtype=np.uint64),
                         context=b"live", signing_key=signing[i] if config.malicious else None,
                         verify_keys=verify, nonce=live.nonce) for i in range(1, 5)}
    sent: dict[Stage, dict[int, bytes]] = {}
    out: dict[int, object] = {}
    collected = []
    for stage in round_stages(config):
        collected.append(live.stage)
        if stage is Stage.ADVERTISE_KEYS:
            replies = {cid: encode(c.advertise()) for cid, c in clients.items()}
        else:
            replies = {cid: encode(clients[cid].handle(encode(m)))  # type: ignore[arg-type]
                       for cid, m in out.items()}
        sent[stage] = replies
        for cid, raw in replies.items():
            assert live.receive(cid, raw) is True
            for other_stage, messages in sent.items():
                for other_cid, other in messages.items():
                    if other_stage is stage and other_cid not in live.received:
                        continue  # the server is waiting for exactly this message
                    for sender in {other_cid, cid}:
                        before = server_state(live)
                        try:
                            new = live.receive(sender, other)
                        except ProtocolAbort:
                            raise
                        except ProtocolError:
                            new = None
                        assert new is not True, (stage, other_stage, other_cid, sender)
                        assert server_state(live) == before
            for raw_server in server_kinds:
                before = server_state(live)
                with pytest.raises(ProtocolError):
                    live.receive(cid, raw_server)
                assert server_state(live) == before
        out = dict(live.advance())
    assert live.result is not None
    # the one round schedule is the one the server runs
    assert tuple(collected) == round_stages(config) == round_stages(config.malicious)
    assert (Stage.CONSISTENCY_CHECK in collected) == config.malicious
