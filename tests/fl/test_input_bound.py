"""The bound a site proves in a round with input validation (fl/input_bound.py,
docs/protocol.md 10.6): the integer bound per encoding, what an honest site's encoding
gives against it, and the setup rules a site checks (under DP the bound is the clip and
nothing else). No proof here: the proofs run in tests/flower and tests/nvflare."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from fl.input_bound import HONEST_FAILURE_LOG2, bits_for, dp_bound, fixed_bound
from fl.round_plan import fixed_setup, with_norm_bound
from fl.round_reply import encode_reply
from fl.round_setup import DpSpec, RoundSetup, SetupError, dp_params
from fl.vector import ArraySpec
from secagg.validation.norm import centered
from transport import fields

DIM = 40


def _fixed(n: int = 4, bits: int = 64) -> RoundSetup:
    return fixed_setup(run_id=1, server_round=0, roster=list(range(10, 10 + n)),
                       arrays=(ArraySpec("w", (DIM,), "float32"),), metrics=(),
                       weight_key="num-examples", neighbors=None, threshold=None,
                       dropout_rate=0.1, corrupt_rate=0.1, security="semi-honest",
                       bits=bits, frac_bits=16, verify_keys={})


def _dp(noise_stddev: float = 0.2, mechanism: str = "dgauss", bits: int = 24) -> RoundSetup:
    setup = _fixed()
    return replace(setup, mode="distributed", frac_bits=0, metrics=(), bits=bits,
                   dp=DpSpec(1.0, 1024.0, bits, noise_stddev, 3, mechanism, 0.5,
                             setup.threshold))


def _norm(vector: np.ndarray, bits: int) -> float:
    return math.sqrt(sum(v * v for v in centered(vector, bits)))


def test_an_honest_dp_site_at_the_clip_is_within_the_bound_and_ten_times_it_is_not() -> None:
    setup = with_norm_bound(_dp(), "clip")
    bound = setup.input_bound
    assert bound == dp_bound(dp_params(setup)) and setup.norm_bound == 1.0
    p = dp_params(setup)
    sigma = math.sqrt(p.noise_variance)
    assert bound == math.ceil(p.rounded_l2_bound + sigma * (
        math.sqrt(p.encoded_dim) + math.sqrt(2 * HONEST_FAILURE_LOG2 * math.log(2))))
    assert setup.bits == max(24, bits_for(setup.num_clients, bound)) == setup.dp.bits
    rng = np.random.default_rng(0)
    sent = np.zeros(DIM)
    norms = []
    for _ in range(50):  # updates far beyond the clip: clipped to it, then noised
        update = rng.normal(size=DIM) * 30
        vector = encode_reply(setup, sent + update, {}, 1.0, sent)
        norms.append(_norm(vector, setup.bits))
        scaled = (np.asarray(centered(vector, setup.bits), dtype=object) * 10) % (
            1 << setup.bits)
        assert _norm(scaled.astype(np.uint64), setup.bits) > bound  # the attacker's
    assert max(norms) <= bound
    # at the clip: the signal is most of an honest contribution, the noise the rest
    assert min(norms) > p.rounded_l2_bound * 0.8


def test_a_site_refuses_a_dp_bound_other_than_the_clip_and_a_skellam_round() -> None:
    setup = _dp()
    assert RoundSetup.from_bytes(replace(setup, norm_bound=1.0).to_bytes()).norm_bound == 1.0
    with pytest.raises(SetupError, match="the DP clip"):
        RoundSetup.from_bytes(replace(setup, norm_bound=0.5).to_bytes())
    skellam = replace(_dp(mechanism="skellam"), norm_bound=1.0)
    with pytest.raises(SetupError, match="discrete Gaussian"):
        RoundSetup.from_bytes(skellam.to_bytes()).config(64)


def test_fixed_point_bound_and_the_honest_weight_cap() -> None:
    setup = with_norm_bound(_fixed(), 50.0)
    assert setup.input_bound == fixed_bound(50.0, 16, DIM + 1) == math.ceil(
        50.0 * 2 ** 16 + math.sqrt(DIM + 1) / 2)
    rng = np.random.default_rng(1)
    for weight in (1.0, 5.0, 40.0):  # rows of norm ~6, ~32, ~250: the last one is capped
        arrays = rng.uniform(-1, 1, DIM)
        vector = encode_reply(setup, arrays, {}, weight, None)
        assert _norm(vector, 64) <= setup.input_bound
        plain = encode_reply(replace(setup, norm_bound=None), arrays, {}, weight, None)
        row = weight * math.sqrt(float(arrays @ arrays) + 1)
        assert np.array_equal(vector, plain) == (row <= 50.0)
    # a setup without the bound has the same bytes as before the field existed
    keys = {raw: set(fields.unpack_map(raw, 1 << 22, max_array_len=1 << 16))
            for raw in (replace(setup, norm_bound=None).to_bytes(), setup.to_bytes())}
    assert [("nb" in k) for k in keys.values()] == [False, True]
    with pytest.raises(SetupError, match="wrap the sum"):
        with_norm_bound(_fixed(bits=32), 50_000.0)
