"""The server's unmasking work (docs/protocol.md section 8), apart from the state machine:
verified reconstruction of each secret with blame for wrong shares, and the removal of the
masks the survivors' inputs still carry, cut into jobs a process pool can run.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from concurrent.futures import Executor

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

UNMASK_WINDOW_BYTES = 8 << 20
"""The window the server removes masks in (bytes of the sum): the correction never takes
a second d-sized vector."""


def reconstruct_verified(owner: int, shares: dict[int, int], t: int,
                         check: Callable[[bytes], bool], suspects: set[int],
                         corrupt: dict[int, set[int]], unattributable: set[int]) -> bytes | None:
    """Reconstruct one secret and verify it with ``check``; ``None`` when impossible.

    The first ``t`` non-suspect shares usually verify. Otherwise the shares are decoded as
    a Reed-Solomon codeword (Gao), which corrects up to (m - t) / 2 wrong shares; beyond
    that, random t-subsets are tried against the check.

    Blame only what is attributable (docs/architecture.md section 9): the holders whose
    shares are off the verified polynomial are named in ``corrupt`` only when they are at
    most (m - t) / 2, the unique-decoding radius; naming an honest holder then takes more
    than (m - t) / 2 + 1 colluding holders of this secret (docs/protocol.md section 8).
    A verified secret whose shares disagree more is put in ``unattributable``, naming
    nobody."""
    holders = sorted(shares)
    radius = (len(holders) - t) // 2
    flagged = any(h in suspects for h in holders)
    clean = [h for h in holders if h not in suspects]

    def verified(value: int) -> bytes | None:
        if value >> 256:
            return None
        secret = value.to_bytes(32, "big")
        try:
            return secret if check(secret) else None
        except (ValueError, CryptoError):
            return None

    def attribute(base: tuple[int, ...]) -> None:
        others = [h for h in holders if h not in base]
        off = {h for h, value in zip(others, extrapolate(shares, base, others), strict=True)
               if value != shares[h]}
        if len(off) > radius:
            unattributable.add(owner)
            return
        for holder in off:
            corrupt.setdefault(holder, set()).add(owner)

    if len(clean) < t:  # too many suspects to skip: try the lowest ids
        clean = holders
    base = tuple(clean[:t])
    first = verified(reconstruct_value({x: shares[x] for x in base}, t))
    if first is not None:
        if flagged:
            attribute(base)
        return first
    decoded = decode_with_errors(shares, t)
    if decoded is not None:
        secret = verified(decoded[0])
        if secret is not None:
            for holder in decoded[1]:  # within the radius by construction
                corrupt.setdefault(holder, set()).add(owner)
            return secret
    rng = random.Random(owner)  # which subsets to try is not secret
    for _ in range(64 if len(holders) > t else 0):
        subset = tuple(sorted(rng.sample(holders, t)))
        secret = verified(reconstruct_value({x: shares[x] for x in subset}, t))
        if secret is not None:
            attribute(subset)
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


MaskKeys = list[tuple[bytes, bool]]


def derive_mask_keys(header: tuple[bytes, bytes, int, int, dict[int, bytes]],
                     jobs: list[MaskJob]) -> MaskKeys:
    """The AES keys of the masks that the survivors' masked inputs still carry, for a batch
    of jobs, each with its sign (True: the sum carries +mask): ``("self", u, b_u, ())``
    gives PRG(b_u); ``("pair", u, sk_u, ((v, pk_v), ...))`` what each survivor v added for
    its pair with dropped u. Top-level so a process pool can run it."""
    session_id, shape_tag, _, _, dropped_keys = header
    keys: MaskKeys = []
    loaded: dict[bytes, X25519PublicKey] = {}  # one key object per survivor, not per pair
    for kind, owner, secret, peers in jobs:
        if kind == "self":
            keys.append((self_mask_key(secret, session_id, owner, shape_tag), True))
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
            keys.append((key, survivor < owner))
    return keys


def apply_masks(keys: MaskKeys, bits: int, start: int, count: int,
                out: np.ndarray | None = None) -> np.ndarray:
    """The sum of the masks ``keys`` over elements [start, start + count) of the vector
    (AES-CTR seeks to the window): what the server subtracts there. With ``out`` (that
    window of the sum) the masks are subtracted from it in place instead. Top-level so a
    process pool can run it."""
    masker = Masker(count, bits)
    if out is not None:
        for key, added in keys:
            (masker.subtract if added else masker.add)(out, key, start)
        return out
    correction = np.zeros(count, dtype=masker.dtype)
    for key, added in keys:
        (masker.add if added else masker.subtract)(correction, key, start)
    return correction


def remove_masks(total: np.ndarray, header: tuple[bytes, bytes, int, int, dict[int, bytes]],
                 jobs: list[MaskJob], executor: Executor | None, workers: int
                 ) -> list[MaskKeys]:
    """Subtract from ``total`` (the sum of the masked inputs, in place) the masks of
    ``jobs``, window by window (:data:`UNMASK_WINDOW_BYTES`: bounded memory), mod 2**bits.
    The jobs are balanced over ``workers`` batches run on ``executor`` (e.g. a process pool,
    which the caller owns), else inline. Returns the mask keys, batch by batch."""
    _, _, dim, bits, _ = header
    workers = workers if executor is not None else 1
    batches = balance(jobs, workers)
    pool = executor if executor is not None and len(batches) > 1 else None
    if pool is not None:
        keys = [f.result() for f in [pool.submit(derive_mask_keys, header, batch)
                                     for batch in batches]]
    else:
        keys = [derive_mask_keys(header, batch) for batch in batches]
    window = max(1, UNMASK_WINDOW_BYTES // total.dtype.itemsize)
    for start in range(0, dim, window):  # window by window: bounded memory
        count = min(window, dim - start)
        part = total[start:start + count]
        if pool is not None:
            futures = [pool.submit(apply_masks, k, bits, start, count) for k in keys]
            for future in futures:
                np.subtract(part, future.result(), out=part)
        else:
            for k in keys:
                apply_masks(k, bits, start, count, out=part)
    if bits < 8 * total.dtype.itemsize:
        np.bitwise_and(total, total.dtype.type((1 << bits) - 1), out=total)
    return keys
