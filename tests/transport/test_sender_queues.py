"""The aggregator's bounds per sender (docs/security.md, bounds per login), on
``transport.sender_queues.SenderQueues`` alone: a sender's queue never holds more than its
bound, deliveries are taken in turn, one per sender, and past its waste budget a sender's
deliveries are dropped unread until the next stage. Through a whole round:
``tests/security/test_transport_fairness.py``."""

from __future__ import annotations

import asyncio

from transport.framing import chunk_charge
from transport.sender_queues import SenderQueues

PAYLOAD = bytes(1000)


def test_a_senders_queue_never_holds_more_than_its_bound() -> None:
    async def main() -> None:
        bound = 5 * chunk_charge(len(PAYLOAD)) + 10  # five fit, the sixth does not
        queues = SenderQueues(bound, waste_budget=100)
        assert [queues.put(7, "masked_input", PAYLOAD) for _ in range(5)] == [None] * 5
        full = queues.put(7, "masked_input", PAYLOAD)
        assert full is not None and f"bound {bound}" in full
        assert queues.dropped == 1
        assert queues.put(8, "masked_input", PAYLOAD) is None  # another sender's own bound
        taken = [await queues.take() for _ in range(6)]
        assert sorted(cid for cid, _, _ in taken) == [7] * 5 + [8]
        assert queues.put(7, "masked_input", PAYLOAD) is None  # taken: room again

    asyncio.run(main())


def test_deliveries_are_taken_in_turn_one_per_sender() -> None:
    async def main() -> None:
        queues = SenderQueues(1 << 20, waste_budget=100)
        for i in range(4):
            queues.put(1, "masked_input", bytes([i]))  # a flooding sender first
        queues.put(2, "masked_input", b"x")
        queues.put(3, "masked_input", b"y")
        order = [(await queues.take())[0] for _ in range(6)]
        assert order == [1, 2, 3, 1, 1, 1]  # the others wait for one of its, not four

    asyncio.run(main())


def test_past_its_waste_budget_a_sender_is_dropped_unread_until_the_next_stage() -> None:
    async def main() -> None:
        queues = SenderQueues(1 << 20, waste_budget=3)
        queues.put(1, "masked_input", b"queued before")
        queues.put(2, "masked_input", b"honest")
        assert [queues.waste(1) for _ in range(3)] == [1, 2, 3]
        assert queues.flooding(1) and not queues.flooding(2)
        assert queues.put(1, "masked_input", b"more") is None
        assert await queues.take() == (2, "masked_input", b"honest")
        assert queues.dropped == 2  # the one queued before and the one after: unread
        queues.new_stage()
        assert not queues.flooding(1)
        queues.put(1, "masked_input", b"next stage")
        assert await queues.take() == (1, "masked_input", b"next stage")

    asyncio.run(main())
