"""Encodings of site updates: fixed point (none/site) and the distributed-DP count column."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dp.encoding import EncodingParams
from dp.randomness import SeededRandom
from fl.codec import DistributedCodec, EncodingOverflow, FixedPointCodec


@pytest.mark.parametrize("bits", [32, 48, 64])
def test_fixed_point_sum_round_trip(bits: int) -> None:
    codec = FixedPointCodec(50, bits=bits, frac_bits=12, max_summands=4)
    rng = np.random.default_rng(0)
    values = [rng.normal(scale=20, size=50) for _ in range(4)]
    total = np.zeros(50, dtype=np.uint64)
    for v in values:
        total = (total + codec.encode(v)) % np.uint64(1 << bits) if bits < 64 \
            else total + codec.encode(v)
    assert np.allclose(codec.decode(total), sum(values), atol=4 * 2**-12)


def test_fixed_point_refuses_values_that_could_wrap() -> None:
    codec = FixedPointCodec(3, bits=32, frac_bits=16, max_summands=5)
    with pytest.raises(EncodingOverflow, match="does not fit"):
        codec.encode(np.array([0.0, 10_000.0, 0.0]))
    with pytest.raises(EncodingOverflow, match="NaN"):
        codec.encode(np.array([0.0, np.nan, 0.0]))


def _codec(dim: int, noise: float = 0.0, sites: int = 1) -> DistributedCodec:
    params = EncodingParams(dim=dim + 1, clip_norm=1.0, scale=4096.0, bits=40,
                            noise_stddev=noise, rotation_seed=7, threshold=sites)
    return DistributedCodec(params, source=SeededRandom(1))


def test_distributed_rows_bound_sensitivity_and_keep_count() -> None:
    codec = _codec(20)
    rng = np.random.default_rng(2)
    grads = rng.normal(scale=5, size=(30, 20))
    rows = codec.rows(grads)
    assert np.all(np.linalg.norm(rows, axis=1) <= 1.0 + 1e-12)  # one patient moves <= C
    assert np.all(rows[:, -1] == codec.gamma)
    small = rng.normal(scale=1e-3, size=(4, 20))
    assert np.allclose(codec.rows(small)[:, :-1], small)  # inside the ball: unchanged


def test_distributed_decode_recovers_sum_and_count() -> None:
    codec = _codec(20)
    rng = np.random.default_rng(3)
    sites = [rng.normal(scale=0.05, size=(n, 20)) for n in (7, 0, 12)]
    total = sum(codec.encode(g, noise=False).astype(object) for g in sites)
    total = np.array([int(t) % (1 << 40) for t in total], dtype=np.uint64)
    grad_sum, count = codec.decode(total, num_included=3)
    assert abs(count - 19) < 0.05
    assert np.allclose(grad_sum, np.vstack([g for g in sites if len(g)]).sum(axis=0),
                       atol=19 * 2 / 4096)


def test_distributed_noise_protects_the_count_too() -> None:
    codec = _codec(8, noise=2.0)
    counts = []
    for _ in range(160):  # 40 draws (OS noise): mean off by > 3 in ~1 of 90,000 runs
        total = codec.encode(np.zeros((5, 8)))
        counts.append(codec.decode(total, 1)[1])
    # the count coordinate carries the noise: stddev about noise / gamma = 4 patients
    # (measured over 300 x 40 draws: 3.85, spread 0.47; the mean's spread 0.68)
    assert 2.0 < float(np.std(counts)) < 7.0
    assert math.isclose(float(np.mean(counts)), 5, abs_tol=3.0)
