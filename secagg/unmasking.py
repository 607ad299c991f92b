"""The server's unmasking work (docs/protocol.md section 8), apart from the state machine:
verified reconstruction of each secret with blame for wrong shares, and the removal of the
masks the survivors' inputs still carry, cut into jobs a process pool can run.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

from .crypto import (
    CryptoError,
    KeyPair,
    Masker,
    load_public_key,
    pairwise_mask_key,
    self_mask_key,
)
from .shamir import (
    PRIME,
    consistent,
    decode_with_errors,
    extrapolate,
    reconstruct_value,
)


def reconstruct_verified(owner: int, shares: dict[int, int], t: int,
                         check: Callable[[bytes], bool], suspects: set[int],
                         corrupt: dict[int, set[int]]) -> bytes | None:
    """Reconstruct one secret and verify it with ``check``; ``None`` when impossible.

    The first ``t`` non-suspect shares usually verify; every suspect whose share is off
    the verified polynomial is then named in ``corrupt``. Otherwise the shares are decoded
    as a Reed-Solomon codeword (Gao), which corrects up to (m - t) / 2 wrong shares and
    names their holders; beyond that, random t-subsets are tried against the check."""
    holders = sorted(shares)
    clean = [h for h in holders if h not in suspects]

    def verified(value: int) -> bytes | None:
        if value >> 256:
            return None
        secret = value.to_bytes(32, "big")
        try:
            return secret if check(secret) else None
        except (ValueError, CryptoError):
            return None

    if len(clean) < t:  # too many suspects to skip: try the lowest ids, check the rest
        clean = holders
    if len(clean) >= t:
        base = tuple(clean[:t])
        first = verified(reconstruct_value({x: shares[x] for x in base}, t))
        if first is not None:
            named = [h for h in holders if h in suspects and h not in base]
            for holder, value in zip(named, extrapolate(shares, base, named), strict=True):
                if value != shares[holder]:
                    corrupt.setdefault(holder, set()).add(owner)
            return first
    decoded = decode_with_errors(shares, t)
    if decoded is not None:
        secret = verified(decoded[0])
        if secret is not None:
            for holder in decoded[1]:
                corrupt.setdefault(holder, set()).add(owner)
            return secret
    rng = random.Random(owner)  # which subsets to try is not secret
    for _ in range(64 if len(holders) > t else 0):
        subset = tuple(sorted(rng.sample(holders, t)))
        secret = verified(reconstruct_value({x: shares[x] for x in subset}, t))
        if secret is not None:
            blame(owner, shares, subset, corrupt)
            return secret
    return None


def screen_shares(sharesets: list[dict[int, int]], t: int) -> set[int]:
    """Holders that sent a share off its polynomial, for all secrets at once.

    Secrets shared among the same holders are combined with random 128-bit coefficients;
    a combination of codewords is a codeword, and a corrupted share survives the
    combination except with probability about 2^-128. One consistency check per holder
    set, and Gao's decoder on the combination when it fails."""
    groups: dict[tuple[int, ...], list[dict[int, int]]] = {}
    for shares in sharesets:
        if len(shares) > t:
            groups.setdefault(tuple(sorted(shares)), []).append(shares)
    suspects: set[int] = set()
    for holders, members in groups.items():
        coefficients = [int.from_bytes(os.urandom(16), "big") for _ in members]
        combined = {h: sum(c * m[h] for c, m in zip(coefficients, members, strict=True))
                    % PRIME for h in holders}
        if consistent(combined, t):
            continue
        decoded = decode_with_errors(combined, t)
        if decoded is not None:
            suspects |= decoded[1]
        else:  # beyond the decoding radius: check every share of this group one by one
            suspects |= set(holders)
    return suspects


def blame(owner: int, shares: dict[int, int], subset: tuple[int, ...],
          corrupt: dict[int, set[int]]) -> None:
    """Name every holder whose share is off the polynomial through ``subset``."""
    others = [h for h in sorted(shares) if h not in subset]
    for holder, value in zip(others, extrapolate(shares, subset, others), strict=True):
        if value != shares[holder]:
            corrupt.setdefault(holder, set()).add(owner)


MaskJob = tuple[str, int, bytes, tuple[tuple[int, bytes], ...]]


def balance(jobs: list[MaskJob], parts: int) -> list[list[MaskJob]]:
    """Split jobs into ``parts`` batches of about equal keystream count."""
    batches: list[list[MaskJob]] = [[] for _ in range(max(1, parts))]
    loads = [0] * len(batches)
    for job in sorted(jobs, key=lambda j: -max(1, len(j[3]))):
        i = loads.index(min(loads))
        batches[i].append(job)
        loads[i] += max(1, len(job[3]))
    return [b for b in batches if b]


def mask_correction(header: tuple[bytes, bytes, int, int, dict[int, bytes]],
                    jobs: list[MaskJob]) -> np.ndarray:
    """The masks that the survivors' masked inputs still carry, for a batch of jobs:
    ``("self", u, b_u, ())`` adds PRG(b_u); ``("pair", u, sk_u, ((v, pk_v), ...))`` adds
    what each survivor v added for its pair with dropped u. Top-level so a process pool
    can run it."""
    session_id, shape_tag, dim, bits, dropped_keys = header
    masker = Masker(dim, bits)
    correction = np.zeros(dim, dtype=masker.dtype)
    loaded: dict[bytes, X25519PublicKey] = {}  # one key object per survivor, not per pair
    for kind, owner, secret, peers in jobs:
        if kind == "self":
            masker.add(correction, self_mask_key(secret, session_id, owner, shape_tag))
            continue
        pair = KeyPair.from_private_bytes(secret)
        owner_pk = dropped_keys[owner]
        for survivor, survivor_pk in peers:
            peer = loaded.get(survivor_pk)
            if peer is None:
                peer = loaded[survivor_pk] = load_public_key(survivor_pk)
            key = pairwise_mask_key(pair.exchange(peer), session_id, survivor, owner,
                                    survivor_pk, owner_pk, shape_tag)
            # the survivor added +mask if survivor < dropped, else -mask
            if survivor < owner:
                masker.add(correction, key)
            else:
                masker.subtract(correction, key)
    return correction
