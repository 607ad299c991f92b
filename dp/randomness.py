"""Sources of uniform random bits for the noise samplers.

The noise that protects patients must come from a cryptographic source: the exact samplers
of :mod:`dp.samplers` consume only uniform 64-bit words drawn from a :class:`RandomSource`.
The default, :class:`SystemRandom`, reads ``os.urandom`` (the kernel CSPRNG) in bulk.
:class:`SeededRandom` is an AES-256-CTR keystream from a 32-byte key: cryptographically
strong but reproducible, for tests and for replaying a simulation. Numpy's generators are
never used for noise (docs/architecture.md section 3: "never numpy's generators for secrets").
"""

from __future__ import annotations

import hashlib
import os
from typing import Protocol, cast

import numpy as np
import numpy.typing as npt
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

U64 = npt.NDArray[np.uint64]


class RandomSource(Protocol):
    """Anything that returns ``n`` cryptographically uniform bytes."""

    def random_bytes(self, n: int) -> bytes: ...


class SystemRandom:
    """``os.urandom``: the kernel's CSPRNG (the production default)."""

    def random_bytes(self, n: int) -> bytes:
        return os.urandom(n)


class SeededRandom:
    """AES-256-CTR keystream keyed by SHA-256(seed): reproducible, for tests and replays.

    Do not use a guessable seed in production: whoever knows the seed knows the noise.
    """

    def __init__(self, seed: int | bytes) -> None:
        raw = seed if isinstance(seed, bytes) else int(seed).to_bytes(32, "big", signed=True)
        key = hashlib.sha256(b"secagg-dp-seeded-random" + raw).digest()
        self._encryptor = Cipher(algorithms.AES(key), modes.CTR(b"\x00" * 16)).encryptor()

    def random_bytes(self, n: int) -> bytes:
        return self._encryptor.update(b"\x00" * n)


def uniform_words(source: RandomSource, n: int) -> U64:
    """``n`` independent uniform 64-bit words."""
    return np.frombuffer(source.random_bytes(8 * n), dtype=np.uint64).copy()


def uniform_below(source: RandomSource, bound: int, n: int) -> U64:
    """``n`` exact uniform integers in ``[0, bound)`` by rejection (no modulo bias).

    A 64-bit word ``w`` is accepted when ``w < 2**64 - (2**64 mod bound)``; the accepted words
    are uniform on a multiple of ``bound`` values, so ``w mod bound`` is exactly uniform.
    """
    if not 1 <= bound < 2**63:
        raise ValueError(f"bound must be in [1, 2**63), got {bound}")
    limit = np.uint64(2**64 - (2**64 % bound)) if 2**64 % bound else None
    out = np.empty(n, dtype=np.uint64)
    pending = np.arange(n)
    b = np.uint64(bound)
    while pending.size:
        w = uniform_words(source, pending.size)
        ok = np.ones(pending.size, dtype=bool) if limit is None else w < limit
        out[pending[ok]] = w[ok] % b
        pending = pending[~ok]
    return out


def secure_normal(source: RandomSource, n: int) -> npt.NDArray[np.float64]:
    """``n`` standard normal floats from ``source`` (Box-Muller on 53-bit uniforms), each
    the sum of four draws over 2 (Holohan & Braghin 2021, the remedy Opacus' ``secure_mode``
    uses against floating-point attacks on the Gaussian mechanism)."""
    m = 4 * n
    pairs = (m + 1) // 2
    words = uniform_words(source, 2 * pairs)
    u = ((words >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53  # in (0, 1)
    radius = np.sqrt(-2.0 * np.log(u[:pairs]))
    angle = 2.0 * np.pi * u[pairs:]
    normals = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:m]
    return cast(npt.NDArray[np.float64], normals.reshape(4, n).sum(axis=0) / 2.0)
