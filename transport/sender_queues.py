"""The server driver's bounds per sender (docs/security.md, bounds per login): deliveries
wait in one queue per sender and are taken in turn, one per sender, so a flooding sender
delays only itself; a queue holds at most ``bound`` bytes (charged as the reassembly
charges frames); and a sender that makes the server spend more than ``waste_budget``
messages that change nothing in one stage has its deliveries dropped unread until the next.
What a delivery means is the driver's (``transport/server_driver.py``).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque

from .framing import chunk_charge


class SenderQueues:
    """Deliveries by sender, taken in turn, each sender's bytes and waste bounded."""

    def __init__(self, bound: int, waste_budget: int) -> None:
        self.bound = bound
        self.waste_budget = waste_budget
        self.dropped = 0  # deliveries dropped unread (a sender past its budget or bound)
        self._queues: OrderedDict[int, deque[tuple[str, bytes]]] = OrderedDict()
        self._queued: dict[int, int] = {}  # sender -> bytes charged in its queue
        self._waste: dict[int, int] = {}  # this stage: sender -> messages wasted
        self._work = asyncio.Event()

    def flooding(self, cid: int) -> bool:
        """Whether ``cid`` is past its waste budget this stage."""
        return self._waste.get(cid, 0) >= self.waste_budget

    def put(self, cid: int, kind: str, payload: bytes) -> str | None:
        """Queue one delivery of ``cid``; ``None``, or why it was dropped unread (its queue
        is full: a wasted message, which the caller counts)."""
        if self.flooding(cid):
            self.dropped += 1
            return None
        cost = chunk_charge(len(payload))
        queued = self._queued.get(cid, 0)
        if queued + cost > self.bound:
            self.dropped += 1
            return f"its queue holds {queued} bytes (bound {self.bound})"
        queue = self._queues.get(cid)
        if queue is None:
            queue = self._queues[cid] = deque()
        queue.append((kind, payload))
        self._queued[cid] = queued + cost
        self._work.set()
        return None

    async def take(self) -> tuple[int, str, bytes]:
        """The next sender's oldest delivery (its next one waits for every other
        sender's); a sender past its waste budget meanwhile has its deliveries dropped."""
        queues = self._queues
        while True:
            if not queues:
                self._work.clear()
                await self._work.wait()
                continue
            cid, queue = queues.popitem(last=False)
            kind, payload = queue.popleft()
            self._queued[cid] -= chunk_charge(len(payload))
            if queue:
                queues[cid] = queue
            else:
                del self._queued[cid]
            if not self.flooding(cid):
                return cid, kind, payload
            self.dropped += 1
            await asyncio.sleep(0)

    def waste(self, cid: int) -> int:
        """Count one message of ``cid`` that changed nothing; returns its count this
        stage."""
        waste = self._waste.get(cid, 0) + 1
        self._waste[cid] = waste
        return waste

    def new_stage(self) -> None:
        self._waste.clear()
