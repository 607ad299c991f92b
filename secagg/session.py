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

from .config import Config
from .crypto import PROTOCOL, hkdf, sha256, u32
from .graph import Graph
from .messages import MAX_CLIENT_ID


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
