"""The masked_input deadline allows input validation's work (issue 31): each site's proof,
the generators a process hashes once, and the server's n verifications, from the one cost
model (``transport.deadlines.validation_work``), in every runtime's deadlines."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fl.flower.rounds import proof_allowance
from secagg import Config
from transport.deadlines import (
    MAX_STAGE_SECONDS,
    SAFETY,
    round_timeouts,
    round_work,
    validation_allowance,
    validation_work,
)


@given(n=st.integers(2, 200), dim=st.integers(1, 10**6), colocated=st.integers(1, 8),
       stage=st.floats(1.0, 600.0))
@settings(max_examples=60, deadline=None)
def test_the_masked_input_deadline_covers_the_modelled_proofs(n: int, dim: int,
                                                              colocated: int,
                                                              stage: float) -> None:
    plain = round_timeouts(stage, clients=n, dim=dim, colocated=colocated)
    checked = round_timeouts(stage, clients=n, dim=dim, colocated=colocated, validated=True)
    work = validation_work(clients=n, dim=dim, colocated=colocated)
    want = plain.per_stage["masked_input"] + SAFETY * work["masked_input"]
    cap = max(MAX_STAGE_SECONDS, stage)
    assert checked.per_stage["masked_input"] == pytest.approx(min(cap, want))
    # only masked_input (and the server's unmasking) carry the proof's work
    for label in ("advertise_keys", "share_keys", "consistency_check", "unmasking"):
        assert checked.per_stage[label] == plain.per_stage[label]
    assert checked.give_up >= plain.give_up and checked.answer >= plain.answer
    base = round_work(clients=n, dim=dim, colocated=colocated)
    assert round_work(clients=n, dim=dim, colocated=colocated, validated=True)["finish"] \
        == pytest.approx(base["finish"] + work["finish"])


def test_the_model_grows_with_the_dimension_and_the_verifications() -> None:
    small, large = (validation_work(clients=5, dim=d)["masked_input"] for d in (10**3, 10**5))
    assert large > 50 * small / 2  # about linear in d (the fixed parts aside)
    assert validation_work(clients=50, dim=10**4)["masked_input"] > \
        validation_work(clients=5, dim=10**4)["masked_input"]  # the server checks n proofs
    # the measured figures it is derived from (docs/performance.md "Input validation":
    # 38 s to prove and 22 s to verify at d = 10^5, 309 s of generators) are below it
    one = validation_work(clients=1, dim=10**5)["masked_input"]
    assert one >= 309 + 38 + 22


def test_flower_adds_the_same_allowance_to_its_masked_input_stage() -> None:
    bounded = Config(5, dim=1000, bits=32, norm_bound=100)
    assert proof_allowance(Config(5, dim=1000, bits=32)) == 0.0
    assert proof_allowance(bounded) == pytest.approx(
        SAFETY * validation_work(clients=5, dim=1000)["masked_input"])
    assert proof_allowance(bounded) == validation_allowance(clients=5, dim=1000)
