"""A client built without its input gets it at the masked-input request
(``Client(config, id)`` then ``provide_input``): the snapshot carries no input until then (a
few KB whatever ``dim``), a restored client gets it the same way, every check of the input
still happens with nothing changed on a refusal, and the sum is exact."""

from __future__ import annotations

import numpy as np
import pytest

from secagg import Client, Config, ProtocolError, Server, SigningKey, Stage, encode, simulate

KEY = b"node-local snapshot key"
CONTEXT = b"late input"


def _round(dim: int, security: str = "semi-honest", n: int = 3
           ) -> tuple[Config, Server, dict[int, Client], dict[int, np.ndarray], dict]:
    config = Config(num_clients=n, dim=dim, bits=32, security=security)
    rng = np.random.default_rng(dim)
    inputs = {i: rng.integers(0, 2**32, dim, dtype=np.uint64) for i in range(1, n + 1)}
    signing = {i: SigningKey.generate() for i in inputs} if config.malicious else {}
    verify = {i: k.public for i, k in signing.items()} if config.malicious else None
    extra = {i: {"signing_key": signing.get(i), "verify_keys": verify} for i in inputs}
    server = Server(config, context=CONTEXT, verify_keys=verify)
    clients = {i: Client(config, i, context=CONTEXT, nonce=server.nonce, **extra[i])
               for i in inputs}
    return config, server, clients, inputs, extra


def _restored(client: Client, config: Config, extra: dict) -> Client:
    return Client.restore(client.snapshot(KEY), config=config, client_id=client.client_id,
                          context=CONTEXT, key=KEY, **extra[client.client_id])


def _exact(server: Server, inputs: dict[int, np.ndarray]) -> None:
    result = server.result
    assert result is not None and result.included == frozenset(inputs)
    expected = sum(v.astype(object) for v in inputs.values())
    assert result.total.tolist() == [int(x) % 2**32 for x in expected]


@pytest.mark.parametrize("security", ["semi-honest", "malicious"])
def test_input_given_at_the_masked_input_request_to_a_restored_client_sums_exactly(
        security: str) -> None:
    """Every client is rebuilt from its snapshot before each message (a Flower node's
    life) and gets its input only when the masked-input request arrives."""
    config, server, clients, inputs, extra = _round(16, security)
    for cid, client in clients.items():
        server.receive(cid, encode(client.advertise()))
    while not server.finished:
        out = server.advance()
        for cid, msg in out.items():
            client = _restored(clients[cid], config, extra)
            if client.stage == Stage.SHARE_KEYS:
                assert not client.has_input
                client.provide_input(inputs[cid])
                assert client.has_input
            clients[cid] = client
            server.receive(cid, encode(client.handle(encode(msg))))
    _exact(server, inputs)


def test_the_snapshot_holds_no_input_before_it_is_given_whatever_the_dim() -> None:
    sizes = {}
    for dim in (1_000, 100_000):
        _, server, clients, inputs, _ = _round(dim)
        for cid, client in clients.items():
            server.receive(cid, encode(client.advertise()))
        per_stage = [len(clients[1].snapshot(KEY))]  # advertised
        key_lists = server.advance()
        for cid, client in clients.items():
            server.receive(cid, encode(client.handle(encode(key_lists[cid]))))
        per_stage.append(len(clients[1].snapshot(KEY)))  # shared
        clients[1].provide_input(inputs[1])
        per_stage.append(len(clients[1].snapshot(KEY)))  # shared, input given
        sizes[dim] = per_stage
    print("snapshot bytes (advertised, shared, shared with input):", sizes)
    for dim, (advertised, shared, given) in sizes.items():
        assert advertised < 2048 and shared < 4096, sizes
        assert given >= shared + 4 * dim  # the input, once given, is carried to masking
    assert sizes[1_000][:2] == sizes[100_000][:2]


def test_the_masked_input_request_without_an_input_changes_nothing() -> None:
    _, server, clients, inputs, _ = _round(8)
    for cid, client in clients.items():
        server.receive(cid, encode(client.advertise()))
    out = server.advance()
    for cid, client in clients.items():
        server.receive(cid, encode(client.handle(encode(out[cid]))))
    out = server.advance()
    before = clients[1].snapshot(KEY)
    with pytest.raises(ProtocolError, match="provide_input"):
        clients[1].handle(encode(out[1]))
    assert clients[1].snapshot(KEY) == before and clients[1].aborted is None
    for cid, client in clients.items():  # the same request again, input given: answered
        client.provide_input(inputs[cid])
        server.receive(cid, encode(client.handle(encode(out[cid]))))
    while not server.finished:
        for cid, msg in server.advance().items():
            server.receive(cid, encode(clients[cid].handle(encode(msg))))
    _exact(server, inputs)


@pytest.mark.parametrize("bad, match", [
    (np.zeros(7, dtype=np.uint64), "shape"),
    (np.zeros(8, dtype=np.float64), "dtype"),
    (np.full(8, 2**32, dtype=np.uint64), "outside"),
    (np.full(8, -1, dtype=np.int64), "outside"),
])
def test_a_bad_input_is_refused_with_what_to_change_and_changes_nothing(
        bad: np.ndarray, match: str) -> None:
    _, _, clients, inputs, _ = _round(8)
    client = clients[1]
    before = client.snapshot(KEY)
    with pytest.raises(ValueError, match=match):
        client.provide_input(bad)
    assert not client.has_input and client.snapshot(KEY) == before
    client.provide_input(inputs[1])  # a good one is still taken
    assert client.has_input


def test_one_input_per_round_not_a_second_nor_one_after_masking() -> None:
    config, server, clients, inputs, extra = _round(8)
    clients[1].provide_input(inputs[1])
    snapshot = clients[1].snapshot(KEY)
    with pytest.raises(ProtocolError, match="one input per round"):
        clients[1].provide_input(inputs[2])
    assert clients[1].snapshot(KEY) == snapshot
    restored = _restored(clients[1], config, extra)  # the input travels in the snapshot
    assert restored.has_input
    with pytest.raises(ProtocolError, match="one input per round"):
        restored.provide_input(inputs[1])
    for cid, client in clients.items():
        server.receive(cid, encode(client.advertise()))
        if cid != 1:
            client.provide_input(inputs[cid])
    for _ in range(2):
        out = server.advance()
        for cid, client in clients.items():
            server.receive(cid, encode(client.handle(encode(out[cid]))))
    assert clients[2].stage == Stage.MASKED_INPUT and not clients[2].has_input
    with pytest.raises(ProtocolError, match="one input per round"):
        clients[2].provide_input(inputs[2])


def test_the_constructor_form_with_the_input_still_works() -> None:
    config = Config(num_clients=4, dim=32, bits=20)
    rng = np.random.default_rng(1)
    inputs = {i: rng.integers(0, 2**20, 32, dtype=np.uint64) for i in range(1, 5)}
    result = simulate(config, inputs, seed=2)
    assert result.total.tolist() == [int(x) % 2**20 for x in
                                     sum(v.astype(object) for v in inputs.values())]


def test_a_clients_masked_stream_does_not_keep_it_alive_in_a_cycle() -> None:
    """The stream a client caches for its masked input reaches the client only weakly, so a
    host that lets the client go frees it (its input and masked vector with it) at once,
    not when Python's cycle collector happens to run."""
    import gc
    import weakref

    config, server, clients, inputs, _ = _round(64)
    for cid, client in clients.items():
        server.receive(cid, encode(client.advertise()))
        client.provide_input(inputs[cid])
    for _ in range(2):
        out = server.advance()
        for cid, client in clients.items():
            server.receive(cid, encode(client.handle(encode(out[cid]))))
    gone = weakref.ref(clients[1])
    stream = clients[1].stream(encode(out[1]))  # the cached masked-input stream
    gc.disable()
    try:
        del clients[1], client
        assert gone() is None
        assert stream.whole().dim == config.dim  # the stream alone still works
    finally:
        gc.enable()
