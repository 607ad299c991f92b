"""Claims of docs/protocol.md (3.3a, 7.2) and docs/security.md (finding 7) that had no
attack of their own: a client flooding the real server with rejected messages leaves a
bounded rejection log (one entry per client) and the round exact."""

from __future__ import annotations

import pytest
from adversary import threat
from harness import Round, server_state

from secagg import Config, ProtocolAbort, ProtocolError, encode
from secagg.messages import MaskedInput, decode

pytestmark = pytest.mark.security

VICTIM = 1


@threat(attack="Filling the server's rejection log",
        adversary="malicious client",
        controls="20,000 rejected messages in one stage: truncated and oversized bytes, "
                 "another session's message, a message claiming another client's id, a "
                 "second different masked input; before and after its real one",
        protocol="Server.rejected keeps one entry per client: its latest reason (short, "
                 "quoting none of the attacker's bytes) and a count; no rejection "
                 "changes the round, aborts it or excludes the sender (7.2)")
def test_a_rejection_flood_leaves_a_bounded_log_and_an_exact_round() -> None:
    rnd = Round(Config(num_clients=7, dim=512, bits=16), context=b"reject-log")
    rnd.run_until(MaskedInput)
    good = rnd.pending[VICTIM]
    msg = decode(good)
    assert isinstance(msg, MaskedInput)
    secret = b"attacker-chosen bytes " * 40
    invalid = [good[:-1], good + b"\x00", secret, good[:40] + secret,
               encode(MaskedInput(bytes(32), VICTIM, 16, 512, bytes(1024), msg.peers_digest)),
               encode(MaskedInput(msg.session_id, 2, 16, 512, bytes(1024), msg.peers_digest)),
               b"\xff" * (rnd.server.max_message_bytes() + 1)]
    conflicting = encode(MaskedInput(msg.session_id, VICTIM, 16, 512, bytes(1024),
                                     msg.peers_digest))  # valid, but a second message

    def flood(junk: list[bytes], times: int) -> None:
        for i in range(times):
            with pytest.raises(ProtocolError) as info:
                rnd.server.receive(VICTIM, junk[i % len(junk)])
            assert not isinstance(info.value, ProtocolAbort)

    before = server_state(rnd.server)
    flood(invalid, 10_000)
    assert server_state(rnd.server) == before
    # rejections do not exclude the sender (docs/protocol.md 7.2): its real input still counts
    assert rnd.server.receive(VICTIM, good) is True
    after_first = server_state(rnd.server)
    flood([*invalid, conflicting], 10_000)
    assert len(rnd.server.rejected) == 1  # one entry per client (docs/protocol.md 3.3a)
    assert rnd.server.rejected.count(VICTIM) == 20_000
    assert {cid for cid, _ in rnd.server.rejected} == {VICTIM}
    assert max(len(reason) for _, reason in rnd.server.rejected) < 200
    assert not any("attacker" in reason for _, reason in rnd.server.rejected)
    # the newest are kept: the last rejection is the last entry
    with pytest.raises(ProtocolError):
        rnd.server.receive(VICTIM, invalid[-1])
    assert "more than" in rnd.server.rejected[-1][1]
    assert server_state(rnd.server) == after_first and rnd.server.aborted is None
    result = rnd.assert_correct()
    assert VICTIM in result.included
