"""Known-answer and property tests of the primitives: X25519, HKDF, AES-CTR masks, Ed25519,
the small-order blacklist, Shamir over GF(2^256 + 297), Harary graphs and the SecAgg+
parameter finder. Oracles are independent: published vectors, AES-ECB counter blocks,
pure-Python Lagrange interpolation, a hand-written BFS and scipy's hypergeometric law."""

from __future__ import annotations

import itertools
import math
import os
import random
from collections import deque
from collections.abc import Iterable, Mapping

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from harness import SMALL_ORDER_POINTS
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import hypergeom

from secagg import Config, secagg_plus_parameters
from secagg import shamir as shamir_module
from secagg.crypto import (
    CryptoError,
    KeyPair,
    Masker,
    SigningKey,
    check_public_key,
    dtype_for_bits,
    hkdf,
    is_small_order,
    verify_signature,
)
from secagg.graph import CORRECTNESS_BITS, SECURITY_BITS, Graph, harary_neighbors
from secagg.shamir import (
    PRIME,
    SHARE_BYTES,
    ShamirError,
    decode_share,
    evaluate_at,
    lagrange_weights,
    reconstruct,
    reconstruct_value,
    split,
    split_many,
)

# =============================================================================================
# X25519 (RFC 7748)
# =============================================================================================

RFC7748_5_2 = [
    ("a546e36bf0527c9d3b16154b82465edd62144c0ac1fc5a18506a2244ba449ac4",
     "e6db6867583030db3594c1a424b15f7c726624ec26b3353b10a903a6d0ab1c4c",
     "c3da55379de9c6908e94ea4df28d084f32eccf03491c71f754b4075577a28552"),
    ("4b66e9d4d1b4673c5ad22691957d6af5c11b6421e0ea01d42ca4169e7918ba0d",
     "e5210f12786811d3f4b7959d0538ae2c31dbe7106fc03c3efc4cd549c715a493",
     "95cbde9476e8907d7aade45cb4b873f88b595a68799fa152e6f8f7647aac7957"),
]


@pytest.mark.parametrize(("scalar", "u", "out"), RFC7748_5_2)
def test_x25519_rfc7748_section_5_2(scalar: str, u: str, out: str) -> None:
    """RFC 7748 masks bit 255 on receipt. The protocol instead refuses non-canonical
    encodings (one point, one encoding: duplicate-key checks compare bytes), so the
    vector's u is presented with bit 255 cleared, which RFC 7748 defines as the same u."""
    pair = KeyPair.from_private_bytes(bytes.fromhex(scalar))
    raw = bytearray.fromhex(u)
    if raw[31] & 0x80:
        with pytest.raises(CryptoError, match="canonical"):
            pair.exchange(bytes(raw))
        raw[31] &= 0x7F
    assert pair.exchange(bytes(raw)).hex() == out


def test_x25519_rfc7748_section_5_2_iterated() -> None:
    k = u = (9).to_bytes(32, "little")
    results = {}
    for i in range(1, 1001):
        k, u = KeyPair.from_private_bytes(k).exchange(u), k
        if i in (1, 1000):
            results[i] = k.hex()
    assert results[1] == "422c8e7a6227d7bca1350b3e2bb7279f7897b87bb6854b783c60e80311ae3079"
    assert results[1000] == "684cf59ba83309552800ef566f2f4d3c1c3887c49360e3875f2eb94d99532c51"


def test_x25519_rfc7748_section_6_1() -> None:
    alice = KeyPair.from_private_bytes(bytes.fromhex(
        "77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a"))
    bob = KeyPair.from_private_bytes(bytes.fromhex(
        "5dab087e624a8a4b79e17f8b83800ee66f3bb1292618b6fd1c2f8b27ff88e0eb"))
    assert alice.public.hex() == (
        "8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a")
    assert bob.public.hex() == (
        "de9edb7d7b7dc1b4d35b61c2ece435373f8343c85b78674dadfc7e146f882b4f")
    shared = "4a5d9d5ba4ce2de1728e3bf480350f25e07e21c947d19e3376f09b3c1e161742"
    assert alice.exchange(bob.public).hex() == shared
    assert bob.exchange(alice.public).hex() == shared
    assert KeyPair.from_private_bytes(alice.private_bytes()).public == alice.public


def test_fresh_key_pairs_differ_and_agree() -> None:
    a, b = KeyPair(), KeyPair()
    assert a.public != b.public
    assert a.exchange(b.public) == b.exchange(a.public)


# =============================================================================================
# small-order points (libsodium's blacklist)
# =============================================================================================


@pytest.mark.parametrize("point", SMALL_ORDER_POINTS, ids=lambda p: p.hex()[:8])
def test_small_order_points_rejected(point: bytes) -> None:
    assert is_small_order(point)
    with pytest.raises(CryptoError):
        check_public_key(point)
    with pytest.raises(CryptoError):
        KeyPair().exchange(point)
    high = point[:31] + bytes([point[31] | 0x80])  # bit 255 is ignored by X25519
    with pytest.raises(CryptoError):
        check_public_key(high)


@pytest.mark.parametrize("point", SMALL_ORDER_POINTS, ids=lambda p: p.hex()[:8])
def test_blacklist_points_really_have_small_order(point: bytes) -> None:
    """Independent check of the list: any clamped scalar (a multiple of 8) times a point of
    order dividing 8 is the identity, which ``cryptography`` reports as an all-zero secret."""
    for _ in range(3):
        with pytest.raises(ValueError):
            X25519PrivateKey.generate().exchange(X25519PublicKey.from_public_bytes(point))


def test_blacklist_is_exactly_seven_distinct_encodings() -> None:
    assert len(set(SMALL_ORDER_POINTS)) == 7
    p = 2**255 - 19
    values = {int.from_bytes(e, "little") for e in SMALL_ORDER_POINTS}
    assert {0, 1, p - 1, p, p + 1} <= values


@pytest.mark.parametrize("bad", [b"", b"\x09" * 31, b"\x09" * 33, "x" * 32, bytearray(32)])
def test_malformed_public_key_rejected(bad: object) -> None:
    with pytest.raises(CryptoError):
        check_public_key(bad)  # type: ignore[arg-type]


def test_ordinary_public_keys_accepted() -> None:
    for _ in range(50):
        check_public_key(KeyPair().public)
    assert not is_small_order((9).to_bytes(32, "little"))


# =============================================================================================
# HKDF-SHA256 (RFC 5869)
# =============================================================================================


def test_hkdf_rfc5869_test_case_1() -> None:
    okm = hkdf(bytes.fromhex("0b" * 22), bytes.fromhex("000102030405060708090a0b0c"),
               bytes.fromhex("f0f1f2f3f4f5f6f7f8f9"), 42)
    assert okm.hex() == ("3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf"
                         "34007208d5b887185865")


def test_hkdf_rfc5869_test_case_3_empty_salt_and_info() -> None:
    okm = hkdf(bytes.fromhex("0b" * 22), b"", b"", 42)
    assert okm.hex() == ("8da4e775a563c18f715f802a063c5a31b8a11f5c5ee1879ec3454e5f3c738d2d"
                         "9d201395faa4b61a96c8")


# =============================================================================================
# AES-256-CTR masks (NIST SP 800-38A F.5.5)
# =============================================================================================

NIST_KEY = bytes.fromhex("603deb1015ca71be2b73aef0857d77811f352c073b6108d72d9810a30914dff4")
NIST_IV = bytes.fromhex("f0f1f2f3f4f5f6f7f8f9fafbfcfdfeff")
NIST_PLAIN = bytes.fromhex(
    "6bc1bee22e409f96e93d7e117393172aae2d8a571e03ac9c9eb76fac45af8e51"
    "30c81c46a35ce411e5fbc1191a0a52eff69f2445df4f9b17ad2b417be66c3710")
NIST_CIPHER = bytes.fromhex(
    "601ec313775789a5b7a7f504bbf3d228f443e3ca4d62b59aca84e990cacaf5c5"
    "2b0930daa23de94ce87017ba2d84988ddfc9c58db67aada613c2dd08457941a6")


def ecb_ctr_keystream(key: bytes, iv: bytes, nbytes: int) -> bytes:
    """An independent AES-CTR: AES-ECB of the big-endian 128-bit counter blocks."""
    ecb = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
    start = int.from_bytes(iv, "big")
    blocks = b"".join(((start + i) % (1 << 128)).to_bytes(16, "big")
                      for i in range(-(-nbytes // 16)))
    return (ecb.update(blocks) + ecb.finalize())[:nbytes]


def test_aes256_ctr_nist_sp800_38a_f55() -> None:
    stream = ecb_ctr_keystream(NIST_KEY, NIST_IV, len(NIST_PLAIN))
    assert bytes(a ^ b for a, b in zip(NIST_PLAIN, stream, strict=True)) == NIST_CIPHER
    ctr = Cipher(algorithms.AES(NIST_KEY), modes.CTR(NIST_IV)).encryptor()
    assert ctr.update(NIST_PLAIN) + ctr.finalize() == NIST_CIPHER


@pytest.mark.parametrize("bits", [8, 12, 16, 31, 32, 33, 64])
@pytest.mark.parametrize("dim", [1, 7, 16, 1000])
def test_masker_keystream_is_aes_ctr_from_zero_counter(bits: int, dim: int) -> None:
    masker = Masker(dim, bits)
    width = dtype_for_bits(bits).itemsize
    assert width == {8: 1, 12: 2, 16: 2, 31: 4, 32: 4, 33: 8, 64: 8}[bits]
    stream = masker.keystream(NIST_KEY)
    assert stream.dtype == np.dtype(f"<u{width}") and stream.shape == (dim,)
    expected = np.frombuffer(ecb_ctr_keystream(NIST_KEY, bytes(16), dim * width),
                             dtype=f"<u{width}")
    assert np.array_equal(stream, expected)
    other = masker.keystream(bytes(32)).copy()
    assert not np.array_equal(other, expected) or dim == 1


@pytest.mark.parametrize("bits", [8, 16, 32, 64])
def test_masker_add_subtract_wrap_modulo_width(bits: int) -> None:
    dim = 257
    masker = Masker(dim, bits)
    key = os.urandom(32)
    x = np.arange(dim, dtype=masker.dtype)
    y = x.copy()
    masker.add(y, key)
    mask = [int(v) for v in masker.keystream(key)]
    assert [int(v) for v in y] == [(i + m) % (1 << (8 * masker.dtype.itemsize))
                                   for i, m in enumerate(mask)]
    masker.subtract(y, key)
    assert np.array_equal(x, y)


@pytest.mark.parametrize("bits", [8, 16, 32, 64])
def test_masker_keystream_is_uniform(bits: int) -> None:
    """Every bit of every lane is a fair coin (5 sigma), and bytes pass a chi-square test.
    A fixed key per width: with a fresh random key the 120 bit tests and 4 chi-square tests
    would fail a correct keystream about once in 14,000 runs."""
    dim = 1 << 15 if bits <= 16 else 1 << 13
    stream = Masker(dim, bits).keystream(bytes([bits]) * 32).copy()
    width = 8 * stream.dtype.itemsize
    as_int = stream.astype(np.uint64)
    for bit in range(width):
        ones = int(((as_int >> np.uint64(bit)) & np.uint64(1)).sum())
        assert abs(ones - dim / 2) < 5 * math.sqrt(dim / 4), (bit, ones)
    from scipy.stats import chisquare

    counts = np.bincount(np.frombuffer(stream.tobytes(), dtype=np.uint8), minlength=256)
    assert chisquare(counts).pvalue > 1e-6


# =============================================================================================
# Ed25519 (RFC 8032 section 7.1, test 1)
# =============================================================================================

ED_SECRET = bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")
ED_PUBLIC = bytes.fromhex("d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a")
ED_SIGNATURE = bytes.fromhex(
    "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e"
    "39701cf9b46bd25bf5f0595bbe24655141438e7a100b")


def test_ed25519_rfc8032_test_1() -> None:
    key = SigningKey(Ed25519PrivateKey.from_private_bytes(ED_SECRET))
    assert key.public == ED_PUBLIC
    assert key.sign(b"") == ED_SIGNATURE
    verify_signature(ED_PUBLIC, ED_SIGNATURE, b"")  # raises unless valid


@pytest.mark.parametrize("how", ["flip_sig", "flip_key", "message", "short_sig", "long_sig",
                                 "short_key", "empty_sig", "zero_key", "other_key"])
def test_ed25519_verification_fails_closed(how: str) -> None:
    sig, key, msg = ED_SIGNATURE, ED_PUBLIC, b""
    if how == "flip_sig":
        sig = sig[:10] + bytes([sig[10] ^ 1]) + sig[11:]
    elif how == "flip_key":
        key = key[:5] + bytes([key[5] ^ 4]) + key[6:]
    elif how == "message":
        msg = b"\x00"
    elif how == "short_sig":
        sig = sig[:63]
    elif how == "long_sig":
        sig = sig + b"\x00"
    elif how == "short_key":
        key = key[:31]
    elif how == "empty_sig":
        sig = b""
    elif how == "zero_key":
        key = bytes(32)
    else:
        key = SigningKey.generate().public
    with pytest.raises(CryptoError):
        verify_signature(key, sig, msg)


# =============================================================================================
# Shamir secret sharing over GF(2^256 + 297)
# =============================================================================================


def is_probable_prime(n: int) -> bool:
    if n < 2:
        return False
    small = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71]
    for p in small:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def oracle_interpolate(points: Mapping[int, int], at: int) -> int:
    """Lagrange interpolation mod PRIME, independently: Fermat inverses, no caching."""
    total = 0
    for xi, yi in points.items():
        num, den = 1, 1
        for xj in points:
            if xj != xi:
                num = num * (at - xj) % PRIME
                den = den * (xi - xj) % PRIME
        total = (total + yi * num * pow(den, PRIME - 2, PRIME)) % PRIME
    return total


def shares_as_ints(shares: Mapping[int, bytes]) -> dict[int, int]:
    return {x: int.from_bytes(s, "big") for x, s in shares.items()}


def test_field_is_the_smallest_prime_above_2_256() -> None:
    assert PRIME == (1 << 256) + 297
    assert is_probable_prime(PRIME)
    assert not any(is_probable_prime(c) for c in range((1 << 256) + 1, PRIME))
    assert SHARE_BYTES == 33 and PRIME < 1 << (8 * SHARE_BYTES)


@pytest.mark.parametrize(("holders", "t"), [(n, t) for n in range(1, 7) for t in range(1, n + 1)])
def test_reconstruction_from_every_threshold_subset(holders: int, t: int) -> None:
    ids = [3 * i + 1 for i in range(holders)]
    secret = os.urandom(32)
    shares = split(secret, ids, t)
    assert set(shares) == set(ids)
    assert all(len(s) == SHARE_BYTES for s in shares.values())
    for size in range(t, holders + 1):
        for subset in itertools.combinations(ids, size):
            assert reconstruct({x: shares[x] for x in subset}, t) == secret
            points = {x: shares_as_ints(shares)[x] for x in subset[:t]}
            assert oracle_interpolate(points, 0) == int.from_bytes(secret, "big")
    for subset in itertools.combinations(ids, t - 1):
        with pytest.raises(ShamirError):
            reconstruct({x: shares[x] for x in subset}, t)


@pytest.mark.parametrize(("holders", "t"), [(3, 2), (5, 3), (7, 5), (10, 4)])
def test_fewer_than_threshold_shares_are_consistent_with_every_secret(holders: int,
                                                                      t: int) -> None:
    """Perfect hiding: for t - 1 shares and any two secrets there are degree < t polynomials
    through those shares with either secret (one each), so the shares rule nothing out."""
    ids = list(range(1, holders + 1))
    secret = os.urandom(32)
    shares = shares_as_ints(split(secret, ids, t))
    seen = dict(list(shares.items())[: t - 1])
    for other in (int.from_bytes(secret, "big"), 0, (1 << 256) - 1,
                  int.from_bytes(os.urandom(32), "big")):
        points = {0: other, **seen}  # t points fix one polynomial of degree < t
        for x, y in seen.items():
            assert oracle_interpolate(points, x) == y
        assert oracle_interpolate(points, 0) == other
        # and it is a genuine degree < t polynomial: any t of its points give it back
        extra = {x: oracle_interpolate(points, x) for x in ids}
        subset = dict(list(extra.items())[-t:])
        assert oracle_interpolate(subset, 0) == other


@settings(max_examples=60, deadline=None)
@given(holders=st.sets(st.integers(1, (1 << 32) - 1), min_size=1, max_size=40),
       data=st.data(), secret=st.binary(min_size=32, max_size=32))
def test_shamir_property_any_threshold_subset(holders: set[int], data: st.DataObject,
                                              secret: bytes) -> None:
    ids = sorted(holders)
    t = data.draw(st.integers(1, len(ids)))
    shares = split(secret, ids, t)
    subset = data.draw(st.permutations(ids)).copy()[:t]
    points = {x: shares_as_ints(shares)[x] for x in subset}
    assert reconstruct({x: shares[x] for x in subset}, t) == secret
    assert oracle_interpolate(points, 0) == int.from_bytes(secret, "big")
    # every share lies on the polynomial the subset defines
    for x in ids:
        assert oracle_interpolate(points, x) == shares_as_ints(shares)[x]
        assert evaluate_at(points, tuple(subset), x) == shares_as_ints(shares)[x]
    weights = lagrange_weights(tuple(sorted(subset)))
    assert sum(w * points[x] for w, x in zip(weights, sorted(subset), strict=True)) % PRIME \
        == int.from_bytes(secret, "big")


@settings(max_examples=40, deadline=None)
@given(holders=st.integers(1, 40), data=st.data())
def test_shamir_limb_evaluation_matches_naive_polynomials(holders: int,
                                                          data: st.DataObject) -> None:
    """The BLAS limb arithmetic behind ``split_many`` against big-int evaluation, including
    the extreme coefficient p - 1 and ids near 2^32 (the largest limb products)."""
    ids = tuple(data.draw(st.lists(st.integers(1, (1 << 32) - 1), min_size=holders,
                                   max_size=holders, unique=True)))
    t = data.draw(st.integers(1, holders))
    element = st.one_of(st.integers(0, PRIME - 1), st.sampled_from([0, 1, PRIME - 1]))
    coefficients = [[data.draw(element) for _ in range(t)] for _ in range(2)]
    got = shamir_module._evaluate_all(coefficients, ids)
    naive = [[sum(c * pow(x, j, PRIME) for j, c in enumerate(cs)) % PRIME for x in ids]
             for cs in coefficients]
    assert got == naive


def test_shamir_limb_evaluation_worst_case() -> None:
    ids = tuple(range((1 << 32) - 64, 1 << 32))
    coefficients = [[PRIME - 1] * 64, [PRIME - 1 - i for i in range(64)]]
    naive = [[sum(c * pow(x, j, PRIME) for j, c in enumerate(cs)) % PRIME for x in ids]
             for cs in coefficients]
    assert shamir_module._evaluate_all(coefficients, ids) == naive


def test_shamir_large_holder_set_and_extreme_secrets() -> None:
    ids = list(range((1 << 32) - 200, 1 << 32))
    secrets = [bytes(32), b"\xff" * 32, os.urandom(32)]
    for secret, shares in zip(secrets, split_many(secrets, ids, 150), strict=True):
        sample = random.Random(1).sample(ids, 150)
        assert reconstruct({x: shares[x] for x in sample}, 150) == secret


@pytest.mark.parametrize(("holders", "t", "secret"), [
    ([1, 1, 2], 2, bytes(32)), ([0, 1, 2], 2, bytes(32)), ([-1, 1, 2], 2, bytes(32)),
    ([1, 2, 3], 0, bytes(32)), ([1, 2, 3], 4, bytes(32)), ([1, 2, 3], 2, bytes(31)),
    ([1, 2, 3], 2, bytes(33)), ([PRIME, 2], 1, bytes(32))])
def test_shamir_rejects_bad_parameters(holders: list[int], t: int, secret: bytes) -> None:
    with pytest.raises(ShamirError):
        split(secret, holders, t)


def test_shamir_share_decoding_and_inconsistent_shares() -> None:
    with pytest.raises(ShamirError):
        decode_share(PRIME.to_bytes(SHARE_BYTES, "big"))
    with pytest.raises(ShamirError):
        decode_share(b"\x00" * 32)
    assert decode_share((PRIME - 1).to_bytes(SHARE_BYTES, "big")) == PRIME - 1
    shares = split(os.urandom(32), [1, 2, 3], 2)
    bad = dict(shares)
    # find a tampered share that makes f(0) leave the 32-byte range: reconstruct refuses it
    for delta in range(1, 10_000):
        bad[2] = ((int.from_bytes(shares[2], "big") + delta) % PRIME).to_bytes(SHARE_BYTES,
                                                                                 "big")
        if reconstruct_value(shares_as_ints({1: bad[1], 2: bad[2]}), 2) >= 1 << 256:
            with pytest.raises(ShamirError):
                reconstruct({1: bad[1], 2: bad[2]}, 2)
            break


# =============================================================================================
# Harary graphs (Bell et al. 2020)
# =============================================================================================


def adjacency(n: int, degree: int) -> dict[int, set[int]]:
    return {p: set(harary_neighbors(p, degree, n)) for p in range(n)}


def connected(adj: Mapping[int, Iterable[int]], removed: Iterable[int] = ()) -> bool:
    gone = set(removed)
    alive = [v for v in adj if v not in gone]
    if not alive:
        return True
    seen = {alive[0]}
    queue = deque([alive[0]])
    while queue:
        v = queue.popleft()
        for w in adj[v]:
            if w not in gone and w not in seen:
                seen.add(w)
                queue.append(w)
    return len(seen) == len(alive)


CASES = [(n, d) for n in range(3, 12) for d in range(2, n)]


@pytest.mark.parametrize(("n", "degree"), CASES)
def test_harary_graph_symmetric_with_harary_degrees(n: int, degree: int) -> None:
    adj = adjacency(n, degree)
    for v, ws in adj.items():
        assert v not in ws
        for w in ws:
            assert v in adj[w], (v, w)
    degrees = sorted(len(ws) for ws in adj.values())
    if degree >= n - 1:
        assert degrees == [n - 1] * n
    elif degree % 2 == 1 and n % 2 == 1:
        assert degrees == [degree] * (n - 1) + [degree + 1]  # Harary 1962
    else:
        assert degrees == [degree] * n
    assert len({frozenset((v, w)) for v, ws in adj.items() for w in ws}) == \
        math.ceil(degree * n / 2) if degree < n - 1 else n * (n - 1) // 2


@pytest.mark.parametrize(("n", "degree"), CASES)
def test_harary_graph_is_degree_connected(n: int, degree: int) -> None:
    """H(d, n) stays connected after removing any d - 1 vertices, and (d < n - 1) some d
    vertices disconnect it: its connectivity is exactly d."""
    adj = adjacency(n, degree)
    assert connected(adj)
    for removed in itertools.combinations(range(n), min(degree, n) - 1):
        assert connected(adj, removed), removed
    if degree < n - 1:
        v = min(adj, key=lambda u: len(adj[u]))
        assert len(adj[v]) == degree and not connected(adj, adj[v])


@pytest.mark.parametrize(("n", "k"), [(5, 3), (6, 4), (7, 4), (9, 5), (12, 6), (40, 9)])
def test_session_graph_closed_neighbourhoods(n: int, k: int) -> None:
    graph = Graph(tuple(range(101, 101 + n)), k, os.urandom(32))
    hoods = {c: graph.closed_neighborhood(c) for c in graph.clients}
    sizes = sorted(len(h) for h in hoods.values())
    assert all(c in h for c, h in hoods.items())
    for c, h in hoods.items():
        for other in h:
            assert c in hoods[other]
    extra = 1 if (k - 1) % 2 == 1 and n % 2 == 1 else 0
    assert sizes == [k] * (n - extra) + [k + 1] * extra
    adj = {c: h - {c} for c, h in hoods.items()}
    assert connected(adj)
    assert graph.min_holders() == k


def test_session_graph_relabelling_depends_on_seed_only() -> None:
    clients = tuple(range(1, 31))
    a = Graph(clients, 5, b"\x01" * 32)
    b = Graph(tuple(reversed(clients)), 5, b"\x01" * 32)
    c = Graph(clients, 5, b"\x02" * 32)
    hood = {x: a.closed_neighborhood(x) for x in clients}
    assert hood == {x: b.closed_neighborhood(x) for x in clients}
    assert hood != {x: c.closed_neighborhood(x) for x in clients}


def test_session_graph_relabelling_is_uniform() -> None:
    from scipy.stats import chisquare

    from secagg.graph import _keystream_permutation

    counts: dict[tuple[int, ...], int] = {}
    for i in range(6000):
        perm = tuple(_keystream_permutation(i.to_bytes(32, "big"), 4))
        counts[perm] = counts.get(perm, 0) + 1
    assert len(counts) == 24
    assert chisquare(list(counts.values())).pvalue > 1e-6


def test_complete_graph_is_everyone() -> None:
    graph = Graph((4, 8, 15, 16, 23), None, bytes(32))
    assert graph.is_complete
    assert all(graph.closed_neighborhood(c) == frozenset(graph.clients) for c in graph.clients)


# =============================================================================================
# SecAgg+ parameter finder (Bell et al. 2020)
# =============================================================================================

RATES = [(0.1, 0.1), (0.05, 0.05), (0.1, 0.3), (0.2, 0.2), (0.3, 0.1), (0.0, 0.0)]
SIZES = [10, 50, 100, 500, 1000, 5000]


def _bounds(n: int, k: int, t: int, dropout: float, corrupt: float) -> dict[str, float]:
    degree = k - 1
    bad = math.floor(corrupt * n + 1e-9)
    alive = math.ceil((1 - dropout) * n - 1e-9)
    corrupt_law = hypergeom(n, bad, degree)
    alive_law = hypergeom(n, alive, degree)
    return {"corrupt_ge_t": float(corrupt_law.sf(t - 1)),
            "corrupt_ge_2t_minus_k": float(corrupt_law.sf(2 * t - k - 1)),
            "alive_lt_t": float(alive_law.cdf(t - 1))}


@pytest.mark.parametrize("security", ["semi-honest", "malicious"])
@pytest.mark.parametrize(("dropout", "corrupt"), RATES)
@pytest.mark.parametrize("n", SIZES)
def test_secagg_plus_parameters_meet_the_bounds(n: int, dropout: float, corrupt: float,
                                                security: str) -> None:
    if security == "malicious" and dropout >= 0.3 and n >= 1000:
        pytest.skip("slow search (several seconds), covered at smaller n")
    params = secagg_plus_parameters(n, dropout, corrupt, security)
    assert params.num_clients == n
    k, t = params.holders, params.threshold
    lowest = (2 * k) // 3 + 1 if security == "malicious" else k // 2 + 1
    assert lowest <= t <= k
    Config(num_clients=n, threshold=t, neighbors=params.neighbors, security=security,
           dropout_rate=dropout, corrupt_rate=corrupt)  # Config agrees it is safe
    if params.neighbors is None:
        assert t >= math.ceil(corrupt * n) + 1
        if security == "malicious":
            assert 2 * t > n + math.ceil(corrupt * n)
        assert t <= math.floor((1 - dropout) * n)
        return
    assert 3 <= k < n
    b = _bounds(n, k, t, dropout, corrupt)
    assert b["corrupt_ge_t"] <= 2.0 ** -(SECURITY_BITS + 1) / n
    assert b["alive_lt_t"] <= 2.0 ** -CORRECTNESS_BITS / n
    if security == "malicious":
        assert b["corrupt_ge_2t_minus_k"] <= 2.0 ** -(SECURITY_BITS + 1) / n


@pytest.mark.parametrize(("n", "dropout", "corrupt"), [
    (10, 0.1, 0.3), (50, 0.1, 0.3), (500, 0.1, 0.1), (1000, 0.2, 0.2)])
def test_malicious_parameters_bound_corrupt_holders_for_split_requests(
        n: int, dropout: float, corrupt: float) -> None:
    """Against a malicious server, c corrupt holders plus t - c honest answers of each kind
    reveal both secrets when c >= 2t - k; that must be as unlikely as 2^-41/n. (Regression:
    the first finder gave k=7, t=5 for n=10 at corrupt_rate=0.3, where P = 1/6.)"""
    params = secagg_plus_parameters(n, dropout, corrupt, "malicious")
    assert params.neighbors is not None
    b = _bounds(n, params.neighbors, params.threshold, dropout, corrupt)
    assert b["corrupt_ge_2t_minus_k"] <= 2.0 ** -(SECURITY_BITS + 1) / n


def test_secagg_plus_neighbourhood_grows_slowly() -> None:
    ks = []
    for n in (100, 1000, 10_000):
        params = secagg_plus_parameters(n, 0.1, 0.1)
        assert params.neighbors is not None
        ks.append(params.neighbors)
    assert ks == sorted(ks)
    assert ks[-1] <= 20 * math.log2(10_000)  # polylog, far below n
    assert ks[-1] < 10_000 // 50
    malicious = secagg_plus_parameters(10_000, 0.1, 0.1, "malicious")
    assert malicious.neighbors is not None and malicious.neighbors < 500


@pytest.mark.parametrize(("n", "dropout", "corrupt", "security"), [
    (3, 0.1, 0.1, "semi-honest"), (4, 0.1, 0.1, "malicious"), (5, 0.1, 0.1, "malicious"),
    (10, 0.3, 0.1, "malicious"), (3, 0.0, 0.0, "semi-honest")])
def test_secagg_plus_falls_back_to_complete_graph_for_small_n(n: int, dropout: float,
                                                              corrupt: float,
                                                              security: str) -> None:
    params = secagg_plus_parameters(n, dropout, corrupt, security)
    assert params.neighbors is None and params.holders == n
    assert params.threshold >= (2 * n) // 3 + 1 if security == "malicious" else n // 2 + 1


def test_secagg_plus_refuses_impossible_requests() -> None:
    with pytest.raises(ValueError, match="no safe parameters"):
        secagg_plus_parameters(3, 0.1, 0.1, "malicious")
    for bad in [dict(dropout_rate=1.0), dict(corrupt_rate=-0.1), dict(security="paranoid")]:
        with pytest.raises(ValueError):
            secagg_plus_parameters(100, **bad)  # type: ignore[arg-type]


def test_config_refuses_unsafe_sparse_pairs() -> None:
    params = secagg_plus_parameters(1000, 0.1, 0.1)
    assert params.neighbors is not None
    with pytest.raises(ValueError, match="secagg_plus_parameters"):
        Config(num_clients=1000, neighbors=params.neighbors, threshold=params.threshold - 1,
               dropout_rate=0.1, corrupt_rate=0.1)
    with pytest.raises(ValueError):
        Config(num_clients=1000, neighbors=5, threshold=3, dropout_rate=0.1, corrupt_rate=0.1)


_ID_LISTS = {  # an unmasking request's survivor list on the wire -> ids, or the error
    "fixint and 2-byte": (b"\x93\x05\xcc\xc8\xcd\x01\x2c", (5, 200, 300)),
    "1-byte and 4-byte": (b"\x92\xcc\x80\xce\x00\x01\x00\x00", (128, 65536)),
    "2-byte not canonical": (b"\x92\x05\xcd\x00\x06", "canonical"),
    "1-byte not canonical": (b"\x92\x05\xcc\x06", "canonical"),
    "unsorted 2-byte": (b"\x92\xcd\x01\x2c\xcd\x01\x00", "sorted"),
    "repeated 2-byte": (b"\x92\xcd\x01\x2c\xcd\x01\x2c", "sorted"),
    "zero": (b"\x92\x00\x05", "client id in 1.."),
    "negative": (b"\x92\x05\xff", "non-negative integer"),
    "truncated 2-byte": (b"\x92\x05\xcd\x01", "truncated"),
}


@pytest.mark.parametrize("case", sorted(_ID_LISTS))
def test_id_lists_decode_exactly_or_name_the_fault(case: str) -> None:
    """The survivor list's decoder (a tight loop: n ids for each of n clients) takes
    every canonical width and refuses what the general reader refuses, with its reason."""
    from secagg.errors import ProtocolError
    from secagg.messages import UnmaskRequest, decode, encode

    wire, expected = _ID_LISTS[case]
    honest = encode(UnmaskRequest(b"\x01" * 32, 7, (7, 9), ()))
    marker = b"\x92\x07\x09"
    assert honest.count(marker) == 1
    raw = honest.replace(marker, wire)
    if case.startswith("truncated"):  # the message ends inside the list
        raw = honest[:honest.index(marker)] + wire
    if isinstance(expected, tuple):
        assert decode(raw).survivors == expected  # type: ignore[union-attr]
    else:
        with pytest.raises(ProtocolError, match=expected):
            decode(raw)
