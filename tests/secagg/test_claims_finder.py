"""docs/protocol.md 9.4 and docs/security.md finding 9: the SecAgg+ parameter finder returns
the smallest feasible closed neighbourhood (and its smallest safe threshold), the answer a
scan of every degree gives, although it bisects and scans only a window below."""

from __future__ import annotations

import itertools
from pathlib import Path

from secagg import secagg_plus_parameters
from secagg.graph import sparse_threshold_range

SIZES = (10, 20, 30, 50, 75, 100, 200, 500)
DROPOUTS = (0.0, 0.05, 0.1, 0.2, 0.3)
CORRUPTIONS = (0.0, 0.05, 0.1, 0.2)
SECURITY = ("semi-honest", "malicious")
GRID = list(itertools.product(SIZES, DROPOUTS, CORRUPTIONS, SECURITY))


def _linear_scan(n: int, dropout: float, corrupt: float, security: str
                 ) -> tuple[int, int] | None:
    """Every even degree from 2 up, as Google's finder does: the first feasible one."""
    for degree in range(2, n - 1, 2):
        found = sparse_threshold_range(n, degree + 1, dropout, corrupt, security)
        if found is not None:
            return degree + 1, found[0]
    return None


def test_the_finder_agrees_with_a_linear_scan_on_the_grid() -> None:
    assert len(GRID) == 320  # the count docs/protocol.md 9.4 quotes
    disagreements = []
    sparse = 0
    for n, dropout, corrupt, security in GRID:
        try:
            params = secagg_plus_parameters(n, dropout, corrupt, security)
            found = None if params.neighbors is None else (params.neighbors,
                                                           params.threshold)
        except ValueError:  # not even the complete graph is safe
            found = None
        expected = _linear_scan(n, dropout, corrupt, security)
        sparse += expected is not None
        if found != expected:
            disagreements.append((n, dropout, corrupt, security, found, expected))
    assert not disagreements
    assert 0 < sparse < len(GRID)  # the grid has both sparse and complete-graph answers


def test_the_parameters_the_docs_quote_are_the_finders() -> None:
    docs = Path(__file__).resolve().parents[2] / "docs"
    text = {name: " ".join((docs / name).read_text(encoding="utf-8").split())
            for name in ("security.md", "flower.md", "performance.md")}
    mal = secagg_plus_parameters(50, 0, 0.1, "malicious")
    assert (mal.neighbors, mal.threshold) == (9, 8)
    assert '`secagg_plus_parameters(50, 0, 0.1, "malicious")` gives (9, 8)' in text["security.md"]
    flower = secagg_plus_parameters(50, 0.1, 0)
    assert (flower.neighbors, flower.threshold) == (13, 7)
    assert "k = 13, t = 7 (`secagg_plus_parameters(50, 0.1, 0)`)" in text["flower.md"]
    for n in (100, 200, 400, 800, 1600):  # the SecAgg+ table of docs/performance.md
        p = secagg_plus_parameters(n, 0.1, 0.1)
        assert f"| {n} | {p.neighbors} | {p.threshold} |" in text["performance.md"]
