"""``secagg.simulate`` returns exactly the modular sum of the included inputs, for every
configuration and dropout pattern; it aborts exactly when too few clients survive.

The oracle is plain Python integers. On the complete graph the outcome is predicted from
the drop pattern alone: ``drop={id: stage}`` means the client sends nothing from ``stage``
on, so the clients reaching each stage are nested and the round finishes iff at least t
clients never drop; the included clients are those that sent a masked input.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from secagg import Config, ProtocolAbort, Stage, simulate
from secagg.crypto import dtype_for_bits
from secagg.graph import threshold_floor


def python_sum(inputs: Mapping[int, np.ndarray], ids: frozenset[int], bits: int,
               dim: int) -> list[int]:
    out = [0] * dim
    for cid in ids:
        for j, v in enumerate(inputs[cid].tolist()):
            out[j] += int(v)
    return [v % (1 << bits) for v in out]


def random_inputs(n: int, dim: int, bits: int, seed: int) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for cid in range(1, n + 1):
        kind = cid % 3
        if kind == 0:  # the extremes wrap the sum
            vec = np.full(dim, (1 << bits) - 1, dtype=np.uint64)
        elif kind == 1:
            vec = rng.integers(0, 1 << 63, size=dim, dtype=np.uint64) % np.uint64(1 << bits) \
                if bits < 64 else rng.integers(0, 2**64 - 1, size=dim, dtype=np.uint64,
                                               endpoint=True)
        else:
            vec = np.zeros(dim, dtype=np.uint64)
            vec[rng.integers(0, dim)] = np.uint64((1 << bits) - 1)
        out[cid] = vec
    return out


def sent_masked_input(result_bytes: Mapping[int, Mapping[str, int]]) -> frozenset[int]:
    return frozenset(c for c, per in result_bytes.items() if "masked_input" in per)


@st.composite
def rounds(draw: st.DrawFn) -> tuple[Config, dict[int, Stage], int]:
    n = draw(st.integers(3, 12))
    security = draw(st.sampled_from(["semi-honest", "malicious"]))
    sparse = draw(st.booleans()) and n >= 5
    neighbors = draw(st.integers(3, n - 1)) if sparse else None
    holders = n if neighbors is None else neighbors
    low = threshold_floor(n, neighbors, security)
    assume(low <= holders)
    threshold = draw(st.one_of(st.just(low), st.integers(low, holders)))
    bits = draw(st.integers(8, 64))
    dim = draw(st.integers(1, 50))
    config = Config(num_clients=n, threshold=threshold, dim=dim, bits=bits,
                    neighbors=neighbors, security=security, unchecked_graph=True)
    stay = draw(st.sampled_from([1, 5, 15, 40]))  # weight of "never drops"
    stages: list[Stage | None] = [*([None] * stay), *Stage]
    drop = {}
    for cid in range(1, n + 1):
        stage = draw(st.sampled_from(stages))
        if stage is not None:
            drop[cid] = stage
    seed = draw(st.integers(0, 2**32 - 1))
    return config, drop, seed


def predict_complete(config: Config, drop: Mapping[int, Stage]
                     ) -> tuple[bool, frozenset[int]]:
    """(finishes, included) on the complete graph, from the drop pattern alone."""
    ids = range(1, config.num_clients + 1)
    t = config.threshold
    assert t is not None
    never_drop = [c for c in ids if c not in drop]
    included = frozenset(c for c in ids if c not in drop or drop[c] > Stage.MASKED_INPUT)
    return len(never_drop) >= t, included


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(case=rounds())
def test_simulate_returns_the_exact_modular_sum(case: tuple[Config, dict[int, Stage],
                                                            int]) -> None:
    config, drop, seed = case
    inputs = random_inputs(config.num_clients, config.dim, config.bits, seed)
    complete = config.neighbors is None
    if complete:
        finishes, included = predict_complete(config, drop)
    try:
        result = simulate(config, inputs, drop=drop, seed=seed)
    except ProtocolAbort:
        event("aborted")
        if complete:
            assert not finishes, "aborted although t clients never dropped"
        return
    event("finished, complete graph" if complete else "finished, SecAgg+")
    if complete:
        assert finishes, "finished although fewer than t clients stayed to the end"
        assert result.included == included
        assert dict(result.client_aborts) == {}
    assert result.included == sent_masked_input(result.bytes_sent)
    assert not result.included & {c for c, s in drop.items() if s <= Stage.MASKED_INPUT}
    assert result.total.dtype == dtype_for_bits(config.bits)  # natural width
    assert result.total.shape == (config.dim,)
    assert result.total.tolist() == python_sum(inputs, result.included, config.bits,
                                               config.dim)
    for cid, stage in drop.items():
        if stage is Stage.CONSISTENCY_CHECK and not config.malicious:
            stage = Stage.UNMASKING  # no consistency stage: it first misses unmasking
        assert result.dropped[cid] <= stage


@pytest.mark.parametrize("security", ["semi-honest", "malicious"])
def test_design_example_twenty_clients_three_dropouts(security: str) -> None:
    """docs/architecture.md section 4 / README: n=20, t=11, d=100000, 32 bits, three dropouts."""
    dim = 100_000 if security == "semi-honest" else 20_000
    threshold = 11 if security == "semi-honest" else 14
    config = Config(num_clients=20, threshold=threshold, dim=dim, bits=32, security=security)
    rng = np.random.default_rng(7)
    inputs = {cid: rng.integers(0, 1 << 32, size=dim, dtype=np.uint64)
              for cid in range(1, 21)}
    drop = {3: Stage.SHARE_KEYS, 7: Stage.MASKED_INPUT, 9: Stage.UNMASKING}
    result = simulate(config, inputs, drop=drop, seed=0)
    assert result.included == frozenset(range(1, 21)) - {3, 7}
    expected = sum(inputs[c] for c in sorted(result.included)) % np.uint64(1 << 32)
    assert result.total.dtype == np.uint32  # natural width: no 64-bit copy
    assert np.array_equal(result.total, expected)
    assert result.dropped[3] == Stage.SHARE_KEYS and result.dropped[7] == Stage.MASKED_INPUT
    assert result.dropped[9] == Stage.UNMASKING


def test_too_few_survivors_abort() -> None:
    config = Config(num_clients=5, threshold=4, dim=3, bits=16)
    inputs = {c: np.full(3, c, dtype=np.uint64) for c in range(1, 6)}
    for stage in Stage:
        with pytest.raises(ProtocolAbort):
            simulate(config, inputs, drop={1: stage, 2: stage}, seed=1)
    result = simulate(config, inputs, drop={1: Stage.UNMASKING}, seed=1)
    assert result.total.tolist() == [15, 15, 15]


def test_sum_wraps_past_the_modulus() -> None:
    """Flower wraps silently past ~1000 clients; here wrap-around is the defined modular sum."""
    config = Config(num_clients=6, dim=4, bits=8)
    inputs = {c: np.full(4, 255, dtype=np.uint64) for c in range(1, 7)}
    result = simulate(config, inputs, seed=3)
    assert result.total.tolist() == [(6 * 255) % 256] * 4
