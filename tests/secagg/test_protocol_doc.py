"""docs/protocol.md against the code: the constants, tables and test vectors the spec
states are parsed from the document and recomputed here, and the byte layouts the spec
describes are re-implemented from its text with hashlib / cryptography and compared with
``secagg``. If the code or the document changes alone, these tests fail.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import re
import struct
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from secagg import Client, Config, Server, Stage, crypto, messages, shamir
from secagg.crypto import KeyPair, Masker, SigningKey
from secagg.graph import Graph, _keystream_permutation, harary_neighbors
from secagg.messages import (
    InputProof,
    KeyEntry,
    MaskedInput,
    ShareKeys,
    SurvivorList,
    UnmaskingShares,
    encode,
    peers_digest,
)
from secagg.session import derive_session_id, normalize_roster, session_graph
from secagg.transcripts import (
    advertisement_digest,
    advertisement_transcript,
    client_message_transcript,
    key_set_digest,
    share_associated_data,
    survivors_transcript,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
TEXT = DOC.read_text(encoding="utf-8")


# --- parsing ------------------------------------------------------------------------------


def _block(marker: str) -> list[str]:
    """The lines following ``<!-- doc-check: marker -->`` up to the first blank line."""
    lines = TEXT.splitlines()
    start = lines.index(f"<!-- doc-check: {marker} -->") + 1
    out = []
    for line in lines[start:]:
        if not line.strip():
            break
        out.append(line)
    return out


def _table(marker: str) -> list[list[str]]:
    rows = [line for line in _block(marker) if line.startswith("|")]
    body = rows[2:]  # header and separator
    return [[cell.strip().strip("`") for cell in row.strip().strip("|").split("|")]
            for row in body]


def _resolve(path: str) -> object:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _vectors() -> dict[str, str]:
    return {name: value for name, value in _table("vectors")}


# --- re-implementation of section 5 from the document's text ------------------------------

P = b"secagg/v1"


def _u32(x: int) -> bytes:
    return struct.pack(">I", x)


def _hkdf(ikm: bytes, salt: bytes, info: bytes, length: int = 32) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt, info=info).derive(ikm)


def _label(tag: bytes, sid: bytes, stage: int, a: int, b: int, *extra: bytes) -> bytes:
    return b"|".join([P, tag, sid, bytes([stage]), _u32(a), _u32(b), *extra])


def _transcript(tag: bytes, sid: bytes, stage: int, signer: int, payload: bytes,
                binding: bytes = b"") -> bytes:
    return b"|".join([P, b"sig", tag, sid, bytes([stage]), _u32(signer),
                      *([binding] if binding else []), hashlib.sha256(payload).digest()])


def _advert(sid: bytes, u: int, entry: KeyEntry) -> bytes:
    """A_u of section 5.7."""
    return hashlib.sha256(P + b"|advert|" + sid + _u32(u) + entry.encryption_key
                          + entry.masking_key + entry.self_mask_commitment).digest()


def _key_set(sid: bytes, keys: dict[int, KeyEntry]) -> bytes:
    """K(KL) of section 5.7."""
    return hashlib.sha256(P + b"|key-set|" + sid + b"".join(
        _u32(v) + _advert(sid, v, keys[v]) for v in sorted(keys))).digest()


def _aes_ctr(key: bytes, nbytes: int) -> bytes:
    enc = Cipher(algorithms.AES(key), modes.CTR(b"\x00" * 16)).encryptor()
    return enc.update(b"\x00" * nbytes)


def _session_id(cfg: Config, roster: tuple[int, ...], context: bytes) -> bytes:
    enc = struct.pack(">IIQBIB", cfg.num_clients, cfg.threshold, cfg.dim, cfg.bits,
                      cfg.neighbors or 0, int(cfg.security == "malicious"))
    roster_bytes = b"".join(_u32(c) for c in sorted(roster))
    return hashlib.sha256(P + b"|session|" + enc + hashlib.sha256(roster_bytes).digest()
                          + hashlib.sha256(context).digest()).digest()


def _permutation(seed: bytes, n: int) -> list[int]:
    stream = _aes_ctr(seed, 4 * 64 * n + 4096)
    pos = 0
    perm = list(range(n))
    for i in range(n - 1, 0, -1):
        bound = i + 1
        limit = 2**32 - (2**32 % bound)
        while True:
            r = int.from_bytes(stream[pos:pos + 4], "little")
            pos += 4
            if r < limit:
                break
        j = r % bound
        perm[i], perm[j] = perm[j], perm[i]
    return perm


def _prg(key: bytes, dim: int, bits: int) -> list[int]:
    width = next(w for w in (8, 16, 32, 64) if bits <= w)
    raw = _aes_ctr(key, dim * width // 8)
    size = width // 8
    return [int.from_bytes(raw[i * size:(i + 1) * size], "little") % 2**bits
            for i in range(dim)]


SID = bytes(range(32))
SHAPE = struct.pack(">QB", 4, 12)


# --- tests --------------------------------------------------------------------------------


def test_constants_match_the_code() -> None:
    rows = _table("constants")
    assert len(rows) >= 10
    for _, value, path in rows:
        expected = eval(value, {"__builtins__": {}})  # the doc's own literal, e.g. 2**256 + 297
        assert _resolve(path) == expected, (path, value)


def test_derived_sizes() -> None:
    assert messages.SHARE_PLAINTEXT_BYTES == 4 + 4 + 2 * shamir.SHARE_BYTES
    assert messages.CIPHERTEXT_BYTES == messages.SHARE_PLAINTEXT_BYTES + 16
    assert shamir.PRIME.bit_length() == 257
    assert shamir.PRIME > 2**256
    # the smallest prime above 2^256: p passes Miller-Rabin, and a Fermat witness shows
    # every odd number in between composite (base 3: 2^256 + 1 is a base-2 pseudoprime)
    assert _probably_prime(shamir.PRIME)
    for c in range(2**256 + 1, shamir.PRIME, 2):
        assert pow(3, c - 1, c) != 1


def _probably_prime(n: int) -> bool:
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41):
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


def test_stage_table() -> None:
    rows = _table("stages")
    assert [int(r[0]) for r in rows] == [s.value for s in Stage]
    for value, name, label, *_ in rows:
        stage = Stage(int(value))
        assert name == stage.name and label == stage.label


def test_kind_table() -> None:
    rows = _table("kinds")
    specs = messages.MESSAGE_KINDS
    assert {r[1]: int(r[0]) for r in rows} == {s.message.__name__: int(k) for k, s in specs.items()}
    for kind, _, direction, length, _ in rows:
        spec = specs[messages.MessageKind(int(kind))]
        assert spec.arity == int(length)
        assert spec.client == direction.startswith("client")
        side = messages.CLIENT_KINDS if direction.startswith("client") else messages.SERVER_KINDS
        assert int(kind) in side


def test_label_table_matches_derivations() -> None:
    a = KeyPair.from_private_bytes(b"\x05" * 32)
    b = KeyPair.from_private_bytes(b"\x06" * 32)
    ss = a.exchange(b.public)
    seed = b"\x42" * 32
    A9 = _advert(SID, 9, KeyEntry(a.public, b.public, b"\x01" * 32))
    A4 = _advert(SID, 4, KeyEntry(b.public, a.public, b"\x02" * 32))
    rebuilt = {
        ("share-key", 1): (_hkdf(ss, SID, _label(b"share-key", SID, 1, 9, 4, a.public,
                                                   b.public)),
                           crypto.share_key(ss, SID, 9, 4, a.public, b.public)),
        ("share-ciphertext", 1): (_label(b"share-ciphertext", SID, 1, 9, 4, A9, A4),
                                  share_associated_data(SID, 9, 4, A9, A4)),
        ("pairwise-mask", 2): (_hkdf(ss, SID, _label(b"pairwise-mask", SID, 2, 4, 9, b.public,
                                                       a.public, SHAPE), 16),
                               crypto.pairwise_mask_key(ss, SID, 9, 4, a.public, b.public,
                                                        SHAPE)),
        ("self-mask", 2): (_hkdf(seed, SID, _label(b"self-mask", SID, 2, 9, 9, SHAPE), 16),
                           crypto.self_mask_key(seed, SID, 9, SHAPE)),
        ("self-mask-commit", 0): (
            hashlib.sha256(_label(b"self-mask-commit", SID, 0, 9, 9) + seed).digest(),
            crypto.self_mask_commitment(seed, SID, 9)),
    }
    rows = _table("labels")
    assert {(r[0], int(r[1])) for r in rows} == set(rebuilt)
    for key, (from_doc, from_code) in rebuilt.items():
        assert from_doc == from_code, key
    # the pairwise key is symmetric, the share key is not
    assert crypto.pairwise_mask_key(ss, SID, 4, 9, b.public, a.public, SHAPE) == \
        rebuilt[("pairwise-mask", 2)][1]
    assert crypto.share_key(ss, SID, 4, 9, b.public, a.public) != rebuilt[("share-key", 1)][1]
    assert len(share_associated_data(SID, 9, 4, A9, A4)) == 71 + 66


def test_transcript_table() -> None:
    rows = _table("transcripts")
    assert {(r[0], int(r[1])) for r in rows} == {
        ("advertise", 0), ("survivors", 3), ("share-keys", 1), ("masked-input", 2),
        ("unmasking", 4), ("input-proof", 2)}
    keys = {7: KeyEntry(b"\x01" * 32, b"\x02" * 32, b"\x03" * 32),
            2: KeyEntry(b"\x04" * 32, b"\x05" * 32, b"\x06" * 32)}
    ks = _key_set(SID, keys)
    assert key_set_digest(SID, keys) == ks
    assert advertisement_digest(SID, 7, keys[7]) == _advert(SID, 7, keys[7])
    shares = ShareKeys(SID, 7, {9: b"\x05" * 90, 2: b"\x06" * 90})
    assert client_message_transcript(shares, ks) == _transcript(
        b"share-keys", SID, 1, 7, _u32(2) + b"\x06" * 90 + _u32(9) + b"\x05" * 90, ks)
    masked = MaskedInput(SID, 7, 16, 3, b"\x01" * 6, b"\x02" * 32)
    assert client_message_transcript(masked, ks) == _transcript(
        b"masked-input", SID, 2, 7, bytes([16]) + (3).to_bytes(8, "big") + b"\x02" * 32
        + b"\x01" * 6, ks)
    unmask = UnmaskingShares(SID, 7, {3: b"\x07" * 33}, {4: b"\x08" * 33, 1: b"\x09" * 33})
    assert client_message_transcript(unmask, ks) == _transcript(
        b"unmasking", SID, 4, 7, b"s" + _u32(1) + _u32(3) + b"\x07" * 33 + b"k" + _u32(1)
        + b"\x09" * 33 + _u32(4) + b"\x08" * 33, ks)
    proof = InputProof(SID, 7, b"\x0a" * 40)
    assert client_message_transcript(proof, ks) == _transcript(
        b"input-proof", SID, 2, 7, b"\x0a" * 40, ks)
    assert peers_digest([9, 2]) == hashlib.sha256(
        b"secagg/v1|peers|" + _u32(2) + _u32(9)).digest()
    entry = KeyEntry(b"\x01" * 32, b"\x02" * 32, b"\x03" * 32)
    assert advertisement_transcript(SID, 7, entry) == _transcript(
        b"advertise", SID, 0, 7, b"\x01" * 32 + b"\x02" * 32 + b"\x03" * 32)
    a7 = _advert(SID, 7, keys[7])
    assert survivors_transcript(SID, 7, [9, 2, 7], a7) == _transcript(
        b"survivors", SID, 3, 7, _u32(2) + _u32(7) + _u32(9), a7)
    # the list's digest is kept per list (the server checks n signatures over one): any
    # container or order of the same list gives the same bytes, another list other bytes
    for same in ((7, 9, 2), frozenset({2, 7, 9}), {9, 7, 2}, (2, 7, 9)):
        assert survivors_transcript(SID, 7, same, a7) == survivors_transcript(
            SID, 7, [9, 2, 7], a7)
    assert survivors_transcript(SID, 7, (2, 7, 9, 11), a7) == _transcript(
        b"survivors", SID, 3, 7, _u32(2) + _u32(7) + _u32(9) + _u32(11), a7)


def test_small_order_list() -> None:
    values = {int(line.strip(), 16) for line in _block("small-order") if
              line.strip().startswith("0x")}
    assert values == set(crypto._SMALL_ORDER_U)
    p = 2**255 - 19
    for u in values | {p, p + 1}:
        encoded = u.to_bytes(32, "little")
        with pytest.raises(crypto.CryptoError):
            crypto.check_public_key(encoded)
        high = bytearray(encoded)
        high[31] |= 0x80  # bit 255 is ignored
        with pytest.raises(crypto.CryptoError):
            crypto.check_public_key(bytes(high))
    crypto.check_public_key(KeyPair().public)


@pytest.mark.parametrize("malicious", [False, True])
def test_session_id_layout(malicious: bool) -> None:
    cfg = Config(num_clients=6, dim=33, bits=20, neighbors=4, unchecked_graph=True,
                 security="malicious" if malicious else "semi-honest")
    roster = (90, 4, 17, 2**32 - 1, 5, 6)
    assert derive_session_id(cfg, normalize_roster(cfg, roster), b"ctx") == \
        _session_id(cfg, roster, b"ctx")
    assert len(cfg.encode()) == 22


@pytest.mark.parametrize("n", [2, 3, 10, 257, 1000])
def test_relabelling_layout(n: int) -> None:
    sid = hashlib.sha256(b"relabel %d" % n).digest()
    seed = _hkdf(sid, sid, P + b"|graph-relabelling")
    assert _keystream_permutation(seed, n) == _permutation(seed, n)
    if n > 4:
        cfg = Config(num_clients=n, neighbors=3, unchecked_graph=True)
        roster = tuple(range(100, 100 + n))
        graph = session_graph(cfg, roster, sid)
        ring = [roster[q] for q in _permutation(seed, n)]
        assert list(graph._ring) == ring  # type: ignore[attr-defined]


@pytest.mark.parametrize("n", [7, 8, 9, 12])
@pytest.mark.parametrize("k", [3, 4, 5, 6])
def test_harary_closed_neighbourhoods(n: int, k: int) -> None:
    graph = Graph(tuple(range(1, n + 1)), k, bytes(32))
    sizes = sorted(len(graph.closed_neighborhood(c)) for c in range(1, n + 1))
    if (k - 1) % 2 == 1 and n % 2 == 1:
        assert sizes == [k] * (n - 1) + [k + 1]
    else:
        assert sizes == [k] * n
    adjacency = [set(harary_neighbors(p, k - 1, n)) for p in range(n)]
    assert all(p in adjacency[q] for p in range(n) for q in adjacency[p])


@pytest.mark.parametrize("bits", [8, 12, 16, 31, 32, 33, 64])
def test_prg_layout(bits: int) -> None:
    key = hashlib.sha256(b"prg %d" % bits).digest()
    masker = Masker(5, bits)
    words = [int(v) for v in masker.keystream(key)]
    assert [v % 2**bits for v in words] == _prg(key, 5, bits)


def test_vectors() -> None:
    v = _vectors()
    cfg1 = Config(num_clients=5, threshold=3, dim=4, bits=12)
    roster1 = normalize_roster(cfg1, (3, 7, 11, 19, 42))
    sid1 = derive_session_id(cfg1, roster1, b"round-1")
    cfg2 = Config(num_clients=10, neighbors=5, unchecked_graph=True)
    roster2 = normalize_roster(cfg2, None)
    sid2 = derive_session_id(cfg2, roster2, b"example")
    k1 = KeyPair.from_private_bytes(b"\x01" * 32)
    k2 = KeyPair.from_private_bytes(b"\x02" * 32)
    ss = k1.exchange(k2.public)
    seed = b"\x11" * 32
    commit = crypto.self_mask_commitment(seed, sid1, 3)
    signer = SigningKey(Ed25519PrivateKey.from_private_bytes(b"\x09" * 32))
    entry3 = KeyEntry(k1.public, k2.public, commit)
    adv = advertisement_transcript(sid1, 3, entry3)
    a3 = _advert(sid1, 3, entry3)
    a7 = _advert(sid1, 7, KeyEntry(k2.public, k1.public, crypto.self_mask_commitment(
        seed, sid1, 7)))
    computed = {
        "cfg1": cfg1.encode(),
        "shape_tag1": cfg1.shape_tag,
        "sid1": sid1,
        "cfg2": cfg2.encode(),
        "sid2": sid2,
        "graph_seed2": _hkdf(sid2, sid2, P + b"|graph-relabelling"),
        "pk_01": k1.public,
        "pk_02": k2.public,
        "x25519_01_02": ss,
        "share_key_3_to_7": crypto.share_key(ss, sid1, 3, 7, k1.public, k2.public),
        "advert_digest_3": a3,
        "share_ad_3_to_7": share_associated_data(sid1, 3, 7, a3, a7),
        "pairwise_key_3_7": crypto.pairwise_mask_key(ss, sid1, 3, 7, k1.public, k2.public,
                                                     cfg1.shape_tag),
        "self_mask_key_3": crypto.self_mask_key(seed, sid1, 3, cfg1.shape_tag),
        "commit_3": commit,
        "advertise_transcript_3": adv,
        "advertise_signature_3": signer.sign(adv),
        "survivors_transcript_3": survivors_transcript(sid1, 3, [3, 7, 11], a3),
    }
    assert set(v) == set(computed)
    for name, value in computed.items():
        assert v[name] == value.hex(), name


def test_further_vectors() -> None:
    cfg2 = Config(num_clients=10, neighbors=5, unchecked_graph=True)
    roster2 = normalize_roster(cfg2, None)
    sid2 = derive_session_id(cfg2, roster2, b"example")
    seed = _hkdf(sid2, sid2, P + b"|graph-relabelling")
    perm = _keystream_permutation(seed, 10)
    graph = session_graph(cfg2, roster2, sid2)
    assert f"`{perm}`" in TEXT
    assert f"`{tuple(graph._ring)}`" in TEXT  # type: ignore[attr-defined]
    hoods = ", ".join("`{" + ", ".join(map(str, sorted(graph.closed_neighborhood(c)))) + "}`"
                      for c in (1, 2, 3))
    assert hoods in TEXT
    words = Masker(4, 12).keystream(bytes(range(16)))
    assert f"`{[int(x) for x in words]}`" in TEXT
    assert f"`{[int(x) % 4096 for x in words]}`" in TEXT
    wire = encode(SurvivorList(b"\x01" * 32, 3, (1, 2, 3))).hex()
    assert f"`{wire}`" in TEXT


def test_size_limits_stated() -> None:
    cfg = Config(num_clients=7, dim=10, bits=20)
    client = Client(cfg, 1, np.zeros(10, dtype=np.uint64))
    server = Server(cfg)
    assert "`4096 + 416·n`" in TEXT
    assert client.max_message_bytes() == 4096 + 416 * 7
    assert "`1024 + max(dim·w/8, proof) + 128·n`" in TEXT
    assert server.max_message_bytes() == 1024 + 10 * 4 + 128 * 7
    if importlib.util.find_spec("py_arkworks_bls12381") is not None:
        from secagg.validation import proof_size

        bounded = Server(Config(num_clients=7, dim=10, bits=20, norm_bound=100))
        assert bounded.max_message_bytes() == 1024 + proof_size(10) + 128 * 7


def test_share_ciphertexts_on_the_wire_have_the_stated_size() -> None:
    cfg = Config(num_clients=3, dim=2, bits=8)
    clients = [Client(cfg, c, np.zeros(2, dtype=np.uint64)) for c in (1, 2, 3)]
    server = Server(cfg)
    for c in clients:
        server.receive(c.client_id, encode(c.advertise()))
    key_lists = server.advance()
    reply = clients[0].handle(encode(key_lists[1]))
    sizes = {len(ct) for ct in reply.ciphertexts.values()}  # type: ignore[union-attr]
    assert sizes == {int(_constant("share ciphertext bytes"))}
    shares = shamir.split(b"\xff" * 32, [1, 2, 3], 2)
    assert {len(s) for s in shares.values()} == {int(_constant("Shamir share bytes"))}


def _constant(name: str) -> str:
    for row in _table("constants"):
        if row[0] == name:
            return row[1]
    raise KeyError(name)


def test_section_numbers_cited_by_the_code_exist() -> None:
    headings = set(re.findall(r"^## (\d+)\. ", TEXT, flags=re.MULTILINE))
    assert headings == {str(i) for i in range(1, 11)}
    src = Path(__file__).resolve().parents[2] / "secagg"
    cited = set()
    for path in src.rglob("*.py"):
        cited |= set(re.findall(r"protocol\.md(?:\s+|\s*\(\s*)section\s+(\d+)",
                                path.read_text(encoding="utf-8")))
    assert cited and cited <= headings
