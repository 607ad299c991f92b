"""Who shares with whom: complete graphs (SecAgg) and random Harary graphs (SecAgg+).

Bell et al. 2020 replace the complete graph of Bonawitz et al. 2017 with a sparse
k-regular graph over a random relabelling of the clients. Each client exchanges pairwise
masks with its graph neighbours and Shamir-shares its secrets among its *closed
neighbourhood* N[u] (itself plus its neighbours). ``neighbors=k`` in :class:`secagg.Config`
is the size of that closed neighbourhood, so the complete graph is ``k = n`` and the
threshold always counts shares among ``k`` holders.

The relabelling is derived from the session id (itself derived from the configuration and
the caller's context, never chosen by the server), so every client computes its own
neighbourhood and rejects a server that claims another one. See docs/protocol.md section 4.

``secagg_plus_parameters`` derives a safe (k, t) the way Bell et al. 2020 and Google's
implementation (``HararyGraphParameterFinder``) do: the honest surviving subgraph stays
connected except with probability 2^-40, no client has t corrupt holders except with
probability 2^-40, and every client keeps t surviving holders except with probability
2^-20; when no sparse graph satisfies this it falls back to the complete graph.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

SECURITY_MODES = ("semi-honest", "malicious")
"""The threat models a round runs under (docs/security.md)."""

SECURITY_BITS = 40
CORRECTNESS_BITS = 20
_SMALL = 1e-14


def harary_neighbors(position: int, degree: int, n: int) -> list[int]:
    """Ring positions adjacent to ``position`` in the Harary graph H(degree, n).

    Even degree: the ``degree/2`` nearest positions on each side. Odd degree adds the
    opposite position (for odd ``n`` one vertex gets one extra edge, as in Harary 1962).
    """
    if degree >= n - 1:
        return [p for p in range(n) if p != position]
    half = degree // 2
    out = {(position + j) % n for j in range(1, half + 1)}
    out |= {(position - j) % n for j in range(1, half + 1)}
    if degree % 2 == 1:
        if n % 2 == 0:
            out.add((position + n // 2) % n)
        else:
            step = (n + 1) // 2
            # edges (i, i + step) for i in 0 .. (n - 1) / 2, both directions
            if position <= (n - 1) // 2:
                out.add((position + step) % n)
            other = (position - step) % n
            if other <= (n - 1) // 2:
                out.add(other)
    out.discard(position)
    return sorted(out)


def _keystream_permutation(seed: bytes, n: int) -> list[int]:
    """A uniformly random permutation of range(n) from a 32-byte seed (Fisher-Yates over
    an AES-CTR stream with rejection sampling, so it is exactly uniform)."""
    encryptor = Cipher(algorithms.AES(seed), modes.CTR(b"\x00" * 16)).encryptor()
    perm = list(range(n))
    buffer = b""
    offset = 0
    for i in range(n - 1, 0, -1):
        bound = i + 1
        limit = (1 << 32) - ((1 << 32) % bound)
        while True:
            if offset + 4 > len(buffer):
                buffer = encryptor.update(b"\x00" * 4096)
                offset = 0
            value = int.from_bytes(buffer[offset:offset + 4], "little")
            offset += 4
            if value < limit:
                break
        j = value % bound
        perm[i], perm[j] = perm[j], perm[i]
    return perm


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: one graph per session
class Graph:
    """The share/mask graph of one session.

    ``closed_neighborhood(u)`` is N[u]: u and every client u exchanges pairwise masks with.
    """

    clients: tuple[int, ...]
    neighbors: int | None
    seed: bytes

    def __post_init__(self) -> None:
        order = sorted(self.clients)
        object.__setattr__(self, "clients", tuple(order))
        # N[u] per client, computed once per graph and freed with it (a module-level cache
        # keyed by graph kept up to 65,536 entries, each holding its graph of a past round).
        object.__setattr__(self, "_neighborhoods", {})
        # survivor_graph_problem's answers, freed with the graph: every client of a process
        # checks the same survivor list on the same graph (O(n k) each time)
        object.__setattr__(self, "_survivor_checks", {})
        object.__setattr__(self, "_all", frozenset(order))  # N[u] of a complete graph
        n = len(order)
        if self.neighbors is None or self.neighbors >= n:
            object.__setattr__(self, "_ring", ())
            object.__setattr__(self, "_position", {})
            return
        perm = _keystream_permutation(self.seed, n)
        ring = tuple(order[p] for p in perm)
        object.__setattr__(self, "_ring", ring)
        object.__setattr__(self, "_position", {c: i for i, c in enumerate(ring)})

    @property
    def is_complete(self) -> bool:
        return self.neighbors is None or self.neighbors >= len(self.clients)

    def closed_neighborhood(self, client_id: int) -> frozenset[int]:
        """N[u]: the holders of u's Shamir shares (u included)."""
        cache: dict[int, frozenset[int]] = self._neighborhoods  # type: ignore[attr-defined]
        found = cache.get(client_id)
        if found is None:
            found = cache[client_id] = _closed_neighborhood(self, client_id)
        return found

    def min_holders(self) -> int:
        """The smallest closed neighbourhood size in the graph."""
        if self.is_complete:
            return len(self.clients)
        assert self.neighbors is not None
        return self.neighbors


def _closed_neighborhood(graph: Graph, client_id: int) -> frozenset[int]:
    if client_id not in graph._all:  # type: ignore[attr-defined]
        raise KeyError(client_id)
    if graph.is_complete:
        all_clients: frozenset[int] = graph._all  # type: ignore[attr-defined]
        return all_clients
    assert graph.neighbors is not None
    ring: tuple[int, ...] = graph._ring  # type: ignore[attr-defined]
    position: dict[int, int] = graph._position  # type: ignore[attr-defined]
    p = position[client_id]
    near = harary_neighbors(p, graph.neighbors - 1, len(ring))
    return frozenset([client_id, *(ring[q] for q in near)])


def survivor_graph_problem(graph: Graph, survivors: Iterable[int], threshold: int
                           ) -> str | None:
    """Why revealing dropped clients' masking keys would be unsafe on this sparse graph,
    or ``None`` (docs/protocol.md section 4.6). Removing the dropouts' masks leaves the
    server with the sum of each connected part of the survivor graph, so the survivors must
    stay connected, and every survivor must keep at least ``threshold`` surviving graph
    neighbours: while fewer than ``threshold`` of its holders are corrupt, one of them is
    honest and their pairwise mask keeps its input hidden even from colluders."""
    alive = frozenset(survivors)
    # the answer is kept with the graph: the clients of one process share it
    # (secagg.session.session_view) and check the same list once, not n times O(n k)
    checks: dict[tuple[frozenset[int], int], str | None]
    checks = graph._survivor_checks  # type: ignore[attr-defined]
    key = (alive, threshold)
    if key not in checks:
        if len(checks) >= _SURVIVOR_CHECKS:
            checks.clear()
        checks[key] = _survivor_graph_problem(graph, alive, threshold)
    return checks[key]


_SURVIVOR_CHECKS = 4
"""Survivor lists whose check one graph remembers (a round has one; then it starts afresh)."""


def _survivor_graph_problem(graph: Graph, alive: frozenset[int], threshold: int
                            ) -> str | None:
    outside = sorted(alive - set(graph.clients))
    if outside:
        return f"rely on a survivor list naming clients outside the roster: {outside[:10]}"
    if graph.is_complete or not alive:
        return None
    neighbours = {s: graph.closed_neighborhood(s) & alive for s in alive}
    for s in sorted(alive):
        if len(neighbours[s]) - 1 < threshold:
            return (f"leave client {s} with {len(neighbours[s]) - 1} surviving graph "
                    f"neighbours, fewer than the threshold {threshold}: its input would be "
                    "exposed to the server and the corrupt ones among them")
    start = min(alive)
    seen = {start}
    frontier = [start]
    while frontier:
        for peer in neighbours[frontier.pop()]:
            if peer not in seen:
                seen.add(peer)
                frontier.append(peer)
    if len(seen) != len(alive):
        return (f"split the {len(alive)} survivors into disconnected parts (one of "
                f"{len(seen)} clients): the server would learn the sum of each part")
    return None


# ---------------------------------------------------------------------------------------
# Parameter selection (Bell et al. 2020, section 3; Google fcp HararyGraphParameterFinder)
# ---------------------------------------------------------------------------------------


def _log_comb(n: int, k: int) -> float:
    if k < 0 or k > n:
        return -math.inf
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def hypergeometric_pmf(population: int, successes: int, draws: int) -> list[float]:
    """P[X = x] for x = 0..draws, X the successes among ``draws`` taken without replacement."""
    denom = _log_comb(population, draws)
    out = []
    for x in range(draws + 1):
        lp = _log_comb(successes, x) + _log_comb(population - successes, draws - x) - denom
        out.append(math.exp(lp) if lp > -math.inf else 0.0)
    return out


def _log_prob_disconnected(n: int, degree: int, bad: int) -> float:
    """Union bound on the honest surviving subgraph of a random Harary graph being
    disconnected: two disjoint runs of degree/2 consecutive removed vertices are needed."""
    run = 2 * (degree // 2)  # two runs of floor(degree/2) each (conservative for odd degree)
    if run > bad:
        return -math.inf
    log_pairs = math.log(n) + math.log(max(n - degree - 1, 1)) - math.log(2)
    return (log_pairs + math.lgamma(bad + 1) + math.lgamma(n - run + 1)
            - math.lgamma(n + 1) - math.lgamma(bad - run + 1))


@dataclass(frozen=True)
class GraphParameters:
    """A (neighbors, threshold) pair. ``neighbors is None`` means the complete graph."""

    num_clients: int
    neighbors: int | None
    threshold: int

    @property
    def holders(self) -> int:
        return self.num_clients if self.neighbors is None else self.neighbors


def _check_rates(dropout_rate: float, corrupt_rate: float, security: str) -> None:
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate={dropout_rate} must be in [0, 1)")
    if not 0.0 <= corrupt_rate < 1.0:
        raise ValueError(f"corrupt_rate={corrupt_rate} must be in [0, 1)")
    if security not in SECURITY_MODES:
        raise ValueError(f"security={security!r}: use one of {SECURITY_MODES}")


def minimum_threshold(holders: int, security: str) -> int:
    """The smallest threshold the protocol accepts for ``holders`` share holders:
    more than half (semi-honest) or more than two thirds (malicious), as in Bonawitz et al."""
    if security == "malicious":
        return (2 * holders) // 3 + 1
    return holders // 2 + 1


def threshold_floor(num_clients: int, neighbors: int | None, security: str) -> int:
    """The smallest threshold ``Config`` accepts: ``minimum_threshold`` of the largest
    share-holder set, which is n (complete graph), k, or k + 1 for one client when k is
    even and n odd (Harary's extra edge)."""
    if neighbors is None or neighbors >= num_clients:
        return minimum_threshold(num_clients, security)
    odd_extra = neighbors % 2 == 0 and num_clients % 2 == 1
    return minimum_threshold(neighbors + 1 if odd_extra else neighbors, security)


def sparse_threshold_range(n: int, k: int, dropout_rate: float, corrupt_rate: float,
                           security: str) -> tuple[int, int] | None:
    """The admissible thresholds (lo, hi) for closed neighbourhoods of size ``k`` in a
    random Harary graph over ``n`` clients, or ``None`` when no threshold is safe.

    lo: no client has ``lo`` corrupt holders (or, against a malicious server,
    2*lo - k corrupt holders) except with probability 2^-40/n; hi: every client keeps
    ``hi`` surviving holders except with probability 2^-20/n.
    """
    degree = k - 1
    # round the bad clients up: a federation of 9 at a 10% rate may well have one
    bad_corrupt = math.ceil(corrupt_rate * n - _SMALL)
    bad_drop = math.ceil(dropout_rate * n - _SMALL)
    log_target = -(SECURITY_BITS + 1) * math.log(2)
    if _log_prob_disconnected(n, degree, bad_corrupt + bad_drop) >= log_target:
        return None
    sec_tail = 2.0 ** -(SECURITY_BITS + 1) / n
    cor_tail = 2.0 ** -CORRECTNESS_BITS / n
    pmf_corrupt = hypergeometric_pmf(n, bad_corrupt, degree)
    # c_max: the most corrupt neighbours a client has, except with probability sec_tail
    tail = 0.0
    c_max = -1
    for a in range(degree, -1, -1):
        if tail + pmf_corrupt[a] > sec_tail:
            c_max = a
            break
        tail += pmf_corrupt[a]
    # semi-honest: the corrupt holders must not reach t; malicious: a server that tells
    # two groups different stories gets at most 2t - k shares of each kind plus the
    # corrupt ones, so 2t > k + c_max (k counts the client itself, which is honest)
    t1 = c_max if security == "semi-honest" else (k + c_max) // 2
    surviving = n - bad_drop
    pmf_alive = hypergeometric_pmf(n, surviving, degree)
    # t2: largest b with P[surviving neighbours < b] <= cor_tail
    cdf = 0.0
    t2 = 0
    for b in range(degree + 1):
        if cdf + pmf_alive[b] > cor_tail:
            t2 = b
            break
        cdf += pmf_alive[b]
    lo = max(t1 + 1, 2, minimum_threshold(k, security))
    if t2 < lo:
        return None
    return lo, t2


def complete_graph_threshold(n: int, corrupt_rate: float, security: str) -> int:
    """The smallest safe threshold on the complete graph: more than the corrupt clients
    (semi-honest), more than (n + corrupt) / 2 (malicious), and the Bonawitz minimum."""
    corrupt = math.ceil(corrupt_rate * n - _SMALL)
    by_corruption = corrupt + 1 if security == "semi-honest" else (n + corrupt) // 2 + 1
    return max(minimum_threshold(n, security), by_corruption, 2)


def check_complete(n: int, threshold: int, dropout_rate: float, corrupt_rate: float,
                   security: str) -> None:
    """Raise ``ValueError`` unless ``threshold`` is safe and live on the complete graph."""
    _check_rates(dropout_rate, corrupt_rate, security)
    low = complete_graph_threshold(n, corrupt_rate, security)
    high = math.floor((1 - dropout_rate + _SMALL) * n)
    if not low <= threshold <= high:
        raise ValueError(
            f"threshold={threshold} is unsafe for num_clients={n} at dropout_rate="
            f"{dropout_rate}, corrupt_rate={corrupt_rate}, security={security!r}: it must be "
            f"in [{low}, {high}] (above the corrupt clients, at most the survivors)")


def secagg_plus_parameters(num_clients: int, dropout_rate: float = 0.1,
                           corrupt_rate: float = 0.1,
                           security: str = "semi-honest") -> GraphParameters:
    """A safe (neighbors, threshold) for ``num_clients`` clients, the expected dropout rate
    and the fraction of corrupt clients (Bell et al. 2020). Falls back to the complete
    graph when no sparse graph is safe; raises ``ValueError`` when not even that is."""
    n = num_clients
    if n < 2:
        raise ValueError(f"num_clients={n}: secure aggregation needs at least 2 clients")
    _check_rates(dropout_rate, corrupt_rate, security)
    def feasible(degree: int) -> tuple[int, int] | None:
        return sparse_threshold_range(n, degree + 1, dropout_rate, corrupt_rate, security)

    # Feasibility mostly grows with the degree (more holders: a smaller corrupt fraction
    # and a larger surviving fraction, fewer disconnecting runs), so search by doubling,
    # bisect, then scan a window below: O(log n + 16) evaluations instead of n/2
    # (Google's finder scans every degree).
    degrees = list(range(2, n - 1, 2))
    hi = next((i for i in (2**j - 1 for j in range(64)) if i >= len(degrees)
               or feasible(degrees[i]) is not None), len(degrees))
    hi = min(hi, len(degrees))
    lo = -1 if hi == 0 else (hi - 1) // 2 - 1
    while hi - lo > 1:  # invariant: degrees[lo] infeasible (or lo = -1), degrees[hi] feasible
        mid = (lo + hi) // 2
        if feasible(degrees[mid]) is not None:
            hi = mid
        else:
            lo = mid
    if hi < len(degrees):
        # feasibility is not strictly monotone in malicious mode (the bound 2t > k + c
        # moves in steps): look a little below the bisection point for a smaller degree
        for i in range(max(0, hi - 16), hi + 1):
            found = feasible(degrees[i])
            if found is not None:
                return GraphParameters(n, degrees[i] + 1, found[0])
    t = complete_graph_threshold(n, corrupt_rate, security)
    survivors = math.floor((1 - dropout_rate + _SMALL) * n)
    if t > survivors:
        raise ValueError(
            f"no safe parameters for num_clients={n}, dropout_rate={dropout_rate}, "
            f"corrupt_rate={corrupt_rate}, security={security!r}: the threshold must be at "
            f"least {t} but only about {survivors} clients survive; lower the dropout rate, "
            "add clients, or use security='semi-honest'")
    return GraphParameters(n, None, t)


def check_pair(clients: Sequence[int] | Iterable[int], neighbors: int, threshold: int,
               dropout_rate: float, corrupt_rate: float, security: str) -> None:
    """Raise ``ValueError`` unless (neighbors, threshold) is safe at the declared rates."""
    n = len(list(clients))
    _check_rates(dropout_rate, corrupt_rate, security)
    found = sparse_threshold_range(n, neighbors, dropout_rate, corrupt_rate, security)
    if found is None or not found[0] <= threshold <= found[1]:
        rec = secagg_plus_parameters(n, dropout_rate, corrupt_rate, security)
        what = ("no threshold is safe for this neighbourhood size" if found is None
                else f"the threshold must be in [{found[0]}, {found[1]}]")
        raise ValueError(
            f"neighbors={neighbors}, threshold={threshold} is unsafe for num_clients={n} at "
            f"dropout_rate={dropout_rate}, corrupt_rate={corrupt_rate} ({what}); use "
            f"neighbors={rec.neighbors}, threshold={rec.threshold} "
            "(secagg.secagg_plus_parameters)")
