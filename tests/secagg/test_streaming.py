"""The streamed masked input (docs/protocol.md 6.3): chunks sum exactly, the whole message
is the one-chunk case, chunks go in order and count only once complete, upload slots bound
the pending senders, and in malicious mode the last chunk's signature covers the stream."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from harness import assert_pending_consistent

from secagg import Config, ProtocolError, Stage, encode, simulate
from secagg.client import Client
from secagg.crypto import Masker, dtype_for_bits
from secagg.masked_stream import MaskedStream
from secagg.messages import MaskedChunk, MaskedInput, split_masked_input
from secagg.server import Server
from secagg.simulate import LocalRound


def _inputs(config: Config, seed: int = 0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {cid: rng.integers(0, 1 << config.bits, config.dim, dtype=np.uint64)
            for cid in range(1, config.num_clients + 1)}


def _exact(inputs: dict[int, np.ndarray], included: frozenset[int], bits: int) -> list[int]:
    total = sum((inputs[c].astype(object) for c in sorted(included)),
                np.zeros(len(next(iter(inputs.values()))), dtype=object))
    return [int(v) % (1 << bits) for v in total]


@pytest.mark.parametrize("bits", [16, 32, 64])
@pytest.mark.parametrize("chunk_elements", [1, 7, 16, 37, 100])
@pytest.mark.parametrize("drop_stage", [None, Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS,
                                        Stage.MASKED_INPUT, Stage.UNMASKING])
def test_chunked_masked_input_sums_exactly(bits: int, chunk_elements: int,
                                           drop_stage: Stage | None) -> None:
    """Every chunk size (1 element, sizes that do not divide d = 37, d itself and more than
    d), bits 16/32/64, a client dropped at every stage: the sum is exact, in the natural
    width, and the client produced the same bytes as its whole MaskedInput."""
    config = Config(num_clients=5, threshold=3, dim=37, bits=bits)
    inputs = _inputs(config, seed=bits + chunk_elements)
    drop = {2: drop_stage} if drop_stage is not None else {}
    width = dtype_for_bits(bits).itemsize
    result = simulate(config, inputs, drop=drop, seed=1, chunk_bytes=chunk_elements * width)
    assert result.total.dtype == dtype_for_bits(bits)
    expected_in = frozenset(range(1, 6)) - ({2} if drop_stage is not None
                                             and drop_stage <= Stage.MASKED_INPUT else set())
    assert result.included == expected_in
    assert result.total.tolist() == _exact(inputs, result.included, bits)


def _masked_round(config: Config, seed: int = 0, upload_budget: int = 1 << 30
                  ) -> tuple[Server, dict[int, Client], dict[int, MaskedStream],
                             dict[int, np.ndarray]]:
    """A round run to the opening of masked_input: the server and each client's stream."""
    inputs = _inputs(config, seed)
    parties = LocalRound.new(config, inputs, b"streaming-test", upload_budget=upload_budget)
    server = parties.server
    clients = {cid: parties.client(cid, inputs[cid]) for cid in parties.roster}
    for cid, client in clients.items():
        server.receive(cid, encode(client.advertise()))
    outgoing = server.advance()
    for cid, msg in outgoing.items():
        server.receive(cid, encode(clients[cid].handle(encode(msg))))
    outgoing = server.advance()
    assert server.stage is Stage.MASKED_INPUT
    streams = {}
    for cid, msg in outgoing.items():
        stream = clients[cid].stream(encode(msg))
        assert isinstance(stream, MaskedStream)
        streams[cid] = stream
    return server, clients, streams, inputs


def _finish(server: Server, clients: dict[int, Client]) -> object:
    while server.result is None:
        outgoing = server.advance()
        for cid, msg in outgoing.items():
            if cid in clients:
                server.receive(cid, encode(clients[cid].handle(encode(msg))))
    return server.result


def test_every_chunking_gives_the_whole_messages_bytes_and_signature() -> None:
    config = Config(num_clients=4, threshold=3, dim=53, bits=32, security="malicious")
    _, _, streams, _ = _masked_round(config)
    stream = streams[1]
    whole = stream.whole()
    assert isinstance(whole, MaskedInput) and stream.whole() is whole
    for elements in (1, 5, 16, 52, 53, 1000):
        chunks = list(stream.chunks(elements))
        assert b"".join(bytes(c.masked) for c in chunks) == bytes(whole.masked)
        assert [c.signature for c in chunks[:-1]] == [b""] * (len(chunks) - 1)
        assert chunks[-1].signature == whole.signature  # one input, one signature
        split = list(split_masked_input(whole, elements))
        assert [encode(c) for c in split] == [encode(c) for c in chunks]


@pytest.mark.parametrize("bits", [8, 12, 16, 32, 64])
def test_the_masker_seeks_to_any_window(bits: int) -> None:
    """AES-CTR seeks: the keystream of elements [start, start + count) is that slice of the
    whole stream, at every start (also ones not on a 16-byte counter block)."""
    dim, key = 301, bytes(range(16))
    whole = Masker(dim, bits).keystream(key).copy()
    window = Masker(40, bits)
    for start in (0, 1, 3, 15, 16, 17, 100, 261):
        count = min(40, dim - start)
        assert np.array_equal(window.keystream(key, start, count), whole[start:start + count])


def test_chunks_go_in_order_and_count_only_when_complete() -> None:
    config = Config(num_clients=4, threshold=3, dim=40, bits=32)
    server, clients, streams, inputs = _masked_round(config)
    assert server.grant_uploads() == [1, 2, 3, 4]
    chunks = {cid: list(s.chunks(10)) for cid, s in streams.items()}
    sum_before = server._uploads.sum.copy()
    assert server.receive(1, encode(chunks[1][0])) is True
    assert server.receive(1, encode(chunks[1][0])) is False  # redelivery of the latest
    server.receive(1, encode(chunks[1][1]))
    for bad in (chunks[1][0], chunks[1][3]):  # an earlier chunk again, a skip ahead
        with pytest.raises(ProtocolError, match="stream is at element 20"):
            server.receive(1, encode(bad))
    assert np.array_equal(server._uploads.sum, sum_before)  # pending: not in the sum yet
    assert 1 not in server.received and server.uploading == {1, 2, 3, 4}
    for chunk in chunks[1][2:]:
        server.receive(1, encode(chunk))
    assert 1 in server.received and 1 not in server.uploading
    for cid in (2, 3):
        for chunk in chunks[cid]:
            server.receive(cid, encode(chunk))
    for chunk in chunks[4][:3]:  # client 4's stream stops before its last chunk
        server.receive(4, encode(chunk))
    result = _finish(server, clients)
    assert result.included == {1, 2, 3}  # type: ignore[attr-defined]
    assert result.dropped[4] is Stage.MASKED_INPUT  # type: ignore[attr-defined]
    assert any(cid == 4 and "stopped at element 30 of 40" in why
               for cid, why in server.rejected)
    assert result.total.tolist() == _exact(inputs, frozenset({1, 2, 3}), 32)  # type: ignore[attr-defined]


def test_grants_skip_excluded_clients_until_a_later_call() -> None:
    """``grant_uploads(exclude=...)`` (what a transport passes: the clients it knows are
    gone) skips them for this call only; every client is granted once, lowest id first,
    and one that completed, was cancelled or is uploading is never granted again."""
    config = Config(num_clients=6, threshold=4, dim=30, bits=16)
    server, clients, streams, inputs = _masked_round(config, upload_budget=30 * 2 * 2)
    assert server.upload_slots == 2
    assert server.grant_uploads(exclude={1, 3}) == [2, 4]
    assert server.grant_uploads(exclude={1, 3}) == []  # both slots taken
    assert_pending_consistent(server)
    server.receive(5, encode(streams[5].whole()))  # whole: no slot, never granted after
    for chunk in streams[2].chunks(8):
        server.receive(2, encode(chunk))
    assert not server.is_pending(2) and not server.is_uploading(2)
    assert server.grant_uploads(exclude={1}) == [3]  # 3 no longer excluded; 5 is done
    assert server.cancel_upload(4, "stalled") is True
    assert not server.is_pending(4)
    assert_pending_consistent(server)
    assert server.grant_uploads(exclude={1}) == [6]
    for cid in (3, 6):
        for chunk in streams[cid].chunks(8):
            server.receive(cid, encode(chunk))
    assert server.grant_uploads() == [1]  # back: granted now
    assert server.grant_uploads() == []
    for chunk in streams[1].chunks(8):
        server.receive(1, encode(chunk))
    assert server.pending_count == 0 and server.pending == frozenset()
    result = _finish(server, clients)
    assert result.included == {1, 2, 3, 5, 6}  # type: ignore[attr-defined]
    assert result.total.tolist() == _exact(inputs, frozenset({1, 2, 3, 5, 6}), 16)  # type: ignore[attr-defined]


def test_upload_slots_bound_the_pending_senders() -> None:
    """upload_budget of one vector: one sender streams at a time; another's chunk is
    refused until it is granted; a whole MaskedInput needs no slot; a cancelled upload is
    dropped and its slot goes to the next client."""
    config = Config(num_clients=5, threshold=3, dim=30, bits=16)
    server, clients, streams, inputs = _masked_round(config, upload_budget=30 * 2)
    assert server.upload_slots == 1
    assert server.grant_uploads() == [1]
    assert server.grant_uploads() == []  # no free slot
    first = list(streams[2].chunks(8))
    with pytest.raises(ProtocolError, match="no upload slot is granted"):
        server.receive(2, encode(first[0]))
    assert 2 not in server.uploading
    server.receive(3, encode(streams[3].whole()))  # whole: completes in one message
    for chunk in streams[1].chunks(8):
        server.receive(1, encode(chunk))
    assert server.grant_uploads() == [2]
    for chunk in first[:2]:
        server.receive(2, encode(chunk))
    assert server.cancel_upload(2, "no chunk for 60 s") is True
    assert server.cancel_upload(2, "again") is False
    with pytest.raises(ProtocolError, match="not part of this stage"):
        server.receive(2, encode(first[2]))
    assert server.grant_uploads() == [4]
    for chunk in streams[4].chunks(8):
        server.receive(4, encode(chunk))
    assert server.grant_uploads() == [5]
    for chunk in streams[5].chunks(30):
        server.receive(5, encode(chunk))
    result = _finish(server, clients)
    assert result.included == {1, 3, 4, 5}  # type: ignore[attr-defined]
    assert result.dropped[2] is Stage.MASKED_INPUT  # type: ignore[attr-defined]
    assert result.total.tolist() == _exact(inputs, frozenset({1, 3, 4, 5}), 16)  # type: ignore[attr-defined]


def _relabel(chunk: MaskedChunk, **changes: object) -> bytes:
    return encode(replace(chunk, **changes))  # type: ignore[arg-type]


@pytest.mark.parametrize("attack", ["splice", "reorder", "duplicate", "truncate",
                                    "signed-early", "resigned-whole"])
def test_malicious_splice_reorder_truncate_rejected(attack: str) -> None:
    """A server or broker that splices chunks of two streams (another client's chunk under
    the victim's name), reorders chunks (rewriting offsets), duplicates one in place of
    another, cuts the stream, or moves the signature: the victim's last chunk is refused
    with a typed error, nothing enters the sum, the others' round completes."""
    config = Config(num_clients=5, threshold=4, dim=48, bits=32, security="malicious")
    server, clients, streams, inputs = _masked_round(config, seed=5)
    server.grant_uploads()
    for cid in (2, 3, 4, 5):
        for chunk in streams[cid].chunks(12):
            server.receive(cid, encode(chunk))
    victim = list(streams[1].chunks(12))
    other = list(streams[2].chunks(12))
    if attack == "splice":
        sent = [encode(victim[0]), _relabel(other[1], client_id=1,
                                            peers_digest=victim[1].peers_digest),
                encode(victim[2]),
                encode(victim[3])]
    elif attack == "reorder":
        sent = [encode(victim[0]), _relabel(victim[2], offset=12),
                _relabel(victim[1], offset=24), encode(victim[3])]
    elif attack == "duplicate":
        sent = [encode(victim[0]), _relabel(victim[0], offset=12), encode(victim[2]),
                encode(victim[3])]
    elif attack == "truncate":  # the last chunk cut short, the signature kept
        sent = [encode(c) for c in victim[:3]] + [
            _relabel(victim[3], masked=bytes(victim[3].masked)[:-4])]
    elif attack == "signed-early":
        sent = [_relabel(victim[0], signature=victim[3].signature)]
    else:  # the stream re-cut into other chunk boundaries keeps its signature: allowed;
        # but a signature taken from another client's stream is not
        sent = [encode(c) for c in victim[:3]] + [
            _relabel(victim[3], signature=other[3].signature)]
    sum_before = server._uploads.sum.copy()
    with pytest.raises(ProtocolError, match="signature"):
        for raw in sent:
            server.receive(1, raw)
    assert 1 not in server.received
    assert np.array_equal(server._uploads.sum, sum_before)
    result = _finish(server, clients)
    assert 1 not in result.included  # type: ignore[attr-defined]
    assert result.total.tolist() == _exact(inputs, result.included, 32)  # type: ignore[attr-defined]


def test_a_stream_rechunked_on_the_way_still_verifies() -> None:
    """The signature covers the stream's bytes, not its chunk boundaries: a transport may
    re-cut it (e.g. a restored client's MaskedInput split at another size)."""
    config = Config(num_clients=4, threshold=3, dim=40, bits=32, security="malicious")
    server, clients, streams, inputs = _masked_round(config, seed=2)
    server.grant_uploads()
    for cid, stream in streams.items():
        for chunk in split_masked_input(stream.whole(), 3 + cid):
            server.receive(cid, encode(chunk))
    result = _finish(server, clients)
    assert result.included == {1, 2, 3, 4}  # type: ignore[attr-defined]
    assert result.total.tolist() == _exact(inputs, result.included, 32)  # type: ignore[attr-defined]


@pytest.mark.parametrize("bits", [12, 32, 64])
def test_unmasking_window_by_window_is_exact(bits: int, monkeypatch: pytest.MonkeyPatch
                                             ) -> None:
    """The server removes masks in windows (UNMASK_WINDOW_BYTES; here 20 bytes, so windows
    that do not divide d and start off a counter block): with a survivor's self mask and
    a dropped client's pairwise masks to remove, the sum is exact."""
    import secagg.unmasking

    monkeypatch.setattr(secagg.unmasking, "UNMASK_WINDOW_BYTES", 20)
    config = Config(num_clients=5, threshold=3, dim=45, bits=bits)
    inputs = _inputs(config, seed=bits)
    result = simulate(config, inputs, drop={3: Stage.MASKED_INPUT, 5: Stage.UNMASKING},
                      seed=2, chunk_bytes=7 * dtype_for_bits(bits).itemsize)
    assert result.included == {1, 2, 4, 5}
    assert result.total.tolist() == _exact(inputs, result.included, bits)


@pytest.mark.parametrize("security", ["semi-honest", "malicious"])
def test_a_chunk_ahead_of_the_stream_waits_for_the_gap(security: str) -> None:
    """A broker restart cuts chunk 1 of a stream and delivers chunk 2 first (the sender
    re-sends chunk 1 when it reconnects). On the grant's chunk grid the chunk ahead is held,
    not refused: the stream completes in order and the sum is exact (issue 30: a refusal
    excluded every streaming site from the round's first attempt)."""
    config = Config(num_clients=4, threshold=3, dim=48, bits=32, security=security)
    server, clients, streams, inputs = _masked_round(config, seed=21)
    server.grant_uploads(chunk_elements=12)
    chunks = {cid: [encode(c) for c in s.chunks(12)] for cid, s in streams.items()}
    order = [0, 2, 3]
    assert [server.receive(1, chunks[1][i]) for i in order] == [True, True, True]
    assert server.receive(1, chunks[1][3]) is False  # a held chunk again: a no-op
    assert 1 not in server.received and 1 in server.uploading
    assert server.receive(1, chunks[1][1]) is True  # the gap: the held chunks follow it
    assert 1 in server.received and 1 not in server.uploading
    for cid in (2, 3, 4):
        for raw in chunks[cid]:
            server.receive(cid, raw)
    result = _finish(server, clients)
    assert result.included == {1, 2, 3, 4}  # type: ignore[attr-defined]
    assert result.total.tolist() == _exact(inputs, result.included, 32)  # type: ignore[attr-defined]


def test_chunks_ahead_are_held_only_on_the_grid_and_once() -> None:
    """What is held stays bounded by one input: only offsets on the granted chunk grid
    (never overlapping), each once; without a chunk grid nothing is held."""
    config = Config(num_clients=3, threshold=2, dim=40, bits=32)
    server, _, streams, _ = _masked_round(config, seed=22)
    server.grant_uploads(chunk_elements=10)
    chunks = list(streams[1].chunks(10))
    with pytest.raises(ProtocolError, match="chunk grid"):
        server.receive(1, _relabel(chunks[2], offset=25))  # ahead, off the grid
    assert server.receive(1, encode(chunks[2])) is True
    with pytest.raises(ProtocolError, match="second, different chunk at element 20"):
        server.receive(1, _relabel(chunks[2], masked=bytes(chunks[3].masked)))
    server2, _, streams2, _ = _masked_round(config, seed=23)
    server2.grant_uploads()  # no chunk grid
    with pytest.raises(ProtocolError, match="the stream is at element 0"):
        server2.receive(1, encode(list(streams2[1].chunks(10))[1]))


def test_a_digest_the_caller_checked_is_not_computed_again(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """Issue 32: a transport's reassembly has checked each message against its sha256, and
    hands it to ``Server.receive(digest=)``: the server hashes no masked-input bytes again
    (it hashed a whole masked input three times), still recognises a redelivery by that
    digest, and refuses a digest that cannot be a sha256. Without ``digest`` it hashes each
    accepted chunk once."""
    import secagg.server

    config = Config(num_clients=4, threshold=3, dim=40, bits=32)
    hashed: list[int] = []
    real = secagg.server.sha256

    def counting(*parts: bytes) -> bytes:
        hashed.append(sum(len(p) for p in parts))
        return real(*parts)

    for given in (True, False):
        server, clients, streams, inputs = _masked_round(config, seed=5)
        granted = server.grant_uploads(chunk_elements=16)
        monkeypatch.setattr(secagg.server, "sha256", counting)
        hashed.clear()
        for cid in granted:
            for chunk in streams[cid].chunks(16):
                raw = encode(chunk)
                digest = real(raw) if given else None
                assert server.receive(cid, raw, digest=digest) is True
                assert server.receive(cid, raw, digest=digest) is False  # redelivery
        big = [n for n in hashed if n > 64]  # the chunks' bytes, not ids or key digests
        if given:
            assert big == []
        else:
            assert 0 < len(big) <= 2 * 3 * len(granted)  # at most one per receive
        monkeypatch.setattr(secagg.server, "sha256", real)
        result = _finish(server, clients)
        assert result.total.tolist() == _exact(inputs, result.included, 32)
    server, _, streams, _ = _masked_round(config, seed=6)
    (cid, *_rest) = server.grant_uploads(chunk_elements=40)
    raw = encode(next(iter(streams[cid].chunks(40))))
    for bad in (b"", b"x" * 31, "0" * 32):
        with pytest.raises(ValueError, match="32-byte sha256"):
            server.receive(cid, raw, digest=bad)  # type: ignore[arg-type]
    assert server.receive(cid, raw) is True
