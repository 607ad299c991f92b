"""A zero-knowledge proof that the vector a client masks has L2 norm at most B, bound to
the round, the stage and the client (docs/protocol.md section 10).

The client's encoded input v in [0, 2^bits)^d is read as centred integers x (two's
complement mod 2^bits). It commits C = <x, G> + r H (Pedersen vector commitment; r is
derived from its mask keys, section 10.4) and proves, non-interactively (Fiat-Shamir):

* ``||x||^2 + ||q||^2 = B^2`` for slack integers q (8 of them: B^2 - ||x||^2 as a sum of
  squares), so ``||x||^2 <= B^2`` over the integers once wrap-around mod the group order
  is excluded;
* wrap-around is excluded by the approximate smallness proof of Gentry, Halevi and
  Lyubashevsky (Eurocrypt 2022), as ACORN (Bell et al., USENIX Security 2023, section 4)
  uses it: the client reveals z = R (x || q) + y for a ternary matrix R chosen by the hash
  after the commitments and noise y it committed to beforehand; |z_i| <= Z for all rows
  means every coordinate of (x || q) is at most 2Z in absolute value except with
  probability (2/3)^LAMBDA, and the parameters make (d + 8) (2Z)^2 < r / 2;
* with a ``weight_index`` k (the weight of a weighted sum, section 10.7): ``x_k = ||s||^2``
  for 8 more committed integers s (Lagrange: a sum of squares is non-negative), under the
  same smallness projection, so ``0 <= x_k`` over the integers;
* one Sigma-protocol (Schnorr for the two openings, the linear relation of z, and the
  quadratic relations through committed cross terms, as in Bulletproofs' t(x) check) ties
  them to C and D, compressed to (challenge, responses).

Soundness rests on the discrete logarithm in G1 and the random-oracle model for
SHA-512/SHAKE-256; zero knowledge is perfect for the Sigma part and statistical (2^-56)
for z, whose noise floods R(x || q) by SIGMA bits.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import SecAggError
from . import group
from .group import ORDER, POINT_BYTES, SCALAR_BYTES

LAMBDA = 256
"""Rows of the projection: a cheater passes all of them with probability at most
(1 - 85/256)^256 < 2^-149 (each ternary entry is a SHAKE byte mod 3)."""
SLACK = 8
"""Slack squares: four taken greedily, then Lagrange's four for the small rest."""
SIGMA = 64
"""Bits of noise flooding over the largest honest projection."""
Z_BYTES = 17
"""A revealed projection z_i as signed little-endian bytes."""
DOMAIN = b"secagg/v1|input-validation|l2|"
STAGE_LABEL = b"masked_input"
NONNEG_LABEL = b"|nonneg|"
"""Appended to the header, with the index, only in a round with ``weight_index``."""
_BLOCK = 4096  # projection columns per SHAKE block (bounded memory at any d)


class InvalidProof(SecAggError, ValueError):
    """A proof that does not verify; the message says which check failed."""


@dataclass(frozen=True)
class NormStatement:
    """What one proof is about: this round (``session_id``, and ``advertisement``: the
    digest of the client's advertisement of fresh keys, so a session id reused with the
    same context still never accepts another round's proof), this client, the masked
    vector's shape, and the bound B on the L2 norm of its centred integers."""

    session_id: bytes
    client_id: int
    dim: int
    bits: int
    bound: int
    advertisement: bytes = bytes(32)
    weight_index: int | None = None
    """The coordinate also proved non-negative (the weight of a weighted sum, section
    10.7; ``Config.weight_index``), or None."""

    @property
    def width(self) -> int:
        """Length of the witness: x, the norm's slack q, and with ``weight_index`` the
        weight's squares s (x_k = ||s||^2)."""
        return self.dim + SLACK + (0 if self.weight_index is None else SLACK)

    @property
    def projection_bound(self) -> int:
        """T: the largest |<r_i, witness>| of an honest client, sqrt(width) B'
        (||.||_1 <= sqrt(n) ||.||_2, and ||(x || q)||_2 = B exactly; with the weight's
        squares ||(x || q || s)||_2^2 = B^2 + x_k <= B^2 + B < (B + 1)^2, B' = B + 1)."""
        b = self.bound + (0 if self.weight_index is None else 1)
        return math.isqrt(self.width - 1) * b + b

    @property
    def noise_range(self) -> int:
        return self.projection_bound << SIGMA

    @property
    def z_max(self) -> int:
        """Z: the verifier accepts |z_i| <= Z."""
        return self.projection_bound + self.noise_range

    def header(self) -> bytes:
        return (DOMAIN + self.session_id + self.advertisement + STAGE_LABEL
                + struct.pack(">IQBHHH", self.client_id, self.dim, self.bits, LAMBDA,
                              SLACK, SIGMA)
                + self.bound.to_bytes(16, "big")
                + (b"" if self.weight_index is None
                   else NONNEG_LABEL + self.weight_index.to_bytes(8, "big")))

    @property
    def proof_bytes(self) -> int:
        return proof_size(self.dim, self.weight_index is not None)


def proof_size(dim: int, weighted: bool = False) -> int:
    """Bytes of one proof for a vector of ``dim`` elements (``weighted``: with a
    coordinate proved non-negative, section 10.7)."""
    extra = (POINT_BYTES + SCALAR_BYTES + SLACK * SCALAR_BYTES) if weighted else 0
    return (3 * POINT_BYTES + 4 * SCALAR_BYTES + LAMBDA * Z_BYTES
            + (dim + SLACK + LAMBDA) * SCALAR_BYTES + extra)


def check_parameters(num_clients: int, dim: int, bits: int, bound: int,
                     weight_index: int | None = None) -> None:
    """``ValueError`` naming what to change when the bound cannot be proved soundly: the
    sum of num_clients bounded inputs must not wrap mod 2^bits (the server lifts it to the
    integers, section 10.4), and the smallness proof must exclude wrap-around mod r."""
    if not isinstance(bound, int) or isinstance(bound, bool) or bound < 1:
        raise ValueError(f"norm_bound={bound!r}: need a positive integer (the L2 bound on "
                         "the encoded integers)")
    if weight_index is not None and (not isinstance(weight_index, int)
                                     or isinstance(weight_index, bool)
                                     or not 0 <= weight_index < dim):
        raise ValueError(f"weight_index={weight_index!r}: need the index of a coordinate in "
                         f"0..{dim - 1} (the weight proved non-negative), or None")
    if num_clients * bound >= 1 << (bits - 1):
        raise ValueError(
            f"norm_bound={bound} with {num_clients} clients can wrap the sum mod 2**{bits}: "
            f"need num_clients * norm_bound < 2**{bits - 1}; raise bits or lower the bound")
    st = NormStatement(bytes(32), 1, dim, bits, bound, weight_index=weight_index)
    if st.width * (2 * st.z_max) ** 2 >= ORDER // 2:
        raise ValueError(
            f"norm_bound={bound} at dim={dim} is too large for the group order: the "
            "smallness proof needs (dim + 8) * (2 Z)^2 < r / 2 (dim + 16 with "
            "weight_index); lower the bound or dim")


def centered(values: np.ndarray, bits: int) -> list[int]:
    """The encoded vector as centred integers: v if v < 2^(bits-1) else v - 2^bits."""
    half, modulus = 1 << (bits - 1), 1 << bits
    return [v - modulus if v >= half else v for v in np.asarray(values).tolist()]


def blinding(keys: Iterable[tuple[bytes, bool]]) -> int:
    """The commitment blinding carried by masks ``keys`` (sign True: added): each mask key
    k contributes +-H(k), so the blindings cancel and sum exactly as the masks do
    (section 10.4)."""
    total = 0
    for key, added in keys:
        h = int.from_bytes(hashlib.sha512(b"secagg/v1|commitment-blinding|" + bytes(key))
                           .digest(), "little")
        total += h if added else -h
    return total % ORDER


def four_square_slack(n: int) -> list[int]:
    """SLACK integers whose squares sum to ``n`` >= 0 (n < 2^256): four greedy squares,
    then Lagrange's four for the rest (below 2^19: each greedy step leaves less than
    2 sqrt(n) + 1)."""
    if n < 0 or n >> 256:
        raise ValueError("the slack must be in [0, 2^256)")
    out = []
    for _ in range(4):
        a = math.isqrt(n)
        out.append(a)
        n -= a * a
    limit = math.isqrt(n)
    for a in range(limit, -1, -1):
        ra = n - a * a
        for b in range(min(a, math.isqrt(ra)), -1, -1):
            rb = ra - b * b
            for c in range(min(b, math.isqrt(rb)), -1, -1):
                rc = rb - c * c
                d = math.isqrt(rc)
                if d * d == rc:
                    return [*out, a, b, c, d]
    raise AssertionError("Lagrange's four-square theorem")  # unreachable


def _generators(dim: int, weighted: bool = False
                ) -> tuple[list[group.Point], list[group.Point], list[group.Point],
                           group.Point, group.Point]:
    """G (the input's), the committed slack's (Q, then S for the weight's squares), K
    (the noise's), H and G0."""
    g = group.vector_generators(b"G", dim)
    q = group.vector_generators(b"Q", SLACK)
    if weighted:
        q = q + group.vector_generators(b"S", SLACK)
    k = group.vector_generators(b"K", LAMBDA)
    h, g0 = group.vector_generators(b"H", 2)
    return g, q, k, h, g0


def input_generators(dim: int) -> tuple[list[group.Point], group.Point]:
    """The generators of the input commitment C = <x, G> + r H."""
    g, _, _, h, _ = _generators(dim)
    return g, h


def project(seed: bytes, values: Sequence[int]) -> list[int]:
    """R @ values mod r, R the LAMBDA x len(values) ternary matrix drawn from ``seed``:
    16-bit limbs in int64 (no overflow below 2^47 columns), SHAKE-256 block by block."""
    m = len(values)
    raw = b"".join((v % ORDER).to_bytes(32, "little") for v in values)
    limbs = np.frombuffer(raw, dtype="<u2").reshape(m, 16).astype(np.int64)
    acc = np.zeros((LAMBDA, 16), dtype=np.int64)
    for block, start in enumerate(range(0, m, _BLOCK)):
        cols = min(_BLOCK, m - start)
        stream = hashlib.shake_256(seed + block.to_bytes(8, "big")).digest(LAMBDA * cols)
        r = np.frombuffer(stream, dtype=np.uint8).reshape(LAMBDA, cols) % 3
        acc += (r.astype(np.int64) - 1) @ limbs[start:start + cols]
    return [sum(int(a) << (16 * k) for k, a in enumerate(row)) % ORDER
            for row in acc]


def _seed(header: bytes, c_bytes: bytes, d_bytes: bytes) -> bytes:
    return hashlib.sha512(header + b"|projection|" + c_bytes + d_bytes).digest()


def _challenge(header: bytes, seed: bytes, z: bytes, a_c: group.Point, a_d: group.Point,
               a_z: Sequence[int], t1: bytes, t0: group.Point,
               u: tuple[bytes, group.Point] | None) -> int:
    h = hashlib.sha512(header + b"|challenge|" + seed + z)
    for point in (a_c, a_d):
        h.update(group.encode_point(point))
    h.update(b"".join(group.encode_scalar(v) for v in a_z))
    h.update(t1 + group.encode_point(t0))
    if u is not None:  # the weight's relation (section 10.7): U1, U0
        h.update(u[0] + group.encode_point(u[1]))
    return int.from_bytes(h.digest(), "little") % ORDER


def _rand() -> int:
    return secrets.randbelow(ORDER)


def prove(statement: NormStatement, values: np.ndarray, blind: int) -> bytes:
    """The proof for the encoded vector ``values`` (what the client masks) with the
    commitment blinding ``blind``. ``ValueError`` if its norm exceeds the bound."""
    st = statement
    x = centered(values, st.bits)
    if len(x) != st.dim:
        raise ValueError(f"the input has {len(x)} elements; the statement is for {st.dim}")
    norm2 = sum(v * v for v in x)
    if norm2 > st.bound * st.bound:
        raise ValueError(f"the input's L2 norm is sqrt({norm2}) > norm_bound={st.bound}: "
                         "clip it to the bound before masking")
    witness = x + four_square_slack(st.bound * st.bound - norm2)
    if st.weight_index is not None:
        weight = x[st.weight_index]
        if weight < 0:
            raise ValueError(f"the weight (coordinate {st.weight_index}) is {weight} < 0: a "
                             "weight must be non-negative")
        witness += four_square_slack(weight)
    return prove_relation(st, witness, blind)


def prove_relation(statement: NormStatement, witness: Sequence[int], blind: int) -> bytes:
    """The Sigma-protocol of section 10.1 for the witness (x || q) (d + SLACK integers,
    taken mod r; with ``weight_index``, (x || q || s), s SLACK more: section 10.7),
    whatever it is: ``prove`` is the honest front door that checks the bound and computes
    q and s. A witness that does not satisfy the relations gives a proof that does not
    verify (the soundness tests forge with it)."""
    st = statement
    if len(witness) != st.width:
        raise ValueError(f"the witness has {len(witness)} elements; need {st.width}")
    v = [int(a) for a in witness]
    x, q = v[:st.dim], v[st.dim:]
    weighted = st.weight_index is not None
    norm_len = st.dim + SLACK  # the norm's relation is on (x || q)
    g, gq, k, h, g0 = _generators(st.dim, weighted)
    y = [secrets.randbelow(st.noise_range) for _ in range(LAMBDA)]
    r_d = _rand()
    c_bytes = group.encode_point(group.msm([*g, h], [*x, blind]))
    d_bytes = group.encode_point(group.msm([*gq, *k, h], [*q, *y, r_d]))
    header = st.header()
    seed = _seed(header, c_bytes, d_bytes)
    half = ORDER // 2
    z = [(p - ORDER if p > half else p) + yi for p, yi in zip(project(seed, v), y, strict=True)]
    # a cheater's z may not fit: it is cut to its low bytes (and fails the check anyway)
    width = 8 * Z_BYTES - 1
    z_bytes = b"".join((((zi + (1 << width)) % (1 << (width + 1))) - (1 << width))
                       .to_bytes(Z_BYTES, "little", signed=True) for zi in z)
    rho = [_rand() for _ in v]
    rho_y = [_rand() for _ in range(LAMBDA)]
    alpha_c, alpha_d, tau1, tau0 = _rand(), _rand(), _rand(), _rand()
    t1 = 2 * sum(a * b for a, b in zip(rho[:norm_len], v[:norm_len], strict=True)) % ORDER
    t0 = sum(a * a for a in rho[:norm_len]) % ORDER
    a_c = group.msm([*g, h], [*rho[:st.dim], alpha_c])
    a_d = group.msm([*gq, *k, h], [*rho[st.dim:], *rho_y, alpha_d])
    a_z = [(a + b) % ORDER for a, b in zip(project(seed, rho), rho_y, strict=True)]
    t1_bytes = group.encode_point(group.msm([g0, h], [t1, tau1]))
    t0_point = group.msm([g0, h], [t0, tau0])
    u: tuple[bytes, group.Point] | None = None
    ups0 = ups1 = 0
    if st.weight_index is not None:
        # ||s||^2 = x_k: sum (rho_s + c s)^2 - c (rho_k + c x_k) = c u1 + u0
        rho_s, s = rho[norm_len:], v[norm_len:]
        u1 = (2 * sum(a * b for a, b in zip(rho_s, s, strict=True))
              - rho[st.weight_index]) % ORDER
        u0 = sum(a * a for a in rho_s) % ORDER
        ups1, ups0 = _rand(), _rand()
        u = (group.encode_point(group.msm([g0, h], [u1, ups1])),
             group.msm([g0, h], [u0, ups0]))
    c = _challenge(header, seed, z_bytes, a_c, a_d, a_z, t1_bytes, t0_point, u)
    u_bytes = [] if u is None else [u[0]]
    u_scalars = [] if u is None else [(ups0 + c * ups1) % ORDER]
    w = [(a + c * b) % ORDER for a, b in zip(rho, v, strict=True)]
    w_y = [(a + c * b) % ORDER for a, b in zip(rho_y, y, strict=True)]
    scalars = [c, (alpha_c + c * blind) % ORDER, (alpha_d + c * r_d) % ORDER,
               (tau0 + c * tau1) % ORDER, *u_scalars]
    return b"".join([c_bytes, d_bytes, t1_bytes, *u_bytes,
                     *(group.encode_scalar(s) for s in scalars), z_bytes,
                     *(group.encode_scalar(s) for s in w),
                     *(group.encode_scalar(s) for s in w_y)])


def commitment(proof: bytes) -> bytes:
    """The input commitment C a proof carries (its first 48 bytes)."""
    return bytes(proof[:POINT_BYTES])


def verify(statement: NormStatement, proof: bytes) -> group.Point:
    """Check ``proof`` for ``statement``; returns the input commitment C as a point.
    Raises ``InvalidProof`` naming the failed check (any bytes: never another error)."""
    st = statement
    if len(proof) != st.proof_bytes:
        raise InvalidProof(f"the proof has {len(proof)} bytes; a proof for dim={st.dim} "
                           f"has {st.proof_bytes}")
    pos = 0

    def take(size: int) -> bytes:
        nonlocal pos
        pos += size
        return bytes(proof[pos - size:pos])

    weighted = st.weight_index is not None
    try:
        c_bytes, d_bytes, t1_bytes = take(POINT_BYTES), take(POINT_BYTES), take(POINT_BYTES)
        big_c, big_d, big_t1 = (group.decode_point(b) for b in (c_bytes, d_bytes, t1_bytes))
        u1_bytes = take(POINT_BYTES) if weighted else b""
        big_u1 = group.decode_point(u1_bytes) if weighted else None
        c, beta_c, beta_d, tau = (group.decode_scalar(take(SCALAR_BYTES)) for _ in range(4))
        upsilon = group.decode_scalar(take(SCALAR_BYTES)) if weighted else 0
        z_bytes = take(LAMBDA * Z_BYTES)
        w = [group.decode_scalar(take(SCALAR_BYTES)) for _ in range(st.width)]
        w_y = [group.decode_scalar(take(SCALAR_BYTES)) for _ in range(LAMBDA)]
    except ValueError as exc:
        raise InvalidProof(f"malformed proof: {exc}") from None
    z = [int.from_bytes(z_bytes[i:i + Z_BYTES], "little", signed=True)
         for i in range(0, len(z_bytes), Z_BYTES)]
    z_max = st.z_max
    if any(abs(zi) > z_max for zi in z):
        raise InvalidProof("a projection of the input is too large: its norm exceeds the "
                           "bound (or the proof was made for another vector)")
    g, gq, k, h, g0 = _generators(st.dim, weighted)
    header = st.header()
    seed = _seed(header, c_bytes, d_bytes)
    a_c = group.msm([*g, h, big_c], [*w[:st.dim], beta_c, -c])
    a_d = group.msm([*gq, *k, h, big_d], [*w[st.dim:], *w_y, beta_d, -c])
    a_z = [(a + b - c * zi) % ORDER
           for a, b, zi in zip(project(seed, w), w_y, z, strict=True)]
    norm_len = st.dim + SLACK
    ww = sum(a * a for a in w[:norm_len]) % ORDER
    b2 = st.bound * st.bound
    t0 = group.msm([g0, h, big_t1], [ww - c * c * b2, tau, -c])
    u: tuple[bytes, group.Point] | None = None
    if st.weight_index is not None:  # ||s||^2 = x_k (section 10.7)
        ss = (sum(a * a for a in w[norm_len:]) - c * w[st.weight_index]) % ORDER
        u = (u1_bytes, group.msm([g0, h, big_u1], [ss, upsilon, -c]))
    if _challenge(header, seed, z_bytes, a_c, a_d, a_z, t1_bytes, t0, u) != c:
        raise InvalidProof("the proof does not verify: the norm exceeds the bound"
                           + (", the weight is negative" if weighted else "")
                           + ", or it was made for another round, client or commitment")
    return big_c


def check_sum(commitments: Sequence[group.Point], total: np.ndarray, bits: int,
              blind_sum: int) -> bool:
    """Whether the included clients' commitments add up to a commitment to the unmasked
    sum (lifted to the integers: it does not wrap, ``check_parameters``) with the blinding
    the masks carried: true iff every included client masked what it proved (section
    10.4), except with negligible probability."""
    s = centered(total, bits)
    g, h = input_generators(len(s))
    left = group.msm(list(commitments), [1] * len(commitments))
    right = group.msm([*g, h], [*s, blind_sum])
    return bool(left == right)
