"""The attacker's toolkit for the security review suite.

``Puppeteer`` is a scripted (possibly malicious) server that drives *real, honest*
``secagg.Client`` objects through the wire codec: it builds every server message itself,
so an attack is a short script of what the server sends to whom. It records every byte the
clients send (what a server, or a broker in the middle, actually receives).

``recover_input`` is the attacker's best recovery attempt on everything it received: it
reconstructs every secret it can (all shares it holds, error-correcting Reed-Solomon
decoding and subset search, each candidate checked against the owner's commitment or
public key), decrypts every share ciphertext it can (when it planted its own keys), and
removes every mask it can from the victim's masked input. ``assert_input_hidden`` then
raises ``AttackSucceeded`` if the victim's input comes out, and otherwise checks that what
the attacker holds is statistically uniform (a chi-square test on the residual).

``threat(...)`` attaches the threat-model metadata that ``scripts/security_report.py``
turns into the attack table of docs/security.md.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import pytest

from secagg import (
    Client,
    Config,
    ProtocolAbort,
    ProtocolError,
    RoundNonce,
    Server,
    SigningKey,
    Stage,
    round_stages,
)
from secagg.crypto import (
    CryptoError,
    KeyPair,
    Masker,
    constant_time_equal,
    open_sealed,
    pairwise_mask_key,
    seal,
    self_mask_commitment,
    self_mask_key,
    share_key,
    u32,
)
from secagg.messages import (
    SHARE_PLAINTEXT_BYTES,
    AdvertiseKeys,
    Ciphertexts,
    ClientMessage,
    ConsistencySignature,
    KeyEntry,
    KeyList,
    MaskedInput,
    ServerMessage,
    ShareKeys,
    SurvivorList,
    UnmaskingShares,
    UnmaskRequest,
    decode,
    encode,
)
from secagg.session import derive_session_id, normalize_roster
from secagg.shamir import PRIME, SHARE_BYTES, decode_with_errors, reconstruct_value
from secagg.transcripts import (
    advertisement_digest,
    share_associated_data,
    survivors_transcript,
)

ADVERSARIES = (
    "honest-but-curious server",
    "malicious server",
    "malicious server + colluding clients",
    "honest-but-curious server + colluding clients",
    "malicious client",
    "untrusted broker",
    "network attacker",
    "curious server (plaintext vs. masked update)",
    "anyone who sees the released model",
    "coordinator choosing the context",
    "any sender of bytes",
)


class AttackSucceeded(AssertionError):
    """The attacker recovered what the protocol should hide."""


def threat(*, attack: str, adversary: str, controls: str, protocol: str,
           mode: str = "both", shows: str = "defence") -> pytest.MarkDecorator:
    """Threat-model metadata for one row of docs/security.md (several tests may share a row).

    ``attack``: the row title; ``adversary``: one of ``ADVERSARIES``; ``controls``: what
    the attacker controls; ``protocol``: what the protocol does about it; ``mode``: the
    security mode(s) the row is about."""
    if adversary not in ADVERSARIES:
        raise ValueError(f"unknown adversary {adversary!r}: use one of {ADVERSARIES}")
    return pytest.mark.threat(attack=attack, adversary=adversary, controls=controls,
                              protocol=protocol, mode=mode, shows=shows)


def documented_limitation(reason: str) -> pytest.MarkDecorator:
    """The attack is known to succeed (a stated non-guarantee or a reported defect): the
    test asserts the protection anyway and must fail with ``AttackSucceeded``, nothing
    else. If the protection ever starts to hold, the strict xfail turns the run red so the
    documentation gets updated."""
    return pytest.mark.xfail(strict=True, raises=AttackSucceeded, reason=reason)


# --- the scripted server ---------------------------------------------------------------------


@dataclass
class FakePeer:
    """Key pairs the server made up and planted in a victim's key list under a peer's id."""

    encryption: KeyPair
    masking: KeyPair
    seed: bytes = b"\x07" * 32
    entry: KeyEntry | None = None


class Puppeteer:
    """A server under the test's control, driving real honest clients.

    Every server message goes through ``deliver`` (encoded to wire bytes first); every
    client reply is recorded in ``received`` and indexed by kind. ``contexts`` lets
    clients run with different contexts (e.g. different model hashes)."""

    def __init__(self, config: Config, *, context: bytes = b"security-suite",
                 contexts: Mapping[int, bytes] | None = None, seed: int = 0,
                 inputs: Mapping[int, np.ndarray] | None = None,
                 roster: Iterable[int] | None = None) -> None:
        self.config = config
        self.roster = normalize_roster(config, roster)
        self.context = context
        self.t = config.threshold
        rng = np.random.default_rng(seed)
        self.inputs: dict[int, np.ndarray] = dict(inputs) if inputs is not None else {
            cid: rng.integers(0, config.modulus, size=config.dim, dtype=np.uint64)
            for cid in self.roster}
        self.signing: dict[int, SigningKey] = {}
        self.verify_keys: dict[int, bytes] | None = None
        if config.malicious:
            self.signing = {cid: SigningKey.generate() for cid in self.roster}
            self.verify_keys = {cid: k.public for cid, k in self.signing.items()}
        ctx = dict(contexts or {})
        self.round_nonce = RoundNonce()  # the round nonce this server relays to its clients
        self.nonce = self.round_nonce.value
        self.clients = {
            cid: Client(config, cid, self.inputs[cid], roster=self.roster,
                        context=ctx.get(cid, context), signing_key=self.signing.get(cid),
                        verify_keys=self.verify_keys, nonce=self.nonce)
            for cid in self.roster}
        self.session_id = derive_session_id(config, self.roster, context)
        self.received: list[tuple[int, bytes]] = []
        self.delivered: list[tuple[int, bytes]] = []
        self.aborts: dict[int, ProtocolAbort] = {}
        self.refusals: dict[int, ProtocolError] = {}
        self.adverts: dict[int, AdvertiseKeys] = {}
        self.share_keys: dict[int, ShareKeys] = {}
        self.masked: dict[int, MaskedInput] = {}
        self.signatures: dict[int, bytes] = {}
        self.unmasking: list[UnmaskingShares] = []
        self.views: dict[int, list[ServerMessage]] = {cid: [] for cid in self.roster}
        self.fakes: dict[tuple[int, int], FakePeer] = {}  # (victim, posing as) -> keys
        self.leaked_shares: dict[str, dict[int, dict[int, int]]] = {"seed": {}, "key": {}}
        self.leaked_keys: dict[int, bytes] = {}  # corrupt client -> its masking private key

    # --- recording ----------------------------------------------------------------------

    def _record(self, cid: int, raw: bytes) -> ClientMessage:
        self.received.append((cid, raw))
        msg = decode(raw)
        assert not isinstance(msg, (KeyList, Ciphertexts, SurvivorList, UnmaskRequest))
        if isinstance(msg, AdvertiseKeys):
            self.adverts[cid] = msg
        elif isinstance(msg, ShareKeys):
            self.share_keys[cid] = msg
        elif isinstance(msg, MaskedInput):
            self.masked[cid] = msg
        elif isinstance(msg, ConsistencySignature):
            self.signatures[cid] = msg.signature
        else:
            self.unmasking.append(msg)
        return msg

    def advertise(self, ids: Iterable[int] | None = None) -> dict[int, AdvertiseKeys]:
        for cid in self.roster if ids is None else ids:
            self._record(cid, encode(self.clients[cid].advertise()))
        return self.adverts

    def deliver(self, cid: int, message: ServerMessage | bytes) -> ClientMessage | None:
        """Send one server message to client ``cid``; returns its reply (None: it aborted
        or refused the message, see ``aborts`` / ``refusals``)."""
        raw = message if isinstance(message, bytes) else encode(message)
        self.delivered.append((cid, raw))
        try:
            reply = self.clients[cid].handle(raw)
        except ProtocolAbort as exc:
            self.aborts[cid] = exc
            return None
        except ProtocolError as exc:
            self.refusals[cid] = exc
            return None
        decoded = decode(raw)
        assert isinstance(decoded, (KeyList, Ciphertexts, SurvivorList, UnmaskRequest))
        self.views[cid].append(decoded)
        return self._record(cid, encode(reply))

    def alive(self) -> list[int]:
        return [cid for cid in self.roster if cid not in self.aborts]

    # --- honest message builders (attacks start from these) -------------------------------

    def entry(self, cid: int) -> KeyEntry:
        a = self.adverts[cid]
        return KeyEntry(a.encryption_key, a.masking_key, a.self_mask_commitment, a.signature)

    def key_list(self, cid: int, members: Iterable[int] | None = None,
                 replace: Mapping[int, KeyEntry] | None = None,
                 session_id: bytes | None = None) -> KeyList:
        members = set(self.adverts) if members is None else set(members)
        keys = {m: self.entry(m) for m in members if m in self.adverts}
        keys.update(replace or {})
        return KeyList(session_id or self.session_id, cid, keys)

    def plant_fake(self, victim: int, posing_as: int) -> KeyEntry:
        """Fresh key pairs the server owns, presented to ``victim`` as ``posing_as``'s.
        The server has no signing key: the signature is copied from the real entry."""
        fake = FakePeer(KeyPair(), KeyPair())
        self.fakes[(victim, posing_as)] = fake
        commitment = self_mask_commitment(fake.seed, self.session_id, posing_as)
        fake.entry = KeyEntry(fake.encryption.public, fake.masking.public, commitment,
                              self.adverts[posing_as].signature)
        return fake.entry

    def advert_digest(self, cid: int, entry: KeyEntry | None = None) -> bytes:
        """The advertisement digest of ``cid`` (of ``entry`` if given) in this session."""
        return advertisement_digest(self.session_id, cid, entry or self.entry(cid))

    def ciphertexts(self, cid: int, senders: Iterable[int] | None = None) -> Ciphertexts:
        senders = set(self.share_keys) if senders is None else set(senders)
        cts = {s: self.share_keys[s].ciphertexts[cid] for s in senders
               if s != cid and s in self.share_keys and cid in self.share_keys[s].ciphertexts}
        return Ciphertexts(self.session_id, cid, cts)

    def forged_ciphertexts(self, victim: int) -> Ciphertexts:
        """Ciphertexts 'from' every fake peer planted in ``victim``'s key list, sealed
        under the server's own keys (so the victim's AEAD checks pass)."""
        c_v = self.adverts[victim].encryption_key
        cts: dict[int, bytes] = {}
        for (target, posing), fake in self.fakes.items():
            if target != victim:
                continue
            secret = fake.encryption.exchange(c_v)
            k = share_key(secret, self.session_id, posing, victim, fake.encryption.public, c_v)
            plain = u32(posing) + u32(victim) + field_element(1) + field_element(2)
            cts[posing] = seal(k, plain, share_associated_data(
                self.session_id, posing, victim, self.advert_digest(posing, fake.entry),
                self.advert_digest(victim)))
        return Ciphertexts(self.session_id, victim, cts)

    def survivor_list(self, cid: int, survivors: Iterable[int]) -> SurvivorList:
        return SurvivorList(self.session_id, cid, tuple(sorted(set(survivors))))

    def unmask_request(self, cid: int, survivors: Iterable[int], dropped: Iterable[int] = (),
                       signatures: Mapping[int, bytes] | None = None) -> UnmaskRequest:
        survivors = set(survivors)
        if signatures is None:
            signatures = ({s: sig for s, sig in self.signatures.items() if s in survivors}
                          if self.config.malicious else {})
        return UnmaskRequest(self.session_id, cid, tuple(sorted(survivors)),
                             tuple(sorted(set(dropped))), dict(signatures))

    def peers_of(self, cid: int) -> set[int]:
        """F(cid): the senders of the ciphertexts this server forwarded to ``cid``."""
        for msg in reversed(self.views[cid]):
            if isinstance(msg, Ciphertexts):
                return set(msg.ciphertexts)
        return set()

    # --- whole honest stages ------------------------------------------------------------

    def honest_until_masked_input(self, ids: Iterable[int] | None = None) -> None:
        """Run advertise_keys, share_keys and masked_input honestly for ``ids``."""
        ids = list(self.roster if ids is None else ids)
        self.advertise(ids)
        for cid in ids:
            self.deliver(cid, self.key_list(cid, ids))
        for cid in ids:
            if cid not in self.aborts:
                self.deliver(cid, self.ciphertexts(cid))

    # --- corrupt clients (they hand the server everything they know) -----------------------

    def corrupt(self, cid: int) -> None:
        """Client ``cid`` colludes: it gives the server both shares of every peer it holds
        (call after it received its ciphertexts), its own shares and its masking private
        key (so the server can remove its pairwise masks with anyone)."""
        state = self.clients[cid]._state
        masked = getattr(state, "masked", state)  # the client's _Masked stage record
        held = {owner: bytes(masked.received[o:o + 2 * SHARE_BYTES])
                for owner, o in masked.index.items()}
        held[cid] = bytes(masked.shared.own_shares)
        self.leaked_keys[cid] = bytes(self.clients[cid]._secrets.masking)
        for owner, pair in held.items():
            self.leaked_shares["key"].setdefault(owner, {})[cid] = int.from_bytes(
                pair[:SHARE_BYTES], "big")
            self.leaked_shares["seed"].setdefault(owner, {})[cid] = int.from_bytes(
                pair[SHARE_BYTES:], "big")

    def corrupt_signature(self, cid: int, survivors: Iterable[int]) -> bytes:
        """A corrupt client signs whatever survivor list the server asks for."""
        return self.signing[cid].sign(survivors_transcript(self.session_id, cid, survivors,
                                                           self.advert_digest(cid)))


# --- the attacker's best recovery --------------------------------------------------------------


def _shares_by_owner(p: Puppeteer) -> tuple[dict[int, dict[int, int]], dict[int, dict[int, int]]]:
    """All shares the attacker holds: from UnmaskingShares, from corrupt clients, and from
    share ciphertexts it can open with keys it planted."""
    seed: dict[int, dict[int, int]] = {o: dict(h) for o, h in p.leaked_shares["seed"].items()}
    key: dict[int, dict[int, int]] = {o: dict(h) for o, h in p.leaked_shares["key"].items()}
    for msg in p.unmasking:
        for owner, share in msg.self_mask_shares.items():
            seed.setdefault(owner, {})[msg.client_id] = int.from_bytes(share, "big")
        for owner, share in msg.masking_key_shares.items():
            key.setdefault(owner, {})[msg.client_id] = int.from_bytes(share, "big")
    for (victim, posing), fake in p.fakes.items():
        sk = p.share_keys.get(victim)
        if sk is None or posing not in sk.ciphertexts:
            continue
        c_v = p.adverts[victim].encryption_key
        try:
            secret = fake.encryption.exchange(c_v)
            k = share_key(secret, p.session_id, victim, posing, c_v, fake.encryption.public)
            plain = open_sealed(k, sk.ciphertexts[posing], share_associated_data(
                p.session_id, victim, posing, p.advert_digest(victim),
                p.advert_digest(posing, fake.entry)))
        except CryptoError:
            continue
        assert len(plain) == SHARE_PLAINTEXT_BYTES
        key.setdefault(victim, {})[posing] = int.from_bytes(plain[8:8 + SHARE_BYTES], "big")
        seed.setdefault(victim, {})[posing] = int.from_bytes(plain[8 + SHARE_BYTES:], "big")
    return seed, key


def reconstruct_checked(shares: Mapping[int, int], t: int,
                        check: Callable[[bytes], bool], max_subsets: int = 2000
                        ) -> bytes | None:
    """The secret, if some t of ``shares`` reconstruct a value that passes ``check``:
    Reed-Solomon decoding first, then up to ``max_subsets`` t-subsets."""
    if len(shares) < t:
        return None

    def ok(value: int) -> bytes | None:
        if value >> 256:
            return None
        secret = value.to_bytes(32, "big")
        try:
            return secret if check(secret) else None
        except (ValueError, CryptoError):
            return None

    decoded = decode_with_errors(dict(shares), t)
    if decoded is not None and (found := ok(decoded[0])) is not None:
        return found
    for subset in itertools.islice(itertools.combinations(sorted(shares), t), max_subsets):
        found = ok(reconstruct_value({x: shares[x] for x in subset}, t))
        if found is not None:
            return found
    return None


@dataclass
class Recovery:
    """What the attacker computed for the victim's input, and which masks it could not
    remove."""

    guess: np.ndarray
    removed: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)


def recover_input(p: Puppeteer, victim: int) -> Recovery:
    """The attacker's best estimate of ``victim``'s input from everything it received."""
    cfg = p.config
    masked = p.masked.get(victim)
    if masked is None:  # never sent a masked input: nothing but uniform guessing
        return Recovery(np.zeros(cfg.dim, dtype=np.uint64), missing=["masked input"])
    t = p.t
    sid = p.session_id
    seed_shares, key_shares = _shares_by_owner(p)
    masker = Masker(cfg.dim, cfg.bits)
    y = masked.vector().copy()
    out = Recovery(y)
    advert = p.adverts[victim]

    def seed_ok(seed: bytes) -> bool:
        return constant_time_equal(self_mask_commitment(seed, sid, victim),
                                   advert.self_mask_commitment)

    b_v = reconstruct_checked(seed_shares.get(victim, {}), t, seed_ok)
    if b_v is not None:
        masker.subtract(y, self_mask_key(b_v, sid, victim, cfg.shape_tag))
        out.removed.append("self mask")
    else:
        out.missing.append("self mask")

    def key_ok(owner_pk: bytes) -> Callable[[bytes], bool]:
        return lambda sk: constant_time_equal(KeyPair.from_private_bytes(sk).public, owner_pk)

    s_v = reconstruct_checked(key_shares.get(victim, {}), t, key_ok(advert.masking_key))
    view = next((m for m in reversed(p.views[victim]) if isinstance(m, KeyList)), None)
    for peer in sorted(p.peers_of(victim)):
        assert view is not None
        pk_peer = view.keys[peer].masking_key
        secret: bytes | None = None
        if s_v is not None:
            secret = KeyPair.from_private_bytes(s_v).exchange(pk_peer)
        elif peer in p.leaked_keys:  # a corrupt peer hands over its own masking key
            secret = KeyPair.from_private_bytes(p.leaked_keys[peer]).exchange(
                advert.masking_key)
        elif (victim, peer) in p.fakes:
            secret = p.fakes[(victim, peer)].masking.exchange(advert.masking_key)
        else:
            s_w = reconstruct_checked(key_shares.get(peer, {}), t, key_ok(pk_peer))
            if s_w is not None:
                secret = KeyPair.from_private_bytes(s_w).exchange(advert.masking_key)
        if secret is None:
            out.missing.append(f"pairwise mask with {peer}")
            continue
        k = pairwise_mask_key(secret, sid, victim, peer, advert.masking_key, pk_peer,
                              cfg.shape_tag)
        if victim < peer:
            masker.subtract(y, k)
        else:
            masker.add(y, k)
        out.removed.append(f"pairwise mask with {peer}")
    if cfg.bits < 8 * y.dtype.itemsize:
        np.bitwise_and(y, y.dtype.type((1 << cfg.bits) - 1), out=y)
    out.guess = y.astype(np.uint64)
    return out


def uniformity_chi2(values: np.ndarray, bits: int, buckets: int = 16) -> float:
    """Chi-square statistic of the top log2(buckets) bits of ``values`` (mod 2**bits)."""
    shift = bits - int(np.log2(buckets))
    counts = np.bincount((values.astype(np.uint64) >> np.uint64(shift)).astype(np.int64),
                         minlength=buckets)
    expected = len(values) / buckets
    return float(((counts - expected) ** 2 / expected).sum())


CHI2_15_LIMIT = 80.0
"""chi-square (15 degrees of freedom) bound for a uniform residual: a false alarm with
probability 7e-11 per check (the suite makes 118 checks, of 512 16-bit coordinates, per run;
the former bound 50.0, 1.2e-5 per check, failed about one run in 700); a residual with any
structure left (half the range unused already gives 512) stays far above it."""


def assert_input_hidden(p: Puppeteer, victim: int, recovery: Recovery | None = None) -> None:
    """Raise ``AttackSucceeded`` if the attacker's best recovery yields the victim's input;
    otherwise require the attacker's residual (guess - input) to look uniform."""
    recovery = recovery if recovery is not None else recover_input(p, victim)
    truth = p.inputs[victim].astype(np.uint64)
    modulus = p.config.modulus
    if np.array_equal(recovery.guess, truth):
        raise AttackSucceeded(f"the attacker recovered client {victim}'s input exactly "
                              f"(removed: {', '.join(recovery.removed)})")
    residual = (recovery.guess.astype(object) - truth.astype(object)) % modulus
    residual = np.asarray(residual, dtype=np.uint64)
    agree = int((residual == 0).sum())
    # a uniform residual agrees with the input in about dim / 2**bits coordinates
    assert agree <= 3 + 4 * len(truth) / modulus, (
        f"{agree} of {len(truth)} coordinates recovered; missing: {recovery.missing}")
    if len(truth) >= 256:
        chi2 = uniformity_chi2(residual, p.config.bits)
        assert chi2 < CHI2_15_LIMIT, f"the residual is not uniform (chi2={chi2:.1f})"


def wire_log(p: Puppeteer) -> list[tuple[int, bytes]]:
    """Every byte the clients sent, as the server/broker received it."""
    return list(p.received)


def any_unmasking_from(p: Puppeteer, cid: int) -> bool:
    return any(m.client_id == cid for m in p.unmasking)


def field_element(value: int) -> bytes:
    return (value % PRIME).to_bytes(SHARE_BYTES, "big")


__all__ = [
    "AttackSucceeded", "FakePeer", "Puppeteer", "Recovery", "any_unmasking_from",
    "assert_input_hidden", "documented_limitation", "field_element", "reconstruct_checked",
    "recover_input", "threat", "uniformity_chi2", "wire_log",
]


# --- recorded rounds between real parties ------------------------------------------------


class RecordedRound:
    """One round between a real ``Server`` and real ``Client`` objects with an EMPTY
    context, every byte recorded; stages run one at a time so a test can inject."""

    def __init__(self, config: Config, signing: Mapping[int, SigningKey], seed: int) -> None:
        self.config = config
        rng = np.random.default_rng(seed)
        self.inputs = {i: rng.integers(0, config.modulus, config.dim, dtype=np.uint64)
                       for i in range(1, config.num_clients + 1)}
        verify = {i: k.public for i, k in signing.items()} if config.malicious else None
        self.server = Server(config, verify_keys=verify)  # its round nonce is always fresh
        self.clients = {i: Client(config, i, v, signing_key=signing.get(i), verify_keys=verify,
                                  nonce=self.server.nonce) for i, v in self.inputs.items()}
        self.sent: dict[tuple[Stage, int], bytes] = {}
        self.got: dict[tuple[Stage, int], bytes] = {}
        self.out: dict[int, bytes] = {}
        self.rejected: dict[int, ProtocolError] = {}

    def stage(self, stage: Stage, skip: frozenset[int] | set[int] = frozenset()) -> None:
        for cid, client in self.clients.items():
            if cid in skip:
                continue
            if stage is Stage.ADVERTISE_KEYS:
                raw = encode(client.advertise())
            elif cid in self.out:
                self.got[(stage, cid)] = self.out[cid]
                try:
                    raw = encode(client.handle(self.out[cid]))
                except ProtocolAbort:
                    continue
            else:
                continue
            self.sent[(stage, cid)] = raw
            try:
                self.server.receive(cid, raw)
            except ProtocolError as exc:  # the server rejected it: the client sits out
                self.rejected[cid] = exc

    def close(self) -> None:
        self.out = {cid: encode(m) for cid, m in self.server.advance().items()}

    def run(self, skip: Mapping[Stage, set[int]] | None = None) -> None:
        for stage in round_stages(self.config):
            self.stage(stage, (skip or {}).get(stage, set()))
            self.close()

    def expected(self) -> list[int]:
        result = self.server.result
        assert result is not None
        return [int(x) % self.config.modulus
                for x in sum(self.inputs[i].astype(object) for i in result.included)]


def rejected_without_change(server: Server, cid: int, raw: bytes) -> None:
    before = (server.stage, server.received, dict(server.dropped), server._uploads.sum.tobytes())
    with pytest.raises(ProtocolError) as info:
        server.receive(cid, raw)
    assert not isinstance(info.value, ProtocolAbort)
    assert (server.stage, server.received, dict(server.dropped),
            server._uploads.sum.tobytes()) == before
