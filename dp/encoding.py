"""The integer pipeline of distributed DP: float update <-> integers mod 2**bits for ``secagg``.

Client side, per unit (a patient or a record), after Kairouz, Liu, Steinke, "The Distributed
Discrete Gaussian Mechanism for Federated Learning with Secure Aggregation", ICML 2021
(Algorithm 1) and Agarwal, Kairouz, Liu, "The Skellam Mechanism", NeurIPS 2021 (Algorithm 1):

1. flatten and L2-clip to ``clip_norm``;
2. rotate with the randomized Hadamard transform of the round's public seed;
3. scale by ``scale`` (``1 / granularity``);
4. conditional stochastic rounding: round each coordinate up with probability its fractional
   part, and redraw until the rounded vector's L2 norm is at most ``rounded_l2_bound``
   (KLS 2021, Sec. 4.1 and Thm. 33; the retry makes that bound the sensitivity);
then the site adds its unit vectors, adds one share of integer noise (the round's mechanism,
:mod:`dp.mechanisms`: discrete Gaussian or Skellam) and wraps the result into ``[0, 2**bits)``.

Server side, :meth:`IntegerEncoder.decode` is the exact inverse: centred unwrap mod
``2**bits``, unscale, inverse rotation. It refuses a sum over fewer sites than the noise was
calibrated for (:class:`dp.errors.TooFewSurvivors`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import cast

import numpy as np
import numpy.typing as npt

from dp.errors import PrivacyConfigError, TooFewSurvivors
from dp.mechanisms import mechanism, names
from dp.randomness import RandomSource, SystemRandom, uniform_words
from dp.rotation import padded_dim, rotate, unrotate

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]


@dataclass(frozen=True)
class EncodingParams:
    """Everything the sites and the server must agree on for one round of distributed DP.

    ``noise_stddev`` is the per-site standard deviation in the units of the update (the
    integer noise has variance ``(scale * noise_stddev) ** 2``); ``threshold`` is the number
    of sites it was calibrated for (see :mod:`dp.distributed`).
    """

    dim: int
    clip_norm: float
    scale: float
    bits: int
    noise_stddev: float
    rotation_seed: int
    mechanism: str = "dgauss"
    beta: float = math.exp(-0.5)
    threshold: int = 1
    encoded_dim: int = field(init=False)

    def __post_init__(self) -> None:
        if self.dim < 1:
            raise PrivacyConfigError(f"dim must be >= 1, got {self.dim}")
        if not (self.clip_norm > 0 and math.isfinite(self.clip_norm)):
            raise PrivacyConfigError(f"clip_norm must be a positive number, got {self.clip_norm}")
        if not (self.scale > 0 and math.isfinite(self.scale)):
            raise PrivacyConfigError(f"scale must be a positive number, got {self.scale}")
        if not 2 <= self.bits <= 64:
            raise PrivacyConfigError(f"bits must be in [2, 64] (secagg's modulus), got {self.bits}")
        if not (self.noise_stddev >= 0 and math.isfinite(self.noise_stddev)):
            raise PrivacyConfigError(f"noise_stddev must be >= 0, got {self.noise_stddev}")
        if self.mechanism not in names():
            raise PrivacyConfigError(
                f"mechanism must be one of {names()} (dp.mechanisms), got {self.mechanism!r}"
            )
        if not 0 <= self.beta < 1:
            raise PrivacyConfigError(f"beta must be in [0, 1), got {self.beta}")
        if self.threshold < 1:
            raise PrivacyConfigError(f"threshold must be >= 1, got {self.threshold}")
        object.__setattr__(self, "encoded_dim", padded_dim(self.dim))

    @property
    def noise_variance(self) -> float:
        """Per-site variance of the integer noise."""
        return (self.scale * self.noise_stddev) ** 2

    @property
    def rounded_l2_bound(self) -> float:
        """L2 sensitivity of one unit in the integer domain (KLS 2021, Thm. 33)."""
        return rounded_l2_bound(self.scale * self.clip_norm, self.encoded_dim, self.beta)

    @property
    def rounded_l1_bound(self) -> float:
        """L1 sensitivity: ``||v||_1 <= min(sqrt(d) ||v||_2, ||v||_2**2)`` for integer ``v``."""
        l2 = self.rounded_l2_bound
        return min(math.sqrt(self.encoded_dim) * l2, l2 * l2)

    def replace_one(self) -> EncodingParams:
        """These parameters as the accounting must see a release whose ONE row is a whole
        site's update (a Flower node): one patient can move that row anywhere in the clip
        ball, so neighbouring datasets differ by two rounded rows, and the sensitivity is
        twice :attr:`rounded_l2_bound` (the encoding itself is unchanged)."""
        return _ReplaceOne(**{f.name: getattr(self, f.name) for f in fields(self) if f.init})


class _ReplaceOne(EncodingParams):
    """:meth:`EncodingParams.replace_one`: the same encoding, twice the L2 sensitivity (and
    the L1 bound that follows from it)."""

    @property
    def rounded_l2_bound(self) -> float:
        return 2 * super().rounded_l2_bound


def rounded_l2_bound(scaled_clip: float, dim: int, beta: float) -> float:
    """Norm bound after conditional stochastic rounding (KLS 2021, Thm. 33 / Prop. 22).

    ``min(c + sqrt(d), sqrt(c**2 + d/4 + sqrt(2 ln(1/beta)) (c + sqrt(d)/2)))``; with
    ``beta = 0`` the deterministic bound ``c + sqrt(d)``.
    """
    bound = scaled_clip + math.sqrt(dim)
    if beta == 0:
        return bound
    sq = scaled_clip**2 + dim / 4 + math.sqrt(2 * math.log(1 / beta)) * (
        scaled_clip + math.sqrt(dim) / 2
    )
    return min(bound, math.sqrt(sq))


def finite_units(units: npt.ArrayLike) -> npt.NDArray[np.bool_]:
    """Which units (the first axis; a row, or a parameter's per-unit gradients) hold no NaN
    and no infinity. The rule of every mode: a unit whose update is not finite (e.g. a model
    that overflows on its records) contributes a zero row, and still counts as a unit --
    distributed DP in :meth:`IntegerEncoder.integer_units`, DP-SGD at the site in
    :func:`dp.units.per_unit_gradients` (before clipping). A function of that unit's own
    data alone: the sensitivity is unchanged and no refusal depends on the data."""
    rows = np.asarray(units)
    return cast(npt.NDArray[np.bool_],
                np.all(np.isfinite(rows), axis=tuple(range(1, rows.ndim))))


def clip_rows(x: F64, clip_norm: float) -> F64:
    """Scale each row down to L2 norm at most ``clip_norm`` (rows already inside unchanged)."""
    norms = np.linalg.norm(x, axis=-1, keepdims=True)
    factor = np.minimum(1.0, clip_norm / np.maximum(norms, 1e-300))
    return cast(F64, x * factor)


class IntegerEncoder:
    """Encode site contributions into ``uint64`` vectors for ``secagg`` and decode the sum.

    >>> p = EncodingParams(dim=3, clip_norm=1.0, scale=100.0, bits=20, noise_stddev=0.0,
    ...                    rotation_seed=1)
    >>> enc = IntegerEncoder(p)
    >>> total = (enc.encode(np.array([0.3, 0.0, 0.1]), noise=False)
    ...          + enc.encode(np.array([0.0, 0.2, 0.0]), noise=False)) % 2**20
    >>> np.round(enc.decode(total, num_included=2), 1).tolist()
    [0.3, 0.2, 0.1]
    """

    max_rounding_retries = 1000

    def __init__(self, params: EncodingParams, source: RandomSource | None = None) -> None:
        self.params = params
        self.source = source or SystemRandom()

    # -- client side -------------------------------------------------------------------
    def encode(self, update: F64, *, noise: bool) -> U64:
        """One unit's update (clipped to ``clip_norm``) plus, if ``noise``, the site's noise."""
        return self.encode_units(np.asarray(update, dtype=np.float64)[None, :], noise=noise)

    def encode_units(self, units: F64, *, noise: bool) -> U64:
        """A site's contribution: the sum of its units (rows, each clipped) plus its noise."""
        return self.wrap(self.integer_units(units).sum(axis=0) + self.noise(noise))

    def integer_units(self, units: F64) -> I64:
        """Clip, rotate, scale and conditionally round each row; returns ``(m, encoded_dim)``.
        A row with a NaN or an infinity is zeroed first (it still counts as a unit)."""
        p = self.params
        units = np.asarray(units, dtype=np.float64)
        if units.ndim != 2 or units.shape[1] != p.dim:
            raise PrivacyConfigError(
                f"expected units of shape (m, {p.dim}), got {units.shape}; flatten each "
                "unit's update to the dim the EncodingParams were built with"
            )
        units = np.where(finite_units(units)[:, None], units, 0.0)
        scaled = rotate(clip_rows(units, p.clip_norm), p.rotation_seed) * p.scale
        return self._conditional_round(scaled)

    def noise(self, noise: bool = True) -> I64:
        """This site's share of integer noise (zeros when ``noise`` is False)."""
        p = self.params
        if not noise or p.noise_stddev == 0:
            return np.zeros(p.encoded_dim, dtype=np.int64)
        return mechanism(p.mechanism).sample(p.noise_variance, p.encoded_dim, self.source)

    def _conditional_round(self, x: F64) -> I64:
        floor = np.floor(x)
        frac = x - floor
        bound_sq = self.params.rounded_l2_bound ** 2
        out = np.empty(x.shape, dtype=np.int64)
        pending = np.arange(x.shape[0])
        for _ in range(self.max_rounding_retries):
            if not pending.size:
                return out
            words = uniform_words(self.source, pending.size * x.shape[1]) >> np.uint64(11)
            u = (words.astype(np.float64) / 2.0**53).reshape(pending.size, x.shape[1])
            r = floor[pending] + (u < frac[pending])
            ok = np.einsum("ij,ij->i", r, r) <= bound_sq
            out[pending[ok]] = r[ok].astype(np.int64)
            pending = pending[~ok]
        raise PrivacyConfigError(
            "conditional rounding kept exceeding its norm bound; increase beta or scale"
        )

    def wrap(self, x: I64) -> U64:
        """Reduce integers into ``[0, 2**bits)`` as ``uint64`` (two's complement for 64)."""
        bits = self.params.bits
        if bits == 64:
            return x.astype(np.int64).view(np.uint64)
        return np.mod(x, np.int64(1) << np.int64(bits)).astype(np.uint64)

    # -- server side -------------------------------------------------------------------
    def unwrap(self, modular_sum: U64) -> I64:
        """Centred representative in ``[-2**(bits-1), 2**(bits-1))``."""
        bits = self.params.bits
        v = np.asarray(modular_sum, dtype=np.uint64)
        if bits == 64:
            return v.view(np.int64)
        if np.any(v >> np.uint64(bits)):
            raise PrivacyConfigError(
                f"modular sum has values >= 2**{bits}; sum mod 2**bits with the same bits"
            )
        s = v.astype(np.int64)
        half = np.int64(1) << np.int64(bits - 1)
        return np.where(s >= half, s - (half << np.int64(1)), s)

    def decode(self, modular_sum: U64, num_included: int) -> F64:
        """The exact inverse of the encoding: the (noisy) sum of the included sites' updates."""
        p = self.params
        if np.shape(modular_sum) != (p.encoded_dim,):
            raise PrivacyConfigError(
                f"modular sum must have shape ({p.encoded_dim},) (the padded dim), "
                f"got {np.shape(modular_sum)}"
            )
        if num_included < p.threshold:
            raise TooFewSurvivors(
                f"only {num_included} sites were summed but the noise is calibrated for at "
                f"least {p.threshold}; discard this round or lower the threshold"
            )
        return unrotate(self.unwrap(modular_sum) / p.scale, p.rotation_seed, p.dim)
