"""Input validation inside secure aggregation (docs/protocol.md section 10): test vectors,
a soundness test for every way a client could cheat, and the round's properties.

Every cheat goes through the public surface: a forged proof is made with the same prover
core the honest client uses (``prove_relation``) on a witness that breaks the relation, and
delivered as wire bytes to the real ``Server``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("py_arkworks_bls12381")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from secagg import Config, ProtocolError, Stage, simulate
from secagg.errors import InputMismatch, InputRefused, ProtocolAbort
from secagg.masked_stream import MaskedStream
from secagg.messages import SCHEDULE, InputProof, MessageKind, decode, encode
from secagg.simulate import LocalRound
from secagg.stage import round_stages
from secagg.validation import (
    InvalidProof,
    NormStatement,
    blinding,
    check_parameters,
    group,
    norm,
    proof_size,
    prove,
    verify,
)
from tests.secagg.test_primitives import is_probable_prime

BITS = 32
MOD = 1 << BITS
SID = bytes(range(32))


def encode_signed(values: np.ndarray | list[int]) -> np.ndarray:
    return (np.asarray(values, dtype=np.int64) % MOD).astype(np.uint64)


def vector_with_norm(rng: np.random.Generator, dim: int, norm_: float) -> np.ndarray:
    """Integers whose L2 norm is at most ``norm_`` (rounded towards zero)."""
    direction = rng.normal(size=dim)
    direction /= np.linalg.norm(direction)
    return np.trunc(direction * norm_).astype(np.int64)


# --- test vectors ------------------------------------------------------------------------


def test_hash_to_curve_matches_rfc9380() -> None:
    """The library's hash-to-curve is RFC 9380's BLS12381G1_XMD:SHA-256_SSWU_RO_
    (appendix J.9.1, msg = ""), and the generators are hashed with our tag, in arkworks'
    (msg, dst) order."""
    ark = pytest.importorskip("py_arkworks_bls12381")
    point = ark.G1Point.hash_to_curve(b"", b"QUUX-V01-CS02-with-BLS12381G1_XMD:SHA-256_SSWU_RO_")
    assert point.to_xy_bytes_be().hex() == (
        "052926add2207b76ca4fa57a8734416c8dc95e24501772c814278700eed6d1e4e8cf62d9c09db0fac349"
        "612b759e79a108ba738453bfed09cb546dbb0783dbb3a5f1f566ed67bb6be0e8c67e2e81a4cc68ee2981"
        "3bb7994998f3eae0c9c6a265")
    g0 = group.vector_generators(b"G", 1)[0]
    assert g0 == ark.G1Point.hash_to_curve(b"G|" + (0).to_bytes(8, "big"), group.GENERATOR_TAG)
    assert group.encode_point(g0).hex() == (
        "ac804cf02707290cc78a63394e723fdcfcb9f78f4d5b03823135038eae1e4db5f4436e28942fd7439c75"
        "e5a741e15862")
    h = group.vector_generators(b"H", 1)[0]
    assert group.encode_point(h).hex() == (
        "b25b454247697b26a85fb46b12efb7a36902dbf7e3585dbf8398a18032ff282638281ad2ff29d5c684d5"
        "f30d5789b156")


def test_transcript_and_layout_vectors() -> None:
    statement = NormStatement(SID, 7, 10, 16, 1000)
    assert statement.header().hex() == (
        "7365636167672f76317c696e7075742d76616c69646174696f6e7c6c327c" + SID.hex()
        + bytes(32).hex() + b"masked_input".hex() + "00000007000000000000000a10010000080040"
        + (1000).to_bytes(16, "big").hex())
    assert proof_size(10) == 3 * 48 + 4 * 32 + 256 * 17 + (10 + 8 + 256) * 32 == 13392
    assert statement.z_max == (math.isqrt(17) * 1000 + 1000) * ((1 << 64) + 1)
    # the figures docs/protocol.md section 10 states
    doc = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text("utf-8")
    assert "`proof_size(d)` = 4,624 + 32·(d + 264) bytes" in doc
    assert all(proof_size(d) == 4624 + 32 * (d + 264) for d in (1, 10, 10**6))
    assert "all 256 rows pass with probability below 2^−149" in doc
    assert (1 - 85 / 256) ** norm.LAMBDA < 2.0 ** -149
    assert "distance at most 256·2^−64 = 2^−56" in doc and norm.SIGMA == 64
    # the projection of (1, 2, 3) with the all-zero seed: the first two rows
    r = group.ORDER
    assert norm.project(bytes(64), [1, 2, 3])[:2] == [r - 5, r - 1]
    assert blinding([(bytes(16), True), (bytes([1] * 16), False)]) == (
        36668011984102314524770058257908608465209193147938893921684471850388287806914)


@given(st.one_of(st.integers(0, (1 << 126) - 1), st.integers(0, (1 << 256) - 1)))
@settings(max_examples=200, deadline=None)
def test_four_square_slack_sums_to_n(n: int) -> None:
    q = norm.four_square_slack(n)
    assert len(q) == norm.SLACK and sum(a * a for a in q) == n
    with pytest.raises(ValueError, match="slack"):
        norm.four_square_slack(-1 - n)
    with pytest.raises(ValueError, match="slack"):
        norm.four_square_slack((1 << 256) + n)


def test_config_checks_the_bound_and_binds_it_into_the_session() -> None:
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="norm_bound"):
            Config(4, dim=8, bits=BITS, norm_bound=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="wrap the sum"):
        Config(4, dim=8, bits=16, norm_bound=1 << 14)
    with pytest.raises(ValueError, match="group order"):
        check_parameters(2, 1 << 30, 64, (1 << 62) - 1)
    plain, bounded = Config(4, dim=8, bits=BITS), Config(4, dim=8, bits=BITS, norm_bound=99)
    assert bounded.encode().startswith(plain.encode()) and bounded.encode() != plain.encode()
    assert Config(4, dim=8, bits=BITS, norm_bound=98).encode() != bounded.encode()


# --- the proof alone: completeness and soundness -----------------------------------------


DIM = 40
BOUND = 10_000


def honest(rng_seed: int = 0, norm_: float = BOUND) -> np.ndarray:
    return encode_signed(vector_with_norm(np.random.default_rng(rng_seed), DIM, norm_))


def test_honest_proof_verifies_and_carries_the_commitment() -> None:
    statement = NormStatement(SID, 3, DIM, BITS, BOUND)
    x = honest()
    proof = prove(statement, x, 12345)
    assert len(proof) == proof_size(DIM)
    c = verify(statement, proof)
    g, h = norm.input_generators(DIM)
    assert c == group.msm([*g, h], [*norm.centered(x, BITS), 12345])
    assert norm.check_sum([c], x, BITS, 12345)
    assert not norm.check_sum([c], x, BITS, 12346)


def test_exactly_at_the_bound_verifies() -> None:
    x = [0] * DIM
    x[0], x[1] = 6000, -8000  # norm exactly 10000
    statement = NormStatement(SID, 3, DIM, BITS, BOUND)
    verify(statement, prove(statement, encode_signed(x), 1))


def test_honest_prover_refuses_an_oversized_input() -> None:
    statement = NormStatement(SID, 3, DIM, BITS, BOUND)
    with pytest.raises(ValueError, match="clip it"):
        prove(statement, honest(norm_=BOUND * 1.01 + 2), 1)


def test_too_large_proved_under_a_larger_bound_is_refused() -> None:
    """Cheat: a scaled update proved honestly for a larger bound."""
    big = honest(norm_=BOUND * 10)
    proof = prove(NormStatement(SID, 3, DIM, BITS, BOUND * 10), big, 1)
    with pytest.raises(InvalidProof):
        verify(NormStatement(SID, 3, DIM, BITS, BOUND), proof)


def test_too_large_with_no_slack_is_refused() -> None:
    """Cheat: the scaled vector with the slack left out (the quadratic check)."""
    x = norm.centered(honest(norm_=BOUND * 3), BITS)
    statement = NormStatement(SID, 3, DIM, BITS, BOUND)
    with pytest.raises(InvalidProof, match="does not verify"):
        verify(statement, norm.prove_relation(statement, x + [0] * norm.SLACK, 1))


def test_too_large_with_slack_wrapped_mod_r_is_refused() -> None:
    """Cheat: make ||x||^2 + ||q||^2 = B^2 hold mod r with a negative 'square' (r - k is a
    square mod r for some k): the slack is huge, so its projections give it away."""
    r = group.ORDER
    x = norm.centered(honest(norm_=BOUND * 3), BITS)
    excess = sum(v * v for v in x) - BOUND * BOUND  # > 0: need sum q^2 = -excess mod r
    for k in range(1000):  # q0^2 + k^2 = -excess (mod r): q0 huge, k small
        root = _sqrt_mod((-excess - k * k) % r, r)
        if root is not None:
            break
    assert root is not None and (root * root + k * k + excess) % r == 0
    statement = NormStatement(SID, 3, DIM, BITS, BOUND)
    witness = x + [root, k] + [0] * (norm.SLACK - 2)
    with pytest.raises(InvalidProof, match="too large"):
        verify(statement, norm.prove_relation(statement, witness, 1))


def test_wrapping_coordinates_are_refused() -> None:
    """Cheat: coordinates a and a*i with i^2 = -1 mod r: their squares cancel mod r, so the
    quadratic relation alone would pass with a huge vector. The smallness proof stops it."""
    r = group.ORDER
    i = _sqrt_mod(r - 1, r)
    assert i is not None
    a = 1 << 200
    x = [a, a * i % r] + [0] * (DIM - 2)
    x[2] = BOUND  # ||x||^2 = B^2 mod r: the quadratic check holds
    statement = NormStatement(SID, 3, DIM, BITS, BOUND)
    assert (sum(v * v for v in x) - BOUND * BOUND) % r == 0
    with pytest.raises(InvalidProof, match="too large"):
        verify(statement, norm.prove_relation(statement, x + [0] * norm.SLACK, 1))


def test_wrap_around_that_fits_the_encoding_is_refused_by_the_bound_on_z() -> None:
    """Cheat: x = (a, b) with a^2 + b^2 = k r + B^2 (Cornacchia on a prime p = k r + B^2):
    ||x||^2 = B^2 mod r, a and b are ~2^128, so their projections fit the 17-byte encoding
    and are consistent; only the verifier's |z_i| <= Z check stands in the way."""
    r = group.ORDER
    k = 1
    while True:
        p = k * r + BOUND * BOUND
        if p % 4 == 1 and is_probable_prime(p):
            break
        k += 1
    a, b = _two_squares(p)
    assert a * a + b * b == p and max(a, b) < 1 << 131
    statement = NormStatement(SID, 3, DIM, BITS, BOUND)
    witness = [a, b] + [0] * (DIM - 2) + [0] * norm.SLACK
    with pytest.raises(InvalidProof, match="too large"):
        verify(statement, norm.prove_relation(statement, witness, 1))


@given(excess=st.floats(1.0001, 1e4), seed=st.integers(0, 2**16),
       slack=st.sampled_from(["zeros", "greedy of the excess", "random", "bound-sized"]))
@settings(max_examples=25, deadline=None)
def test_property_no_over_bound_witness_verifies(excess: float, seed: int, slack: str) -> None:
    """Whatever slack a cheater picks for a vector over the bound (norm = excess x B), the
    relation ||x||^2 + ||q||^2 = B^2 cannot hold over the integers, and mod r it holds only
    with a huge q: the proof never verifies."""
    rng = np.random.default_rng(seed)
    x = [int(v) for v in vector_with_norm(rng, 12, BOUND * excess)]
    norm2 = sum(v * v for v in x)
    if norm2 <= BOUND * BOUND:
        return  # rounding brought it within the bound: not a cheat
    q = {"zeros": [0] * norm.SLACK,
         "greedy of the excess": norm.four_square_slack(norm2 - BOUND * BOUND),
         "random": [int(v) for v in rng.integers(-BOUND, BOUND, norm.SLACK)],
         "bound-sized": [BOUND] + [0] * (norm.SLACK - 1)}[slack]
    statement = NormStatement(SID, 3, 12, BITS, BOUND)
    with pytest.raises(InvalidProof):
        verify(statement, norm.prove_relation(statement, x + q, 1))


def test_replayed_proof_of_another_client_round_or_bound_is_refused() -> None:
    statement = NormStatement(SID, 3, DIM, BITS, BOUND)
    proof = prove(statement, honest(), 1)
    verify(statement, proof)
    for other in (NormStatement(SID, 4, DIM, BITS, BOUND),
                  NormStatement(bytes(32), 3, DIM, BITS, BOUND),
                  NormStatement(SID, 3, DIM, BITS, BOUND + 1),
                  NormStatement(SID, 3, DIM, 33, BOUND),
                  NormStatement(SID, 3, DIM, BITS, BOUND, b"\x01" * 32)):
        with pytest.raises(InvalidProof):
            verify(other, proof)


@pytest.fixture(scope="module")
def good_proof() -> bytes:
    return prove(NormStatement(SID, 3, DIM, BITS, BOUND), honest(), 1)


@given(data=st.data())
@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_tampered_proof_is_invalid_proof_never_a_crash(good_proof: bytes,
                                                           data: st.DataObject) -> None:
    statement = NormStatement(SID, 3, DIM, BITS, BOUND)
    how = data.draw(st.sampled_from(["flip", "truncate", "extend", "scalar", "point"]))
    bad = bytearray(good_proof)
    if how == "flip":
        pos = data.draw(st.integers(0, len(bad) - 1))
        bad[pos] ^= 1 << data.draw(st.integers(0, 7))
    elif how == "truncate":
        bad = bad[:data.draw(st.integers(0, len(bad) - 1))]
    elif how == "extend":
        bad += data.draw(st.binary(min_size=1, max_size=40))
    elif how == "scalar":  # a non-canonical scalar (>= r) in some scalar slot
        slots = [3 * 48 + 32 * k for k in range(4)] + [
            3 * 48 + 4 * 32 + 256 * 17 + 32 * k for k in range(DIM + 8 + 256)]
        pos = data.draw(st.sampled_from(slots))
        value = int.from_bytes(bad[pos:pos + 32], "little") + group.ORDER
        if value >= 1 << 256:
            value -= group.ORDER
        bad[pos:pos + 32] = value.to_bytes(32, "little")
    else:  # random bytes where a point goes
        pos = data.draw(st.sampled_from([0, 48, 96]))
        bad[pos:pos + 48] = data.draw(st.binary(min_size=48, max_size=48))
    if bytes(bad) == good_proof:
        return
    with pytest.raises(InvalidProof):
        verify(statement, bytes(bad))


def test_input_proof_message_round_trips_and_hostile_bytes_are_decode_errors() -> None:
    msg = InputProof(SID, 5, b"\x01" * 100)
    data = encode(msg)
    assert decode(data) == msg
    assert data[6] == MessageKind.INPUT_PROOF  # [array, bin(3) "SA1", kind, ...]
    from secagg.errors import DecodeError

    for cut in range(len(data) - 1):
        with pytest.raises(DecodeError):
            decode(data[:cut])


# --- the round -----------------------------------------------------------------------------


Tamper = Callable[[int, LocalRound, MaskedStream], tuple[bytes | None, bool]]
"""(client id, parties, its honest stream) -> (the proof bytes it sends instead (None: the
honest one), whether it sends its masked input at all)."""


def run_round(config: Config, inputs: Mapping[int, np.ndarray],
              tamper: Mapping[int, Tamper] | None = None,
              keep: dict[str, LocalRound] | None = None) -> tuple[LocalRound, dict[int, str]]:
    """One round through the wire codec, like ``simulate``, where a client may cheat in
    masked_input. Returns the parties (also in ``keep``) and the server's refusals."""
    parties = LocalRound.new(config, inputs, b"validation-test")
    if keep is not None:
        keep["parties"] = parties
    server = parties.server
    clients = {cid: parties.client(cid, inputs[cid]) for cid in parties.roster}
    refusals: dict[int, str] = {}
    outgoing: dict[int, bytes] = {}
    for stage in round_stages(config):
        if stage is Stage.ADVERTISE_KEYS:
            for cid, c in clients.items():
                server.receive(cid, encode(c.advertise()))
        else:
            for cid, data in outgoing.items():
                reply = clients[cid].stream(data)
                if isinstance(reply, MaskedStream):
                    proof, send = (tamper[cid](cid, parties, reply) if tamper and cid in tamper
                                   else (None, True))
                    # the schedule's data: this stage's validation message comes first
                    assert type(reply.proof) is SCHEDULE[stage].validation
                    assert reply.proof is not None and reply.proof.stage is stage
                    message = reply.proof if proof is None else InputProof(
                        reply.proof.session_id, cid, proof)
                    try:
                        server.receive(cid, encode(message))
                    except InputRefused as exc:
                        assert exc.client_id == cid
                        refusals[cid] = str(exc)
                        # refused: no longer awaited (the O(1) query agrees with the set)
                        assert not server.is_pending(cid) and cid not in server.pending
                    if send:
                        try:
                            server.receive(cid, encode(reply.whole()))
                        except ProtocolError as exc:
                            assert cid in refusals, exc
                else:
                    server.receive(cid, encode(reply))
        outgoing = {cid: encode(m) for cid, m in server.advance().items()}
    return parties, refusals


def nudge(cid: int, parties: LocalRound, stream: MaskedStream) -> tuple[None, bool]:
    """Cheat: mask the proved vector plus one in coordinate 7 (after the proof was made)."""
    stream._input[7] += np.uint64(1)
    return None, True


def small_inputs(n: int, dim: int, bound: int, seed: int = 0,
                 scale: float = 0.9) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {cid: encode_signed(vector_with_norm(rng, dim, bound * scale))
            for cid in range(1, n + 1)}


def plain_sum(inputs: Mapping[int, np.ndarray], ids: set[int] | frozenset[int]) -> np.ndarray:
    total = np.zeros_like(next(iter(inputs.values())))
    for cid in ids:
        total = (total + inputs[cid]) % MOD
    return total


def test_honest_round_with_validation_equals_the_round_without() -> None:
    inputs = small_inputs(5, 30, 5000)
    plain = simulate(Config(5, dim=30, bits=BITS), inputs, seed=3)
    checked = simulate(Config(5, dim=30, bits=BITS, norm_bound=5000), inputs, seed=3)
    assert np.array_equal(plain.total, checked.total)
    assert checked.included == plain.included == frozenset(range(1, 6))
    assert checked.refused == {}
    assert checked.bytes_sent[1]["masked_input"] > plain.bytes_sent[1]["masked_input"]


def test_scaled_update_is_refused_named_and_left_out_of_the_sum() -> None:
    """The model-replacement attack: client 2 scales its update by 100. Its proof (made
    for the scaled vector: with the slack forced, as no honest prover would) fails; it is
    named, and the sum is the honest clients' sum."""
    config = Config(5, dim=30, bits=BITS, norm_bound=5000)
    inputs = small_inputs(5, 30, 5000)
    scaled = encode_signed(np.asarray(norm.centered(inputs[2], BITS)) * 100)

    def scale(cid: int, parties: LocalRound, stream: MaskedStream) -> tuple[bytes, bool]:
        statement = NormStatement(parties.server.session_id, cid, 30, BITS, 5000,
                                  parties.server._advert_digests[cid])
        witness = norm.centered(scaled, BITS) + [0] * norm.SLACK
        return norm.prove_relation(statement, witness, 1), True

    parties, refusals = run_round(config, inputs, {2: scale})
    result = parties.server.result
    assert result is not None
    assert set(refusals) == {2} and set(result.refused) == {2}
    assert result.included == frozenset({1, 3, 4, 5})
    assert result.dropped[2] is Stage.MASKED_INPUT
    assert np.array_equal(result.total, plain_sum(inputs, {1, 3, 4, 5}))


def test_proof_replayed_from_another_client_or_round_is_refused() -> None:
    config = Config(4, dim=20, bits=BITS, norm_bound=3000)
    inputs = small_inputs(4, 20, 3000)
    stolen: dict[str, bytes] = {}

    def steal(cid: int, parties: LocalRound, stream: MaskedStream) -> tuple[bytes | None, bool]:
        assert stream.proof is not None
        stolen["proof"] = stream.proof.proof  # client 1 answers first: keep its proof
        return None, True

    def replay(cid: int, parties: LocalRound, stream: MaskedStream) -> tuple[bytes, bool]:
        return stolen["proof"], True

    parties, refusals = run_round(config, inputs, {1: steal, 3: replay})
    assert parties.server.result is not None and set(parties.server.result.refused) == {3}
    # the same proof in another round from the same client (the same session id: same
    # config, roster and context; only the fresh keys differ)
    previous = stolen["proof"]
    parties, refusals = run_round(config, inputs, {1: lambda c, p, s: (previous, True)})
    assert set(refusals) == {1}
    result = parties.server.result
    assert result is not None and result.included == frozenset({2, 3, 4})
    assert np.array_equal(result.total, plain_sum(inputs, {2, 3, 4}))


def test_malformed_proof_on_the_wire_is_refused_and_named() -> None:
    config = Config(4, dim=20, bits=BITS, norm_bound=3000)
    inputs = small_inputs(4, 20, 3000)

    def garbage(cid: int, parties: LocalRound, stream: MaskedStream) -> tuple[bytes, bool]:
        return b"\x00" * 17, True

    parties, _ = run_round(config, inputs, {4: garbage})
    result = parties.server.result
    assert result is not None and set(result.refused) == {4}
    assert "bytes" in result.refused[4]
    assert np.array_equal(result.total, plain_sum(inputs, {1, 2, 3}))


def test_masking_another_vector_than_the_proved_one_is_caught() -> None:
    """Client 3 proves its honest vector and masks the scaled one: the commitments do not
    open to the unmasked sum and nothing is released."""
    config = Config(5, dim=30, bits=BITS, norm_bound=5000)
    inputs = small_inputs(5, 30, 5000)

    def switch(cid: int, parties: LocalRound, stream: MaskedStream) -> tuple[None, bool]:
        vector = stream._input
        vector[:] = encode_signed(np.asarray(norm.centered(vector, BITS)) * 100)
        return None, True

    with pytest.raises(InputMismatch, match="masked another vector"):
        run_round(config, inputs, {3: switch})


def test_masking_a_vector_off_by_one_in_one_coordinate_is_caught() -> None:
    config = Config(4, dim=20, bits=BITS, norm_bound=3000)
    inputs = small_inputs(4, 20, 3000)

    with pytest.raises(InputMismatch):
        run_round(config, inputs, {2: nudge})


def test_masked_input_without_a_proof_does_not_count() -> None:
    config = Config(4, dim=20, bits=BITS, norm_bound=3000)
    inputs = small_inputs(4, 20, 3000)

    def out_of_order(cid: int, parties: LocalRound, stream: MaskedStream
                     ) -> tuple[None, bool]:
        server, proof = parties.server, stream.proof
        assert proof is not None
        with pytest.raises(ProtocolError, match="no verified input proof"):
            server.receive(cid, encode(stream.whole()))
        assert server.receive(cid, encode(proof)) is True
        assert server.receive(cid, encode(proof)) is False  # a redelivery
        assert server.receive(cid, encode(stream.whole())) is True
        with pytest.raises(ProtocolError, match="second, different input proof"):
            server.receive(cid, encode(InputProof(proof.session_id, cid, proof.proof[::-1])))
        return None, True  # run_round's own deliveries are redeliveries now

    parties, refusals = run_round(config, inputs, {1: out_of_order})
    assert refusals == {} and parties.server.result is not None
    assert np.array_equal(parties.server.result.total, plain_sum(inputs, {1, 2, 3, 4}))


def test_a_client_refuses_an_input_over_the_bound() -> None:
    config = Config(3, dim=10, bits=BITS, norm_bound=100)
    with pytest.raises(ValueError, match="clip it"):
        simulate(config, {1: encode_signed([101] + [0] * 9), 2: encode_signed([0] * 10),
                          3: encode_signed([0] * 10)})


def test_an_input_proof_in_a_round_without_a_bound_is_rejected() -> None:
    config = Config(3, dim=10, bits=BITS)
    parties = LocalRound.new(config, [1, 2, 3], b"x")
    with pytest.raises(ProtocolError, match="without norm_bound"):
        parties.server.receive(1, encode(InputProof(parties.server.session_id, 1, b"\x00")))


@given(n=st.integers(3, 5), dim=st.integers(1, 12), seed=st.integers(0, 2**16),
       scale=st.floats(0.0, 1.0), drop=st.sampled_from([None, Stage.MASKED_INPUT,
                                                        Stage.UNMASKING]))
@settings(max_examples=12, deadline=None)
def test_property_honest_rounds_give_the_exact_sum_and_name_nobody(
        n: int, dim: int, seed: int, scale: float, drop: Stage | None) -> None:
    bound = 1 << 20
    config = Config(n, dim=dim, bits=BITS, norm_bound=bound)
    inputs = small_inputs(n, dim, bound, seed, scale)
    drops = {n: drop} if drop is not None and n > 3 else {}
    result = simulate(config, inputs, drops, seed=seed)
    assert result.refused == {}
    assert np.array_equal(result.total, plain_sum(inputs, result.included))
    # a client that stops at unmasking has its masked input (and its proof) in the sum
    expected = set(range(1, n + 1)) - {c for c, at in drops.items() if at <= Stage.MASKED_INPUT}
    assert result.included == frozenset(expected)


def test_malicious_mode_round_with_validation() -> None:
    config = Config(4, dim=16, bits=BITS, norm_bound=4000, security="malicious")
    inputs = small_inputs(4, 16, 4000)
    result = simulate(config, inputs, seed=1)
    assert np.array_equal(result.total, plain_sum(inputs, set(range(1, 5))))


def test_abort_is_sticky_after_a_mismatch() -> None:
    config = Config(4, dim=20, bits=BITS, norm_bound=3000)
    inputs = small_inputs(4, 20, 3000)

    holder: dict[str, LocalRound] = {}
    with pytest.raises(InputMismatch):
        run_round(config, inputs, {1: nudge}, holder)
    server = holder["parties"].server
    assert isinstance(server.aborted, ProtocolAbort) and server.result is None
    with pytest.raises(ProtocolError, match="aborted"):
        server.advance()


def _sqrt_mod(a: int, p: int) -> int | None:
    """Tonelli-Shanks (test-side arithmetic to build cheats, not used by the protocol)."""
    if a == 0:
        return 0
    if pow(a, (p - 1) // 2, p) != 1:
        return None
    q, s = p - 1, 0
    while q % 2 == 0:
        q, s = q // 2, s + 1
    z = 2
    while pow(z, (p - 1) // 2, p) != p - 1:
        z += 1
    m, c, t, r = s, pow(z, q, p), pow(a, q, p), pow(a, (q + 1) // 2, p)
    while t != 1:
        i, t2 = 0, t
        while t2 != 1:
            t2, i = t2 * t2 % p, i + 1
        b = pow(c, 1 << (m - i - 1), p)
        m, c, t, r = i, b * b % p, t * b * b % p, r * b % p
    return r


def _two_squares(p: int) -> tuple[int, int]:
    """Cornacchia for a prime p = 1 mod 4: p = a^2 + b^2."""
    root = _sqrt_mod(p - 1, p)
    assert root is not None
    a, b = p, root
    while b * b > p:
        a, b = b, a % b
    c = math.isqrt(p - b * b)
    return b, c


def test_malicious_mode_a_proof_forged_under_an_honest_id_is_rejected_not_named() -> None:
    """In malicious mode the proof is signed: bytes injected under client 2's id (a broker
    or network attacker) are rejected without naming it, and its own proof then counts."""
    config = Config(4, dim=16, bits=BITS, norm_bound=4000, security="malicious")
    inputs = small_inputs(4, 16, 4000)

    def injected(cid: int, parties: LocalRound, stream: MaskedStream) -> tuple[None, bool]:
        server, proof = parties.server, stream.proof
        assert proof is not None and len(proof.signature) == 64
        for forged in (InputProof(proof.session_id, cid, b"\x00" * len(proof.proof)),
                       InputProof(proof.session_id, cid, b"\x00" * len(proof.proof),
                                  proof.signature)):
            with pytest.raises(ProtocolError, match="signature") as caught:
                server.receive(cid, encode(forged))
            assert not isinstance(caught.value, InputRefused)
        assert cid not in server.refused
        return None, True

    parties, refusals = run_round(config, inputs, {2: injected})
    result = parties.server.result
    assert refusals == {} and result is not None and result.refused == {}
    assert np.array_equal(result.total, plain_sum(inputs, {1, 2, 3, 4}))


def test_secagg_plus_round_with_validation_and_a_dropout() -> None:
    """A sparse graph: each client's blinding carries only its neighbours' pairwise keys,
    and the server's sum check still balances with a client dropped at masked_input."""
    config = Config(8, dim=10, bits=BITS, neighbors=6, unchecked_graph=True,
                    norm_bound=20_000)
    assert config.neighbors == 6  # a sparse graph, not the complete one
    inputs = small_inputs(8, 10, 20_000, seed=9)
    result = simulate(config, inputs, {5: Stage.MASKED_INPUT}, seed=9)
    assert result.refused == {} and result.included == frozenset({1, 2, 3, 4, 6, 7, 8})
    assert np.array_equal(result.total, plain_sum(inputs, result.included))


# --- the weight proved non-negative (Config.weight_index, docs/protocol.md 10.7) ----------


WDIM = 12
WBOUND = 5000


def weighted_row(weight: int, seed: int = 0, scale: float = 0.5) -> list[int]:
    """A row whose last coordinate is ``weight`` and whose norm is within WBOUND."""
    rng = np.random.default_rng(seed)
    x = [int(v) for v in vector_with_norm(rng, WDIM - 1, WBOUND * scale)]
    return [*x, weight]


def wstatement(client: int = 3) -> NormStatement:
    return NormStatement(SID, client, WDIM, BITS, WBOUND, weight_index=WDIM - 1)


def forge_weight(x: list[int], squares: list[int]) -> bytes:
    """A proof with the norm's slack honest and the weight's squares ``squares``."""
    st_ = wstatement()
    q = norm.four_square_slack(WBOUND * WBOUND - sum(v * v for v in x))
    return norm.prove_relation(st_, x + q + squares, 1)


def test_weight_index_transcript_layout_and_config() -> None:
    plain, weighted = NormStatement(SID, 7, 10, 16, 1000), wstatement(7)
    assert weighted.header() == (NormStatement(SID, 7, WDIM, BITS, WBOUND).header()
                                 + b"|nonneg|" + (WDIM - 1).to_bytes(8, "big"))
    assert plain.header().endswith((1000).to_bytes(16, "big"))  # unchanged without it
    assert weighted.proof_bytes == proof_size(WDIM, True) == proof_size(WDIM) + 48 + 32 * 9
    doc = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text("utf-8")
    assert "`proof_size(d)` + 336 bytes" in doc
    for bad in (-1, WDIM, True, 1.0):
        with pytest.raises(ValueError, match="weight_index"):
            Config(4, dim=WDIM, bits=BITS, norm_bound=WBOUND,
                   weight_index=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="without norm_bound"):
        Config(4, dim=WDIM, bits=BITS, weight_index=0)
    bounded = Config(4, dim=WDIM, bits=BITS, norm_bound=WBOUND)
    with_w = Config(4, dim=WDIM, bits=BITS, norm_bound=WBOUND, weight_index=WDIM - 1)
    assert with_w.encode().startswith(bounded.encode()) and with_w.encode() != bounded.encode()
    assert Config(4, dim=WDIM, bits=BITS, norm_bound=WBOUND,
                  weight_index=0).encode() != with_w.encode()


@given(weight=st.integers(0, WBOUND // 2), seed=st.integers(0, 2**16),
       index=st.integers(0, WDIM - 1))
@settings(max_examples=15, deadline=None)
def test_property_honest_rows_with_any_weight_in_range_verify(weight: int, seed: int,
                                                              index: int) -> None:
    """Any non-negative weight the bound allows, at any public index, proves and verifies;
    a proof for one index does not verify for another."""
    x = weighted_row(weight, seed)
    x[index], x[-1] = x[-1], x[index]
    st_ = NormStatement(SID, 3, WDIM, BITS, WBOUND, weight_index=index)
    proof = prove(st_, encode_signed(x), 99)
    g, h = norm.input_generators(WDIM)
    assert verify(st_, proof) == group.msm([*g, h], [*x, 99])
    with pytest.raises(InvalidProof):
        verify(NormStatement(SID, 3, WDIM, BITS, WBOUND, weight_index=(index + 1) % WDIM), proof)


def test_weight_at_the_edges_verifies() -> None:
    """w = 0 and w = B (the whole row is the weight) both prove."""
    for x in ([0] * WDIM, [0] * (WDIM - 1) + [WBOUND]):
        verify(wstatement(), prove(wstatement(), encode_signed(x), 1))


def test_honest_prover_refuses_a_negative_weight() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        prove(wstatement(), encode_signed(weighted_row(-1)), 1)


@pytest.mark.parametrize("weight", [-1, -(WBOUND // 2)])
def test_negative_weight_with_the_squares_of_its_magnitude_is_refused(weight: int) -> None:
    """Cheat: small squares summing to |w| (the quadratic relation x_k = ||s||^2 fails)."""
    x = weighted_row(weight)
    with pytest.raises(InvalidProof, match="does not verify"):
        verify(wstatement(), forge_weight(x, norm.four_square_slack(-weight)))


def test_negative_weight_with_squares_wrapped_mod_r_is_refused() -> None:
    """Cheat: squares summing to w mod r (greedy from r + w: the first is ~2^127): the
    relation holds mod r, the projections give the huge square away."""
    x = weighted_row(-7)
    squares = norm.four_square_slack(-7 % group.ORDER)
    assert sum(a * a for a in squares) % group.ORDER == -7 % group.ORDER
    with pytest.raises(InvalidProof, match="too large"):
        verify(wstatement(), forge_weight(x, squares))


def test_negative_weight_wrapped_within_the_encoding_is_refused_by_the_bound_on_z() -> None:
    """Cheat: s = (a, b) with a^2 + b^2 = k r + w (Cornacchia on a prime): both ~2^128, so
    their projections fit the 17-byte encoding; only |z_i| <= Z stands in the way."""
    r, w = group.ORDER, -7
    k = 1
    while not ((k * r + w) % 4 == 1 and is_probable_prime(k * r + w)):
        k += 1
    a, b = _two_squares(k * r + w)
    assert (a * a + b * b - w) % r == 0 and max(a, b) < 1 << 132
    with pytest.raises(InvalidProof, match="too large"):
        verify(wstatement(), forge_weight(weighted_row(w), [a, b] + [0] * (norm.SLACK - 2)))


def test_a_proof_without_the_weight_part_is_refused_in_a_weighted_round() -> None:
    """Cheat: the unweighted proof of a negative-weight row (what passed before 10.7)."""
    x = weighted_row(-3)
    unweighted = prove(NormStatement(SID, 3, WDIM, BITS, WBOUND), encode_signed(x), 1)
    with pytest.raises(InvalidProof, match="bytes"):
        verify(wstatement(), unweighted)


def test_negative_weight_in_a_round_is_refused_named_and_left_out() -> None:
    """Through the wire to the real Server (as ``simulate``): client 2 masks a row whose
    weight cancels the others' and proves it with its weight's squares of |w|; it is named
    and the sum is the honest clients'. With weight_index unset (the round before 10.7) the
    same row's honest proof is accepted: the index is what makes the difference."""
    n = 4
    rows = {cid: encode_signed(weighted_row(100 * cid, cid)) for cid in range(1, n + 1)}
    evil = weighted_row(-(100 + 300 + 400) + 1, 2)

    def cheat(cid: int, parties: LocalRound, stream: MaskedStream) -> tuple[bytes, bool]:
        cfg = parties.server.config
        st_ = NormStatement(parties.server.session_id, cid, WDIM, BITS, WBOUND,
                            parties.server._advert_digests[cid], cfg.weight_index)
        q = norm.four_square_slack(WBOUND * WBOUND - sum(v * v for v in evil))
        squares = [] if cfg.weight_index is None else norm.four_square_slack(-evil[-1])
        stream._input[:] = encode_signed(evil)
        return norm.prove_relation(st_, evil + q + squares, 1), True

    config = Config(n, dim=WDIM, bits=BITS, norm_bound=WBOUND, weight_index=WDIM - 1)
    parties, refusals = run_round(config, rows, {2: cheat})
    result = parties.server.result
    assert result is not None and set(refusals) == {2} and set(result.refused) == {2}
    assert "weight_index=11" in result.refused[2]
    assert result.included == frozenset({1, 3, 4})
    assert np.array_equal(result.total, plain_sum(rows, {1, 3, 4}))
    # without the index the cheat is accepted and the summed weight is 1 (the attack)
    config = Config(n, dim=WDIM, bits=BITS, norm_bound=WBOUND)
    with pytest.raises(InputMismatch):  # the blinding of 1 is not its mask keys'
        run_round(config, rows, {2: cheat})


def test_a_client_refuses_its_own_negative_weight() -> None:
    config = Config(3, dim=WDIM, bits=BITS, norm_bound=WBOUND, weight_index=WDIM - 1)
    rows = {cid: encode_signed(weighted_row(cid)) for cid in (1, 2, 3)}
    rows[2] = encode_signed(weighted_row(-1))
    with pytest.raises(ValueError, match="negative weight"):
        simulate(config, rows)


@given(n=st.integers(3, 5), seed=st.integers(0, 2**16), drop=st.booleans())
@settings(max_examples=6, deadline=None)
def test_property_weighted_rounds_equal_the_rounds_without_validation(
        n: int, seed: int, drop: bool) -> None:
    rng = np.random.default_rng(seed)
    rows = {cid: encode_signed(weighted_row(int(rng.integers(0, WBOUND // 2)), seed + cid))
            for cid in range(1, n + 1)}
    drops = {n: Stage.MASKED_INPUT} if drop and n > 3 else {}
    plain = simulate(Config(n, dim=WDIM, bits=BITS), rows, drops, seed=seed)
    checked = simulate(Config(n, dim=WDIM, bits=BITS, norm_bound=WBOUND,
                              weight_index=WDIM - 1), rows, drops, seed=seed)
    assert checked.refused == {} and checked.included == plain.included
    assert np.array_equal(checked.total, plain.total)
