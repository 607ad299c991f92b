"""``secagg.Config``: the parameters every party of a round agrees on.

Validation happens at construction and every message says what to change. The canonical
encoding (``Config.encode``) goes into the session id, so parties with different
configurations cannot complete a round together.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from .crypto import MAX_BITS, MIN_BITS
from .graph import SECURITY_MODES, check_complete, check_pair, minimum_threshold, threshold_floor

MAX_CLIENTS = 1 << 20
MAX_DIM = 1 << 31


def required_bits(num_clients: int, max_value: int) -> int:
    """The smallest ``bits`` whose modulus holds the sum of ``num_clients`` inputs that are
    each at most ``max_value``: with it the modular sum is the exact integer sum (the
    aggregate never wraps silently, as Flower's does past ~1000 clients). Raises
    ``ValueError`` when even 64 bits are not enough."""
    if num_clients < 1 or max_value < 0:
        raise ValueError("num_clients must be positive and max_value non-negative")
    bits = max(8, (num_clients * max_value).bit_length())
    if bits > 64:
        raise ValueError(f"{num_clients} inputs of up to {max_value} need {bits} bits; the "
                         "modulus is at most 2**64: scale the inputs down")
    return bits


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Config:
    """Parameters of one secure aggregation round (docs/architecture.md section 4).

    ``neighbors=None`` is the complete graph of Bonawitz et al. 2017; ``neighbors=k`` is
    SecAgg+ (Bell et al. 2020) where every client's secrets are shared among its closed
    neighbourhood of ``k`` clients (itself included), and ``threshold`` counts among those k.
    ``threshold=0`` (the default; ``None`` is accepted too) picks the smallest safe value,
    so after construction ``threshold`` is always the round's plain integer threshold.
    ``dropout_rate`` and ``corrupt_rate``, when given, make ``Config`` check (k, t) against
    the Bell et al. bounds (SecAgg+) or the threshold against the corrupt and surviving
    clients (complete graph); see ``secagg.secagg_plus_parameters`` for a safe pair. A
    sparse graph needs at least one of
    the rates (the other counts as 0): its privacy holds only for the rates it was derived
    for, with dropouts and corruptions independent of the graph (docs/protocol.md 4.6).
    ``unchecked_graph=True`` accepts a sparse graph without them and gives up the guarantee
    that the honest survivors stay connected (the server may learn sums of parts).
    ``norm_bound=B`` (opt-in, the ``validation`` extra) makes every client prove in zero
    knowledge that the vector it masks, read as centred integers mod 2**bits, has L2 norm
    at most B; a client whose proof fails is left out of the sum and named
    (docs/protocol.md section 10). ``weight_index=k`` (with ``norm_bound``) makes each
    client also prove its coordinate k non-negative: the weight of a weighted sum
    (section 10.7).
    """

    num_clients: int
    threshold: int = 0
    dim: int = 1
    bits: int = 32
    neighbors: int | None = None
    security: str = "semi-honest"
    dropout_rate: float | None = None
    corrupt_rate: float | None = None
    unchecked_graph: bool = False
    norm_bound: int | None = None
    weight_index: int | None = None
    _holders: int = field(init=False, repr=False, compare=False, default=0)
    _shape_tag: bytes = field(init=False, repr=False, compare=False, default=b"")

    def __post_init__(self) -> None:
        n = self.num_clients
        if not _is_int(n) or n < 2:
            raise ValueError(f"num_clients={n!r}: need an integer of at least 2")
        if n > MAX_CLIENTS:
            raise ValueError(f"num_clients={n}: at most {MAX_CLIENTS} clients are supported")
        if not _is_int(self.dim) or not 1 <= self.dim <= MAX_DIM:
            raise ValueError(f"dim={self.dim!r}: need an integer in 1..{MAX_DIM}")
        if not _is_int(self.bits) or not MIN_BITS <= self.bits <= MAX_BITS:
            raise ValueError(f"bits={self.bits!r}: the modulus is 2**bits with {MIN_BITS} <= "
                             f"bits <= {MAX_BITS}")
        if self.security not in SECURITY_MODES:
            raise ValueError(
                f"security={self.security!r}: use 'semi-honest' or 'malicious'")
        k = self.neighbors
        if k is not None:
            if not _is_int(k) or k < 3:
                raise ValueError(
                    f"neighbors={k!r}: a SecAgg+ neighbourhood (the client and its graph "
                    "neighbours) needs at least 3 members; use neighbors=None for the "
                    "complete graph")
            if k >= n:
                k = None  # a neighbourhood of everyone is the complete graph
                object.__setattr__(self, "neighbors", None)
        holders = n if k is None else k
        object.__setattr__(self, "_holders", holders)
        object.__setattr__(self, "_shape_tag", struct.pack(">QB", self.dim, self.bits))
        # an even k over an odd n gives one client k + 1 holders (Harary): the threshold
        # must be safe for the largest neighbourhood and reachable in the smallest
        low = threshold_floor(n, k, self.security)
        largest = holders + 1 if low > minimum_threshold(holders, self.security) else holders
        t = self.threshold
        if t is None or (t == 0 and _is_int(t)):
            t = low
            object.__setattr__(self, "threshold", t)
        if not _is_int(t):
            raise ValueError(f"threshold={t!r}: need an integer")
        rule = "more than 2/3" if self.security == "malicious" else "more than half"
        where = (f"of the {holders} clients" if k is None
                 else f"of each client's neighbourhood of up to {largest}")
        if t < low:
            raise ValueError(
                f"threshold={t} is unsafe: with security={self.security!r} it must be {rule} "
                f"{where}, i.e. at least {low}")
        if t > holders:
            raise ValueError(
                f"threshold={t} exceeds the {holders} share holders of "
                f"{'the round' if k is None else 'the smallest neighbourhood'}: lower the "
                f"threshold to at most {holders}")
        for name in ("dropout_rate", "corrupt_rate"):
            rate = getattr(self, name)
            if rate is not None and not (isinstance(rate, (int, float)) and 0 <= rate < 1):
                raise ValueError(f"{name}={rate!r}: need a fraction in [0, 1)")
        if not isinstance(self.unchecked_graph, bool):
            raise ValueError(f"unchecked_graph={self.unchecked_graph!r}: use True or False")
        if (k is not None and self.dropout_rate is None and self.corrupt_rate is None
                and not self.unchecked_graph):
            raise ValueError(
                f"neighbors={k} without dropout_rate or corrupt_rate: a sparse graph keeps "
                "the honest survivors connected only for the rates it was derived for; state "
                "them (secagg.secagg_plus_parameters(num_clients, dropout_rate, corrupt_rate) "
                "gives neighbors and threshold), or pass unchecked_graph=True to give up that "
                "guarantee (the server may then learn the sums of parts of the federation)")
        if self.weight_index is not None and self.norm_bound is None:
            raise ValueError(f"weight_index={self.weight_index!r} without norm_bound: the "
                             "weight is proved non-negative inside the norm proof; set "
                             "norm_bound too, or drop weight_index")
        if self.norm_bound is not None:
            from .validation.norm import check_parameters

            check_parameters(n, self.dim, self.bits, self.norm_bound, self.weight_index)
        if self.dropout_rate is not None or self.corrupt_rate is not None:
            rates = (self.dropout_rate or 0.0, self.corrupt_rate or 0.0)
            if k is not None:
                check_pair(range(n), k, t, *rates, self.security)
            else:
                check_complete(n, t, *rates, self.security)

    @property
    def holders(self) -> int:
        """How many clients hold shares of each client's secrets (n, or k in SecAgg+)."""
        return self._holders

    @property
    def malicious(self) -> bool:
        return self.security == "malicious"

    @property
    def modulus(self) -> int:
        return 1 << self.bits

    def encode(self) -> bytes:
        """Canonical bytes of everything that must match across parties (the norm bound
        and the weight index, when set, are appended: rounds without them keep their
        encoding)."""
        fixed = struct.pack(">IIQBIB", self.num_clients, self.threshold, self.dim,
                            self.bits, self.neighbors or 0, int(self.malicious))
        if self.norm_bound is None:
            return fixed
        fixed += b"|norm_bound|" + self.norm_bound.to_bytes(16, "big")
        if self.weight_index is None:
            return fixed
        return fixed + b"|weight_index|" + self.weight_index.to_bytes(8, "big")

    @property
    def shape_tag(self) -> bytes:
        """Binds masks to the vector shape and modulus (as Google's fcp does)."""
        return self._shape_tag
