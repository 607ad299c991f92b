"""Randomized Hadamard rotation with a public seed (Kairouz, Liu, Steinke 2021, Sec. 4.1).

``rotate(x) = H D x / sqrt(D)`` with ``D`` a diagonal of random signs and ``H`` the
Walsh-Hadamard matrix of the padded power-of-two dimension. It is orthogonal, so L2 norms
(and hence sensitivities) are unchanged, and it spreads a vector's mass so every coordinate
is sub-Gaussian with variance proxy ``||x||**2 / D`` -- which is what makes a small bit width
enough (the paper's "flattening"). The signs are public: they are expanded from the round's
public seed with SHAKE-256, so every site and the server derive the same rotation
independently of numpy's version.
"""

from __future__ import annotations

import hashlib
from typing import cast

import numpy as np
import numpy.typing as npt

F64 = npt.NDArray[np.float64]


def padded_dim(dim: int) -> int:
    """The power of two the rotation works in (>= ``dim``)."""
    if dim < 1:
        raise ValueError(f"dim must be positive, got {dim}")
    return 1 << (dim - 1).bit_length()


def rotation_signs(seed: int, size: int) -> F64:
    """``size`` public +-1 signs expanded from ``seed`` with SHAKE-256."""
    stream = hashlib.shake_256(b"secagg-dp-rotation" + int(seed).to_bytes(16, "big")).digest(
        (size + 7) // 8
    )
    bits = np.unpackbits(np.frombuffer(stream, dtype=np.uint8))[:size]
    return 1.0 - 2.0 * bits.astype(np.float64)


def _fwht(x: F64) -> F64:
    """Unnormalised fast Walsh-Hadamard transform along the last axis (length a power of 2)."""
    y = np.array(x, dtype=np.float64, copy=True)
    n = y.shape[-1]
    lead = y.shape[:-1]
    h = 1
    while h < n:
        v = y.reshape(*lead, n // (2 * h), 2, h)
        a = v[..., 0, :].copy()
        v[..., 0, :] += v[..., 1, :]
        v[..., 1, :] = a - v[..., 1, :]
        h *= 2
    return y


def rotate(x: F64, seed: int) -> F64:
    """Pad the last axis to a power of two and apply ``H D / sqrt(D)``."""
    d = x.shape[-1]
    n = padded_dim(d)
    padded = np.zeros((*x.shape[:-1], n))
    padded[..., :d] = x
    return cast(F64, _fwht(padded * rotation_signs(seed, n)) / np.sqrt(n))


def unrotate(y: F64, seed: int, dim: int) -> F64:
    """Inverse of :func:`rotate`: ``D H y / sqrt(D)``, truncated to the first ``dim`` entries."""
    n = y.shape[-1]
    return cast(F64, (_fwht(y) / np.sqrt(n) * rotation_signs(seed, n))[..., :dim])
