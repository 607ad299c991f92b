"""Frames cut off by a dead broker release their sender's reassembly quota (issue 30).

A message whose connection died half-way never completes: its sender re-sends it whole.
Before, the dead frames kept counting against the sender's quota until they aged out
(two minutes), so the re-sent message (or the next chunk of its stream) was refused.
"""

from __future__ import annotations

import os

from transport.framing import frame, round_reassembler


def test_a_cut_message_does_not_refuse_the_senders_next_one() -> None:
    reassembler = round_reassembler(64 << 10, senders=2, max_payload=4 << 10)
    cut = frame(os.urandom(60 << 10), 4 << 10)
    for data in cut[: len(cut) // 2 + 3]:  # the rest died with the broker
        assert reassembler.feed((1, "masked_input"), data, 0.0, quota=1) is None
    nxt = os.urandom(60 << 10)
    got = None
    for data in frame(nxt, 4 << 10):
        got = reassembler.feed((1, "masked_input"), data, 1.0, quota=1) or got
    assert got is not None and got.payload == nxt
    # only the sender's own message went: another sender's partial is intact
    other = frame(os.urandom(60 << 10), 4 << 10)
    reassembler.feed((2, "masked_input"), other[0], 2.0, quota=2)
    for data in frame(os.urandom(60 << 10), 4 << 10)[:4]:
        reassembler.feed((1, "masked_input"), data, 2.0, quota=1)
    done = None
    for data in other[1:]:
        done = reassembler.feed((2, "masked_input"), data, 3.0, quota=2) or done
    assert done is not None

