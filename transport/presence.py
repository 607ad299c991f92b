"""Which clients the server driver knows are gone this round, and why.

A client is gone for good when it signed off (``"offline"``), aborted, flooded the server
(``"flooding"``) or its caller reported it lost (``"lost"``). A last will alone is not a
goodbye: it stands only after ``will_grace`` seconds (then the client is gone
``"offline"`` by its will), and any later message from the client takes it back, since a
will stands for a connection, which came back. The driver (``transport/server_driver.py``)
stops waiting for a gone client and logs each change.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


class Presence:
    """The clients known to be gone (``gone``: id -> why) and the wills that wait."""

    def __init__(self) -> None:
        self.gone: dict[int, str] = {}
        self._wills: dict[int, float] = {}  # client -> when its last will arrived
        # gone because its will stood for will_grace (not signed off, not aborted): any
        # later delivery from it clears that, and it does not cost it its upload slot
        self._by_will: set[int] = set()

    def left_for_good(self, cid: int) -> str | None:
        """Why ``cid`` is gone, unless only its will stood (``None`` then, or when it is
        not gone)."""
        return self.gone[cid] if cid in self.gone and cid not in self._by_will else None

    def waiting(self, pending_count: int, pending: Iterable[int]) -> bool:
        """Whether one of the ``pending`` clients is not gone: O(1) while more clients are
        pending than gone, O(pending) after."""
        if pending_count > len(self.gone):
            return True
        return any(cid not in self.gone for cid in pending)

    def missing(self, pending: Iterable[int]) -> int:
        """How many of the ``pending`` clients are not gone."""
        return sum(1 for cid in pending if cid not in self.gone)

    # -- changes ---------------------------------------------------------------------

    def will(self, cid: int, now: float) -> None:
        """``cid``'s last will arrived at ``now`` (the first one counts)."""
        self._wills.setdefault(cid, now)

    def wills_standing(self, now: float, grace: float) -> list[tuple[int, float]]:
        """The wills that stood ``grace`` seconds by ``now``, by client and arrival: each
        client is gone ``"offline"`` by its will."""
        stood = [(cid, at) for cid, at in self._wills.items() if now - at >= grace]
        for cid, _ in stood:
            del self._wills[cid]
            self.gone[cid] = "offline"
            self._by_will.add(cid)
        return stood

    def next_will(self, grace: float) -> float:
        """When the next will stands (``inf``: none waits)."""
        return min(self._wills.values()) + grace if self._wills else math.inf

    def leave(self, cid: int, why: str) -> None:
        """``cid`` is gone for good this stage (signed off, aborted or flooding)."""
        self.gone[cid] = why

    def signed_off(self, cid: int) -> None:
        """A final goodbye, also after a will."""
        self.leave(cid, "offline")
        self._wills.pop(cid, None)
        self._by_will.discard(cid)

    def may_sign_off(self, cid: int, final: bool) -> bool:
        """Whether an offline notice from ``cid`` changes anything: it is not gone, or the
        notice is final and only its will stood."""
        return cid not in self.gone or (final and cid in self._by_will)

    def aborted(self, cid: int) -> None:
        self.leave(cid, "aborted")
        self._by_will.discard(cid)

    def lost(self, cid: int) -> bool:
        """The caller knows ``cid`` will send nothing more; ``False`` when it was gone for
        good already."""
        if self.left_for_good(cid) is not None:
            return False
        self.gone[cid] = "lost"
        self._by_will.discard(cid)
        self._wills.pop(cid, None)
        return True

    def back(self, cid: int) -> bool:
        """A message from ``cid``: its will no longer counts. ``True`` when it was gone by
        its will (and is no longer); a sign-off or an abort stays final."""
        self._wills.pop(cid, None)
        if cid not in self._by_will:
            return False
        self._by_will.discard(cid)
        del self.gone[cid]
        return True

    def accepted(self, cid: int) -> None:
        """The server accepted a message of ``cid``: it is not gone, unless it is lost (a
        message it sent before it failed)."""
        if self.gone.get(cid) != "lost":
            self.gone.pop(cid, None)

    def reconnected(self) -> None:
        """The server's connection came back: wills published while the broker was down
        say nothing about the clients, and nobody is gone by one."""
        self._wills.clear()
        for cid in [c for c, why in self.gone.items() if why == "offline"]:
            del self.gone[cid]
        self._by_will.clear()
