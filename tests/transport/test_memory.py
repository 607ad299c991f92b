"""The transport drivers over the in-memory bus: framing, topics, control codec, and whole
rounds checked against ``secagg.simulate`` (the oracle), with dropouts, kills, garbage,
replays, chunking and a broker restart."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import numpy as np
import pytest

from secagg import Config, ProtocolAbort, Stage, encode, simulate
from transport import topics as topics_mod
from transport.broker import TopicAcl
from transport.control import (
    ControlError,
    Offline,
    Receipt,
    RoundStart,
    decode_control,
    encode_control,
)
from transport.drivers import Timeouts
from transport.framing import HEADER_BYTES, FrameError, Reassembler, frame, message_id
from transport.memory import MemoryNetwork
from transport.rounds import RoundReport, run_round
from transport.topics import Topics

pytestmark = pytest.mark.timeout(60)

FAST = Timeouts(stage=5.0, start=5.0, retry=0.5, answer=2.0, give_up=20.0,
                resend_interval=0.1)


def make_inputs(n: int, dim: int, bits: int = 32, seed: int = 0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {cid: rng.integers(0, 1 << bits, dim, dtype=np.uint64) for cid in range(1, n + 1)}


def plaintext_sum(inputs: dict[int, np.ndarray], included: frozenset[int],
                  bits: int) -> np.ndarray:
    total = np.zeros_like(next(iter(inputs.values())))
    for cid in included:
        total += inputs[cid]
    return total & np.uint64((1 << bits) - 1) if bits < 64 else total


def check_against_oracle(report: RoundReport, config: Config,
                         inputs: dict[int, np.ndarray], drop: dict[int, Stage]) -> None:
    oracle = simulate(config, inputs, drop, seed=0)
    assert report.included == oracle.included
    assert np.array_equal(report.result.total, oracle.total)
    assert np.array_equal(report.result.total,
                          plaintext_sum(inputs, report.included, config.bits))
    assert dict(report.result.dropped) == dict(oracle.dropped)


def run(coro_factory: Callable[[], object]) -> RoundReport:
    return asyncio.run(coro_factory())  # type: ignore[arg-type]


# --------------------------------------------------------------------------- framing


def test_frame_round_trip_with_chunks_and_duplicates() -> None:
    message = bytes(range(256)) * 40
    frames = frame(message, max_payload=HEADER_BYTES + 100)
    assert len(frames) == -(-len(message) // 100)
    assert all(len(f) <= HEADER_BYTES + 100 for f in frames)
    reassembler = Reassembler(1 << 20)
    out = None
    for data in reversed(frames):  # order does not matter
        assert out is None
        out = reassembler.feed("a", data, 0.0)
        if data is not frames[0]:
            assert reassembler.feed("a", data, 0.0) is None  # QoS 1 duplicate
    assert out is not None and out.payload == message
    assert out.digest == message_id(message)
    assert reassembler.buffered_bytes == 0


def test_single_frame_message() -> None:
    (data,) = frame(b"hello")
    got = Reassembler(100).feed("s", data, 0.0)
    assert got is not None and got.payload == b"hello"


@pytest.mark.parametrize("payload", [b"", b"garbage", b"SGF1" + b"\x00" * 10,
                                     b"\xff" * (HEADER_BYTES + 5)])
def test_garbage_frames_raise(payload: bytes) -> None:
    with pytest.raises(FrameError):
        Reassembler(1000).feed("s", payload, 0.0)


def test_truncated_and_tampered_frames_raise() -> None:
    (data,) = frame(b"x" * 100)
    with pytest.raises(FrameError):
        Reassembler(1000).feed("s", data[:-1], 0.0)
    tampered = data[:-1] + b"y"
    with pytest.raises(FrameError, match="sha256"):
        Reassembler(1000).feed("s", tampered, 0.0)


def test_oversized_message_is_refused_before_buffering() -> None:
    frames = frame(b"z" * 5000, max_payload=HEADER_BYTES + 1000)
    reassembler = Reassembler(4000)
    with pytest.raises(FrameError, match="limit"):
        reassembler.feed("s", frames[0], 0.0)
    assert reassembler.buffered_bytes == 0


def test_inconsistent_chunk_set_is_discarded() -> None:
    a = frame(b"a" * 300, max_payload=HEADER_BYTES + 100)
    b = frame(b"b" * 300, max_payload=HEADER_BYTES + 100)
    reassembler = Reassembler(10_000)
    reassembler.feed("s", a[0], 0.0)
    # a chunk of another message spliced under a's id: the set fails its sha256
    spliced = a[1][:HEADER_BYTES] + b[1][HEADER_BYTES:]
    reassembler.feed("s", spliced, 0.0)
    with pytest.raises(FrameError, match="sha256"):
        reassembler.feed("s", a[2], 0.0)
    assert reassembler.buffered_bytes == 0
    # and the honest message still completes when re-published
    for data in a:
        got = reassembler.feed("s", data, 0.0)
    assert got is not None and got.payload == b"a" * 300


def test_partial_sets_are_bounded_per_sender_and_expire() -> None:
    reassembler = Reassembler(10_000, max_partial=2, ttl=10.0)
    for i in range(5):
        first = frame(bytes([i]) * 300, max_payload=HEADER_BYTES + 100)[0]
        reassembler.feed("s", first, 0.0)
    assert reassembler.buffered_bytes == 200  # only two partial sets kept
    reassembler.feed("t", frame(b"q" * 300, max_payload=HEADER_BYTES + 100)[0], 20.0)
    assert reassembler.buffered_bytes == 100  # the old ones expired


def test_frame_rejects_tiny_payload_limit() -> None:
    with pytest.raises(ValueError, match="max_payload"):
        frame(b"x", max_payload=HEADER_BYTES)


# --------------------------------------------------------------------------- topics


def test_topic_layout_round_trips() -> None:
    t = Topics("r1")
    assert t.parse_upstream(t.stage_upstream(7, Stage.SHARE_KEYS)) == ("share_keys", 7)
    assert t.parse_upstream(t.offline(7)) == ("offline", 7)
    assert t.parse_downstream(t.downstream(7, "receipt")) == (7, "receipt")
    assert t.parse_upstream("secagg/r2/server/share_keys/site-7") is None
    assert t.parse_upstream("secagg/r1/server/share_keys/site-07") is None
    assert t.parse_upstream("secagg/r1/server/share_keys/7") is None
    with pytest.raises(ValueError, match="round name"):
        Topics("a/b")


def test_acl_confines_each_site_to_its_own_topics() -> None:
    t = Topics("r1")
    table = {user: TopicAcl.coerce(entry) for user, entry in topics_mod.acl_table([1, 2]).items()}
    site1 = table["site-1"]
    assert site1.allows("publish", t.stage_upstream(1, Stage.MASKED_INPUT), "site-1", "site-1")
    assert site1.allows("publish", t.offline(1), "site-1", "site-1")
    assert not site1.allows("publish", t.stage_upstream(2, Stage.MASKED_INPUT), "site-1",
                            "site-1")
    assert not site1.allows("publish", t.control, "site-1", "site-1")
    assert not site1.allows("publish", t.downstream(2, "masked_input"), "site-1", "site-1")
    assert site1.allows("subscribe", t.client_filter(1), "site-1", "site-1")
    assert site1.allows("subscribe", t.control, "site-1", "site-1")
    assert not site1.allows("subscribe", t.client_filter(2), "site-1", "site-1")
    assert not site1.allows("subscribe", t.server_filter, "site-1", "site-1")
    assert not site1.allows("subscribe", "secagg/#", "site-1", "site-1")
    server = table["server"]
    assert server.allows("subscribe", t.server_filter, "server", "server")
    assert server.allows("publish", t.control, "server", "server")
    assert not server.allows("publish", t.stage_upstream(1, Stage.SHARE_KEYS), "server",
                             "server")


# --------------------------------------------------------------------------- control


def test_control_codec_round_trip_and_rejects_garbage() -> None:
    start = RoundStart(b"s" * 32, {"dim": 3}, 3, {"share_keys": 5.0})
    assert decode_control(encode_control(start)) == start
    receipt = Receipt(b"d" * 32, False, "why")
    assert decode_control(encode_control(receipt)) == receipt
    assert decode_control(encode_control(Offline("bye"))) == Offline("bye")
    for bad in (b"", b"\xc1", encode(simulate_message()), b"\x81\xa1t\xa3end"):
        with pytest.raises(ControlError):
            decode_control(bad)


def simulate_message() -> object:
    from secagg.messages import AdvertiseKeys

    return AdvertiseKeys(b"s" * 32, 1, b"k" * 32, b"m" * 32, b"c" * 32)


# --------------------------------------------------------------------------- rounds


ALL_STAGE_DROPS = {2: Stage.ADVERTISE_KEYS, 3: Stage.SHARE_KEYS, 4: Stage.MASKED_INPUT,
                   5: Stage.UNMASKING}


@pytest.mark.parametrize("security", ["semi-honest", "malicious"])
def test_round_matches_oracle_with_drops_at_every_stage(security: str) -> None:
    n = 16 if security == "malicious" else 12  # malicious: t > 2n/3 must survive
    config = Config(num_clients=n, dim=64, bits=32, security=security)
    inputs = make_inputs(n, 64)
    drop = dict(ALL_STAGE_DROPS)
    if security == "malicious":
        drop[6] = Stage.CONSISTENCY_CHECK
    network = MemoryNetwork(acl=topics_mod.acl_table(list(inputs)))
    report = run(lambda: run_round(network, config, inputs, drop, timeouts=FAST))
    check_against_oracle(report, config, inputs, drop)
    assert report.invalid_payloads == 0
    for cid, stage in drop.items():
        assert report.outcomes[cid].status == "dropped"
        assert report.outcomes[cid].stage == stage.label
    assert all(report.outcomes[c].status == "done" for c in report.included if c not in drop)


def test_round_with_secagg_plus_and_64_bits() -> None:
    config = Config(num_clients=10, dim=32, bits=64, neighbors=6, dropout_rate=0.1)
    inputs = make_inputs(10, 32, bits=64)
    drop = {1: Stage.MASKED_INPUT}
    report = run(lambda: run_round(MemoryNetwork(), config, inputs, drop, timeouts=FAST))
    check_against_oracle(report, config, inputs, drop)


def test_tiny_chunk_limit_chunks_every_message() -> None:
    config = Config(num_clients=6, dim=200, bits=32)
    inputs = make_inputs(6, 200)
    network = MemoryNetwork()
    report = run(lambda: run_round(network, config, inputs, {2: Stage.SHARE_KEYS},
                                   timeouts=FAST, max_payload=HEADER_BYTES + 64))
    check_against_oracle(report, config, inputs, {2: Stage.SHARE_KEYS})
    # everything but the (constant-size, retained) control messages respects the limit
    assert max(size for _, topic, size in network.published
               if not topic.endswith("/control")) <= HEADER_BYTES + 64
    masked = [size for _, topic, size in network.published if topic.endswith("/site-1")
              and "/masked_input/" in topic]
    assert len(masked) >= 800 // 64  # the 800-byte masked input went in many chunks


def test_silent_dropout_is_dropped_at_the_stage_deadline() -> None:
    config = Config(num_clients=5, dim=16)
    inputs = make_inputs(5, 16)
    timeouts = Timeouts(stage=0.6, start=5.0, retry=0.5, answer=2.0, give_up=10.0)
    started = time.monotonic()
    report = run(lambda: run_round(MemoryNetwork(), config, inputs, {3: Stage.SHARE_KEYS},
                                   timeouts=timeouts, drop_mode="silent"))
    assert time.monotonic() - started >= 0.6
    assert report.result.dropped == {3: Stage.SHARE_KEYS}
    assert 3 not in report.gone  # nobody told the server: the deadline did it
    check_against_oracle(report, config, inputs, {3: Stage.SHARE_KEYS})


def test_killed_client_is_noticed_by_its_will_before_the_deadline() -> None:
    config = Config(num_clients=5, dim=16)
    inputs = make_inputs(5, 16)
    network = MemoryNetwork()
    timeouts = Timeouts(stage=30.0, start=5.0, retry=0.5, answer=2.0, give_up=60.0)
    killed = False

    def tap(user: str, topic: str, payload: bytes) -> list[bytes]:
        nonlocal killed
        if user == "site-4" and "/share_keys/" in topic and not killed:
            killed = True
            network.kill("site-4")  # dies instead of sending share_keys
            return []
        return [payload]

    network.tap = tap
    started = time.monotonic()
    report = run(lambda: run_round(network, config, inputs, timeouts=timeouts))
    assert time.monotonic() - started < 5.0  # far below the 30 s deadline
    assert report.gone == {4: "offline"}
    assert report.result.dropped == {4: Stage.SHARE_KEYS}
    assert report.outcomes[4].status == "lost"
    check_against_oracle(report, config, inputs, {4: Stage.SHARE_KEYS})


def test_garbage_truncated_oversized_and_replayed_payloads_are_dropped() -> None:
    config = Config(num_clients=6, dim=100, security="malicious")
    inputs = make_inputs(6, 100)
    network = MemoryNetwork()
    t_holder: dict[str, Topics] = {}
    seen: dict[str, bytes] = {}

    def tap(user: str, topic: str, payload: bytes) -> list[bytes]:
        if "t" not in t_holder:
            parts = topic.split("/")
            t_holder["t"] = Topics(parts[1])
        t = t_holder["t"]
        out = [payload]
        if user == "site-2" and "/advertise_keys/" in topic:
            seen["advert"] = payload
        if user == "site-2" and "/masked_input/" in topic:
            # before the real message: garbage, a truncated frame, an oversized claim,
            # a replay of its own advertise_keys frame, a bogus offline notice
            out = [b"\x00garbage", payload[: len(payload) // 2],
                   frame(b"A" * (1 << 22), max_payload=1 << 23)[0], seen["advert"], payload]
            network.inject(t.stage_upstream(2, Stage.MASKED_INPUT), b"SGF1")
        if user == "server" and topic.endswith("/site-3/masked_input"):
            seen["to3"] = payload
        if user == "server" and topic.endswith("/site-3/consistency_check"):
            # replays of an earlier server message and garbage on a client's topic
            network.inject(topic, seen["to3"])
            network.inject(topic, b"SGF1" + b"\x01" * 60)
            network.inject(topic.replace("consistency_check", "receipt"), b"junk")
        return out

    network.tap = tap
    report = run(lambda: run_round(network, config, inputs, {5: Stage.SHARE_KEYS},
                                   timeouts=FAST))
    check_against_oracle(report, config, inputs, {5: Stage.SHARE_KEYS})
    assert report.invalid_payloads >= 3
    assert report.outcomes[3].status == "done"
    assert report.outcomes[2].status == "done"


def test_spoofed_client_id_in_payload_is_rejected() -> None:
    config = Config(num_clients=5, dim=16)
    inputs = make_inputs(5, 16)
    network = MemoryNetwork()  # no ACL: site-1 can publish on site-2's topic

    async def scenario() -> RoundReport:
        original = network.route

        def route(user: str, topic: str, payload: bytes, retain: bool) -> None:
            if user == "site-1" and "/advertise_keys/" in topic:
                # site-1's advertisement, first published as if it came from site 2: the
                # server must not take it as client 2's
                original(user, topic.replace("site-1", "site-2"), payload, retain)
            original(user, topic, payload, retain)

        network.route = route  # type: ignore[method-assign]
        return await run_round(network, config, inputs, timeouts=FAST)

    report = run(scenario)
    assert report.rejected >= 1
    check_against_oracle(report, config, inputs, {})


def test_acl_on_the_bus_blocks_a_site_speaking_for_another() -> None:
    config = Config(num_clients=4, dim=8)
    inputs = make_inputs(4, 8)
    network = MemoryNetwork(acl=topics_mod.acl_table([1, 2, 3, 4]))
    leaked: list[str] = []
    original = network.route

    def route(user: str, topic: str, payload: bytes, retain: bool) -> None:
        original(user, topic, payload, retain)
        if user == "site-1" and "/share_keys/" in topic:
            forged = topic.replace("site-1", "site-2")
            before = len(network.published)
            original(user, forged, payload, retain)
            if len(network.published) != before:
                leaked.append(forged)

    network.route = route  # type: ignore[method-assign]
    report = run(lambda: run_round(network, config, inputs, timeouts=FAST))
    assert leaked == []
    assert report.rejected == 0
    check_against_oracle(report, config, inputs, {})


def test_lost_messages_are_recovered_by_receipts_and_resends() -> None:
    config = Config(num_clients=5, dim=32)
    inputs = make_inputs(5, 32)
    network = MemoryNetwork()
    dropped_once: set[str] = set()

    def tap(user: str, topic: str, payload: bytes) -> list[bytes]:
        # the broker silently loses the first copy of: a client's masked input, the server's
        # answer to a client, and a receipt (as an ACL denial acknowledged by the broker does)
        for key in ("site-2/masked", "site-3/masked_input", "site-4/receipt"):
            a, b = key.split("/")
            if (a in topic and b in topic) and key not in dropped_once:
                dropped_once.add(key)
                return []
        return [payload]

    network.tap = tap
    report = run(lambda: run_round(network, config, inputs, timeouts=FAST))
    assert len(dropped_once) == 3
    check_against_oracle(report, config, inputs, {})
    assert sum(o.republished for o in report.outcomes.values()) >= 2
    assert report.resends >= 1


def test_broker_restart_mid_round_completes() -> None:
    config = Config(num_clients=6, dim=64)
    inputs = make_inputs(6, 64)
    network = MemoryNetwork()
    restarted = False

    def tap(user: str, topic: str, payload: bytes) -> list[bytes]:
        nonlocal restarted
        if user == "site-1" and "/masked_input/" in topic and not restarted:
            restarted = True
            asyncio.get_running_loop().create_task(network.restart(0.2))
            return []  # lost in the crash
        return [payload]

    network.tap = tap
    report = run(lambda: run_round(network, config, inputs, timeouts=FAST))
    assert restarted
    check_against_oracle(report, config, inputs, {})


def test_too_many_dropouts_abort_cleanly_and_clients_learn_it() -> None:
    config = Config(num_clients=5, dim=8)
    inputs = make_inputs(5, 8)
    drop = {1: Stage.MASKED_INPUT, 2: Stage.MASKED_INPUT, 3: Stage.MASKED_INPUT}
    network = MemoryNetwork()
    started = time.monotonic()
    with pytest.raises(ProtocolAbort, match="threshold"):
        run(lambda: run_round(network, config, inputs, drop, timeouts=FAST))
    assert time.monotonic() - started < 5.0
    retained = next(iter(network.retained.values()))
    from transport.control import RoundAbort
    from transport.framing import Reassembler as R

    got = R(1 << 16).feed("x", retained, 0.0)
    assert got is not None and isinstance(decode_control(got.payload), RoundAbort)


def test_client_with_another_configuration_never_starts() -> None:
    config = Config(num_clients=3, dim=8)
    inputs = make_inputs(3, 8)

    async def scenario() -> str:
        from secagg import Client, Server
        from transport.rounds import serve_client, serve_server

        network = MemoryNetwork()
        t = Topics("mismatch")
        server = Server(config, roster=[1, 2, 3], context=b"a")
        stranger = Client(config, 1, inputs[1], roster=[1, 2, 3], context=b"b")
        timeouts = Timeouts(stage=0.3, start=0.5, give_up=2.0)
        client_task = asyncio.create_task(serve_client(network, stranger, t,
                                                       timeouts=timeouts))
        with pytest.raises(ProtocolAbort):
            await serve_server(network, server, t, timeouts=timeouts)
        outcome = await client_task
        return outcome.status

    assert asyncio.run(scenario()) == "timeout"



def test_the_servers_round_nonce_is_relayed_and_signed_by_every_client() -> None:
    """The drivers make the advertisement fresh (docs/protocol.md 9.2): the round start
    carries the server's 32-byte nonce and each client signs its advertisement over it
    (Client.bind_nonce). The server verifies against its own nonce, so a malicious-mode
    round completes only if every client bound the relayed one; a recorded advertisement
    of another round (another nonce) is refused (tests/security/test_protocol_replay.py)."""
    config = Config(num_clients=6, dim=64, security="malicious")
    inputs = make_inputs(6, 64)
    starts: list[RoundStart] = []
    network = MemoryNetwork()

    def tap(user: str, topic: str, payload: bytes) -> list[bytes]:
        if user == "server" and topic.endswith("/control"):
            message = decode_control(payload[HEADER_BYTES:])
            if isinstance(message, RoundStart):
                starts.append(message)
        return [payload]

    network.tap = tap
    report = run(lambda: run_round(network, config, inputs, context=b"", timeouts=FAST))
    assert starts and all(len(s.nonce) == 32 for s in starts)
    assert report.result.included == frozenset(range(1, 7))
    check_against_oracle(report, config, inputs, {})
    again = run(lambda: run_round(network, config, inputs, context=b"", timeouts=FAST))
    assert again.result.included == frozenset(range(1, 7))
    assert starts[-1].nonce != starts[0].nonce  # fresh every round
