"""The stage schedule is data (``secagg.messages.SCHEDULE``): the client's accepted
messages and ``stage_opened_by`` are read off it, and a real round follows it."""

from __future__ import annotations

import numpy as np
import pytest

from secagg import Client, Config, Server, SigningKey, Stage, encode, round_stages
from secagg.client import CLIENT_ACCEPTS
from secagg.messages import SCHEDULE, stage_opened_by


@pytest.mark.parametrize("security", ["semi-honest", "malicious"])
def test_a_real_round_follows_the_schedule(security: str) -> None:
    config = Config(num_clients=4, dim=3, bits=16, security=security)
    roster = [1, 2, 3, 4]
    keys = {c: SigningKey.generate() for c in roster} if config.malicious else {}
    verify = {c: k.public for c, k in keys.items()} or None
    server = Server(config, roster=roster, verify_keys=verify)
    clients = {c: Client(config, c, np.full(3, c, dtype=np.uint64), roster=roster,
                         signing_key=keys.get(c), verify_keys=verify, nonce=server.nonce)
               for c in roster}
    stages = round_stages(config)
    wire = {c: client.advertise() for c, client in clients.items()}
    seen = []
    while server.result is None:
        assert {type(m) for m in wire.values()} == {SCHEDULE[stages[len(seen)]].client}
        for c, message in wire.items():
            server.receive(c, encode(message))
        answers = server.advance()
        if server.result is not None:
            break
        kinds = {type(m) for m in answers.values()}
        assert kinds == {SCHEDULE[stages[len(seen)]].answer_in(config.malicious)}
        opened = stage_opened_by(kinds.pop())
        seen.append(opened)
        wire = {c: clients[c].handle(encode(m)) for c, m in answers.items()}
        assert all(clients[c].stage is opened for c in answers)
    assert seen == list(stages[1:])
    assert server.result.total.tolist() == [10, 10, 10]


def test_the_client_accepts_exactly_the_schedules_answers() -> None:
    expected = {(s.stage, m): s.answer_in(m) for s in SCHEDULE.values() for m in (False, True)
                if s.answer_in(m) is not None}
    assert dict(CLIENT_ACCEPTS) == expected
    assert set(SCHEDULE) == set(Stage)
