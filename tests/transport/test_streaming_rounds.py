"""Masked inputs stream through the drivers (docs/deployment.md, "Model-sized updates"):
rounds over the in-memory bus and the embedded broker send chunks, sum exactly, and the
flow control (upload slots, receipts as credits) makes senders wait for a slow server
instead of dropping them; a sender that stalls loses its slot, with its reason."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import secrets
import time
from typing import Any

import numpy as np
import pytest

from secagg import Config, Stage, encode, simulate
from secagg.messages import MaskedChunk
from secagg.server import Server
from tests.transport.mqtt_raw import RawClient, publish_packet
from transport.broker import EmbeddedBroker
from transport.deadlines import logical_timeouts
from transport.drivers import UPLOAD_IDLE_SHARE, StageProgress, Timeouts, TimeoutsError
from transport.framing import HEADER_BYTES, frame
from transport.memory import MemoryNetwork
from transport.mqtt import BrokerSettings, MqttNetwork
from transport.rounds import run_round
from transport.topics import SERVER_USER, Topics, acl_table, site_name

pytestmark = pytest.mark.timeout(60)

FAST = Timeouts(stage=8.0, start=5.0, retry=0.5, answer=2.0, give_up=20.0,
                resend_interval=0.1)


def make_inputs(n: int, dim: int, bits: int, seed: int = 0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {cid: rng.integers(0, 1 << bits, dim, dtype=np.uint64) for cid in range(1, n + 1)}


def exact(inputs: dict[int, np.ndarray], included: frozenset[int], bits: int) -> list[int]:
    total = np.zeros(len(inputs[1]), dtype=object)
    for cid in included:
        total = total + inputs[cid].astype(object)
    return [int(v) % (1 << bits) for v in total]


@pytest.mark.parametrize("bits", [16, 32, 64])
def test_rounds_stream_masked_inputs_in_chunks(bits: int) -> None:
    """The drivers' masked inputs travel as chunks (chunk size not dividing d), one client
    drops at masked_input: the same result as secagg.simulate, exact."""
    config = Config(num_clients=5, threshold=3, dim=1001, bits=bits)
    inputs = make_inputs(5, config.dim, bits, seed=bits)
    drop = {4: Stage.MASKED_INPUT}
    report = asyncio.run(run_round(MemoryNetwork(), config, inputs, drop, timeouts=FAST,
                                   chunk_bytes=40 * (bits // 8)))
    assert report.included == {1, 2, 3, 5}
    assert report.chunks == 4 * -(-1001 // 40)  # every included input came in chunks
    assert report.result.total.dtype == np.dtype(f"uint{bits}")
    assert report.result.total.tolist() == exact(inputs, report.included, bits)
    oracle = simulate(config, inputs, drop, seed=0)
    assert np.array_equal(report.result.total, oracle.total)
    assert report.invalid_payloads == 0 and report.rejected == 0
    sent = {cid: o.bytes_sent.get("masked_input", 0) for cid, o in report.outcomes.items()}
    assert all(sent[c] >= 1001 * bits // 8 for c in (1, 2, 3, 5))


def test_a_slow_server_makes_senders_wait_and_drops_nothing(monkeypatch: Any) -> None:
    """Upload budget of one vector (one slot) and a server that is slow with every chunk:
    the senders stream one after another (never two pending), wait for their grant and
    their receipts, and every input arrives; nothing is dropped or refused."""
    config = Config(num_clients=4, threshold=3, dim=800, bits=32)
    inputs = make_inputs(4, config.dim, 32, seed=3)
    most = [0]
    started: dict[int, float] = {}
    finished: dict[int, float] = {}
    receive = Server.receive

    def slow_receive(self: Server, client_id: int, message: Any, **kw: Any) -> bool:
        if self.stage is Stage.MASKED_INPUT:
            time.sleep(0.01)  # a busy aggregator: every chunk costs it time
            started.setdefault(client_id, time.monotonic())
        accepted = receive(self, client_id, message, **kw)
        if self.stage is Stage.MASKED_INPUT:
            most[0] = max(most[0], len(self.uploading))
            if client_id in self.received:
                finished.setdefault(client_id, time.monotonic())
        return accepted

    monkeypatch.setattr(Server, "receive", slow_receive)
    report = asyncio.run(run_round(MemoryNetwork(), config, inputs, timeouts=FAST,
                                   chunk_bytes=400, upload_budget=800 * 4))
    assert report.included == {1, 2, 3, 4}
    assert report.result.total.tolist() == exact(inputs, report.included, 32)
    assert most[0] == 1  # one pending sender at a time: the slot, not n vectors
    order = sorted(started, key=started.__getitem__)
    for before, after in itertools.pairwise(order):
        assert finished[before] <= started[after]  # each waited for the previous one
    assert report.invalid_payloads == 0 and report.rejected == 0
    assert all(o.status == "done" for o in report.outcomes.values())


def test_a_stalled_sender_loses_its_slot_with_a_reason() -> None:
    """Client 1 is granted the only slot and never sends a chunk: after upload_idle the
    server takes the slot back (client 1 dropped at masked_input, the reason recorded),
    and the others stream and complete."""
    config = Config(num_clients=4, threshold=3, dim=500, bits=32)
    inputs = make_inputs(4, config.dim, 32, seed=4)
    timeouts = Timeouts(stage=10.0, start=5.0, retry=0.5, answer=3.0, give_up=20.0,
                        resend_interval=0.1, upload_idle=1.5)
    report = asyncio.run(run_round(MemoryNetwork(), config, inputs, {1: Stage.MASKED_INPUT},
                                   timeouts=timeouts, drop_mode="silent", chunk_bytes=256,
                                   upload_budget=500 * 4))
    assert report.included == {2, 3, 4}
    assert report.result.dropped[1] is Stage.MASKED_INPUT
    assert report.result.total.tolist() == exact(inputs, report.included, 32)
    assert report.seconds["masked_input"] < 8.0  # not the stage deadline: the idle limit


def test_a_slow_sender_nobody_waits_for_keeps_its_slot(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    """A busy host (issue 30): every site holds a slot and site 1's chunks come 0.8 s
    apart, past the 0.5 s idle limit but well within the stage. No site waits for a slot,
    so taking site 1's back would only drop an honest site: it keeps it, completes, and
    the sum is exact. (With sites waiting, the idle limit still applies:
    ``test_a_stalled_sender_loses_its_slot_with_a_reason``.)"""
    from transport.client_driver import ClientDriver

    publish = ClientDriver._publish_raw

    async def slow(self: ClientDriver, raw: bytes, digest: bytes, *args: Any,
                   **kwargs: Any) -> Any:
        if self.client_id == 1 and self._grant is not None:
            await asyncio.sleep(0.8)
        return await publish(self, raw, digest, *args, **kwargs)

    monkeypatch.setattr(ClientDriver, "_publish_raw", slow)
    config = Config(num_clients=3, threshold=2, dim=300, bits=32)
    inputs = make_inputs(3, config.dim, 32, seed=9)
    timeouts = Timeouts(stage=15.0, start=5.0, retry=5.0, answer=5.0, give_up=40.0,
                        resend_interval=0.1, upload_idle=0.5)
    report = asyncio.run(run_round(MemoryNetwork(), config, inputs, timeouts=timeouts,
                                   chunk_bytes=400, upload_budget=3 * 300 * 4))
    assert report.included == {1, 2, 3}
    assert report.result.total.tolist() == exact(inputs, report.included, 32)


def test_a_hostile_site_cannot_starve_the_others_through_the_broker() -> None:
    """Site 2's valid login, on a second connection during masked_input, floods its own
    masked_input topic: never-finished frame sets, an oversized message, chunks at wrong
    offsets, chunks claiming another client, duplicates and a whole vector of junk. The
    honest sites' streams complete through the real broker, the sum is exact, and every
    hostile message is refused with a typed reason (invalid payload or rejected)."""
    ids = [1, 2, 3, 4, 5]
    config = Config(num_clients=5, threshold=3, dim=3000, bits=32)
    inputs = make_inputs(5, config.dim, 32, seed=6)
    users = {site_name(c): secrets.token_hex(8) for c in ids}
    users[SERVER_USER] = secrets.token_hex(8)
    topics = Topics("stream-hostile")
    topic = topics.stage_upstream(2, Stage.MASKED_INPUT)
    payload = HEADER_BYTES + 1024
    sent: list[int] = []
    session: list[bytes] = []

    def chunk(offset: int, count: int, client: int = 2) -> bytes:
        return encode(MaskedChunk(session[0], client, 32, config.dim, offset,
                                  bytes(4 * count)))

    async def attack(port: int) -> None:
        evil = await RawClient.login(port, "site-2-evil", "site-2", users["site-2"])
        frames = 0
        for i in range(200):  # first frames of chunk-sized sets that never complete
            digest = hashlib.sha256(b"p" + i.to_bytes(4, "big")).digest()
            head = frame(secrets.token_bytes(4000), max_payload=payload)[0]
            evil.send(publish_packet(topic, head[:4] + digest + head[36:]))
            frames += 1
        for data in frame(bytes(8 << 20), max_payload=1 << 16)[:4]:  # oversized message
            evil.send(publish_packet(topic, data))
            frames += 1
        hostile = [chunk(2000, 10), chunk(2999, 1), chunk(0, 10, client=3), chunk(0, 3000)]
        hostile += [chunk(5, 5)] * 20  # duplicates at a wrong offset
        for message in hostile:
            for data in frame(message, max_payload=payload):
                evil.send(publish_packet(topic, data))
                frames += 1
        await evil.ping(10.0)
        sent.append(frames)
        evil.disconnect()

    async def scenario() -> Any:
        async with EmbeddedBroker(users=users, acl=acl_table(ids)) as broker:
            tasks = []

            def on_stage(progress: StageProgress) -> None:
                if progress.stage is Stage.SHARE_KEYS:  # masked_input is open now
                    tasks.append(asyncio.create_task(attack(broker.port)))

            settings = BrokerSettings(port=broker.port, passwords=users)
            timeouts = Timeouts(stage=8.0, start=10.0, retry=1.0, answer=4.0, give_up=30.0)
            report = await run_round(MqttNetwork(settings), config, inputs,
                                     {2: Stage.MASKED_INPUT}, round_name=topics.round_name,
                                     timeouts=timeouts, on_stage=on_stage,
                                     drop_mode="silent", max_payload=payload,
                                     chunk_bytes=2048, context=b"hostile")
            await asyncio.gather(*tasks)
            return report

    from secagg.session import derive_session_id, normalize_roster

    session.append(derive_session_id(config, normalize_roster(config, ids), b"hostile"))
    report = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert sent and sent[0] > 200
    assert report.included == {1, 3, 4, 5}
    assert report.result.total.tolist() == exact(inputs, report.included, 32)
    assert report.invalid_payloads >= 1  # the oversized message, refused by its header
    assert report.rejected >= 4  # the decodable hostile chunks, each a typed rejection
    # memory: the reassembly never held more than every sender's quota of one chunk
    # message (a few KiB each here), whatever site 2 sent
    assert 0 < report.reassembly_peak <= report.reassembly_bound <= 5 * 16 * 1024
    assert report.chunks == 4 * -(-3000 // 512)


def test_a_lost_grant_is_sent_again() -> None:
    """The broker loses client 1's upload grant: the client, still holding its share_keys
    message as the one to re-publish, re-sends it after ``answer`` seconds without news,
    the server answers with its ciphertexts and the grant again, and the round completes
    with every client (no wait until give_up)."""
    from transport.control import Grant, decode_control
    from transport.framing import Reassembler

    config = Config(num_clients=4, threshold=3, dim=600, bits=32)
    inputs = make_inputs(4, config.dim, 32, seed=8)
    network = MemoryNetwork()
    lost: list[str] = []
    topics = Topics("lost-grant")

    def tap(user: str, topic: str, payload: bytes) -> list[bytes]:
        if user == SERVER_USER and topic == topics.downstream(1, "receipt") and not lost:
            done = Reassembler(1 << 20).feed("s", payload, 0.0)
            if done is not None and isinstance(decode_control(done.payload), Grant):
                lost.append(topic)
                return []
        return [payload]

    network.tap = tap
    timeouts = Timeouts(stage=15.0, start=5.0, retry=0.5, answer=1.0, give_up=12.0,
                        resend_interval=0.1)
    started = time.monotonic()
    report = asyncio.run(run_round(network, config, inputs, timeouts=timeouts,
                                   round_name=topics.round_name, chunk_bytes=512))
    assert lost  # the grant was dropped once
    assert report.included == {1, 2, 3, 4}
    assert report.result.total.tolist() == exact(inputs, report.included, 32)
    assert time.monotonic() - started < 10.0


def test_upload_idle_at_or_past_the_masked_input_deadline_is_refused_in_one_line() -> None:
    """A slot holder that fails must give its slot back while the others can still stream:
    upload_idle must be below the masked_input deadline (a per-stage one too); by default it
    is UPLOAD_IDLE_SHARE of it."""
    for bad in ({"stage": 10.0, "upload_idle": 10.0},
                {"stage": 60.0, "per_stage": {"masked_input": 5.0}, "upload_idle": 6.0},
                {"upload_idle": 0.0}):
        with pytest.raises(TimeoutsError, match="upload_idle") as caught:
            Timeouts(**bad)
        assert "\n" not in str(caught.value) and "below the masked_input deadline" in str(
            caught.value)
    assert Timeouts().upload_idle_limit() == UPLOAD_IDLE_SHARE * 60.0 < 60.0
    scaled = Timeouts(stage=8.0, per_stage={"masked_input": 20.0})
    assert scaled.upload_idle_limit() == UPLOAD_IDLE_SHARE * 20.0
    assert Timeouts(stage=8.0, upload_idle=2.0).upload_idle_limit() == 2.0


def test_the_server_keeps_a_window_of_each_stream_once_masked_input_closes(
        monkeypatch: Any) -> None:
    """Four sites stream 60 chunks each: while masked_input is open the server driver keeps
    every accepted chunk's digest (a re-sent chunk is confirmed again,
    tests/security/test_transport_fairness.py); once it closes, the last ``window`` chunks
    of each stream plus one message per site and stage, not 240."""
    from transport.server_driver import ServerDriver

    drivers: list[ServerDriver] = []
    init = ServerDriver.__init__

    def keep(self: ServerDriver, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        drivers.append(self)

    monkeypatch.setattr(ServerDriver, "__init__", keep)
    config = Config(num_clients=4, threshold=3, dim=600, bits=32)
    inputs = make_inputs(4, config.dim, 32, seed=9)
    report = asyncio.run(run_round(MemoryNetwork(), config, inputs, timeouts=FAST,
                                   chunk_bytes=40))
    assert report.included == {1, 2, 3, 4} and report.chunks == 4 * 60
    (driver,) = drivers
    stages = len(driver._deadlines)
    assert len(driver._seen) <= 4 * (driver.window + stages) < report.chunks


def test_a_sender_that_signs_off_frees_its_slot_on_logical_deadlines(monkeypatch: Any
                                                                      ) -> None:
    """One upload slot, logical deadlines (no lease or idle limit ever ends a grant) and
    client 1, granted the slot first, signs off at masked_input: its slot goes to the next
    sender at once (the server re-checks a sender that left, not only on a clock), and
    every other input arrives."""
    config = Config(num_clients=4, threshold=3, dim=600, bits=32)
    inputs = make_inputs(4, config.dim, 32, seed=9)
    granted: list[int] = []
    grant = Server.grant_uploads

    def recording(self: Server, *args: Any, **kwargs: Any) -> list[int]:
        out = grant(self, *args, **kwargs)
        granted.extend(out)
        return out

    monkeypatch.setattr(Server, "grant_uploads", recording)

    async def bounded() -> Any:
        return await asyncio.wait_for(run_round(
            MemoryNetwork(), config, inputs, {1: Stage.MASKED_INPUT},
            timeouts=logical_timeouts(FAST), chunk_bytes=400, upload_budget=600 * 4), 30)

    report = asyncio.run(bounded())
    assert granted[0] == 1  # the premise: the sender that leaves held the only slot
    assert report.included == {2, 3, 4}
    assert report.result.dropped[1] is Stage.MASKED_INPUT
    assert report.result.total.tolist() == exact(inputs, report.included, 32)
