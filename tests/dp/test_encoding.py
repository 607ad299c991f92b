"""The integer pipeline: exact inverse, clipping, rounding bound, wrap-around, dropouts."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dp.distributed import calibrate, choose_bits
from dp.encoding import EncodingParams, IntegerEncoder, clip_rows
from dp.errors import PrivacyConfigError, TooFewSurvivors
from dp.randomness import SeededRandom
from dp.rotation import padded_dim, rotate, unrotate


def _params(**kw: object) -> EncodingParams:
    base: dict[str, object] = dict(dim=300, clip_norm=1.0, scale=2000.0, bits=32,
                                   noise_stddev=0.0, rotation_seed=42)
    base.update(kw)
    return EncodingParams(**base)  # type: ignore[arg-type]


def _secure_sum(vectors: list[np.ndarray], bits: int) -> np.ndarray:
    """Plain-numpy emulation of secagg's sum mod 2**bits."""
    total = np.zeros_like(vectors[0])
    for v in vectors:
        total = total + v  # uint64 wraps mod 2**64
    return total if bits == 64 else total % np.uint64(1 << bits)


def test_rotation_is_orthogonal_and_inverted() -> None:
    x = np.random.default_rng(0).normal(size=(3, 1000))
    y = rotate(x, 5)
    assert y.shape == (3, 1024)
    assert np.allclose(np.linalg.norm(y, axis=1), np.linalg.norm(x, axis=1))
    assert np.allclose(unrotate(y, 5, 1000), x)
    assert not np.allclose(unrotate(y, 6, 1000), x)


@pytest.mark.parametrize("bits", [24, 40, 64])
def test_decode_inverts_encode_without_noise(bits: int) -> None:
    p = _params(bits=bits)
    enc = IntegerEncoder(p, SeededRandom(0))
    rng = np.random.default_rng(1)
    updates = [rng.normal(size=p.dim) * 0.02 for _ in range(5)]
    total = _secure_sum([enc.encode(u, noise=False) for u in updates], bits)
    assert total.dtype == np.uint64 and total.shape == (p.encoded_dim,)
    decoded = enc.decode(total, num_included=5)
    expected = clip_rows(np.stack(updates), p.clip_norm).sum(axis=0)
    # rounding error: at most sqrt(D) per unit in the scaled domain, spread by the rotation
    assert np.linalg.norm(decoded - expected) <= 5 * math.sqrt(p.encoded_dim) / p.scale
    assert np.linalg.norm(decoded - expected) > 0  # rounding is really there


def test_clipping_bounds_each_unit() -> None:
    p = _params()
    enc = IntegerEncoder(p, SeededRandom(2))
    big = np.full(p.dim, 10.0)
    decoded = enc.decode(enc.encode(big, noise=False), num_included=1)
    assert np.linalg.norm(decoded) == pytest.approx(p.clip_norm, rel=0.02)


def test_conditional_rounding_respects_its_norm_bound() -> None:
    p = _params(scale=3.0, dim=64)
    enc = IntegerEncoder(p, SeededRandom(3))
    units = np.random.default_rng(4).normal(size=(200, p.dim))
    ints = enc.integer_units(units)
    assert ints.dtype == np.int64
    assert np.all(np.linalg.norm(ints, axis=1) <= p.rounded_l2_bound + 1e-9)
    assert p.rounded_l2_bound < p.scale * p.clip_norm + math.sqrt(p.encoded_dim)


def test_noisy_sum_has_target_noise_and_decodes_to_the_signal() -> None:
    num_sites, threshold = 6, 4
    cal = calibrate(noise_multiplier=1.0, clip_norm=1.0, num_sites=num_sites,
                    threshold=threshold)
    p = _params(dim=4000, scale=200.0, noise_stddev=cal.per_site_stddev, threshold=threshold,
                bits=choose_bits(dim=4000, clip_norm=1.0, scale=200.0,
                                 noise_stddev=cal.per_site_stddev, num_sites=num_sites).bits)
    enc = IntegerEncoder(p)
    update = np.zeros(p.dim)
    update[0] = 0.5
    shares = [enc.encode(update, noise=True) for _ in range(threshold)]
    decoded = enc.decode(_secure_sum(shares, p.bits), num_included=threshold)
    residual = decoded - threshold * update
    assert abs(residual.std() - cal.central_stddev) < 0.06 * cal.central_stddev
    assert abs(residual.mean()) < 0.1


def test_decode_refuses_fewer_sites_than_the_threshold() -> None:
    p = _params(threshold=3, noise_stddev=1.0)
    enc = IntegerEncoder(p)
    total = enc.encode(np.zeros(p.dim), noise=True)
    with pytest.raises(TooFewSurvivors, match="threshold"):
        enc.decode(total, num_included=2)


def test_chosen_bits_do_not_wrap_and_fewer_would() -> None:
    dim, sites, scale, sd = 512, 8, 500.0, 0.5
    choice = choose_bits(dim=dim, clip_norm=1.0, scale=scale, noise_stddev=sd, num_sites=sites)
    p = _params(dim=dim, scale=scale, noise_stddev=sd, bits=choice.bits)
    enc = IntegerEncoder(p)
    ones = np.full(dim, 1.0 / math.sqrt(dim))  # worst case: all sites aligned
    ints = [enc.integer_units(ones[None, :]).sum(axis=0) + enc.noise() for _ in range(sites)]
    plain = np.sum(ints, axis=0)
    assert np.abs(plain).max() < 2 ** (choice.bits - 1)
    assert choice.max_abs_bound >= np.abs(plain).max()
    assert choice.max_abs_bound < 2 ** (choice.bits - 1)
    small = _params(dim=dim, scale=scale, noise_stddev=sd, bits=choice.bits - 4)
    wrapped = IntegerEncoder(small).wrap(plain)
    back = IntegerEncoder(small).unwrap(wrapped)
    assert not np.array_equal(back, plain)  # too few bits really does wrap


def test_invalid_parameters_say_what_to_change() -> None:
    with pytest.raises(PrivacyConfigError, match="bits"):
        _params(bits=70)
    with pytest.raises(PrivacyConfigError, match="mechanism"):
        _params(mechanism="laplace")
    enc = IntegerEncoder(_params())
    with pytest.raises(PrivacyConfigError, match="shape"):
        enc.encode(np.zeros(7), noise=False)
    # a non-finite unit is zeroed, not refused (a refusal would depend on the data)
    assert not np.any(enc.unwrap(enc.encode(np.full(300, np.nan), noise=False)))
    with pytest.raises(PrivacyConfigError, match="> 64"):
        choose_bits(dim=8, clip_norm=1.0, scale=1e30, noise_stddev=1.0, num_sites=2)
    assert padded_dim(1025) == 2048


def test_secagg_simulate_integration() -> None:
    secagg = pytest.importorskip("secagg")
    if not hasattr(secagg, "simulate"):
        pytest.skip("secagg.simulate is not written yet")
    n, t = 5, 3
    cal = calibrate(noise_multiplier=0.5, clip_norm=1.0, num_sites=n, threshold=t)
    p = _params(dim=100, scale=1000.0, noise_stddev=cal.per_site_stddev, threshold=t)
    config = secagg.Config(num_clients=n, threshold=t, dim=p.encoded_dim, bits=p.bits)
    enc = IntegerEncoder(p)
    updates = {i: np.full(p.dim, 0.01 * i) for i in range(1, n + 1)}
    inputs = {i: enc.encode(u, noise=True) for i, u in updates.items()}
    result = secagg.simulate(config, inputs=inputs, drop={2: secagg.Stage.MASKED_INPUT}, seed=0)
    decoded = enc.decode(result.total, num_included=len(result.included))
    signal = sum(updates[i] for i in result.included)
    assert np.abs(decoded - signal).std() < 3 * cal.central_stddev * math.sqrt(n / t)
