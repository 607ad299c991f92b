"""Why the server refused each client's messages (``Server.rejected``), in memory bounded by
the roster whatever a client sends."""

from __future__ import annotations

from collections.abc import Iterable, Iterator


class RejectionLog:
    """``Server.rejected``: why the server refused each client's messages, one entry per
    client (its latest reason, and how many were refused), most recent last.

    Iterating gives ``(client id, latest reason)`` pairs (indexing too, ``log[-1]``);
    ``count(cid)`` is how many of ``cid``'s messages were refused. The memory is bounded
    by the roster, whatever a client sends: a flood of refused messages only moves its
    entry to the end and adds to its count. Ids outside the roster (a caller handing the
    server an unauthenticated id) share ``spare`` further entries, the oldest evicted."""

    def __init__(self, roster: Iterable[int], spare: int = 16) -> None:
        self._limit = len(frozenset(roster)) + spare
        self._latest: dict[int, str] = {}
        self._counts: dict[int, int] = {}

    def append(self, entry: tuple[int, str]) -> None:
        cid, reason = entry
        self._latest.pop(cid, None)  # re-inserted: the most recent comes last
        self._latest[cid] = reason
        self._counts[cid] = self._counts.get(cid, 0) + 1
        while len(self._latest) > self._limit:
            oldest = next(iter(self._latest))
            del self._latest[oldest], self._counts[oldest]

    def count(self, client_id: int) -> int:
        """How many of ``client_id``'s messages were refused (0: none, or evicted)."""
        return self._counts.get(client_id, 0)

    def __iter__(self) -> Iterator[tuple[int, str]]:
        return iter(list(self._latest.items()))

    def __len__(self) -> int:
        return len(self._latest)

    def __getitem__(self, index: int) -> tuple[int, str]:
        return list(self._latest.items())[index]

    def __repr__(self) -> str:
        return f"RejectionLog({[(c, self._counts[c], r) for c, r in self._latest.items()]})"
