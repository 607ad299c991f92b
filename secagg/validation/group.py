"""The prime-order group of the input-validation proofs: BLS12-381 G1 from arkworks
(``py-arkworks-bls12381``), used only as a discrete-log group (no pairing).

Everything a curve does is arkworks': point addition and multi-scalar multiplication
(Pippenger), hashing to the curve (RFC 9380, ``BLS12381G1_XMD:SHA-256_SSWU_RO_``) for the
generators, and (de)serialisation with its on-curve and subgroup checks. Scalars are Python
integers reduced mod the group order ``ORDER``; nothing here adds or doubles a point by hand.
docs/protocol.md section 10.1.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from ..errors import SecAggError

ORDER = 0x73EDA753299D7D483339D80809A1D80553BDA402FFFE5BFEFFFFFFFF00000001
"""The order r of BLS12-381's G1 (a 255-bit prime)."""
POINT_BYTES = 48
SCALAR_BYTES = 32
GENERATOR_TAG = b"secagg/v1/input-validation/generators"


class ValidationUnavailable(SecAggError, ImportError):
    """Input validation needs the ``validation`` extra: ``pip install 'secagg[validation]'``
    (py-arkworks-bls12381)."""


def _ark() -> Any:
    try:
        import py_arkworks_bls12381 as ark
    except ImportError as exc:  # an optional extra
        raise ValidationUnavailable(
            "norm_bound needs the group library: pip install 'secagg[validation]' "
            "(py-arkworks-bls12381)") from exc
    return ark


def available() -> bool:
    """Whether the group library is installed."""
    try:
        _ark()
    except ValidationUnavailable:
        return False
    return True


Point = Any  # an arkworks G1Point


def scalar(value: int) -> Any:
    """An arkworks scalar from an integer (reduced mod ORDER)."""
    return _ark().Scalar.from_le_bytes_mod_order((value % ORDER).to_bytes(32, "little"))


def msm(points: Sequence[Point], scalars: Sequence[int]) -> Point:
    """sum scalars[i] * points[i]: arkworks' multi-scalar multiplication."""
    ark = _ark()
    if not points:
        return ark.G1Point.identity()
    conv = ark.Scalar.from_le_bytes_mod_order
    return ark.G1Point.multiexp_unchecked(
        list(points), [conv((s % ORDER).to_bytes(32, "little")) for s in scalars])


def identity() -> Point:
    return _ark().G1Point.identity()


def encode_point(point: Point) -> bytes:
    data: bytes = point.to_compressed_bytes()
    return data


def decode_point(data: bytes) -> Point:
    """A point from its 48 compressed bytes, checked on the curve and in the prime-order
    subgroup by arkworks; ``ValueError`` otherwise."""
    if len(data) != POINT_BYTES:
        raise ValueError(f"a point is {POINT_BYTES} bytes, got {len(data)}")
    ark = _ark()
    try:
        point = ark.G1Point.from_compressed_bytes(bytes(data))
    except Exception as exc:  # arkworks raises ValueError (or a Rust panic) on bad bytes
        raise ValueError(f"not a BLS12-381 G1 point: {exc}") from None
    if not point.is_in_subgroup():
        raise ValueError("the point is not in the prime-order subgroup")
    return point


def encode_scalar(value: int) -> bytes:
    return (value % ORDER).to_bytes(SCALAR_BYTES, "little")


def decode_scalar(data: bytes) -> int:
    """A canonical scalar (32 bytes little-endian, below ORDER); ``ValueError`` otherwise."""
    value = int.from_bytes(data, "little")
    if len(data) != SCALAR_BYTES or value >= ORDER:
        raise ValueError("a scalar must be 32 little-endian bytes below the group order")
    return value


@functools.lru_cache(maxsize=16)
def _prefix_cache(label: bytes) -> list[Point]:
    return []


def vector_generators(label: bytes, count: int) -> list[Point]:
    """The first ``count`` generators of the family ``label`` (grown on demand and kept:
    a round of dimension d reuses what a smaller round derived)."""
    have = _prefix_cache(label)
    ark = _ark()
    for i in range(len(have), count):
        # arkworks' order is (msg, dst): the label and index are the message
        have.append(ark.G1Point.hash_to_curve(label + b"|" + i.to_bytes(8, "big"),
                                              GENERATOR_TAG))
    return have[:count]
