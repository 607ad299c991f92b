"""The clients of one session in one process share its public view (roster, members,
session id, SecAgg+ graph): building n clients costs O(n) each in time and memory, not
O(n) each *again* per client (``secagg simulate``'s workers build thousands)."""

from __future__ import annotations

import numpy as np
import pytest

from secagg import Client, Config
from secagg.session import derive_session_id, session_graph, session_view

CONFIG = Config(num_clients=60, dim=4, neighbors=15, dropout_rate=0.1)
ROSTER = tuple(range(1, 61))


def _client(cid: int, roster: object = ROSTER, context: bytes = b"view") -> Client:
    return Client(CONFIG, cid, np.zeros(4, np.uint32), roster=roster,  # type: ignore[arg-type]
                  context=context)


def test_clients_of_one_roster_object_share_one_view() -> None:
    a, b = _client(1), _client(2)
    assert a.graph is b.graph and a.roster is b.roster and a._members is b._members
    assert a.session_id == b.session_id == derive_session_id(CONFIG, ROSTER, b"view")
    # the shared graph is the one each would derive alone
    alone = session_graph(CONFIG, ROSTER, a.session_id)
    assert all(a.graph.closed_neighborhood(c) == alone.closed_neighborhood(c) for c in ROSTER)


def test_another_context_or_a_mutable_roster_is_derived_afresh() -> None:
    assert _client(1, context=b"other").session_id != _client(1).session_id
    roster = list(ROSTER)
    first = _client(1, roster=roster)
    roster[-1] = 61  # a list may change between two clients: never reused
    second = _client(1, roster=roster)
    assert 61 in second.roster and 61 not in first.roster
    assert first.session_id != second.session_id


def test_a_bad_roster_is_refused_also_when_a_view_is_cached() -> None:
    _client(1)
    with pytest.raises(ValueError, match="not in the roster"):
        _client(61)
    with pytest.raises(TypeError, match="context must be bytes"):
        session_view(CONFIG, ROSTER, "text")  # type: ignore[arg-type]


def test_the_survivor_graph_check_is_answered_once_per_graph_and_list() -> None:
    """Every client of a process checks the same survivor list on the shared graph
    (docs/protocol.md 4.6): one computation, the same answer, also for a refused list."""
    from secagg import graph as graph_module

    a, b = _client(1), _client(2)
    calls = []
    real = graph_module._survivor_graph_problem

    def counting(*args: object) -> object:
        calls.append(args)
        return real(*args)  # type: ignore[arg-type]

    graph_module._survivor_graph_problem = counting  # type: ignore[assignment]
    try:
        alive = [c for c in ROSTER if c != 5]
        first = graph_module.survivor_graph_problem(a.graph, alive, 8)
        assert graph_module.survivor_graph_problem(b.graph, set(alive), 8) == first is None
        lonely = sorted(a.graph.closed_neighborhood(1))  # too few neighbours survive
        refused = graph_module.survivor_graph_problem(a.graph, lonely, 8)
        assert refused is not None and ("fewer" in refused or "disconnected" in refused)
        assert graph_module.survivor_graph_problem(b.graph, lonely, 8) == refused
    finally:
        graph_module._survivor_graph_problem = real  # type: ignore[assignment]
    assert len(calls) == 2
