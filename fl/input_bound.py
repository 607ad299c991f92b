"""The L2 bound a site proves in a round with input validation, per encoding: the one place
its arithmetic lives (docs/protocol.md section 10.6; the proof itself is
:mod:`secagg.validation`).

A round setup's ``norm_bound`` (:class:`fl.round_setup.RoundSetup`) is a bound in the
units of what a site sends; secure aggregation needs it on the integers the site masks
(``secagg.Config(norm_bound=)``). Per encoding:

* **fixed point** (exact sums): ``norm_bound`` = B bounds the L2 norm of the row a site
  masks, ``[w x, w m, w]`` (its arrays x, averaged metrics m and weight w). Rounding to
  ``2^-f`` moves each of the d coordinates by at most 1/2, so the integer bound is
  ``ceil(2^f B + sqrt(d) / 2)``. An honest site whose row is longer lowers its weight to
  ``B / ||[x, m, 1]||`` (:func:`capped_weight`): the weight scales the whole row, so this
  is the row clipped to B, and the aggregate stays a weighted average of the sites' models.
* **distributed DP**: the bound is the DP clip C, and the site proves it on its noised
  contribution. Its rotated, scaled and conditionally rounded row has L2 norm at most
  ``rounded_l2_bound`` (Kairouz, Liu, Steinke, ICML 2021, Thm. 33; the encoder redraws
  until it holds, :mod:`dp.encoding`); its share of discrete Gaussian noise, D
  coordinates of parameter sigma = scale x noise_stddev, is sigma-sub-Gaussian per
  coordinate (Canonne, Kamath, Steinke, NeurIPS 2020, Cor. 9), so
  ``E exp(l X^2 / sigma^2) <= (1 - 2 l)^(-1/2)`` and Laurent and Massart's chi-square
  tail (Ann. Statist. 2000, Lemma 1) gives ``||noise|| <= sigma (sqrt(D) + sqrt(2 t))``
  except with probability ``e^-t``. With ``t = 40 ln 2`` the integer bound is
  ``ceil(rounded_l2_bound + sigma (sqrt(D) + sqrt(80 ln 2)))``: an honest site exceeds it
  with probability at most 2^-40 per round (its own round then fails; it sends no proof and
  is never named). Skellam noise is not sub-Gaussian, so a Skellam round has no bound here.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from dp import EncodingParams

F64 = npt.NDArray[np.float64]

HONEST_FAILURE_LOG2 = 40
"""An honest DP site's noise exceeds its share of the bound with probability at most
``2^-HONEST_FAILURE_LOG2`` per round."""


def fixed_bound(norm_bound: float, frac_bits: int, dim: int) -> int:
    """The integer L2 bound of a fixed-point row of ``dim`` coordinates whose float norm is
    at most ``norm_bound`` (``frac_bits`` fractional bits); ``ValueError`` when it has no
    finite integer form."""
    scaled = norm_bound * 2.0 ** frac_bits
    if not math.isfinite(scaled):
        raise ValueError(f"norm_bound={norm_bound} at {frac_bits} fractional bits overflows; "
                         "lower norm_bound or frac_bits")
    return math.ceil(scaled + math.sqrt(dim) / 2)


def dp_bound(params: EncodingParams) -> int:
    """The integer L2 bound of a distributed-DP site's noised contribution (one clipped row
    plus its discrete Gaussian noise share)."""
    if params.mechanism != "dgauss":
        raise ValueError(f"input validation bounds discrete Gaussian noise only (its tail is "
                         f"sub-Gaussian); this round's mechanism is {params.mechanism!r}")
    sigma = math.sqrt(params.noise_variance)
    tail = math.sqrt(2 * HONEST_FAILURE_LOG2 * math.log(2))
    return math.ceil(params.rounded_l2_bound
                     + sigma * (math.sqrt(params.encoded_dim) + tail))


def bits_for(num_clients: int, bound: int) -> int:
    """The fewest bits whose centred range holds the sum of ``num_clients`` inputs of L2
    (so every coordinate's) norm at most ``bound``: ``n B < 2^(bits - 1)``
    (``secagg.validation.check_parameters``)."""
    return (num_clients * bound).bit_length() + 1


def capped_weight(weight: float, values: F64, norm_bound: float) -> float:
    """A fixed-point site's weight, lowered so its row ``weight * [values, 1]`` has L2 norm
    at most ``norm_bound`` (a hair under it, so float error never crosses the bound)."""
    row = math.sqrt(float(np.dot(values, values)) + 1.0)
    return min(weight, norm_bound / row * (1 - 1e-9))
