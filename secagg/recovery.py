"""What the server recovers in the unmasking stage (docs/protocol.md section 8), apart from
the state machine: the replies' shares gathered by secret, each survivor's self-mask seed
and each dropped client's masking key reconstructed and verified against what it advertised
(blame for wrong shares), and the masks these remove from the sum.

The primitives (verified reconstruction, the screen for suspect holders, the mask jobs run
window by window) are ``secagg/unmasking.py``; the state machine (``secagg/server.py``)
decides who survived and aborts the round when a secret cannot be recovered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field

import numpy as np

from .config import Config
from .crypto import KeyPair, constant_time_equal, is_clamped, self_mask_commitment
from .messages import AdvertiseKeys, UnmaskingShares
from .unmasking import MaskJob, MaskKeys, reconstruct_verified, remove_masks, screen_shares


@dataclass
class Recovered:
    """The secrets of one round's unmasking stage, and who sent wrong shares of them."""

    seeds: dict[int, bytes] = field(default_factory=dict)
    """Survivor -> its self-mask seed."""
    private_keys: dict[int, KeyPair] = field(default_factory=dict)
    """Dropped client -> its masking key pair."""
    corrupt: dict[int, set[int]] = field(default_factory=dict)
    """Holder -> the clients whose secret it sent a wrong share of (attributable only)."""
    unattributable: set[int] = field(default_factory=set)
    """Clients whose secret verified although its shares disagree beyond attribution."""


def recover(replies: Iterable[tuple[int, UnmaskingShares]], survivors: frozenset[int],
            forwarded: Mapping[int, frozenset[int]], adverts: Mapping[int, AdvertiseKeys],
            session_id: bytes, threshold: int, abort: Callable[[str], Exception]
            ) -> Recovered:
    """Reconstruct every survivor's seed (checked against its self-mask commitment) and the
    masking key of every client a survivor masked with that did not survive (checked
    against its advertised key), from the ``replies`` (holder, its shares). Raises
    ``abort(reason)`` when a secret has fewer than ``threshold`` shares or none of its
    ``threshold``-subsets verifies."""
    t = threshold
    seed_shares: dict[int, dict[int, int]] = {}
    key_shares: dict[int, dict[int, int]] = {}
    for cid, msg in replies:
        for owner, share in msg.self_mask_shares.items():
            seed_shares.setdefault(owner, {})[cid] = int.from_bytes(share, "big")
        for owner, share in msg.masking_key_shares.items():
            key_shares.setdefault(owner, {})[cid] = int.from_bytes(share, "big")
    dropouts = sorted(set().union(*(forwarded[v] for v in survivors)) - survivors)
    suspects = screen_shares([seed_shares.get(o, {}) for o in survivors]
                             + [key_shares.get(o, {}) for o in dropouts], t)
    out = Recovered()

    def reconstruct(owner: int, shares: dict[int, int], check: Callable[[bytes], bool]
                    ) -> bytes:
        secret = reconstruct_verified(owner, shares, t, check, suspects, out.corrupt,
                                      out.unattributable)
        if secret is None:
            raise abort(f"the shares of client {owner}'s secret are inconsistent and no {t} "
                        f"of them reconstruct the committed value")
        return secret

    for owner in sorted(survivors):
        shares = seed_shares.get(owner, {})
        if len(shares) < t:
            raise abort(f"only {len(shares)} self-mask shares of client {owner} arrived; "
                        f"{t} are needed")
        commitment = adverts[owner].self_mask_commitment

        def seed_ok(seed: bytes, owner: int = owner, commitment: bytes = commitment) -> bool:
            return constant_time_equal(self_mask_commitment(seed, session_id, owner),
                                       commitment)

        out.seeds[owner] = reconstruct(owner, shares, seed_ok)
    for owner in dropouts:
        shares = key_shares.get(owner, {})
        if len(shares) < t:
            raise abort(f"only {len(shares)} masking-key shares of dropped client {owner} "
                        f"arrived; {t} are needed")
        advertised = adverts[owner].masking_key

        def key_ok(secret: bytes, advertised: bytes = advertised) -> bool:
            # only the canonical clamped form: X25519 ignores 5 bits of a private key, and
            # a shifted secret that differs in them must not "verify"
            return is_clamped(secret) and constant_time_equal(
                KeyPair.from_private_bytes(secret).public, advertised)

        out.private_keys[owner] = KeyPair.from_private_bytes(reconstruct(owner, shares, key_ok))
    return out


def unmask(total: np.ndarray, recovered: Recovered, survivors: frozenset[int],
           forwarded: Mapping[int, frozenset[int]], adverts: Mapping[int, AdvertiseKeys],
           session_id: bytes, config: Config, executor: Executor | None, workers: int
           ) -> list[MaskKeys]:
    """sum y - sum PRG(b_u) for survivors - the survivors' pairwise masks with dropouts, in
    ``total`` (the sum of the survivors' masked inputs) in place; returns the mask keys.

    The mask work is cut into independent jobs; with an ``executor`` (e.g. a process pool,
    which the caller owns) they run in parallel, otherwise inline
    (:func:`secagg.unmasking.remove_masks`)."""
    jobs: list[MaskJob] = [("self", owner, seed, ())
                           for owner, seed in recovered.seeds.items()]
    masked_with: dict[int, list[int]] = {}  # dropped u -> survivors that masked with u
    for survivor in sorted(survivors):
        for peer in forwarded[survivor]:
            masked_with.setdefault(peer, []).append(survivor)
    for dropped, pair in recovered.private_keys.items():
        peers = tuple((v, adverts[v].masking_key) for v in masked_with.get(dropped, ()))
        if peers:
            jobs.append(("pair", dropped, pair.private_bytes(), peers))
    header = (session_id, config.shape_tag, config.dim, config.bits,
              {d: adverts[d].masking_key for d in recovered.private_keys})
    return remove_masks(total, header, jobs, executor, workers)
