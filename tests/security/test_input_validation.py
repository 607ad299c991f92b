"""Poisoning under secure aggregation: a malicious site's update, with and without the
round's norm bound (docs/protocol.md section 10).

A malicious site controls its input and its messages. Without ``norm_bound`` the masks
hide any update, so one site can replace the aggregate; with it, a site must prove that the
vector it masks has L2 norm at most B, and the proof is tied to what it masks. What the
bound does not stop is an update within it: a backdoor of norm <= B is bounded, not
prevented.
"""

from __future__ import annotations

import numpy as np
import pytest
from adversary import AttackSucceeded, documented_limitation, threat

from secagg import Config, simulate

pytest.importorskip("py_arkworks_bls12381")

from secagg.errors import InputMismatch
from secagg.validation import NormStatement, norm
from tests.secagg.test_validation import (
    BITS,
    encode_signed,
    nudge,
    plain_sum,
    run_round,
    small_inputs,
)

pytestmark = pytest.mark.security

N, DIM, BOUND, ATTACKER, SCALE = 5, 24, 4000, 2, 1000


def _scaled(inputs: dict[int, np.ndarray]) -> np.ndarray:
    """The model-replacement update: the attacker's vector times the inverse of its
    weight (1/n) and more."""
    return encode_signed(np.asarray(norm.centered(inputs[ATTACKER], BITS)) * SCALE)


@threat(attack="Model replacement: a site scales its update",
        adversary="malicious client",
        controls="its input (scaled by 1000) and its input proof (made for the scaled vector, "
                 "with the slack forced: no honest prover makes it)",
        protocol="norm_bound (docs/protocol.md 10): the proof fails, the site is left out of "
                 "the sum and named in AggregateResult.refused; the sum is the honest sites'")
def test_scaled_update_is_refused_and_named_with_a_norm_bound() -> None:
    config = Config(N, dim=DIM, bits=BITS, norm_bound=BOUND)
    inputs = small_inputs(N, DIM, BOUND)
    scaled = _scaled(inputs)

    def attack(cid: int, parties: object, stream: object) -> tuple[bytes, bool]:
        server = parties.server  # type: ignore[attr-defined]
        statement = NormStatement(server.session_id, cid, DIM, BITS, BOUND,
                                  server._advert_digests[cid])
        return norm.prove_relation(statement, norm.centered(scaled, BITS)
                                   + [0] * norm.SLACK, 1), True

    parties, refusals = run_round(config, inputs, {ATTACKER: attack})
    result = parties.server.result
    assert result is not None and set(result.refused) == {ATTACKER} == set(refusals)
    honest = set(range(1, N + 1)) - {ATTACKER}
    assert result.included == frozenset(honest)
    assert np.array_equal(result.total, plain_sum(inputs, honest))


@threat(attack="Model replacement: a site scales its update",
        adversary="malicious client",
        controls="its input (scaled by 1000), in a round without norm_bound",
        protocol="nothing: the masks hide every update, the scaled one replaces the sum "
                 "(the default; turn on norm_bound)", shows="limitation")
@documented_limitation("without norm_bound a site's update is not validated")
def test_scaled_update_replaces_the_sum_without_a_bound() -> None:
    inputs = small_inputs(N, DIM, BOUND)
    inputs[ATTACKER] = _scaled(inputs)
    result = simulate(Config(N, dim=DIM, bits=BITS), inputs, seed=2)
    total = np.asarray(norm.centered(result.total, BITS), dtype=np.float64)
    if np.linalg.norm(total) > N * BOUND:
        raise AttackSucceeded(f"the sum has norm {np.linalg.norm(total):.0f}, above the "
                              f"{N} x {BOUND} that honest sites can reach")


@threat(attack="A site proves one vector and masks another",
        adversary="malicious client",
        controls="the vector it masks, after proving an honest one (scaled by 1000, or off "
                 "by one in one coordinate)",
        protocol="docs/protocol.md 10.4: the commitments do not open to the unmasked sum; "
                 "InputMismatch, nothing is released, nobody is named (one site can abort "
                 "the round: ACORN-detect's guarantee)")
@pytest.mark.parametrize("how", ["scaled", "off by one"])
def test_masking_another_vector_releases_nothing(how: str) -> None:
    config = Config(N, dim=DIM, bits=BITS, norm_bound=BOUND)
    inputs = small_inputs(N, DIM, BOUND)

    def switch(cid: int, parties: object, stream: object) -> tuple[None, bool]:
        vector = stream._client._secrets.input  # type: ignore[attr-defined]
        vector[:] = _scaled({ATTACKER: vector})
        return None, True

    holder: dict[str, object] = {}
    with pytest.raises(InputMismatch):
        run_round(config, inputs, {ATTACKER: switch if how == "scaled" else nudge}, holder)
    server = holder["parties"].server  # type: ignore[attr-defined]
    assert server.result is None and server.aborted is not None


@threat(attack="A stealthy backdoor within the bound",
        adversary="malicious client",
        controls="its input: any direction (a trigger pattern), L2 norm exactly the bound",
        protocol="accepted, as any in-bound update: its effect on the sum is at most B in L2 "
                 "(bounded, not prevented; robust aggregation or DP noise must do the rest)",
        shows="limitation")
@documented_limitation("an update within the bound is accepted whatever its direction")
def test_in_bound_backdoor_is_bounded_not_prevented() -> None:
    config = Config(N, dim=DIM, bits=BITS, norm_bound=BOUND)
    inputs = small_inputs(N, DIM, BOUND)
    trigger = np.zeros(DIM, dtype=np.int64)
    trigger[:4] = BOUND // 2  # norm exactly BOUND: a pattern on four features
    inputs[ATTACKER] = encode_signed(trigger)
    result = simulate(config, inputs, seed=4)
    assert result.refused == {} and ATTACKER in result.included
    others = plain_sum(inputs, set(range(1, N + 1)) - {ATTACKER})
    shift = np.asarray(norm.centered((result.total - others) % (1 << BITS), BITS))
    assert np.linalg.norm(shift) <= BOUND  # bounded ...
    raise AttackSucceeded("... but accepted: the trigger is in the sum")
