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

from fl.round_plan import with_norm_bound
from fl.round_reply import encode_reply
from fl.round_setup import RoundSetup, dp_params, encoded_dim
from secagg.errors import InputMismatch
from secagg.validation import NormStatement, norm
from tests.fl.test_input_bound import _dp as dp_setup
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
        vector = stream._input  # type: ignore[attr-defined]
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


# --- with distributed DP: the bound is the clip, noise included (docs/protocol.md 10.6) ----


def _dp_round() -> tuple[RoundSetup, Config, dict[int, np.ndarray]]:
    """A 4-site distributed-DP round setup with the bound at the clip (tests/fl's), and each
    site's honest contribution: an update far beyond the clip, clipped to it, plus noise."""
    setup = with_norm_bound(dp_setup(), "clip")
    rng = np.random.default_rng(5)
    sent = np.zeros(setup.model_dim)
    inputs = {cid: encode_reply(setup, rng.normal(size=setup.model_dim) * 30, {}, 1.0, sent)
              for cid in range(1, setup.num_clients + 1)}
    return setup, setup.config(encoded_dim(setup)), inputs


def _forge(vector: np.ndarray, bits: int) -> object:
    def attack(cid: int, parties: object, stream: object) -> tuple[bytes, bool]:
        server = parties.server  # type: ignore[attr-defined]
        cfg = server.config
        statement = NormStatement(server.session_id, cid, cfg.dim, bits, cfg.norm_bound,
                                  server._advert_digests[cid])
        stream._input[:] = vector  # type: ignore[attr-defined]
        return norm.prove_relation(statement, norm.centered(vector, bits)
                                   + [0] * norm.SLACK, 1), True
    return attack


@threat(attack="Model replacement under distributed DP",
        adversary="malicious client",
        controls="its noised contribution, scaled by 10 (and its proof for it)",
        protocol="norm_bound at the DP clip, the noise's tail included (fl/input_bound.py): "
                 "honest sites at the clip pass, the scaled one is refused and named")
def test_under_dp_an_honest_site_at_the_clip_passes_and_a_scaled_one_is_refused() -> None:
    _, config, inputs = _dp_round()
    bits = config.bits
    scaled = ((np.asarray(norm.centered(inputs[ATTACKER], bits), dtype=object) * 10)
              % (1 << bits)).astype(np.uint64)
    parties, refusals = run_round(config, inputs, {ATTACKER: _forge(scaled, bits)})
    result = parties.server.result
    assert result is not None and set(result.refused) == {ATTACKER} == set(refusals)
    honest = set(inputs) - {ATTACKER}
    assert result.included == frozenset(honest)
    total = np.zeros(config.dim, dtype=object)
    for cid in honest:
        total = total + inputs[cid].astype(object)
    assert np.array_equal(result.total, (total % (1 << bits)).astype(np.uint64))


@threat(attack="Under distributed DP, a site leaves out its noise",
        adversary="malicious client",
        controls="its contribution: no noise, a signal of norm up to the bound instead",
        protocol="accepted: the bound covers the noised contribution, so a noiseless site "
                 "can send up to B_int (4.1x the clip's norm here); verifiable noise is not "
                 "done (docs/protocol.md 10.6)", shows="limitation")
@documented_limitation("under DP the bound is the clip plus the noise's tail, not the clip")
def test_under_dp_a_noiseless_site_sends_more_than_the_clip() -> None:
    setup, config, inputs = _dp_round()
    p = dp_params(setup)
    trigger = np.zeros(config.dim, dtype=np.int64)
    trigger[:4] = config.norm_bound // 2  # norm exactly the bound, no noise
    inputs[ATTACKER] = (trigger % (1 << config.bits)).astype(np.uint64)
    result = simulate(config, inputs, seed=6)
    assert result.refused == {} and ATTACKER in result.included
    if np.linalg.norm(trigger) > p.rounded_l2_bound:
        raise AttackSucceeded(f"accepted a signal of norm {np.linalg.norm(trigger):.0f}, "
                              f"{np.linalg.norm(trigger) / p.rounded_l2_bound:.1f}x the "
                              "clip's")

