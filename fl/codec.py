"""What a site's secure-aggregation input is, per privacy mode, and how the sum is decoded.

Every site hands secure aggregation one ``uint64`` vector mod ``2**bits``: its update
*and* its sample count, so the count is summed securely too and never sent in clear.

* ``none``: :class:`FixedPointCodec` over ``[n_k * delta_k, n_k]`` (weighted FedAvg: the
  server learns only ``sum n_k delta_k`` and ``sum n_k``).
* ``site``: the same codec over ``[delta_k, 1]``. The update is already DP (Opacus, at the
  site), but a count is not: releasing ``sum n_k`` exactly would leak whether a patient is
  in the federation. So site mode averages uniformly over the included sites and the count
  coordinate carries only the number of sites.
* ``distributed``: :class:`DistributedCodec`. Each sampled patient contributes one row
  ``[g_p clipped to sqrt(C^2 - gamma^2), gamma]`` of L2 norm at most ``C``; the rows go
  through :class:`dp.encoding.IntegerEncoder` (rotate, scale, round, the site's noise share).
  The last coordinate of the decoded sum is ``gamma * (#patients) + noise``: the count is
  protected by the same noise and the same epsilon as the update, at no extra privacy cost.

The wire forms and their decode are written once, here, for every runtime: the site role
and both coordinators (:mod:`fl.contribution`) and the Flower and NVFlare runtimes
(:mod:`fl.round_setup`) call :func:`encode_weighted` / :func:`decode_weighted` (weighted
FedAvg) and :meth:`DistributedCodec.encode` / :func:`noisy_mean` (distributed DP).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from dp import EncodingParams, IntegerEncoder, RandomSource
from secagg.crypto import MAX_BITS, MIN_BITS, dtype_for_bits

from .errors import FLError

F64 = npt.NDArray[np.float64]
U64 = npt.NDArray[np.uint64]
UInt = npt.NDArray[np.unsignedinteger[Any]]


class EncodingOverflow(FLError, ValueError):
    """A value is too large for the modulus; the sum would wrap silently."""


class FixedPointCodec:
    """Floats as signed fixed point (``frac_bits`` fractional bits) mod ``2**bits``.

    ``max_summands`` sites may be added before the centred range could overflow; encoding
    refuses a value that could make the sum wrap, rather than corrupting it quietly.
    """

    def __init__(self, dim: int, *, bits: int = 64, frac_bits: int = 24,
                 max_summands: int = 1) -> None:
        if not MIN_BITS <= bits <= MAX_BITS:
            raise ValueError(f"bits must be in [{MIN_BITS}, {MAX_BITS}], got {bits}")
        if not 0 <= frac_bits < bits - 2:
            raise ValueError(f"frac_bits must be in [0, bits - 2), got {frac_bits}")
        self.dim = dim
        self.bits = bits
        self.scale = float(2**frac_bits)
        self.frac_bits = frac_bits
        self.limit = 2 ** (bits - 1) // max(1, max_summands)

    @property
    def encoded_dim(self) -> int:
        return self.dim

    def encode(self, values: F64) -> UInt:
        """The fixed-point vector in the sum's natural width (``uint32`` for 32 bits: the
        smallest unsigned dtype holding ``bits``, as secagg carries it), through one
        float64 and one int64 working copy."""
        v = np.asarray(values, dtype=np.float64)
        if v.shape != (self.dim,):
            raise ValueError(f"expected a vector of length {self.dim}, got shape {v.shape}")
        if not np.all(np.isfinite(v)):
            raise EncodingOverflow("the update contains NaN or inf; lower the learning rate")
        ints = np.multiply(v, self.scale)
        np.rint(ints, out=ints)
        worst = max(float(ints.max()), -float(ints.min())) if ints.size else 0.0
        if worst >= self.limit:
            # the value is not in the message: a runtime may pass the text to the server,
            # and a server that picks bits and frac_bits would read the site's update off it
            raise EncodingOverflow(f"a coordinate does not fit {self.bits}-bit fixed point "
                                   f"with {self.frac_bits} fractional bits for this many "
                                   "sites; lower the learning rate or frac_bits")
        as_int = ints.astype(np.int64)
        del ints
        if self.bits == 64:
            return as_int.view(np.uint64)
        np.bitwise_and(as_int, np.int64((1 << self.bits) - 1), out=as_int)  # mod 2**bits
        return as_int.astype(dtype_for_bits(self.bits))

    def decode(self, total: U64) -> F64:
        t = np.asarray(total, dtype=np.uint64)
        if self.bits == 64:
            signed = t.view(np.int64)
        else:
            s = t.astype(np.int64)
            half = np.int64(1) << np.int64(self.bits - 1)
            signed = np.where(s >= half, s - (half << np.int64(1)), s)
        return signed.astype(np.float64) / self.scale


class DistributedCodec:
    """Patient rows with a count column, through the distributed-DP integer encoder.

    ``params.dim`` is the model dimension plus one (the count column). ``max_weight``
    (heterogeneity-aware site weights, :mod:`dp.site_weights`): ``params.clip_norm`` is
    ``max_weight`` times the rows' clip ``C``, so the noise is calibrated to the largest
    weighted row; a site with weight ``w <= max_weight`` sends ``w [g_p, gamma]`` and the
    decoded count is ``sum w_k n_k`` (the weighted mean's denominator).
    """

    def __init__(self, params: EncodingParams, count_weight: float | None = None,
                 source: RandomSource | None = None, max_weight: float = 1.0) -> None:
        if not (max_weight > 0 and math.isfinite(max_weight)):
            raise ValueError(f"max_weight must be a positive number, got {max_weight}")
        clip = params.clip_norm / max_weight
        gamma = clip / 2 if count_weight is None else count_weight
        if not 0 < gamma < clip:
            raise ValueError(f"count_weight must be in (0, clip_norm={clip})")
        self.params = params
        self.max_weight = max_weight
        self.clip_norm = clip
        self.gamma = gamma
        # Leave a hair of room so float error in the row norm never triggers the encoder's
        # own clip, which would shrink the count coordinate.
        self.update_clip = math.sqrt(clip**2 - gamma**2) * (1 - 1e-9)
        self.encoder = IntegerEncoder(params, source)

    @property
    def encoded_dim(self) -> int:
        return self.params.encoded_dim

    def rows(self, unit_updates: F64, weight: float = 1.0) -> F64:
        """``weight * [g_p clipped, gamma]`` per unit; every row has L2 norm at most
        ``weight * C <= params.clip_norm``. A weight above ``max_weight`` is refused."""
        if not 0 < weight <= self.max_weight:
            raise EncodingOverflow(f"the site weight {weight!r} is outside (0, max_weight="
                                   f"{self.max_weight:g}]: the noise is calibrated to "
                                   "max_weight times the clip; refused")
        g = np.asarray(unit_updates, dtype=np.float64).reshape(-1, self.params.dim - 1)
        norms = np.linalg.norm(g, axis=1, keepdims=True)
        g = g * np.minimum(1.0, self.update_clip / np.maximum(norms, 1e-300))
        return weight * np.hstack([g, np.full((len(g), 1), self.gamma)])

    def encode(self, unit_updates: F64, *, noise: bool = True, weight: float = 1.0) -> U64:
        """A site's input: the sum of its units' rows plus its noise share, mod 2**bits."""
        rows = self.rows(unit_updates, weight)
        if len(rows) == 0:  # nobody sampled: the site still sends its noise share
            return self.encoder.wrap(self.encoder.noise(noise))
        return self.encoder.encode_units(rows, noise=noise)

    def decode(self, total: U64, num_included: int) -> tuple[F64, float]:
        """The noisy (weighted) sum of the unit updates and the noisy (weighted) number of
        units."""
        s = self.encoder.decode(total, num_included)
        return s[:-1], float(s[-1] / self.gamma)


def encode_weighted(codec: FixedPointCodec, values: F64, weight: float) -> UInt:
    """Weighted FedAvg's input ``[w * values, w]`` (``codec.dim == len(values) + 1``): the sum
    reveals only ``sum w * values`` and ``sum w``."""
    if not (math.isfinite(weight) and weight >= 0):
        raise EncodingOverflow(f"the weight must be a non-negative number, got {weight!r}")
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    row = np.empty(v.size + 1, dtype=np.float64)  # one copy, not w * values and an append
    np.multiply(v, weight, out=row[:-1])
    row[-1] = weight
    return codec.encode(row)


def decode_weighted(codec: FixedPointCodec, total: U64) -> tuple[F64, float]:
    """The weighted average of the summed ``[w * values, w]`` inputs and ``sum w``."""
    values = codec.decode(total)
    weight = float(values[-1])
    if not weight > 0:
        raise EncodingOverflow("the securely summed weight is not positive")
    return values[:-1] / weight, weight


def noisy_mean(codec: DistributedCodec, total: U64, num_included: int) -> tuple[F64, float]:
    """The noisy sum of the unit updates over the noisy unit count (floored at 1: the count
    is post-processing of the same release), and that count."""
    sums, count = codec.decode(total, num_included)
    return sums / max(count, 1.0), count
