"""The client's state, one record per stage (docs/protocol.md table 3.2b): each holds
exactly the data its stage has, so nothing is an ``Optional`` guarded by an assert, and the
secrets live in buffers ``_wipe`` overwrites in place (docs/protocol.md section 7.1)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from .errors import ProtocolAbort
from .messages import KeyEntry
from .shamir import SHARE_BYTES
from .stage import Stage

PAIR = 2 * SHARE_BYTES  # one peer's two shares, masking key then seed


def wipe(buffer: bytearray | np.ndarray) -> None:
    if isinstance(buffer, np.ndarray):
        buffer.fill(0)
    else:
        memoryview(buffer)[:] = bytes(len(buffer))


@dataclass(frozen=True, eq=False)
class Secrets:
    """The client's own secrets, in buffers wiped in place by ``_erase`` (docs/protocol.md
    section 7.1 says what that does and does not guarantee)."""

    encryption: bytearray  # c_u, 32 bytes
    masking: bytearray  # s_u, 32 bytes
    seed: bytearray  # b_u, 32 bytes
    input: np.ndarray | None  # x_u, unmasked (None until given, Client.provide_input): y_u
    # streams from it (MaskedStream), wiped at the end

    def key(self, which: bytearray) -> X25519PrivateKey:
        return X25519PrivateKey.from_private_bytes(which)


@dataclass(frozen=True, eq=False)
class Advertised:
    """Sent ``AdvertiseKeys``; waits for the ``KeyList``."""

    stage = Stage.ADVERTISE_KEYS


@dataclass(frozen=True, eq=False)
class Shared:
    """Sent ``ShareKeys``; waits for the ``Ciphertexts``."""

    keys: Mapping[int, KeyEntry]  # KL(u), own entry included
    key_set: bytes  # key_set_digest(KL(u)): binds every later signature to this round
    adverts: Mapping[int, bytes]  # advertisement digest of every member of KL(u)
    loaded: Mapping[bytes, X25519PublicKey]  # checked public keys of KL(u)
    own_shares: bytearray  # u's own share of s_u and of b_u
    secrets: bytearray  # X25519(c_u, C_v) for each peer, 32 bytes each, in ``order``
    order: Mapping[int, int]  # peer -> offset in ``secrets``
    stage = Stage.SHARE_KEYS


@dataclass(frozen=True, eq=False)
class Masked:
    """Sent ``MaskedInput``; waits for the ``UnmaskRequest`` (or ``SurvivorList``)."""

    shared: Shared
    peers: frozenset[int]  # F(u)
    received: bytearray  # each peer's two shares for u, 66 bytes each, in ``index``
    index: Mapping[int, int]  # peer -> offset in ``received``
    stage = Stage.MASKED_INPUT


@dataclass(frozen=True, eq=False)
class Checked:
    """Sent ``ConsistencySignature`` over ``survivors`` (malicious); waits for the request."""

    masked: Masked
    survivors: tuple[int, ...]
    stage = Stage.CONSISTENCY_CHECK


@dataclass(frozen=True, eq=False)
class Finished:
    """Sent ``UnmaskingShares``: done; answers only redeliveries."""

    stage = Stage.UNMASKING


@dataclass(frozen=True, eq=False)
class Aborted:
    error: ProtocolAbort
    stage: Stage


State = Advertised | Shared | Masked | Checked | Finished | Aborted
