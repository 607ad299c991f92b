"""Shamir secret sharing of 32-byte secrets over the prime field GF(2^256 + 297).

The field is the smallest prime field that holds every 32-byte string, so a secret is
shared as one field element (no chunking, no GF(2^128) arithmetic as in Flower). Shares
are evaluated at the holders' client ids (nonzero, distinct). Speed comes from caching:
the powers x^j mod p for a holder set and the Lagrange weights for a reconstruction set
are computed once and reused for every secret of the round, so a split is one C-level
dot product per holder and a reconstruction is one dot product per secret.

Coefficients are drawn from ``os.urandom`` with rejection sampling (exactly uniform).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from functools import lru_cache
from operator import mul
from typing import Any

import numpy as np

from .errors import ShamirError as ShamirError  # re-exported

PRIME = (1 << 256) + 297
SHARE_BYTES = 33
SECRET_BYTES = 32


def _random_field_elements(count: int) -> list[int]:
    out: list[int] = []
    while len(out) < count:
        raw = os.urandom(33 * (count - len(out)))
        for i in range(0, len(raw), 33):
            # 264 random bits, keep values below the largest multiple of p: exactly uniform
            value = int.from_bytes(raw[i:i + 33], "big")
            if value < PRIME * ((1 << 264) // PRIME):
                out.append(value % PRIME)
    return out[:count]


def _check_holders(holders: Sequence[int], threshold: int) -> tuple[int, ...]:
    xs = tuple(holders)
    if len(set(xs)) != len(xs):
        raise ShamirError("share holders must be distinct")
    if any(x <= 0 or x >= PRIME for x in xs):
        raise ShamirError("share holder ids must be positive field elements")
    if not 1 <= threshold <= len(xs):
        raise ShamirError(f"threshold {threshold} must be in 1..{len(xs)} (the holder count)")
    return xs


_LIMBS = 17  # 16-bit limbs of a field element (p < 2^257)
_OUT_LIMBS = 40  # limbs of an unreduced dot product (< t * p^2 < 2^(514 + log2 t))


_P_LIMBS = [(PRIME >> (16 * i)) & 0xFFFF for i in range(_LIMBS)]


def _normalize(limbs: Any, upto: int) -> None:
    """Carry-propagate limb rows 0..upto (signed carries: ``>>`` floors)."""
    for m in range(upto):
        carry = limbs[m] >> 16
        limbs[m] &= 0xFFFF
        limbs[m + 1] += carry


@lru_cache(maxsize=64)
def _limb_power_table(xs: tuple[int, ...], degree: int) -> np.ndarray:
    """x^j mod p (up to a multiple of p, value < 2^258) for every holder x and j <= degree,
    as float64 16-bit limbs shaped (degree + 1, holders * 17): the right operand of one
    plain BLAS product.

    Built column by column in numpy, all holders at once: a column is the previous block
    times y = x^m (m chosen so y < 2^32, hence limb * y < 2^48 fits int64), then folded
    with 2^256 = -297 (mod p). No Python big-int arithmetic per entry.
    """
    h = len(xs)
    bits = max(x.bit_length() for x in xs)
    m = max(1, min(32 // bits, degree + 1))
    table = np.empty((degree + 1, h, _LIMBS), dtype=np.float64)
    block = np.zeros((_LIMBS + 4, m * h), dtype=np.int64)
    first = b"".join((x ** i % PRIME).to_bytes(2 * _LIMBS, "little")
                     for i in range(m) for x in xs)
    block[:_LIMBS] = np.frombuffer(first, dtype="<u2").reshape(m * h, _LIMBS).T
    multiplier = np.tile(np.array([x ** m for x in xs], dtype=np.int64), m)
    j = 0
    while True:
        for i in range(m):
            if j + i <= degree:
                table[j + i] = block[:_LIMBS, i * h:(i + 1) * h].T
        j += m
        if j > degree:
            return table.reshape(degree + 1, h * _LIMBS)
        block *= multiplier  # limbs < 2^17, y < 2^32: products < 2^49
        _normalize(block, _LIMBS + 3)
        high = block[16] + (block[17] << 16) + (block[18] << 32) + (block[19] << 48)
        block[16:] = 0
        # value = low + high * 2^256 = low - 297 * high + p  (mod p), kept positive
        block[0] += 297 - 297 * high
        block[16] = 1
        _normalize(block, _LIMBS - 1)


def _evaluate_all(coefficients: list[list[int]], xs: tuple[int, ...]) -> list[list[int]]:
    """f_s(x) mod p for every polynomial s and holder x.

    Field elements are split into 16-bit limbs, so every limb product is < 2^34 and a sum
    of t of them is < 2^53 (exact in float64) for t < 2^19: the evaluation is one BLAS
    matrix product plus a carry pass, instead of t * len(xs) Python big-int products.
    """
    degree = len(coefficients[0]) - 1
    count = len(coefficients)
    table = _limb_power_table(xs, degree)  # (t, h * 17)
    raw = b"".join(c.to_bytes(2 * _LIMBS, "little") for coeffs in coefficients for c in coeffs)
    coeff_limbs = np.frombuffer(raw, dtype="<u2").reshape(count, degree + 1, _LIMBS)
    left = coeff_limbs.transpose(0, 2, 1).reshape(count * _LIMBS, degree + 1)
    product: Any = (left.astype(np.float64) @ table).astype(np.int64)
    product = product.reshape(count, _LIMBS, len(xs), _LIMBS)  # (s, coeff limb, h, power limb)
    acc: Any = np.zeros((_OUT_LIMBS, count, len(xs)), dtype=np.int64)
    for a in range(_LIMBS):
        acc[a:a + _LIMBS] += product[:, a].transpose(2, 0, 1)
    _normalize(acc, _OUT_LIMBS - 1)
    packed = np.ascontiguousarray(acc.transpose(1, 2, 0)).astype("<u2")  # (s, h, limbs)
    return [[int.from_bytes(packed[s, i].tobytes(), "little") % PRIME
             for i in range(len(xs))] for s in range(count)]


def split_many(secrets: Sequence[bytes], holders: Sequence[int],
               threshold: int) -> list[dict[int, bytes]]:
    """Share each 32-byte secret t-of-len(holders); returns, per secret, holder -> share."""
    xs = _check_holders(holders, threshold)
    coefficients = []
    for secret in secrets:
        if len(secret) != SECRET_BYTES:
            raise ShamirError(f"secrets are {SECRET_BYTES} bytes, got {len(secret)}")
        coefficients.append(
            [int.from_bytes(secret, "big"), *_random_field_elements(threshold - 1)])
    if not coefficients:
        return []
    values = _evaluate_all(coefficients, xs)
    return [{x: v.to_bytes(SHARE_BYTES, "big") for x, v in zip(xs, row, strict=True)}
            for row in values]


def split(secret: bytes, holders: Sequence[int], threshold: int) -> dict[int, bytes]:
    """Share one 32-byte secret t-of-len(holders)."""
    return split_many([secret], holders, threshold)[0]


def _batch_inverse(values: Sequence[int]) -> list[int]:
    """Inverses mod p of all values with one modular inversion (Montgomery's trick)."""
    prefix = [1]
    for v in values:
        prefix.append(prefix[-1] * v % PRIME)
    inv = pow(prefix[-1], -1, PRIME)
    out = [0] * len(values)
    for i in range(len(values) - 1, -1, -1):
        out[i] = inv * prefix[i] % PRIME
        inv = inv * values[i] % PRIME
    return out


@lru_cache(maxsize=1024)
def _barycentric_weights(xs: tuple[int, ...]) -> tuple[int, ...]:
    """w_i = 1 / prod_{j != i} (x_i - x_j) mod p."""
    denominators = []
    for i, xi in enumerate(xs):
        d = 1
        for j, xj in enumerate(xs):
            if j != i:
                d *= xi - xj  # exact small integers; one reduction at the end
        denominators.append(d % PRIME)
    return tuple(_batch_inverse(denominators))


@lru_cache(maxsize=1024)
def lagrange_weights(xs: tuple[int, ...]) -> tuple[int, ...]:
    """Weights l_i with f(0) = sum l_i f(x_i) for any polynomial of degree < len(xs):
    l_i = w_i * prod_{j != i} (0 - x_j), w_i the barycentric weight."""
    weights = _barycentric_weights(xs)
    full = 1
    for x in xs:
        full = full * (-x) % PRIME
    inverses = _batch_inverse([(-x) % PRIME for x in xs])
    return tuple(w * full % PRIME * inv % PRIME
                 for w, inv in zip(weights, inverses, strict=True))


def decode_share(share: bytes) -> int:
    if len(share) != SHARE_BYTES:
        raise ShamirError(f"a share is {SHARE_BYTES} bytes, got {len(share)}")
    value = int.from_bytes(share, "big")
    if value >= PRIME:
        raise ShamirError("share value is not a field element")
    return value


def reconstruct_value(shares: Mapping[int, int], threshold: int) -> int:
    """f(0) from the first ``threshold`` shares (by holder id) as a field element."""
    if len(shares) < threshold:
        raise ShamirError(f"need {threshold} shares, have {len(shares)}")
    xs = tuple(sorted(shares)[:threshold])
    weights = lagrange_weights(xs)
    total: int = sum(map(mul, weights, (shares[x] for x in xs)))
    return total % PRIME


def reconstruct(shares: Mapping[int, bytes], threshold: int) -> bytes:
    """The 32-byte secret from at least ``threshold`` shares (holder id -> share)."""
    value = reconstruct_value({x: decode_share(s) for x, s in shares.items()}, threshold)
    if value >= 1 << 256:
        raise ShamirError("shares are inconsistent: the reconstructed value is not 32 bytes")
    return value.to_bytes(SECRET_BYTES, "big")


def evaluate_at(shares: Mapping[int, int], xs: tuple[int, ...], at: int) -> int:
    """The polynomial through the points (x, shares[x]) for x in ``xs``, evaluated at ``at``."""
    return extrapolate(shares, xs, [at])[0]


# --- error correction (Gao 2003, a Reed-Solomon decoder) ------------------------------------
# Shamir shares are a Reed-Solomon codeword: with m shares of a degree t-1 polynomial, up to
# (m - t) / 2 corrupted shares can be corrected and their holders named, without guessing.


def _trim(poly: list[int]) -> list[int]:
    while poly and poly[-1] == 0:
        poly.pop()
    return poly


def _poly_sub(a: list[int], b: list[int]) -> list[int]:
    out = [0] * max(len(a), len(b))
    for i, c in enumerate(a):
        out[i] = c
    for i, c in enumerate(b):
        out[i] = (out[i] - c) % PRIME
    return _trim(out)


def _poly_mul(a: list[int], b: list[int]) -> list[int]:
    if not a or not b:
        return []
    out = [0] * (len(a) + len(b) - 1)
    for i, ca in enumerate(a):
        if ca:
            for j, cb in enumerate(b):
                out[i + j] += ca * cb
    return _trim([c % PRIME for c in out])


def _poly_divmod(a: list[int], b: list[int]) -> tuple[list[int], list[int]]:
    rem = list(a)
    inv_lead = pow(b[-1], -1, PRIME)
    quotient = [0] * max(len(a) - len(b) + 1, 0)
    for shift in range(len(a) - len(b), -1, -1):
        coeff = rem[shift + len(b) - 1] * inv_lead % PRIME
        quotient[shift] = coeff
        if coeff:
            for j, cb in enumerate(b):
                rem[shift + j] = (rem[shift + j] - coeff * cb) % PRIME
    return _trim(quotient), _trim(rem[:len(b) - 1])


def _poly_eval(poly: list[int], x: int) -> int:
    acc = 0
    for c in reversed(poly):
        acc = (acc * x + c) % PRIME
    return acc


def decode_with_errors(shares: Mapping[int, int], threshold: int
                       ) -> tuple[int, frozenset[int]] | None:
    """Gao's decoder: the secret f(0) and the holders whose shares are off f, when at most
    (len(shares) - threshold) // 2 shares are wrong; ``None`` when no such f exists."""
    xs = sorted(shares)
    m = len(xs)
    if m < threshold:
        return None
    g0 = [1]
    for x in xs:
        g0 = _poly_mul(g0, [(-x) % PRIME, 1])
    g1: list[int] = []
    for xi in xs:  # Lagrange interpolation through all m points
        basis, _ = _poly_divmod(g0, [(-xi) % PRIME, 1])
        denom = _poly_eval(basis, xi)
        scale = shares[xi] * pow(denom, -1, PRIME) % PRIME
        g1 = _trim([(a + scale * b) % PRIME for a, b in
                    zip(g1 + [0] * (len(basis) - len(g1)), basis, strict=True)])
    r0, r1, v0, v1 = g0, g1, [], [1]
    while r1 and 2 * (len(r1) - 1) >= m + threshold:
        q, r = _poly_divmod(r0, r1)
        r0, r1 = r1, r
        v0, v1 = v1, _poly_sub(v0, _poly_mul(q, v1))
    if not v1:
        return None
    f, rem = _poly_divmod(r1, v1)
    if rem or len(f) > threshold:
        return None
    bad = frozenset(x for x in xs if _poly_eval(f, x) != shares[x])
    if len(bad) > (m - threshold) // 2:
        return None
    return (f[0] if f else 0), bad


def extrapolate(points: Mapping[int, int], xs: tuple[int, ...], targets: Sequence[int]
                ) -> list[int]:
    """The polynomial through (x, points[x]) for x in ``xs`` (degree < len(xs)), evaluated
    at each target (barycentric form: O(len(xs)) per target)."""
    weights = _barycentric_weights(xs)
    known = set(xs)
    out = []
    for target in targets:
        if target in known:  # the barycentric form divides by (target - x)
            out.append(points[target] % PRIME)
            continue
        diffs = [(target - x) % PRIME for x in xs]
        inverses = _batch_inverse(diffs)
        ell = 1
        for d in diffs:
            ell = ell * d % PRIME
        acc = sum(w * points[x] % PRIME * inv for w, x, inv in zip(weights, xs, inverses,
                                                                  strict=True))
        out.append(ell * acc % PRIME)
    return out


def consistent(shares: Mapping[int, int], threshold: int) -> bool:
    """True when all shares lie on one polynomial of degree < threshold."""
    holders = sorted(shares)
    if len(holders) <= threshold:
        return True
    base = tuple(holders[:threshold])
    rest = holders[threshold:]
    return extrapolate(shares, base, rest) == [shares[x] for x in rest]
