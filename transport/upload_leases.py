"""The server driver's upload leases (docs/deployment.md 6.1): when each granted sender's
upload slot ends, and when it is taken back.

A grant lasts a lease, the masked_input deadline shared by the waves of senders the slots
take; a sender also loses its slot after the idle limit without a chunk while another
waits for one, or at once when it leaves. The leases only decide; the driver
(``transport/server_driver.py``) grants, cancels and tells the senders. No slot can be
due before :attr:`UploadLeases.due`, so the scan over every slot runs only then, not after
every message; a sender that left is looked at right away (:meth:`UploadLeases.recheck`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable


class UploadLeases:
    """The leases of one masked_input stage: each granted sender's lease end and its
    latest chunk."""

    def __init__(self, idle_limit: Callable[[], float]) -> None:
        self._idle_limit = idle_limit  # seconds without a chunk (Timeouts.upload_idle_limit)
        # uploading client -> when its last chunk arrived (from its first: before that it
        # may still be waiting for the Ciphertexts its grant overtook; its lease applies)
        self._seen: dict[int, float] = {}
        self._end: dict[int, float] = {}  # uploading client -> when its grant ends
        self._lease: float | None = None  # seconds each grant of this stage lasts
        self.due = math.inf
        """No lease can be due for reclaiming before this time (a lower bound, kept as
        grants, chunks and wills come)."""
        self._recheck: set[int] = set()

    def __contains__(self, cid: object) -> bool:
        return cid in self._end

    def length(self, senders: int, slots: int, deadline: float) -> float:
        """How long one grant lasts: the masked_input ``deadline`` shared by the waves of
        ``senders`` the ``slots`` take, ceil(senders / slots), fixed at the stage's first
        grant. Senders that hold their slot to its end still leave every later wave its
        share of the stage; a sender that drips or stalls loses its slot to the next
        wave."""
        if self._lease is None:
            self._lease = deadline / math.ceil(max(1, senders) / slots)
        return self._lease

    def grant(self, cid: int, end: float) -> None:
        self._end[cid] = end
        self.due = min(self.due, end)

    def chunk(self, cid: int, now: float) -> None:
        """A chunk of ``cid``'s stream arrived at ``now``: its idle clock starts again."""
        self._seen[cid] = now
        self.due = min(self.due, now + self._idle_limit())

    def will(self, cid: int, at: float) -> None:
        """``cid``'s last will stood: it keeps its slot, should it come back, and its idle
        clock runs from the will (a killed site loses the slot after the idle limit)."""
        if cid in self._end:
            self._seen[cid] = min(at, self._seen.get(cid, at))
            self.due = min(self.due, at + self._idle_limit())

    def recheck(self, cid: int) -> None:
        """``cid`` left or was refused: look at its slot at the next reclaim."""
        self._recheck.add(cid)

    def forget(self, cid: int) -> None:
        self._seen.pop(cid, None)
        self._end.pop(cid, None)

    def new_stage(self) -> None:
        self._seen.clear()
        self._end.clear()
        self.due = math.inf
        self._recheck.clear()
        self._lease = None

    def reclaim(self, now: float, uploading: Callable[[int], bool],
                left: Callable[[int], str | None], slot_wanted: Callable[[], bool],
                revoke: Callable[[int, str], None]) -> None:
        """``revoke(cid, reason)`` each slot due now: its sender ``left`` (why, else
        ``None``), sent nothing for the idle limit since its last chunk while a slot is
        wanted, or ran out of its lease (which alone bounds a sender that never starts).
        A lease whose sender no longer uploads (``uploading``) is forgotten.

        Every lease is examined only once :attr:`due` has passed (which the scan then
        moves to the next time any lease can be due); between two, only the senders
        rechecked since: O(1) per message, not O(uploads)."""
        idle = self._idle_limit()
        if now >= self.due:
            candidates: Iterable[int] = list(self._end)
            self.due = math.inf
        else:
            candidates = [cid for cid in self._recheck if cid in self._end]
        self._recheck.clear()
        for cid in candidates:
            if not uploading(cid):
                self.forget(cid)
                continue
            why = left(cid)
            if why is not None:
                reason = f"it left while streaming its masked input ({why})"
            elif now - self._seen.get(cid, now) >= idle and slot_wanted():
                reason = (f"its upload slot was taken back: no chunk of its masked input "
                          f"for {idle:g} s while other sites waited for a slot")
            elif now >= self._end[cid]:
                reason = (f"its upload slot was taken back: its masked input did not "
                          f"complete within its lease of {self._lease:g} s (the "
                          f"masked_input deadline shared by the senders that wait)")
            else:
                self.due = min(self.due, self._end[cid], self._seen.get(cid, math.inf) + idle)
                continue
            revoke(cid, reason)  # which forgets its lease
