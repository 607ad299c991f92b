"""What both sides derive before a round starts: the session id and the graph.

The session id is not an opaque value sent by the server (Google's fcp trusts a server-sent
one): every party derives it from the configuration, the roster of client ids and the
caller's context (round number, model hash, federation name...), so a client checks what it
is bound to. Whoever picks the roster and context fixes the id; put randomness the server
cannot choose into the context if grinding the SecAgg+ relabelling matters (docs/protocol.md
section 9). Freshness comes from the ephemeral keys that every later derivation also binds.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .config import Config
from .crypto import PROTOCOL, hkdf, sha256, u32
from .graph import Graph
from .wire import MAX_CLIENT_ID


def normalize_roster(config: Config, roster: Iterable[int] | None) -> tuple[int, ...]:
    """The sorted client ids of the round (default 1..n); validated against the config."""
    ids = tuple(range(1, config.num_clients + 1)) if roster is None else tuple(roster)
    for cid in ids:
        if not isinstance(cid, int) or isinstance(cid, bool) or not 1 <= cid <= MAX_CLIENT_ID:
            raise ValueError(f"client id {cid!r}: ids are integers in 1..{MAX_CLIENT_ID}")
    if len(set(ids)) != len(ids):
        raise ValueError("the roster repeats a client id; give every client a distinct id")
    if len(ids) != config.num_clients:
        raise ValueError(
            f"the roster has {len(ids)} clients but num_clients={config.num_clients}; "
            "make them agree")
    return tuple(sorted(ids))


def derive_session_id(config: Config, roster: tuple[int, ...], context: bytes) -> bytes:
    if not isinstance(context, (bytes, bytearray)):
        raise TypeError("context must be bytes (e.g. round number and model hash)")
    roster_bytes = b"".join(u32(c) for c in roster)
    return sha256(PROTOCOL, b"|session|", config.encode(), sha256(roster_bytes),
                  sha256(bytes(context)))


def session_graph(config: Config, roster: tuple[int, ...], session_id: bytes) -> Graph:
    seed = hkdf(session_id, session_id, PROTOCOL + b"|graph-relabelling")
    return Graph(roster, config.neighbors, seed)


@dataclass(frozen=True, eq=False)
class SessionView:
    """What every party of one session derives from (config, roster, context), all public:
    the sorted roster, its members, the session id and the graph."""

    roster: tuple[int, ...]
    members: frozenset[int]
    session_id: bytes
    graph: Graph


_SHARED_VIEWS = 8
"""How many sessions' views one process keeps for reuse (then it starts afresh). Only
single dict operations touch the cache (each atomic under the GIL): no lock, no threads in
the sans-IO core."""
_views: dict[tuple[int, Config, bytes], tuple[object, SessionView]] = {}


def session_view(config: Config, roster: Iterable[int] | None, context: bytes) -> SessionView:
    """The session's view, derived once per process for every client built from the same
    immutable roster object (a tuple, a range or None): ``secagg simulate``'s workers build
    thousands of clients of one session, and deriving the roster, its set and the SecAgg+
    graph (O(n) each) per client made building them O(n^2) in time and memory (10,000
    clients: a 10,000-entry graph per client). Everything here is public and immutable, so
    sharing it between clients shares nothing secret."""
    if not isinstance(context, (bytes, bytearray)):
        raise TypeError("context must be bytes (e.g. round number and model hash)")
    immutable = roster is None or isinstance(roster, (tuple, range))
    key = (id(roster), config, bytes(context))
    if immutable:
        hit = _views.get(key)
        if hit is not None and hit[0] is roster:
            return hit[1]
    ids = normalize_roster(config, roster)
    session_id = derive_session_id(config, ids, context)
    view = SessionView(ids, frozenset(ids), session_id, session_graph(config, ids, session_id))
    if immutable:  # the entry holds the roster object: its id is not reused while cached
        if len(_views) >= _SHARED_VIEWS:
            _views.clear()
        _views[key] = (roster, view)
    return view
