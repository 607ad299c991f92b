"""One test per lesson of docs/architecture.md section 8: what Flower's SecAgg+ and Google's fcp get
wrong, shown not to happen here, and what they get right, shown to hold."""

from __future__ import annotations

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from secagg import Client, Config, ProtocolAbort, Server, Stage, required_bits, simulate
from secagg.crypto import (
    KeyPair,
    dtype_for_bits,
    hkdf,
    pair_label,
    pairwise_mask_key,
    self_mask_key,
)
from secagg.messages import Ciphertexts, KeyList, MaskedInput, decode, encode
from secagg.shamir import PRIME, SHARE_BYTES, reconstruct, split


def _inputs(n: int, dim: int, bits: int, seed: int = 0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {i: rng.integers(0, 2**bits, dim, dtype=np.uint64) for i in range(1, n + 1)}


def _exact_sum(inputs: dict[int, np.ndarray], ids: frozenset[int], bits: int) -> np.ndarray:
    total = [0] * len(next(iter(inputs.values())))
    for cid in ids:
        total = [a + int(b) for a, b in zip(total, inputs[cid], strict=True)]
    return np.array([v % (1 << bits) for v in total], dtype=np.uint64)


def _round_to_masked_input(config: Config, n: int, dim: int) -> tuple[
        dict[int, Client], dict[int, MaskedInput], dict[int, np.ndarray]]:
    inputs = _inputs(n, dim, config.bits)
    server = Server(config, context=b"lessons")
    clients = {i: Client(config, i, v, context=b"lessons") for i, v in inputs.items()}
    for cid, client in clients.items():
        server.receive(cid, encode(client.advertise()))
    for cid, msg in server.advance().items():
        server.receive(cid, encode(clients[cid].handle(encode(msg))))
    masked = {}
    for cid, msg in server.advance().items():
        reply = clients[cid].handle(encode(msg))
        assert isinstance(reply, MaskedInput)
        masked[cid] = reply
    return clients, masked, inputs


def test_masks_are_aes_ctr_keystream_of_a_128_bit_key_not_mersenne_twister() -> None:
    """Flower expands masks with numpy's MT19937 from a 32-bit seed. Here the mask of a
    client is exactly AES-128-CTR keystream under HKDF-derived 128-bit keys (the X25519
    security level), from 256-bit secrets."""
    config = Config(num_clients=3, threshold=2, dim=64, bits=32)
    clients, masked, inputs = _round_to_masked_input(config, 3, 64)
    client = clients[1]
    session = client.session_id

    def keystream(key: bytes) -> np.ndarray:
        assert len(key) == 16
        enc = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
        return np.frombuffer(enc.update(bytes(64 * 4)), dtype="<u4")

    seed = bytes(client._secrets.seed)  # white-box: the self-mask seed the client committed to
    expected = inputs[1].astype(np.uint32) + keystream(
        self_mask_key(seed, session, 1, config.shape_tag))
    own = client.advertise().masking_key
    for peer in (2, 3):
        peer_pk = clients[peer].advertise().masking_key
        secrets = clients[1]._secrets
        secret = KeyPair(secrets.key(secrets.masking)).exchange(peer_pk)
        key = pairwise_mask_key(secret, session, 1, peer, own, peer_pk, config.shape_tag)
        expected = expected + keystream(key)  # client 1 < peer: +mask
    assert np.array_equal(masked[1].vector(), expected.astype(np.uint32))


def test_masked_input_looks_uniform_not_like_the_input() -> None:
    config = Config(num_clients=3, threshold=2, dim=20_000, bits=16)
    zero_inputs = {i: np.zeros(20_000, dtype=np.uint64) for i in (1, 2, 3)}
    server = Server(config, context=b"u")
    clients = {i: Client(config, i, v, context=b"u") for i, v in zero_inputs.items()}
    for cid, client in clients.items():
        server.receive(cid, encode(client.advertise()))
    for cid, msg in server.advance().items():
        server.receive(cid, encode(clients[cid].handle(encode(msg))))
    reply = clients[1].handle(encode(server.advance()[1]))
    assert isinstance(reply, MaskedInput)
    counts = np.bincount(reply.vector() >> 12, minlength=16)  # 16 buckets of the top bits
    expected = 20_000 / 16
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # 15 degrees of freedom, fresh keys every run: P[chi2 > 80] = 7e-11 for a uniform mask
    # (the former bound 50 failed a correct one once in 83,000 runs); the input itself
    # (all zero) gives 300,000
    assert chi2 < 80.0


def test_unmask_request_naming_a_peer_alive_and_dropped_aborts() -> None:
    """Flower never checks that the alive and dropped lists are disjoint, so a server gets
    both shares of one client and recovers its update exactly."""
    config = Config(num_clients=4, threshold=3, dim=8, bits=32)
    inputs = _inputs(4, 8, 32)
    server = Server(config, context=b"both")
    clients = {i: Client(config, i, v, context=b"both") for i, v in inputs.items()}
    for cid, client in clients.items():
        server.receive(cid, encode(client.advertise()))
    for _ in range(2):
        for cid, msg in server.advance().items():
            server.receive(cid, encode(clients[cid].handle(encode(msg))))
    request = server.advance()[1]
    evil = type(request)(request.session_id, 1, request.survivors, (2,), {})
    with pytest.raises(ProtocolAbort, match="both survived and dropped"):
        clients[1].handle(encode(evil))
    assert clients[1].revealed == {}


def test_client_dropping_before_masked_input_does_not_abort_the_round() -> None:
    """Flower aborts the whole round when a client drops before masked_input."""
    config = Config(num_clients=6, threshold=4, dim=32, bits=32)
    inputs = _inputs(6, 32, 32)
    result = simulate(config, inputs, drop={2: Stage.ADVERTISE_KEYS, 5: Stage.SHARE_KEYS},
                      seed=1)
    assert result.included == frozenset({1, 3, 4, 6})
    assert np.array_equal(result.total, _exact_sum(inputs, result.included, 32))


def test_sums_do_not_wrap_silently_past_1000_clients() -> None:
    """Flower's fixed modulus wraps the sum past ~1000 clients without a word. Here the
    modulus is chosen for the inputs (``required_bits``) and the sum is the exact integer
    sum; with too few bits the wrap is the documented modular sum, never a surprise."""
    assert required_bits(1500, 2**20 - 1) == 31
    assert required_bits(1500, 2**20 - 1) > 20 + 10  # log2(1500) > 10
    with pytest.raises(ValueError, match="scale the inputs down"):
        required_bits(2**10, 2**60)
    n, top = 12, 2**16 - 1
    inputs = {i: np.full(16, top, dtype=np.uint64) for i in range(1, n + 1)}
    bits = required_bits(n, top)
    result = simulate(Config(num_clients=n, dim=16, bits=bits), inputs, seed=2)
    assert result.total.tolist() == [n * top] * 16  # exact, not reduced
    wrapped = simulate(Config(num_clients=n, dim=16, bits=16), inputs, seed=2)
    assert wrapped.total.tolist() == [(n * top) % 2**16] * 16


def test_shamir_shares_a_raw_32_byte_key_in_one_prime_field_element() -> None:
    """Flower shares a whole PEM key with GF(2^128) Shamir. Here the 32-byte X25519 key is
    one element of GF(2^256 + 297), each share is 33 bytes."""
    assert PRIME > 2**256 and PRIME - 2**256 == 297
    secret = bytes(range(32))
    shares = split(secret, [5, 9, 12, 40], 3)
    assert all(len(s) == SHARE_BYTES == 33 for s in shares.values())
    assert reconstruct({9: shares[9], 12: shares[12], 40: shares[40]}, 3) == secret


def test_session_id_is_derived_by_each_party_and_not_sent_by_the_server() -> None:
    """fcp trusts a server-sent session id. Here both sides derive it from config, roster
    and context; a server with another context cannot talk to the clients."""
    config = Config(num_clients=3, threshold=2, dim=4, bits=32)
    a = Client(config, 1, np.zeros(4, dtype=np.uint64), context=b"round-7|model-abc")
    b = Server(config, context=b"round-7|model-abc")
    c = Server(config, context=b"round-7|model-EVIL")
    assert a.session_id == b.session_id != c.session_id
    other = Client(config, 2, np.zeros(4, dtype=np.uint64), context=b"round-7|model-EVIL")
    c.receive(2, encode(other.advertise()))
    foreign = KeyList(c.session_id, 1, {})
    with pytest.raises(ProtocolAbort, match="another session"):
        a.handle(encode(foreign))


def test_share_ciphertexts_bind_session_stage_and_both_ids_as_associated_data() -> None:
    """fcp uses no AEAD associated data. Here a ciphertext moved to another recipient or
    presented as another sender's fails its tag and the client aborts."""
    config = Config(num_clients=4, threshold=3, dim=4, bits=32)
    inputs = _inputs(4, 4, 32)
    server = Server(config, context=b"ad")
    clients = {i: Client(config, i, v, context=b"ad") for i, v in inputs.items()}
    for cid, client in clients.items():
        server.receive(cid, encode(client.advertise()))
    for cid, msg in server.advance().items():
        server.receive(cid, encode(clients[cid].handle(encode(msg))))
    forwarded = server.advance()
    to_one = forwarded[1]
    assert isinstance(to_one, Ciphertexts)
    swapped = dict(to_one.ciphertexts)
    swapped[2], swapped[3] = swapped[3], swapped[2]  # sender labels exchanged
    with pytest.raises(ProtocolAbort, match="AEAD"):
        clients[1].handle(encode(Ciphertexts(to_one.session_id, 1, swapped)))
    label = pair_label(b"share-ciphertext", to_one.session_id, Stage.SHARE_KEYS, 2, 1)
    assert to_one.session_id in label and label.endswith(b"\x00\x00\x00\x02|\x00\x00\x00\x01")


def test_malicious_mode_has_a_signed_consistency_round() -> None:
    """fcp has no signature round; malicious mode here signs advertisements and the
    survivor list, and the client checks t signatures before it unmasks."""
    config = Config(num_clients=5, threshold=4, dim=8, bits=32, security="malicious")
    inputs = _inputs(5, 8, 32)
    result = simulate(config, inputs, drop={5: Stage.CONSISTENCY_CHECK}, seed=3)
    assert result.included == frozenset({1, 2, 3, 4, 5})
    assert "consistency_check" in result.seconds
    assert np.array_equal(result.total, _exact_sum(inputs, result.included, 32))


def test_masks_bind_the_session_and_the_vector_shape() -> None:
    """What fcp does well: a mask key for one session or shape is useless for another."""
    secret = hkdf(b"k" * 32, b"s" * 32, b"x")
    args = (secret, b"s" * 32, 1, 2, b"p" * 32, b"q" * 32)
    base = pairwise_mask_key(*args, Config(num_clients=2, dim=10, bits=32).shape_tag)
    assert base != pairwise_mask_key(*args, Config(num_clients=2, dim=11, bits=32).shape_tag)
    assert base != pairwise_mask_key(*args, Config(num_clients=2, dim=10, bits=31).shape_tag)
    other_session = (secret, b"t" * 32, 1, 2, b"p" * 32, b"q" * 32)
    assert base != pairwise_mask_key(*other_session,
                                     Config(num_clients=2, dim=10, bits=32).shape_tag)
    # symmetric in the pair, so both ends derive the same mask
    assert base == pairwise_mask_key(secret, b"s" * 32, 2, 1, b"q" * 32, b"p" * 32,
                                     Config(num_clients=2, dim=10, bits=32).shape_tag)


def test_masked_vector_width_follows_bits() -> None:
    for bits, width in ((8, 1), (9, 2), (16, 2), (17, 4), (32, 4), (33, 8), (64, 8)):
        assert dtype_for_bits(bits).itemsize == width
    config = Config(num_clients=3, threshold=2, dim=10, bits=12)
    _, masked, _ = _round_to_masked_input(config, 3, 10)
    wire = decode(encode(masked[1]))
    assert isinstance(wire, MaskedInput) and len(wire.masked) == 20
    assert int(wire.vector().max()) < 2**12
